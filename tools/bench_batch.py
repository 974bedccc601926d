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
from diffexport.export.decoder import cache_width  # noqa: E402
from diffexport.generation import Sampling  # noqa: E402

PRESET = "diff-v1-110m"
IMG = Path(__file__).resolve().parent.parent / "docs" / "img"


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
        folders = bench_context.genai_folders(loaded, root, args.weights, args.anchor, cores)
        weights = bench_decode.weight_bytes_per_token(folders["DiffAttention folder"])
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
        picture = bench_context.plot(medians, bounds, IMG / f"decode-batch{suffix}.png",
                                     f"{PRESET} ({args.weights} weights) batched decode on CPU, onnxruntime-genai",
                                     "batch (prompts decoded together)", "decode tokens/s, all rows", log2_x=True)
        print(f"wrote {benchdoc.write_section('decode-batch' + suffix, body)} and {picture}")


if __name__ == "__main__":
    main()
