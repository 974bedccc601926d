"""The zoo's trained text model (diff-text-tiny) and what makes it: Hugging Face folders written
from our models (layouts.hf_export), train_tiny.py --bpe-vocab, the weight preset and
`diffexport presets NAME -o DIR`."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from helpers import assert_one_line_error, cli_main

from diffexport.core.errors import DiffExportError
from diffexport.modeling.checkpoint import load_model, save_hf_folder
from diffexport.modeling.families import DiffV1Config, baseline_for, build_model, config_from_dict
from diffexport.modeling.presets import get_preset, preset_weights

ROOT = Path(__file__).resolve().parent.parent
TEXT_PRESET = "diff-text-tiny"


def _perturbed(cfg, seed: int):
    """A model whose every weight differs from its init (lambdas and norms included): a reordering
    mistake in the writer cannot hide behind zeros or ones."""
    model = build_model(cfg, seed=seed).eval()
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.05 * torch.randn(p.shape, generator=generator))
    return model


@pytest.mark.parametrize("tied", [True, False])
def test_hf_folder_written_from_our_model_is_what_transformers_computes(tmp_path, tied):
    transformers = pytest.importorskip("transformers")
    cfg = DiffV1Config(vocab_size=97, d_model=96, n_layers=3, ffn_hidden=160, n_heads=3, n_kv_heads=1, head_dim=16,
                       head_norm_affine=False, tie_embeddings=tied)
    for config in (cfg, baseline_for(cfg)):
        model = _perturbed(config, seed=5)
        folder = save_hf_folder(model, tmp_path / f"{config.family}-{tied}", max_position_embeddings=128)
        hf = transformers.AutoModelForCausalLM.from_pretrained(folder).eval()
        ids = torch.randint(0, 97, (2, 19), generator=torch.Generator().manual_seed(1))
        with torch.no_grad():
            ours, theirs, reloaded = model(ids), hf(ids).logits, load_model(folder).model(ids)
        assert torch.allclose(ours, theirs, atol=2e-5, rtol=0), (ours - theirs).abs().max()
        assert torch.equal(ours, reloaded)  # the import reads back exactly what was written


@pytest.mark.parametrize("change, words", [
    (dict(head_norm_affine=True), "an affine head norm"),
    (dict(lambda_init=0.5), "a constant lambda_init"),
    (dict(head_norm_eps=1e-3), "a head-norm eps"),
])
def test_hf_folder_refuses_what_diffllama_cannot_say(tmp_path, change, words):
    cfg = DiffV1Config(vocab_size=32, d_model=32, n_layers=1, n_heads=1, head_dim=16, **change)
    with pytest.raises(DiffExportError, match=words):
        save_hf_folder(build_model(cfg), tmp_path / "out")
    assert not (tmp_path / "out").exists()


def test_the_text_preset_is_a_trained_diffllama_with_tokenizer_and_chat_template():
    folder = preset_weights(TEXT_PRESET)
    names = {p.name for p in folder.iterdir()}
    assert {"config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json", "chat_template.jinja",
            "generation_config.json"} <= names
    loaded = load_model(preset=TEXT_PRESET)
    assert loaded.source == "hf-diffllama" and Path(loaded.path) == folder
    entry = get_preset(TEXT_PRESET)  # the JSON's config is the folder's, so `presets` and match_preset agree
    assert config_from_dict(entry["family"], entry["config"]) == loaded.config
    assert not torch.equal(loaded.model.embed.weight, build_model(loaded.config, seed=0).embed.weight)
    assert sum(p.stat().st_size for p in folder.iterdir()) < 8_000_000  # small enough to ship in the wheel


def test_presets_writes_the_trained_folder_and_refuses_what_it_cannot(tmp_path):
    out = tmp_path / "tiny"
    result = cli_main("presets", TEXT_PRESET, "-o", out)
    assert result.returncode == 0, result.stderr
    source = preset_weights(TEXT_PRESET)
    assert sorted(p.name for p in out.iterdir()) == sorted(p.name for p in source.iterdir())
    assert all((out / p.name).read_bytes() == p.read_bytes() for p in source.iterdir())
    assert_one_line_error(cli_main("presets", TEXT_PRESET, "-o", out), "exists")  # nothing replaced without --force
    assert cli_main("presets", TEXT_PRESET, "-o", out, "--force").returncode == 0
    assert_one_line_error(cli_main("presets", "diff-v1-tiny", "-o", tmp_path / "random"), "has no trained weights")
    assert not (tmp_path / "random").exists()
    assert_one_line_error(cli_main("presets", TEXT_PRESET), "give both the preset and the folder")
    assert_one_line_error(cli_main("presets", "no-such-preset", "-o", tmp_path / "x"),
                          "unknown preset 'no-such-preset'")
    # a link at the output's name is never written through, even with --force; the target stays as it was
    victim = tmp_path / "victim"
    victim.mkdir()
    (tmp_path / "link").symlink_to(victim)
    for extra in ((), ("--force",)):
        assert_one_line_error(cli_main("presets", TEXT_PRESET, "-o", tmp_path / "link", *extra), "symbolic link")
    assert list(victim.iterdir()) == []
    listing = cli_main("presets")
    assert f"{TEXT_PRESET:18s} diff_v1      trained" in listing.stdout


@pytest.mark.slow
def test_train_tiny_bpe_writes_hf_folders_scored_in_bits_per_byte(tmp_path):
    """--bpe-vocab: a byte-level BPE learnt on the training part, the pair written as DiffLlama and
    Llama folders that transformers and diffexport load alike, held-out bits per byte that a fresh
    computation over the same windows reproduces."""
    transformers = pytest.importorskip("transformers")
    corpus = tmp_path / "corpus.txt"
    corpus.write_text((ROOT / "docs" / "ARCHITECTURE.md").read_text(encoding="utf-8"), encoding="utf-8")
    out = tmp_path / "run"
    cmd = [sys.executable, str(ROOT / "tools" / "train_tiny.py"), "--text", str(corpus), "--bpe-vocab", "320",
           "--size", "text", "--context", "32", "--steps", "20", "--batch", "4", "--log-every", "20",
           "--out-dir", str(out)]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr
    report = json.loads((out / "train_log.json").read_text())["models"]
    for name, model_type in (("diff", "diffllama"), ("transformer", "llama")):
        folder = out / name
        assert json.loads((folder / "config.json").read_text())["model_type"] == model_type
        tokenizer = transformers.AutoTokenizer.from_pretrained(folder)
        held = (out / "heldout.txt").read_text(encoding="utf-8")
        ids = torch.tensor(tokenizer(held).input_ids)
        n = min(256, (len(ids) - 1) // 32)
        targets = ids[1: n * 32 + 1]
        with torch.no_grad():
            logits = transformers.AutoModelForCausalLM.from_pretrained(folder).eval()(ids[: n * 32].view(n, 32)).logits
            nats = torch.nn.functional.cross_entropy(logits.flatten(0, 1).double(), targets, reduction="sum")
        scored = sum(len(tokenizer.convert_ids_to_tokens(int(t))) for t in targets)  # byte-level: a char a byte
        bits = nats.item() / scored / torch.log(torch.tensor(2.0)).item()
        assert abs(bits - report[name]["heldout_bits_per_byte"]) < 1e-3, (bits, report[name])
        assert tokenizer.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False,
                                             add_generation_prompt=True) == "# user: hi\n# assistant:\n"
    spec = importlib.util.spec_from_file_location("train_tiny", ROOT / "tools" / "train_tiny.py")
    train_tiny = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(train_tiny)
    for args in (["--bpe-vocab", "200", "--text", str(corpus)], ["--bpe-vocab", "400"]):  # too few ids; no --text
        with pytest.raises(SystemExit) as exit_:
            train_tiny.main([*args, "--out-dir", str(tmp_path / "never")])
        assert exit_.value.code == 2
    assert not (tmp_path / "never").exists()


def test_the_trained_preset_is_not_called_random_by_the_analysis_tools():
    both = cli_main("stats", "--preset", TEXT_PRESET, "--preset", "diff-v1-tiny", "--tokens", "256", "--seq-len", "64")
    assert both.returncode == 0, both.stderr
    notes = [line for line in both.stderr.splitlines() if line.startswith("note: ")]
    assert len(notes) == 1 and "preset diff-v1-tiny with random weights" in notes[0] and TEXT_PRESET not in notes[0]
    alone = cli_main("stats", "--preset", TEXT_PRESET, "--tokens", "256", "--seq-len", "64")
    assert alone.returncode == 0 and "random weights" not in alone.stderr
