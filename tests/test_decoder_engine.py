"""A decoder folder's TensorRT engine: built natively by TensorRT-RTX on the CPU with profiles over the
cache, stepped by EngineDecoder as the folder's check steps the folder, and generated through; the
engine's own run needs a GPU, so its runner is the folder's graph in onnxruntime behind the engine's
interface (these tests prove the stepping and the comparison around it, not an engine)."""


import json
import re

import numpy as np
import pytest
import torch

onnx = pytest.importorskip("onnx")
pytest.importorskip("onnxruntime")

from decoder_helpers import PROMPT, text_perplexity  # noqa: E402
from helpers import (  # noqa: E402
    assert_one_line_error,
    cli_main,
    quiet,
)

from diffexport.backends import step_loop  # noqa: E402
from diffexport.core import contract  # noqa: E402
from diffexport.core.eager_generation import BeamSearch, Sampling  # noqa: E402
from diffexport.format.decoder_folder import cache_width  # noqa: E402
from diffexport.modeling.checkpoint import load_model  # noqa: E402
from diffexport.validation.options import CheckOptions  # noqa: E402

pytestmark = pytest.mark.slow  # exports, emulation or training: see README (quick loop)


def test_trt_rtx_builds_the_kv_cache_folder_natively(v1_folder, tmp_path):
    pytest.importorskip("tensorrt_rtx")
    engine = tmp_path / "kv.engine"
    result = cli_main("trt", v1_folder, "-o", engine, "--attention", "native", "--builder", "tensorrt-rtx",
                     "--max", "2x64", "--max-past", "256")
    assert result.returncode == 0, result.stderr
    assert "2 DiffAttention nodes -> native" in result.stdout
    record = json.loads((tmp_path / "kv.engine.json").read_text())
    assert record["profile"]["max_past"] == 256 and record["onnx_metadata"]["kv_cache"] == "1"
    too_long = cli_main("trt", v1_folder, "-o", tmp_path / "x.engine", "--attention", "native", "--builder",
                       "tensorrt-rtx", "--max", "1x64", "--max-past", "2000")
    assert_one_line_error(too_long, "exceeds the context length 2048")
    longer_than_context = cli_main("trt", v1_folder, "-o", tmp_path / "x.engine", "--max", "1x100000")
    assert_one_line_error(longer_than_context, "--max sequence 100000 exceeds the folder's context length 2048")


def test_profile_ranges_of_a_kv_graph_and_plugin_refusal(v1_folder):
    from diffexport.backends.tensorrt import EngineOptions, _profile_shapes, prepare_graph

    model = onnx.load(str(v1_folder / "model.onnx"))
    options = EngineOptions(min_shape=(1, 1), opt_shape=(1, 1), max_shape=(2, 32), opt_past=100, max_past=500)
    shapes = _profile_shapes(model, options)
    assert shapes["input_ids"] == ((1, 1), (1, 1), (2, 32))
    assert shapes["attention_mask"] == ((1, 1), (1, 101), (2, 532))
    width = shapes["past_key_values.0.key"][0][3]
    assert shapes["past_key_values.0.key"] == ((1, 1, 0, width), (1, 1, 100, width), (2, 1, 500, width))
    staged, count = prepare_graph(model, EngineOptions(attention="plugin"))
    nodes = [n for n in staged.graph.node if n.op_type == contract.OP_NAME]
    assert count == 2 and all(len(n.input) == 6 for n in nodes)
    assert [a.s.decode() for n in nodes for a in n.attribute if a.name == "plugin_version"] == ["2", "2"]
    assert not staged.functions  # no body to import instead of the plugin


class _OrtAsEngine:
    """The folder's own graph in onnxruntime behind EngineRunner's interface (call, input_shapes,
    input_dtypes): running the engine itself needs TensorRT and a GPU, neither of which is here, so
    these tests prove the stepping and the comparison around it, not an engine."""

    def __init__(self, model_path, corrupt_cache=False):
        import onnxruntime as ort

        self.session = ort.InferenceSession(str(model_path), providers=["CPUExecutionProvider"])
        types = {"tensor(float)": np.float32, "tensor(float16)": np.float16, "tensor(int64)": np.int64}
        inputs = self.session.get_inputs()
        self.input_shapes = {i.name: tuple(d if isinstance(d, int) else -1 for d in i.shape) for i in inputs}
        self.input_dtypes = {i.name: types[i.type] for i in inputs}
        self.outputs = [o.name for o in self.session.get_outputs()]
        self.corrupt_cache, self.calls = corrupt_cache, []

    def __call__(self, feeds):
        self.calls.append({name: (value.shape, value.dtype) for name, value in feeds.items()})
        got = self.session.run(self.outputs, {n: np.asarray(feeds[n]).astype(t) for n, t in self.input_dtypes.items()})
        out = {name: value.astype(np.float32) for name, value in zip(self.outputs, got)}
        if self.corrupt_cache:  # an engine that loses the oldest cached token at every step
            for name in self.outputs[1:]:
                out[name][:, :, 0] = 0
        return out


