"""`diffexport check`: its options, the model it loads, and the reports it prints (validation.check_artifact routes the
path).
"""

from __future__ import annotations

import argparse
import shlex
import sys
from pathlib import Path

from diffexport.cli.common import Command, add_force, add_model_source, load_named_model, log_line
from diffexport.core.errors import DiffExportError  # light: no torch
from diffexport.core.lazy import lazy_import

artifact_check = lazy_import("diffexport.validation.artifact")
check_options = lazy_import("diffexport.validation.options")
decoder_folder = lazy_import("diffexport.format.decoder_folder")
eager_generation = lazy_import("diffexport.core.eager_generation")
html_report = lazy_import("diffexport.report")


def _check_options(args, folder_config: dict | None = None):
    for flag, value in (("--atol", args.atol), ("--rtol", args.rtol)):
        if value is not None and not (value >= 0 and value != float("inf")):
            raise DiffExportError(f"{flag} must be a finite number >= 0, got {value}")
    shapes = check_options.parse_shapes(args.shapes) if args.shapes else check_options.DEFAULT_SHAPES
    return check_options.CheckOptions(shapes=shapes, provider=args.provider, seed=args.seed,
                        save_dir=Path(args.save_dir) if args.save_dir else None, atol=args.atol, rtol=args.rtol,
                        reference=args.reference, plugin_lib=args.plugin_lib, text=args.text, tokenizer=args.tokenizer,
                        plot=args.plot, beams=_check_beams(args), **_check_sampling(args, folder_config))


def _check_sampling(args, folder_config: dict | None) -> dict:
    """check's --sample: CheckOptions' sampling and draws. A folder whose search samples (its
    checkpoint's generation_config) gives the defaults, as it does to generate; the options override."""
    given = [flag for flag, value in (("--temperature", args.temperature), ("--top-k", args.top_k),
                                      ("--top-p", args.top_p), ("--repetition-penalty", args.repetition_penalty),
                                      ("--draws", args.draws)) if value is not None]
    if not args.sample:
        if given:
            raise DiffExportError(f"{given[0]} shapes the sampling check: add --sample")
        return {}
    draws = 2000 if args.draws is None else args.draws  # checked with the other options (check_decode_options)
    config = folder_config if folder_config is not None else {}
    # the folder's penalty only where its search samples: a greedy folder's draws are checked without one
    folder_samples = decoder_folder.folder_search(config)["do_sample"]
    penalty = 1.0 if args.repetition_penalty is None and not folder_samples else args.repetition_penalty
    sampling, taken, _ = decoder_folder.search_sampling(config, sample=True, temperature=args.temperature,
                                                        top_k=args.top_k, top_p=args.top_p,
                                                        repetition_penalty=penalty, seed=args.seed)
    if taken:
        log_line(f"from the folder's genai_config.json search: {', '.join(taken)} (the options override it)")
    return {"sampling": sampling, "draws": draws}


def _check_beams(args):
    """check's --num-beams: every hypothesis of N beams is compared (as many returned as beams)."""
    if args.num_beams is None:
        if args.length_penalty is not None or args.no_early_stopping:
            raise DiffExportError("--length-penalty and --no-early-stopping shape a beam search: add --num-beams N")
        return None
    return eager_generation.BeamSearch(num_beams=args.num_beams, num_return_sequences=args.num_beams,
                      length_penalty=1.0 if args.length_penalty is None else args.length_penalty,
                      early_stopping=not args.no_early_stopping)


def _load_for_check(args, meta: dict, path) -> object:
    """check's model. A preset or --config without a checkpoint is first held to the export's
    configuration on shapes alone: a wrong preset is one line before its random weights are built
    (a 13B preset would not even fit this machine's memory to find that out)."""
    if args.ckpt is None and args.preset is None and args.config is None:
        raise DiffExportError(check_options.name_the_source(meta, Path(path)))
    if args.ckpt is None:
        shape_only = load_named_model(args, device="meta", default_model=False)
        check_options.check_same_config(meta, shape_only.config, Path(path))
    return load_named_model(args, default_model=False)


def cmd_check(args) -> int:
    """Run an exported ONNX model in ONNX Runtime (or a TensorRT .engine on the GPU) against the eager PyTorch model;
    non-zero exit on mismatch."""
    with_model = not (args.against and args.ckpt is None and args.preset is None and args.config is None)
    reports = artifact_check.check_artifact(args.model, lambda folder_config: _check_options(args, folder_config),
                             (lambda meta: _load_for_check(args, meta, args.model)) if with_model else None,
                             against=args.against, steps=args.steps, shapes_given=bool(args.shapes),
                             plot=args.plot is not None, sample=args.sample, num_beams=args.num_beams, log=log_line)
    for report in reports:
        print(report.text())
    return 0 if all(report.passed for report in reports) else 1


