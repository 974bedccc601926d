"""The fused DiffAttention CUDA kernel (plugins/kernels) from Python, through its C ABI.

The library is a plain shared object (libdiffexport_kernels.so, built with CMake, not against
torch), loaded with ctypes. `diff_attention(...)` runs it on CUDA tensors laid out as the op
contract says; op.py makes it the `diffexport::diff_attention` implementation on CUDA.

Where the library is looked for, first hit wins:
  $DIFFEXPORT_KERNEL_LIB, <repo>/build/plugins/kernels/, diffexport/lib/ (a wheel with the library).
Which implementation the op uses on CUDA: $DIFFEXPORT_ATTENTION = auto (the fused kernel when
the library loads and supports the call, else the FlashDiffAttn_1 reference), fused (the kernel
or an error saying why not), reference.
"""

from __future__ import annotations

import ctypes
import functools
import os
from pathlib import Path

import torch

from diffexport.core import contract, kv_cache_codes
from diffexport.core.contract import VARIANT_V1, DiffAttentionAttrs
from diffexport.core.errors import DiffExportError
from diffexport.core.quantization import check_bits

LIBRARY_NAME = "libdiffexport_kernels.so"
ABI_VERSION = 4  # DIFFX_ABI_VERSION in plugins/kernels/diff_attention.h
# ABI 3 only added the split-KV decode workspace and diffx_attention_plan, ABI 4 the 8-bit KV cache's
# fields after all others: for calls of more than DECODE_MAX_QUERY tokens on a float cache an ABI-2
# or -3 build reads the same params, the prefix it knows (before/after timings of prefill).
PREFILL_ABI_VERSIONS = (2, 3, 4)
# ... and an ABI-3 build reads them for decode-sized calls too (its split-KV kernels), on a float cache.
FLOAT_CACHE_ABI_VERSIONS = (3, 4)
HEAD_DIMS = contract.KERNEL_HEAD_DIMS
DTYPE_CODES = {torch.float16: 1, torch.bfloat16: 2, torch.float32: 3}  # float32: converted to fp16 inside
MAX_INT8_BITS = 8  # logit_bits 2..8 run the INT8 kernel; 16 (or 0) = fp16/bf16 logits
IMPL_ENV = "DIFFEXPORT_ATTENTION"
IMPL_CHOICES = ("auto", "fused", "reference")
# Read by the C library itself on every call: auto (default: the split-KV decode kernels for
# q_len <= DECODE_MAX_QUERY; above, the sm_90a TMA + wgmma kernel for fp logits on an sm_90 GPU with a
# library built with it, else the mma.sync one-pass kernel), mma (the one-pass kernel for every call)
# or hopper (the TMA + wgmma kernel for every longer fp-logit call; an error off sm_90).
KERNEL_PATH_ENV = "DIFFEXPORT_KERNEL_PATH"
DECODE_MAX_QUERY = 16  # DIFFX_DECODE_MAX_QUERY in plugins/kernels/diff_attention.h
PLAN_NAMES = {1: "one-pass", 2: "split-kv", 3: "hopper"}
BUILD_HINT = ("build it with `cmake -S . -B build -G Ninja && cmake --build build` (needs nvcc) "
              "or point DIFFEXPORT_KERNEL_LIB at libdiffexport_kernels.so")

STATUS_OK = 0


