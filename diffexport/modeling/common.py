"""Pieces every family shares: config base, RMSNorm, SwiGLU, RoPE, the pre-norm decoder LM."""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import Any, ClassVar, Mapping

import torch
import torch.nn as nn
import torch.nn.functional as F

from diffexport.core.errors import DiffExportError
from diffexport.core.progress import Progress


def swiglu_hidden(d_model: int, multiple_of: int = 256) -> int:
    """8/3 * d_model rounded up to a multiple (the paper's 3B: 3072 -> 8192)."""
    return multiple_of * math.ceil(8 * d_model / 3 / multiple_of)


MAX_SIZES = {"vocab_size": 1 << 24, "d_model": 1 << 16, "n_layers": 1024, "ffn_hidden": 1 << 20}


@dataclasses.dataclass
class ModelConfig:
    """Base of the family configs: dict round-trip with one-line errors on bad values."""

    family: ClassVar[str] = ""
    # What the family's attention is, for every layer that exports, runs or checks it (optimum's
    # NormalizedConfig is the model): set once by each family, never rederived from its name.
    differential: ClassVar[bool] = False  # two softmax maps per head, subtracted (DIFF V1, V2)
    maps_per_head: ClassVar[int] = 1  # attention maps (query/key maps) per head
    values_per_head: ClassVar[int] = 1  # a head's value width in head_dim units (DIFF V1: 2)
    contract_variant: ClassVar[int | None] = None  # the DiffAttention variant it exports as (None: no such node)

    vocab_size: int = 512
    d_model: int = 128
    n_layers: int = 2
    ffn_hidden: int | None = None
    rope_theta: float = 10000.0
    rope_interleaved: bool = False  # False: rotate-half (Llama/NeoX), True: adjacent pairs (GPT-J)
    # None: plain RoPE; else {"rope_type": "linear" | "llama3" | "yarn", ...} (ROPE_SCALING_KEYS)
    rope_scaling: dict | None = None
    norm_eps: float = 1e-5
    tie_embeddings: bool = False
    init_std: float = 0.02

    def __post_init__(self) -> None:
        self._check_types()
        d_model = self.d_model
        if isinstance(d_model, bool) or not isinstance(d_model, int) or not 1 <= d_model <= MAX_SIZES["d_model"]:
            raise DiffExportError(f"{self.family} config: d_model must be an int in 1..{MAX_SIZES['d_model']}, "
                                  f"got {d_model!r}")
        if self.ffn_hidden is None:
            self.ffn_hidden = swiglu_hidden(self.d_model)
        # Bounds far above any released model: a config is validated before anything is built, so
        # a stray 10**9 layers cannot grow memory while the skeleton is made.
        for name, limit in MAX_SIZES.items():
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= limit:
                raise DiffExportError(f"{self.family} config: {name} must be an int in 1..{limit}, got {value!r}")
        for name in ("rope_theta", "norm_eps"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value <= 0:
                raise DiffExportError(f"{self.family} config: {name} must be a finite number > 0, got {value!r}")
        value = self.init_std
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value < 0:
            raise DiffExportError(f"{self.family} config: init_std must be a finite number >= 0, got {value!r}")
        self.rope_scaling = check_rope_scaling(self.family, self.rope_scaling)
        for name in ("rope_interleaved", "tie_embeddings"):
            if not isinstance(getattr(self, name), bool):
                raise DiffExportError(f"{self.family} config: {name} must be true or false, "
                                      f"got {getattr(self, name)!r}")

    def _check_types(self) -> None:
        """Every field holds what its annotation says (JSON and pickles carry any type): a string
        where a number belongs is one line here, not a ValueError deep in the model code."""
        for field in dataclasses.fields(self):
            value = getattr(self, field.name)
            kinds = str(field.type).replace(" ", "").split("|")
            if value is None and "None" in kinds:
                continue
            if "bool" in kinds:
                ok = isinstance(value, bool)
            elif "int" in kinds:
                ok = isinstance(value, int) and not isinstance(value, bool)
            elif "float" in kinds:
                ok = isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
            else:
                continue
            if not ok:
                want = {"bool": "true or false", "int": "an int", "float": "a finite number"}[
                    next(k for k in ("bool", "int", "float") if k in kinds)]
                raise DiffExportError(f"{self.family} config: {field.name} must be {want}"
                                      f"{' or null' if 'None' in kinds else ''}, got {value!r}")

    @property
    def attention_maps(self) -> int:
        """The attention maps of a layer: 2 x n_heads for a DIFF model, n_heads for the baseline."""
        return self.maps_per_head * self.n_heads

    @property
    def value_dim(self) -> int:
        """A head's value (and output) width: 2 x head_dim for DIFF V1, head_dim otherwise."""
        return self.values_per_head * self.head_dim

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


# Context-extension schemes whose rotation does not depend on the sequence length (so one graph
# serves every length), with the keys each takes besides rope_type; the names are transformers'
# (config.json "rope_scaling" / "rope_parameters"), the arithmetic follows rope_inv_freq and
# rope_cos_sin. Schemes that change with the sequence length (dynamic NTK, LongRoPE's short/long
# switch) are not among them.
ROPE_SCALING_KEYS = {
    "linear": ("factor",),  # position interpolation: every frequency divided by factor
    "llama3": ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings"),
    # YaRN: frequencies ramped between interpolated and kept, cos/sin scaled by attention_factor
    "yarn": ("factor", "original_max_position_embeddings", "beta_fast", "beta_slow", "attention_factor", "truncate"),
}


def yarn_attention_factor(factor: float, mscale: float | None = None, mscale_all_dim: float | None = None) -> float:
    """YaRN's default cos/sin scale, as transformers infers it: 0.1*ln(factor) + 1 (1 for factor <= 1),
    or the ratio of two such terms weighted by mscale and mscale_all_dim when both are given (DeepSeek)."""
    def term(weight: float) -> float:
        return 1.0 if factor <= 1 else 0.1 * weight * math.log(factor) + 1.0
    if mscale and mscale_all_dim:
        return term(mscale) / term(mscale_all_dim)
    return term(1.0)


def _yarn_defaults(value: Mapping) -> dict:
    """A yarn scaling with the optional keys filled as transformers fills them (beta_fast 32,
    beta_slow 1, truncate true, attention_factor from factor)."""
    out = dict(value)
    out.setdefault("beta_fast", 32.0)
    out.setdefault("beta_slow", 1.0)
    out.setdefault("truncate", True)
    factor = out.get("factor")
    if "attention_factor" not in out and isinstance(factor, (int, float)) and not isinstance(factor, bool) \
            and math.isfinite(factor) and factor > 0:
        out["attention_factor"] = yarn_attention_factor(float(factor))
    return out


def check_rope_scaling(family: str, value: Any) -> dict | None:
    """A config's rope_scaling, validated: None (or rope_type "default") for plain RoPE, else a dict of
    exactly the scheme's keys with finite positive numbers (an int context for llama3 and yarn, a
    bool truncate for yarn, whose other optional keys take transformers' defaults)."""
    if value is None:
        return None
    where = f"{family} config: rope_scaling"
    if not isinstance(value, Mapping):
        raise DiffExportError(f"{where} must be an object or null, got {value!r}")
    kind = value.get("rope_type")
    if kind == "default" and set(value) == {"rope_type"}:
        return None
    if kind not in ROPE_SCALING_KEYS:
        raise DiffExportError(f"{where}: rope_type {kind!r} is not one diffexport computes; "
                              f"supported: default, {', '.join(ROPE_SCALING_KEYS)}")
    if kind == "yarn":
        value = _yarn_defaults(value)
    wanted = {"rope_type", *ROPE_SCALING_KEYS[kind]}
    if set(value) != wanted:
        raise DiffExportError(f"{where}: rope_type {kind!r} takes exactly the keys {sorted(wanted)}, "
                              f"got {sorted(value)}")
    out: dict[str, Any] = {"rope_type": kind}
    for key in ROPE_SCALING_KEYS[kind]:
        number = value[key]
        if key == "original_max_position_embeddings":
            if isinstance(number, bool) or not isinstance(number, int) or not 1 <= number <= 1 << 30:
                raise DiffExportError(f"{where}: {key} must be an int in 1..{1 << 30}, got {number!r}")
        elif key == "truncate":
            if not isinstance(number, bool):
                raise DiffExportError(f"{where}: truncate must be true or false, got {number!r}")
        elif (isinstance(number, bool) or not isinstance(number, (int, float)) or not math.isfinite(number)
              or number <= 0):
            raise DiffExportError(f"{where}: {key} must be a finite number > 0, got {number!r}")
        out[key] = number if key in ("original_max_position_embeddings", "truncate") else float(number)
    if kind == "llama3" and not out["high_freq_factor"] > out["low_freq_factor"]:
        raise DiffExportError(f"{where}: llama3 needs high_freq_factor > low_freq_factor, got "
                              f"{out['high_freq_factor']:g} and {out['low_freq_factor']:g}")
    return out


def rope_inv_freq(head_dim: int, theta: float, scaling: Mapping | None = None,
                  device: torch.device | None = None) -> torch.Tensor:
    """RoPE's inverse frequencies [head_dim/2] in fp32: theta^(-2i/head_dim), then the scaling's rescale.

    linear: all divided by factor. llama3 (Llama 3.1): with L = original_max_position_embeddings,
    wavelengths 2*pi/f longer than L/low_freq_factor are divided by factor, those shorter than
    L/high_freq_factor kept, and the band between blended: s*f + (1 - s)*f/factor with
    s = (L/wavelength - low_freq_factor) / (high_freq_factor - low_freq_factor).
    yarn: pairs that turn fewer than beta_slow times over L are divided by factor, those that turn
    more than beta_fast times kept, and a linear ramp over the pair index blends the ones between."""
    exponents = torch.arange(0, head_dim, 2, device=device, dtype=torch.float32) / head_dim
    inv_freq = 1.0 / (theta ** exponents)
    if scaling is None:
        return inv_freq
    factor = scaling["factor"]
    if scaling["rope_type"] == "linear":
        return inv_freq / factor
    if scaling["rope_type"] == "yarn":
        return _yarn_inv_freq(head_dim, theta, scaling, theta ** exponents)
    context, low, high = (scaling[k]
                          for k in ("original_max_position_embeddings", "low_freq_factor", "high_freq_factor"))
    wavelength = 2 * math.pi / inv_freq
    long_waves = torch.where(wavelength > context / low, inv_freq / factor, inv_freq)
    s = (context / wavelength - low) / (high - low)
    blended = (1 - s) * long_waves / factor + s * long_waves
    in_band = (wavelength >= context / high) & (wavelength <= context / low)
    return torch.where(in_band, blended, long_waves)


def _yarn_inv_freq(head_dim: int, theta: float, scaling: Mapping, wavelengths: torch.Tensor) -> torch.Tensor:
    """YaRN's frequencies (Peng et al. 2023, as transformers computes them); wavelengths: theta^(2i/D)."""
    def pair_turning(turns: float) -> float:  # the (fractional) pair index that turns `turns` times over L
        return head_dim * math.log(scaling["original_max_position_embeddings"] / (turns * 2 * math.pi)) \
            / (2 * math.log(theta))
    low, high = pair_turning(scaling["beta_fast"]), pair_turning(scaling["beta_slow"])
    if scaling["truncate"]:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, head_dim - 1)
    if low == high:
        high += 0.001  # a ramp of no width would divide by zero
    pairs = torch.arange(head_dim // 2, dtype=torch.float32, device=wavelengths.device)
    ramp = ((pairs - low) / (high - low)).clamp(0, 1)
    kept = 1 - ramp  # 1: the pair keeps its frequency (extrapolation), 0: divided by factor
    return 1.0 / (scaling["factor"] * wavelengths) * (1 - kept) + 1.0 / wavelengths * kept


def rope_attention_scale(scaling: Mapping | None) -> float:
    """The factor on cos and sin a scheme asks for (YaRN's attention_factor; 1 otherwise)."""
    return 1.0 if scaling is None or scaling["rope_type"] != "yarn" else scaling["attention_factor"]


def rope_cos_sin(positions: torch.Tensor, head_dim: int, theta: float, dtype: torch.dtype,
                 scaling: Mapping | None = None):
    """cos, sin of shape [B, T, head_dim/2] for integer positions [B, T] (computed in fp32)."""
    freqs = positions.float()[..., None] * rope_inv_freq(head_dim, theta, scaling, positions.device)
    cos, sin = freqs.cos(), freqs.sin()
    scale = rope_attention_scale(scaling)
    if scale != 1.0:  # YaRN: in fp32 before the cast, as transformers does
        cos, sin = cos * scale, sin * scale
    return cos.to(dtype), sin.to(dtype)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, interleaved: bool) -> torch.Tensor:
    """Rotate x [B, T, n, D] by position. interleaved: pairs (2i, 2i+1); else halves (i, i + D/2)."""
    cos, sin = cos[:, :, None, :], sin[:, :, None, :]
    if interleaved:
        x1, x2 = x[..., 0::2], x[..., 1::2]
        return torch.stack((x1 * cos - x2 * sin, x1 * sin + x2 * cos), dim=-1).flatten(-2)
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)


