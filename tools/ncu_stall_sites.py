"""Where a profiled kernel's warps wait: Nsight Compute's per-instruction warp-state samples, condensed.

    ncu --import R.ncu-rep --page source --csv --print-source sass | python tools/ncu_stall_sites.py - \
        --kernel diff_attention_decode_kernel --title "split-KV decode kernel, Sq=1, 32768 keys"

`--set full` samples every warp's state at a fixed interval (the SourceCounters section) and files
each sample under the SASS instruction the warp was at and the reason it could not issue. The raw
page gives those reasons summed over the kernel; this gives them per instruction, which is what
says whether a loop waits at its barrier, at a copy's arrival, on the tensor pipe or on the
exponentials. gpu_campaign.sh runs it on the GPU machine for each profiled launch and appends the
section to profile.txt (the report itself stays there); campaign_report.py reads it back.

Input: ncu's source page as CSV, one block per profiled launch, each opened by a "Kernel Name" row,
then a header row starting "Address","Source" and one row per instruction. The columns read are
"Warp Stall Sampling (All Samples)", "... (Not-issued Samples)", "Instructions Executed" and one
"stall_<reason>" column per reason; a column missing from the export is reported as missing.
"""

from __future__ import annotations

import argparse
import csv
import io
import re
import sys
from collections import Counter
from dataclasses import dataclass, field

SECTION_PREFIX = "where the warps wait, "  # campaign_report.py finds the sections by it
ALL_SAMPLES = "Warp Stall Sampling (All Samples)"
NOT_ISSUED = "Warp Stall Sampling (Not-issued Samples)"
EXECUTED = "Instructions Executed"
UNNAMED = "(not named in the export)"  # such a launch matches any --kernel, and says so
MAX_INPUT_BYTES = 256 << 20  # a source page of a few thousand instructions is a few MB


@dataclass
class Instruction:
    address: int
    sass: str
    samples: float
    not_issued: float
    executed: float
    reasons: dict[str, float]

    @property
    def opcode(self) -> str:
        """The base opcode (BAR, HMMA, LDGSTS ...), its predicate and modifiers dropped."""
        words = self.sass.split()
        words = words[1:] if words and words[0].startswith("@") else words
        return words[0].split(".")[0] if words else "?"


@dataclass
class Launch:
    kernel: str
    instructions: list[Instruction] = field(default_factory=list)
    missing: list[str] = field(default_factory=list)


def _number(text: str) -> float:
    text = text.strip().replace(",", "")
    return float(text) if text else 0.0


def _reason(column: str) -> str | None:
    """'stall_long_sb' -> 'long_sb'; None for the not-issued variants and other columns."""
    low = column.lower()
    if "stall_" not in low or re.search(r"not[ _-]issued", low):
        return None
    return low.rsplit("stall_", 1)[1].strip() or None


def parse(text: str) -> list[Launch]:
    """Every launch block of ncu's source-page CSV, in order."""
    launches: list[Launch] = []
    header: list[str] | None = None
    named = False  # a "Kernel Name" row opened the launch that the next header belongs to
    for row in csv.reader(io.StringIO(text)):
        if not row:
            continue
        first = row[0].strip()
        if first == "Kernel Name":
            launches.append(Launch(row[1].strip() if len(row) > 1 else UNNAMED))
            header, named = None, True
        elif first == "Address":
            header = [name.strip() for name in row]
            if not named:  # an export without the name rows: each header opens a launch of its own
                launches.append(Launch(UNNAMED))
            named = False
            launches[-1].missing = [name for name in (ALL_SAMPLES, NOT_ISSUED, EXECUTED) if name not in header]
            if not any(_reason(name) for name in header):
                launches[-1].missing.append("stall_<reason>")
        elif header is not None and len(row) == len(header):
            cells = dict(zip(header, row))
            try:
                address = int(first, 16)
                values = {name: _number(cells[name]) for name in (ALL_SAMPLES, NOT_ISSUED, EXECUTED) if name in cells}
                reasons = {r: _number(value) for name, value in cells.items() if (r := _reason(name))}
            except ValueError:
                continue  # a row that is not an instruction (a file or function line)
            launches[-1].instructions.append(Instruction(
                address, cells.get("Source", "").strip(), values.get(ALL_SAMPLES, 0.0),
                values.get(NOT_ISSUED, 0.0), values.get(EXECUTED, 0.0), reasons))
    return launches


