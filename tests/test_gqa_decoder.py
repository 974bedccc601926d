"""`diffexport onnx --kv-cache --attention gqa`: DiffAttention rewritten as onnxruntime's
GroupQueryAttention (passes/group_query_attention.py). The rewritten folder must compute what the
DiffAttention folder computes, everywhere (left-padded rows, chunks after the prompt, V1 and V2,
fp16), decode token for token in onnxruntime-genai's shared buffer, quantise, and refuse what it
cannot rewrite."""

import json
import shutil

import numpy as np
import pytest
import torch

onnx = pytest.importorskip("onnx")
pytest.importorskip("onnxruntime")

from helpers import assert_one_line_error, cli_main, perturb_norm_weights, quiet  # noqa: E402

from diffexport.backends import genai, step_loop  # noqa: E402
from diffexport.core import contract  # noqa: E402
from diffexport.core.eager_generation import Sampling, generate, pad_batch  # noqa: E402
from diffexport.core.errors import DiffExportError  # noqa: E402
from diffexport.export import ExportOptions  # noqa: E402
from diffexport.format import decoders  # noqa: E402
from diffexport.format.decoder_folder import read_decoder_folder  # noqa: E402
from diffexport.modeling.checkpoint import load_model, save_safetensors  # noqa: E402
from diffexport.modeling.families import build_model  # noqa: E402
from diffexport.modeling.presets import preset_config  # noqa: E402
from diffexport.passes.decoder_formats import export_decoder  # noqa: E402
from diffexport.passes.group_query_attention import rewrite_decoder  # noqa: E402
from diffexport.validation.decoder import run_decoder_check  # noqa: E402
from diffexport.validation.inspect_onnx import inspect_onnx  # noqa: E402
from diffexport.validation.options import CheckOptions  # noqa: E402

pytestmark = pytest.mark.slow  # exports: see README (quick loop)

PROMPT = [5, 17, 42, 99, 3, 250, 7]


@pytest.fixture(scope="module")
def v1_pair(artifacts):
    """(checkpoint, DiffAttention folder, GQA folder) of a V1 model with 4 diff-heads on 2 kv-groups."""
    summary = artifacts.decoder_summary("diff-v1-gqa", "gqa")
    assert (summary.attention, summary.cache_heads, summary.diff_attention_nodes) == ("gqa", 4, 2)
    assert "GroupQueryAttention" in summary.report()
    return (artifacts.checkpoint("diff-v1-gqa"), artifacts.decoder("diff-v1-gqa"),
            artifacts.decoder("diff-v1-gqa", "gqa"))


