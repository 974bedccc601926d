"""The fused kernel on a CUDA GPU, through its C ABI (diffexport.kernel.kernels), against the float64
oracle with the flash-attention rule (NUMERICS.md), and the INT8-logits variant against the
reference that applies the same quantisation. Marked gpu: skipped without CUDA. Skipped too when
the library is not built, unless DIFFEXPORT_REQUIRE_KERNELS=1 (GPU sessions set it: a missing
library must fail there, not pass quietly)."""

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from helpers import assert_close_lowprec, lowprec_baseline, make_inputs, padding_mask
from oracle import diff_attention_oracle

from diffexport.core.contract import DiffAttentionAttrs
from diffexport.core.kv_cache_codes import KvCacheScales, decode
from diffexport.core.quantization import LogitQuant
from diffexport.kernel import kernel_probe, kernels, reference

pytestmark = pytest.mark.gpu
POISON = float("nan")


@pytest.fixture(scope="module", autouse=True)
def lib():
    if kernels.library_path() is None:
        message = f"kernel library not built: {kernels.BUILD_HINT}"
        if os.environ.get("DIFFEXPORT_REQUIRE_KERNELS"):
            pytest.fail(message)
        pytest.skip(message)
    return kernels.load_library()


def require_hopper(probe: str = "hopper"):
    if torch.cuda.get_device_capability() != (9, 0):
        pytest.skip("the Hopper path runs on sm_90 GPUs only")
    if "sm90=1" not in kernels.build_info():
        message = "kernel library built without the Hopper path (sm_90a and CUTLASS headers needed)"
        if os.environ.get("DIFFEXPORT_REQUIRE_KERNELS"):
            pytest.fail(message)
        pytest.skip(message)
    # Tried first in a child process: a hang or a fault there must not take this worker's other tests.
    reason = kernel_probe.probed(probe)
    if reason:
        pytest.fail(f"the Hopper path ({probe}) failed its probe (diffexport/kernel/kernel_probe.py), not launched "
                    f"here: {reason}")


def min_cosine(dtype):
    return 0.9999 if dtype == torch.float16 else 0.999


def oracle(cpu_inputs, attrs, key_mask=None):
    q, k, v, lam, w = (t.double().numpy() for t in cpu_inputs)
    mask = None if key_mask is None else key_mask.cpu().numpy()
    return diff_attention_oracle(q, k, v, lam, w, mask, **attrs.as_dict())


def strided(t: torch.Tensor, pad: int = 8) -> torch.Tensor:
    """The same values as a view with padded rows and a seq-major batch layout (no copy needed by the kernel)."""
    B, S, W = t.shape
    big = torch.full((S, B, W + 2 * pad), 7.0, dtype=t.dtype, device=t.device)
    view = big[:, :, pad:pad + W].transpose(0, 1)
    view.copy_(t)
    return view


def run_kernel(inputs, attrs, *, bits=0, smooth_k=True):
    B, Sq = inputs[0].shape[:2]
    out = torch.full((B, Sq, attrs.num_heads * attrs.value_dim), POISON, dtype=inputs[0].dtype, device="cuda")
    kernels.diff_attention(*inputs, attrs, logit_bits=bits, smooth_k=smooth_k, out=out)
    torch.cuda.synchronize()
    return out


