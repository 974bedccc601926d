"""Quantised decode on CPU: file size and decode tokens/s of diff-v1-110m's KV-cache folder in fp32,
int8 and int4 weights (`diffexport quantize`), exported with each attention op (DiffAttention, and
`--attention gqa`: onnxruntime's GroupQueryAttention), side by side with the same-size plain Llama
that onnxruntime-genai's own model builder writes in fp32 and int4, plus the accuracy of our
quantised folders under their budgets (`diffexport check FOLDER`).

    python tools/bench_quant.py [--prompt 128] [--new 128] [--rounds 3] [--write]

Every folder runs in onnxruntime-genai, batch 1, greedy, with intra_op_num_threads = the machine's
cores written into its genai_config (neither writer sets threads by default); decode tokens/s
counts the tokens after the first (prefill excluded); after a warm-up generation of 8 tokens each
folder runs once per round, rounds interleaved, medians reported. Weights are seeded random
(diff-v1-110m preset seed 0; the Llama from tools/bench_decode.py's hf_models). Bound: weight bytes
a decode step reads (initializers, less an embedding table only a Gather reads) / read bandwidth
measured in the same run. --write replaces the section in docs/BENCHMARKS.md.
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

from diffexport.modeling.checkpoint import load_model  # noqa: E402
from diffexport.passes.decoder_formats import export_decoder  # noqa: E402
from diffexport.passes.weight_quant import WeightQuantOptions, quantize_weights  # noqa: E402
from diffexport.validation.decoder import run_decoder_check  # noqa: E402
from diffexport.validation.options import CheckOptions  # noqa: E402

PRESET = "diff-v1-110m"
TARGET_VS_FP32, TARGET_VS_BUILDER = 3.0, 0.85  # issue 18's targets for our int4 folder


def folder_bytes(folder: Path) -> int:
    return sum(p.stat().st_size for p in folder.iterdir() if p.is_file())


OURS = {"diffattention": "diff-v1-110m (diffexport)", "gqa": "diff-v1-110m (diffexport, --attention gqa)"}
BUILDER = "llama-100m (model builder)"


def build_ours(root: Path, log, attention: str) -> dict[str, Path]:
    loaded = load_model(None, preset=PRESET, seed=0)
    folders = {"fp32": root / f"{attention}-fp32"}
    log(f"exporting {PRESET} --kv-cache --attention {attention}")
    export_decoder(loaded, folders["fp32"], attention=attention, log=lambda _: None)
    for name, options in (("int8", WeightQuantOptions(bits=8, block_size=32)),
                          ("int4", WeightQuantOptions(bits=4, block_size=32))):
        log(f"quantising {name} ({options.describe()}, accuracy level {options.accuracy_level})")
        folders[name] = root / f"{attention}-{name}"
        quantize_weights(folders["fp32"], folders[name], options, log=lambda _: None)
    return folders


def build_builder(root: Path, log) -> dict[str, Path]:
    """onnxruntime-genai's model builder on a plain Llama of the same shape (fp32 and int4, CPU)."""
    bench_decode.hf_models(root)  # writes root/llama (with a tokenizer) and root/diffllama
    folders = {}
    for precision in ("fp32", "int4"):
        log(f"onnxruntime-genai model builder -p {precision} -e cpu")
        out = root / f"llama-{precision}"
        subprocess.run([sys.executable, "-m", "onnxruntime_genai.models.builder", "-i", str(root / "llama"),
                        "-o", str(out), "-p", precision, "-e", "cpu", "-c", str(root / "cache")], check=True,
                       capture_output=True)
        folders[precision] = out
    return folders


def accuracy(folder: Path, log) -> str:
    """Our check of a quantised folder: worst step's KL and cosine, greedy agreement, verdict."""
    loaded = load_model(None, preset=PRESET, seed=0)
    report = run_decoder_check(folder, loaded, CheckOptions(), log=lambda _: None)
    kls = [float(line.split("KL ")[1].split()[0]) for line in report.lines if "KL " in line]
    coses = [float(line.split("cosine ")[1].split()[0]) for line in report.lines if "cosine " in line]
    greedy = next((line.split("greedy tokens onnxruntime == eager")[1].split("(")[0].strip()
                   for line in report.lines if "greedy tokens" in line), "?")
    log(f"checked {folder.name}: {'PASS' if report.passed else 'FAIL'}")
    return (f"{max(kls):.2e} | {min(coses):.5f} | {greedy} | {'PASS' if report.passed else 'FAIL'}"
            if kls else "no logits compared")


