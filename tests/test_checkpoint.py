"""Checkpoints: round trips, Hugging Face DiffLlama and unilm imports, and every kind of bad input."""

import json
import math
import os
import pickle
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from helpers import assert_one_line_error, cli_main, resave_checkpoint, run_cli

from diffexport.core.errors import DiffExportError
from diffexport.modeling import layouts
from diffexport.modeling.checkpoint import FORMAT, load_model, save_checkpoint, save_safetensors
from diffexport.modeling.families import DiffV1Config, build_model
from diffexport.modeling.presets import preset_config


def _logits(model, rng, vocab, seq=13):
    ids = torch.randint(0, vocab, (2, seq), generator=rng)
    with torch.no_grad():
        return ids, model(ids)


@pytest.mark.parametrize("preset", ["diff-v1-tiny", "diff-v2-tiny", "transformer-tiny"])
def test_native_round_trips(preset, tmp_path, rng):
    model = build_model(preset_config(preset), seed=11)
    ids, ref = _logits(model, rng, model.config.vocab_size)
    for loaded in (load_model(save_checkpoint(model, tmp_path / "m.pt")),
                   load_model(save_safetensors(model, tmp_path / "st")),
                   load_model(tmp_path / "st" / "model.safetensors")):
        assert loaded.config == model.config
        with torch.no_grad():
            assert torch.equal(loaded.model(ids), ref)
    assert not list(tmp_path.rglob("*.tmp")), "temporary files left behind"


def test_tied_embeddings_round_trip(tmp_path, rng):
    cfg = DiffV1Config(n_heads=2, tie_embeddings=True)
    model = build_model(cfg, seed=12)
    loaded = load_model(save_checkpoint(model, tmp_path / "tied.pt")).model
    assert loaded.lm_head.weight is loaded.embed.weight
    ids, ref = _logits(model, rng, cfg.vocab_size)
    with torch.no_grad():
        assert torch.equal(loaded(ids), ref)


def _hf_model(tmp_path, heads, kv_heads, tie, **extra):
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(heads * 10 + kv_heads)
    cfg = transformers.DiffLlamaConfig(vocab_size=96, hidden_size=64, intermediate_size=112, num_hidden_layers=3,
                                       num_attention_heads=heads, num_key_value_heads=kv_heads, head_dim=16,
                                       tie_word_embeddings=tie, **extra)
    hf = transformers.DiffLlamaForCausalLM(cfg).eval()
    with torch.no_grad():  # HF's init leaves norms at 1: perturb so the test sees the weights move
        for name, p in hf.named_parameters():
            if "norm" in name:
                p.add_(0.1 * torch.randn_like(p))
    path = tmp_path / f"hf-{heads}-{kv_heads}-{tie}"
    hf.save_pretrained(path)
    return hf, path


@pytest.mark.parametrize("heads,kv_heads,tie", [(4, 4, False), (8, 4, False), (8, 2, True), (4, 2, False)])
def test_hf_diffllama_logits_match(heads, kv_heads, tie, tmp_path, rng):
    hf, path = _hf_model(tmp_path, heads, kv_heads, tie)
    loaded = load_model(path)
    assert loaded.source == "hf-diffllama"
    assert (loaded.config.n_heads, loaded.config.n_kv_heads) == (heads // 2, kv_heads // 2)
    ids = torch.randint(0, 96, (2, 15), generator=rng)
    with torch.no_grad():
        ref = hf(ids).logits
        ours = loaded.model(ids)
    assert (ours - ref).abs().max().item() <= 1e-4


LLAMA3_SCALING = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                  "original_max_position_embeddings": 64}  # head_dim 16: its 8 wavelengths fall on all three branches


YARN_SCALINGS = [  # head_dim 16 over a context of 64: the ramp covers pairs 0..7 in part (beta_fast 32, beta_slow 1)
    {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64},
    {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64, "beta_fast": 16, "beta_slow": 2,
     "truncate": False},
    {"rope_type": "yarn", "factor": 8.0, "original_max_position_embeddings": 64, "mscale": 0.707,
     "mscale_all_dim": 1.0},
    {"rope_type": "yarn", "factor": 2.0, "original_max_position_embeddings": 32, "attention_factor": 1.3},
]


@pytest.mark.parametrize("scaling,older_json", [({"rope_type": "linear", "factor": 4.0}, False),
                                                (LLAMA3_SCALING, False),
                                                ({"rope_type": "linear", "factor": 2.0}, True),
                                                *((yarn, False) for yarn in YARN_SCALINGS)])
