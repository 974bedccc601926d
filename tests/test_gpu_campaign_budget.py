"""The GPU campaign's time budget (tools/gpu_campaign.sh --budget), checked on the CPU.

A lent GPU machine gives a session 15 minutes of device time, start-up included, so the campaign
goes in one call under --budget: each group of parts must end early enough to leave the later
groups their reserve, a step that hangs is stopped at its clipped limit, and a part left with no
time is reported and counted, never passed. Here the GPU-side programs are stand-ins on PATH (and
PYTHON) that record their calls and sleep or hang on request; the script under test is the real one,
with the real `timeout`. What runs on the GPU itself is tests/test_gpu_campaign_env.py's concern."""

import json
import lzma
import os
import re
import shutil
import subprocess
import sys
import tarfile
import time
from pathlib import Path

import pytest
import torch
from tool_main import run_tool, tool_module

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parent.parent
CAMPAIGN = ROOT / "tools" / "gpu_campaign.sh"

# Stand-ins: each records its argv in $STUB_LOG. PYTHON's hangs when its argv holds $STUB_HANG
# (SIGINT ends it, as it ends pytest), and its kernel probe answers $STUB_PROBE, or fails where
# $DIFFEXPORT_KERNEL_LIB holds $STUB_BAD_LIB; nvidia-smi sleeps $STUB_SMI_SLEEP seconds and
# compute-sanitizer $STUB_SANITIZER_SLEEP, then records that it ended. STUB_LOG_LIB: each tool's line also
# records the kernel library its environment names. STUB_REAL_PYTHON: campaign_report.py --fastest-kv8
# runs for real, on what the test left in the output folder.
PYTHON_STUB = """#!/usr/bin/env bash
echo "python $*" >> "$STUB_LOG"
if [[ -n "${STUB_HANG:-}" && " $* " == *"$STUB_HANG"* ]]; then sleep 1000; exit 0; fi
case " $* " in
  *" -m diffexport.kernel.kernel_probe "*)
    if [[ -n "${STUB_BAD_LIB:-}" && "$DIFFEXPORT_KERNEL_LIB" == *"$STUB_BAD_LIB"* ]]; then
      echo "failed: stand-in disagrees"
    else echo "${STUB_PROBE:-unavailable: stand-in}"; fi ;;
  *" -m diffexport kernels --check "*) echo "result: ok" ;;
  *" -m pytest "*) echo "1 passed in 0.01s" ;;
  *" tools/campaign_report.py --fastest-kv8 "*) [[ -n "${STUB_REAL_PYTHON:-}" ]] && exec "$STUB_REAL_PYTHON" "$@"
    echo "stand-in python" ;;
  *) cat > /dev/null 2>&1 < /dev/null; echo "stand-in python" ;;
esac
"""
TOOL_STUB = """#!/usr/bin/env bash
echo "$(basename "$0") $*${STUB_LOG_LIB:+ lib=$DIFFEXPORT_KERNEL_LIB}" >> "$STUB_LOG"
[[ "$(basename "$0")" == nvidia-smi ]] && sleep "${STUB_SMI_SLEEP:-0}"
if [[ "$(basename "$0")" == compute-sanitizer ]]; then
  sleep "${STUB_SANITIZER_SLEEP:-0}"; echo "$(basename "$0") $* ended" >> "$STUB_LOG"
  echo "========= ERROR SUMMARY: 0 errors"
fi
exit 0
"""
TOOLS = ("nvidia-smi", "nvcc", "cmake", "cuobjdump", "compute-sanitizer", "ncu")
# Reserves for seconds-long runs (the real ones are minutes, RESERVE in the script), each still
# above its steps' kill grace + 5 s (pytest 20, bench and decode 15, build, ncu and sanitizers 10), as the
# script's must be: a reserve below that leaves a step nothing, whatever the budget.
RESERVES = "env=1 build=18 variants=0 test=27 sanitize=17 bench=22 decode=22 profile=17"


@pytest.fixture
def stubs(tmp_path):
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    for name in TOOLS:
        (bin_dir / name).write_text(TOOL_STUB)
    (bin_dir / "python-stub").write_text(PYTHON_STUB)
    for path in bin_dir.iterdir():
        path.chmod(0o755)
    library = tmp_path / "build" / "plugins" / "kernels" / "libdiffexport_kernels.so"  # the build's own
    library.parent.mkdir(parents=True)
    library.write_bytes(b"")
    env = dict(os.environ, PATH=f"{bin_dir}:{os.environ['PATH']}", PYTHON=str(bin_dir / "python-stub"),
               STUB_LOG=str(tmp_path / "calls.log"), DIFFEXPORT_KERNEL_LIB=str(library),
               CAMPAIGN_BUILD_DIR=str(tmp_path / "build"), CAMPAIGN_RESERVE=RESERVES,
               CAMPAIGN_UNPACK_LIBRARIES="0")  # this checkout's packed carried builds stay as they are
    for name in ("CAMPAIGN_BUDGET", "CAMPAIGN_COMPARE", "CAMPAIGN_DECODE_COMPARE", "CAMPAIGN_VARIANTS",
                 "DIFFEXPORT_PROBE_HOPPER",
                 "DIFFEXPORT_PROBE_HOPPER_INT8", "OUT"):
        env.pop(name, None)
    return env, tmp_path


def campaign(env, tmp_path, *argv, timeout=120):
    out = tmp_path / "out"
    start = time.monotonic()
    proc = subprocess.run(["bash", str(CAMPAIGN), "--out", str(out), *argv], env=env, cwd=ROOT,
                          capture_output=True, text=True, timeout=timeout, stdin=subprocess.DEVNULL)
    log = (out / "campaign.log").read_text() if (out / "campaign.log").exists() else ""
    return proc, log, out, time.monotonic() - start


def verdicts(log: str) -> dict[str, str]:
    return dict(re.findall(r"part (\w+) (ok|FAILED|SKIPPED)", log))


