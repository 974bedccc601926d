"""The form the project's linter holds (pyproject.toml's [tool.ruff]), run by the suite so that CI
runs it: the package, the tests and the tools pass, and the configuration does catch what it names."""

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def _ruff(*args, stdin=None):
    return subprocess.run([sys.executable, "-m", "ruff", *args], cwd=ROOT, capture_output=True, text=True,
                          input=stdin, timeout=120)


def test_the_code_passes_the_projects_linter():
    result = _ruff("check", "diffexport", "tests", "tools")
    assert result.returncode == 0, result.stdout + result.stderr


def test_the_linter_catches_what_its_configuration_names():
    planted = "import os\nx = 1; y = 2\nprint(undefined_name)\n"
    result = _ruff("check", "--stdin-filename", "planted.py", "--output-format", "concise", "-", stdin=planted)
    assert result.returncode == 1
    assert {"F401", "E702", "F821"} <= {part for line in result.stdout.splitlines() for part in line.split()}
