"""tools/ncu_stall_sites.py condenses Nsight Compute's per-instruction warp-state samples (its source
page as CSV) into the section profile.txt gets. Checked on exports made here in the layout ncu writes
(a "Kernel Name" row per launch, an "Address","Source" header, one row per SASS instruction), with
counts whose shares are worked out by hand below."""

import csv
import io
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
TOOL = ROOT / "tools" / "ncu_stall_sites.py"
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
        "no warp-state samples (was the SourceCounters section collected?)"]
    none = run(export(("void other_kernel()", SPLIT)), "--kernel", "diff_attention_sm90", "--title", "Hopper path")
    assert none.returncode == 1
    assert none.stdout == ("--- where the warps wait, Hopper path\n"
                           "no launch of a kernel matching 'diff_attention_sm90' in the export\n")


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