LENGTHS = [(1, 1), (17, 17), (113, 113), (1023, 1023), (17, 1023), (1, 4097), (64, 64), (65, 130)]


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["fp16", "bf16"])
@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("variant", [1, 2])
@pytest.mark.parametrize("causal", [1, 0])
@pytest.mark.parametrize("case", range(len(LENGTHS)))
@pytest.mark.parametrize("path", ["auto", "mma"])
def test_fused_matches_the_oracle(dtype, head_dim, variant, causal, case, path, rng, monkeypatch):
    """Both choices on the same cases: auto (split-KV for q_len <= 16; above, the Hopper path on an
    sm_90 GPU with a library that has it, else the mma.sync one-pass kernel) and mma (the one-pass
    kernel for every call: the fallback, and the mma.sync code an sm_90 GPU would otherwise not run)."""
    q_len, kv_len = LENGTHS[case]
    ratio = (1, 2, 4, 8)[case % 4]
    attrs = DiffAttentionAttrs(variant=variant, num_heads=8, num_kv_heads=8 // ratio, head_dim=head_dim,
                               causal=causal, norm=int(variant == 1), output_scale=0.7)
    cpu = make_inputs(attrs, 2, q_len, kv_len, dtype=dtype, rng=rng)
    inputs = [t.cuda() for t in cpu]
    monkeypatch.setenv(kernels.KERNEL_PATH_ENV, path)
    if path == "mma":
        expected = "one-pass"
    elif q_len <= kernels.DECODE_MAX_QUERY:
        expected = "split-kv"
    elif kernel_probe.applicable("hopper") is None:  # auto takes the Hopper path on this GPU and build
        require_hopper()  # probed in a child process first: a hang there must not take this worker
        expected = "hopper"
    else:
        expected = "one-pass"
    out = torch.empty(2, q_len, attrs.num_heads * attrs.value_dim, dtype=dtype, device="cuda")
    assert kernels.kernel_plan(kernels.make_params(*inputs, out, attrs))[0] == expected
    out = run_kernel(inputs, attrs)
    assert not out.isnan().any(), "output not fully written (poison left)"
    ref = oracle(cpu, attrs)
    baseline = lowprec_baseline(*inputs, attrs)
    assert_close_lowprec(out.cpu(), baseline.cpu(), ref, f"fused {attrs} {q_len}x{kv_len}",
                         min_cosine=min_cosine(dtype))


@pytest.mark.parametrize("variant", [1, 2])
def test_strided_views_and_output(variant, rng):
    """Views with padded rows and seq-major batches, the output a view too: its padding stays untouched."""
    attrs = DiffAttentionAttrs(variant=variant, num_heads=4, num_kv_heads=2, head_dim=64, causal=1,
                               norm=int(variant == 1))
    cpu = make_inputs(attrs, 3, 77, 200, dtype=torch.float16, rng=rng)
    dense = [t.cuda() for t in cpu]
    views = [strided(t) for t in dense[:3]] + dense[3:]
    assert not views[0].is_contiguous()
    out_big = torch.full((3, 77, attrs.num_heads * attrs.value_dim + 16), 1234.0, dtype=torch.float16, device="cuda")
    out = out_big[:, :, 8:-8]
    kernels.diff_attention(*views, attrs, out=out)
    torch.cuda.synchronize()
    assert (out_big[:, :, :8] == 1234).all() and (out_big[:, :, -8:] == 1234).all()
    assert torch.equal(out, run_kernel(dense, attrs))


@pytest.mark.parametrize("causal", [1, 0])
def test_32k_keys_fp16_sums_do_not_overflow(causal, rng):
    attrs = DiffAttentionAttrs(variant=1, num_heads=2, num_kv_heads=1, head_dim=128, causal=causal, output_scale=0.5)
    cpu = make_inputs(attrs, 1, 70, 32768 + 5, dtype=torch.float16, rng=rng)
    inputs = [t.cuda() for t in cpu]
    out = run_kernel(inputs, attrs)
    assert_close_lowprec(out.cpu(), lowprec_baseline(*inputs, attrs).cpu(), oracle(cpu, attrs), "32k keys")


def test_rows_that_see_no_key_are_zero_not_nan(rng):
    """Below the contract (it refuses causal Sq > Skv) the C ABI defines it: rows seeing no key give 0."""
    attrs = DiffAttentionAttrs(variant=1, num_heads=2, num_kv_heads=2, head_dim=64, causal=1)
    q_len, kv_len = 70, 5
    cpu = make_inputs(attrs, 1, q_len, kv_len, dtype=torch.float16, rng=rng)
    inputs = [t.cuda() for t in cpu]
    out = torch.full((1, q_len, 2 * 128), POISON, dtype=torch.float16, device="cuda")
    kernels.launch(kernels.make_params(*inputs, out, attrs), out.device)
    torch.cuda.synchronize()
    assert torch.isfinite(out).all()
    assert (out[:, : q_len - kv_len] == 0).all()
    tail = [cpu[0][:, q_len - kv_len:], *cpu[1:]]
    ref = oracle(tail, attrs)
    base = lowprec_baseline(*[t.cuda() for t in tail], attrs)
    assert_close_lowprec(out[:, q_len - kv_len:].cpu(), base.cpu(), ref, "last rows")


