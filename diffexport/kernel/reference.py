"""Eager references of differential attention, on the op contract's inputs.

Every function here takes the DiffAttention inputs exactly as the contract lays them out
(query [B, Sq, 2*H*D], key, value, lambda_full, norm_weight) plus validated attributes, and
returns the contract's output [B, Sq, H*Dv]:

  naive_diff_attention   the paper's Eq. 1 written out: two explicit softmax maps, subtract, times V
  flash_diff_attention_1 the paper's FlashDiffAttn_1: two attention calls with V of width Dv
  flash_diff_attention_2 the paper's FlashDiffAttn_2: four attention calls with V halves
  quantised_diff_attention  Eq. 1 with low-bit logits (diffexport/core/quantization.py): the mirror
                         the INT8-logits kernel is tested against

The attention calls go to flash_attn when it is importable and can take the call (CUDA,
fp16/bf16, equal q/v head dims), else to torch's scaled_dot_product_attention.
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F

from diffexport.core.contract import VARIANT_V1, DiffAttentionAttrs
from diffexport.core.quantization import LogitQuant, qk_int_logits, quantise_logit_rows


def split_maps(query, key, value, attrs: DiffAttentionAttrs):
    """Contract layout -> (q1, q2 [B,H,Sq,D]; k1, k2 [B,Hkv,Skv,D]; v [B,Hkv,Skv,Dv])."""
    B, Sq, _ = query.shape
    Skv = key.shape[1]
    H, Hkv, D, Dv = attrs.num_heads, attrs.num_kv_heads, attrs.head_dim, attrs.value_dim
    q = query.view(B, Sq, H, 2, D)
    q1, q2 = q[:, :, :, 0].transpose(1, 2), q[:, :, :, 1].transpose(1, 2)
    if attrs.variant == VARIANT_V1:
        k = key.view(B, Skv, Hkv, 2, D)
        k1, k2 = k[:, :, :, 0].transpose(1, 2), k[:, :, :, 1].transpose(1, 2)
    else:
        k1 = k2 = key.view(B, Skv, Hkv, D).transpose(1, 2)
    v = value.view(B, Skv, Hkv, Dv).transpose(1, 2)
    return q1, q2, k1, k2, v


def causal_mask(q_len: int, kv_len: int, device) -> torch.Tensor:
    """Bottom-right aligned causal mask [Sq, Skv], True = visible (query i sees key j <= i + Skv - Sq)."""
    rows = torch.arange(q_len, device=device)[:, None] + (kv_len - q_len)
    return torch.arange(kv_len, device=device)[None, :] <= rows


def visible_mask(q_len: int, kv_len: int, causal: bool, key_mask, device) -> torch.Tensor | None:
    """Boolean visibility broadcastable to [B, heads, Sq, Skv] (True = attended), or None when all keys are.

    Bottom-right causal alignment AND the contract's key_mask [B, Skv] (1 = present, 0 = padding)."""
    visible = causal_mask(q_len, kv_len, device)[None, None] if causal else None
    if key_mask is not None:
        present = (key_mask != 0)[:, None, None, :]
        visible = present if visible is None else visible & present
    return visible


def zero_unseen_rows(out: torch.Tensor, visible: torch.Tensor | None) -> torch.Tensor:
    """The contract's rule: a query row that sees no key at all gives zeros (never NaN)."""
    if visible is None:
        return out
    return out.masked_fill(~visible.any(-1, keepdim=True), 0)


def acc_dtype(t: torch.Tensor) -> torch.dtype:
    """Accumulation dtype: fp32 for fp16/bf16/fp32 inputs, fp64 stays fp64 (for float64 oracles)."""
    return torch.promote_types(t.dtype, torch.float32)


def lambda_as_bhs1(lambda_full, attrs: DiffAttentionAttrs) -> torch.Tensor:
    """lambda_full as fp32 broadcastable to [B, H, Sq, 1]: V1 [1] -> [1,1,1,1], V2 [B,Sq,H] -> [B,H,Sq,1]."""
    lam = lambda_full.to(acc_dtype(lambda_full))
    if attrs.variant == VARIANT_V1:
        return lam.reshape(1, 1, 1, 1)
    return lam.permute(0, 2, 1).unsqueeze(-1)


def finish_heads(diff_out, norm_weight, attrs: DiffAttentionAttrs, dtype) -> torch.Tensor:
    """The epilogue after the lambda combination: per-head RMSNorm (fp32), output scale, [B,H,Sq,Dv] -> [B,Sq,H*Dv]."""
    B, H, Sq, Dv = diff_out.shape
    out = diff_out.to(acc_dtype(diff_out))
    if attrs.norm:
        out = out * torch.rsqrt(out.pow(2).mean(-1, keepdim=True) + attrs.norm_eps)
    if norm_weight is not None:  # the contract always passes one; None (= ones) is for convenience here
        out = out * norm_weight.to(out.dtype)
    out = out * attrs.output_scale
    return out.to(dtype).transpose(1, 2).reshape(B, Sq, H * Dv)