class DiffxAttentionParams(ctypes.Structure):
    """Mirror of DiffxAttentionParams in diff_attention.h (checked against diffx_params_size())."""

    _fields_ = [
        ("query", ctypes.c_void_p), ("q_batch_stride", ctypes.c_int64), ("q_row_stride", ctypes.c_int64),
        ("key", ctypes.c_void_p), ("k_batch_stride", ctypes.c_int64), ("k_row_stride", ctypes.c_int64),
        ("value", ctypes.c_void_p), ("v_batch_stride", ctypes.c_int64), ("v_row_stride", ctypes.c_int64),
        ("lambda_full", ctypes.c_void_p), ("lambda_batch_stride", ctypes.c_int64),
        ("lambda_row_stride", ctypes.c_int64), ("lambda_head_stride", ctypes.c_int64),
        ("norm_weight", ctypes.c_void_p),
        ("output", ctypes.c_void_p), ("o_batch_stride", ctypes.c_int64), ("o_row_stride", ctypes.c_int64),
        ("key_mask", ctypes.c_void_p), ("mask_batch_stride", ctypes.c_int64),
        ("dtype", ctypes.c_int32), ("variant", ctypes.c_int32),
        ("batch", ctypes.c_int32), ("q_len", ctypes.c_int32), ("kv_len", ctypes.c_int32),
        ("num_heads", ctypes.c_int32), ("num_kv_heads", ctypes.c_int32), ("head_dim", ctypes.c_int32),
        ("causal", ctypes.c_int32), ("norm", ctypes.c_int32),
        ("scale", ctypes.c_float), ("norm_eps", ctypes.c_float), ("output_scale", ctypes.c_float),
        ("logit_bits", ctypes.c_int32), ("smooth_k", ctypes.c_int32),
        ("workspace", ctypes.c_void_p), ("workspace_bytes", ctypes.c_size_t),
        # ABI 4: an 8-bit KV cache (DiffxKvFormat, diffexport/core/kv_cache_codes.py)
        ("kv_format", ctypes.c_int32), ("k_scale", ctypes.c_void_p), ("v_scale", ctypes.c_void_p),
    ]


# Bytes of the params an ABI-2/3 build reads: everything before the ABI-4 fields.
PARAMS_BEFORE_ABI4 = DiffxAttentionParams.kv_format.offset


def library_candidates() -> list[Path]:
    env = os.environ.get("DIFFEXPORT_KERNEL_LIB")
    if env:
        return [Path(env)]
    package = Path(__file__).resolve().parent.parent
    return [package.parent / "build" / "plugins" / "kernels" / LIBRARY_NAME, package / "lib" / LIBRARY_NAME]


def library_path() -> Path | None:
    return next((p for p in library_candidates() if p.is_file()), None)


@functools.lru_cache(maxsize=None)
def load_library() -> ctypes.CDLL:
    """The kernel library, loaded once and checked against this module's ABI; DiffExportError if unusable."""
    path = library_path()
    if path is None:
        where = ", ".join(str(p) for p in library_candidates())
        raise DiffExportError(f"fused kernel library not found (looked at {where}): {BUILD_HINT}")
    return open_library(path)


def open_library(path: Path, *, prefill_only: bool = False, float_cache_only: bool = False) -> ctypes.CDLL:
    """The kernel library at `path`, checked against this module's ABI (benchmarks compare builds
    with it; everything else goes through load_library). prefill_only: also an older build whose
    params are the same for calls of more than DECODE_MAX_QUERY tokens (PREFILL_ABI_VERSIONS), for
    before/after timings of prefill; such a library has no diffx_attention_plan. float_cache_only:
    also an ABI-3 build, for before/after timings of decode on a float KV cache."""
    try:
        lib = ctypes.CDLL(str(path))
    except OSError as exc:
        raise DiffExportError(f"cannot load the fused kernel library {path}: {exc}") from None
    try:
        _declare(lib)
    except AttributeError as exc:  # an older or foreign library
        raise DiffExportError(f"{path} lacks a kernel ABI function ({exc}): rebuild it from this checkout") from None
    abi = lib.diffx_abi_version()
    if abi != ABI_VERSION and not (prefill_only and abi in PREFILL_ABI_VERSIONS
                                   or float_cache_only and abi in FLOAT_CACHE_ABI_VERSIONS):
        raise DiffExportError(f"{path} has kernel ABI {abi}, this diffexport needs "
                              f"{ABI_VERSION}: rebuild the library from this checkout")
    if abi >= 3:
        try:
            declare_plan(lib)
        except AttributeError as exc:
            raise DiffExportError(f"{path} lacks a kernel ABI function ({exc}): rebuild it from this "
                                  "checkout") from None
    expected = ctypes.sizeof(DiffxAttentionParams) if abi == ABI_VERSION else PARAMS_BEFORE_ABI4
    if lib.diffx_params_size() != expected:
        raise DiffExportError(f"{path}: params struct is {lib.diffx_params_size()} bytes, the binding expects "
                              f"{expected} for ABI {abi}: rebuild the library from this checkout")
    return lib


