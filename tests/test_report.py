"""`diffexport report`: one self-contained HTML page per artifact (diffexport/report/).

The page is built from a real check and a real speed measurement, and is held to them: its numbers
are the check's, its plots are PNGs that decode, nothing in it reaches the network, every string
from the artifact is escaped. Headless Chromium (Debian's package, driven by Playwright) renders
it: no console error, every plot loaded, a screenshot taken. Where no Chromium is installed that
test skips, except under DIFFEXPORT_REQUIRE_BROWSER=1 (CI installs Chromium and sets it)."""

import base64
import dataclasses
import html.parser
import os
import shutil
import types
from pathlib import Path

import numpy as np
import pytest
from helpers import assert_one_line_error, cli_main, quiet

from diffexport.core.errors import DiffExportError
from diffexport.modeling.checkpoint import load_model
from diffexport.report import render_html, write_report
from diffexport.validation.options import CheckOptions

pytestmark = pytest.mark.slow


class PageParts(html.parser.HTMLParser):
    """Every tag with its attributes, and the text, of a page."""

    def __init__(self, text: str):
        super().__init__()
        self.tags, self.text = [], []
        self.feed(text)

    def handle_starttag(self, tag, attrs):
        self.tags.append((tag, dict(attrs)))

    def handle_data(self, data):
        self.text.append(data)


@pytest.fixture(scope="module")
def decoder_page(artifacts, tmp_path_factory):
    """The report of an HF DiffLlama's KV-cache folder (transformers is a reference too), through the API."""
    hf = artifacts.hf_diffllama_with_chat_template()
    kv = artifacts.cli_output("onnx", hf, "--kv-cache", output="kv")
    out = tmp_path_factory.mktemp("report")
    options = CheckOptions(provider="cpu", save_dir=out / "check")
    path, report = write_report(kv, lambda meta: load_model(hf), out / "kv.html", options, steps=8, log=quiet)
    return path, report


def test_the_page_shows_the_check_and_speed_it_measured(decoder_page):
    path, report = decoder_page
    page = path.read_text(encoding="utf-8")
    text = " ".join(PageParts(page).text)
    check, speed = report.check, report.speed
    assert check.passed and report.kind == "decoder"
    assert check.measures["greedy"] == (9, 9) and check.measures["decode_steps"] == 9  # prefill + 8 steps
    assert check.measures["transformers_greedy"] is True
    assert len(check.comparisons) == 9 and all(c.passed for _, c in check.comparisons)
    assert "greedy tokens == eager" in text and "9/9 steps" in text and "transformers generate() == eager" in text
    worst = max((c for _, c in check.comparisons), key=lambda c: c.max_abs / c.bound)
    assert f"max |error| {worst.max_abs:.3g} of {worst.bound:.3g}" in text
    assert check.polygraphy_command in text  # the command that reproduces the comparison, as the check printed it
    # the model: DiffLlama imports as V1, lambda per layer with its value
    lambdas = report.model["lambdas"]
    assert report.model["family"] == "diff_v1" and len(lambdas) == 2
    assert all(f"{lam:.4f}" in text for _, _, lam in lambdas)
    # the artifact: the files it holds, its dtype and op version
    files = {name: what for name, _, what in report.artifact_facts["files"]}
    assert {"model.onnx", "genai_config.json", "README.md", "tokenizer.json"} <= set(files)
    # each row says what the file is, not "file" on every row
    assert files["model.onnx"] == "the graph (ONNX)" and files["README.md"] == "the model card"
    assert files["genai_config.json"] == "onnxruntime-genai's configuration" and "file" not in files.values()
    # the speed row reproduces this folder's number: the same measurement, on this folder
    speed_row = [command for what, command in report.commands if what.startswith("the speed section")]
    assert len(speed_row) == 1 and f"measure_decoder({str(report.artifact)!r})" in speed_row[0]
    assert "tools/bench_decode.py" not in " ".join(command for _, command in report.commands)
    assert report.artifact_facts["dtype"] == "float32" and "DiffAttention op version" in text
    # the speed: measured, finite, beside its bound
    assert speed.prompt_tokens_per_s > 0 and speed.decode_tokens_per_s > 0 and speed.weight_bytes > 0
    assert np.isfinite(speed.decode_bound) and speed.read_bytes_per_s > 1e8
    assert f"{speed.decode_tokens_per_s:,.1f} tokens/s" in text and "memory-bandwidth estimate" in text


