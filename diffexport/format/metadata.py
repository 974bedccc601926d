"""The metadata an export stamps into its ONNX file (`diffexport.*` metadata_props): every key named
once, read and validated here, once, into a typed record (ExportMetadata) for every layer that
needs it (check, engines' records, decoder folders, the model card, the report)."""

from __future__ import annotations

import functools
import json
import os
from pathlib import Path

from diffexport.core import contract, tolerances
from diffexport.core.errors import DiffExportError
from diffexport.core.files import load_onnx
from diffexport.format.metadata_keys import (
    ATTENTION,
    CONFIG,
    DTYPE,
    FAMILY,
    KV_CACHE,
    KV_CACHE_QUANT,
    OP_VERSION,
    QDQ,
    WEIGHT_QUANT,
    stored_key,
    stored_metadata,
)
from diffexport.format.names import DTYPES
from diffexport.format.nodes import is_diff_attention, node_attrs
from diffexport.modeling.common import ModelConfig
from diffexport.modeling.families import config_from_dict


class ExportMetadata(dict):
    """An export's metadata, validated (check_export_metadata): the stored strings by key, as ONNX
    files and engines' records hold them, and what they mean as attributes."""

    @property
    def family(self) -> str:
        return self[FAMILY]

    @property
    def dtype(self) -> str:
        return self[DTYPE]

    @functools.cached_property
    def model_config(self) -> ModelConfig:
        """The exported model's configuration (its family's config class)."""
        return config_from_dict(self.get(FAMILY, ""), json.loads(self[CONFIG]))

    @property
    def is_decoder(self) -> bool:
        """A KV-cache decoder graph (a decoder folder's model.onnx), not a prefill graph."""
        return self.get(KV_CACHE) == "1"

    @property
    def attention(self) -> str | None:
        """A decoder folder's format (format/decoders.py; None: a prefill graph)."""
        return self.get(ATTENTION)

    def record(self, key: str) -> dict | None:
        """A quantisation record (WEIGHT_QUANT, QDQ, KV_CACHE_QUANT) parsed, None when absent."""
        if key not in self:
            return None
        try:
            record = json.loads(self[key])
        except (ValueError, RecursionError):
            record = None
        if not isinstance(record, dict):
            raise DiffExportError(f"its {stored_key(key)} metadata is not a quantisation record")
        return record


def quant_budget(meta: dict[str, str]) -> tolerances.QuantBudget | None:
    """The accuracy budget an export's quantisation records call for (core/tolerances.py; None:
    not quantised). meta: its metadata by key, validated or as stored (stored_metadata)."""
    return tolerances.quant_budget(weights=meta.get(WEIGHT_QUANT), qdq=meta.get(QDQ), kv_cache=meta.get(KV_CACHE_QUANT))


def read_export_metadata(path: str | os.PathLike) -> ExportMetadata:
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
    meta = stored_metadata(model)
    if CONFIG not in meta or DTYPE not in meta:
        raise DiffExportError(f"{path} carries no diffexport metadata, so there is no model to compare it with: "
                              "for a graph of another exporter (or what `diffexport optimize` made of one) use "
                              "`check MODEL --against THE_ORIGINAL.onnx`")
    meta = check_export_metadata(meta, path)
    _check_nodes_match_config(nodes, meta, path)
    return meta


def _check_nodes_match_config(nodes: list, meta: ExportMetadata, path: Path) -> None:
    """Every DiffAttention node has the shape the metadata's config gives its attention: a node
    edited to other heads (num_heads doubled) would otherwise reach a runtime's reshape as an
    internal error, or run on weights laid out for other heads."""
    cfg = meta.model_config  # validated just above
    expected = {"variant": cfg.contract_variant, "num_heads": cfg.n_heads, "num_kv_heads": cfg.n_kv_heads,
                "head_dim": cfg.head_dim}
    for name, attrs in nodes:
        for key, value in expected.items():
            if getattr(attrs, key) != value:
                raise DiffExportError(f"{path.name}: DiffAttention node {name or '(unnamed)'} has {key} "
                                      f"{getattr(attrs, key)}, but the model's config says {value}: the graph was "
                                      "edited after export (re-export it)")


def check_export_metadata(meta: dict[str, str], path) -> ExportMetadata:
    """The metadata an export (or an engine's record of it) declares, validated once: a known dtype
    and op version, and a config that is a valid configuration of its family."""
    if not isinstance(meta, dict) or not all(isinstance(v, str) for v in meta.values()):
        raise DiffExportError(f"{path}: its diffexport metadata is not a mapping of strings")
    if meta.get(DTYPE) not in DTYPES:
        raise DiffExportError(f"{path} declares an unknown dtype {meta.get(DTYPE)!r}")
    known = (contract.OP_VERSION, contract.KEY_MASK_VERSION, contract.KV_CACHE_VERSION)
    if meta.get(OP_VERSION, str(contract.OP_VERSION)) not in map(str, known):
        raise DiffExportError(f"{path} declares DiffAttention op version {meta[OP_VERSION]!r}; this diffexport "
                              f"knows {', '.join(map(str, known))} (upgrade diffexport, or re-export)")
    meta = ExportMetadata(meta)
    try:
        meta.model_config  # parsed once, here, and kept
    except (json.JSONDecodeError, RecursionError, DiffExportError) as exc:
        raise DiffExportError(f"{path}: its diffexport.config/family metadata is not a model configuration "
                              f"({str(exc).splitlines()[0]})") from None
    return meta
