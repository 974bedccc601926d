"""The command line: fast --help without torch, presets, info. The demo (README command 1) is run
by the installed wheel's script (tests/test_wheel.py)."""

import dataclasses
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from helpers import cli_main, run_cli

from diffexport.cli import main


def test_help_does_not_import_heavy_modules():
    code = ("import sys; from diffexport.cli import build_parser; build_parser().format_help(); "
            "heavy = [m for m in ('torch', 'onnx', 'onnxruntime', 'tensorrt', 'transformers') if m in sys.modules]; "
            "print(heavy); sys.exit(1 if heavy else 0)")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert result.returncode == 0, result.stdout + result.stderr


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
    from diffexport.modeling.checkpoint import save_checkpoint
    from diffexport.modeling.families import build_model
    from diffexport.modeling.presets import preset_config

    model = build_model(preset_config("diff-v1-tiny"), seed=3)
    path = save_checkpoint(model, tmp_path / "m.pt")
    result = run_cli("info", str(path))
    assert result.returncode == 0, result.stderr
    expected = [f"{lam:.4f}" for lam in model.lambdas()]
    assert all(value in result.stdout for value in expected)
    assert "0.2000" in result.stdout  # lambda_init of layer 0


def test_progress_only_on_a_terminal():
    import io

    from diffexport.core.progress import Progress

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


def test_readme_command_list_names_every_flag():
    """Every long flag of every subcommand appears in the README's command list."""
    import argparse
    import re

    from diffexport.cli import build_parser

    readme = (Path(__file__).resolve().parent.parent / "README.md").read_text()
    block = readme[readme.index("## Commands"):readme.index("## Layout")]
    parser = build_parser()
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    missing = []
    for name, command in sub.choices.items():
        assert f"diffexport {name}" in block, name
        for action in command._actions:
            flags = [f for f in action.option_strings if f not in ("-h", "--help")]
            if flags and not any(re.search(re.escape(f) + r"(?![\w-])", block) for f in flags):
                missing.append(f"{name} {flags[-1]}")
    assert not missing, missing


def test_trt_help_says_what_fp16_means():
    result = run_cli("trt", "--help")
    assert "Not trtexec's --fp16" in " ".join(result.stdout.split())


def test_check_refuses_bad_user_bounds_in_one_line(tmp_path):
    from helpers import assert_one_line_error

    for name in ("model.onnx", "other.onnx"):  # present (a missing one is refused first), never read
        (tmp_path / name).write_bytes(b"")
    result = run_cli("check", tmp_path / "model.onnx", "--against", tmp_path / "other.onnx", "--atol", "-1")
    assert_one_line_error(result, "--atol must be a finite number >= 0")


@pytest.mark.parametrize("error, where", [(MemoryError(), "out of host memory"),
                                          (torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 80 GiB"),
                                           "out of GPU memory")])
def test_running_out_of_memory_is_one_line_not_a_bug_report(monkeypatch, capsys, error, where):
    from diffexport import cli

    def exhausted(args):
        """Statistics that ran out of memory."""
        raise error

    monkeypatch.setitem(cli.COMMANDS, "stats", dataclasses.replace(cli.COMMANDS["stats"], run=exhausted))
    assert cli.main(["stats"]) == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"error: {where}") and "internal error" not in lines[0]


def test_in_process_cli_gives_what_the_process_gives(tmp_path):
    """The suite's error-path tests run cli.main in-process (helpers.cli_main): for a usage error, a
    one-line refusal and a command's output, exit status, stdout and stderr are the child's, byte
    for byte; stdin reaches the command; the environment, directory and SIGTERM handler come back."""
    import os
    import signal

    handler, cwd, env = signal.getsignal(signal.SIGTERM), os.getcwd(), dict(os.environ)
    for argv in (["onnx", "--frobnicate"], ["info", tmp_path / "nope.pt"], ["presets"]):
        child, here = run_cli(*argv), cli_main(*argv)
        assert (here.returncode, here.stdout, here.stderr) == (child.returncode, child.stdout, child.stderr), argv
    assert cli_main("info", tmp_path / "nope.pt").returncode == 2
    (tmp_path / "kv").mkdir()
    (tmp_path / "kv" / "genai_config.json").write_text("{}")
    piped = cli_main("generate", tmp_path / "kv", "--interactive", cwd=tmp_path, stdin=b"\xff\n")
    assert piped.returncode == 2 and piped.stderr.startswith("error: ")
    assert (signal.getsignal(signal.SIGTERM), os.getcwd(), dict(os.environ)) == (handler, cwd, env)


def test_mistyped_flags_commands_and_choices_are_one_line_naming_the_closest(capsys):
    """argparse's own mistakes follow the CLI's convention (one line, exit 2) and name what the user meant."""
    cases = [
        (["onnx", "--kvcache"], "error: diffexport onnx: unrecognized argument: --kvcache (did you mean --kv-cache?)"),
        (["generate", "kv", "--prompt", "hi", "--temprature=0.7", "--topk", "3"],
         "(did you mean --temperature for --temprature, --top-k for --topk?)"),
        (["onxx", "m.pt"], "invalid choice: 'onxx'"),
        (["onnx", "--attention", "gpa"], "(did you mean gqa?)"),
        (["inspect"], "error: diffexport inspect: the following arguments are required: model"),
    ]
    for argv, expected in cases:
        with pytest.raises(SystemExit) as exit_info:
            main(argv)
        err = capsys.readouterr().err
        assert exit_info.value.code == 2 and expected in err, (argv, err)
        assert len(err.strip().splitlines()) == 1 and err.startswith("error: ") and "--help`" in err, (argv, err)
    with pytest.raises(SystemExit):
        main(["onxx"])
    assert "(did you mean onnx?)" in capsys.readouterr().err



