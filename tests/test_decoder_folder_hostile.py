"""A decoder folder from a stranger: a genai_config.json that asks onnxruntime-genai to load, write or run
anything, hostile or inconsistent folders, a DiffAttention node edited after export, and what is not a
decoder folder at all: each refused in one line before a runtime reads it."""


import json
import re
import shutil

import pytest

onnx = pytest.importorskip("onnx")
pytest.importorskip("onnxruntime")

from helpers import (  # noqa: E402
    assert_one_line_error,
    cli_main,
)

from diffexport.backends import genai  # noqa: E402
from diffexport.core.errors import DiffExportError  # noqa: E402

pytestmark = pytest.mark.slow  # exports, emulation or training: see README (quick loop)


def test_a_strangers_genai_config_asks_for_nothing_genai_would_load_write_or_run(v1_folder, tmp_path, monkeypatch):
    """genai_config.json keys onnxruntime-genai acts on and diffexport never writes (a library to
    load, a profile to write, another graph to run, thousands of threads, a huge vocabulary), links
    and nesting bombs: one line, exit 2, before onnxruntime-genai is imported, for every command."""
    import diffexport.generation.text_generation

    def genai_reached(*_):
        raise AssertionError("onnxruntime-genai was reached")

    monkeypatch.setattr(genai, "import_genai", genai_reached)
    monkeypatch.setattr(diffexport.generation.text_generation, "folder_tokenizer", genai_reached, raising=False)
    config = json.loads((v1_folder / "genai_config.json").read_text())

    def folder_with(name, edit=None, text=None):
        folder = tmp_path / name
        shutil.copytree(v1_folder, folder)
        bad = json.loads(json.dumps(config))
        if edit:
            edit(bad)
        (folder / "genai_config.json").write_text(text if text is not None else json.dumps(bad))
        return folder

    session = lambda key, value: lambda c: c["model"]["decoder"]["session_options"].__setitem__(key, value)  # noqa: E731
    cases = [
        ("custom-ops", session("custom_ops_library", "libevil.so"),
         "custom_ops_library is not a key diffexport writes"),
        ("profiling", session("enable_profiling", str(tmp_path / "outside" / "p")), "enable_profiling is not a key"),
        ("log-level", session("log_severity_level", 0), "log_severity_level is not a key"),
        ("threads", session("intra_op_num_threads", 20000), "intra_op_num_threads must be an integer in 1..1024"),
        ("provider-options", session("provider_options", [{"cuda": {"user_compute_stream": "1"}}]),
         "provider_options must be a list of {provider: options} objects"),
        ("provider-other", session("provider_options", [{"tensorrt": {}}]), "provider_options must be a list"),
        ("pipeline", lambda c: c["model"].__setitem__("type", "decoder-pipeline"), "model.type 'decoder-pipeline'"),
        ("stage", lambda c: c["model"]["decoder"].__setitem__("pipeline", [{"stage": {"filename": "x.onnx"}}]),
         "model.decoder.pipeline is not a key"),
        ("top-level", lambda c: c.__setitem__("engine", {}), "the file.engine is not a key"),
        ("vocab-words", lambda c: c["model"].__setitem__("vocab_size", "abc"), "vocab_size must be an integer"),
        ("vocab-huge", lambda c: c["model"].__setitem__("vocab_size", 2**31 - 1), "vocab_size must be an integer"),
        ("pad-words", lambda c: c["model"].__setitem__("pad_token_id", "x"), "pad_token_id must be a token id"),
        ("shared-buffer", lambda c: c["search"].__setitem__("past_present_share_buffer", True),
         "past_present_share_buffer must be false for a diffattention folder"),
        # numbers within their bounds that are not the graph's (genai sizes buffers from them)
        ("vocab-other", lambda c: c["model"].__setitem__("vocab_size", 2**20),
         "model.vocab_size is 1048576, but the graph's metadata says 512"),
        ("layers-other", lambda c: c["model"]["decoder"].__setitem__("num_hidden_layers", 64),
         "decoder.num_hidden_layers is 64, but the graph's metadata says 2"),
        ("width-other", lambda c: c["model"]["decoder"].__setitem__("head_size", 4096),
         "decoder.head_size is 4096, but the graph's metadata says 64"),
    ]
    graph_checked = {"shared-buffer", "vocab-other", "layers-other", "width-other"}
    for number, (name, edit, message) in enumerate(cases):
        folder = folder_with(name, edit)
        (folder / "libevil.so").write_bytes(b"\x7fELF not really")
        commands = [("generate", folder, "--ids", "1")]
        if number < 2:  # every command reads the folder through the same reader: the others on two cases
            commands += [("generate", folder, "--ids", "1", "--backend", "onnxruntime"),
                         ("check", folder, "--preset", "diff-v1-tiny")]
        for argv in commands:
            assert_one_line_error(cli_main(*argv), message)
        if name not in graph_checked:  # (the graph's metadata, which genai's own gate does not read)
            with pytest.raises(DiffExportError, match=re.escape(message)):  # the API's own gate, before genai
                genai.open_genai_model(folder)
    assert not (tmp_path / "outside").exists()
    quantized = tmp_path / "quantized"
    assert_one_line_error(cli_main("quantize", folder_with("q", cases[0][1]), "-o", quantized, "--weights", "int8"),
                          "custom_ops_library is not a key")
    assert not quantized.exists()
    deep = folder_with("deep", text='{"model": ' + "[" * 200_000 + "]" * 200_000 + "}")
    assert_one_line_error(cli_main("generate", deep, "--ids", "1"), "not a readable genai config")
    prompts = tmp_path / "deep.jsonl"  # a prompts file line nested as deeply
    prompts.write_text('{"ids": ' + "[" * 200_000 + "]" * 200_000 + "}\n")
    assert_one_line_error(cli_main("generate", v1_folder, "--prompts-file", prompts, "--backend", "onnxruntime"),
                          "line 1: not JSON (nested")
    linked = folder_with("linked")
    (linked / "genai_config.json").unlink()
    (linked / "genai_config.json").symlink_to(v1_folder / "genai_config.json")
    assert_one_line_error(cli_main("generate", linked, "--ids", "1"), "genai_config.json is a symbolic link")
    assert_one_line_error(cli_main("quantize", linked, "-o", quantized, "--weights", "int8"), "is a symbolic link")
    assert not quantized.exists()  # (it used to exit 0 with no genai_config.json in the output)


