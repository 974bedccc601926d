"""KV-cache decoder export: a folder onnxruntime-genai runs as it is (`diffexport onnx --kv-cache -o OUTDIR`).

One graph serves prefill (past length 0) and decode (one or more new tokens):
  inputs   input_ids [B, S] int64, attention_mask [B, P+S] int64 (0 = left padding),
           past_key_values.{i}.key / .value [B, 1, P, W]
  outputs  logits [B, S, V], present.{i}.key / .value [B, 1, P+S, W]
The cache is token-major: W is the contract's key (value) width of all kv heads of a layer, so a
DiffAttention node reads `present` as it is (a free reshape of the unit axis) and no step
transposes or re-packs past tokens. For onnxruntime-genai this is one "kv head" of head_size W
(V1: keys 2*Hkv*D, values Hkv*2D: equal widths; V2 and the baseline Transformer: Hkv*D both).
Token positions come from the attention mask inside the graph (cumsum - 1), so left-padded batches
need no position_ids input. Each attention is ONE DiffAttention node of op version 2 (key_mask).

Folder: model.onnx (+ model.onnx.data when large), genai_config.json, tokenizer files (copied from an
HF checkpoint folder or --tokenizer). Written into a temporary folder beside OUTDIR, checked, renamed:
an interrupted export leaves nothing, and an existing OUTDIR is never touched.
"""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import time
from pathlib import Path
from typing import Callable

import torch

from diffexport.core import contract
from diffexport.core.errors import DiffExportError
from diffexport.core.files import check_output_path, is_hub_cache_link, refuse_output_over_inputs, staging_folder
from diffexport.export import exporter
from diffexport.export.exporter import DTYPES, ExportOptions
from diffexport.export.op_schema import register_schema
from diffexport.export.translation import translation_table
from diffexport.format import decoders, model_card
from diffexport.format.decoder_folder import (
    GENAI_PROVIDERS,
    cache_heads,
    cache_width,
    check_tokenizer,
    default_provider,
    genai_config,
    has_tokenizer,
    hf_search,
    hf_values,
)
from diffexport.format.genai_config import MAX_CONTEXT, MAX_THREADS
from diffexport.format.metadata_keys import ATTENTION, CACHE_WIDTH, KV_CACHE, stored_key
from diffexport.format.names import GENAI_CONFIG, MODEL_FILE
from diffexport.format.names import decoder_input_names as input_names
from diffexport.format.names import decoder_output_names as output_names
from diffexport.modeling import hub, layouts
from diffexport.modeling.checkpoint import LoadedModel

KV_FAMILIES = ("diff_v1", "diff_v2", "transformer")
# How a decoder folder's attention runs: format/decoders.py (its registry; kept here by name for the API).
ATTENTION_OPS = tuple(decoders.FORMATS)
DEFAULT_CONTEXT = 2048  # native checkpoints carry no context length
# A decoder format's post-export rewrite (its pass): (model path in the temporary folder, external
# data, context length, log), rewriting the file in place before the folder is published.
DecoderRewrite = Callable[[Path, bool, int, Callable[[str], None]], None]
@dataclasses.dataclass
class DecoderExportSummary:
    folder: Path
    layers: int
    diff_attention_nodes: int
    cache_width: int
    context_length: int
    tokenizer: bool
    file_bytes: int
    dtype: str
    seconds: float
    attention: str = decoders.DEFAULT
    cache_heads: int = 1
    provider: str = "cpu"

    def report(self) -> str:
        tok = "tokenizer files copied" if self.tokenizer else "no tokenizer: token ids only"
        cache = (f"cache [batch, {self.cache_heads}, past, {self.cache_width // self.cache_heads}] per layer for keys "
                 "and values")
        fmt = decoders.decoder_format(self.attention)
        if fmt.rewrite:
            graph = (f"graph         {self.diff_attention_nodes} {fmt.summary} over {self.layers} layers; {cache}"
                     + (", genai's shared past/present buffer" if fmt.shared_buffer else "")
                     + ("" if fmt.tensorrt else " (onnxruntime only)"))
        elif self.diff_attention_nodes:
            graph = (f"graph         {self.diff_attention_nodes} {contract.OP_NAME} (op v{contract.KEY_MASK_VERSION}, "
                     f"key_mask) over {self.layers} layers; {cache}")
        else:
            graph = f"graph         {exporter.BASELINE_NOTE}; {self.layers} layers; {cache}"
        return "\n".join([
            f"exported      {self.folder}/ ({self.file_bytes / 1e6:.1f} MB, {self.dtype}, KV-cache decoder, "
            f"{self.seconds:.1f}s)",
            graph,
            f"genai         {GENAI_CONFIG} (context {self.context_length}, {self.provider} provider), {tok}",
        ])


