"""A few fused-kernel launches for compute-sanitizer (tests/test_kernel_gpu.py runs this under
memcheck and racecheck, tools/gpu_campaign.sh under all four tools): short and odd lengths, GQA,
both variants, the INT8 path, the split-KV decode kernels, key masks, an 8-bit KV cache (int8 and fp8
codes: the decode kernel reading them, a longer call dequantising them), and (on sm_90) the Hopper
path with fp and INT8 logits. Outputs are checked after a copy to the host: under initcheck that copy proves every
output byte was written by our kernels (a device-side
torch reduction would read through kernels the sanitizer was told to leave alone)."""

import os
import sys

import torch

from diffexport.core.contract import DiffAttentionAttrs
from diffexport.core.kv_cache_codes import KvCacheScales
from diffexport.kernel import kernel_probe, kernels

CASES = [  # variant, heads, kv heads, head dim, causal, batch, q_len, kv_len, logit bits
    (1, 4, 2, 64, 1, 2, 17, 33, 0),
    (2, 4, 1, 128, 0, 1, 113, 70, 0),
    (1, 2, 2, 128, 1, 1, 1, 65, 0),
    (1, 4, 2, 64, 1, 2, 70, 130, 8),
    (2, 2, 2, 128, 1, 1, 65, 65, 4),
    (1, 2, 1, 64, 1, 1, 200, 1100, 8),  # several query blocks (grid order), two K-sum chunks
    (1, 4, 1, 128, 1, 2, 1, 5000, 0),   # split-KV decode: many splits, a ragged last tile
    (2, 4, 2, 64, 1, 3, 16, 300, 8),    # split-KV decode, full 16-row tile, INT8 logits
    (1, 2, 2, 64, 0, 1, 5, 1, 0),       # split-KV decode of a one-key cache
]

KV_CACHE_CASES = [  # variant, heads, kv heads, head dim, causal, batch, q_len, kv_len, cache format
    (1, 4, 2, 64, 1, 2, 1, 300, "int8"),   # decode reading int8 codes, GQA heads packed
    (2, 4, 1, 128, 1, 1, 16, 130, "fp8"),  # the full 16-row tile, e4m3 codes, a ragged last tile
    (1, 2, 2, 128, 1, 1, 33, 70, "int8"),  # a longer call: the codes dequantised into the workspace
]


def paths() -> list[str]:
    """Every kernel this GPU and library run: auto (split-KV for decode-sized calls; above, the Hopper
    path on an sm_90 GPU whose library has it, else the mma.sync kernel) and, where auto takes the
    Hopper path, mma as well, so the mma.sync code is checked there too. On sm_90 the Hopper path is
    probed first (diffexport/kernel/kernel_probe.py): a hang or fault must not hide the other results."""
    if kernel_probe.applicable("hopper"):  # not an sm_90 GPU, or a library without the path
        return ["auto"]
    reason = kernel_probe.probed("hopper") or kernel_probe.probed("hopper-int8")  # the cases hold both
    if reason:
        print(f"kernel cases: the Hopper path (auto's choice here) failed its probe, only mma is run: {reason}")
        return ["mma"]
    return ["auto", "mma"]


def main(argv: list[str]) -> None:
    """kernel_cases.py [PATH]: every path of paths(), or only PATH (auto or mma), so that the GPU campaign
    can run a slow sanitizer on each path in a process of its own, at once."""
    if argv and (len(argv) > 1 or argv[0] not in ("auto", "mma")):
        raise SystemExit(f"error: kernel_cases.py takes one kernel path, auto or mma, not {' '.join(argv)!r}")
    chosen = paths()
    if argv:
        if argv[0] not in chosen:  # mma where auto already runs it (no Hopper path), or a failed probe
            print(f"kernel cases: {argv[0]} is not a path of its own here ({', '.join(chosen)} runs every kernel)")
            return
        chosen = [argv[0]]
    auto_runs = "auto" in paths()  # (in this process or, from the campaign, in another)
    for path in chosen:
        os.environ[kernels.KERNEL_PATH_ENV] = path
        run_cases(leave_to_auto=path == "mma" and auto_runs)
        print(f"kernel cases ok ({path})")


# A decode-sized call on the mma path runs the one-pass kernel with one partial query block; one of
# at most this many keys keeps that kernel's few-rows handling checked there.
MMA_DECODE_SIZED_KEYS = 128