def test_hostile_decoder_folders(v1_folder, v1_ckpt, tmp_path):
    """Corrupt genai configs, a model file named outside the folder or behind a link, a plain folder to check."""

    def folder_with(name, config_text=None, link_model=False):
        folder = tmp_path / name
        shutil.copytree(v1_folder, folder)
        if config_text is not None:
            (folder / "genai_config.json").write_text(config_text)
        if link_model:
            (folder / "model.onnx").unlink()
            (folder / "model.onnx").symlink_to(v1_folder / "model.onnx")
        return folder

    assert_one_line_error(cli_main("generate", folder_with("garbage", "{not json"), "--ids", "1"),
                          "not a readable genai config")
    assert_one_line_error(cli_main("generate", folder_with("list", "[1, 2]"), "--ids", "1"),
                          "not a readable genai config")
    escape = json.dumps({"model": {"decoder": {"filename": "../outside.onnx"}}})
    assert_one_line_error(cli_main("generate", folder_with("escape", escape), "--ids", "1"), "inside the folder")
    assert_one_line_error(cli_main("generate", folder_with("linked", link_model=True), "--ids", "1"),
                          "symbolic link")
    (tmp_path / "plain").mkdir()
    assert_one_line_error(cli_main("check", tmp_path / "plain", "--preset", "diff-v1-tiny"), "no genai_config.json")
    # cache fields a runner allocates from: wrong types or sizes, or a cache the graph does not take
    config = json.loads((v1_folder / "genai_config.json").read_text())
    for name, value in (("words", "abc"), ("huge", 1 << 40), ("zero", 0)):
        bad = json.loads(json.dumps(config))
        bad["model"]["decoder"]["num_key_value_heads"] = value
        assert_one_line_error(cli_main("generate", folder_with(name, json.dumps(bad)), "--ids", "1", "--backend",
                                      "onnxruntime"), "num_key_value_heads must be an integer")
    for name, value in (("context-words", "abc"), ("context-huge", 1 << 40), ("context-one", 1)):
        bad = json.loads(json.dumps(config))
        bad["model"]["context_length"] = value
        assert_one_line_error(cli_main("generate", folder_with(name, json.dumps(bad)), "--ids", "1", "--backend",
                                      "onnxruntime"), "context_length must be an integer")
    for name, value in (("eos-words", "abc"), ("eos-empty", []), ("eos-mixed", [2, "x"]), ("eos-negative", -1)):
        bad = json.loads(json.dumps(config))
        bad["model"]["eos_token_id"] = value
        assert_one_line_error(cli_main("generate", folder_with(name, json.dumps(bad)), "--ids", "1", "--backend",
                                      "onnxruntime"), "eos_token_id must be a token id or a list of them")
    for name, key, value in (("temp-words", "temperature", "abc"), ("temp-zero", "temperature", 0),
                             ("topk-float", "top_k", 2.5), ("topp-big", "top_p", 1.5), ("sample-int", "do_sample", 1),
                             ("penalty-nan", "repetition_penalty", float("nan")), ("beams-0", "num_beams", 0)):
        bad = json.loads(json.dumps(config))
        bad["search"][key] = value
        assert_one_line_error(cli_main("generate", folder_with(name, json.dumps(bad)), "--ids", "1"),
                              f"genai_config.json: search.{key} must be")
    other = json.loads(json.dumps(config))
    other["model"]["decoder"]["num_key_value_heads"] = 2  # a gqa folder's config beside a DiffAttention graph
    assert_one_line_error(cli_main("check", folder_with("mismatch", json.dumps(other)), "--ckpt", v1_ckpt),
                          "do not belong together")
    vocab = json.loads(json.dumps(config))
    vocab["model"]["vocab_size"] = 1 << 24  # genai would size its logits and penalties from it
    with pytest.raises(DiffExportError, match="vocab_size is 16777216, but the graph's metadata says"):
        genai.open_genai_model(folder_with("vocab", json.dumps(vocab)))  # its own gate, before genai reads it


