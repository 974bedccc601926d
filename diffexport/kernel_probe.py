"""A kernel path tried once in a child process before a test run or a benchmark relies on it.

A path that has never run on a GPU (the opt-in Hopper kernel, until a campaign has seen it pass)
can hang on a barrier or fault on an address. In the caller's process either one takes everything
after it down: a hung launch stalls the run until its time limit, a fault leaves a CUDA context
that refuses every later call. `probe(path)` runs a few small launches of that path in a child
process under a time limit and compares them with the one-pass kernel on the same inputs; the GPU
tests, tests/kernel_cases.py and tools/bench_attention.py leave a path that fails it out, say why,
and still run everything else.

    python -m diffexport.kernel_probe hopper     # the launches, then "ok" or "failed: <why>"; exit 0 or 1

`probed(path)` keeps the answer in $DIFFEXPORT_PROBE_<PATH> so that child processes (pytest
workers, the sanitizer runs of tools/gpu_campaign.sh) reuse it instead of probing again.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys

PATHS = ("hopper", "mma", "auto")  # DIFFEXPORT_KERNEL_PATH values; the probe compares each with "mma"
EXPECTED_PLAN = {"hopper": "hopper", "mma": "one-pass"}
TIMEOUT_S = 90.0  # the child's CUDA start-up takes seconds; a working path's launches take milliseconds
MIN_COSINE = 0.999  # bf16 outputs of two kernels computing the same attention in different orders
DEVICE = "cuda"

# variant, head dim, causal, batch, q_len, kv_len: two query blocks with a ragged end, keys that
# fill several pipeline stages, both variants and head dims, a causal and a full mask.
CASES = [
    (1, 128, 1, 2, 130, 300),
    (2, 64, 0, 1, 70, 520),
]


def env_name(path: str) -> str:
    return f"DIFFEXPORT_PROBE_{path.upper()}"


def child_command(path: str) -> list[str]:
    return [sys.executable, "-m", "diffexport.kernel_probe", "--child", path]


def probe(path: str, timeout: float = TIMEOUT_S) -> str | None:
    """None when every probe launch of `path` ran and agreed with the one-pass kernel, else why not."""
    return run_probe(path, timeout)[0]


def run_probe(path: str, timeout: float) -> tuple[str | None, list[str]]:
    """(why the probe failed or None, the child's output lines)."""
    if path not in PATHS:
        raise ValueError(f"kernel path {path!r} is not one of {', '.join(PATHS)}")
    try:
        done = subprocess.run(child_command(path), capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        return f"no answer within {timeout:g} s (a hung launch?); the child process was killed", []
    lines = [line.rstrip() for line in (done.stdout + "\n" + done.stderr).splitlines() if line.strip()]
    if done.returncode == 0:
        return None, lines
    last = lines[-1].strip() if lines else ""
    if done.returncode < 0:
        return f"the child process died of signal {-done.returncode}" + (f": {last}" if last else ""), lines
    return last or f"the child process exited with status {done.returncode}", lines


def probed(path: str, timeout: float = TIMEOUT_S) -> str | None:
    """probe(path), once per process tree: the answer is kept in $DIFFEXPORT_PROBE_<PATH> ("ok" or why not)."""
    name = env_name(path)
    if not os.environ.get(name):
        os.environ[name] = probe(path, timeout) or "ok"
    answer = os.environ[name]
    return None if answer == "ok" else answer


def run_child(path: str) -> int:
    """The probe launches (in the child): every case on the one-pass kernel and on `path`, compared."""
    import torch

    from diffexport import kernels
    from diffexport.contract import DiffAttentionAttrs

    if DEVICE == "cuda" and not torch.cuda.is_available():
        print("failed: no CUDA device")
        return 1
    gen = torch.Generator().manual_seed(0)
    for variant, head_dim, causal, batch, q_len, kv_len in CASES:
        attrs = DiffAttentionAttrs(variant=variant, num_heads=2, num_kv_heads=1, head_dim=head_dim, causal=causal,
                                   norm=int(variant == 1))

        def rand(*shape):
            return torch.randn(*shape, generator=gen).to(torch.bfloat16).to(DEVICE)

        q = rand(batch, q_len, 2 * attrs.num_heads * head_dim)
        k, v = rand(batch, kv_len, attrs.key_width), rand(batch, kv_len, attrs.num_kv_heads * attrs.value_dim)
        lam = (torch.full((1,), 0.4) if variant == 1 else torch.rand(batch, q_len, attrs.num_heads, generator=gen))
        lam, weight = lam.to(torch.bfloat16).to(DEVICE), torch.ones(attrs.value_dim).to(DEVICE)
        outs = {}
        for run in ("mma", path):
            os.environ[kernels.KERNEL_PATH_ENV] = run
            out = torch.empty(batch, q_len, attrs.num_heads * attrs.value_dim, dtype=torch.bfloat16, device=DEVICE)
            plan, _ = kernels.kernel_plan(kernels.make_params(q, k, v, lam, weight, out, attrs))
            if run in EXPECTED_PLAN and plan != EXPECTED_PLAN[run]:
                print(f"failed: DIFFEXPORT_KERNEL_PATH={run} plans the {plan} kernel, not {EXPECTED_PLAN[run]}")
                return 1
            kernels.diff_attention(q, k, v, lam, weight, attrs, out=out)
            if DEVICE == "cuda":
                torch.cuda.synchronize()
            outs[run] = out.float().cpu()
        got, want = outs[path], outs["mma"]
        cosine = torch.nn.functional.cosine_similarity(got.flatten(), want.flatten(), dim=0).item()
        err = (got - want).abs().max().item()
        case = f"V{variant} D{head_dim} causal {causal} B{batch} Sq {q_len} Skv {kv_len}"
        print(f"{path} vs one-pass, {case}: max abs {err:.2e}, cosine {cosine:.6f}")
        if not torch.isfinite(got).all() or not cosine >= MIN_COSINE:
            print(f"failed: {path} disagrees with the one-pass kernel on {case} (cosine {cosine:.6f})")
            return 1
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m diffexport.kernel_probe", description=__doc__.split("\n\n")[0])
    parser.add_argument("path", choices=PATHS)
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--timeout", type=float, default=TIMEOUT_S, help="seconds the child may take")
    args = parser.parse_args(argv)
    if args.child:
        try:
            return run_child(args.path)
        except Exception as exc:  # noqa: BLE001 - one line for the parent, whatever the CUDA error
            print(f"failed: {type(exc).__name__}: {(str(exc).splitlines() or [''])[0][:300]}")
            return 1
    reason, lines = run_probe(args.path, args.timeout)
    for line in lines if reason is None else lines[:-1]:
        print(f"  {line}")
    print("ok" if reason is None else (reason if reason.startswith("failed:") else f"failed: {reason}"))
    return 0 if reason is None else 1


if __name__ == "__main__":
    sys.exit(main())
