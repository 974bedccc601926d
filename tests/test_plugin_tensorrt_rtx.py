"""The built plugin library inside a TensorRT-family plugin registry (TensorRT-RTX, on the CPU):
loading (twice), the creator found by the contract's name/version/namespace, its field list,
plugin creation from good and bad field collections, the plugin's core names and its metadata.

Then TensorRT-RTX's ONNX parser on exported graphs: it hands each DiffAttention node to our creator
with the node's attributes as fields. It can go no further with a C++ plugin: it ends the process
while adding the plugin layer (its network API has no plugin layer), so engines with the plugin are
built on users' machines only.
Skipped unless the plugin library is built (it needs TensorRT's headers: cmake -DTensorRT_ROOT=...)
and tensorrt_rtx is installed."""

import os
from pathlib import Path

import pytest

trt = pytest.importorskip("tensorrt_rtx")
np = pytest.importorskip("numpy")

import onnx  # noqa: E402

from diffexport.backends.tensorrt import EngineOptions, build_engine, plugin_registered  # noqa: E402
from diffexport.core import contract  # noqa: E402
from diffexport.export import export_onnx  # noqa: E402
from diffexport.format.nodes import is_diff_attention, node_attrs  # noqa: E402
from diffexport.modeling.checkpoint import load_model  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
PLUGIN = Path(os.environ.get("DIFFEXPORT_PLUGIN_LIB",
                            ROOT / "build" / "plugins" / "tensorrt" / "libdiffexport_plugins.so"))

pytestmark = pytest.mark.skipif(not PLUGIN.is_file(), reason=f"plugin library not built ({PLUGIN}): configure "
                                "CMake with -DTensorRT_ROOT=<TensorRT with include/>")


@pytest.fixture(scope="module")
def creator():
    registry = trt.get_plugin_registry()
    registry.load_library(str(PLUGIN))
    registry.load_library(str(PLUGIN))  # idempotent: the same creators again
    found = registry.get_creator(contract.PLUGIN_NAME, contract.PLUGIN_VERSION, contract.PLUGIN_NAMESPACE)
    assert found is not None
    return found


def fields(**values):
    out = []
    for name, value in values.items():
        spec = next(a for a in contract.PLUGIN_FIELDS if a.name == name)
        if spec.kind == "int":
            out.append(trt.PluginField(name, np.array([value], np.int32), trt.PluginFieldType.INT32))
        else:
            out.append(trt.PluginField(name, np.array([value], np.float32), trt.PluginFieldType.FLOAT32))
    return trt.PluginFieldCollection(out)


def test_creator_identity_and_fields(creator):
    assert (creator.name, creator.plugin_version, creator.plugin_namespace) == (
        contract.PLUGIN_NAME, contract.PLUGIN_VERSION, contract.PLUGIN_NAMESPACE)
    assert [f.name for f in creator.field_names] == list(contract.PLUGIN_FIELD_NAMES)


def test_plugin_from_good_fields(creator):
    plugin = creator.create_plugin("layer0", fields(num_heads=4, num_kv_heads=2, head_dim=128, output_scale=0.6,
                                                    logit_bits=8, smooth_k=0), trt.TensorRTPhase.BUILD)
    assert plugin is not None
    core = plugin.get_capability_interface(trt.PluginCapabilityType.CORE)
    assert (core.plugin_name, core.plugin_version, core.plugin_namespace) == (
        contract.PLUGIN_NAME, contract.PLUGIN_VERSION, contract.PLUGIN_NAMESPACE)
    build = plugin.get_capability_interface(trt.PluginCapabilityType.BUILD)
    assert build.num_outputs == 1
    meta = build.metadata_string
    for expected in ("num_heads=4", "num_kv_heads=2", "head_dim=128", "output_scale=0.6", "logit_bits=8", "smooth_k=0",
                     "causal=1", "variant=1"):
        assert expected in meta


