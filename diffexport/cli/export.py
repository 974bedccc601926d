"""`diffexport info`, `presets`, `onnx`, `optimize`, `quantize`, `inspect` and `demo`: their options and printing.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from diffexport.cli.common import add_force, add_model_source, load_named_model, log_line, require_model_source
from diffexport.core.errors import DiffExportError  # light: no torch
from diffexport.core.files import refuse_output_over_inputs  # light: os and pathlib
from diffexport.format import decoders  # light too: the decoder formats' registry

DEMO_PRESET = "diff-text-tiny"  # the demo's model when none is named: the zoo's trained text model
DEMO_PROMPT = "def fibonacci(n):"  # it was trained on Python source
DEMO_NEW_TOKENS = 24


def cmd_info(args) -> int:
    """Family, preset match, parameter count, layers, heads and lambda values of a checkpoint."""
    from diffexport.modeling.summary import describe

    given = Path(args.ckpt) if args.ckpt else None
    if given is not None and (given.suffix in (".onnx", ".engine", ".plan") or (given / "genai_config.json").is_file()):
        what, model = ("a KV-cache export folder", given / "model.onnx") if given.is_dir() else ("an exported model", given)
        raise DiffExportError(f"{given} is {what}, not a checkpoint: `diffexport inspect {model}` describes it "
                              "(info describes checkpoints and presets)")
    # A preset alone is described from shapes (meta device): no need to allocate 13B random weights.
    only_preset = args.ckpt is None and args.config is None
    print(describe(load_named_model(args, device="meta" if only_preset else "cpu")))
    return 0


def cmd_presets(args) -> int:
    """List the model zoo's presets; `presets NAME -o DIR` writes a trained one as a Hugging Face folder."""
    from diffexport.modeling.presets import all_presets, write_preset_folder

    if args.name is not None or args.output is not None:
        if args.name is None or args.output is None:
            raise DiffExportError("give both the preset and the folder: diffexport presets NAME -o DIR")
        folder = write_preset_folder(args.name, args.output, replace=args.force)
        print(f"wrote         {folder}/ ({args.name}: a Hugging Face DiffLlama folder with its tokenizer)")
        return 0
    for name, entry in all_presets().items():
        trained = "trained" if "weights" in entry else "random"
        print(f"{name:18s} {entry['family']:12s} {trained:8s} {entry['description']}")
    return 0


def _export_options(args):
    from diffexport.export import ExportOptions

    dtype = "float16" if args.fp16 else "bfloat16" if args.bf16 else "float32"
    return ExportOptions(dtype=dtype, body_style=args.body, opset=args.opset, hidden=args.hidden,
                         external_data=True if args.external_data else None, legacy=args.legacy, force=args.force)


def cmd_onnx(args) -> int:
    """Export a DIFF checkpoint to ONNX: one DiffAttention node per attention, runnable in ONNX Runtime and TensorRT."""

    from diffexport.export import export_onnx
    from diffexport.export.exporter import check_target

    require_model_source(args)  # the model is asked for before the output is looked at
    options = _export_options(args)
    output_name = ("model-kv" if args.kv_cache else "model.onnx") if args.output is None else args.output
    refuse_output_over_inputs(output_name, [args.ckpt, args.config] + ([args.tokenizer] if args.kv_cache else []))
    if args.kv_cache:
        from diffexport.export.decoder import check_target as check_folder
        from diffexport.passes.decoder_formats import export_decoder

        output = "model-kv" if args.output is None else args.output
        check_folder(Path(output), options, args.context_length, args.threads,
                     args.attention or decoders.default_format(args.provider, options.dtype), args.provider)  # before loading
        loaded = load_named_model(args, dtype=options.dtype, default_model=False)
        summary = export_decoder(loaded, output, options, tokenizer=args.tokenizer, context_length=args.context_length,
                                 threads=args.threads, attention=args.attention, provider=args.provider, log=log_line)
        print(summary.report())
        return 0
    if args.tokenizer or args.context_length or args.threads or args.attention or args.provider:
        raise DiffExportError("--tokenizer, --context-length, --threads, --attention and --provider belong to --kv-cache "
                              "exports")
    output = "model.onnx" if args.output is None else args.output
    check_target(Path(output), options)  # before loading a possibly big checkpoint
    loaded = load_named_model(args, dtype=options.dtype, default_model=False)
    summary = export_onnx(loaded, output, options, log=log_line)
    print(summary.report())
    return 0