def test_a_diffattention_node_edited_to_other_heads_is_refused(v1_folder, tmp_path):
    """A node whose num_heads (or kv heads, head size) is not what the metadata's config
    says: one line, exit 2, for every command that reads the folder, not onnxruntime's reshape error."""
    import onnx

    for key, change in (("num_heads", lambda v: 2 * v), ("head_dim", lambda v: 2 * v), ("num_kv_heads", lambda v: 1)):
        folder = tmp_path / key
        shutil.copytree(v1_folder, folder)
        model = onnx.load(str(folder / "model.onnx"))
        node = next(n for n in model.graph.node if n.op_type == "DiffAttention")
        attribute = next(a for a in node.attribute if a.name == key)
        before, attribute.i = attribute.i, change(attribute.i)
        assert attribute.i != before, key
        onnx.save(model, str(folder / "model.onnx"))
        for backend in ("onnxruntime", "genai"):
            assert_one_line_error(cli_main("generate", folder, "--ids", "1,2", "--backend", backend),
                                  f"has {key} {attribute.i}, but the model's config says")
    assert_one_line_error(cli_main("inspect", tmp_path / "num_heads"), "the graph was edited after export")


def test_generate_refuses_a_prefill_export_and_a_plain_folder(tmp_path):
    prefill = tmp_path / "m.onnx"
    assert cli_main("onnx", "--preset", "diff-v1-tiny", "-o", prefill).returncode == 0
    (tmp_path / "plain").mkdir()
    assert_one_line_error(cli_main("generate", tmp_path / "plain", "--ids", "1"), "no genai_config.json")
    assert_one_line_error(cli_main("generate", prefill, "--ids", "1"), "is not a folder")
    (tmp_path / "fake").mkdir()
    (tmp_path / "fake" / "genai_config.json").write_text(json.dumps({"model": {"decoder": {"filename": "m.onnx"}}}))
    (tmp_path / "fake" / "m.onnx").write_bytes(prefill.read_bytes())
    assert_one_line_error(cli_main("generate", tmp_path / "fake", "--ids", "1"), "prefill-only export")
