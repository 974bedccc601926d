"""The emulator's fibers (plugins/kernels/emulation/fibers.h: a block's CUDA threads switched at
their barriers on one OS thread) on their own, through fibers_check.cpp, with each of its switches:
the assembly one the emulator uses on x86-64 and AArch64, and POSIX swapcontext, the fallback
elsewhere, which no other test builds."""

import os
import shutil
import subprocess
from pathlib import Path

import pytest

EMULATION = Path(__file__).resolve().parent.parent / "plugins" / "kernels" / "emulation"
FACTS = 4  # lines fibers_check prints a run; it runs three times (ascending, descending, ascending)


@pytest.fixture(scope="module", params=["assembly", "ucontext"])
def fibers_check(request, tmp_path_factory):
    compiler = shutil.which(os.environ.get("CXX", "c++"))
    if compiler is None:
        pytest.skip("no C++ compiler")
    exe = tmp_path_factory.mktemp("fibers") / "fibers_check"
    build = subprocess.run([compiler, "-O2", "-std=c++20", "-Wall", "-Werror",
                            f"-DDIFFX_EMU_FIBER_UCONTEXT={int(request.param == 'ucontext')}",
                            str(EMULATION / "fibers_check.cpp"), "-o", str(exe)], capture_output=True, text=True)
    assert build.returncode == 0, build.stderr[-3000:]
    return exe


def test_fibers_meet_at_their_barriers_and_keep_their_own_stacks(fibers_check):
    run = subprocess.run([str(fibers_check)], capture_output=True, text=True, timeout=60)
    lines = run.stdout.splitlines()
    assert run.returncode == 0 and len(lines) == 3 * FACTS, run.stdout + run.stderr
    assert all(line.startswith("ok ") for line in lines), run.stdout


def test_a_barrier_some_threads_never_reach_is_one_line_not_a_hang(fibers_check):
    run = subprocess.run([str(fibers_check), "deadlock"], capture_output=True, text=True, timeout=60)
    assert run.returncode != 0
    assert run.stderr.strip().splitlines() == [
        "diffexport emulator: every unfinished thread of the block waits at a barrier that the others do not reach "
        "(a GPU hangs)"]