def test_a_hanging_test_part_is_stopped_in_time_and_the_later_parts_still_run(stubs):
    env, tmp_path = stubs
    env["STUB_HANG"] = "-m pytest"
    proc, log, out, wall = campaign(env, tmp_path, "--budget", "95", "env", "build", "test+sanitize", "bench",
                                    "decode", "profile")
    # test+sanitize must end by 95 - (22 + 22 + 17) = 34 s; pytest gets what is left less its 20 s grace.
    assert verdicts(log) == {"env": "ok", "build": "ok", "test": "FAILED", "sanitize": "ok", "bench": "ok",
                             "decode": "ok", "profile": "ok"}, log
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert wall < 34, wall
    assert re.search(r"pytest: stopped at its time limit of \d+ s", (out / "pytest.log").read_text())
    calls = (tmp_path / "calls.log").read_text()
    assert "tools/bench_attention.py --json" in calls and "tools/bench_attention.py --decode" in calls
    assert re.search(r"budget: 95 s .*\n(.*\n)*.*done: 1 part\(s\) failed in \d+ s of a 95 s budget", log), log


def test_a_decode_only_build_is_timed_in_decode_alone(stubs):
    """CAMPAIGN_DECODE_COMPARE: a build that differs in the decode kernels only (its prefill would be
    this build's code timed again) joins the decode bench's --compare, not the prefill bench's."""
    env, tmp_path = stubs
    env["CAMPAIGN_COMPARE"] = "before=/carried/before.so"
    env["CAMPAIGN_DECODE_COMPARE"] = "kvtiles1=/carried/kvtiles1.so"
    proc, log, _, _ = campaign(env, tmp_path, "bench", "decode")
    assert verdicts(log) == {"bench": "ok", "decode": "ok"}, log
    calls = (tmp_path / "calls.log").read_text().splitlines()
    bench = [c for c in calls if "tools/bench_attention.py --json" in c]
    decode = [c for c in calls if "tools/bench_attention.py --decode" in c]
    assert len(bench) == 1 and len(decode) == 1, calls
    assert "--compare before=/carried/before.so" in bench[0] and "kvtiles1" not in bench[0]
    assert "--compare before=/carried/before.so kvtiles1=/carried/kvtiles1.so" in decode[0]


def test_the_packed_cutlass_headers_are_unpacked_once_whole_or_refused(stubs):
    """build-carry/cutlass-include.tar.xz (how tools/prepare_gpu_campaign.sh carries the headers)
    becomes build-cutlass/include before the first part; an archive without the headers is one
    error line, exit 2, and leaves no build-cutlass behind. (A copy of the script in a scratch
    checkout: it works on the folder above its own.)"""
    env, tmp_path = stubs
    checkout = tmp_path / "checkout"
    (checkout / "tools").mkdir(parents=True)
    (checkout / "tools" / "gpu_campaign.sh").write_text(CAMPAIGN.read_text())
    (checkout / "build-carry").mkdir()
    headers = tmp_path / "headers" / "include" / "cute"
    headers.mkdir(parents=True)
    (headers / "tensor.hpp").write_text("// stand-in\n")
    with tarfile.open(checkout / "build-carry" / "cutlass-include.tar.xz", "w:xz") as tar:
        tar.add(tmp_path / "headers" / "include", arcname="include")
    run = subprocess.run(["bash", str(checkout / "tools" / "gpu_campaign.sh"), "--out", str(tmp_path / "out"), "env"],
                         env=env, capture_output=True, text=True, timeout=60, stdin=subprocess.DEVNULL)
    assert run.returncode == 0, run.stdout + run.stderr
    assert (checkout / "build-cutlass" / "include" / "cute" / "tensor.hpp").read_text() == "// stand-in\n"
    assert [p.name for p in checkout.iterdir() if p.name.startswith("build-cutlass")] == ["build-cutlass"]
    # Not the headers: refused before any part, nothing left.
    shutil.rmtree(checkout / "build-cutlass")
    with tarfile.open(checkout / "build-carry" / "cutlass-include.tar.xz", "w:xz") as tar:
        tar.add(tmp_path / "headers" / "include" / "cute" / "tensor.hpp", arcname="README")
    run = subprocess.run(["bash", str(checkout / "tools" / "gpu_campaign.sh"), "--out", str(tmp_path / "out2"), "env"],
                         env=env, capture_output=True, text=True, timeout=60, stdin=subprocess.DEVNULL)
    assert run.returncode == 2 and run.stdout == "", run.stdout + run.stderr
    assert run.stderr == ("error: build-carry/cutlass-include.tar.xz holds no CUTLASS headers "
                          "(include/cute/tensor.hpp)\n")
    assert not [p.name for p in checkout.iterdir() if p.name.startswith("build-cutlass")]
    # Not an archive at all (a truncated carry): the same one line, nothing left.
    (checkout / "build-carry" / "cutlass-include.tar.xz").write_bytes(b"\xfd7zXZ\x00 truncated")
    run = subprocess.run(["bash", str(checkout / "tools" / "gpu_campaign.sh"), "--out", str(tmp_path / "out3"), "env"],
                         env=env, capture_output=True, text=True, timeout=60, stdin=subprocess.DEVNULL)
    assert run.returncode == 2 and run.stdout == "", run.stdout + run.stderr
    assert run.stderr == ("error: build-carry/cutlass-include.tar.xz holds no CUTLASS headers "
                          "(include/cute/tensor.hpp)\n")
    assert not [p.name for p in checkout.iterdir() if p.name.startswith("build-cutlass")]
    # The headers and a 2 MiB file of zeros (a few KB of xz) under a 1 MiB limit: refused, nothing left.
    (tmp_path / "headers" / "include" / "zeros.bin").write_bytes(bytes(2 << 20))
    with tarfile.open(checkout / "build-carry" / "cutlass-include.tar.xz", "w:xz") as tar:
        tar.add(tmp_path / "headers" / "include", arcname="include")
    run = subprocess.run(["bash", str(checkout / "tools" / "gpu_campaign.sh"), "--out", str(tmp_path / "out4"), "env"],
                         env={**env, "CAMPAIGN_UNPACK_LIMIT_MB": "1"}, capture_output=True, text=True, timeout=60,
                         stdin=subprocess.DEVNULL)
    assert run.returncode == 2 and run.stdout == "", run.stdout + run.stderr
    assert run.stderr == ("error: build-carry/cutlass-include.tar.xz unpacks to more than 1 MiB "
                          "(CAMPAIGN_UNPACK_LIMIT_MB)\n")
    assert not [p.name for p in checkout.iterdir() if p.name.startswith("build-cutlass")]
    # Within a 3 MiB limit the same archive unpacks.
    run = subprocess.run(["bash", str(checkout / "tools" / "gpu_campaign.sh"), "--out", str(tmp_path / "out5"), "env"],
                         env={**env, "CAMPAIGN_UNPACK_LIMIT_MB": "3"}, capture_output=True, text=True, timeout=60,
                         stdin=subprocess.DEVNULL)
    assert run.returncode == 0, run.stdout + run.stderr
    assert sorted(p.name for p in (checkout / "build-cutlass").iterdir()) == ["include"]
    assert (checkout / "build-cutlass" / "include" / "zeros.bin").stat().st_size == 2 << 20


