"""The fused kernel library's C ABI on the CPU: loading, the params mirror, every parameter check
and one-line errors. No GPU needed: diffx_attention_check never touches the device, so fake
(aligned, never dereferenced) addresses stand in for device pointers. The library must be built
(.ci/run builds it for every architecture); these tests skip only where it was not."""

import ctypes
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from helpers import run_cli

from diffexport.core import contract
from diffexport.core.contract import DiffAttentionAttrs
from diffexport.core.errors import DiffExportError
from diffexport.kernel import kernel_probe, kernels

HEADER = Path(__file__).resolve().parent.parent / "plugins" / "kernels" / "diff_attention.h"
FAKE = 1 << 24  # a 16-byte-aligned address the check never dereferences


@pytest.fixture(scope="module")
def lib():
    if kernels.library_path() is None:
        pytest.skip(f"kernel library not built: {kernels.BUILD_HINT}")
    return kernels.load_library()


def auto_prefill_kernel() -> str:
    """The kernel DIFFEXPORT_KERNEL_PATH=auto gives longer fp-logit calls: the Hopper path where it can
    run (kernel_probe.applicable: an sm_90 GPU and a library with it; none on the CPU machine), else one-pass."""
    return "hopper" if torch.cuda.is_available() and kernel_probe.applicable("hopper") is None else "one-pass"


def header_enum(name: str) -> dict[str, int]:
    body = re.search(r"typedef enum %s \{(.*?)\}" % name, HEADER.read_text(), re.S).group(1)
    return {k: int(v) for k, v in re.findall(r"(DIFFX_\w+)\s*=\s*(\d+)", body)}


STATUS = header_enum("DiffxStatus")


def valid_params(variant=1, head_dim=64, num_heads=4, num_kv_heads=2, batch=2, q_len=100, kv_len=100, bits=0,
                 smooth_k=1):
    D = head_dim
    Dv = 2 * D if variant == 1 else D
    key_maps = 2 * num_kv_heads if variant == 1 else num_kv_heads
    p = kernels.DiffxAttentionParams()
    p.query, p.q_row_stride = FAKE, 2 * num_heads * D
    p.q_batch_stride = q_len * p.q_row_stride
    p.key, p.k_row_stride = FAKE, key_maps * D
    p.k_batch_stride = kv_len * p.k_row_stride
    p.value, p.v_row_stride = FAKE, num_kv_heads * Dv
    p.v_batch_stride = kv_len * p.v_row_stride
    p.lambda_full, p.norm_weight = FAKE, FAKE
    if variant == 2:
        p.lambda_batch_stride, p.lambda_row_stride, p.lambda_head_stride = q_len * num_heads, num_heads, 1
    p.output, p.o_row_stride = FAKE, num_heads * Dv
    p.o_batch_stride = q_len * p.o_row_stride
    p.dtype, p.variant, p.batch, p.q_len, p.kv_len = 1, variant, batch, q_len, kv_len
    p.num_heads, p.num_kv_heads, p.head_dim = num_heads, num_kv_heads, head_dim
    p.causal, p.norm, p.scale, p.norm_eps, p.output_scale = 1, int(variant == 1), 0.0, 1e-5, 0.8
    p.logit_bits, p.smooth_k = bits, smooth_k
    return p


def test_binding_mirrors_the_header(lib):
    assert lib.diffx_abi_version() == kernels.ABI_VERSION
    assert lib.diffx_params_size() == ctypes.sizeof(kernels.DiffxAttentionParams)
    struct = re.search(r"typedef struct DiffxAttentionParams \{(.*?)\} DiffxAttentionParams;",
                       HEADER.read_text(), re.S).group(1)
    struct = re.sub(r"/\*.*?\*/", "", struct, flags=re.S)
    names = [n for decl in struct.split(";") for n in re.findall(r"(\w+)\s*(?:,|$)", decl.strip())
             if decl.strip() and n not in ("int32_t", "int64_t", "float", "size_t", "void", "char")]
    assert names == [f for f, _ in kernels.DiffxAttentionParams._fields_]
    assert re.search(r"DIFFX_ABI_VERSION (\d+)", HEADER.read_text()).group(1) == str(kernels.ABI_VERSION)


def test_params_carry_every_contract_attribute():
    """The kernel's params use the contract's attribute names, so the plugin can forward them 1:1."""
    fields = {f for f, _ in kernels.DiffxAttentionParams._fields_}
    assert set(contract.ATTRIBUTE_NAMES) <= fields
    assert set(contract.ALL_INPUT_NAMES) <= fields  # key_mask (op version 2) included


