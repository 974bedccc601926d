"""The documentation's code runs: every Python block of every page (the pages and their tests are
listed in PAGES, and a test fails on a page with Python that is not there): docs/API.md in order
(one namespace, one folder), the Hugging Face recipe of docs/PASSES.md followed by the commands it
gives, the README's example and docs/EXPORT.md's decoder example."""

import os
import re
import subprocess
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


def test_export_page_decoder_example_runs(tmp_path):
    """docs/EXPORT.md's "From Python" block as written, on a saved preset checkpoint as its ckpt.pt."""
    from diffexport.modeling.checkpoint import load_model, save_checkpoint

    save_checkpoint(load_model(None, preset="diff-v1-tiny").model, tmp_path / "ckpt.pt")
    (block,) = python_blocks("EXPORT.md")
    ns = run_blocks([block], tmp_path)
    assert ns["report"].passed and ns["same"] and (tmp_path / "model-kv" / "genai_config.json").is_file()


# Each page with Python blocks, and the test above that runs them.
PAGES = {"README.md": test_readme_api_example_runs, "docs/API.md": test_api_page_examples_run,
         "docs/PASSES.md": test_hf_torch_onnx_recipe_then_optimize_and_check,
         "docs/EXPORT.md": test_export_page_decoder_example_runs}


def project_pages(root: Path) -> list[Path]:
    """The project's Markdown pages: what git tracks or would track. Ignored folders hold what
    commands wrote (the demo's model card, build trees, campaign output), not pages we keep."""
    listed = subprocess.run(["git", "ls-files", "-co", "--exclude-standard", "--", "*.md"], cwd=root,
                            capture_output=True, text=True)
    if listed.returncode == 0:
        return [root / line for line in listed.stdout.splitlines() if (root / line).is_file()]
    return [path for path in root.rglob("*.md")  # not a git checkout (an unpacked sdist)
            if not path.relative_to(root).parts[0].startswith((".", "build", "diffexport-demo"))
            and "campaign" not in path.parts]


def test_every_page_with_python_is_run():
    root = DOCS.parent
    pages = {path.relative_to(root).as_posix() for path in project_pages(root)
             if "```python" in path.read_text(errors="replace")}
    assert pages <= set(PAGES), f"pages with Python blocks no test runs: {sorted(pages - set(PAGES))}"



def test_deployment_build_installs_the_cutlass_headers_before_cmake():
    """docs/DEPLOYMENT.md's build of the native libraries: without the kernels extra (CUTLASS/CuTe
    headers) CMake leaves the Hopper path out, so the block installs it before the first cmake."""
    text = (DOCS / "DEPLOYMENT.md").read_text()
    block = re.search(r"## 1\. Build the native libraries[^\n]*\n+```\n(.*?)```", text, re.S).group(1)
    commands = [line.strip() for line in block.splitlines() if line.strip() and not line.startswith("#")]
    kernels = next(i for i, c in enumerate(commands) if c.startswith("pip install") and '".[kernels]"' in c)
    assert kernels < next(i for i, c in enumerate(commands) if c.startswith("cmake"))
