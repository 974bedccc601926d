"""export/norm_form.py: torch's RMSNorm (x * Reciprocal(Sqrt(v))) becomes x / Sqrt(v), which
onnxruntime then fuses into SimplifiedLayerNormalization when a session loads; the values stay
those of the eager norm; a Reciprocal read elsewhere is left alone; exports come out divided, the
DiffAttention function body as the contract writes it."""

import collections

import numpy as np
import pytest
import torch

onnx = pytest.importorskip("onnx")
ort = pytest.importorskip("onnxruntime")

from onnx import TensorProto, helper, numpy_helper  # noqa: E402

from diffexport.export.norm_form import divide_by_root  # noqa: E402

WIDTH = 37  # an awkward width


def _rms_graph(gain: np.ndarray, eps: float, swap: bool, reciprocal_out: bool):
    """The norm as torch's dynamo exporter writes it: Pow, ReduceMean, Add, Sqrt, Reciprocal, Mul, Mul gain."""
    product = ["inv", "x"] if swap else ["x", "inv"]
    nodes = [helper.make_node("Pow", ["x", "two"], ["sq"]), helper.make_node("ReduceMean", ["sq", "axes"], ["ms"]),
             helper.make_node("Add", ["ms", "eps"], ["v"]), helper.make_node("Sqrt", ["v"], ["root"]),
             helper.make_node("Reciprocal", ["root"], ["inv"]), helper.make_node("Mul", product, ["normed"]),
             helper.make_node("Mul", ["normed", "gain"], ["y"])]
    outputs = [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["b", "s", WIDTH])]
    if reciprocal_out:
        outputs.append(helper.make_tensor_value_info("inv", TensorProto.FLOAT, ["b", "s", 1]))
    inits = [numpy_helper.from_array(np.array(2, np.float32), "two"), numpy_helper.from_array(np.array([-1]), "axes"),
             numpy_helper.from_array(np.array(eps, np.float32), "eps"), numpy_helper.from_array(gain, "gain")]
    graph = helper.make_graph(nodes, "norm", [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["b", "s", WIDTH])],
                              outputs, inits)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)])


def _divided(model):
    import onnx_ir as ir

    model_ir = ir.serde.deserialize_model(model)
    count = divide_by_root(model_ir)
    return ir.serde.serialize_model(model_ir), count


def _loaded_ops(model, tmp_path):
    """The op types onnxruntime runs after its load-time optimisations (what a session executes)."""
    options = ort.SessionOptions()
    options.optimized_model_filepath = str(tmp_path / "loaded.onnx")
    ort.InferenceSession(model.SerializeToString(), options, providers=["CPUExecutionProvider"])
    return collections.Counter(n.op_type for n in onnx.load(str(tmp_path / "loaded.onnx")).graph.node)


@pytest.mark.parametrize("swap", [False, True])
def test_divided_norm_equals_eager_and_fuses_at_load(swap, tmp_path):
    rng = np.random.default_rng()
    gain = rng.standard_normal(WIDTH).astype(np.float32)
    model = _rms_graph(gain, 1e-6, swap, reciprocal_out=False)
    assert _loaded_ops(model, tmp_path)["SimplifiedLayerNormalization"] == 0  # torch's form: six kernels
    divided, count = _divided(model)
    assert count == 1
    onnx.checker.check_model(divided, full_check=True)
    assert [n.op_type for n in divided.graph.node if n.op_type in ("Div", "Reciprocal")] == ["Div"]
    assert _loaded_ops(divided, tmp_path)["SimplifiedLayerNormalization"] == 1

    x = (rng.standard_normal((2, 5, WIDTH)) * 30).astype(np.float32)
    x[1, 2] = 0  # an all-zero row: eps alone under the root
    norm = torch.nn.RMSNorm(WIDTH, eps=1e-6, dtype=torch.float64)
    with torch.no_grad():
        norm.weight.copy_(torch.from_numpy(gain.astype(np.float64)))
        want = norm(torch.from_numpy(x.astype(np.float64))).numpy()  # float64, torch's own RMSNorm
    got = ort.InferenceSession(divided.SerializeToString(), providers=["CPUExecutionProvider"]).run(None, {"x": x})[0]
    assert np.isfinite(got).all()
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5 * np.abs(want).max())


def test_a_reciprocal_read_elsewhere_stays():
    model = _rms_graph(np.ones(WIDTH, np.float32), 1e-5, False, reciprocal_out=True)
    divided, count = _divided(model)
    assert count == 0 and "Reciprocal" in [n.op_type for n in divided.graph.node]


def test_exports_divide_their_norms_but_not_the_function_body(tmp_path):
    from diffexport.export.exporter import ExportOptions, export_onnx
    from diffexport.modeling.checkpoint import load_model

    lines = []
    export_onnx(load_model(preset="diff-v2-tiny"), tmp_path / "m.onnx", ExportOptions(), log=lines.append)
    assert any(line.startswith("norms         5 RMSNorm(s)") for line in lines)  # 2 layers x 2 + the final norm
    model = onnx.load(str(tmp_path / "m.onnx"))
    main = collections.Counter(n.op_type for n in model.graph.node)
    assert main["Reciprocal"] == 0 and main["Div"] >= 5
    (function,) = model.functions
    assert "Reciprocal" in [n.op_type for n in function.node]  # the op's body as function_body writes it
    assert _loaded_ops(model, tmp_path)["SimplifiedLayerNormalization"] == 5
