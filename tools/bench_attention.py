"""Fused differential attention vs its baselines on a CUDA GPU: ms, TFLOP/s, speed-ups, % of matmul peak.

One run measures, side by side for each (dtype, head dim, causal, N): our fused mma.sync kernel
(DIFFEXPORT_KERNEL_PATH=mma), its INT8 logits variant (8 bits, K-smoothing; the time includes the K
quantisation pre-pass), the Hopper path on sm_90 GPUs whose library has it (DIFFEXPORT_KERNEL_PATH=hopper;
what auto runs there) with fp and with INT8 logits (s8 wgmma), the paper's
FlashDiffAttn_1 and FlashDiffAttn_2 on the eager attention backend (flash_attn when importable,
else torch SDPA), and the naive eager form where its N x N maps fit in memory. FLOPs are the exact
12*N^2*d per diff-head (halved for causal); the matmul peak is a bf16 8192^3 matmul measured in
the same run. Medians of CUDA-event timings after warm-up, every method of a case timed once a
round (benchdoc.interleaved_medians), so that the GPU's drift over the loop falls on all alike. Not a test.

--decode measures decode steps instead (Sq = 1 and 4 query tokens against 1k-128k cached keys):
our split-KV decode kernels, the one-pass kernel on the same call (DIFFEXPORT_KERNEL_PATH=mma),
the INT8-logits variant and the compositions, as achieved GB/s (the bytes of Q, K, V and the
output once) beside a device-to-device copy's GB/s measured in the same run. Each call is timed
inside a CUDA graph of 20 calls, so Python's launch overhead is not in the numbers; our kernels'
graphs (every build's) are replayed in rounds, the compositions' one after another.

--cta-cost measures the Hopper path's fixed cost per CTA: the prefill cases' grid (4096 tiles of 64
query rows, a CTA each unless the build is persistent; non-causal) against 256 to 4096 keys, timed
as CUDA graphs (a build's key counts in rounds), and a least-squares line through (keys, ms). Its
intercept is the time that does not grow with the keys a tile reads (barrier set-up, Q's load, the
pipeline's fill and drain, the epilogue, the CTA's launch), paid once per tile in each of the grid's
waves: the most a persistent scheduler, which overlaps one tile's epilogue and prologue with the
next tile's loads, could take off a launch of that grid (and, for a persistent build, what it left).
Tiles and waves count 64-row tiles: a build whose Hopper CTA holds 128 rows (both maps a warpgroup,
DIFFX_SM90_MAPS_PER_WARPGROUP=2, at d = 64) runs half as many CTAs in half the waves, so its fixed
cost per CTA is twice its per-tile column; the intercept, a launch's fixed cost, compares as it is.
"""

from __future__ import annotations

import argparse
import ctypes
import functools
import json
import os
import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import benchdoc  # noqa: E402

from diffexport.core.contract import DiffAttentionAttrs  # noqa: E402
from diffexport.core.errors import DiffExportError  # noqa: E402
from diffexport.core.kv_cache_codes import KvCacheScales  # noqa: E402
from diffexport.kernel import kernel_probe, kernels, reference  # noqa: E402

TOKENS_PER_BATCH = 16384  # B * N: keeps B*H*N/64 CTAs (work per launch) the same at every N
NAIVE_MAX_BYTES = 24 * 2**30
CONTROL = benchdoc.CONTROL_BUILD


def event_ms(fn) -> float:
    """One call of fn on the current stream, timed by CUDA events (ms)."""
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    fn()
    end.record()
    end.synchronize()
    return start.elapsed_time(end)


def median_ms(fn, warmup: int, repeats: int) -> float:
    for _ in range(warmup):
        fn()
    return statistics.median(event_ms(fn) for _ in range(repeats))


def not_measured(name: str, exc: Exception) -> None:
    """The line for a method left out of a table (its memory handed back for the next one)."""
    print(f"  {name}: not measured ({(str(exc).splitlines() or [type(exc).__name__])[0][:150]})", file=sys.stderr)
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def interleaved_medians(methods: dict, warmup: int, repeats: int, time_one=event_ms) -> dict[str, float]:
    """Median ms of each method, timed in rounds (benchdoc.interleaved_medians); a method that raises
    (a backend refusing a shape, out of memory) is left out with a line saying why."""
    return benchdoc.interleaved_medians(methods, warmup, repeats, time_one,
                                        failures=(RuntimeError, torch.OutOfMemoryError), left_out=not_measured)


def matmul_peak_tflops() -> float:
    a = torch.randn(8192, 8192, dtype=torch.bfloat16, device="cuda")
    b = torch.randn(8192, 8192, dtype=torch.bfloat16, device="cuda")
    ms = median_ms(lambda: a @ b, 5, 20)
    return 2 * 8192**3 / (ms * 1e-3) / 1e12


SDPA_BACKENDS = ("flash", "cudnn", "efficient")


def forced(backend: str, fn, inputs, attrs):
    """fn on the default attention library ('default': flash_attn when importable, else SDPA's own
    choice) or with one torch SDPA backend forced."""
    if backend == "default":
        return lambda: fn(*inputs, attrs)
    from torch.nn.attention import sdpa_kernel

    chosen = reference.sdpa_backend(backend)

    def run():
        with sdpa_kernel([chosen]):
            return fn(*inputs, attrs)
    return run


def attention_flops(attrs: DiffAttentionAttrs, batch: int, n: int) -> float:
    """Exact DIFF V1 work: S1, S2 (2 * 2N^2 d) and P1 V, P2 V (2 * 2N^2 * 2d) per diff-head."""
    per_head = 12 * n * n * attrs.head_dim
    return per_head * batch * attrs.num_heads * (0.5 if attrs.causal else 1.0)


def random_inputs(attrs: DiffAttentionAttrs, batch: int, q_len: int, kv_len: int, dtype, seed: int):
    """Contract inputs on the GPU: normal Q, K, V, lambda 0.4 (V1), weights near 1."""
    gen = torch.Generator(device="cuda").manual_seed(seed)
    q = torch.randn(batch, q_len, 2 * attrs.num_heads * attrs.head_dim, device="cuda", dtype=dtype, generator=gen)
    k = torch.randn(batch, kv_len, attrs.key_width, device="cuda", dtype=dtype, generator=gen)
    v = torch.randn(batch, kv_len, attrs.num_kv_heads * attrs.value_dim, device="cuda", dtype=dtype, generator=gen)
    lam = torch.tensor([0.4], device="cuda", dtype=dtype)
    w = 1 + 0.1 * torch.randn(attrs.value_dim, device="cuda", generator=gen)
    return q, k, v, lam, w


