"""The DiffAttention op contract: defined once, read by every layer.

The torch custom op (`diffexport::diff_attention`), the ONNX exporter, the graph passes, the
ONNX function body and the TensorRT plugin's field list all take their names, input order,
attributes and checks from here. docs/OP_SPEC.md is the human-readable form of this module.
Pure Python on purpose: no torch, no onnx, so any tool can read it cheaply.

Layout (one canonical layout, whatever checkpoint the model came from):
  diff-head h (0 <= h < H) owns query maps 2h (map 1) and 2h+1 (map 2), adjacent ("pairs").
  V1: kv-group g owns key maps 2g (K1) and 2g+1 (K2) and one value head of width 2D.
  V2: kv-group g owns one key head and one value head, both of width D, shared by both maps.
  Diff-head h reads kv-group g = h // (H / Hkv)  (flash-attention GQA semantics: each map
  attends its own key, never the other map's).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Mapping

from diffexport.core.errors import DiffExportError

OP_NAME = "DiffAttention"
ONNX_DOMAIN = "diffexport"
OP_VERSION = 1  # the five inputs below; what prefill exports and the TensorRT plugin use
KEY_MASK_VERSION = 2  # version 1 plus the optional key_mask input (KV-cache decoders, padded batches)
TORCH_OP = "diffexport::diff_attention"
PLUGIN_NAME = OP_NAME
PLUGIN_NAMESPACE = "diffexport"
PLUGIN_VERSION = "1"  # the plugin creator of op version 1 (five inputs)
# Stamped on version-2 nodes: the plugin library registers a second creator under this version, whose
# sixth input is key_mask (plugins/tensorrt/plugin_library.cpp).
KEY_MASK_PLUGIN_VERSION = "2"
# Version 3: version 2 read from an 8-bit KV cache (decoders whose cache is stored as int8 or float8
# e4m3 codes, diffexport/core/kv_cache_codes.py): key and value hold the codes, and two more inputs
# give their per-channel scales. Every input is present (key_mask included); the plugin registers a
# third creator under this version.
KV_CACHE_VERSION = 3
KV_CACHE_PLUGIN_VERSION = "3"
KV_CODE_TYPES = ("int8", "float8e4m3fn")  # ONNX element types of a version-3 node's key and value

# The fused kernel library (plugins/kernels/diff_attention.h) and the TensorRT plugin over it take
# a subset of the contract: these head dims. inspect, trt and the kernel binding read this one rule.
KERNEL_HEAD_DIMS = (64, 128)


def plugin_refusal(head_dim: int) -> str | None:
    """Why the fused kernel and the TensorRT plugin refuse a node of this head dim, or None."""
    if head_dim in KERNEL_HEAD_DIMS:
        return None
    return (f"head_dim {head_dim}: the fused kernel and the DiffAttention plugin take head_dim "
            f"{' or '.join(map(str, KERNEL_HEAD_DIMS))}")


VARIANT_V1 = 1  # two maps with their own K, V of width 2D, scalar lambda per layer
VARIANT_V2 = 2  # two maps share K and V of width D, lambda per token and head

DTYPES = ("float32", "float16", "bfloat16")


@dataclass(frozen=True)
class TensorSpec:
    name: str
    shape: tuple[str, ...]
    doc: str
    optional: bool = False
    dtype: str = "T"  # "T": the activation dtype shared by query/key/value/lambda; else a fixed type


@dataclass(frozen=True)
class AttributeSpec:
    name: str
    kind: str  # "int" or "float": the ONNX attribute type and the TensorRT field type
    default: Any
    doc: str
    choices: tuple[Any, ...] = ()
    minimum: float | None = None
    exclusive_minimum: bool = False

    def check(self, value: Any) -> None:
        if self.kind == "int" and not isinstance(value, int):
            raise DiffExportError(f"attribute {self.name} must be an int, got {value!r}")
        if self.kind == "float" and not isinstance(value, (int, float)):
            raise DiffExportError(f"attribute {self.name} must be a float, got {value!r}")
        if self.kind == "float" and not math.isfinite(float(value)):
            raise DiffExportError(f"attribute {self.name} must be finite, got {value!r}")
        if self.choices and value not in self.choices:
            raise DiffExportError(f"attribute {self.name}={value!r} is not one of {list(self.choices)}")
        if self.minimum is not None:
            low_ok = value > self.minimum if self.exclusive_minimum else value >= self.minimum
            if not low_ok:
                sign = ">" if self.exclusive_minimum else ">="
                raise DiffExportError(f"attribute {self.name}={value!r} must be {sign} {self.minimum}")


# Symbols: B batch, Sq query length, Skv key length, H diff-heads, Hkv kv-groups,
# D query/key head dim, Dv value head dim (2D for V1, D for V2).
INPUTS: tuple[TensorSpec, ...] = (
    TensorSpec("query", ("B", "Sq", "2*H*D"), "rotated queries; maps 2h, 2h+1 belong to diff-head h"),
    TensorSpec("key", ("B", "Skv", "Kw"), "rotated keys; Kw = 2*Hkv*D (V1: K1, K2 per group) or Hkv*D (V2)"),
    TensorSpec("value", ("B", "Skv", "Hkv*Dv"), "values; Dv = 2*D (V1) or D (V2)"),
    TensorSpec("lambda_full", ("L",), "V1: shape [1], the layer's lambda; V2: shape [B, Sq, H], after sigmoid"),
    TensorSpec("norm_weight", ("Dv",), "per-channel weight of every diff-head, applied after the RMSNorm "
               "(or alone when norm=0); float32 whatever T is; all ones where the model has none",
               dtype="float32"),
)
# Version 2 extends version 1 by one optional input; a node without it is a version-1 node.
KEY_MASK = TensorSpec("key_mask", ("B", "Skv"), "1: key token present, 0: padding (padded batches, any pattern); "
                      "absent: every key present. A query row that sees no key at all gets zeros",
                      optional=True, dtype="int64")
OPTIONAL_INPUTS: tuple[TensorSpec, ...] = (KEY_MASK,)
# Version 3 appends these (required there); key and value then take the code type "C".
KV_SCALES: tuple[TensorSpec, ...] = (
    TensorSpec("k_scale", ("Kw",), "version 3: float32 scale of each key channel (key = code * k_scale, "
               "up to a per-channel shift no softmax sees)", dtype="float32"),
    TensorSpec("v_scale", ("Hkv*Dv",), "version 3: float32 scale of each value channel (value = code * v_scale)",
               dtype="float32"),
)
OUTPUTS: tuple[TensorSpec, ...] = (
    TensorSpec("output", ("B", "Sq", "H*Dv"), "diff-heads concatenated, ready for the output projection"),
)
ATTRIBUTES: tuple[AttributeSpec, ...] = (
    AttributeSpec("variant", "int", VARIANT_V1, "1: DIFF V1, 2: DIFF V2", choices=(VARIANT_V1, VARIANT_V2)),
    AttributeSpec("num_heads", "int", None, "H, differential heads (half the query maps)", minimum=1),
    AttributeSpec("num_kv_heads", "int", None, "Hkv, kv-groups; must divide H", minimum=1),
    AttributeSpec("head_dim", "int", None, "D, query/key head dim of one map", minimum=1),
    AttributeSpec("causal", "int", 1, "1: key j visible to query i iff j <= i + Skv - Sq (bottom-right)",
                  choices=(0, 1)),
    AttributeSpec("scale", "float", 0.0, "logit scale; 0 means 1/sqrt(D)", minimum=0.0),
    AttributeSpec("norm", "int", 1, "1: per-head RMSNorm over Dv after the lambda combination",
                  choices=(0, 1)),
    AttributeSpec("norm_eps", "float", 1e-5, "RMSNorm epsilon", minimum=0.0, exclusive_minimum=True),
    AttributeSpec("output_scale", "float", 1.0, "multiplies the output last: (1 - lambda_init) for V1"),
)
ATTRIBUTE_NAMES = tuple(a.name for a in ATTRIBUTES)

# Fields the TensorRT plugin reads besides the op's attributes: how to compute, not what. The
# ONNX function body (ONNX Runtime) ignores them and computes unquantised logits; `diffexport trt
# --int8` stamps them on the nodes of the graph it builds. Values follow diffexport/core/quantization.py.
PLUGIN_ONLY_ATTRIBUTES: tuple[AttributeSpec, ...] = (
    AttributeSpec("logit_bits", "int", 16, "16: fp16/bf16 attention logits; 8, 6, 4: the INT8-logits kernel "
                  "with that integer range", choices=(16, 8, 6, 4)),
    AttributeSpec("smooth_k", "int", 1, "with logit_bits < 16: subtract K's per-head mean over tokens before "
                  "quantising (softmax unchanged)", choices=(0, 1)),
)
PLUGIN_FIELDS: tuple[AttributeSpec, ...] = ATTRIBUTES + PLUGIN_ONLY_ATTRIBUTES
PLUGIN_FIELD_NAMES = tuple(a.name for a in PLUGIN_FIELDS)
# Node attributes TensorRT's ONNX parser reads to pick the plugin; not plugin fields.
PLUGIN_SELECTOR_ATTRIBUTES = ("plugin_namespace", "plugin_version")
INPUT_NAMES = tuple(t.name for t in INPUTS)  # version 1 (the plugin's inputs)
ALL_INPUTS = INPUTS + OPTIONAL_INPUTS
ALL_INPUT_NAMES = tuple(t.name for t in ALL_INPUTS)
KV_CACHE_INPUTS = ALL_INPUTS + KV_SCALES  # version 3, in this order
KV_CACHE_INPUT_NAMES = tuple(t.name for t in KV_CACHE_INPUTS)


def op_version(has_key_mask: bool, kv_cache: bool = False) -> int:
    """The domain version a graph must import: 2 as soon as one node passes key_mask, 3 when its
    nodes read an 8-bit KV cache."""
    if kv_cache:
        return KV_CACHE_VERSION
    return KEY_MASK_VERSION if has_key_mask else OP_VERSION


@dataclass(frozen=True)
class DiffAttentionAttrs:
    """Validated attribute values of one DiffAttention node (field order = ATTRIBUTES order)."""

    variant: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    causal: int = 1
    scale: float = 0.0
    norm: int = 1
    norm_eps: float = 1e-5
    output_scale: float = 1.0

    def __post_init__(self) -> None:
        for spec in ATTRIBUTES:
            spec.check(getattr(self, spec.name))
            if spec.kind == "int":  # store True/False flags as the ints ONNX and TensorRT carry
                object.__setattr__(self, spec.name, int(getattr(self, spec.name)))
            else:
                object.__setattr__(self, spec.name, float(getattr(self, spec.name)))
        if self.num_heads % self.num_kv_heads:
            raise DiffExportError(
                f"num_kv_heads={self.num_kv_heads} must divide num_heads={self.num_heads} "
                "(each diff-head reads one kv-group)"
            )
        if self.variant == VARIANT_V2 and self.norm:
            raise DiffExportError("variant 2 (DIFF V2) has no per-head norm: set norm=0")

    @property
    def value_dim(self) -> int:
        return 2 * self.head_dim if self.variant == VARIANT_V1 else self.head_dim

    @property
    def key_width(self) -> int:
        maps = 2 if self.variant == VARIANT_V1 else 1
        return maps * self.num_kv_heads * self.head_dim

    @property
    def effective_scale(self) -> float:
        return self.scale if self.scale > 0 else 1.0 / math.sqrt(self.head_dim)

    def as_dict(self) -> dict[str, Any]:
        return {name: getattr(self, name) for name in ATTRIBUTE_NAMES}

    @classmethod
    def from_mapping(cls, values: Mapping[str, Any]) -> "DiffAttentionAttrs":
        unknown = sorted(set(values) - set(ATTRIBUTE_NAMES))
        if unknown:
            raise DiffExportError(f"unknown DiffAttention attribute(s) {unknown}; known: {list(ATTRIBUTE_NAMES)}")
        missing = [a.name for a in ATTRIBUTES if a.default is None and a.name not in values]
        if missing:
            raise DiffExportError(f"DiffAttention attribute(s) {missing} are required")
        return cls(**values)


def check_shapes(
    attrs: DiffAttentionAttrs,
    query: tuple[int, ...],
    key: tuple[int, ...],
    value: tuple[int, ...],
    lambda_full: tuple[int, ...],
    norm_weight: tuple[int, ...],
    key_mask: tuple[int, ...] | None = None,
) -> tuple[int, int, int]:
    """Validate input shapes against the attributes; return the output shape (B, Sq, H*Dv)."""
    H, Hkv, D, Dv = attrs.num_heads, attrs.num_kv_heads, attrs.head_dim, attrs.value_dim
    for name, shape in (("query", query), ("key", key), ("value", value)):
        if len(shape) != 3:
            raise DiffExportError(f"{name} must be 3-D [batch, seq, width], got shape {list(shape)}")
    B, Sq, qw = query
    if qw != 2 * H * D:
        raise DiffExportError(f"query width {qw} != 2*num_heads*head_dim = {2 * H * D}")
    if key[0] != B or value[0] != B:
        raise DiffExportError(f"batch sizes differ: query {B}, key {key[0]}, value {value[0]}")
    Skv = key[1]
    if value[1] != Skv:
        raise DiffExportError(f"key length {Skv} != value length {value[1]}")
    if key[2] != attrs.key_width:
        raise DiffExportError(f"key width {key[2]} != {attrs.key_width} for variant {attrs.variant}")
    if value[2] != Hkv * Dv:
        raise DiffExportError(f"value width {value[2]} != num_kv_heads*{Dv} = {Hkv * Dv}")
    if Skv < 1:
        raise DiffExportError("key length must be at least 1")
    if attrs.causal and Sq > Skv:
        raise DiffExportError(f"causal attention needs Sq <= Skv (bottom-right alignment), got {Sq} > {Skv}")
    expected_lambda = (1,) if attrs.variant == VARIANT_V1 else (B, Sq, H)
    if tuple(lambda_full) != expected_lambda:
        raise DiffExportError(f"lambda_full shape {list(lambda_full)} != {list(expected_lambda)} "
                              f"for variant {attrs.variant}")
    if norm_weight is None:
        raise DiffExportError("norm_weight is required (pass all ones where the model has no weight)")
    if tuple(norm_weight) != (Dv,):
        raise DiffExportError(f"norm_weight shape {list(norm_weight)} != [{Dv}]")
    if key_mask is not None and tuple(key_mask) != (B, Skv):
        raise DiffExportError(f"key_mask shape {list(key_mask)} != [batch, key length] = {[B, Skv]}")
    return (B, Sq, H * Dv)
