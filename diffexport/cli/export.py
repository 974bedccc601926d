"""`diffexport info`, `presets`, `onnx`, `optimize`, `quantize`, `inspect` and `demo`: their options and printing.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from diffexport.cli.common import Command, add_force, add_model_source, load_named_model, log_line, require_model_source
from diffexport.core.errors import DiffExportError  # light: no torch
from diffexport.core.files import refuse_output_over_inputs  # light: os and pathlib
from diffexport.core.lazy import lazy_import
from diffexport.format import decoders  # light too: the decoder formats' registry

demo = lazy_import("diffexport.report.demo")
decoder_export = lazy_import("diffexport.export.decoder")
decoder_formats = lazy_import("diffexport.passes.decoder_formats")
diff_kv_cache = lazy_import("diffexport.passes.diff_kv_cache")
export_package = lazy_import("diffexport.export")
exporter = lazy_import("diffexport.export.exporter")
inspect_onnx = lazy_import("diffexport.validation.inspect_onnx")
model_summary = lazy_import("diffexport.modeling.summary")
optimize = lazy_import("diffexport.passes.optimize")
presets = lazy_import("diffexport.modeling.presets")
qdq = lazy_import("diffexport.passes.qdq")
weight_quant = lazy_import("diffexport.passes.weight_quant")



def cmd_info(args) -> int:
    """Family, preset match, parameter count, layers, heads and lambda values of a checkpoint."""
    given = Path(args.ckpt) if args.ckpt else None
    if given is not None and (given.suffix in (".onnx", ".engine", ".plan") or (given / "genai_config.json").is_file()):
        what, model = (("a KV-cache export folder", given / "model.onnx") if given.is_dir()
                       else ("an exported model", given))
        raise DiffExportError(f"{given} is {what}, not a checkpoint: `diffexport inspect {model}` describes it "
                              "(info describes checkpoints and presets)")
    # A preset alone is described from shapes (meta device): no need to allocate 13B random weights.
    only_preset = args.ckpt is None and args.config is None
    print(model_summary.describe(load_named_model(args, device="meta" if only_preset else "cpu")))
    return 0


def cmd_presets(args) -> int:
    """List the model zoo's presets; `presets NAME -o DIR` writes a trained one as a Hugging Face folder."""
    if args.name is not None or args.output is not None:
        if args.name is None or args.output is None:
            raise DiffExportError("give both the preset and the folder: diffexport presets NAME -o DIR")
        folder = presets.write_preset_folder(args.name, args.output, replace=args.force)
        print(f"wrote         {folder}/ ({args.name}: a Hugging Face DiffLlama folder with its tokenizer)")
        return 0
    for name, entry in presets.all_presets().items():
        trained = "trained" if "weights" in entry else "random"
        print(f"{name:18s} {entry['family']:12s} {trained:8s} {entry['description']}")
    return 0


def _export_options(args):
    dtype = "float16" if args.fp16 else "bfloat16" if args.bf16 else "float32"
    return export_package.ExportOptions(dtype=dtype, body_style=args.body, opset=args.opset, hidden=args.hidden,
                         external_data=True if args.external_data else None, legacy=args.legacy, force=args.force)


def cmd_onnx(args) -> int:
    """Export a DIFF checkpoint to ONNX: one DiffAttention node per attention, runnable in ONNX Runtime and TensorRT."""

    require_model_source(args)  # the model is asked for before the output is looked at
    options = _export_options(args)
    output_name = ("model-kv" if args.kv_cache else "model.onnx") if args.output is None else args.output
    refuse_output_over_inputs(output_name, [args.ckpt, args.config] + ([args.tokenizer] if args.kv_cache else []))
    if args.kv_cache:
        output = "model-kv" if args.output is None else args.output
        decoder_export.check_target(Path(output), options, args.context_length, args.threads,
                     # before loading
                     args.attention or decoders.default_format(args.provider, options.dtype), args.provider)
        loaded = load_named_model(args, dtype=options.dtype, default_model=False)
        summary = decoder_formats.export_decoder(loaded, output, options, tokenizer=args.tokenizer,
                                                 context_length=args.context_length, threads=args.threads,
                                                 attention=args.attention, provider=args.provider, log=log_line)
        print(summary.report())
        return 0
    if args.tokenizer or args.context_length or args.threads or args.attention or args.provider:
        raise DiffExportError("--tokenizer, --context-length, --threads, --attention and --provider belong to "
                              "--kv-cache "
                              "exports")
    output = "model.onnx" if args.output is None else args.output
    exporter.check_target(Path(output), options)  # before loading a possibly big checkpoint
    loaded = load_named_model(args, dtype=options.dtype, default_model=False)
    summary = export_package.export_onnx(loaded, output, options, log=log_line)
    print(summary.report())
    return 0


