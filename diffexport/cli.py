"""The `diffexport` command line. Heavy modules load inside the commands, so --help stays fast.

Every failure the user can fix prints one line `error: ...` and exits with 2.
Set DIFFEXPORT_DEBUG=1 to see tracebacks.
"""

from __future__ import annotations

import argparse
import os
import sys

from diffexport.errors import DiffExportError  # light: no torch
from diffexport.format import decoders  # light too: the decoder formats' registry


def _add_model_source(parser: argparse.ArgumentParser, positional: bool = True) -> None:
    if positional:
        parser.add_argument("ckpt", nargs="?",
                            help="ckpt.pt, a .safetensors file, a diffexport or Hugging Face DiffLlama directory, "
                                 "or a bare state dict (with --preset/--config)")
    parser.add_argument("--preset", help="a model zoo preset (see `diffexport presets`); alone: a seeded random model")
    parser.add_argument("--config", help="JSON {family, config} for a bare state dict")
    parser.add_argument("--layout", default="auto", choices=["auto", "native", "unilm"],
                        help="weight naming/layout of a bare state dict (default: detect)")
    parser.add_argument("--seed", type=int, default=0, help="seed for random preset weights")


def _load(args, device: str = "cpu", dtype: str | None = None, default_model: bool = True):
    """The model the arguments name; with none named, the default preset (or an error where a
    silent random model would surprise: export and check)."""
    import torch

    from diffexport.checkpoint import load_config_file, load_model
    from diffexport.errors import DiffExportError
    from diffexport.presets import DEFAULT_PRESET

    config = load_config_file(args.config) if args.config else None
    preset = args.preset
    if args.ckpt is None and preset is None and config is None:
        if not default_model:
            raise DiffExportError(f"name the model: a checkpoint{' (--ckpt)' if args.command == 'check' else ''} "
                                  f"or --preset NAME (e.g. --preset {DEFAULT_PRESET} for a seeded random model)")
        preset = DEFAULT_PRESET

    return load_model(args.ckpt, preset=preset, config=config, layout=args.layout, seed=args.seed,
                      device=device, dtype=getattr(torch, dtype) if dtype else None)


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


def _export_options(args):
    from diffexport.export import ExportOptions

    dtype = "float16" if args.fp16 else "bfloat16" if args.bf16 else "float32"
    return ExportOptions(dtype=dtype, body_style=args.body, opset=args.opset, hidden=args.hidden,
                         external_data=True if args.external_data else None, legacy=args.legacy)


