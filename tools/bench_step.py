"""One decode step of two KV-cache folders side by side in onnxruntime (CPU): an A/B of a graph change.

Both graphs get the same feeds (batch 1, one new token after --past cached ones) and run in
interleaved rounds (A then B, then B then A, ...) so that drift on a shared machine hits both;
the table gives the median step time of each, the ratio, the kernels onnxruntime runs after its
load-time fusions, and the largest logit difference between the two.

    python tools/bench_step.py BEFORE_FOLDER AFTER_FOLDER [--past 192] [--threads 1 2] [--rounds 40]
"""

from __future__ import annotations

import argparse
import collections
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
import benchdoc  # noqa: E402

DIMS = {"batch": 1, "sequence": 1}


def session(model: Path, threads: int, optimized: Path | None = None):
    import onnxruntime as ort

    options = ort.SessionOptions()
    options.intra_op_num_threads = threads
    if optimized is not None:
        options.optimized_model_filepath = str(optimized)
    return ort.InferenceSession(str(model), options, providers=["CPUExecutionProvider"])


def loaded_kernels(model: Path) -> collections.Counter:
    """The node types onnxruntime runs after its load-time optimisations."""
    import onnx

    with tempfile.TemporaryDirectory() as tmp:
        optimized = Path(tmp) / "loaded.onnx"
        session(model, 1, optimized)
        return collections.Counter(n.op_type for n in onnx.load(str(optimized), load_external_data=False).graph.node)


def feeds_for(sess, past: int) -> dict[str, np.ndarray]:
    dims = {**DIMS, "past_sequence": past, "total_sequence": past + 1}
    rng = np.random.default_rng(0)
    feeds = {}
    for value in sess.get_inputs():
        shape = [dims[d] if isinstance(d, str) else d for d in value.shape]
        if value.type == "tensor(int64)":
            feeds[value.name] = np.ones(shape, np.int64)
        else:
            feeds[value.name] = rng.standard_normal(shape).astype(np.float32)
    return feeds


def wall_seconds(fn) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("before", type=Path)
    parser.add_argument("after", type=Path)
    parser.add_argument("--past", type=int, default=192)
    parser.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--rounds", type=int, default=40)
    args = parser.parse_args()
    models = [folder / "model.onnx" for folder in (args.before, args.after)]
    for model in models:
        if not model.is_file():
            print(f"error: {model} not found: give two KV-cache folders (diffexport onnx --kv-cache)", file=sys.stderr)
            return 2
    kernels = [loaded_kernels(m) for m in models]
    print(benchdoc.stamp())
    print(f"One decode step (batch 1, past {args.past}), medians of {args.rounds} interleaved rounds.\n")
    print("| threads | before ms | after ms | before / after | kernels before | kernels after | max logit diff |")
    print("|---:|---:|---:|---:|---:|---:|---:|")
    for threads in args.threads:
        sessions = [session(m, threads) for m in models]
        feeds = feeds_for(sessions[0], args.past)
        logits = [s.run(["logits"], feeds)[0] for s in sessions]
        steps = {"before": lambda s=sessions[0]: s.run(None, feeds), "after": lambda s=sessions[1]: s.run(None, feeds)}
        medians = benchdoc.interleaved_medians(steps, 0, args.rounds, wall_seconds)
        before, after = medians["before"] * 1e3, medians["after"] * 1e3
        diff = float(np.abs(logits[0] - logits[1]).max())
        print(f"| {threads} | {before:.2f} | {after:.2f} | {before / after:.3f} | {sum(kernels[0].values())} | "
              f"{sum(kernels[1].values())} | {diff:.2e} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