def test_build_info(lib):
    info = kernels.build_info()
    assert re.match(rf"archs=\S+ cuda=\d+\.\d+ abi={kernels.ABI_VERSION} sm90=[01]$", info), info


@pytest.mark.parametrize("variant,head_dim,bits", [(1, 64, 0), (1, 128, 16), (2, 64, 8), (2, 128, 4), (1, 128, 6)])
def test_valid_params_pass(lib, variant, head_dim, bits):
    p = valid_params(variant=variant, head_dim=head_dim, bits=bits)
    if bits not in (0, 16):
        p.workspace, p.workspace_bytes = FAKE, lib.diffx_attention_workspace_size(ctypes.byref(p))
    assert lib.diffx_attention_check(ctypes.byref(p)) == 0, lib.diffx_last_error().decode()


BAD = [
    ("dtype", 4, "DIFFX_ERR_UNSUPPORTED_DTYPE", "dtype 4"),
    ("variant", 0, "DIFFX_ERR_BAD_VARIANT", "variant 0"),
    ("head_dim", 96, "DIFFX_ERR_UNSUPPORTED_HEAD_DIM", "head_dim 96"),
    ("batch", 0, "DIFFX_ERR_BAD_SIZE", "batch 0"),
    ("q_len", 0, "DIFFX_ERR_BAD_SIZE", "q_len 0"),
    ("kv_len", -3, "DIFFX_ERR_BAD_SIZE", "kv_len -3"),
    ("num_kv_heads", 3, "DIFFX_ERR_BAD_HEADS", "divide num_heads 4"),
    ("num_heads", 70000, "DIFFX_ERR_BAD_HEADS", "num_heads 70000"),
    ("causal", 2, "DIFFX_ERR_BAD_ATTRIBUTE", "causal 2"),
    ("norm", -1, "DIFFX_ERR_BAD_ATTRIBUTE", "norm -1"),
    ("scale", float("nan"), "DIFFX_ERR_BAD_ATTRIBUTE", "scale nan"),
    ("scale", -1.0, "DIFFX_ERR_BAD_ATTRIBUTE", "scale -1"),
    ("norm_eps", 0.0, "DIFFX_ERR_BAD_ATTRIBUTE", "norm_eps 0"),
    ("output_scale", float("inf"), "DIFFX_ERR_BAD_ATTRIBUTE", "output_scale inf"),
    ("logit_bits", 9, "DIFFX_ERR_BAD_ATTRIBUTE", "logit_bits 9"),
    ("logit_bits", 1, "DIFFX_ERR_BAD_ATTRIBUTE", "logit_bits 1"),
    ("smooth_k", 5, "DIFFX_ERR_BAD_ATTRIBUTE", "smooth_k 5"),
    ("query", None, "DIFFX_ERR_NULL_POINTER", "query is a null pointer"),
    ("output", None, "DIFFX_ERR_NULL_POINTER", "output is a null pointer"),
    ("lambda_full", None, "DIFFX_ERR_NULL_POINTER", "lambda_full"),
    ("norm_weight", None, "DIFFX_ERR_NULL_POINTER", "norm_weight"),
    ("key", FAKE + 8, "DIFFX_ERR_MISALIGNED", "key must start on a 16-byte boundary"),
    ("norm_weight", FAKE + 2, "DIFFX_ERR_MISALIGNED", "norm_weight must be 4-byte aligned"),
    ("q_row_stride", 100, "DIFFX_ERR_MISALIGNED", "query row stride 100"),
    ("v_row_stride", 64, "DIFFX_ERR_MISALIGNED", "value row stride 64 must be >= its width 256"),
    ("k_batch_stride", 4, "DIFFX_ERR_MISALIGNED", "key batch stride 4"),
    ("key_mask", FAKE + 4, "DIFFX_ERR_MISALIGNED", "key_mask must be 8-byte aligned"),
]


@pytest.mark.parametrize("stride,ok", [(100, True), (0, True), (128, True), (99, False)])
def test_key_mask_stride(lib, stride, ok):
    """Op version 2: the mask row stride is 0 (one row for every sequence) or at least kv_len."""
    p = valid_params()
    p.key_mask, p.mask_batch_stride = FAKE, stride
    status = lib.diffx_attention_check(ctypes.byref(p))
    assert status == (STATUS["DIFFX_OK"] if ok else STATUS["DIFFX_ERR_BAD_SIZE"])
    if not ok:
        assert "key_mask batch stride 99" in lib.diffx_last_error().decode()


