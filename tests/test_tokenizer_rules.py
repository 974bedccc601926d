"""A stranger's tokenizer.json must not hang the tokenizer libraries (issue 43, item 6): regular
expressions that can backtrack without end are refused before any library opens the file
(diffexport/format/tokenizer_rules.py), while the patterns of the tokenizers in use pass."""

import json
import shutil

import pytest
from helpers import assert_one_line_error, cli_main, run_cli

from diffexport.core.errors import DiffExportError
from diffexport.format.tokenizer_rules import check_tokenizer_json, regex_risk

IN_USE = {  # pre-tokenizer patterns of published tokenizers (tokenizer.json, pre_tokenizer Split)
    "gpt2": r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+",
    "llama3": r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+"
              r"|\s+(?!\S)|\s+",
    "qwen2": r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+"
             r"|\s+(?!\S)|\s+",
    "gpt4o": r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+"
             r"(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
             r"|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*"
             r"(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
             r"|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+",
    "deepseek": r"""[!"#$%&'()*+,\-./:;<=>?@\[\\\]^_`{|}~][A-Za-z]+|[^\r\n\p{L}\p{P}\p{S}]?[\p{L}\p{M}]+"""
                r"| ?[\p{P}\p{S}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+",
    "cjk": r"[一-龥\u3040-ゟ゠-ヿ]+",
    "thousands": r"\d{1,3}(?=(\d{3})+$)",  # a fixed count repeated: one way to split
    "literal parens": r"\(a+\)+|[(a+)+]",
    "optional group": r"(ab+)?c",
}

HOSTILE = {
    r"(a+)+$": "holds a repetition", r"(a*)*": "holds a repetition", r"((ab)*)+": "holds a repetition",
    r"(?:x+y?)+z": "holds a repetition", r"(a{2,3})+": "holds a repetition",
    r"(a|aa)+": "holds an alternation", r"(\s|\S)*x": "holds an alternation", r"(a|b){2,}": "holds an alternation",
    r"a{100000}": "above 1000", "a" * 5000: "5000 characters",
}


@pytest.mark.parametrize("name", IN_USE)
def test_the_patterns_in_use_pass(name):
    assert regex_risk(IN_USE[name]) is None


@pytest.mark.parametrize("pattern", HOSTILE)
def test_backtracking_patterns_are_named(pattern):
    assert HOSTILE[pattern] in (regex_risk(pattern) or "")


def _with_split(tokenizer_json, pattern: str) -> None:
    """A Split pre-tokenizer with `pattern` before the tokenizer's own (as a published tokenizer has)."""
    tree = json.loads(tokenizer_json.read_text())
    split = {"type": "Split", "pattern": {"Regex": pattern}, "behavior": "Isolated", "invert": False}
    tree["pre_tokenizer"] = {"type": "Sequence", "pretokenizers": [split, tree["pre_tokenizer"]]}
    tokenizer_json.write_text(json.dumps(tree))


def test_a_real_tokenizer_with_a_safe_split_still_works(artifacts, tmp_path):
    """The rule reads the file as the libraries do: Llama 3's pattern in front of the byte-level
    pre-tokenizer passes and the tokenizer runs."""
    from tokenizers import Tokenizer

    folder = shutil.copytree(artifacts.hf_diffllama(), tmp_path / "hf")
    _with_split(folder / "tokenizer.json", IN_USE["llama3"])
    check_tokenizer_json(folder / "tokenizer.json")
    assert Tokenizer.from_file(str(folder / "tokenizer.json")).encode("the cat's 1234 mats").ids


@pytest.mark.slow
def test_a_hostile_pattern_is_refused_before_any_library_matches_it(artifacts, tmp_path):
    """`(a+)+$` (which never finishes on 40 characters of "a" and a "!") in a decoder folder, an
    export's --tokenizer and a check's --tokenizer: one line each, nothing written. generate runs
    in a child with a timeout, so a regression fails instead of hanging the suite."""
    hf = artifacts.hf_diffllama()
    tokenizer = shutil.copytree(hf, tmp_path / "tok", ignore=shutil.ignore_patterns("*.safetensors"))
    _with_split(tokenizer / "tokenizer.json", r"(a+)+$")
    with pytest.raises(DiffExportError, match=r"has a regular expression '\(a\+\)\+\$' with a repeated group"):
        check_tokenizer_json(tokenizer / "tokenizer.json")
    folder = shutil.copytree(artifacts.cli_output("onnx", hf, "--kv-cache", output="kv"), tmp_path / "kv")
    shutil.copyfile(tokenizer / "tokenizer.json", folder / "tokenizer.json")
    result = run_cli("generate", folder, "--prompt", "a" * 40 + "!", "--max-new-tokens", "2")
    assert_one_line_error(result, "could run without end on a short text")
    export = cli_main("onnx", hf, "--kv-cache", "--tokenizer", tokenizer, "-o", tmp_path / "out")
    assert_one_line_error(export, "tok/tokenizer.json has a regular expression")
    assert not (tmp_path / "out").exists()
    text = tmp_path / "text.txt"
    text.write_text("a" * 40 + "!")
    check = cli_main("check", folder, "--ckpt", hf, "--text", text, "--tokenizer", tokenizer)
    assert_one_line_error(check, "could run without end")


