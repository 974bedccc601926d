"""The TensorRT plugin's own code, run by tests/plugin_harness (an executable that plays TensorRT's
part through its public headers: no TensorRT engine is involved). The interface checks launch
nothing and run wherever the harness is built; the enqueue cases need a CUDA GPU and compare the
plugin's output with the float64 oracle under NUMERICS.md's rules (INT8 logits against the
reference that applies the same quantisation).

The harness and the plugin are built by CMake when TensorRT's headers are found
(-DTensorRT_INCLUDE_DIR=...); without them these tests are skipped, unless
DIFFEXPORT_REQUIRE_PLUGIN_HARNESS=1 (the GPU campaign sets it: a missing build must fail there)."""

import os
import subprocess
from pathlib import Path

import numpy as np
import pytest
import torch
from helpers import assert_close_lowprec, lowprec_baseline, make_inputs
from oracle import diff_attention_oracle

from diffexport.core.contract import DiffAttentionAttrs
from diffexport.core.kv_cache_codes import KvCacheScales, decode
from diffexport.core.quantization import LogitQuant
from diffexport.kernel import reference

ROOT = Path(__file__).resolve().parent.parent
HARNESS_ENV, LIB_ENV = "DIFFEXPORT_PLUGIN_HARNESS", "DIFFEXPORT_PLUGIN_LIB"
pytestmark = pytest.mark.plugin_harness  # the GPU campaign selects these with -m "gpu or plugin_harness"
TYPE_NAMES = {torch.float32: "float", torch.float16: "half", torch.bfloat16: "bf16", torch.int64: "int64",
              torch.int8: "int8", torch.float8_e4m3fn: "fp8"}


@pytest.fixture(scope="module")
def harness() -> tuple[Path, Path]:
    exe = Path(os.environ.get(HARNESS_ENV) or ROOT / "build/tests/plugin_harness/diffexport_plugin_harness")
    lib = Path(os.environ.get(LIB_ENV) or ROOT / "build/plugins/tensorrt/libdiffexport_plugins.so")
    missing = [str(p) for p in (exe, lib) if not p.is_file()]
    if missing:
        message = (f"plugin harness not built ({', '.join(missing)} missing): configure CMake with "
                   f"-DTensorRT_INCLUDE_DIR=<TensorRT headers>, or set {HARNESS_ENV} and {LIB_ENV}")
        if os.environ.get("DIFFEXPORT_REQUIRE_PLUGIN_HARNESS"):
            pytest.fail(message)
        pytest.skip(message)
    return exe, lib


def run_harness(*args, timeout=120) -> subprocess.CompletedProcess:
    done = subprocess.run([str(a) for a in args], capture_output=True, text=True, timeout=timeout)
    print(done.stdout, done.stderr)
    return done


def test_interface_methods(harness):
    """Creators, fields good and bad, capabilities, output types and shapes (runtime symbols too),
    every type x format at every position, configure/onShapeChange/workspace, the error recorder,
    clone and the serialisation round trip: all without a GPU."""
    exe, lib = harness
    done = run_harness(exe, lib, "api")
    failed = [line for line in done.stdout.splitlines() if line.startswith("FAIL")]
    assert done.returncode == 0 and not failed, "\n".join(failed) or done.stderr
    assert sum(line.startswith("ok:") for line in done.stdout.splitlines()) >= 40


def test_harness_refuses_a_library_without_the_entry_points(harness, tmp_path):
    """The harness itself can fail: a library that is not a plugin is one error line, exit 2."""
    exe, _ = harness
    done = run_harness(exe, "libc.so.6", "api")
    assert done.returncode != 0 and "FAIL: the library exports getCreators" in done.stdout


