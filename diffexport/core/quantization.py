"""Low-bit attention logits: the ONE definition of the quantisation, mirrored by the CUDA kernel.

Two schemes:

"qk" (the kernel's INT8-logits path, SageAttention-style):
  * Q is quantised per block of QUERY_BLOCK consecutive query tokens of one map of one head
    (per batch element): one absmax scale per block, over the block's tokens and all D channels.
  * K likewise per block of KEY_BLOCK key tokens of one kv head (before any GQA sharing).
  * Optional K-smoothing first: K minus its per-(batch, kv head) mean over ALL key tokens. It
    shifts every logit row by a constant, so softmax is unchanged; it shrinks K's range.
  * Integer grid of `bits` bits, symmetric: qmax = 2**(bits-1) - 1 (127, 31, 7 for 8, 6, 4 bits).
    inv = qmax / absmax (fp32), code = clamp(round_half_even(x * inv), -qmax, qmax),
    scale = absmax / qmax (fp32). An all-zero block gets absmax 1 (codes 0, any scale works).
  * logit = fp32(sum_d code_q * code_k) * (scale_q * scale_k), then times the softmax scale.
    The integer sum is exact (int32 in the kernel, float64 here).

"logits" (the paper's section 3.7 study: quantise the logits themselves):
  * each row of visible logits of one head (one query token against its keys) gets one absmax
    scale; the same grid, rounding and clamping as above; masked entries take no part.

bits = 16 in the analysis tools means "not quantised" (the paper's 16-bit baseline); here
bits must lie in 2..16. Everything is computed in fp32 (fp64 for the integer sums), so the
CPU reference and the kernel can agree to rounding of the final fp32 products.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from diffexport.core.errors import DiffExportError

QUERY_BLOCK = 64  # query tokens per Q scale (the kernel's query tile)
KEY_BLOCK = 64  # key tokens per K scale (the kernel's key tile)
SCHEMES = ("qk", "logits")
UNQUANTISED_BITS = 16


def check_bits(bits: int) -> int:
    if isinstance(bits, bool) or not isinstance(bits, int) or not 2 <= bits <= 16:
        raise DiffExportError(f"logit bits must be an integer from 2 to 16 (16 = not quantised), got {bits!r}")
    return bits


def qmax_for(bits: int) -> int:
    """Largest code of the symmetric signed grid: 127 for 8 bits, 31 for 6, 7 for 4, 1 for 2."""
    return 2 ** (check_bits(bits) - 1) - 1


@dataclass(frozen=True)
class LogitQuant:
    """A logit quantisation setting: scheme, bits, K-smoothing (qk scheme only)."""

    bits: int
    scheme: str = "qk"
    smooth_k: bool = True

    def __post_init__(self) -> None:
        check_bits(self.bits)
        if self.scheme not in SCHEMES:
            raise DiffExportError(f"unknown logit quantisation scheme {self.scheme!r}; choose one of "
                                  f"{', '.join(SCHEMES)}")

    @property
    def active(self) -> bool:
        return self.bits < UNQUANTISED_BITS

    @property
    def recipe(self) -> str:
        """The scheme without the width: "qk, K-smoothing", "qk" or "logits"."""
        return self.scheme + (", K-smoothing" if self.scheme == "qk" and self.smooth_k else "")

    def describe(self) -> str:
        return f"{self.bits}-bit {self.recipe}" if self.active else "not quantised"


def absmax_codes(x: torch.Tensor, bits: int, reduce_dims: tuple[int, ...]):
    """Symmetric absmax codes of fp32 x with one scale per slice over `reduce_dims`.

    Returns (codes as fp32 integers, scale broadcastable to x).
    """
    qmax = float(qmax_for(bits))
    x = x.float()
    absmax = x.abs().amax(dim=reduce_dims, keepdim=True)
    absmax = torch.where(absmax > 0, absmax, torch.ones_like(absmax))
    # True IEEE divisions, as the kernel does: `qmax / tensor` would be reciprocal()*qmax in torch
    # (two roundings), and CUDA turns a division by a Python scalar into a multiplication.
    qmax_t = torch.full_like(absmax, qmax)
    inv = qmax_t / absmax
    codes = torch.round(x * inv).clamp_(-qmax, qmax)  # torch.round: half to even, like cvt.rni
    return codes, absmax / qmax_t


def quantise_tokens(x: torch.Tensor, bits: int, block: int):
    """Per-block codes of x [B, heads, S, D]: one scale per (b, head, block of `block` tokens).

    Returns codes [B, heads, S, D] and scales [B, heads, ceil(S/block)]. The last block may be short.
    """
    B, Hx, S, D = x.shape
    n_blocks = -(-S // block)
    pad = n_blocks * block - S
    padded = torch.nn.functional.pad(x.float(), (0, 0, 0, pad))  # zeros never raise an absmax
    codes, scale = absmax_codes(padded.view(B, Hx, n_blocks, block, D), bits, (3, 4))
    return codes.view(B, Hx, n_blocks * block, D)[:, :, :S], scale.view(B, Hx, n_blocks)


def smooth_keys(k: torch.Tensor) -> torch.Tensor:
    """K minus its mean over tokens, per (batch, kv head), in fp32: softmax(q k^T) is unchanged."""
    k = k.float()
    return k - k.mean(dim=2, keepdim=True)


def qk_int_logits(q: torch.Tensor, k: torch.Tensor, bits: int, smooth_k: bool = True) -> torch.Tensor:
    """Dequantised q k^T (without the softmax scale) of the "qk" scheme.

    q [B, Hq, Sq, D], k [B, Hkv, Skv, D] with Hkv dividing Hq (GQA: a query head reads kv head
    h // (Hq / Hkv)); returns fp32 [B, Hq, Sq, Skv].
    """
    if smooth_k:
        k = smooth_keys(k)
    q_codes, q_scale = quantise_tokens(q, bits, QUERY_BLOCK)
    k_codes, k_scale = quantise_tokens(k, bits, KEY_BLOCK)
    rep = q.shape[1] // k.shape[1]
    k_codes, k_scale = k_codes.repeat_interleave(rep, dim=1), k_scale.repeat_interleave(rep, dim=1)
    acc = (q_codes.double() @ k_codes.double().transpose(-1, -2)).float()  # exact integer sums
    q_s = q_scale.repeat_interleave(QUERY_BLOCK, dim=2)[:, :, : q.shape[2], None]
    k_s = k_scale.repeat_interleave(KEY_BLOCK, dim=2)[:, :, None, : k.shape[2]]
    return acc * (q_s * k_s)


def quantise_logit_rows(s: torch.Tensor, bits: int, visible: torch.Tensor | None = None) -> torch.Tensor:
    """The "logits" scheme: fake-quantise fp32 logits s [..., Sq, Skv] with one absmax per row.

    visible [Sq, Skv] (True = attended) keeps masked entries out of the absmax; they come back unchanged.
    """
    s = s.float()
    scope = s if visible is None else s.masked_fill(~visible, 0.0)
    codes, scale = absmax_codes(scope, bits, (-1,))
    out = codes * scale
    return out if visible is None else torch.where(visible, out, s)
