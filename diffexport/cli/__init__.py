"""The `diffexport` command line: argparse and printing, one module per group of commands
(export, check, generate, analysis, gpu, serve), each with its commands and their options; the logic
they call is the Python API. Heavy modules load inside the commands, so --help stays fast.

Every failure the user can fix prints one line `error: ...` and exits with 2.
Set DIFFEXPORT_DEBUG=1 to see tracebacks.
"""

from __future__ import annotations

import argparse
import difflib
import os
import re
import sys

from diffexport import __version__
from diffexport.cli import analysis, check, export, generate, gpu, serve
from diffexport.cli.common import Command
from diffexport.core.errors import DiffExportError
from diffexport.core.lazy import lazy_import
from diffexport.core.stoppable import end_within_seconds, install_interrupt_handlers

hub = lazy_import("diffexport.modeling.hub")

# Every subcommand's record (cli/common.Command), in the help's order.
HELP_ORDER = ("onnx", "trt", "check", "report", "generate", "optimize", "quantize", "inspect", "demo", "info",
              "presets", "stats", "quant-sweep", "linear-sweep", "retrieval", "kernels", "triton")
COMMANDS: dict[str, Command] = {c.name: c for c in sorted(
    [*export.COMMANDS, *gpu.COMMANDS, *check.COMMANDS, *generate.COMMANDS, *analysis.COMMANDS, *serve.COMMANDS],
    key=lambda c: HELP_ORDER.index(c.name))}


class OneLineParser(argparse.ArgumentParser):
    """argparse with the CLI's error convention: one line `error: ...` and exit 2 (not the usage
    block), naming the closest option or command when a name was mistyped. Subcommand parsers
    are made with this class too (argparse builds them with the parent's)."""

    def error(self, message: str):
        sys.stderr.write(f"error: {self.prog}: {message}{self.suggestion(message)}; see `{self.prog} --help`\n")
        raise SystemExit(2)

    def suggestion(self, message: str) -> str:
        def closest(typed: str, names) -> str | None:
            close = difflib.get_close_matches(typed, list(names), n=1, cutoff=0.6)
            return close[0] if close else None

        unknown = re.match(r"unrecognized arguments?: (.*)$", message)
        if unknown:
            options = [o for o in self._option_string_actions if o.startswith("--")]
            pairs = [(typed, closest(typed, options)) for typed in
                     (word.split("=", 1)[0] for word in unknown.group(1).split() if word.startswith("-"))]
            pairs = [f"{best} for {typed}" if len(pairs) > 1 else best for typed, best in pairs if best]
            return f" (did you mean {', '.join(pairs)}?)" if pairs else ""
        choice = re.match(r"argument .*: invalid choice: '([^']*)' \(choose from (.*)\)$", message)
        if choice:
            best = closest(choice.group(1), re.findall(r"'([^']*)'", choice.group(2)))
            return f" (did you mean {best}?)" if best else ""
        return ""


def build_parser() -> argparse.ArgumentParser:
    parser = OneLineParser(prog="diffexport", description="Differential Transformer models from "
                           "PyTorch to ONNX, ONNX Runtime and TensorRT.")
    parser.add_argument("--version", action="store_true", help="print the version and exit")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    parser._subcommands = {}
    for name, command in COMMANDS.items():
        summary = " ".join(command.run.__doc__.split("\n\n")[0].split())  # the first paragraph, on one line
        p = sub.add_parser(name, help=summary, description=command.run.__doc__)
        parser._subcommands[name] = p
        command.options(p)
        p.set_defaults(func=command.run)
    return parser


def check_inputs_exist(args) -> None:
    """A missing checkpoint, model or folder is refused here, before a command imports torch, onnx or
    transformers (1.5-2 s on a fast machine, for a typo). The loaders keep their own checks: this
    is only the fast way out, in their words. (A Hugging Face Hub id names no path: it passes.)"""
    for ckpt in [getattr(args, "ckpt", None), *(getattr(args, "ckpts", None) or [])]:
        if isinstance(ckpt, str) and not os.path.exists(ckpt) and not hub.is_hub_id(ckpt):
            raise DiffExportError(f"checkpoint not found: {ckpt}")
    command = COMMANDS[args.command]
    model = getattr(args, command.input_arg, None)
    if args.command == "check" and isinstance(model, str) and not model.endswith(".onnx"):
        model = None  # an engine or a folder: the loader words it (what to give depends on the kind)
    if isinstance(model, str) and not os.path.exists(model):
        raise DiffExportError(command.missing_input.format(model))


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args, extra = parser.parse_known_args(argv)
    if extra:  # one error line, as the subcommand's parser words it
        sub = parser._subcommands.get(args.command, parser) if args.command else parser
        sub.error(f"unrecognized argument{'s' if len(extra) > 1 else ''}: {' '.join(extra)}")
    install_interrupt_handlers()  # SIGTERM takes Ctrl-C's way out, so every cleanup runs
    if argv is None:  # a process of its own (not main() called by a program): it ends within seconds
        end_within_seconds()
    if args.version:
        print(__version__)
        return 0
    if args.command is None:
        parser.print_help()
        return 2

    try:
        check_inputs_exist(args)
        return args.func(args)
    except DiffExportError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return exc.exit_code
    except KeyboardInterrupt:
        print("error: interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:  # `diffexport inspect m.onnx | head`: the reader left; quiet, as cat is
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())  # the interpreter's final flush must not fail again
        return 141  # 128 + SIGPIPE, what a shell reports for a tool the pipe ended
    except OSError as exc:  # the file system said no: read-only, disk full, a name too long, ...
        if os.environ.get("DIFFEXPORT_DEBUG"):
            raise
        where = f" ({exc.filename})" if exc.filename else ""
        print(f"error: the file system refused: {exc.strerror or exc}{where}",
              file=sys.stderr)
        return 2
    except MemoryError:  # the host ran out: not a bug, and the user can ask for less
        print("error: out of host memory: lower --batch, --seq-len or --tokens, or use a smaller model",
              file=sys.stderr)
        return 2
    except Exception as exc:  # a bug of ours: still one line, unless debugging
        if os.environ.get("DIFFEXPORT_DEBUG"):
            raise
        torch = sys.modules.get("torch")  # only a command that loaded torch can run out of GPU memory
        if torch is not None and isinstance(exc, torch.OutOfMemoryError):
            print("error: out of GPU memory: lower --batch, --seq-len or --tokens, or run with --device cpu",
                  file=sys.stderr)
            return 2
        print(f"internal error: {type(exc).__name__}: {exc} (rerun with DIFFEXPORT_DEBUG=1 and report it)",
              file=sys.stderr)
        return 1


if __name__ == "__main__":
    raise SystemExit(main())
