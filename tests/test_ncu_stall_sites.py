"""tools/ncu_stall_sites.py condenses Nsight Compute's per-instruction warp-state samples (its source
page as CSV) into the section profile.txt gets. Checked on exports made here in the layout ncu writes
(a "Kernel Name" row per launch, an "Address","Source" header, one row per SASS instruction), with
counts whose shares are worked out by hand below."""

import csv
import io
import re
import subprocess
import sys
from pathlib import Path

import pytest

from diffexport.kernel import kernels

ROOT = Path(__file__).resolve().parent.parent
TOOL = ROOT / "tools" / "ncu_stall_sites.py"
KERNEL_SOURCES = ROOT / "plugins" / "kernels"
sys.path.insert(0, str(ROOT / "tools"))
import ncu_stall_sites  # noqa: E402
from kernel_resources import find_tool  # noqa: E402
from ncu_stall_sites import cubin_functions, library_functions  # noqa: E402

DECODE_BF16_D128 = "diff_attention_decode_kernelI13__nv_bfloat16Li128ELi256E"  # mangled: the symbols' own names
HEADER = ["Address", "Source", "Warp Stall Sampling (All Samples)", "Warp Stall Sampling (Not-issued Samples)",
          "Instructions Executed", "Thread Instructions Executed", "stall_barrier", "stall_long_sb", "stall_math",
          "stall_selected", "stall_barrier_not_issued"]
MERGE = [("0x7f0000000000", "LDG.E R2, desc[UR4][R2.64]", 90, 80, 10, 320, 0, 90, 0, 0, 0)]
# 400 samples: the barrier 200 (50%), long_sb 120 (30%), math 60 (15%), selected 20 (5%).
SPLIT = [("0x7f0000001000", "BAR.SYNC.DEFER_BLOCKING 0x0", 180, 178, 50, 1600, 180, 0, 0, 0, 999),
         ("0x7f0000001010", "@!P0 BAR.SYNC.DEFER_BLOCKING 0x1", 20, 20, 50, 1600, 20, 0, 0, 0, 999),
         ("0x7f0000001020", "HMMA.16816.F32 R4, R8, R12, R4", 60, 40, 400, 12800, 0, 0, 60, 0, 0),
         ("0x7f0000001030", "LDGSTS.E.BYPASS.128 [R3], desc[UR6][R6.64]", 120, 100, 100, 3200, 0, 120, 0, 0, 0),
         ("0x7f0000001040", "PRMT R5, R5, 0x7604, R9", 20, 0, 400, 12800, 0, 0, 0, 20, 0),
         ("0x7f0000001050", "EXIT", 0, 0, 0, 0, 0, 0, 0, 0, 0)]


def export(*launches) -> str:
    out = io.StringIO()
    writer = csv.writer(out, quoting=csv.QUOTE_ALL)
    for name, rows in launches:
        writer.writerow(["Kernel Name", name])
        writer.writerow(HEADER)
        writer.writerows(rows)
    return out.getvalue()


def run(text: str, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(TOOL), "-", *args], input=text, capture_output=True, text=True,
                          timeout=60)


def test_the_split_kernels_samples_by_reason_opcode_and_instruction():
    text = export(("void diff_attention_decode_merge_kernel(KernelArgs)", MERGE),
                  ("void diff_attention_decode_kernel<__half, 128>(KernelArgs)", SPLIT))
    out = run(text, "--kernel", "diff_attention_decode_kernel", "--title", "split-KV decode kernel, Sq=1", "--top", "3")
    assert out.returncode == 0, out.stderr
    lines = out.stdout.splitlines()
    assert lines[0] == "--- where the warps wait, split-KV decode kernel, Sq=1"
    assert lines[1] == "kernel: void diff_attention_decode_kernel<__half, 128>(KernelArgs)"  # not the merge kernel
    # 400 samples at 5 of 6 instructions; not issued 338 = 84.5%, printed rounded; 1,000 executed.
    assert lines[2] == "samples: 400 at 5 of 6 instructions (not issued 338, 84%); warp instructions executed 1,000"
    # the not-issued variant of a reason is not a reason of its own
    assert lines[3] == "by reason (share of samples): barrier 50.0%, long_sb 30.0%, math 15.0%, selected 5.0%"
    # BAR: 200 of 400 samples, 100 of 1,000 executed; predicates and modifiers dropped.
    assert lines[4] == ("by opcode (share of samples | of executed): BAR 50.0% | 10.0%, LDGSTS 30.0% | 10.0%, "
                        "HMMA 15.0% | 40.0%, PRMT 5.0% | 40.0%")
    assert lines[5].startswith("top instructions")
    top = lines[6:]
    assert len(top) == 3
    # offsets from the kernel's first instruction, as cuobjdump -sass prints them
    assert top[0].split()[:3] == ["45.0%", "/*00000*/", "BAR.SYNC.DEFER_BLOCKING"]
    assert top[0].endswith("barrier 45.0%  executed 50")
    assert "long_sb 30.0%" in top[1] and "/*00030*/  LDGSTS" in top[1] and "/*00020*/  HMMA" in top[2]


