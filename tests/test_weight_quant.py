"""`diffexport quantize`: INT4/INT8 MatMulNBits weights through onnxruntime's quantiser, judged
against the unquantised model under the budgets of tolerances.WEIGHT_QUANT_BUDGETS."""

import json

import numpy as np
import pytest
from helpers import assert_one_line_error, cli_main, run_printed_polygraphy

onnx = pytest.importorskip("onnx")
ort = pytest.importorskip("onnxruntime")
pytest.importorskip("onnxruntime.quantization")

pytestmark = pytest.mark.slow  # exports and onnxruntime sessions: see README (quick loop)

LAYERS = 2  # diff-v1-tiny
WEIGHT_MATMULS = LAYERS * 4 + 1  # q|k|v and gate|up packed, o, down per layer, and the LM head


@pytest.fixture(scope="module")
def exported(artifacts, tmp_path_factory):
    return artifacts.copy(artifacts.cli_output("onnx", "--preset", "diff-v1-tiny"), tmp_path_factory.mktemp("wq"))


def _logits(path, ids):
    session = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    return session.run(["logits"], {"input_ids": ids})[0]


def _mean_kl(ref, out):
    log_p = ref - np.logaddexp.reduce(ref, axis=-1, keepdims=True)
    log_q = out - np.logaddexp.reduce(out, axis=-1, keepdims=True)
    return float((np.exp(log_p) * (log_p - log_q)).sum(-1).mean())


@pytest.mark.parametrize("bits,block,method", [(4, 32, "rtn"), (8, 128, "rtn"), (4, 64, "hqq")])
def test_quantised_export_keeps_diff_attention_and_meets_its_budget(exported, tmp_path, bits, block, method):
    from diffexport.core.tolerances import WEIGHT_QUANT_BUDGETS
    from diffexport.passes.weight_quant import WeightQuantOptions, quantize_weights

    out = tmp_path / "q.onnx"
    summary = quantize_weights(exported, out, WeightQuantOptions(bits=bits, block_size=block, method=method),
                               log=lambda _: None)
    assert summary.quantised == WEIGHT_MATMULS and summary.bytes_after < summary.bytes_before / (2 if bits == 8 else 3)
    before, after = onnx.load(str(exported)), onnx.load(str(out))
    ops = [n.op_type for n in after.graph.node]
    assert ops.count("MatMulNBits") == WEIGHT_MATMULS and "MatMul" not in ops  # the graph's matmuls all have weights
    # the attention is untouched: the same DiffAttention nodes, the same function body
    diff = [n for n in after.graph.node if n.op_type == "DiffAttention"]
    assert [n.SerializeToString() for n in diff] == [n.SerializeToString() for n in before.graph.node
                                                     if n.op_type == "DiffAttention"]
    assert [f.SerializeToString() for f in after.functions] == [f.SerializeToString() for f in before.functions]
    record = json.loads(next(p.value for p in after.metadata_props if p.key == "diffexport.weight_quant"))
    assert (record["bits"], record["block_size"], record["method"]) == (bits, block, method)

    ids = np.random.default_rng(bits * 1000 + block).integers(0, 512, size=(2, 37), dtype=np.int64)
    ref, got = _logits(exported, ids), _logits(out, ids)
    assert np.isfinite(got).all()
    assert 0 < _mean_kl(ref, got) <= WEIGHT_QUANT_BUDGETS[bits].max_kl  # changed, within budget
    report = cli_main("check", out, "--preset", "diff-v1-tiny", "--shapes", "1x9,2x33")
    assert report.returncode == 0, report.stdout + report.stderr
    assert f"budget        int{bits} weights" in report.stderr + report.stdout and "KL" in report.stdout
    if (bits, method) == (4, "rtn"):  # its atol is the difference seen, printed rounded up: the rerun passes
        run_printed_polygraphy(report.stdout)


