"""Native code run on a stranger's input where it can be stopped: a forked child under a CPU-time
limit, and a process that ends within seconds of SIGTERM or Ctrl-C whatever it is doing.

Why: the tokenizer libraries match regular expressions in native code that holds the interpreter
and that no signal interrupts. A pattern the guard lets through (format/tokenizer_rules.py refuses
the exponential ones; polynomial ones such as `\\s*\\s*$` are left, and GPT-2's own `\\s+(?!\\S)` is
quadratic) can take minutes on a few hundred characters. So the encoding runs in a child forked for
the call (it shares the loaded tokenizer, nothing is loaded again), limited in CPU seconds, not in
wall-clock seconds: a busy machine slows a child down, it never makes one fail. The parent waits
in Python, so SIGTERM reaches it, and the child dies with its parent.

The watchdog covers the rest: a process stuck in other native code (a library call that holds the
interpreter) cannot run its Python SIGTERM handler. The C-level handler still writes the signal's
number to a pipe (signal.set_wakeup_fd); a small helper process reading that pipe gives the
process GRACE_SECONDS to clean up and exit, then kills it. The helper leaves when the pipe closes
(the process ended), and ignores the signals sent to the whole process group.
"""

from __future__ import annotations

import contextlib
import ctypes
import math
import os
import pickle
import resource
import signal
import subprocess
import sys
from typing import Callable

from diffexport.core.errors import DiffExportError

GRACE_SECONDS = 6  # between SIGTERM (or Ctrl-C) and SIGKILL, for a process that cannot run its handler
PR_SET_PDEATHSIG = 1  # linux/prctl.h
# CPU time a tokenisation may take: a floor for short texts, then time per character, over 100x what
# the tokenizers here need (0.4 us a character for onnxruntime-genai's BPE, 0.8 for transformers').
CPU_SECONDS_FLOOR = 2.0
CPU_SECONDS_PER_CHAR = 1e-4


def cpu_seconds_for(chars: int) -> float:
    """The CPU time a tokenizer may spend on a text of `chars` characters."""
    return CPU_SECONDS_FLOOR + chars * CPU_SECONDS_PER_CHAR


def _can_fork() -> bool:
    return sys.platform.startswith("linux") and hasattr(os, "fork")


def die_with_parent(sig: int) -> None:
    """Linux: this process gets `sig` when the thread that started it ends (prctl PR_SET_PDEATHSIG)."""
    try:
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, int(sig), 0, 0, 0)
    except (OSError, AttributeError):  # no prctl here: the CPU limit still ends the child
        pass


class ChildError(Exception):
    """An exception the child raised, carried back as its type name and first line."""


def _child(fn: Callable, args: tuple, cpu_seconds: float, write_fd: int, parent: int) -> None:
    try:
        signal.set_wakeup_fd(-1)  # the parent's watchdog pipe is the parent's
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, signal.SIG_DFL)
    except ValueError:  # forked from a thread the interpreter does not take for its main one
        pass
    die_with_parent(signal.SIGKILL)
    if os.getppid() != parent:  # the parent died before prctl took effect
        os._exit(1)
    limit = max(1, math.ceil(cpu_seconds))  # a forked child's CPU time starts at zero
    resource.setrlimit(resource.RLIMIT_CPU, (limit, limit + 1))  # SIGXCPU, then SIGKILL
    try:
        result = ("ok", fn(*args))
    except DiffExportError as exc:
        result = ("refused", str(exc))
    except BaseException as exc:  # noqa: BLE001 - carried to the parent, which words it
        result = ("error", f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}")
    try:
        payload = pickle.dumps(result)
    except Exception as exc:  # noqa: BLE001
        payload = pickle.dumps(("error", f"unpicklable result: {exc}"))
    view = memoryview(payload)
    while view:
        view = view[os.write(write_fd, view):]
    os.close(write_fd)


