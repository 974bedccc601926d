"""Pieces every family shares: config base, RMSNorm, SwiGLU, RoPE, the pre-norm decoder LM."""

from __future__ import annotations

import dataclasses
import math
from typing import Any, ClassVar, Mapping

import torch
import torch.nn as nn
import torch.nn.functional as F

from diffexport.errors import DiffExportError


def swiglu_hidden(d_model: int, multiple_of: int = 256) -> int:
    """8/3 * d_model rounded up to a multiple (the paper's 3B: 3072 -> 8192)."""
    return multiple_of * math.ceil(8 * d_model / 3 / multiple_of)


@dataclasses.dataclass
class ModelConfig:
    """Base of the family configs: dict round-trip with one-line errors on bad values."""

    family: ClassVar[str] = ""

    vocab_size: int = 512
    d_model: int = 128
    n_layers: int = 2
    ffn_hidden: int | None = None
    rope_theta: float = 10000.0
    rope_interleaved: bool = False  # False: rotate-half (Llama/NeoX), True: adjacent pairs (GPT-J)
    norm_eps: float = 1e-5
    tie_embeddings: bool = False
    init_std: float = 0.02

    def __post_init__(self) -> None:
        if self.ffn_hidden is None:
            self.ffn_hidden = swiglu_hidden(self.d_model)
        for name in ("vocab_size", "d_model", "n_layers", "ffn_hidden"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise DiffExportError(f"{self.family} config: {name} must be a positive int, got {value!r}")

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, values: Mapping[str, Any]) -> "ModelConfig":
        if not isinstance(values, Mapping):
            raise DiffExportError(f"{cls.family} config must be a mapping, got {type(values).__name__}")
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(values) - known)
        if unknown:
            raise DiffExportError(f"{cls.family} config: unknown key(s) {unknown}")
        try:
            return cls(**values)
        except TypeError as exc:  # a required field missing
            raise DiffExportError(f"{cls.family} config: {exc}") from None


def resolve_heads(cfg, maps_per_head: int) -> None:
    """Fill n_kv_heads (default n_heads) and head_dim (default d_model / (maps_per_head * n_heads)), then check."""
    if cfg.n_kv_heads is None:
        cfg.n_kv_heads = cfg.n_heads
    if cfg.head_dim is None:
        width = maps_per_head * cfg.n_heads
        if cfg.d_model % width:
            raise DiffExportError(f"{cfg.family} config: d_model={cfg.d_model} is not divisible by "
                                  f"{maps_per_head}*n_heads={width}; give head_dim")
        cfg.head_dim = cfg.d_model // width
    check_heads(cfg.family, cfg.n_heads, cfg.n_kv_heads, cfg.head_dim)


def check_heads(family: str, n_heads: int, n_kv_heads: int, head_dim: int) -> None:
    for name, value in (("n_heads", n_heads), ("n_kv_heads", n_kv_heads), ("head_dim", head_dim)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise DiffExportError(f"{family} config: {name} must be a positive int, got {value!r}")
    if n_heads % n_kv_heads:
        raise DiffExportError(f"{family} config: n_kv_heads={n_kv_heads} must divide n_heads={n_heads}")
    if head_dim % 2:
        raise DiffExportError(f"{family} config: head_dim={head_dim} must be even for RoPE")


class RMSNorm(nn.Module):
    """RMSNorm computed in fp32 (as Llama and the official DIFF code); weight optional."""

    def __init__(self, dim: int, eps: float = 1e-5, affine: bool = True):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim)) if affine else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x32 = x.float()
        out = (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)).to(x.dtype)
        return out if self.weight is None else self.weight * out


class SwiGLU(nn.Module):
    def __init__(self, d_model: int, hidden: int):
        super().__init__()
        self.gate_proj = nn.Linear(d_model, hidden, bias=False)
        self.up_proj = nn.Linear(d_model, hidden, bias=False)
        self.down_proj = nn.Linear(hidden, d_model, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


def rope_cos_sin(positions: torch.Tensor, head_dim: int, theta: float, dtype: torch.dtype):
    """cos, sin of shape [B, T, head_dim/2] for integer positions [B, T] (computed in fp32)."""
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, device=positions.device, dtype=torch.float32)
                                / head_dim))
    freqs = positions.float()[..., None] * inv_freq
    return freqs.cos().to(dtype), freqs.sin().to(dtype)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, interleaved: bool) -> torch.Tensor:
    """Rotate x [B, T, n, D] by position. interleaved: pairs (2i, 2i+1); else halves (i, i + D/2)."""
    cos, sin = cos[:, :, None, :], sin[:, :, None, :]
    if interleaved:
        x1, x2 = x[..., 0::2], x[..., 1::2]
        return torch.stack((x1 * cos - x2 * sin, x1 * sin + x2 * cos), dim=-1).flatten(-2)
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)


class DecoderLayer(nn.Module):
    """Y = Attn(RMSNorm(X)) + X;  X' = SwiGLU(RMSNorm(Y)) + Y."""

    def __init__(self, cfg: ModelConfig, attn: nn.Module):
        super().__init__()
        self.attn_norm = RMSNorm(cfg.d_model, cfg.norm_eps)
        self.attn = attn
        self.mlp_norm = RMSNorm(cfg.d_model, cfg.norm_eps)
        self.mlp = SwiGLU(cfg.d_model, cfg.ffn_hidden)

    def forward(self, x, cos, sin):
        x = x + self.attn(self.attn_norm(x), cos, sin)
        return x + self.mlp(self.mlp_norm(x))


class DecoderLM(nn.Module):
    """Token embedding, pre-norm decoder layers, final norm, LM head. Families supply attention."""

    def __init__(self, cfg: ModelConfig, attentions: list[nn.Module]):
        super().__init__()
        self.config = cfg
        self.embed = nn.Embedding(cfg.vocab_size, cfg.d_model)
        self.layers = nn.ModuleList(DecoderLayer(cfg, attn) for attn in attentions)
        self.norm = RMSNorm(cfg.d_model, cfg.norm_eps)
        self.lm_head = nn.Linear(cfg.d_model, cfg.vocab_size, bias=False)
        if cfg.tie_embeddings:
            self.lm_head.weight = self.embed.weight

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor | None = None,
                return_hidden: bool = False):
        """input_ids [B, T] int64 -> logits [B, T, V] (and the last hidden state [B, T, d_model])."""
        B, T = input_ids.shape
        if positions is None:
            positions = torch.arange(T, device=input_ids.device).expand(B, T)
        x = self.embed(input_ids)
        cos, sin = rope_cos_sin(positions, self.config.head_dim, self.config.rope_theta, x.dtype)
        for layer in self.layers:
            x = layer(x, cos, sin)
        hidden = self.norm(x)
        logits = self.lm_head(hidden)
        return (logits, hidden) if return_hidden else logits

    @torch.no_grad()
    def init_weights(self, seed: int = 0) -> None:
        """Seeded init in place (works after to_empty on a meta-built model)."""
        from diffexport.progress import Progress

        gen = torch.Generator().manual_seed(seed)
        with Progress("initialising weights", self.num_parameters(), min_total=1e8) as progress:
            for name, p in self.named_parameters():
                if name.endswith("norm.weight"):
                    p.fill_(1.0)
                else:  # drawn in place: no temporary the size of the parameter
                    p.normal_(0.0, self.param_init_std(name), generator=gen)
                progress.advance(p.numel())

    def param_init_std(self, name: str) -> float:
        return self.config.init_std

    def num_parameters(self) -> int:
        return sum(p.numel() for p in self.parameters())  # tied weights are counted once