def test_variant_2_with_norm_is_refused_as_the_contract_does(lib):
    p = valid_params(variant=2)
    p.norm = 1
    assert lib.diffx_attention_check(ctypes.byref(p)) == STATUS["DIFFX_ERR_BAD_ATTRIBUTE"]
    assert "variant 2 (DIFF V2) has no per-head norm" in lib.diffx_last_error().decode()
    with pytest.raises(DiffExportError, match="no per-head norm"):
        DiffAttentionAttrs(variant=2, num_heads=4, num_kv_heads=2, head_dim=64, norm=1)


def test_query_blocks_fit_the_grid(lib):
    """The contract bounds q_len at 65535 query blocks of 64 tokens."""
    p = valid_params(q_len=65535 * 64 + 1, kv_len=65535 * 64 + 1)
    assert lib.diffx_attention_check(ctypes.byref(p)) == STATUS["DIFFX_ERR_BAD_SIZE"]
    assert f"q_len {65535 * 64 + 1} must be in 1..{65535 * 64}" in lib.diffx_last_error().decode()


@pytest.mark.parametrize("field,value,status,message", BAD, ids=[f"{b[0]}={b[1]}" for b in BAD])
def test_bad_params_are_refused_with_a_reason(lib, field, value, status, message):
    p = valid_params()
    setattr(p, field, value)
    assert lib.diffx_attention_check(ctypes.byref(p)) == STATUS[status]
    detail = lib.diffx_last_error().decode()
    assert message in detail and "\n" not in detail


def test_null_params_and_status_strings(lib):
    assert lib.diffx_attention_check(None) == STATUS["DIFFX_ERR_NULL_POINTER"]
    for code in STATUS.values():
        assert lib.diffx_status_string(code).decode() != "unknown status"
    assert lib.diffx_status_string(999).decode() == "unknown status"