def test_gqa_folder_graph_cache_and_genai_config(v1_pair):
    _, _, folder = v1_pair
    model = onnx.load(str(folder / "model.onnx"))
    assert not [n for n in model.graph.node if n.domain == contract.ONNX_DOMAIN] and not model.functions
    gqa = [n for n in model.graph.node if n.op_type == "GroupQueryAttention"]
    assert len(gqa) == 2 and all(n.domain == "com.microsoft" for n in gqa)
    attrs = {a.name: onnx.helper.get_attribute_value(a) for a in gqa[0].attribute}
    # 8 query maps over the 2 kv-groups' 2 keys each, head size D = 16, the op's scale 1/sqrt(D); the
    # probabilities out (qk_output) for the other value half
    assert (attrs["num_heads"], attrs["kv_num_heads"], attrs["qk_output"]) == (8, 4, 2)
    assert attrs["scale"] == pytest.approx(0.25)
    dims = {v.name: [d.dim_param or d.dim_value for d in v.type.tensor_type.shape.dim]
            for v in list(model.graph.input) + list(model.graph.output)}
    assert dims["past_key_values.0.key"] == ["batch", 4, "past_sequence", 16]
    assert dims["present.1.value"] == ["batch", 4, "total_sequence", 16]
    config = json.loads((folder / "genai_config.json").read_text())
    assert (config["model"]["decoder"]["num_key_value_heads"], config["model"]["decoder"]["head_size"]) == (4, 16)
    assert config["search"]["past_present_share_buffer"] is True
    meta = {p.key: p.value for p in model.metadata_props}
    assert meta["diffexport.attention"] == "gqa" and meta["diffexport.kv_cache"] == "1"
    # rotary inside GQA: the rotate-half nodes and the positions' Cos/Sin are gone, the caches hold
    # the context's positions, D/2 = 8 frequencies (each map a head of its own)
    assert attrs["do_rotary"] == 1 and attrs["rotary_interleaved"] == 0
    assert not [n for n in model.graph.node if n.op_type in ("Cos", "Sin", "CumSum") and not n.name.startswith("gqa/")]
    assert all(n.name.startswith(("gqa/", "packed/")) for n in model.graph.node if n.op_type == "Split")
    # onnxruntime's fused norms (residual adds inside) and packed q/k/v and gate/up projections
    ops = [n.op_type for n in model.graph.node]
    assert ops.count("SkipSimplifiedLayerNormalization") == 4 and ops.count("RMSNormalization") == 3  # 2 heads + final
    assert not {"Pow", "ReduceMean", "Reciprocal"} & set(ops)
    # per layer: q|k|v, out, gate|up, down and the halves' combination; and the head (the other value
    # half's MatMul sits in an If, one per layer)
    assert ops.count("MatMul") == 11 and ops.count("If") == 2
    # the map layout's column moves live in the q|k|v weight: GQA reads the packed projection itself,
    # as the builder's Llama does (key and value inputs empty, no Split); SiLU is QuickGelu
    producers = {o: n for n in model.graph.node for o in n.output}
    for node in gqa:
        assert producers[node.input[0]].op_type == "MatMul" and node.input[1] == node.input[2] == ""
    assert ops.count("QuickGelu") == 2 and "Sigmoid" not in ops
    inits = {t.name: t for t in model.graph.initializer}
    assert [list(inits[gqa[0].input[i]].dims) for i in (7, 8)] == [[2048, 8], [2048, 8]]
    runtimes = inspect_onnx(folder / "model.onnx")["runtimes"]  # what `diffexport inspect` prints
    assert "GroupQueryAttention" in runtimes["onnxruntime"] and runtimes["tensorrt_native"].startswith("no")


def _steps(folder, rows, chunks, right_padded=frozenset()):
    """Logits of a padded batch (left, or right for the rows in right_padded, as onnxruntime-genai
    pads): the prompt, then `chunks` (token counts) fed in turn."""
    runner = step_loop.OrtDecoder(folder)
    ids, mask = (t.numpy() for t in pad_batch(rows, pad_token_id=0, right_padded=right_padded))
    cache = runner.empty_cache(len(rows))
    out = []
    rng = np.random.default_rng(3)
    for size in [None, *chunks]:
        if size is not None:
            ids = rng.integers(1, 500, (len(rows), size))
            mask = np.concatenate([mask, np.ones((len(rows), size), np.int64)], axis=1)
        logits, cache = runner.step(ids, mask, cache)
        out.append(logits)
    return out


def test_gqa_folder_equals_the_diffattention_folder_everywhere(v1_pair):
    """Every logit, padded rows included (the contract gives a row that sees no key zeros; GQA alone
    would average the masked keys), over decode steps and multi-token chunks after the prompt, with
    left- and right-padded rows (right: padding between prompt and answer, as genai pads a batch;
    GQA's own rotary positions, the cache slots, would put the padding between them)."""
    _, diff, gqa = v1_pair
    rows = [PROMPT, PROMPT[:3], PROMPT[2:], [9], PROMPT[:2], PROMPT[1:5]]
    chunks = [1, 1, 3, 1, 2, 1]
    for a, b in zip(_steps(diff, rows, chunks, {4, 5}), _steps(gqa, rows, chunks, {4, 5})):
        assert np.isfinite(b).all()
        np.testing.assert_allclose(b, a, atol=2e-5, rtol=0)