def test_op_uses_the_fused_kernel_on_cuda(rng, monkeypatch):
    from diffexport.kernel import op

    attrs = DiffAttentionAttrs(variant=1, num_heads=4, num_kv_heads=2, head_dim=64, causal=1)
    inputs = [t.cuda() for t in make_inputs(attrs, 2, 33, 33, dtype=torch.bfloat16, rng=rng)]
    monkeypatch.setenv(kernels.IMPL_ENV, "fused")
    fused = op.call(*inputs, attrs)
    assert torch.equal(fused, run_kernel(inputs, attrs))
    monkeypatch.setenv(kernels.IMPL_ENV, "reference")
    assert torch.equal(op.call(*inputs, attrs), reference.flash_diff_attention_1(*inputs, attrs))
    monkeypatch.setenv(kernels.IMPL_ENV, "fused")
    wide = DiffAttentionAttrs(variant=1, num_heads=2, num_kv_heads=2, head_dim=32, causal=1)
    small = [t.cuda() for t in make_inputs(wide, 1, 5, 5, dtype=torch.bfloat16, rng=rng)]
    with pytest.raises(Exception, match="head_dim 64 or 128"):
        op.call(*small, wide)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["fp16", "bf16"])
@pytest.mark.parametrize("variant,head_dim", [(1, 64), (1, 128), (2, 128)])
@pytest.mark.parametrize("bits", [8, 6, 4])
@pytest.mark.parametrize("smooth_k", [True, False])
@pytest.mark.parametrize("path", ["auto", "mma"])
def test_int8_logits_match_the_mirrored_quantisation(dtype, variant, head_dim, bits, smooth_k, path, rng, monkeypatch):
    """Both kernels that run INT8 logits: mma (the mma.sync one-pass kernel, s8 mma.sync) and auto
    (on an sm_90 GPU with a library that has it, the Hopper path's s8 wgmma; elsewhere mma again)."""
    attrs = DiffAttentionAttrs(variant=variant, num_heads=4, num_kv_heads=2, head_dim=head_dim, causal=1,
                               norm=int(variant == 1), output_scale=0.8)
    cpu = make_inputs(attrs, 2, 150, 300, dtype=dtype, rng=rng)
    cpu[1].add_(torch.linspace(-1, 2, attrs.key_width).to(dtype))  # a per-channel K offset: what smoothing removes
    inputs = [t.cuda() for t in cpu]
    monkeypatch.setenv(kernels.KERNEL_PATH_ENV, path)
    expected = "one-pass"
    if path == "auto" and kernel_probe.applicable("hopper-int8") is None:
        require_hopper("hopper-int8")
        expected = "hopper"
    out = torch.empty(2, 150, attrs.num_heads * attrs.value_dim, dtype=dtype, device="cuda")
    assert kernels.kernel_plan(kernels.make_params(*inputs, out, attrs, logit_bits=bits))[0] == expected
    out = run_kernel(inputs, attrs, bits=bits, smooth_k=smooth_k).float()
    assert not out.isnan().any()
    mirror = reference.quantised_diff_attention(*[t.float() if t.is_floating_point() else t for t in inputs],
                                                attrs, LogitQuant(bits, "qk", smooth_k)).float()
    exact = torch.as_tensor(oracle(cpu, attrs), dtype=torch.float32, device="cuda")
    fp_err = (run_kernel(inputs, attrs).float() - exact).abs().max().item()  # this dtype's rounding budget
    err = (out - mirror).abs().max().item()
    cos_mirror = torch.nn.functional.cosine_similarity(out.flatten(), mirror.flatten(), dim=0).item()
    cos_exact = torch.nn.functional.cosine_similarity(out.flatten(), exact.flatten(), dim=0).item()
    print(f"int{bits} smooth={smooth_k} {dtype}: vs mirror max {err:.2e} cos {cos_mirror:.6f}; "
          f"vs unquantised cos {cos_exact:.6f}")
    assert err <= 2 * fp_err + 1e-3, f"vs mirrored quantisation: {err:.3e} > 2*{fp_err:.3e} + 1e-3"
    assert cos_mirror >= min_cosine(dtype)
    if bits == 8:
        assert cos_exact >= 0.99  # a sanity floor; the measured value is reported by tools/bench_attention.py