def test_hf_diffllama_rope_scaling_matches_transformers(scaling, older_json, tmp_path, rng):
    """Linear, Llama-3.1 and YaRN scaling (DiffLlama initialised from a Llama 3.x checkpoint, or
    stretched with YaRN): the frequencies and YaRN's cos/sin factor are transformers' own, and the
    logits over 200 positions agree. older_json: the config.json of transformers 4.x
    (`rope_scaling` with `type`, `rope_theta` beside it)."""
    pytest.importorskip("transformers")
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    from diffexport.modeling.common import rope_attention_scale, rope_inv_freq

    hf, path = _hf_model(tmp_path, 4, 2, False, rope_scaling=dict(scaling), max_position_embeddings=512)
    if older_json:
        _edit_config(path, rope_parameters=None, rope_theta=10000.0,
                     rope_scaling={"type": scaling["rope_type"], "factor": scaling["factor"]})
    loaded = load_model(path)
    kind = scaling["rope_type"]
    assert loaded.config.rope_scaling["rope_type"] == kind
    expected, attention_factor = ROPE_INIT_FUNCTIONS[kind](hf.config, "cpu")
    ours = rope_inv_freq(16, loaded.config.rope_theta, loaded.config.rope_scaling)
    assert torch.equal(ours, expected)
    assert rope_attention_scale(loaded.config.rope_scaling) == attention_factor
    assert not torch.equal(ours, rope_inv_freq(16, loaded.config.rope_theta))  # the scaling did something
    ids = torch.randint(0, 96, (2, 200), generator=rng)
    with torch.no_grad():
        assert (loaded.model(ids) - hf(ids).logits).abs().max().item() <= 1e-4
    reloaded = load_model(save_checkpoint(loaded.model, tmp_path / "native.pt"))  # the field round-trips
    assert reloaded.config.rope_scaling == loaded.config.rope_scaling


@pytest.mark.parametrize("scaling,message", [
    ("linear", "rope_scaling must be an object or null"),
    ({"rope_type": "dynamic", "factor": 2.0}, "rope_type 'dynamic' is not one diffexport computes"),
    ({"rope_type": "yarn", "factor": 2.0}, "takes exactly the keys"),  # no original context
    ({**YARN_SCALINGS[0], "truncate": "yes"}, "truncate must be true or false"),
    ({**YARN_SCALINGS[0], "attention_factor": 0.0}, "attention_factor must be a finite number > 0"),
    ({**YARN_SCALINGS[0], "mscale": 1.0}, "takes exactly the keys"),  # transformers' key, resolved when read
    ({"rope_type": "linear"}, "takes exactly the keys ['factor', 'rope_type']"),
    ({"rope_type": "linear", "factor": 2.0, "beta": 1.0}, "takes exactly the keys"),
    ({"rope_type": "linear", "factor": float("inf")}, "factor must be a finite number > 0"),
    ({**LLAMA3_SCALING, "original_max_position_embeddings": 64.5}, "original_max_position_embeddings must be an int"),
    ({**LLAMA3_SCALING, "high_freq_factor": 1.0}, "needs high_freq_factor > low_freq_factor"),
])
def test_rope_scaling_values_are_validated(scaling, message):
    with pytest.raises(DiffExportError, match=re.escape(message)):
        DiffV1Config(n_heads=2, rope_scaling=scaling)


def test_yarn_in_a_native_config_takes_transformers_defaults():
    """A hand-written config names factor and the original context; the rest is filled as
    transformers fills it, and the filled dict is what the checkpoint keeps."""
    scaling = DiffV1Config(n_heads=2, rope_scaling=dict(YARN_SCALINGS[0])).rope_scaling
    assert scaling == {**YARN_SCALINGS[0], "beta_fast": 32.0, "beta_slow": 1.0, "truncate": True,
                       "attention_factor": pytest.approx(0.1 * math.log(4.0) + 1)}
    assert DiffV1Config(n_heads=2, rope_scaling=scaling).rope_scaling == scaling


def test_rope_scaling_default_is_plain_rope():
    assert DiffV1Config(n_heads=2, rope_scaling={"rope_type": "default"}).rope_scaling is None