def _declare(lib: ctypes.CDLL) -> None:
    lib.diffx_abi_version.restype = ctypes.c_int
    lib.diffx_params_size.restype = ctypes.c_size_t
    lib.diffx_build_info.restype = ctypes.c_char_p
    lib.diffx_status_string.restype = ctypes.c_char_p
    lib.diffx_status_string.argtypes = [ctypes.c_int]
    lib.diffx_last_error.restype = ctypes.c_char_p
    params_p = ctypes.POINTER(DiffxAttentionParams)
    lib.diffx_attention_check.restype = ctypes.c_int
    lib.diffx_attention_check.argtypes = [params_p]
    lib.diffx_attention_workspace_size.restype = ctypes.c_size_t
    lib.diffx_attention_workspace_size.argtypes = [params_p]
    lib.diffx_attention_forward.restype = ctypes.c_int
    lib.diffx_attention_forward.argtypes = [params_p, ctypes.c_void_p]


def declare_plan(lib: ctypes.CDLL) -> None:
    int_p = ctypes.POINTER(ctypes.c_int)
    lib.diffx_attention_plan.restype = ctypes.c_int
    lib.diffx_attention_plan.argtypes = [ctypes.POINTER(DiffxAttentionParams), int_p, int_p]


def kernel_plan(params: DiffxAttentionParams, lib: ctypes.CDLL | None = None) -> tuple[str, int]:
    """Which kernel the library runs for these params ("one-pass", "split-kv" or "hopper") and its key splits."""
    lib = lib or load_library()
    path, splits = ctypes.c_int(), ctypes.c_int()
    status = lib.diffx_attention_plan(ctypes.byref(params), ctypes.byref(path), ctypes.byref(splits))
    if status != STATUS_OK:
        raise status_error(lib, status)
    return PLAN_NAMES[path.value], splits.value


def build_info() -> str:
    return load_library().diffx_build_info().decode()


def status_error(lib: ctypes.CDLL, status: int) -> DiffExportError:
    detail = lib.diffx_last_error().decode() or lib.diffx_status_string(status).decode()
    return DiffExportError(f"fused kernel: {detail}")


def unsupported_reason(query, key, value, lambda_full, norm_weight, attrs: DiffAttentionAttrs,
                       key_mask=None, kv_scales: tuple | None = None) -> str | None:
    """Why the fused kernel cannot take this call, or None when it can (library not considered).
    kv_scales: (k_scale, v_scale) of an 8-bit cache (key and value then hold its codes)."""
    kv_reason = kv_cache_reason(key, value, kv_scales)
    if kv_reason:
        return kv_reason
    tensors = {"query": query, "key": key, "value": value, "lambda_full": lambda_full, "norm_weight": norm_weight}
    if kv_scales is not None:
        tensors.update(k_scale=kv_scales[0], v_scale=kv_scales[1])
    if key_mask is not None:
        tensors["key_mask"] = key_mask
        if key_mask.dtype != torch.int64 or key_mask.stride(-1) != 1:
            return "key_mask must be int64 with contiguous rows"
    if not all(t.is_cuda for t in tensors.values()):
        return "the fused kernel runs on CUDA tensors only"
    if len({t.device for t in tensors.values()}) > 1:
        return "all inputs must be on the same CUDA device"
    if query.dtype not in DTYPE_CODES:
        return f"the fused kernel takes float16, bfloat16 or float32 (run in fp16), got {query.dtype}"
    if kv_scales is None and (key.dtype != query.dtype or value.dtype != query.dtype):
        return "query, key, value and lambda_full must share one dtype"
    if lambda_full.dtype != query.dtype:
        return "query, key, value and lambda_full must share one dtype"
    if norm_weight.dtype != torch.float32:
        return f"norm_weight must be float32, got {norm_weight.dtype}"
    if attrs.head_dim not in HEAD_DIMS:
        return f"the fused kernel supports head_dim 64 or 128, got {attrs.head_dim}"
    for name in ("query", "key", "value"):
        t = tensors[name]
        multiple = 16 if t.element_size() == 1 else 8  # rows on 16 bytes: 8-bit codes need 16 elements
        if t.stride(-1) != 1 or t.stride(1) % multiple or t.stride(0) % multiple or t.data_ptr() % 16:
            return (f"{name} must have contiguous rows starting on 16 bytes, with strides that are multiples "
                    f"of {multiple} elements (call .contiguous())")
    if not norm_weight.is_contiguous():
        return "norm_weight must be contiguous"
    return None