@pytest.mark.skipif(shutil.which("compute-sanitizer") is None, reason="compute-sanitizer not on PATH")
@pytest.mark.parametrize("tool", ["memcheck", "racecheck"])
def test_compute_sanitizer_is_clean(tool):
    script = Path(__file__).with_name("kernel_cases.py")
    result = subprocess.run(["compute-sanitizer", "--tool", tool, "--error-exitcode", "99", sys.executable,
                             str(script)], capture_output=True, text=True, timeout=900)
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-2000:]
    assert "ERROR SUMMARY: 0 errors" in result.stdout or "RACECHECK SUMMARY: 0 hazards" in result.stdout


def test_float32_io_equals_the_fp16_kernel(rng):
    attrs = DiffAttentionAttrs(variant=1, num_heads=4, num_kv_heads=2, head_dim=128, causal=1)
    half = [t.cuda() for t in make_inputs(attrs, 2, 100, 300, dtype=torch.float16, rng=rng)]
    wide = [t.float() for t in half]
    assert torch.equal(kernels.diff_attention(*wide, attrs), run_kernel(half, attrs).float())


MASK_CASES = [  # variant, head dim, batch, q_len, kv_len, pads (helpers.padding_mask), dtype: op version 2
    (1, 128, 2, 1, 4097, [3000, 0], torch.float16),
    (1, 64, 2, 70, 70, [70, 5], torch.bfloat16),
    (2, 128, 3, 4, 1023, [0, 1022, 500], torch.float16),
    # prefills (the Hopper path on sm_90): every third key a hole, and a hole across a tile boundary;
    # 128-key tiles at V1 d = 64 and V2, 64-key ones at V1 d = 128
    (1, 64, 2, 300, 300, [(1, 300, 3), (40, 203)], torch.bfloat16),
    (2, 128, 2, 130, 390, [(2, 390, 5), 0], torch.float16),
    (1, 128, 2, 100, 260, [(0, 260, 3), (60, 70)], torch.bfloat16),
]


@pytest.mark.parametrize("case", MASK_CASES)
def test_key_mask_matches_the_oracle(case, rng):
    variant, head_dim, batch, q_len, kv_len, pads, dtype = case
    attrs = DiffAttentionAttrs(variant=variant, num_heads=4, num_kv_heads=2, head_dim=head_dim, causal=1,
                               norm=int(variant == 1), output_scale=0.6)
    cpu = make_inputs(attrs, batch, q_len, kv_len, dtype=dtype, rng=rng)
    key_mask = padding_mask(batch, kv_len, pads)
    B, Sq = cpu[0].shape[:2]
    out = torch.full((B, Sq, attrs.num_heads * attrs.value_dim), POISON, dtype=dtype, device="cuda")
    kernels.diff_attention(*[t.cuda() for t in cpu], attrs, out=out, key_mask=key_mask.cuda())
    torch.cuda.synchronize()
    assert not out.isnan().any()
    assert_close_lowprec(out.cpu(), lowprec_baseline(*cpu, attrs, key_mask=key_mask), oracle(cpu, attrs, key_mask),
                         str(case), min_cosine=min_cosine(dtype))