@pytest.fixture(scope="module")
def kv_engine(v1_folder, tmp_path_factory):
    pytest.importorskip("tensorrt_rtx")
    engine = tmp_path_factory.mktemp("kvengine") / "kv.engine"
    result = cli_main("trt", v1_folder, "-o", engine, "--attention", "native", "--builder", "tensorrt-rtx",
                     "--max", "3x64", "--max-past", "64")
    assert result.returncode == 0, result.stderr
    return engine


def _engine_check(engine, folder, loaded, tmp_path, runner, steps=12, text=None, max_sequence=None, beams=None):
    from diffexport.backends.tensorrt import EngineDecoder, read_engine_record
    from diffexport.format.metadata import check_export_metadata
    from diffexport.validation.decoder import decode_check as _decode_check
    from diffexport.validation.options import TextIds

    record = read_engine_record(engine)
    stepper = EngineDecoder(engine, record, check_export_metadata(record["onnx_metadata"], engine), runner)
    stepper.max_sequence = max_sequence or stepper.max_sequence
    options = CheckOptions(save_dir=tmp_path / "c", text=None if text is None else str(text), beams=beams)
    return _decode_check(stepper, engine.name, "onnxruntime standing in for the engine", "engine", ["polygraphy run"],
                         loaded, options, tmp_path / "c", quiet, steps, device="cpu",
                         text=None if text is None else TextIds(options, loaded.config.vocab_size, 2))


def test_engine_decoder_steps_an_engine_as_the_folder_check_does(kv_engine, v1_folder, v1_ckpt, tmp_path):
    loaded = load_model(v1_ckpt)
    runner = _OrtAsEngine(v1_folder / "model.onnx")
    report = _engine_check(kv_engine, v1_folder, loaded, tmp_path, runner)
    assert report.passed, report.text()
    assert "greedy tokens engine == eager at 13/13 steps  PASS" in report.text()
    prefill, first, last = runner.calls[0], runner.calls[1], runner.calls[-1]
    assert prefill["past_key_values.0.key"][0] == (3, 1, 0, cache_width(loaded.config))  # the empty past
    assert first["input_ids"][0] == (3, 1) and first["past_key_values.1.value"][0][2] == 16
    assert last["attention_mask"][0] == (3, 16 + 12) and first["past_key_values.0.key"][1] == np.float32
    inputs = json.loads((tmp_path / "c" / "inputs.json").read_text())
    assert len(inputs) == 2  # polygraphy gets the prefill and the first decode step

    broken = _engine_check(kv_engine, v1_folder, loaded, tmp_path, _OrtAsEngine(v1_folder / "model.onnx", True))
    assert not broken.passed and "FAIL" in broken.text()

    # --text: windows of the engine's context (max past 64 + 1), each prefill in calls of its longest sequence
    text = tmp_path / "t.txt"
    text.write_text("an engine should predict this text as its folder does. " * 3)  # 165 bytes: 65, 65 and 35
    runner = _OrtAsEngine(v1_folder / "model.onnx")
    report = _engine_check(kv_engine, v1_folder, loaded, tmp_path, runner, steps=2, text=text, max_sequence=8)
    assert report.passed, report.text()
    assert "text          165 tokens in 3 window(s) of up to 65, 6 comparisons" in report.text()
    one_row = [call for call in runner.calls if call["input_ids"][0][0] == 1]
    assert max(call["input_ids"][0][1] for call in one_row) == 8  # prefill chunks of 8 (32 = 4 x 8)
    assert max(call["attention_mask"][0][1] for call in one_row) == 65  # within the profile's past
    expected, _ = text_perplexity(loaded.model.eval(), list(text.read_bytes()), 65)
    line = next(x for x in report.text().splitlines() if x.startswith("perplexity"))
    assert float(re.search(r"engine ([0-9.e+]+)", line).group(1)) == pytest.approx(expected, rel=1e-4)

    # --num-beams: the engine loop's beam search (every beam a row, within the profile's batch 3)
    # against eager's; no genai search here, and no end ids (the engine is checked without its folder)
    runner = _OrtAsEngine(v1_folder / "model.onnx")
    report = _engine_check(kv_engine, v1_folder, loaded, tmp_path, runner, steps=6, beams=BeamSearch(3, 2))
    assert report.passed, report.text()
    assert "beam hypotheses engine == eager: 6/6  PASS" in report.text()  # 3 prompts x 2 hypotheses
    assert "genai" not in report.text()
    assert max(call["input_ids"][0][0] for call in runner.calls) == 3  # the beams, batched
    broken = _engine_check(kv_engine, v1_folder, loaded, tmp_path, _OrtAsEngine(v1_folder / "model.onnx", True),
                           steps=6, beams=BeamSearch(3, 2))
    assert re.search(r"beam hypotheses engine == eager: [0-5]/6; worst score gap under eager .* FAIL", broken.text())


