"""`diffexport onnx --kv-cache`, `diffexport generate` and `diffexport check FOLDER`: KV-cache decoder folders of
V1 (affine head norm, GQA), V2, the baseline Transformer and an HF DiffLlama with its tokenizer, run by
onnxruntime-genai and a plain onnxruntime loop, token for token against eager (and transformers)."""

import json
import re
import shutil

import numpy as np
import pytest
import torch

onnx = pytest.importorskip("onnx")
pytest.importorskip("onnxruntime")

from helpers import (  # noqa: E402
    assert_one_line_error,
    byte_bpe_tokenizer,
    cli_main,
    perturb_norm_weights,
    quiet,
    run_printed_polygraphy,
)

from diffexport.backends import base, genai, step_loop  # noqa: E402
from diffexport.core import contract  # noqa: E402
from diffexport.core.eager_generation import BeamSearch, Sampling, generate  # noqa: E402
from diffexport.core.errors import DiffExportError  # noqa: E402
from diffexport.export import ExportOptions  # noqa: E402
from diffexport.export.decoder import export_decoder_graph as export_decoder  # noqa: E402
from diffexport.format.decoder_folder import cache_width  # noqa: E402
from diffexport.modeling.checkpoint import load_model, save_checkpoint, save_safetensors  # noqa: E402
from diffexport.modeling.families import build_model  # noqa: E402
from diffexport.modeling.presets import preset_config  # noqa: E402
from diffexport.validation.decoder import run_decoder_check  # noqa: E402
from diffexport.validation.options import CheckOptions  # noqa: E402

pytestmark = pytest.mark.slow  # exports, emulation or training: see README (quick loop)

PROMPT = [5, 17, 42, 99, 3, 250, 7]
NEW_TOKENS = 36


@pytest.fixture(scope="module")
def v1_ckpt(artifacts):
    """A native ckpt.pt of a V1 model with GQA and an affine head norm that is not all ones."""
    return artifacts.checkpoint("diff-v1-gqa")


@pytest.fixture(scope="module")
def v1_folder(artifacts):
    return artifacts.decoder("diff-v1-gqa")


def _genai_tokens(folder, prompt=PROMPT, n=NEW_TOKENS):
    pytest.importorskip("onnxruntime_genai")
    tokens = genai.generate_genai(folder, prompt, n, Sampling()).tokens
    assert len(tokens) >= 32, f"only {len(tokens)} tokens before end-of-sequence: compare at least 32"
    return tokens


def _eager_tokens(loaded, prompt=PROMPT, n=NEW_TOKENS, eos=None):
    return generate(loaded.model.eval(), torch.tensor([prompt]), max_new_tokens=n, eos_token_id=eos).tokens[0].tolist()


def test_v1_folder_graph_and_genai_config(v1_folder, v1_ckpt):
    model = onnx.load(str(v1_folder / "model.onnx"))
    nodes = [n for n in model.graph.node if n.op_type == contract.OP_NAME]
    assert len(nodes) == 2 and all(len(n.input) == 6 for n in nodes)
    assert {o.domain: o.version for o in model.opset_import}[contract.ONNX_DOMAIN] == contract.KEY_MASK_VERSION
    assert [a.s.decode() for n in nodes for a in n.attribute if a.name == "plugin_version"] == ["2", "2"]
    inputs = {i.name: [d.dim_param or d.dim_value for d in i.type.tensor_type.shape.dim] for i in model.graph.input}
    width = cache_width(load_model(v1_ckpt).config)
    assert inputs["input_ids"] == ["batch", "sequence"] and inputs["attention_mask"] == ["batch", "total_sequence"]
    assert inputs["past_key_values.1.value"] == ["batch", 1, "past_sequence", width]
    # each DiffAttention reads the graph's present output (past + new tokens, a Concat) through a view of
    # its unit axis: no transpose or re-pack of the cache outside the op
    producers = {o: n for n in model.graph.node for o in n.output}
    outputs = {o.name for o in model.graph.output}
    for node in nodes:
        for key_or_value in node.input[1:3]:
            view = producers[key_or_value]
            assert view.op_type in ("Squeeze", "Reshape"), view.op_type
            concat = producers[view.input[0]]
            assert concat.op_type == "Concat" and concat.output[0] in outputs
            assert any(i.startswith("past_key_values.") for i in concat.input)
    config = json.loads((v1_folder / "genai_config.json").read_text())
    decoder = config["model"]["decoder"]
    assert (decoder["head_size"], decoder["num_key_value_heads"], decoder["num_hidden_layers"]) == (width, 1, 2)
    assert config["search"]["past_present_share_buffer"] is False


def test_v1_genai_and_onnxruntime_loop_equal_eager_tokens(v1_folder, v1_ckpt):
    loaded = load_model(v1_ckpt)
    eos = json.loads((v1_folder / "genai_config.json").read_text())["model"]["eos_token_id"]
    expected = _eager_tokens(loaded, eos=eos)
    assert _genai_tokens(v1_folder) == expected
    run = step_loop.generate_stepped(v1_folder, PROMPT, NEW_TOKENS, Sampling())
    assert run.tokens == expected and len(expected) >= 32


def test_v1_check_passes_and_its_polygraphy_files_exist(v1_folder, v1_ckpt, tmp_path):
    report = run_decoder_check(v1_folder, load_model(v1_ckpt), CheckOptions(provider="cpu", save_dir=tmp_path),
                               log=quiet)
    assert report.passed, report.text()
    assert "33 steps" in report.text() and "33/33 steps  PASS" in report.text()
    feeds = json.loads((tmp_path / "inputs.json").read_text())
    assert len(feeds) == 2  # one prefill, one decode step
    run_printed_polygraphy(report.polygraphy_command)  # both iterations, the prompts' padding rows too


def test_check_fails_on_a_folder_with_corrupted_weights(v1_folder, v1_ckpt, tmp_path):
    """A check that cannot fail is no check: perturb one weight of the graph and the check must fail."""

    broken = tmp_path / "broken"
    shutil.copytree(v1_folder, broken)
    model = onnx.load(str(broken / "model.onnx"))
    target = max(model.graph.initializer, key=lambda t: int(np.prod(t.dims)))
    array = onnx.numpy_helper.to_array(target).copy()
    array.flat[::7] += 0.05
    target.CopyFrom(onnx.numpy_helper.from_array(array, target.name))
    onnx.save(model, str(broken / "model.onnx"))
    report = run_decoder_check(broken, load_model(v1_ckpt), CheckOptions(provider="cpu", save_dir=tmp_path / "c"),
                               log=quiet)
    assert not report.passed and "FAIL" in report.text()


def _text_perplexity(model, ids, window):
    """An independent perplexity: each window of the ids in one eager forward, next-token NLL in float64."""
    nll, count = 0.0, 0
    for start in range(0, len(ids), window):
        part = torch.tensor([ids[start:start + window]])
        if part.shape[1] < 2:
            continue
        with torch.no_grad():
            logp = torch.log_softmax(model(part)[0, :-1].double(), -1)
        nll -= float(logp.gather(-1, part[0, 1:, None]).sum())
        count += part.shape[1] - 1
    return float(np.exp(nll / count)), count


def test_check_scores_a_text_through_the_folders_cache(v1_folder, v1_ckpt, tmp_path, monkeypatch):
    """--text on a folder: windows of the text, each half prefill and half one-token decode steps
    through the folder's cache, against the eager model's forward over the whole window; the
    perplexity printed is recomputed here. A runner whose cache loses a token only on one-row calls
    (the text's, not the greedy check's batch of 3) must fail the text and pass the greedy steps."""
    loaded = load_model(v1_ckpt)
    text = tmp_path / "t.txt"
    text.write_text("a folder should predict the next byte of this text as the model does. " * 20)
    ids = list(text.read_bytes())
    assert len(ids) == 1400  # two windows: 1,024 tokens and 376
    options = CheckOptions(provider="cpu", save_dir=tmp_path / "c", text=str(text))
    report = run_decoder_check(v1_folder, loaded, options, log=quiet, steps=4)
    assert report.passed, report.text()
    assert "text          1400 tokens in 2 window(s) of up to 1024, 4 comparisons" in report.text()
    line = next(x for x in report.text().splitlines() if x.startswith("perplexity"))
    printed = [float(v) for v in re.findall(r"(?:onnxruntime|eager) ([0-9.e+]+)", line)]
    expected, count = _text_perplexity(loaded.model.eval(), ids, 1024)
    assert printed == pytest.approx([expected, expected], rel=1e-4) and f"on {count} next tokens" in line
    assert "(UTF-8 bytes)" in line  # the folder has no tokenizer
    assert len(json.loads((tmp_path / "c" / "inputs.json").read_text())) == 2  # polygraphy: greedy steps only

    step = step_loop.OrtDecoder.step

    def forgetful(self, ids, mask, cache):  # one-row calls with a past lose their oldest cached token's value
        if ids.shape[0] == 1 and mask.shape[1] > ids.shape[1]:
            cache = {name: past.copy() for name, past in cache.items()}
            for name in cache:
                if name.endswith(".value"):
                    cache[name][:, :, 0] = 0
        return step(self, ids, mask, cache)

    monkeypatch.setattr(step_loop.OrtDecoder, "step", forgetful)
    broken = run_decoder_check(v1_folder, loaded, CheckOptions(provider="cpu", save_dir=tmp_path / "b",
                                                               text=str(text)), log=quiet, steps=4)
    assert not broken.passed, broken.text()
    assert "5/5 steps  PASS" in broken.text()  # the greedy batch never calls with one row
    assert re.search(r"logits text window 1 decode .*FAIL", broken.text()) and \
        "logits text window 1 prefill" not in broken.text()  # the prefill has no past to lose


