"""Shared by the benchmark tools: hardware/commit stamp, timing in interleaved rounds, replacing a tool's
section in docs/BENCHMARKS.md, and which timing of a saved case is the best composition."""

from __future__ import annotations

import datetime
import os
import platform
import re
import statistics
import subprocess
from pathlib import Path

from diffexport.backends.speed import cpu_name  # noqa: F401 (the tools' name)

DOC = Path(__file__).resolve().parent.parent / "docs" / "BENCHMARKS.md"
# The name under which a run times this build's Hopper call a second time, as a method of its own:
# the control whose ratio is the loop's noise for identical code (bench_attention.py, campaign_report.py).
CONTROL_BUILD = "again"
MAX_RESULT_BYTES = 64 << 20  # a result file a campaign brings back: a run call returns files of at most 16 MiB
HEADER = """# Benchmarks

Every table here is written by a tool in `tools/`, with the command that produced it, the date,
the hardware and the commit. Rerun the command to refresh a section; the tool replaces it.
Nothing here is a test: tests never time anything.
"""


def stamp() -> str:
    """Date, hardware, software and commit, as one markdown paragraph."""
    import torch

    try:
        commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                                cwd=DOC.parent, check=True).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], capture_output=True,
                               text=True, cwd=DOC.parent).stdout.strip()
        commit += " (with uncommitted changes)" if dirty else ""
    except (OSError, subprocess.CalledProcessError):
        commit = "unknown"
    try:
        import onnxruntime

        ort = f", onnxruntime {onnxruntime.__version__}"
    except ImportError:
        ort = ""
    memory = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 1024**3
    gpu = ""
    if torch.cuda.is_available():
        major, minor = torch.cuda.get_device_capability()
        gpu = f"GPU {torch.cuda.get_device_name()} (sm_{major}{minor}, CUDA {torch.version.cuda}); "
    return (f"Date {datetime.date.today().isoformat()}; {gpu}{cpu_name()}, {os.cpu_count()} cores, {memory:.0f} GiB; "
            f"torch {torch.__version__}{ort}, Python {platform.python_version()}; commit {commit}.")


def interleaved_medians(methods: dict, warmup: int, repeats: int, time_one, failures: tuple = (),
                        left_out=None) -> dict:
    """The median of time_one(fn) for each method, measured in rounds: each round times every method
    once, starting one method later than the round before (two methods: A B, B A, ...). A machine's
    clocks, temperature and neighbours drift over a loop; timed one method after another, that drift
    fell on the methods timed last (identical code read 0.99-1.09x in one H200 loop, 2026-11-28),
    where in rounds it falls on all of them alike. `warmup` untimed rounds come first. A method that
    raises one of `failures` is left out from then on, left_out(name, exc) told why."""
    live = dict(methods)

    def call(name, fn):
        try:
            return fn()
        except failures as exc:
            live.pop(name, None)
            if left_out:
                left_out(name, exc)
            return None

    for _ in range(warmup):
        for name, fn in list(live.items()):
            call(name, fn)
    times = {name: [] for name in live}
    for round_index in range(repeats):
        names = list(live)
        if not names:
            break
        start = round_index % len(names)
        for name in names[start:] + names[:start]:
            if name in live:
                measured = call(name, lambda fn=live[name]: time_one(fn))
                if measured is not None:
                    times[name].append(measured)
    return {name: statistics.median(times[name]) for name in live if times[name]}


def best_composition(timings: dict) -> tuple[str, dict] | None:
    """The fastest composition of one case: FlashDiffAttn_1/_2 on a backend ("flash_diff_1/cudnn") or
    the naive form; never one of our kernels (fused*, split_kv*, one_pass) nor another build ("@NAME")."""
    comps = [(name, t) for name, t in timings.items() if ("/" in name or name == "naive") and "@" not in name]
    return min(comps, key=lambda item: item[1]["ms"]) if comps else None


def write_section(key: str, body: str) -> Path:
    """Replace (or append) the section between the markers of `key` in docs/BENCHMARKS.md."""
    start, end = f"<!-- bench:{key} -->", f"<!-- /bench:{key} -->"
    text = DOC.read_text() if DOC.exists() else HEADER
    block = f"{start}\n{body.rstrip()}\n{end}"
    pattern = re.compile(re.escape(start) + ".*?" + re.escape(end), re.S)
    text = pattern.sub(lambda _: block, text) if pattern.search(text) else text.rstrip() + "\n\n" + block + "\n"
    DOC.write_text(text)
    return DOC


def op_profile(session, steps: int) -> tuple[float, int, list]:
    """End an onnxruntime session's profiling (enable_profiling, `steps` identical runs) and sum its
    kernel times by op type: (us per step, nodes per step, [(op type, us per step, nodes per step)]
    by time)."""
    import collections
    import json

    events = json.loads(Path(session.end_profiling()).read_text())
    times, counts = collections.Counter(), collections.Counter()
    for e in events:
        if e.get("cat") == "Node" and e["name"].endswith("_kernel_time"):
            times[e["args"]["op_name"]] += e["dur"]
            counts[e["args"]["op_name"]] += 1
    total = sum(times.values()) / steps
    return total, sum(counts.values()) // steps, [(op, t / steps, counts[op] // steps) for op, t in times.most_common()]