def bench_case(dtype, head_dim: int, causal: int, n: int, heads: int, warmup: int, repeats: int,
               backends: list[str], other_builds: dict, hopper_only: frozenset = frozenset(),
               masked_builds: tuple[str, ...] = ()) -> dict:
    batch = max(1, TOKENS_PER_BATCH // n)
    attrs = DiffAttentionAttrs(variant=1, num_heads=heads, num_kv_heads=heads, head_dim=head_dim, causal=causal,
                               output_scale=0.8)
    inputs = random_inputs(attrs, batch, n, n, dtype, n + head_dim + causal)  # q, k, v, lambda, norm weight
    q = inputs[0]
    out = torch.empty(batch, n, heads * attrs.value_dim, device="cuda", dtype=dtype)
    # "fused" and "fused_int8" are the mma.sync kernel on every GPU (mma: auto takes the Hopper path on
    # sm_90), so rows of different GPUs and builds compare the same code.
    methods = {
        "fused": on_path("mma", lambda: kernels.diff_attention(*inputs, attrs, out=out)),
        "fused_int8": on_path("mma", lambda: kernels.diff_attention(*inputs, attrs, logit_bits=8, out=out)),
    }
    hopper = hopper_available()
    if hopper:  # the sm_90a TMA + wgmma path beside the mma.sync one
        methods["fused_hopper"] = on_path("hopper", lambda: kernels.diff_attention(*inputs, attrs, out=out))
        if hopper_available("hopper-int8"):  # its INT8 logits: Q.K^T on s8 wgmma
            methods["fused_hopper_int8"] = on_path(
                "hopper", lambda: kernels.diff_attention(*inputs, attrs, logit_bits=8, out=out))
        # The control: the same call again, as a method of its own. Its ratio to the first is this
        # loop's noise for identical code, the yardstick for the other builds' ratios.
        methods[f"fused_hopper@{CONTROL}"] = methods["fused_hopper"]
    # The Hopper call with an all-ones key mask: what a KV-cache decoder's prompt prefill passes (its
    # attention_mask). Its output must be the unmasked call's bit for bit. Also from masked_builds.
    key_mask = torch.ones(batch, n, dtype=torch.int64, device="cuda")
    masked_libs = {HOPPER_MASKED: None} if hopper else {}
    masked_libs.update({f"{HOPPER_MASKED}@{b}": other_builds[b] for b in masked_builds
                        if hopper and b in other_builds and "sm90=1" in other_builds[b].diffx_build_info().decode()})
    masked_out = {name: torch.empty_like(out) for name in masked_libs}
    for name, lib in masked_libs.items():
        methods[name] = on_path("hopper", lambda name=name, lib=lib: kernels.diff_attention(
            *inputs, attrs, out=masked_out[name], key_mask=key_mask, lib=lib))
    for name, lib in other_builds.items():  # other builds of the library, timed in the same loop
        if name not in hopper_only:  # (a Hopper variant's mma.sync kernel is this build's)
            methods[f"fused@{name}"] = on_path("mma", lambda lib=lib: kernels.diff_attention(
                *inputs, attrs, out=out, lib=lib))
            methods[f"fused_int8@{name}"] = on_path("mma", lambda lib=lib: kernels.diff_attention(
                *inputs, attrs, logit_bits=8, out=out, lib=lib))
        if hopper and "sm90=1" in lib.diffx_build_info().decode():  # a build without the sm_90a path has no column
            methods[f"fused_hopper@{name}"] = on_path(
                "hopper", lambda lib=lib: kernels.diff_attention(*inputs, attrs, out=out, lib=lib))
    for backend in backends:  # each composition on each attention library, the backend forced
        for name, fn in (("flash_diff_1", reference.flash_diff_attention_1),
                         ("flash_diff_2", reference.flash_diff_attention_2)):
            methods[f"{name}/{backend}"] = forced(backend, fn, inputs, attrs)
    if batch * heads * n * n * 4 * 4 <= NAIVE_MAX_BYTES:
        methods["naive"] = lambda: reference.naive_diff_attention(*inputs, attrs)
    flops = attention_flops(attrs, batch, n)
    row = {"dtype": str(dtype).replace("torch.", ""), "d": head_dim, "causal": causal, "n": n, "batch": batch,
           "heads": heads, "backend": reference.attention_backend(q, q), "timings": {}}
    # (a backend refusing a value head of 2d is left out)
    for name, ms in interleaved_medians(methods, warmup, repeats).items():
        row["timings"][name] = {"ms": ms, "tflops": flops / (ms * 1e-3) / 1e12}
    exact = kernels.diff_attention(*inputs, attrs).float()
    quant = kernels.diff_attention(*inputs, attrs, logit_bits=8).float()
    row["int8_cosine"] = torch.nn.functional.cosine_similarity(quant.flatten(), exact.flatten(), dim=0).item()
    # Each other build's Hopper output on the same inputs against this build's: a variant is timed
    # beside this one only as the same function (its probe covers small shapes, this the timed ones).
    row["build_cosine"] = {}
    for name, lib in other_builds.items():
        if f"fused_hopper@{name}" in row["timings"]:
            other = on_path("hopper", lambda lib=lib: kernels.diff_attention(*inputs, attrs, lib=lib))().float()
            row["build_cosine"][name] = torch.nn.functional.cosine_similarity(
                other.flatten(), exact.flatten(), dim=0).nan_to_num(-1.0).item()
            del other
    # An all-ones key mask changes nothing: each masked call's output against its build's unmasked one.
    row["key_mask_same_output"] = {}
    for name, lib in masked_libs.items():
        plain = on_path("hopper", lambda lib=lib: kernels.diff_attention(*inputs, attrs, lib=lib))()
        methods[name]()
        row["key_mask_same_output"][name] = bool(torch.equal(masked_out[name], plain))
        del plain
    methods.clear()  # the timed lambdas, then the GPU tensors they held
    del q, exact, quant
    inputs = out = masked_out = key_mask = None
    torch.cuda.empty_cache()
    return row


@functools.cache
def hopper_available(probe: str = "hopper") -> bool:
    """An sm_90 GPU, a library with the Hopper path, and the path (probe: "hopper" for fp logits,
    "hopper-int8") passed its probe in a child process (a hung or faulting launch here would cost
    every row of the table)."""
    if kernel_probe.applicable(probe):
        return False
    reason = kernel_probe.probed(probe)
    if reason:
        print(f"Hopper path ({probe}) left out of the table, it failed its probe: {reason}", file=sys.stderr)
    return reason is None


def on_path(path: str, fn):
    """fn run with DIFFEXPORT_KERNEL_PATH=path (read by the library at each call), then unset again."""
    def run():
        os.environ[kernels.KERNEL_PATH_ENV] = path
        try:
            return fn()
        finally:
            os.environ.pop(kernels.KERNEL_PATH_ENV, None)
    return run


def table(rows: list[dict], peak: float) -> str:
    def cell(r):
        return "-" if r is None else f"{r['ms']:.3f} ({r['tflops']:.0f})"

    lines = ["| dtype | d (V) | causal | N | B x H | fused | fused INT8 | Hopper path | Hopper INT8 | best composition "
             "| which | fused vs best | Hopper vs best | INT8 vs fused | Hopper INT8 vs Hopper | fused % of matmul "
             "peak | Hopper % of matmul peak | INT8 cosine |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for row in rows:
        t = row["timings"]
        fused, int8, hopper = t.get("fused"), t.get("fused_int8"), t.get("fused_hopper")
        hopper_int8 = t.get("fused_hopper_int8")
        best = benchdoc.best_composition(t)
        vs_best = f"{best[1]['ms'] / fused['ms']:.2f}x" if fused and best else "-"
        hopper_vs_best = f"{best[1]['ms'] / hopper['ms']:.2f}x" if hopper and best else "-"
        vs_fused = f"{fused['ms'] / int8['ms']:.2f}x" if fused and int8 else "-"
        vs_hopper = f"{hopper['ms'] / hopper_int8['ms']:.2f}x" if hopper and hopper_int8 else "-"
        pct = f"{100 * fused['tflops'] / peak:.0f}%" if fused else "-"
        hopper_pct = f"{100 * hopper['tflops'] / peak:.0f}%" if hopper else "-"
        lines.append(f"| {row['dtype']} | {row['d']} ({2 * row['d']}) | {row['causal']} | {row['n']} "
                     f"| {row['batch']} x {row['heads']} | {cell(fused)} | {cell(int8)} | {cell(hopper)} "
                     f"| {cell(hopper_int8)} | {cell(best[1] if best else None)} | {best[0] if best else '-'} "
                     f"| {vs_best} | {hopper_vs_best} | {vs_fused} | {vs_hopper} | {pct} | {hopper_pct} "
                     f"| {row['int8_cosine']:.5f} |")
    return "\n".join(lines)


def composition_table(rows: list[dict]) -> str:
    """Every composition's median ms per case ('-': the backend refused the shape)."""
    names = sorted({name for row in rows for name in row["timings"] if not name.startswith("fused")})
    lines = ["| dtype | d | causal | N | " + " | ".join(names) + " |", "|---|---|---|---|" + "---|" * len(names)]
    for row in rows:
        cells = [f"{row['timings'][n]['ms']:.3f}" if n in row["timings"] else "-" for n in names]
        lines.append(f"| {row['dtype']} | {row['d']} | {row['causal']} | {row['n']} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


# The columns of builds_table: this build's method and its timing under each other build's name.
BUILD_COLUMNS = (("fused", "fused"), ("INT8", "fused_int8"), ("Hopper", "fused_hopper"))


def builds_table(rows: list[dict], names: list[str]) -> str:
    columns = [(title, key) for title, key in BUILD_COLUMNS if any(key in row["timings"] for row in rows)]
    head = "| dtype | d | causal | N | " + " | ".join(
        f"{title} | " + " | ".join(f"{title}@{n}" for n in names) for title, _ in columns) + " |"
    lines = [head, "|---|---|---|---|" + "---|" * (len(columns) * (1 + len(names)))]
    for row in rows:
        t = row["timings"]

        def cell(key, this):
            if key not in t or this not in t:
                return "-"
            return f"{t[key]['ms']:.3f} ({t[key]['ms'] / t[this]['ms']:.2f}x)"
        cells = []
        for _, key in columns:
            cells.append(f"{t[key]['ms']:.3f}" if key in t else "-")
            cells.extend(cell(f"{key}@{n}", key) for n in names)
        lines.append(f"| {row['dtype']} | {row['d']} | {row['causal']} | {row['n']} | " + " | ".join(cells) + " |")
    agree = [f"{n} {min(r['build_cosine'][n] for r in rows if n in r.get('build_cosine', {})):.6f}" for n in names
             if any(n in r.get("build_cosine", {}) for r in rows)]
    if agree:
        lines.append("\nHopper output of each other build against this build's on the timed inputs, worst cosine: "
                     + ", ".join(agree) + ".")
    return "\n".join(lines)


def profile_launches(n: int, lib_path: Path | None = None, logit_bits: int = 0, head_dim: int = 128) -> None:
    """Launches for Nsight Compute: 3 warm-up launches of the fused kernel then the profiled one, on
    bf16, d=head_dim, non-causal, B*N = 16384 tokens, 16 diff-heads. The kernel is the one
    DIFFEXPORT_KERNEL_PATH picks (the campaign sets mma or hopper); lib_path: another build (before/after);
    logit_bits 8: INT8 logits (each launch is then the K pre-pass kernels and the attention kernel)."""
    lib = kernels.open_library(lib_path, prefill_only=True) if lib_path else kernels.load_library()
    batch, heads = max(1, TOKENS_PER_BATCH // n), 16
    attrs = DiffAttentionAttrs(variant=1, num_heads=heads, num_kv_heads=heads, head_dim=head_dim, causal=0)
    inputs = random_inputs(attrs, batch, n, n, torch.bfloat16, n)
    for _ in range(4):
        kernels.diff_attention(*inputs, attrs, lib=lib, logit_bits=logit_bits)
    torch.cuda.synchronize()


HOPPER_MASKED = "fused_hopper_key_mask"  # the Hopper prefill call with a key mask


def key_mask_table(rows: list[dict]) -> str:
    """The Hopper prefill calls with an all-ones key mask against the same calls without, this build's
    and each --masked-compare build's ('-' where a case has no such timing)."""
    builds = list(dict.fromkeys(name.split("@", 1)[1] for row in rows for name in row["timings"]
                                if name.startswith(f"{HOPPER_MASKED}@")))
    pairs = [(HOPPER_MASKED, "fused_hopper", "this build")] + [
        (f"{HOPPER_MASKED}@{b}", f"fused_hopper@{b}", b) for b in builds]
    lines = ["| dtype | d | causal | N | " + " | ".join(f"{what}: masked ms (vs none)" for *_, what in pairs) + " |",
             "|---|---|---|---|" + "---|" * len(pairs)]
    for row in rows:
        t, same = row["timings"], row.get("key_mask_same_output", {})
        cells = []
        for masked, plain, _ in pairs:
            if masked not in t or plain not in t:
                cells.append("-")
                continue
            differs = "" if same.get(masked, True) else ", output differs"
            cells.append(f"{t[masked]['ms']:.3f} ({t[masked]['ms'] / t[plain]['ms']:.2f}x{differs})")
        lines.append(f"| {row['dtype']} | {row['d']} | {row['causal']} | {row['n']} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


DECODE_GRAPH_CALLS = 20
DECODE_COMPOSITION_WARMUP, DECODE_COMPOSITION_REPEATS = 1, 3  # replays of a composition's graph in --decode
KV_CACHE_FORMATS = ("int8", "fp8")  # the 8-bit caches decode is timed on beside the float one
MASKED, MASKED_INT8 = "split_kv_key_mask", "split_kv_int8_cache_key_mask"  # decode calls with a key mask


def captured(fn) -> torch.cuda.CUDAGraph:
    """DECODE_GRAPH_CALLS calls of fn captured as one CUDA graph (timed per replay, so that Python's
    launch overhead is not in the numbers)."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # warm-up outside the capture (allocations, kernel attributes)
        fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(DECODE_GRAPH_CALLS):
            fn()
    return graph


def graph_ms(fn, warmup: int, repeats: int) -> float:
    """Median ms of one call of fn, replayed as a CUDA graph of DECODE_GRAPH_CALLS calls."""
    return median_ms(captured(fn).replay, warmup, repeats) / DECODE_GRAPH_CALLS


def copy_bandwidth_gbs() -> float:
    """Device-to-device copy of 2 GiB: read + write bytes over time (the bound a decode kernel nears)."""
    src = torch.empty(2**30, dtype=torch.float16, device="cuda").normal_()
    dst = torch.empty_like(src)
    ms = median_ms(lambda: dst.copy_(src), 3, 20)
    return 2 * src.numel() * src.element_size() / (ms * 1e-3) / 1e9


def prepared_call(inputs, attrs, out, *, bits: int = 0, path: str = "auto", lib=None, kv_scales=None, key_mask=None):
    """Our library (or `lib`, another build) called directly on prepared params and a preallocated
    workspace (capturable), with DIFFEXPORT_KERNEL_PATH set to `path` for the call; returns (fn, plan).
    kv_scales: inputs hold an 8-bit KV cache's codes (kernels.diff_attention)."""
    lib = lib or kernels.load_library()
    params = kernels.make_params(*inputs, out, attrs, logit_bits=bits, kv_scales=kv_scales, key_mask=key_mask)
    size = lib.diffx_attention_workspace_size(ctypes.byref(params))
    workspace = torch.empty(max(size, 1), dtype=torch.uint8, device="cuda")
    params.workspace, params.workspace_bytes = (workspace.data_ptr(), size) if size else (None, 0)
    os.environ[kernels.KERNEL_PATH_ENV] = path
    plan = kernels.kernel_plan(params, lib)

    def run(workspace=workspace):
        os.environ[kernels.KERNEL_PATH_ENV] = path
        stream = ctypes.c_void_p(torch.cuda.current_stream().cuda_stream)
        status = lib.diffx_attention_forward(ctypes.byref(params), stream)
        if status != kernels.STATUS_OK:
            raise kernels.status_error(lib, status)
    return run, plan


def decode_case(dtype, head_dim: int, q_len: int, kv_len: int, batch: int, heads: int, kv_heads: int, warmup: int,
                repeats: int, backends: list[str], other_builds: dict | None = None,
                masked_builds: tuple[str, ...] = ()) -> dict:
    attrs = DiffAttentionAttrs(variant=1, num_heads=heads, num_kv_heads=kv_heads, head_dim=head_dim, causal=1,
                               output_scale=0.8)
    inputs = q, k, v, lam, w = random_inputs(attrs, batch, q_len, kv_len, dtype, kv_len + head_dim + q_len)
    out = torch.empty(batch, q_len, heads * attrs.value_dim, device="cuda", dtype=dtype)
    nbytes = sum(t.numel() * t.element_size() for t in (q, k, v, out))
    methods, plans = {}, {}
    for name, bits, path in (("split_kv", 0, "auto"), ("one_pass", 0, "mma"), ("split_kv_int8", 8, "auto")):
        methods[name], plans[name] = prepared_call(inputs, attrs, out, bits=bits, path=path)
    # An 8-bit KV cache of the same keys and values (static per-channel scales from these keys, K
    # smoothed): the decode kernel reads the codes, half the bytes of a bf16 cache.
    caches, kv_out, cache_bytes = {}, {}, {}
    for fmt in KV_CACHE_FORMATS:
        scales = KvCacheScales.calibrate(k, v, fmt)
        codes = (q, scales.quantise_keys(k), scales.quantise_values(v), lam, w)
        caches[fmt] = (codes, (scales.k_scale, scales.v_scale))
        kv_out[fmt] = torch.empty_like(out)
        cache_bytes[f"split_kv_{fmt}_cache"] = sum(t.numel() * t.element_size() for t in (q, *codes[1:3], out))
        methods[f"split_kv_{fmt}_cache"], _ = prepared_call(codes, attrs, kv_out[fmt], kv_scales=caches[fmt][1])
    # The same calls with the key mask every KV-cache decoder passes (op version 2: attention_mask),
    # all ones here (a batch of equal lengths): what a deployed decode step runs, whose output must
    # be the unmasked call's bit for bit. Also from each build of masked_builds (its int8-cache call
    # too, where the build has 8-bit caches).
    key_mask = torch.ones(batch, kv_len, dtype=torch.int64, device="cuda")
    masked_names = (MASKED, MASKED_INT8, *(f"{name}@{b}" for b in masked_builds for name in (MASKED, MASKED_INT8)))
    masked_out = {name: torch.empty_like(out) for name in masked_names}
    methods[MASKED], _ = prepared_call(inputs, attrs, masked_out[MASKED], key_mask=key_mask)
    methods[MASKED_INT8], _ = prepared_call(caches["int8"][0], attrs, masked_out[MASKED_INT8],
                                            kv_scales=caches["int8"][1], key_mask=key_mask)
    cache_bytes[MASKED_INT8] = cache_bytes["split_kv_int8_cache"]
    for build, lib in (other_builds or {}).items():  # the same split-KV calls from each other build
        methods[f"split_kv@{build}"], plans[f"split_kv@{build}"] = prepared_call(inputs, attrs, out, path="auto",
                                                                               lib=lib)
        if build in masked_builds:
            methods[f"{MASKED}@{build}"], _ = prepared_call(inputs, attrs, masked_out[f"{MASKED}@{build}"],
                                                            key_mask=key_mask, lib=lib)
            methods[f"{MASKED_INT8}@{build}"], _ = prepared_call(
                caches["int8"][0], attrs, masked_out[f"{MASKED_INT8}@{build}"], kv_scales=caches["int8"][1],
                key_mask=key_mask, lib=lib)
            cache_bytes[f"{MASKED_INT8}@{build}"] = cache_bytes["split_kv_int8_cache"]
        for fmt in KV_CACHE_FORMATS:  # (a build older than the 8-bit caches refuses them: not measured)
            name = f"split_kv_{fmt}_cache@{build}"
            kv_out[name] = torch.empty_like(out)
            cache_bytes[name] = cache_bytes[f"split_kv_{fmt}_cache"]
            methods[name], _ = prepared_call(caches[fmt][0], attrs, kv_out[name], kv_scales=caches[fmt][1], lib=lib)
    os.environ.pop(kernels.KERNEL_PATH_ENV, None)
    row = {"dtype": str(dtype).replace("torch.", ""), "d": head_dim, "q_len": q_len, "kv_len": kv_len,
           "batch": batch, "heads": heads, "kv_heads": kv_heads, "bytes": nbytes,
           "splits": plans["split_kv"][1], "timings": {},
           # each other build's plan for the bf16 call (a plan from the GPU's SMs, onewave's, differs)
           "splits_by_build": {name.partition("@")[2]: plan[1] for name, plan in plans.items() if "@" in name}}

    def record(name, ms):
        row["timings"][name] = {"ms": ms, "gbs": cache_bytes.get(name, nbytes) / (ms * 1e-3) / 1e9}

    # Our kernels' calls (every build's), captured first and timed in rounds: their ratios are what
    # the table compares. (Each graph holds only the call's launches: these calls allocate nothing.)
    graphs = {}
    for name, fn in methods.items():
        try:
            graphs[name] = captured(fn).replay
        except (RuntimeError, torch.OutOfMemoryError) as exc:
            not_measured(name, exc)
        finally:
            os.environ.pop(kernels.KERNEL_PATH_ENV, None)
    for name, ms in interleaved_medians(graphs, warmup, repeats).items():
        record(name, ms / DECODE_GRAPH_CALLS)
    del graphs
    # The compositions, one after another: each graph holds its call's temporaries (the GQA-expanded
    # K and V, gigabytes at 128k keys), released before the next. They are 1.7-21x slower than the
    # split-KV call (H200, 2026-11-28), so fewer replays tell which is best: at 128k keys their full
    # count was most of the decode bench's time.
    for backend in backends:
        for name, fn in (("flash_diff_1", reference.flash_diff_attention_1),
                         ("flash_diff_2", reference.flash_diff_attention_2)):
            try:
                record(f"{name}/{backend}", graph_ms(forced(backend, fn, inputs, attrs),
                                                     min(warmup, DECODE_COMPOSITION_WARMUP),
                                                     min(repeats, DECODE_COMPOSITION_REPEATS)))
            except (RuntimeError, torch.OutOfMemoryError) as exc:
                not_measured(f"{name}/{backend}", exc)
            torch.cuda.empty_cache()
    exact = torch.as_tensor(reference.flash_diff_attention_1(*[t.float() for t in inputs], attrs))
    methods["split_kv"]()
    row["max_err_vs_fp32"] = (out.float() - exact).abs().max().item()
    row["cosine_vs_fp32"] = {"bf16_cache" if dtype == torch.bfloat16 else "fp16_cache": cosine(out, exact)}
    for fmt in KV_CACHE_FORMATS:  # the 8-bit cache's outputs against the float32 reference on the float cache
        methods[f"split_kv_{fmt}_cache"]()
        row["cosine_vs_fp32"][f"{fmt}_cache"] = cosine(kv_out[fmt], exact)
        for build in other_builds or {}:  # ... and each other build's, where it ran
            name = f"split_kv_{fmt}_cache@{build}"
            if name in row["timings"]:
                methods[name]()
                row["cosine_vs_fp32"][f"{fmt}_cache@{build}"] = cosine(kv_out[name], exact)
    # An all-ones key mask changes nothing: each masked call's output against its unmasked call's.
    unmasked = {MASKED: (methods["split_kv"], out), MASKED_INT8: (methods["split_kv_int8_cache"], kv_out["int8"])}
    unmasked.update({f"{MASKED}@{b}": (methods[f"split_kv@{b}"], out) for b in masked_builds
                     if f"split_kv@{b}" in methods})
    unmasked.update({f"{MASKED_INT8}@{b}": (methods[f"split_kv_int8_cache@{b}"], kv_out[f"split_kv_int8_cache@{b}"])
                     for b in masked_builds if f"split_kv_int8_cache@{b}" in row["timings"]})
    row["key_mask_same_output"] = {}
    for name, (plain, plain_out) in unmasked.items():
        if name in row["timings"]:
            plain()
            methods[name]()
            row["key_mask_same_output"][name] = bool(torch.equal(masked_out[name], plain_out))
    del inputs, q, k, v, out, exact, caches, kv_out, masked_out, key_mask
    torch.cuda.empty_cache()
    return row


CTA_COST_KEYS = (256, 512, 1024, 2048, 4096)  # keys per CTA: 4-64 tiles, past the pipeline's 3-4 stages
CTA_COST_QUERIES = 4096  # with TOKENS_PER_BATCH: the 4096 CTAs of every timed prefill case


def fixed_cost_fit(points: list[tuple[int, float]]) -> dict:
    """The least-squares line ms = intercept + slope * keys through (keys, ms), with the largest
    relative distance of a point from it (how straight the measured line is)."""
    fit = statistics.linear_regression([k for k, _ in points], [ms for _, ms in points])
    worst = max(abs(ms - (fit.intercept + fit.slope * k)) / ms for k, ms in points)
    return {"intercept_ms": fit.intercept, "ms_per_1k_keys": 1000 * fit.slope, "worst_residual": worst}


def cta_cost_case(dtype, head_dim: int, heads: int, warmup: int, repeats: int, lib=None) -> dict | None:
    """The Hopper path (lib: another build's) on the timed cases' grid, non-causal, against
    CTA_COST_KEYS keys; None when the library does not plan the Hopper kernel for it."""
    batch = max(1, TOKENS_PER_BATCH // CTA_COST_QUERIES)
    attrs = DiffAttentionAttrs(variant=1, num_heads=heads, num_kv_heads=heads, head_dim=head_dim, causal=0,
                               output_scale=0.8)
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    tiles = batch * heads * -(-CTA_COST_QUERIES // 64)  # 64 query rows each: one a CTA, or a persistent CTA's turn
    # Each key count's graph, timed in rounds with the others; `held` keeps what its launches read and
    # write alive until then (the inputs, the output, and the call, whose closure owns the workspace).
    graphs, held = {}, []
    try:
        for keys in CTA_COST_KEYS:
            inputs = random_inputs(attrs, batch, CTA_COST_QUERIES, keys, dtype, keys + head_dim)
            out = torch.empty(batch, CTA_COST_QUERIES, heads * attrs.value_dim, device="cuda", dtype=dtype)
            fn, plan = prepared_call(inputs, attrs, out, path="hopper", lib=lib)
            if plan[0] != "hopper":
                return None
            graphs[keys] = captured(fn).replay
            held.append((inputs, out, fn))
        medians = interleaved_medians(graphs, warmup, repeats)
        if len(medians) < len(CTA_COST_KEYS):
            raise RuntimeError("a key count could not be timed")
        points = [(keys, medians[keys] / DECODE_GRAPH_CALLS) for keys in CTA_COST_KEYS]
    finally:
        os.environ.pop(kernels.KERNEL_PATH_ENV, None)
        graphs = held = None
        torch.cuda.empty_cache()
    # One CTA a streaming multiprocessor at a time (its shared memory), so ceil(tiles / sms) waves.
    waves = -(-tiles // sms)
    fit = fixed_cost_fit(points)
    return {"dtype": str(dtype).replace("torch.", ""), "d": head_dim, "tiles": tiles, "sms": sms, "waves": waves,
            "points": points, **fit, "per_tile_us": 1000 * fit["intercept_ms"] / waves}


def run_cta_cost(args, other_builds: dict) -> int:
    if not hopper_available():
        print("error: --cta-cost needs the Hopper path: an sm_90 GPU and a library with it that passes its probe",
              file=sys.stderr)
        return 2
    builds = {"this build": None}
    builds.update({name: lib for name, lib in other_builds.items() if "sm90=1" in lib.diffx_build_info().decode()})
    record = {"mode": "cta_cost", "rows": [], "stamp": benchdoc.stamp(), "warmup": args.warmup,
              "repeats": args.repeats, "command": args.command}
    for name, lib in builds.items():
        for d in args.head_dims:
            print(f"{name}: Hopper path d={d}, {CTA_COST_QUERIES} queries against {CTA_COST_KEYS} keys ...",
                  file=sys.stderr, flush=True)
            try:
                row = cta_cost_case(getattr(torch, args.dtypes[0]), d, args.heads, args.warmup, args.repeats, lib)
            except (RuntimeError, DiffExportError) as exc:  # one build's failure leaves the others' rows
                not_measured(name, exc)
                continue
            if row is None:
                print(f"  {name}: the Hopper kernel is not what it plans here; left out", file=sys.stderr)
                continue
            record["rows"].append({"build": name, **row})
            save_partial(args.json, record)
    print(cta_cost_table(record["rows"]))
    return 0


def cta_cost_table(rows: list[dict]) -> str:
    lines = ["| build | dtype | d (V) | tiles | waves | ms at " + " / ".join(map(str, CTA_COST_KEYS)) + " keys "
             "| fixed ms per launch | us per tile | ms per 1k keys | worst point off the line |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['build']} | {r['dtype']} | {r['d']} ({2 * r['d']}) | {r['tiles']} | {r['waves']} "
                     f"| {' / '.join(f'{ms:.3f}' for _, ms in r['points'])} | {r['intercept_ms']:.3f} "
                     f"| {r['per_tile_us']:.1f} | {r['ms_per_1k_keys']:.3f} | {100 * r['worst_residual']:.1f}% |")
    return "\n".join(lines)


def cosine(out: torch.Tensor, exact: torch.Tensor) -> float:
    return torch.nn.functional.cosine_similarity(out.double().flatten(), exact.double().flatten(), dim=0).item()


def kv8_build_ratios(timings: dict, build: str) -> str:
    """Each 8-bit cache's time from `build` over this build's ("-" where either is missing)."""
    def ratio(fmt):
        this, other = timings.get(f"split_kv_{fmt}_cache"), timings.get(f"split_kv_{fmt}_cache@{build}")
        return f"{other['ms'] / this['ms']:.2f}x" if this and other else "-"
    return " / ".join(ratio(fmt) for fmt in KV_CACHE_FORMATS)


def decode_table(rows: list[dict], copy_gbs: float) -> str:
    def cell(t):
        return "-" if t is None else f"{t['ms'] * 1e3:.1f} ({t['gbs']:.0f})"

    builds = sorted({name.split("@", 1)[1] for row in rows for name in row["timings"] if "@" in name})
    masked = [b for b in builds if any(f"{MASKED}@{b}" in row["timings"] for row in rows)]

    def build_cell(row, b):  # another build's bf16 call, with its splits where its plan differs (onewave)
        splits = row.get("splits_by_build", {}).get(b, row["splits"])
        return cell(row["timings"].get(f"split_kv@{b}")) + ("" if splits == row["splits"] else f", {splits} splits")

    def mask_cost(row, masked_name, plain_name):  # a key-masked call's time over the unmasked one's
        t, same = row["timings"], row.get("key_mask_same_output", {})
        if masked_name not in t or plain_name not in t:
            return "-"
        differs = "" if same.get(masked_name, True) else " (output differs)"
        return f"{t[masked_name]['ms'] / t[plain_name]['ms']:.2f}x{differs}"

    lines = ["| dtype | d (V) | Sq | keys | B x H (kv) | splits | split-KV | one-pass | split-KV INT8 | best "
             "composition "
             "| which | split-KV vs best | vs one-pass | % of copy GB/s | int8 cache | fp8 cache "
             "| 8-bit KV vs bf16 KV (int8 / fp8) | cosine vs fp32 (int8 / fp8) | key mask vs none (bf16 / int8) |"
             + "".join(f" split-KV @{b} | this vs @{b} | 8-bit KV @{b} vs this (int8 / fp8) |" for b in builds)
             + "".join(f" key mask vs none @{b} (bf16 / int8) |" for b in masked),
             "|---" * 19 + "|" + "---|---|---|" * len(builds) + "---|" * len(masked)]
    for row in rows:
        t = row["timings"]
        ours = t.get("split_kv")
        best = benchdoc.best_composition(t)
        vs_best = f"{best[1]['ms'] / ours['ms']:.2f}x" if ours and best else "-"
        vs_one = f"{t['one_pass']['ms'] / ours['ms']:.2f}x" if ours and "one_pass" in t else "-"
        pct = f"{100 * ours['gbs'] / copy_gbs:.0f}%" if ours else "-"
        kv8 = [t.get(f"split_kv_{fmt}_cache") for fmt in KV_CACHE_FORMATS]
        kv8_vs = " / ".join(f"{ours['ms'] / c['ms']:.2f}x" if ours and c else "-" for c in kv8)
        cos = row.get("cosine_vs_fp32", {})
        kv8_cos = " / ".join(f"{cos[f'{fmt}_cache']:.5f}" if f"{fmt}_cache" in cos else "-" for fmt in KV_CACHE_FORMATS)
        lines.append(f"| {row['dtype']} | {row['d']} ({2 * row['d']}) | {row['q_len']} | {row['kv_len']} "
                     f"| {row['batch']} x {row['heads']} ({row['kv_heads']}) | {row['splits']} | {cell(ours)} "
                     f"| {cell(t.get('one_pass'))} | {cell(t.get('split_kv_int8'))} "
                     f"| {cell(best[1] if best else None)} | {best[0] if best else '-'} | {vs_best} | {vs_one} | {pct} "
                     f"| {cell(kv8[0])} | {cell(kv8[1])} | {kv8_vs} | {kv8_cos} "
                     f"| {mask_cost(row, MASKED, 'split_kv')} / {mask_cost(row, MASKED_INT8, 'split_kv_int8_cache')} |"
                     + "".join((f" {build_cell(row, b)} | "
                                f"{t[f'split_kv@{b}']['ms'] / ours['ms']:.2f}x |" if ours and f"split_kv@{b}" in t
                                else " - | - |") + f" {kv8_build_ratios(t, b)} |" for b in builds)
                     + "".join(f" {mask_cost(row, f'{MASKED}@{b}', f'split_kv@{b}')} / "
                               f"{mask_cost(row, f'{MASKED_INT8}@{b}', f'split_kv_int8_cache@{b}')} |" for b in masked))
    return "\n".join(lines)


def render(path: Path, write: bool) -> int:
    """The tables of a saved --json run, printed (and with write, its section of docs/BENCHMARKS.md
    replaced); a file that is not one is one error line and 2, with nothing written."""
    if path.is_symlink() or not path.is_file():
        print(f"error: --render {path}: needs a saved run's JSON file (not a link)", file=sys.stderr)
        return 2
    if path.stat().st_size > benchdoc.MAX_RESULT_BYTES:
        print(f"error: --render {path}: {path.stat().st_size >> 20} MiB, more than a run writes", file=sys.stderr)
        return 2
    try:  # every table is built before anything is written
        record = json.loads(path.read_text(errors="replace"))
        if record.get("mode") == "decode":
            publish_decode(record, write)
        elif record.get("mode") == "cta_cost":
            print(cta_cost_table(record["rows"]))
        else:
            publish(record, timed_builds(record), write)
    except (json.JSONDecodeError, KeyError, TypeError, AttributeError, ValueError, ZeroDivisionError) as exc:
        print(f"error: --render {path}: not what bench_attention.py --json writes ({type(exc).__name__}: {exc})",
              file=sys.stderr)
        return 2
    return 0


def publish_decode(record: dict, write: bool) -> None:
    text = decode_table(record["rows"], record["copy_gbs"])
    if completeness(record):
        print(completeness(record), file=sys.stderr)
    print(text)
    if not write:
        return
    body = (f"## Split-KV decode on the GPU (DIFF V1, causal, forward)\n\n`{record['command']}`\n\n"
            f"{completeness(record)}{record['stamp']} Device-to-device copy bandwidth measured in this run: "
            f"{record['copy_gbs']:.0f} GB/s "
            f"(read + write of 2 GiB). Cells: median µs per call (achieved GB/s on the bytes of Q, K, V and the "
            f"output once), each call timed inside a CUDA graph of {DECODE_GRAPH_CALLS} calls, {record['repeats']} "
            f"replays after {record['warmup']} warm-up"
            f"{rounds_sentence(record, 'our kernels (every build), the compositions one after another')} "
            + (f"The compositions: {record['composition_repeats']} replays after {record['composition_warmup']} "
               "warm-up. " if "composition_repeats" in record else "") +
            "One-pass: the same call with DIFFEXPORT_KERNEL_PATH=mma. "
            "INT8 includes its K quantisation pre-pass (which reads all of K once more). int8 / fp8 cache: the same "
            "keys and values as an 8-bit KV cache (per-channel static scales, K smoothed; GB/s on its own bytes), "
            "the ratio is the bf16/fp16 split-KV call's time over the 8-bit one's, and the cosine is of its output "
            "against the float32 reference on the float cache; '8-bit KV @build vs this' is that build's 8-bit call's "
            "time over this build's. 'key mask vs none': the bf16 call's and the int8 cache's time with an "
            "all-ones key mask [B, keys] (what every KV-cache decoder passes) over the same call without one "
            "(each masked output is checked bit for bit against the unmasked one). Compositions: "
            f"FlashDiffAttn_1/_2 on {', '.join(record['backends'])}.\n\n" + text + "\n")
    print(f"wrote {benchdoc.write_section('fused-attention-decode', body)}", file=sys.stderr)


def profile_decode_launches(kv_len: int, kv_cache: str | None = None) -> None:
    """Launches for Nsight Compute: 3 warm-up decode steps then the profiled one (bf16, d=128,
    Sq=1, batch 4, 16 diff-heads over 4 kv groups); kv_cache: the same keys and values as an 8-bit
    cache of that format."""
    kernels.load_library()
    attrs = DiffAttentionAttrs(variant=1, num_heads=16, num_kv_heads=4, head_dim=128, causal=1)
    q, k, v, lam, w = random_inputs(attrs, 4, 1, kv_len, torch.bfloat16, kv_len)
    kv_scales = None
    if kv_cache:
        scales = KvCacheScales.calibrate(k, v, kv_cache)
        k, v, kv_scales = scales.quantise_keys(k), scales.quantise_values(v), (scales.k_scale, scales.v_scale)
    for _ in range(4):
        kernels.diff_attention(q, k, v, lam, w, attrs, kv_scales=kv_scales)
    torch.cuda.synchronize()


def timed_builds(record: dict) -> list[str]:
    """The other builds (and the control) a prefill run timed, in the order it timed them (a set's
    order would change from one process to the next)."""
    return list(dict.fromkeys(name.split("@", 1)[1] for row in record["rows"] for name in row["timings"]
                              if "@" in name))


def publish(record: dict, builds: list[str], write: bool) -> None:
    """Print the tables of a run (beside the timings of `builds`, timed_builds) and, with write,
    replace the section of docs/BENCHMARKS.md."""
    rows, peak = record["rows"], record["peak_tflops"]
    text = table(rows, peak) + "\n\nAll compositions, median ms:\n\n" + composition_table(rows)
    if completeness(record):
        print(completeness(record), file=sys.stderr)
    if builds:
        text += ("\n\nThis build vs the others, median ms (ratio = other / this):\n\n"
                 + builds_table(rows, builds))
    if any(HOPPER_MASKED in row["timings"] for row in rows):
        text += ("\n\nThe Hopper call with an all-ones key mask (what a KV-cache decoder's prompt prefill passes), "
                 "median ms and its ratio to the same build's call without one; each masked output is checked "
                 "bit for bit against the unmasked one:\n\n" + key_mask_table(rows))
    print(text)
    if not write:
        return
    body = (f"## Fused differential attention on the GPU (DIFF V1, forward)\n\n`{record['command']}`\n\n"
            f"{completeness(record)}{record['stamp']} Measured bf16 matmul peak (8192^3) in this run: "
            f"{peak:.0f} TFLOP/s. "
            f"Cells: median ms (TFLOP/s on 12*N^2*d per diff-head, halved for causal), {record['repeats']} runs "
            f"after {record['warmup']} warm-up{rounds_sentence(record, 'every method, the compositions too')} "
            "Compositions: FlashDiffAttn_1/_2 on the default attention library "
            f"(`{rows[0]['backend']}`) and with each torch SDPA backend forced ({', '.join(record['backends'])}), "
            "and the naive form where it fits; 'best' is the fastest of them in this run. Fused: the mma.sync "
            "one-pass kernel (DIFFEXPORT_KERNEL_PATH=mma). INT8 = 8-bit logits with K-smoothing, including the K "
            "quantisation pre-pass; its cosine is the default (auto) path's INT8 output against its fp output on "
            "the same inputs. Hopper path: the sm_90a TMA + wgmma kernel (DIFFEXPORT_KERNEL_PATH=hopper), what "
            "the default (auto) runs on sm_90 GPUs whose library has it, and Hopper INT8 its INT8 logits (Q.K^T "
            "on s8 wgmma, with the same pre-pass); '-' where the GPU or the build has none."
            + (f" Hopper@{CONTROL}: this build's Hopper call timed a second time, as a method of its own: its "
               "ratio is the loop's noise for identical code." if CONTROL in builds else "")
            + "\n\n" + text + "\n")
    print(f"wrote {benchdoc.write_section('fused-attention', body)}", file=sys.stderr)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dtypes", nargs="+", default=["bfloat16", "float16"])
    parser.add_argument("--head-dims", nargs="+", type=int, default=[128, 64])
    parser.add_argument("--seqs", nargs="+", type=int, default=[1024, 4096, 16384])
    parser.add_argument("--causal", nargs="+", type=int, default=[0, 1])
    parser.add_argument("--heads", type=int, default=16, help="diff-heads per batch element (default 16)")
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--repeats", type=int, default=10)
    parser.add_argument("--backends", nargs="+", default=["default", *SDPA_BACKENDS],
                        help="attention libraries for the compositions: default and/or forced SDPA backends")
    parser.add_argument("--json", type=Path, help="also write the raw rows here")
    parser.add_argument("--compare", nargs="*", default=[], metavar="NAME=PATH",
                        help="other builds of the kernel library, timed beside the current one (before/after)")
    parser.add_argument("--hopper-variants", nargs="*", default=[], metavar="NAME=PATH",
                        help="builds that differ from this one in the Hopper path only: timed on it alone (not in "
                             "--decode)")
    parser.add_argument("--profile", type=int, metavar="N", help="only launch the fused kernel 4 times at N (for ncu)")
    parser.add_argument("--profile-lib", type=Path, metavar="PATH",
                        help="--profile: launch this build of the library (an older prefill-compatible ABI too)")
    parser.add_argument("--profile-head-dim", type=int, default=128, choices=(64, 128),
                        help="--profile: the head dim of the launches (64: the d = 64 cases)")
    parser.add_argument("--profile-logit-bits", type=int, default=0, choices=(0, 8),
                        help="--profile: 8 launches INT8 logits (K pre-pass kernels, then the attention kernel)")
    parser.add_argument("--profile-decode", type=int, metavar="KEYS",
                        help="only launch the split-KV decode kernel 4 times against KEYS keys (for ncu)")
    parser.add_argument("--profile-kv-cache", choices=KV_CACHE_FORMATS,
                        help="--profile-decode: the keys and values as an 8-bit KV cache of this format")
    parser.add_argument("--render", type=Path, metavar="JSON", help="print (or --write) the tables of a saved --json "
                                                                    "run")
    parser.add_argument("--write", action="store_true", help="replace the section in docs/BENCHMARKS.md")
    parser.add_argument("--decode", action="store_true",
                        help="decode steps instead: --queries tokens against --keys cached keys, in GB/s")
    parser.add_argument("--queries", nargs="+", type=int, default=[1, 4], help="decode: query tokens per call")
    parser.add_argument("--keys", nargs="+", type=int, default=[1024, 8192, 32768, 131072],
                        help="decode: cached keys")
    parser.add_argument("--decode-batch", type=int, default=4, help="decode: batch (default 4)")
    parser.add_argument("--kv-heads", type=int, help="decode: kv groups (default --heads / 4: GQA 4)")
    parser.add_argument("--masked-compare", nargs="*", default=[], metavar="NAME",
                        help="builds of --compare whose split-KV call (decode) or Hopper call (prefill) is also "
                             "timed with an all-ones key mask (this build's always is)")
    parser.add_argument("--cta-cost", action="store_true",
                        help="the Hopper path's fixed cost per CTA instead (first of --dtypes, each of --head-dims)")
    argv = sys.argv[1:] if argv is None else argv
    args = parser.parse_args(argv)
    args.command = "python tools/bench_attention.py " + " ".join(argv)  # as the run records it
    if args.render:  # a run saved on the GPU machine: its own stamp and command, no GPU needed here
        return render(args.render, args.write)
    if CONTROL in (spec.partition("=")[0] for spec in args.compare + args.hopper_variants):
        print(f"error: '{CONTROL}' names the control (this build timed twice): give the build another name",
              file=sys.stderr)
        return 2
    unknown = set(args.masked_compare) - {spec.partition("=")[0] for spec in args.compare}
    if unknown:
        print(f"error: --masked-compare {' '.join(sorted(unknown))}: not a build of --compare", file=sys.stderr)
        return 2
    if not torch.cuda.is_available():
        print("error: this benchmark needs a CUDA GPU", file=sys.stderr)
        return 2
    if args.profile:
        profile_launches(args.profile, args.profile_lib, args.profile_logit_bits, args.profile_head_dim)
        return 0
    if args.profile_decode:
        profile_decode_launches(args.profile_decode, args.profile_kv_cache)
        return 0
    kernels.load_library()
    other_builds = {}
    # Hopper variants share this build's mma.sync and decode kernels: decode leaves them out.
    hopper_only = frozenset(spec.partition("=")[0] for spec in args.hopper_variants)
    for spec in args.compare + ([] if args.decode else args.hopper_variants):
        name, _, path = spec.partition("=")
        try:
            other_builds[name] = kernels.open_library(Path(path), prefill_only=not args.decode,
                                                      float_cache_only=args.decode)
        except DiffExportError as exc:  # the table of this build still comes out
            print(f"--compare {name}: left out: {exc}", file=sys.stderr)
    if args.decode:
        return run_decode(args, other_builds)
    if args.cta_cost:
        return run_cta_cost(args, other_builds)
    peak = matmul_peak_tflops()
    print(f"bf16 matmul 8192^3: {peak:.0f} TFLOP/s", file=sys.stderr)
    cases = [(dtype, d, causal, n) for dtype in args.dtypes for d in args.head_dims for causal in args.causal
             for n in args.seqs]
    record = {"peak_tflops": peak, "rows": [], "cases": len(cases), "complete": False, "stamp": benchdoc.stamp(),
              "command": args.command,
              "warmup": args.warmup, "repeats": args.repeats, "backends": args.backends, "rounds": True}
    for dtype, d, causal, n in cases:
        print(f"{dtype} d={d} causal={causal} N={n} ...", file=sys.stderr, flush=True)
        record["rows"].append(bench_case(getattr(torch, dtype), d, causal, n, args.heads, args.warmup, args.repeats,
                                         args.backends, other_builds, hopper_only, tuple(args.masked_compare)))
        save_partial(args.json, record)
    record["complete"] = True
    save_partial(args.json, record)
    publish(record, timed_builds(record), args.write)
    return 0


def save_partial(path: Path | None, record: dict) -> None:
    """Rewrite the --json file after each case (whole or not at all), so a run stopped at the
    campaign's time limit still returns the cases it measured, marked incomplete."""
    if path is None:
        return
    scratch = path.with_name(path.name + ".partial")
    scratch.write_text(json.dumps(record, indent=1))
    os.replace(scratch, path)


def rounds_sentence(record: dict, which: str) -> str:
    """How a run ordered its timings: in rounds (interleaved_medians), or, for runs recorded before
    that, one method's runs back to back."""
    if not record.get("rounds"):
        return "."
    return (f", timed in rounds ({which}): each round times every method once, one method later than the "
            "round before, so that the GPU's drift over the loop falls on all of them alike.")


def completeness(record: dict) -> str:
    """The sentence a section carries when its run was stopped before its last case ('' when whole;
    records written before this field existed were only ever written whole)."""
    if record.get("complete", True):
        return ""
    return (f"**Partial run: stopped at its time limit after {len(record['rows'])} of {record['cases']} cases; "
            "the cases missing from the table were not measured.** ")


def run_decode(args, other_builds: dict) -> int:
    copy_gbs = copy_bandwidth_gbs()
    print(f"device-to-device copy: {copy_gbs:.0f} GB/s", file=sys.stderr)
    kv_heads = args.kv_heads or max(1, args.heads // 4)
    cases = [(dtype, d, q_len, kv_len) for dtype in args.dtypes for d in args.head_dims for q_len in args.queries
             for kv_len in args.keys]
    record = {"mode": "decode", "copy_gbs": copy_gbs, "rows": [], "cases": len(cases), "complete": False,
              "stamp": benchdoc.stamp(), "command": args.command,
              "warmup": args.warmup, "repeats": args.repeats, "backends": args.backends, "rounds": True,
              "composition_warmup": min(args.warmup, DECODE_COMPOSITION_WARMUP),
              "composition_repeats": min(args.repeats, DECODE_COMPOSITION_REPEATS)}
    for dtype, d, q_len, kv_len in cases:
        print(f"{dtype} d={d} Sq={q_len} keys={kv_len} ...", file=sys.stderr, flush=True)
        record["rows"].append(decode_case(getattr(torch, dtype), d, q_len, kv_len, args.decode_batch, args.heads,
                                          kv_heads, args.warmup, args.repeats, args.backends, other_builds,
                                          tuple(args.masked_compare)))
        save_partial(args.json, record)
    record["complete"] = True
    save_partial(args.json, record)
    publish_decode(record, args.write)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
