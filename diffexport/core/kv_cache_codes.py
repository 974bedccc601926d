"""An 8-bit KV cache for the fused kernel: the ONE definition of its codes and scales, which the CUDA
kernel's split-KV decode path reads (plugins/kernels/kv_codes.cuh, DiffxKvFormat in diff_attention.h).

  * Formats: "int8" (codes -127..127, torch.int8) and "fp8" (float8 e4m3, torch.float8_e4m3fn,
    finite values up to 448). A code's real value is value(code) * scale[channel].
  * Scales are static, one float32 per channel of the cache's rows (key row: key heads x D; value
    row: Hkv x Dv): the channel's largest magnitude over the calibration tokens divided by the
    format's largest code (127 or 448). A decode step then reads a quarter of a float32 cache's bytes
    and half of an fp16 one's; the kernel folds K's scales into Q and V's onto the output, so no
    scale is applied per key.
  * K-smoothing (SageAttention's, the INT8-logits path's): the keys are stored minus a per-channel
    shift, the calibration tokens' mean. Every logit row then moves by the constant q . shift, which
    no softmax sees, and K's range (hence its quantisation step) shrinks. The shift is part of the
    cache's definition: every key written to it, prefill or decode, is shifted by the same vector.
    Values are never shifted (a constant added to V would survive the differential combination).
  * Codes past the grid saturate: int8 to +-127, fp8 to +-448 (e4m3's NaN codes are never written).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from diffexport.core.errors import DiffExportError

FORMATS = {"int8": 1, "fp8": 2}  # name -> DiffxKvFormat
CODE_DTYPES = {"int8": torch.int8, "fp8": torch.float8_e4m3fn}
LARGEST_CODE = {"int8": 127.0, "fp8": 448.0}
_TINY = 1e-12  # the scale of a channel calibration saw at zero (any positive number keeps 0 at 0)


def check_format(fmt: str) -> str:
    if fmt not in FORMATS:
        raise DiffExportError(f"KV cache format must be one of {', '.join(FORMATS)}, got {fmt!r}")
    return fmt


def format_of(codes: torch.Tensor) -> str | None:
    """The format whose codes this tensor holds (by dtype), or None for a float cache."""
    return next((f for f, d in CODE_DTYPES.items() if codes.dtype == d), None)


@dataclass(frozen=True)
class KvCacheScales:
    """A cache's static per-channel quantisation: format, K scale and shift [key width], V scale [value width]."""

    fmt: str
    k_scale: torch.Tensor
    v_scale: torch.Tensor
    k_shift: torch.Tensor

    @classmethod
    def calibrate(cls, keys: torch.Tensor, values: torch.Tensor, fmt: str, *, smooth_k: bool = True) -> KvCacheScales:
        """Scales (and K's shift) from calibration keys [..., key width] and values [..., value width]."""
        check_format(fmt)
        k = keys.detach().float().reshape(-1, keys.shape[-1])
        v = values.detach().float().reshape(-1, values.shape[-1])
        if not (torch.isfinite(k).all() and torch.isfinite(v).all()):
            raise DiffExportError("KV cache calibration: a key or value is not finite")
        shift = k.mean(dim=0) if smooth_k else torch.zeros(k.shape[-1], device=k.device)
        top = LARGEST_CODE[fmt]
        k_scale = ((k - shift).abs().amax(dim=0) / top).clamp_min(_TINY)
        v_scale = (v.abs().amax(dim=0) / top).clamp_min(_TINY)
        return cls(fmt, k_scale.contiguous(), v_scale.contiguous(), shift.contiguous())

    def quantise_keys(self, keys: torch.Tensor) -> torch.Tensor:
        return encode(keys.float() - self.k_shift.to(keys.device), self.k_scale.to(keys.device), self.fmt)

    def quantise_values(self, values: torch.Tensor) -> torch.Tensor:
        return encode(values.float(), self.v_scale.to(values.device), self.fmt)


def encode(x: torch.Tensor, scale: torch.Tensor, fmt: str) -> torch.Tensor:
    """Codes of x (float, last dim = channels) on the format's grid: round half to even, saturated."""
    top = LARGEST_CODE[check_format(fmt)]
    y = (x / scale).clamp(-top, top)
    if fmt == "int8":
        return torch.round(y).to(torch.int8)
    return y.to(torch.float8_e4m3fn)  # round to nearest even; within +-448 no NaN


def decode(codes: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """The real values (float32) the codes stand for: value(code) * scale[channel] (without K's shift)."""
    if format_of(codes) is None:
        raise DiffExportError(f"not an 8-bit KV cache: {codes.dtype} (int8 or float8_e4m3fn codes)")
    return codes.float() * scale.float().to(codes.device)
