"""`diffexport generate`: its options, checked together, and the streaming of what text_generation returns.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from diffexport.backends.runtimes import DEFAULT_RUNTIME, RUNTIMES, open_runtime
from diffexport.cli.common import Command, log_line
from diffexport.core.errors import DiffExportError  # light: no torch
from diffexport.core.lazy import lazy_import

base = lazy_import("diffexport.backends.base")
decoder_folder = lazy_import("diffexport.format.decoder_folder")
eager_generation = lazy_import("diffexport.core.eager_generation")
text_generation = lazy_import("diffexport.generation.text_generation")


def _prompt_ids(args, folder, config: dict) -> tuple[list[int], object]:
    """The prompt as token ids, and the tokenizer (None with --ids); config: the folder's genai config."""
    return text_generation.prompt_ids(folder, config, args.max_new_tokens, ids=args.ids, prompt=args.prompt,
                                      chat=args.chat, system=args.system)


def _generate_beams(args, runtime, ids: list[int], tokenizer, search) -> int:
    """One prompt's beam search: the hypotheses once it ends, best first."""
    run = runtime.beam_searcher(search, [ids], len(ids) + args.max_new_tokens)(ids, args.max_new_tokens)
    for rank, answer in enumerate(text_generation.beam_answers(tokenizer, run), 1):
        if search.num_return_sequences > 1:
            sys.stdout.write(f"--- hypothesis {rank} of {search.num_return_sequences} (stopped: {answer['stop']})\n")
        sys.stdout.write(answer["completion"] if tokenizer is not None else " ".join(map(str, answer["tokens"])))
        sys.stdout.write("\n")
    sys.stdout.flush()
    rate = run.steps * search.num_beams / run.seconds if run.seconds > 0 else float("nan")
    log_line(f"{runtime.name} beam search, {search.num_beams} beams: prompt {run.prompt_tokens} tokens, {run.steps} "
             "steps "
         f"in {run.seconds:.2f} s ({rate:.1f} beam tokens/s; best stopped: {run.stops[0]})")
    return 0


def _generate_file(args, runtime, config: dict, sampling, search, batch_size: int) -> int:
    """--prompts-file: one JSON line per prompt on stdout, in the file's order, each as soon as it
    and every earlier one are done (text_generation.answer_prompt_rows)."""
    rows = text_generation.read_prompt_rows(runtime.folder, config, args.prompts_file, args.max_new_tokens,
                                            chat=args.chat, system=args.system, stop=args.stop)
    for answer in text_generation.answer_prompt_rows(runtime, config, rows, sampling, search=search,
                                                     batch_size=batch_size, sort_by_length=args.sort_by_length,
                                                     log=log_line):
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


def _generate_interactive(args, runtime, config: dict, sampling) -> int:
    """--interactive: a chat session on stdin (text_generation.ChatSession). Every line is a user
    turn, and its answer streams to stdout."""
    session = text_generation.ChatSession(runtime, config, sampling, args.max_new_tokens, system=args.system,
                                          stop=args.stop, log=log_line)

    def show(text: str) -> None:
        sys.stdout.write(text)
        sys.stdout.flush()

    prompt_shown, number, refused = sys.stdin.isatty(), 0, 0
    while True:
        if prompt_shown:
            sys.stderr.write("> ")
            sys.stderr.flush()
        line = _stdin_turn(number := number + 1)
        if line is None:
            break
        if not line.strip():
            continue
        if session.turn(line, show) is None:  # said on stderr; the session goes on with the next turn
            refused += 1
        else:
            show("\n")
    # a scripted session (stdin from a file) learns that a turn went unanswered from the status
    return 2 if refused else 0


def cmd_generate(args) -> int:
    """Generate text (or token ids) with a KV-cache export folder, through onnxruntime-genai or a plain onnxruntime
    loop."""
    with base.intra_op_threads(args.threads):  # --threads: over the folder's own, for every path below
        return _generate(args)