def test_check_text_refusals_are_one_line(v1_folder, v1_ckpt, tmp_path):
    one = tmp_path / "one.txt"
    one.write_text("a")
    assert_one_line_error(cli_main("check", v1_folder, "--ckpt", v1_ckpt, "--text", one),
                          "has 1 tokens; a perplexity needs 2: give more text")
    assert_one_line_error(cli_main("check", v1_folder, "--ckpt", v1_ckpt, "--text", tmp_path / "none.txt"),
                          "text file not found")
    assert_one_line_error(cli_main("check", v1_folder, "--ckpt", v1_ckpt, "--text", one, "--tokenizer",
                                  tmp_path / "no-tokenizer"), "cannot load tokenizer")


@pytest.mark.parametrize("preset", ["diff-v2-tiny", "transformer-tiny"])
def test_v2_and_transformer_folders_generate_and_check(preset, tmp_path):
    model = perturb_norm_weights(build_model(preset_config(preset), seed=4), 4)
    save_safetensors(model, tmp_path / "st")
    loaded = load_model(tmp_path / "st")
    summary = export_decoder(loaded, tmp_path / "kv", log=quiet)
    assert summary.diff_attention_nodes == (0 if preset.startswith("transformer") else 2)
    eos = json.loads((tmp_path / "kv" / "genai_config.json").read_text())["model"]["eos_token_id"]
    assert _genai_tokens(tmp_path / "kv") == _eager_tokens(loaded, eos=eos)
    report = run_decoder_check(tmp_path / "kv", loaded, CheckOptions(provider="cpu"), log=quiet)
    assert report.passed, report.text()


def test_fp16_folder_passes_its_rule(tmp_path):
    loaded = load_model(None, preset="diff-v1-tiny", seed=6, dtype=torch.float16)
    export_decoder(loaded, tmp_path / "kv16", ExportOptions(dtype="float16"), log=quiet)
    model = onnx.load(str(tmp_path / "kv16" / "model.onnx"))
    assert {i.name: i.type.tensor_type.elem_type for i in model.graph.input}["past_key_values.0.key"] == \
        onnx.TensorProto.FLOAT16
    report = run_decoder_check(tmp_path / "kv16", loaded, CheckOptions(provider="cpu"), log=quiet)
    assert report.passed, report.text()
    assert "torch low-precision baseline" in report.text()


@pytest.fixture(scope="module")
def hf_dir(artifacts):
    """An HF DiffLlama folder with GQA (8 maps over 4 kv heads) and its tokenizer files."""
    return artifacts.hf_diffllama()


@pytest.fixture(scope="module")
def hf_kv(artifacts, hf_dir):
    """`diffexport onnx HF --kv-cache`: the folder with the HF checkpoint's tokenizer."""
    return artifacts.cli_output("onnx", hf_dir, "--kv-cache", output="kv")


@pytest.fixture(scope="module")
def hf_chat_kv(artifacts):
    """The same export of the HF folder with a chat_template.jinja, which the export copies."""
    return artifacts.cli_output("onnx", artifacts.hf_diffllama_with_chat_template(), "--kv-cache", output="kv")


def test_hf_diffllama_folder_with_tokenizer(hf_dir, hf_kv):
    pytest.importorskip("onnxruntime_genai")
    assert (hf_kv / "tokenizer.json").is_file()
    config = json.loads((hf_kv / "genai_config.json").read_text())["model"]
    assert (config["eos_token_id"], config["pad_token_id"], config["context_length"]) == (2, 0, 512)
    loaded = load_model(hf_dir)
    # genai greedy tokens == eager == transformers' generate (HF stops at eos: compare up to it)
    import transformers

    hf = transformers.DiffLlamaForCausalLM.from_pretrained(hf_dir).eval()
    prompt = [1, 40, 41, 42, 60, 61]
    with torch.no_grad():
        hf_tokens = hf.generate(torch.tensor([prompt]), max_new_tokens=NEW_TOKENS, do_sample=False,
                                pad_token_id=0)[0, len(prompt):].tolist()
    ours = _eager_tokens(loaded, prompt, eos=2)
    assert ours == hf_tokens
    assert _genai_tokens(hf_kv, prompt) == ours
    report = run_decoder_check(hf_kv, loaded, CheckOptions(provider="cpu"), log=quiet)
    assert report.passed and "transformers generate() == eager" in report.text(), report.text()
    text = cli_main("generate", hf_kv, "--prompt", "the cat sat", "--max-new-tokens", "8")
    assert text.returncode == 0, text.stderr
    assert "decode" in text.stderr and "tokens/s" in text.stderr
    looped = cli_main("generate", hf_kv, "--prompt", "the cat sat", "--max-new-tokens", "8",
                     "--backend", "onnxruntime")
    assert looped.returncode == 0 and looped.stdout == text.stdout, looped.stderr


def _prompt_tokens(result) -> int:
    return int(re.search(r"prompt (\d+) tokens", result.stderr).group(1))


def test_generate_chat_puts_the_prompt_in_the_chat_template(artifacts, hf_chat_kv, tmp_path):
    """`generate --chat`: the prompt becomes a user turn (after --system) in the tokenizer's chat
    template, from tokenizer_config.json or the chat_template.jinja the export copies; a tokenizer
    without one is refused in one line."""
    og = pytest.importorskip("onnxruntime_genai")
    artifacts.copy(hf_chat_kv, tmp_path)  # this test changes its chat template
    assert (tmp_path / "kv" / "chat_template.jinja").is_file()
    tokenizer = og.Tokenizer(og.Model(str(tmp_path / "kv")))
    for extra, text in (([], "<s>user: the cat sat\n<s>assistant: "),
                        (["--system", "be brief"], "<s>system: be brief\n<s>user: the cat sat\n<s>assistant: ")):
        result = cli_main("generate", tmp_path / "kv", "--prompt", "the cat sat", "--chat", *extra,
                         "--max-new-tokens", "2")
        assert result.returncode == 0, result.stderr
        assert _prompt_tokens(result) == len(tokenizer.encode(text)) > len(tokenizer.encode("the cat sat"))
    (tmp_path / "kv" / "chat_template.jinja").write_bytes(b"a" * (1024**2 + 1))
    assert_one_line_error(cli_main("generate", tmp_path / "kv", "--prompt", "hi", "--chat"), "larger than 1 MiB")
    (tmp_path / "kv" / "chat_template.jinja").unlink()
    assert_one_line_error(cli_main("generate", tmp_path / "kv", "--prompt", "hi", "--chat"), "has no chat template")
    (tmp_path / "elsewhere.jinja").write_text("{{ messages[0]['content'] }}")
    (tmp_path / "kv" / "chat_template.jinja").symlink_to(tmp_path / "elsewhere.jinja")  # a link is never followed
    assert_one_line_error(cli_main("generate", tmp_path / "kv", "--prompt", "hi", "--chat"), "is a symbolic link")
    assert_one_line_error(cli_main("generate", tmp_path / "kv", "--ids", "1,2", "--chat"), "give --prompt")
    assert_one_line_error(cli_main("generate", tmp_path / "kv", "--prompt", "hi", "--system", "x"), "add --chat")