def extend_cache(past, key: torch.Tensor, value: torch.Tensor):
    """Append this step's rotated keys and values [B, S, W] to a layer's cache; -> (key, value, present).

    The cache is token-major, exactly the contract's key/value layout, so attention reads it as it
    is: no transpose or re-pack of past tokens on any step (docs/EXPORT.md, KV-cache decoders).
    Eager caches are [B, P, W]; the exported decoder's are [B, 1, P, W] (onnxruntime-genai's
    [batch, kv heads, tokens, head size] with one head): those are concatenated in 4-D, so the
    graph's `present` outputs are the Concat results themselves and attention reads a view of them."""
    if past is None:
        return key, value, (key, value)
    if past[0].dim() == 4:
        key4 = torch.cat((past[0], key.unsqueeze(1)), dim=2)
        value4 = torch.cat((past[1], value.unsqueeze(1)), dim=2)
        return key4.squeeze(1), value4.squeeze(1), (key4, value4)
    key, value = torch.cat((past[0], key), dim=1), torch.cat((past[1], value), dim=1)
    return key, value, (key, value)


def positions_from_mask(attention_mask: torch.Tensor) -> torch.Tensor:
    """Token positions [B, P+S] of a padded batch: present tokens count 0, 1, 2, ... (a right-padded row's
    answer goes on from its prompt's count, past the padding); left padding gets 0."""
    return (attention_mask.cumsum(-1) - 1).clamp(min=0)