def cmd_optimize(args) -> int:
    """Fuse differential attention written in standard ops (e.g. a plain torch.onnx export) into DiffAttention nodes."""
    result = optimize.optimize_file(args.model, args.output, expect_fused=args.expect_fused, lower=args.lower,
                           body=args.body, force=args.force)
    report = result.report
    fired = ", ".join(f"{rule} {count}" for rule, count in report.fired.items())
    print(f"fused         {report.total} differential attention(s) ({fired})")
    if result.absorbed:
        print(f"absorbed      {result.absorbed} head-norm epilogue(s) into the fused nodes")
    if result.max_abs is not None:
        note = "" if result.verified_batch == 2 else " (batch 1 only: the input graph fails at batch 2)"
        print(f"verified      onnxruntime outputs before vs after: max abs {result.max_abs:.2e}{note}")
    if result.lowered:
        print(f"lowered       {result.lowered} DiffAttention node(s) to standard ops ({args.body} body)")
    if args.verbose or report.total == 0:
        for miss in report.misses:
            print(f"not fused     {miss}")
    print(f"wrote         {args.output}")
    return 0


def quantized_output(model: str, recipe: str) -> Path:
    """quantize's default output: beside the model, its name and the recipe (model.onnx ->
    model-int4.onnx, the folder kv -> kv-int4)."""
    source = Path(model)
    if source.suffix == ".onnx":
        return source.with_name(f"{source.stem}-{recipe}.onnx")
    return source.with_name(f"{source.name.rstrip('/') or 'model'}-{recipe}")


def cmd_quantize(args) -> int:
    """Quantise an export: INT4/INT8 MatMulNBits weights for ONNX Runtime and onnxruntime-genai (--weights), or a
    calibrated INT8/FP8 Q/DQ graph for TensorRT (--qdq)."""
    cache_alone = bool(args.kv_cache and args.weights is None and not args.qdq and diff_kv_cache.takes(args.model))
    if args.output is None:
        args.output = quantized_output(args.model, f"qdq-{args.qdq}" if args.qdq else "kv8" if cache_alone else
                                       (args.weights or "int4") + ("-kv8" if args.kv_cache else ""))
    if args.qdq:
        given = [flag for flag, value in (("--weights", args.weights), ("--block-size", args.block_size),
                                          ("--method", args.method), ("--asymmetric", args.asymmetric or None),
                                          ("--accuracy-level", args.accuracy_level), ("--kv-cache", args.kv_cache))
                 if value is not None]
        if given:
            raise DiffExportError(f"{', '.join(given)} belong to weight-only quantisation (--weights), not --qdq")
        options = qdq.QDQOptions(format=args.qdq, calib=args.calib, tokenizer=args.tokenizer,
                                 samples=args.calib_samples, seq_len=args.calib_seq_len, seed=args.seed,
                                 force=args.force)
        print("\n".join(qdq.quantize_qdq(args.model, args.output, options).lines()))
        return 0

    if cache_alone:
        given = [flag for flag, value in (("--block-size", args.block_size), ("--method", args.method),
                                          ("--asymmetric", args.asymmetric or None),
                                          ("--accuracy-level", args.accuracy_level)) if value is not None]
        if given:
            raise DiffExportError(f"{', '.join(given)} belong to weight-only quantisation (--weights); a "
                                  "DiffAttention folder's --kv-cache quantises its cache alone")
        options = diff_kv_cache.KvCacheOptions(format=args.kv_cache, calib=args.calib, tokenizer=args.tokenizer,
                                               samples=args.calib_samples, seq_len=args.calib_seq_len, seed=args.seed,
                                               force=args.force)
        print("\n".join(diff_kv_cache.quantize_kv_cache(args.model, args.output, options).lines()))
        return 0
    options = weight_quant.WeightQuantOptions(bits=int((args.weights or "int4").removeprefix("int")),
                                 block_size=32 if args.block_size is None else args.block_size,
                                 method=args.method or "rtn", symmetric=not args.asymmetric,
                                 accuracy_level=4 if args.accuracy_level is None else args.accuracy_level,
                                 calib=args.calib, tokenizer=args.tokenizer, samples=args.calib_samples,
                                 seq_len=args.calib_seq_len, seed=args.seed, force=args.force, kv_cache=args.kv_cache)
    print("\n".join(weight_quant.quantize_weights(args.model, args.output, options).lines()))
    return 0