def test_the_budget_fails_a_broken_quantisation(exported, tmp_path):
    """The LM head's scales negated (a sign error a quantiser could make): the check must FAIL."""
    from onnx import numpy_helper

    from diffexport.passes.weight_quant import quantize_weights

    out = tmp_path / "q.onnx"
    quantize_weights(exported, out, log=lambda _: None)
    model = onnx.load(str(out))
    node = [n for n in model.graph.node if n.op_type == "MatMulNBits"][-1]  # the LM head comes last
    scales = next(t for t in model.graph.initializer if t.name == node.input[2])
    scales.CopyFrom(numpy_helper.from_array(-numpy_helper.to_array(scales), scales.name))
    broken = tmp_path / "broken.onnx"
    onnx.save(model, str(broken))
    report = cli_main("check", broken, "--preset", "diff-v1-tiny", "--shapes", "2x33")
    assert report.returncode == 1 and "FAIL" in report.stdout, report.stdout + report.stderr


def test_kv_cache_folder_is_quantised_and_still_decodes(tmp_path):
    folder = tmp_path / "kv"
    assert cli_main("onnx", "--preset", "diff-v1-tiny", "--kv-cache", "-o", folder).returncode == 0
    out = tmp_path / "kv-int4"
    result = cli_main("quantize", folder, "-o", out, "--weights", "int4")
    assert result.returncode == 0, result.stderr
    assert sorted(p.name for p in out.iterdir()) == sorted(p.name for p in folder.iterdir())
    assert (out / "genai_config.json").read_text() == (folder / "genai_config.json").read_text()
    plot = tmp_path / "steps.png"
    report = cli_main("check", out, "--preset", "diff-v1-tiny", "--plot", plot)
    assert report.returncode == 0, report.stdout + report.stderr
    assert "greedy tokens onnxruntime == eager" in report.stdout
    run_printed_polygraphy(report.stdout)  # the int4 folder's prefill and decode step, padding rows too
    assert plot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and f"plot          {plot}" in report.stdout
    pytest.importorskip("onnxruntime_genai")
    generated = cli_main("generate", out, "--ids", "1,2,3", "--max-new-tokens", "6")
    assert generated.returncode == 0 and len(generated.stdout.split()) == 6, generated.stdout + generated.stderr


def test_bad_quantize_requests_are_one_line_and_write_nothing(exported, tmp_path):
    from onnx import TensorProto, helper

    graph = helper.make_graph([helper.make_node("Relu", ["x"], ["y"], name="r")], "g",
                              [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 3])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 3])])
    plain = tmp_path / "plain.onnx"
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)], ir_version=10), str(plain))
    done = tmp_path / "done.onnx"
    assert cli_main("quantize", exported, "-o", done).returncode == 0
    existing = tmp_path / "exists"
    existing.mkdir()
    corrupt = tmp_path / "corrupt.onnx"
    corrupt.write_bytes(b"\x08\x07not a protobuf" * 20)
    before = sorted(p.name for p in tmp_path.iterdir())
    cases = [
        (("quantize", exported, "-o", tmp_path / "x.onnx", "--block-size", "48"), "--block-size 48: use one of"),
        (("quantize", exported, "-o", tmp_path / "x.onnx", "--weights", "int8", "--method", "hqq"), "int4 only"),
        (("quantize", plain, "-o", tmp_path / "x.onnx"), "nothing to quantise"),
        (("quantize", done, "-o", tmp_path / "x.onnx"), "is already quantised"),
        (("quantize", exported, "-o", exported), "would overwrite the input"),
        (("quantize", exported, "-o", tmp_path / "x.txt"), "name the quantised model *.onnx"),
        (("quantize", tmp_path / "missing.onnx", "-o", tmp_path / "x.onnx"), "does not exist"),
        (("quantize", existing, "-o", tmp_path / "y"), "genai_config.json"),
        (("quantize", corrupt, "-o", tmp_path / "x.onnx"), "is not a readable ONNX file"),
        (("quantize", exported, "-o", "/sys/kernel/x.onnx"), "is not writable"),
        (("check", exported, "--preset", "diff-v1-tiny", "--plot", tmp_path / "p.png"), "--plot draws a KV-cache"),
    ]
    for args, message in cases:
        assert_one_line_error(cli_main(*args), message)
    bad_bits = cli_main("quantize", exported, "-o", tmp_path / "x.onnx", "--weights", "int3")
    assert bad_bits.returncode == 2 and "invalid choice: 'int3'" in bad_bits.stderr
    assert sorted(p.name for p in tmp_path.iterdir()) == before


