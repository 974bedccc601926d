"""Fused differential attention vs its baselines on a CUDA GPU: ms, TFLOP/s, speed-ups, % of matmul peak.

One run measures, side by side for each (dtype, head dim, causal, N): our fused kernel, its INT8
logits variant (8 bits, K-smoothing; the time includes the K quantisation pre-pass), the paper's
FlashDiffAttn_1 and FlashDiffAttn_2 on the eager attention backend (flash_attn when importable,
else torch SDPA), and the naive eager form where its N x N maps fit in memory. FLOPs are the exact
12*N^2*d per diff-head (halved for causal); the matmul peak is a bf16 8192^3 matmul measured in
the same run. Medians of CUDA-event timings after warm-up. Not a test.
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import benchdoc  # noqa: E402

from diffexport import kernels, reference  # noqa: E402
from diffexport.contract import DiffAttentionAttrs  # noqa: E402

TOKENS_PER_BATCH = 16384  # B * N: keeps B*H*N/64 CTAs (work per launch) the same at every N
NAIVE_MAX_BYTES = 24 * 2**30


def median_ms(fn, warmup: int, repeats: int) -> float:
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def matmul_peak_tflops() -> float:
    a = torch.randn(8192, 8192, dtype=torch.bfloat16, device="cuda")
    b = torch.randn(8192, 8192, dtype=torch.bfloat16, device="cuda")
    ms = median_ms(lambda: a @ b, 5, 20)
    return 2 * 8192**3 / (ms * 1e-3) / 1e12


def attention_flops(attrs: DiffAttentionAttrs, batch: int, n: int) -> float:
    """Exact DIFF V1 work: S1, S2 (2 * 2N^2 d) and P1 V, P2 V (2 * 2N^2 * 2d) per diff-head."""
    per_head = 12 * n * n * attrs.head_dim
    return per_head * batch * attrs.num_heads * (0.5 if attrs.causal else 1.0)


def bench_case(dtype, head_dim: int, causal: int, n: int, heads: int, warmup: int, repeats: int) -> dict:
    batch = max(1, TOKENS_PER_BATCH // n)
    attrs = DiffAttentionAttrs(variant=1, num_heads=heads, num_kv_heads=heads, head_dim=head_dim, causal=causal,
                               output_scale=0.8)
    gen = torch.Generator(device="cuda").manual_seed(n + head_dim + causal)
    q = torch.randn(batch, n, 2 * heads * head_dim, device="cuda", dtype=dtype, generator=gen)
    k = torch.randn(batch, n, attrs.key_width, device="cuda", dtype=dtype, generator=gen)
    v = torch.randn(batch, n, heads * attrs.value_dim, device="cuda", dtype=dtype, generator=gen)
    lam = torch.tensor([0.4], device="cuda", dtype=dtype)
    w = 1 + 0.1 * torch.randn(attrs.value_dim, device="cuda", generator=gen)
    inputs = (q, k, v, lam, w)
    out = torch.empty(batch, n, heads * attrs.value_dim, device="cuda", dtype=dtype)
    methods = {
        "fused": lambda: kernels.diff_attention(*inputs, attrs, out=out),
        "fused_int8": lambda: kernels.diff_attention(*inputs, attrs, logit_bits=8, out=out),
        "flash_diff_1": lambda: reference.flash_diff_attention_1(*inputs, attrs),
        "flash_diff_2": lambda: reference.flash_diff_attention_2(*inputs, attrs),
    }
    if batch * heads * n * n * 4 * 4 <= NAIVE_MAX_BYTES:
        methods["naive"] = lambda: reference.naive_diff_attention(*inputs, attrs)
    flops = attention_flops(attrs, batch, n)
    row = {"dtype": str(dtype).replace("torch.", ""), "d": head_dim, "causal": causal, "n": n, "batch": batch,
           "heads": heads, "backend": reference.attention_backend(q, q)}
    for name, fn in methods.items():
        try:
            ms = median_ms(fn, warmup, repeats)
        except (RuntimeError, torch.OutOfMemoryError) as exc:
            print(f"  {name}: failed ({str(exc).splitlines()[0]})", file=sys.stderr)
            torch.cuda.empty_cache()
            continue
        row[name] = {"ms": ms, "tflops": flops / (ms * 1e-3) / 1e12}
    exact = kernels.diff_attention(*inputs, attrs).float()
    quant = kernels.diff_attention(*inputs, attrs, logit_bits=8).float()
    row["int8_cosine"] = torch.nn.functional.cosine_similarity(quant.flatten(), exact.flatten(), dim=0).item()
    del inputs, q, k, v, out, exact, quant
    torch.cuda.empty_cache()
    return row


def table(rows: list[dict], peak: float) -> str:
    def cell(row, name):
        r = row.get(name)
        return "-" if r is None else f"{r['ms']:.3f} ({r['tflops']:.0f})"

    lines = ["| dtype | d (V) | causal | N | B x H | fused | fused INT8 | FlashDiffAttn_1 | FlashDiffAttn_2 | naive "
             "| fused vs best baseline | INT8 vs fused | fused % of matmul peak | INT8 cosine |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for row in rows:
        baselines = [row[m]["ms"] for m in ("flash_diff_1", "flash_diff_2", "naive") if m in row]
        fused = row.get("fused")
        int8 = row.get("fused_int8")
        vs_best = f"{min(baselines) / fused['ms']:.2f}x" if fused and baselines else "-"
        vs_fused = f"{fused['ms'] / int8['ms']:.2f}x" if fused and int8 else "-"
        pct = f"{100 * fused['tflops'] / peak:.0f}%" if fused else "-"
        lines.append(f"| {row['dtype']} | {row['d']} ({2 * row['d']}) | {row['causal']} | {row['n']} "
                     f"| {row['batch']} x {row['heads']} | {cell(row, 'fused')} | {cell(row, 'fused_int8')} "
                     f"| {cell(row, 'flash_diff_1')} | {cell(row, 'flash_diff_2')} | {cell(row, 'naive')} "
                     f"| {vs_best} | {vs_fused} | {pct} | {row['int8_cosine']:.5f} |")
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dtypes", nargs="+", default=["bfloat16", "float16"])
    parser.add_argument("--head-dims", nargs="+", type=int, default=[128, 64])
    parser.add_argument("--seqs", nargs="+", type=int, default=[1024, 4096, 16384])
    parser.add_argument("--causal", nargs="+", type=int, default=[0, 1])
    parser.add_argument("--heads", type=int, default=16, help="diff-heads per batch element (default 16)")
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--repeats", type=int, default=10)
    parser.add_argument("--write", action="store_true", help="replace the section in docs/BENCHMARKS.md")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        print("error: this benchmark needs a CUDA GPU", file=sys.stderr)
        return 2
    kernels.load_library()
    peak = matmul_peak_tflops()
    print(f"bf16 matmul 8192^3: {peak:.0f} TFLOP/s", file=sys.stderr)
    rows = []
    for dtype in args.dtypes:
        for d in args.head_dims:
            for causal in args.causal:
                for n in args.seqs:
                    print(f"{dtype} d={d} causal={causal} N={n} ...", file=sys.stderr, flush=True)
                    rows.append(bench_case(getattr(torch, dtype), d, causal, n, args.heads, args.warmup, args.repeats))
    text = table(rows, peak)
    print(text)
    if args.write:
        command = "python tools/bench_attention.py " + " ".join(sys.argv[1:])
        body = (f"## Fused differential attention on the GPU (DIFF V1, forward)\n\n`{command}`\n\n"
                f"{benchdoc.stamp()} Measured bf16 matmul peak (8192^3) in this run: {peak:.0f} TFLOP/s. "
                f"Cells: median ms (TFLOP/s on 12*N^2*d per diff-head, halved for causal), {args.repeats} runs "
                f"after {args.warmup} warm-up. Baselines use `{rows[0]['backend']}` attention calls. INT8 = 8-bit "
                "logits with K-smoothing, including the K quantisation pre-pass; its cosine is against the "
                "fused fp output on the same inputs.\n\n" + text + "\n")
        print(f"wrote {benchdoc.write_section('fused-attention', body)}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
