"""The baseline Transformer the paper compares against: standard causal attention, same block.

baseline_for(diff_v1_config) gives the matching baseline: twice the heads of head_dim D, twice
the kv heads, so Q/K/V/O projections have exactly the DIFF model's shapes (same parameters
and FLOPs apart from DIFF's 4*D lambda and 2*D norm weights per layer).
"""

from __future__ import annotations

import dataclasses

import torch.nn as nn

from diffexport.kernel import reference
from diffexport.modeling.common import DecoderLM, ModelConfig, apply_rope, extend_cache, resolve_heads, with_key_mask


@dataclasses.dataclass
class TransformerConfig(ModelConfig):
    family = "transformer"

    n_heads: int = 4
    n_kv_heads: int | None = None
    head_dim: int | None = None

    def __post_init__(self) -> None:
        super().__post_init__()
        resolve_heads(self, maps_per_head=1)


def baseline_for(diff_cfg) -> TransformerConfig:
    """The Transformer matching a DIFF V1 config: 2H heads and 2Hkv kv heads of head_dim D."""
    shared = {f.name: getattr(diff_cfg, f.name) for f in dataclasses.fields(ModelConfig)}
    return TransformerConfig(**shared, n_heads=2 * diff_cfg.n_heads, n_kv_heads=2 * diff_cfg.n_kv_heads,
                             head_dim=diff_cfg.head_dim)


class CausalSelfAttention(nn.Module):
    def __init__(self, cfg: TransformerConfig, layer_index: int):
        super().__init__()
        H, Hkv, D = cfg.n_heads, cfg.n_kv_heads, cfg.head_dim
        self.head_dim = D
        self.interleaved = cfg.rope_interleaved
        self.q_proj = nn.Linear(cfg.d_model, H * D, bias=False)
        self.k_proj = nn.Linear(cfg.d_model, Hkv * D, bias=False)
        self.v_proj = nn.Linear(cfg.d_model, Hkv * D, bias=False)
        self.o_proj = nn.Linear(H * D, cfg.d_model, bias=False)
        self.impl = reference.attend  # or a callable with its signature (the analysis probes)

    def forward(self, x, cos, sin, past=None, key_mask=None, use_cache=False):
        B, T, _ = x.shape  # past: this layer's cache (k, v), each (B, P, Hkv * D), token-major
        D = self.head_dim
        q = apply_rope(self.q_proj(x).unflatten(-1, (-1, D)), cos, sin, self.interleaved).transpose(1, 2)
        k = apply_rope(self.k_proj(x).unflatten(-1, (-1, D)), cos, sin, self.interleaved).flatten(2)
        k, v, present = extend_cache(past, k, self.v_proj(x))  # k, v: (B, P + T, Hkv * D)
        heads_k, heads_v = (t.unflatten(-1, (-1, D)).transpose(1, 2) for t in (k, v))
        out = with_key_mask(self.impl, key_mask)(q, heads_k, heads_v, causal=True, scale=D ** -0.5)  # (B, H, T, D)
        out = self.o_proj(out.transpose(1, 2).reshape(B, T, -1))
        return (out, present) if use_cache else out


class TransformerLM(DecoderLM):
    def __init__(self, cfg: TransformerConfig):
        super().__init__(cfg, [CausalSelfAttention(cfg, i) for i in range(cfg.n_layers)])
