"""`diffexport trt` and `diffexport check model.engine` on the CPU: plugin-free engines built with
TensorRT-RTX through the same code path users take with TensorRT, the engine record, and every
refusal as one line. Running engines and the plugin path need TensorRT and a GPU (not here)."""

import json
import os

import onnx
import pytest
from helpers import assert_one_line_error, cli_main

from diffexport.backends.tensorrt import EngineOptions, find_plugin_library, graph_precision, prepare_graph
from diffexport.core import contract
from diffexport.core.errors import DiffExportError
from diffexport.format.nodes import node_attrs

pytestmark = pytest.mark.slow  # exports, emulation or training: see README (quick loop)


@pytest.fixture(scope="module")
def exported(artifacts, tmp_path_factory):
    """m.onnx and m_fp16.onnx (the session's exports, copied here: qdq_export writes beside them)."""
    folder = tmp_path_factory.mktemp("trt")
    for dtype in ("", "--fp16"):
        name = f"m{dtype.replace('--', '_')}.onnx"
        artifacts.copy(artifacts.cli_output("onnx", "--preset", "diff-v1-tiny", *([dtype] if dtype else [])),
                       folder, name)
    return folder


def test_plugin_graph_is_stamped_for_the_plugin(exported):
    model = onnx.load(str(exported / "m_fp16.onnx"))
    assert graph_precision(model) == "fp16"
    staged, count = prepare_graph(model, EngineOptions(logit_bits=6, smooth_k=False))
    nodes = [n for n in staged.graph.node if n.op_type == contract.OP_NAME]
    assert count == len(nodes) == 2
    for node in nodes:
        attrs = {a.name: onnx.helper.get_attribute_value(a) for a in node.attribute}
        assert attrs["plugin_namespace"] == contract.PLUGIN_NAMESPACE.encode()
        assert attrs["plugin_version"] == contract.PLUGIN_VERSION.encode()
        assert attrs["logit_bits"] == 6 and attrs["smooth_k"] == 0
        node_attrs(node)  # the op attributes still validate: plugin-only fields are set aside
    original = [n for n in model.graph.node if n.op_type == contract.OP_NAME][0]
    assert "logit_bits" not in {a.name for a in original.attribute}  # the input model is untouched
    # No function body left to import instead of the plugin (TensorRT < 10.7 prefers the body).
    assert [f.name for f in model.functions] == [contract.OP_NAME] and not staged.functions


def test_plugin_graph_writes_the_default_fields_too(exported):
    staged, _ = prepare_graph(onnx.load(str(exported / "m_fp16.onnx")), EngineOptions())
    for node in (n for n in staged.graph.node if n.op_type == contract.OP_NAME):
        attrs = {a.name: onnx.helper.get_attribute_value(a) for a in node.attribute}
        assert attrs["logit_bits"] == 16 and attrs["smooth_k"] == 1


def test_native_graph_has_no_diff_attention(exported):
    lowered, count = prepare_graph(onnx.load(str(exported / "m.onnx")), EngineOptions(attention="native"))
    assert count == 2 and not [n for n in lowered.graph.node if n.op_type == contract.OP_NAME]


@pytest.mark.parametrize("options,message", [
    (EngineOptions(attention="native", logit_bits=8), "need the plugin's INT8-logits kernel"),
    (EngineOptions(logit_bits=5), "--logit-bits must be 8, 6 or 4"),
    (EngineOptions(attention="tensor-cores"), "--attention must be one of"),
])
def test_prepare_refuses(exported, options, message):
    with pytest.raises(DiffExportError, match=message):
        prepare_graph(onnx.load(str(exported / "m_fp16.onnx")), options)


def test_plugin_graphs_are_refused_where_the_plugin_cannot_run(exported):
    """A head dim the plugin's kernels do not take, and a machine with only TensorRT-RTX: both before
    any parsing, both naming --attention native (inspect says the same: contract.plugin_refusal)."""
    from diffexport.backends.tensorrt import build_engine

    model = onnx.load(str(exported / "m.onnx"))
    with pytest.raises(DiffExportError, match="head_dim 32.*--attention native"):
        build_engine(model, EngineOptions(module="tensorrt_rtx"))
    pytest.importorskip("tensorrt_rtx")
    for node in model.graph.node:
        if node.op_type == contract.OP_NAME:
            next(a for a in node.attribute if a.name == "head_dim").i = 64
    refusal = "TensorRT-RTX cannot build graphs with plugin layers.*--attention native"
    with pytest.raises(DiffExportError, match=refusal):
        build_engine(model, EngineOptions(module="tensorrt_rtx"))