POLYNOMIAL = r"\s*\s*\s*$"  # no repeated group: the guard passes it, yet it is about n^4 on a run of spaces


@pytest.mark.slow
def test_a_polynomial_pattern_is_stopped_in_cpu_time_and_long_text_before_tokenizing(artifacts, tmp_path):
    """`\\s*\\s*\\s*$` passes the guard (polynomial, not exponential), but onnxruntime-genai's tokenizer
    spends about 28 s of CPU on 100 spaces before an x, and minutes on 150, in native code that no
    signal interrupts. Encoding runs in a child under a CPU-time limit (stoppable.call_bounded), so
    `generate` is one line after a few CPU seconds, as are the analyses' texts (transformers'
    tokenizer: eight runs of 250 spaces, about 2 s each, each under the regex library's own retry
    limit); a prompt longer than the context could hold is refused before it is tokenized; and an
    ordinary prompt on the same folder still runs."""
    from diffexport.format.decoder_folder import read_decoder_folder

    hf = artifacts.hf_diffllama()
    folder = shutil.copytree(artifacts.cli_output("onnx", hf, "--kv-cache", output="kv"), tmp_path / "kv")
    _with_split(folder / "tokenizer.json", POLYNOMIAL)
    token_chars = check_tokenizer_json(folder / "tokenizer.json")  # the guard lets it through
    stuck = cli_main("generate", folder, "--prompt", " " * 100 + "x", "--max-new-tokens", "2")
    assert_one_line_error(stuck, "s of CPU time: the tokenizer's regular expressions backtrack on this text")
    assert cli_main("generate", folder, "--prompt", "the cat", "--max-new-tokens", "2").returncode == 0
    most = read_decoder_folder(folder).context_length * token_chars
    long = cli_main("generate", folder, "--prompt", "a" * (most + 1), "--max-new-tokens", "2")
    assert_one_line_error(long, f"more than the context could hold ({most:,}")
    text = tmp_path / "text.txt"
    text.write_text((" " * 250 + "x") * 8)
    stats = cli_main("stats", "--preset", "diff-v1-tiny", "--text", text, "--tokenizer", folder, "--tokens", "256",
                     "--seq-len", "64")
    assert_one_line_error(stats, "s of CPU time: the tokenizer's regular expressions backtrack")


def test_a_panic_inside_the_tokenizers_library_is_one_line(capfd):
    """A Rust panic in the tokenizers library (pyo3's PanicException is no Exception, so it went
    through as a traceback, with the panic hook's lines on stderr) is one DiffExportError line; the
    hook's lines are held back, other stderr output of the call is passed on, other errors pass."""
    import os

    from tokenizers import Tokenizer

    from diffexport.format.tokenizer_rules import tokenizer_library_call

    spec = {"version": "1.0", "padding": None, "added_tokens": [], "normalizer": None, "post_processor": None,
            "decoder": None, "pre_tokenizer": {"type": "Whitespace"},
            "truncation": {"direction": "Right", "max_length": 2, "strategy": "LongestFirst", "stride": 5},
            "model": {"type": "WordLevel", "vocab": {"a": 0, "b": 1, "[UNK]": 2}, "unk_token": "[UNK]"}}
    tokenizer = Tokenizer.from_str(json.dumps(spec))
    capfd.readouterr()
    with pytest.raises(DiffExportError, match=r"^encoding failed inside the tokenizers library \(`stride` must be"):
        with tokenizer_library_call("encoding"):
            tokenizer.encode("a b a b a b")
    assert "panicked" not in capfd.readouterr().err
    with tokenizer_library_call("a call"):
        os.write(2, b"a library's own warning\n")
    assert capfd.readouterr().err == "a library's own warning\n"
    with pytest.raises(ValueError):
        with tokenizer_library_call("a call"):
            raise ValueError("not a panic")


