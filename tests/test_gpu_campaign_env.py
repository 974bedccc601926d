"""The GPU campaign (tools/gpu_campaign.sh) runs on the lent GPU machine's image, which has torch,
numpy, onnx, onnxruntime and pytest but none of the optional extras (../shared/design/ENVIRONMENT.md),
and every minute there is scarce. A module-level import of an extra in anything the campaign reaches
would stop its whole pytest call at collection, or a tool at start-up, and cost a GPU session its
run. Here, on the CPU, the campaign's entry points run with those packages made unimportable in
every process: its GPU test files collect, and the command lines its tests and parts launch start
(on the CPU device where they take one)."""

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parent.parent
CAMPAIGN = ROOT / "tools" / "gpu_campaign.sh"

# Not on the GPU machine's image (its list in ENVIRONMENT.md): what the extras would bring, and
# safetensors, a dependency of the package that the campaign never installs (it runs the checkout).
ABSENT = ("onnxscript", "onnx_ir", "onnxruntime_genai", "polygraphy", "onnx_graphsurgeon", "transformers",
          "safetensors", "matplotlib", "tensorrt", "tensorrt_rtx", "modelopt", "flash_attn")

# None in sys.modules is how Python spells "absent": `import` raises ModuleNotFoundError and
# importlib.util.find_spec returns None, as for a package that is not installed.
BLOCKER = f"""
import sys
for _name in {ABSENT!r}:
    sys.modules[_name] = None
"""


@pytest.fixture(scope="module")
def image_env(tmp_path_factory):
    """An environment whose Python processes, children included, cannot import ABSENT (a
    sitecustomize on PYTHONPATH), with the repository importable as the campaign has it (no install)."""
    site = tmp_path_factory.mktemp("gpu-image")
    (site / "sitecustomize.py").write_text(BLOCKER)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(site), str(ROOT)]), PYTHONDONTWRITEBYTECODE="1")
    env.pop("DIFFEXPORT_KERNEL_PATH", None)
    probe = subprocess.run([sys.executable, "-c", "import onnxscript"], env=env, capture_output=True, text=True)
    assert probe.returncode != 0 and "ModuleNotFoundError" in probe.stderr, probe.stderr  # the blocker holds
    return env


def run(env, *argv, timeout=300):
    return subprocess.run([sys.executable, *map(str, argv)], env=env, cwd=ROOT, capture_output=True, text=True,
                          timeout=timeout, stdin=subprocess.DEVNULL)


def campaign_test_files() -> list[str]:
    """The test files part_test of the campaign hands to pytest (read from the script: one list)."""
    body = re.search(r"part_test\(\) \{(.*?)\n\}", CAMPAIGN.read_text(), re.S).group(1)
    files = sorted(set(re.findall(r"tests/test_\w+\.py", body)))
    assert files and all((ROOT / f).is_file() for f in files), files
    return files


def test_the_campaign_gpu_tests_collect_without_the_extras(image_env):
    files = campaign_test_files()
    out = run(image_env, "-m", "pytest", "-p", "no:cacheprovider", "-q", "--collect-only", "-m", "gpu", *files,
              "tests/kernel_cases.py")
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    collected = re.search(r"(\d+)/\d+ tests collected|(\d+) tests collected", out.stdout)
    assert collected and int(collected.group(1) or collected.group(2)) > 100, out.stdout[-500:]


def test_the_campaign_command_lines_start_without_the_extras(image_env, tmp_path):
    # The parts' own programs: their argument parsing and imports (no GPU here to go further).
    for argv in (["tools/bench_attention.py", "--help"], ["tools/train_tiny.py", "--help"],
                 ["-m", "diffexport", "kernels"]):
        out = run(image_env, *argv)
        assert out.returncode == 0, (argv, out.stderr[-2000:])
    probe = run(image_env, "-m", "diffexport.kernel.kernel_probe", "hopper")  # prints a verdict, never a traceback
    assert "Traceback" not in probe.stderr and probe.stdout.strip(), probe.stderr[-2000:]

    # What the GPU tests launch as subprocesses, on the CPU: analysis commands, a short training
    # run and the sweep of its checkpoint (tests/test_reference_gpu.py, tests/test_kernel_gpu.py).
    stats = run(image_env, "-m", "diffexport", "stats", "--tokens", "256", "--seq-len", "64", "--json",
                "--device", "cpu")
    assert stats.returncode == 0, stats.stderr[-2000:]
    assert json.loads(stats.stdout)["diff-v1-tiny"]["attention_logits"]["overall"]["top1"] > 0
    train = run(image_env, "tools/train_tiny.py", "--out-dir", tmp_path, "--steps", "4", "--log-every", "2",
                "--head-dim", "64", "--device", "cpu", "--only", "diff")
    assert train.returncode == 0, train.stderr[-2000:]
    sweep = run(image_env, "-m", "diffexport", "quant-sweep", tmp_path / "diff.pt", "--bits", "8", "--tokens", "256",
                "--samples", "2", "--device", "cpu", "--attention", "reference", "--json")
    assert sweep.returncode == 0, sweep.stderr[-2000:]
    assert json.loads(sweep.stdout)["models"]["diff"], sweep.stdout[-500:]


def test_child_processes_of_the_tests_import_this_checkout_uninstalled(tmp_path):
    """The GPU machine runs the checkout uninstalled: a test's child process (a tools/ script, or
    `-m diffexport` from another folder) finds the package through helpers.checkout_env alone.
    `python -S` leaves out site-packages, where this machine's editable install lives."""
    from helpers import checkout_env

    probe = [sys.executable, "-S", "-c", "import diffexport; print(diffexport.__file__)"]
    bare = subprocess.run(probe, capture_output=True, text=True, cwd=tmp_path, timeout=60,
                          env={k: v for k, v in checkout_env().items() if k != "PYTHONPATH"})
    assert bare.returncode != 0 and "No module named 'diffexport'" in bare.stderr
    found = subprocess.run(probe, capture_output=True, text=True, cwd=tmp_path, timeout=60, env=checkout_env())
    assert found.returncode == 0, found.stderr
    assert Path(found.stdout.strip()).resolve() == (ROOT / "diffexport" / "__init__.py").resolve()