def test_a_kernel_profiled_twice_reads_its_first_launch_and_says_so():
    text = export(("void diff_attention_decode_kernel<a>()", SPLIT), ("void diff_attention_decode_kernel<b>()", MERGE))
    out = run(text, "--kernel", "decode_kernel", "--title", "t")
    assert out.returncode == 0, out.stderr
    assert out.stdout.splitlines()[1] == "kernel: void diff_attention_decode_kernel<a>() (the first of 2 launches)"


def test_what_the_export_lacks_is_said_not_guessed():
    rows = [r[:2] + r[4:5] for r in SPLIT]  # no sampling columns at all: SourceCounters not collected
    out_io = io.StringIO()
    writer = csv.writer(out_io, quoting=csv.QUOTE_ALL)
    writer.writerow(["Address", "Source", "Instructions Executed"])  # one launch, no "Kernel Name" row
    writer.writerows(rows)
    out = run(out_io.getvalue(), "--title", "t")
    assert out.returncode == 0, out.stderr
    assert out.stdout.splitlines()[1:] == [
        "kernel: (not named in the export)",
        "not in the export: Warp Stall Sampling (All Samples), Warp Stall Sampling (Not-issued Samples), "
        "stall_<reason>",
        "columns in the export: Address, Source, Instructions Executed",  # to read another layout next time
        "no warp-state samples (was the SourceCounters section collected?)"]
    other = export(("void other_kernel()", SPLIT))
    none = run(other, "--kernel", "diff_attention_sm90", "--title", "Hopper path")
    assert none.returncode == 1
    first_lines = [line for line in other.splitlines() if line.strip()][:3]
    assert none.stdout == ("--- where the warps wait, Hopper path\n"
                           "no launch of a kernel matching 'diff_attention_sm90' in the export\n"
                           "kernels in the export: void other_kernel()\n"
                           + "".join(f"export line {n}: {line}\n" for n, line in enumerate(first_lines, 1)))


def test_a_huge_export_is_refused_unparsed(tmp_path, monkeypatch, capsys):
    """Past its bound (256 MB; lowered here) the export is one error line, exit 2, nothing printed."""
    monkeypatch.setattr(ncu_stall_sites, "MAX_INPUT_BYTES", 1000)
    big = tmp_path / "source.csv"
    big.write_text(export(("k", SPLIT * 20)))
    assert ncu_stall_sites.main([str(big), "--title", "t"]) == 2
    out = capsys.readouterr()
    assert out.out == "" and out.err == f"error: {big}: more than 0 MB, not a source page of one launch\n"


def test_what_is_no_export_is_said_so(tmp_path, capsys):
    """Bytes of another kind (a binary) read as an export holding no launch; CSV with NUL bytes and an
    unclosed quote, under a header without the sampling columns, as a launch whose columns are missing."""
    path = tmp_path / "source.csv"
    path.write_bytes(bytes(range(256)) * 40)
    code = ncu_stall_sites.main([str(path), "--kernel", "decode", "--title", "t"])
    out = capsys.readouterr()
    assert code == 1 and out.err == ""
    lines = out.out.splitlines()
    assert lines[1:3] == ["no launch of a kernel matching 'decode' in the export", "kernels in the export: none"]
    # the bytes are quoted as printable ASCII, each line cut at 800 characters
    assert lines[3].startswith("export line 1: ") and len(lines) <= 6
    assert all(" " <= c <= "~" for line in lines[3:] for c in line)
    assert all(len(line) <= len("export line 1: ") + 800 + 4 for line in lines[3:])
    path.write_bytes(b'Address,Source\n0x1,\x00BAR\n"unclosed')
    code = ncu_stall_sites.main([str(path), "--kernel", "decode", "--title", "t"])
    out = capsys.readouterr()
    assert code == 0 and out.err == ""
    assert out.out.splitlines()[2].startswith("not in the export: Warp Stall Sampling (All Samples)")
    assert out.out.splitlines()[3] == "columns in the export: Address, Source"
    assert out.out.splitlines()[-1] == "no warp-state samples (was the SourceCounters section collected?)"


