"""What the compiled kernel library holds, read from its binary on the CPU (cuobjdump and nvdisasm;
no GPU needed): the Hopper path's sm_90a kernels are built from wgmma (HGMMA) and TMA (UTMALDG)
with register reallocation, and neither they nor the split-KV decode kernels spill on any
architecture. Skipped where the library is not built or the binary utilities are missing
(.ci/run installs them from the nvidia-cuda-cuobjdump and nvidia-cuda-nvdisasm wheels).

Also the Hopper path's layout facts (plugins/kernels/hopper/layout_check.cu): its index arithmetic
against CuTe's own layouts, compiled with nvcc as host code and run on the CPU."""

import importlib.util
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from diffexport.kernel import kernels

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tools"))
import kernel_resources  # noqa: E402

ARCHS = {"sm_80", "sm_86", "sm_87", "sm_89", "sm_90a"}
KERNELS = Path(__file__).resolve().parent.parent / "plugins" / "kernels"


@pytest.fixture(scope="module")
def lib():
    path = kernels.library_path()
    if path is None:
        pytest.skip(f"kernel library not built: {kernels.BUILD_HINT}")
    if kernel_resources.find_tool("cuobjdump") is None:
        pytest.skip("cuobjdump not found (pip install nvidia-cuda-cuobjdump)")
    return path


def test_decode_kernels_are_built_for_every_architecture_without_spills(lib):
    rows = kernel_resources.resource_usage(lib)
    decode = [r for r in rows if "diff_attention_decode" in r["kernel"]]
    built = {r["arch"] for r in decode}
    assert ARCHS & built == ARCHS & {r["arch"] for r in rows}, "decode kernels missing for an architecture"
    # 16 split-KV kernels with two K/V stages (dtype x D x variant x logits), 4 more with one stage (V1 at
    # head dim 128, whose two stages need more shared memory than sm_86/sm_89 have); for the 8-bit caches
    # (dtype x int8/fp8 codes) two tiles a step in three stages at every D and variant, one tile a step
    # in three where the first does not fit every GPU (all but V2 at head dim 64) and in two where
    # neither does (V1 at head dim 128): 4 x 8; and 6 merge kernels (dtype x value dim) per architecture
    for arch in built:
        names = {r["kernel"] for r in decode if r["arch"] == arch}
        assert sum("decode_kernel<" in n for n in names) == 52 and sum("merge_kernel<" in n for n in names) == 6, arch
    # No decode kernel spills: the int8-cache V1 head-dim-64 kernel with two tiles a step, capped at 128
    # registers for two CTAs an SM, kept 8-16 bytes of ldmatrix offsets in local memory until its
    # copies and padded rows took fewer registers.
    spilled = [(r["arch"], r["kernel"], r["stack"]) for r in decode if r["stack"]]
    assert not spilled, spilled


def test_static_shared_memory_leaves_the_dynamic_tiles_room_on_every_target(lib):
    """diff_attention_fwd.cuh asserts at compile time that each kernel's dynamic shared memory fits
    99 KB (sm_86/sm_89's per-block limit) minus kStaticSmemBudget; the static part, known only to
    the compiler, is read here from the binary for every kernel on every architecture."""
    source = (KERNELS / "diff_attention_fwd.cuh").read_text()
    budget = int(re.search(r"constexpr int kStaticSmemBudget = (\d+);", source).group(1))
    rows = kernel_resources.resource_usage(lib)
    assert {r["arch"] for r in rows} >= {"sm_86", "sm_89"}
    over = [(r["arch"], r["kernel"], r["shared"]) for r in rows if r["shared"] > budget]
    assert not over, over


@pytest.fixture(scope="module")
def sm90a_markers(lib):
    """Per sm_90a kernel, the counts of kernel_resources.MARKERS opcodes in its SASS (read once)."""
    if "90a-real" not in kernels.build_info():
        pytest.skip("library built without sm_90a (CMAKE_CUDA_ARCHITECTURES)")
    if kernel_resources.find_tool("nvdisasm") is None:
        pytest.skip("nvdisasm not found (pip install nvidia-cuda-nvdisasm)")
    return kernel_resources.sass_markers(lib, "sm_90a", exact=("LDG.E.64", "LDGSTS.E.64"))


