"""Human-readable model summaries and the eager self-check the demo runs."""

from __future__ import annotations

import torch

from diffexport.kernel import reference
from diffexport.modeling.checkpoint import LoadedModel
from diffexport.modeling.families import DiffV1LM, DiffV2LM
from diffexport.modeling.presets import match_preset


@torch.no_grad()
def model_facts(loaded: LoadedModel) -> dict:
    """What a model is, as data (describe() prints it; `diffexport report` shows it): family, source,
    preset, parameters, sizes, RoPE, heads, head norm, and lambda per layer where it is per layer
    (V1 and DiffLlama: (layer, lambda_init, lambda), lambda None for a model built on the meta
    device); lambda_note says what lambda is where it is not."""
    cfg, model = loaded.config, loaded.model
    facts = {"family": cfg.family, "source": loaded.source, "path": loaded.path, "preset": match_preset(cfg),
             "parameters": model.num_parameters(), "layers": cfg.n_layers, "d_model": cfg.d_model,
             "ffn": cfg.ffn_hidden, "vocab": cfg.vocab_size, "rope": describe_rope(cfg), "head_norm": None,
             "lambdas": None, "lambda_note": None}
    if isinstance(model, DiffV1LM):
        facts["heads"] = (f"{cfg.n_heads} diff-heads x 2 maps, {cfg.n_kv_heads} kv-groups, head_dim {cfg.head_dim}, "
                          f"value dim {2 * cfg.head_dim}")
        facts["head_norm"] = f"RMSNorm over {2 * cfg.head_dim} ({'with' if cfg.head_norm_affine else 'no'} weight)"
        facts["lambdas"] = []
        for i, layer in enumerate(model.layers):
            lam = layer.attn.lambda_full()
            facts["lambdas"].append((i, float(layer.attn.lambda_init), None if lam.is_meta else float(lam)))
    elif isinstance(model, DiffV2LM):
        facts["heads"] = (f"{cfg.n_heads} diff-heads (2x{cfg.n_heads} query maps), {cfg.n_kv_heads} kv heads, "
                          f"head_dim {cfg.head_dim}")
        facts["lambda_note"] = "per token and head: sigmoid(lambda_proj(x))"
    else:
        facts["heads"] = (f"{cfg.n_heads} heads, {cfg.n_kv_heads} kv heads, head_dim {cfg.head_dim} "
                          "(baseline Transformer)")
    return facts


def describe(loaded: LoadedModel) -> str:
    facts = model_facts(loaded)
    lines = [
        f"family        {facts['family']}",
        f"source        {facts['source']}{' ' + facts['path'] if facts['path'] else ''}",
        f"preset        {facts['preset'] or '(no exact match)'}",
        f"parameters    {facts['parameters']:,}",
        f"layers        {facts['layers']}   d_model {facts['d_model']}   ffn {facts['ffn']}   vocab {facts['vocab']}",
        f"rope          {facts['rope']}",
        f"heads         {facts['heads']}",
    ]
    if facts["head_norm"]:
        lines.append(f"head norm     {facts['head_norm']}")
    if facts["lambdas"] is not None:
        lines.append("lambda        layer  lambda_init  lambda")
        for i, init, lam in facts["lambdas"]:
            lines.append(f"              {i:5d}  {init:11.4f}  {'(shape only)' if lam is None else f'{lam:.4f}'}")
    if facts["lambda_note"]:
        lines.append(f"lambda        {facts['lambda_note']}")
    return "\n".join(lines)


def describe_rope(cfg) -> str:
    """theta, layout and frequency scaling of a config's RoPE, in one line."""
    layout = "adjacent pairs" if cfg.rope_interleaved else "rotate-half"
    text = f"theta {cfg.rope_theta:g}, {layout}"
    scaling = cfg.rope_scaling
    if scaling is None:
        return text
    params = ", ".join(f"{key} {str(value).lower() if isinstance(value, bool) else format(value, 'g')}"
                       for key, value in scaling.items() if key != "rope_type")
    return f"{text}, {scaling['rope_type']} scaling ({params})"


@torch.no_grad()
def self_check(model, seed: int = 0, batch: int = 2, seq: int = 17) -> tuple[bool, str]:
    """Logits through diffexport::diff_attention vs the same model through naive Eq. 1 (fp32)."""
    attns = [layer.attn for layer in model.layers if hasattr(layer.attn, "impl")]
    if not attns:
        return True, "self-check    skipped (baseline Transformer has no differential attention)"
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, model.config.vocab_size, (batch, seq), generator=gen)
    logits_op = model(ids)
    for a in attns:
        a.impl = "naive"
    try:
        logits_naive = model(ids)
    finally:
        for a in attns:
            a.impl = "op"
    err = (logits_op - logits_naive).abs().max().item()
    bound = 1e-5 * max(1.0, logits_naive.abs().max().item())
    ok = bool(torch.isfinite(logits_op).all()) and err <= bound
    backend = reference.attention_backend(torch.empty(1, 1, 1, 1), torch.empty(1, 1, 1, 1))
    return ok, (f"self-check    logits [{batch}x{seq}] op ({backend}) vs naive Eq. 1: max abs {err:.2e} "
                f"(bound {bound:.1e}) {'PASS' if ok else 'FAIL'}")