def call_bounded(fn: Callable, *args, cpu_seconds: float, what: str):
    """fn(*args) in a forked child limited to `cpu_seconds` of CPU time; its result (picklable)
    back here. Over the limit: one DiffExportError naming `what`. The child's DiffExportError is
    raised again here; any other exception comes back as ChildError (its type and first line), for
    the caller to word. Ctrl-C or SIGTERM here kills the child. Where fork is not available (not
    Linux), fn runs here, unbounded."""
    if not _can_fork():
        return fn(*args)
    sys.stdout.flush()
    sys.stderr.flush()
    read_fd, write_fd = os.pipe()
    parent = os.getpid()
    pid = os.fork()
    if pid == 0:  # pragma: no cover - the child; coverage does not follow a fork
        code = 0
        try:
            os.close(read_fd)
            _child(fn, args, cpu_seconds, write_fd, parent)
        except BaseException:  # noqa: BLE001 - nothing may escape into the parent's code
            code = 1
        finally:
            os._exit(code)
    os.close(write_fd)
    chunks, done = [], False
    try:
        while True:
            chunk = os.read(read_fd, 1 << 20)
            if not chunk:
                break
            chunks.append(chunk)
        _, status = os.waitpid(pid, 0)
        done = True
    finally:
        os.close(read_fd)
        if not done:  # interrupted here: the child goes too
            try:
                os.kill(pid, signal.SIGKILL)
                os.waitpid(pid, 0)
            except (ProcessLookupError, ChildProcessError):
                pass
    if os.WIFSIGNALED(status) and os.WTERMSIG(status) in (signal.SIGXCPU, signal.SIGKILL):
        raise DiffExportError(f"{what} took more than {math.ceil(cpu_seconds)} s of CPU time: the tokenizer's "
                              "regular expressions backtrack on this text; shorten it or use another tokenizer")
    if not chunks:
        how = (f"signal {os.WTERMSIG(status)}" if os.WIFSIGNALED(status) else f"exit {os.WEXITSTATUS(status)}")
        raise ChildError(f"the process running it ended ({how})")
    kind, value = pickle.loads(b"".join(chunks))  # our own child's bytes
    if kind == "refused":
        raise DiffExportError(value)
    if kind == "error":
        raise ChildError(value)
    return value


# -- interrupts held back while a temporary file is made -----------------------------------------
_held = 0  # nesting depth of interrupts_held()
_pending = False  # an interrupt came while held


def interrupt(signum=None, frame=None):
    """The handler of SIGTERM (and Ctrl-C): KeyboardInterrupt, so every cleanup runs; inside
    interrupts_held() it is raised when the block ends instead."""
    global _pending
    if _held:
        _pending = True
        return
    raise KeyboardInterrupt


@contextlib.contextmanager
def interrupts_held():
    """A block an interrupt does not cut in two: a temporary file or folder made and its name bound
    for cleanup. (Masking the signal would not do: Python runs its handlers in the main thread at
    its next check whichever thread the signal reached.) The interrupt is raised when the block ends."""
    global _held, _pending
    _held += 1
    try:
        yield
    finally:
        _held -= 1
        if not _held and _pending:
            _pending = False
            raise KeyboardInterrupt


def install_interrupt_handlers() -> None:
    """SIGTERM and SIGINT through interrupt() (main thread only; elsewhere signals are left alone)."""
    try:
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, interrupt)
    except ValueError:  # not the main thread
        pass


# -- ending within seconds ---------------------------------------------------------------------
_watchdog: subprocess.Popen | None = None

# The helper: wait for one byte (a signal arrived) or EOF (the process ended); after a byte, wait up
# to GRACE_SECONDS for EOF, else SIGKILL the process. TERM, INT and HUP are ignored: a signal to the
# process group must not take the helper first.
_WATCHDOG_SCRIPT = (
    "trap '' TERM INT HUP; "
    "x=$(head -c1 | od -An -tu1); [ -n \"$x\" ] || exit 0; "
    "timeout {grace} cat >/dev/null; [ $? -eq 124 ] && kill -KILL {pid}; exit 0"
)


def end_within_seconds() -> bool:
    """Arm the watchdog for this process (main thread only, Linux, once): after SIGTERM or SIGINT it
    is killed GRACE_SECONDS later if its handlers have not ended it. -> whether it is armed."""
    global _watchdog
    if _watchdog is not None:
        return True
    if not _can_fork():
        return False
    read_fd, write_fd = os.pipe()  # both close on exec: only the helper gets the read end, as its stdin
    try:
        os.set_blocking(write_fd, False)
        signal.set_wakeup_fd(write_fd, warn_on_full_buffer=False)
    except ValueError:  # not the main thread
        os.close(read_fd)
        os.close(write_fd)
        return False
    script = _WATCHDOG_SCRIPT.format(grace=GRACE_SECONDS, pid=os.getpid())
    try:
        _watchdog = subprocess.Popen(["/bin/sh", "-c", script], stdin=read_fd, stdout=subprocess.DEVNULL,
                                     stderr=subprocess.DEVNULL)
    except OSError:  # no /bin/sh: the Python handlers alone
        signal.set_wakeup_fd(-1)
        os.close(write_fd)
        os.close(read_fd)
        return False
    os.close(read_fd)
    return True
