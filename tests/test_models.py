"""The model families: official semantics, canonical layout, causality, presets, meta-device builds."""

import math

import pytest
import torch
import torch.nn.functional as F

from diffexport.core.errors import DiffExportError
from diffexport.modeling import layouts
from diffexport.modeling.common import apply_rope, rope_cos_sin
from diffexport.modeling.families import (
    DiffV1Config,
    DiffV2Config,
    TransformerConfig,
    baseline_for,
    build_model,
    config_from_dict,
)
from diffexport.modeling.presets import all_presets, match_preset, preset_config


def _ids(cfg, rng, batch=2, seq=11):
    return torch.randint(0, cfg.vocab_size, (batch, seq), generator=rng)


def _set_impl(model, impl):
    for layer in model.layers:
        layer.attn.impl = impl


def _interleaved_rope(x, cos, sin):
    """GPT-J rotation written independently: pairs (2i, 2i+1) rotate by frequency i."""
    out = x.clone()
    c, s = cos[:, :, None, :], sin[:, :, None, :]
    out[..., 0::2] = x[..., 0::2] * c - x[..., 1::2] * s
    out[..., 1::2] = x[..., 0::2] * s + x[..., 1::2] * c
    return out


def _official_v1_attention(attn, x, cos, sin, n_heads, n_kv_heads, head_dim):
    """The official multihead_flashdiff_1 forward (flash GQA semantics), re-written with SDPA."""
    B, T, _ = x.shape
    q = _interleaved_rope(attn.q_proj(x).view(B, T, 2 * n_heads, head_dim), cos, sin)
    k = _interleaved_rope(attn.k_proj(x).view(B, T, 2 * n_kv_heads, head_dim), cos, sin)
    v = attn.v_proj(x).view(B, T, n_kv_heads, 2 * head_dim)
    q = q.reshape(B, T, n_heads, 2, head_dim)
    k = k.reshape(B, T, n_kv_heads, 2, head_dim)
    rep = n_heads // n_kv_heads

    def flash(qi, ki):  # [B, T, H, D] layout like flash_attn_func, causal
        qi, ki, vi = qi.transpose(1, 2), ki.transpose(1, 2).repeat_interleave(rep, 1), \
            v.transpose(1, 2).repeat_interleave(rep, 1)
        return F.scaled_dot_product_attention(qi, ki, vi, is_causal=True).transpose(1, 2)

    a1, a2 = flash(q[:, :, :, 0], k[:, :, :, 0]), flash(q[:, :, :, 1], k[:, :, :, 1])
    lam = (torch.exp((attn.lambda_q1 * attn.lambda_k1).sum()) - torch.exp((attn.lambda_q2 * attn.lambda_k2).sum())
           + attn.lambda_init)
    o = a1 - lam * a2
    o = o * torch.rsqrt(o.pow(2).mean(-1, keepdim=True) + 1e-5) * attn.head_norm.weight
    o = o * (1 - attn.lambda_init)
    return attn.o_proj(o.reshape(B, T, n_heads * 2 * head_dim))


@torch.no_grad()
@pytest.mark.parametrize("n_heads,n_kv_heads", [(2, 2), (4, 2), (4, 1)])
def test_v1_attention_matches_official_formula(n_heads, n_kv_heads, rng):
    cfg = DiffV1Config(vocab_size=64, d_model=64, n_layers=3, n_heads=n_heads, n_kv_heads=n_kv_heads,
                       head_dim=8, rope_interleaved=True)
    model = build_model(cfg, seed=1)
    x = torch.randn(2, 13, 64, generator=rng)
    cos, sin = rope_cos_sin(torch.arange(13).expand(2, 13), 8, cfg.rope_theta, torch.float32)
    for layer in model.layers:
        ours = layer.attn(x, cos, sin)
        official = _official_v1_attention(layer.attn, x, cos, sin, n_heads, n_kv_heads, 8)
        assert (ours - official).abs().max() < 1e-5


