"""The `diffexport` command line. Heavy modules load inside the commands, so --help stays fast.

Every failure the user can fix prints one line `error: ...` and exits with 2.
Set DIFFEXPORT_DEBUG=1 to see tracebacks.
"""

from __future__ import annotations

import argparse
import os
import sys


def _add_model_source(parser: argparse.ArgumentParser, ckpt_required: bool = False) -> None:
    parser.add_argument("ckpt", nargs=None if ckpt_required else "?",
                        help="ckpt.pt, a .safetensors file, a diffexport or Hugging Face DiffLlama directory, "
                             "or a bare state dict (with --preset/--config)")
    parser.add_argument("--preset", help="a model zoo preset (see `diffexport presets`); alone: a seeded random model")
    parser.add_argument("--config", help="JSON {family, config} for a bare state dict")
    parser.add_argument("--layout", default="auto", choices=["auto", "native", "unilm"],
                        help="weight naming/layout of a bare state dict (default: detect)")
    parser.add_argument("--seed", type=int, default=0, help="seed for random preset weights")


def _load(args, device: str = "cpu"):
    from diffexport.checkpoint import load_config_file, load_model
    from diffexport.presets import DEFAULT_PRESET

    config = load_config_file(args.config) if args.config else None
    preset = args.preset
    if args.ckpt is None and preset is None and config is None:
        preset = DEFAULT_PRESET
    return load_model(args.ckpt, preset=preset, config=config, layout=args.layout, seed=args.seed,
                      device=device)


def cmd_info(args) -> int:
    """Family, preset match, parameter count, layers, heads and lambda values of a checkpoint."""
    from diffexport.summary import describe

    # A preset alone is described from shapes (meta device): no need to allocate 13B random weights.
    only_preset = args.ckpt is None and args.config is None
    print(describe(_load(args, device="meta" if only_preset else "cpu")))
    return 0


def cmd_presets(args) -> int:
    """List the model zoo's presets."""
    from diffexport.presets import all_presets

    for name, entry in all_presets().items():
        print(f"{name:18s} {entry['family']:12s} {entry['description']}")
    return 0


def cmd_demo(args) -> int:
    """The main job on the built-in default model: summary, then the op checked against eager Eq. 1."""
    from diffexport.summary import describe, self_check

    loaded = _load(args)
    print(describe(loaded))
    ok, report = self_check(loaded.model, seed=args.seed)
    print(report)
    print("ONNX export is not available yet in this version; the summary and eager check above are the demo.")
    return 0 if ok else 1


COMMANDS = {"info": cmd_info, "presets": cmd_presets, "demo": cmd_demo}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="diffexport", description="Differential Transformer models from "
                                     "PyTorch to ONNX, ONNX Runtime and TensorRT.")
    parser.add_argument("--version", action="store_true", help="print the version and exit")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name, fn in COMMANDS.items():
        p = sub.add_parser(name, help=fn.__doc__.splitlines()[0], description=fn.__doc__)
        if name in ("info", "demo"):
            _add_model_source(p)
        p.set_defaults(func=fn)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
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
    except Exception as exc:  # a bug of ours: still one line, unless debugging
        if os.environ.get("DIFFEXPORT_DEBUG"):
            raise
        print(f"internal error: {type(exc).__name__}: {exc} (rerun with DIFFEXPORT_DEBUG=1 and report it)",
              file=sys.stderr)
        return 1


if __name__ == "__main__":
    raise SystemExit(main())
