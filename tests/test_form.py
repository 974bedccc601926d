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
    planted = "import os\nx = 1; y = 2\nprint(undefined_name)\n" + f"z = {'1 + ' * 40}1\n"
    result = _ruff("check", "--stdin-filename", "planted.py", "--output-format", "concise", "-", stdin=planted)
    assert result.returncode == 1
    assert {"F401", "E702", "F821", "E501"} <= {part for line in result.stdout.splitlines() for part in line.split()}


def test_the_linter_holds_imports_order_and_complexity():
    planted = ("import sys\nimport os\n\n\ndef f(x):\n    import json\n\n    return json.dumps(x)\n\n\n"
               "def g(x):\n" + "".join(f"    if x == {i}:\n        return {i}\n" for i in range(26))
               + "    return -1\n")
    result = _ruff("check", "--stdin-filename", "diffexport/planted.py", "--output-format", "concise", "-",
                   stdin=planted)
    assert {"I001", "PLC0415", "C901"} <= {part for line in result.stdout.splitlines() for part in line.split()}


def test_the_allowed_in_function_imports_are_optional_dependencies():
    """The files pyproject.toml lets import in a function import only third-party packages there:
    never the standard library (nothing to defer) nor the package's own modules (core/lazy.py)."""
    import ast
    import tomllib

    config = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["ruff"]["lint"]["per-file-ignores"]
    allowed = [path for path, rules in config.items() if "PLC0415" in rules and path.startswith("diffexport/")]
    assert allowed
    found = []
    for path in allowed:
        tree = ast.parse((ROOT / path).read_text())
        for function in [n for n in ast.walk(tree) if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))]:
            for node in ast.walk(function):
                if isinstance(node, ast.Import):
                    modules = [alias.name for alias in node.names]
                elif isinstance(node, ast.ImportFrom):
                    modules = [node.module or ""]
                else:
                    continue
                for module in modules:
                    top = module.split(".")[0]
                    if top in sys.stdlib_module_names or top == "diffexport":
                        found.append(f"{path}:{node.lineno} {module}")
    assert found == []