def test_the_decode_merge_launches_early_on_hopper(sm90a_markers):
    """DIFFX_DECODE_PDL: on sm_90 every split-KV kernel lets the merge kernel launch as it starts
    (griddepcontrol.launch_dependents, PREEXIT) and every merge kernel waits for the splits' end
    (griddepcontrol.wait, ACQBULK) before it reads their parts; no other kernel does either."""
    split = {n: c for n, c in sm90a_markers.items() if "diff_attention_decode_kernel<" in n}
    merge = {n: c for n, c in sm90a_markers.items() if "diff_attention_decode_merge_kernel<" in n}
    assert len(split) == 52 and len(merge) == 6
    assert all(c["PREEXIT"] >= 1 and c["ACQBULK"] == 0 for c in split.values()), split
    assert all(c["ACQBULK"] >= 1 and c["PREEXIT"] == 0 for c in merge.values()), merge
    others = [n for n, c in sm90a_markers.items() if n not in split and n not in merge and c["PREEXIT"] + c["ACQBULK"]]
    assert not others, others


def test_hopper_path_is_tma_and_wgmma_without_spills(lib, sm90a_markers):
    if "sm90=1" not in kernels.build_info():
        pytest.skip("library built without the Hopper path (no sm_90a or no CUTLASS headers)")
    rows = [r for r in kernel_resources.resource_usage(lib) if "diff_attention_sm90_kernel" in r["kernel"]]
    assert {r["arch"] for r in rows} == {"sm_90a"}, "the Hopper kernels are compiled for sm_90a only"
    assert len(rows) == 16  # fp16/bf16 x D 64/128 x V1/V2 x fp/INT8 logits
    assert not [r for r in rows if r["stack"]], "the Hopper kernels spill"
    markers = sm90a_markers
    hopper = {name: counts for name, counts in markers.items() if "diff_attention_sm90_kernel" in name}
    assert len(hopper) == 16
    for name, counts in hopper.items():
        assert counts["HGMMA"] > 0 and counts["UTMALDG"] > 0 and counts["USETMAXREG"] > 0, (name, counts)
        assert counts["HMMA"] == 0 and counts["IMMA"] == 0, (name, "mma.sync in the wgmma kernel")
        int8 = ", true>" in name  # INT8 logits: S on s8 wgmma (IGMMA), P.V on HGMMA
        assert (counts["IGMMA"] > 0) == int8, (name, counts)
    one_pass = [c for n, c in markers.items() if "diff_attention_fwd_kernel" in n]
    assert one_pass and all(c["HGMMA"] == 0 and c["HMMA"] > 0 for c in one_pass)  # the check can tell them apart


def find_nvcc() -> str | None:
    """nvcc on PATH, else in $CUDA_HOME/bin (default /usr/local/cuda)."""
    cuda_bin = os.path.join(os.environ.get("CUDA_HOME", "/usr/local/cuda"), "bin")
    return shutil.which("nvcc") or shutil.which("nvcc", path=cuda_bin)


def cutlass_include() -> Path | None:
    """The pinned nvidia-cutlass wheel's headers (the kernels extra), as CMake finds them."""
    spec = importlib.util.find_spec("cutlass_library")
    include = Path(spec.origin).parent / "source" / "include" if spec and spec.origin else None
    return include if include and (include / "cute" / "tensor.hpp").is_file() else None


