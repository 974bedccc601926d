"""Peak memory and time of `diffexport onnx` on a big preset (default: the paper's 3B).

    python tools/bench_export.py [--preset diff-v1-3b] [--fp16] [--write]

Runs the real command in a child process and reads the child's peak resident set size from
the kernel (getrusage RUSAGE_CHILDREN), so the number includes everything the export holds:
the model, the traced program and the writer. Target: peak RSS <= 1.5x the exported weight bytes.
"""

from __future__ import annotations

import argparse
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import benchdoc  # noqa: E402


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--preset", default="diff-v1-3b")
    parser.add_argument("--fp16", action="store_true")
    parser.add_argument("--dir", help="where to write the export (default: a temporary folder, removed after)")
    parser.add_argument("--write", action="store_true", help="replace the section in docs/BENCHMARKS.md")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(dir=args.dir) as tmp:
        out = Path(tmp) / "model.onnx"
        command = [sys.executable, "-m", "diffexport", "onnx", "--preset", args.preset, "-o", str(out)]
        command += ["--fp16"] if args.fp16 else []
        start = time.monotonic()
        result = subprocess.run(command, capture_output=True, text=True)
        wall = time.monotonic() - start
        if result.returncode != 0:
            print(result.stderr, file=sys.stderr)
            return result.returncode
        peak = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss * 1024  # kB on Linux
        files = [out, out.with_name(out.name + ".data")]
        weight_bytes = sum(p.stat().st_size for p in files if p.exists())
        export_line = next(line for line in result.stdout.splitlines() if line.startswith("exported"))
        export_seconds = float(export_line.rsplit(", ", 1)[1].rstrip("s)"))
    dtype = "fp16" if args.fp16 else "fp32"
    row = (f"| {args.preset} | {dtype} | {weight_bytes / 1e9:.2f} GB | {peak / 1e9:.2f} GB | "
           f"{peak / weight_bytes:.2f}x | {wall:.0f} s | {export_seconds:.0f} s |")
    text = ("| preset | dtype | written (onnx + data) | peak RSS | peak / written | wall, whole command | "
            "export after load |\n|---|---|---|---|---|---|---|\n" + row)
    print(text)
    if args.write:
        shown = "python tools/bench_export.py " + " ".join(sys.argv[1:])
        body = (f"## Export of a large model: peak memory and time\n\n`{shown}`\n\n{benchdoc.stamp()} "
                "The whole command runs in a child process: random-weight init of the preset (single-threaded "
                "normal draws), tracing, writing with external data, `onnx.checker` full check. "
                f"Target: peak RSS <= 1.5x the written bytes.\n\n{text}\n")
        print(f"wrote {benchdoc.write_section(f'export-{args.preset}-{dtype}', body)}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
