"""`diffexport check FOLDER`: a KV-cache decoder folder against the eager model (and transformers for
Hugging Face checkpoints), step by step with its cache: passing folders, corrupted weights that
fail, a user's text scored through the cache, quantised folders within their budget, RoPE scaling."""


import json
import re
import shutil

import numpy as np
import pytest
import torch

onnx = pytest.importorskip("onnx")
pytest.importorskip("onnxruntime")

from decoder_helpers import text_perplexity  # noqa: E402
from helpers import (  # noqa: E402
    assert_one_line_error,
    cli_main,
    quiet,
    run_printed_polygraphy,
)

from diffexport.backends import step_loop  # noqa: E402
from diffexport.modeling.checkpoint import load_model  # noqa: E402
from diffexport.validation.decoder import run_decoder_check  # noqa: E402
from diffexport.validation.options import CheckOptions  # noqa: E402

pytestmark = pytest.mark.slow  # exports, emulation or training: see README (quick loop)




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
    expected, count = text_perplexity(loaded.model.eval(), ids, 1024)
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
    # HF's 8 maps over 4 kv heads: GQA's 8 maps of 16 over 4 kv heads, HF's own layout (K1s, then K2s)
    assert (config["num_key_value_heads"], config["head_size"]) == (4, 16)
    report = cli_main("check", kv, "--ckpt", hf_dir, "--save-dir", tmp_path / "saved")
    assert report.returncode == 0, report.stdout + report.stderr
    assert "transformers" in report.stdout
    text = cli_main("generate", kv, "--prompt", "the cat sat", "--max-new-tokens", "8")
    assert text.returncode == 0 and text.stdout.strip(), text.stderr


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
                                   num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                                   max_position_embeddings=256)
    transformers.LlamaForCausalLM(cfg).eval().save_pretrained(tmp_path / "llama")
    assert cli_main("onnx", tmp_path / "llama", "--kv-cache", "-o", tmp_path / "kv").returncode == 0
    assert json.loads((tmp_path / "kv" / "genai_config.json").read_text())["model"]["context_length"] == 256
    report = cli_main("check", tmp_path / "kv", "--ckpt", tmp_path / "llama")
    assert report.returncode == 0, report.stdout + report.stderr
    assert "transformers generate() == eager" in report.stdout


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
