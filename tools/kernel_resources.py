"""Registers, stack (spills), static shared memory and key SASS instructions of every kernel in the
built kernel library, read with cuobjdump and nvdisasm (no GPU needed). CI prints it after the
build; tests/test_kernel_build.py checks it (the Hopper path holds wgmma and TMA instructions and
neither it nor the decode kernels spill).

    python tools/kernel_resources.py [--lib build/plugins/kernels/libdiffexport_kernels.so] [--arch sm_90a]

cuobjdump and nvdisasm come from the CUDA toolkit or from the pip wheels nvidia-cuda-cuobjdump and
nvidia-cuda-nvdisasm (found under nvidia/cu*/bin of the Python environment).
"""

from __future__ import annotations

import argparse
import collections
import importlib.util
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

DEFAULT_LIB = Path(__file__).resolve().parent.parent / "build" / "plugins" / "kernels" / "libdiffexport_kernels.so"
# SASS opcodes that say which hardware path a kernel takes.
# PREEXIT and ACQBULK: griddepcontrol.launch_dependents and .wait (programmatic dependent launch).
MARKERS = ("HGMMA", "IGMMA", "UTMALDG", "USETMAXREG", "HMMA", "IMMA", "LDGSTS", "LDSM", "PREEXIT", "ACQBULK")


def find_tool(name: str) -> str | None:
    """A CUDA binary utility on PATH, in $CUDA_HOME/bin, or in an nvidia-cuda-* wheel."""
    found = shutil.which(name)
    if found:
        return found
    home = os.environ.get("CUDA_HOME") or os.environ.get("CUDA_PATH") or "/usr/local/cuda"
    candidates = [Path(home) / "bin" / name]
    spec = importlib.util.find_spec("nvidia")
    for root in (spec.submodule_search_locations or []) if spec else []:
        candidates += sorted(Path(root).glob(f"cu*/bin/{name}"))
    return next((str(c) for c in candidates if c.is_file() and os.access(c, os.X_OK)), None)


def demangle(names: list[str]) -> dict[str, str]:
    filt = shutil.which("c++filt")
    if not filt or not names:
        return {n: n for n in names}
    out = subprocess.run([filt], input="\n".join(names), capture_output=True, text=True).stdout.splitlines()
    return dict(zip(names, out)) if len(out) == len(names) else {n: n for n in names}


def resource_usage(lib: Path) -> list[dict]:
    """One row per (architecture, kernel): registers, stack bytes (spills show here), static shared bytes."""
    tool = find_tool("cuobjdump")
    if tool is None:
        raise RuntimeError("cuobjdump not found (CUDA toolkit, or pip install nvidia-cuda-cuobjdump)")
    text = subprocess.run([tool, "--dump-resource-usage", str(lib)], capture_output=True, text=True, check=True).stdout
    rows, arch, function = [], None, None
    for line in text.splitlines():
        if m := re.search(r"arch = (sm_\w+)", line):
            arch = m.group(1)
        elif m := re.search(r"Function (\S+):", line):
            function = m.group(1)
        elif (m := re.search(r"REG:(\d+) STACK:(\d+) SHARED:(\d+)", line)) and function:
            rows.append({"arch": arch, "mangled": function, "reg": int(m.group(1)), "stack": int(m.group(2)),
                         "shared": int(m.group(3))})
            function = None
    names = demangle(sorted({r["mangled"] for r in rows}))
    for r in rows:
        r["kernel"] = names[r["mangled"]]
    return rows


def sass_markers(lib: Path, arch: str = "sm_90a", exact: tuple[str, ...] = ()) -> dict[str, collections.Counter]:
    """Per kernel (demangled) of one architecture: how many of each MARKERS opcode its SASS holds, and
    of each `exact` opcode with its modifiers (e.g. LDG.E.64)."""
    tool, disasm = find_tool("cuobjdump"), find_tool("nvdisasm")
    if tool is None or disasm is None:
        raise RuntimeError("cuobjdump and nvdisasm not found (CUDA toolkit, or pip install nvidia-cuda-cuobjdump "
                           "nvidia-cuda-nvdisasm)")
    env = {**os.environ, "PATH": f"{Path(disasm).parent}{os.pathsep}{os.environ.get('PATH', '')}"}
    text = subprocess.run([tool, "-sass", "-arch", arch, str(lib)], capture_output=True, text=True, check=True,
                          env=env).stdout
    counts: dict[str, collections.Counter] = {}
    current = None
    for line in text.splitlines():
        if m := re.search(r"Function : (\S+)", line):
            current = counts.setdefault(m.group(1), collections.Counter())
        elif current is not None and (m := re.search(r"/\*[0-9a-f]{4,}\*/\s+(?:@!?U?P\w+\s+)?(([A-Z][A-Z0-9_]*)\S*)",
                                                     line)):
            if m.group(2) in MARKERS:
                current[m.group(2)] += 1
            if m.group(1) in exact:
                current[m.group(1)] += 1
    names = demangle(sorted(counts))
    return {names[k]: v for k, v in counts.items()}


def short(kernel: str) -> str:
    return re.sub(r"\(diffx::KernelArgs\)|\(diffx::sm90::Params<.*>\)$", "", kernel.replace("void diffx::", ""))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--lib", type=Path, default=DEFAULT_LIB)
    parser.add_argument("--arch", default="sm_90a", help="architecture whose rows and SASS markers are printed")
    args = parser.parse_args()
    if not args.lib.is_file():
        print(f"error: {args.lib} not found (build the kernel library first)", file=sys.stderr)
        return 2
    try:
        rows = [r for r in resource_usage(args.lib) if r["arch"] == args.arch]
        markers = sass_markers(args.lib, args.arch)
    except (RuntimeError, subprocess.CalledProcessError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    print(f"{args.lib} ({args.arch}): registers, stack bytes (non-zero = spills), static shared bytes, SASS markers")
    for r in sorted(rows, key=lambda r: r["kernel"]):
        found = markers.get(r["kernel"], collections.Counter())
        marks = " ".join(f"{k}:{found[k]}" for k in MARKERS if found[k])
        print(f"  REG {r['reg']:3d}  STACK {r['stack']:3d}  SHARED {r['shared']:5d}  {short(r['kernel'])[:90]}  "
              f"{marks}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
