"""The kernel-path probe (diffexport/kernel_probe.py) on the CPU: what the parent reports for a child
that hangs, dies of a signal, fails or succeeds, the answer kept for child processes, and the
child's own comparison run on CPU tensors with the torch reference standing in for the kernels
(the real launches run on the GPU machine, tools/gpu_campaign.sh)."""

import os
import sys

import pytest
import torch

from diffexport import kernel_probe, kernels, reference


@pytest.fixture(autouse=True)
def no_kept_answer(monkeypatch):
    for path in kernel_probe.PATHS:
        monkeypatch.delenv(kernel_probe.env_name(path), raising=False)


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
        kernel_probe.probe("wgmma")


def test_the_answer_is_kept_for_child_processes(monkeypatch):
    calls = []
    monkeypatch.setattr(kernel_probe, "probe", lambda path, timeout: calls.append(path) or "failed: it hung")
    assert kernel_probe.probed("hopper") == "failed: it hung"
    assert kernel_probe.probed("hopper") == "failed: it hung" and calls == ["hopper"]
    assert os.environ[kernel_probe.env_name("hopper")] == "failed: it hung"
    monkeypatch.setenv(kernel_probe.env_name("mma"), "ok")  # as tools/gpu_campaign.sh exports it
    assert kernel_probe.probed("mma") is None and calls == ["hopper"]


def test_the_real_child_on_a_machine_without_a_gpu(capsys):
    """The command the campaign runs: here it must say plainly that there is no GPU, exit 1."""
    if torch.cuda.is_available():
        pytest.skip("a CUDA device is present")
    assert kernel_probe.main(["hopper"]) == 1
    assert capsys.readouterr().out.strip().splitlines()[-1] == "failed: no CUDA device"


@pytest.mark.parametrize("broken", [False, True])
def test_the_child_compares_the_path_with_the_one_pass_kernel(monkeypatch, capsys, broken):
    """run_child on CPU tensors, the torch reference as both kernels (the probed one off by a
    wrong lambda when `broken`): it checks each path's plan, compares every case and names the
    first that disagrees."""
    monkeypatch.setattr(kernel_probe, "DEVICE", "cpu")
    monkeypatch.setattr(kernels, "kernel_plan", lambda params, lib=None: (
        {"mma": "one-pass", "hopper": "hopper"}[os.environ[kernels.KERNEL_PATH_ENV]], 1))

    def fake_kernel(q, k, v, lam, w, attrs, *, out):
        if broken and os.environ[kernels.KERNEL_PATH_ENV] == "hopper":
            lam = -lam
        out.copy_(reference.naive_diff_attention(q.float(), k.float(), v.float(), lam.float(), w.float(), attrs))
        return out

    monkeypatch.setattr(kernels, "diff_attention", fake_kernel)
    monkeypatch.setattr(kernels, "make_params", lambda *args, **kw: None)
    monkeypatch.delenv(kernels.KERNEL_PATH_ENV, raising=False)
    status = kernel_probe.run_child("hopper")
    lines = capsys.readouterr().out.strip().splitlines()
    if broken:
        assert status == 1 and lines[-1].startswith("failed: hopper disagrees with the one-pass kernel on V1 D128")
    else:
        assert status == 0 and len(lines) == len(kernel_probe.CASES)
        assert all("cosine 1.0000" in line or "cosine 0.9999" in line for line in lines), lines


def test_a_path_that_plans_another_kernel_fails_the_probe(monkeypatch, capsys):
    monkeypatch.setattr(kernel_probe, "DEVICE", "cpu")
    monkeypatch.setattr(kernels, "kernel_plan", lambda params, lib=None: ("one-pass", 1))
    monkeypatch.setattr(kernels, "make_params", lambda *args, **kw: None)
    monkeypatch.setattr(kernels, "diff_attention", lambda *args, out, **kw: out.zero_())
    monkeypatch.delenv(kernels.KERNEL_PATH_ENV, raising=False)
    assert kernel_probe.run_child("hopper") == 1
    assert capsys.readouterr().out.strip() == ("failed: DIFFEXPORT_KERNEL_PATH=hopper plans the one-pass kernel, "
                                               "not hopper")
