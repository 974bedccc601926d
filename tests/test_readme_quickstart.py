"""README.md's Quick start, run as written there (parsed from the file, so the two cannot drift),
in an empty folder with the network switched off for Hugging Face: every line must succeed, and
the generate line must print what transformers' own greedy generate gives for that prompt."""

from __future__ import annotations

import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest
from helpers import checkout_env

ROOT = Path(__file__).resolve().parent.parent
pytestmark = pytest.mark.slow


def quickstart_lines() -> list[str]:
    text = (ROOT / "README.md").read_text()
    section = text.split("## Quick start", 1)[1].split("\n## ", 1)[0]
    block = re.search(r"```\n(.*?)```", section, re.S)
    assert block, "README.md's Quick start has no code block"
    return [line for line in block.group(1).splitlines() if line.strip()]


def test_quickstart_walks_the_whole_way(tmp_path):
    transformers = pytest.importorskip("transformers")
    import torch

    env = checkout_env()
    env.update(HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1")  # a fresh machine with no network
    lines = quickstart_lines()
    assert [shlex.split(line, comments=True)[:2] for line in lines][:3] == [
        ["diffexport", "presets"], ["diffexport", "onnx"], ["diffexport", "generate"]]
    outputs = {}
    for line in lines:
        args = shlex.split(line, comments=True)
        assert args[0] == "diffexport"
        out = subprocess.run([sys.executable, "-m", "diffexport", *args[1:]], cwd=tmp_path, env=env,
                             capture_output=True, text=True, timeout=600)
        assert out.returncode == 0, f"{line}\n{out.stdout[-2000:]}\n{out.stderr[-2000:]}"
        outputs[args[1], len(outputs)] = out

    generate_line = next(line for line in lines if line.startswith("diffexport generate"))
    args = shlex.split(generate_line, comments=True)
    prompt, new_tokens = args[args.index("--prompt") + 1], int(args[args.index("--max-new-tokens") + 1])
    printed = next(out for (command, _), out in outputs.items() if command == "generate").stdout
    # transformers' own greedy continuation of the prompt, from the folder the first line wrote
    folder = tmp_path / shlex.split(lines[0], comments=True)[-1]
    tokenizer = transformers.AutoTokenizer.from_pretrained(folder)
    model = transformers.AutoModelForCausalLM.from_pretrained(folder).eval()
    ids = tokenizer(prompt, return_tensors="pt").input_ids
    with torch.no_grad():
        expected = model.generate(ids, max_new_tokens=new_tokens, do_sample=False)[0, ids.shape[1]:]
    expected_text = tokenizer.decode(expected, skip_special_tokens=True)
    assert len(expected_text.strip()) >= 20, f"the trained model gives hardly any text: {expected_text!r}"
    assert printed.strip() == expected_text.strip(), (printed, expected_text)
    assert (tmp_path / "kv-int4.report.html").is_file()
    checks = [out.stdout for (command, _), out in outputs.items() if command == "check"]
    assert len(checks) == 2 and all("result        PASS" in text for text in checks)
