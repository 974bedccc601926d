"""A tool of tools/ run through its main(argv) in the test's own process: a fresh interpreter costs a
torch import (about 2.5 s on a CI machine) before the tool reads a byte, and the report tools' tests
call them some thirty times. The scripts themselves still start from a shell in the tests that run
them so (test_gpu_campaign_env, the campaign's dry runs)."""

import contextlib
import importlib
import io
import subprocess
import sys
from pathlib import Path

TOOLS = Path(__file__).resolve().parent.parent / "tools"


def tool_module(name: str):
    """tools/<name>.py imported as a module (the folder on sys.path for the import alone: each tool
    puts it there itself for its siblings)."""
    sys.path.insert(0, str(TOOLS))
    try:
        return importlib.import_module(name)
    finally:
        sys.path.remove(str(TOOLS))


def run_tool(name: str, *args: str) -> subprocess.CompletedProcess:
    """tools/<name>.py's main(list(args)): its exit status, stdout and stderr, as subprocess.run with
    capture_output=True, text=True returns them (argparse's SystemExit is the status)."""
    module = tool_module(name)
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            status = module.main(list(args))
        except SystemExit as stop:
            status = stop.code if isinstance(stop.code, int) else int(stop.code is not None)
    return subprocess.CompletedProcess([name, *args], status, out.getvalue(), err.getvalue())
