"""`diffexport quantize --qdq int8|fp8`: calibrated Q/DQ graphs for TensorRT through onnxruntime's
static quantiser, judged against the unquantised model under tolerances.QDQ_BUDGETS, and built
ahead of time with TensorRT-RTX where it is installed."""

import json

import numpy as np
import pytest
from helpers import assert_one_line_error, cli_main

onnx = pytest.importorskip("onnx")
ort = pytest.importorskip("onnxruntime")
pytest.importorskip("onnxruntime.quantization")

pytestmark = pytest.mark.slow  # exports and onnxruntime sessions: see README (quick loop)

WEIGHT_MATMULS = 2 * 7 + 1  # diff-v1-tiny: q, k, v, o, gate, up, down per layer, and the LM head


@pytest.fixture(scope="module")
def exports(artifacts, tmp_path_factory):
    """fp32 at opset 18 (the default) and 19, fp16 at 19 (the session's exports, copied here)."""
    folder = tmp_path_factory.mktemp("qdq")
    for name, flags in (("m18", ()), ("m19", ("--opset", "19")), ("m16", ("--fp16", "--opset", "19"))):
        artifacts.copy(artifacts.cli_output("onnx", "--preset", "diff-v1-tiny", *flags), folder, f"{name}.onnx")
    return folder


def _logits(path, ids):
    session = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    return session.run(["logits"], {"input_ids": ids})[0].astype(np.float64)


def _initializers(model):
    return {t.name: t for t in model.graph.initializer}


@pytest.mark.parametrize("source,fmt", [("m18", "int8"), ("m16", "int8"), ("m19", "fp8")])
def test_qdq_graph_quantises_every_weight_matmul_and_meets_its_budget(exports, tmp_path, source, fmt):
    from diffexport.core.tolerances import QDQ_BUDGETS
    from diffexport.passes.qdq import QDQOptions, quantize_qdq

    src, out = exports / f"{source}.onnx", tmp_path / "q.onnx"
    summary = quantize_qdq(src, out, QDQOptions(format=fmt, calib="synthetic", samples=8, seq_len=64),
                           log=lambda _: None)
    # weights stored in 8 bits (a quarter of fp32, half of fp16); the embedding table stays as it was
    assert summary.quantised == WEIGHT_MATMULS
    assert summary.bytes_after < summary.bytes_before * (0.6 if source == "m16" else 0.4)
    before, after = onnx.load(str(src)), onnx.load(str(out))
    inits = _initializers(after)
    quant_type = onnx.TensorProto.INT8 if fmt == "int8" else onnx.TensorProto.FLOAT8E4M3FN
    float_type = onnx.TensorProto.FLOAT16 if source == "m16" else onnx.TensorProto.FLOAT
    producers = {o: n for n in after.graph.node for o in n.output}
    matmuls = [n for n in after.graph.node if n.op_type == "MatMul"]
    assert len(matmuls) == WEIGHT_MATMULS
    for node in matmuls:
        # both inputs dequantised: the activation through a calibrated Q/DQ pair, the weight stored quantised
        act, weight = producers[node.input[0]], producers[node.input[1]]
        assert act.op_type == weight.op_type == "DequantizeLinear", node.name
        assert producers[act.input[0]].op_type == "QuantizeLinear"
        assert inits[weight.input[0]].data_type == quant_type
        for dq in (act, weight):  # symmetric (zero point 0, as TensorRT requires), scales in the graph's type
            assert inits[dq.input[1]].data_type == float_type
            assert not np.asarray(onnx.numpy_helper.to_array(inits[dq.input[2]]), np.float32).any()
        if fmt == "int8":  # one weight scale per output column
            assert list(inits[weight.input[1]].dims) == [inits[weight.input[0]].dims[1]]
    # the attention is untouched: the same DiffAttention nodes, the same function body, no Q/DQ on them
    diff = [n for n in after.graph.node if n.op_type == "DiffAttention"]
    assert [n.SerializeToString() for n in diff] == [n.SerializeToString() for n in before.graph.node
                                                     if n.op_type == "DiffAttention"]
    assert all(producers[i].op_type != "DequantizeLinear" for n in diff for i in n.input if i in producers)
    assert [f.SerializeToString() for f in after.functions] == [f.SerializeToString() for f in before.functions]
    record = json.loads(next(p.value for p in after.metadata_props if p.key == "diffexport.qdq"))
    assert (record["format"], record["samples"], record["seq_len"], record["quantised"]) == (fmt, 8, 64,
                                                                                              WEIGHT_MATMULS)

    ids = np.random.default_rng(7).integers(0, 512, size=(2, 41), dtype=np.int64)
    ref, got = _logits(src, ids), _logits(out, ids)
    assert np.isfinite(got).all() and not np.array_equal(ref, got)  # changed ...
    log_p = ref - np.logaddexp.reduce(ref, axis=-1, keepdims=True)
    log_q = got - np.logaddexp.reduce(got, axis=-1, keepdims=True)
    assert (np.exp(log_p) * (log_p - log_q)).sum(-1).mean() <= QDQ_BUDGETS[fmt].max_kl  # ... within budget
    report = cli_main("check", out, "--preset", "diff-v1-tiny", "--shapes", "1x9,2x33")
    assert report.returncode == 0, report.stdout + report.stderr
    assert f"budget        {fmt} Q/DQ" in report.stderr and "KL" in report.stdout
    against = cli_main("check", out, "--against", src, "--shapes", "2x17")
    assert against.returncode == 0 and f"{fmt} Q/DQ" in against.stdout + against.stderr, against.stdout + against.stderr


