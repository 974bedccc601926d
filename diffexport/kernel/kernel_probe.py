"""The fused kernels tried on this GPU, each in a child process, against the torch reference.

A kernel path on a GPU model or driver nobody has tested it on (the Hopper kernel, which auto takes
on sm_90, first ran on an H200 on 2026-11-26) can hang on a barrier or fault on an address.
In the caller's process either one takes everything after it down: a hung launch stalls the run
until its time limit, a fault leaves a CUDA context that refuses every later call. `probe(name)`
runs a few small launches of one path in a child process under a time limit and compares them with
the torch reference on the same inputs. Users run all of them with `diffexport kernels --check`;
the GPU tests, tests/kernel_cases.py and tools/bench_attention.py probe the Hopper path first and
leave it out, saying why, when it fails, so that every other result is still collected.

    python -m diffexport.kernel.kernel_probe hopper     # the launches, then "ok: ..." or "failed: <why>"; exit 0 or 1

`probed(name)` keeps the answer in $DIFFEXPORT_PROBE_<NAME> so that child processes (pytest
workers, the sanitizer runs of tools/gpu_campaign.sh) reuse it instead of probing again.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
from dataclasses import dataclass

from diffexport.core.contract import DiffAttentionAttrs
from diffexport.core.lazy import lazy_import

kernels = lazy_import("diffexport.kernel.kernels")
kv_cache_codes = lazy_import("diffexport.core.kv_cache_codes")
quantization = lazy_import("diffexport.core.quantization")
reference = lazy_import("diffexport.kernel.reference")

TIMEOUT_S = 90.0  # the child's CUDA start-up takes seconds; a working path's launches take milliseconds
MIN_COSINE = 0.999  # bf16 kernel output against the float32 reference (the GPU tests' bf16 floor)
DEVICE = "cuda"

# variant, head dim, causal, batch, q_len, kv_len
# Every (variant, head dim) instantiation once, causal and not, odd and even counts of 64-row query
# blocks (a cluster of two Hopper CTAs pads an odd count), key counts that end inside a 64- and a
# 128-key tile; and a grid of 280 tiles (35 blocks x 2 heads x 4), more than an H100 or H200 has
# SMs, so that a persistent Hopper grid takes two or three tiles of different lengths a CTA. With
# both maps a Hopper warpgroup (128 rows a CTA at d = 64) 70 and 200 rows end in a partial second
# row block, and 50 and 2200 (non-causal and causal) leave the last CTA's second row block no row.
PREFILL = ((1, 128, 1, 2, 130, 300),  # three query blocks with a ragged end, keys over several stages
           (2, 64, 0, 1, 70, 520),
           (1, 64, 1, 1, 200, 333),
           (2, 128, 0, 2, 190, 260),
           (1, 64, 0, 3, 50, 190),
           (1, 64, 1, 4, 2200, 2200))
DECODE = ((1, 128, 1, 2, 1, 700),  # one token over a cache of 11 tiles, and a full 16-row tile
          (2, 64, 1, 1, 16, 300))


@dataclass(frozen=True)
class Check:
    kernel_path: str  # $DIFFEXPORT_KERNEL_PATH for the launches
    plan: str  # the kernel the library must choose for them
    cases: tuple
    logit_bits: int
    what: str
    kv_cache: str = ""  # an 8-bit KV cache's format (kv_cache_codes.FORMATS): key and value as its codes


CHECKS = {
    "one-pass": Check("mma", "one-pass", PREFILL, 0, "the mma.sync prefill kernel"),
    "int8": Check("mma", "one-pass", PREFILL, 8, "INT8 logits, against the mirrored quantisation"),
    "split-kv": Check("auto", "split-kv", DECODE, 0, "the split-KV decode kernels"),
    "kv-int8": Check("auto", "split-kv", DECODE, 0, "split-KV decode reading an int8 KV cache", "int8"),
    "kv-fp8": Check("auto", "split-kv", DECODE, 0, "split-KV decode reading an fp8 e4m3 KV cache", "fp8"),
    "hopper": Check("hopper", "hopper", PREFILL, 0, "the sm_90a TMA + wgmma kernel"),
    "hopper-int8": Check("hopper", "hopper", PREFILL, 8, "INT8 logits on the sm_90a kernel's s8 wgmma"),
}


def env_name(name: str) -> str:
    return "DIFFEXPORT_PROBE_" + name.upper().replace("-", "_")


def applicable(name: str) -> str | None:
    """Why `name` cannot run on this GPU and library, or None (in the caller's process: no launch)."""
    import torch

    if CHECKS[name].kernel_path == "hopper":
        if torch.cuda.get_device_capability() != (9, 0):
            return "an sm_90 GPU only"
        if "sm90=1" not in kernels.build_info():
            return "library built without it (sm_90a and the CUTLASS headers needed)"
    return None


def child_command(name: str) -> list[str]:
    return [sys.executable, "-m", "diffexport.kernel.kernel_probe", "--child", name]


def probe(name: str, timeout: float = TIMEOUT_S) -> str | None:
    """None when every probe launch of `name` ran and agreed with the reference, else why not."""
    return run_probe(name, timeout)[0]


def run_probe(name: str, timeout: float = TIMEOUT_S) -> tuple[str | None, list[str]]:
    """(why the probe failed or None, the child's output lines)."""
    if name not in CHECKS:
        raise ValueError(f"kernel probe {name!r} is not one of {', '.join(CHECKS)}")
    try:
        done = subprocess.run(child_command(name), capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        return f"no answer within {timeout:g} s (a hung launch?); the child process was killed", []
    lines = [line.rstrip() for line in (done.stdout + "\n" + done.stderr).splitlines() if line.strip()]
    if done.returncode == 0:
        return None, lines
    last = lines[-1].strip() if lines else ""
    if done.returncode < 0:
        return f"the child process died of signal {-done.returncode}" + (f": {last}" if last else ""), lines
    return last or f"the child process exited with status {done.returncode}", lines


def probed(name: str, timeout: float = TIMEOUT_S) -> str | None:
    """probe(name), once per process tree: the answer is kept in $DIFFEXPORT_PROBE_<NAME> ("ok" or why not)."""
    var = env_name(name)
    if not os.environ.get(var):
        os.environ[var] = probe(name, timeout) or "ok"
    answer = os.environ[var]
    return None if answer == "ok" or answer.startswith("ok:") else answer


def run_child(name: str) -> int:
    """The probe launches (in the child): every case of the check against the float32 reference."""
    import torch

    check = CHECKS[name]
    if DEVICE == "cuda" and not torch.cuda.is_available():
        print("failed: no CUDA device")
        return 1
    os.environ[kernels.KERNEL_PATH_ENV] = check.kernel_path
    gen = torch.Generator().manual_seed(0)
    worst_cos, worst_err = 1.0, 0.0
    for variant, head_dim, causal, batch, q_len, kv_len in check.cases:
        attrs = DiffAttentionAttrs(variant=variant, num_heads=2, num_kv_heads=1, head_dim=head_dim, causal=causal,
                                   norm=int(variant == 1))

        def rand(*shape):
            return torch.randn(*shape, generator=gen).to(torch.bfloat16).to(DEVICE)

        q = rand(batch, q_len, 2 * attrs.num_heads * head_dim)
        k, v = rand(batch, kv_len, attrs.key_width), rand(batch, kv_len, attrs.num_kv_heads * attrs.value_dim)
        lam = (torch.full((1,), 0.4) if variant == 1 else torch.rand(batch, q_len, attrs.num_heads, generator=gen))
        lam, weight = lam.to(torch.bfloat16).to(DEVICE), torch.ones(attrs.value_dim).to(DEVICE)
        out = torch.empty(batch, q_len, attrs.num_heads * attrs.value_dim, dtype=torch.bfloat16, device=DEVICE)
        case = f"V{variant} D{head_dim} causal {causal} B{batch} Sq {q_len} Skv {kv_len}"
        kv_scales = None
        if check.kv_cache:  # the same keys and values as the cache's codes; the reference gets what they stand for
            cache = kv_cache_codes.KvCacheScales.calibrate(k, v, check.kv_cache)
            k, v = cache.quantise_keys(k), cache.quantise_values(v)
            kv_scales = (cache.k_scale, cache.v_scale)
        plan, _ = kernels.kernel_plan(kernels.make_params(q, k, v, lam, weight, out, attrs,
                                                          logit_bits=check.logit_bits, kv_scales=kv_scales))
        if plan != check.plan:
            print(f"failed: DIFFEXPORT_KERNEL_PATH={check.kernel_path} plans the {plan} kernel for {case}, "
                  f"not {check.plan}")
            return 1
        kernels.diff_attention(q, k, v, lam, weight, attrs, logit_bits=check.logit_bits, out=out, kv_scales=kv_scales)
        if DEVICE == "cuda":
            torch.cuda.synchronize()
        if kv_scales:
            k, v = kv_cache_codes.decode(k, kv_scales[0]), kv_cache_codes.decode(v, kv_scales[1])
        exact = [t.float() for t in (q, k, v, lam, weight)]
        if check.logit_bits:
            quant = quantization.LogitQuant(check.logit_bits, "qk", True)
            want = reference.quantised_diff_attention(*exact, attrs, quant)
        else:
            want = reference.naive_diff_attention(*exact, attrs)
        got, want = out.float().cpu(), want.float().cpu()
        cosine = torch.nn.functional.cosine_similarity(got.flatten(), want.flatten(), dim=0).item()
        err = (got - want).abs().max().item()
        print(f"{name} {case}: max abs {err:.2e}, cosine {cosine:.6f}")
        if not torch.isfinite(got).all() or not cosine >= MIN_COSINE:
            print(f"failed: {name} disagrees with the torch reference on {case} (cosine {cosine:.6f})")
            return 1
        worst_cos, worst_err = min(worst_cos, cosine), max(worst_err, err)
    print(f"ok: {len(check.cases)} launches, worst cosine {worst_cos:.6f}, max abs {worst_err:.2e} (bf16 vs float32)")
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m diffexport.kernel.kernel_probe",
                                     description=__doc__.split("\n\n")[0])
    parser.add_argument("name", choices=list(CHECKS))
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--timeout", type=float, default=TIMEOUT_S, help="seconds the child may take")
    args = parser.parse_args(argv)
    if args.child:
        try:
            return run_child(args.name)
        except Exception as exc:  # noqa: BLE001 - one line for the parent, whatever the CUDA error
            print(f"failed: {type(exc).__name__}: {(str(exc).splitlines() or [''])[0][:300]}")
            return 1
    reason, lines = run_probe(args.name, args.timeout)
    for line in lines[:-1]:  # the launches; the last line is the verdict
        print(f"  {line}")
    if reason is None:
        print(lines[-1] if lines else "ok")
    else:
        print(reason if reason.startswith("failed:") else f"failed: {reason}")
    return 0 if reason is None else 1


if __name__ == "__main__":
    sys.exit(main())
