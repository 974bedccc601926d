"""Nothing pre-existing destroyed (issue 59, item 4): an output that is, contains or lies inside an
input is refused in one line whatever --force says, in every command that writes; `-o .` and
`-o ..` name nothing of their own; a file rewritten in place (a checked folder's card) keeps its
mode."""

import os
import stat

import pytest
from helpers import assert_one_line_error, cli_main

from diffexport.core.errors import DiffExportError
from diffexport.core.files import atomic_write, refuse_output_over_inputs
from diffexport.format import model_card


@pytest.fixture(scope="module")
def home(artifacts, tmp_path_factory):
    """A user's folder holding a KV-cache folder, a checkpoint and an unrelated file of theirs."""
    import shutil

    root = tmp_path_factory.mktemp("home")
    shutil.copytree(artifacts.decoder("diff-v1-gqa", "gqa"), root / "kv")
    shutil.copy(artifacts.checkpoint("diff-v1-gqa"), root / "ckpt.pt")
    (root / "mine.txt").write_text("the user's own file")
    return root


def _untouched(home):
    assert (home / "mine.txt").read_text() == "the user's own file"
    assert (home / "kv" / "model.onnx").is_file() and (home / "ckpt.pt").is_file()
    assert not [p for p in home.parent.iterdir() if p.name.endswith((".old", ".tmp"))]


@pytest.mark.parametrize("args, output, how", [
    (("quantize", "{home}/kv"), "{home}", "contains the input"),
    (("quantize", "{home}/kv"), "{home}/kv", "is the input"),
    (("quantize", "{home}/kv"), "{home}/kv/q", "lies inside the input"),
    (("triton", "{home}/kv"), "{home}", "contains the input"),
    (("onnx", "{home}/ckpt.pt", "--kv-cache"), "{home}", "contains the input"),
    (("onnx", "{home}/ckpt.pt"), "{home}/ckpt.pt", "is the input"),
    (("report", "{home}/kv"), "{home}/kv/r.html", "lies inside the input"),
    (("optimize", "{home}/kv/model.onnx"), "{home}/kv/model.onnx", "is the input"),
])
def test_an_output_over_an_input_is_refused_even_with_force(home, args, output, how):
    command = [a.format(home=home) for a in args] + ["-o", output.format(home=home), "--force"]
    assert_one_line_error(cli_main(*command), how)
    _untouched(home)


@pytest.mark.parametrize("output", [".", ".."])
def test_dot_outputs_name_nothing_of_their_own(home, output):
    assert_one_line_error(cli_main("quantize", home / "kv", "-o", output, "--force", cwd=home),
                          "names no file or folder of its own")
    _untouched(home)


def test_a_link_to_the_input_counts_as_the_input(home, tmp_path):
    (tmp_path / "alias").symlink_to(home)
    with pytest.raises(DiffExportError, match="contains the input"):
        refuse_output_over_inputs(tmp_path / "alias", [home / "kv"])
    refuse_output_over_inputs(tmp_path / "beside", [home / "kv", "org/not-a-path"])  # siblings and hub ids pass


def test_a_rewritten_file_keeps_its_mode(home, tmp_path):
    private = tmp_path / "private.txt"
    private.write_text("old")
    private.chmod(0o600)
    atomic_write(private, lambda tmp: open(tmp, "w").write("new"))
    assert private.read_text() == "new" and stat.S_IMODE(private.stat().st_mode) == 0o600
    fresh = tmp_path / "fresh.txt"
    atomic_write(fresh, lambda tmp: open(tmp, "w").write("x"))
    umask = os.umask(0)
    os.umask(umask)
    assert stat.S_IMODE(fresh.stat().st_mode) == 0o666 & ~umask
    card = home / "kv" / model_card.CARD  # check's results update: a 0600 card stays 0600
    card.chmod(0o600)
    assert model_card.update_results(home / "kv", ["checked here"])
    assert stat.S_IMODE(card.stat().st_mode) == 0o600 and "checked here" in card.read_text()