def test_hf_diffllama_bin_weights(tmp_path, rng):
    """Older HF directories hold pytorch_model.bin (read with weights_only=True)."""
    hf, path = _hf_model(tmp_path, 4, 2, False)
    (path / "model.safetensors").unlink()
    torch.save(hf.state_dict(), path / "pytorch_model.bin")
    ids = torch.randint(0, 96, (1, 7), generator=rng)
    with torch.no_grad():
        assert (load_model(path).model(ids) - hf(ids).logits).abs().max().item() <= 1e-4


def test_hf_diffllama_rejects_unsupported(tmp_path):
    _, path = _hf_model(tmp_path, 4, 2, False)
    cfg = json.loads((path / "config.json").read_text())
    cfg["attention_bias"] = True
    (path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(DiffExportError, match="attention_bias"):
        load_model(path)


def _to_unilm(state, cfg):
    """Our canonical names -> unilm's (the inverse of layouts.unilm_state's renaming)."""
    out = {theirs: state[ours] for ours, theirs in layouts.UNILM_NAMES.items() if ours in state}
    for i in range(cfg.n_layers):
        for ours, theirs in layouts.UNILM_LAYER_NAMES.items():
            out[f"layers.{i}.{theirs}"] = state[f"layers.{i}.{ours}"]
    return out


def test_unilm_state_dict_with_interleaved_rope(tmp_path, rng):
    cfg = DiffV1Config(vocab_size=80, d_model=64, n_layers=2, n_heads=2, n_kv_heads=1, rope_interleaved=True)
    official = build_model(cfg, seed=13)  # our model with the official code's interleaved RoPE
    path = tmp_path / "unilm.pt"
    torch.save(_to_unilm(official.state_dict(), cfg), path)
    cfg_file = tmp_path / "cfg.json"
    cfg_file.write_text(json.dumps({"family": "diff_v1", "config": cfg.to_dict()}))
    from diffexport.modeling.checkpoint import load_config_file

    loaded = load_model(path, config=load_config_file(cfg_file))
    assert loaded.source == "state-dict:unilm" and loaded.config.rope_interleaved is False
    ids, ref = _logits(official, rng, 80)
    with torch.no_grad():
        assert (loaded.model(ids) - ref).abs().max() < 1e-5


# ------------------------------------------------------------------ bad input

@pytest.fixture(scope="module")
def good_ckpt(tmp_path_factory):
    path = tmp_path_factory.mktemp("good") / "tiny.pt"
    save_checkpoint(build_model(preset_config("diff-v1-tiny"), seed=0), path)
    return path


def test_missing_file(tmp_path):
    assert_one_line_error(cli_main("info", tmp_path / "nope.pt"), "checkpoint not found")


def test_truncated_file(good_ckpt, tmp_path):
    bad = tmp_path / "truncated.pt"
    bad.write_bytes(good_ckpt.read_bytes()[: good_ckpt.stat().st_size // 2])
    assert_one_line_error(cli_main("info", bad), "corrupt or truncated")


def test_corrupted_file(good_ckpt, tmp_path):
    data = bytearray(good_ckpt.read_bytes())
    gen = torch.Generator().manual_seed(1)
    for i in torch.randint(100, len(data) - 100, (200,), generator=gen).tolist():
        data[i] ^= 0xFF
    bad = tmp_path / "corrupt.pt"
    bad.write_bytes(bytes(data))
    result = run_cli("info", bad)
    assert_one_line_error(result, "")
    bad.write_bytes(os.urandom(4096))
    assert_one_line_error(cli_main("info", bad), "corrupt or truncated")
    bad.write_text("# a text file is not a checkpoint\n")  # torch's reply advises weights_only=False: not ours
    result = cli_main("info", bad)
    assert_one_line_error(result, "corrupt or truncated")
    assert "weights_only" not in result.stderr and "will likely succeed" not in result.stderr, result.stderr


class _Payload:
    """Unpickling this runs code: it creates the marker file."""

    def __init__(self, marker):
        self.marker = str(marker)

    def __reduce__(self):
        return (exec, (f"open({self.marker!r}, 'w').write('pwned')",))


@pytest.mark.parametrize("writer", ["torch.save", "pickle.dump"])
def test_pickle_with_code_is_not_executed(writer, tmp_path):
    marker = tmp_path / "EXECUTED"
    evil = tmp_path / "evil.pt"
    payload = {"format": FORMAT, "format_version": 1, "family": "diff_v1", "config": {}, "state_dict": _Payload(marker)}
    if writer == "torch.save":
        torch.save(payload, evil)
    else:
        evil.write_bytes(pickle.dumps(payload))
    # the check itself: unpickling with plain pickle WOULD run it (proof the payload is live)
    probe = tmp_path / "probe"
    pickle.loads(pickle.dumps(_Payload(probe)))
    assert probe.exists()
    result = run_cli("info", evil)
    assert_one_line_error(result, "refusing to load")
    assert not marker.exists(), "code from the checkpoint ran"
    with pytest.raises(DiffExportError, match="refusing"):
        load_model(evil)
    assert not marker.exists()


def test_missing_key(good_ckpt, tmp_path):
    path = resave_checkpoint(good_ckpt, tmp_path, lambda o: o["state_dict"].pop("layers.1.attn.lambda_q2"))
    assert_one_line_error(cli_main("info", path), "missing key(s) layers.1.attn.lambda_q2")


def test_unexpected_key(good_ckpt, tmp_path):
    path = resave_checkpoint(good_ckpt, tmp_path, lambda o: o["state_dict"].update({"layers.9.extra": torch.ones(2)}))
    assert_one_line_error(cli_main("info", path), "unexpected key(s) layers.9.extra")


def test_wrong_shape(good_ckpt, tmp_path):
    path = resave_checkpoint(good_ckpt, tmp_path,
                   lambda o: o["state_dict"].update({"layers.0.attn.q_proj.weight": torch.ones(64, 128)}))
    assert_one_line_error(cli_main("info", path), "wrong shape for layers.0.attn.q_proj.weight")


def test_nan_weights(good_ckpt, tmp_path):
    def poison(o):
        o["state_dict"]["norm.weight"][3] = float("nan")
    assert_one_line_error(cli_main("info", resave_checkpoint(good_ckpt, tmp_path, poison)), "NaN")


def test_unknown_format_version(good_ckpt, tmp_path):
    path = resave_checkpoint(good_ckpt, tmp_path, lambda o: o.update({"format_version": 99}))
    assert_one_line_error(cli_main("info", path), "unknown format_version 99")


def test_bad_config_values(good_ckpt, tmp_path):
    path = resave_checkpoint(good_ckpt, tmp_path, lambda o: o["config"].update({"n_kv_heads": 3}))
    assert_one_line_error(cli_main("info", path), "must divide")


def test_non_diff_hf_directory(tmp_path):
    d = tmp_path / "mistral"
    d.mkdir()
    (d / "config.json").write_text(json.dumps({"model_type": "mistral", "hidden_size": 64}))
    assert_one_line_error(cli_main("info", d), "not a DIFF model")
    (d / "config.json").write_text(json.dumps({"model_type": "llama", "hidden_size": 64}))  # the baseline, incomplete
    assert_one_line_error(cli_main("info", d), "Llama config.json lacks 'num_attention_heads'")


def _hf_llama(tmp_path, **extra):
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(11)
    cfg = transformers.LlamaConfig(vocab_size=96, hidden_size=64, intermediate_size=112, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, head_dim=16, **extra)
    hf = transformers.LlamaForCausalLM(cfg).eval()
    with torch.no_grad():  # HF's init leaves norms at 1: perturb so the test sees the weights move
        for name, p in hf.named_parameters():
            if "norm" in name:
                p.add_(0.1 * torch.randn_like(p))
    hf.save_pretrained(tmp_path / "llama")
    return hf, tmp_path / "llama"


@pytest.mark.parametrize("extra", [{}, {"tie_word_embeddings": True, "max_position_embeddings": 512,
                                        "rope_scaling": dict(LLAMA3_SCALING)}])
def test_hf_llama_imports_as_the_baseline_transformer(extra, tmp_path, rng):
    """The Llama a DiffLlama is commonly initialised from loads as the baseline family, so the
    analysis tools compare the two; its logits are transformers' own, and so is its default eps."""
    from diffexport.modeling.checkpoint import from_module

    hf, path = _hf_llama(tmp_path, **extra)
    _edit_config(path, rms_norm_eps=None)  # missing: Llama's default is 1e-6, DiffLlama's 1e-5
    loaded = load_model(path)
    assert (loaded.source, loaded.config.family, loaded.config.norm_eps) == ("hf-llama", "transformer", 1e-6)
    assert (loaded.config.n_heads, loaded.config.n_kv_heads, loaded.config.head_dim) == (4, 2, 16)
    ids = torch.randint(0, 96, (2, 150), generator=rng)
    with torch.no_grad():
        expected = hf(ids).logits
        assert (loaded.model(ids) - expected).abs().max().item() <= 1e-5
        assert (from_module(hf).model(ids) - expected).abs().max().item() <= 1e-5


def test_hf_llama_with_biases_is_refused(tmp_path):
    _, path = _hf_llama(tmp_path)
    _edit_config(path, mlp_bias=True)
    with pytest.raises(DiffExportError, match="Llama with mlp_bias=true is not supported"):
        load_model(path)


def test_non_diff_state_dict(tmp_path):
    path = tmp_path / "gpt2.pt"
    torch.save({"wte.weight": torch.randn(10, 4), "h.0.attn.c_attn.weight": torch.randn(4, 12)}, path)
    assert_one_line_error(cli_main("info", path, "--preset", "diff-v1-tiny"), "not a DIFF model")
    assert_one_line_error(cli_main("info", path), "without a config")


def test_truncated_safetensors(tmp_path):
    directory = save_safetensors(build_model(preset_config("diff-v1-tiny"), seed=0), tmp_path / "st")
    weights = directory / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:1000])
    assert_one_line_error(cli_main("info", directory), "corrupt or truncated")


def test_safetensors_without_config(tmp_path):
    directory = save_safetensors(build_model(preset_config("diff-v1-tiny"), seed=0), tmp_path / "st")
    (directory / "config.json").unlink()
    assert_one_line_error(cli_main("info", directory / "model.safetensors"), "config.json")


def test_not_a_checkpoint_object(tmp_path):
    path = tmp_path / "list.pt"
    torch.save([1, 2, 3], path)
    assert_one_line_error(cli_main("info", path), "not a diffexport checkpoint")


def test_unknown_preset():
    assert_one_line_error(cli_main("info", "--preset", "diff-v9"), "unknown preset")


def test_failed_save_leaves_nothing(tmp_path):
    model = build_model(preset_config("diff-v1-tiny"), seed=0)
    model.layers[0].attn.q_proj.weight.data = model.layers[0].attn.q_proj.weight.data.t()  # non-contiguous is fine
    target = tmp_path / "out.pt"

    class Boom(Exception):
        pass

    import diffexport.modeling.checkpoint as ck
    original = ck.torch.save

    def failing_save(obj, f):
        Path(f).write_bytes(b"partial")
        raise Boom()

    ck.torch.save = failing_save
    try:
        with pytest.raises(Boom):
            save_checkpoint(model, target)
    finally:
        ck.torch.save = original
    assert not target.exists() and not list(tmp_path.iterdir())


@pytest.mark.slow
def test_from_module_takes_our_model_and_an_in_memory_diffllama(tmp_path, rng):
    from diffexport.core.errors import DiffExportError
    from diffexport.modeling.checkpoint import from_module

    hf, _ = _hf_model(tmp_path, 8, 4, False)
    loaded = from_module(hf)
    assert loaded.source == "hf-diffllama (in memory)" and loaded.path is None
    ids = torch.randint(0, 96, (2, 11), generator=rng)
    with torch.no_grad():
        assert (loaded.model(ids) - hf(ids).logits).abs().max().item() <= 1e-4
    ours = load_model(None, preset="diff-v2-tiny", seed=1).model
    assert from_module(ours).model is ours
    with pytest.raises(DiffExportError, match="Linear is not a model diffexport knows"):
        from_module(torch.nn.Linear(2, 2))


def _edit_config(path, **changes):
    cfg = json.loads((path / "config.json").read_text())
    for key, value in changes.items():
        if value is None:
            cfg.pop(key, None)
        else:
            cfg[key] = value
    (path / "config.json").write_text(json.dumps(cfg))


@pytest.mark.parametrize("changes", [
    {"rms_norm_eps": None},  # missing: transformers' default 1e-5 (not 1e-6)
    {"mlp_bias": True},  # transformers' DiffLlama MLP never has biases: ignored as it ignores it
])
def test_hf_config_is_read_as_transformers_reads_it(changes, tmp_path, rng):
    transformers = pytest.importorskip("transformers")
    _, path = _hf_model(tmp_path, 4, 2, False, rms_norm_eps=1e-5)
    _edit_config(path, **changes)
    hf = transformers.DiffLlamaForCausalLM.from_pretrained(path).eval()
    ids = torch.randint(0, 96, (2, 13), generator=rng)
    with torch.no_grad():
        assert (load_model(path).model(ids) - hf(ids).logits).abs().max().item() <= 1e-5


@pytest.mark.parametrize("changes,message", [
    ({"rope_scaling": {"rope_type": "longrope", "factor": 2.0}}, "rope_type='longrope' is not supported"),
    ({"rope_scaling": {"rope_type": "yarn", "factor": 2.0, "mscale": "big", "mscale_all_dim": 1.0}},
     "yarn mscale and mscale_all_dim must be finite numbers"),
    ({"rope_scaling": {"rope_type": "yarn", "factor": 2.0, "truncate": 1}}, "truncate must be true or false"),
    ({"rope_scaling": {"rope_type": "dynamic", "factor": 2.0}}, "rope_type='dynamic' is not supported"),
    ({"rope_scaling": {"rope_type": "llama3", "factor": 8.0, "high_freq_factor": 4.0,
                       "original_max_position_embeddings": 64}}, "needs 'low_freq_factor'"),
    ({"rope_scaling": {"rope_type": "linear", "factor": -2.0}}, "factor must be a finite number > 0"),
    ({"partial_rotary_factor": 0.5}, "partial_rotary_factor=0.5 is not supported"),
    ({"tie_word_embeddings": "yes"}, "tie_word_embeddings must be true or false"),
    ({"rope_theta": float("nan"), "rope_parameters": None}, "rope_theta must be a finite number"),
    ({"num_attention_heads": "four"}, "num_attention_heads must be a positive integer"),
    ({"lambda_std_dev": "abc"}, "lambda_std_dev must be a finite number"),
    ({"rope_scaling": "linear"}, "must be an object"),
])
def test_hf_config_values_transformers_would_read_differently_are_refused(changes, message, tmp_path):
    _, path = _hf_model(tmp_path, 4, 2, False)
    _edit_config(path, **changes)
    with pytest.raises(DiffExportError, match=re.escape(message)):
        load_model(path)


@pytest.mark.parametrize("changes,message", [
    ({"n_layers": 10**9}, "n_layers must be an int in 1..1024"),
    ({"d_model": 10**7}, "d_model must be an int in 1..65536"),
    ({"tie_embeddings": "yes"}, "tie_embeddings must be true or false"),
    ({"rope_theta": float("nan")}, "rope_theta must be a finite number"),
    ({"vocab_size": "512"}, "vocab_size must be an int"),
])
def test_config_values_are_validated_before_anything_is_built(changes, message, tmp_path):
    import time

    from diffexport.modeling.checkpoint import load_config_file

    path = tmp_path / "cfg.json"
    path.write_text(json.dumps({"family": "diff_v1", "config": {"vocab_size": 512, "d_model": 128, **changes}}))
    start = time.perf_counter()
    with pytest.raises(DiffExportError, match=re.escape(message)):
        load_model(None, config=load_config_file(path))
    assert time.perf_counter() - start < 5


def test_a_model_larger_than_memory_is_refused_before_allocation(tmp_path):
    from diffexport.modeling.checkpoint import load_config_file

    path = tmp_path / "cfg.json"
    path.write_text(json.dumps({"family": "diff_v1", "config": {"vocab_size": 1 << 20, "d_model": 1 << 15,
                                                                 "n_layers": 256, "n_heads": 64}}))
    result = run_cli("info", "--config", path)
    assert_one_line_error(result, "parameters (")
    assert "GiB to build), more than the" in result.stderr
    with pytest.raises(DiffExportError, match="check the config's sizes"):
        load_model(None, config=load_config_file(path))


def test_unilm_import_refuses_to_drop_a_real_subln_weight(tmp_path):
    """head_norm_affine: false drops subln.weight only when it is all ones (then nothing changes)."""
    cfg = DiffV1Config(vocab_size=80, d_model=64, n_layers=2, n_heads=2, n_kv_heads=1, head_norm_affine=True)
    model = build_model(cfg, seed=3)
    with torch.no_grad():
        model.layers[1].attn.head_norm.weight.mul_(1.5)
    path = tmp_path / "unilm.pt"
    torch.save(_to_unilm(model.state_dict(), cfg), path)
    plain = DiffV1Config(**{**cfg.to_dict(), "head_norm_affine": False})
    with pytest.raises(DiffExportError, match=r"layers.1.self_attn.subln.weight is not all ones"):
        load_model(path, config=plain, layout="unilm")
    with torch.no_grad():
        model.layers[1].attn.head_norm.weight.fill_(1.0)
        model.layers[0].attn.head_norm.weight.fill_(1.0)
    torch.save(_to_unilm(model.state_dict(), cfg), path)
    assert load_model(path, config=plain, layout="unilm").config.head_norm_affine is False


def test_checkpoint_whose_structure_pickle_inflates_to_gigabytes_is_refused_unread(tmp_path):
    """A small zip whose data.pkl declares more than 256 MiB: refused from the archive's directory,
    before anything is inflated."""
    import zipfile

    path = tmp_path / "bomb.pt"
    with zipfile.ZipFile(path, "w", compression=zipfile.ZIP_DEFLATED) as archive:
        with archive.open("archive/data.pkl", "w", force_zip64=True) as member:
            block = b"\0" * (1 << 20)
            for _ in range(257):
                member.write(block)
    assert path.stat().st_size < 2 << 20
    with pytest.raises(DiffExportError, match="declares 269,484,032 bytes"):
        load_model(path)


def _hub_cache_entry(cache, repo: str, files: dict) -> str:
    """A repository in huggingface_hub's own cache layout, as a download leaves it: refs/main holds
    the commit, each file of snapshots/COMMIT/ is a relative link to blobs/HASH. Returns the commit."""
    import hashlib

    commit = "0123456789abcdef0123456789abcdef01234567"
    root = cache / ("models--" + repo.replace("/", "--"))
    (root / "refs").mkdir(parents=True)
    (root / "refs" / "main").write_text(commit)
    (root / "blobs").mkdir()
    snapshot = root / "snapshots" / commit
    snapshot.mkdir(parents=True)
    for name, source in files.items():
        data = source.read_bytes() if isinstance(source, Path) else source.encode()
        blob = root / "blobs" / hashlib.sha256(data).hexdigest()
        blob.write_bytes(data)
        (snapshot / name).symlink_to(Path("..") / ".." / "blobs" / blob.name)
    return commit


def test_hub_ids_resolve_from_the_offline_cache(artifacts, tmp_path, monkeypatch):
    """`org/name[@revision]` where a path would go: read from huggingface_hub's cache offline (nothing
    fetched, no network here), and the one-line refusals: not cached, not a model, not safetensors."""
    hf = artifacts.hf_diffllama()
    cache = tmp_path / "hub"
    commit = _hub_cache_entry(cache, "test-org/tiny-diffllama",
                              {p.name: p for p in hf.iterdir() if p.is_file() and not p.name.endswith(".bin")})
    _hub_cache_entry(cache, "test-org/no-config", {"tokenizer.json": hf / "tokenizer.json"})
    _hub_cache_entry(cache, "test-org/bin-only", {"config.json": hf / "config.json"})
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_HUB_CACHE", str(cache))
    exported = run_cli("onnx", "test-org/tiny-diffllama", "--kv-cache", "-o", tmp_path / "kv")
    assert exported.returncode == 0, exported.stdout + exported.stderr
    tokenizer = tmp_path / "kv" / "tokenizer.json"  # the repository's tokenizer came along, as a file
    assert tokenizer.is_file() and not tokenizer.is_symlink()
    assert tokenizer.read_bytes() == (hf / "tokenizer.json").read_bytes()
    # a snapshot link that leaves its repository's blobs/ (here: to a file beside the cache) is refused
    _hub_cache_entry(cache, "test-org/escaping", {p.name: p for p in hf.iterdir() if p.is_file()
                                                  and not p.name.endswith(".bin")})
    outside = tmp_path / "elsewhere.json"
    outside.write_bytes((hf / "tokenizer.json").read_bytes())
    escaping = next((cache / "models--test-org--escaping" / "snapshots").iterdir()) / "tokenizer.json"
    escaping.unlink()
    escaping.symlink_to(outside)
    refused = run_cli("onnx", "test-org/escaping", "--kv-cache", "-o", tmp_path / "kv-escaping")
    assert refused.returncode == 2 and "tokenizer.json is a symbolic link" in refused.stderr, refused.stderr
    assert not (tmp_path / "kv-escaping").exists()
    # the export records the hub id and the snapshot's commit, and the card names the base model
    from diffexport.format.metadata import read_export_metadata

    meta = read_export_metadata(tmp_path / "kv" / "model.onnx")
    assert meta["source_name"] == "test-org/tiny-diffllama" and meta["source_revision"] == commit
    card = (tmp_path / "kv" / "README.md").read_text()
    assert "\nbase_model: test-org/tiny-diffllama\n" in card.split("\n---\n", 1)[0] + "\n"
    assert f"`test-org/tiny-diffllama` (revision `{commit}`)" in card
    info = run_cli("info", f"test-org/tiny-diffllama@{commit}")
    assert info.returncode == 0 and "diff_v1" in info.stdout, info.stdout + info.stderr
    # the refusals, in one child (huggingface_hub reads HF_HUB_OFFLINE when it is imported): each
    # `diffexport info ID` run through main() with its own stderr
    code = ("import contextlib, io, json, sys\nfrom diffexport.cli import main\nresults = []\n"
            "for arg in sys.argv[1:]:\n    err = io.StringIO()\n    with contextlib.redirect_stderr(err):\n"
            "        try:\n            code = main(['info', arg])\n        except SystemExit as stop:\n"
            "            code = stop.code\n    results.append((code, err.getvalue()))\nprint(json.dumps(results))\n")
    script = code
    # a refs/ file naming a folder outside the repository's snapshots (which holds a model)
    _hub_cache_entry(cache, "test-org/refs-out", {"config.json": hf / "config.json"})
    (tmp_path / "outside-snapshot").mkdir()
    for name in ("config.json", "model.safetensors"):
        (tmp_path / "outside-snapshot" / name).write_bytes((hf / name).read_bytes())
    (cache / "models--test-org--refs-out" / "refs" / "main").write_text("../../../outside-snapshot")
    refusals = {"test-org/not-cached": "not in the local Hugging Face cache while offline (HF_HUB_OFFLINE is set)",
                "test-org/no-config": "has no config.json", "test-org/bin-only": "does not fetch pickled .bin weights",
                "no-such-file.pt": "checkpoint not found: no-such-file.pt",
                # ids huggingface_hub itself rejects, and revisions that are paths: one line each
                "a../b..": "nor a valid Hugging Face Hub id", "org/na--me": "nor a valid Hugging Face Hub id",
                "org-/name": "nor a valid Hugging Face Hub id",
                "test-org/tiny-diffllama@../../../../tmp/x": "a revision is a branch, tag or commit, not a path",
                "test-org/tiny-diffllama@/etc": "a revision is a branch, tag or commit, not a path",
                "test-org/refs-out": "outside its repository's snapshots in the Hugging Face cache: refused"}
    child = subprocess.run([sys.executable, "-c", code, *refusals], capture_output=True, text=True, timeout=300)
    assert child.returncode == 0, child.stderr
    for (arg, message), (code, stderr) in zip(refusals.items(), json.loads(child.stdout.splitlines()[-1])):
        assert_one_line_error(subprocess.CompletedProcess(arg, code, "", stderr), message)
    # not offline by the user's setting, but no Hub to reach (a closed local port): said as it is
    env = {k: v for k, v in os.environ.items() if k != "HF_HUB_OFFLINE"}
    env.update(HF_ENDPOINT="http://127.0.0.1:9", HF_HUB_ETAG_TIMEOUT="5", HF_HUB_DOWNLOAD_TIMEOUT="5")
    child = subprocess.run([sys.executable, "-c", script, "test-org/not-cached"], capture_output=True, text=True,
                           timeout=300, env=env)
    (code_, stderr), = json.loads(child.stdout.splitlines()[-1])
    assert_one_line_error(subprocess.CompletedProcess("", code_, "", stderr), "the Hub could not be reached from here")
    assert "HF_HUB_OFFLINE" not in stderr
    # a --tokenizer given as a hub id is read from the same snapshot, through the same rules
    text = tmp_path / "words.txt"
    text.write_text("the cat sat on the mat " * 20)
    stats = run_cli("stats", "test-org/tiny-diffllama", "--text", text, "--tokenizer", "test-org/tiny-diffllama",
                    "--tokens", "64", "--seq-len", "16")
    assert stats.returncode == 0, stats.stdout + stats.stderr
    stats = run_cli("stats", "test-org/tiny-diffllama", "--text", text, "--tokenizer", "test-org/escaping",
                    "--tokens", "64", "--seq-len", "16")
    assert_one_line_error(stats, "tokenizer.json is a symbolic link")
