"""The package as users install it: the sdist and the wheel built from it (python -m build), the
wheel installed NON-editable into a fresh venv, and that install used from outside the checkout.

The venv is made without the system's site-packages; the wheel goes in with --no-deps and only then
does a .pth line put this interpreter's site-packages (torch, onnxruntime, ...) behind it, so the
dependencies are not downloaded again. A .pth line adds a folder to sys.path without running that
folder's own .pth files, so the editable install of the checkout (an import hook started from a
.pth) stays out: every diffexport module the venv imports comes from the wheel, which the tests
assert file by file. Because the host's test extras sit behind the venv too, the demo runs once more
with every package README command 1 would not install made unimportable (a sitecustomize).
"""

from __future__ import annotations

import importlib.metadata
import os
import shlex
import shutil
import site
import subprocess
import sys
import tarfile
import zipfile
from pathlib import Path

import pytest
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

ROOT = Path(__file__).resolve().parent.parent
pytestmark = pytest.mark.slow

# what a user needs from the sdist to build the kernel library and the TensorRT plugin
SDIST_BUILD_FILES = ("CMakeLists.txt", "plugins/CMakeLists.txt", "plugins/kernels/CMakeLists.txt",
                     "plugins/kernels/diff_attention.cu", "plugins/kernels/diff_attention.h",
                     "plugins/tensorrt/CMakeLists.txt", "plugins/tensorrt/DiffAttentionPlugin.cpp",
                     "pyproject.toml", "setup.py")


def _tracked_files() -> list[str]:
    out = subprocess.run(["git", "ls-files", "-co", "--exclude-standard"], cwd=ROOT, capture_output=True, text=True)
    if out.returncode != 0:
        pytest.skip("not a git checkout: the test builds from the checkout's tracked files")
    return [f for f in out.stdout.splitlines() if (ROOT / f).is_file()]


def _module_names(package_dir: Path) -> set[str]:
    """diffexport.* module names of a package folder's .py files (__main__ left out: it runs the CLI)."""
    names = set()
    for path in package_dir.rglob("*.py"):
        parts = path.relative_to(package_dir.parent).with_suffix("").parts
        if parts[-1] == "__main__":
            continue
        names.add(".".join(parts[:-1] if parts[-1] == "__init__" else parts))
    return names


def _installed_closure(roots: list[Requirement]) -> set[str]:
    """Canonical names of the distributions that installing `roots` pulls in, read from this
    interpreter's installed metadata (each requirement's markers evaluated with its own extras)."""
    seen: set[str] = set()
    pending = [(req, "") for req in roots]
    while pending:
        req, extra = pending.pop()
        if req.marker is not None and not req.marker.evaluate({"extra": extra}):
            continue
        name = canonicalize_name(req.name)
        for wanted in [""] + sorted(req.extras):
            if (name, wanted) in seen:
                continue
            seen.add((name, wanted))
            try:
                requires = importlib.metadata.requires(name) or []
            except importlib.metadata.PackageNotFoundError:
                continue  # a platform-only dependency not installed here, so nothing can import it
            pending += [(Requirement(line), wanted) for line in requires]
    return {name for name, _ in seen}


def _onnx_install_blocker(wheel: Path, site_dir: Path) -> Path:
    """A sitecustomize that makes unimportable every installed package that README command 1
    (`pip install torch==2.13.0 ".[onnx]"`) would not install: the host's test extras (transformers,
    tokenizers, matplotlib, ...) must not be what lets the demo pass."""
    with zipfile.ZipFile(wheel) as archive:
        metadata = next(n for n in archive.namelist() if n.endswith(".dist-info/METADATA"))
        lines = archive.read(metadata).decode().splitlines()
    requires = [Requirement(line.split(":", 1)[1]) for line in lines if line.startswith("Requires-Dist:")]
    roots = [Requirement("torch==2.13.0")] + [Requirement(f"{r.name}{r.specifier}") for r in requires
                                                if r.marker is None or r.marker.evaluate({"extra": "onnx"})]
    allowed = _installed_closure(roots) | {"diffexport"}
    blocked = sorted(module for module, dists in importlib.metadata.packages_distributions().items()
                     if module.isidentifier() and not any(canonicalize_name(d) in allowed for d in dists))
    site_dir.mkdir(parents=True, exist_ok=True)
    (site_dir / "sitecustomize.py").write_text(  # None in sys.modules: `import` raises ModuleNotFoundError
        f"import sys\nfor _name in {blocked!r}:\n    sys.modules[_name] = None\n")
    return site_dir