def test_a_new_users_wrong_turns_name_the_right_command(artifacts, tmp_path, capsys):
    """info on an export points at inspect; check without a model names what the export records;
    quantize writes beside the model when no -o is given (issue 46, friction f)."""
    exported = artifacts.copy(artifacts.cli_output("onnx", "--preset", "diff-v1-tiny"), tmp_path)
    assert main(["info", str(exported)]) == 2
    assert f"`diffexport inspect {exported}` describes it" in capsys.readouterr().err
    assert main(["check", str(exported)]) == 2
    err = capsys.readouterr().err
    assert "it records a preset's seeded weights, so --preset diff-v1-tiny [--seed N]" in err, err
    assert main(["quantize", str(exported), "--weights", "int8"]) == 0
    assert (tmp_path / "model-int8.onnx").is_file() and f"wrote         {tmp_path / 'model-int8.onnx'}" in \
        capsys.readouterr().out


def test_a_missing_input_fails_before_the_heavy_imports():
    """A typo in a path is one line in a fraction of a second: refused before torch loads (issue 46, h)."""
    import sys

    code = ("import sys\nfrom diffexport.cli import main\n"
            "codes = [main(a) for a in (['info', 'missing.pt'], ['onnx', 'missing.pt'], ['stats', 'a.pt', "
            "'missing.pt'],"
            " ['check', 'missing.onnx', '--preset', 'diff-v1-tiny'], ['generate', 'missing-kv', '--prompt', 'hi'],"
            " ['quantize', 'missing.onnx'], ['trt', 'missing.onnx'])]\n"
            "print(codes, 'torch' in sys.modules, 'onnx' in sys.modules, 'transformers' in sys.modules)")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert result.stdout.strip() == "[2, 2, 2, 2, 2, 2, 2] False False False", result.stdout + result.stderr
    lines = result.stderr.strip().splitlines()
    assert lines[0] == "error: checkpoint not found: missing.pt" and len(lines) == 7, result.stderr
    assert lines[4].startswith("error: missing-kv is not a folder") and "exported .onnx file" in lines[5]


def test_one_rule_for_outputs_already_there(artifacts, tmp_path):
    """onnx, quantize, optimize and their folders: an existing output is refused in one line and left
    as it was; --force replaces it whole (issue 46, friction e). A link is never written through."""
    from helpers import assert_one_line_error

    exported = artifacts.copy(artifacts.cli_output("onnx", "--preset", "diff-v1-tiny"), tmp_path)
    target = tmp_path / "taken.onnx"
    target.write_bytes(b"the user's own file")
    for argv in (["onnx", "--preset", "diff-v1-tiny", "-o", target], ["quantize", exported, "-o", target],
                 ["optimize", exported, "-o", target]):
        assert_one_line_error(cli_main(*argv), f"{target} already exists: give a new name, or --force")
        assert target.read_bytes() == b"the user's own file"
    assert cli_main("quantize", exported, "-o", target, "--force").returncode == 0
    assert target.stat().st_size > 1000
    folder = tmp_path / "kv"
    folder.mkdir()
    (folder / "notes.txt").write_text("mine")
    assert_one_line_error(cli_main("onnx", "--preset", "diff-v1-tiny", "--kv-cache", "-o", folder), "already exists")
    assert sorted(p.name for p in folder.iterdir()) == ["notes.txt"]
    assert cli_main("onnx", "--preset", "diff-v1-tiny", "--kv-cache", "-o", folder, "--force").returncode == 0
    assert (folder / "genai_config.json").is_file() and not (folder / "notes.txt").exists()
    assert sorted(p.name for p in tmp_path.iterdir() if p.name.startswith(".")) == []  # nothing left aside
    link = tmp_path / "link.onnx"
    link.symlink_to(target)
    assert_one_line_error(cli_main("onnx", "--preset", "diff-v1-tiny", "-o", link, "--force"), "is a symbolic link")


def test_a_decoder_check_shows_its_decode_steps_on_a_terminal(artifacts, monkeypatch):
    """check of a folder runs prefill + N decode steps (minutes for a big or quantised folder): on a
    terminal a progress line moves with them, and the transformers reference is announced."""
    import io

    from diffexport.modeling.checkpoint import load_model
    from diffexport.validation.decoder import run_decoder_check
    from diffexport.validation.options import CheckOptions

    class Tty(io.StringIO):
        def isatty(self):
            return True

    shown = Tty()
    monkeypatch.setattr(sys, "stderr", shown)
    loaded = load_model(artifacts.checkpoint("diff-v1-gqa"))
    report = run_decoder_check(artifacts.decoder("diff-v1-gqa"), loaded, CheckOptions(provider="cpu"), log=print,
                               steps=3)
    assert report.passed
    assert "decode steps" in shown.getvalue() and "decode steps done in" in shown.getvalue()