def profile_tables(profiles: dict) -> list[str]:
    """The op types of each profiled step side by side: ms per step and nodes per step."""
    names = list(profiles)
    ops: list[str] = []
    for _, _, table in profiles.values():
        ops += [op for op, _, _ in table[:8] if op not in ops]
    lines = ["| op type | " + " | ".join(f"{n}: ms / nodes" for n in names) + " |",
             "|---|" + "---:|" * len(names)]
    for op in ops:
        cells = []
        for name in names:
            row = next(((t, k) for o, t, k in profiles[name][2] if o == op), None)
            cells.append("-" if row is None else f"{row[0] / 1e3:.2f} / {row[1]}")
        lines.append(f"| {op} | " + " | ".join(cells) + " |")
    lines.append("| all | " + " | ".join(f"{profiles[n][0] / 1e3:.2f} / {profiles[n][1]}" for n in names) + " |")
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--prompt", type=int, default=128)
    parser.add_argument("--new", type=int, default=128)
    parser.add_argument("--rounds", type=int, default=3, help="interleaved rounds; the table shows medians")
    parser.add_argument("--write", action="store_true")
    args = parser.parse_args()

    def log(message):
        print(message, file=sys.stderr, flush=True)

    prompt = np.random.default_rng(0).integers(3, bench_decode.VOCAB, size=args.prompt).tolist()
    bandwidth = bench_decode.read_bandwidth()
    cores = os.cpu_count() or 1
    runs: dict[str, list[float]] = {}
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        log(f"read bandwidth {bandwidth / 1e9:.1f} GB/s; building folders in {root}")
        ours = {attention: build_ours(root, log, attention) for attention in OURS}
        builder = build_builder(root, log)
        rows = [(OURS[attention], k, v) for attention, folders in ours.items() for k, v in folders.items()]
        rows += [(BUILDER, k, v) for k, v in builder.items()]
        threaded = {str(folder): bench_decode.with_threads(folder, root, cores) for _, _, folder in rows}
        for round_ in range(args.rounds):
            log(f"round {round_ + 1}/{args.rounds}")
            for model, precision, folder in rows:
                result = bench_decode.time_genai(threaded[str(folder)], prompt, args.new)
                tps = (len(result.tokens) - 1) / result.decode_seconds
                runs.setdefault(str(folder), []).append(tps)
                log(f"  {model:44s} {precision:5s} decode {tps:6.1f} tok/s")
        checks = {(attention, name): accuracy(ours[attention][name], log) for attention in OURS
                  for name in ("int8", "int4")}
        past = args.prompt + args.new // 2
        profiles = {name: bench_decode.profile_step(folder, past, cores)
                    for name, folder in (("diff-v1-110m int4 (diffexport)", ours["diffattention"]["int4"]),
                                         ("diff-v1-110m int4 (diffexport, gqa)", ours["gqa"]["int4"]),
                                         ("llama-100m int4 (model builder)", builder["int4"]))}
        table = ["| model | weights | folder MB | read per token MB | decode tok/s | bound tok/s | decode / bound | "
                 "vs fp32 of its writer |", "|---|---|---:|---:|---:|---:|---:|---:|"]
        medians = {}
        for model, precision, folder in rows:
            tps = statistics.median(runs[str(folder)])
            medians[(model, precision)] = tps
            per_token = bench_decode.weight_bytes_per_token(folder)
            fp32 = statistics.median(runs[str(next(f for m, p, f in rows if m == model and p == "fp32"))])
            table.append(f"| {model} | {precision} | {folder_bytes(folder) / 1e6:.0f} | {per_token / 1e6:.0f} | "
                         f"{tps:.1f} | {bandwidth / per_token:.1f} | {tps / (bandwidth / per_token):.2f} | "
                         f"{tps / fp32:.2f}x |")
    targets = []
    for attention, label in OURS.items():
        vs_fp32 = medians[(label, "int4")] / medians[(label, "fp32")]
        vs_builder = medians[(label, "int4")] / medians[(BUILDER, "int4")]
        targets.append(
            f"- `--attention {attention}`: >= {TARGET_VS_FP32:g}x our fp32 decode tokens/s: **{vs_fp32:.2f}x, "
            f"{'met' if vs_fp32 >= TARGET_VS_FP32 else 'missed'}**; >= {TARGET_VS_BUILDER:g}x the builder's int4 "
            f"Llama: **{vs_builder:.2f}x, {'met' if vs_builder >= TARGET_VS_BUILDER else 'missed'}**.")
    check_table = ["| attention | weights | worst step KL (nats) | worst step cosine | greedy tokens == eager | "
                   "verdict |",
                   "|---|---|---:|---:|---|---|"]
    check_table += [f"| {attention} | {name} | {line} |" for (attention, name), line in checks.items()]
    body = "\n".join([
        "## Quantised decode on CPU (onnxruntime-genai, batch 1, greedy)", "",
        f"`python tools/bench_quant.py --prompt {args.prompt} --new {args.new} --rounds {args.rounds} --write`", "",
        benchdoc.stamp(), "",
        f"Medians of {args.rounds} interleaved rounds; prompt {args.prompt} tokens, {args.new} new tokens; "
        f"intra_op_num_threads = {cores} written into every genai_config. Our int8/int4: `diffexport quantize "
        "--weights int8|int4` (block 32, symmetric RTN, accuracy level 4); the builder's int4: its own `-p int4 -e "
        "cpu` defaults. Read bandwidth measured by the tool: "
        f"{bandwidth / 1e9:.1f} GB/s; bound = that / the bytes a decode step reads.", "",
        *table, "",
        "Targets for our int4 folders:", "", *targets, "",
        f"Accuracy of our quantised folders (`diffexport check FOLDER --preset {PRESET}`: 2 prompts, prefill + 32 "
        "decode steps, each step judged on the budget of docs/QUANTIZATION.md; random weights, so this proves "
        "the graphs, not how a trained model quantises):", "", *check_table, "",
        f"Where one int4 decode step spends its time (onnxruntime's profile, {cores} threads, past {past} tokens):",
        "", *profile_tables(profiles)])
    print(body)
    if args.write:
        print(f"wrote {benchdoc.write_section('quant', body)}")


if __name__ == "__main__":
    main()
