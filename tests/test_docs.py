"""The documentation's code runs: every Python block of docs/API.md in order (one namespace,
one folder), and the Hugging Face recipe of docs/PASSES.md followed by the commands it gives."""

import os
import re
from pathlib import Path

import pytest

from helpers import run_cli

pytestmark = pytest.mark.slow  # exports, emulation or training: see README (quick loop)

DOCS = Path(__file__).resolve().parent.parent / "docs"


def python_blocks(page: str) -> list[str]:
    path = DOCS.parent / page if page == "README.md" else DOCS / page
    return re.findall(r"```python\n(.*?)```", path.read_text(), re.S)


def run_blocks(blocks: list[str], folder: Path, replace: dict[str, str] | None = None) -> dict:
    namespace: dict = {"__name__": "__doc_example__"}
    cwd = os.getcwd()
    os.chdir(folder)
    try:
        for block in blocks:
            for old, new in (replace or {}).items():
                block = block.replace(old, new)
            exec(compile(block, "<docs example>", "exec"), namespace)
    finally:
        os.chdir(cwd)
    return namespace


def test_api_page_examples_run(tmp_path):
    blocks = python_blocks("API.md")
    assert len(blocks) >= 5
    ns = run_blocks(blocks, tmp_path)
    assert ns["report"].passed and ns["decode_report"].passed and ns["result"].report.total == 2
    assert (tmp_path / "model.onnx").is_file() and (tmp_path / "model-kv" / "genai_config.json").is_file()


def test_hf_torch_onnx_recipe_then_optimize_and_check(tmp_path):
    transformers = pytest.importorskip("transformers")
    import torch

    torch.manual_seed(0)
    cfg = transformers.DiffLlamaConfig(vocab_size=96, hidden_size=64, intermediate_size=112, num_hidden_layers=2,
                                       num_attention_heads=4, num_key_value_heads=2, head_dim=16)
    transformers.DiffLlamaForCausalLM(cfg).save_pretrained(tmp_path / "hf")
    (recipe,) = python_blocks("PASSES.md")
    run_blocks([recipe], tmp_path, {'"path/to/your-diffllama"': repr(str(tmp_path / "hf"))})
    fused = run_cli("optimize", tmp_path / "diffllama.onnx", "-o", tmp_path / "diffllama-fused.onnx",
                    "--expect-fused", "2")
    assert fused.returncode == 0, fused.stderr
    checked = run_cli("check", tmp_path / "diffllama-fused.onnx", "--against", tmp_path / "diffllama.onnx")
    assert checked.returncode == 0 and "PASS" in checked.stdout, checked.stdout + checked.stderr


def test_readme_api_example_runs(tmp_path):
    (block,) = python_blocks("README.md")
    ns = run_blocks([block], tmp_path)
    assert ns["report"].passed and (tmp_path / "model.onnx").is_file()