@pytest.mark.parametrize("values,reason", [
    (dict(num_heads=4, num_kv_heads=2), "required field head_dim is missing"),
    (dict(num_heads=4, num_kv_heads=3, head_dim=64), "must divide"),
    (dict(num_heads=4, num_kv_heads=2, head_dim=32), "head_dim=32 is not supported"),
    (dict(num_heads=4, num_kv_heads=2, head_dim=64, logit_bits=5), "logit_bits=5"),
    (dict(num_heads=4, num_kv_heads=2, head_dim=64, scale=float("nan")), "scale must be finite"),
])
def test_bad_fields_give_no_plugin_and_a_reason(creator, values, reason, capfd):
    assert creator.create_plugin("bad", fields(**values), trt.TensorRTPhase.RUNTIME) is None
    captured = capfd.readouterr()
    assert reason in captured.err + captured.out


def test_function_mode_builds_the_body_where_the_plugin_is_loaded(creator, tmp_path):
    """`--attention function` after this process loaded the plugin: the parser would give the nodes
    to our creator (which refuses head dim 32), so the body is inlined first and the engine builds."""
    assert plugin_registered(trt)
    export_onnx(load_model(None, preset="diff-v1-tiny", seed=2), tmp_path / "m.onnx", log=lambda _: None)
    model = onnx.load(str(tmp_path / "m.onnx"))
    attention = [n for n in model.graph.node if is_diff_attention(n)]
    assert attention and all(contract.plugin_refusal(node_attrs(n).head_dim) for n in attention)  # refused
    options = EngineOptions(attention="function", module="tensorrt_rtx", targets=("SM80",), progress=False)
    result = build_engine(model, options)
    assert result.engine_bytes > 0 and result.plugin_layers == 0


# ------------------------------------------------- TensorRT-RTX's ONNX parser routes nodes to the plugin

PARSE_SCRIPT = r"""
import sys, onnx, tensorrt_rtx as trt
from diffexport.backends.tensorrt import EngineOptions, prepare_graph
model = onnx.load(sys.argv[1])
if sys.argv[2] == "staged":
    model, _ = prepare_graph(model, EngineOptions(logit_bits=int(sys.argv[3])))
trt.get_plugin_registry().load_library(sys.argv[4])
class Log(trt.ILogger):
    def __init__(self):
        trt.ILogger.__init__(self)
    def log(self, severity, msg):
        print(f"[{severity.name}] {msg}", flush=True)
log = Log()
network = trt.Builder(log).create_network(0)
parser = trt.OnnxParser(network, log)
ok = parser.parse(model.SerializeToString())
plugins = sum("PLUGIN" in str(network.get_layer(i).type).upper() for i in range(network.num_layers))
print(f"PARSED ok={ok} plugin_layers={plugins}", flush=True)
"""


def parse_with_plugin(onnx_path, graph, logit_bits=16):
    """Parse in a child process (TensorRT-RTX 1.7 ends the process when it adds a plugin layer, which
    it does not support): its log, and whether it finished."""
    import subprocess
    import sys

    result = subprocess.run([sys.executable, "-c", PARSE_SCRIPT, str(onnx_path), graph, str(logit_bits), str(PLUGIN)],
                            capture_output=True, text=True, timeout=300)
    return result.stdout + result.stderr


@pytest.fixture(scope="module")
def head_dim_64_models(tmp_path_factory):
    from helpers import run_cli

    from diffexport.modeling.checkpoint import save_checkpoint
    from diffexport.modeling.families import build_model, config_from_dict

    folder = tmp_path_factory.mktemp("rtx_plugin")
    paths = {}
    for family, extra in (("diff_v1", dict(n_heads=2, n_kv_heads=1, head_dim=64)),
                          ("diff_v2", dict(n_heads=2, n_kv_heads=2, head_dim=64))):
        cfg = config_from_dict(family, dict(vocab_size=256, d_model=256, n_layers=2, ffn_hidden=256, **extra))
        ckpt = save_checkpoint(build_model(cfg, seed=3), folder / f"{family}.pt")
        paths[family] = folder / f"{family}.onnx"
        result = run_cli("onnx", ckpt, "-o", paths[family], "--fp16")
        assert result.returncode == 0, result.stderr
    return paths