def test_the_packed_libraries_are_unpacked_whole_or_refused(stubs):
    """Each carried build-NAME/libdiffexport_kernels.so.xz (tools/prepare_gpu_campaign.sh packs them)
    becomes the library beside it before the first part, a library already there is kept, and a
    file that is no xz is one error line, exit 2, with no library and no partial file left."""
    env, tmp_path = stubs
    env["CAMPAIGN_UNPACK_LIBRARIES"] = "1"  # as on the GPU machine, in a scratch checkout
    checkout = tmp_path / "checkout"
    (checkout / "tools").mkdir(parents=True)
    (checkout / "tools" / "gpu_campaign.sh").write_text(CAMPAIGN.read_text())
    library = bytes(range(256)) * 512  # a stand-in of 128 KiB
    for name in ("build-before", "build-packmaps", "build-kept"):
        (checkout / name).mkdir()
        (checkout / name / "libdiffexport_kernels.so.xz").write_bytes(lzma.compress(library))
    (checkout / "build-kept" / "libdiffexport_kernels.so").write_bytes(b"built here")
    # a link, packed or as the library's name, is never unpacked through
    outside = tmp_path / "outside"
    outside.write_bytes(b"not to be written")
    (checkout / "build-linked").mkdir()
    (checkout / "build-linked" / "libdiffexport_kernels.so.xz").write_bytes(lzma.compress(library))
    (checkout / "build-linked" / "libdiffexport_kernels.so").symlink_to(outside)
    (checkout / "build-link-packed").mkdir()
    (checkout / "build-link-packed" / "libdiffexport_kernels.so.xz").symlink_to(
        checkout / "build-before" / "libdiffexport_kernels.so.xz")
    # prepare_gpu_campaign.sh's variants, one carried folder: each unpacked, but not through a folder link
    for name in ("s8qk", "s8all"):
        (checkout / "build-variants" / name).mkdir(parents=True)
        (checkout / "build-variants" / name / "libdiffexport_kernels.so.xz").write_bytes(lzma.compress(library))
    linked_folder = tmp_path / "linked-folder"
    linked_folder.mkdir()
    (linked_folder / "libdiffexport_kernels.so.xz").write_bytes(lzma.compress(library))
    (checkout / "build-variants" / "linked").symlink_to(linked_folder)
    (checkout / "build-dirlink").symlink_to(linked_folder)

    def campaign_env(out):
        return subprocess.run(["bash", str(checkout / "tools" / "gpu_campaign.sh"), "--out", str(tmp_path / out),
                               "env"], env=env, capture_output=True, text=True, timeout=60, stdin=subprocess.DEVNULL)

    run = campaign_env("out")
    assert run.returncode == 0, run.stdout + run.stderr
    assert (checkout / "build-before" / "libdiffexport_kernels.so").read_bytes() == library
    assert (checkout / "build-packmaps" / "libdiffexport_kernels.so").read_bytes() == library
    for name in ("s8qk", "s8all"):
        assert (checkout / "build-variants" / name / "libdiffexport_kernels.so").read_bytes() == library
    assert [p.name for p in linked_folder.iterdir()] == ["libdiffexport_kernels.so.xz"]
    assert (checkout / "build-kept" / "libdiffexport_kernels.so").read_bytes() == b"built here"
    assert outside.read_bytes() == b"not to be written"
    assert (checkout / "build-linked" / "libdiffexport_kernels.so").is_symlink()
    # nor through build-variants itself as a link
    shutil.rmtree(checkout / "build-variants")
    (checkout / "build-variants").symlink_to(tmp_path / "variants-elsewhere", target_is_directory=True)
    (tmp_path / "variants-elsewhere" / "s8qk").mkdir(parents=True)
    (tmp_path / "variants-elsewhere" / "s8qk" / "libdiffexport_kernels.so.xz").write_bytes(lzma.compress(library))
    assert campaign_env("out-linked-variants").returncode == 0
    assert [p.name for p in (tmp_path / "variants-elsewhere" / "s8qk").iterdir()] == ["libdiffexport_kernels.so.xz"]
    assert not (checkout / "build-link-packed" / "libdiffexport_kernels.so").exists()
    assert sorted(p.name for p in (checkout / "build-linked").iterdir()) == ["libdiffexport_kernels.so",
                                                                           "libdiffexport_kernels.so.xz"]
    (checkout / "build-broken").mkdir()
    packed = lzma.compress(library)
    (checkout / "build-broken" / "libdiffexport_kernels.so.xz").write_bytes(packed[:len(packed) // 2])  # cut short
    run = campaign_env("out2")
    assert run.returncode == 2 and run.stdout == "", run.stdout + run.stderr
    assert run.stderr == "error: build-broken/libdiffexport_kernels.so.xz is not a packed kernel library (xz)\n"
    assert [p.name for p in (checkout / "build-broken").iterdir()] == ["libdiffexport_kernels.so.xz"]
    # One that unpacks past the limit (2 MiB of zeros under 1 MiB): one error line, nothing left.
    shutil.rmtree(checkout / "build-broken")
    (checkout / "build-huge").mkdir()
    (checkout / "build-huge" / "libdiffexport_kernels.so.xz").write_bytes(lzma.compress(bytes(2 << 20)))
    env["CAMPAIGN_UNPACK_LIMIT_MB"] = "1"
    run = campaign_env("out3")
    assert run.returncode == 2 and run.stdout == "", run.stdout + run.stderr
    assert run.stderr == ("error: build-huge/libdiffexport_kernels.so.xz unpacks to more than 1 MiB "
                          "(CAMPAIGN_UNPACK_LIMIT_MB)\n")
    assert [p.name for p in (checkout / "build-huge").iterdir()] == ["libdiffexport_kernels.so.xz"]
    env["CAMPAIGN_UNPACK_LIMIT_MB"] = "1e3"  # not whole MiB: refused before anything is unpacked
    run = campaign_env("out4")
    assert run.returncode == 2 and run.stderr == (
        "error: CAMPAIGN_UNPACK_LIMIT_MB takes whole MiB from 1 to 999999, not '1e3'\n"), run.stderr


def test_a_hanging_bench_leaves_the_later_parts_their_reserve(stubs):
    env, tmp_path = stubs
    env["STUB_HANG"] = "tools/bench_attention.py --json"
    proc, log, out, wall = campaign(env, tmp_path, "--budget", "64", "env", "bench", "decode", "profile")
    # The bench must end by 64 - (22 + 17) = 25 s, less its 15 s grace: about 10 s, then SIGINT.
    assert verdicts(log) == {"env": "ok", "bench": "FAILED", "decode": "ok", "profile": "ok"}, log
    assert proc.returncode == 1
    assert wall < 25, wall
    assert "bench: stopped at its time limit" in log


def test_the_sanitizers_run_at_once_racecheck_once_per_kernel_path(stubs):
    env, tmp_path = stubs
    env["STUB_SANITIZER_SLEEP"] = "2"
    _, log, out, _ = campaign(env, tmp_path, "sanitize")
    assert verdicts(log) == {"sanitize": "ok"}, log
    calls = [c for c in (tmp_path / "calls.log").read_text().splitlines() if c.startswith("compute-sanitizer")]
    started = [c for c in calls if not c.endswith(" ended")]
    assert len(started) == 5 and calls.index(next(c for c in calls if c.endswith(" ended"))) >= 5, calls
    assert sum("--tool racecheck" in c and c.endswith("kernel_cases.py auto") for c in started) == 1, started
    assert sum("--tool racecheck" in c and c.endswith("kernel_cases.py mma") for c in started) == 1, started
    # One section each, in a fixed order, with its exit status: what tools/campaign_report.py reads.
    text = (out / "sanitizer.log").read_text()
    assert re.findall(r"^--- (.*)$", text, re.M) == ["memcheck", "initcheck", "racecheck (auto)", "racecheck (mma)",
                                                     "synccheck"]
    assert "racecheck (mma): exit status 0" in text


@pytest.mark.parametrize("probed", ["auto and mma", "mma only"])
def test_the_mma_sanitizer_run_leaves_auto_its_long_decode_calls(monkeypatch, probed):
    """tests/kernel_cases.py on the mma path of an sm_90 GPU (auto, the Hopper path, runs in another
    sanitizer process): the decode-sized calls of more than 128 keys and the 8-bit cache's decode
    calls are auto's (the split-KV kernels), so the mma run leaves them out and runs every other case;
    where the Hopper path failed its probe, mma is the only path and runs them all."""
    sys.path.insert(0, str(ROOT / "tests"))
    try:
        import kernel_cases
    finally:
        sys.path.remove(str(ROOT / "tests"))
    calls = []

    def launch(q, k, v, lam, w, attrs, logit_bits=0, key_mask=None, kv_scales=None):
        calls.append((q.shape[1], k.shape[1], kv_scales is not None))
        return torch.zeros(1)

    monkeypatch.setattr(kernel_cases.kernels, "diff_attention", launch)
    monkeypatch.setattr(torch.Tensor, "cuda", lambda self: self)
    monkeypatch.setattr(kernel_cases, "paths", lambda: ["auto", "mma"] if probed == "auto and mma" else ["mma"])
    # (main sets $DIFFEXPORT_KERNEL_PATH for its launches, in this process here: restored at the end)
    monkeypatch.setenv(kernel_cases.kernels.KERNEL_PATH_ENV, "auto")
    kernel_cases.main(["mma"])
    every = ({(c[6], c[7], False) for c in kernel_cases.CASES}
             | {(c[6], c[7], True) for c in kernel_cases.KV_CACHE_CASES})
    auto_only = {(1, 5000, False), (16, 300, False), (1, 300, True), (16, 130, True)}
    assert set(calls) == (every - auto_only if probed == "auto and mma" else every)


def test_a_variant_that_fails_its_probe_is_left_out_of_the_bench(stubs):
    env, tmp_path = stubs
    env.update(CAMPAIGN_VARIANTS="good:-DGOOD=1,-DALSO=2 bad:-DBAD=1", STUB_PROBE="ok: stand-in",
               STUB_BAD_LIB="build-bad",
               CAMPAIGN_BUILD_DIR=os.path.relpath(tmp_path / "build", ROOT))  # relative: made absolute for the bench
    _, log, _, _ = campaign(env, tmp_path, "variants", "bench")
    assert verdicts(log) == {"variants": "FAILED", "bench": "ok"}, log
    assert "variant good, hopper-int8 probe: ok: stand-in" in log
    assert "variant bad, hopper probe: failed: stand-in disagrees" in log
    # commas separate one variant's flags
    assert "-DCMAKE_CUDA_FLAGS=-DGOOD=1 -DALSO=2\n" in (tmp_path / "calls.log").read_text()
    bench = next(c for c in (tmp_path / "calls.log").read_text().splitlines() if "bench_attention.py --json" in c)
    assert f"good={tmp_path}/build-good/plugins/kernels/libdiffexport_kernels.so" in bench
    assert "bad=" not in bench


def test_no_time_left_is_a_skip_that_counts_as_a_failure(stubs):
    env, tmp_path = stubs
    # The bench's 15 s grace does not fit in an 8 s budget: the step is refused, not run unbounded.
    proc, log, _, _ = campaign(env, tmp_path, "--budget", "8", "env", "bench")
    assert verdicts(log) == {"env": "ok", "bench": "FAILED"}, log
    assert "bench: SKIPPED, no time left in the budget" in log
    assert proc.returncode == 1
    assert "bench_attention" not in (tmp_path / "calls.log").read_text()

    # A part whose group starts with the budget spent is skipped whole, and each is counted.
    env["STUB_SMI_SLEEP"] = "7"
    proc, log, _, _ = campaign(env, tmp_path, "--budget", "6", "env", "bench+decode")
    assert verdicts(log) == {"env": "ok", "bench": "SKIPPED", "decode": "SKIPPED"}, log
    assert "part bench SKIPPED: the budget of 6 s is spent" in log
    assert proc.returncode == 2


def test_without_a_budget_the_parts_keep_their_own_limits(stubs):
    env, tmp_path = stubs
    proc, log, _, _ = campaign(env, tmp_path, "env", "build", "bench")
    assert verdicts(log) == {"env": "ok", "build": "ok", "bench": "ok"}, log
    assert proc.returncode == 0
    assert "budget" not in log


@pytest.mark.parametrize("argv, message", [
    (["env", "nosuch"], "unknown part: nosuch"),
    (["--budget", "ten", "env"], "error: --budget takes whole seconds, not 'ten'"),
    (["--budget", "-5", "env"], "error: --budget takes whole seconds, not '-5'"),
    (["env", "--budget"], "unknown part: --budget"),
    (["--budget"], "error: --budget needs a value"),
])
def test_a_bad_command_line_runs_nothing(stubs, argv, message):
    env, tmp_path = stubs
    proc, log, _, _ = campaign(env, tmp_path, *argv)
    assert proc.returncode == 2 and message in proc.stderr
    assert "part env" not in log and not (tmp_path / "calls.log").exists()


@pytest.mark.parametrize("workers", ["0", "auto", "8; rm -rf /", "100"])
def test_a_bad_worker_count_runs_nothing(stubs, workers):
    env, tmp_path = stubs
    env["CAMPAIGN_TEST_WORKERS"] = workers
    proc, log, _, _ = campaign(env, tmp_path, "env", "test")
    assert proc.returncode == 2 and proc.stderr.count("\n") == 1
    assert proc.stderr.startswith("error: CAMPAIGN_TEST_WORKERS takes a number of pytest workers")
    assert "part env" not in log and not (tmp_path / "calls.log").exists()


def test_the_documented_one_call_command_is_the_script_s():
    """tools/README.md's one-call command names parts and options the script has."""
    readme = (ROOT / "tools" / "README.md").read_text()
    commands = re.findall(r"^\s+(?:\S+=\S+ )*tools/gpu_campaign\.sh (.+)$", readme, re.M)
    assert commands, "tools/README.md shows no gpu_campaign.sh command"
    script = CAMPAIGN.read_text()
    known = set(re.findall(r"^part_(\w+)\(\)", script, re.M)) | {"all"}
    for command in commands:
        words = command.split("#")[0].split()
        budget = words.index("--budget") if "--budget" in words else None
        if budget is not None:
            assert words[budget + 1].isdigit(), command
        parts = [w for w in words if not w.startswith("-") and not w.startswith("$") and not w.isdigit()]
        assert parts and all(p in known for group in parts for p in group.split("+")), command


def test_a_bench_stopped_at_its_limit_renders_as_partial(tmp_path):
    """bench.json is rewritten after every case; a run stopped before its last case renders what it
    measured and says it is partial (and a record written whole, or before the field existed, does not)."""
    saved = json.loads((ROOT / "docs" / "campaign" / "2026-11-23-h100" / "bench.json").read_text())
    assert "complete" not in saved  # written before the field existed: whole by construction
    partial = dict(saved, rows=saved["rows"][:5], cases=len(saved["rows"]), complete=False)
    for name, record in (("partial.json", partial), ("whole.json", saved)):
        (tmp_path / name).write_text(json.dumps(record))
        out = subprocess.run([sys.executable, "tools/bench_attention.py", "--render", str(tmp_path / name)], cwd=ROOT,
                             capture_output=True, text=True, timeout=120)
        assert out.returncode == 0, out.stderr
        table = out.stdout.split("\n\n")[0].splitlines()
        assert len(table) == 2 + len(record["rows"])  # header, rule, one line per measured case
        says_partial = f"Partial run: stopped at its time limit after 5 of {len(saved['rows'])} cases" in out.stderr
        assert says_partial == (name == "partial.json"), out.stderr


def test_methods_are_timed_in_rounds_so_a_drift_falls_on_all_alike(capsys):
    """bench_attention.interleaved_medians on stand-in methods whose every call reads 1% slower than
    the call before (a GPU warming over the loop): each round times every method once, one method
    later than the round before, so their medians keep the true ratios, where timing one method's
    runs back to back would put ~10% of drift on the method timed last. A method that raises in its
    warm-up or in a round is left out with a line saying why; the others are still measured."""
    bench = tool_module("bench_attention")
    calls = []

    def method(name, base, fail_at=None):
        def run():
            calls.append(name)
            if fail_at is not None and calls.count(name) == fail_at:
                raise RuntimeError(f"{name} refused this shape\nsecond line")
            return base * (1 + 0.01 * len(calls))
        return run

    methods = {"a": method("a", 1.0), "b": method("b", 2.0), "c": method("c", 4.0),
               "warm-up failure": method("warm-up failure", 1.0, fail_at=1),
               "round failure": method("round failure", 1.0, fail_at=6)}
    medians = bench.interleaved_medians(methods, warmup=2, repeats=10, time_one=lambda fn: fn())
    assert list(medians) == ["a", "b", "c"]
    assert medians["b"] / medians["a"] == pytest.approx(2.0, rel=0.03)
    assert medians["c"] / medians["a"] == pytest.approx(4.0, rel=0.03)
    err = capsys.readouterr().err
    assert "warm-up failure: not measured (warm-up failure refused this shape)" in err
    assert "round failure: not measured (round failure refused this shape)" in err
    # warm-up: two rounds in the given order; then round r starts r methods later
    assert calls[:5] == ["a", "b", "c", "warm-up failure", "round failure"]
    assert calls[5:9] == ["a", "b", "c", "round failure"]
    timed = calls[9:]
    assert timed[:8] == ["a", "b", "c", "round failure", "b", "c", "round failure", "a"]
    assert timed[12:16] == ["round failure", "a", "b", "c"]  # its last call, then the round goes on without it
    assert timed.count("a") == timed.count("b") == timed.count("c") == 10
    # back to back, the same stand-ins read the drift: what the rounds are for
    calls.clear()
    sequential = {name: bench.statistics.median([methods[name]() for _ in range(10)]) for name in ("a", "b", "c")}
    assert sequential["c"] / sequential["a"] > 4.0 * 1.15


def test_the_fixed_cost_per_cta_is_a_fitted_line_and_renders(tmp_path):
    """bench_attention.py --cta-cost: the intercept and slope of the least-squares line through the
    measured points, how far the worst point lies off it, and the table --render prints of a saved run."""
    bench_attention = tool_module("bench_attention")
    keys = bench_attention.CTA_COST_KEYS
    straight = bench_attention.fixed_cost_fit([(k, 0.08 + 0.5e-3 * k) for k in keys])
    assert straight["intercept_ms"] == pytest.approx(0.08) and straight["ms_per_1k_keys"] == pytest.approx(0.5)
    assert straight["worst_residual"] < 1e-9
    bent = bench_attention.fixed_cost_fit([(k, 0.08 + 0.5e-3 * k + (0.05 if k == keys[0] else 0)) for k in keys])
    assert bent["worst_residual"] > 0.05 and bent["intercept_ms"] > 0.08
    row = {"build": "this build", "dtype": "bfloat16", "d": 64, "tiles": 4096, "sms": 132, "waves": 32,
           "points": [[k, 0.08 + 0.5e-3 * k] for k in keys], **straight, "per_tile_us": 2.5}
    (tmp_path / "cta_cost.json").write_text(json.dumps({"mode": "cta_cost", "rows": [row]}))
    out = subprocess.run([sys.executable, "tools/bench_attention.py", "--render", str(tmp_path / "cta_cost.json")],
                         cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.splitlines()[2] == ("| this build | bfloat16 | 64 (128) | 4096 | 32 | 0.208 / 0.336 / 0.592 / "
                                          "1.104 / 2.128 | 0.080 | 2.5 | 0.500 | 0.0% |")


def test_the_closing_call_in_tools_readme_runs_every_part(stubs):
    """The one call tools/README.md gives for issue 44's closing campaign, as written there (with the
    stand-ins): a typo in it would cost a GPU session its run."""
    env, tmp_path = stubs
    text = (ROOT / "tools" / "README.md").read_text()
    block = re.search(r"^    (CAMPAIGN_TEST_WORKERS=\d+ [^\n]*\\\n(?:      [^\n]*\\\n)*      [^\n]*env "
                      r"build\+variants[^\n]*)$",
                      text, re.M).group(1)
    command = re.sub(r"\\\n\s*", "", block)
    env.update(OUT=str(tmp_path / "out"), STUB_PROBE="ok: stand-in")
    proc = subprocess.run(["bash", "-c", command], env=env, cwd=ROOT, capture_output=True, text=True, timeout=120,
                          stdin=subprocess.DEVNULL)
    log = (tmp_path / "out" / "campaign.log").read_text()
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    assert verdicts(log) == {part: "ok" for part in ("env", "build", "variants", "test", "sanitize", "bench", "decode")}
    calls = (tmp_path / "calls.log").read_text()
    assert ("--seqs 4096 16384 --compare before=build-before/libdiffexport_kernels.so --hopper-variants slack8="
            in calls)
    assert "-n 14 " in calls and "--keys 8192 32768 131072" in calls


def readme_block(pattern: str) -> str:
    """The command of tools/README.md whose first line matches pattern, its continuation lines joined."""
    text = (ROOT / "tools" / "README.md").read_text()
    block = re.search(rf"^    ({pattern}(?:[^\n]*\\\n      )*[^\n]*)$", text, re.M).group(1)
    return re.sub(r"\\\n\s*", "", block)


def run_readme_command(env, tmp_path, command: str):
    env.update(OUT=str(tmp_path / "out"), STUB_PROBE="ok: stand-in")
    proc = subprocess.run(["bash", "-c", command], env=env, cwd=ROOT, capture_output=True, text=True, timeout=120,
                          stdin=subprocess.DEVNULL)
    log = (tmp_path / "out" / "campaign.log").read_text()
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    return log, (tmp_path / "calls.log").read_text()


# The decode-only builds prepare_gpu_campaign.sh makes for the issue 62 call (tools/README.md), in its order.
DECODE_VARIANTS = ("kvtiles1", "packmaps", "s8qk", "overlap", "warpcopies", "s8pack", "s8warp", "s8all", "maskloads",
                   "onewave")


def fastest_decode_json(folder: Path, speed: dict | None = None) -> None:
    """A decode.json as the decode part leaves it, each build's int8 cache calls speed[build] = (this
    build's time / the build's, cosine vs fp32); by default s8all fastest but below the cosine budget,
    s8warp the fastest within it, packmaps slower than this build."""
    speed = speed or {"packmaps": (0.9, 0.9999), "s8warp": (1.4, 0.9998), "s8all": (1.5, 0.998)}
    rows = [{"dtype": "bfloat16", "kv_len": keys, "d": 128,
             "cosine_vs_fp32": {"int8_cache": 0.9999, **{f"int8_cache@{b}": c for b, (_, c) in speed.items()}},
             "timings": {"split_kv": {"ms": 0.1, "gbs": 1.0}, "split_kv_int8_cache": {"ms": 0.08, "gbs": 1.0},
                         **{f"split_kv_int8_cache@{b}": {"ms": 0.08 / x, "gbs": 1.0} for b, (x, _) in speed.items()}}}
            for keys in (32768, 131072)]
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "decode.json").write_text(json.dumps({"mode": "decode", "copy_gbs": 4000.0, "rows": rows,
                                                    "cases": 2, "complete": True}))


def test_the_issue_62_first_call_in_tools_readme_times_every_variant_then_profiles(stubs):
    """The first call prepared for issue 62, as written: the prefill bench with the Hopper variants
    beside this build and `before`, decode with every carried build, then the profile: the int8-cache
    decode launch of this build and of the carried build decode just timed fastest within the cosine
    budget, then the Hopper launch at d = 64, 16k of this build and each variant; no suite (call 2)."""
    env, tmp_path = stubs
    env.update(STUB_LOG_LIB="1", STUB_REAL_PYTHON=sys.executable)
    fastest_decode_json(tmp_path / "out")
    log, calls = run_readme_command(env, tmp_path, readme_block(r"CAMPAIGN_COMPARE=\"before=[^\n]*\\\n      "
                                                                r"CAMPAIGN_DECODE_COMPARE="))
    assert verdicts(log) == {part: "ok" for part in ("env", "build", "variants", "bench", "decode", "profile")}
    assert "-DCMAKE_CUDA_FLAGS=-DDIFFX_SM90_CLUSTER_M=2" in calls
    assert "-DCMAKE_CUDA_FLAGS=-DDIFFX_SM90_MAPS_PER_WARPGROUP=2" in calls
    bench = next(x for x in calls.splitlines() if "bench_attention.py" in x and "--decode" not in x)
    # a variant of -DDIFFX_SM90_* flags only is timed on the Hopper path alone, and not in decode; the
    # Hopper call of this build and `before` also with a key mask
    assert ("--seqs 4096 16384 --masked-compare before --compare before=build-before/libdiffexport_kernels.so "
            "--hopper-variants cluster2=" in bench)
    decode = next(x for x in calls.splitlines() if "bench_attention.py --decode" in x)
    # the carried decode-only builds beside `before` in decode (its bf16 cases), not in the prefill bench
    carried = " ".join(f"{name}=build-variants/{name}/libdiffexport_kernels.so" for name in DECODE_VARIANTS)
    assert ("--keys 32768 131072 --dtypes bfloat16 --masked-compare before maskloads --compare "
            f"before=build-before/libdiffexport_kernels.so {carried} --hopper-variants") in decode
    assert not any(name in bench for name in DECODE_VARIANTS)
    # ... the very builds that the README's preparation before it makes
    prepared = re.search(r'PREPARE_VARIANTS="([^"]*)"[^\n]*\\\n\s*tools/prepare_gpu_campaign.sh 58e623d',
                         (ROOT / "tools" / "README.md").read_text()).group(1)
    assert tuple(spec.partition(":")[0] for spec in prepared.split()) == DECODE_VARIANTS
    # then the Hopper path's fixed cost per CTA, of this build and every carried one
    cta_cost = next(x for x in calls.splitlines() if "bench_attention.py --cta-cost" in x)
    assert ("/cta_cost.json --compare before=build-before/libdiffexport_kernels.so --hopper-variants cluster2="
            in cta_cost)
    assert "-m pytest" not in calls and "compute-sanitizer" not in calls
    ncu = [x for x in calls.splitlines() if x.startswith("ncu ") and " -o " in x]
    assert calls.index("--seqs 4096 16384") < calls.index("--cta-cost") < calls.index("--decode") < calls.index(ncu[0])
    # the profile: decode-kv8 of this build, then of s8warp (s8all is faster, but its cosine misses 0.999)
    decode_launches = [x for x in ncu if "regex:diff_attention_decode" in x]
    hopper = [x for x in ncu if "regex:diff_attention_sm90" in x]
    assert ncu == decode_launches + hopper and len(decode_launches) == 2 and len(hopper) == 3, ncu
    assert all("--profile-kv-cache int8" in x for x in decode_launches)
    assert not any(decode_launches[0].endswith(f"{name}/libdiffexport_kernels.so") for name in DECODE_VARIANTS)
    assert "/tmp/profile-decode-kv8-s8warp" in decode_launches[1]
    assert decode_launches[1].endswith(" lib=build-variants/s8warp/libdiffexport_kernels.so")
    assert re.search(r"profile: fastest int8 cache build: s8warp: this build's int8 cache time / its 1\.400x "
                     r"\(geometric mean of 2 cases\), cosine vs fp32 0\.99980 at worst", log), log
    assert all("--profile 16384 --profile-head-dim 64" in x for x in hopper)
    assert "--profile-lib" not in hopper[0] and "-cluster2/plugins/kernels/libdiffexport_kernels.so" in hopper[1]
    assert "-maps2/plugins/kernels/libdiffexport_kernels.so" in hopper[2]
    # each launch's per-instruction warp samples, exported from its own report (tools/ncu_stall_sites.py)
    sources = [x for x in calls.splitlines() if x.startswith("ncu --import") and "--page source" in x]
    reports = [re.search(r" -o (\S+)", x).group(1) + ".ncu-rep" for x in ncu]
    assert sorted(x.split()[2] for x in sources) == sorted(reports), (sources, reports)
    # ... condensed with the line information of the library each launch ran (a carried decode build's own)
    condense = [x for x in calls.splitlines() if x.startswith("python tools/ncu_stall_sites.py")]
    assert len(condense) == 5 and all("--arch sm_90a" in x for x in condense), condense
    libraries = [re.search(r"--library (\S+)", x).group(1) for x in condense]
    assert sum(x.endswith("build-variants/s8warp/libdiffexport_kernels.so") for x in libraries) == 1
    assert sum(x.endswith("-cluster2/plugins/kernels/libdiffexport_kernels.so") for x in libraries) == 1


@pytest.mark.parametrize("library", ["", "build-variants/s8warp/libdiffexport_kernels.so"])
def test_the_issue_62_second_call_in_tools_readme_runs_the_suite_beside_the_sanitizers(stubs, library):
    """Call 2, as written: the GPU suite on 14 workers and the sanitizers, on the first call's build,
    or with DIFFEXPORT_KERNEL_LIB on a carried candidate default (relative, as the README gives it:
    made absolute for the tests' child processes, and named in campaign.log)."""
    env, tmp_path = stubs
    env["STUB_LOG_LIB"] = "1"
    if library:
        env["DIFFEXPORT_KERNEL_LIB"] = library
    else:
        env.pop("DIFFEXPORT_KERNEL_LIB")
    log, calls = run_readme_command(env, tmp_path, readme_block(r"CAMPAIGN_TEST_WORKERS=14 tools/gpu_campaign.sh"))
    assert verdicts(log) == {"test": "ok", "sanitize": "ok"}
    assert "-n 14 " in calls and "ncu" not in calls and "bench_attention.py" not in calls
    expected = str(ROOT / library) if library else str(tmp_path / "build" / "plugins/kernels/libdiffexport_kernels.so")
    runs = [x for x in calls.splitlines() if x.startswith("compute-sanitizer --tool") and not x.endswith(" ended")]
    assert len(runs) == 5 and all(x.endswith(f" lib={expected}") for x in runs), runs
    assert (f"kernel library: {expected} (DIFFEXPORT_KERNEL_LIB), not this build's" in log) == bool(library)


@pytest.mark.parametrize("setting", ["", "packmaps=/carried/packmaps.so"])
def test_the_profile_takes_the_decode_builds_named_or_none(stubs, setting):
    """PROFILE_DECODE_COMPARE names the carried decode builds the profile takes beside this build
    (nothing: none), whatever CAMPAIGN_DECODE_COMPARE times."""
    env, tmp_path = stubs
    env.update(PROFILE_PARTS="decode-kv8", PROFILE_DECODE_COMPARE=setting, STUB_LOG_LIB="1",
               CAMPAIGN_DECODE_COMPARE="s8qk=/carried/s8qk.so packmaps=/carried/packmaps.so")
    proc, log, _, _ = campaign(env, tmp_path, "profile")
    assert verdicts(log) == {"profile": "ok"}, log
    launches = [x for x in (tmp_path / "calls.log").read_text().splitlines() if x.startswith("ncu ") and " -o " in x]
    assert [x.rsplit(" lib=", 1)[1] for x in launches[1:]] == ([setting.split("=")[1]] if setting else [])


def test_no_build_faster_than_this_one_is_profiled_as_none(stubs):
    """PROFILE_DECODE_COMPARE=fastest where every carried build was slower, the fastest is no
    CAMPAIGN_DECODE_COMPARE build, or decode.json is missing or broken: this build's launch alone, and
    campaign.log says why."""
    env, tmp_path = stubs
    env.update(PROFILE_PARTS="decode-kv8", PROFILE_DECODE_COMPARE="fastest", STUB_REAL_PYTHON=sys.executable,
               CAMPAIGN_DECODE_COMPARE="packmaps=/carried/packmaps.so")
    expected = ("decode.json missing", "none faster than this build by more than 1.04x; the best, packmaps: this "
                "build's int8 cache time / its 0.900x", "s8warp is no CAMPAIGN_DECODE_COMPARE build")
    for speed, why in zip((None, {"packmaps": (0.9, 0.9999), "s8all": (1.2, float("nan"))}, {"s8warp": (1.4, 1.0)}),
                          expected):
        if speed:
            fastest_decode_json(tmp_path / "out", speed)
        proc, log, _, _ = campaign(env, tmp_path, "profile")
        assert verdicts(log) == {"profile": "ok"}, log
        assert why in [x for x in log.splitlines() if " profile: " in x][-1], log
    (tmp_path / "out" / "decode.json").write_text('{"rows": [')  # cut off: the report fails, nothing chosen
    proc, log, _, _ = campaign(env, tmp_path, "profile")
    assert verdicts(log) == {"profile": "ok"}, log
    assert "campaign_report.py --fastest-kv8 FAILED: error: " in [x for x in log.splitlines() if " profile: " in x][-1]
    launches = [x for x in (tmp_path / "calls.log").read_text().splitlines() if x.startswith("ncu ") and " -o " in x]
    assert len(launches) == 4 and not any("packmaps" in x or "s8warp" in x for x in launches)


@pytest.mark.parametrize("name, setting, message", [
    ("PROFILE_PARTS", "hopper bogus", "PROFILE_PARTS takes fused, decode, decode-kv8, hopper"),
    ("PROFILE_PARTS", "hopper;ls", "PROFILE_PARTS takes fused, decode, decode-kv8, hopper"),
    ("PROFILE_DECODE_COMPARE", "fastest packmaps", "PROFILE_DECODE_COMPARE takes fastest or name=path pairs"),
    ("PROFILE_DECODE_COMPARE", "packmaps", "PROFILE_DECODE_COMPARE takes fastest or name=path pairs"),
    ("PROFILE_DECODE_COMPARE", "a=b;ls", "PROFILE_DECODE_COMPARE takes fastest or name=path pairs")])
def test_a_bad_profile_setting_runs_nothing(stubs, name, setting, message):
    env, tmp_path = stubs
    env[name] = setting
    proc, log, _, _ = campaign(env, tmp_path, "profile")
    assert proc.returncode == 2 and proc.stderr.count("\n") == 1
    assert proc.stderr.startswith(f"error: {message}")
    assert not log and not (tmp_path / "calls.log").exists()


@pytest.mark.parametrize("content", [None, "link", "huge", "{not json", '{"mode": "decode", "rows": 5}',
                                     '{"mode": "decode", "copy_gbs": 1, "rows": [{"timings": {"split_kv": 3}}]}',
                                     '{"rows": [{"timings": {"fused@x": {}}}]}', "[1, 2]"])
def test_render_refuses_what_is_not_a_saved_run_in_one_line_writing_nothing(tmp_path, content):
    """bench_attention.py --render --write on a missing, linked, huge or malformed file: one error
    line, exit 2, docs/BENCHMARKS.md untouched."""
    path = tmp_path / "run.json"
    if content == "link":
        (tmp_path / "real.json").write_text("{}")
        path.symlink_to(tmp_path / "real.json")
    elif content == "huge":
        with open(path, "wb") as f:
            f.truncate(65 << 20)  # sparse: no disk used
    elif content is not None:
        path.write_text(content)
    doc = ROOT / "docs" / "BENCHMARKS.md"
    before = doc.read_bytes()
    out = run_tool("bench_attention", "--render", str(path), "--write")
    assert out.returncode == 2, out.stderr[-2000:]
    assert out.stderr.count("\n") == 1 and out.stderr.startswith("error: --render "), out.stderr
    assert doc.read_bytes() == before


def test_masked_decode_builds_must_be_builds_of_compare():
    """--masked-compare names builds of --compare whose key-masked decode call is timed too: a name
    that is not one is refused with one line (exit 2) before any GPU or library is touched."""
    out = run_tool("bench_attention", "--decode", "--compare", "before=build-before/lib.so",
                   "--masked-compare", "before", "befor")
    assert out.returncode == 2
    assert out.stderr == "error: --masked-compare befor: not a build of --compare\n"