def test_hf_folder_without_tokenizer_exports_ids_only(tmp_path):
    """save_pretrained writes generation_config.json but no tokenizer: token ids only, eos from the config."""
    transformers = pytest.importorskip("transformers")
    cfg = transformers.DiffLlamaConfig(vocab_size=96, hidden_size=64, intermediate_size=112, num_hidden_layers=1,
                                       num_attention_heads=4, num_key_value_heads=2, head_dim=16, eos_token_id=5)
    transformers.DiffLlamaForCausalLM(cfg).save_pretrained(tmp_path / "hf")
    summary = export_decoder(load_model(tmp_path / "hf"), tmp_path / "kv", log=quiet)
    assert not summary.tokenizer and not (tmp_path / "kv" / "tokenizer.json").exists()
    assert json.loads((tmp_path / "kv" / "genai_config.json").read_text())["model"]["eos_token_id"] == 5


def test_generate_streams_ids_and_samples_reproducibly(v1_folder):
    pytest.importorskip("onnxruntime_genai")
    first = cli_main("generate", v1_folder, "--ids", "1,2,3", "--max-new-tokens", "6", "--sample", "--top-k", "5",
                    "--seed", "3")
    again = cli_main("generate", v1_folder, "--ids", "1,2,3", "--max-new-tokens", "6", "--sample", "--top-k", "5",
                    "--seed", "3")
    assert first.returncode == 0 and first.stdout == again.stdout, first.stderr
    assert len(first.stdout.split()) <= 6 and all(t.isdigit() for t in first.stdout.split())


# ---------------------------------------------------------------- bad input: one line, exit 2, nothing written

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
        ("custom-ops", session("custom_ops_library", "libevil.so"), "custom_ops_library is not a key diffexport writes"),
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


def test_kv_export_refuses_a_linked_tokenizer_file(tmp_path):
    real = tmp_path / "real"
    byte_bpe_tokenizer(real)
    linked = tmp_path / "linked"
    linked.mkdir()
    (linked / "tokenizer.json").symlink_to(real / "tokenizer.json")
    result = cli_main("onnx", "--preset", "diff-v1-tiny", "--kv-cache", "--tokenizer", linked, "-o", tmp_path / "kv")
    assert_one_line_error(result, "symbolic link")
    assert not (tmp_path / "kv").exists()


def test_generate_bad_requests(v1_folder):
    assert_one_line_error(cli_main("generate", v1_folder, "--ids", "1,2", "--max-new-tokens", "0"),
                          "--max-new-tokens must be >= 1")
    assert_one_line_error(cli_main("generate", v1_folder, "--ids", "1,2", "--max-new-tokens", "-3"),
                          "--max-new-tokens must be >= 1")
    assert_one_line_error(cli_main("generate", v1_folder, "--ids", "1,2", "--max-new-tokens", "2047"),
                          "exceeds the context length 2048")
    assert_one_line_error(cli_main("generate", v1_folder, "--ids", "1,x"), "comma-separated integers")
    assert_one_line_error(cli_main("generate", v1_folder, "--ids", "1,99999"), "token ids in [0, 512)")
    assert_one_line_error(cli_main("generate", v1_folder, "--prompt", "hello"), "has no tokenizer")
    assert_one_line_error(cli_main("generate", v1_folder, "--ids", "1", "--sample", "--top-p", "0"), "top-p")
    for seed in ("-1", str(2**40)):  # genai draws a fresh seed each run for -1, and takes 32 bits: check's rule
        assert_one_line_error(cli_main("generate", v1_folder, "--ids", "1", "--sample", "--seed", seed),
                              "--seed must be an integer in 0..2147483647 when sampling")


def test_kv_export_bad_targets_and_tokenizers(tmp_path, v1_ckpt):
    existing = tmp_path / "exists"
    existing.mkdir()
    (existing / "keep.txt").write_text("mine")
    assert_one_line_error(cli_main("onnx", v1_ckpt, "--kv-cache", "-o", existing), "already exists")
    assert (existing / "keep.txt").read_text() == "mine"
    assert_one_line_error(cli_main("onnx", v1_ckpt, "--kv-cache", "--bf16", "--provider", "cpu", "-o", tmp_path / "a"),
                          "CPU provider has no bfloat16 kernels")
    assert_one_line_error(cli_main("onnx", v1_ckpt, "--kv-cache", "--bf16", "--attention", "gqa", "-o", tmp_path / "a"),
                          "gqa folders are float32 or float16")
    assert_one_line_error(cli_main("onnx", v1_ckpt, "--provider", "cuda", "-o", tmp_path / "a.onnx"),
                          "belong to --kv-cache")
    assert_one_line_error(cli_main("onnx", v1_ckpt, "--kv-cache", "-o", tmp_path / "a.onnx"), "writes a folder")
    assert_one_line_error(cli_main("onnx", v1_ckpt, "--tokenizer", tmp_path, "-o", tmp_path / "b.onnx"),
                          "belong to --kv-cache")
    assert_one_line_error(cli_main("onnx", v1_ckpt, "--kv-cache", "--threads", "0", "-o", tmp_path / "e"),
                          "--threads must be in 1..1024")
    for context in ("67108864", str(10**12)):  # gqa's rotary caches would grow with it: refused before tracing
        assert_one_line_error(cli_main("onnx", v1_ckpt, "--kv-cache", "--attention", "gqa", "--context-length", context,
                                       "-o", tmp_path / "long"), "--context-length must be in 2..1,048,576")
    assert not (tmp_path / "long").exists()
    small = tmp_path / "tok"
    byte_bpe_tokenizer(small)  # 279 tokens: more than a 128-token vocabulary holds
    cfg = preset_config("diff-v1-tiny")
    cfg.vocab_size = 128
    too_small = save_checkpoint(build_model(cfg, seed=1), tmp_path / "v128.pt")
    result = cli_main("onnx", too_small, "--kv-cache", "--tokenizer", small, "-o", tmp_path / "c")
    assert_one_line_error(result, "not this model's tokenizer")
    assert_one_line_error(cli_main("onnx", v1_ckpt, "--kv-cache", "--tokenizer", tmp_path / "nope", "-o",
                                  tmp_path / "d"), "is not a folder")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["exists", "tok", "v128.pt"]  # nothing half-written


def test_provider_in_the_folder_and_at_generate(v1_folder, v1_ckpt, tmp_path):
    """--provider names genai's execution provider in the folder; `generate --provider` overrides it."""
    pytest.importorskip("onnxruntime_genai")
    cuda = tmp_path / "cuda"
    assert cli_main("onnx", v1_ckpt, "--kv-cache", "--provider", "cuda", "-o", cuda).returncode == 0
    options = json.loads((cuda / "genai_config.json").read_text())["model"]["decoder"]["session_options"]
    assert options["provider_options"] == [{"cuda": {}}]
    assert json.loads((v1_folder / "genai_config.json").read_text())["model"]["decoder"]["session_options"][
        "provider_options"] == []  # the default: genai's CPU provider
    on_cpu = cli_main("generate", cuda, "--ids", "5,17,42", "--max-new-tokens", "6", "--provider", "cpu")
    as_exported = cli_main("generate", v1_folder, "--ids", "5,17,42", "--max-new-tokens", "6")
    assert on_cpu.returncode == 0 and on_cpu.stdout == as_exported.stdout != ""
    import onnxruntime_genai as og

    if not og.is_cuda_available():  # this onnxruntime-genai has no CUDA: one line that says what is missing
        assert_one_line_error(cli_main("generate", cuda, "--ids", "5,17", "--max-new-tokens", "2"), "needs the "
                              "onnxruntime-genai-cuda package")
    if "CUDAExecutionProvider" not in __import__("onnxruntime").get_available_providers():
        assert_one_line_error(cli_main("generate", v1_folder, "--ids", "5", "--backend", "onnxruntime", "--provider",
                                      "cuda"), "install onnxruntime-gpu")


def test_bf16_folder_is_for_cuda_and_tensorrt(v1_ckpt, tmp_path):
    """A bf16 folder names genai's CUDA provider, holds a bf16 cache, builds in TensorRT(-RTX) and is
    refused in one line where this machine's runtimes cannot run it (no bf16 CPU kernels)."""
    folder = tmp_path / "bf16"
    result = cli_main("onnx", v1_ckpt, "--kv-cache", "--bf16", "-o", folder)
    assert result.returncode == 0, result.stderr
    assert "cuda provider" in result.stdout
    config = json.loads((folder / "genai_config.json").read_text())
    assert config["model"]["decoder"]["session_options"]["provider_options"] == [{"cuda": {}}]
    model = onnx.load(str(folder / "model.onnx"), load_external_data=False)
    types = {i.name: i.type.tensor_type.elem_type for i in [*model.graph.input, *model.graph.output]}
    assert types["past_key_values.0.key"] == types["present.1.value"] == types["logits"] == onnx.TensorProto.BFLOAT16
    assert_one_line_error(cli_main("check", folder, "--ckpt", v1_ckpt), "bfloat16 folder")
    assert_one_line_error(cli_main("generate", folder, "--ids", "1,2", "--backend", "onnxruntime"), "bfloat16 folder")
    pytest.importorskip("tensorrt_rtx")
    engine = tmp_path / "bf16.engine"
    built = cli_main("trt", folder, "-o", engine, "--attention", "native", "--builder", "tensorrt-rtx", "--bf16",
                    "--max", "2x64", "--max-past", "64")
    assert built.returncode == 0, built.stderr
    assert "bf16" in built.stdout and json.loads(engine.with_name("bf16.engine.json").read_text())[
        "onnx_metadata"]["dtype"] == "bfloat16"