@pytest.mark.parametrize("smooth_k", [1, 0])
def test_workspace_size_and_check(lib, smooth_k):
    """INT8 path: codes [B*key_maps, 64-padded keys, D] int8, scales per 64-key block, K sums per
    1024-key chunk (smoothing)."""
    p = valid_params(variant=1, head_dim=64, num_kv_heads=2, batch=2, kv_len=1100, bits=8, smooth_k=smooth_k)
    maps, blocks, chunks = 2 * 2 * 2, 18, 2
    codes, scales, mean = maps * blocks * 64 * 64, maps * blocks * 4, maps * chunks * 64 * 4
    up = lambda x: -(-x // 256) * 256  # noqa: E731
    expected = up(codes) + up(scales) + (up(mean) if smooth_k else 0)
    assert lib.diffx_attention_workspace_size(ctypes.byref(p)) == expected
    assert lib.diffx_attention_check(ctypes.byref(p)) == STATUS["DIFFX_ERR_WORKSPACE_TOO_SMALL"]
    assert str(expected) in lib.diffx_last_error().decode()
    p.workspace, p.workspace_bytes = FAKE + 16, expected
    assert lib.diffx_attention_check(ctypes.byref(p)) == STATUS["DIFFX_ERR_MISALIGNED"]
    p.workspace = FAKE
    assert lib.diffx_attention_check(ctypes.byref(p)) == 0
    for bits in (0, 16):
        p.logit_bits = bits
        assert lib.diffx_attention_workspace_size(ctypes.byref(p)) == 0


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the no-GPU error path")
def test_forward_without_a_gpu_is_an_error_not_a_crash(lib):
    p = valid_params()
    status = lib.diffx_attention_forward(ctypes.byref(p), None)
    assert status == STATUS["DIFFX_ERR_CUDA"]
    assert "no usable CUDA device" in lib.diffx_last_error().decode()


def test_python_entry_refuses_what_the_kernel_cannot_take():
    attrs = DiffAttentionAttrs(variant=1, num_heads=2, num_kv_heads=1, head_dim=64)
    q, k, v = torch.randn(1, 5, 256), torch.randn(1, 5, 128), torch.randn(1, 5, 128)
    lam, w = torch.tensor([0.5]), torch.ones(128)
    with pytest.raises(DiffExportError, match="CUDA tensors only"):
        kernels.diff_attention(q, k, v, lam, w, attrs)
    with pytest.raises(DiffExportError, match="2..8 bits"):
        kernels.diff_attention(q, k, v, lam, w, attrs, logit_bits=12)
    with pytest.raises(DiffExportError, match="from 2 to 16"):
        kernels.diff_attention(q, k, v, lam, w, attrs, logit_bits=1)
    with pytest.raises(DiffExportError, match="query width"):
        kernels.diff_attention(q[..., :128], k, v, lam, w, attrs)
    assert not kernels.use_fused(q, k, v, lam, w, attrs)  # auto on CPU tensors: the reference


def test_missing_or_corrupt_library_is_one_line(tmp_path, monkeypatch):
    kernels.load_library.cache_clear()
    try:
        monkeypatch.setenv("DIFFEXPORT_KERNEL_LIB", str(tmp_path / "nope.so"))
        with pytest.raises(DiffExportError, match="not found .*cmake -S . -B build"):
            kernels.load_library()
        bad = tmp_path / "libdiffexport_kernels.so"
        bad.write_bytes(b"\x7fELF not really a library")
        monkeypatch.setenv("DIFFEXPORT_KERNEL_LIB", str(bad))
        with pytest.raises(DiffExportError, match="cannot load the fused kernel library"):
            kernels.load_library()
        monkeypatch.setenv(kernels.IMPL_ENV, "fastest")
        with pytest.raises(DiffExportError, match="not one of auto, fused, reference"):
            kernels.impl_choice()
    finally:
        kernels.load_library.cache_clear()


def test_cli_kernels(lib, tmp_path):
    result = run_cli("kernels")
    assert result.returncode == 0, result.stderr
    assert "archs=" in result.stdout and str(kernels.library_path()) in result.stdout


@pytest.mark.slow
def test_cli_kernels_not_built_is_information_a_broken_library_an_error(tmp_path):
    """`diffexport kernels` reports a missing library (exit 0, with the build command); a file
    that is there but not a usable library is an error (one line, exit 2)."""
    env = {**os.environ, "DIFFEXPORT_KERNEL_LIB": str(tmp_path / "missing.so")}
    missing = subprocess.run([sys.executable, "-m", "diffexport", "kernels"], capture_output=True, text=True, env=env)
    assert missing.returncode == 0, missing.stderr
    assert "not built" in missing.stdout and "cmake -S . -B build" in missing.stdout
    broken = tmp_path / "libdiffexport_kernels.so"
    broken.write_bytes(b"\x7fELF not a library")
    env["DIFFEXPORT_KERNEL_LIB"] = str(broken)
    bad = subprocess.run([sys.executable, "-m", "diffexport", "kernels"], capture_output=True, text=True, env=env)
    assert bad.returncode == 2
    assert bad.stderr.startswith("error: cannot load the fused kernel library") and bad.stderr.count("\n") == 1


def test_float32_io_workspace(lib):
    """float32 I/O: fp16 copies of query, key, value, lambda and output, then the INT8 part."""
    up = lambda x: -(-x // 256) * 256  # noqa: E731
    p = valid_params(variant=2, head_dim=64, num_heads=4, num_kv_heads=2, batch=2, q_len=100, kv_len=100)
    p.dtype = 3
    halves = [2 * 100 * 2 * 4 * 64, 2 * 100 * 2 * 64, 2 * 100 * 2 * 64, 2 * 100 * 4, 2 * 100 * 4 * 64]
    expected = sum(up(2 * n) for n in halves)
    assert lib.diffx_attention_workspace_size(ctypes.byref(p)) == expected
    assert lib.diffx_attention_check(ctypes.byref(p)) == STATUS["DIFFX_ERR_WORKSPACE_TOO_SMALL"]
    p.lambda_head_stride = 2
    p.workspace, p.workspace_bytes = FAKE, expected
    assert lib.diffx_attention_check(ctypes.byref(p)) == STATUS["DIFFX_ERR_BAD_SIZE"]
    assert "head stride 1" in lib.diffx_last_error().decode()
    p.lambda_head_stride = 1
    assert lib.diffx_attention_check(ctypes.byref(p)) == 0
    p.logit_bits = 8
    assert lib.diffx_attention_workspace_size(ctypes.byref(p)) > expected


def test_decode_sized_calls_plan_the_split_kv_kernels(lib, monkeypatch):
    """q_len <= 16 runs the split-KV decode kernels (splits from the shapes alone, never empty);
    DIFFEXPORT_KERNEL_PATH=mma forces the one-pass kernel; an unknown value is a one-line error."""
    def plan(**kw):
        return kernels.kernel_plan(valid_params(**kw), lib)

    assert plan(q_len=100, kv_len=100) == (auto_prefill_kernel(), 1)
    assert plan(q_len=17, kv_len=4096) == (auto_prefill_kernel(), 1)
    # batch 2 x 4 heads, one CTA per head (q_len 16 leaves no room to pack the GQA pair): 8 CTAs a
    # split, 32 splits reach 256 CTAs; 4096 keys are 64 tiles, 2 a split
    assert plan(q_len=16, kv_len=4096) == ("split-kv", 32)
    # q_len 1: the two heads of each kv group share a CTA, 4 CTAs a split, 64 splits of one tile
    assert plan(q_len=1, kv_len=4096) == ("split-kv", 64)
    assert plan(q_len=1, kv_len=4096, bits=8) == ("split-kv", 32)  # INT8: Q scales per head, no packing
    assert plan(q_len=16, kv_len=100) == ("split-kv", 2)  # never more splits than 64-key tiles
    assert plan(q_len=1, kv_len=1) == ("split-kv", 1)
    # 70 tiles over 64 splits: 2 tiles a split, so 35 splits (none left empty)
    assert plan(q_len=4, kv_len=70 * 64) == ("split-kv", 35)
    # 32 heads over 2 kv groups, all 16 of a group in one CTA: 64 x 2 CTAs, 2 splits reach 256
    assert plan(q_len=1, kv_len=128 * 1024, batch=64, num_heads=32) == ("split-kv", 2)
    assert plan(q_len=1, kv_len=128 * 1024, batch=64, num_heads=32, num_kv_heads=32) == ("split-kv", 1)
    monkeypatch.setenv(kernels.KERNEL_PATH_ENV, "mma")
    assert plan(q_len=1, kv_len=4096) == ("one-pass", 1)
    monkeypatch.setenv(kernels.KERNEL_PATH_ENV, "hopper-please")
    with pytest.raises(DiffExportError, match="DIFFEXPORT_KERNEL_PATH=hopper-please is not auto, mma or hopper"):
        plan(q_len=1, kv_len=4096)


def test_decode_workspace_is_a_growing_bound(lib, monkeypatch):
    """The decode partials: min(B*H*q*tiles, B*H*q + 256*min(ratio*q, 16)) rows x 2 maps (one part per
    split: the CTA merges its warps) of Dv + 2 floats, reserved whatever DIFFEXPORT_KERNEL_PATH says, and never
    shrinking as batch, heads,
    keys or q_len grow (a TensorRT plugin sizes it once at its profile's maximum)."""
    up = lambda x: -(-x // 256) * 256  # noqa: E731

    def size(**kw):
        return lib.diffx_attention_workspace_size(ctypes.byref(valid_params(**kw)))

    rows = min(2 * 4 * 3 * 64, 2 * 4 * 3 + 256 * min(2 * 3, 16))
    states = rows * 2
    assert size(q_len=3, kv_len=4096) == up(states * 128 * 4) + up(states * 2 * 4)
    assert size(q_len=17, kv_len=4096) == 0
    monkeypatch.setenv(kernels.KERNEL_PATH_ENV, "mma")
    assert size(q_len=3, kv_len=4096) == up(states * 128 * 4) + up(states * 2 * 4)
    monkeypatch.delenv(kernels.KERNEL_PATH_ENV)
    previous = 0
    for batch, heads, kv_len in [(1, 1, 1), (1, 1, 640), (1, 2, 640), (1, 255, 640), (1, 256, 640), (2, 256, 640),
                                 (2, 256, 70_000)]:
        now = size(q_len=1, batch=batch, num_heads=heads, num_kv_heads=1, kv_len=kv_len)
        assert now >= previous, (batch, heads, kv_len)
        previous = now
    sizes = [size(q_len=q, kv_len=4096) for q in range(1, 17)]
    assert sizes == sorted(sizes), sizes
    p = valid_params(q_len=1, kv_len=4096)
    assert lib.diffx_attention_check(ctypes.byref(p)) == STATUS["DIFFX_ERR_WORKSPACE_TOO_SMALL"]
    assert "split-KV decode" in lib.diffx_last_error().decode()


@pytest.mark.parametrize("asked", ["auto", "hopper"])
def test_hopper_path_where_it_runs_and_only_for_what_it_implements(asked, lib, monkeypatch):
    """The Hopper path takes prefill-sized calls, fp or INT8 logits: always when DIFFEXPORT_KERNEL_PATH=hopper
    asks for it, under auto where it runs (an sm_90 GPU, a library built with it); decode-sized calls
    keep split-KV, zero batch strides (which TMA descriptors cannot express) keep the mma.sync kernel,
    and mma keeps every call off it."""
    def plan(**kw):
        return kernels.kernel_plan(valid_params(**kw), lib)

    monkeypatch.setenv(kernels.KERNEL_PATH_ENV, "mma")
    assert plan(q_len=100) == ("one-pass", 1)
    if asked == "auto" and auto_prefill_kernel() != "hopper":
        monkeypatch.setenv(kernels.KERNEL_PATH_ENV, "auto")
        assert plan(q_len=100) == ("one-pass", 1)  # no sm_90 GPU, or a library without the Hopper path
        return
    monkeypatch.setenv(kernels.KERNEL_PATH_ENV, asked)
    assert plan(q_len=100) == ("hopper", 1)
    assert plan(q_len=17, batch=1) == ("hopper", 1)
    assert plan(q_len=16, kv_len=4096) == ("split-kv", 32)
    assert plan(q_len=100, bits=8) == ("hopper", 1)
    assert plan(q_len=100, bits=4) == ("hopper", 1)
    p = valid_params(q_len=100)
    p.v_batch_stride = 0  # one value tensor broadcast over the batch
    assert kernels.kernel_plan(p, lib) == ("one-pass", 1)
    p.batch = 1
    assert kernels.kernel_plan(p, lib) == ("hopper", 1)


OLDER_BUILD = r"""
#include "diff_attention.h"
int diffx_abi_version(void) { return FAKE_ABI; }
size_t diffx_params_size(void) { return offsetof(DiffxAttentionParams, kv_format); }  /* the params before ABI 4 */
const char* diffx_build_info(void) { return "archs=90a-real cuda=13.0 abi=older"; }
const char* diffx_status_string(int status) { (void)status; return "fake"; }
const char* diffx_last_error(void) { return ""; }
int diffx_attention_check(const DiffxAttentionParams* p) { (void)p; return 0; }
size_t diffx_attention_workspace_size(const DiffxAttentionParams* p) { (void)p; return 0; }
int diffx_attention_forward(const DiffxAttentionParams* p, void* s) { (void)p; (void)s; return 0; }
#if FAKE_ABI >= 3
int diffx_attention_plan(const DiffxAttentionParams* p, int* path, int* splits) {
  (void)p, (void)path, (void)splits;
  return 0;
}
#endif
"""


@pytest.mark.parametrize("abi", [1, 2, 3])
def test_an_older_build_opens_for_prefill_comparisons_only_when_its_params_agree(tmp_path, abi):
    """tools/bench_attention.py --compare times a build of an earlier commit beside this one: an ABI-2
    or -3 build (the params before ABI 4's 8-bit cache fields, which come last; ABI 3 added the decode
    workspace and diffx_attention_plan) opens with prefill_only, and nowhere else; an ABI-1 build (no
    key_mask) never."""
    source = tmp_path / "older.c"
    source.write_text(OLDER_BUILD)
    path = tmp_path / "libolder.so"
    built = subprocess.run(["cc", "-shared", "-fPIC", f"-DFAKE_ABI={abi}", f"-I{HEADER.parent}", str(source), "-o",
                            str(path)], capture_output=True, text=True)
    if built.returncode != 0:
        pytest.skip(f"no C compiler here: {built.stderr[-300:]}")
    with pytest.raises(DiffExportError, match=f"has kernel ABI {abi}, this diffexport needs {kernels.ABI_VERSION}"):
        kernels.open_library(path)
    if abi in kernels.FLOAT_CACHE_ABI_VERSIONS:  # ABI 3: its split-KV decode on a float cache, too
        assert kernels.open_library(path, float_cache_only=True).diffx_abi_version() == abi
    else:
        with pytest.raises(DiffExportError, match=f"has kernel ABI {abi}"):
            kernels.open_library(path, float_cache_only=True)
    if abi in kernels.PREFILL_ABI_VERSIONS:
        lib = kernels.open_library(path, prefill_only=True)
        assert lib.diffx_abi_version() == abi and lib.diffx_build_info() == b"archs=90a-real cuda=13.0 abi=older"
    else:
        with pytest.raises(DiffExportError, match=f"has kernel ABI {abi}"):
            kernels.open_library(path, prefill_only=True)