def _log(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def cmd_onnx(args) -> int:
    """Export a DIFF checkpoint to ONNX: one DiffAttention node per attention, runnable in ONNX Runtime and TensorRT."""
    from pathlib import Path

    from diffexport.export import export_onnx
    from diffexport.export.exporter import check_target

    options = _export_options(args)
    if args.kv_cache:
        from diffexport.export.decoder import check_target as check_folder, export_decoder

        output = "model-kv" if args.output is None else args.output
        attention = args.attention or decoders.DEFAULT
        check_folder(Path(output), options, args.context_length, args.threads, attention, args.provider)  # before loading
        loaded = _load(args, dtype=options.dtype, default_model=False)
        summary = export_decoder(loaded, output, options, tokenizer=args.tokenizer, context_length=args.context_length,
                                 threads=args.threads, attention=attention, provider=args.provider, log=_log)
        print(summary.report())
        return 0
    if args.tokenizer or args.context_length or args.threads or args.attention or args.provider:
        raise DiffExportError("--tokenizer, --context-length, --threads, --attention and --provider belong to --kv-cache "
                              "exports")
    output = "model.onnx" if args.output is None else args.output
    check_target(Path(output), options)  # before loading a possibly big checkpoint
    loaded = _load(args, dtype=options.dtype, default_model=False)
    summary = export_onnx(loaded, output, options, log=_log)
    print(summary.report())
    return 0


def _check_options(args, folder_config: dict | None = None):
    from pathlib import Path

    from diffexport.validation import DEFAULT_SHAPES, CheckOptions, parse_shapes

    from diffexport.errors import DiffExportError

    for flag, value in (("--atol", args.atol), ("--rtol", args.rtol)):
        if value is not None and not (value >= 0 and value != float("inf")):
            raise DiffExportError(f"{flag} must be a finite number >= 0, got {value}")
    return CheckOptions(shapes=parse_shapes(args.shapes) if args.shapes else DEFAULT_SHAPES,
                        provider=args.provider, seed=args.seed,
                        save_dir=Path(args.save_dir) if args.save_dir else None, atol=args.atol, rtol=args.rtol,
                        reference=args.reference, plugin_lib=args.plugin_lib, text=args.text, tokenizer=args.tokenizer,
                        plot=args.plot, beams=_check_beams(args), **_check_sampling(args, folder_config))


def _check_sampling(args, folder_config: dict | None) -> dict:
    """check's --sample: CheckOptions' sampling and draws. A folder whose search samples (its
    checkpoint's generation_config) gives the defaults, as it does to generate; the options override."""
    from diffexport.export.decoder import folder_search
    from diffexport.generation import Sampling

    given = [flag for flag, value in (("--temperature", args.temperature), ("--top-k", args.top_k),
                                      ("--top-p", args.top_p), ("--repetition-penalty", args.repetition_penalty),
                                      ("--draws", args.draws)) if value is not None]
    if not args.sample:
        if given:
            raise DiffExportError(f"{given[0]} shapes the sampling check: add --sample")
        return {}
    draws = 2000 if args.draws is None else args.draws  # checked with the other options (check_decode_options)
    search = folder_search(folder_config) if folder_config is not None else {"do_sample": False}
    taken = []

    def pick(given, key: str, own):
        if given is not None or not search["do_sample"]:
            return own if given is None else given
        if search[key] != own:
            taken.append(f"{key.replace('_', ' ')} {search[key]}")
        return search[key]

    sampling = Sampling(greedy=False, temperature=pick(args.temperature, "temperature", 1.0),
                        top_k=pick(args.top_k, "top_k", 0), top_p=pick(args.top_p, "top_p", 1.0), seed=args.seed,
                        repetition_penalty=pick(args.repetition_penalty, "repetition_penalty", 1.0))
    if taken:
        _log(f"from the folder's genai_config.json search: {', '.join(taken)} (the options override it)")
    return {"sampling": sampling, "draws": draws}


def _check_beams(args):
    """check's --num-beams: every hypothesis of N beams is compared (as many returned as beams)."""
    from diffexport.generation import BeamSearch

    if args.num_beams is None:
        if args.length_penalty is not None or args.no_early_stopping:
            raise DiffExportError("--length-penalty and --no-early-stopping shape a beam search: add --num-beams N")
        return None
    return BeamSearch(num_beams=args.num_beams, num_return_sequences=args.num_beams,
                      length_penalty=1.0 if args.length_penalty is None else args.length_penalty,
                      early_stopping=not args.no_early_stopping)


def _load_for_check(args, meta: dict, path) -> object:
    """check's model. A preset or --config without a checkpoint is first held to the export's
    configuration on shapes alone: a wrong preset is one line before its random weights are built
    (a 13B preset would not even fit this machine's memory to find that out)."""
    from pathlib import Path

    from diffexport.validation import check_same_config

    if args.ckpt is None and (args.preset is not None or args.config is not None):
        check_same_config(meta, _load(args, device="meta", default_model=False).config, Path(path))
    return _load(args, default_model=False)


def cmd_check(args) -> int:
    """Run an exported ONNX model in ONNX Runtime (or a TensorRT .engine on the GPU) against the eager PyTorch model; non-zero exit on mismatch."""
    from diffexport.validation.artifact import check_artifact

    with_model = not (args.against and args.ckpt is None and args.preset is None and args.config is None)
    reports = check_artifact(args.model, lambda folder_config: _check_options(args, folder_config),
                             (lambda meta: _load_for_check(args, meta, args.model)) if with_model else None,
                             against=args.against, steps=args.steps, shapes_given=bool(args.shapes), plot=args.plot is not None,
                             sample=args.sample, num_beams=args.num_beams, log=_log)
    for report in reports:
        print(report.text())
    return 0 if all(report.passed for report in reports) else 1


def cmd_optimize(args) -> int:
    """Fuse differential attention written in standard ops (e.g. a plain torch.onnx export) into DiffAttention nodes."""
    from diffexport.passes.optimize import optimize_file

    result = optimize_file(args.model, args.output, expect_fused=args.expect_fused, lower=args.lower,
                           body=args.body)
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


def cmd_quantize(args) -> int:
    """Quantise an export: INT4/INT8 MatMulNBits weights for ONNX Runtime and onnxruntime-genai (--weights), or a calibrated INT8/FP8 Q/DQ graph for TensorRT (--qdq)."""
    if args.qdq:
        from diffexport.passes.qdq import QDQOptions, quantize_qdq

        given = [flag for flag, value in (("--weights", args.weights), ("--block-size", args.block_size),
                                          ("--method", args.method), ("--asymmetric", args.asymmetric or None),
                                          ("--accuracy-level", args.accuracy_level)) if value is not None]
        if given:
            raise DiffExportError(f"{', '.join(given)} belong to weight-only quantisation (--weights), not --qdq")
        options = QDQOptions(format=args.qdq, calib=args.calib, tokenizer=args.tokenizer, samples=args.calib_samples,
                             seq_len=args.calib_seq_len, seed=args.seed)
        print("\n".join(quantize_qdq(args.model, args.output, options).lines()))
        return 0
    from diffexport.passes.weight_quant import WeightQuantOptions, quantize_weights

    options = WeightQuantOptions(bits=int((args.weights or "int4").removeprefix("int")),
                                 block_size=32 if args.block_size is None else args.block_size,
                                 method=args.method or "rtn", symmetric=not args.asymmetric,
                                 accuracy_level=4 if args.accuracy_level is None else args.accuracy_level,
                                 calib=args.calib, tokenizer=args.tokenizer, samples=args.calib_samples,
                                 seq_len=args.calib_seq_len, seed=args.seed)
    print("\n".join(quantize_weights(args.model, args.output, options).lines()))
    return 0


def cmd_inspect(args) -> int:
    """Describe an ONNX file: opsets, I/O shapes, node histogram, DiffAttention nodes, weights, runnable where."""
    from diffexport.inspect_onnx import inspect_onnx, render, to_json

    info = inspect_onnx(args.model)
    print(to_json(info) if args.json else render(info))
    return 0


def cmd_demo(args) -> int:
    """The main job on the built-in default model: export to ONNX, run it in ONNX Runtime (CPU), check against eager.

    Prints the model summary, the op-vs-Eq.-1 self-check, the export summary and the check report.
    """
    import shutil
    import tempfile
    from pathlib import Path

    from diffexport.validation import CheckOptions, run_check
    from diffexport.export import ExportOptions, export_onnx
    from diffexport.summary import describe, self_check

    loaded = _load(args)
    print(describe(loaded))
    op_ok, op_report = self_check(loaded.model, seed=args.seed)  # the op vs eager Eq. 1, before exporting it
    print(op_report)
    temporary = args.out_dir is None
    out_dir = Path(tempfile.mkdtemp(prefix="diffexport-demo-")) if temporary else Path(args.out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    passed = False
    try:
        summary = export_onnx(loaded, out_dir / "model.onnx", ExportOptions(), log=_log)
        print(summary.report())
        report = run_check(summary.path, loaded, CheckOptions(provider="cpu", seed=args.seed), log=_log)
        print(report.text())
        kv_ok = _demo_generation(loaded, out_dir, args.seed)
        passed = report.passed and op_ok and kv_ok
    finally:
        if temporary and passed:  # nothing worth keeping: the files were only the demo's means
            shutil.rmtree(out_dir, ignore_errors=True)
            _log(f"removed       {out_dir} (the demo's temporary files; --out-dir DIR keeps them)")
        elif temporary:
            _log(f"kept          {out_dir}: the demo did not pass, its files are there to inspect")
    return 0 if passed else 1


def _demo_generation(loaded, out_dir, seed: int) -> bool:
    """The demo's second half: the KV-cache decoder folder, generated through onnxruntime-genai, checked."""
    import shutil

    from diffexport.backends import decoding
    from diffexport.validation import CheckOptions, run_decoder_check
    from diffexport.export.decoder import export_decoder
    from diffexport.format import names
    from diffexport.generation import Sampling, generate

    folder = out_dir / "model-kv"
    if folder.exists():  # replaced only when it holds nothing but an earlier demo's files
        ours = {names.MODEL_FILE, names.MODEL_FILE + ".data", names.GENAI_CONFIG}
        if folder.is_symlink() or not folder.is_dir() or not {p.name for p in folder.iterdir()} <= ours:
            raise DiffExportError(f"{folder} exists and is not an earlier demo's output: move it or pick --out-dir")
        shutil.rmtree(folder)
    summary = export_decoder(loaded, folder, log=_log)
    print(summary.report())
    prompt = [1, 2, 3, 4, 5, 6, 7, 8]
    try:
        run = decoding.generate_genai(folder, prompt, 16, Sampling())
        backend = "onnxruntime-genai"
    except DiffExportError:  # onnxruntime-genai missing: the plain loop, said so
        run = decoding.generate_onnxruntime(folder, prompt, 16, Sampling())
        backend = "onnxruntime loop (onnxruntime-genai not installed)"
    import torch

    eager = generate(loaded.model, torch.tensor([prompt]), max_new_tokens=len(run.tokens)).tokens[0].tolist()
    same = eager == run.tokens
    print(f"generate      {backend}: prompt {prompt} -> {run.tokens} "
          f"({run.decode_tokens_per_s:.0f} tokens/s); eager generate {'identical' if same else 'DIFFERENT'}")
    report = run_decoder_check(folder, loaded, CheckOptions(provider="cpu", seed=seed), log=_log)
    print(report.text())
    return same and report.passed


def _prompt_ids(args, folder, config: dict) -> tuple[list[int], object]:
    """The prompt as token ids, and the tokenizer (None with --ids); config: the folder's genai config."""
    from diffexport.text_generation import prompt_ids

    return prompt_ids(folder, config, args.max_new_tokens, ids=args.ids, prompt=args.prompt, chat=args.chat,
                      system=args.system)


def _sampling(args, config: dict):
    """The draw: the command line's options over the folder's genai_config search values
    (text_generation.folder_sampling); what came from the folder is said on stderr."""
    from diffexport.text_generation import folder_sampling

    return folder_sampling(config, greedy=args.greedy, sample=args.sample, num_beams=args.num_beams,
                           temperature=args.temperature, top_k=args.top_k, top_p=args.top_p,
                           repetition_penalty=args.repetition_penalty, seed=args.seed, log=_log)


def _beam_search_options(args):
    """--num-beams and its options as a BeamSearch (None: no beam search)."""
    from diffexport.text_generation import beam_search_options

    return beam_search_options(args.num_beams, args.num_return_sequences, args.length_penalty,
                               not args.no_early_stopping, sample=args.sample,
                               repetition_penalty=args.repetition_penalty, stop=args.stop,
                               interactive=args.interactive,
                               batched=args.batch_size is not None or args.sort_by_length)


def _backend_options(args) -> dict:
    return dict(backend=args.backend, provider=args.provider, engine=args.engine, plugin_lib=args.plugin_lib)


def _generate_beams(args, folder, ids: list[int], tokenizer, search) -> int:
    """One prompt's beam search: the hypotheses once it ends, best first."""
    from diffexport.text_generation import beam_answers, beam_searcher

    searcher = beam_searcher(folder, search, [ids], len(ids) + args.max_new_tokens, **_backend_options(args))
    run = searcher(ids, search, args.max_new_tokens)
    for rank, answer in enumerate(beam_answers(tokenizer, run), 1):
        if search.num_return_sequences > 1:
            sys.stdout.write(f"--- hypothesis {rank} of {search.num_return_sequences} (stopped: {answer['stop']})\n")
        sys.stdout.write(answer["completion"] if tokenizer is not None else " ".join(map(str, answer["tokens"])))
        sys.stdout.write("\n")
    sys.stdout.flush()
    rate = run.steps * search.num_beams / run.seconds if run.seconds > 0 else float("nan")
    _log(f"{args.backend} beam search, {search.num_beams} beams: prompt {run.prompt_tokens} tokens, {run.steps} steps "
         f"in {run.seconds:.2f} s ({rate:.1f} beam tokens/s; best stopped: {run.stops[0]})")
    return 0


def _generate_file(args, folder, config: dict, sampling, search=None) -> int:
    """--prompts-file: one JSON line per prompt on stdout, in the file's order, each as soon as it
    and every earlier one are done (text_generation.answer_prompt_rows)."""
    import json

    from diffexport.text_generation import answer_prompt_rows, read_prompt_rows

    rows = read_prompt_rows(folder, config, args.prompts_file, args.max_new_tokens, chat=args.chat,
                            system=args.system, stop=args.stop)
    for answer in answer_prompt_rows(folder, config, rows, sampling, search=search, batch_size=args.batch_size,
                                     sort_by_length=args.sort_by_length, log=_log, **_backend_options(args)):
        sys.stdout.write(json.dumps(answer, ensure_ascii=False) + "\n")
        sys.stdout.flush()
    return 0


MAX_TURN_BYTES = 2**20  # a chat turn is text a person typed or piped: far below this


def _stdin_turn(number: int) -> str | None:
    """Line `number` of stdin without its newline (None at the end), read as bytes so that a line over
    MAX_TURN_BYTES is refused before more of it is read, and text that is not UTF-8 in one line."""
    raw = sys.stdin.buffer.readline(MAX_TURN_BYTES + 1)
    if not raw:
        return None
    if len(raw) > MAX_TURN_BYTES:
        raise DiffExportError(f"stdin line {number} is longer than {MAX_TURN_BYTES // 2**20} MiB: not a chat turn")
    try:
        return raw.decode("utf-8").rstrip("\r\n")
    except UnicodeDecodeError:
        raise DiffExportError(f"stdin line {number} is not UTF-8 text") from None


def _generate_interactive(args, folder, config: dict, sampling) -> int:
    """--interactive: a chat session on stdin (text_generation.ChatSession). Every line is a user
    turn, and its answer streams to stdout."""
    from diffexport.text_generation import ChatSession

    session = ChatSession(folder, config, sampling, args.max_new_tokens, system=args.system, stop=args.stop,
                          log=_log, **_backend_options(args))

    def show(text: str) -> None:
        sys.stdout.write(text)
        sys.stdout.flush()

    prompt_shown, number = sys.stdin.isatty(), 0
    while True:
        if prompt_shown:
            sys.stderr.write("> ")
            sys.stderr.flush()
        line = _stdin_turn(number := number + 1)
        if line is None:
            break
        if line.strip() and session.turn(line, show) is not None:
            show("\n")
    return 0


def cmd_generate(args) -> int:
    """Generate text (or token ids) with a KV-cache export folder, through onnxruntime-genai or a plain onnxruntime loop."""
    from pathlib import Path

    from diffexport.backends import decoding
    from diffexport.export.decoder import read_decoder_folder
    from diffexport.generation import StopText

    folder = Path(args.folder)
    _, config, _ = read_decoder_folder(folder)
    if args.max_new_tokens < 1:
        raise DiffExportError(f"--max-new-tokens must be >= 1, got {args.max_new_tokens}")
    sampling = _sampling(args, config)
    if args.backend == "genai":
        decoding.import_genai()
    if (args.backend == "tensorrt") != (args.engine is not None):
        raise DiffExportError("--backend tensorrt runs the engine `diffexport trt FOLDER` built: give both "
                              "--backend tensorrt and --engine ENGINE")
    if args.backend == "tensorrt" and args.provider != "auto":
        raise DiffExportError("--provider chooses onnxruntime's execution provider: a TensorRT engine runs on the GPU")
    if (args.chat or args.system is not None) and args.ids is not None:
        raise DiffExportError("--chat and --system template a text prompt: give --prompt, not --ids")
    if args.system is not None and not (args.chat or args.interactive):
        raise DiffExportError("--system is a turn of the chat template: add --chat")
    if any(not stop for stop in args.stop):
        raise DiffExportError("--stop needs non-empty text")
    if (args.batch_size is not None or args.sort_by_length) and args.prompts_file is None:
        raise DiffExportError(f"{'--batch-size' if args.batch_size is not None else '--sort-by-length'} "
                              "groups the prompts of --prompts-file")
    if args.interactive and args.chat:
        raise DiffExportError("--interactive is a chat already (every line a user turn): drop --chat")
    search = _beam_search_options(args)
    if args.interactive:
        return _generate_interactive(args, folder, config, sampling)
    if args.prompts_file is not None:
        args.batch_size = 8 if args.batch_size is None else args.batch_size
        if args.batch_size < 1:
            raise DiffExportError(f"the batch size must be >= 1, got {args.batch_size}")
        return _generate_file(args, folder, config, sampling, search)
    if args.stop and args.ids is not None:
        raise DiffExportError("--stop matches generated text: give --prompt (the folder's tokenizer), not --ids")
    ids, tokenizer = _prompt_ids(args, folder, config)
    if search is not None:
        return _generate_beams(args, folder, ids, tokenizer, search)
    stream = tokenizer.create_stream() if tokenizer is not None else None
    text = StopText(args.stop, stream.decode) if args.stop else None

    def show(token: int) -> None:
        sys.stdout.write(stream.decode(token) if stream is not None else f"{token} ")
        sys.stdout.flush()

    def show_until_stop(token: int) -> bool:  # --stop: shows what cannot begin a stop string, ends at one
        sys.stdout.write(text.push(token))
        sys.stdout.flush()
        return text.done

    shown = dict(on_token=show) if text is None else dict(stop_after=show_until_stop)
    from diffexport.text_generation import generate_once

    run = generate_once(folder, ids, args.max_new_tokens, sampling, **_backend_options(args), **shown)
    if text is not None:
        sys.stdout.write(text.flush())
    sys.stdout.write("\n")
    _log(f"{args.backend}: prompt {run.prompt_tokens} tokens at {run.prompt_tokens_per_s:.1f} tokens/s, "
         f"{len(run.tokens)} new tokens, decode {run.decode_tokens_per_s:.1f} tokens/s (stopped: {run.stop})")
    return 0


# ---------------------------------------------------------------- analysis (stats, quant-sweep, retrieval)

def _add_models(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("ckpts", nargs="*", metavar="CKPT",
                        help="checkpoints (DIFF or baseline Transformer), compared side by side")
    parser.add_argument("--preset", action="append", default=[],
                        help="a zoo preset with seeded random weights (repeatable); no model at all: the default preset")
    parser.add_argument("--seed", type=int, default=0, help="seed for preset weights and synthetic inputs")
    parser.add_argument("--json", action="store_true", help="machine-readable output")
    parser.add_argument("--plot", help="also write a PNG plot here (needs matplotlib: diffexport[plots])")


def _add_stream(parser: argparse.ArgumentParser, tokens: int) -> None:
    parser.add_argument("--text", help="a UTF-8 text file to run on (default: a built-in synthetic stream)")
    parser.add_argument("--tokenizer", help="Hugging Face tokenizer (folder or hub name) for --text; "
                                            "without it the text is read as bytes")
    parser.add_argument("--tokens", type=int, default=tokens, help=f"tokens to run (default {tokens})")
    parser.add_argument("--seq-len", type=int, help="tokens per sequence (default: a document of the checkpoint's "
                                                     "training task, else 256)")
    parser.add_argument("--batch", type=int, default=8, help="sequences per forward pass (default 8)")


def _analysis_device(args):
    """--device (stats, quant-sweep, retrieval): auto = CUDA when torch sees a GPU, else the CPU."""
    import torch

    from diffexport.errors import DiffExportError

    wanted = getattr(args, "device", "cpu")
    if wanted == "auto":
        wanted = "cuda" if torch.cuda.is_available() else "cpu"
    if wanted == "cuda" and not torch.cuda.is_available():
        raise DiffExportError("--device cuda: torch sees no CUDA device (a CPU build of torch, or no GPU); "
                              "use --device cpu")
    return torch.device(wanted)


def _load_models(args) -> dict:
    """label -> LoadedModel for every CKPT and --preset (on --device); the default preset when none is named."""
    from pathlib import Path

    from diffexport.checkpoint import load_model
    from diffexport.presets import DEFAULT_PRESET

    device = _analysis_device(args)  # before any model loads: a missing GPU fails first
    models = {}
    for path in args.ckpts:
        label = Path(path).stem if Path(path).stem not in models else path
        models[label] = load_model(path)
    for preset in args.preset or ([] if args.ckpts else [DEFAULT_PRESET]):
        models[preset if preset not in models else f"{preset}#{len(models)}"] = load_model(preset=preset, seed=args.seed)
    for loaded in models.values():
        loaded.model.to(device)
    return models


def _random_weights_note(args) -> None:
    """Printed on stderr just before the results of stats/quant-sweep/retrieval run on presets alone."""
    from diffexport.presets import DEFAULT_PRESET

    if not args.ckpts:
        presets = args.preset or [DEFAULT_PRESET]
        _log(f"note: no checkpoint given: these results are for preset {', '.join(presets)} with random weights "
             f"(seed {args.seed}); pass a trained CKPT for meaningful numbers")


def _stream_options(args):
    from diffexport.analysis.runs import StreamOptions

    return StreamOptions(text=args.text, tokenizer=args.tokenizer, tokens=args.tokens, seq_len=args.seq_len,
                         batch=args.batch, seed=args.seed)


def cmd_stats(args) -> int:
    """Largest attention-logit and hidden-state magnitudes per layer (the paper's Table 5), for DIFF or baseline models."""
    import json

    from diffexport.analysis import plots, stats
    from diffexport.analysis.runs import model_stream, progress_bar

    plots.check_plot_path(args.plot)
    results, sources, families = {}, {}, {}
    for name, loaded in _load_models(args).items():
        families[name] = loaded.config.family
        stream = model_stream(loaded, _stream_options(args))
        sources[name] = stream.source
        progress, advance = progress_bar(f"{name}: statistics", len(stream.batches))
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
        _log(f"wrote {plots.plot_stats(results, args.plot)}")
    return 0


def _sweep_models(args, label: str, run, note: str = "") -> dict:
    """Every model of the command line through analysis.runs.sweep_models."""
    from diffexport.analysis.runs import sweep_models

    results = sweep_models(_load_models(args), label, run, _stream_options(args), positions=args.positions,
                           task=args.task, samples=args.samples, log=_log, note=note)
    _random_weights_note(args)
    return results


def _print_sweep(args, results: dict, key: str, describe, text: str, plot) -> None:
    import json

    if args.json:
        print(json.dumps({key: describe, "models": {n: [vars(p) for p in pts] for n, pts in results.items()}},
                         indent=2))
    else:
        print(text)
    if args.plot:
        _log(f"wrote {plot()}")


def cmd_quant_sweep(args) -> int:
    """Quantise attention logits to each --bits width (dynamic absmax, the kernel's definition) and report the damage."""
    from diffexport.analysis import fused, plots, sweep
    from diffexport.errors import DiffExportError
    from diffexport.quantization import LogitQuant

    for bits in args.bits:
        LogitQuant(bits, args.scheme)  # a bad value fails before any model loads
    plots.check_plot_path(args.plot)
    bits_list = sorted(set(args.bits) | {16}, reverse=True)
    describe = LogitQuant(16, args.scheme, not args.no_smooth_k).recipe
    settings = [LogitQuant(bits, args.scheme, not args.no_smooth_k) for bits in bits_list]
    if args.attention == "kernel":  # what needs no model is refused before any model loads
        reason = next(filter(None, map(fused.quant_unsupported, settings)), None)
        if reason is None and _analysis_device(args).type != "cuda":
            reason = "the fused kernel runs on CUDA tensors (use --device cuda on a GPU)"
        if reason:
            raise DiffExportError(f"--attention kernel: {reason}")

    def run(name, loaded, stream, task_eval, masks, advance):
        attention, why = fused.choose(args.attention, loaded.model, settings, next(loaded.model.parameters()).device)
        _log(f"{name}: attention {'fused kernel' if attention.name == 'kernel' else 'torch reference'} ({why})")
        return sweep.sweep(loaded.model, bits_list, stream.batches, scheme=args.scheme, smooth_k=not args.no_smooth_k,
                           attention=attention, task_eval=task_eval, masks=masks, progress=advance)

    results = _sweep_models(args, "sweep", run)
    _print_sweep(args, results, "scheme", describe, sweep.render(results, describe),
                 lambda: plots.plot_sweep(results, args.plot, describe))
    return 0


def cmd_linear_sweep(args) -> int:
    """Quantise every linear layer (int8/int4 weights, or w8a8 weights and activations, as `quantize` deploys them) and report the damage, DIFF vs Transformer."""
    from diffexport.analysis import linear_quant, plots

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
    import json

    from diffexport.analysis import needles, plots
    from diffexport.analysis.runs import progress_bar
    from diffexport.quantization import LogitQuant

    quant = LogitQuant(args.logit_bits, args.scheme)
    plots.check_plot_path(args.plot)
    results = {}
    for name, loaded in _load_models(args).items():
        context = args.context or int((loaded.task or {}).get("context_len", 128))
        cells = needles.grid(args.needles, args.queries, args.depths)
        progress, advance = progress_bar(f"{name}: retrieval", len(cells))
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
        _log(f"wrote {plots.plot_retrieval(results, args.plot)}")
    return 0


def _shape_pair(text: str, flag: str) -> tuple[int, int]:
    from diffexport.errors import DiffExportError

    try:
        batch, seq = (int(x) for x in text.lower().split("x"))
    except ValueError:
        raise DiffExportError(f"{flag} {text!r}: write BATCHxSEQ, e.g. 1x128") from None
    return batch, seq


def cmd_trt(args) -> int:
    """Build a TensorRT engine from an exported ONNX file: DiffAttention plugin (fp16/bf16, --int8 logits) or native layers."""
    from pathlib import Path

    from diffexport.backends.tensorrt import EngineOptions, build_engine_file

    if args.int8 and args.logit_bits not in (None, 8):
        raise DiffExportError("--int8 means --logit-bits 8: pass one of them")
    bits = 8 if args.int8 else (args.logit_bits or 16)
    options = EngineOptions(attention=args.attention, precision="fp16" if args.fp16 else "bf16" if args.bf16 else "auto",
                            logit_bits=bits, smooth_k=not args.no_smooth_k, plugin_lib=args.plugin_lib,
                            module={"auto": "auto", "tensorrt": "tensorrt", "tensorrt-rtx": "tensorrt_rtx"}[args.builder],
                            targets=tuple(args.targets), min_shape=_shape_pair(args.min, "--min"),
                            opt_shape=_shape_pair(args.opt or "1x128", "--opt"),
                            max_shape=_shape_pair(args.max or "4x2048", "--max"), timing_cache=args.timing_cache,
                            save_onnx=args.save_onnx, opt_past=args.opt_past)
    result = build_engine_file(args.model, args.output, options, max_given=args.max is not None,
                               opt_given=args.opt is not None, max_past=args.max_past)
    print("\n".join(result.summary() + [f"wrote         {args.output} (+ {Path(args.output).name}.json)"]))
    return 0


def cmd_kernels(args) -> int:
    """Where the fused CUDA kernel library is, what it was built for, and whether this machine can run it."""
    import torch

    from diffexport import kernels

    if kernels.library_path() is None:  # informational: not built is a state, not a failure
        if args.check:
            raise DiffExportError(f"--check needs the kernel library, which is not built: {kernels.BUILD_HINT}")
        where = ", ".join(str(p) for p in kernels.library_candidates())
        print(f"library      not built (looked at {where})")
        print(f"build        {kernels.BUILD_HINT}")
        print(f"op on CUDA   the PyTorch reference (${kernels.IMPL_ENV}={kernels.impl_choice()}, no library)")
        return 0
    lib = kernels.load_library()  # a library that is there but unusable: one-line error, exit 2
    print(f"library      {kernels.library_path()}")
    print(f"build        {kernels.build_info()}")
    print(f"op on CUDA   ${kernels.IMPL_ENV}={kernels.impl_choice()}")
    if torch.cuda.is_available():
        cap = torch.cuda.get_device_capability()
        print(f"GPU          {torch.cuda.get_device_name()} (sm_{cap[0]}{cap[1]})")
    else:
        print("GPU          none visible to torch: the library loads, kernels cannot run here")
    del lib
    if not args.check:
        return 0
    if not torch.cuda.is_available():
        raise DiffExportError("--check needs a CUDA GPU visible to torch")
    return check_kernels()


def check_kernels() -> int:
    """Every kernel path this GPU and library have, each in a child process, against the torch reference."""
    from diffexport import kernel_probe

    failed = 0
    for name, check in kernel_probe.CHECKS.items():
        why_not = kernel_probe.applicable(name)
        if why_not:
            print(f"check {name:<9} skipped  {check.what}: {why_not}")
            continue
        reason, lines = kernel_probe.run_probe(name)
        failed += reason is not None
        summary = lines[-1].removeprefix("ok: ") if lines else "ran"
        verdict = f"ok       {summary}" if reason is None else f"FAILED   {reason}"
        print(f"check {name:<9} {verdict}  ({check.what})")
    print(f"result       {'PASS' if not failed else f'FAIL: {failed} kernel path(s)'}")
    return 1 if failed else 0


COMMANDS = {"onnx": cmd_onnx, "trt": cmd_trt, "check": cmd_check, "generate": cmd_generate, "optimize": cmd_optimize, "quantize": cmd_quantize, "inspect": cmd_inspect, "demo": cmd_demo, "info": cmd_info,
            "presets": cmd_presets, "stats": cmd_stats, "quant-sweep": cmd_quant_sweep,
            "linear-sweep": cmd_linear_sweep, "retrieval": cmd_retrieval,
            "kernels": cmd_kernels}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="diffexport", description="Differential Transformer models from "
                                     "PyTorch to ONNX, ONNX Runtime and TensorRT.")
    parser.add_argument("--version", action="store_true", help="print the version and exit")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    parser._subcommands = {}
    for name, fn in COMMANDS.items():
        p = sub.add_parser(name, help=fn.__doc__.splitlines()[0], description=fn.__doc__)
        parser._subcommands[name] = p
        if name == "kernels":
            p.add_argument("--check", action="store_true",
                           help="run every kernel path this GPU has (one-pass, INT8 logits, split-KV decode, Hopper) "
                                "on small shapes, each in a child process, against the torch reference")
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
            p.add_argument("-o", "--output", required=True, help="the quantised .onnx (a new folder for a folder)")
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
        if name == "inspect":
            p.add_argument("model", help="an .onnx file or a --kv-cache folder (weights are not loaded)")
            p.add_argument("--json", action="store_true", help="machine-readable output")
        if name == "trt":
            p.add_argument("model", help="an .onnx file written by `diffexport onnx` (fp16/bf16 for the plugin), "
                                         "or a --kv-cache folder")
            p.add_argument("-o", "--output", default="model.engine", help="engine path (default model.engine)")
            precision = p.add_mutually_exclusive_group()
            precision.add_argument("--fp16", action="store_true",
                                   help="the graph must already be fp16 (export it with `diffexport onnx --fp16`): "
                                        "the network is strongly typed, TensorRT takes its types from the ONNX. Not "
                                        "trtexec's --fp16, which lets TensorRT pick fp16 kernels for an fp32 graph")
            precision.add_argument("--bf16", action="store_true",
                                   help="the graph must already be bf16 (`diffexport onnx --bf16`); see --fp16")
            p.add_argument("--int8", action="store_true", help="INT8 attention logits in every DiffAttention (= --logit-bits 8)")
            p.add_argument("--logit-bits", type=int, choices=[8, 6, 4], help="low-bit attention logits (plugin only)")
            p.add_argument("--no-smooth-k", action="store_true", help="INT8 logits without K-smoothing")
            p.add_argument("--attention", default="plugin", choices=["plugin", "native", "function"],
                           help="plugin: our CUDA plugin (default); native: lowered to TensorRT's own layers; "
                                "function: the ONNX function body, inlined by the parser")
            p.add_argument("--plugin-lib", help="libdiffexport_plugins.so (default: $DIFFEXPORT_PLUGIN_LIB or build/)")
            p.add_argument("--min", default="1x1", help="profile minimum BATCHxSEQ (default 1x1)")
            p.add_argument("--opt", help="profile optimum BATCHxSEQ (default 1x128, at most --max)")
            p.add_argument("--max", help="profile maximum BATCHxSEQ (default 4x2048; KV-cache folders: "
                                         "4x(context/4, at most 512))")
            p.add_argument("--opt-past", type=int, default=128,
                           help="KV-cache graphs: past length the profile optimises for (default 128)")
            p.add_argument("--max-past", type=int,
                           help="KV-cache graphs: longest past (default: the folder's context length - 1, else 2048)")
            p.add_argument("--timing-cache", help="timing cache file: read if present, written after the build")
            p.add_argument("--save-onnx", help="also write the graph given to the parser (plugin fields stamped and "
                                               "no function body, or lowered): what trtexec/polygraphy need for "
                                               "the same engine on any TensorRT 10.1+")
            p.add_argument("--builder", default="auto", choices=["auto", "tensorrt", "tensorrt-rtx"],
                           help="which TensorRT (auto: tensorrt, else tensorrt-rtx)")
            p.add_argument("--targets", nargs="+", default=["SM80", "SM89"],
                           help="TensorRT-RTX ahead-of-time GPU targets (default SM80 SM89)")
        if name == "generate":
            p.add_argument("folder", help="a folder written by `diffexport onnx CKPT --kv-cache -o FOLDER`")
            prompt = p.add_mutually_exclusive_group(required=True)
            prompt.add_argument("--prompt", help="prompt text (needs the folder's tokenizer)")
            prompt.add_argument("--ids", help="prompt token ids, comma-separated (e.g. 1,2,3)")
            prompt.add_argument("--interactive", action="store_true",
                                help="a chat session: every line of stdin is a user turn, answered in the chat "
                                     "template with the conversation so far (--system: a system turn first)")
            prompt.add_argument("--prompts-file", help='JSON Lines, one prompt per line: {"prompt": "text"} or '
                                                       '{"ids": [1, 2, 3]}, optionally with "id"; answers go to '
                                                       "stdout as JSON Lines, in order")
            p.add_argument("--batch-size", type=int, help="--prompts-file: prompts run together (default 8)")
            p.add_argument("--sort-by-length", action="store_true",
                           help="--prompts-file: batch the prompts longest first, so each batch pads little "
                                "(answers still come in the file's order, each once every earlier one is done)")
            p.add_argument("--chat", action="store_true",
                           help="put --prompt into the tokenizer's chat template as a user turn (chat models)")
            p.add_argument("--system", help="with --chat: a system turn before the prompt")
            p.add_argument("--max-new-tokens", type=int, default=64, help="tokens to generate (default 64)")
            mode = p.add_mutually_exclusive_group()
            mode.add_argument("--greedy", action="store_true", help="greedy decoding (the default)")
            mode.add_argument("--sample", action="store_true", help="sample with --temperature/--top-k/--top-p")
            p.add_argument("--temperature", type=float,
                           help="sampling temperature (default 1.0, or the folder's when its search samples)")
            p.add_argument("--top-k", type=int, help="sample among the k most likely (0: all; default 0, or the "
                                                     "folder's when its search samples)")
            p.add_argument("--top-p", type=float,
                           help="nucleus sampling mass (default 1.0: all, or the folder's when its search samples)")
            p.add_argument("--seed", type=int, default=0, help="sampling seed (default 0)")
            p.add_argument("--stop", action="append", default=[], metavar="TEXT",
                           help="end an answer where its text first holds TEXT (repeatable; the answer stops "
                                "before it); text prompts only")
            p.add_argument("--repetition-penalty", type=float,
                           help="greedy or sampled: the logit of every id a row already holds, prompt included, "
                                "divided by P (times P when negative); 1.0: none, 1.1-1.3: usual (default: the "
                                "folder's search value, 1.0 unless its checkpoint named one)")
            p.add_argument("--num-beams", type=int, default=1,
                           help="beam search with N beams (genai's own, or the same rule on the onnxruntime loop "
                                "and engines): printed once the search ends (default 1: no beam search)")
            p.add_argument("--num-return-sequences", type=int,
                           help="--num-beams: how many of the best hypotheses to print, best first (default 1)")
            p.add_argument("--length-penalty", type=float,
                           help="--num-beams: an ended hypothesis scores sum(log p) / length^L, length counting "
                                "the prompt (genai's rule); > 0 favours longer answers (default 1.0)")
            p.add_argument("--no-early-stopping", action="store_true",
                           help="--num-beams: keep searching while a running beam could still beat the ended "
                                "ones (default: stop once N hypotheses have ended)")
            p.add_argument("--backend", default="genai", choices=list(("genai", "onnxruntime", "tensorrt")),
                           help="genai: onnxruntime-genai (default); onnxruntime: a plain session loop; tensorrt: "
                                "the --engine built from this folder, on the GPU")
            p.add_argument("--engine", help="--backend tensorrt: the engine `diffexport trt FOLDER` built")
            p.add_argument("--plugin-lib", help="--backend tensorrt: libdiffexport_plugins.so for plugin engines "
                                                "(default: $DIFFEXPORT_PLUGIN_LIB or this install's build)")
            p.add_argument("--provider", default="auto", choices=["auto", "cpu", "cuda"],
                           help="execution provider (auto: genai, the one the folder's genai_config.json names; the "
                                "onnxruntime loop, CUDA when onnxruntime-gpu and a GPU are present)")
        if name == "check":
            p.add_argument("model", help="the exported .onnx file, a --kv-cache folder, or an .engine built by "
                                         "`diffexport trt` (GPU)")
            p.add_argument("--ckpt", dest="ckpt", help="the checkpoint it was exported from (or --preset)")
            _add_model_source(p, positional=False)
        elif name in ("info", "demo", "onnx"):
            _add_model_source(p)
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
                           help="with --kv-cache: intra-op threads in genai_config.json (default: onnxruntime-genai's "
                                "own, one thread on the machines we measured; set it to the target's cores)")
            p.add_argument("--attention", choices=list(decoders.FORMATS),
                           help="with --kv-cache: diffattention (default: one DiffAttention node per layer, runs in "
                                "onnxruntime and TensorRT) or gqa (onnxruntime's GroupQueryAttention with a shared "
                                "cache buffer: faster decode in onnxruntime, no TensorRT)")
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
        if name == "check":
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
                                "own DiffLlamaForCausalLM or LlamaForCausalLM (HF checkpoints), or both (auto: both for HF checkpoints "
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
        if name in ("stats", "quant-sweep", "linear-sweep", "retrieval"):
            _add_models(p)
        if name in ("stats", "quant-sweep", "linear-sweep"):
            _add_stream(p, tokens=16384 if name == "stats" else 8192)
        if name in ("stats", "quant-sweep", "retrieval"):
            p.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"],
                           help="where the models run (auto: CUDA when torch sees a GPU, else the CPU)")
        if name == "quant-sweep":
            p.add_argument("--attention", default="auto", choices=["auto", "reference", "kernel"],
                           help="what computes the quantised attention: the torch reference (any model, both "
                                "schemes) or the fused CUDA kernel's INT8-logits path (DIFF, head_dim 64/128, "
                                "scheme qk, bits 2..8; needs --device cuda and the built kernel library); auto: "
                                "the kernel where it applies, else the reference (stderr says which and why)")
        if name in ("quant-sweep", "retrieval"):
            p.add_argument("--scheme", default="qk", choices=["qk", "logits"],
                           help="qk: Q and K quantised per block, as the INT8 kernel (default); "
                                "logits: each row of logits quantised (the paper's study)")
        if name == "quant-sweep":
            p.add_argument("--bits", type=int, nargs="+", default=[16, 8, 6, 4],
                           help="logit bit widths, 2..16 (16 = not quantised, always the reference)")
            p.add_argument("--no-smooth-k", action="store_true", help="qk scheme without K-smoothing")
        if name == "linear-sweep":
            p.add_argument("--schemes", nargs="+", default=["int8", "int4", "w8a8"], choices=["int8", "int4", "w8a8"],
                           help="int8/int4: weights only, RTN in blocks; w8a8: int8 weights per channel and "
                                "int8 activations per tensor (default: all three)")
            p.add_argument("--block-size", type=int, default=32, help="int8/int4 block (default 32)")
        if name in ("quant-sweep", "linear-sweep"):
            p.add_argument("--task", default="auto", choices=["auto", "needles", "none"],
                           help="task metric: auto = what the checkpoint was trained on")
            p.add_argument("--samples", type=int, default=32, help="task documents per (needles, queries, depth) cell")
            p.add_argument("--positions", default="auto", choices=["auto", "all", "answers"],
                           help="where cosine/KL are measured: every position, or only the needle task's answers "
                                "(auto: answers for a checkpoint trained on the task)")
        if name == "retrieval":
            p.add_argument("--needles", type=int, nargs="+", default=[1, 2, 4, 6], help="needle counts N")
            p.add_argument("--queries", type=int, nargs="+", default=[1, 2], help="asked needles R (R <= N)")
            p.add_argument("--depths", type=float, nargs="+", default=[0, 25, 50, 75, 100],
                           help="depth of the first asked needle, percent of the document")
            p.add_argument("--context", type=int, help="document tokens (default: the checkpoint's training "
                                                       "context, else 128)")
            p.add_argument("--samples", type=int, default=32, help="documents per cell (default 32)")
            p.add_argument("--logit-bits", type=int, default=16, help="run with quantised logits (16 = not)")
        if name == "demo":
            p.add_argument("--out-dir", help="folder for model.onnx and the check files (default: a temp folder)")
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
