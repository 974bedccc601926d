"""`diffexport linear-sweep`: linear layers fake-quantised as `diffexport quantize` deploys them
(int8/int4 weights in blocks, w8a8 with calibrated per-tensor activations), DIFF vs Transformer."""

import json

import numpy as np
import pytest
import torch
from helpers import assert_one_line_error, cli_main

from diffexport.analysis import linear_quant
from diffexport.analysis.linear_quant import ActivationRanges, LinearQuant, QuantisedLinears
from diffexport.core.errors import DiffExportError
from diffexport.modeling.families import DiffV1Config, TransformerConfig, build_model

CONFIGS = {
    "diff_v1": DiffV1Config(vocab_size=97, d_model=64, n_layers=2, n_heads=2, n_kv_heads=1),
    "transformer": TransformerConfig(vocab_size=97, d_model=64, n_layers=2, n_heads=4, n_kv_heads=2),
}


def _reference_quant(w: np.ndarray, levels: int, block: int | None) -> np.ndarray:
    """float64 symmetric RTN: one scale per `block` inputs of a row (None: per row)."""
    w = w.astype(np.float64)
    out_f, in_f = w.shape
    size = in_f if block is None else block
    pad = -in_f % size
    blocks = np.pad(w, ((0, 0), (0, pad))).reshape(out_f, -1, size)
    scale = np.maximum(np.abs(blocks).max(-1, keepdims=True) / levels, 1e-12)
    q = np.clip(np.round(blocks / scale), -levels, levels) * scale
    return q.reshape(out_f, -1)[:, :in_f]


@pytest.mark.parametrize("scheme,levels,block,shape", [("int4", 7, 32, (48, 100)), ("int8", 127, 16, (40, 64)),
                                                       ("w8a8", 127, None, (33, 70))])
def test_weight_fake_quantisation_matches_an_independent_rtn(scheme, levels, block, shape):
    w = torch.randn(*shape, generator=torch.Generator().manual_seed(5)) * 0.1
    w[3, 7] = 2.0  # an outlier: its block (or row) gets a coarse scale
    got = LinearQuant(scheme, block or 32).weight(w).double().numpy()
    ref = _reference_quant(w.numpy(), levels, block)
    np.testing.assert_allclose(got, ref, rtol=1e-5, atol=1e-7)
    per_block = got[:, :block or shape[1]]
    assert len(np.unique(np.round(per_block[0] / np.abs(per_block[0]).max() * levels))) <= 2 * levels + 1


def test_options_are_checked():
    with pytest.raises(DiffExportError, match="use one of int8, int4, w8a8"):
        LinearQuant("int3")
    with pytest.raises(DiffExportError, match="--block-size 48"):
        LinearQuant("int4", 48)
    model = build_model(CONFIGS["diff_v1"], seed=0)
    with pytest.raises(DiffExportError, match="w8a8 needs activation ranges"):
        QuantisedLinears(model, LinearQuant("w8a8"))


@pytest.mark.parametrize("family", sorted(CONFIGS))
def test_quantised_linears_leave_the_model_as_it_was(family):
    model = build_model(CONFIGS[family], seed=1).eval()
    model.lm_head.weight = model.embed.weight  # tied: the head's copy is quantised, the table is not
    ids = torch.randint(0, 97, (2, 19), generator=torch.Generator().manual_seed(0))
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with torch.no_grad():
        ref = model(ids)
        with QuantisedLinears(model, LinearQuant("int4")):
            quantised = model(ids)
            embedded = model.embed(ids)
        after = model(ids)
    assert not torch.equal(quantised, ref) and torch.isfinite(quantised).all()
    torch.testing.assert_close(embedded, model.embed.weight[ids], rtol=0, atol=0)
    torch.testing.assert_close(after, ref, rtol=0, atol=0)
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())
    assert all("forward" not in vars(m) for _, m in linear_quant.linears(model))


def test_w8a8_pays_for_an_activation_outlier_and_weights_only_do_not():
    """The mechanism the comparison measures: one input channel of the MLP made 64x larger while the
    function stays the same (its norm weight up, the weight columns that read it down). Per-tensor
    activation scales stretch around it (w8a8 loses much more); weight-only int8 barely changes."""
    model = build_model(CONFIGS["transformer"], seed=2).eval()
    batches = [torch.randint(0, 97, (4, 33), generator=torch.Generator().manual_seed(s)) for s in range(3)]
    quants = [LinearQuant("int8"), LinearQuant("w8a8")]
    plain = {p.scheme: p for p in linear_quant.sweep(model, quants, batches)}
    assert plain["float"].kl_mean == 0.0 and plain["float"].cosine_min == 1.0
    with torch.no_grad():
        ref = model(batches[0])
        layer = model.layers[0]
        layer.mlp_norm.weight[5] *= 64
        layer.mlp.gate_proj.weight[:, 5] /= 64
        layer.mlp.up_proj.weight[:, 5] /= 64
        torch.testing.assert_close(model(batches[0]), ref, rtol=1e-4, atol=1e-4)  # the same function
    outlier = {p.scheme: p for p in linear_quant.sweep(model, quants, batches)}
    assert outlier["w8a8"].kl_mean > 5 * plain["w8a8"].kl_mean
    assert outlier["int8"].kl_mean < 5 * plain["int8"].kl_mean + 1e-7


def test_activation_ranges_record_the_absolute_maximum():
    model = build_model(CONFIGS["diff_v1"], seed=3).eval()
    ids = torch.randint(0, 97, (2, 9), generator=torch.Generator().manual_seed(1))
    seen = {}
    hooks = [m.register_forward_pre_hook(lambda mod, inp, name=name: seen.__setitem__(
        name, max(seen.get(name, 0.0), inp[0].abs().max().item()))) for name, m in linear_quant.linears(model)]
    with torch.no_grad(), ActivationRanges(model) as ranges:
        model(ids)
    for hook in hooks:
        hook.remove()
    assert ranges.absmax == seen and len(seen) == len(linear_quant.linears(model))


def test_cli_compares_the_pair_and_plots(tmp_path):
    pytest.importorskip("matplotlib")
    plot = tmp_path / "linear.png"
    result = cli_main("linear-sweep", "--preset", "diff-v1-tiny", "--preset", "transformer-tiny", "--tokens", "512",
                     "--seq-len", "64", "--json", "--plot", plot)
    assert result.returncode == 0, result.stderr
    data = json.loads(result.stdout)
    for name in ("diff-v1-tiny", "transformer-tiny"):
        points = {p["scheme"]: p for p in data["models"][name]}
        assert list(points) == ["float", "int8", "int4", "w8a8"]
        assert 0 < points["int8"]["kl_mean"] < points["int4"]["kl_mean"]
        assert all(np.isfinite(p["kl_mean"]) for p in points.values())
    assert plot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    bad = cli_main("linear-sweep", "--preset", "diff-v1-tiny", "--schemes", "int3")
    assert bad.returncode == 2 and "invalid choice" in bad.stderr
    assert_one_line_error(cli_main("linear-sweep", "--preset", "diff-v1-tiny", "--block-size", "48"), "--block-size 48")
    assert_one_line_error(cli_main("linear-sweep", "--preset", "diff-v1-tiny", "--plot", tmp_path / "p.jpg"),
                          "must end in .png")
    assert_one_line_error(cli_main("linear-sweep", tmp_path / "missing.pt"), "missing.pt")