DECODE_CASES = [  # variant, head dim, GQA ratio, batch, q_len, kv_len: the split-KV decode kernels (q_len <= 16)
    (1, 64, 1, 4, 1, 1), (1, 128, 2, 1, 1, 1000), (2, 128, 4, 2, 4, 32768 + 5), (1, 64, 8, 1, 16, 70_000),
    (2, 64, 1, 3, 7, 4097), (1, 128, 4, 2, 16, 16),
]


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["fp16", "bf16"])
@pytest.mark.parametrize("causal", [1, 0])
@pytest.mark.parametrize("case", DECODE_CASES, ids=[f"v{c[0]}-d{c[1]}-gqa{c[2]}-b{c[3]}-{c[4]}x{c[5]}"
                                                    for c in DECODE_CASES])
def test_decode_kernel_matches_the_oracle(case, causal, dtype, rng, monkeypatch):
    """Decode-sized calls run the split-KV kernels; the one-pass kernel (DIFFEXPORT_KERNEL_PATH=mma)
    on the same inputs meets the same bound."""
    variant, head_dim, ratio, batch, q_len, kv_len = case
    attrs = DiffAttentionAttrs(variant=variant, num_heads=8, num_kv_heads=8 // ratio, head_dim=head_dim,
                               causal=causal, norm=int(variant == 1), output_scale=0.7)
    cpu = make_inputs(attrs, batch, q_len, kv_len, dtype=dtype, rng=rng)
    inputs = [t.cuda() for t in cpu]
    out = torch.empty(batch, q_len, attrs.num_heads * attrs.value_dim, dtype=dtype, device="cuda")
    assert kernels.kernel_plan(kernels.make_params(*inputs, out, attrs))[0] == "split-kv"
    split = run_kernel(inputs, attrs)
    assert not split.isnan().any(), "output not fully written (poison left)"
    ref, baseline = oracle(cpu, attrs), lowprec_baseline(*inputs, attrs).cpu()
    assert_close_lowprec(split.cpu(), baseline, ref, f"split-kv {case}", min_cosine=min_cosine(dtype))
    monkeypatch.setenv(kernels.KERNEL_PATH_ENV, "mma")
    assert kernels.kernel_plan(kernels.make_params(*inputs, out, attrs)) == ("one-pass", 1)
    assert_close_lowprec(run_kernel(inputs, attrs).cpu(), baseline, ref, f"one-pass {case}",
                         min_cosine=min_cosine(dtype))


@pytest.mark.parametrize("bits,smooth_k", [(8, True), (4, False)])
@pytest.mark.parametrize("variant,head_dim", [(1, 64), (2, 128)])
def test_decode_int8_logits_match_the_mirrored_quantisation(variant, head_dim, bits, smooth_k, rng):
    attrs = DiffAttentionAttrs(variant=variant, num_heads=4, num_kv_heads=2, head_dim=head_dim, causal=1,
                               norm=int(variant == 1), output_scale=0.8)
    cpu = make_inputs(attrs, 2, 3, 5000, dtype=torch.float16, rng=rng)
    cpu[1].add_(torch.linspace(-1, 2, attrs.key_width).to(torch.float16))
    inputs = [t.cuda() for t in cpu]
    out = run_kernel(inputs, attrs, bits=bits, smooth_k=smooth_k).float()
    mirror = reference.quantised_diff_attention(*[t.float() for t in inputs], attrs,
                                                LogitQuant(bits, "qk", smooth_k)).float()
    exact = torch.as_tensor(oracle(cpu, attrs), dtype=torch.float32, device="cuda")
    fp_err = (run_kernel(inputs, attrs).float() - exact).abs().max().item()
    err = (out - mirror).abs().max().item()
    cos = torch.nn.functional.cosine_similarity(out.flatten(), mirror.flatten(), dim=0).item()
    assert err <= 2 * fp_err + 1e-3, f"vs mirrored quantisation: {err:.3e} > 2*{fp_err:.3e} + 1e-3"
    assert cos >= min_cosine(torch.float16)


KV_CACHE_BUDGET = {"int8": 0.9995, "fp8": 0.998}  # cosine vs the float cache's oracle (the emulated tests' floor)


@pytest.mark.parametrize("fmt", ["int8", "fp8"])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["fp16", "bf16"])
@pytest.mark.parametrize("variant,head_dim,ratio,q_len,kv_len", [(1, 64, 4, 1, 5000), (1, 128, 2, 4, 1000),
                                                                   (2, 64, 1, 16, 300), (2, 128, 8, 2, 33000)])