# ---------------------------------------------------------------- TensorRT: profiles over past length

def test_trt_rtx_builds_the_kv_cache_folder_natively(v1_folder, tmp_path):
    pytest.importorskip("tensorrt_rtx")
    engine = tmp_path / "kv.engine"
    result = cli_main("trt", v1_folder, "-o", engine, "--attention", "native", "--builder", "tensorrt-rtx",
                     "--max", "2x64", "--max-past", "256")
    assert result.returncode == 0, result.stderr
    assert "2 DiffAttention nodes -> native" in result.stdout
    record = json.loads((tmp_path / "kv.engine.json").read_text())
    assert record["profile"]["max_past"] == 256 and record["onnx_metadata"]["kv_cache"] == "1"
    too_long = cli_main("trt", v1_folder, "-o", tmp_path / "x.engine", "--attention", "native", "--builder",
                       "tensorrt-rtx", "--max", "1x64", "--max-past", "2000")
    assert_one_line_error(too_long, "exceeds the context length 2048")
    longer_than_context = cli_main("trt", v1_folder, "-o", tmp_path / "x.engine", "--max", "1x100000")
    assert_one_line_error(longer_than_context, "--max sequence 100000 exceeds the folder's context length 2048")


def test_profile_ranges_of_a_kv_graph_and_plugin_refusal(v1_folder):
    from diffexport.backends.tensorrt import EngineOptions, _profile_shapes, prepare_graph

    model = onnx.load(str(v1_folder / "model.onnx"))
    options = EngineOptions(min_shape=(1, 1), opt_shape=(1, 1), max_shape=(2, 32), opt_past=100, max_past=500)
    shapes = _profile_shapes(model, options)
    assert shapes["input_ids"] == ((1, 1), (1, 1), (2, 32))
    assert shapes["attention_mask"] == ((1, 1), (1, 101), (2, 532))
    width = shapes["past_key_values.0.key"][0][3]
    assert shapes["past_key_values.0.key"] == ((1, 1, 0, width), (1, 1, 100, width), (2, 1, 500, width))
    staged, count = prepare_graph(model, EngineOptions(attention="plugin"))
    nodes = [n for n in staged.graph.node if n.op_type == contract.OP_NAME]
    assert count == 2 and all(len(n.input) == 6 for n in nodes)
    assert [a.s.decode() for n in nodes for a in n.attribute if a.name == "plugin_version"] == ["2", "2"]
    assert not staged.functions  # no body to import instead of the plugin


@pytest.mark.parametrize("weights", ["int4", "int8"])
def test_hf_diffllama_folder_quantised_generates_and_meets_its_budget(hf_dir, hf_kv, tmp_path, weights):
    """Issue 18's end point for an HF checkpoint: the quantised folder still decodes in
    onnxruntime-genai with its tokenizer and passes its budget against our port and transformers."""
    pytest.importorskip("onnxruntime_genai")
    result = cli_main("quantize", hf_kv, "-o", tmp_path / "q", "--weights", weights)
    assert result.returncode == 0, result.stderr
    assert (tmp_path / "q" / "tokenizer.json").is_file()
    text = tmp_path / "t.txt"  # --text: read with the folder's own tokenizer, judged on the budget
    text.write_text("the cat sat on the mat and the dog sat on the log. " * 12)
    report = cli_main("check", tmp_path / "q", "--ckpt", hf_dir, "--text", text)
    assert report.returncode == 0, report.stdout + report.stderr
    assert f"budget        {weights} weights" in report.stderr and "transformers" in report.stdout
    perplexity = next(x for x in report.stdout.splitlines() if x.startswith("perplexity"))
    assert f"(tokenizer {tmp_path / 'q'})" in perplexity and "KL" in report.stdout.split("text          ")[-1]
    text = cli_main("generate", tmp_path / "q", "--prompt", "the cat sat", "--max-new-tokens", "8")
    assert text.returncode == 0 and text.stdout.strip(), text.stderr


def test_hf_diffllama_gqa_folder_checks_against_transformers(artifacts, hf_dir, tmp_path):
    """`--attention gqa` on an HF DiffLlama (8 maps over 4 kv heads, weightless head norm): its check
    compares with our port and with transformers' own model, and genai generates text."""
    pytest.importorskip("onnxruntime_genai")
    kv = artifacts.cli_output("onnx", hf_dir, "--kv-cache", "--attention", "gqa", output="kv")
    config = json.loads((kv / "genai_config.json").read_text())["model"]["decoder"]
    # HF's 8 maps over 4 kv heads are 4 diff-heads over 2 kv-groups, each [K1, K2] of 2 x 16
    assert (config["num_key_value_heads"], config["head_size"]) == (2, 32)
    report = cli_main("check", kv, "--ckpt", hf_dir, "--save-dir", tmp_path / "saved")
    assert report.returncode == 0, report.stdout + report.stderr
    assert "transformers" in report.stdout
    text = cli_main("generate", kv, "--prompt", "the cat sat", "--max-new-tokens", "8")
    assert text.returncode == 0 and text.stdout.strip(), text.stderr


def test_generate_prompts_file_with_text_and_chat(hf_chat_kv, tmp_path):
    """`generate --prompts-file` with text prompts (the folder's tokenizer, --chat templating each)
    and ids (one ending with the pad id, 0 here): every answer is what the prompt gives alone, and
    its completion is the tokenizer's text of its tokens."""
    og = pytest.importorskip("onnxruntime_genai")
    kv = hf_chat_kv
    lines = [{"prompt": "the cat sat", "id": "a"}, {"prompt": "on a mat, said the dog"}, {"ids": [5, 6, 0]}]
    (tmp_path / "p.jsonl").write_text("".join(json.dumps(line) + "\n" for line in lines))
    tokenizer = og.Tokenizer(og.Model(str(kv)))
    for chat in ([], ["--chat"]):
        out = cli_main("generate", kv, "--prompts-file", tmp_path / "p.jsonl", *chat, "--batch-size", "2",
                      "--max-new-tokens", "6")
        assert out.returncode == 0, out.stderr
        answers = [json.loads(line) for line in out.stdout.splitlines()]
        assert [a["line"] for a in answers] == [1, 2, 3] and answers[0]["id"] == "a" and "id" not in answers[1]
        for line, answer in zip(lines, answers):
            if "ids" in line:
                ids = line["ids"]
            else:
                template = (kv / "chat_template.jinja").read_text()
                text = tokenizer.apply_chat_template(json.dumps([{"role": "user", "content": line["prompt"]}]),
                                                     template_str=template, add_generation_prompt=True) \
                    if chat else line["prompt"]
                ids = [int(t) for t in tokenizer.encode(text)]
            alone = genai.generate_genai(kv, ids, 6, Sampling())
            assert answer["tokens"] == alone.tokens and answer["stop"] == alone.stop
            spoken = alone.tokens[:-1] if alone.stop == "eos" else alone.tokens
            assert answer["completion"] == tokenizer.decode(spoken)