@functools.lru_cache(maxsize=None)
def _flash_attn_func():
    try:
        from flash_attn import flash_attn_func  # optional extra: diffexport[flash-attn]
    except ImportError:
        return None
    return flash_attn_func


def attention_backend(q: torch.Tensor, v: torch.Tensor) -> str:
    """Which library an attention call on these tensors goes to: 'flash_attn' or 'sdpa'."""
    usable = (
        q.is_cuda
        and q.dtype in (torch.float16, torch.bfloat16)
        and q.shape[-1] == v.shape[-1]  # stock flash-attention 2 refuses head_dim_v != head_dim_qk
    )
    return "flash_attn" if usable and _flash_attn_func() is not None else "sdpa"


SDPA_BACKEND_NAMES = ("flash", "cudnn", "efficient", "math")


def sdpa_backend(name: str):
    """torch's SDPBackend for one of SDPA_BACKEND_NAMES (to force it with sdpa_kernel)."""
    from torch.nn.attention import SDPBackend

    return {"flash": SDPBackend.FLASH_ATTENTION, "cudnn": SDPBackend.CUDNN_ATTENTION,
            "efficient": SDPBackend.EFFICIENT_ATTENTION, "math": SDPBackend.MATH}[name]


def attend(q, k, v, *, causal: bool, scale: float, key_mask=None) -> torch.Tensor:
    """softmax(scale*q k^T [+ bottom-right causal mask] [+ key padding mask]) v with GQA;
    q [B,H,Sq,D], k/v [B,Hkv,Skv,*], key_mask [B, Skv] (1 = present) or None."""
    Sq, Skv = q.shape[2], k.shape[2]
    gqa = q.shape[1] != k.shape[1]
    if key_mask is not None:
        visible = visible_mask(Sq, Skv, causal, key_mask, q.device)
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=visible, scale=scale, enable_gqa=gqa)
        return zero_unseen_rows(out, visible)
    if attention_backend(q, v) == "flash_attn":
        # flash_attn wants [B, S, H, D] and aligns causal masks bottom-right, as the contract does.
        out = _flash_attn_func()(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                 softmax_scale=scale, causal=causal)
        return out.transpose(1, 2)
    if causal and Sq != Skv:
        # SDPA's is_causal aligns top-left; decode with a KV cache needs bottom-right.
        mask = causal_mask(Sq, Skv, q.device)
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale, enable_gqa=gqa)
    return F.scaled_dot_product_attention(q, k, v, is_causal=causal, scale=scale, enable_gqa=gqa)


def _subtract(o1, o2, lambda_full, attrs):
    acc = acc_dtype(o1)
    return o1.to(acc) - lambda_as_bhs1(lambda_full, attrs) * o2.to(acc)


def naive_diff_attention(query, key, value, lambda_full, norm_weight, attrs: DiffAttentionAttrs,
                         *, clamp_renormalise: bool = False, key_mask=None) -> torch.Tensor:
    """Eq. 1 written out with explicit maps.

    clamp_renormalise=True is a TEXTBOOK VARIANT, not the paper: it clamps negative entries of
    A1 - lambda*A2 to zero and renormalises each row to sum 1. No released model uses it; it is
    here only so the textbook's worked example can be reproduced.
    """
    q1, q2, k1, k2, v = split_maps(query, key, value, attrs)
    rep = attrs.num_heads // attrs.num_kv_heads
    k1, k2, v = (t.repeat_interleave(rep, dim=1) for t in (k1, k2, v))
    scale = attrs.effective_scale
    if key_mask is None:  # Eq. 1 exactly as plain exports write it (what `diffexport optimize` fuses)
        mask = causal_mask(q1.shape[2], k1.shape[2], q1.device) if attrs.causal else None
    else:
        mask = visible_mask(q1.shape[2], k1.shape[2], bool(attrs.causal), key_mask, q1.device)

    def softmax_map(q, k):
        acc = acc_dtype(q)
        logits = (q.to(acc) @ k.to(acc).transpose(-1, -2)) * scale
        probs = masked_softmax(logits, mask)
        return probs if key_mask is None else zero_unseen_rows(probs, mask)

    diff_map = softmax_map(q1, k1) - lambda_as_bhs1(lambda_full, attrs) * softmax_map(q2, k2)
    if clamp_renormalise:
        diff_map = diff_map.clamp_min(0)
        diff_map = diff_map / diff_map.sum(-1, keepdim=True)
    return finish_heads(diff_map @ v.to(diff_map.dtype), norm_weight, attrs, query.dtype)


