"""The `diffexport` command line: argparse and printing, one module per group of commands
(export, check, generate, analysis, gpu), each with its commands and their options; the logic
they call is the Python API. Heavy modules load inside the commands, so --help stays fast.

Every failure the user can fix prints one line `error: ...` and exits with 2.
Set DIFFEXPORT_DEBUG=1 to see tracebacks.
"""

from __future__ import annotations

import argparse
import os
import sys

from diffexport.cli import analysis, check, export, generate, gpu
from diffexport.cli.generate import sampling_options as _sampling  # noqa: F401 (tests' old name)

# Command -> (function, the module that adds its options); the order is the help's.
COMMANDS = {"onnx": (export.cmd_onnx, export), "trt": (gpu.cmd_trt, gpu), "check": (check.cmd_check, check),
            "generate": (generate.cmd_generate, generate), "optimize": (export.cmd_optimize, export),
            "quantize": (export.cmd_quantize, export), "inspect": (export.cmd_inspect, export),
            "demo": (export.cmd_demo, export), "info": (export.cmd_info, export),
            "presets": (export.cmd_presets, export), "stats": (analysis.cmd_stats, analysis),
            "quant-sweep": (analysis.cmd_quant_sweep, analysis), "linear-sweep": (analysis.cmd_linear_sweep, analysis),
            "retrieval": (analysis.cmd_retrieval, analysis), "kernels": (gpu.cmd_kernels, gpu)}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="diffexport", description="Differential Transformer models from "
                                     "PyTorch to ONNX, ONNX Runtime and TensorRT.")
    parser.add_argument("--version", action="store_true", help="print the version and exit")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    parser._subcommands = {}
    for name, (fn, module) in COMMANDS.items():
        p = sub.add_parser(name, help=fn.__doc__.splitlines()[0], description=fn.__doc__)
        parser._subcommands[name] = p
        if hasattr(module, "add_arguments"):
            module.add_arguments(name, p)
        p.set_defaults(func=fn)
    return parser


def _terminate_like_interrupt(signum, frame):
    """SIGTERM takes the same way out as Ctrl-C, so every cleanup (temporary files) runs."""
    raise KeyboardInterrupt


def main(argv: list[str] | None = None) -> int:
    import signal

    parser = build_parser()
    args, extra = parser.parse_known_args(argv)
    if extra:  # the subcommand's own usage, then one error line
        sub = parser._subcommands.get(args.command, parser) if args.command else parser
        sub.error(f"unrecognized arguments: {' '.join(extra)}")
    try:
        signal.signal(signal.SIGTERM, _terminate_like_interrupt)
    except ValueError:  # main() called from a thread other than the main one: leave signals alone
        pass
    if args.version:
        from diffexport import __version__

        print(__version__)
        return 0
    if args.command is None:
        parser.print_help()
        return 2
    from diffexport.errors import DiffExportError

    try:
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