def test_generate_interactive_is_a_chat_over_stdin(hf_chat_kv):
    """`generate --interactive`: every stdin line is a user turn (blank lines skipped), answered in the
    chat template with the conversation so far, the answers streamed one per line; on both backends
    each answer is what a single templated prompt of that conversation gives. When the conversation
    passes the context the oldest turns go; a turn too long alone is not answered, said on stderr,
    and the session goes on to exit 2."""
    og = pytest.importorskip("onnxruntime_genai")
    kv = hf_chat_kv
    tokenizer = og.Tokenizer(og.Model(str(kv)))
    template = (kv / "chat_template.jinja").read_text()

    def ids_of(messages):
        text = tokenizer.apply_chat_template(json.dumps(messages), template_str=template, add_generation_prompt=True)
        return [int(t) for t in tokenizer.encode(text)]

    def answer(messages, new=10):  # as the session streams it (a random model's bytes need not be UTF-8)
        run = genai.generate_genai(kv, ids_of(messages), new, Sampling())
        stream = tokenizer.create_stream()
        return "".join(stream.decode(t) for t in (run.tokens[:-1] if run.stop == "eos" else run.tokens))

    system = {"role": "system", "content": "be brief"}
    first, second = {"role": "user", "content": "the cat sat"}, {"role": "user", "content": "on a mat, said the dog"}
    one = answer([system, first])
    two = answer([system, first, {"role": "assistant", "content": one}, second])
    long_turn = {"role": "user", "content": " ".join(["the dog sat on the mat"] * 26)}
    after_drop = answer([system, long_turn])
    assert len(ids_of([system, long_turn])) + 10 <= 512  # one long turn fits the context, two do not
    assert len(ids_of([system, long_turn, {"role": "assistant", "content": after_drop}, long_turn])) + 10 > 512
    too_long = " ".join(["the dog sat on the mat"] * 80)
    for backend in ("genai", "onnxruntime"):
        out = cli_main("generate", kv, "--interactive", "--system", "be brief", "--max-new-tokens", "10",
                      "--backend", backend, stdin=f"{first['content']}\n\n{second['content']}\n")
        assert out.returncode == 0, out.stderr
        assert out.stdout == f"{one}\n{two}\n" and out.stderr.count("new tokens in") == 2
        conversation, read = map(int, re.findall(r"conversation (\d+) tokens, (\d+) read", out.stderr)[1])
        assert read < conversation  # the session kept its cache
        out = cli_main("generate", kv, "--interactive", "--system", "be brief", "--max-new-tokens", "10",
                      "--backend", backend, stdin=f"{long_turn['content']}\n{too_long}\n{long_turn['content']}\n")
        assert out.returncode == 2, out.stderr  # the session went on, its status says a turn was not answered
        assert "exceeds the context length 512: not answered" in out.stderr and "dropped the oldest turn" in out.stderr
        assert out.stdout.splitlines()[-1] == after_drop  # the same long turn again, its first exchange dropped
    assert_one_line_error(cli_main("generate", kv, "--interactive", "--chat"), "drop --chat")


def test_generate_interactive_refuses_bad_input(hf_kv, hf_chat_kv, v1_folder):
    """--interactive's inputs: a folder without a tokenizer or a chat template, and stdin that is not
    UTF-8 or has a line over 1 MiB (refused before more of it is read): one line, exit 2."""
    pytest.importorskip("onnxruntime_genai")
    plain, kv = hf_kv, hf_chat_kv  # without and with a chat template
    assert_one_line_error(cli_main("generate", v1_folder, "--interactive", stdin="hi\n"), "has no tokenizer")
    assert_one_line_error(cli_main("generate", plain, "--interactive", stdin="hi\n"),
                          "has no chat template")
    assert_one_line_error(cli_main("generate", kv, "--interactive", stdin=b"\n caf\xe9\n"),
                          "stdin line 2 is not UTF-8 text")
    assert_one_line_error(cli_main("generate", kv, "--interactive", stdin=b"x" * (2**20 + 5)),
                          "stdin line 1 is longer than 1 MiB")
    out = cli_main("generate", kv, "--interactive", "--max-new-tokens", "2", stdin="")
    assert out.returncode == 0 and out.stdout == ""  # no turn: nothing to answer


def test_a_chat_template_that_raises_mid_session_is_one_line(hf_chat_kv, tmp_path):
    """A folder's template that answers the first turn and raises on the second (raise_exception, as
    transformers' templates do): the first answer is given, then one error line naming the template's
    message, exit 2, not a Jinja traceback."""
    pytest.importorskip("onnxruntime_genai")
    folder = shutil.copytree(hf_chat_kv, tmp_path / "kv")
    template = (folder / "chat_template.jinja").read_text()
    (folder / "chat_template.jinja").write_text(
        "{% if messages | length > 2 %}{{ raise_exception('this template takes one turn') }}{% endif %}" + template)
    out = cli_main("generate", folder, "--interactive", "--max-new-tokens", "2", stdin="hello\nagain\n")
    assert out.returncode == 2 and "Traceback" not in out.stderr, out.stderr
    errors = [line for line in out.stderr.splitlines() if line.startswith("error: ")]
    assert errors == ["error: the chat template refused the conversation: this template takes one turn"], out.stderr
    assert out.stderr.rstrip().endswith(errors[0]) and out.stderr.count("new tokens in") == 1  # turn 1 answered
    assert len(out.stdout.splitlines()) == 1


def test_generation_config_becomes_the_folders_search_defaults(tmp_path):
    """A checkpoint's generation_config.json (sampling, penalty, beams) lands in the folder's genai
    search block (values genai cannot take passed over, said in the log); `generate` follows it as
    transformers' generate() does: greedy with the checkpoint's repetition penalty equals
    transformers' tokens, the folder's sampling is used unless --greedy, the options override it."""
    transformers = pytest.importorskip("transformers")
    pytest.importorskip("onnxruntime_genai")
    from diffexport.cli import build_parser
    from diffexport.cli.generate import generate_request
    from diffexport.format.decoder_folder import SEARCH_DEFAULTS

    torch.manual_seed(12)
    cfg = transformers.DiffLlamaConfig(vocab_size=96, hidden_size=64, intermediate_size=112, num_hidden_layers=2,
                                       num_attention_heads=8, num_key_value_heads=4, head_dim=16,
                                       pad_token_id=0, bos_token_id=1, eos_token_id=2, max_position_embeddings=256)
    hf = transformers.DiffLlamaForCausalLM(cfg).eval()
    hf.generation_config.update(do_sample=True, temperature=0.7, top_p=0.9, repetition_penalty=1.3)
    hf.save_pretrained(tmp_path / "hf")
    path = tmp_path / "hf" / "generation_config.json"
    values = json.loads(path.read_text())
    values["early_stopping"] = "never"  # transformers' third value: genai takes a bool
    values["no_repeat_ngram_size"] = 2  # processors genai's folder leaves out; `check` must not apply them
    values["bad_words_ids"] = [[t] for t in range(3, 96, 2)]
    path.write_text(json.dumps(values))
    result = cli_main("onnx", tmp_path / "hf", "--kv-cache", "-o", tmp_path / "kv")
    assert result.returncode == 0, result.stderr
    assert "passed over early_stopping='never'" in result.stdout + result.stderr
    search = json.loads((tmp_path / "kv" / "genai_config.json").read_text())["search"]
    assert {k: search[k] for k in SEARCH_DEFAULTS} == {**SEARCH_DEFAULTS, "do_sample": True, "temperature": 0.7,
                                                       "top_p": 0.9, "repetition_penalty": 1.3}
    prompt = [5, 17, 42, 9, 60]
    hf = transformers.DiffLlamaForCausalLM.from_pretrained(tmp_path / "hf").eval()
    with torch.no_grad():  # transformers reads the same generation_config: greedy, penalty 1.3
        expected = hf.generate(torch.tensor([prompt]), do_sample=False, max_new_tokens=12, min_new_tokens=12,
                               pad_token_id=0, no_repeat_ngram_size=0, bad_words_ids=None)[0, len(prompt):].tolist()
        plain = hf.generate(torch.tensor([prompt]), do_sample=False, max_new_tokens=12, min_new_tokens=12,
                            pad_token_id=0, repetition_penalty=1.0)[0, len(prompt):].tolist()
    assert expected != plain  # the checkpoint's penalty matters here
    for backend in ("genai", "onnxruntime"):
        out = cli_main("generate", tmp_path / "kv", "--ids", ",".join(map(str, prompt)), "--max-new-tokens", "12",
                      "--greedy", "--backend", backend)
        assert out.returncode == 0, out.stderr
        assert [int(t) for t in out.stdout.split()] == expected, backend
        assert "repetition penalty 1.3" in out.stderr
    # check compares plain greedy decoding: transformers' side must not take the checkpoint's penalty
    report = run_decoder_check(tmp_path / "kv", load_model(tmp_path / "hf"), CheckOptions(provider="cpu"), log=quiet)
    assert report.passed and "transformers generate() == eager" in report.text(), report.text()
    config = json.loads((tmp_path / "kv" / "genai_config.json").read_text())

    def sampling(*flags):
        args = build_parser().parse_args(["generate", str(tmp_path / "kv"), "--ids", "1", *flags])
        return generate_request(args).sampling(config)

    folder = sampling()
    assert (folder.greedy, folder.temperature, folder.top_k, folder.top_p, folder.repetition_penalty) == \
        (False, 0.7, 50, 0.9, 1.3)
    assert sampling("--greedy").greedy and sampling("--greedy").repetition_penalty == 1.3
    mine = sampling("--temperature", "1.2", "--top-k", "0", "--repetition-penalty", "1.0")
    assert (mine.greedy, mine.temperature, mine.top_k, mine.top_p, mine.repetition_penalty) == (False, 1.2, 0, 0.9, 1.0)
    config["search"] = dict(SEARCH_DEFAULTS)  # a folder that does not sample: diffexport's own defaults
    plain = sampling("--sample")
    assert (plain.greedy, plain.temperature, plain.top_k, plain.top_p, plain.repetition_penalty) == \
        (False, 1.0, 0, 1.0, 1.0)
    assert sampling().greedy


