"""DIFF Transformer V2 (unilm Diff-Transformer-V2): 2H query heads over shared K/V heads.

One causal attention over 2H query maps of head_dim D with Hkv key/value heads of the same D,
then out_h = A_{2h} - sigmoid(lambda_proj(x))_h * A_{2h+1}: lambda per token and per head.
No per-head norm, no (1 - lambda_init), no exp re-parameterisation. Paired maps 2h, 2h+1 read
the same kv head, so Hkv must divide H.
"""

from __future__ import annotations

import dataclasses

import torch
import torch.nn as nn

from diffexport.core.contract import VARIANT_V2, DiffAttentionAttrs
from diffexport.kernel import op, reference
from diffexport.modeling.common import DecoderLM, ModelConfig, apply_rope, extend_cache, resolve_heads, with_key_mask


@dataclasses.dataclass
class DiffV2Config(ModelConfig):
    family = "diff_v2"
    differential, maps_per_head, values_per_head, contract_variant = True, 2, 1, VARIANT_V2

    n_heads: int = 4  # H output heads; the attention runs 2H query maps
    n_kv_heads: int | None = None  # default n_heads
    head_dim: int | None = None  # default d_model / n_heads

    def __post_init__(self) -> None:
        super().__post_init__()
        resolve_heads(self, maps_per_head=1)


class DiffV2Attention(nn.Module):
    def __init__(self, cfg: DiffV2Config, layer_index: int):
        super().__init__()
        H, Hkv, D = cfg.n_heads, cfg.n_kv_heads, cfg.head_dim
        self.interleaved = cfg.rope_interleaved
        self.q_proj = nn.Linear(cfg.d_model, 2 * H * D, bias=False)  # maps (h, pair, D)
        self.k_proj = nn.Linear(cfg.d_model, Hkv * D, bias=False)
        self.v_proj = nn.Linear(cfg.d_model, Hkv * D, bias=False)
        self.o_proj = nn.Linear(H * D, cfg.d_model, bias=False)
        self.lambda_proj = nn.Linear(cfg.d_model, H, bias=False)
        self.attrs = DiffAttentionAttrs(variant=VARIANT_V2, num_heads=H, num_kv_heads=Hkv, head_dim=D,
                                        causal=1, norm=0, output_scale=1.0)
        self.impl = "op"  # or a name of reference.REFERENCES (see diff_v1)

    def forward(self, x, cos, sin, past=None, key_mask=None, use_cache=False):
        B, T, _ = x.shape  # (B, T, d_model); past: this layer's cache (k, v), each (B, P, width)
        D = self.attrs.head_dim
        q = apply_rope(self.q_proj(x).unflatten(-1, (-1, D)), cos, sin, self.interleaved).flatten(2)
        k = apply_rope(self.k_proj(x).unflatten(-1, (-1, D)), cos, sin, self.interleaved).flatten(2)
        k, v, present = extend_cache(past, k, self.v_proj(x))  # k, v: (B, P + T, width)
        lam = torch.sigmoid(self.lambda_proj(x))  # (B, T, H): per token, per head
        if self.impl == "op":
            out = op.call(q, k, v, lam, torch.ones(D, device=x.device), self.attrs,  # V2 has no weight
                          key_mask=key_mask)
        else:
            out = with_key_mask(reference.resolve(self.impl), key_mask)(q, k, v, lam, None, self.attrs)
        out = self.o_proj(out)  # out: (B, T, H * D)
        return (out, present) if use_cache else out


class DiffV2LM(DecoderLM):
    def __init__(self, cfg: DiffV2Config):
        super().__init__(cfg, [DiffV2Attention(cfg, i) for i in range(cfg.n_layers)])
