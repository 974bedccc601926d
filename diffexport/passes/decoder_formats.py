"""KV-cache decoder folders in every format: the export, then the format's own pass.

The export (export/decoder.py) writes the DiffAttention graph into a temporary folder. A format
whose registry entry names a rewrite (format/decoders.py: gqa's "group_query_attention") has its
graph written by a pass, and passes sit above the export, so the pass is handed in from here and
runs inside that temporary folder before the folder is published. Adding a format: its entry in
the registry, its pass, and one line in REWRITES.
"""

from __future__ import annotations

import os

from diffexport.export import decoder
from diffexport.export.exporter import ExportOptions
from diffexport.format import decoders
from diffexport.passes import group_query_attention

REWRITES: dict[str, decoder.DecoderRewrite] = {
    "group_query_attention": group_query_attention.rewrite_decoder_file,
}


def rewrite_for(attention: str) -> decoder.DecoderRewrite | None:
    """The post-export pass of the format named `attention` (None: the export's graph is final)."""
    fmt = decoders.decoder_format(attention)
    return REWRITES[fmt.rewrite] if fmt.rewrite else None


def export_decoder(loaded, out_dir: str | os.PathLike, options=None, *, attention: str | None = None,
                   **kwargs) -> decoder.DecoderExportSummary:
    """A KV-cache decoder folder in any format: export.decoder.export_decoder_graph with the format's pass
    handed in (same arguments).
    attention None: the default for the folder's provider and dtype (decoders.default_format: gqa
    for the CPU)."""
    if attention is None:
        dtype = options.dtype if options is not None else ExportOptions().dtype
        attention = decoders.default_format(kwargs.get("provider"), dtype, loaded.config.differential)
    return decoder.export_decoder_graph(loaded, out_dir, options, attention=attention, rewrite=rewrite_for(attention),
                                  **kwargs)