def test_generate_stops_at_stop_strings(hf_kv, tmp_path):
    """--stop ends an answer where its text first holds the string: the streamed text and a prompts
    file's completion are the free answer's text before it, the tokens the free answer's up to the
    one that completed it, on both backends; --stop needs text."""
    og = pytest.importorskip("onnxruntime_genai")
    kv = hf_kv
    tokenizer = og.Tokenizer(og.Model(str(kv)))
    prompts = ["the cat sat", "on a mat, said the dog"]
    free = {}
    for prompt in prompts:
        run = genai.generate_genai(kv, [int(t) for t in tokenizer.encode(prompt)], 24, Sampling(),
                                   min_new_tokens=24)
        free[prompt] = (run.tokens, tokenizer.decode(run.tokens))
    tokens, text = free[prompts[0]]
    stop = text[len(text) // 2:len(text) // 2 + 2]  # two characters from the middle of the free answer
    assert stop and text.index(stop) > 0
    for backend in ("genai", "onnxruntime"):
        out = cli_main("generate", kv, "--prompt", prompts[0], "--max-new-tokens", "24", "--stop", stop,
                      "--stop", "\u2603 never", "--backend", backend)
        assert out.returncode == 0, out.stderr
        assert out.stdout == text[:text.index(stop)] + "\n" and "stopped: stop_string" in out.stderr
    (tmp_path / "p.jsonl").write_text("".join(json.dumps({"prompt": p}) + "\n" for p in prompts))
    for backend in ("genai", "onnxruntime"):
        out = cli_main("generate", kv, "--prompts-file", tmp_path / "p.jsonl", "--max-new-tokens", "24",
                      "--stop", stop, "--backend", backend)
        assert out.returncode == 0, out.stderr
        for prompt, answer in zip(prompts, map(json.loads, out.stdout.splitlines())):
            tokens, text = free[prompt]
            if stop in text:
                assert answer["stop"] == "stop_string" and answer["completion"] == text[:text.index(stop)]
                assert tokens[:len(answer["tokens"])] == answer["tokens"]
                assert stop in tokenizer.decode(answer["tokens"]) and stop not in tokenizer.decode(answer["tokens"][:-1])
            else:
                assert answer["stop"] != "stop_string" and answer["tokens"] == tokens[:len(answer["tokens"])]
    # each line's own "stop" in place of --stop's ([] for none), on both backends
    tokens, text = free[prompts[0]]
    for cli_stop, own in (([], stop), (["--stop", stop], [])):
        (tmp_path / "own.jsonl").write_text(json.dumps({"prompt": prompts[0], "stop": own}) + "\n" +
                                            json.dumps({"prompt": prompts[0]}) + "\n")
        for backend in ("genai", "onnxruntime"):
            out = cli_main("generate", kv, "--prompts-file", tmp_path / "own.jsonl", "--max-new-tokens",
                          "24", *cli_stop, "--backend", backend)
            assert out.returncode == 0, out.stderr
            answers = [json.loads(line) for line in out.stdout.splitlines()]
            cut, whole = (answers[0], answers[1]) if own else (answers[1], answers[0])
            assert cut["stop"] == "stop_string" and cut["completion"] == text[:text.index(stop)]
            assert whole["stop"] != "stop_string" and whole["tokens"] == tokens[:len(whole["tokens"])]
    assert_one_line_error(cli_main("generate", kv, "--prompts-file", tmp_path / "own.jsonl",
                                  "--num-beams", "2", "--stop", stop), "drop --stop")
    (tmp_path / "own.jsonl").write_text(json.dumps({"prompt": prompts[0], "stop": "x"}) + "\n")
    assert_one_line_error(cli_main("generate", kv, "--prompts-file", tmp_path / "own.jsonl",
                                  "--num-beams", "2"), "own.jsonl line 1: stop ends one streamed answer")
    assert_one_line_error(cli_main("generate", kv, "--ids", "5,6", "--stop", "x"),
                          "--stop matches generated text")
    (tmp_path / "ids.jsonl").write_text('{"ids": [5, 6]}\n')
    assert_one_line_error(cli_main("generate", kv, "--prompts-file", tmp_path / "ids.jsonl", "--stop", "x"),
                          "--stop matches generated text: the prompts file gives token ids only")
    assert_one_line_error(cli_main("generate", kv, "--prompt", "hi", "--stop", ""), "--stop needs non-empty text")


def test_several_end_ids_all_stop_generation(tmp_path):
    """generation_config.json's eos_token_id as a list (Llama 3 chat models end a turn with
    <|eot_id|>, not the list's first id): the folder keeps the whole list, and genai, the
    onnxruntime loop and eager generate all stop at the first id of it that is generated."""
    transformers = pytest.importorskip("transformers")
    pytest.importorskip("onnxruntime_genai")
    torch.manual_seed(5)
    cfg = transformers.DiffLlamaConfig(vocab_size=96, hidden_size=64, intermediate_size=112, num_hidden_layers=1,
                                       num_attention_heads=4, num_key_value_heads=2, head_dim=16)
    transformers.DiffLlamaForCausalLM(cfg).save_pretrained(tmp_path / "hf")
    loaded = load_model(tmp_path / "hf")
    prompt = [3, 4, 5, 6]
    free = _eager_tokens(loaded, prompt, n=12)
    stop_at = next(i for i in range(1, 12) if free[i] not in free[:i])  # a token generated for the first time
    unused = next(t for t in range(96) if t not in free)
    generation = json.loads((tmp_path / "hf" / "generation_config.json").read_text())
    generation["eos_token_id"] = [unused, free[stop_at]]  # the first id is never generated
    (tmp_path / "hf" / "generation_config.json").write_text(json.dumps(generation))
    export_decoder(loaded, tmp_path / "kv", log=quiet)
    config = json.loads((tmp_path / "kv" / "genai_config.json").read_text())["model"]
    assert config["eos_token_id"] == [unused, free[stop_at]]
    expected = free[:stop_at + 1]
    assert _eager_tokens(loaded, prompt, n=12, eos=config["eos_token_id"]) == expected
    assert genai.generate_genai(tmp_path / "kv", prompt, 12, Sampling()).tokens == expected
    looped = step_loop.generate_stepped(tmp_path / "kv", prompt, 12, Sampling())
    assert looped.tokens == expected and looped.stop == "eos"


LLAMA3_ROPE = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 16}
YARN_ROPE = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32, "beta_fast": 8.0}


@pytest.mark.parametrize("attention,rope", [("diffattention", LLAMA3_ROPE), ("gqa", LLAMA3_ROPE), ("gqa", YARN_ROPE)])
def test_rope_scaling_folders_check_against_transformers(attention, rope, tmp_path):
    """A DiffLlama with Llama 3.1 RoPE scaling (what a DiffLlama made from a Llama 3.x checkpoint
    carries) or YaRN: both folder kinds check against our port and transformers, the gqa folder
    with the graph's own scaled rotary embedding in its cos/sin caches (YaRN's attention factor
    included)."""
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(3)
    cfg = transformers.DiffLlamaConfig(vocab_size=96, hidden_size=64, intermediate_size=112, num_hidden_layers=2,
                                       num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                                       max_position_embeddings=128, rope_scaling=dict(rope))
    transformers.DiffLlamaForCausalLM(cfg).eval().save_pretrained(tmp_path / "hf")
    export = cli_main("onnx", tmp_path / "hf", "--kv-cache", "--attention", attention, "-o", tmp_path / "kv")
    assert export.returncode == 0, export.stderr
    if attention == "gqa":
        scaled = "positions, scaled by YaRN's 1.13863)" if rope["rope_type"] == "yarn" else "positions)"
        assert f"rotary inside GroupQueryAttention (cos/sin caches of 128 {scaled}" in export.stdout + export.stderr
    report = cli_main("check", tmp_path / "kv", "--ckpt", tmp_path / "hf")
    assert report.returncode == 0, report.stdout + report.stderr
    assert "transformers generate() == eager" in report.stdout


