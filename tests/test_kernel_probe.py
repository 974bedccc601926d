"""The kernel-path probe (diffexport/kernel/kernel_probe.py) on the CPU: what the parent reports for a child
that hangs, dies of a signal, fails or succeeds, the answer kept for child processes, and the
child's own comparison run on CPU tensors with the torch reference standing in for the kernels
(the real launches run on the GPU machine, tools/gpu_campaign.sh)."""

import os
import sys

import pytest
import torch
from helpers import assert_one_line_error, cli_main

from diffexport.core.kv_cache_codes import decode
from diffexport.core.quantization import LogitQuant
from diffexport.kernel import kernel_probe, kernels, reference


def unset_for_this_test(monkeypatch, name: str):
    """Unset, and restored after the test even where the code under test sets it (delenv alone
    records nothing for a variable that was not there)."""
    monkeypatch.setenv(name, "")
    monkeypatch.delenv(name)


@pytest.fixture(autouse=True)
def no_kept_answer(monkeypatch):
    for name in kernel_probe.CHECKS:
        unset_for_this_test(monkeypatch, kernel_probe.env_name(name))
    unset_for_this_test(monkeypatch, kernels.KERNEL_PATH_ENV)  # run_child sets it


def child_running(monkeypatch, code: str):
    monkeypatch.setattr(kernel_probe, "child_command", lambda path: [sys.executable, "-c", code])


def test_a_hung_child_is_killed_and_reported(monkeypatch):
    child_running(monkeypatch, "import time; time.sleep(60)")
    reason = kernel_probe.probe("hopper", timeout=2)
    assert reason.startswith("no answer within 2 s") and "killed" in reason


def test_a_child_killed_by_a_signal_is_reported_with_its_last_words(monkeypatch):
    child_running(monkeypatch, "import os, sys; print('launching'); sys.stdout.flush(); os.abort()")
    reason = kernel_probe.probe("hopper")
    assert reason.startswith("the child process died of signal 6") and "launching" in reason


def test_a_failing_child_gives_its_last_line_and_a_passing_one_none(monkeypatch):
    child_running(monkeypatch, "print('case 1 fine'); print('failed: CUDA error: an illegal memory access'); exit(1)")
    assert kernel_probe.probe("hopper") == "failed: CUDA error: an illegal memory access"
    child_running(monkeypatch, "print('case 1 fine')")
    assert kernel_probe.probe("hopper") is None
    with pytest.raises(ValueError, match="not one of"):
        kernel_probe.probe("mma")


def test_the_answer_is_kept_for_child_processes(monkeypatch):
    calls = []
    monkeypatch.setattr(kernel_probe, "probe", lambda path, timeout: calls.append(path) or "failed: it hung")
    monkeypatch.setenv(kernel_probe.env_name("hopper"), "")  # not yet probed; the answer goes with the test
    assert kernel_probe.probed("hopper") == "failed: it hung"
    assert kernel_probe.probed("hopper") == "failed: it hung" and calls == ["hopper"]
    assert os.environ[kernel_probe.env_name("hopper")] == "failed: it hung"
    monkeypatch.setenv(kernel_probe.env_name("split-kv"), "ok: 2 launches")  # as tools/gpu_campaign.sh exports it
    assert kernel_probe.probed("split-kv") is None and calls == ["hopper"]
    assert kernel_probe.env_name("split-kv") == "DIFFEXPORT_PROBE_SPLIT_KV"


def test_the_real_child_on_a_machine_without_a_gpu(capsys):
    """The command the campaign runs: here it must say plainly that there is no GPU, exit 1."""
    if torch.cuda.is_available():
        pytest.skip("a CUDA device is present")
    assert kernel_probe.main(["hopper"]) == 1
    assert capsys.readouterr().out.strip().splitlines()[-1] == "failed: no CUDA device"


PLANS = {"mma": "one-pass", "hopper": "hopper", "auto": "split-kv"}


def kernels_on_the_cpu(monkeypatch, broken: str | None = None):
    """The child's launches on CPU tensors, the torch reference standing in for every kernel path
    (path `broken` with a wrong lambda) and each path planning its own kernel."""
    monkeypatch.setattr(kernel_probe, "DEVICE", "cpu")
    # (run_child sets $DIFFEXPORT_KERNEL_PATH, in the test's own process here: restored at the end)
    monkeypatch.setenv(kernels.KERNEL_PATH_ENV, "auto")
    monkeypatch.setattr(kernels, "kernel_plan",
                        lambda params, lib=None: (PLANS[os.environ[kernels.KERNEL_PATH_ENV]], 1))
    monkeypatch.setattr(kernels, "make_params", lambda *args, **kw: None)

    def fake_kernel(q, k, v, lam, w, attrs, *, logit_bits, out, kv_scales=None):
        if os.environ[kernels.KERNEL_PATH_ENV] == broken:
            lam = -lam
        if kv_scales is not None:  # an 8-bit cache: the values its codes stand for
            k, v = decode(k, kv_scales[0]), decode(v, kv_scales[1])
        inputs = [t.float() for t in (q, k, v, lam, w)]
        if logit_bits:
            want = reference.quantised_diff_attention(*inputs, attrs, LogitQuant(logit_bits, "qk", True))
        else:
            want = reference.naive_diff_attention(*inputs, attrs)
        return out.copy_(want)

    monkeypatch.setattr(kernels, "diff_attention", fake_kernel)