def test_the_page_is_one_file_that_fetches_nothing(decoder_page):
    path, _ = decoder_page
    page = path.read_text(encoding="utf-8")
    parts = PageParts(page)
    names = [tag for tag, _ in parts.tags]
    assert "script" not in names and "link" not in names and "iframe" not in names
    csp = [a["content"] for tag, a in parts.tags if tag == "meta" and a.get("http-equiv") == "Content-Security-Policy"]
    assert csp == ["default-src 'none'; img-src data:; style-src 'unsafe-inline'"]
    images = [a for tag, a in parts.tags if tag == "img"]
    assert [a["alt"] for a in images] == ["lambda per layer", "error per decode step against its bound",
                                          "tokens per second"]
    for a in images:
        head, data = a["src"].split(",", 1)
        assert head == "data:image/png;base64"
        assert base64.b64decode(data)[:8] == b"\x89PNG\r\n\x1a\n"
    every_url = [value for _, a in parts.tags for key, value in a.items() if key in ("src", "href", "action")]
    assert all(value.startswith("data:") for value in every_url)


def test_strings_from_the_artifact_are_escaped(decoder_page):
    """A folder (or a file in it) named like markup shows as text, never as a tag."""
    _, report = decoder_page
    hostile = '<script>alert("x")</script>&<img src=http://a>'
    facts = dict(report.artifact_facts, files=[*report.artifact_facts["files"], (hostile, 3, "file")])
    page = render_html(dataclasses.replace(report, artifact=Path("/tmp") / hostile, artifact_facts=facts))
    parts = PageParts(page)
    assert "script" not in [tag for tag, _ in parts.tags]
    assert len([1 for tag, _ in parts.tags if tag == "img"]) == 3  # the hostile <img> stays text
    assert hostile in "".join(parts.text)


def test_chromium_renders_the_page_without_errors(decoder_page, tmp_path):
    path, _ = decoder_page
    browser = shutil.which("chromium") or shutil.which("chromium-browser")
    try:
        from playwright.sync_api import sync_playwright
    except ImportError:
        sync_playwright = None
    if browser is None or sync_playwright is None:
        missing = "Chromium (apt-get install chromium)" if browser is None else "playwright (pip install playwright)"
        if os.environ.get("DIFFEXPORT_REQUIRE_BROWSER") == "1":
            pytest.fail(f"DIFFEXPORT_REQUIRE_BROWSER=1 but {missing} is missing")
        pytest.skip(f"needs {missing}")
    messages = []
    with sync_playwright() as pw:
        chromium = pw.chromium.launch(executable_path=browser, args=[
            "--no-sandbox", "--disable-gpu", "--disable-background-networking", "--disable-component-update",
            "--disable-sync", "--no-first-run"])
        try:
            page = chromium.new_page(viewport={"width": 1200, "height": 900})
            page.on("console", lambda m: messages.append(f"console {m.type}: {m.text}"))
            page.on("pageerror", lambda e: messages.append(f"page error: {e}"))
            page.on("request", lambda r: messages.append(f"request: {r.url}") if not r.url.startswith(
                ("file:", "data:")) else None)
            page.goto(path.resolve().as_uri(), wait_until="load")
            images = page.evaluate("[...document.images].map(i => [i.alt, i.complete, i.naturalWidth, "
                                   "i.getBoundingClientRect().width])")
            title = page.title()
            shot = tmp_path / "report.png"
            page.screenshot(path=str(shot), full_page=True)
        finally:
            chromium.close()
    assert messages == []
    assert title == "diffexport report: kv"
    assert len(images) == 3, images
    assert all(done and natural > 100 and shown > 100 for _, done, natural, shown in images), images
    assert shot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and shot.stat().st_size > 50_000


def test_a_prefill_file_from_the_command_line(artifacts, tmp_path):
    """`diffexport report model.onnx --preset ... --no-speed`: the check's comparisons per shape,
    exit 0; again without --force: one line, the page kept."""
    onnx_path = artifacts.cli_output("onnx", "--preset", "diff-v1-tiny")
    out = tmp_path / "prefill.html"
    result = cli_main("report", onnx_path, "--preset", "diff-v1-tiny", "-o", out, "--save-dir", tmp_path / "check",
                      "--no-speed")
    assert result.returncode == 0, result.stderr
    assert f"report        {out} (PASS" in result.stdout
    page = out.read_text(encoding="utf-8")
    parts = PageParts(page)
    assert [a["alt"] for tag, a in parts.tags if tag == "img"] == ["lambda per layer", "each output against its bound"]
    text = " ".join(parts.text)
    assert "prefill ONNX file" in text and "Not measured (--no-speed)" in text
    assert "comparisons within their bound" in text and "diffexport check --preset" not in text
    assert f"diffexport check {onnx_path} --preset diff-v1-tiny" in text
    before = out.read_bytes()
    again = cli_main("report", onnx_path, "--preset", "diff-v1-tiny", "-o", out, "--no-speed")
    assert_one_line_error(again, "already exists")
    assert out.read_bytes() == before


