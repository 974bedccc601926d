"""The decoder formats a KV-cache folder can be written in, and everything that differs between them.

A folder's format is recorded in its model.onnx metadata (`diffexport.attention`). Code above this
layer asks the registry (`decoder_format(name)`) instead of comparing the name. Adding a format
means adding an entry here and its rewrite pass in passes/; passes/decoder_formats.py maps each
format's `rewrite` to that pass and hands it to the export.
"""

from __future__ import annotations

import dataclasses

from diffexport.core.errors import DiffExportError


@dataclasses.dataclass(frozen=True)
class DecoderFormat:
    name: str
    # The op attention runs as once rewritten, for reports ("" for the DiffAttention node itself).
    summary: str
    # The cache is head-major [B, Hkv, T, W / Hkv] (True) or token-major [B, 1, T, W] (False).
    head_major_cache: bool
    # onnxruntime-genai keeps past and present in one buffer (search.past_present_share_buffer).
    shared_buffer: bool
    # Export dtypes the format is written in; refusal says why the others are not.
    dtypes: tuple[str, ...]
    dtype_refusal: str
    # Whether TensorRT builds the folder's graph; refusal says why not.
    tensorrt: bool
    tensorrt_refusal: str
    # The post-export rewrite of DiffAttention nodes ("" = none); a model without such nodes
    # (the baseline Transformer) cannot be written in a format that has one.
    rewrite: str
    # The rewrite fuses the norms for onnxruntime itself (the export leaves them alone).
    fuses_norms: bool


DEFAULT = "diffattention"  # the export's own graph; default_format picks a folder's format

FORMATS: dict[str, DecoderFormat] = {f.name: f for f in (
    DecoderFormat(
        name="diffattention",
        summary="",
        head_major_cache=False, shared_buffer=False,
        dtypes=("float32", "float16", "bfloat16"), dtype_refusal="",
        tensorrt=True, tensorrt_refusal="",
        rewrite="", fuses_norms=False),
    DecoderFormat(
        name="gqa",
        summary="GroupQueryAttention (onnxruntime contrib op)",
        head_major_cache=True, shared_buffer=True,
        dtypes=("float32", "float16"),
        dtype_refusal=("--attention gqa folders are float32 or float16: the rewrite is verified in onnxruntime on "
                       "the CPU, which has no bfloat16 kernels (use --fp16, or a bf16 DiffAttention folder for "
                       "TensorRT)"),
        tensorrt=False,
        tensorrt_refusal=("runs its attention as onnxruntime's GroupQueryAttention (the CPU default), which "
                          "TensorRT does not have: export the folder for TensorRT with `diffexport onnx CKPT "
                          "--kv-cache --attention diffattention` (or --provider cuda) and build from that"),
        rewrite="group_query_attention", fuses_norms=True),
)}


def default_provider(dtype: str) -> str:
    """The provider a folder's genai_config names unless told: bf16 folders run on CUDA only
    (onnxruntime's CPU provider has no bfloat16 kernels)."""
    return "cuda" if dtype == "bfloat16" else "cpu"


def default_format(provider: str | None, dtype: str, has_diff_attention: bool = True) -> str:
    """The format of a KV-cache folder when the user names none. For onnxruntime on the CPU, gqa:
    its decode is the faster one at every prompt length, fp32 and int4 (docs/BENCHMARKS.md, "DIFF
    decode on CPU against its peers"). For CUDA (TensorRT's folders: its plugin reads DiffAttention
    nodes), for dtypes gqa does not take and for a model with no DiffAttention node to rewrite (the
    baseline Transformer), the export's own graph."""
    fast = FORMATS["gqa"]
    if (provider or default_provider(dtype)) == "cpu" and dtype in fast.dtypes and has_diff_attention:
        return fast.name
    return DEFAULT


def decoder_format(name: str | None) -> DecoderFormat:
    """The format of that name (None: the default); one-line error for an unknown one."""
    fmt = FORMATS.get(DEFAULT if name is None else name)
    if fmt is None:
        raise DiffExportError(f"unknown attention op {name!r}; choose one of {list(FORMATS)}")
    return fmt


def cache_heads(fmt: DecoderFormat, n_kv_heads: int) -> int:
    """Heads of a layer's cache: the kv groups for a head-major cache, else 1 (one "head" of width W)."""
    return n_kv_heads if fmt.head_major_cache else 1
