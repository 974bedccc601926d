"""The model card (README.md) of every decoder folder: export writes it in the Hub's format, quantize
writes one for what its folder holds (a card the user wrote is carried, never replaced), `check`
fills in the results section of our card only, atomically; its Python runs as written."""

import re

import pytest
from helpers import cli_main

from diffexport.format import model_card

pytestmark = pytest.mark.slow  # exports: see README (quick loop)


@pytest.fixture(scope="module")
def folder(artifacts):
    """An HF DiffLlama KV-cache folder with its tokenizer (shared: tests copy it before changing it)."""
    return artifacts.cli_output("onnx", artifacts.hf_diffllama_with_chat_template(), "--kv-cache", output="kv")


def _header(text: str) -> dict:
    import yaml

    match = re.match(r"^---\n(.*?)\n---\n", text, re.S)
    assert match, text[:200]
    return yaml.safe_load(match.group(1))


def test_export_writes_a_hub_card(folder):
    text = (folder / model_card.CARD).read_text()
    header = _header(text)
    assert header["library_name"] == "onnxruntime-genai" and header["pipeline_tag"] == "text-generation"
    assert {"diffexport", "differential-transformer", "onnx", "diff_v1"} <= set(header["tags"])
    assert model_card.MARKER in text and model_card.is_ours(folder / model_card.CARD)
    for fact in ("from hf-diffllama `diffllama`", "| dtype | float32 |", "| context length | 512 tokens |",
                 "| tokenizer | included |",
                 # the CPU default's form, and what to export for TensorRT instead
                 "`gqa` (GroupQueryAttention (onnxruntime contrib op); onnxruntime only: for TensorRT, export with "
                 "`--attention diffattention`)"):
        assert fact in text, fact
    # the export's card says it is not checked yet; the folder is the session's, and a `check` of it
    # in another test fills that section in by design, so the fresh card is asked of what export calls
    fresh = model_card.decoder_card(folder, "model.onnx", folder.name)
    results = fresh[fresh.index(model_card.RESULTS_START):fresh.index(model_card.RESULTS_END)]
    assert model_card.NOT_CHECKED in results
    assert _header(fresh) == header


def test_the_cards_python_runs_as_written(folder):
    """The card's onnxruntime-genai example, run with FOLDER replaced by the folder."""
    import contextlib
    import io

    text = (folder / model_card.CARD).read_text()
    code = re.search(r"```python\n(.*?)```", text, re.S).group(1).replace('"FOLDER"', repr(str(folder)))
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        exec(compile(code, "README.md", "exec"), {})
    assert out.getvalue().strip()


def test_check_fills_in_our_results_and_leaves_a_users_card_alone(folder, artifacts, tmp_path):
    checked = artifacts.copy(folder, tmp_path, "checked")
    ckpt = artifacts.hf_diffllama_with_chat_template()
    result = cli_main("check", checked, "--ckpt", ckpt, "--steps", "4")
    assert result.returncode == 0, result.stderr
    text = (checked / model_card.CARD).read_text()
    section = text[text.index(model_card.RESULTS_START):text.index(model_card.RESULTS_END)]
    assert "**PASS** on " in section and f"`diffexport check checked --ckpt {ckpt.name}`" in section
    assert "result        PASS" in section and model_card.NOT_CHECKED not in section
    assert "results section updated" in result.stdout
    def outside(card):  # the card without its results section
        return card[:card.index(model_card.RESULTS_START)] + card[card.index(model_card.RESULTS_END):]

    assert outside(text) == outside((folder / model_card.CARD).read_text())  # nothing else changed
    assert not list(checked.glob(".*.tmp"))  # written through a temporary file, none left
    mine = artifacts.copy(folder, tmp_path, "mine")
    (mine / model_card.CARD).write_text("# my notes\n" + model_card.RESULTS_START + "\n" + model_card.RESULTS_END)
    result = cli_main("check", mine, "--ckpt", ckpt, "--steps", "4")
    assert result.returncode == 0 and "card " not in result.stdout
    assert (mine / model_card.CARD).read_text().startswith("# my notes\n")
    linked = artifacts.copy(folder, tmp_path, "linked")
    (linked / model_card.CARD).unlink()
    (linked / model_card.CARD).symlink_to(folder / model_card.CARD)  # a link is never written through
    assert not model_card.update_results(linked, ["x"])


