"""Graph passes: lowering DiffAttention to standard ops (per-node specialised), and cleanup."""

import pytest

onnx = pytest.importorskip("onnx")
ort = pytest.importorskip("onnxruntime")

from helpers import assert_same_logits  # noqa: E402

from diffexport.core import contract  # noqa: E402
from diffexport.core.errors import DiffExportError  # noqa: E402
from diffexport.export import export_onnx  # noqa: E402
from diffexport.modeling.checkpoint import load_model  # noqa: E402
from diffexport.passes.cleanup import cleanup  # noqa: E402
from diffexport.passes.lowering import lower_diff_attention  # noqa: E402

pytestmark = pytest.mark.slow  # exports, emulation or training: see README (quick loop)


@pytest.fixture(scope="module", params=["diff-v1-tiny", "diff-v2-tiny"])
def exported(request, tmp_path_factory):
    path = tmp_path_factory.mktemp("passes") / f"{request.param}.onnx"
    export_onnx(load_model(None, preset=request.param, seed=9), path, log=lambda _: None)
    return onnx.load(str(path))


@pytest.mark.parametrize("style", ["decomposed", "attention"])
def test_lowering_removes_every_diff_attention_and_keeps_numerics(exported, style):
    model = exported
    if style == "attention":  # the attention body needs the whole model at opset 23
        model = onnx.version_converter.convert_version(model, 23)
    result = lower_diff_attention(model, style)
    lowered = cleanup(result.model)
    assert result.lowered == 2
    ops = {(n.domain, n.op_type) for n in lowered.graph.node}
    assert not any(d.startswith("diffexport") for d, _ in ops) and not lowered.functions
    assert ("", "Attention") in ops if style == "attention" else ("", "Softmax") in ops
    assert {o.domain for o in lowered.opset_import} <= {"", "ai.onnx"}
    assert_same_logits(exported, lowered, [(1, 1), (2, 23)], seed=1)


def test_cleanup_keeps_diff_attention_nodes_and_metadata(exported):
    cleaned = cleanup(exported)
    assert sum(n.op_type == contract.OP_NAME for n in cleaned.graph.node) == 2
    assert [(f.domain, f.name) for f in cleaned.functions] == [(contract.ONNX_DOMAIN, contract.OP_NAME)]
    assert {p.key for p in cleaned.metadata_props} >= {"diffexport.config", "diffexport.dtype"}


def test_lowering_without_diff_attention_changes_nothing():
    graph = onnx.helper.make_graph([onnx.helper.make_node("Neg", ["x"], ["y"])], "g",
                                   [onnx.helper.make_tensor_value_info("x", onnx.TensorProto.FLOAT, [2])],
                                   [onnx.helper.make_tensor_value_info("y", onnx.TensorProto.FLOAT, [2])])
    model = onnx.helper.make_model(graph, opset_imports=[onnx.helper.make_opsetid("", 18)])
    result = lower_diff_attention(model)
    assert result.lowered == 0 and result.model.graph == model.graph


def test_lowering_refuses_bad_nodes(exported):
    bad = onnx.ModelProto.FromString(exported.SerializeToString())
    node = next(n for n in bad.graph.node if n.op_type == contract.OP_NAME)
    next(a for a in node.attribute if a.name == "num_kv_heads").i = 3
    with pytest.raises(DiffExportError, match="must divide"):
        lower_diff_attention(bad)
    with pytest.raises(DiffExportError, match="opset >= 23"):
        lower_diff_attention(exported, "attention")