def test_hf_llama_baseline_folder_checks_against_transformers(tmp_path):
    """A Hugging Face Llama (the baseline a DiffLlama is compared with) exports as a KV-cache folder
    of the baseline family; its check steps it against our port and transformers' LlamaForCausalLM."""
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(4)
    cfg = transformers.LlamaConfig(vocab_size=96, hidden_size=64, intermediate_size=112, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=256)
    transformers.LlamaForCausalLM(cfg).eval().save_pretrained(tmp_path / "llama")
    assert cli_main("onnx", tmp_path / "llama", "--kv-cache", "-o", tmp_path / "kv").returncode == 0
    assert json.loads((tmp_path / "kv" / "genai_config.json").read_text())["model"]["context_length"] == 256
    report = cli_main("check", tmp_path / "kv", "--ckpt", tmp_path / "llama")
    assert report.returncode == 0, report.stdout + report.stderr
    assert "transformers generate() == eager" in report.stdout


# ---------------------------------------------------------------- `check` on a KV-cache engine

class _OrtAsEngine:
    """The folder's own graph in onnxruntime behind EngineRunner's interface (call, input_shapes,
    input_dtypes): running the engine itself needs TensorRT and a GPU, neither of which is here, so
    these tests prove the stepping and the comparison around it, not an engine."""

    def __init__(self, model_path, corrupt_cache=False):
        import onnxruntime as ort

        self.session = ort.InferenceSession(str(model_path), providers=["CPUExecutionProvider"])
        types = {"tensor(float)": np.float32, "tensor(float16)": np.float16, "tensor(int64)": np.int64}
        inputs = self.session.get_inputs()
        self.input_shapes = {i.name: tuple(d if isinstance(d, int) else -1 for d in i.shape) for i in inputs}
        self.input_dtypes = {i.name: types[i.type] for i in inputs}
        self.outputs = [o.name for o in self.session.get_outputs()]
        self.corrupt_cache, self.calls = corrupt_cache, []

    def __call__(self, feeds):
        self.calls.append({name: (value.shape, value.dtype) for name, value in feeds.items()})
        got = self.session.run(self.outputs, {n: np.asarray(feeds[n]).astype(t) for n, t in self.input_dtypes.items()})
        out = {name: value.astype(np.float32) for name, value in zip(self.outputs, got)}
        if self.corrupt_cache:  # an engine that loses the oldest cached token at every step
            for name in self.outputs[1:]:
                out[name][:, :, 0] = 0
        return out


@pytest.fixture(scope="module")
def kv_engine(v1_folder, tmp_path_factory):
    pytest.importorskip("tensorrt_rtx")
    engine = tmp_path_factory.mktemp("kvengine") / "kv.engine"
    result = cli_main("trt", v1_folder, "-o", engine, "--attention", "native", "--builder", "tensorrt-rtx",
                     "--max", "3x64", "--max-past", "64")
    assert result.returncode == 0, result.stderr
    return engine


def _engine_check(engine, folder, loaded, tmp_path, runner, steps=12, text=None, max_sequence=None, beams=None):
    from diffexport.backends.tensorrt import EngineDecoder, read_engine_record
    from diffexport.format.metadata import check_export_metadata
    from diffexport.validation.decoder import decode_check as _decode_check
    from diffexport.validation.options import TextIds

    record = read_engine_record(engine)
    stepper = EngineDecoder(engine, record, check_export_metadata(record["onnx_metadata"], engine), runner)
    stepper.max_sequence = max_sequence or stepper.max_sequence
    options = CheckOptions(save_dir=tmp_path / "c", text=None if text is None else str(text), beams=beams)
    return _decode_check(stepper, engine.name, "onnxruntime standing in for the engine", "engine", ["polygraphy run"],
                         loaded, options, tmp_path / "c", quiet, steps, device="cpu",
                         text=None if text is None else TextIds(options, loaded.config.vocab_size, 2))


def test_engine_decoder_steps_an_engine_as_the_folder_check_does(kv_engine, v1_folder, v1_ckpt, tmp_path):
    loaded = load_model(v1_ckpt)
    runner = _OrtAsEngine(v1_folder / "model.onnx")
    report = _engine_check(kv_engine, v1_folder, loaded, tmp_path, runner)
    assert report.passed, report.text()
    assert "greedy tokens engine == eager at 13/13 steps  PASS" in report.text()
    prefill, first, last = runner.calls[0], runner.calls[1], runner.calls[-1]
    assert prefill["past_key_values.0.key"][0] == (3, 1, 0, cache_width(loaded.config))  # the empty past
    assert first["input_ids"][0] == (3, 1) and first["past_key_values.1.value"][0][2] == 16
    assert last["attention_mask"][0] == (3, 16 + 12) and first["past_key_values.0.key"][1] == np.float32
    inputs = json.loads((tmp_path / "c" / "inputs.json").read_text())
    assert len(inputs) == 2  # polygraphy gets the prefill and the first decode step

    broken = _engine_check(kv_engine, v1_folder, loaded, tmp_path, _OrtAsEngine(v1_folder / "model.onnx", True))
    assert not broken.passed and "FAIL" in broken.text()

    # --text: windows of the engine's context (max past 64 + 1), each prefill in calls of its longest sequence
    text = tmp_path / "t.txt"
    text.write_text("an engine should predict this text as its folder does. " * 3)  # 165 bytes: 65, 65 and 35
    runner = _OrtAsEngine(v1_folder / "model.onnx")
    report = _engine_check(kv_engine, v1_folder, loaded, tmp_path, runner, steps=2, text=text, max_sequence=8)
    assert report.passed, report.text()
    assert "text          165 tokens in 3 window(s) of up to 65, 6 comparisons" in report.text()
    one_row = [call for call in runner.calls if call["input_ids"][0][0] == 1]
    assert max(call["input_ids"][0][1] for call in one_row) == 8  # prefill chunks of 8 (32 = 4 x 8)
    assert max(call["attention_mask"][0][1] for call in one_row) == 65  # within the profile's past
    expected, _ = _text_perplexity(loaded.model.eval(), list(text.read_bytes()), 65)
    line = next(x for x in report.text().splitlines() if x.startswith("perplexity"))
    assert float(re.search(r"engine ([0-9.e+]+)", line).group(1)) == pytest.approx(expected, rel=1e-4)

    # --num-beams: the engine loop's beam search (every beam a row, within the profile's batch 3)
    # against eager's; no genai search here, and no end ids (the engine is checked without its folder)
    runner = _OrtAsEngine(v1_folder / "model.onnx")
    report = _engine_check(kv_engine, v1_folder, loaded, tmp_path, runner, steps=6, beams=BeamSearch(3, 2))
    assert report.passed, report.text()
    assert "beam hypotheses engine == eager: 6/6  PASS" in report.text()  # 3 prompts x 2 hypotheses
    assert "genai" not in report.text()
    assert max(call["input_ids"][0][0] for call in runner.calls) == 3  # the beams, batched
    broken = _engine_check(kv_engine, v1_folder, loaded, tmp_path, _OrtAsEngine(v1_folder / "model.onnx", True),
                           steps=6, beams=BeamSearch(3, 2))
    assert re.search(r"beam hypotheses engine == eager: [0-5]/6; worst score gap under eager .* FAIL", broken.text())


def v1_folder_model(engine):
    """The graph the engine was built from (its record names it)."""
    return json.loads(engine.with_name(engine.name + ".json").read_text())["onnx"]


def test_engine_check_of_a_decoder_refuses_before_the_gpu(kv_engine, v1_folder, v1_ckpt, tmp_path):
    # --shapes sizes single graphs: a decoder (folder or engine) would not use it, so it is refused
    for decoder in (kv_engine, v1_folder):
        assert_one_line_error(cli_main("check", decoder, "--ckpt", v1_ckpt, "--shapes", "2x9"),
                              "--shapes sizes the calls to a single graph; a KV-cache decoder is checked on 3")
    # the profile is held against the calls the check will make before anything runs
    assert_one_line_error(cli_main("check", kv_engine, "--ckpt", v1_ckpt, "--steps", "60"),
                          "past 75 is outside kv.engine's profile (batch 1..3, sequence 1..64, past 0..64)")
    assert_one_line_error(cli_main("check", kv_engine, "--ckpt", v1_ckpt, "--steps", "-1"), "--steps must be")
    assert_one_line_error(cli_main("check", v1_folder_model(kv_engine), "--ckpt", v1_ckpt, "--steps", "4"),
                          "is a single graph: use --shapes")  # --steps is not silently ignored on one graph
    if not torch.cuda.is_available():
        assert_one_line_error(cli_main("check", kv_engine, "--ckpt", v1_ckpt, "--steps", "8"), "needs an NVIDIA GPU")
    record = kv_engine.with_name("kv.engine.json")
    saved = record.read_text()
    try:
        edited = json.loads(saved)
        del edited["profile"]["max_past"]
        record.write_text(json.dumps(edited))
        assert_one_line_error(cli_main("check", kv_engine, "--ckpt", v1_ckpt), "has no valid KV-cache profile")
    finally:
        record.write_text(saved)


