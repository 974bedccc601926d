"""TensorRT-family parse and build, ahead of time on the CPU with TensorRT-RTX (module tensorrt_rtx).

Proves our exported graphs are TensorRT-parseable end to end apart from the plugin: the parser
inlines the DiffAttention function when no plugin is registered, and the lowered graph has only
standard ops. Builds for sm_80 and sm_89 (TensorRT-RTX cannot target sm_90). Skipped where the
wheels are not installed (pip install tensorrt-rtx-cu13); CI installs them.
"""

import pytest

onnx = pytest.importorskip("onnx")
pytest.importorskip("tensorrt_rtx")

from diffexport.backends.tensorrt import EngineOptions, build_engine  # noqa: E402
from diffexport.core.errors import DiffExportError  # noqa: E402
from diffexport.export import export_onnx  # noqa: E402
from diffexport.modeling.checkpoint import load_model  # noqa: E402
from diffexport.passes.cleanup import cleanup  # noqa: E402
from diffexport.passes.lowering import lower_diff_attention  # noqa: E402

pytestmark = pytest.mark.slow  # exports, emulation or training: see README (quick loop)


# "function": the graph as it is (the parser inlines the DiffAttention function; no plugin is registered)
RTX_INLINED = EngineOptions(attention="function", module="tensorrt_rtx", targets=("SM80", "SM89"), progress=False)


@pytest.fixture(scope="module", params=["diff-v1-tiny", "diff-v2-tiny"])
def exported(request, tmp_path_factory):
    path = tmp_path_factory.mktemp("rtx") / "m.onnx"
    export_onnx(load_model(None, preset=request.param, seed=2), path, log=lambda _: None)
    return onnx.load(str(path))


def test_exported_graph_parses_and_builds_with_the_function_inlined(exported):
    result = build_engine(exported, RTX_INLINED)
    assert result.engine_bytes > 0 and result.layers > 100


def test_lowered_graph_parses_and_builds(exported):
    lowered = cleanup(lower_diff_attention(exported).model)
    result = build_engine(lowered, RTX_INLINED)
    assert result.engine_bytes > 0


def test_parse_failures_name_the_node(exported):
    broken = onnx.ModelProto.FromString(exported.SerializeToString())
    node = next(n for n in broken.graph.node if n.op_type == "Softmax" or n.op_type == "MatMul")
    node.op_type = "NoSuchOp"
    with pytest.raises(DiffExportError, match=rf"cannot parse.*{node.name}"):
        build_engine(broken, RTX_INLINED)