def test_text_calibration_reads_the_text_and_records_it(exports, tmp_path):
    text = tmp_path / "calib.txt"
    text.write_text("Differential attention cancels common-mode noise between two softmax maps. " * 40)
    out = tmp_path / "q.onnx"
    result = cli_main("quantize", exports / "m18.onnx", "-o", out, "--qdq", "int8", "--calib", text,
                     "--calib-samples", "64", "--calib-seq-len", "256")
    assert result.returncode == 0, result.stderr
    record = json.loads(next(p.value for p in onnx.load(str(out), load_external_data=False).metadata_props
                             if p.key == "diffexport.qdq"))
    n_bytes = len(text.read_bytes())
    assert record["samples"] == n_bytes // 256 and "UTF-8 bytes" in record["source"]  # as many as the text holds
    assert "calibrated    on 11 x 256 tokens" in result.stdout


def test_the_budget_fails_a_broken_qdq_graph(exports, tmp_path):
    """The LM head's weight scales negated (a sign error a quantiser could make): the check must FAIL."""
    from onnx import numpy_helper

    from diffexport.passes.qdq import QDQOptions, quantize_qdq

    out = tmp_path / "q.onnx"
    quantize_qdq(exports / "m18.onnx", out, QDQOptions(calib="synthetic", samples=4, seq_len=32), log=lambda _: None)
    model = onnx.load(str(out))
    producers = {o: n for n in model.graph.node for o in n.output}
    head = [n for n in model.graph.node if n.op_type == "MatMul"][-1]  # the LM head comes last
    scales = _initializers(model)[producers[head.input[1]].input[1]]
    scales.CopyFrom(numpy_helper.from_array(-numpy_helper.to_array(scales), scales.name))
    broken = tmp_path / "broken.onnx"
    onnx.save(model, str(broken))
    report = cli_main("check", broken, "--preset", "diff-v1-tiny", "--shapes", "2x33")
    assert report.returncode == 1 and "FAIL" in report.stdout, report.stdout + report.stderr


def test_qdq_graphs_build_with_tensorrt_rtx(exports, tmp_path):
    """Parse and build ahead of time (attention lowered: TensorRT-RTX takes no plugin); FP8 only for
    targets that have FP8 tensor cores."""
    pytest.importorskip("tensorrt_rtx")
    from diffexport.backends.tensorrt import EngineOptions, build_engine
    from diffexport.core.errors import DiffExportError
    from diffexport.passes.qdq import QDQOptions, quantize_qdq

    for source, fmt, targets in (("m16", "int8", ("SM80", "SM89")), ("m19", "fp8", ("SM89",))):
        out = tmp_path / f"{source}-{fmt}.onnx"
        quantize_qdq(exports / f"{source}.onnx", out, QDQOptions(format=fmt, calib="synthetic", samples=4, seq_len=32),
                     log=lambda _: None)
        model = onnx.load(str(out))
        options = EngineOptions(attention="native", module="tensorrt_rtx", targets=targets, progress=False)
        result = build_engine(model, options)
        assert result.engine_bytes > 0 and result.precision == ("fp16" if source == "m16" else "fp32")
    with pytest.raises(DiffExportError, match="FP8 Q/DQ, which needs SM89"):
        build_engine(model, EngineOptions(attention="native", module="tensorrt_rtx", targets=("SM80", "SM89"),
                                          progress=False))


