"""The metadata an export stamps into its ONNX file (`diffexport.*` metadata_props): read and
validated here, once, for every layer that needs it (check, engines' records, decoder folders)."""

from __future__ import annotations

import json
import os
from pathlib import Path

from diffexport import contract
from diffexport.errors import DiffExportError
from diffexport.files import load_onnx
from diffexport.format.names import DTYPES, META_PREFIX
from diffexport.format.nodes import is_diff_attention, node_attrs
from diffexport.modeling import config_from_dict


def read_export_metadata(path: str | os.PathLike) -> dict[str, str]:
    """diffexport's metadata_props of an ONNX file (weights are not read). Its DiffAttention nodes
    must hold contract-valid attributes: a tampered node (variant 9, say) is refused here rather
    than run by whichever runtime tolerates it."""
    path = Path(path)
    model = load_onnx(path, weights=False)
    for node in model.graph.node:
        if is_diff_attention(node):
            try:
                node_attrs(node)
            except DiffExportError as exc:
                raise DiffExportError(f"{path.name}: {exc}") from None
    meta = {p.key[len(META_PREFIX):]: p.value for p in model.metadata_props if p.key.startswith(META_PREFIX)}
    if "config" not in meta or "dtype" not in meta:
        raise DiffExportError(f"{path} carries no diffexport metadata, so there is no model to compare it with: "
                              "for a graph of another exporter (or what `diffexport optimize` made of one) use "
                              "`check MODEL --against THE_ORIGINAL.onnx`")
    return check_export_metadata(meta, path)


def check_export_metadata(meta: dict[str, str], path) -> dict[str, str]:
    """The metadata an export (or an engine's record of it) declares, validated once: a known dtype
    and op version, and a config that is a valid configuration of its family."""
    if not isinstance(meta, dict) or not all(isinstance(v, str) for v in meta.values()):
        raise DiffExportError(f"{path}: its diffexport metadata is not a mapping of strings")
    if meta.get("dtype") not in DTYPES:
        raise DiffExportError(f"{path} declares an unknown dtype {meta.get('dtype')!r}")
    known = (contract.OP_VERSION, contract.KEY_MASK_VERSION)
    if meta.get("op_version", str(contract.OP_VERSION)) not in map(str, known):
        raise DiffExportError(f"{path} declares DiffAttention op version {meta['op_version']!r}; this diffexport "
                              f"knows {', '.join(map(str, known))} (upgrade diffexport, or re-export)")
    try:
        config_from_dict(meta.get("family", ""), json.loads(meta["config"]))
    except (json.JSONDecodeError, RecursionError, DiffExportError) as exc:
        raise DiffExportError(f"{path}: its diffexport.config/family metadata is not a model configuration "
                              f"({str(exc).splitlines()[0]})") from None
    return meta