def test_missing_plugin_library_is_one_line(tmp_path):
    with pytest.raises(DiffExportError, match="plugin library not found .*-DTensorRT_ROOT"):
        find_plugin_library(tmp_path / "nope.so")




def test_native_engine_builds_with_tensorrt_rtx(exported, tmp_path):
    pytest.importorskip("tensorrt_rtx")
    engine, cache = tmp_path / "m.engine", tmp_path / "timing.cache"
    result = cli_main("trt", exported / "m_fp16.onnx", "-o", engine, "--attention", "native", "--builder",
                     "tensorrt-rtx", "--targets", "SM80", "--min", "1x1", "--opt", "2x64", "--max", "4x512",
                     "--timing-cache", cache)
    assert result.returncode == 0, result.stderr
    assert "2 DiffAttention nodes -> native (0 plugin layers)" in result.stdout and "fp16" in result.stdout
    assert engine.stat().st_size > 100_000
    umask = os.umask(0)
    os.umask(umask)
    assert engine.stat().st_mode & 0o777 == 0o666 & ~umask  # like open(), not mkstemp's owner-only
    record = json.loads((tmp_path / "m.engine.json").read_text())
    assert record["attention"] == "native" and record["module"] == "tensorrt_rtx" and record["targets"] == ["SM80"]
    assert record["profile"] == {"min": [1, 1], "opt": [2, 64], "max": [4, 512]}
    assert json.loads(record["onnx_metadata"]["config"])["head_dim"] == 32
    assert cache.is_file() and cache.stat().st_size > 0


@pytest.mark.parametrize("extra,message", [
    (("--builder", "tensorrt-rtx"), "the DiffAttention plugin cannot run this graph (head_dim 32: the fused kernel "
                                    "and the DiffAttention plugin take head_dim 64 or 128): build it with --attention "
                                    "native"),
    (("--attention", "native", "--int8"), "need the plugin's INT8-logits kernel"),
    (("--attention", "native", "--fp16", "--builder", "tensorrt-rtx"), "the ONNX file is fp32"),
    (("--attention", "native", "--min", "4x1", "--max", "2x8", "--builder", "tensorrt-rtx"), "profile batch"),
    (("--attention", "native", "--opt", "1by8"), "--opt '1by8': write BATCHxSEQ"),
    (("--int8", "--logit-bits", "4"), "--int8 means --logit-bits 8"),
])
def test_trt_refusals_are_one_line(exported, tmp_path, extra, message):
    pytest.importorskip("tensorrt_rtx")
    result = cli_main("trt", exported / "m.onnx", "-o", tmp_path / "x.engine", *extra)
    assert_one_line_error(result, message)
    assert not (tmp_path / "x.engine").exists()


def test_trt_file_errors(exported, tmp_path):
    assert_one_line_error(cli_main("trt", tmp_path / "missing.onnx", "-o", tmp_path / "x.engine"), "missing.onnx")
    assert_one_line_error(cli_main("trt", exported / "m.onnx", "-o", tmp_path / "x.onnx"), "name the engine")


def test_check_engine_needs_its_record_and_a_gpu(exported, tmp_path):
    pytest.importorskip("tensorrt_rtx")
    engine = tmp_path / "m.engine"
    assert cli_main("trt", exported / "m.onnx", "-o", engine, "--attention", "native", "--builder", "tensorrt-rtx",
                   "--opt", "1x32", "--max", "2x64").returncode == 0
    import torch

    if not torch.cuda.is_available():
        assert_one_line_error(cli_main("check", engine, "--preset", "diff-v1-tiny"), "needs an NVIDIA GPU")
    assert_one_line_error(cli_main("check", engine, "--preset", "diff-v1-110m"), "different configuration")
    # decode-step options name what a prefill engine lacks, before any GPU is looked for
    assert_one_line_error(cli_main("check", engine, "--preset", "diff-v1-tiny", "--plot", tmp_path / "p.png"),
                          "this engine is a prefill graph")
    assert_one_line_error(cli_main("check", engine, "--preset", "diff-v1-tiny", "--steps", "3"),
                          "this engine is a prefill graph; use --shapes")
    assert not (tmp_path / "p.png").exists()
    (tmp_path / "m.engine.json").write_text("{not json")
    assert_one_line_error(cli_main("check", engine, "--preset", "diff-v1-tiny"), "is corrupt")
    (tmp_path / "m.engine.json").unlink()
    assert_one_line_error(cli_main("check", engine, "--preset", "diff-v1-tiny"), "no m.engine.json beside")


