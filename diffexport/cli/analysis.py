"""`diffexport stats`, `quant-sweep`, `linear-sweep` and `retrieval`: their options and printing (the loops are
analysis.runs).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from diffexport.cli.common import Command, log_line
from diffexport.core.errors import DiffExportError
from diffexport.core.lazy import lazy_import

checkpoint = lazy_import("diffexport.modeling.checkpoint")
fused = lazy_import("diffexport.analysis.fused")
linear_quant = lazy_import("diffexport.analysis.linear_quant")
needle_task = lazy_import("diffexport.inputs.needle_task")
needles = lazy_import("diffexport.analysis.needles")
plots = lazy_import("diffexport.analysis.plots")
presets = lazy_import("diffexport.modeling.presets")
quantization = lazy_import("diffexport.core.quantization")
runs = lazy_import("diffexport.analysis.runs")
stats = lazy_import("diffexport.analysis.stats")
streams = lazy_import("diffexport.inputs.streams")
sweep = lazy_import("diffexport.analysis.sweep")


def _add_models(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("ckpts", nargs="*", metavar="CKPT",
                        help="checkpoints (DIFF or baseline Transformer), compared side by side")
    parser.add_argument("--preset", action="append", default=[],
                        help="a zoo preset with seeded random weights (repeatable); no model at all: the default "
                             "preset")
    parser.add_argument("--seed", type=int, default=0, help="seed for preset weights and synthetic inputs")
    parser.add_argument("--json", action="store_true", help="machine-readable output")
    parser.add_argument("--plot", help="also write a PNG plot here (needs matplotlib: diffexport[plots])")


def _add_stream(parser: argparse.ArgumentParser, tokens: int) -> None:
    parser.add_argument("--text", help="a UTF-8 text file to run on (default: a built-in synthetic stream)")
    parser.add_argument("--tokenizer", help="Hugging Face tokenizer (folder or hub name) for --text; "
                                            "without it the text is read as bytes")
    parser.add_argument("--tokens", type=int, default=tokens, help=f"tokens to run (default {tokens})")
    parser.add_argument("--seq-len", type=int, help="tokens per sequence (default: the checkpoint's training "
                                                     "context, a needle-task document or a text window, else 256)")
    parser.add_argument("--batch", type=int, default=8, help="sequences per forward pass (default 8)")


def _analysis_device(args):
    """--device (stats, quant-sweep, retrieval): auto = CUDA when torch sees a GPU, else the CPU."""
    import torch

    wanted = getattr(args, "device", "cpu")
    if wanted == "auto":
        wanted = "cuda" if torch.cuda.is_available() else "cpu"
    if wanted == "cuda" and not torch.cuda.is_available():
        raise DiffExportError("--device cuda: torch sees no CUDA device (a CPU build of torch, or no GPU); "
                              "use --device cpu")
    return torch.device(wanted)


def _load_models(args) -> dict:
    """label -> LoadedModel for every CKPT and --preset (on --device); the default preset when none is named."""
    device = _analysis_device(args)  # before any model loads: a missing GPU fails first
    models = {}
    for path in args.ckpts:
        label = Path(path).stem if Path(path).stem not in models else path
        models[label] = checkpoint.load_model(path)
    for preset in args.preset or ([] if args.ckpts else [presets.DEFAULT_PRESET]):
        name = preset if preset not in models else f"{preset}#{len(models)}"
        models[name] = checkpoint.load_model(preset=preset, seed=args.seed)
    for loaded in models.values():
        loaded.model.to(device)
    return models


def _random_weights_note(args) -> None:
    """Printed on stderr just before the results of stats/quant-sweep/retrieval run on presets alone."""
    untrained = [] if args.ckpts else [name for name in args.preset or [presets.DEFAULT_PRESET]
                                       if presets.preset_weights(name) is None]
    if untrained:
        log_line(f"note: no checkpoint given: these results are for preset {', '.join(untrained)} with random weights "
             f"(seed {args.seed}); pass a trained CKPT for meaningful numbers")


def _stream_options(args):
    return runs.StreamOptions(text=args.text, tokenizer=args.tokenizer, tokens=args.tokens, seq_len=args.seq_len,
                         batch=args.batch, seed=args.seed)


def cmd_stats(args) -> int:
    """Largest attention-logit and hidden-state magnitudes per layer (the paper's Table 5), for DIFF or baseline
    models."""
    plots.check_plot_path(args.plot)
    results, sources, families = {}, {}, {}
    for name, loaded in _load_models(args).items():
        families[name] = loaded.config.family
        stream = runs.model_stream(loaded, _stream_options(args))
        sources[name] = stream.source
        progress, advance = runs.progress_bar(f"{name}: statistics", len(stream.batches))
        with progress:
            results[name] = stats.collect(loaded.model, stream.batches, advance)
    _random_weights_note(args)
    if args.json:
        print(json.dumps({name: {"family": families[name], "stream": sources[name], **result.to_dict()}
                          for name, result in results.items()}, indent=2))
    else:
        print("\n".join(f"{name}: stream {src}" for name, src in sources.items()))
        print(stats.render(results))
    if args.plot:
        log_line(f"wrote {plots.plot_stats(results, args.plot)}")
    return 0


def _sweep_models(args, label: str, run, note: str = "") -> dict:
    """Every model of the command line through analysis.runs.sweep_models."""
    results = runs.sweep_models(_load_models(args), label, run, _stream_options(args), positions=args.positions,
                           task=args.task, samples=args.samples, log=log_line, note=note)
    _random_weights_note(args)
    return results


def _print_sweep(args, results: dict, key: str, describe, text: str, plot) -> None:
    if args.json:
        print(json.dumps({key: describe, "models": {n: [vars(p) for p in pts] for n, pts in results.items()}},
                         indent=2))
    else:
        print(text)
    if args.plot:
        log_line(f"wrote {plot()}")


def cmd_quant_sweep(args) -> int:
    """Quantise attention logits to each --bits width (dynamic absmax, the kernel's definition) and report the
    damage."""
    for bits in args.bits:
        quantization.LogitQuant(bits, args.scheme)  # a bad value fails before any model loads
    plots.check_plot_path(args.plot)
    bits_list = sorted(set(args.bits) | {16}, reverse=True)
    describe = quantization.LogitQuant(16, args.scheme, not args.no_smooth_k).recipe
    settings = [quantization.LogitQuant(bits, args.scheme, not args.no_smooth_k) for bits in bits_list]
    if args.attention == "kernel":  # what needs no model is refused before any model loads
        reason = next(filter(None, map(fused.quant_unsupported, settings)), None)
        if reason is None and _analysis_device(args).type != "cuda":
            reason = "the fused kernel runs on CUDA tensors (use --device cuda on a GPU)"
        if reason:
            raise DiffExportError(f"--attention kernel: {reason}")

    def run(name, loaded, stream, task_eval, masks, advance):
        attention, why = fused.choose(args.attention, loaded.model, settings, next(loaded.model.parameters()).device)
        log_line(f"{name}: attention {'fused kernel' if attention.name == 'kernel' else 'torch reference'} ({why})")
        return sweep.sweep(loaded.model, bits_list, stream.batches, scheme=args.scheme, smooth_k=not args.no_smooth_k,
                           attention=attention, task_eval=task_eval, masks=masks, progress=advance)

    results = _sweep_models(args, "sweep", run)
    _print_sweep(args, results, "scheme", describe, sweep.render(results, describe),
                 lambda: plots.plot_sweep(results, args.plot, describe))
    return 0


def cmd_linear_sweep(args) -> int:
    """Quantise every linear layer (int8/int4 weights, or w8a8 weights and activations, as `quantize` deploys them) and
    report the damage, DIFF vs Transformer."""
    quants = [linear_quant.LinearQuant(scheme, args.block_size) for scheme in dict.fromkeys(args.schemes)]
    plots.check_plot_path(args.plot)

    def run(name, loaded, stream, task_eval, masks, advance):
        unquantised_task = None if task_eval is None else (lambda: task_eval(None))
        return linear_quant.sweep(loaded.model.eval(), quants, stream.batches, task_eval=unquantised_task,
                                  masks=masks, progress=advance)

    w8a8 = any(q.scheme == "w8a8" for q in quants)
    results = _sweep_models(args, "linear sweep", run, "; w8a8 calibrated on the same tokens" if w8a8 else "")
    describe = [q.describe for q in quants]
    _print_sweep(args, results, "schemes", describe, linear_quant.render(results, describe),
                 lambda: plots.plot_linear_sweep(results, args.plot))
    return 0


def cmd_retrieval(args) -> int:
    """Multi-needle retrieval: accuracy per (needles, queries, depth) and the attention on the answer vs the rest."""
    quant = quantization.LogitQuant(args.logit_bits, args.scheme)
    plots.check_plot_path(args.plot)
    results = {}
    for name, loaded in _load_models(args).items():
        context = args.context or streams.task_context_len(loaded.task, needle_task.TASK_NAME) or 128
        cells = needle_task.grid(args.needles, args.queries, args.depths)
        progress, advance = runs.progress_bar(f"{name}: retrieval", len(cells))
        with progress:
            results[name] = needles.evaluate(
                loaded.model, needles=tuple(args.needles), queries=tuple(args.queries), depths=tuple(args.depths),
                context_len=context, samples=args.samples, seed=args.seed + 1, quant=quant,
                progress=lambda done, total: advance(done))
    _random_weights_note(args)
    if args.json:
        print(json.dumps({n: {"context_len": r.context_len, "samples": r.samples, "accuracy": r.accuracy(),
                              "cells": [vars(c) for c in r.cells]} for n, r in results.items()}, indent=2))
    else:
        print(needles.render(results, quant.describe()))
    if args.plot:
        log_line(f"wrote {plots.plot_retrieval(results, args.plot)}")
    return 0


def _add_device(p: argparse.ArgumentParser) -> None:
    p.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"],
                   help="where the models run (auto: CUDA when torch sees a GPU, else the CPU)")


def _add_scheme(p: argparse.ArgumentParser) -> None:
    p.add_argument("--scheme", default="qk", choices=["qk", "logits"],
                   help="qk: Q and K quantised per block, as the INT8 kernel (default); "
                        "logits: each row of logits quantised (the paper's study)")


def _add_task_metric(p: argparse.ArgumentParser) -> None:
    p.add_argument("--task", default="auto", choices=["auto", "needles", "none"],
                   help="task metric: auto = what the checkpoint was trained on")
    p.add_argument("--samples", type=int, default=32, help="task documents per (needles, queries, depth) cell")
    p.add_argument("--positions", default="auto", choices=["auto", "all", "answers"],
                   help="where cosine/KL are measured: every position, or only the needle task's answers "
                        "(auto: answers for a checkpoint trained on the task)")


def _stats_arguments(p: argparse.ArgumentParser) -> None:
    _add_models(p)
    _add_stream(p, tokens=16384)
    _add_device(p)


def _quant_sweep_arguments(p: argparse.ArgumentParser) -> None:
    _add_models(p)
    _add_stream(p, tokens=8192)
    _add_device(p)
    p.add_argument("--attention", default="auto", choices=["auto", "reference", "kernel"],
                   help="what computes the quantised attention: the torch reference (any model, both "
                        "schemes) or the fused CUDA kernel's INT8-logits path (DIFF, head_dim 64/128, "
                        "scheme qk, bits 2..8; needs --device cuda and the built kernel library); auto: "
                        "the kernel where it applies, else the reference (stderr says which and why)")
    _add_scheme(p)
    p.add_argument("--bits", type=int, nargs="+", default=[16, 8, 6, 4],
                   help="logit bit widths, 2..16 (16 = not quantised, always the reference)")
    p.add_argument("--no-smooth-k", action="store_true", help="qk scheme without K-smoothing")
    _add_task_metric(p)


def _linear_sweep_arguments(p: argparse.ArgumentParser) -> None:
    _add_models(p)
    _add_stream(p, tokens=8192)
    p.add_argument("--schemes", nargs="+", default=["int8", "int4", "w8a8"], choices=["int8", "int4", "w8a8"],
                   help="int8/int4: weights only, RTN in blocks; w8a8: int8 weights per channel and "
                        "int8 activations per tensor (default: all three)")
    p.add_argument("--block-size", type=int, default=32, help="int8/int4 block (default 32)")
    _add_task_metric(p)


def _retrieval_arguments(p: argparse.ArgumentParser) -> None:
    _add_models(p)
    _add_device(p)
    _add_scheme(p)
    p.add_argument("--needles", type=int, nargs="+", default=[1, 2, 4, 6], help="needle counts N")
    p.add_argument("--queries", type=int, nargs="+", default=[1, 2], help="asked needles R (R <= N)")
    p.add_argument("--depths", type=float, nargs="+", default=[0, 25, 50, 75, 100],
                   help="depth of the first asked needle, percent of the document")
    p.add_argument("--context", type=int, help="document tokens (default: the checkpoint's training "
                                               "context, else 128)")
    p.add_argument("--samples", type=int, default=32, help="documents per cell (default 32)")
    p.add_argument("--logit-bits", type=int, default=16, help="run with quantised logits (16 = not)")


COMMANDS = [Command("stats", cmd_stats, _stats_arguments),
            Command("quant-sweep", cmd_quant_sweep, _quant_sweep_arguments),
            Command("linear-sweep", cmd_linear_sweep, _linear_sweep_arguments),
            Command("retrieval", cmd_retrieval, _retrieval_arguments)]