@pytest.mark.slow
def test_hopper_index_arithmetic_matches_cute_layouts(tmp_path):
    """The wgmma kernel cannot run here, but what it assumes of CuTe's layouts can be checked: the
    accumulator rows/columns its masks and epilogue compute, P converted in place as the P.V A
    operand, the transposed V view, the TMA byte counts, for all 8 instantiations."""
    nvcc = find_nvcc()
    include = cutlass_include()
    if nvcc is None or include is None:
        pytest.skip("needs nvcc and the CUTLASS headers (pip install -e '.[kernels]')")
    # The default build holds both tile widths: 128 keys in the fp shapes where three stages fit,
    # 64 in the others (V1 at d = 128, and every INT8 shape, whose P.V is the fp one), so the
    # -DDIFFX_SM90_KEY_BLOCK=64 variant's layouts are checked without a second compile (36 s here).
    exe = tmp_path / "layout_check"
    build = subprocess.run([nvcc, "-std=c++17", "--expt-relaxed-constexpr", "-isystem", str(include),
                            f"-I{KERNELS}", str(KERNELS / "hopper" / "layout_check.cu"), "-o", str(exe)],
                           capture_output=True, text=True, timeout=600)
    assert build.returncode == 0, build.stderr[-3000:]
    run = subprocess.run([str(exe)], capture_output=True, text=True, timeout=120)
    print(run.stdout)
    assert run.returncode == 0 and "all layout facts hold" in run.stdout, run.stdout[-3000:]
    # 8 shapes x fp/INT8 logits, and the 2 shapes both maps a warpgroup changes (bf16)
    assert run.stdout.count(" facts, shared storage ") == 18
    # 128-key tiles in the fp shapes where three stages fit (3 a dtype: all but V1 at d = 128)
    assert run.stdout.count("stages of 128 keys") == 6, run.stdout
    assert run.stdout.count("stages of 64 keys") == 12, run.stdout
    # both maps a warpgroup at head dim 64 (V1 and V2): 64-key tiles
    assert run.stdout.count("stages of 64 keys), both maps a warpgroup (128 rows)") == 2, run.stdout


# The Hopper-only variants the GPU campaign builds on the GPU machine (tools/README.md), and the
# default kernel (which auto runs on sm_90), with what their SASS must hold beside HGMMA.
# The value dims built at d = 64: V1's 128 (the timed shape), and V2's 64 where its schedule differs.
HOPPER_VARIANTS = {
    "default": ("", "UTMALDG.4D", (128,)),
    # K/V tiles loaded by TMA multicast into both CTAs of a cluster
    "cluster2": ("-DDIFFX_SM90_CLUSTER_M=2", "UTMALDG.4D.MULTICAST", (128,)),
    # both maps a warpgroup: four Q tiles of 64 rows (two row blocks x two maps), plain TMA loads;
    # V1 waits for P2.V before the next tile's S, V2 keeps it in flight (two schedules)
    "maps2": ("-DDIFFX_SM90_MAPS_PER_WARPGROUP=2", "UTMALDG.4D", (128, 64)),
}