def test_large_graphs_go_through_a_file_and_save_onnx(exported, tmp_path, monkeypatch):
    """Past protobuf's 2 GiB limit the graph is parsed from a file with external data (forced here
    by lowering the limit); --save-onnx writes the graph the parser got, stamped for the plugin."""
    pytest.importorskip("tensorrt_rtx")
    from diffexport.backends import tensorrt as backend

    monkeypatch.setattr(backend, "PROTOBUF_LIMIT", 1)
    saved = tmp_path / "staged.onnx"
    result = backend.build_engine(onnx.load(str(exported / "m.onnx")), EngineOptions(
        attention="native", module="tensorrt_rtx", targets=("SM80",), progress=False, save_onnx=str(saved)))
    assert result.engine_bytes > 100_000
    assert (tmp_path / "staged.onnx.data").stat().st_size > 1_000_000  # weights beside the graph
    assert not [n for n in onnx.load(str(saved)).graph.node if n.op_type == contract.OP_NAME]  # lowered


def test_save_onnx_keeps_the_plugin_fields(exported, tmp_path):
    from diffexport.backends.tensorrt import save_graph

    staged, _ = prepare_graph(onnx.load(str(exported / "m_fp16.onnx")), EngineOptions(logit_bits=8))
    save_graph(staged, tmp_path / "int8.onnx")
    node = next(n for n in onnx.load(str(tmp_path / "int8.onnx")).graph.node if n.op_type == contract.OP_NAME)
    assert {a.name: onnx.helper.get_attribute_value(a) for a in node.attribute}["logit_bits"] == 8


@pytest.fixture(scope="module")
def qdq_export(exported):
    """An explicitly quantised graph as ModelOpt or onnxruntime's quantiser writes them for TensorRT:
    signed, symmetric INT8 Q/DQ pairs on the MatMuls, calibrated on token ids."""
    np = pytest.importorskip("numpy")
    quantization = pytest.importorskip("onnxruntime.quantization")

    class Tokens(quantization.CalibrationDataReader):
        def __init__(self):
            rng = np.random.default_rng(0)
            self.feeds = iter([{"input_ids": rng.integers(0, 512, (2, 48), dtype=np.int64)} for _ in range(4)])

        def get_next(self):
            return next(self.feeds, None)

    path = exported / "m_qdq.onnx"
    quantization.quantize_static(str(exported / "m.onnx"), str(path), Tokens(),
                                 quant_format=quantization.QuantFormat.QDQ,
                                 op_types_to_quantize=["MatMul"], per_channel=True,
                                 activation_type=quantization.QuantType.QInt8, weight_type=quantization.QuantType.QInt8,
                                 extra_options={"ActivationSymmetric": True, "WeightSymmetric": True})
    return path


def test_qdq_graph_keeps_its_quantisation_for_the_plugin(qdq_export):
    model = onnx.load(str(qdq_export))
    staged, count = prepare_graph(model, EngineOptions(logit_bits=8))
    ops = [n.op_type for n in staged.graph.node]
    assert count == 2 and ops.count("QuantizeLinear") >= 10
    assert ops == [n.op_type for n in model.graph.node]  # nothing but the DiffAttention fields changed


def test_qdq_graph_builds_natively_with_tensorrt_rtx(qdq_export, tmp_path):
    pytest.importorskip("tensorrt_rtx")
    engine = tmp_path / "qdq.engine"
    result = cli_main("trt", qdq_export, "-o", engine, "--attention", "native", "--builder", "tensorrt-rtx",
                     "--targets", "SM80", "--max", "2x256")
    assert result.returncode == 0, result.stderr
    assert "2 DiffAttention nodes -> native" in result.stdout and engine.stat().st_size > 100_000