def with_key_mask(fn, key_mask):
    """Call an attention implementation with key_mask only when there is one (analysis probes take none)."""
    return fn if key_mask is None else functools.partial(fn, key_mask=key_mask)


class DecoderLayer(nn.Module):
    """Y = Attn(RMSNorm(X)) + X;  X' = SwiGLU(RMSNorm(Y)) + Y."""

    def __init__(self, cfg: ModelConfig, attn: nn.Module):
        super().__init__()
        self.attn_norm = RMSNorm(cfg.d_model, cfg.norm_eps)
        self.attn = attn
        self.mlp_norm = RMSNorm(cfg.d_model, cfg.norm_eps)
        self.mlp = SwiGLU(cfg.d_model, cfg.ffn_hidden)

    def forward(self, x, cos, sin, past=None, key_mask=None):
        """-> (x', present): present is the layer's cache (k, v) including this step."""
        attn_out, present = self.attn(self.attn_norm(x), cos, sin, past=past, key_mask=key_mask, use_cache=True)
        x = x + attn_out
        return x + self.mlp(self.mlp_norm(x)), present


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
                return_hidden: bool = False, *, attention_mask: torch.Tensor | None = None,
                past_key_values: list | None = None, use_cache: bool = False):
        """input_ids [B, S] int64 -> logits [B, S, V] (and the last hidden state [B, S, d_model]).

        KV cache: past_key_values is one (k, v) per layer, each [B, P, W] (rotated keys, values in the
        contract's token-major layout; [B, 1, P, W] in the exported decoder); attention_mask [B, P+S]
        marks present tokens (1) and left padding (0). With use_cache the presents (the pasts' rank,
        P+S tokens) come last in the returned tuple."""
        B, S = input_ids.shape
        P = 0 if past_key_values is None else past_key_values[0][0].shape[-2]  # [B, P, W] or [B, 1, P, W]
        key_mask = None
        if attention_mask is not None:
            if tuple(attention_mask.shape) != (B, P + S):
                raise DiffExportError(f"attention_mask shape {list(attention_mask.shape)} != [batch, past + new] "
                                      f"= {[B, P + S]}")
            key_mask = attention_mask.to(torch.int64)
        if positions is None:
            if key_mask is not None:
                positions = positions_from_mask(key_mask)[:, P:]
            else:
                positions = torch.arange(P, P + S, device=input_ids.device).expand(B, S)
        x = self.embed(input_ids)
        cos, sin = rope_cos_sin(positions, self.config.head_dim, self.config.rope_theta, x.dtype,
                                self.config.rope_scaling)
        presents = []
        for index, layer in enumerate(self.layers):
            x, present = layer(x, cos, sin, None if past_key_values is None else past_key_values[index], key_mask)
            presents.append(present)
        hidden = self.norm(x)
        logits = self.lm_head(hidden)
        outputs = (logits, hidden) if return_hidden else (logits,)
        if use_cache:
            outputs += (presents,)
        return outputs if len(outputs) > 1 else logits

    @torch.no_grad()
    def init_weights(self, seed: int = 0) -> None:
        """Seeded init in place (works after to_empty on a meta-built model)."""

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
