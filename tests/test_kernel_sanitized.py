"""The emulated kernels under the host compiler's sanitizers: the CPU counterpart of
compute-sanitizer over tests/kernel_cases.py (plugins/kernels/emulation/sanitize_cases.cpp).

ThreadSanitizer: in these builds every CUDA thread of the emulation is a std::thread (not a fiber, as
in the default emulator, which would be one thread to it), so a shared-memory access no
barrier orders against another thread's write is a reported race. Its runs write each cp.async at
both ends of the window the PTX ISA gives it (DIFFX_EMULATOR_COPIES_LAND=2): at the thread's wait,
so a tile read before its wait races, and at the issue, so a copy into a stage that another warp may
still be reading (no barrier between that read and the issue) races too.
AddressSanitizer + UBSan: tensors, workspace, key mask and dynamic shared memory are allocated at
their exact sizes, so any access past one is reported, as is undefined integer arithmetic.

These builds lower three sizes so that each structure costs a few emulated tiles and threads, not
many: the split-KV target to 4 CTAs (DIFFX_DECODE_TARGET_CTAS: a cache of two or more tiles splits
with a handful of CTAs), the K-smoothing chunk to 128 keys (DIFFX_KEY_SUM_CHUNK), and the merge
kernel's CTA to 64 threads (DIFFX_MERGE_THREADS; ThreadSanitizer's cost grows with the threads that
meet at a barrier, and 64 still makes two or four groups of parts at head dim 64). They also turn on
the 8-bit cache's packed maps (DIFFX_DECODE_KV_PACK_MAPS=1), so that the cache cases run both
layouts of two tiles a step (the int8 case's 2 group rows packed, the fp8 case's 16 not) and, as a
99 KB GPU runs them, one tile a step. The ThreadSanitizer build also turns on the overlapped decode
loop (DIFFX_DECODE_KV_OVERLAP=1: the key ring a step ahead of the value ring, each refilled after
the step's barrier); AddressSanitizer's keeps the default loop, with warp copies
(DIFFX_DECODE_KV_WARP_COPIES=1: the warps that read a row copy it), which a third build, under
ThreadSanitizer, runs on the decode kernel's cache cases. The launches are
kernel_cases.CASES (the list compute-sanitizer runs on the GPU), in fp16 (the builds leave the bf16
instantiations out, DIFFX_EMULATE_FP16_ONLY, which halves their compile: bf16 goes through the same
2-byte indexing and barriers; compute-sanitizer's GPU runs take both), key-masked where causal,
with each cache cut to at most KEYS_CAP keys plus its ragged remainder (emulated_keys): under the
lowered sizes every case keeps its query blocks, several splits or chunks, and its ragged last
tile, in a fraction of the time (ThreadSanitizer ran the uncut list in
8 minutes on a 2-core CI machine). Plus a float32 launch (the conversion kernels), and for
ThreadSanitizer the decode pipelines in their steady state (STEADY_STATE_LAUNCHES). Skipped where
the compiler cannot build with a sanitizer."""

import os
import shutil
import subprocess
from pathlib import Path

import pytest
from kernel_cases import CASES, KV_CACHE_CASES

from diffexport.core.kv_cache_codes import FORMATS as KV_FORMATS
from diffexport.kernel.kernels import DECODE_MAX_QUERY  # calls this short take the split-KV decode kernels

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parent.parent
KERNELS = ROOT / "plugins" / "kernels"
SOURCES = [KERNELS / "params.cpp", KERNELS / "emulation" / "emulator.cpp", KERNELS / "emulation" / "sanitize_cases.cpp"]
SANITIZERS = {  # build: flags (the builds' names before a "-" are their -fsanitize values)
    # (the overlapped decode loop, off by default: its refills are the ordering ThreadSanitizer checks)
    "thread": ["-O1", "-fsanitize=thread", "-DDIFFX_DECODE_KV_OVERLAP=1"],
    # (warp copies, off by default: refills ordered by a warp's __syncwarp or a pair's barrier alone)
    "thread-warp-copies": ["-O1", "-fsanitize=thread", "-DDIFFX_DECODE_KV_WARP_COPIES=1"],
    # -Og, not -O1: GCC 12 took 116 CPU-s to compile this build at -O1 and 48 at -Og, whose launches
    # run 7 s longer (2026-11-30); the checks are instrumented at either level (fewer optimised away at -Og)
    "address,undefined": ["-Og", "-fsanitize=address,undefined", "-fno-sanitize-recover=undefined",
                          "-fno-omit-frame-pointer", "-DDIFFX_DECODE_KV_WARP_COPIES=1"],
}
REPORTS = ("WARNING: ThreadSanitizer", "ERROR: AddressSanitizer", "runtime error:", "ERROR: LeakSanitizer")