def cmd_optimize(args) -> int:
    """Fuse differential attention written in standard ops (e.g. a plain torch.onnx export) into DiffAttention nodes."""
    from diffexport.passes.optimize import optimize_file

    result = optimize_file(args.model, args.output, expect_fused=args.expect_fused, lower=args.lower,
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
    """Quantise an export: INT4/INT8 MatMulNBits weights for ONNX Runtime and onnxruntime-genai (--weights), or a calibrated INT8/FP8 Q/DQ graph for TensorRT (--qdq)."""
    if args.output is None:
        args.output = quantized_output(args.model, f"qdq-{args.qdq}" if args.qdq else
                                       (args.weights or "int4") + ("-kv8" if args.kv_cache else ""))
    if args.qdq:
        from diffexport.passes.qdq import QDQOptions, quantize_qdq

        given = [flag for flag, value in (("--weights", args.weights), ("--block-size", args.block_size),
                                          ("--method", args.method), ("--asymmetric", args.asymmetric or None),
                                          ("--accuracy-level", args.accuracy_level), ("--kv-cache", args.kv_cache))
                 if value is not None]
        if given:
            raise DiffExportError(f"{', '.join(given)} belong to weight-only quantisation (--weights), not --qdq")
        options = QDQOptions(format=args.qdq, calib=args.calib, tokenizer=args.tokenizer, samples=args.calib_samples,
                             seq_len=args.calib_seq_len, seed=args.seed, force=args.force)
        print("\n".join(quantize_qdq(args.model, args.output, options).lines()))
        return 0
    from diffexport.passes.weight_quant import WeightQuantOptions, quantize_weights

    options = WeightQuantOptions(bits=int((args.weights or "int4").removeprefix("int")),
                                 block_size=32 if args.block_size is None else args.block_size,
                                 method=args.method or "rtn", symmetric=not args.asymmetric,
                                 accuracy_level=4 if args.accuracy_level is None else args.accuracy_level,
                                 calib=args.calib, tokenizer=args.tokenizer, samples=args.calib_samples,
                                 seq_len=args.calib_seq_len, seed=args.seed, force=args.force, kv_cache=args.kv_cache)
    print("\n".join(quantize_weights(args.model, args.output, options).lines()))
    return 0


def cmd_inspect(args) -> int:
    """Describe an ONNX file: opsets, I/O shapes, node histogram, DiffAttention nodes, weights, runnable where."""
    from diffexport.validation.inspect_onnx import inspect_onnx, render, to_json

    info = inspect_onnx(args.model)
    print(to_json(info) if args.json else render(info))
    return 0


def cmd_demo(args) -> int:
    """The main job on the built-in model (the zoo's trained diff-text-tiny): export to ONNX, run it in ONNX Runtime (CPU), check against eager.

    Prints the model summary, the op-vs-Eq.-1 self-check, the export summary and the check report,
    then exports the KV-cache decoder folder, generates from a text prompt and checks the folder.
    The files stay in --out-dir (default ./diffexport-demo), so the polygraphy commands it prints run.
    """
    from pathlib import Path

    from diffexport.export import ExportOptions, export_onnx
    from diffexport.modeling.summary import describe, self_check
    from diffexport.validation.options import CheckOptions
    from diffexport.validation.prefill import run_check

    loaded = load_named_model(args, default_preset=DEMO_PRESET)
    print(describe(loaded))
    op_ok, op_report = self_check(loaded.model, seed=args.seed)  # the op vs eager Eq. 1, before exporting it
    print(op_report)
    out_dir = Path(args.out_dir)
    summary = export_onnx(loaded, out_dir / "model.onnx", ExportOptions(force=_earlier_demo_export(out_dir)),
                          log=log_line)
    print(summary.report())
    report = run_check(summary.path, loaded, CheckOptions(provider="cpu", seed=args.seed), log=log_line)
    print(report.text())
    kv_ok = _demo_generation(loaded, out_dir, args.seed)
    passed = report.passed and op_ok and kv_ok
    log_line(f"kept          {out_dir}/: the demo's files, which the commands above read")
    return 0 if passed else 1


def _earlier_demo_export(out_dir: Path) -> bool:
    """Whether out_dir's model.onnx is an export of ours (an earlier demo's), which the demo replaces."""
    from diffexport.format.metadata import read_export_metadata

    path = out_dir / "model.onnx"
    if path.is_symlink() or not path.is_file():
        return False
    try:
        read_export_metadata(path)
    except DiffExportError:
        return False
    return True


def _demo_generation(loaded, out_dir, seed: int) -> bool:
    """The demo's second half: the KV-cache decoder folder, generated through onnxruntime-genai
    (from a text prompt where the model has a tokenizer), compared with eager generate, checked."""
    import shutil

    import torch

    from diffexport.backends import decoding, genai
    from diffexport.core.eager_generation import Sampling, generate
    from diffexport.export.decoder import export_decoder_graph
    from diffexport.format import decoder_folder, names
    from diffexport.generation import text_generation
    from diffexport.validation.decoder import run_decoder_check
    from diffexport.validation.options import CheckOptions

    folder = out_dir / "model-kv"
    if folder.exists():  # replaced only when it holds nothing but an earlier demo's files
        ours = {names.MODEL_FILE, names.MODEL_FILE + ".data", names.GENAI_CONFIG, "README.md",
                *decoder_folder.TOKENIZER_FILES}
        if folder.is_symlink() or not folder.is_dir() or not {p.name for p in folder.iterdir()} <= ours:
            raise DiffExportError(f"{folder} exists and is not an earlier demo's output: move it or pick --out-dir")
        shutil.rmtree(folder)
    summary = export_decoder_graph(loaded, folder, log=log_line)
    print(summary.report())
    tokenizer = None
    if decoder_folder.has_tokenizer(folder):
        tokenizer = text_generation.folder_tokenizer(folder)
        prompt = text_generation.encode(tokenizer, folder, DEMO_PROMPT)
    else:
        prompt = [1, 2, 3, 4, 5, 6, 7, 8]
    try:
        run = genai.generate_genai(folder, prompt, DEMO_NEW_TOKENS, Sampling())
        backend = "onnxruntime-genai"
    except DiffExportError:  # onnxruntime-genai missing: the plain loop, said so
        run = decoding.generate_onnxruntime(folder, prompt, DEMO_NEW_TOKENS, Sampling())
        backend = "onnxruntime loop (onnxruntime-genai not installed)"

    eager = generate(loaded.model, torch.tensor([prompt]), max_new_tokens=len(run.tokens)).tokens[0].tolist()
    same = eager == run.tokens
    if tokenizer is not None:
        print(f"prompt        {DEMO_PROMPT!r}\ngenerated     {tokenizer.decode(run.tokens)!r}")
    print(f"generate      {backend}: {len(prompt)} prompt tokens -> {run.tokens} "
          f"({run.decode_tokens_per_s:.0f} tokens/s); eager generate {'identical' if same else 'DIFFERENT'}")
    report = run_decoder_check(folder, loaded, CheckOptions(provider="cpu", seed=seed), log=log_line)
    print(report.text())
    return same and report.passed


def add_arguments(name: str, p: argparse.ArgumentParser) -> None:
    """The options of command `name` (one of this module's)."""
    if name in ('optimize', 'quantize', 'onnx'):
        add_force(p)
    if name == "optimize":
        p.add_argument("model", help="input .onnx")
        p.add_argument("-o", "--output", required=True, help="output .onnx")
        p.add_argument("--expect-fused", type=int, help="exit non-zero when fewer attentions are fused")
        p.add_argument("--verbose", action="store_true", help="say why each candidate was not fused")
        p.add_argument("--lower", action="store_true",
                       help="then replace DiffAttention nodes by standard ops (runtimes without functions)")
        p.add_argument("--body", default="decomposed", choices=["decomposed", "attention"],
                       help="function body / lowering style (attention needs opset 23)")
    if name == "quantize":
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
                       help="with --weights, on a gqa folder (the CPU default): GroupQueryAttention's cache as int8, "
                            "one calibrated scale per channel (needs --calib); a quarter of a float32 cache's bytes")
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
    if name == "presets":
        p.add_argument("name", nargs="?", help="with -o: a trained preset to write out")
        p.add_argument("-o", "--output", help="write the trained preset NAME to this new folder, as a Hugging "
                                              "Face DiffLlama folder (config, safetensors, tokenizer, chat template)")
        add_force(p)
    if name == "inspect":
        p.add_argument("model", help="an .onnx file or a --kv-cache folder (weights are not loaded)")
        p.add_argument("--json", action="store_true", help="machine-readable output")
    if name in ("info", "demo", "onnx"):
        add_model_source(p)
    if name == "onnx":
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
    if name == "demo":
        p.add_argument("--out-dir", default="diffexport-demo",
                       help="folder for the demo's files, kept so the commands it prints run (default diffexport-demo)")