def _clean_env(venv: Path) -> dict:
    """The environment a user's shell gives the venv: its bin first, no PYTHONPATH to the checkout."""
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONHOME", "VIRTUAL_ENV")}
    env["PATH"] = os.pathsep.join([str(venv / "bin"), env.get("PATH", "")])
    env["VIRTUAL_ENV"] = str(venv)
    return env


def _run(args, **kwargs) -> subprocess.CompletedProcess:
    out = subprocess.run(list(map(str, args)), capture_output=True, text=True, timeout=600, **kwargs)
    assert out.returncode == 0, (f"{' '.join(map(str, args))} exited {out.returncode}:\n{out.stdout[-3000:]}\n"
                                 f"{out.stderr[-3000:]}")
    return out


@pytest.fixture(scope="module")
def built(tmp_path_factory) -> dict:
    """The sdist and the wheel built from it, from a copy of the checkout's tracked files (the
    build writes egg-info and build/ into its source; the checkout stays untouched)."""
    pytest.importorskip("build")
    base = tmp_path_factory.mktemp("wheel")
    source = base / "source"
    for name in _tracked_files():
        (source / name).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(ROOT / name, source / name)
    dist = base / "dist"
    # sdist first, then the wheel from the unpacked sdist: a file the sdist leaves out fails the wheel
    _run([sys.executable, "-m", "build", "--sdist", "--wheel", "--outdir", dist, source])
    sdists, wheels = sorted(dist.glob("*.tar.gz")), sorted(dist.glob("*.whl"))
    assert len(sdists) == 1 and len(wheels) == 1, sorted(p.name for p in dist.iterdir())
    return {"sdist": sdists[0], "wheel": wheels[0], "base": base}


@pytest.fixture(scope="module")
def venv(built) -> Path:
    """A fresh venv with the wheel installed non-editable, then the dependencies put behind it."""
    venv = built["base"] / "venv"
    _run([sys.executable, "-m", "venv", venv])
    python = venv / "bin" / "python"
    _run([python, "-m", "pip", "install", "-q", "--no-deps", "--no-index", built["wheel"]],
         env=_clean_env(venv))
    venv_site = Path(_run([python, "-c", "import sysconfig; print(sysconfig.get_path('purelib'))"],
                          env=_clean_env(venv)).stdout.strip())
    (venv_site / "zz_host_dependencies.pth").write_text("\n".join(site.getsitepackages()) + "\n")
    return venv


def test_wheel_version_is_the_package_version(built):
    from diffexport import __version__

    assert built["wheel"].name.startswith(f"diffexport-{__version__}-"), built["wheel"].name
    assert built["sdist"].name == f"diffexport-{__version__}.tar.gz"


def test_wheel_holds_every_module_of_the_package(built):
    with zipfile.ZipFile(built["wheel"]) as wheel:
        names = wheel.namelist()
    in_wheel = {n for n in names if n.startswith("diffexport/") and n.endswith(".py")}
    in_tree = {p.relative_to(ROOT).as_posix() for p in (ROOT / "diffexport").rglob("*.py")}
    assert in_tree - in_wheel == set(), "modules of the checkout missing from the wheel"
    zoo = {n for n in names if n.startswith("diffexport/_zoo/")}
    # the zoo whole: preset JSON files and the trained presets' folders (weights, tokenizer, template)
    shipped = {f"diffexport/_zoo/{p.relative_to(ROOT / 'models').as_posix()}" for p in (ROOT / "models").rglob("*")
               if p.is_file() and "__pycache__" not in p.parts}
    assert shipped - zoo == set(), "zoo files missing from the wheel"


def test_sdist_carries_what_builds_the_kernels_and_plugin(built):
    with tarfile.open(built["sdist"]) as sdist:
        top = sdist.getnames()[0].split("/")[0]
        names = {n.split("/", 1)[1] for n in sdist.getnames() if "/" in n}
    missing = [f for f in SDIST_BUILD_FILES if f not in names]
    assert not missing, f"the sdist {top} lacks {missing}"
    tracked_plugins = {f for f in _tracked_files() if f.startswith(("plugins/", "models/"))}
    assert tracked_plugins - names == set(), "tracked plugin or zoo files missing from the sdist"


