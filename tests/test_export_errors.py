"""Bad input to `diffexport onnx` / `diffexport check`: one line `error: ...`, exit 2, nothing half-written."""

import pytest
import torch

onnx = pytest.importorskip("onnx")
pytest.importorskip("onnxruntime")

from helpers import assert_one_line_error, cli_main  # noqa: E402

from diffexport.core.errors import DiffExportError  # noqa: E402
from diffexport.export import ExportOptions, export_onnx  # noqa: E402
from diffexport.modeling.checkpoint import load_model, save_checkpoint  # noqa: E402
from diffexport.modeling.families import build_model  # noqa: E402
from diffexport.modeling.presets import preset_config  # noqa: E402


@pytest.fixture(scope="module")
def tiny(artifacts):
    """A V1 checkpoint and its export, made once through the CLI."""
    ckpt = artifacts.checkpoint("diff-v1")
    assert "2 DiffAttention" in artifacts.cli_stdout("onnx", ckpt)
    return ckpt, artifacts.cli_output("onnx", ckpt)


@pytest.mark.slow
def test_cli_check_passes_on_its_own_export(tiny):
    ckpt, model = tiny
    result = cli_main("check", model, "--ckpt", ckpt, "--shapes", "1x3,2x5")
    assert result.returncode == 0, result.stderr
    assert "result        PASS" in result.stdout and "polygraphy run" in result.stdout


@pytest.mark.slow
def test_the_baseline_exports_as_the_baseline_in_both_exports(tmp_path):
    """One story for a baseline Transformer (a plain Llama reads as one): the prefill export and the
    KV-cache export both take it, both say it is the baseline with no DiffAttention node, and check
    passes on it (issue 46, friction d)."""
    ckpt = save_checkpoint(build_model(preset_config("transformer-tiny"), seed=0), tmp_path / "base.pt")
    note = "a baseline Transformer (standard attention, no DiffAttention node: the op is for DIFF models)"
    prefill = cli_main("onnx", ckpt, "-o", tmp_path / "m.onnx")
    assert prefill.returncode == 0 and note in prefill.stdout, prefill.stdout + prefill.stderr
    folder = cli_main("onnx", ckpt, "--kv-cache", "-o", tmp_path / "kv")
    assert folder.returncode == 0 and note in folder.stdout, folder.stdout + folder.stderr
    checked = cli_main("check", tmp_path / "m.onnx", "--ckpt", ckpt, "--shapes", "1x5,2x9")
    assert checked.returncode == 0 and "result        PASS" in checked.stdout, checked.stdout + checked.stderr


@pytest.mark.slow
def test_output_in_a_missing_folder_creates_it(tmp_path):
    """-o into folders that do not exist yet makes them (as optimum-cli does); under a file it is one line."""
    result = cli_main("onnx", "--preset", "diff-v1-tiny", "-o", tmp_path / "new" / "deeper" / "m.onnx")
    assert result.returncode == 0, result.stderr
    assert (tmp_path / "new" / "deeper" / "m.onnx").is_file()
    (tmp_path / "afile").write_text("x")
    result = cli_main("onnx", "--preset", "diff-v1-tiny", "-o", tmp_path / "afile" / "sub" / "m.onnx")
    assert_one_line_error(result, "is not a folder")
    assert (tmp_path / "afile").read_text() == "x"


@pytest.mark.parametrize("content", [b"", b"\x08\x07garbage-not-a-protobuf" * 10])
def test_corrupt_onnx_given_to_check(tmp_path, content):
    bad = tmp_path / "bad.onnx"
    bad.write_bytes(content)
    result = cli_main("check", bad, "--preset", "diff-v1-tiny")
    assert_one_line_error(result, "")
    assert "bad.onnx" in result.stderr


def test_truncated_onnx_given_to_check(tiny, tmp_path):
    _, model = tiny
    cut = tmp_path / "cut.onnx"
    cut.write_bytes(model.read_bytes()[: model.stat().st_size // 2])
    assert_one_line_error(cli_main("check", cut, "--preset", "diff-v1-tiny"), "cut.onnx")


def test_foreign_onnx_without_metadata(tmp_path):
    from onnx import TensorProto, helper

    graph = helper.make_graph([helper.make_node("Neg", ["x"], ["y"])], "g",
                              [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1])])
    onnx.save(helper.make_model(graph), tmp_path / "neg.onnx")
    assert_one_line_error(cli_main("check", tmp_path / "neg.onnx", "--preset", "diff-v1-tiny"),
                          "no diffexport metadata")


@pytest.mark.slow
def test_checkpoint_of_another_preset(tiny):
    """A preset is held to the export's configuration on shapes alone, before its weights are built:
    a 13B preset (49 GiB of float32) is the same one line as a small one, on any machine."""
    _, model = tiny
    assert_one_line_error(cli_main("check", model, "--preset", "diff-v2-tiny"), "holds a diff_v1 model")
    assert_one_line_error(cli_main("check", model, "--preset", "diff-v1-3b"), "different configuration")
    assert_one_line_error(cli_main("check", model, "--preset", "diff-v1-13.1b"), "different configuration")


@pytest.mark.slow
def test_same_preset_other_weights(tiny):
    _, model = tiny
    assert_one_line_error(cli_main("check", model, "--preset", "diff-v1-tiny", "--seed", "7"), "other weights")


