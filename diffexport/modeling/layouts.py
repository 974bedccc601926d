"""Layout conversion: permute foreign DIFF weights once, at load time, into the canonical layout.

Canonical (diffexport.core.contract): query maps of diff-head h at rows (h, map, D); V1 keys at
(g, map, D); values (g, 2D); RoPE rotate-half. Everything here is a pure re-indexing of rows:
attention logits q.k are unchanged when q and k get the same permutation inside a head, so the
converted model computes exactly what the original computed.

  HF DiffLlama: num_attention_heads counts single maps; map 1 = first half of the heads,
  map 2 = second half ("halves"); kv heads likewise; the 2D value of kv-group g is
  [v_g ; v_{g + Hkv/2}]. RoPE rotate-half, head norm without weight, lambda_init from the
  0-based layer index.
  unilm official V1: maps 2h, 2h+1 adjacent (already canonical), RoPE interleaved (GPT-J).
"""

from __future__ import annotations

import dataclasses
import math
from typing import Callable, Mapping

import torch

from diffexport.core.errors import DiffExportError
from diffexport.modeling.common import ROPE_SCALING_KEYS, yarn_attention_factor


def interleaved_to_halves(head_dim: int) -> torch.Tensor:
    """Index p with new[i] = old[p[i]]: pairs (2i, 2i+1) -> (i, i + D/2)."""
    return torch.cat([torch.arange(0, head_dim, 2), torch.arange(1, head_dim, 2)])


