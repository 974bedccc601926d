"""The command line: fast --help without torch, the demo (README command 1), presets, info."""

import subprocess
import sys

from helpers import run_cli


def test_help_does_not_import_heavy_modules():
    code = ("import sys; from diffexport.cli import build_parser; build_parser().format_help(); "
            "heavy = [m for m in ('torch', 'onnx', 'onnxruntime', 'tensorrt', 'transformers') if m in sys.modules]; "
            "print(heavy); sys.exit(1 if heavy else 0)")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert result.returncode == 0, result.stdout + result.stderr


def test_demo_runs_on_default_model():
    result = run_cli("demo")
    assert result.returncode == 0, result.stderr
    assert "preset        diff-v1-tiny" in result.stdout
    assert "PASS" in result.stdout
    assert "error" not in result.stderr and "Traceback" not in result.stderr
    assert "polygraphy run" in result.stdout and "2 DiffAttention" in result.stdout


def test_presets_lists_the_zoo():
    result = run_cli("presets")
    assert result.returncode == 0
    for name in ("diff-v1-tiny", "diff-v2-tiny", "transformer-tiny", "diff-v1-3b", "diff-v1-13.1b"):
        assert name in result.stdout


def test_info_on_a_huge_preset_is_shape_only_and_quick():
    result = run_cli("info", "--preset", "diff-v1-13.1b")
    assert result.returncode == 0, result.stderr
    assert "13,2" in result.stdout and "(shape only)" in result.stdout


def test_info_shows_lambdas(tmp_path):
    from diffexport.checkpoint import save_checkpoint
    from diffexport.modeling import build_model
    from diffexport.presets import preset_config

    model = build_model(preset_config("diff-v1-tiny"), seed=3)
    path = save_checkpoint(model, tmp_path / "m.pt")
    result = run_cli("info", str(path))
    assert result.returncode == 0, result.stderr
    expected = [f"{lam:.4f}" for lam in model.lambdas()]
    assert all(value in result.stdout for value in expected)
    assert "0.2000" in result.stdout  # lambda_init of layer 0


def test_progress_only_on_a_terminal():
    import io

    from diffexport.progress import Progress

    class Tty(io.StringIO):
        def isatty(self):
            return True

    quiet = io.StringIO()
    with Progress("work", 10, stream=quiet) as p:
        p.advance(10)
    assert quiet.getvalue() == ""
    shown = Tty()
    with Progress("work", 10, stream=shown) as p:
        p.advance(10)
    assert "work" in shown.getvalue() and shown.getvalue().endswith("\n")
    small = Tty()
    with Progress("work", 10, min_total=100, stream=small) as p:
        p.advance(10)
    assert small.getvalue() == ""
