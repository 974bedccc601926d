"""The keys of the metadata diffexport stamps into an ONNX file, each named once (no imports: every
layer, the CLI's light paths included, may read them). format/metadata.py reads and validates
them into a typed record; the export and the quantisation passes write them.
"""

from __future__ import annotations

# diffexport's keys in an ONNX file's metadata_props: "diffexport.config", "diffexport.dtype", ...
META_PREFIX = "diffexport."

# The keys, each stored as META_PREFIX + key (stored_key). What the export writes:
FAMILY, CONFIG, DTYPE, OP_VERSION = "family", "config", "dtype", "op_version"
BODY_STYLE, OUTPUTS, WEIGHTS = "body_style", "outputs", "weights"
SOURCE, SOURCE_NAME, SOURCE_REVISION = "source", "source_name", "source_revision"
KV_CACHE, CACHE_WIDTH, ATTENTION = "kv_cache", "cache_width", "attention"  # decoder folders' graphs
# What `diffexport quantize` adds: one JSON record per kind of quantisation (its passes write them).
WEIGHT_QUANT, QDQ, KV_CACHE_QUANT = "weight_quant", "qdq", "kv_cache_quant"
WEIGHT_RECORDS = (WEIGHT_QUANT, QDQ)  # the weights' quantisation (one or the other)


def stored_key(key: str) -> str:
    """The metadata_props key a metadata key is stored under ("config" -> "diffexport.config")."""
    return META_PREFIX + key


def stored_metadata(model) -> dict[str, str]:
    """An ONNX model's diffexport metadata_props by key (the prefix taken off), as stored: not
    validated (read_export_metadata validates a file's)."""
    return {p.key[len(META_PREFIX):]: p.value for p in model.metadata_props if p.key.startswith(META_PREFIX)}
# What `diffexport optimize` adds to a graph it fused.
OPTIMIZED_FROM, OPTIMIZE_REPORT = "optimized_from", "optimize_report"