def test_probe_quantises_cached_calls_with_a_key_mask(v1_ckpt):
    """The eager reference of an INT8-logits decoder engine: AttentionProbe on cached, padded calls."""
    from diffexport.analysis.probe import AttentionProbe
    from diffexport.core.eager_generation import left_pad
    from diffexport.core.quantization import LogitQuant

    model = load_model(v1_ckpt).model.eval()
    ids, mask = left_pad([[5, 6, 7], [8, 9, 10, 11, 12]], pad_token_id=0)

    def two_steps(quant):
        with torch.no_grad(), AttentionProbe(model, quant=quant):
            _, past = model(ids, attention_mask=mask, past_key_values=None, use_cache=True)
            step_mask = torch.cat([mask, torch.ones(2, 1, dtype=mask.dtype)], 1)
            return model(torch.tensor([[3], [4]]), attention_mask=step_mask, past_key_values=past, use_cache=True)[0]

    with torch.no_grad():
        _, past = model(ids, attention_mask=mask, past_key_values=None, use_cache=True)
        step_mask = torch.cat([mask, torch.ones(2, 1, dtype=mask.dtype)], 1)
        plain = model(torch.tensor([[3], [4]]), attention_mask=step_mask, past_key_values=past, use_cache=True)[0]
    explicit, int8 = two_steps(LogitQuant(16)), two_steps(LogitQuant(8))
    assert torch.isfinite(int8).all()
    torch.testing.assert_close(explicit, plain, rtol=1e-5, atol=1e-5)
    # float64: in float32 the cosine of two vectors this close can round to exactly 1 (seen on an Intel Xeon)
    cosine = torch.nn.functional.cosine_similarity(int8.double().flatten(), plain.double().flatten(), dim=0)
    assert 0.99 < cosine < 1.0 and not torch.equal(int8, plain)  # quantised, and close


def test_generate_through_a_decoder_engine(kv_engine, v1_folder, monkeypatch, tmp_path):
    """`generate --backend tensorrt`: the engine's runner in the onnxruntime loop, its context bounded by the
    profile's past length (the engine stood in for by onnxruntime, as above)."""
    from diffexport.backends import tensorrt

    monkeypatch.setattr(tensorrt, "open_engine", lambda data, module, lib=None: _OrtAsEngine(v1_folder / "model.onnx"))
    runner = tensorrt.open_decoder_engine(kv_engine, v1_folder)
    assert runner.context == 65 and runner.config["model"]["eos_token_id"] == 511  # --max-past 64
    run = step_loop.generate_stepped(v1_folder, PROMPT, 100, Sampling(), runner=runner, ignore_eos=True)
    plain = step_loop.generate_stepped(v1_folder, PROMPT, 100, Sampling(), ignore_eos=True)
    assert len(run.tokens) == 65 - len(PROMPT) and run.tokens == plain.tokens[:len(run.tokens)]
    runner.max_sequence = 3  # a prompt longer than the profile's sequence goes in chunks of 3, 3 and 1
    runner._run.calls.clear()
    chunked = step_loop.generate_stepped(v1_folder, PROMPT, 20, Sampling(), runner=runner, ignore_eos=True)
    assert [c["input_ids"][0] for c in runner._run.calls[:4]] == [(1, 3), (1, 3), (1, 1), (1, 1)]
    assert runner._run.calls[2]["attention_mask"][0] == (1, 7) and chunked.tokens == plain.tokens[:20]
    monkeypatch.undo()
    assert_one_line_error(cli_main("generate", v1_folder, "--ids", "1,2", "--backend", "tensorrt"),
                          "give both --backend tensorrt and --engine")
    assert_one_line_error(cli_main("generate", v1_folder, "--ids", "1,2", "--backend", "tensorrt", "--engine",
                                  tmp_path / "missing.engine"), "missing.engine does not exist")
    (tmp_path / "bad.engine").write_bytes(b"not an engine")  # an engine without its record is refused unread
    assert_one_line_error(cli_main("generate", v1_folder, "--ids", "1,2", "--backend", "tensorrt", "--engine",
                                  tmp_path / "bad.engine"), "no bad.engine.json beside")
    other = tmp_path / "v2"
    assert cli_main("onnx", "--preset", "diff-v2-tiny", "--kv-cache", "-o", other).returncode == 0
    assert_one_line_error(cli_main("generate", other, "--ids", "1,2", "--backend", "tensorrt", "--engine", kv_engine),
                          "was built from another model than v2")
    if not torch.cuda.is_available():
        assert_one_line_error(cli_main("generate", v1_folder, "--ids", "1,2", "--backend", "tensorrt", "--engine",
                                      kv_engine), "needs an NVIDIA GPU")


def test_genai_runs_on_the_machines_cores_unless_the_folder_says(v1_folder, tmp_path, monkeypatch):
    """onnxruntime-genai's default is one intra-op thread: a folder without --threads is opened with
    this machine's physical cores (overlaid, the folder not edited); a folder's own count is kept."""
    pytest.importorskip("onnxruntime_genai")
    og = genai.import_genai()
    overlays = []

    class RecordingConfig(og.Config):
        def overlay(self, text):
            overlays.append(json.loads(text))
            return super().overlay(text)

    monkeypatch.setattr(genai, "import_genai", lambda: type("og", (), {"Config": RecordingConfig,
                                                                          "Model": og.Model})())
    assert base.machine_threads() >= 1
    genai.open_genai_model(v1_folder)
    assert overlays == [{"model": {"decoder": {"session_options": {
        "intra_op_num_threads": base.machine_threads()}}}}]
    own = tmp_path / "own"
    shutil.copytree(v1_folder, own)
    config = json.loads((own / "genai_config.json").read_text())
    config["model"]["decoder"]["session_options"]["intra_op_num_threads"] = 1
    (own / "genai_config.json").write_text(json.dumps(config))
    overlays.clear()
    genai.open_genai_model(own)
    assert overlays == [] and json.loads((own / "genai_config.json").read_text()) == config


def test_generate_threads_overrides_the_folder(v1_folder, tmp_path):
    """`generate --threads N` (issue 46 j): genai and the onnxruntime loop run on N intra-op threads
    whatever the folder says, seen in the threads the process starts; out of range is one line."""
    pytest.importorskip("onnxruntime_genai")

    def threads_started(open_model) -> int:
        before = int(next(line for line in open("/proc/self/status") if line.startswith("Threads:")).split()[1])
        held = open_model()
        after = int(next(line for line in open("/proc/self/status") if line.startswith("Threads:")).split()[1])
        del held
        return after - before

    own = tmp_path / "own"
    shutil.copytree(v1_folder, own)
    config = json.loads((own / "genai_config.json").read_text())
    config["model"]["decoder"]["session_options"]["intra_op_num_threads"] = 1
    (own / "genai_config.json").write_text(json.dumps(config))
    folder_says = threads_started(lambda: genai.open_genai_model(own))
    with base.intra_op_threads(6):
        user_says = threads_started(lambda: genai.open_genai_model(own))
        loop = step_loop.OrtDecoder(own)
    assert user_says >= folder_says + 5, (folder_says, user_says)
    assert loop.session.get_session_options().intra_op_num_threads == 6
    assert base.INTRA_OP_THREADS.get() is None  # only within
    result = cli_main("generate", own, "--ids", "1,2,3", "--max-new-tokens", "2", "--threads", "3")
    assert result.returncode == 0, result.stderr
    assert_one_line_error(cli_main("generate", own, "--ids", "1,2", "--threads", "0"), "--threads must be 1 to 1024, got 0")


def test_special_ids_outside_the_vocabulary_are_refused_at_export(artifacts, tmp_path):
    """A checkpoint folder whose generation_config.json names an eos (or pad, bos) id the model has
    no logit for: generation could never stop there, and the folder's reader would refuse it, so
    the export says so in one line and writes nothing (issue 43)."""
    source = tmp_path / "hf"
    shutil.copytree(artifacts.hf_diffllama(), source)
    (source / "generation_config.json").write_text(json.dumps({"eos_token_id": [2, 99_999], "pad_token_id": 0}))
    result = cli_main("onnx", source, "--kv-cache", "-o", tmp_path / "kv")
    assert_one_line_error(result, "eos_token_id 99999 (from the checkpoint's or tokenizer's generation_config.json")
    assert "vocabulary of 320 ids" in result.stderr and not (tmp_path / "kv").exists()
