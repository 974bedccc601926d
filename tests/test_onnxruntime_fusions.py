"""passes/onnxruntime_fusions.py on small graphs: the packed MatMuls compute what the separate ones
did, and a weight another node also reads, or a group of different inner sizes, stays as it is."""

import numpy as np
import pytest

onnx = pytest.importorskip("onnx")
ort = pytest.importorskip("onnxruntime")

from onnx import TensorProto, helper, numpy_helper  # noqa: E402

from diffexport.passes import onnxruntime_fusions  # noqa: E402
from diffexport.passes.onnxruntime_fusions import fuse_for_onnxruntime, pack_shared_input_matmuls  # noqa: E402


def _graph(rng):
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, ["b", "s", 16])
    weights = {"wq": (16, 8), "wk": (16, 4), "wv": (16, 4), "shared": (16, 3), "other": (8, 5)}
    inits = [numpy_helper.from_array(rng.standard_normal(shape).astype(np.float32), name)
             for name, shape in weights.items()]
    nodes = [helper.make_node("MatMul", ["x", w], [f"y_{w}"], name=f"mm_{w}") for w in ("wq", "wk", "wv", "shared")]
    nodes.append(helper.make_node("MatMul", ["y_wq", "other"], ["y_other"], name="mm_other"))  # K 8: other input
    nodes.append(helper.make_node("Transpose", ["shared"], ["shared_t"], perm=[1, 0]))  # a second reader
    outputs = ["y_wq", "y_wk", "y_wv", "y_shared", "y_other", "shared_t"]
    graph = helper.make_graph(nodes, "g", [x], [helper.make_tensor_value_info(o, TensorProto.FLOAT, ["b", "s", None])
                                                 for o in outputs[:-1]]
                              + [helper.make_tensor_value_info("shared_t", TensorProto.FLOAT, [3, 16])], inits)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)])


def _run(model, x):
    return ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"]).run(None, {"x": x})


def test_packing_keeps_every_output_and_leaves_shared_weights():
    rng = np.random.default_rng(0)
    model = _graph(rng)
    x = rng.standard_normal((2, 3, 16)).astype(np.float32)
    before = _run(model, x)
    packed = onnx.ModelProto.FromString(model.SerializeToString())
    assert pack_shared_input_matmuls(packed) == 1
    onnx.checker.check_model(packed, full_check=True)
    ops = [n.op_type for n in packed.graph.node]
    assert ops.count("MatMul") == 3 and ops.count("Split") == 1  # q|k|v packed; shared and other as they were
    assert {t.name for t in packed.graph.initializer} >= {"shared", "other"}
    assert not {"wq", "wk", "wv"} & {t.name for t in packed.graph.initializer}
    for a, b in zip(before, _run(packed, x)):
        np.testing.assert_allclose(b, a, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("large", [1 << 16, 16])  # 16: gamma is a "large" weight, moved aside and back
def test_rms_norms_fuse_with_their_residual_add(large, monkeypatch):
    """x + y, then RMSNorm written as torch's exporter writes it: one SkipSimplifiedLayerNormalization."""
    monkeypatch.setattr(onnxruntime_fusions, "_SHAPE_ONLY_ELEMENTS", large)
    rng = np.random.default_rng(1)
    inputs = [helper.make_tensor_value_info(n, TensorProto.FLOAT, ["b", "s", 32]) for n in ("x", "y")]
    consts = [numpy_helper.from_array(np.asarray(v, np.float32), n) for n, v in
              (("two", 2.0), ("eps", 1e-6), ("gamma", rng.standard_normal(32)))]
    consts.append(numpy_helper.from_array(np.asarray([-1], np.int64), "axes"))
    nodes = [helper.make_node("Add", ["x", "y"], ["sum"]), helper.make_node("Pow", ["sum", "two"], ["sq"]),
             helper.make_node("ReduceMean", ["sq", "axes"], ["mean"], keepdims=1, noop_with_empty_axes=0),
             helper.make_node("Add", ["mean", "eps"], ["var"]), helper.make_node("Sqrt", ["var"], ["std"]),
             helper.make_node("Reciprocal", ["std"], ["inv"]), helper.make_node("Mul", ["sum", "inv"], ["normed"]),
             helper.make_node("Mul", ["gamma", "normed"], ["out"])]
    outputs = [helper.make_tensor_value_info(n, TensorProto.FLOAT, ["b", "s", 32]) for n in ("out", "sum")]
    model = helper.make_model(helper.make_graph(nodes, "g", inputs, outputs, consts),
                              opset_imports=[helper.make_opsetid("", 18)])
    feeds = {n: rng.standard_normal((2, 3, 32)).astype(np.float32) for n in ("x", "y")}
    want = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"]).run(None, feeds)
    fused, counts = fuse_for_onnxruntime(model)  # consumes the model's weights
    assert (counts.skip_norms, counts.norms) == (1, 0)
    assert [n.op_type for n in fused.graph.node] == ["SkipSimplifiedLayerNormalization"]
    got = ort.InferenceSession(fused.SerializeToString(), providers=["CPUExecutionProvider"]).run(None, feeds)
    for a, b in zip(want, got):
        np.testing.assert_allclose(b, a, rtol=1e-5, atol=1e-5)


def test_fusing_moves_every_weight_back(monkeypatch):
    """Large weights sit out the rewrite rules as data-less stubs: the fused graph has each one back,
    bytes and all, and the input model gave them up (never two copies)."""
    monkeypatch.setattr(onnxruntime_fusions, "_SHAPE_ONLY_ELEMENTS", 16)
    rng = np.random.default_rng(2)
    model = _graph(rng)
    x = rng.standard_normal((2, 3, 16)).astype(np.float32)
    before = _run(model, x)
    fused, counts = fuse_for_onnxruntime(model)
    assert counts.packed == 1 and len(model.graph.initializer) == 0
    assert all(t.data_location == onnx.TensorProto.DEFAULT for t in fused.graph.initializer)
    onnx.checker.check_model(fused, full_check=True)
    for a, b in zip(before, _run(fused, x)):
        np.testing.assert_allclose(b, a, rtol=1e-6, atol=1e-6)
