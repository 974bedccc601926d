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

With `--library LIB` (the kernel library the launch ran, built with -lineinfo as CMake builds it)
the samples are also summed per source line: the library's cubins of `--arch` are disassembled
with nvdisasm's line information, the launch's kernel is found among them by its instruction
sequence (its name in the export is demangled, the cubins' are not), and each instruction's
samples go to its chain of source lines in plugins/ (the kernel's statement > the inlined
helper's line ...).
"""

from __future__ import annotations

import argparse
import csv
import io
import os
import re
import struct
import subprocess
import sys
import tempfile
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from kernel_resources import find_tool  # noqa: E402  (the CUDA binary utilities, toolkit or wheel)

SECTION_PREFIX = "where the warps wait, "  # campaign_report.py finds the sections by it
ALL_SAMPLES = "Warp Stall Sampling (All Samples)"
NOT_ISSUED = "Warp Stall Sampling (Not-issued Samples)"
EXECUTED = "Instructions Executed"
REPO = Path(__file__).resolve().parent.parent
UNNAMED = "(not named in the export)"  # such a launch matches any --kernel, and says so
MAX_INPUT_BYTES = 256 << 20  # a source page of a few thousand instructions is a few MB
SHOWN_CHARS = 800  # of an export's header or first lines, quoted when its layout is not the one read here


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
        return _opcode(self.sass)


@dataclass
class Launch:
    kernel: str
    instructions: list[Instruction] = field(default_factory=list)
    missing: list[str] = field(default_factory=list)
    columns: list[str] = field(default_factory=list)  # the export's header, shown when a column is missing


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
            launches[-1].columns = header
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


@dataclass
class SassLine:
    offset: int
    opcode: str
    frames: tuple[tuple[str, int], ...]  # (source file, line), innermost first, as nvdisasm lists them


def _opcode(sass: str) -> str:
    words = sass.split()
    words = words[1:] if words and words[0].startswith("@") else words
    return words[0].split(".")[0] if words else "?"


def parse_disassembly(text: str, pattern: re.Pattern) -> dict[str, list[SassLine]]:
    """nvdisasm --print-line-info-inline output: each function whose (mangled) name matches, its
    instructions with the source-line chain in force at each. Where inlined code starts, nvdisasm
    writes one "//## File" line per level before the instruction, each a callee's line "inlined at"
    its caller's, then the outermost line alone:
        ptx.cuh, line 89 inlined at diff_attention_fwd.cuh, line 174
        diff_attention_fwd.cuh, line 174 inlined at diff_attention_decode.cuh, line 502
        diff_attention_decode.cuh, line 502
    A line that starts where the chain so far ends continues it; any other starts a new chain."""
    functions: dict[str, list[SassLine]] = {}
    current: list[SassLine] | None = None
    frames: tuple[tuple[str, int], ...] = ()
    fresh = False  # a "//## File" line came after the last instruction
    for line in text.splitlines():
        if label := re.match(r"^\.text\.(\S+):\s*$", line):
            current = functions.setdefault(label.group(1), []) if pattern.search(label.group(1)) else None
            frames, fresh = (), False
        elif current is None:
            continue
        elif "//## File" in line:
            chain = tuple((path, int(n)) for path, n in re.findall(r'"([^"]+)", line (\d+)', line))
            frames = frames + chain[1:] if fresh and frames and chain[:1] == frames[-1:] else chain
            fresh = True
        elif ins := re.match(r"^\s*/\*([0-9a-f]{4,})\*/\s+(.*?)\s*;", line):
            current.append(SassLine(int(ins.group(1), 16), _opcode(ins.group(2)), frames))
            fresh = False
    return {name: body for name, body in functions.items() if body}


SASS_BYTES = 16  # an instruction on sm_70 and later
PADDING = 64     # instructions a function may end with past what the profiler lists (NOP, the final BRA)


def cubin_functions(data: bytes) -> dict[str, int]:
    """The function symbols of a cubin (ELF64, little-endian) and their sizes in bytes, from its
    symbol table: which cubin holds a kernel of a given length, without disassembling any. {} for
    bytes that are not such an ELF file, or whose tables point past its end."""
    try:
        return _elf_functions(data)
    except (struct.error, ValueError, IndexError):
        return {}


def _elf_functions(data: bytes) -> dict[str, int]:
    if data[:4] != b"\x7fELF" or data[4:6] != b"\x02\x01":
        return {}
    shoff, = struct.unpack_from("<Q", data, 0x28)
    shentsize, shnum = struct.unpack_from("<HH", data, 0x3A)
    sections = [struct.unpack_from("<IIQQQQIIQQ", data, shoff + i * shentsize) for i in range(shnum)
                if shoff + (i + 1) * shentsize <= len(data)]
    functions = {}
    for _, kind, _, _, offset, size, link, _, _, entsize in sections:
        if kind != 2 or entsize < 24 or link >= len(sections):  # SHT_SYMTAB, and its string table
            continue
        strings = data[sections[link][4]:sections[link][4] + sections[link][5]]
        for at in range(offset, min(offset + size, len(data) - 23), entsize):
            name, info, _, _, _, length = struct.unpack_from("<IBBHQQ", data, at)
            if info & 0xF == 2 and name < len(strings):  # STT_FUNC
                functions[strings[name:strings.index(b"\0", name)].decode("latin-1")] = length
    return functions


def library_functions(library: str, kernel: str, arch: str, instructions: int | None = None
                      ) -> dict[str, list[SassLine]]:
    """The functions matching `kernel` in the library's cubins of `arch`, disassembled in parallel;
    with `instructions` (the launch's count), only the cubins holding such a function of about that
    length (within an eighth, or PADDING: the profiler may list the kernel's own subroutines, such as
    the division slow paths, and leave out its padding)."""
    cuobjdump, nvdisasm = find_tool("cuobjdump"), find_tool("nvdisasm")
    if cuobjdump is None or nvdisasm is None:
        raise RuntimeError("cuobjdump and nvdisasm not found (CUDA toolkit, or pip install nvidia-cuda-cuobjdump "
                           "nvidia-cuda-nvdisasm)")
    pattern = re.compile(kernel)

    def holds_the_kernel(path: Path) -> bool:
        return any(pattern.search(name) and (instructions is None or
                                             abs(size // SASS_BYTES - instructions) <= max(PADDING, instructions // 8))
                   for name, size in cubin_functions(path.read_bytes()).items())

    with tempfile.TemporaryDirectory() as folder:
        subprocess.run([cuobjdump, "-xelf", "all", "-arch", arch, os.path.abspath(library)], cwd=folder,
                       capture_output=True, check=True, timeout=120)
        cubins = [path for path in sorted(Path(folder).glob("*.cubin")) if holds_the_kernel(path)]

        def disassemble(path: Path) -> str:
            return subprocess.run([nvdisasm, "--print-line-info-inline", str(path)], capture_output=True,
                                  text=True, check=True, timeout=120).stdout

        with ThreadPoolExecutor(max_workers=os.cpu_count() or 1) as pool:
            texts = list(pool.map(disassemble, cubins))
    functions: dict[str, list[SassLine]] = {}
    for text in texts:
        functions.update(parse_disassembly(text, pattern))
    return functions


def match_function(launch: Launch, functions: dict[str, list[SassLine]]) -> tuple[str, float] | None:
    """The function whose instruction sequence is the launch's: at least 98% of its instructions and
    of the launch's within its length have the same opcode at the same offset; the best such (name,
    agreement), or None. Its trailing NOPs and branches past the launch's last instruction do not
    count, nor the launch's instructions past the function's end (subroutines the profiler lists)."""
    start = min(i.address for i in launch.instructions)
    ops = {i.address - start: i.opcode for i in launch.instructions}
    best = None
    for name, body in functions.items():
        within = [offset for offset in ops if offset <= body[-1].offset]
        if not within:
            continue
        end = max(within) + SASS_BYTES  # the launch's last instruction inside this function
        used = [x for x in body if x.offset < end or x.opcode not in ("NOP", "BRA")]
        same = sum(ops.get(x.offset) == x.opcode for x in used)
        agree = same / max(len(used), len(within))
        if agree >= 0.98 and (best is None or agree > best[1]):
            best = (name, agree)
    return best


def _own_frames(frames: tuple[tuple[str, int], ...]) -> tuple[tuple[str, int], ...]:
    """The chain's lines in this repository's kernel sources, outermost (the kernel's statement) first;
    the innermost line of any file where none is ours (a CUDA header)."""
    own = tuple(f for f in reversed(frames) if "plugins/" in f[0].replace(os.sep, "/"))
    return own or frames[:1]


def _source_text(path: str, line: int) -> str:
    """The line's text, read where the build saw it, else in this checkout (a library built in another
    folder from the same tree, as prepare_gpu_campaign.sh builds the carried ones)."""
    unix = path.replace(os.sep, "/")
    if not os.path.exists(path) and "plugins/" in unix:
        path = str(REPO / unix[unix.index("plugins/"):])
    try:
        if os.path.islink(path) or os.path.getsize(path) > (4 << 20):
            return ""
        with open(path, encoding="utf-8", errors="replace") as source:
            lines = source.read().splitlines()
    except OSError:
        return ""
    return lines[line - 1].strip() if 0 < line <= len(lines) else ""


def by_source_line(launch: Launch, body: list[SassLine], top: int = 10) -> list[str]:
    """The launch's samples summed per chain of source lines, the top ones with their reasons and the
    text of the outermost line."""
    start = min(i.address for i in launch.instructions)
    chains = {x.offset: _own_frames(x.frames) for x in body}
    samples: Counter = Counter()
    reasons: dict[tuple, Counter] = {}
    for i in launch.instructions:
        chain = chains.get(i.address - start, ())
        samples[chain] += i.samples
        reasons.setdefault(chain, Counter()).update(i.reasons)
    total = sum(samples.values())
    lines = ["by source line (share of samples, the kernel's line > the inlined helpers' lines, top reasons, "
             "the kernel's line):"]
    for chain, value in samples.most_common(top):
        if value <= 0:
            break
        shown = [f"{os.path.basename(path)}:{line}" for path, line in chain] or ["(no line information)"]
        if len(shown) > 3:
            shown = shown[:2] + ["...", shown[-1]]
        text = _source_text(*chain[0]) if chain else ""
        lines.append(f"  {100 * value / total:5.1f}%  {' > '.join(shown):<56s}  "
                     f"{_shares(reasons[chain], total, 2) or '-'}" + (f"  | {text[:70]}" if text else ""))
    return lines


def _printable(text: str, limit: int) -> str:
    """text cut to limit characters, anything but printable ASCII shown as '?'."""
    cut = text[:limit]
    return "".join(c if " " <= c <= "~" else "?" for c in cut) + (" ..." if len(text) > limit else "")


def _shares(counter: Counter, total: float, top: int) -> str:
    return ", ".join(f"{name} {100 * value / total:.1f}%" for name, value in counter.most_common(top) if value)


def summary(launch: Launch, title: str, top: int = 12, launches_matched: int = 1) -> list[str]:
    """The section profile.txt gets: totals, samples by reason and by opcode, the top instructions."""
    lines = [f"--- {SECTION_PREFIX}{title}",
             f"kernel: {launch.kernel}" + (f" (the first of {launches_matched} launches)" if launches_matched > 1
                                           else "")]
    if launch.missing:  # with the columns there were, so that another layout can be read next time
        lines.append("not in the export: " + ", ".join(launch.missing))
        lines.append("columns in the export: " + _printable(", ".join(launch.columns), SHOWN_CHARS))
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


def source_lines(launch: Launch, functions: dict[str, list[SassLine]]) -> list[str]:
    """The section's last part: which of the library's functions the launch ran, its samples per line."""
    found = match_function(launch, functions) if launch.instructions else None
    if found is None:
        return [f"source lines: none of the library's {len(functions)} functions matching the kernel has its "
                "instruction sequence (another build?)"]
    return ([f"source lines: the library's {found[0]} ({100 * found[1]:.1f}% of the opcodes agree)"]
            + by_source_line(launch, functions[found[0]]))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("csv", help="ncu's source page as CSV, or - for stdin")
    parser.add_argument("--kernel", default="", help="a regular expression the launch's kernel name must match")
    parser.add_argument("--title", required=True, help="the launch's section title in profile.txt")
    parser.add_argument("--top", type=int, default=12, help="instructions listed (default 12)")
    parser.add_argument("--library", help="the kernel library the launch ran: samples per source line too")
    parser.add_argument("--arch", default="sm_90a", help="its cubins to read (default sm_90a)")
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
    launches = parse(text)
    matched = [launch for launch in launches if launch.kernel == UNNAMED or pattern.search(launch.kernel)]
    if not matched:
        # What the export held instead, so that a layout other than the one read here can be read next time.
        seen = sorted({launch.kernel for launch in launches})
        head = [line for line in text.splitlines() if line.strip()][:3]
        print(f"--- {SECTION_PREFIX}{args.title}\nno launch of a kernel matching {args.kernel!r} in the export",
              f"\nkernels in the export: {_printable(', '.join(seen), SHOWN_CHARS) if seen else 'none'}",
              *(f"\nexport line {n}: {_printable(line, SHOWN_CHARS)}" for n, line in enumerate(head, 1)), sep="")
        return 1
    lines = summary(matched[0], args.title, args.top, len(matched))
    print("\n".join(lines), flush=True)  # kept if the disassembly below runs out of time
    if args.library and lines[-1].startswith("  "):  # samples to place
        try:
            lines = source_lines(matched[0], library_functions(args.library, args.kernel, args.arch,
                                                               len(matched[0].instructions)))
        except (OSError, RuntimeError, subprocess.SubprocessError) as exc:
            lines = [f"source lines: not read ({type(exc).__name__}: {str(exc)[:200]})"]
        print("\n".join(lines))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