def v1_folder_model(engine):
    """The graph the engine was built from (its record names it)."""
    return json.loads(engine.with_name(engine.name + ".json").read_text())["onnx"]


def test_engine_check_of_a_decoder_refuses_before_the_gpu(kv_engine, v1_folder, v1_ckpt, tmp_path):
    # --shapes sizes single graphs: a decoder (folder or engine) would not use it, so it is refused
    for decoder in (kv_engine, v1_folder):
        assert_one_line_error(cli_main("check", decoder, "--ckpt", v1_ckpt, "--shapes", "2x9"),
                              "--shapes sizes the calls to a single graph; a KV-cache decoder is checked on 3")
    # the profile is held against the calls the check will make before anything runs
    assert_one_line_error(cli_main("check", kv_engine, "--ckpt", v1_ckpt, "--steps", "60"),
                          "past 75 is outside kv.engine's profile (batch 1..3, sequence 1..64, past 0..64)")
    assert_one_line_error(cli_main("check", kv_engine, "--ckpt", v1_ckpt, "--steps", "-1"), "--steps must be")
    assert_one_line_error(cli_main("check", v1_folder_model(kv_engine), "--ckpt", v1_ckpt, "--steps", "4"),
                          "is a single graph: use --shapes")  # --steps is not silently ignored on one graph
    if not torch.cuda.is_available():
        assert_one_line_error(cli_main("check", kv_engine, "--ckpt", v1_ckpt, "--steps", "8"), "needs an NVIDIA GPU")
    record = kv_engine.with_name("kv.engine.json")
    saved = record.read_text()
    try:
        edited = json.loads(saved)
        del edited["profile"]["max_past"]
        record.write_text(json.dumps(edited))
        assert_one_line_error(cli_main("check", kv_engine, "--ckpt", v1_ckpt), "has no valid KV-cache profile")
    finally:
        record.write_text(saved)


def test_generate_through_a_decoder_engine(kv_engine, v1_folder, monkeypatch, tmp_path):
    """`generate --backend tensorrt`: the engine's runner in the onnxruntime loop, its context bounded by the
    profile's past length (the engine stood in for by onnxruntime, as above)."""
    from diffexport.backends import tensorrt

    monkeypatch.setattr(tensorrt, "open_engine", lambda data, module, lib=None: _OrtAsEngine(v1_folder / "model.onnx"))
    runner = tensorrt.open_decoder_engine(kv_engine, v1_folder)
    assert runner.context == 65 and runner.config["model"]["eos_token_id"] == 511  # --max-past 64
    run = step_loop.generate_stepped(v1_folder, PROMPT, 100, Sampling(), runner=runner, ignore_eos=True)
    plain = step_loop.generate_stepped(v1_folder, PROMPT, 100, Sampling(), ignore_eos=True)
    assert len(run.tokens) == 65 - len(PROMPT) and run.tokens == plain.tokens[:len(run.tokens)]
    runner.max_sequence = 3  # a prompt longer than the profile's sequence goes in chunks of 3, 3 and 1
    runner._run.calls.clear()
    chunked = step_loop.generate_stepped(v1_folder, PROMPT, 20, Sampling(), runner=runner, ignore_eos=True)
    assert [c["input_ids"][0] for c in runner._run.calls[:4]] == [(1, 3), (1, 3), (1, 1), (1, 1)]
    assert runner._run.calls[2]["attention_mask"][0] == (1, 7) and chunked.tokens == plain.tokens[:20]
    monkeypatch.undo()
    assert_one_line_error(cli_main("generate", v1_folder, "--ids", "1,2", "--backend", "tensorrt"),
                          "give both --backend tensorrt and --engine")
    assert_one_line_error(cli_main("generate", v1_folder, "--ids", "1,2", "--backend", "tensorrt", "--engine",
                                  tmp_path / "missing.engine"), "missing.engine does not exist")
    (tmp_path / "bad.engine").write_bytes(b"not an engine")  # an engine without its record is refused unread
    assert_one_line_error(cli_main("generate", v1_folder, "--ids", "1,2", "--backend", "tensorrt", "--engine",
                                  tmp_path / "bad.engine"), "no bad.engine.json beside")
    other = tmp_path / "v2"
    assert cli_main("onnx", "--preset", "diff-v2-tiny", "--kv-cache", "-o", other).returncode == 0
    assert_one_line_error(cli_main("generate", other, "--ids", "1,2", "--backend", "tensorrt", "--engine", kv_engine),
                          "was built from another model than v2")
    if not torch.cuda.is_available():
        assert_one_line_error(cli_main("generate", v1_folder, "--ids", "1,2", "--backend", "tensorrt", "--engine",
                                      kv_engine), "needs an NVIDIA GPU")