def cmd_inspect(args) -> int:
    """Describe an ONNX file: opsets, I/O shapes, node histogram, DiffAttention nodes, weights, runnable where."""
    info = inspect_onnx.inspect_onnx(args.model)
    print(inspect_onnx.to_json(info) if args.json else inspect_onnx.render(info))
    return 0


def cmd_demo(args) -> int:
    """The main job on the built-in model (the zoo's trained diff-text-tiny): export to ONNX, run it in ONNX Runtime
    (CPU), check against eager.

    Prints the model summary, the op-vs-Eq.-1 self-check, the export summary and the check report,
    then exports the KV-cache decoder folder, generates from a text prompt and checks the folder.
    The files stay in --out-dir (default ./diffexport-demo), so the polygraphy commands it prints run.
    """
    loaded = load_named_model(args, default_preset=demo.DEMO_PRESET)
    passed = demo.run_demo(loaded, args.out_dir, seed=args.seed, show=print, log=log_line)
    log_line(f"kept          {Path(args.out_dir)}/: the demo's files, which the commands above read")
    return 0 if passed else 1


def _onnx_arguments(p: argparse.ArgumentParser) -> None:
    add_force(p)
    add_model_source(p)
    p.add_argument("-o", "--output", help="output .onnx path (default model.onnx), or with --kv-cache "
                                          "a new folder (default model-kv)")
    p.add_argument("--kv-cache", action="store_true",
                   help="KV-cache decoder folder for onnxruntime-genai: model.onnx with past/present, "
                        "genai_config.json, tokenizer")
    p.add_argument("--tokenizer", help="with --kv-cache: tokenizer folder to copy (HF folders: their own)")
    p.add_argument("--context-length", type=int,
                   help="with --kv-cache: context length for genai (default: the HF config's, else 2048)")
    p.add_argument("--threads", type=int,
                   help="with --kv-cache: intra-op threads written into genai_config.json (default: none "
                        "written; diffexport's generate and check then use the machine's physical cores, "
                        "where onnxruntime-genai alone would use one thread)")
    p.add_argument("--attention", choices=list(decoders.FORMATS),
                   help="with --kv-cache: gqa (onnxruntime's GroupQueryAttention on a shared cache buffer: the "
                        "faster decode in onnxruntime; the default for the CPU provider) or diffattention (one "
                        "DiffAttention node per layer, runs in onnxruntime and TensorRT; the default for "
                        "--provider cuda and --bf16, and what `diffexport trt` builds from)")
    p.add_argument("--provider", choices=["cpu", "cuda"],
                   help="with --kv-cache: the execution provider genai_config.json names for onnxruntime-genai "
                        "(default: cpu; cuda for --bf16, which the CPU provider cannot run)")
    precision = p.add_mutually_exclusive_group()
    precision.add_argument("--fp16", action="store_true", help="float16 weights and activations")
    precision.add_argument("--bf16", action="store_true", help="bfloat16 weights and activations")
    p.add_argument("--body", default="decomposed", choices=["decomposed", "attention"],
                   help="DiffAttention function body for ONNX Runtime: decomposed MatMul/Softmax "
                        "(opset 18, default) or opset-23 Attention")
    p.add_argument("--opset", type=int, help="default-domain opset (default: 18, or 23 for --body attention)")
    p.add_argument("--hidden", action="store_true", help="also output last_hidden_state")
    p.add_argument("--external-data", action="store_true",
                   help="weights in model.onnx.data (automatic above the 2 GiB protobuf limit)")
    p.add_argument("--legacy", action="store_true",
                   help="fallback: torch's deprecated TorchScript exporter instead of dynamo")