@pytest.mark.slow
@pytest.mark.parametrize("variant", sorted(HOPPER_VARIANTS))
def test_the_hopper_variants_build_for_sm90a_without_spills_or_serialised_wgmma(tmp_path, variant):
    """The GPU campaign builds the Hopper-only variants on the GPU machine (tools/README.md, the
    first call), where a build that fails costs the lent machine's time; the default kernel is
    what every sm_90 user runs. Here, for the shape they
    are timed on (bf16, d = 64, fp logits: V1, and V2 where its schedule differs): each compiles for
    sm_90a with today's defaults, spills nothing, and ptxas keeps its wgmmas asynchronous. ptxas
    serialises every wgmma of a kernel (a "Potential Performance Loss" note, C7510-C7519) where it
    cannot prove a register safe: an input written while another wgmma runs, a wgmma pending
    across a loop's back edge, too few registers. Both maps a warpgroup met all three before its
    schedule was set (plugins/kernels/README.md), so that is checked, not trusted."""
    nvcc = find_nvcc()
    include, cuobjdump = cutlass_include(), kernel_resources.find_tool("cuobjdump")
    if nvcc is None or include is None or cuobjdump is None:
        pytest.skip("needs nvcc, cuobjdump and the CUTLASS headers (pip install -e '.[kernels]')")
    flag, loads, value_dims = HOPPER_VARIANTS[variant]
    unit = tmp_path / "sm90_bf16_d64_fp.cu"
    unit.write_text('#include "hopper/diff_attention_sm90.cuh"\n' + "".join(
        f"template cudaError_t diffx::launch_diff_attention_sm90<__nv_bfloat16, 64, {dv}, false>("
        "const diffx::KernelArgs&, cudaStream_t);\n" for dv in value_dims))
    cubin = tmp_path / f"{variant}.cubin"
    build = subprocess.run([nvcc, "-std=c++17", "-O3", "--expt-relaxed-constexpr", "-isystem", str(include),
                            f"-I{KERNELS}", "-DDIFFX_HAVE_SM90=1", '-DDIFFX_BUILD_ARCHS="90a-real"', *flag.split(),
                            "--generate-code=arch=compute_90a,code=[sm_90a]", "-Xptxas", "-v",
                            "-cubin", str(unit), "-o", str(cubin)], capture_output=True, text=True, timeout=600)
    assert build.returncode == 0, build.stderr[-3000:]
    ptxas = build.stdout + build.stderr
    assert "ptxas info    : Compile time" in ptxas  # -v spoke: its silence below counts
    assert not re.findall(r".*(?:Potential Performance Loss|warpgroup\.wait is injected).*", ptxas)
    rows = kernel_resources.resource_usage(cubin)
    assert len(rows) == len(value_dims) and all("diff_attention_sm90_kernel" in r["kernel"] for r in rows), rows
    assert not [r for r in rows if r["stack"]], rows
    sass = subprocess.run([cuobjdump, "-sass", str(cubin)], capture_output=True, text=True, check=True).stdout
    assert sass.count(loads) > 0 and sass.count("HGMMA") > 0


def loops_of(sass: str, function: str) -> list[list[str]]:
    """The instructions (predicates left out) of each loop (the code from a backward branch's target
    to the branch) of the SASS function whose mangled name contains `function` (cuobjdump -sass)."""
    [body] = [f for f in sass.split("Function : ")[1:] if function in f.split("\n", 1)[0]]
    code = [(int(m.group(1), 16), m.group(2).strip()) for m in re.finditer(r"/\*([0-9a-f]{4,})\*/\s+([^;/]*);", body)]
    loops = []
    for address, text in code:
        if (m := re.search(r"\bBRA (?:!?U?P\d, )?0x([0-9a-f]+)", text)) and int(m.group(1), 16) < address:
            start = int(m.group(1), 16)
            loops.append([re.sub(r"^@!?U?P\w+\s+", "", t) for a, t in code if start <= a <= address])
    return loops


def decode_sass_for_sm90a(tmp_path: Path, name: str, instances: list[str], *flags: str,
                          reloads: dict[str, int] | None = None) -> str:
    """The SASS of split-KV decode instantiations (each its template arguments) compiled for sm_90a with
    flags, after checking that no kernel spills; a skip without nvcc and cuobjdump. reloads: for the
    kernels whose mangled name holds a key, at most that many loop invariants kept in local memory
    instead: stored once before the loop (STL, none in a loop), loaded back in the loop with the mmas
    (LDL), no other spill traffic there."""
    nvcc, cuobjdump = find_nvcc(), kernel_resources.find_tool("cuobjdump")
    if nvcc is None or cuobjdump is None:
        pytest.skip("needs nvcc and cuobjdump")
    unit, cubin = tmp_path / f"{name}.cu", tmp_path / f"{name}.cubin"
    unit.write_text('#include "diff_attention_decode.cuh"\n' + "".join(
        f"template cudaError_t diffx::launch_diff_attention_decode<{args}>(const diffx::KernelArgs&, cudaStream_t);\n"
        for args in instances))
    build = subprocess.run([nvcc, "-std=c++17", "-O3", f"-I{KERNELS}", '-DDIFFX_BUILD_ARCHS="90a-real"', *flags,
                            "--generate-code=arch=compute_90a,code=[sm_90a]", "-cubin", str(unit), "-o", str(cubin)],
                           capture_output=True, text=True, timeout=600)
    assert build.returncode == 0, build.stderr[-3000:]
    rows = kernel_resources.resource_usage(cubin)
    sass = subprocess.run([cuobjdump, "-sass", str(cubin)], capture_output=True, text=True, check=True).stdout
    for row in [r for r in rows if r["stack"]]:
        allowed = max([n for key, n in (reloads or {}).items() if key in row["mangled"]], default=0)
        [body] = [f for f in sass.split("Function : ")[1:] if f.split("\n", 1)[0].strip() == row["mangled"]]
        loops = loops_of(sass, row["mangled"])
        main = [loop for loop in loops if any(i.startswith("HMMA") for i in loop)]
        assert allowed and row["stack"] <= 8 * allowed and len(main) == 1, row
        assert body.count("STL") <= allowed and not [i for loop in loops for i in loop if i.startswith("STL")], row
        assert sum(i.startswith("LDL") for i in main[0]) <= allowed, row
    return sass