def test_decode_reads_an_8_bit_kv_cache(fmt, dtype, variant, head_dim, ratio, q_len, kv_len, rng):
    """The split-KV kernel on an int8 / fp8 e4m3 cache (per-channel scales, K smoothed): to its dtype's
    rounding of what the codes stand for, and within the quantisation's budget of the float cache."""
    attrs = DiffAttentionAttrs(variant=variant, num_heads=8, num_kv_heads=8 // ratio, head_dim=head_dim, causal=1,
                               norm=int(variant == 1), output_scale=0.7)
    cpu = make_inputs(attrs, 2, q_len, kv_len, dtype=dtype, rng=rng)
    cpu[1].add_(torch.linspace(-2, 3, attrs.key_width).to(dtype))  # per-channel offsets: what smoothing removes
    scales = KvCacheScales.calibrate(cpu[1], cpu[2], fmt)
    k_codes, v_codes = scales.quantise_keys(cpu[1]), scales.quantise_values(cpu[2])
    dequantised = [cpu[0], decode(k_codes, scales.k_scale), decode(v_codes, scales.v_scale), *cpu[3:]]  # float32
    inputs = [cpu[0].cuda(), k_codes.cuda(), v_codes.cuda(), cpu[3].cuda(), cpu[4].cuda()]
    kv_scales = (scales.k_scale.cuda(), scales.v_scale.cuda())
    out = torch.full((2, q_len, attrs.num_heads * attrs.value_dim), POISON, dtype=dtype, device="cuda")
    assert kernels.kernel_plan(kernels.make_params(*inputs, out, attrs, kv_scales=kv_scales))[0] == "split-kv"
    kernels.diff_attention(*inputs, attrs, kv_scales=kv_scales, out=out)
    assert not out.isnan().any(), "output not fully written (poison left)"
    baseline = lowprec_baseline(*[t.to(dtype).cuda() for t in dequantised[:4]], dequantised[4].cuda(), attrs).cpu()
    assert_close_lowprec(out.cpu(), baseline, oracle(dequantised, attrs), f"{fmt} cache", min_cosine=min_cosine(dtype))
    exact = torch.as_tensor(oracle(cpu, attrs), dtype=torch.float64)
    cos = torch.nn.functional.cosine_similarity(out.cpu().double().flatten(), exact.flatten(), dim=0).item()
    assert cos >= KV_CACHE_BUDGET[fmt], f"{fmt} cache vs the float cache: cosine {cos:.6f}"


@pytest.mark.parametrize("variant,head_dim", [(1, 64), (1, 128), (2, 64), (2, 128)])
def test_hopper_path_views_masks_and_its_refusals(variant, head_dim, rng, monkeypatch):
    """The Hopper path on strided views (TMA descriptors with the contract's free strides), key masks
    and 4k keys, fp and INT8 logits; on another GPU asking for it is an error."""
    attrs = DiffAttentionAttrs(variant=variant, num_heads=4, num_kv_heads=2, head_dim=head_dim, causal=1,
                               norm=int(variant == 1), output_scale=0.6)
    cpu = make_inputs(attrs, 3, 77, 4100, dtype=torch.bfloat16, rng=rng)
    dense = [t.cuda() for t in cpu]
    views = [strided(t) for t in dense[:3]] + dense[3:]
    key_mask = torch.ones(3, 4100, dtype=torch.int64)
    key_mask[1, :3000] = 0
    monkeypatch.setenv(kernels.KERNEL_PATH_ENV, "hopper")
    if torch.cuda.get_device_capability() != (9, 0):
        with pytest.raises(Exception, match="DIFFEXPORT_KERNEL_PATH=hopper needs an sm_90 GPU"):
            kernels.diff_attention(*views, attrs)
        return
    require_hopper()
    out = torch.full((3, 77, attrs.num_heads * attrs.value_dim), POISON, dtype=torch.bfloat16, device="cuda")
    kernels.diff_attention(*views, attrs, out=out, key_mask=key_mask.cuda())
    torch.cuda.synchronize()
    assert not out.isnan().any()
    assert_close_lowprec(out.cpu(), lowprec_baseline(*cpu, attrs, key_mask=key_mask), oracle(cpu, attrs, key_mask),
                         "hopper views+mask", min_cosine=min_cosine(torch.bfloat16))
    require_hopper("hopper-int8")
    quant = torch.full_like(out, POISON)
    kernels.diff_attention(*views, attrs, out=quant, key_mask=key_mask.cuda(), logit_bits=8)
    monkeypatch.setenv(kernels.KERNEL_PATH_ENV, "mma")  # the same INT8 logits on the mma.sync kernel
    mma = kernels.diff_attention(*views, attrs, key_mask=key_mask.cuda(), logit_bits=8)
    torch.cuda.synchronize()
    assert not quant.isnan().any()
    cos = torch.nn.functional.cosine_similarity(quant.float().flatten(), mma.float().flatten(), dim=0).item()
    assert cos >= min_cosine(torch.bfloat16), f"Hopper INT8 vs mma.sync INT8 on views+mask: cosine {cos:.6f}"


