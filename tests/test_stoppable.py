"""Native work on strangers' input where it can be stopped (diffexport/core/stoppable.py): a call in a
forked child bounded in CPU time (not wall-clock time), and a diffexport process that ends within
seconds of SIGTERM even while native code holds the interpreter (issue 59, item 1)."""

import os
import signal
import subprocess
import sys
import textwrap
import time

import pytest
from helpers import checkout_env, process_ends

from diffexport.core.errors import DiffExportError
from diffexport.core.stoppable import GRACE_SECONDS, ChildError, call_bounded

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="fork, prctl and RLIMIT_CPU: Linux")


def _spin(seconds_of_cpu_asked):
    while True:  # pure CPU, as a backtracking regular expression is
        pass


def _refuse(message):
    raise DiffExportError(message)


def _fail():
    raise ValueError("broken tokenizer\nsecond line")


def test_a_bounded_call_returns_its_result_and_carries_errors_back():
    parent = os.getpid()
    assert call_bounded(lambda n: [os.getpid() != parent, n * 2], 21, cpu_seconds=5, what="x") == [True, 42]
    with pytest.raises(DiffExportError, match="^the child's own words$"):
        call_bounded(_refuse, "the child's own words", cpu_seconds=5, what="x")
    with pytest.raises(ChildError, match="^ValueError: broken tokenizer$"):
        call_bounded(_fail, cpu_seconds=5, what="x")


def test_a_bounded_call_is_stopped_by_its_cpu_time():
    """One CPU second, however long the machine takes to give it: the child is killed by SIGXCPU,
    one line here, and this process goes on."""
    with pytest.raises(DiffExportError, match=r"^tokenizing 9 characters took more than 1 s of CPU time"):
        call_bounded(_spin, 1, cpu_seconds=1, what="tokenizing 9 characters")
    assert call_bounded(lambda: "still here", cpu_seconds=1, what="x") == "still here"


def test_sigterm_ends_a_process_stuck_in_native_code():
    """A diffexport process whose main thread is inside native code that holds the interpreter (PBKDF2
    with a billion rounds: minutes, no signal check, as a tokenizer's regex is) cannot run its Python
    SIGTERM handler; the watchdog kills it GRACE_SECONDS after the signal. Without the watchdog it
    would end only when the hash was done (and then by the handler's KeyboardInterrupt, not SIGKILL)."""
    script = textwrap.dedent("""
        import hashlib, signal, sys
        from diffexport.core.stoppable import end_within_seconds
        def interrupt(signum, frame):
            raise KeyboardInterrupt
        signal.signal(signal.SIGTERM, interrupt)
        assert end_within_seconds()
        print("armed", flush=True)
        hashlib.pbkdf2_hmac("sha256", b"x", b"salt", 10**9)
    """)
    child = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                             env=checkout_env(), text=True)
    try:
        assert child.stdout.readline().strip() == "armed", child.stderr.read()
        _until_busy_in_native_code(child.pid)  # the signal must find it inside the hash, not before
        child.send_signal(signal.SIGTERM)
        status = child.wait(timeout=GRACE_SECONDS + 60)  # a safety net for a broken watchdog, not a measurement
    finally:
        child.kill()
        child.wait()
    assert status == -signal.SIGKILL


def _cpu_seconds(pid: int) -> float:
    with open(f"/proc/{pid}/stat") as stat:
        fields = stat.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")  # utime + stime


def _until_busy_in_native_code(pid: int) -> None:
    """Wait until the process has spent 0.3 s of CPU after printing "armed": only the hash runs then."""
    start = _cpu_seconds(pid)
    for _ in range(2000):
        if _cpu_seconds(pid) - start >= 0.3:
            return
        time.sleep(0.01)
    pytest.fail("the child never got busy")


def test_an_interrupt_waits_for_the_held_block_and_no_temporary_stays(tmp_path, monkeypatch):
    """An interrupt inside interrupts_held() is raised when the block ends, so a temporary folder is
    either not made or made and known to its cleanup: SIGTERM at the wrong instant left
    `.m.onnx.XXXX.tmp` behind under load."""
    from diffexport.core import stoppable
    from diffexport.core.files import staging_folder

    with pytest.raises(KeyboardInterrupt):
        with stoppable.interrupts_held():
            stoppable.interrupt()  # what SIGTERM calls
            reached = True
    assert reached and not stoppable._pending
    import tempfile

    real_mkdtemp = tempfile.mkdtemp

    def interrupted_mkdtemp(*args, **kwargs):  # the signal lands just as the folder is made
        made = real_mkdtemp(*args, **kwargs)
        stoppable.interrupt()
        return made

    monkeypatch.setattr(tempfile, "mkdtemp", interrupted_mkdtemp)
    with pytest.raises(KeyboardInterrupt):
        with staging_folder(tmp_path / "out"):
            pytest.fail("the block ran after the interrupt")
    monkeypatch.undo()
    assert list(tmp_path.iterdir()) == []


def test_a_process_that_ends_leaves_no_watchdog_behind():
    script = "import diffexport.core.stoppable as s; assert s.end_within_seconds(); print(s._watchdog.pid, flush=True)"
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=checkout_env(),
                         timeout=60)
    assert out.returncode == 0, out.stderr
    helper = int(out.stdout.strip())
    # the helper reads end-of-file when the process is gone
    assert process_ends(helper, polls=400), f"the watchdog {helper} outlived its process"