def kv_cache_reason(key, value, kv_scales: tuple | None) -> str | None:
    """Why key, value and kv_scales are not an 8-bit cache the kernel reads (None: they are, or no
    cache was given: float key and value without scales)."""
    fmt = kv_cache_codes.format_of(key)
    if fmt is None and kv_scales is None:
        return None
    if kv_scales is None or fmt is None or value.dtype != key.dtype:
        return ("an 8-bit KV cache takes key and value codes of one format (int8 or float8_e4m3fn) "
                "with their k_scale and v_scale")
    widths = {"k_scale": key.shape[-1], "v_scale": value.shape[-1]}
    for name, t in zip(("k_scale", "v_scale"), kv_scales):
        if t.dtype != torch.float32 or tuple(t.shape) != (widths[name],) or not t.is_contiguous():
            return f"{name} must be a contiguous float32 vector of {widths[name]} channels"
    return None


def make_params(query, key, value, lambda_full, norm_weight, out, attrs: DiffAttentionAttrs, *,
                logit_bits: int = 0, smooth_k: bool = True, key_mask=None,
                kv_scales: tuple | None = None) -> DiffxAttentionParams:
    """The C params struct for tensors already validated (pointers, element strides, attributes)."""
    p = DiffxAttentionParams()
    p.query, p.q_batch_stride, p.q_row_stride = query.data_ptr(), query.stride(0), query.stride(1)
    p.key, p.k_batch_stride, p.k_row_stride = key.data_ptr(), key.stride(0), key.stride(1)
    p.value, p.v_batch_stride, p.v_row_stride = value.data_ptr(), value.stride(0), value.stride(1)
    p.lambda_full = lambda_full.data_ptr()
    if attrs.variant != VARIANT_V1:
        p.lambda_batch_stride, p.lambda_row_stride, p.lambda_head_stride = lambda_full.stride()
    p.norm_weight = norm_weight.data_ptr()
    p.output, p.o_batch_stride, p.o_row_stride = out.data_ptr(), out.stride(0), out.stride(1)
    if key_mask is not None:
        p.key_mask, p.mask_batch_stride = key_mask.data_ptr(), key_mask.stride(0)
    p.dtype = DTYPE_CODES.get(query.dtype, 0)
    p.variant, p.num_heads = attrs.variant, attrs.num_heads
    p.num_kv_heads, p.head_dim = attrs.num_kv_heads, attrs.head_dim
    p.batch, p.q_len, p.kv_len = query.shape[0], query.shape[1], key.shape[1]
    p.causal, p.norm = attrs.causal, attrs.norm
    p.scale, p.norm_eps, p.output_scale = attrs.effective_scale, attrs.norm_eps, attrs.output_scale
    p.logit_bits, p.smooth_k = logit_bits, int(bool(smooth_k))
    fmt = kv_cache_codes.format_of(key)
    if fmt is not None:
        p.kv_format = kv_cache_codes.FORMATS[fmt]
        p.k_scale, p.v_scale = kv_scales[0].data_ptr(), kv_scales[1].data_ptr()
    return p


def launch(params: DiffxAttentionParams, device: torch.device, lib: ctypes.CDLL | None = None) -> None:
    """Allocate the workspace (INT8, float32 I/O, decode partials) and run the kernel on the device's current stream."""
    lib = lib or load_library()
    workspace = None
    size = lib.diffx_attention_workspace_size(ctypes.byref(params))
    if size:
        workspace = torch.empty(size, dtype=torch.uint8, device=device)
        params.workspace, params.workspace_bytes = workspace.data_ptr(), size
    stream = torch.cuda.current_stream(device).cuda_stream
    with torch.cuda.device(device):
        status = lib.diffx_attention_forward(ctypes.byref(params), ctypes.c_void_p(stream))
    if status != STATUS_OK:
        raise status_error(lib, status)
    # The caching allocator may hand the workspace to other work once Python drops it: tie its
    # lifetime to the stream that uses it.
    if workspace is not None:
        workspace.record_stream(torch.cuda.current_stream(device))