def test_installed_wheel_imports_every_module_from_itself(venv):
    expected = sorted(_module_names(ROOT / "diffexport"))
    script = (
        "import importlib, pkgutil, sys, diffexport\n"
        "names = [m.name for m in pkgutil.walk_packages(diffexport.__path__, 'diffexport.')"
        " if not m.name.endswith('__main__')] + ['diffexport']\n"
        "for name in names:\n"
        "    module = importlib.import_module(name)\n"
        "    assert module.__file__.startswith(sys.prefix), (name, module.__file__)\n"
        "print('\\n'.join(sorted(names)))\n")
    out = _run([venv / "bin" / "python", "-c", script], env=_clean_env(venv), cwd=venv)
    assert sorted(out.stdout.split()) == expected


def test_installed_console_script_help_and_demo(built, venv, tmp_path):
    env = _clean_env(venv)
    script = venv / "bin" / "diffexport"
    assert script.is_file()
    help_text = _run([script, "--help"], env=env, cwd=tmp_path).stdout
    assert "demo" in help_text and "triton" in help_text
    assert "diff-v1-tiny" in _run([script, "presets"], env=env, cwd=tmp_path).stdout  # the zoo, from the wheel
    # the demo (README command 1) as the installed script runs it: every step passes, and the files
    # stay, so each polygraphy command it printed runs as printed
    demo = _run([script, "demo", "--out-dir", tmp_path / "demo"], env=env, cwd=tmp_path)
    assert "preset        diff-text-tiny" in demo.stdout and "4 DiffAttention" in demo.stdout
    assert "PASS" in demo.stdout and "error" not in demo.stderr and "Traceback" not in demo.stderr
    assert "generated     '" in demo.stdout and "eager generate identical" in demo.stdout
    commands = [line.split(None, 1)[1] for line in demo.stdout.splitlines() if line.startswith("polygraphy ")]
    assert len(commands) == 2 and (tmp_path / "demo" / "model-kv" / "model.onnx").is_file()
    polygraphy = shutil.which("polygraphy", path=env["PATH"]) or pytest.skip("no polygraphy on PATH")
    for command in commands:
        args = shlex.split(command)
        assert args[:2] == ["polygraphy", "run"]
        out = subprocess.run([polygraphy, *args[1:]], cwd=tmp_path, capture_output=True, text=True, timeout=300)
        assert out.returncode == 0 and "PASSED" in out.stdout + out.stderr, out.stdout[-2000:] + out.stderr[-2000:]
    # again, with only what README command 1 installs importable: it replaces its own earlier files
    only_onnx = dict(env, PYTHONPATH=str(_onnx_install_blocker(built["wheel"], tmp_path / "only-onnx")))
    probe = subprocess.run([venv / "bin" / "python", "-c", "import transformers"], env=only_onnx, cwd=tmp_path,
                           capture_output=True, text=True)
    assert probe.returncode != 0 and "ModuleNotFoundError" in probe.stderr, probe.stderr  # the blocker holds
    again = _run([script, "demo", "--out-dir", tmp_path / "demo"], env=only_onnx, cwd=tmp_path)
    assert "transformers not installed" in again.stdout and "eager generate identical" in again.stdout

    # a Triton repository written by the installed package, its model.py loaded by the venv's Python
    _run([script, "triton", tmp_path / "demo" / "model-kv", "-o", tmp_path / "repo", "--name", "tiny"],
         env=env, cwd=tmp_path)
    model_py = tmp_path / "repo" / "tiny" / "1" / "model.py"
    load = ("import importlib.util, sys\n"
            f"spec = importlib.util.spec_from_file_location('model', {str(model_py)!r})\n"
            "module = importlib.util.module_from_spec(spec); spec.loader.exec_module(module)\n"
            "import diffexport.serving.triton_model as served\n"
            "assert module.TritonPythonModel is served.TritonPythonModel\n"
            "assert served.__file__.startswith(sys.prefix), served.__file__\n"
            "print('loaded', served.__file__)\n")
    assert "loaded" in _run([venv / "bin" / "python", "-c", load], env=env, cwd=tmp_path).stdout