@pytest.mark.slow
def test_the_warp_copies_variant_builds_for_sm90a_without_a_barrier_in_its_loop(tmp_path):
    """The campaign times packed maps with warp copies (-DDIFFX_DECODE_KV_PACK_MAPS=1
    -DDIFFX_DECODE_KV_WARP_COPIES=1, a library built on the CPU by tools/prepare_gpu_campaign.sh).
    Here, for the V1 int8 caches at d = 128 (the benchmark's shape, one CTA an SM) and d = 64 (capped
    at 128 registers for two): it compiles for sm_90a, the packed-maps kernel's main loop (the one
    with the mmas) holds no BAR.SYNC, and the 16-row kernel's beside it only barriers of 64 threads (a
    pair of warps), where without the flag it holds the CTA's. No spill at d = 128; at d = 64, since the
    key-mask flags travel with the keys (2026-12-01), ptxas keeps one loop invariant (a shared-memory
    address) of a kernel in local memory: one LDL a step of about 500-800 instructions, no store in
    the loop. The check allows that and no more."""
    sass = decode_sass_for_sm90a(tmp_path, "warpcopies", [f"{t}, {d}, {2 * d}, false, 1" for t, d in (
        ("__nv_bfloat16", 128), ("__half", 64))], "-DDIFFX_DECODE_KV_PACK_MAPS=1", "-DDIFFX_DECODE_KV_WARP_COPIES=1",
        reloads={"Li64ELi128E": 1})
    for t in ("13__nv_bfloat16Li128ELi256E", "6__halfLi64ELi128E"):
        # <T, D, DV, INT8 false, 3 stages, int8 cache, 2 tiles a step, packed maps or not>
        packed, plain = ([[i for i in loop if i.startswith("BAR")]
                          for loop in loops_of(sass, f"diff_attention_decode_kernelI{t}Lb0ELi3ELi1ELi2ELb{pm}E")
                          if any(i.startswith("HMMA") for i in loop)] for pm in (1, 0))
        assert len(packed) == 1 and len(plain) == 1, t
        assert packed == [[]], t
        assert plain[0] and all(re.fullmatch(r"BAR\.SYNC\S* R\d+, 0x40", i) for i in plain[0]), plain


def test_decode_kernels_copy_key_flags_with_their_keys(sm90a_markers):
    """DIFFX_DECODE_STAGED_FLAGS (default): in every split-KV decode kernel of the built library
    (sm_90a's SASS; the source is the same for every architecture), a key-masked step's flags come by
    cp.async with its keys (LDGSTS.E.64), and no flag is loaded in the step (no LDG.E.64: until
    2026-12-01 one a lane a step at head dim 128, one per score element at head dim 64)."""
    split = {n: c for n, c in sm90a_markers.items() if "diff_attention_decode_kernel<" in n}
    assert len(split) == 52
    assert all(c["LDGSTS.E.64"] >= 1 and c["LDG.E.64"] == 0 for c in split.values()), split
    one_pass = [c for n, c in sm90a_markers.items() if "diff_attention_fwd_kernel<" in n]
    assert one_pass and all(c["LDG.E.64"] >= 1 for c in one_pass)  # the count sees a flag load where there is one