def test_a_cubin_that_is_not_one_holds_no_function():
    """The symbol-table reader takes bytes of any kind: not an ELF, a header alone, tables past the end."""
    real_header = b"\x7fELF\x02\x01" + bytes(58)
    broken = bytearray(real_header)
    broken[0x28:0x30] = (1 << 40).to_bytes(8, "little")  # section headers far past the end
    broken[0x3A:0x3E] = (64).to_bytes(2, "little") + (3).to_bytes(2, "little")
    for data in (b"", b"not an elf", real_header, bytes(broken), b"\x7fELF" + bytes(4000)):
        assert cubin_functions(data) == {}


def test_a_bad_input_is_one_error_line(tmp_path):
    missing = subprocess.run([sys.executable, str(TOOL), str(tmp_path / "none.csv"), "--title", "t"],
                             capture_output=True, text=True, timeout=60)
    assert missing.returncode == 2 and missing.stderr.startswith("error: ") and missing.stderr.count("\n") == 1
    pattern = run(export(("k", SPLIT)), "--kernel", "(", "--title", "t")
    assert pattern.returncode == 2 and pattern.stderr.startswith("error: ") and pattern.stdout == ""


def test_an_export_without_kernel_names_reads_its_launches_apart():
    """Without the "Kernel Name" rows, each header opens a launch: the first (the split kernel, which
    runs before the merge) is read, not the two summed, and the name is said to be missing."""
    text = export(("split", SPLIT), ("merge", MERGE))
    text = "\n".join(x for x in text.splitlines() if not x.startswith('"Kernel Name"')) + "\n"
    out = run(text, "--kernel", "diff_attention_decode_kernel", "--title", "t")
    assert out.returncode == 0, out.stderr
    lines = out.stdout.splitlines()
    assert lines[1] == "kernel: (not named in the export) (the first of 2 launches)"
    assert lines[2].startswith("samples: 400 at 5 of 6 instructions")


@pytest.fixture(scope="module")
def decode_kernel():
    """The bf16 d = 128 decode kernels of the built library, disassembled with line information by the
    tool (the toolchain's real output); the largest of them."""
    path = kernels.library_path()
    if path is None:
        pytest.skip(f"kernel library not built: {kernels.BUILD_HINT}")
    if find_tool("cuobjdump") is None or find_tool("nvdisasm") is None:
        pytest.skip("cuobjdump or nvdisasm not found (pip install -e '.[kernels]')")
    functions = library_functions(str(path), DECODE_BF16_D128, "sm_90a")
    if not functions:
        pytest.skip("the library has no sm_90a decode kernels")
    name = max(functions, key=lambda n: len(functions[n]))
    return path, name, functions[name]


def barrier_samples_export(name: str, body, opcodes=None, extra=()) -> str:
    """An export of one launch of that kernel whose only samples are 10 at each barrier (BAR); opcodes
    (offset -> opcode) replaces some, extra adds instructions past its end."""
    opcodes = opcodes or {}
    rows = [(f"0x{0x7f0000000000 + x.offset:x}", f"{opcodes.get(x.offset, x.opcode)} ;",
             *([10] * 3 if x.opcode == "BAR" else [0] * 3), 0, *([10] if x.opcode == "BAR" else [0]), 0, 0, 0, 0)
            for x in body if x.offset not in opcodes or opcodes[x.offset]]
    rows += [(f"0x{0x7f0000000000 + offset:x}", "FFMA R0, R1, R2, R3 ;", 0, 0, 5, 0, 0, 0, 0, 0, 0) for offset in extra]
    return export((name, rows))