def _optimize_arguments(p: argparse.ArgumentParser) -> None:
    add_force(p)
    p.add_argument("model", help="input .onnx")
    p.add_argument("-o", "--output", required=True, help="output .onnx")
    p.add_argument("--expect-fused", type=int, help="exit non-zero when fewer attentions are fused")
    p.add_argument("--verbose", action="store_true", help="say why each candidate was not fused")
    p.add_argument("--lower", action="store_true",
                   help="then replace DiffAttention nodes by standard ops (runtimes without functions)")
    p.add_argument("--body", default="decomposed", choices=["decomposed", "attention"],
                   help="function body / lowering style (attention needs opset 23)")


def _quantize_arguments(p: argparse.ArgumentParser) -> None:
    add_force(p)
    p.add_argument("model", help="an .onnx file written by `diffexport onnx`, or a --kv-cache folder")
    p.add_argument("-o", "--output", help="the quantised .onnx, or a new folder for a folder (default: beside "
                                          "the model, named after it and the recipe: model-int4.onnx, kv-int4)")
    p.add_argument("--weights", choices=["int4", "int8"], help="weight-only bits (the default: int4)")
    p.add_argument("--block-size", type=int, help="--weights: weights per scale: 16, 32 (default), 64, "
                                                  "128 or 256")
    p.add_argument("--method", choices=["rtn", "hqq", "gptq"],
                   help="--weights: rtn, round to nearest (default); hqq, half-quadratic; gptq, calibrated "
                        "on --calib (hqq and gptq: int4 only)")
    p.add_argument("--asymmetric", action="store_true", help="--weights: a zero point per block")
    p.add_argument("--accuracy-level", type=int, choices=[0, 1, 2, 3, 4],
                   help="--weights: MatMulNBits compute type: 4 = int8 activations, ONNX Runtime's fast CPU "
                        "path (default); 0 = its default (fp32)")
    p.add_argument("--kv-cache", choices=["int8"],
                   help="the cache as int8, one calibrated scale per channel (needs --calib): on a gqa folder (the "
                        "CPU default) with --weights, GroupQueryAttention's cache; alone, on a DiffAttention folder "
                        "(--attention diffattention, for TensorRT), op version 3, whose plugin reads the codes "
                        "(half an fp16 cache's bytes)")
    p.add_argument("--qdq", choices=["int8", "fp8"],
                   help="instead: a calibrated Q/DQ graph for TensorRT (weights and matmul activations)")
    p.add_argument("--calib", metavar="TEXTFILE|synthetic",
                   help="calibration data of --qdq and --method gptq: a UTF-8 text file, or 'synthetic' "
                        "(seeded token ids)")
    p.add_argument("--tokenizer", help="--calib: Hugging Face tokenizer (folder or hub name); without it "
                                       "the text's bytes are the token ids")
    p.add_argument("--calib-samples", type=int, default=32, help="--calib: sequences (default 32)")
    p.add_argument("--calib-seq-len", type=int, default=128, help="--calib: tokens per sequence (default 128)")
    p.add_argument("--seed", type=int, default=0, help="--calib synthetic: seed of the token ids")


def _inspect_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("model", help="an .onnx file or a --kv-cache folder (weights are not loaded)")
    p.add_argument("--json", action="store_true", help="machine-readable output")


def _demo_arguments(p: argparse.ArgumentParser) -> None:
    add_model_source(p)
    p.add_argument("--out-dir", default="diffexport-demo",
                   help="folder for the demo's files, kept so the commands it prints run (default diffexport-demo)")


def _info_arguments(p: argparse.ArgumentParser) -> None:
    add_model_source(p)


def _presets_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("name", nargs="?", help="with -o: a trained preset to write out")
    p.add_argument("-o", "--output", help="write the trained preset NAME to this new folder, as a Hugging "
                                          "Face DiffLlama folder (config, safetensors, tokenizer, chat template)")
    add_force(p)


COMMANDS = [Command("onnx", cmd_onnx, _onnx_arguments), Command("optimize", cmd_optimize, _optimize_arguments),
            Command("quantize", cmd_quantize, _quantize_arguments,
                    missing_input="{} does not exist: give an exported .onnx file or a --kv-cache folder"),
            Command("inspect", cmd_inspect, _inspect_arguments), Command("demo", cmd_demo, _demo_arguments),
            Command("info", cmd_info, _info_arguments), Command("presets", cmd_presets, _presets_arguments)]