def test_options_are_validated_in_the_python_api():
    from diffexport.core.errors import DiffExportError
    from diffexport.passes.weight_quant import WeightQuantOptions

    for options, message in [(WeightQuantOptions(bits=2), "int4 or int8"),
                             (WeightQuantOptions(block_size=0), "use one"),
                             (WeightQuantOptions(method="awq"), "use one of rtn, hqq, gptq"),
                             (WeightQuantOptions(method="gptq"), "--method gptq needs calibration data"),
                             (WeightQuantOptions(method="gptq", bits=8, calib="synthetic"), "int4 only"),
                             (WeightQuantOptions(calib="synthetic"), "belong to --qdq and --method gptq")]:
        with pytest.raises(DiffExportError, match=message):
            options.validate()


def test_a_tied_head_read_through_transpose_gets_its_own_quantised_copy(tmp_path):
    """The exporter folds the tied LM head's Transpose(embedding) only for small tables: the quantiser
    must still see (and quantise) the head, while the Gather keeps reading the float table."""
    from onnx import TensorProto, helper, numpy_helper

    from diffexport.passes.weight_quant import materialise_transposed_weights, quantize_weights

    rng = np.random.default_rng(3)
    table = rng.standard_normal((96, 64)).astype(np.float32)
    nodes = [helper.make_node("Gather", ["table", "input_ids"], ["h"], name="embed"),
             helper.make_node("Transpose", ["table"], ["table_t"], name="t", perm=[1, 0]),
             helper.make_node("MatMul", ["h", "table_t"], ["logits"], name="head")]
    graph = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("input_ids", TensorProto.INT64, ["b", "s"])],
                              [helper.make_tensor_value_info("logits", TensorProto.FLOAT, ["b", "s", 96])],
                              [numpy_helper.from_array(table, "table")])
    src = tmp_path / "tied.onnx"
    tied = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)], ir_version=10)
    helper.set_model_props(tied, {"diffexport.config": json.dumps({"vocab_size": 96})})  # for --qdq's calibration
    onnx.save(tied, str(src))
    ids = rng.integers(0, 96, (1, 5)).astype(np.int64)

    model = onnx.load(str(src))
    assert materialise_transposed_weights(model) == 1
    assert [n.op_type for n in model.graph.node] == ["Gather", "MatMul"]
    moved = tmp_path / "moved.onnx"
    onnx.save(model, str(moved))
    run = lambda path: ort.InferenceSession(str(path), providers=["CPUExecutionProvider"]).run(  # noqa: E731
        None, {"input_ids": ids})[0]
    np.testing.assert_array_equal(run(moved), run(src))  # the same function, bit for bit

    out = tmp_path / "q.onnx"
    summary = quantize_weights(src, out, log=lambda _: None)
    quantised = onnx.load(str(out))
    assert summary.quantised == 1 and [n.op_type for n in quantised.graph.node] == ["Gather", "MatMulNBits"]
    assert next(n for n in quantised.graph.node if n.op_type == "Gather").input[0] == "table"  # still float
    assert 0.99 < float(np.corrcoef(run(out).ravel(), run(src).ravel())[0, 1]) < 1.0

    from diffexport.passes.qdq import QDQOptions, quantize_qdq

    out = tmp_path / "qdq.onnx"
    summary = quantize_qdq(src, out, QDQOptions(calib="synthetic", samples=4, seq_len=8), log=lambda _: None)
    quantised = onnx.load(str(out))
    producers = {o: n for n in quantised.graph.node for o in n.output}
    head = next(n for n in quantised.graph.node if n.op_type == "MatMul")
    assert summary.quantised == 1 and producers[head.input[1]].op_type == "DequantizeLinear"
    assert 0.99 < float(np.corrcoef(run(out).ravel(), run(src).ravel())[0, 1]) < 1.0


