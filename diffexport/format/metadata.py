"""The metadata an export stamps into its ONNX file (`diffexport.*` metadata_props): read and
validated here, once, for every layer that needs it (check, engines' records, decoder folders)."""

from __future__ import annotations

import json
import os
from pathlib import Path

from diffexport.core import contract
from diffexport.core.errors import DiffExportError
from diffexport.core.files import load_onnx
from diffexport.format.names import DTYPES, META_PREFIX
from diffexport.format.nodes import is_diff_attention, node_attrs
from diffexport.modeling.families import config_from_dict


def read_export_metadata(path: str | os.PathLike) -> dict[str, str]:
    """diffexport's metadata_props of an ONNX file (weights are not read). Its DiffAttention nodes
    must hold contract-valid attributes: a tampered node (variant 9, say) is refused here rather
    than run by whichever runtime tolerates it."""
    path = Path(path)
    model = load_onnx(path, weights=False)
    nodes = []
    for node in model.graph.node:
        if is_diff_attention(node):
            try:
                nodes.append((node.name, node_attrs(node)))
            except DiffExportError as exc:
                raise DiffExportError(f"{path.name}: {exc}") from None
    meta = {p.key[len(META_PREFIX):]: p.value for p in model.metadata_props if p.key.startswith(META_PREFIX)}
    if "config" not in meta or "dtype" not in meta:
        raise DiffExportError(f"{path} carries no diffexport metadata, so there is no model to compare it with: "
                              "for a graph of another exporter (or what `diffexport optimize` made of one) use "
                              "`check MODEL --against THE_ORIGINAL.onnx`")
    meta = check_export_metadata(meta, path)
    _check_nodes_match_config(nodes, meta, path)
    return meta


# the DiffAttention variant each family's attention is exported as (the baseline Transformer has none)
VARIANTS = {"diff_v1": contract.VARIANT_V1, "diff_v2": contract.VARIANT_V2}


def _check_nodes_match_config(nodes: list, meta: dict[str, str], path: Path) -> None:
    """Every DiffAttention node has the shape the metadata's config gives its attention: a node
    edited to other heads (num_heads doubled) would otherwise reach a runtime's reshape as an
    internal error, or run on weights laid out for other heads."""
    cfg = config_from_dict(meta["family"], json.loads(meta["config"]))  # validated just above
    expected = {"variant": VARIANTS.get(cfg.family), "num_heads": cfg.n_heads, "num_kv_heads": cfg.n_kv_heads,
                "head_dim": cfg.head_dim}
    for name, attrs in nodes:
        for key, value in expected.items():
            if getattr(attrs, key) != value:
                raise DiffExportError(f"{path.name}: DiffAttention node {name or '(unnamed)'} has {key} "
                                      f"{getattr(attrs, key)}, but the model's config says {value}: the graph was "
                                      "edited after export (re-export it)")


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