@pytest.mark.slow
def test_the_loaded_flags_variant_builds_for_sm90a_with_one_flag_load_and_no_spill(tmp_path):
    """The campaign times DIFFX_DECODE_STAGED_FLAGS=0 as `maskloads` (a library built on the CPU by
    tools/prepare_gpu_campaign.sh): a masked step's flags loaded from global memory in the step, one
    load a lane, after Q.K^T at head dim 64. The head-dim-64 kernels (fp16; float, int8 and e4m3 caches,
    INT8 logits) compile for sm_90a without a spill at their two-CTA cap of 128 registers, each with
    one LDG.E.64 and no flag copy, where the default build has copies and no load."""
    instances = [f"__half, 64, {dv}, {args}" for dv in (128, 64) for args in ("false", "true", "false, 1", "false, 2")]
    counts = {}
    for flag in (0, 1):
        decode_sass_for_sm90a(tmp_path, f"flags_{flag}", instances, f"-DDIFFX_DECODE_STAGED_FLAGS={flag}")
        markers = kernel_resources.sass_markers(tmp_path / f"flags_{flag}.cubin", "sm_90a",
                                                exact=("LDG.E.64", "LDGSTS.E.64"))
        counts[flag] = {n: c for n, c in markers.items() if "diff_attention_decode_kernel<" in n}
    assert len(counts[0]) >= 10 and counts[0].keys() == counts[1].keys(), counts
    assert all(c["LDG.E.64"] == 1 and c["LDGSTS.E.64"] == 0 for c in counts[0].values()), counts[0]
    assert all(c["LDG.E.64"] == 0 and c["LDGSTS.E.64"] >= 1 for c in counts[1].values()), counts[1]


def test_the_fma_pipe_exponential_matches_exp2_within_its_bound(tmp_path):
    """hopper/exp2_fma.h (the exponentials DIFFX_SM90_EXP2_FMA_EVERY moves off MUFU), built for the
    host from the same header: relative error against exp2 in double precision below 4e-6 over
    [-126, 127], zeros below -126.5 and at -inf, NaN kept (hopper/exp2_fma_check.cpp)."""
    compiler = shutil.which("c++") or shutil.which("g++")
    if compiler is None:
        pytest.skip("needs a C++ compiler")
    exe = tmp_path / "exp2_fma_check"
    build = subprocess.run([compiler, "-std=c++17", "-O2", f"-I{KERNELS / 'hopper'}",
                            str(KERNELS / "hopper" / "exp2_fma_check.cpp"), "-o", str(exe)],
                           capture_output=True, text=True, timeout=300)
    assert build.returncode == 0, build.stderr[-3000:]
    run = subprocess.run([str(exe)], capture_output=True, text=True, timeout=120)
    assert run.returncode == 0 and run.stdout.endswith("result: ok\n"), run.stdout
    worst = float(re.search(r"max relative error (\S+) at", run.stdout).group(1))
    assert 1e-7 < worst < 4e-6, run.stdout  # the degree-4 fit's 2.6e-6, not an exact exp2 by accident
    assert "non-zero results below -126.5 or at -inf: 0\n" in run.stdout and "NaN in, NaN out: yes" in run.stdout