@torch.no_grad()
@pytest.mark.parametrize("n_heads,n_kv_heads", [(4, 4), (4, 2), (4, 1)])
def test_v2_attention_matches_official_formula(n_heads, n_kv_heads, rng):
    """unilm Diff-Transformer-V2: one causal call over 2H maps, out = A[0::2] - sigmoid(lambda) * A[1::2]."""
    cfg = DiffV2Config(vocab_size=64, d_model=64, n_layers=1, n_heads=n_heads, n_kv_heads=n_kv_heads,
                       head_dim=8, rope_interleaved=True)
    attn = build_model(cfg, seed=2).layers[0].attn
    B, T = 2, 9
    x = torch.randn(B, T, 64, generator=rng)
    cos, sin = rope_cos_sin(torch.arange(T).expand(B, T), 8, cfg.rope_theta, torch.float32)
    q = _interleaved_rope(attn.q_proj(x).view(B, T, 2 * n_heads, 8), cos, sin).transpose(1, 2)
    k = _interleaved_rope(attn.k_proj(x).view(B, T, n_kv_heads, 8), cos, sin).transpose(1, 2)
    v = attn.v_proj(x).view(B, T, n_kv_heads, 8).transpose(1, 2)
    rep = 2 * n_heads // n_kv_heads
    a = F.scaled_dot_product_attention(q, k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1),
                                       is_causal=True).transpose(1, 2)  # [B, T, 2H, D]
    official = a[:, :, 0::2] - torch.sigmoid(attn.lambda_proj(x)).unsqueeze(-1) * a[:, :, 1::2]
    official = attn.o_proj(official.reshape(B, T, n_heads * 8))
    assert (attn(x, cos, sin) - official).abs().max() < 1e-5


@torch.no_grad()
@pytest.mark.parametrize("cfg", [
    DiffV1Config(n_heads=2, n_kv_heads=1), DiffV1Config(n_heads=2, head_norm_affine=False, lambda_init=0.5),
    DiffV2Config(n_heads=4, n_kv_heads=2), TransformerConfig(n_heads=4, n_kv_heads=2),
], ids=["v1-gqa", "v1-const-lambda", "v2", "baseline"])
def test_causal_and_finite(cfg, rng):
    model = build_model(cfg, seed=3)
    ids = _ids(cfg, rng)
    logits = model(ids)
    assert logits.shape == (2, 11, cfg.vocab_size) and torch.isfinite(logits).all()
    changed = ids.clone()
    changed[:, 7:] = (changed[:, 7:] + 1) % cfg.vocab_size
    later = model(changed)
    assert torch.equal(later[:, :7], logits[:, :7]), "a future token changed an earlier logit"
    assert (later[:, 7:] - logits[:, 7:]).abs().max() > 1e-4


@torch.no_grad()
@pytest.mark.parametrize("cfg", [DiffV1Config(n_heads=2, n_kv_heads=1), DiffV2Config(n_heads=4, n_kv_heads=2)])
def test_op_path_equals_naive_path(cfg, rng):
    model = build_model(cfg, seed=4)
    ids = _ids(cfg, rng, batch=3, seq=17)
    via_op = model(ids)
    _set_impl(model, "naive")
    assert (model(ids) - via_op).abs().max() < 1e-5


@torch.no_grad()
def test_interleaved_rope_converts_exactly_to_rotate_half(rng):
    cfg = DiffV1Config(n_heads=2, n_kv_heads=1, rope_interleaved=True)
    model = build_model(cfg, seed=5)
    converted = build_model(DiffV1Config(n_heads=2, n_kv_heads=1, rope_interleaved=False), seed=None)
    converted.load_state_dict(layouts.rope_to_halves(model.state_dict(), cfg))
    ids = _ids(cfg, rng)
    assert (model(ids) - converted(ids)).abs().max() < 1e-5


def test_rope_conventions_differ_and_keep_norms(rng):
    x = torch.randn(1, 5, 2, 8, generator=rng)
    cos, sin = rope_cos_sin(torch.arange(5).expand(1, 5), 8, 10000.0, torch.float32)
    a, b = apply_rope(x, cos, sin, True), apply_rope(x, cos, sin, False)
    assert torch.allclose(a, _interleaved_rope(x, cos, sin), atol=1e-6)
    assert torch.allclose(a.norm(dim=-1), x.norm(dim=-1), atol=1e-5)
    assert torch.allclose(b.norm(dim=-1), x.norm(dim=-1), atol=1e-5)
    assert (a - b).abs().max() > 1e-3