def _shares(counter: Counter, total: float, top: int) -> str:
    return ", ".join(f"{name} {100 * value / total:.1f}%" for name, value in counter.most_common(top) if value)


def summary(launch: Launch, title: str, top: int = 12, launches_matched: int = 1) -> list[str]:
    """The section profile.txt gets: totals, samples by reason and by opcode, the top instructions."""
    lines = [f"--- {SECTION_PREFIX}{title}",
             f"kernel: {launch.kernel}" + (f" (the first of {launches_matched} launches)" if launches_matched > 1
                                           else "")]
    if launch.missing:
        lines.append("not in the export: " + ", ".join(launch.missing))
    ins = launch.instructions
    samples = sum(i.samples for i in ins)
    executed = sum(i.executed for i in ins)
    if not ins or samples <= 0:
        return lines + ["no warp-state samples (was the SourceCounters section collected?)"]
    not_issued = sum(i.not_issued for i in ins)
    lines.append(f"samples: {samples:,.0f} at {sum(i.samples > 0 for i in ins)} of {len(ins)} instructions "
                 f"(not issued {not_issued:,.0f}, {100 * not_issued / samples:.0f}%); "
                 f"warp instructions executed {executed:,.0f}")
    reasons: Counter = Counter()
    for i in ins:
        reasons.update(i.reasons)
    lines.append("by reason (share of samples): " + (_shares(reasons, samples, 8) or "none"))
    by_op: Counter = Counter()
    run_op: Counter = Counter()
    for i in ins:
        by_op[i.opcode] += i.samples
        run_op[i.opcode] += i.executed
    lines.append("by opcode (share of samples | of executed): " + ", ".join(
        f"{op} {100 * value / samples:.1f}% | {100 * run_op[op] / executed if executed else 0:.1f}%"
        for op, value in by_op.most_common(10) if value))
    # Offsets from the kernel's first instruction, as cuobjdump -sass numbers them (the library's SASS
    # can be read beside this on a machine without a GPU).
    start = min(i.address for i in ins)
    lines.append("top instructions (share of samples, offset in the kernel, SASS, its top reasons, executed):")
    for i in sorted(ins, key=lambda x: -x.samples)[:top]:
        if i.samples <= 0:
            break
        why = _shares(Counter(i.reasons), samples, 3)
        lines.append(f"  {100 * i.samples / samples:5.1f}%  /*{i.address - start:05x}*/  {i.sass[:60]:<60s}  "
                     f"{why or '-'}  executed {i.executed:,.0f}")
    return lines


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("csv", help="ncu's source page as CSV, or - for stdin")
    parser.add_argument("--kernel", default="", help="a regular expression the launch's kernel name must match")
    parser.add_argument("--title", required=True, help="the launch's section title in profile.txt")
    parser.add_argument("--top", type=int, default=12, help="instructions listed (default 12)")
    args = parser.parse_args(argv)
    try:
        if args.csv == "-":
            text = sys.stdin.read(MAX_INPUT_BYTES + 1)
        else:
            with open(args.csv, encoding="utf-8", errors="replace") as source:
                text = source.read(MAX_INPUT_BYTES + 1)
        pattern = re.compile(args.kernel)
    except (OSError, re.error) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    if len(text) > MAX_INPUT_BYTES:
        print(f"error: {args.csv}: more than {MAX_INPUT_BYTES >> 20} MB, not a source page of one launch",
              file=sys.stderr)
        return 2
    matched = [launch for launch in parse(text) if launch.kernel == UNNAMED or pattern.search(launch.kernel)]
    if not matched:
        print(f"--- {SECTION_PREFIX}{args.title}\nno launch of a kernel matching {args.kernel!r} in the export")
        return 1
    print("\n".join(summary(matched[0], args.title, args.top, len(matched))))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
