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
diffexport.backends.genai.generate_batch_genai, what `diffexport generate --prompts-file` runs.
Decode tokens/s = every row's tokens after its first / the time after the prefill; rounds are
interleaved after a warm-up, medians reported.
Bound: a decode step reads the weights once for the whole batch and each row's cache, so
bound = B x read bandwidth / (weight bytes + B x cache bytes at the mean past length); bandwidth is
onnxruntime's own GEMV (tools/bench_decode.py), the median of probes before the first round and after
each. It ignores compute, which a large batch meets first on a CPU. --write replaces the section in
docs/BENCHMARKS.md and draws docs/img/decode-batch[-int4].png.

    python tools/bench_batch.py --mixed N [--batches 8] [--prompt 384] [--new 32] [--rounds 3] [--write]

--mixed: N prompts of spread lengths (log-uniform in 16..--prompt, seeded) in the batches of
base.batch_plan at the largest --batches, in the file's order and longest first
(`generate --prompts-file --sort-by-length`), interleaved rounds; the whole file's seconds and its
prefill seconds, the padding each order computes (exact, from the batch plan), and a check that
both orders give every prompt the same tokens. Rows stop at their own end id or after --new.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
import bench_context  # noqa: E402
import bench_decode  # noqa: E402
import benchdoc  # noqa: E402

from diffexport.backends import base, genai  # noqa: E402
from diffexport.core.eager_generation import Sampling  # noqa: E402
from diffexport.format.decoder_folder import cache_width  # noqa: E402
from diffexport.modeling.checkpoint import load_model  # noqa: E402

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
    parser.add_argument("--mixed", type=int, metavar="N", help="N prompts of spread lengths: file order vs "
                                                                 "longest first")
    parser.add_argument("--write", action="store_true")
    args = parser.parse_args()
    if args.mixed is not None:
        if args.mixed < 2 or not 16 <= args.prompt <= 2048 - args.new or args.new < 1:
            parser.error("--mixed N >= 2, --prompt in 16..2048 - --new")
        mixed_lengths(args)
        return
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
        models = {label: genai.open_genai_model(folder) for label, folder in folders.items()}
        for label, folder in folders.items():  # warm-up
            genai.generate_batch_genai(folder, prompts[:2], 4, Sampling(), model=models[label])
        for round_ in range(args.rounds):  # interleaved: drift of a shared machine hits every runtime alike
            for batch in args.batches:
                for label, folder in folders.items():
                    run = genai.generate_batch_genai(folder, prompts[:batch], args.new, Sampling(),
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


def padding(prompts: list[list[int]], plan: list[list[int]]) -> int:
    """Pad tokens a plan's batches compute: each batch pads every prompt to its longest."""
    return sum(len(indices) * max(len(prompts[i]) for i in indices) - sum(len(prompts[i]) for i in indices)
               for indices in plan)


def mixed_lengths(args) -> None:
    """A file of spread prompt lengths run in its order and longest first (see the module doc)."""
    cores = os.cpu_count() or 1
    batch = max(args.batches)
    rng = np.random.default_rng(0)
    lengths = np.exp(rng.uniform(np.log(16), np.log(args.prompt), size=args.mixed)).astype(int).tolist()
    prompts = [rng.integers(3, bench_decode.VOCAB, size=n).tolist() for n in lengths]
    orders = {"file order": False, "longest first": True}
    pads = {name: padding(prompts, base.batch_plan(prompts, batch, by_length)) for name, by_length in orders.items()}
    loaded = load_model(None, preset=PRESET, seed=0)
    totals: dict[tuple[str, str], list[float]] = {}
    prefills: dict[tuple[str, str], list[float]] = {}
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        folders = bench_context.genai_folders(loaded, root, args.weights, args.anchor, cores)
        models = {label: genai.open_genai_model(folder) for label, folder in folders.items()}
        for label, folder in folders.items():  # warm-up
            genai.generate_batch_genai(folder, prompts[:2], 4, Sampling(), model=models[label])
        answers: dict[tuple[str, str], list] = {}
        for round_ in range(args.rounds):
            for label, folder in folders.items():
                for name, by_length in orders.items():
                    start = time.perf_counter()
                    tokens: list = [None] * len(prompts)
                    prefill = 0.0
                    # a runtime's generate_in_batches loop, on the model opened once (the threads copies link
                    # their weights)
                    for indices in base.batch_plan(prompts, batch, by_length):
                        run = genai.generate_batch_genai(folder, [prompts[i] for i in indices], args.new,
                                                         Sampling(), model=models[label])
                        prefill += run.prefill_seconds
                        for i, t in zip(indices, run.tokens):
                            tokens[i] = t
                    seconds = time.perf_counter() - start
                    answers.setdefault((label, name), tokens)
                    totals.setdefault((label, name), []).append(seconds)
                    prefills.setdefault((label, name), []).append(prefill)
                    print(f"round {round_ + 1}/{args.rounds}  {label:24s} {name:14s} {seconds:6.2f} s "
                          f"(prefill {prefill:5.2f} s)", flush=True)
        for label in folders:
            same = answers[(label, "file order")] == answers[(label, "longest first")]
            print(f"{label}: both orders give every prompt the same tokens: {same}")
    new_tokens = {label: sum(len(t) for t in answers[(label, "file order")]) for label in folders}
    real = sum(lengths)
    table = ["| folder | file order: s (prefill s) | longest first: s (prefill s) | speed-up | prefill speed-up | "
             "same tokens |", "|---|---:|---:|---:|---:|:---:|"]
    for label in folders:
        file_s, sorted_s = (statistics.median(totals[(label, n)]) for n in orders)
        file_p, sorted_p = (statistics.median(prefills[(label, n)]) for n in orders)
        same = "yes" if answers[(label, "file order")] == answers[(label, "longest first")] else "no"
        table.append(f"| {label} ({new_tokens[label]} new tokens) | {file_s:.2f} ({file_p:.2f}) | "
                     f"{sorted_s:.2f} ({sorted_p:.2f}) | {file_s / sorted_s:.2f}x | {file_p / sorted_p:.2f}x | "
                     f"{same} |")
    body = "\n".join([
        f"## Length-sorted batches on CPU ({'' if args.weights == 'fp32' else args.weights + ' weights; '}"
        "onnxruntime-genai, greedy)", "",
        f"`python tools/bench_batch.py --mixed {args.mixed} --batches {batch} --prompt {args.prompt} --new {args.new} "
        f"--rounds {args.rounds}{'' if args.weights == 'fp32' else ' --weights ' + args.weights} --write`", "",
        benchdoc.stamp(), "",
        f"{PRESET}, {args.weights}, onnxruntime-genai with intra_op_num_threads = {cores}: {args.mixed} prompts of "
        f"{min(lengths)}-{max(lengths)} tokens (log-uniform, {real} in all), {batch} at a time, each row "
        f"generating until its end id or {args.new} tokens; the whole file's seconds, medians of {args.rounds} "
        f"interleaved rounds. Padding computed (exact, from the batch plan): file order {pads['file order']} "
        f"tokens ({pads['file order'] / real:.0%} of the prompts'), longest first {pads['longest first']} "
        f"({pads['longest first'] / real:.0%}).", "", *table])
    print(body)
    if args.write:
        print(f"wrote {benchdoc.write_section('decode-batch-sorted', body)}")


if __name__ == "__main__":
    main()