@pytest.mark.parametrize("name", sorted(kernel_probe.CHECKS))
def test_the_child_runs_every_case_against_the_reference(monkeypatch, capsys, name):
    """run_child's control flow on the CPU: each case on the check's own kernel path, compared with the
    float32 reference (the INT8 check with the mirrored quantisation), one line each, then the verdict."""
    kernels_on_the_cpu(monkeypatch)
    assert kernel_probe.run_child(name) == 0
    lines = capsys.readouterr().out.strip().splitlines()
    assert len(lines) == len(kernel_probe.CHECKS[name].cases) + 1
    assert lines[-1].startswith(f"ok: {len(kernel_probe.CHECKS[name].cases)} launches, worst cosine 0.99")
    assert os.environ[kernels.KERNEL_PATH_ENV] == kernel_probe.CHECKS[name].kernel_path


def test_a_path_that_disagrees_with_the_reference_fails_its_probe(monkeypatch, capsys):
    kernels_on_the_cpu(monkeypatch, broken="hopper")
    assert kernel_probe.run_child("hopper") == 1
    last = capsys.readouterr().out.strip().splitlines()[-1]
    assert last.startswith("failed: hopper disagrees with the torch reference on V1 D128 causal 1 B2 Sq 130")
    assert kernel_probe.run_child("one-pass") == 0  # the other paths are not affected


def test_a_path_that_plans_another_kernel_fails_the_probe(monkeypatch, capsys):
    kernels_on_the_cpu(monkeypatch)
    monkeypatch.setitem(PLANS, "hopper", "one-pass")  # e.g. a library that quietly falls back
    assert kernel_probe.run_child("hopper") == 1
    assert capsys.readouterr().out.strip() == ("failed: DIFFEXPORT_KERNEL_PATH=hopper plans the one-pass kernel for "
                                               "V1 D128 causal 1 B2 Sq 130 Skv 300, not hopper")


def test_kernels_check_needs_a_gpu_and_the_library(monkeypatch):
    if torch.cuda.is_available():
        pytest.skip("a CUDA device is present")
    if kernels.library_path() is not None:
        assert_one_line_error(cli_main("kernels", "--check"), "--check needs a CUDA GPU visible to torch")
    monkeypatch.setenv("DIFFEXPORT_KERNEL_LIB", "/nonexistent/libdiffexport_kernels.so")  # the only place looked at
    assert_one_line_error(cli_main("kernels", "--check"), "--check needs the kernel library, which is not built")


def test_kernels_check_reports_every_path_and_fails_on_one(monkeypatch, capsys):
    """The report of `diffexport kernels --check`: one line per path (skipped ones say why), a failed
    path named with its reason, exit 1."""
    from diffexport.cli import gpu as cli  # the kernels command's module

    answers = {"one-pass": (None, ["ok: 2 launches, worst cosine 0.999990, max abs 3.91e-03 (bf16 vs float32)"]),
               "int8": (None, ["ok: 2 launches, worst cosine 0.999950, max abs 7.81e-03 (bf16 vs float32)"]),
               "split-kv": ("no answer within 90 s (a hung launch?); the child process was killed", []),
               "kv-int8": (None, ["ok: 2 launches, worst cosine 0.999980, max abs 3.91e-03 (bf16 vs float32)"]),
               "kv-fp8": (None, ["ok: 2 launches, worst cosine 0.999970, max abs 3.91e-03 (bf16 vs float32)"])}
    monkeypatch.setattr(kernel_probe, "applicable",
                        lambda name: "an sm_90 GPU only" if name.startswith("hopper") else None)
    monkeypatch.setattr(kernel_probe, "run_probe", lambda name: answers[name])
    assert cli.check_kernels() == 1
    out = capsys.readouterr().out.splitlines()
    assert out[0].startswith("check one-pass    ok       2 launches, worst cosine 0.999990")
    assert out[1].startswith("check int8        ok       2 launches") and "mirrored quantisation" in out[1]
    assert out[2].startswith("check split-kv    FAILED   no answer within 90 s")
    assert out[3].startswith("check kv-int8     ok       2 launches") and "an int8 KV cache" in out[3]
    assert out[4].startswith("check kv-fp8      ok       2 launches") and "an fp8 e4m3 KV cache" in out[4]
    assert out[5].startswith("check hopper      skipped  the sm_90a TMA + wgmma kernel: an sm_90 GPU only")
    assert out[6].startswith("check hopper-int8 skipped  INT8 logits on the sm_90a kernel's s8 wgmma")
    assert out[7] == "result         FAIL: 1 kernel path(s)"
    answers["split-kv"] = answers["one-pass"]
    assert cli.check_kernels() == 0
    assert capsys.readouterr().out.splitlines()[-1] == "result         PASS"