def test_gqa_rotary_left_in_the_graph_computes_the_same(v1_pair, tmp_path):
    """The rewrite without a context length (or with rotary nodes it does not recognise) keeps the
    graph's own rotary nodes; that graph too equals the DiffAttention folder everywhere."""
    _, diff, gqa = v1_pair
    model = onnx.load(str(diff / "model.onnx"))
    result = rewrite_decoder(model)
    assert result.rotary.startswith("kept in the graph (no context length")
    tampered = onnx.ModelProto.FromString(model.SerializeToString())
    sub = next(n for n in tampered.graph.node if n.op_type == "Sub" and n.input[0].startswith("mul"))
    sub.input[0], sub.input[1] = sub.input[1], sub.input[0]  # b*sin - a*cos: not the rotation GQA does
    assert rewrite_decoder(tampered, rotary_positions=64).rotary.startswith("kept in the graph (")
    shutil.copytree(gqa, tmp_path / "kept")
    for prop in result.model.metadata_props:  # a gqa folder's graph says so (the folder's genai config shares buffers)
        if prop.key == "diffexport.attention":
            prop.value = "gqa"
    onnx.save(result.model, str(tmp_path / "kept" / "model.onnx"))
    assert [a.i for a in next(n for n in result.model.graph.node if n.op_type == "GroupQueryAttention").attribute
            if a.name == "do_rotary"] == [0]
    rows, chunks = [PROMPT, PROMPT[:3], [9], PROMPT[1:4]], [1, 2, 1]
    for a, b in zip(_steps(diff, rows, chunks, {3}), _steps(tmp_path / "kept", rows, chunks, {3})):
        np.testing.assert_allclose(b, a, atol=2e-5, rtol=0)


def test_generation_stops_at_the_context_length(tmp_path):
    """The rotary caches hold the context's positions: both runners stop where genai's max_length does,
    and a step past the context is refused in one line, not by onnxruntime."""
    pytest.importorskip("onnxruntime_genai")
    loaded = load_model(None, preset="diff-v1-tiny", seed=2)
    export_decoder(loaded, tmp_path / "kv", attention="gqa", context_length=16, log=quiet)
    prompt = list(range(1, 10))
    ort = step_loop.generate_stepped(tmp_path / "kv", prompt, 20, Sampling(), ignore_eos=True)
    assert len(ort.tokens) == 16 - len(prompt) and ort.stop == "length"
    genai_run = genai.generate_genai(tmp_path / "kv", prompt, 20, Sampling(), min_new_tokens=20)
    assert genai_run.tokens == ort.tokens and genai_run.stop == "length"
    runner = step_loop.OrtDecoder(tmp_path / "kv")
    with pytest.raises(DiffExportError, match="exceed the folder's context length 16"):
        runner.step(np.ones((1, 17), np.int64), np.ones((1, 17), np.int64), runner.empty_cache(1))
    with pytest.raises(DiffExportError, match="prompt's 17 tokens exceed"):
        genai.generate_genai(tmp_path / "kv", list(range(1, 18)), 4, Sampling())
    for backend in ("genai", "onnxruntime"):  # the CLI: one line, exit 2
        assert_one_line_error(cli_main("generate", tmp_path / "kv", "--ids", ",".join(map(str, range(1, 18))),
                                      "--backend", backend), "exceeds the context length 16")


def test_the_export_layer_needs_the_formats_pass_handed_in(tmp_path):
    """export.decoder cannot import passes (they sit above it): a gqa folder asked of it without the
    pass is refused in one line before anything is traced or written; a pass handed to a format
    that has none is refused too. passes.decoder_formats hands in the registry's pass."""
    from diffexport.export import decoder
    from diffexport.passes import decoder_formats, group_query_attention

    loaded = load_model(None, preset="diff-v1-tiny", seed=2)
    with pytest.raises(DiffExportError, match="written by a pass after the export: call diffexport.passes"):
        decoder.export_decoder_graph(loaded, tmp_path / "kv", attention="gqa", log=quiet)
    with pytest.raises(DiffExportError, match="has no post-export rewrite"):
        decoder.export_decoder_graph(loaded, tmp_path / "kv", rewrite=group_query_attention.rewrite_decoder_file,
                                     log=quiet)
    assert not (tmp_path / "kv").exists() and list(tmp_path.iterdir()) == []
    assert decoder_formats.rewrite_for("gqa") is group_query_attention.rewrite_decoder_file
    assert decoder_formats.rewrite_for("diffattention") is None
    assert {f.rewrite for f in decoders.FORMATS.values() if f.rewrite} == set(decoder_formats.REWRITES)


