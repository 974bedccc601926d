"""Analysis tools: the attention probe, magnitude statistics, token streams, the logit sweep."""

import json
import math

import pytest
import torch
from helpers import assert_one_line_error, cli_main

from diffexport.analysis import stats, sweep
from diffexport.analysis.probe import AttentionProbe
from diffexport.core.errors import DiffExportError
from diffexport.core.files import MAX_TEXT_BYTES
from diffexport.core.quantization import LogitQuant
from diffexport.inputs import streams
from diffexport.modeling.checkpoint import save_checkpoint
from diffexport.modeling.families import DiffV1Config, DiffV2Config, TransformerConfig, build_model

CONFIGS = {
    "diff_v1": DiffV1Config(vocab_size=97, d_model=64, n_layers=2, n_heads=2, n_kv_heads=1),
    "diff_v2": DiffV2Config(vocab_size=97, d_model=64, n_layers=2, n_heads=4, n_kv_heads=2),
    "transformer": TransformerConfig(vocab_size=97, d_model=64, n_layers=2, n_heads=4, n_kv_heads=2),
}


def _ids(vocab, batch=2, length=37, seed=0):
    return torch.randint(0, vocab, (batch, length), generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("family", sorted(CONFIGS))
def test_probe_unquantised_matches_the_model_and_restores_it(family):
    model = build_model(CONFIGS[family], seed=3)
    ids = _ids(97)
    with torch.no_grad():
        expected = model(ids)
        seen = []
        with AttentionProbe(model, on_logits=lambda layer, maps, visible: seen.append((layer, len(maps),
                                                                                       maps[0].shape))):
            probed = model(ids)
        after = model(ids)
    torch.testing.assert_close(probed, expected, atol=1e-5, rtol=0)
    assert torch.equal(after, expected)  # the original attention is back
    maps_per_layer = 1 if family == "transformer" else 2
    heads = 4 if family == "transformer" else CONFIGS[family].n_heads
    assert seen == [(i, maps_per_layer, (2, heads, 37, 37)) for i in range(2)]


def test_probe_logits_are_scaled_qk_of_the_visible_entries():
    cfg = CONFIGS["transformer"]
    model = build_model(cfg, seed=4)
    captured = {}
    with torch.no_grad(), AttentionProbe(model, on_logits=lambda layer, maps, visible: captured.setdefault(
            layer, (maps[0], visible))):
        model(_ids(97, batch=1, length=5))
    s, visible = captured[0]
    assert visible.tolist() == torch.ones(5, 5).tril().bool().tolist()  # causal: keys <= query
    # recompute layer 0's q.k/sqrt(D) independently from the weights
    from diffexport.modeling.common import apply_rope, rope_cos_sin

    attn, layer = model.layers[0].attn, model.layers[0]
    with torch.no_grad():
        x = layer.attn_norm(model.embed(_ids(97, batch=1, length=5)))
        cos, sin = rope_cos_sin(torch.arange(5)[None], 16, cfg.rope_theta, x.dtype)
        q = apply_rope(attn.q_proj(x).unflatten(-1, (-1, 16)), cos, sin, False).transpose(1, 2)
        k = apply_rope(attn.k_proj(x).unflatten(-1, (-1, 16)), cos, sin, False).transpose(1, 2)
        ref = (q @ k.repeat_interleave(2, 1).transpose(-1, -2)) / 4.0
    torch.testing.assert_close(s, ref, atol=1e-5, rtol=0)


def test_quantised_probe_moves_outputs_more_at_fewer_bits():
    model = build_model(CONFIGS["diff_v1"], seed=5)
    ids = _ids(97, length=70)
    with torch.no_grad():
        ref = model(ids)
        errors = []
        for bits in (16, 8, 4, 2):
            with AttentionProbe(model, quant=LogitQuant(bits)):
                errors.append((model(ids) - ref).abs().max().item())
    assert errors[0] < 1e-5 and errors[0] < errors[1] < errors[2] < errors[3]


def test_probe_refuses_what_it_cannot_hook():
    with pytest.raises(DiffExportError, match="not a supported model family"):
        AttentionProbe(torch.nn.Linear(2, 2))


def test_magnitude_tracker_matches_sorting():
    torch.manual_seed(6)
    parts = [torch.randn(1000) * 3, torch.randn(50) * 10, torch.rand(7000)]
    tracker = stats.MagnitudeTracker()
    for p in parts:
        tracker.add(p)
    everything = torch.cat(parts).abs().sort(descending=True).values
    for k in stats.TOP_RANKS:
        assert tracker.rank(k) == pytest.approx(everything[k - 1].item())
    assert tracker.median() == pytest.approx(everything.median().item(), rel=0.01)
    merged = stats.MagnitudeTracker()
    merged.add(torch.tensor([1e4, -2e4]))
    both = tracker.merge(merged)
    assert both.rank(1) == 2e4 and both.rank(3) == pytest.approx(everything[0].item()) and both.count == 8052
    assert math.isnan(stats.MagnitudeTracker().median()) and math.isnan(merged.rank(3))
    with pytest.raises(ValueError):
        tracker.add(torch.tensor([float("nan")]))


def test_collect_counts_every_visible_logit_and_hidden_value():
    cfg = CONFIGS["diff_v1"]
    model = build_model(cfg, seed=7)
    batches = [_ids(97, batch=3, length=11), _ids(97, batch=1, length=11, seed=1)]
    result = stats.collect(model, batches)
    visible = 11 * 12 // 2
    assert [t.count for t in result.logits] == [4 * 2 * 2 * visible] * 2  # 4 seqs, 2 maps, 2 heads
    assert [t.count for t in result.hidden] == [4 * 11 * 64] * 2
    table = stats.render({"m": result})
    assert "attention logits" in table and "hidden states" in table
    data = result.to_dict()
    assert data["tokens"] == 44 and len(data["attention_logits"]["layers"]) == 2


def test_streams_cut_text_and_refuse_empty_files(tmp_path):
    text = tmp_path / "t.txt"
    text.write_text("héllo world " * 40)
    got = streams.stream_batches(512, text=str(text), tokenizer=None, tokens=10_000, seq_len=16, batch=4, seed=0)
    assert "UTF-8 bytes" in got.source and all(b.shape[1] == 16 and b.max() < 256 for b in got.batches)
    assert sum(b.shape[0] for b in got.batches) == len(("héllo world " * 40).encode()) // 16
    assert got.answer_masks is None
    empty = tmp_path / "empty.txt"
    empty.write_text("  \n")
    with pytest.raises(DiffExportError, match="empty"):
        streams.text_ids(str(empty), None, 512)
    with pytest.raises(DiffExportError, match="give --tokenizer"):
        streams.text_ids(str(text), None, 100)
    with pytest.raises(DiffExportError, match="fewer than one sequence"):
        streams.batches([1, 2, 3], 16, 2)
    huge = tmp_path / "huge.txt"  # sparse: over the limit without using the disk
    with open(huge, "wb") as handle:
        handle.truncate(MAX_TEXT_BYTES + 1)
    with pytest.raises(DiffExportError, match="limited to 64 MiB"):
        streams.text_ids(str(huge), None, 512)
    ids, flags, source = streams.synthetic_ids(97, 500, 50, 0)  # too small a vocabulary for the task
    assert source == "uniform random token ids" and len(ids) == 500 and max(ids) < 97 and flags is None


@pytest.mark.parametrize("tokens,seq_len,batch,message", [
    (10**12, 64, 4, "--tokens must be 1 to 4,194,304, got 1000000000000"),
    (8192, 10**9, 4, "--seq-len must be 2 to 16,384, got 1000000000"),
    (8192, 64, 0, "--batch must be 1 to 1,024, got 0"),
])
def test_stream_sizes_are_bounded_before_any_id_is_drawn(tokens, seq_len, batch, message):
    """issue 43: linear-sweep --tokens 10**12 and --seq-len 10**9 ran without end."""
    with pytest.raises(DiffExportError, match=f"^{message}$"):
        streams.stream_batches(512, text=None, tokenizer=None, tokens=tokens, seq_len=seq_len, batch=batch, seed=0)


def test_calibration_tokens_are_bounded():
    from diffexport.passes.calibration import CalibrationFields

    with pytest.raises(DiffExportError, match="4096 x --calib-seq-len 65536 is 268,435,456 tokens; calibration takes "
                                              "at "
                                              "most 1,048,576"):
        CalibrationFields(calib="synthetic", samples=4096, seq_len=65536).validate_calibration("--method gptq")
    CalibrationFields(calib="synthetic", samples=128, seq_len=2048).validate_calibration("--method gptq")


def test_task_stream_marks_exactly_the_answer_positions():
    from diffexport.inputs import needle_task

    got = streams.stream_batches(512, text=None, tokenizer=None, tokens=71 * 10, seq_len=71, batch=4, seed=3)
    assert got.source == "needle-task documents" and len(got.answer_masks) == len(got.batches) == 3
    for ids, mask in zip(got.batches, got.answer_masks):
        asked = ids[:, :-1][mask[:, :-1]]
        assert mask.any(dim=1).all()  # every document asks at least once
        assert ((asked >= needle_task.CITY_FIRST) & (asked < needle_task.NUMBER_FIRST)).all()  # "? CITY" -> number next
        nxt = ids[:, 1:][mask[:, :-1]]
        assert ((nxt >= needle_task.NUMBER_FIRST) & (nxt < needle_task.FILLER_FIRST)).all()


def test_sweep_reference_point_is_exact_and_damage_grows():
    model = build_model(CONFIGS["transformer"], seed=8)
    points = sweep.sweep(model, [16, 8, 3], [_ids(97, length=40)], task_eval=lambda quant, attention: float(quant.bits))
    assert [p.bits for p in points] == [16, 8, 3]
    assert points[0].cosine_mean == pytest.approx(1.0, abs=1e-6) and points[0].kl_mean == pytest.approx(0, abs=1e-9)
    assert points[1].kl_mean < points[2].kl_mean and points[2].cosine_min <= points[1].cosine_min
    assert [p.task_accuracy for p in points] == [16.0, 8.0, 3.0]
    only_some = torch.zeros(2, 40, dtype=torch.bool)
    only_some[0, 7] = only_some[1, 30] = True
    masked = sweep.sweep(model, [16, 3], [_ids(97, length=40)], masks=[only_some])
    assert masked[0].kl_mean == pytest.approx(0, abs=1e-9) and masked[1].kl_mean != points[2].kl_mean
    with pytest.raises(DiffExportError, match="no positions"):
        sweep.sweep(model, [8], [_ids(97, length=40)], masks=[torch.zeros(2, 40, dtype=torch.bool)])
    with pytest.raises(DiffExportError, match="2 to 16"):
        sweep.sweep(model, [8, 1], [_ids(97)])


def test_stats_cli_json_on_a_checkpoint_and_a_preset(tmp_path):
    ckpt = save_checkpoint(build_model(CONFIGS["transformer"], seed=9), tmp_path / "base.pt")
    out = cli_main("stats", str(ckpt), "--preset", "diff-v1-tiny", "--tokens", "512", "--seq-len", "64", "--json")
    assert out.returncode == 0, out.stderr
    data = json.loads(out.stdout)
    assert set(data) == {"base", "diff-v1-tiny"}
    assert data["base"]["family"] == "transformer" and data["diff-v1-tiny"]["stream"] == "needle-task documents"
    assert data["base"]["stream"] == "uniform random token ids"  # vocab 97 cannot hold the task
    assert data["base"]["attention_logits"]["overall"]["top1"] > 0


@pytest.mark.parametrize("argv, message", [
    (["quant-sweep", "--bits", "8", "1"], "2 to 16"),
    (["quant-sweep", "--bits", "17"], "2 to 16"),
    (["retrieval", "--logit-bits", "0"], "2 to 16"),
    (["stats", "--plot", "out.svg"], "must end in .png"),
    (["stats", "--plot", "no/such/dir/p.png"], "does not exist"),
    (["retrieval", "--needles", "2", "--queries", "1", "--context", "5"], "cannot hold"),
])
def test_analysis_cli_bad_values_one_line(argv, message):
    assert_one_line_error(cli_main(*argv), message)


def test_kernel_attention_is_chosen_only_where_it_applies():
    """quant-sweep --attention: auto falls back to the torch reference and says why; kernel refuses
    with the same reason (the model's family, head dim, scheme, bits, device)."""
    from diffexport.analysis import fused

    d64 = build_model(DiffV1Config(vocab_size=97, d_model=128, n_layers=1, n_heads=2, n_kv_heads=1, head_dim=64))
    reasons = {
        "transformer": fused.kernel_unsupported(build_model(CONFIGS["transformer"])),
        "head dim": fused.kernel_unsupported(build_model(CONFIGS["diff_v1"])),
        "scheme": fused.kernel_unsupported(d64, LogitQuant(8, "logits")),
        "bits": fused.kernel_unsupported(d64, LogitQuant(12)),
    }
    assert "DIFF attention only" in reasons["transformer"] and "head_dim 64 or 128" in reasons["head dim"]
    assert "scheme qk" in reasons["scheme"] and "2..8 bits" in reasons["bits"]
    assert fused.kernel_unsupported(d64, LogitQuant(4)) is None
    assert fused.kernel_unsupported(d64, LogitQuant(16)) is None
    cpu = torch.device("cpu")
    attention, why = fused.choose("auto", d64, [LogitQuant(8)], cpu)
    assert attention.name == "reference" and "CUDA tensors" in why
    attention, why = fused.choose("auto", d64, [LogitQuant(12)], cpu)
    assert attention.name == "reference" and "2..8 bits" in why
    with pytest.raises(DiffExportError, match="--attention kernel: the fused kernel runs on CUDA"):
        fused.choose("kernel", d64, [LogitQuant(8)], cpu)
    assert fused.choose("reference", d64, [LogitQuant(8)], cpu)[0] is fused.REFERENCE
    with pytest.raises(DiffExportError, match="unknown attention"):
        fused.Attention("flash")
    with pytest.raises(DiffExportError, match="head_dim 64 or 128"):
        fused.FusedAttention(build_model(CONFIGS["diff_v1"]), LogitQuant(8))


def test_quant_sweep_cli_refuses_the_kernel_where_it_cannot_run():
    """What needs no model (bits, scheme, device) is refused before any model loads."""
    assert_one_line_error(cli_main("quant-sweep", "--attention", "kernel", "--bits", "12"),
                          "--attention kernel: the INT8-logits kernel takes 2..8 bits")
    assert_one_line_error(cli_main("quant-sweep", "--attention", "kernel", "--scheme", "logits"),
                          "--attention kernel: the fused kernel quantises Q and K (scheme qk)")
    assert_one_line_error(cli_main("quant-sweep", "--attention", "kernel", "--device", "cpu"),
                          "--attention kernel: the fused kernel runs on CUDA tensors")
    auto = cli_main("quant-sweep", "--bits", "8", "--tokens", "256", "--seq-len", "64", "--json")
    assert auto.returncode == 0, auto.stderr
    assert "attention torch reference (the fused kernel supports head_dim" in auto.stderr
    assert {p["attention"] for p in json.loads(auto.stdout)["models"]["diff-v1-tiny"]} == {"reference"}
    if not torch.cuda.is_available():
        assert_one_line_error(cli_main("quant-sweep", "--device", "cuda"), "--device cuda: torch sees no CUDA device")
        assert_one_line_error(cli_main("retrieval", "--device", "cuda"), "--device cuda")


@pytest.mark.slow
def test_analysis_cli_refuses_empty_text_and_foreign_checkpoints(tmp_path):
    empty = tmp_path / "empty.txt"
    empty.write_text("")
    assert_one_line_error(cli_main("stats", "--text", str(empty)), "is empty")
    gpt2 = tmp_path / "gpt2"
    gpt2.mkdir()
    (gpt2 / "config.json").write_text(json.dumps({"model_type": "gpt2"}))
    assert_one_line_error(cli_main("stats", str(gpt2)), "not a DIFF model")
    other = tmp_path / "other.pt"
    torch.save({"format": "diffexport.modeling.checkpoint", "format_version": 1, "family": "mamba", "config": {},
                "state_dict": {}}, other)
    assert_one_line_error(cli_main("quant-sweep", str(other)), "not a supported model family")


def test_checkpoint_carries_its_training_task(tmp_path):
    from diffexport.modeling.checkpoint import load_model

    model = build_model(CONFIGS["diff_v1"], seed=10)
    with_task = save_checkpoint(model, tmp_path / "a.pt", task={"name": "needles", "context_len": 64})
    without = save_checkpoint(model, tmp_path / "b.pt")
    assert load_model(with_task).task == {"name": "needles", "context_len": 64}
    assert load_model(without).task is None


@pytest.mark.slow
def test_cli_writes_each_plot_as_png(tmp_path):
    pytest.importorskip("matplotlib")
    runs = {
        "stats": ["stats", "--tokens", "256", "--seq-len", "64"],
        "sweep": ["quant-sweep", "--bits", "8", "4", "--tokens", "256", "--seq-len", "64"],
        "retrieval": ["retrieval", "--needles", "1", "2", "--queries", "1", "--depths", "0", "100", "--samples", "2",
                      "--context", "32"],
    }
    for name, argv in runs.items():
        out = cli_main(*argv, "--plot", tmp_path / f"{name}.png")
        assert out.returncode == 0, out.stderr
        # no checkpoint: the results describe random weights, and the tool says so first
        assert "note: no checkpoint given: these results are for preset diff-v1-tiny with random weights" in out.stderr
        data = (tmp_path / f"{name}.png").read_bytes()
        assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 5000
    assert sorted(p.name for p in tmp_path.iterdir()) == ["retrieval.png", "stats.png", "sweep.png"]  # no temp files


def test_text_through_a_local_tokenizer(tmp_path):
    """--tokenizer: a Hugging Face tokenizer folder (built here, word level, no download)."""
    pytest.importorskip("transformers")
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    words = Tokenizer(models.WordLevel({"[UNK]": 0, "hello": 5, "world": 7, "the": 90}, unk_token="[UNK]"))
    words.pre_tokenizer = pre_tokenizers.Whitespace()
    PreTrainedTokenizerFast(tokenizer_object=words, unk_token="[UNK]").save_pretrained(tmp_path / "tok")
    text = tmp_path / "t.txt"
    text.write_text("hello world the moon")
    assert streams.text_ids(str(text), str(tmp_path / "tok"), 512) == [5, 7, 90, 0]
    with pytest.raises(DiffExportError, match="not this model's tokenizer"):
        streams.text_ids(str(text), str(tmp_path / "tok"), 50)
    with pytest.raises(DiffExportError, match="cannot load tokenizer"):
        streams.text_ids(str(text), str(tmp_path / "missing"), 512)


def test_a_tokenizer_folders_own_code_never_runs(tmp_path, monkeypatch):
    """A tokenizer folder whose tokenizer_config.json maps AutoTokenizer to a Python file in the
    folder (auto_map): refused in one line, the file never imported, even where transformers would
    ask whether to run it and the user would say yes."""
    pytest.importorskip("transformers")
    import json

    folder = tmp_path / "tok"
    folder.mkdir()
    marker = tmp_path / "ran"
    (folder / "evil.py").write_text(f"open({str(marker)!r}, 'w').write('x')\nclass EvilTokenizer: pass\n")
    (folder / "tokenizer_config.json").write_text(json.dumps({"auto_map": {"AutoTokenizer": ["evil.EvilTokenizer",
                                                                                           None]}}))
    monkeypatch.setattr("builtins.input", lambda *_: "y")  # a user at a terminal who answers yes, if asked
    text = tmp_path / "t.txt"
    text.write_text("hello world")
    with pytest.raises(DiffExportError, match="cannot load tokenizer"):
        streams.text_ids(str(text), str(folder), 512)
    assert not marker.exists()


@pytest.mark.slow
def test_quant_sweep_on_a_task_checkpoint_compares_answers_and_reports_accuracy(tmp_path):
    from diffexport.modeling.presets import preset_config

    ckpt = save_checkpoint(build_model(preset_config("diff-v1-tiny"), seed=11), tmp_path / "task.pt",
                           task={"name": "needles", "context_len": 32})
    out = cli_main("quant-sweep", ckpt, "--bits", "6", "--tokens", "400", "--samples", "2", "--json")
    assert out.returncode == 0, out.stderr
    assert "answer positions" in out.stderr
    points = json.loads(out.stdout)["models"]["task"]
    assert [p["bits"] for p in points] == [16, 6] and all(p["task_accuracy"] is not None for p in points)
    text = tmp_path / "t.txt"
    text.write_text("some text " * 100)
    assert_one_line_error(cli_main("quant-sweep", ckpt, "--text", text, "--positions", "answers"),
                          "needs the built-in needle-task stream")
    auto = cli_main("quant-sweep", ckpt, "--text", text, "--bits", "8", "--samples", "1", "--seq-len", "64")
    assert auto.returncode == 0 and "every position" in auto.stderr, auto.stderr


def test_sweep_plot_kl_axis_is_readable():
    """The KL panel: a labelled tick every decade between the floor (drawn as 0) and the largest value."""
    pytest.importorskip("matplotlib")
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from diffexport.analysis import plots

    values = [0.0, 3e-7, 4e-5, 2e-3]
    floor = plots.kl_floor(values)
    assert floor == pytest.approx(3e-8)
    fig, ax = plt.subplots()
    ax.plot([16, 8, 6, 4], [max(v, floor) for v in values])
    plots.format_kl_axis(ax, floor)
    fig.canvas.draw()
    low, high = ax.get_ylim()
    labels = [t.get_text() for t in ax.get_yticklabels() if low <= t.get_position()[1] <= high and t.get_text()]
    plt.close(fig)
    assert len(labels) >= 4, labels
    assert "1e-03" in labels and "1e-06" in labels