def test_bad_qdq_requests_are_one_line_and_write_nothing(exports, tmp_path):
    m18, m19 = exports / "m18.onnx", exports / "m19.onnx"
    done = tmp_path / "done.onnx"
    assert cli_main("quantize", m18, "-o", done, "--weights", "int8").returncode == 0
    qdq = tmp_path / "qdq.onnx"
    assert cli_main("quantize", m18, "-o", qdq, "--qdq", "int8", "--calib", "synthetic",
                   "--calib-samples", "2", "--calib-seq-len", "16").returncode == 0
    short = tmp_path / "short.txt"
    short.write_text("too short")
    bf16 = tmp_path / "bf16.onnx"
    assert cli_main("onnx", "--preset", "diff-v1-tiny", "--bf16", "--opset", "19", "-o", bf16).returncode == 0
    before = sorted(p.name for p in tmp_path.iterdir())
    x = tmp_path / "x.onnx"
    cases = [
        (("quantize", m18, "-o", x, "--qdq", "int8"), "--qdq needs calibration data"),
        (("quantize", m18, "-o", x, "--qdq", "int8", "--calib", short), "fewer than one calibration sample of 128"),
        (("quantize", m18, "-o", x, "--qdq", "int8", "--calib", tmp_path / "none.txt"), "text file not found"),
        (("quantize", m18, "-o", x, "--qdq", "fp8", "--calib", "synthetic"), "needs opset 19 or newer"),
        (("quantize", exports / "m16.onnx", "-o", x, "--qdq", "fp8", "--calib", "synthetic"), "use --qdq int8"),
        (("quantize", bf16, "-o", x, "--qdq", "int8", "--calib", "synthetic"), "does not run bfloat16"),
        (("quantize", done, "-o", x, "--qdq", "int8", "--calib", "synthetic"), "is already quantised"),
        (("quantize", qdq, "-o", x, "--qdq", "int8", "--calib", "synthetic"), "is already quantised"),
        (("quantize", qdq, "-o", x, "--weights", "int4"), "is already quantised"),
        (("quantize", m19, "-o", m19, "--qdq", "int8", "--calib", "synthetic"), "would overwrite the input"),
        (("quantize", m18, "-o", x, "--qdq", "int8", "--calib", "synthetic", "--weights", "int4"),
         "--weights belong to weight-only"),
        (("quantize", m18, "-o", x, "--calib", "synthetic"), "--calib/--tokenizer belong to --qdq and --method gptq"),
        (("quantize", m18, "-o", x, "--qdq", "int8", "--calib", "synthetic", "--tokenizer", "t"),
         "--tokenizer goes with a --calib text file"),
        (("quantize", m18, "-o", x, "--qdq", "int8", "--calib", "synthetic", "--calib-samples", "0"),
         "--calib-samples 0: use 1..4096"),
    ]
    for args, message in cases:
        assert_one_line_error(cli_main(*args), message)
    assert sorted(p.name for p in tmp_path.iterdir()) == before


def test_kv_cache_folder_gets_qdq_and_passes_its_step_check(tmp_path):
    """Calibrated on the prefill step (an empty cache); every decode step is judged on the budget."""
    kv, out = tmp_path / "kv", tmp_path / "kv-w8a8"
    assert cli_main("onnx", "--preset", "diff-v1-tiny", "--kv-cache", "-o", kv).returncode == 0
    result = cli_main("quantize", kv, "-o", out, "--qdq", "int8", "--calib", "synthetic", "--calib-samples", "8",
                     "--calib-seq-len", "32")
    assert result.returncode == 0, result.stderr
    assert sorted(p.name for p in out.iterdir()) == sorted(p.name for p in kv.iterdir())
    report = cli_main("check", out, "--preset", "diff-v1-tiny")
    assert report.returncode == 0 and "int8 Q/DQ" in report.stdout + report.stderr, report.stdout + report.stderr
