"""`diffexport inspect`: what an ONNX file holds, in text and JSON, without loading weights."""

import json

import pytest

onnx = pytest.importorskip("onnx")

from helpers import assert_one_line_error, cli_main  # noqa: E402

from diffexport.export import ExportOptions, export_onnx  # noqa: E402
from diffexport.modeling.checkpoint import load_model  # noqa: E402

pytestmark = pytest.mark.slow  # exports, emulation or training: see README (quick loop)


@pytest.fixture(scope="module")
def external_export(tmp_path_factory):
    path = tmp_path_factory.mktemp("inspect") / "m.onnx"
    export_onnx(load_model(None, preset="diff-v1-tiny"), path, ExportOptions(external_data=True, hidden=True),
                log=lambda _: None)
    return path


def test_json_describes_the_export(external_export, tmp_path):
    result = cli_main("inspect", external_export, "--json")
    assert result.returncode == 0, result.stderr
    info = json.loads(result.stdout)
    assert info["opsets"] == {"ai.onnx": 18, "diffexport": 1}
    assert info["inputs"] == [{"name": "input_ids", "dtype": "int64", "shape": ["batch", "sequence"]}]
    assert [o["name"] for o in info["outputs"]] == ["logits", "last_hidden_state"]
    assert info["outputs"][0]["shape"] == ["batch", "sequence", 512]
    assert len(info["diff_attention"]) == 2 and info["histogram"]["diffexport::DiffAttention"] == 2
    node = info["diff_attention"][0]["attributes"]
    assert list(node)[:4] == ["variant", "num_heads", "num_kv_heads", "head_dim"]
    assert node["plugin_namespace"] == "diffexport" and node["num_heads"] == 2
    assert info["weights"]["external_data"] == {"m.onnx.data": "present"}
    assert 499_000 < info["weights"]["parameters"] < 501_000
    assert 4 * info["weights"]["parameters"] <= info["weights"]["bytes"] < 4.01 * info["weights"]["parameters"]
    assert info["metadata"]["diffexport.family"] == "diff_v1"
    assert info["runtimes"]["onnxruntime"].startswith("yes") and "bfloat16" not in info["runtimes"]["onnxruntime"]
    # this preset's head_dim 32 is outside the plugin's kernels (64, 128): one rule, shared with `trt`
    assert info["runtimes"]["tensorrt_plugin"].startswith("no: head_dim 32: the fused kernel and the DiffAttention "
                                                          "plugin take head_dim 64 or 128; build with `diffexport trt "
                                                          "--attention native`")
    model = onnx.load(str(external_export))
    for node in model.graph.node:
        if node.op_type == "DiffAttention":
            next(a for a in node.attribute if a.name == "head_dim").i = 64
    onnx.save(model, str(tmp_path / "d64.onnx"), save_as_external_data=True, location="d64.onnx.data")
    info = json.loads(cli_main("inspect", tmp_path / "d64.onnx", "--json").stdout)
    assert "TensorRT >= 10.7 picks it" in info["runtimes"]["tensorrt_plugin"]


def test_bf16_graph_is_flagged_for_cuda_only(tmp_path):
    path = tmp_path / "bf16.onnx"
    export_onnx(load_model(None, preset="diff-v2-tiny"), path, ExportOptions(dtype="bfloat16"), log=lambda _: None)
    info = json.loads(cli_main("inspect", path, "--json").stdout)
    assert info["outputs"][0]["dtype"] == "bfloat16"
    assert info["runtimes"]["onnxruntime"].endswith("bfloat16: CUDA provider only (the CPU provider has no bfloat16 "
                                                    "kernels)")