def diff_attention(query, key, value, lambda_full, norm_weight, attrs: DiffAttentionAttrs, *,
                   logit_bits: int = 0, smooth_k: bool = True, out: torch.Tensor | None = None,
                   key_mask: torch.Tensor | None = None, kv_scales: tuple | None = None,
                   lib: ctypes.CDLL | None = None) -> torch.Tensor:
    """The fused kernel on contract inputs: output [B, Sq, H*Dv] in query's dtype.

    logit_bits 0 or 16: fp16/bf16 logits; 2..8: INT8 logits (diffexport/core/quantization.py "qk").
    float32 tensors are converted to fp16 in the workspace, computed in fp16 and converted back.
    `out` (optional) is written in place: it must be [B, Sq, H*Dv] with contiguous rows.
    key_mask (op version 2): [B, Skv] int64, 0 = padding key. lib: another build (open_library).
    An 8-bit KV cache: key and value hold its codes (torch.int8 or torch.float8_e4m3fn) and
    kv_scales = (k_scale, v_scale), float32 per channel (diffexport/core/kv_cache_codes.py).
    """
    if logit_bits not in (0, 16):
        check_bits(logit_bits)
        if logit_bits > MAX_INT8_BITS:
            raise DiffExportError(f"the INT8-logits kernel takes 2..8 bits, got {logit_bits} (16 = not quantised)")
    out_shape = contract.check_shapes(attrs, tuple(query.shape), tuple(key.shape), tuple(value.shape),
                                      tuple(lambda_full.shape), tuple(norm_weight.shape),
                                      None if key_mask is None else tuple(key_mask.shape))
    reason = unsupported_reason(query, key, value, lambda_full, norm_weight, attrs, key_mask, kv_scales)
    if reason:
        raise DiffExportError(reason)
    if kv_scales is not None and logit_bits not in (0, 16):
        raise DiffExportError("an 8-bit KV cache does not combine with INT8 logits (logit_bits 2..8)")
    if out is None:
        out = torch.empty(out_shape, dtype=query.dtype, device=query.device)
    elif tuple(out.shape) != out_shape or out.dtype != query.dtype or out.device != query.device:
        raise DiffExportError(f"out must be {list(out_shape)} {query.dtype} on {query.device}")
    params = make_params(query, key, value, lambda_full, norm_weight, out, attrs,
                         logit_bits=logit_bits, smooth_k=smooth_k, key_mask=key_mask, kv_scales=kv_scales)
    launch(params, query.device, lib)
    return out


def impl_choice() -> str:
    choice = os.environ.get(IMPL_ENV, "auto").strip().lower() or "auto"
    if choice not in IMPL_CHOICES:
        raise DiffExportError(f"{IMPL_ENV}={choice!r} is not one of {', '.join(IMPL_CHOICES)}")
    return choice


def use_fused(query, key, value, lambda_full, norm_weight, attrs: DiffAttentionAttrs, key_mask=None) -> bool:
    """Whether the op should run the fused kernel for this CUDA call ($DIFFEXPORT_ATTENTION)."""
    choice = impl_choice()
    if choice == "reference":
        return False
    if choice == "fused":
        load_library()  # raises with the build hint when missing
        reason = unsupported_reason(query, key, value, lambda_full, norm_weight, attrs, key_mask)
        if reason:
            raise DiffExportError(f"{IMPL_ENV}=fused: {reason}")
        return True
    if query.dtype == torch.float32:  # auto keeps fp32 accuracy: the kernel would compute in fp16
        return False
    if unsupported_reason(query, key, value, lambda_full, norm_weight, attrs, key_mask):
        return False
    try:
        load_library()
    except DiffExportError:
        return False
    return True