# variant, heads, kv heads, head dim, causal, batch, q_len, kv_len, dtype, logit bits, key mask,
# the profile's smallest query length (1: a decoder's profile, whose workspace holds split-KV states)
CASES = {
    "v1-fp16-d64-prefill": (1, 4, 2, 64, 1, 2, 37, 37, torch.float16, 16, False, 0),
    "v1-bf16-d128-noncausal": (1, 4, 4, 128, 0, 1, 130, 70, torch.bfloat16, 16, False, 0),
    "v2-fp16-d64-prefill": (2, 4, 1, 64, 1, 2, 65, 130, torch.float16, 16, False, 0),
    "v2-bf16-d128-prefill": (2, 8, 2, 128, 1, 1, 100, 100, torch.bfloat16, 16, False, 0),
    "v1-fp32-d64": (1, 2, 2, 64, 1, 2, 17, 33, torch.float32, 16, False, 0),
    "v1-bf16-d64-int8": (1, 4, 2, 64, 1, 2, 100, 300, torch.bfloat16, 8, False, 0),
    "v2-fp16-d128-int4": (2, 4, 2, 128, 1, 1, 90, 90, torch.float16, 4, False, 0),
    "v1-bf16-d128-decode-mask": (1, 8, 2, 128, 1, 3, 1, 1000, torch.bfloat16, 16, True, 1),
    "v2-fp16-d64-decode-mask": (2, 4, 4, 64, 1, 2, 4, 333, torch.float16, 16, True, 1),
    "v1-fp16-d64-decode-int8": (1, 4, 2, 64, 1, 2, 1, 700, torch.float16, 8, True, 1),
    "v1-fp16-d64-prefill-mask": (1, 4, 2, 64, 1, 2, 40, 90, torch.float16, 16, True, 1),
}


def write_case(folder: Path, attrs: DiffAttentionAttrs, tensors, bits: int, key_mask, min_q_len: int,
               kv_scales: tuple = ()) -> Path:
    """The harness's case file; kv_scales (k_scale, v_scale): a version-3 node, key and value its codes."""
    lines = [f"version {3 if kv_scales else 2 if key_mask is not None else 1}"]
    for name, value in attrs.as_dict().items():
        lines.append(f"field {name} {'f' if isinstance(value, float) else 'i'} {value!r}")
    lines.append(f"field logit_bits i {bits}")
    for index, t in enumerate(list(tensors) + ([key_mask] if key_mask is not None else []) + list(kv_scales)):
        t = t.contiguous()
        t.view(torch.uint8).numpy().tofile(folder / f"input{index}.bin")
        lines.append(f"input {index} {TYPE_NAMES[t.dtype]} {t.dim()} {' '.join(map(str, t.shape))} input{index}.bin")
    B, Sq = tensors[0].shape[:2]
    lines.append(f"output {TYPE_NAMES[tensors[0].dtype]} 3 {B} {Sq} {attrs.num_heads * attrs.value_dim}")
    if min_q_len:
        lines.append(f"min_q_len {min_q_len}")
    (folder / "case.txt").write_text("\n".join(lines) + "\n")
    return folder / "case.txt"