def test_gqa_folder_decodes_in_genai_like_eager(v1_pair):
    pytest.importorskip("onnxruntime_genai")
    ckpt, _, folder = v1_pair
    loaded = load_model(ckpt)
    eos = json.loads((folder / "genai_config.json").read_text())["model"]["eos_token_id"]
    expected = generate(loaded.model.eval(), torch.tensor([PROMPT]), max_new_tokens=36, eos_token_id=eos).tokens[0]
    tokens = genai.generate_genai(folder, PROMPT, 36, Sampling()).tokens
    assert len(tokens) >= 32 and tokens == expected.tolist()
    assert step_loop.generate_stepped(folder, PROMPT, 36, Sampling()).tokens == tokens
    report = run_decoder_check(folder, loaded, CheckOptions(provider="cpu"), log=quiet)
    assert report.passed, report.text()


@pytest.mark.parametrize("preset,dtype", [("diff-v2-tiny", "float32"), ("diff-v1-tiny", "float16")])
def test_gqa_v2_and_fp16_folders_pass_their_check(preset, dtype, tmp_path):
    model = perturb_norm_weights(build_model(preset_config(preset), seed=8), 8)
    save_safetensors(model, tmp_path / "st")
    loaded = load_model(tmp_path / "st", dtype=torch.float16 if dtype == "float16" else None)
    export_decoder(loaded, tmp_path / "kv", ExportOptions(dtype=dtype), attention="gqa", log=quiet)
    report = run_decoder_check(tmp_path / "kv", loaded, CheckOptions(provider="cpu"), log=quiet)
    assert report.passed, report.text()
    assert "33/33" in report.text()


def test_gqa_check_fails_when_the_norm_weight_is_lost(v1_pair, tmp_path):
    """A check that cannot fail is no check: all-ones head norm weights in the rewritten graph."""
    ckpt, _, folder = v1_pair
    shutil.copytree(folder, tmp_path / "broken")
    model = onnx.load(str(tmp_path / "broken" / "model.onnx"))
    for t in model.graph.initializer:
        if "head_norm_weight" in t.name:
            t.CopyFrom(onnx.numpy_helper.from_array(np.ones(onnx.numpy_helper.to_array(t).shape, np.float32), t.name))
    onnx.save(model, str(tmp_path / "broken" / "model.onnx"))
    report = run_decoder_check(tmp_path / "broken", load_model(ckpt), CheckOptions(provider="cpu"), log=quiet)
    assert not report.passed


def test_gqa_cli_quantise_check_generate(tmp_path):
    pytest.importorskip("onnxruntime_genai")
    out = cli_main("onnx", "--preset", "diff-v1-tiny", "--kv-cache", "--attention", "gqa", "-o", tmp_path / "kv")
    assert out.returncode == 0, out.stderr
    assert "GroupQueryAttention" in out.stdout
    q = cli_main("quantize", tmp_path / "kv", "-o", tmp_path / "q", "--weights", "int8")
    assert q.returncode == 0, q.stderr
    check = cli_main("check", tmp_path / "q", "--preset", "diff-v1-tiny")
    assert check.returncode == 0, check.stdout + check.stderr
    text = cli_main("generate", tmp_path / "q", "--ids", "1,2,3", "--max-new-tokens", "4")
    assert text.returncode == 0 and len(text.stdout.split()) == 4, text.stderr