def generate_request(args):
    """The command line's options as the API's request (text_generation.GenerateRequest), which
    refuses their clashes."""
    return text_generation.GenerateRequest(
        prompt=args.prompt, ids=args.ids, interactive=args.interactive or False, prompts_file=args.prompts_file,
        max_new_tokens=args.max_new_tokens, chat=args.chat, system=args.system, stop=tuple(args.stop),
        batch_size=args.batch_size, sort_by_length=args.sort_by_length, greedy=args.greedy, sample=args.sample,
        temperature=args.temperature, top_k=args.top_k, top_p=args.top_p, repetition_penalty=args.repetition_penalty,
        seed=args.seed, num_beams=args.num_beams, num_return_sequences=args.num_return_sequences,
        length_penalty=args.length_penalty, early_stopping=not args.no_early_stopping)


def _generate(args) -> int:
    folder = Path(args.folder)
    _, config, _ = decoder_folder.read_decoder_folder(folder)
    request = generate_request(args)
    sampling = request.sampling(config, log=log_line)
    runtime = open_runtime(args.backend, folder, provider=args.provider, engine=args.engine, plugin_lib=args.plugin_lib)
    search = request.search
    if request.interactive:
        return _generate_interactive(args, runtime, config, sampling)
    if request.prompts_file is not None:
        return _generate_file(args, runtime, config, sampling, search, request.batch)
    ids, tokenizer = _prompt_ids(args, folder, config)
    if search is not None:
        return _generate_beams(args, runtime, ids, tokenizer, search)
    stream = tokenizer.create_stream() if tokenizer is not None else None
    text = eager_generation.StopText(args.stop, stream.decode) if args.stop else None

    def show(token: int) -> None:
        sys.stdout.write(stream.decode(token) if stream is not None else f"{token} ")
        sys.stdout.flush()

    def show_until_stop(token: int) -> bool:  # --stop: shows what cannot begin a stop string, ends at one
        sys.stdout.write(text.push(token))
        sys.stdout.flush()
        return text.done

    shown = dict(on_token=show) if text is None else dict(stop_after=show_until_stop)
    run = runtime.generate(ids, args.max_new_tokens, sampling, **shown)
    if text is not None:
        sys.stdout.write(text.flush())
    sys.stdout.write("\n")
    log_line(f"{runtime.name}: prompt {run.prompt_tokens} tokens at {run.prompt_tokens_per_s:.1f} tokens/s, "
         f"{len(run.tokens)} new tokens, decode {run.decode_tokens_per_s:.1f} tokens/s (stopped: {run.stop})")
    return 0


def _generate_arguments(p: argparse.ArgumentParser) -> None:
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
    p.add_argument("--backend", default=DEFAULT_RUNTIME, choices=list(RUNTIMES),
                   help="genai: onnxruntime-genai (default); onnxruntime: a plain session loop; tensorrt: "
                        "the --engine built from this folder, on the GPU")
    p.add_argument("--engine", help="--backend tensorrt: the engine `diffexport trt FOLDER` built")
    p.add_argument("--plugin-lib", help="--backend tensorrt: libdiffexport_plugins.so for plugin engines "
                                        "(default: $DIFFEXPORT_PLUGIN_LIB or this install's build)")
    p.add_argument("--threads", type=int,
                   help="intra-op threads for onnxruntime(-genai) (default: the folder's genai_config, else "
                        "this machine's physical cores)")
    p.add_argument("--provider", default="auto", choices=["auto", "cpu", "cuda"],
                   help="execution provider (auto: genai, the one the folder's genai_config.json names; the "
                        "onnxruntime loop, CUDA when onnxruntime-gpu and a GPU are present)")


COMMANDS = [Command("generate", cmd_generate, _generate_arguments, input_arg="folder",
                    missing_input="{} is not a folder: give the folder `diffexport onnx --kv-cache -o` wrote")]