@pytest.mark.slow
def test_bad_shapes_argument(tiny):
    ckpt, model = tiny
    assert_one_line_error(cli_main("check", model, "--ckpt", ckpt, "--shapes", "2by3"), "BATCHxSEQ")


@pytest.mark.slow
def test_bf16_on_the_cpu_provider_says_what_to_use(tmp_path):
    loaded = load_model(None, preset="diff-v1-tiny", dtype=__import__("torch").bfloat16)
    export_onnx(loaded, tmp_path / "bf16.onnx", ExportOptions(dtype="bfloat16"), log=lambda _: None)
    assert_one_line_error(cli_main("check", tmp_path / "bf16.onnx", "--preset", "diff-v1-tiny", "--provider", "cpu"),
                           "CUDA provider or TensorRT")


@pytest.mark.slow
def test_interrupted_export_leaves_nothing(tmp_path, monkeypatch):
    """Ctrl-C while the weights are being written: no model.onnx, no temporary folder, no .data file."""
    import onnx_ir

    real_save = onnx_ir.save

    def save_then_interrupt(model, path, **kwargs):
        real_save(model, path, **kwargs)  # the temporary file is complete on disk...
        raise KeyboardInterrupt  # ...and the user presses Ctrl-C before it is published

    monkeypatch.setattr(onnx_ir, "save", save_then_interrupt)
    loaded = load_model(None, preset="diff-v1-tiny")
    for external in (False, True):
        with pytest.raises(KeyboardInterrupt):
            export_onnx(loaded, tmp_path / "model.onnx", ExportOptions(external_data=external), log=lambda _: None)
        assert list(tmp_path.iterdir()) == []


@pytest.mark.slow
def test_failed_check_of_the_graph_leaves_an_older_export_intact(tmp_path, monkeypatch):
    """An export that fails after tracing must not replace a good model.onnx already there."""
    loaded = load_model(None, preset="diff-v1-tiny")
    good = export_onnx(loaded, tmp_path / "model.onnx", log=lambda _: None).path
    before = good.read_bytes()

    def broken(*args, **kwargs):
        raise onnx.checker.ValidationError("synthetic failure")

    monkeypatch.setattr(onnx.checker, "check_model", broken)
    with pytest.raises(DiffExportError, match="onnx.checker"):  # asked to replace it (--force), and failing
        export_onnx(loaded, tmp_path / "model.onnx", ExportOptions(force=True), log=lambda _: None)
    assert good.read_bytes() == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["model.onnx"]


@pytest.mark.parametrize("command", [["onnx", "-o", "x.onnx"], ["check", "x.onnx"]])
def test_a_model_must_be_named(command, tmp_path, tiny):
    """No silent random model: export and check need a checkpoint or --preset."""
    _, model = tiny
    args = [model if a == "x.onnx" and command[0] == "check" else tmp_path / a if a == "x.onnx" else a
            for a in command]
    assert_one_line_error(cli_main(*args), "name the model")


@pytest.mark.slow
def test_fp16_export_of_weights_beyond_its_range_is_refused(tmp_path):
    """A finite fp32 weight fp16 cannot hold would export as inf: one line naming it, nothing written."""
    model = load_model(None, preset="diff-v1-tiny", seed=0).model
    with torch.no_grad():
        model.layers[0].mlp.up_proj.weight[0, 0] = 1e5
    ckpt = save_checkpoint(model, tmp_path / "big.pt")
    result = cli_main("onnx", ckpt, "--fp16", "-o", tmp_path / "m.onnx")
    assert_one_line_error(result, "layers.0.mlp.up_proj.weight holds values up to 1e+05, beyond float16's range")
    assert not (tmp_path / "m.onnx").exists()
    assert cli_main("onnx", ckpt, "--bf16", "-o", tmp_path / "b.onnx").returncode == 0


@pytest.mark.slow
def test_export_removes_only_the_data_file_of_the_export_it_replaces(tmp_path):
    """Re-exporting without external data removes the .data file the replaced export used, and
    never an unrelated file that merely has the name."""
    out, data = tmp_path / "m.onnx", tmp_path / "m.onnx.data"
    data.write_text("someone else's file")
    assert_one_line_error(cli_main("onnx", "--preset", "diff-v1-tiny", "-o", out), "m.onnx.data already exists")
    assert cli_main("onnx", "--preset", "diff-v1-tiny", "-o", out, "--force").returncode == 0
    assert data.read_text() == "someone else's file"  # --force replaces the export, never an unrelated file
    data.unlink()
    assert cli_main("onnx", "--preset", "diff-v1-tiny", "-o", out, "--external-data", "--force").returncode == 0
    assert data.stat().st_size > 100_000
    assert cli_main("onnx", "--preset", "diff-v1-tiny", "-o", out, "--force").returncode == 0
    assert not data.exists()  # the replaced export's weights: stale, removed


def test_onnx_without_a_model_asks_for_the_model_before_the_output(tmp_path, monkeypatch):
    """`diffexport onnx` with no arguments, where model.onnx (or model-kv/) is already there: the
    error names the missing model, not the existing output."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "model.onnx").write_bytes(b"an earlier export")
    (tmp_path / "model-kv").mkdir()
    for args in ((), ("--kv-cache",)):
        result = cli_main("onnx", *args)
        assert_one_line_error(result, "name the model")
        assert "exists" not in result.stderr
    assert (tmp_path / "model.onnx").read_bytes() == b"an earlier export"