def run_cases(leave_to_auto: bool = False) -> None:
    """Every case on the kernel path set in the environment. leave_to_auto (the mma path where auto
    runs too): the decode-sized calls auto gives the split-KV kernels are left to auto but for the
    short ones, and the 8-bit cache's decode-sized calls (the same split-KV kernel on either path)
    too. On the mma path the long ones were the one-pass kernel walking thousands of keys in a few
    CTAs, the slowest part of the run under racecheck, which stopped at its time limit there on an
    H200 (2026-11-28) without adding a kernel the other cases do not check."""
    gen = torch.Generator().manual_seed(0)
    for variant, heads, kv_heads, head_dim, causal, batch, q_len, kv_len, bits in CASES:
        if leave_to_auto and q_len <= kernels.DECODE_MAX_QUERY and kv_len > MMA_DECODE_SIZED_KEYS:
            continue
        attrs = DiffAttentionAttrs(variant=variant, num_heads=heads, num_kv_heads=kv_heads, head_dim=head_dim,
                                   causal=causal, norm=int(variant == 1))
        for dtype in (torch.float16, torch.bfloat16):
            q = torch.randn(batch, q_len, 2 * heads * head_dim, generator=gen).to(dtype).cuda()
            k = torch.randn(batch, kv_len, attrs.key_width, generator=gen).to(dtype).cuda()
            v = torch.randn(batch, kv_len, kv_heads * attrs.value_dim, generator=gen).to(dtype).cuda()
            lam = (torch.full((1,), 0.4) if variant == 1 else torch.rand(batch, q_len, heads, generator=gen))
            w = torch.ones(attrs.value_dim).cuda()
            out = kernels.diff_attention(q, k, v, lam.to(dtype).cuda(), w, attrs, logit_bits=bits)
            assert torch.isfinite(out.cpu()).all()
            if causal:  # op version 2: left padding through key_mask (the first rows see no key)
                mask = torch.ones(batch, kv_len, dtype=torch.int64)
                mask[0, : kv_len // 2] = 0
                out = kernels.diff_attention(q, k, v, lam.to(dtype).cuda(), w, attrs, logit_bits=bits,
                                             key_mask=mask.cuda())
                assert torch.isfinite(out.cpu()).all()
    for variant, heads, kv_heads, head_dim, causal, batch, q_len, kv_len, fmt in KV_CACHE_CASES:
        if leave_to_auto and q_len <= kernels.DECODE_MAX_QUERY:
            continue
        attrs = DiffAttentionAttrs(variant=variant, num_heads=heads, num_kv_heads=kv_heads, head_dim=head_dim,
                                   causal=causal, norm=int(variant == 1))
        for dtype in (torch.float16, torch.bfloat16):
            q = torch.randn(batch, q_len, 2 * heads * head_dim, generator=gen).to(dtype).cuda()
            # Codes and scales made on the host and copied over: under initcheck, which instruments
            # our kernels only, bytes that torch's kernels wrote on the device read as uninitialised
            # (2026-11-28: 98 such reports, all of codes quantised on the GPU).
            k = torch.randn(batch, kv_len, attrs.key_width, generator=gen)
            v = torch.randn(batch, kv_len, kv_heads * attrs.value_dim, generator=gen)
            cache = KvCacheScales.calibrate(k, v, fmt)
            lam = (torch.full((1,), 0.4) if variant == 1 else torch.rand(batch, q_len, heads, generator=gen))
            codes = cache.quantise_keys(k).cuda(), cache.quantise_values(v).cuda()
            scales = cache.k_scale.cuda(), cache.v_scale.cuda()
            out = kernels.diff_attention(q, *codes, lam.to(dtype).cuda(), torch.ones(attrs.value_dim).cuda(), attrs,
                                         kv_scales=scales)
            assert torch.isfinite(out.cpu()).all()
            if causal:  # with left padding too: the decode kernels copy the flags with the codes
                mask = torch.ones(batch, kv_len, dtype=torch.int64)
                mask[0, : kv_len // 3] = 0
                out = kernels.diff_attention(q, *codes, lam.to(dtype).cuda(), torch.ones(attrs.value_dim).cuda(),
                                             attrs, kv_scales=scales, key_mask=mask.cuda())
                assert torch.isfinite(out.cpu()).all()


if __name__ == "__main__":
    main(sys.argv[1:])