def test_gqa_refusals(v1_pair, tmp_path):
    _, diff, gqa = v1_pair
    assert_one_line_error(cli_main("onnx", "--preset", "transformer-tiny", "--kv-cache", "--attention", "gqa",
                                  "-o", tmp_path / "t"), "baseline Transformer has none")
    assert not (tmp_path / "t").exists()
    assert_one_line_error(cli_main("onnx", "--preset", "diff-v1-tiny", "--attention", "gqa", "-o", tmp_path / "m.onnx"),
                          "belong to --kv-cache exports")
    assert_one_line_error(cli_main("trt", gqa, "-o", tmp_path / "e.engine"), "TensorRT does not have")
    assert_one_line_error(cli_main("optimize", gqa / "model.onnx", "-o", tmp_path / "o.onnx"),
                          "runs its attention as onnxruntime's GroupQueryAttention")
    assert not (tmp_path / "o.onnx").exists()
    model = onnx.load(str(diff / "model.onnx"))
    with pytest.raises(DiffExportError, match="GroupQueryAttention: the graph's inputs"):
        rewrite_decoder(onnx.load(str(gqa / "model.onnx")).__class__())  # an empty graph
    # a cache read by anything besides its attention would see the wrong layout: refused
    tampered = onnx.ModelProto.FromString(model.SerializeToString())
    tampered.graph.node.append(onnx.helper.make_node("Identity", ["present.0.key"], ["extra"]))
    with pytest.raises(DiffExportError, match="read by more than its attention"):
        rewrite_decoder(tampered)
    tampered = onnx.ModelProto.FromString(model.SerializeToString())
    tampered.graph.node.append(onnx.helper.make_node("Identity", ["past_key_values.1.value"], ["extra"]))
    with pytest.raises(DiffExportError, match="only its shape may be read"):
        rewrite_decoder(tampered)
    assert rewrite_decoder(model).layers == 2  # the untouched graph rewrites
    # a V1 folder in the layout before 2026-11-28 (Hkv cache heads of 2D) is named as such
    shutil.copytree(gqa, tmp_path / "old")
    config = json.loads((tmp_path / "old" / "genai_config.json").read_text())
    config["model"]["decoder"].update(num_key_value_heads=2, head_size=32)
    (tmp_path / "old" / "genai_config.json").write_text(json.dumps(config))
    with pytest.raises(DiffExportError, match="before 2026-11-28 .* export it again"):
        read_decoder_folder(tmp_path / "old")


def test_decoder_formats_come_from_one_registry():
    """Everything that differs between decoder formats is an entry of format/decoders.py; the API's
    TensorRT build refuses a format TensorRT lacks before TensorRT is even imported (the CLI's `trt`
    asks the same registry)."""
    import onnx

    from diffexport.backends.tensorrt import EngineOptions, build_engine
    from diffexport.format import decoders

    gqa = decoders.decoder_format("gqa")
    assert (gqa.head_major_cache, gqa.shared_buffer, gqa.tensorrt, "bfloat16" in gqa.dtypes) == (True, True, False,
                                                                                                 False)
    assert decoders.decoder_format(None) is decoders.FORMATS[decoders.DEFAULT]
    assert decoders.cache_heads(gqa, 4) == 4 and decoders.cache_heads(decoders.decoder_format(None), 4) == 1
    with pytest.raises(DiffExportError, match="unknown attention op 'mqa'"):
        decoders.decoder_format("mqa")
    model = onnx.helper.make_model(onnx.helper.make_graph([], "g", [], []))
    onnx.helper.set_model_props(model, {"diffexport.attention": "gqa"})
    with pytest.raises(DiffExportError, match="TensorRT does not have"):
        build_engine(model, EngineOptions(module="no-such-tensorrt"))


def test_the_onnxruntime_loop_is_a_decoder_runner(artifacts):
    """backends/base.py's protocol, which the step loop, the searches and check rely on: the onnxruntime
    loop follows it (the TensorRT engine runner follows it too; no engine runs here)."""
    from diffexport.backends.base import DecoderRunner
    from diffexport.backends.tensorrt import EngineDecoder

    runner = step_loop.OrtDecoder(artifacts.decoder("diff-v1-gqa", "gqa"))
    assert isinstance(runner, DecoderRunner) and runner.max_sequence is None and runner.layers > 0
    cache = runner.empty_cache(2)
    logits, cache = runner.step(np.array([[1, 2], [3, 4]]), np.ones((2, 2), dtype=np.int64), cache)
    assert logits.shape[:2] == (2, 2) and all(v.shape[2] == 2 for v in cache.values())
    assert callable(EngineDecoder.step) and callable(EngineDecoder.empty_cache)