FP16 = 1  # sanitize_cases' dtype code (2 is bf16, which these builds leave out)
KEY_SUM_CHUNK = 128  # the builds' K-smoothing chunk: KEYS_CAP keys make two
KEYS_CAP = 256  # 4 tiles: two splits of two or more tiles at 4 target CTAs, two K-sum chunks


# Decode calls whose splits take more steps than the pipeline has stages, so that a step refills a
# stage an earlier step read: under the lowered target (4 CTAs) a 2001-key cache (32 tiles, the last
# ragged) splits into 4 of 8 tiles, where a refill of a read stage needs 3 (two stages, one tile a
# step) or 7 (an 8-bit cache: three stages of two tiles). The capped cases above split into 1-2 tiles.
# Head dim 64: the pipelines' code is that of 128, at half the emulated work. Format as launches().
STEADY_STATE_LAUNCHES = ["1,2,1,64,1,1,1,2001,0,1,1"]  # fp16 cache, two stages
STEADY_STATE_KV_CACHE_LAUNCHES = [
    "1,1,1,64,1,1,2,2001,0,1,1,1",  # int8 codes, 2 group rows: both maps in one tile (packed maps)
    "2,4,1,64,0,1,4,2001,0,1,0,2",  # e4m3 codes, 16 group rows: a tile a map
]


def emulated_keys(q_len: int, kv_len: int) -> int:
    """A case's cache under the lowered sizes: at most KEYS_CAP keys and the case's ragged
    remainder (so a ragged last tile stays ragged), never fewer than its queries (bottom-right
    causal rows keep keys to see)."""
    if kv_len <= KEYS_CAP + 64:
        return kv_len
    return max(q_len, KEYS_CAP + kv_len % 64)


