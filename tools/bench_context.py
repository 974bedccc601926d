"""Decode speed against context length on CPU: how the cost of a decode step grows with the cached
tokens for our two KV-cache folder kinds, beside onnxruntime-genai's builder Llama of the same size.

    python tools/bench_context.py [--prompts 128 512 1024 1792] [--new 64] [--rounds 3] [--anchor]
                                  [--weights fp32|int4] [--write]

Models (batch 1, greedy, seeded random weights): diff-v1-110m exported with --kv-cache (DiffAttention:
the op's function body in onnxruntime, the token-major cache concatenated every step) and with
--attention gqa (GroupQueryAttention on genai's shared cache buffer); with --anchor, llama-100m written
by onnxruntime-genai's model builder (the same shape). --weights int4: our folders through `diffexport
quantize` (block 32, RTN, accuracy level 4) and the builder's `-p int4`; each weight setting has its
own section (and plot). Every genai_config gets intra_op_num_threads =
the machine's cores. For each prompt length, decode tokens/s counts the tokens after the first, after
a warm-up generation; rounds are interleaved and medians reported.
Bound: read bandwidth (onnxruntime's own GEMV, as tools/bench_decode.py measures it, probed before
the first round and after each, median) / (the weight
bytes a step reads + the cache bytes it reads at the run's mean past length: layers x 2 x W x 4 bytes
per cached token; the cache stays fp32). --write replaces the section in docs/BENCHMARKS.md and draws
docs/img/decode-context.png (decode-context-int4.png for int4).
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
import bench_decode  # noqa: E402
import benchdoc  # noqa: E402

from diffexport.format.decoder_folder import cache_width  # noqa: E402
from diffexport.modeling.checkpoint import load_model  # noqa: E402
from diffexport.passes.decoder_formats import export_decoder  # noqa: E402
from diffexport.passes.weight_quant import WeightQuantOptions, quantize_weights  # noqa: E402

PRESET = "diff-v1-110m"
IMG = Path(__file__).resolve().parent.parent / "docs" / "img"


def cache_bytes_per_token(layers: int, width: int) -> int:
    """What one decode step reads of the cache per cached token: keys and values of every layer, fp32."""
    return layers * 2 * width * 4


def genai_folders(loaded, root: Path, weights: str, anchor: bool, threads: int) -> dict[str, Path]:
    """Label -> genai folder with intra_op_num_threads set: our DiffAttention and gqa folders of the
    model (int4: through `diffexport quantize`, block 32) and, with anchor, the builder's Llama of the
    same size in the same weights."""
    folders = {}
    for label, attention in (("DiffAttention folder", "diffattention"), ("--attention gqa folder", "gqa")):
        out = root / attention
        export_decoder(loaded, out, attention=attention, log=lambda _: None)
        if weights == "int4":
            quantize_weights(out, root / f"{attention}-int4", WeightQuantOptions(bits=4, block_size=32),
                             log=lambda _: None)
            out = root / f"{attention}-int4"
        folders[label] = bench_decode.with_threads(out, root, threads)
    if anchor:
        bench_decode.hf_models(root)
        out = root / "llama-genai"
        subprocess.run([sys.executable, "-m", "onnxruntime_genai.models.builder", "-i", str(root / "llama"),
                        "-o", str(out), "-p", weights, "-e", "cpu", "-c", str(root / "cache")], check=True,
                       capture_output=True)
        folders["builder's llama-100m"] = bench_decode.with_threads(out, root, threads)
    return folders


def plot(results: dict[str, dict[int, float]], bounds: dict[int, float], path: Path, title: str, xlabel: str,
         ylabel: str, log2_x: bool = False) -> Path:
    """One line per runtime (x -> tokens/s) and the bound dashed; shared by the decode benchmarks."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.2))
    for name, by_x in results.items():
        xs = sorted(by_x)
        ax.plot(xs, [by_x[x] for x in xs], marker="o", label=name)
    xs = sorted(bounds)
    ax.plot(xs, [bounds[x] for x in xs], linestyle="--", color="grey", label="bound (weights + cache read)")
    if log2_x:
        ax.set_xscale("log", base=2)
        ax.set_xticks(xs, [str(x) for x in xs])
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.set_ylim(bottom=0)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    ax.set_title(title)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--prompts", type=int, nargs="+", default=[128, 512, 1024, 1792])
    parser.add_argument("--new", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--anchor", action="store_true", help="also the builder's Llama of the same size")
    parser.add_argument("--weights", default="fp32", choices=["fp32", "int4"])
    parser.add_argument("--write", action="store_true")
    args = parser.parse_args()
    if min(args.prompts) < 16 or max(args.prompts) + args.new > 2048 or args.new < 2:
        parser.error("prompts from 16 tokens, prompt + --new within the 2048-token context, --new >= 2")
    cores = os.cpu_count() or 1
    probes = [bench_decode.read_bandwidth()]  # again after every round: the median resists a noisy neighbour
    prompt_all = np.random.default_rng(0).integers(3, bench_decode.VOCAB, size=max(args.prompts)).tolist()
    loaded = load_model(None, preset=PRESET, seed=0)
    per_token_cache = cache_bytes_per_token(loaded.config.n_layers, cache_width(loaded.config))
    speeds: dict[str, dict[int, list[float]]] = {}
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        print(f"read bandwidth {probes[0] / 1e9:.1f} GB/s; exporting in {root}", flush=True)
        folders = genai_folders(loaded, root, args.weights, args.anchor, cores)
        weights = bench_decode.weight_bytes_per_token(folders["DiffAttention folder"])
        for round_ in range(args.rounds):  # interleaved: drift of a shared machine hits every runtime alike
            for length in args.prompts:
                for label, folder in folders.items():
                    run = bench_decode.time_genai(folder, prompt_all[:length], args.new)
                    tps = (len(run.tokens) - 1) / run.decode_seconds
                    speeds.setdefault(label, {}).setdefault(length, []).append(tps)
                    print(f"round {round_ + 1}/{args.rounds}  prompt {length:5d}  {label:24s} decode {tps:6.1f} tok/s",
                          flush=True)
            probes.append(bench_decode.read_bandwidth())
            print(f"read bandwidth {probes[-1] / 1e9:.1f} GB/s", flush=True)
    bandwidth = statistics.median(probes)
    medians = {label: {n: statistics.median(v) for n, v in by.items()} for label, by in speeds.items()}
    bounds = {n: bandwidth / (weights + per_token_cache * (n + args.new / 2)) for n in args.prompts}
    labels = list(medians)
    table = ["| prompt tokens | " + " | ".join(f"{label} tok/s" for label in labels) +
             " | bound tok/s | gqa / DiffAttention |",
             "|---:|" + "---:|" * (len(labels) + 2)]
    for n in args.prompts:
        cells = " | ".join(f"{medians[label][n]:.1f}" for label in labels)
        ratio = medians["--attention gqa folder"][n] / medians["DiffAttention folder"][n]
        table.append(f"| {n} | {cells} | {bounds[n]:.1f} | {ratio:.2f}x |")
    suffix = "" if args.weights == "fp32" else f"-{args.weights}"
    body = "\n".join([
        "## Decode on CPU against context length ("
        f"{'' if args.weights == 'fp32' else args.weights + ' weights; '}KV cache, batch 1, greedy)", "",
        f"`python tools/bench_context.py --prompts {' '.join(map(str, args.prompts))} --new {args.new} "
        f"--rounds {args.rounds}{' --anchor' if args.anchor else ''}"
        f"{'' if args.weights == 'fp32' else ' --weights ' + args.weights} --write`", "", benchdoc.stamp(), "",
        f"{PRESET}, " + ("fp32" if args.weights == "fp32" else
                         f"{args.weights} weights (ours: diffexport quantize, block 32, RTN; the builder: -p int4)")
        + f", onnxruntime-genai with intra_op_num_threads = {cores}; {args.new} new tokens after each "
        f"prompt; medians of {args.rounds} interleaved rounds. Read bandwidth measured by the tool (the median of "
        f"{len(probes)} probes, before the first round and after each): {bandwidth / 1e9:.1f} GB/s; bound = that / "
        f"(weight bytes a step reads, {weights / 1e6:.0f} MB, + "
        f"{per_token_cache / 1e3:.1f} kB of cache per cached token at the run's mean past length).", "",
        *table, "", f"![decode against context length](img/decode-context{suffix}.png)"])
    print(body)
    if args.write:
        picture = plot(medians, bounds, IMG / f"decode-context{suffix}.png",
                       f"{PRESET} ({args.weights} weights) decode on CPU against context length",
                       "prompt tokens (context at the first decode step)", "decode tokens/s (batch 1)")
        print(f"wrote {benchdoc.write_section('decode-context' + suffix, body)} and {picture}")


if __name__ == "__main__":
    main()
