"""What several commands share: the model-source options, loading the model they name, progress lines on stderr.
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import dataclass
from typing import Callable

from diffexport.core.errors import DiffExportError  # light, as the zoo's index: --help stays fast
from diffexport.core.lazy import lazy_import
from diffexport.modeling.presets import DEFAULT_PRESET

checkpoint = lazy_import("diffexport.modeling.checkpoint")


def no_options(parser: argparse.ArgumentParser) -> None:
    """A command that takes no options."""


@dataclass(frozen=True)
class Command:
    """One subcommand, registered once: its name, the function that runs it (whose docstring is its
    help), the options it takes, and the argument naming its input file or folder with the words a
    missing one is refused in ("{}" is the path), before anything heavy loads."""
    name: str
    run: Callable[[argparse.Namespace], int]
    options: Callable[[argparse.ArgumentParser], None] = no_options
    input_arg: str = "model"
    missing_input: str = "{} does not exist: give an .onnx file"


def add_model_source(parser: argparse.ArgumentParser, positional: bool = True) -> None:
    if positional:
        parser.add_argument("ckpt", nargs="?",
                            help="ckpt.pt, a .safetensors file, a diffexport or Hugging Face DiffLlama directory, "
                                 "or a bare state dict (with --preset/--config)")
    parser.add_argument("--preset", help="a model zoo preset (see `diffexport presets`); alone: a seeded random model")
    parser.add_argument("--config", help="JSON {family, config} for a bare state dict")
    parser.add_argument("--layout", default="auto", choices=["auto", "native", "unilm"],
                        help="weight naming/layout of a bare state dict (default: detect)")
    parser.add_argument("--seed", type=int, default=0, help="seed for random preset weights")


def load_named_model(args, device: str = "cpu", dtype: str | None = None, default_model: bool = True,
                     default_preset: str | None = None):
    """The model the arguments name; with none named, default_preset (the default: the zoo's
    DEFAULT_PRESET), or an error where a silent random model would surprise (export and check)."""
    import torch

    if not default_model:
        require_model_source(args)
    config = checkpoint.load_config_file(args.config) if args.config else None
    preset = args.preset
    if args.ckpt is None and preset is None and config is None:
        preset = default_preset or DEFAULT_PRESET

    return checkpoint.load_model(args.ckpt, preset=preset, config=config, layout=args.layout, seed=args.seed,
                      device=device, dtype=getattr(torch, dtype) if dtype else None)


def require_model_source(args) -> None:
    """The one-line refusal of export and check when no model is named: asked first, before the
    output or anything else is looked at."""
    if args.ckpt is None and args.preset is None and args.config is None:
        raise DiffExportError(f"name the model: a checkpoint{' (--ckpt)' if args.command == 'check' else ''} "
                              f"or --preset NAME (e.g. --preset {DEFAULT_PRESET} for a seeded random model)")


def log_line(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def add_force(parser: argparse.ArgumentParser) -> None:
    """--force: the one way to replace an output that is already there (every command refuses it otherwise)."""
    parser.add_argument("--force", action="store_true",
                        help="replace the output if it is already there (without it an existing file or folder "
                             "is refused and nothing is overwritten)")