def test_v1_lambda_reparameterisation():
    cfg = DiffV1Config(n_heads=2, n_layers=3)
    model = build_model(cfg, seed=0)
    attn = model.layers[2].attn
    assert attn.lambda_init == pytest.approx(0.8 - 0.6 * math.exp(-0.3 * 2))
    with torch.no_grad():
        attn.lambda_q1.fill_(0.5)
        attn.lambda_k1.fill_(0.25)
        attn.lambda_q2.fill_(-0.5)
        attn.lambda_k2.fill_(0.125)
    d = cfg.head_dim
    expected = math.exp(0.125 * d) - math.exp(-0.0625 * d) + attn.lambda_init  # + lambda_init, never -
    assert float(attn.lambda_full().detach()) == pytest.approx(expected, rel=1e-6)
    assert attn.attrs.output_scale == pytest.approx(1 - attn.lambda_init)


def test_baseline_matches_parameters():
    diff = DiffV1Config(d_model=128, n_layers=3, n_heads=2, n_kv_heads=1)
    base = baseline_for(diff)
    assert (base.n_heads, base.n_kv_heads, base.head_dim) == (4, 2, diff.head_dim)
    n_diff = build_model(diff, device="meta").num_parameters()
    n_base = build_model(base, device="meta").num_parameters()
    assert n_diff - n_base == diff.n_layers * (4 * diff.head_dim + 2 * diff.head_dim)


def test_presets_build_on_meta_without_memory():
    for name in all_presets():
        cfg = preset_config(name)
        model = build_model(cfg, device="meta")
        assert all(p.is_meta for p in model.parameters())
        assert match_preset(cfg) == name
    three_b = build_model(preset_config("diff-v1-3b"), device="meta")
    assert 3.3e9 < three_b.num_parameters() < 3.6e9
    cfg = preset_config("diff-v1-3b")
    assert (cfg.n_layers, cfg.d_model, cfg.n_heads, cfg.head_dim, cfg.ffn_hidden) == (28, 3072, 12, 128, 8192)


def test_seeded_builds_are_deterministic():
    cfg = preset_config("diff-v1-tiny")
    a, b = build_model(cfg, seed=7), build_model(cfg, seed=7)
    assert all(torch.equal(x, y) for x, y in zip(a.state_dict().values(), b.state_dict().values()))
    c = build_model(cfg, seed=8)
    assert not torch.equal(a.embed.weight, c.embed.weight)


@pytest.mark.parametrize("family,values,message", [
    ("diff_v1", dict(n_heads=4, n_kv_heads=3), "must divide"),
    ("diff_v1", dict(d_model=100, n_heads=3), "not divisible"),
    ("diff_v1", dict(head_dim=7), "even"),
    ("diff_v2", dict(n_heads=2, n_kv_heads=4), "must divide"),
    ("diff_v1", dict(n_layers=0), "n_layers must be an int in 1..1024"),
    ("diff_v1", dict(unknown_knob=1), "unknown key"),
    ("gpt2", dict(), "unknown model family"),
])
def test_bad_configs(family, values, message):
    with pytest.raises(DiffExportError, match=message):
        config_from_dict(family, values)


def test_training_step_through_the_op(rng):
    """The op has gradients: one SGD step lowers the loss on a fixed batch."""
    cfg = DiffV1Config(n_heads=2, n_kv_heads=1, n_layers=1)
    model = build_model(cfg, seed=9).train()
    ids = _ids(cfg, rng, seq=16)
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    losses = []
    for _ in range(3):
        loss = F.cross_entropy(model(ids[:, :-1]).flatten(0, 1), ids[:, 1:].flatten())
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    assert model.layers[0].attn.lambda_q1.grad is not None
    assert losses[-1] < losses[0]


@pytest.mark.slow
def test_building_allocates_the_weights_once(tmp_path):
    """Peak RSS while building a ~170M-parameter model stays near one copy of its fp32 weights."""
    import subprocess
    import sys

    # VmHWM: this child's own peak (ru_maxrss would start at the forked test process's peak, and a
    # long session's would hide the build's growth)
    code = """
import torch
from diffexport.modeling.diff_v1 import DiffV1Config
from diffexport.modeling.families import build_model
def peak_kb():
    return int(next(line.split()[1] for line in open("/proc/self/status") if line.startswith("VmHWM:")))
cfg = DiffV1Config(vocab_size=32000, d_model=1024, n_layers=8, n_heads=4)
before = peak_kb()
model = build_model(cfg, seed=0)
after = peak_kb()
weights = sum(p.numel() * p.element_size() for p in model.parameters())
print((after - before) * 1024 / weights)
"""
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr
    ratio = float(result.stdout.strip())
    assert ratio < 1.3, f"building took {ratio:.2f}x the weight bytes"