def test_a_tokenizer_past_the_graphs_vocabulary_is_refused(artifacts, tmp_path):
    """A folder's tokenizer.json that can give ids the graph has no row for (an added token past the
    vocabulary, or a larger model vocabulary) is refused before a prompt is tokenized: its ids
    would reach onnxruntime's Gather as an internal error. Read from the file, no tokenizer library."""
    hf = artifacts.hf_diffllama()
    folder = shutil.copytree(artifacts.cli_output("onnx", hf, "--kv-cache", output="kv"), tmp_path / "kv")
    vocab = json.loads((folder / "genai_config.json").read_text())["model"]["vocab_size"]
    check_tokenizer_json(folder / "tokenizer.json", vocab)  # the folder's own passes
    tree = json.loads((folder / "tokenizer.json").read_text())
    tree["added_tokens"].append({"id": vocab + 7, "content": "<extra>", "single_word": False, "lstrip": False,
                                 "rstrip": False, "normalized": False, "special": True})
    (folder / "tokenizer.json").write_text(json.dumps(tree))
    with pytest.raises(DiffExportError, match=f"gives token ids up to {vocab + 7}, past the model's vocabulary"):
        check_tokenizer_json(folder / "tokenizer.json", vocab)
    assert_one_line_error(cli_main("generate", folder, "--prompt", "the cat", "--max-new-tokens", "2",
                                   "--backend", "onnxruntime"), "past the model's vocabulary")


def test_a_tokenizer_that_panics_on_text_is_one_line(tmp_path, capfd):
    """A tokenizer folder whose normalizer replaces an empty pattern panics inside the tokenizers
    library on any text (index out of bounds), through transformers as `check --text`, calibration
    and the analyses load it (inputs/streams.text_ids, which all of them call): one line, exit 2."""
    from helpers import byte_bpe_tokenizer

    folder = tmp_path / "tok"
    byte_bpe_tokenizer(folder)
    tree = json.loads((folder / "tokenizer.json").read_text())
    tree["normalizer"] = {"type": "Replace", "pattern": {"String": ""}, "content": "x"}
    (folder / "tokenizer.json").write_text(json.dumps(tree))
    text = tmp_path / "text.txt"
    text.write_text("the cat sat on the mat. " * 40)
    capfd.readouterr()
    result = cli_main("stats", "--preset", "diff-v1-tiny", "--text", text, "--tokenizer", folder,
                      "--tokens", "256", "--seq-len", "64")
    assert_one_line_error(result, "failed inside the tokenizers library (index out of bounds")
    assert "panicked" not in capfd.readouterr().err


def test_hub_cache_links_are_read_and_guarded_and_no_other_link_is(artifacts, tmp_path):
    """huggingface_hub's cache holds a snapshot's files as links into the repository's blobs/: such a
    link is read (and its tokenizer.json guarded like a file); a link out of blobs/, into another
    repository's blobs/, or outside any snapshot is not."""
    from diffexport.core.files import is_hub_cache_link

    hf = artifacts.hf_diffllama()
    hostile = tmp_path / "hostile.json"
    shutil.copyfile(hf / "tokenizer.json", hostile)
    _with_split(hostile, r"(a+)+$")
    repo = tmp_path / "hub" / "models--org--name"
    other = tmp_path / "hub" / "models--org--other"
    for root in (repo, other):
        (root / "blobs").mkdir(parents=True)
        (root / "snapshots" / "abc").mkdir(parents=True)
    shutil.copyfile(hostile, repo / "blobs" / "h1")
    shutil.copyfile(hostile, other / "blobs" / "h2")
    snapshot = repo / "snapshots" / "abc"
    (snapshot / "tokenizer.json").symlink_to("../../blobs/h1")
    (snapshot / "into-other").symlink_to("../../../models--org--other/blobs/h2")
    (snapshot / "outside").symlink_to(hostile)
    (snapshot / "blobs-folder").symlink_to("../../blobs")
    (tmp_path / "plain-link.json").symlink_to(hostile)
    assert is_hub_cache_link(snapshot / "tokenizer.json")
    for path in (snapshot / "into-other", snapshot / "outside", snapshot / "blobs-folder",
                 tmp_path / "plain-link.json", repo / "blobs" / "h1"):
        assert not is_hub_cache_link(path), path
    # the guard runs on the link it accepts: the pattern is refused before any library sees it
    with pytest.raises(DiffExportError, match="could run without end"):
        check_tokenizer_json(snapshot / "tokenizer.json")