@pytest.mark.parametrize("family", ["diff_v1", "diff_v2"])
@pytest.mark.parametrize("graph,bits", [("exported", 16), ("staged", 16), ("staged", 8)])
def test_parser_gives_every_node_to_the_plugin(head_dim_64_models, family, graph, bits):
    """The exported file as it is (function body kept: parsers of TensorRT >= 10.7 prefer a registered
    plugin) and the graph `diffexport trt` stages (body removed, every field written): the
    DiffAttention node reaches our creator with the node's attributes as fields, and is accepted.
    TensorRT-RTX 1.7 then ends the process while adding the plugin layer, so only the first node
    gets this far here."""
    log = parse_with_plugin(head_dim_64_models[family], graph, bits)
    assert "Importing this node as a plugin" in log, log[-3000:]
    assert "Successfully created plugin: DiffAttention" in log, log[-3000:]
    assert "DiffAttention plugin:" not in log  # the creator refused nothing
    if graph == "staged":
        assert "not found in plugin node" not in log  # no creator field left to its default
    if "PARSED" in log:  # a TensorRT-RTX that adds plugin layers: then they must all be there
        assert "PARSED ok=True plugin_layers=2" in log


def test_version_2_creator_takes_the_same_fields(creator):
    """Plugin version "2" (op version 2: + key_mask) sits beside version "1" in the same library."""
    registry = trt.get_plugin_registry()
    v2 = registry.get_creator(contract.PLUGIN_NAME, contract.KEY_MASK_PLUGIN_VERSION, contract.PLUGIN_NAMESPACE)
    assert v2 is not None and v2.plugin_version == contract.KEY_MASK_PLUGIN_VERSION
    assert [f.name for f in v2.field_names] == list(contract.PLUGIN_FIELD_NAMES)
    plugin = v2.create_plugin("layer0", fields(num_heads=2, num_kv_heads=1, head_dim=64), trt.TensorRTPhase.BUILD)
    core = plugin.get_capability_interface(trt.PluginCapabilityType.CORE)
    assert core.plugin_version == contract.KEY_MASK_PLUGIN_VERSION
    assert "key_mask" in plugin.get_capability_interface(trt.PluginCapabilityType.BUILD).metadata_string


@pytest.mark.parametrize("graph", ["exported", "staged"])
def test_parser_gives_kv_cache_nodes_to_the_version_2_plugin(tmp_path, graph):
    """A KV-cache decoder (fp16, head dim 64) exported for TensorRT (`--attention diffattention`; the
    CPU provider's default is onnxruntime's GroupQueryAttention): its six-input nodes reach the
    version-2 creator."""
    from helpers import run_cli

    from diffexport.modeling.checkpoint import save_checkpoint
    from diffexport.modeling.families import build_model, config_from_dict

    cfg = config_from_dict("diff_v1", dict(vocab_size=256, d_model=256, n_layers=2, ffn_hidden=256, n_heads=2,
                                           n_kv_heads=1, head_dim=64))
    ckpt = save_checkpoint(build_model(cfg, seed=3), tmp_path / "v1.pt")
    result = run_cli("onnx", ckpt, "--kv-cache", "--fp16", "--attention", "diffattention", "-o", tmp_path / "kv")
    assert result.returncode == 0, result.stderr
    log = parse_with_plugin(tmp_path / "kv" / "model.onnx", graph)
    assert "Successfully created plugin: DiffAttention" in log, log[-3000:]
    assert "DiffAttention plugin:" not in log
    if "PARSED" in log:
        assert "PARSED ok=True plugin_layers=2" in log


def test_parser_reports_the_creators_reason(tmp_path):
    """A head dim the kernel lacks: the creator refuses the node and says why through the logger."""
    from helpers import run_cli

    path = tmp_path / "tiny.onnx"
    assert run_cli("onnx", "--preset", "diff-v1-tiny", "-o", path, "--fp16").returncode == 0
    log = parse_with_plugin(path, "staged")
    assert "PARSED ok=False plugin_layers=0" in log, log[-3000:]
    assert "DiffAttention plugin: " in log and "head_dim=32 is not supported" in log