def flash_diff_attention_1(query, key, value, lambda_full, norm_weight, attrs: DiffAttentionAttrs,
                           key_mask=None) -> torch.Tensor:
    """FlashDiffAttn_1: one attention call per map, each with the full-width V (12*N^2*d FLOPs)."""
    q1, q2, k1, k2, v = split_maps(query, key, value, attrs)
    causal, scale = bool(attrs.causal), attrs.effective_scale
    o1 = attend(q1, k1, v, causal=causal, scale=scale, key_mask=key_mask)
    o2 = attend(q2, k2, v, causal=causal, scale=scale, key_mask=key_mask)
    return finish_heads(_subtract(o1, o2, lambda_full, attrs), norm_weight, attrs, query.dtype)


def flash_diff_attention_2(query, key, value, lambda_full, norm_weight, attrs: DiffAttentionAttrs,
                           key_mask=None) -> torch.Tensor:
    """FlashDiffAttn_2: four calls with V halves, for kernels that need head_dim_v == head_dim_qk."""
    q1, q2, k1, k2, v = split_maps(query, key, value, attrs)
    kw = dict(causal=bool(attrs.causal), scale=attrs.effective_scale, key_mask=key_mask)
    va, vb = v.chunk(2, dim=-1)
    o1 = torch.cat([attend(q1, k1, va, **kw), attend(q1, k1, vb, **kw)], dim=-1)
    o2 = torch.cat([attend(q2, k2, va, **kw), attend(q2, k2, vb, **kw)], dim=-1)
    return finish_heads(_subtract(o1, o2, lambda_full, attrs), norm_weight, attrs, query.dtype)


def attention_logits(q, k, scale: float, visible, quant: LogitQuant | None) -> torch.Tensor:
    """fp32 logits scale * q k^T [B, Hq, Sq, Skv] (k [B, Hkv, Skv, D], GQA by repetition), quantised as asked."""
    if quant is not None and quant.active and quant.scheme == "qk":
        return qk_int_logits(q, k, quant.bits, quant.smooth_k) * scale
    rep = q.shape[1] // k.shape[1]
    acc = acc_dtype(q)
    s = (q.to(acc) @ k.to(acc).repeat_interleave(rep, dim=1).transpose(-1, -2)) * scale
    if quant is not None and quant.active:  # scheme "logits"
        s = quantise_logit_rows(s, quant.bits, visible)
    return s


def masked_softmax(s, visible):
    return (s if visible is None else s.masked_fill(~visible, float("-inf"))).softmax(-1)


def explicit_diff_maps(query, key, value, lambda_full, attrs: DiffAttentionAttrs, quant: LogitQuant | None = None,
                       key_mask=None):
    """Eq. 1 up to the maps: (s1, s2 logits, visible mask or None, A1 - lambda*A2, v repeated for GQA).

    visible is [Sq, Skv] without key_mask (what the analysis observers read), [B, 1, Sq, Skv] with it."""
    q1, q2, k1, k2, v = split_maps(query, key, value, attrs)
    if key_mask is None:
        visible = causal_mask(q1.shape[2], k1.shape[2], q1.device) if attrs.causal else None
    else:
        visible = visible_mask(q1.shape[2], k1.shape[2], bool(attrs.causal), key_mask, q1.device)
    scale = attrs.effective_scale
    s1 = attention_logits(q1, k1, scale, visible, quant)
    s2 = attention_logits(q2, k2, scale, visible, quant)
    a1, a2 = masked_softmax(s1, visible), masked_softmax(s2, visible)
    if key_mask is not None:  # padding can leave a row with no visible key: zeros, not NaN
        a1, a2 = zero_unseen_rows(a1, visible), zero_unseen_rows(a2, visible)
    diff_map = a1 - lambda_as_bhs1(lambda_full, attrs) * a2
    v = v.to(diff_map.dtype).repeat_interleave(attrs.num_heads // attrs.num_kv_heads, dim=1)
    return s1, s2, visible, diff_map, v


def quantised_diff_attention(query, key, value, lambda_full, norm_weight, attrs: DiffAttentionAttrs,
                             quant: LogitQuant, key_mask=None) -> torch.Tensor:
    """Eq. 1 with logits quantised as `quant` says (16 bits = the unquantised explicit form)."""
    *_, diff_map, v = explicit_diff_maps(query, key, value, lambda_full, attrs, quant, key_mask)
    return finish_heads(diff_map @ v, norm_weight, attrs, query.dtype)


REFERENCES = {
    "naive": naive_diff_attention,
    "flash_diff_1": flash_diff_attention_1,
    "flash_diff_2": flash_diff_attention_2,
}


def resolve(impl):
    """A model's attention `impl`: a REFERENCES name, or a callable with the same signature."""
    return impl if callable(impl) else REFERENCES[impl]