def test_a_prefill_files_speed(artifacts, monkeypatch):
    """measure_prefill: the prompt rate of onnxruntime calls, the weights' bytes and the bound they set
    (the bandwidth probe itself is measured in the decoder page's test; a fixed 10 GB/s here)."""
    from diffexport.backends import speed

    monkeypatch.setattr(speed, "read_bandwidth", lambda: 1e10)
    onnx_path = artifacts.cli_output("onnx", "--preset", "diff-v1-tiny")
    measured = speed.measure_prefill(onnx_path, 512, prompt_tokens=16, rounds=2)
    assert measured.prompt_tokens == 16 and measured.prompt_tokens_per_s > 0 and measured.rounds == 2
    assert measured.weight_bytes == speed.weight_bytes_per_token(onnx_path) > 1_000_000  # fp32 tiny: ~2 MB
    assert measured.decode_bound == 1e10 / measured.weight_bytes and np.isnan(measured.decode_tokens_per_s)
    from diffexport.report.page import _speed_section  # the section of the page this measure fills

    assert "a prefill file has no decode" in _speed_section(types.SimpleNamespace(speed=measured))


def test_refusals_come_before_the_model_loads(artifacts, tmp_path):
    def must_not_load(meta):
        raise AssertionError("the model was loaded before the refusal")

    kv = artifacts.decoder("diff-v1")
    (tmp_path / "taken.html").write_text("mine")
    (tmp_path / "link.html").symlink_to(tmp_path / "elsewhere.html")
    (tmp_path / "model.engine").write_bytes(b"\0" * 64)
    (tmp_path / "bad.onnx").write_bytes(b"not onnx")
    cases = [(kv, tmp_path / "taken.html", "already exists"),
             (kv, tmp_path / "link.html", "symbolic link"),
             (kv, tmp_path / "page.txt", "ending in .html"),
             (kv, tmp_path / "taken.html" / "r.html", "is not a folder"),
             (tmp_path / "model.engine", tmp_path / "e.html", "a report covers a KV-cache folder or an .onnx file"),
             (tmp_path / "bad.onnx", tmp_path / "b.html", "bad.onnx"),
             (tmp_path / "missing", tmp_path / "m.html", "missing does not exist")]
    for artifact, output, message in cases:
        with pytest.raises(DiffExportError, match=message.replace(".", r"\.")):
            write_report(artifact, must_not_load, output, log=quiet)
    with pytest.raises(DiffExportError, match="--steps must be a whole number of decode steps, 0 or more; got -3"):
        write_report(kv, must_not_load, tmp_path / "s.html", steps=-3, log=quiet)
    assert (tmp_path / "taken.html").read_text() == "mine" and not (tmp_path / "elsewhere.html").exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["bad.onnx", "link.html", "model.engine", "taken.html"]


def test_a_check_that_could_not_fail_is_never_a_green_pass_on_the_page(decoder_page):
    """An inconclusive check (e.g. --sample with one bin) shows INCONCLUSIVE at the top and in the
    check section, never PASS."""
    _, report = decoder_page
    check = dataclasses.replace(report.check, passed=False, inconclusive=("sampled tokens genai vs eager",))
    parts = PageParts(render_html(dataclasses.replace(report, check=check)))
    text = " ".join(parts.text)
    assert check.verdict == "INCONCLUSIVE" and text.count("INCONCLUSIVE") >= 2
    assert "verdict PASS" not in text and not text.split("made")[0].strip().endswith("PASS")


def test_a_quantised_folder_of_random_weights_says_why_agreement_is_low(artifacts, tmp_path):
    """int4 weights of a random-weight preset: KL within the budget but low top-1 agreement; the
    page says that agreement is reported, not judged, and why it says little for random weights."""
    kv = artifacts.cli_output("onnx", "--preset", "diff-v1-tiny", "--kv-cache", output="kv")
    quantised = tmp_path / "kv-int4"
    assert cli_main("quantize", kv, "-o", quantised).returncode == 0
    path, report = write_report(quantised, lambda meta: load_model(preset="diff-v1-tiny"), tmp_path / "q.html",
                                CheckOptions(provider="cpu", save_dir=tmp_path / "check"), steps=2, speed=False,
                                log=quiet)
    text = " ".join(PageParts(path.read_text(encoding="utf-8")).text)
    assert "lowest top-1 agreement" in text and "why agreement is not judged" in text
    assert "this model has random weights" in text


def test_plot_text_from_strangers_is_shown_not_read_as_mathematics():
    """Matplotlib reads `$...$` as mathematics: a folder or output named `q$^^$x` or
    `m$\\undefinedcmd$x` made it raise and `report` exit with a traceback. Our plots show text as it is."""
    from diffexport.report.page import _prefill_plot, _speed_plot

    names = ["q$^^$x", "m$\\undefinedcmd$x", "$$", "a$b"]
    comparisons = [(None, types.SimpleNamespace(name=n, max_abs=1e-6, bound=1e-4)) for n in names]
    assert _prefill_plot(comparisons).startswith(b"\x89PNG")
    speed = types.SimpleNamespace(prompt_tokens_per_s=100.0, decode_tokens_per_s=float("nan"),
                                  runtime="q$^^$x $\\undefinedcmd$", rounds=3)
    assert _speed_plot(speed).startswith(b"\x89PNG")
