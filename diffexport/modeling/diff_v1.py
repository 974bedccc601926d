"""DIFF Transformer V1 (Ye et al. 2024): multi-head differential attention, as the paper and official code.

Per layer l (1-based): lambda = exp(lq1.lk1) - exp(lq2.lk2) + lambda_init,
lambda_init = 0.8 - 0.6*exp(-0.3*(l-1)) (or a constant). Each diff-head output is RMS-normed
over 2D (optionally with a weight) and scaled by (1 - lambda_init).

Weights are kept in the canonical layout of diffexport.core.contract: query maps 2h and 2h+1 belong
to diff-head h ("pairs"), K likewise per kv-group, V of width 2D per kv-group. Checkpoints in
other layouts are permuted into this one when loaded (diffexport.modeling.layouts).
"""

from __future__ import annotations

import dataclasses
import math

import torch
import torch.nn as nn

from diffexport.core.contract import VARIANT_V1, DiffAttentionAttrs
from diffexport.kernel import op, reference
from diffexport.modeling.common import (
    DecoderLM,
    ModelConfig,
    RMSNorm,
    apply_rope,
    extend_cache,
    resolve_heads,
    with_key_mask,
)


def lambda_init_schedule(layer_index: int) -> float:
    """The paper's depth schedule; layer_index is 0-based (= l - 1)."""
    return 0.8 - 0.6 * math.exp(-0.3 * layer_index)


@dataclasses.dataclass
class DiffV1Config(ModelConfig):
    family = "diff_v1"
    differential, maps_per_head, values_per_head, contract_variant = True, 2, 2, VARIANT_V1

    n_heads: int = 2  # H differential heads (half of the matching Transformer's heads)
    n_kv_heads: int | None = None  # kv-groups (GQA); default n_heads
    head_dim: int | None = None  # D of one map; default d_model / (2 * n_heads)
    head_norm_affine: bool = True  # the official code's later commit; HF DiffLlama: False
    head_norm_eps: float = 1e-5
    lambda_init: float | None = None  # None: the depth schedule; a number: that constant
    lambda_std: float = 0.1

    def __post_init__(self) -> None:
        super().__post_init__()
        resolve_heads(self, maps_per_head=2)

    def layer_lambda_init(self, layer_index: int) -> float:
        return lambda_init_schedule(layer_index) if self.lambda_init is None else float(self.lambda_init)


class DiffV1Attention(nn.Module):
    def __init__(self, cfg: DiffV1Config, layer_index: int):
        super().__init__()
        H, Hkv, D = cfg.n_heads, cfg.n_kv_heads, cfg.head_dim
        self.interleaved = cfg.rope_interleaved
        self.lambda_init = cfg.layer_lambda_init(layer_index)
        self.q_proj = nn.Linear(cfg.d_model, 2 * H * D, bias=False)  # (h, map, D)
        self.k_proj = nn.Linear(cfg.d_model, 2 * Hkv * D, bias=False)  # (g, map, D)
        self.v_proj = nn.Linear(cfg.d_model, Hkv * 2 * D, bias=False)  # (g, 2D)
        self.o_proj = nn.Linear(H * 2 * D, cfg.d_model, bias=False)
        self.lambda_q1 = nn.Parameter(torch.zeros(D))
        self.lambda_k1 = nn.Parameter(torch.zeros(D))
        self.lambda_q2 = nn.Parameter(torch.zeros(D))
        self.lambda_k2 = nn.Parameter(torch.zeros(D))
        self.head_norm = RMSNorm(2 * D, cfg.head_norm_eps, affine=cfg.head_norm_affine)
        self.attrs = DiffAttentionAttrs(variant=VARIANT_V1, num_heads=H, num_kv_heads=Hkv, head_dim=D,
                                        causal=1, norm=1, norm_eps=cfg.head_norm_eps,
                                        output_scale=1.0 - self.lambda_init)
        # "op": diffexport::diff_attention; a name of reference.REFERENCES ("naive" Eq. 1, "flash_diff_1",
        # "flash_diff_2"): plain torch ops, what a model exported without our op looks like; or a callable
        # with the references' signature (the analysis probes: explicit maps, quantised logits)
        self.impl = "op"

    def lambda_full(self) -> torch.Tensor:
        """The layer's lambda as a [1] fp32 tensor (exp re-parameterisation, computed in fp32)."""
        l1 = torch.exp(torch.sum(self.lambda_q1.float() * self.lambda_k1.float()))
        l2 = torch.exp(torch.sum(self.lambda_q2.float() * self.lambda_k2.float()))
        return (l1 - l2 + self.lambda_init).reshape(1)

    def forward(self, x, cos, sin, past=None, key_mask=None, use_cache=False):
        B, T, _ = x.shape  # (B, T, d_model); past: this layer's cache (k, v), each (B, P, width)
        D = self.attrs.head_dim
        q = apply_rope(self.q_proj(x).unflatten(-1, (-1, D)), cos, sin, self.interleaved).flatten(2)
        k = apply_rope(self.k_proj(x).unflatten(-1, (-1, D)), cos, sin, self.interleaved).flatten(2)
        k, v, present = extend_cache(past, k, self.v_proj(x))  # k, v: (B, P + T, width)
        lam = self.lambda_full().to(x.dtype)
        weight = self.head_norm.weight  # the contract wants it fp32, and all ones for a weightless norm
        weight = torch.ones(2 * D, device=x.device) if weight is None else weight.float()
        if self.impl == "op":
            out = op.call(q, k, v, lam, weight, self.attrs, key_mask=key_mask)
        else:
            out = with_key_mask(reference.resolve(self.impl), key_mask)(q, k, v, lam, weight, self.attrs)
        out = self.o_proj(out)  # out: (B, T, H * 2D)
        return (out, present) if use_cache else out


class DiffV1LM(DecoderLM):
    def __init__(self, cfg: DiffV1Config):
        super().__init__(cfg, [DiffV1Attention(cfg, i) for i in range(cfg.n_layers)])

    def param_init_std(self, name: str) -> float:
        return self.config.lambda_std if ".lambda_" in name else self.config.init_std

    def lambdas(self) -> list[float]:
        with torch.no_grad():
            return [float(layer.attn.lambda_full()) for layer in self.layers]