def cmd_report(args) -> int:
    """Write one self-contained HTML page about an exported folder or .onnx file: the model, the artifact, its check
    against eager, its speed on this machine, and the commands that reproduce them."""
    options = check_options.CheckOptions(provider="cpu", seed=args.seed,
                                         save_dir=Path(args.save_dir) if args.save_dir else None,
                                         text=args.text, tokenizer=args.tokenizer)
    asked = "diffexport " + " ".join(shlex.quote(a) for a in sys.argv[1:]) if sys.argv[1:2] == ["report"] else ""
    path, report = html_report.write_report(args.artifact, lambda meta: _load_for_check(args, meta, args.artifact),
                                            args.output, options, force=args.force, speed=not args.no_speed,
                                            steps=args.steps, asked=asked, log=log_line)
    print(f"report        {path} ({'PASS' if report.check.passed else 'FAIL'}; open it in a browser: "
          "one file, plots inlined, nothing fetched)")
    return 0 if report.check.passed else 1


def _check_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("model", help="the exported .onnx file, a --kv-cache folder, or an .engine built by "
                                 "`diffexport trt` (GPU)")
    p.add_argument("--ckpt", dest="ckpt", help="the checkpoint it was exported from (or --preset)")
    add_model_source(p, positional=False)
    p.add_argument("--shapes", help="BATCHxSEQ list (default 1x1,1x17,2x33,3x64)")
    p.add_argument("--provider", default="auto", choices=["auto", "cpu", "cuda"],
                   help="onnxruntime provider (auto: CUDA when onnxruntime-gpu and a GPU are present)")
    p.add_argument("--save-dir", help="where the polygraphy inputs/outputs go (default MODEL.check/)")
    p.add_argument("--steps", type=int, help="decode steps checked for a --kv-cache folder or its engine "
                                             "(default 32)")
    p.add_argument("--num-beams", type=int,
                   help="--kv-cache folders and their engines: also beam search with N beams, on the "
                        "onnxruntime loop (or the engine) and in onnxruntime-genai, against eager beam "
                        "search, every hypothesis in rank order")
    p.add_argument("--length-penalty", type=float, help="--num-beams: as generate's (default 1.0)")
    p.add_argument("--no-early-stopping", action="store_true", help="--num-beams: as generate's")
    p.add_argument("--sample", action="store_true",
                   help="--kv-cache folders: also onnxruntime-genai's sampled tokens against the eager "
                        "distribution (--temperature, --top-k, --top-p, --repetition-penalty as generate's; "
                        "draws seeded by --seed)")
    p.add_argument("--temperature", type=float, help="--sample: default 1.0")
    p.add_argument("--top-k", type=int, help="--sample: default 0 (no cut)")
    p.add_argument("--top-p", type=float, help="--sample: default 1.0 (no cut)")
    p.add_argument("--repetition-penalty", type=float, help="--sample: default 1.0 (none)")
    p.add_argument("--draws", type=int, help="--sample: draws per prompt (default 2000)")
    p.add_argument("--reference", default="auto", choices=["auto", "diffexport", "transformers", "both"],
                   help="what the ONNX file is compared with: diffexport's port of the model, transformers' "
                        "own DiffLlamaForCausalLM or LlamaForCausalLM (HF checkpoints), or both (auto: both for HF "
                        "checkpoints "
                        "when transformers is installed, else diffexport)")
    p.add_argument("--against", metavar="OTHER.onnx",
                   help="compare with another ONNX file on the same inputs (e.g. optimize's input); with "
                        "--ckpt also against the model")
    p.add_argument("--plugin-lib", help="engines: libdiffexport_plugins.so to load (default: "
                                        "$DIFFEXPORT_PLUGIN_LIB or this install's build; never the path an "
                                        "engine's .json names)")
    p.add_argument("--atol", type=float, help="your own bound: |out - ref| <= atol + rtol*|ref| elementwise "
                                              "(polygraphy's rule) instead of the automatic dtype rule")
    p.add_argument("--rtol", type=float, help="see --atol (default 0 when only --atol is given)")
    p.add_argument("--text", help="a UTF-8 text whose tokens replace the random ids (prefill files, engines, "
                                  "--against); KV-cache folders also run its first 4096 tokens through their "
                                  "cache (windows of half prefill, half decode steps) against eager; the "
                                  "perplexity of both sides is reported")
    p.add_argument("--tokenizer", help="--text: Hugging Face tokenizer (folder or hub name); without it a "
                                       "folder's own tokenizer, else the text's bytes are the token ids")
    p.add_argument("--plot", help="KV-cache folders and their engines: a PNG of KL (or error) and cosine per "
                                  "decode step (with --sample, also P-sampling.png: genai's draws against "
                                  "the eager probabilities)")


def _report_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("artifact", help="a --kv-cache folder or an exported .onnx file")
    p.add_argument("--ckpt", dest="ckpt", help="the checkpoint it was exported from (or --preset)")
    add_model_source(p, positional=False)
    p.add_argument("-o", "--output", help="the page (default ARTIFACT.report.html beside it)")
    add_force(p)
    p.add_argument("--text", help="a UTF-8 text whose tokens the check also runs (perplexity on the page)")
    p.add_argument("--tokenizer", help="--text: Hugging Face tokenizer (default: a folder's own)")
    p.add_argument("--steps", type=int, help="decode steps checked for a folder (default 32)")
    p.add_argument("--save-dir", help="where the check's polygraphy files go (default ARTIFACT.check/)")
    p.add_argument("--no-speed", action="store_true", help="skip the speed measurement (a few seconds)")


COMMANDS = [Command("check", cmd_check, _check_arguments), Command("report", cmd_report, _report_arguments)]