def test_samples_per_source_line_land_on_the_statements_that_compiled_to_them(decode_kernel, tmp_path):
    """Every barrier's samples go to a line that is a __syncthreads() (read here from the source, not
    from the tool): an off-by-one in the offsets or the wrong one of nvdisasm's two line records
    where inlined code starts would put them on other statements."""
    lib, name, body = decode_kernel
    bars = sum(x.opcode == "BAR" for x in body)
    assert bars >= 4
    export_file = tmp_path / "source.csv"
    export_file.write_text(barrier_samples_export(name, body))
    out = subprocess.run([sys.executable, str(TOOL), str(export_file), "--kernel", DECODE_BF16_D128, "--title", "t",
                          "--library", str(lib), "--top", "3"], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    lines = out.stdout.splitlines()
    assert f"source lines: the library's {name} (100.0% of the opcodes agree)" in lines
    start = lines.index(next(x for x in lines if x.startswith("by source line")))
    entries = [x for x in lines[start + 1:] if x.startswith("  ")]
    assert entries, out.stdout
    shares = []
    for entry in entries:
        share, chain = re.match(r"\s+([\d.]+)%\s+(\S+(?: > \S+)*)", entry).groups()
        shares.append(float(share))
        file, line = chain.split(" > ")[-1].rsplit(":", 1)  # the innermost line of the chain
        source = next(KERNEL_SOURCES.rglob(file)).read_text().splitlines()[int(line) - 1]
        assert "__syncthreads()" in source, (entry, source)
        assert "barrier" in entry
    assert sum(shares) == pytest.approx(100.0, abs=0.1 * len(shares)) or len(entries) == 10


def test_a_launch_of_another_build_is_placed_on_no_line(decode_kernel, tmp_path):
    """One opcode in 25 not the library's (a build of other source or flags): no function is named and
    no line gets the samples."""
    lib, name, body = decode_kernel
    export_file = tmp_path / "source.csv"
    export_file.write_text(barrier_samples_export(name, body, {x.offset: "XMAD" for x in body[::25]}))
    out = subprocess.run([sys.executable, str(TOOL), str(export_file), "--kernel", DECODE_BF16_D128, "--title", "t",
                          "--library", str(lib)], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    assert re.search(r"^source lines: none of the library's \d+ functions matching the kernel has its instruction "
                     r"sequence \(another build\?\)$", out.stdout, re.M), out.stdout
    assert "by source line" not in out.stdout


def test_a_listing_without_the_padding_and_with_subroutines_still_matches(decode_kernel, tmp_path):
    """The profiler may leave out the kernel's trailing NOPs and branch, and list subroutines it calls
    past its end: the kernel is still found, every opcode of what both list agreeing."""
    lib, name, body = decode_kernel
    tail = []
    for x in reversed(body):
        if x.opcode not in ("NOP", "BRA"):
            break
        tail.append(x.offset)
    assert tail, "the kernel ends with padding"
    end = body[-1].offset + 16
    export_file = tmp_path / "source.csv"
    export_file.write_text(barrier_samples_export(name, body, {offset: "" for offset in tail},
                                                  extra=range(end + 4096, end + 4096 + 100 * 16, 16)))
    out = subprocess.run([sys.executable, str(TOOL), str(export_file), "--kernel", DECODE_BF16_D128, "--title", "t",
                          "--library", str(lib)], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    assert f"source lines: the library's {name} (100.0% of the opcodes agree)" in out.stdout, out.stdout


def test_every_instruction_is_placed_inside_the_kernel_it_was_inlined_into(decode_kernel):
    """nvdisasm writes one line record per inlining level; stitched together, an instruction's
    outermost line is a statement of the decode kernel's own body (a chain cut short would end in a
    helper, e.g. the softmax's exponent in diff_attention_fwd.cuh), and the exponent of the online
    softmax keeps all three levels: the kernel's call, the softmax's line, the ex2 wrapper. ptxas
    leaves a few instructions a helper's line without its caller (0.1% of this kernel, 2026-11-29;
    up to 16% in the float-cache kernels, at the shared tile loaders): those stay the helper's."""
    _, _, body = decode_kernel
    source = (KERNEL_SOURCES / "diff_attention_decode.cuh").read_text().splitlines()
    first = next(i for i, x in enumerate(source) if "diff_attention_decode_kernel(const KernelArgs args) {" in x) + 1
    last = next(i for i, x in enumerate(source) if "diff_attention_decode_merge_kernel(" in x) + 1
    outer = [(Path(x.frames[-1][0]).name, x.frames[-1][1]) for x in body if x.frames]
    inside = [name == "diff_attention_decode.cuh" and first - 2 <= line < last for name, line in outer]
    assert len(outer) == len(body) and sum(inside) >= 0.97 * len(body), (len(body), sum(inside))
    # (the loop in turn and the overlapped loop each call it: any of those lines)
    softmax_calls = {("diff_attention_decode.cuh", i + 1) for i, x in enumerate(source)
                     if "online_softmax_step(s, acc_o" in x}
    exp = [[(Path(f).name, n) for f, n in reversed(x.frames)] for x in body if x.opcode == "MUFU"]
    assert any(chain[0] in softmax_calls and len(chain) == 3
               and chain[1][0] == "diff_attention_fwd.cuh" and chain[2][0] == "ptx.cuh" for chain in exp), exp