def test_text_report_and_missing_external_data(external_export, tmp_path):
    text = cli_main("inspect", external_export).stdout
    assert "input         input_ids int64 [batch, sequence]" in text and "DiffAttention 2 node(s)" in text
    assert "model         diff_v1 float32, 2 layers, d_model 128, vocab 512; rope theta 10000.0\n" in text
    edited = onnx.load(str(external_export), load_external_data=False)  # metadata is shown, never trusted
    next(p for p in edited.metadata_props if p.key == "diffexport.config").value = "{not json"
    onnx.save(edited, str(tmp_path / "edited.onnx"))
    assert "model         diff_v1 float32 (its config metadata is not readable)" in cli_main(
        "inspect", tmp_path / "edited.onnx").stdout
    lonely = tmp_path / "m.onnx"
    lonely.write_bytes(external_export.read_bytes())  # the .data file stays behind
    assert "m.onnx.data (MISSING)" in cli_main("inspect", lonely).stdout


def test_a_kv_cache_folder_is_inspected_through_its_decoder(tmp_path):
    from diffexport.export.decoder import export_decoder_graph as export_decoder

    folder = tmp_path / "kv"
    export_decoder(load_model(None, preset="diff-v2-tiny"), folder, context_length=64, log=lambda _: None)
    info = json.loads(cli_main("inspect", folder, "--json").stdout)
    assert info["path"] == str(folder / "model.onnx") and info["metadata"]["diffexport.kv_cache"] == "1"
    assert info["decoder_folder"] == {"context_length": 64, "providers": ["cpu"]}
    assert [i["name"] for i in info["inputs"]][:3] == ["input_ids", "attention_mask", "past_key_values.0.key"]
    assert "genai         KV-cache folder: context 64 tokens, provider cpu" in cli_main("inspect", folder).stdout
    config = json.loads((folder / "genai_config.json").read_text())
    config["model"]["decoder"]["session_options"] = ["cuda"]  # a hand-edited config: refused, not a traceback
    (folder / "genai_config.json").write_text(json.dumps(config))
    assert_one_line_error(cli_main("inspect", folder), "provider_options must be a list")
    (tmp_path / "plain").mkdir()
    assert_one_line_error(cli_main("inspect", tmp_path / "plain"), "has no genai_config.json")


def test_folders_and_devices_are_told_apart_from_missing_files(tmp_path):
    """Where a file is wanted, a folder or a device is named as such, not reported missing."""
    (tmp_path / "dir.onnx").mkdir()
    for argv, message in [
        (("inspect", tmp_path / "nope.onnx"), "nope.onnx does not exist: give an .onnx file"),
        (("check", "/dev/null", "--preset", "diff-v1-tiny"), "/dev/null is not a regular file (a device"),
        (("quantize", "/dev/null", "-o", tmp_path / "q.onnx"), "/dev/null is not a regular file (a device"),
        (("check", tmp_path / "dir.onnx", "--against", tmp_path / "dir.onnx"), "dir.onnx is a folder: give an .onnx"),
        (("check", tmp_path / "dir.engine", "--preset", "diff-v1-tiny"), "dir.engine does not exist: give an engine"),
    ]:
        assert_one_line_error(cli_main(*argv), message)
    from diffexport.backends.tensorrt import read_engine_record
    from diffexport.core.errors import DiffExportError

    (tmp_path / "dir.engine").mkdir()
    with pytest.raises(DiffExportError, match="dir.engine is a folder: give an engine built by `diffexport trt`"):
        read_engine_record(tmp_path / "dir.engine")  # what generate --engine and check model.engine read first


def test_foreign_and_bad_files(tmp_path):
    from onnx import TensorProto, helper

    graph = helper.make_graph([helper.make_node("Neg", ["x"], ["y"])], "g",
                              [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["n"])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["n"])])
    onnx.save(helper.make_model(graph), tmp_path / "neg.onnx")
    info = json.loads(cli_main("inspect", tmp_path / "neg.onnx", "--json").stdout)
    assert info["diff_attention"] == [] and info["runtimes"]["onnxruntime"].startswith("yes")
    (tmp_path / "bad.onnx").write_bytes(b"\x01\x02not onnx" * 5)
    result = cli_main("inspect", tmp_path / "bad.onnx")
    assert result.returncode == 2 and result.stderr.startswith("error: ") and "bad.onnx" in result.stderr
