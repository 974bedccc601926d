"""Batched decode on CPU: how onnxruntime-genai's throughput grows with the batch for our two
KV-cache folder kinds, beside onnxruntime-genai's builder Llama of the same size.

    python tools/bench_batch.py [--batches 1 2 4 8] [--prompt 128] [--new 64] [--rounds 3]
                                [--weights fp32|int4] [--anchor] [--write]

Models (greedy, seeded random weights): diff-v1-110m exported with --kv-cache (DiffAttention) and
with --attention gqa; with --anchor, llama-100m written by onnxruntime-genai's model builder (the
same shape). --weights int4: our folders through `diffexport quantize` (block 32, RTN, accuracy level
4) and the builder's `-p int4`. Every genai_config gets intra_op_num_threads = the machine's cores.
Each batch holds B different prompts of --prompt tokens (no padding: this measures the batch, not
the padding) and every row generates --new tokens (genai's min_length), through
diffexport.backends.decoding.generate_batch_genai, what `diffexport generate --prompts-file` runs.
Decode tokens/s = every row's tokens after its first / the time after the prefill; rounds are
interleaved after a warm-up, medians reported.
Bound: a decode step reads the weights once for the whole batch and each row's cache, so
bound = B x read bandwidth / (weight bytes + B x cache bytes at the mean past length); bandwidth is
onnxruntime's own GEMV (tools/bench_decode.py), the median of probes before the first round and after
each. It ignores compute, which a large batch meets first on a CPU. --write replaces the section in
docs/BENCHMARKS.md and draws docs/img/decode-batch[-int4].png.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
import bench_context  # noqa: E402
import bench_decode  # noqa: E402
import benchdoc  # noqa: E402

from diffexport.backends import decoding  # noqa: E402
from diffexport.checkpoint import load_model  # noqa: E402
from diffexport.export.decoder import cache_width, export_decoder  # noqa: E402
from diffexport.generation import Sampling  # noqa: E402
from diffexport.passes.weight_quant import WeightQuantOptions, quantize_weights  # noqa: E402

PRESET = "diff-v1-110m"
IMG = Path(__file__).resolve().parent.parent / "docs" / "img"


def plot(results: dict[str, dict[int, float]], bounds: dict[int, float], path: Path, weights: str) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.2))
    for name, by_batch in results.items():
        xs = sorted(by_batch)
        ax.plot(xs, [by_batch[x] for x in xs], marker="o", label=name)
    xs = sorted(bounds)
    ax.plot(xs, [bounds[x] for x in xs], linestyle="--", color="grey", label="bound (weights + cache read)")
    ax.set_xscale("log", base=2)
    ax.set_xticks(xs, [str(x) for x in xs])
    ax.set_xlabel("batch (prompts decoded together)")
    ax.set_ylabel("decode tokens/s, all rows")
    ax.set_ylim(bottom=0)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    ax.set_title(f"{PRESET} ({weights} weights) batched decode on CPU, onnxruntime-genai")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 2, 4, 8])
    parser.add_argument("--prompt", type=int, default=128)
    parser.add_argument("--new", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--weights", default="fp32", choices=["fp32", "int4"])
    parser.add_argument("--anchor", action="store_true", help="also the builder's Llama of the same size")
    parser.add_argument("--write", action="store_true")
    args = parser.parse_args()
    if min(args.batches) < 1 or args.prompt < 1 or args.new < 2 or args.prompt + args.new > 2048:
        parser.error("batches >= 1, --prompt >= 1, --new >= 2, prompt + new within the 2048-token context")
    cores = os.cpu_count() or 1
    probes = [bench_decode.read_bandwidth()]
    rng = np.random.default_rng(0)
    prompts = rng.integers(3, bench_decode.VOCAB, size=(max(args.batches), args.prompt)).tolist()
    loaded = load_model(None, preset=PRESET, seed=0)
    per_token_cache = bench_context.cache_bytes_per_token(loaded.config.n_layers, cache_width(loaded.config))
    speeds: dict[str, dict[int, list[float]]] = {}
    prefill: dict[str, dict[int, list[float]]] = {}
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        print(f"read bandwidth {probes[0] / 1e9:.1f} GB/s; exporting in {root}", flush=True)
        folders = {}
        for label, attention in (("DiffAttention folder", "diffattention"), ("--attention gqa folder", "gqa")):
            out = root / attention
            export_decoder(loaded, out, attention=attention, log=lambda _: None)
            if args.weights == "int4":
                quantize_weights(out, root / f"{attention}-int4", WeightQuantOptions(bits=4, block_size=32),
                                 log=lambda _: None)
                out = root / f"{attention}-int4"
            folders[label] = bench_decode.with_threads(out, root, cores)
        weights = bench_decode.weight_bytes_per_token(folders["DiffAttention folder"])
        if args.anchor:
            bench_decode.hf_models(root)
            out = root / "llama-genai"
            subprocess.run([sys.executable, "-m", "onnxruntime_genai.models.builder", "-i", str(root / "llama"),
                            "-o", str(out), "-p", args.weights, "-e", "cpu", "-c", str(root / "cache")], check=True,
                           capture_output=True)
            folders["builder's llama-100m"] = bench_decode.with_threads(out, root, cores)
        models = {label: decoding.open_genai_model(folder) for label, folder in folders.items()}
        for label, folder in folders.items():  # warm-up
            decoding.generate_batch_genai(folder, prompts[:2], 4, Sampling(), model=models[label])
        for round_ in range(args.rounds):  # interleaved: drift of a shared machine hits every runtime alike
            for batch in args.batches:
                for label, folder in folders.items():
                    run = decoding.generate_batch_genai(folder, prompts[:batch], args.new, Sampling(),
                                                        model=models[label], min_new_tokens=args.new)
                    assert all(len(t) == args.new for t in run.tokens), "a row stopped early"
                    speeds.setdefault(label, {}).setdefault(batch, []).append(run.decode_tokens_per_s)
                    prefill.setdefault(label, {}).setdefault(batch, []).append(run.prefill_seconds)
                    print(f"round {round_ + 1}/{args.rounds}  batch {batch:3d}  {label:24s} decode "
                          f"{run.decode_tokens_per_s:7.1f} tok/s  prefill {run.prefill_seconds:6.2f} s", flush=True)
            probes.append(bench_decode.read_bandwidth())
            print(f"read bandwidth {probes[-1] / 1e9:.1f} GB/s", flush=True)
    bandwidth = statistics.median(probes)
    medians = {label: {b: statistics.median(v) for b, v in by.items()} for label, by in speeds.items()}
    prefills = {label: {b: statistics.median(v) for b, v in by.items()} for label, by in prefill.items()}
    past = args.prompt + args.new / 2
    bounds = {b: b * bandwidth / (weights + b * per_token_cache * past) for b in args.batches}
    labels = list(medians)
    table = ["| batch | " + " | ".join(f"{label}: decode tok/s (prefill s)" for label in labels) +
             " | bound tok/s | " + " | ".join(f"{label}: vs its batch 1" for label in labels) + " |",
             "|---:|" + "---:|" * (2 * len(labels) + 1)]
    first = min(args.batches)
    for b in args.batches:
        cells = " | ".join(f"{medians[label][b]:.1f} ({prefills[label][b]:.2f})" for label in labels)
        growth = " | ".join(f"{medians[label][b] / medians[label][first]:.2f}x" for label in labels)
        table.append(f"| {b} | {cells} | {bounds[b]:.1f} | {growth} |")
    suffix = "" if args.weights == "fp32" else f"-{args.weights}"
    body = "\n".join([
        f"## Batched decode on CPU ({'' if args.weights == 'fp32' else args.weights + ' weights; '}"
        "onnxruntime-genai, greedy)", "",
        f"`python tools/bench_batch.py --batches {' '.join(map(str, args.batches))} --prompt {args.prompt} "
        f"--new {args.new} --rounds {args.rounds}{'' if args.weights == 'fp32' else ' --weights ' + args.weights}"
        f"{' --anchor' if args.anchor else ''} --write`", "", benchdoc.stamp(), "",
        f"{PRESET}, " + ("fp32" if args.weights == "fp32" else
                         f"{args.weights} weights (ours: diffexport quantize, block 32, RTN; the builder: -p int4)")
        + f", onnxruntime-genai with intra_op_num_threads = {cores}; each batch holds B different "
        f"{args.prompt}-token prompts and every row generates {args.new} tokens; medians of {args.rounds} "
        f"interleaved rounds. Read bandwidth measured by the tool (median of {len(probes)} probes): "
        f"{bandwidth / 1e9:.1f} GB/s; bound = B x that / (weight bytes a step reads, {weights / 1e6:.0f} MB, "
        f"+ B x {per_token_cache / 1e3:.1f} kB of cache per cached token at the mean past length {past:.0f}); "
        "compute is not in it.", "",
        *table, "", f"![batched decode](img/decode-batch{suffix}.png)"])
    print(body)
    if args.write:
        picture = plot(medians, bounds, IMG / f"decode-batch{suffix}.png", args.weights)
        print(f"wrote {benchdoc.write_section('decode-batch' + suffix, body)} and {picture}")


if __name__ == "__main__":
    main()
