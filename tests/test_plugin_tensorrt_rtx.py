"""The built plugin library inside a TensorRT-family plugin registry (TensorRT-RTX, on the CPU):
loading (twice), the creator found by the contract's name/version/namespace, its field list,
plugin creation from good and bad field collections, the plugin's core names and its metadata.

TensorRT-RTX can go no further with a C++ plugin: its ONNX parser aborts on plugin nodes and its
network API has no plugin layer, so engines with the plugin are built on users' machines only.
Skipped unless the plugin library is built (it needs TensorRT's headers: cmake -DTensorRT_ROOT=...)
and tensorrt_rtx is installed."""

import os
from pathlib import Path

import pytest

trt = pytest.importorskip("tensorrt_rtx")
np = pytest.importorskip("numpy")

from diffexport import contract  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
PLUGIN = Path(os.environ.get("DIFFEXPORT_PLUGIN_LIB", ROOT / "build" / "plugins" / "tensorrt" / "libdiffexport_plugins.so"))

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
