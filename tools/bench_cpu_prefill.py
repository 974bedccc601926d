"""Prefill throughput on CPU: ONNX Runtime (our export, both function bodies) vs eager PyTorch.

    python tools/bench_cpu_prefill.py [--presets diff-v1-tiny diff-v1-110m] [--seqs 128 512] [--write]

Batch 1, seeded random tokens, warm-up runs, then the median of repeated runs; tokens/s and
GFLOP/s (explicit formula below) for each runtime, and the ORT/eager ratio, side by side from one
process. --write replaces the section in docs/BENCHMARKS.md.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import benchdoc  # noqa: E402

from diffexport.core.onnxruntime_session import open_session  # noqa: E402
from diffexport.export import ExportOptions, export_onnx  # noqa: E402
from diffexport.modeling.checkpoint import load_model  # noqa: E402


def forward_flops(cfg, seq: int) -> float:
    """Multiply-adds x 2 for one sequence: projections, MLP and LM head (2 * weights * tokens), plus
    causal attention: DIFF V1 6*N^2*D per diff-head (12*N^2*D halved), V2 4*N^2*D."""
    d, f, v = cfg.d_model, cfg.ffn_hidden, cfg.vocab_size
    H, Hkv, D = cfg.n_heads, cfg.n_kv_heads, cfg.head_dim
    if cfg.family == "diff_v1":
        proj = d * 2 * H * D + d * 2 * Hkv * D + d * Hkv * 2 * D + H * 2 * D * d
        attn = 6 * seq * seq * D * H
    else:
        proj = d * 2 * H * D + 2 * d * Hkv * D + H * D * d + d * H
        attn = 4 * seq * seq * D * H
    per_layer = 2 * seq * (proj + 3 * d * f) + attn
    return cfg.n_layers * per_layer + 2 * seq * d * v


def median_seconds(fn, warmup: int, repeats: int) -> float:
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def bench_preset(preset: str, seqs: list[int], repeats: int, folder: Path) -> list[dict]:
    loaded = load_model(None, preset=preset, seed=0)
    model = loaded.model.eval()
    sessions = {}
    for style in ("decomposed", "attention"):
        path = folder / f"{preset}-{style}.onnx"
        export_onnx(loaded, path, ExportOptions(body_style=style), log=lambda _: None)
        sessions[style] = open_session(path, "cpu")
    rows = []
    rng = np.random.default_rng(0)
    for seq in seqs:
        ids = rng.integers(0, loaded.config.vocab_size, size=(1, seq), dtype=np.int64)
        ids_t = torch.from_numpy(ids)
        reps = repeats if seq <= 128 else max(3, repeats // 2)
        with torch.no_grad():
            t_eager = median_seconds(lambda: model(ids_t), 3, reps)
        t_ort = {s: median_seconds(lambda s=s: sessions[s].run(None, {"input_ids": ids}), 3, reps)
                 for s in sessions}
        flops = forward_flops(loaded.config, seq)
        rows.append(dict(preset=preset, params=model.num_parameters(), seq=seq, eager=t_eager, **t_ort, flops=flops))
        print(f"{preset} seq {seq}: eager {seq / t_eager:,.0f} tok/s, ORT decomposed {seq / t_ort['decomposed']:,.0f}, "
              f"ORT attention {seq / t_ort['attention']:,.0f}", file=sys.stderr, flush=True)
    return rows


def table(rows: list[dict]) -> str:
    lines = ["| preset | params | batch x seq | eager PyTorch tok/s (GFLOP/s) | ORT decomposed tok/s (GFLOP/s) "
             "| ORT attention tok/s (GFLOP/s) | ORT decomposed / eager | ORT attention / eager |",
             "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        def cell(t):
            return f"{r['seq'] / t:,.0f} ({r['flops'] / t / 1e9:.1f})"
        lines.append(f"| {r['preset']} | {r['params'] / 1e6:.1f}M | 1 x {r['seq']} | {cell(r['eager'])} | "
                     f"{cell(r['decomposed'])} | {cell(r['attention'])} | {r['eager'] / r['decomposed']:.2f}x | "
                     f"{r['eager'] / r['attention']:.2f}x |")
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--presets", nargs="+", default=["diff-v1-tiny", "diff-v1-110m"])
    parser.add_argument("--seqs", nargs="+", type=int, default=[128, 512])
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--write", action="store_true", help="replace the section in docs/BENCHMARKS.md")
    args = parser.parse_args()
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for preset in args.presets:
            rows += bench_preset(preset, args.seqs, args.repeats, Path(tmp))
    text = table(rows)
    print(text)
    if args.write:
        command = "python tools/bench_cpu_prefill.py " + " ".join(sys.argv[1:])
        body = (f"## CPU prefill: ONNX Runtime vs eager PyTorch\n\n`{command}`\n\n{benchdoc.stamp()} "
                f"Both runtimes use their default thread pools; fp32; medians of {args.repeats} runs "
                f"(half that at seq > 128) after 3 warm-up runs.\n\n{text}\n")
        print(f"wrote {benchdoc.write_section('cpu-prefill', body)}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