@pytest.mark.gpu
@pytest.mark.parametrize("name", list(CASES))
def test_enqueue_matches_the_oracle(harness, name, tmp_path, rng):
    """Build phase, serialisation, runtime phase and two enqueues (the clone and the plugin rebuilt
    from its serialised fields, bit-identical), on device buffers, against the float64 oracle."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    variant, heads, kv_heads, head_dim, causal, batch, q_len, kv_len, dtype, bits, masked, min_q = CASES[name]
    attrs = DiffAttentionAttrs(variant=variant, num_heads=heads, num_kv_heads=kv_heads, head_dim=head_dim,
                               causal=causal, norm=int(variant == 1), output_scale=0.8)
    # fp32 runs as fp16 inside the kernel library: its values must fit fp16, its yardstick is fp16's.
    cpu = list(make_inputs(attrs, batch, q_len, kv_len, dtype=dtype, rng=rng))
    cpu[4] = cpu[4].float()
    if bits < 16:  # a per-channel K offset: what K-smoothing removes
        cpu[1] = cpu[1] + torch.linspace(-1, 2, attrs.key_width).to(dtype)
    key_mask = None
    if masked:  # left padding: batch row 0 starts late, row 1 sees every key
        key_mask = torch.ones(batch, kv_len, dtype=torch.int64)
        key_mask[0, : kv_len // 3] = 0
    exe, lib = harness
    case = write_case(tmp_path, attrs, cpu, bits, key_mask, min_q)
    done = run_harness(exe, lib, "run", case, tmp_path / "output.bin")
    failed = [line for line in done.stdout.splitlines() if line.startswith("FAIL")]
    assert done.returncode == 0 and not failed, "\n".join(failed) or done.stderr
    raw = np.fromfile(tmp_path / "output.bin", dtype=np.uint8)
    out = torch.from_numpy(raw).view(dtype).reshape(batch, q_len, heads * attrs.value_dim)
    assert not out.isnan().any(), "output not fully written (0xFF poison left)"

    q, k, v, lam, w = (t.double().numpy() for t in cpu)
    mask_np = None if key_mask is None else key_mask.numpy()
    exact = torch.as_tensor(diff_attention_oracle(q, k, v, lam, w, mask_np, **attrs.as_dict()))
    low = torch.float16 if dtype == torch.float32 else dtype
    gpu = [t.cuda() for t in cpu[:4]] + [cpu[4].cuda()]
    gpu_low = [t.to(low) for t in gpu[:4]] + [gpu[4]]
    gpu_mask = None if key_mask is None else key_mask.cuda()
    baseline = lowprec_baseline(*gpu_low, attrs, key_mask=gpu_mask).cpu()
    if bits == 16:
        assert_close_lowprec(out.cpu(), baseline, exact, f"plugin {name}",
                             min_cosine=0.9999 if low == torch.float16 else 0.999)
        return
    mirror = reference.quantised_diff_attention(*[t.float() for t in gpu], attrs, LogitQuant(bits, "qk", True),
                                                key_mask=gpu_mask).float().cpu()
    fp_err = (baseline.double() - exact).abs().max().item()  # this dtype's rounding budget
    err = (out.double() - mirror.double()).abs().max().item()
    cos = torch.nn.functional.cosine_similarity(out.double().flatten(), mirror.double().flatten(), dim=0).item()
    assert err <= 2 * fp_err + 1e-3, f"vs mirrored quantisation: {err:.3e} > 2*{fp_err:.3e} + 1e-3"
    assert cos >= 0.999, f"cosine {cos:.6f} against the mirrored quantisation"


# variant, heads, kv heads, head dim, batch, q_len, kv_len, dtype, cache format (version 3: key and
# value an 8-bit cache's codes); a decoder's profile (the smallest query length 1)
KV_CACHE_CASES = {
    "v1-bf16-d128-decode-int8-cache": (1, 8, 2, 128, 2, 1, 1000, torch.bfloat16, "int8"),
    "v2-fp16-d64-decode-fp8-cache": (2, 4, 4, 64, 2, 4, 333, torch.float16, "fp8"),
    "v1-fp16-d64-prefill-int8-cache": (1, 4, 2, 64, 2, 40, 90, torch.float16, "int8"),  # dequantised first
}


@pytest.mark.gpu
@pytest.mark.parametrize("name", list(KV_CACHE_CASES))
def test_enqueue_reads_an_8_bit_kv_cache(harness, name, tmp_path, rng):
    """Plugin version 3 (key and value an int8 / fp8 cache's codes, k_scale and v_scale): the build and
    runtime phases and two enqueues, against the float64 oracle on the values the codes stand for."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    variant, heads, kv_heads, head_dim, batch, q_len, kv_len, dtype, fmt = KV_CACHE_CASES[name]
    attrs = DiffAttentionAttrs(variant=variant, num_heads=heads, num_kv_heads=kv_heads, head_dim=head_dim,
                               causal=1, norm=int(variant == 1), output_scale=0.8)
    cpu = list(make_inputs(attrs, batch, q_len, kv_len, dtype=dtype, rng=rng))
    cache = KvCacheScales.calibrate(cpu[1], cpu[2], fmt)
    codes = [cache.quantise_keys(cpu[1]), cache.quantise_values(cpu[2])]
    key_mask = torch.ones(batch, kv_len, dtype=torch.int64)
    key_mask[0, : kv_len // 3] = 0
    exe, lib = harness
    case = write_case(tmp_path, attrs, [cpu[0], *codes, *cpu[3:]], 16, key_mask, 1, (cache.k_scale, cache.v_scale))
    done = run_harness(exe, lib, "run", case, tmp_path / "output.bin")
    failed = [line for line in done.stdout.splitlines() if line.startswith("FAIL")]
    assert done.returncode == 0 and not failed, "\n".join(failed) or done.stderr
    out = torch.from_numpy(np.fromfile(tmp_path / "output.bin", dtype=np.uint8)).view(dtype)
    out = out.reshape(batch, q_len, heads * attrs.value_dim)
    assert not out.isnan().any(), "output not fully written (0xFF poison left)"
    dequantised = [cpu[0], decode(codes[0], cache.k_scale), decode(codes[1], cache.v_scale), *cpu[3:]]  # float32
    q, k, v, lam, w = (t.double().numpy() for t in dequantised)
    exact = torch.as_tensor(diff_attention_oracle(q, k, v, lam, w, key_mask.numpy(), **attrs.as_dict()))
    baseline = lowprec_baseline(*[t.to(dtype).cuda() for t in dequantised[:4]], dequantised[4].cuda(), attrs,
                                key_mask=key_mask.cuda()).cpu()
    assert_close_lowprec(out, baseline, exact, f"plugin {name}", min_cosine=0.9999 if dtype == torch.float16 else 0.999)