def test_gptq_calibrates_and_meets_the_int4_budget(exported, tmp_path):
    """onnxruntime's GPTQ on calibration batches: the prefill file and a KV-cache folder (fed an
    empty cache) both come out as MatMulNBits within the int4 budget."""
    from diffexport.core.tolerances import WEIGHT_QUANT_BUDGETS
    from diffexport.passes.weight_quant import WeightQuantOptions, quantize_weights

    out = tmp_path / "gptq.onnx"
    options = WeightQuantOptions(method="gptq", calib="synthetic", samples=8, seq_len=64)
    summary = quantize_weights(exported, out, options, log=lambda _: None)
    assert summary.quantised == WEIGHT_MATMULS
    model = onnx.load(str(out))
    record = json.loads(next(p.value for p in model.metadata_props if p.key == "diffexport.weight_quant"))
    assert record["method"] == "gptq" and "8 x 64 synthetic tokens" in record["calibration"]
    ids = np.random.default_rng(11).integers(0, 512, size=(2, 29), dtype=np.int64)
    ref, got = _logits(exported, ids), _logits(out, ids)
    assert np.isfinite(got).all() and 0 < _mean_kl(ref, got) <= WEIGHT_QUANT_BUDGETS[4].max_kl
    folder = tmp_path / "kv"
    assert cli_main("onnx", "--preset", "diff-v1-tiny", "--kv-cache", "-o", folder).returncode == 0
    result = cli_main("quantize", folder, "-o", tmp_path / "kv-gptq", "--method", "gptq", "--calib", "synthetic",
                     "--calib-samples", "4", "--calib-seq-len", "32")
    assert result.returncode == 0 and "Progress" not in result.stdout, result.stdout + result.stderr
    report = cli_main("check", tmp_path / "kv-gptq", "--preset", "diff-v1-tiny")
    assert report.returncode == 0, report.stdout + report.stderr


def test_check_scores_a_text_and_reports_both_perplexities(exported, tmp_path):
    """--text: the text's bytes replace the random ids; the perplexity printed is the next-token NLL of
    each graph on those slices (recomputed here from onnxruntime's logits)."""
    import re

    from diffexport.passes.weight_quant import quantize_weights

    out = tmp_path / "q.onnx"
    quantize_weights(exported, out, log=lambda _: None)
    text = tmp_path / "t.txt"
    text.write_text("a quantised model should predict the next byte of this text nearly as well. " * 3)
    report = cli_main("check", out, "--against", exported, "--text", text, "--shapes", "1x17,2x33")
    assert report.returncode == 0, report.stdout + report.stderr
    ids = np.frombuffer(text.read_bytes(), np.uint8).astype(np.int64)
    slices, used = [], 0
    for batch, seq in ((1, 17), (2, 33)):
        slices.append(ids[used:used + batch * seq].reshape(batch, seq))
        used += batch * seq

    def perplexity(path):
        nll, count = 0.0, 0
        for part in slices:
            x = _logits(path, part)[:, :-1].astype(np.float64)
            logp = x - np.logaddexp.reduce(x, axis=-1, keepdims=True)
            nll -= np.take_along_axis(logp, part[:, 1:, None], -1).sum()
            count += part[:, 1:].size
        return np.exp(nll / count), count

    (ours, count), (theirs, _) = perplexity(out), perplexity(exported)
    line = next(x for x in report.stdout.splitlines() if x.startswith("perplexity"))
    printed = [float(v) for v in re.findall(r"onnx ([0-9.e+]+)", line)]
    assert printed == pytest.approx([ours, theirs], rel=1e-3) and f"on {count} next tokens" in line
    assert_one_line_error(cli_main("check", out, "--against", exported, "--text", text, "--shapes", "4x64"),
                          "the --shapes need 256")
    assert_one_line_error(cli_main("check", out, "--against", exported, "--text", tmp_path / "none.txt"),
                          "text file not found")
    assert_one_line_error(cli_main("check", out, "--against", exported, "--text", tmp_path),  # a folder, not text
                          "is not a regular file")
    binary = tmp_path / "binary.txt"
    binary.write_bytes(b"\xff\xfe" * 200)
    assert_one_line_error(cli_main("check", out, "--against", exported, "--text", binary), "is not UTF-8 text")
    huge = tmp_path / "huge.txt"  # sparse: over the limit without using the disk, refused before it is read
    with open(huge, "wb") as handle:
        handle.truncate(65 * 2**20)
    assert_one_line_error(cli_main("check", out, "--against", exported, "--text", huge), "limited to 64 MiB")