def test_quantize_writes_its_own_card_and_carries_a_users(folder, artifacts, tmp_path):
    result = cli_main("quantize", folder, "-o", tmp_path / "int4", "--weights", "int4")
    assert result.returncode == 0, result.stderr
    text = (tmp_path / "int4" / model_card.CARD).read_text()
    assert "# int4: " in text and "| weights | int4 MatMulNBits (block 32, rtn) |" in text
    assert model_card.NOT_CHECKED in text
    mine = artifacts.copy(folder, tmp_path, "mine")
    (mine / model_card.CARD).write_text("# my card\n")
    result = cli_main("quantize", mine, "-o", tmp_path / "mine-int4", "--weights", "int4")
    assert result.returncode == 0, result.stderr
    assert (tmp_path / "mine-int4" / model_card.CARD).read_text() == "# my card\n"


def test_a_card_names_a_hub_base_model_only_for_a_hub_id(tmp_path):
    assert model_card.HUB_ID.match("org/name") and not model_card.HUB_ID.match("diffllama")
    assert not model_card.HUB_ID.match("../x") and not model_card.HUB_ID.match("/abs/path")


HOSTILE_TEXT = {  # metadata a stranger's checkpoint or graph can carry into a card
    "source": "<script>alert(1)</script>",
    "source_name": "x`<img src=x onerror=alert(1)>`|y\n---\npipeline_tag: evil",
    "source_revision": "a**b**[link](javascript:alert(1))\n# heading",
}


def test_strangers_metadata_reaches_the_card_as_text(folder, tmp_path):
    """Every metadata string of the graph that the card shows is written as text: HTML's < and >
    as entities or inside a code span, no newline (so no --- that ends the front matter, no heading),
    no emphasis or link, no | that splits a table; the YAML header is exactly the one a clean folder
    gets. A check report line with a code fence stays inside the results' fence."""
    import shutil

    import onnx

    from diffexport.format.metadata_keys import META_PREFIX

    copy = shutil.copytree(folder, tmp_path / "kv")
    model = onnx.load(copy / "model.onnx", load_external_data=False)
    props = {p.key: p for p in model.metadata_props}
    for key, value in HOSTILE_TEXT.items():
        if META_PREFIX + key in props:
            props[META_PREFIX + key].value = value
        else:
            model.metadata_props.add(key=META_PREFIX + key, value=value)
    onnx.save(model, copy / "model.onnx")
    card = model_card.decoder_card(copy, "model.onnx", "kv")
    clean = model_card.decoder_card(folder, "model.onnx", "kv")
    assert _header(card) == _header(clean)
    assert card.count("\n---\n") == clean.count("\n---\n") and "\n# heading" not in card
    assert "<script" not in card and "<img" not in card.replace("`<img", "")  # only inside a code span
    line = next(line for line in card.splitlines() if line.startswith("Exported by"))
    assert line.startswith("Exported by diffexport") and "from &lt;script&gt;alert(1)&lt;/script&gt; " in line
    assert "``x`<img src=x onerror=alert(1)>`\\|y --- pipeline_tag: evil``" in line  # a code span: text
    assert "(revision `a**b**[link](javascript:alert(1)) # heading`)" in line
    results = model_card.results_lines("FAIL", ["```", "<b>not bold</b>"], "diffexport check x")
    assert results[2] == results[-1] == "````" and results[3:5] == ["```", "<b>not bold</b>"]