class _DecoderStep(torch.nn.Module):
    """(input_ids, attention_mask, past...) -> (logits, present...): the graph's documented interface."""

    def __init__(self, model):
        super().__init__()
        self.model = model

    def forward(self, input_ids, attention_mask, *past_flat):
        past = [(past_flat[2 * i], past_flat[2 * i + 1]) for i in range(len(past_flat) // 2)]  # [B, 1, P, W]
        logits, presents = self.model(input_ids, attention_mask=attention_mask, past_key_values=past, use_cache=True)
        return (logits, *[t for kv in presents for t in kv])


def _trace(model, options: ExportOptions, dtype: torch.dtype):

    register_schema()
    cfg = model.config
    gen = torch.Generator().manual_seed(0)
    B, S, P = 2, 5, 3  # none is 0 or 1, which torch.export would specialise on
    ids = torch.randint(0, cfg.vocab_size, (B, S), generator=gen)
    mask = torch.ones(B, P + S, dtype=torch.int64)
    width = cache_width(cfg)
    past = [torch.zeros(B, 1, P, width, dtype=dtype) for _ in range(2 * cfg.n_layers)]
    batch, seq, total, past_len = (torch.export.Dim(n)
                                   for n in ("batch", "sequence", "total_sequence", "past_sequence"))
    # torch.export groups *past_flat into one entry of the input structure
    shapes = ({0: batch, 1: seq}, {0: batch, 1: total}, tuple({0: batch, 2: past_len} for _ in past))
    with exporter.quiet_exporter():
        program = torch.onnx.export(
            _DecoderStep(model), (ids, mask, *past), dynamo=True, opset_version=options.resolved_opset(),
            custom_translation_table=translation_table(), dynamic_shapes=shapes,
            input_names=input_names(cfg.n_layers), output_names=output_names(cfg.n_layers), optimize=True,
            verbose=False)
    return program.model


def check_target(out_dir: Path, options: ExportOptions, context_length: int | None,
                 threads: int | None = None, attention: str = decoders.DEFAULT, provider: str | None = None) -> None:
    fmt = decoders.decoder_format(attention)  # an unknown format: one line, before anything else
    if options.dtype not in ("float32", "float16", "bfloat16"):
        raise DiffExportError(f"--kv-cache exports float32, float16 or bfloat16, not {options.dtype}")
    if provider not in (None, *GENAI_PROVIDERS):
        raise DiffExportError(f"unknown provider {provider!r} for genai_config.json; choose one of "
                              f"{list(GENAI_PROVIDERS)}")
    if options.dtype == "bfloat16" and provider == "cpu":
        raise DiffExportError("a bfloat16 folder cannot name the CPU provider: onnxruntime's CPU provider has no "
                              "bfloat16 kernels (export --fp16 or fp32 for the CPU; bf16 is for CUDA and TensorRT)")
    if options.dtype not in fmt.dtypes:
        raise DiffExportError(fmt.dtype_refusal)
    if options.hidden:
        raise DiffExportError("--kv-cache graphs output logits and the cache; drop --hidden")
    if options.legacy:
        raise DiffExportError("--kv-cache needs the dynamo exporter; drop --legacy")
    if out_dir.suffix == ".onnx":
        raise DiffExportError(f"--kv-cache writes a folder (model.onnx, {GENAI_CONFIG}, tokenizer): "
                              f"give a folder name, not {out_dir.name}")
    if out_dir.exists() and not out_dir.is_dir() and not out_dir.is_symlink():
        raise DiffExportError(f"{out_dir} is a file: --kv-cache writes a folder, give a folder name")
    check_output_path(out_dir, replace=options.force)
    if context_length is not None and not 2 <= context_length <= MAX_CONTEXT:
        raise DiffExportError(f"--context-length must be in 2..{MAX_CONTEXT:,}, got {context_length:,}")
    if threads is not None and not 1 <= threads <= MAX_THREADS:
        raise DiffExportError(f"--threads must be in 1..{MAX_THREADS}, got {threads}")


def export_decoder_graph(loaded: LoadedModel, out_dir: str | os.PathLike, options: ExportOptions | None = None, *,
                   tokenizer: str | os.PathLike | None = None, context_length: int | None = None,
                   threads: int | None = None, attention: str = decoders.DEFAULT, provider: str | None = None,
                   rewrite: DecoderRewrite | None = None,
                   log: Callable[[str], None] = print) -> DecoderExportSummary:
    """Export `loaded` as a KV-cache decoder folder for onnxruntime-genai (and plain onnxruntime).
    A format whose entry names a rewrite (attention "gqa": every DiffAttention node as onnxruntime's
    GroupQueryAttention) needs that pass handed in as `rewrite`, since passes sit above the export:
    diffexport.passes.decoder_formats.export_decoder does that for every format."""
    options = options or ExportOptions()
    out_dir = Path(out_dir)
    check_target(out_dir, options, context_length, threads, attention, provider)
    refuse_output_over_inputs(out_dir, [loaded.path, tokenizer])
    provider = provider or default_provider(options.dtype)
    cfg = loaded.config
    if cfg.family not in KV_FAMILIES:
        raise DiffExportError(f"--kv-cache exports {list(KV_FAMILIES)} models, not {cfg.family!r}")
    fmt = decoders.decoder_format(attention)
    if fmt.rewrite and rewrite is None:
        raise DiffExportError(f"the {fmt.name} format's graph is written by a pass after the export: call "
                              "diffexport.passes.decoder_formats.export_decoder, or `diffexport onnx --kv-cache "
                              f"--attention {fmt.name}`")
    if rewrite is not None and not fmt.rewrite:
        raise DiffExportError(f"the {fmt.name} format has no post-export rewrite, but one was handed in")
    if fmt.rewrite and not cfg.differential:
        raise DiffExportError(f"--attention {fmt.name} rewrites DiffAttention nodes; the baseline Transformer has none "
                              "(export it without --attention)")
    source_dir = Path(loaded.path) if layouts.hf_import_of(loaded.source) and loaded.path else None
    if tokenizer is not None:  # named by the user (a folder or a Hub id): a tokenizer of this vocabulary

        tokenizer = hub.resolve(tokenizer, what="tokenizer")
        tok_files = check_tokenizer(Path(tokenizer), cfg.vocab_size)
    elif source_dir is not None and has_tokenizer(source_dir):
        tok_files = check_tokenizer(source_dir, cfg.vocab_size)  # an HF folder with its own tokenizer
    else:
        tok_files = []
    special = {**hf_values(source_dir), **hf_values(None if tokenizer is None else Path(tokenizer))}
    for key in ("bos_token_id", "eos_token_id", "pad_token_id"):  # genai_config's reader refuses them after
        value = special.get(key)
        outside = [v for v in (value if isinstance(value, list) else [value]) if v is not None and v >= cfg.vocab_size]
        if outside:
            raise DiffExportError(f"{key} {outside[0]} (from the checkpoint's or tokenizer's generation_config.json or "
                                  f"config.json) is outside the model's vocabulary of {cfg.vocab_size} ids: fix the "
                                  "file; nothing was written")
    search, skipped = hf_search(source_dir)
    if search:
        taken = ", ".join(f"{k} {json.dumps(v)}" for k, v in search.items())
        log(f"search        from generation_config.json: {taken}")
    for note in skipped:
        log(f"search        generation_config.json: passed over {note}")
    if context_length is None:
        context = special.get("max_position_embeddings")
        context_length = context if isinstance(context, int) and context >= 2 else DEFAULT_CONTEXT
        if context_length > MAX_CONTEXT:  # before tracing: the gqa format's rotary caches grow with it
            raise DiffExportError(f"the checkpoint's max_position_embeddings {context_length:,} is past the "
                                  f"{MAX_CONTEXT:,} tokens a folder may hold: give --context-length N (at most "
                                  f"{MAX_CONTEXT:,})")
    start = time.monotonic()
    model, weights_id = exporter.model_in_dtype(loaded, options.dtype)
    dtype = DTYPES[options.dtype]
    log(f"tracing       {cfg.family} KV-cache decoder ({model.num_parameters():,} parameters, {options.dtype}), "
        f"opset {options.resolved_opset()}")
    with torch.no_grad():
        model_ir = _trace(model, options, dtype)
    if not fmt.fuses_norms:  # else the format's own fusion writes the fused norms (onnxruntime_fusions)
        exporter.norms_for_onnxruntime(model_ir, log)
    is_diff = cfg.differential
    meta = {stored_key(KV_CACHE): "1", stored_key(CACHE_WIDTH): str(cache_width(cfg)), stored_key(ATTENTION): attention}
    if is_diff:
        count = exporter.attach_diff_attention(model_ir, loaded, options, weights_id, key_mask=True,
                                 outputs=output_names(cfg.n_layers), extra_meta=meta)
    else:  # the baseline Transformer (side-by-side comparisons): no DiffAttention node, the same metadata
        count = 0
        exporter.stamp_metadata(model_ir, loaded, options, weights_id, output_names(cfg.n_layers), meta)
    external = exporter.wants_external(model_ir, options)
    # without force the rename fails, leaving nothing, if out_dir appeared meanwhile
    with staging_folder(out_dir, options.force) as tmp_dir:
        log(f"writing       {out_dir}/" + (" with external data" if external else ""))
        exporter.save_checked(model_ir, tmp_dir / MODEL_FILE, external, log)
        del model_ir
        if rewrite is not None:  # the format's pass, on the checked graph inside the temporary folder
            rewrite(tmp_dir / MODEL_FILE, external, context_length, log)
        config = genai_config(cfg, options.dtype, context_length, special, threads, attention, provider, search)
        (tmp_dir / GENAI_CONFIG).write_text(json.dumps(config, indent=2) + "\n")
        for path in tok_files:
            # the files tokenizer_files vetted: regular ones, or a Hub cache's links into its blobs/ (copied as files)
            shutil.copyfile(path, tmp_dir / path.name, follow_symlinks=is_hub_cache_link(path))
        (tmp_dir / model_card.CARD).write_text(model_card.decoder_card(tmp_dir, MODEL_FILE, out_dir.name))
    size = sum(p.stat().st_size for p in out_dir.iterdir())
    return DecoderExportSummary(folder=out_dir, layers=cfg.n_layers, diff_attention_nodes=count,
                                cache_width=cache_width(cfg), context_length=context_length, tokenizer=bool(tok_files),
                                file_bytes=size, dtype=options.dtype, seconds=time.monotonic() - start,
                                attention=attention, cache_heads=cache_heads(cfg, attention), provider=provider)