def test_campaign_preparation_refuses_what_is_not_a_commit_before_writing():
    """tools/prepare_gpu_campaign.sh checks its commit before it touches the carried folders: a name
    that is no commit here is one line, exit 2, and build-cutlass/build-before stay as they were."""
    root = KERNELS.parent.parent
    before = {name: (root / name).exists() and sorted(p.name for p in (root / name).iterdir())
              for name in ("build-cutlass", "build-before", "build-variants")}
    out = subprocess.run(["bash", str(root / "tools" / "prepare_gpu_campaign.sh"), "no-such-commit-0123"],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 2 and out.stdout == ""
    assert out.stderr == "error: no-such-commit-0123 is not a commit here\n"
    # A variant without its flags, the same (before the CUTLASS headers are copied).
    out = subprocess.run(["bash", str(root / "tools" / "prepare_gpu_campaign.sh"), "HEAD"], capture_output=True,
                         text=True, timeout=60, env=dict(os.environ, PREPARE_VARIANTS="kvtiles1"))
    assert out.returncode == 2 and out.stdout == ""
    assert out.stderr == "error: PREPARE_VARIANTS takes name:flags, not 'kvtiles1'\n"
    # A variant named twice, the same (its folder would be built twice and timed once).
    out = subprocess.run(["bash", str(root / "tools" / "prepare_gpu_campaign.sh"), "HEAD"], capture_output=True,
                         text=True, timeout=60, env=dict(os.environ, PREPARE_VARIANTS="v1:-DX=1 v2:-DX=2 v1:-DX=3"))
    assert out.returncode == 2 and out.stdout == ""
    assert out.stderr == "error: PREPARE_VARIANTS names 'v1' twice\n"
    assert before == {name: (root / name).exists() and sorted(p.name for p in (root / name).iterdir())
                      for name in ("build-cutlass", "build-before", "build-variants")}


def test_campaign_preparation_keeps_a_build_of_the_same_kernel_inputs(tmp_path):
    """tools/prepare_gpu_campaign.sh builds a library only where its folder holds none made from the
    same kernel inputs (the commit's plugins/ but its Markdown and the CPU emulator, and CMakeLists.txt, architecture,
    flags, nvcc, CUTLASS),
    and packs the CUTLASS headers only when they changed: a second run keeps every folder, new flags
    rebuild that variant alone, a broken packed library is rebuilt, and PREPARE_REBUILD=1 rebuilds all.
    Run in a clone, with cmake and nvcc stand-ins that log their builds and write a stand-in library
    (the real build takes minutes)."""
    if importlib.util.find_spec("cutlass_library") is None:
        pytest.skip("nvidia-cutlass not installed (pip install -e '.[kernels]')")
    if shutil.which("git") is None or shutil.which("xz") is None:
        pytest.skip("git and xz are needed")
    root = KERNELS.parent.parent
    checkout = tmp_path / "checkout"
    subprocess.run(["git", "clone", "--quiet", str(root), str(checkout)], check=True, timeout=120)
    script = checkout / "tools" / "prepare_gpu_campaign.sh"
    script.write_text((root / "tools" / "prepare_gpu_campaign.sh").read_text())  # this tree's script
    stubs = tmp_path / "stubs"
    stubs.mkdir()
    log = tmp_path / "builds.log"
    (stubs / "cmake").write_text(
        "#!/bin/sh\n"
        f'if [ "$1" = --build ]; then echo "$2" >> {log}; mkdir -p "$2/plugins/kernels"; '
        'echo "library of $2" > "$2/plugins/kernels/libdiffexport_kernels.so"; fi\n')
    (stubs / "nvcc").write_text("#!/bin/sh\necho 'nvcc stand-in, release 13.0'\n")
    for stub in stubs.iterdir():
        stub.chmod(0o755)
    env = dict(os.environ, PATH=f"{stubs}:{os.environ['PATH']}", TMPDIR=str(tmp_path))

    def prepare(variants, **extra):
        out = subprocess.run(["bash", str(script), "HEAD"], capture_output=True, text=True, timeout=300,
                             env={**env, "PREPARE_VARIANTS": variants, **extra}, stdin=subprocess.DEVNULL)
        assert out.returncode == 0, out.stdout + out.stderr
        return out.stdout

    def builds():
        return len(log.read_text().splitlines()) if log.exists() else 0

    first = prepare("tiles1:-DDIFFX_DECODE_KV_TILES=1")
    assert builds() == 2 and "kept" not in first
    tiles1 = checkout / "build-variants" / "tiles1"  # the variants in one carried folder
    assert (tiles1 / "INPUTS").read_text() != (checkout / "build-before" / "INPUTS").read_text()
    assert 'carry=["build-carry", "build-before", "build-variants"]' in first
    assert "tiles1=build-variants/tiles1/libdiffexport_kernels.so" in first
    again = prepare("tiles1:-DDIFFX_DECODE_KV_TILES=1")
    assert builds() == 2, again  # nothing built
    head = subprocess.run(["git", "-C", str(checkout), "rev-parse", "--short=7", "HEAD"], capture_output=True,
                          text=True, check=True).stdout.strip()
    assert f"build-before            kept: built from the same kernel inputs (HEAD {head})" in again
    assert "build-variants/tiles1   kept" in again
    assert "build-carry             kept: the same CUTLASS headers" in again  # not packed again
    prepare("tiles1:-DDIFFX_DECODE_KV_TILES=1,-DDIFFX_DECODE_KV_STAGES=2")  # new flags: that variant alone
    assert builds() == 3
    # A second variant is built beside it; one no longer named is removed, not carried.
    prepare("tiles1:-DDIFFX_DECODE_KV_TILES=1,-DDIFFX_DECODE_KV_STAGES=2 s8:-DDIFFX_DECODE_KV_S8_QK=1")
    assert builds() == 4 and sorted(p.name for p in tiles1.parent.iterdir()) == ["s8", "tiles1"]
    dropped = prepare("s8:-DDIFFX_DECODE_KV_S8_QK=1")
    assert builds() == 4 and "build-variants/tiles1   removed: not a variant of PREPARE_VARIANTS" in dropped
    assert [p.name for p in tiles1.parent.iterdir()] == ["s8"]
    # build-variants as a link is replaced by a folder of its own; the link's target is not written.
    shutil.move(tiles1.parent, tmp_path / "variants-elsewhere")
    tiles1.parent.symlink_to(tmp_path / "variants-elsewhere")
    prepare("s8:-DDIFFX_DECODE_KV_S8_QK=1")
    assert builds() == 5 and not tiles1.parent.is_symlink() and (tiles1.parent / "s8" / "INPUTS").is_file()
    assert [p.name for p in (tmp_path / "variants-elsewhere").iterdir()] == ["s8"]
    shutil.rmtree(tiles1.parent / "s8")
    (tiles1.parent / "s8").write_text("a file where its folder was")
    assert "build-variants/s8       removed: not a folder of its own" in prepare("s8:-DDIFFX_DECODE_KV_S8_QK=1")
    assert builds() == 6 and (tiles1.parent / "s8" / "INPUTS").is_file()
    assert 'carry=["build-carry", "build-before"]' in prepare(" ") and not tiles1.parent.exists()
    (checkout / "build-before" / "libdiffexport_kernels.so.xz").write_bytes(b"\xfd7zXZ\x00 cut short")
    prepare("")  # a packed library that is no longer whole is built again
    assert builds() == 7

    def commit(path, text):
        (checkout / path).write_text((checkout / path).read_text() + text)
        subprocess.run(["git", "-C", str(checkout), "commit", "--quiet", "-am", "an edit", "--author", "t <t@t>"],
                       check=True, timeout=60, env={**env, "GIT_COMMITTER_NAME": "t", "GIT_COMMITTER_EMAIL": "t@t"})

    commit("plugins/kernels/README.md", "\nA line of prose.\n")  # no kernel input: the build is kept
    assert "build-before            kept" in prepare("") and builds() == 7
    commit("plugins/kernels/emulation/fibers.h", "\n// a comment\n")  # the CPU emulator: no library input
    assert "build-before            kept" in prepare("") and builds() == 7
    commit("plugins/kernels/diff_attention.h", "\n// a comment\n")  # a kernel input: built again
    prepare("")
    assert builds() == 8
    # A folder that is a link, even to a current copy, is never kept, and its target is not written.
    copy = tmp_path / "elsewhere"
    shutil.copytree(checkout / "build-before", copy)
    kept_bytes = {f.name: f.read_bytes() for f in copy.iterdir()}
    shutil.rmtree(checkout / "build-before")
    (checkout / "build-before").symlink_to(copy)
    prepare("")
    assert builds() == 9 and not (checkout / "build-before").is_symlink()
    assert {f.name: f.read_bytes() for f in copy.iterdir()} == kept_bytes
    prepare("", PREPARE_REBUILD="1")
    assert builds() == 10
    assert not list(tmp_path.glob("diffexport-build-*"))  # no worktree left behind