def permute_rows_within_heads(weight: torch.Tensor, head_dim: int, perm: torch.Tensor) -> torch.Tensor:
    """Apply the same row permutation inside every head_dim-row block of a projection weight."""
    rows, cols = weight.shape
    return weight.reshape(rows // head_dim, head_dim, cols)[:, perm].reshape(rows, cols)


def reorder_head_blocks(weight: torch.Tensor, block_rows: int, order: list[int]) -> torch.Tensor:
    """new block i = old block order[i] (blocks of block_rows rows)."""
    rows, cols = weight.shape
    return weight.reshape(rows // block_rows, block_rows, cols)[order].reshape(rows, cols)


def halves_to_pairs_order(n_maps: int) -> list[int]:
    """HF head order (map-major) -> canonical (head-major): new (h, m) <- old m*(n/2) + h."""
    half = n_maps // 2
    return [m * half + h for h in range(half) for m in range(2)]


def _take(state: dict, key: str) -> torch.Tensor:
    if key not in state:
        raise DiffExportError(f"missing key {key!r} in the checkpoint's state dict")
    return state.pop(key)


# transformers' config defaults (5.x) for keys a config.json may leave out: a missing key must mean
# what it means to transformers (DiffLlama's rms_norm_eps is 1e-5, Llama's 1e-6: the wrong one once
# gave logits 3.6e-3 apart).
HF_DEFAULTS = {
    "diffllama": {"rms_norm_eps": 1e-5, "tie_word_embeddings": False, "lambda_std_dev": 0.1, "rope_theta": 10000.0,
                  "hidden_act": "silu", "attention_bias": False},
    "llama": {"rms_norm_eps": 1e-6, "tie_word_embeddings": False, "rope_theta": 10000.0, "hidden_act": "silu",
              "attention_bias": False, "mlp_bias": False},
}
HF_NAMES = {"diffllama": "DiffLlama", "llama": "Llama"}


class _HFConfig:
    """A config.json of one model type, read as transformers reads it: its defaults for missing
    keys, one-line errors for values of the wrong type."""

    def __init__(self, hf: Mapping, model_type: str):
        self.hf, self.defaults, self.name = hf, HF_DEFAULTS[model_type], HF_NAMES[model_type]

    def int(self, key: str) -> int:
        if key not in self.hf:
            raise DiffExportError(f"{self.name} config.json lacks {key!r}")
        value = self.hf[key]
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise DiffExportError(f"{self.name} config.json: {key} must be a positive integer, got {value!r}")
        return value

    def float(self, key: str, value=None) -> float:
        value = self.hf.get(key, self.defaults.get(key)) if value is None else value
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value <= 0:
            raise DiffExportError(f"{self.name} config.json: {key} must be a finite number > 0, got {value!r}")
        return float(value)

    def bool(self, key: str) -> bool:
        value = self.hf.get(key, self.defaults[key])
        if not isinstance(value, bool):
            raise DiffExportError(f"{self.name} config.json: {key} must be true or false, got {value!r}")
        return value

    def rope_scaling(self, rope: Mapping) -> dict | None:
        """The rope_scaling of a diffexport config for the rope object, read as transformers reads it:
        `type` is the old name of rope_type; llama3 and yarn take original_max_position_embeddings
        from the config's top level first, then the rope object, then max_position_embeddings; yarn's
        optional keys (beta_fast/beta_slow, where 0 or null means the default, truncate, and an
        attention_factor or the mscale/mscale_all_dim it is inferred from) get transformers' defaults."""
        rope_type = rope.get("rope_type", rope.get("type", "default"))
        partial = rope.get("partial_rotary_factor", self.hf.get("partial_rotary_factor", 1.0))
        if partial != 1.0:
            raise DiffExportError(f"{self.name} partial_rotary_factor={partial!r} is not supported "
                                  "(RoPE over the whole head)")
        if rope_type == "default":
            return None
        if rope_type not in ROPE_SCALING_KEYS:
            raise DiffExportError(f"{self.name} rope_type={rope_type!r} is not supported "
                                  f"(default, {', '.join(ROPE_SCALING_KEYS)})")
        values: dict = {"rope_type": rope_type}
        context_key = "original_max_position_embeddings"
        if rope_type in ("llama3", "yarn"):
            context = self.hf.get(context_key)
            values[context_key] = context if context is not None else \
                rope.get(context_key, self.hf.get("max_position_embeddings"))
        if rope_type == "yarn":
            factor = rope.get("factor")
            if factor is None and isinstance(values[context_key], int) and values[context_key] > 0:
                factor = self.hf.get("max_position_embeddings", 0) / values[context_key]  # as DeepSeek-V3 writes it
            values["factor"] = factor
            for key, default in (("beta_fast", 32.0), ("beta_slow", 1.0)):
                values[key] = rope.get(key) or default
            values["truncate"] = rope.get("truncate", True)
            attention_factor = rope.get("attention_factor")
            if attention_factor is None and isinstance(factor, (int, float)) and not isinstance(factor, bool) \
                    and math.isfinite(factor) and factor > 0:
                mscales = [rope.get(k) for k in ("mscale", "mscale_all_dim")]
                if not all(isinstance(m, (int, float)) and not isinstance(m, bool) and math.isfinite(m)
                           for m in mscales if m is not None):
                    raise DiffExportError(f"{self.name} config.json: yarn mscale and mscale_all_dim must be finite "
                                          f"numbers, got {mscales}")
                attention_factor = yarn_attention_factor(float(factor), *mscales)
            values["attention_factor"] = attention_factor
        for key in ROPE_SCALING_KEYS[rope_type]:
            if key not in values:
                values[key] = rope.get(key)
            if values[key] is None:
                raise DiffExportError(f"{self.name} config.json: rope_type {rope_type!r} needs {key!r}")
        return values

    def shared(self) -> dict:
        """What a Llama-style decoder's config.json says, as diffexport config values, plus 'heads'
        and 'kv_heads' (attention heads as the model type counts them)."""
        if self.bool("attention_bias"):
            raise DiffExportError(f"{self.name} with attention_bias=true is not supported "
                                  "(diffexport models have no biases)")
        if self.hf.get("hidden_act", self.defaults["hidden_act"]) != "silu":
            raise DiffExportError(f"{self.name} hidden_act={self.hf['hidden_act']!r} is not supported (only silu)")
        rope = self.hf.get("rope_scaling") or self.hf.get("rope_parameters") or {}  # transformers: rope_scaling wins
        if not isinstance(rope, Mapping):
            raise DiffExportError(f"{self.name} config.json: rope_scaling/rope_parameters must be an object, "
                                  f"got {rope!r}")
        theta = self.float("rope_theta", rope.get("rope_theta", self.hf.get("rope_theta", self.defaults["rope_theta"])))
        heads = self.int("num_attention_heads")
        kv_heads = self.int("num_key_value_heads") if self.hf.get("num_key_value_heads") is not None else heads
        hidden = self.int("hidden_size")
        return {
            "vocab_size": self.int("vocab_size"),
            "d_model": hidden,
            "n_layers": self.int("num_hidden_layers"),
            "ffn_hidden": self.int("intermediate_size"),
            "rope_theta": theta,
            "rope_interleaved": False,
            "rope_scaling": self.rope_scaling(rope),
            "norm_eps": self.float("rms_norm_eps"),
            "tie_embeddings": self.bool("tie_word_embeddings"),
            "heads": heads,
            "kv_heads": kv_heads,
            "head_dim": self.int("head_dim") if self.hf.get("head_dim") is not None else hidden // heads,
        }


def hf_diffllama_config(hf: Mapping) -> dict:
    """DiffLlama config.json -> diff_v1 config values, read as transformers reads it (its defaults
    for missing keys, rope_scaling before rope_parameters); one-line errors for what we cannot
    represent or what is not a valid value."""
    reader = _HFConfig(hf, "diffllama")
    # mlp_bias is ignored, as transformers' DiffLlamaMLP ignores it: its projections never have biases.
    cfg = reader.shared()
    heads, kv_heads = cfg.pop("heads"), cfg.pop("kv_heads")
    if heads % 2 or kv_heads % 2:
        raise DiffExportError(f"DiffLlama needs even num_attention_heads and num_key_value_heads, "
                              f"got {heads} and {kv_heads}")
    cfg.update(n_heads=heads // 2, n_kv_heads=kv_heads // 2, head_norm_affine=False, head_norm_eps=cfg["norm_eps"],
               lambda_init=None, lambda_std=reader.float("lambda_std_dev"))
    return cfg


def hf_llama_config(hf: Mapping) -> dict:
    """Llama config.json -> baseline Transformer config values (the model a DiffLlama is commonly
    initialised from, to compare against with the analysis tools), read as transformers reads it."""
    reader = _HFConfig(hf, "llama")
    if reader.bool("mlp_bias"):
        raise DiffExportError("Llama with mlp_bias=true is not supported (diffexport models have no biases)")
    cfg = reader.shared()
    cfg["n_heads"], cfg["n_kv_heads"] = cfg.pop("heads"), cfg.pop("kv_heads")
    return cfg


def _hf_common_state(state: dict, cfg) -> dict:
    """Embedding, final norm and LM head of a Llama-style HF state dict (consumes them from `state`)."""
    out = {"embed.weight": _take(state, "model.embed_tokens.weight"),
           "norm.weight": _take(state, "model.norm.weight")}
    if "lm_head.weight" in state:
        lm_head = state.pop("lm_head.weight")
        if not cfg.tie_embeddings:
            out["lm_head.weight"] = lm_head
    elif not cfg.tie_embeddings:
        raise DiffExportError("missing key 'lm_head.weight' (and tie_word_embeddings is false)")
    return out


def _hf_block(state: dict, out: dict, i: int) -> str:
    """Layer i's norms and MLP (the same names in Llama and DiffLlama); returns its attention prefix."""
    src, dst = f"model.layers.{i}.", f"layers.{i}."
    out[dst + "attn_norm.weight"] = _take(state, src + "input_layernorm.weight")
    out[dst + "mlp_norm.weight"] = _take(state, src + "post_attention_layernorm.weight")
    for name in ("gate_proj", "up_proj", "down_proj"):
        out[dst + f"mlp.{name}.weight"] = _take(state, src + f"mlp.{name}.weight")
    return src + "self_attn."


def hf_llama_state(state: dict, cfg) -> dict:
    """HF LlamaForCausalLM state dict -> canonical transformer state dict (consumes `state`): the
    same tensors under our names (rotate-half RoPE and head order are Llama's already)."""
    out = _hf_common_state(state, cfg)
    for i in range(cfg.n_layers):
        a = _hf_block(state, out, i)
        for name in ("q_proj", "k_proj", "v_proj", "o_proj"):
            out[f"layers.{i}.attn.{name}.weight"] = _take(state, a + f"{name}.weight")
    _reject_leftovers(state)
    return out


def hf_diffllama_state(state: dict, cfg) -> dict:
    """HF DiffLlamaForCausalLM state dict -> canonical diff_v1 state dict (consumes `state`)."""
    D, H2, Hkv2 = cfg.head_dim, 2 * cfg.n_heads, 2 * cfg.n_kv_heads
    out = _hf_common_state(state, cfg)
    for i in range(cfg.n_layers):
        dst = f"layers.{i}."
        a = _hf_block(state, out, i)
        out[dst + "attn.q_proj.weight"] = reorder_head_blocks(_take(state, a + "q_proj.weight"), D,
                                                              halves_to_pairs_order(H2))
        out[dst + "attn.k_proj.weight"] = reorder_head_blocks(_take(state, a + "k_proj.weight"), D,
                                                              halves_to_pairs_order(Hkv2))
        # value of kv-group g = [v_g ; v_{g + Hkv/2}]: the same map-major -> head-major reorder
        out[dst + "attn.v_proj.weight"] = reorder_head_blocks(_take(state, a + "v_proj.weight"), D,
                                                              halves_to_pairs_order(Hkv2))
        out[dst + "attn.o_proj.weight"] = _take(state, a + "o_proj.weight")  # (h, 2D) columns already
        for name in ("lambda_q1", "lambda_k1", "lambda_q2", "lambda_k2"):
            out[dst + f"attn.{name}"] = _take(state, a + name)
    _reject_leftovers(state)
    return out


@dataclasses.dataclass(frozen=True)
class HFImport:
    """A Hugging Face model type diffexport imports: which family it becomes, the LoadedModel
    source it is reported as, transformers' class for it (the independent reference of `check`)
    and the two converters."""

    model_type: str
    family: str
    source: str
    transformers_class: str
    config: Callable[[Mapping], dict]
    state: Callable[[dict, object], dict]


HF_IMPORTS = {
    "diffllama": HFImport("diffllama", "diff_v1", "hf-diffllama", "DiffLlamaForCausalLM", hf_diffllama_config,
                          hf_diffllama_state),
    # the baseline: the Llama a DiffLlama is commonly initialised from, for the analysis tools' comparisons
    "llama": HFImport("llama", "transformer", "hf-llama", "LlamaForCausalLM", hf_llama_config, hf_llama_state),
}


def hf_import_of(source: str) -> HFImport | None:
    """The HF import a LoadedModel.source names ("hf-llama", "hf-diffllama (in memory)", ...), if any."""
    return next((imp for imp in HF_IMPORTS.values() if source.split(" ")[0] == imp.source), None)


# unilm's official code defines the attention module (q_proj, k_proj, v_proj, out_proj, lambda_*,
# subln); the names around it are those of its torchscale-style decoder (our documented assumption).
UNILM_NAMES = {
    "embed.weight": "embed_tokens.weight",
    "norm.weight": "layer_norm.weight",
    "lm_head.weight": "output_projection.weight",
}
UNILM_LAYER_NAMES = {
    "attn_norm.weight": "self_attn_layer_norm.weight",
    "mlp_norm.weight": "final_layer_norm.weight",
    "mlp.gate_proj.weight": "ffn.gate.weight",
    "mlp.up_proj.weight": "ffn.fc1.weight",
    "mlp.down_proj.weight": "ffn.fc2.weight",
    "attn.q_proj.weight": "self_attn.q_proj.weight",
    "attn.k_proj.weight": "self_attn.k_proj.weight",
    "attn.v_proj.weight": "self_attn.v_proj.weight",
    "attn.o_proj.weight": "self_attn.out_proj.weight",
    "attn.lambda_q1": "self_attn.lambda_q1",
    "attn.lambda_k1": "self_attn.lambda_k1",
    "attn.lambda_q2": "self_attn.lambda_q2",
    "attn.lambda_k2": "self_attn.lambda_k2",
    "attn.head_norm.weight": "self_attn.subln.weight",
}


def looks_unilm(state: Mapping) -> bool:
    return any(k.endswith("self_attn.out_proj.weight") or k.endswith("subln.weight") for k in state)


def unilm_state(state: dict, cfg) -> dict:
    """unilm-named V1 state dict -> canonical (consumes `state`). The cfg says whether the
    checkpoint's RoPE was interleaved (the official code's choice); the result is rotate-half."""
    perm = interleaved_to_halves(cfg.head_dim) if cfg.rope_interleaved else None
    out = {ours: _take(state, theirs) for ours, theirs in UNILM_NAMES.items()
           if not (ours == "lm_head.weight" and cfg.tie_embeddings)}
    if cfg.tie_embeddings:
        state.pop(UNILM_NAMES["lm_head.weight"], None)
    for i in range(cfg.n_layers):
        for ours, theirs in UNILM_LAYER_NAMES.items():
            key = f"layers.{i}.{theirs}"
            if ours == "attn.head_norm.weight" and not cfg.head_norm_affine:
                weight = state.pop(key, None)
                # A weightless norm equals the affine one only when the weight is all ones:
                # anything else would be dropped silently.
                if weight is not None and not bool((weight == 1).all()):
                    raise DiffExportError(f"{key} is not all ones but the config says head_norm_affine: false: "
                                          "set head_norm_affine: true to keep it (the official code's subln is "
                                          "affine)")
                continue
            tensor = _take(state, key)
            if perm is not None and ours in ("attn.q_proj.weight", "attn.k_proj.weight"):
                tensor = permute_rows_within_heads(tensor, cfg.head_dim, perm)
            out[f"layers.{i}.{ours}"] = tensor
    _reject_leftovers(state)
    return out


def rope_to_halves(state: dict, cfg) -> dict:
    """A canonical-named state dict whose RoPE is interleaved -> rotate-half (Q/K rows permuted)."""
    perm = interleaved_to_halves(cfg.head_dim)
    out = dict(state)
    for key in state:
        if key.endswith("attn.q_proj.weight") or key.endswith("attn.k_proj.weight"):
            out[key] = permute_rows_within_heads(state[key], cfg.head_dim, perm)
    return out


def _reject_leftovers(state: Mapping) -> None:
    if state:
        names = sorted(state)
        more = f" (+{len(names) - 3} more)" if len(names) > 3 else ""
        raise DiffExportError(f"unexpected key(s) in the checkpoint: {', '.join(names[:3])}{more}")


# ---------------------------------------------------------------- writing Hugging Face folders

def _inverse(order: list[int]) -> list[int]:
    inverse = [0] * len(order)
    for new, old in enumerate(order):
        inverse[old] = new
    return inverse


def hf_export(cfg, state: Mapping) -> tuple[dict, dict]:
    """A canonical diff_v1 (-> DiffLlama) or transformer (-> Llama) model as (config.json values,
    HF state dict): the exact inverse of the imports above, refused in one line where the model has
    something the HF class cannot say (an affine head norm, a constant lambda_init, ...)."""
    problems = []
    if cfg.rope_interleaved or cfg.rope_scaling:
        problems.append("interleaved RoPE or RoPE scaling")
    if cfg.family == "diff_v1":
        if cfg.head_norm_affine:
            problems.append("an affine head norm (DiffLlama's has no weight)")
        if cfg.lambda_init is not None:
            problems.append("a constant lambda_init (DiffLlama uses the depth schedule)")
        if cfg.head_norm_eps != cfg.norm_eps:
            problems.append("a head-norm eps other than rms_norm_eps")
        model_type, maps = "diffllama", 2
    elif cfg.family == "transformer":
        model_type, maps = "llama", 1
    else:
        problems.append(f"family {cfg.family} (DiffLlama is V1; the baseline is Llama)")
    if problems:
        raise DiffExportError(f"this {cfg.family} model cannot be written as a Hugging Face folder: it has "
                              + "; ".join(problems))
    hf = {"architectures": [HF_IMPORTS[model_type].transformers_class], "model_type": model_type,
          "vocab_size": cfg.vocab_size, "hidden_size": cfg.d_model, "intermediate_size": cfg.ffn_hidden,
          "num_hidden_layers": cfg.n_layers, "num_attention_heads": maps * cfg.n_heads,
          "num_key_value_heads": maps * cfg.n_kv_heads, "head_dim": cfg.head_dim, "hidden_act": "silu",
          "rms_norm_eps": cfg.norm_eps, "rope_theta": cfg.rope_theta, "tie_word_embeddings": cfg.tie_embeddings,
          "attention_bias": False, "torch_dtype": "float32"}
    if model_type == "diffllama":
        hf["lambda_std_dev"] = cfg.lambda_std
    else:
        hf["mlp_bias"] = False
    out = {"model.embed_tokens.weight": state["embed.weight"], "model.norm.weight": state["norm.weight"]}
    if not cfg.tie_embeddings:
        out["lm_head.weight"] = state["lm_head.weight"]
    for i in range(cfg.n_layers):
        src, dst = f"layers.{i}.", f"model.layers.{i}."
        out[dst + "input_layernorm.weight"] = state[src + "attn_norm.weight"]
        out[dst + "post_attention_layernorm.weight"] = state[src + "mlp_norm.weight"]
        for name in ("gate_proj", "up_proj", "down_proj"):
            out[dst + f"mlp.{name}.weight"] = state[src + f"mlp.{name}.weight"]
        for name, heads in (("q_proj", cfg.n_heads), ("k_proj", cfg.n_kv_heads), ("v_proj", cfg.n_kv_heads)):
            weight = state[src + f"attn.{name}.weight"]
            if maps == 2:  # canonical head-major -> DiffLlama's map-major
                weight = reorder_head_blocks(weight, cfg.head_dim, _inverse(halves_to_pairs_order(2 * heads)))
            out[dst + f"self_attn.{name}.weight"] = weight
        out[dst + "self_attn.o_proj.weight"] = state[src + "attn.o_proj.weight"]
        if maps == 2:
            for name in ("lambda_q1", "lambda_k1", "lambda_q2", "lambda_k2"):
                out[dst + f"self_attn.{name}"] = state[src + f"attn.{name}"]
    return hf, {k: v.detach().contiguous() for k, v in out.items()}