def test_quant_sweep_runs_the_int8_logits_kernel_on_cuda(tmp_path):
    """quant-sweep on a GPU: --attention auto picks the fused kernel for a DIFF model it takes, and
    its damage per bit width matches the torch reference of the same quantisation on the CPU."""
    import json

    from helpers import run_cli

    from diffexport.modeling.checkpoint import save_checkpoint
    from diffexport.modeling.families import DiffV1Config, build_model

    config = DiffV1Config(vocab_size=512, d_model=256, n_layers=2, n_heads=2, n_kv_heads=1, head_dim=64)
    ckpt = save_checkpoint(build_model(config, seed=5), tmp_path / "d64.pt")
    common = [str(ckpt), "--bits", "8", "4", "--tokens", "2048", "--seq-len", "256", "--json"]
    gpu = run_cli("quant-sweep", *common, "--device", "cuda")
    assert gpu.returncode == 0, gpu.stderr
    assert "attention fused kernel" in gpu.stderr
    cpu = run_cli("quant-sweep", *common, "--device", "cpu", "--attention", "reference")
    assert cpu.returncode == 0, cpu.stderr
    got, want = (json.loads(r.stdout)["models"]["d64"] for r in (gpu, cpu))
    assert [p["attention"] for p in got] == ["kernel"] * 3 and [p["bits"] for p in got] == [16, 8, 4]
    assert got[1]["kl_mean"] < got[2]["kl_mean"]
    for g, w in zip(got, want):
        assert g["cosine_mean"] == pytest.approx(w["cosine_mean"], abs=1e-4)


def test_train_tiny_on_cuda_then_sweep_the_task_through_the_kernel(tmp_path):
    """tools/train_tiny.py --device cuda trains a pair the kernel takes; quant-sweep then reports the
    task accuracy per bit width with the fused kernel computing every quantised attention."""
    import json

    from helpers import checkout_env, run_cli

    root = Path(__file__).resolve().parent.parent
    cmd = [sys.executable, str(root / "tools" / "train_tiny.py"), "--out-dir", str(tmp_path), "--steps", "200",
           "--log-every", "100", "--head-dim", "64", "--device", "cuda", "--only", "diff"]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=600, env=checkout_env())
    assert done.returncode == 0, done.stderr
    out = run_cli("quant-sweep", str(tmp_path / "diff.pt"), "--bits", "8", "4", "--tokens", "1024", "--samples", "4",
                  "--device", "cuda", "--attention", "kernel", "--json")
    assert out.returncode == 0, out.stderr
    points = json.loads(out.stdout)["models"]["diff"]
    assert [p["attention"] for p in points] == ["kernel"] * 3
    assert all(0.0 <= p["task_accuracy"] <= 1.0 for p in points)
    assert abs(points[1]["task_accuracy"] - points[0]["task_accuracy"]) <= 0.05  # 8-bit logits keep the task