def launches(sanitizer: str = "address,undefined") -> list[str]:
    """sanitize_cases' arguments: variant,heads,kv_heads,head_dim,causal,batch,q_len,kv_len,bits,dtype,masked.
    ThreadSanitizer gets one CTA shape of each case: one batch row, one kv group, one query head
    (decode keeps its query heads per group: it packs them into the rows of one tile) and one full
    query block (64 rows). The emulator runs a grid's CTAs one after another, so a race can only be
    within a CTA, and more CTAs of the same shape only cost time (three quarters of it, 2026-11-27;
    ragged query blocks stay in the cases of 17 and 33 rows). AddressSanitizer keeps every CTA: its
    question is each index."""
    cases = CASES if sanitizer != "thread" else [
        (v, h // hkv if sq <= DECODE_MAX_QUERY else 1, 1, d, causal, 1, min(sq, 64), skv, bits)
        for v, h, hkv, d, causal, b, sq, skv, bits in CASES]
    args = [f"{v},{h},{hkv},{d},{causal},{b},{sq},{emulated_keys(sq, skv)},{bits},{FP16},{causal}"
            for v, h, hkv, d, causal, b, sq, skv, bits in cases]
    heads = "1,1" if sanitizer == "thread" else "2,2"
    steady = STEADY_STATE_LAUNCHES if sanitizer == "thread" else []
    # + float32 I/O: the conversion kernels around the fp16 one
    return args + steady + kv_cache_launches(sanitizer) + [f"1,{heads},64,1,1,33,40,0,3,1"]


def kv_cache_launches(sanitizer: str) -> list[str]:
    """The 8-bit cache's launches (sanitize_cases' arguments plus the cache format). ThreadSanitizer:
    the decode kernel's cases only (a longer call's dequantisation is an elementwise kernel before
    the one-pass kernel, whose races the other cases already cover)."""
    kv_cases = KV_CACHE_CASES if sanitizer != "thread" else [
        (v, h // hkv, 1, d, causal, 1, sq, skv, fmt)
        for v, h, hkv, d, causal, b, sq, skv, fmt in KV_CACHE_CASES if sq <= DECODE_MAX_QUERY]
    steady = STEADY_STATE_KV_CACHE_LAUNCHES if sanitizer == "thread" else []
    return [f"{v},{h},{hkv},{d},{causal},{b},{sq},{emulated_keys(sq, skv)},0,{FP16},{causal},"
            f"{KV_FORMATS[fmt]}" for v, h, hkv, d, causal, b, sq, skv, fmt in kv_cases] + steady


@pytest.fixture(scope="module")
def builds(tmp_path_factory):
    """Both sanitizer builds, started together in the background (each compiler is one process): the
    ThreadSanitizer build is the quick one, so its launches run while AddressSanitizer's compiles."""
    compiler = shutil.which(os.environ.get("CXX", "c++"))
    if compiler is None:
        pytest.skip("no C++ compiler")
    started = {}
    for name, flags in SANITIZERS.items():
        folder = tmp_path_factory.mktemp("sanitized")
        exe, log = folder / "sanitize_cases", folder / "build.log"
        with open(log, "w") as out:
            started[name] = (subprocess.Popen(
                [compiler, "-g", "-std=c++20", "-DDIFFX_EMULATE", "-DDIFFX_EMULATE_FP16_ONLY",
                 "-DDIFFX_DECODE_TARGET_CTAS=4", "-DDIFFX_DECODE_KV_PACK_MAPS=1",
                 "-DDIFFX_MERGE_THREADS=64",
                 f"-DDIFFX_KEY_SUM_CHUNK={KEY_SUM_CHUNK}", f"-I{KERNELS}", *flags, *map(str, SOURCES), "-lpthread",
                 "-o", str(exe)], stdout=out, stderr=subprocess.STDOUT), exe, log)
    yield started
    for proc, _, _ in started.values():
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def built(builds, name):
    proc, exe, log = builds[name]
    if proc.wait(timeout=600) != 0:
        pytest.skip(f"cannot build with -fsanitize={name.split('-')[0]}: {log.read_text().strip().splitlines()[-1:]}")
    return exe


@pytest.fixture(params=["thread", "address,undefined"])  # the quick build's launches first
def sanitized(request, builds):
    return request.param, built(builds, request.param)


def sanitizer_reports(exe, args, **env):
    """The sanitizer's report lines of one run of sanitize_cases (with its exit status where not 0),
    and its output."""
    env = dict(os.environ, **env)
    env.pop("DIFFEXPORT_KERNEL_PATH", None)  # the emulator has the automatic paths only (a shell may set hopper)
    run = subprocess.run([str(exe), *args], capture_output=True, text=True, timeout=900, env=env)
    output = run.stdout + run.stderr
    reports = [line for line in output.splitlines() if any(r in line for r in REPORTS)]
    return reports if run.returncode == 0 else [f"exit {run.returncode}", *reports], output


def test_emulated_kernels_are_sanitizer_clean(sanitized):
    name, exe = sanitized
    env = dict(TSAN_OPTIONS="halt_on_error=1", ASAN_OPTIONS="detect_leaks=1:abort_on_error=0",
               DIFFX_EMULATOR_COPIES_LAND="2" if name == "thread" else "0")
    reports, output = sanitizer_reports(exe, launches(name), **env)
    assert not reports, f"-fsanitize={name}:\n" + "\n".join(output.splitlines()[:60])
    assert output.count(" ok") == len(launches(name))  # every launch ran and wrote finite outputs
    # The 8-bit cache's decode kernel as the emulator runs it by default takes two tiles a step (an
    # sm_90's shared memory); again as a GPU of 99 KB runs it: one tile a step, three stages.
    kv = kv_cache_launches(name)
    reports, output = sanitizer_reports(exe, kv, DIFFX_EMULATOR_SMEM_OPTIN="101376", **env)
    assert not reports, f"-fsanitize={name}, 99 KB:\n" + "\n".join(output.splitlines()[:60])
    assert output.count(" ok") == len(kv)


def test_warp_copies_are_thread_sanitizer_clean(builds):
    """Warp copies (DIFFX_DECODE_KV_WARP_COPIES=1), no CTA barrier a step: with packed maps each warp
    refills the rows it alone reads once its lanes have met (__syncwarp); with a tile a map the two
    warps of a quarter each refill half of the rows they share once they have met at their named
    barrier. ThreadSanitizer, copies written at both ends of their window, on the decode kernel's
    cache cases and their steady state (packed int8 and 16-row fp8 cases refill stages within their
    splits). Mutants whose packed warps copy each other's rows, or whose pairs meet at __syncwarp,
    are reported races. (The emulated ldmatrix meets its lanes itself, so a missing __syncwarp
    between a lane's copy and another lane's read is not one here: ptxas compiles it to a NOP, as
    the warp runs converged.)"""
    exe = built(builds, "thread-warp-copies")
    kv = kv_cache_launches("thread")
    reports, output = sanitizer_reports(exe, kv, TSAN_OPTIONS="halt_on_error=1", DIFFX_EMULATOR_COPIES_LAND="2")
    assert not reports, "-fsanitize=thread, warp copies:\n" + "\n".join(output.splitlines()[:60])
    assert output.count(" ok") == len(kv)
