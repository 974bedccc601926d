"""Text generation with a KV-cache decoder folder, as an API: the folder's tokenizer and chat
template, prompts as token ids within the context, the draw (the caller's options over the
folder's genai_config search values), a chat session and a prompts file answered in batches, on a
runtime the caller opened (backends/runtimes.open_runtime; one answer and beam search are the
runtime's own methods). `diffexport generate` is a thin layer over these: it parses options and
prints.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from diffexport.backends.base import Runtime
from diffexport.backends.genai import import_genai
from diffexport.core.eager_generation import BeamSearch, Sampling, StopText
from diffexport.core.errors import DiffExportError
from diffexport.core.stoppable import call_bounded, cpu_seconds_for
from diffexport.format import decoder_folder
from diffexport.format.decoder_folder import (
    eos_token_ids,
    has_tokenizer,
    read_decoder_folder,
    search_sampling,
    tokenizer_files,
)
from diffexport.format.tokenizer_rules import check_tokenizer_json
from diffexport.generation import prompts as prompts_file
from diffexport.generation.chat_template import render_chat


class BoundedTokenizer:
    """onnxruntime-genai's tokenizer of a folder, its encoding bounded: a text longer than the
    context could hold (its tokens times the longest token's characters) is refused before it is
    tokenized, and encoding runs in a child process under a CPU-time limit (stoppable.py), since a
    tokenizer's regular expressions can take minutes on a short hostile text in native code nothing
    interrupts. Everything else (decode, create_stream) is the tokenizer's own."""

    def __init__(self, tokenizer, context: int, token_chars: int):
        self._tokenizer, self.max_chars = tokenizer, context * token_chars

    def encode(self, text: str) -> list[int]:
        if len(text) > self.max_chars:
            raise DiffExportError(f"the text is {len(text):,} characters, more than the context could hold "
                                  f"({self.max_chars:,}: its tokens times the longest token's characters)")
        return call_bounded(self._encode, text, cpu_seconds=cpu_seconds_for(len(text)),
                            what=f"tokenizing {len(text):,} characters")

    def _encode(self, text: str) -> list[int]:
        return [int(t) for t in self._tokenizer.encode(text)]

    def __getattr__(self, name):
        return getattr(self._tokenizer, name)


def folder_tokenizer(folder: Path):
    """onnxruntime-genai's tokenizer of a decoder folder (one line when the folder has none)."""

    if not has_tokenizer(folder):
        raise DiffExportError(f"{folder} has no tokenizer: give token ids, or re-export with --tokenizer DIR")
    read = read_decoder_folder(folder)  # og.Model below reads it: nothing it would load, write or run, and its graph
    tokenizer_files(folder)  # nor a link, an oversized file or a pattern that never finishes
    # nor ids past the graph's vocabulary (a prompt's would reach onnxruntime's Gather)
    token_chars = check_tokenizer_json(folder / "tokenizer.json", read.vocab_size)
    og = import_genai()
    try:
        return BoundedTokenizer(og.Tokenizer(og.Model(str(folder))), read.context_length, token_chars)
    except Exception as exc:  # onnxruntime-genai's own errors on a broken tokenizer
        raise DiffExportError(f"the tokenizer in {folder} failed: {str(exc).splitlines()[0][:160]}") from None


def conversation_text(tokenizer, folder: Path, messages: list[dict]) -> str:
    """A conversation (role/content turns) in the folder's chat template, ready for the assistant's
    answer: chat_template.jinja or tokenizer_config.json's chat_template, rendered within bounds of
    time, memory and output (chat_template.py). `tokenizer` is kept for the callers' sake: the
    rendered text is what they encode with it."""

    return render_chat(folder, messages)


def chat_text(tokenizer, folder: Path, prompt: str, system: str | None) -> str:
    """The prompt as one user turn (after an optional system turn) in the tokenizer's chat template,
    ready for the assistant's answer."""
    messages = ([{"role": "system", "content": system}] if system else []) + [{"role": "user", "content": prompt}]
    return conversation_text(tokenizer, folder, messages)


def encode(tokenizer, folder: Path, text: str, chat: bool = False, system: str | None = None) -> list[int]:
    """Text -> token ids (chat: as a user turn of the chat template, after `system`)."""
    try:
        text = chat_text(tokenizer, folder, text, system) if chat else text
        ids = [int(t) for t in tokenizer.encode(text)]
    except DiffExportError:
        raise
    except Exception as exc:  # onnxruntime-genai's own errors on a broken tokenizer (ChildError: in the child)
        raise DiffExportError(f"the tokenizer in {folder} failed: {str(exc).splitlines()[0][:160]}") from None
    if not ids:
        raise DiffExportError("the prompt encodes to no tokens")
    return ids


def check_room(ids: list[int], max_new_tokens: int, context: int, where: str = "prompt",
               limit: str = "--max-new-tokens") -> None:
    """The prompt and the tokens asked for must fit the folder's context length."""
    if len(ids) + max_new_tokens > context:
        raise DiffExportError(f"{where} ({len(ids)} tokens) + {limit} {max_new_tokens} exceeds the "
                              f"context length {context}")


def parse_ids(text: str, vocab_size: int) -> list[int]:
    """'1,2,3' -> token ids within the vocabulary (one-line errors otherwise)."""
    try:
        ids = [int(t) for t in text.split(",") if t.strip()]
    except ValueError:
        raise DiffExportError(f"--ids must be comma-separated integers, got {text!r}") from None
    bad = [t for t in ids if not 0 <= t < vocab_size]
    if not ids or bad:
        raise DiffExportError(f"--ids needs token ids in [0, {vocab_size}), got {bad[:3] or 'none'}")
    return ids


def prompt_ids(folder: Path, config: dict, max_new_tokens: int, *, ids: str | None = None, prompt: str | None = None,
               chat: bool = False, system: str | None = None) -> tuple[list[int], object]:
    """The prompt (`ids` as '1,2,3', else the text `prompt`) as token ids that leave room for
    max_new_tokens in the context, and the tokenizer (None for ids); config: the folder's genai config."""
    if ids is not None:
        tokens, tokenizer = parse_ids(ids, decoder_folder.vocab_size(config)), None
    else:
        tokenizer = folder_tokenizer(folder)
        tokens = encode(tokenizer, folder, prompt, chat, system)
    check_room(tokens, max_new_tokens, decoder_folder.context_length(config))
    return tokens, tokenizer


def folder_sampling(config: dict, *, greedy: bool = False, sample: bool = False, num_beams: int = 1,
                    temperature: float | None = None, top_k: int | None = None, top_p: float | None = None,
                    repetition_penalty: float | None = None, seed: int = 0,
                    log: Callable[[str], None] | None = None) -> Sampling:
    """The draw generate makes (decoder_folder.search_sampling: the caller's options over the folder's
    genai_config search values); what came from the folder is said through `log`."""
    sampling, taken, folder_samples = search_sampling(
        config, greedy=greedy, sample=sample, num_beams=num_beams, temperature=temperature, top_k=top_k, top_p=top_p,
        repetition_penalty=repetition_penalty, seed=seed)
    if taken and log:
        log(f"from the folder's genai_config.json search: {', '.join(taken)} (the options override it"
            f"{'; --greedy decodes greedily' if folder_samples else ''})")
    return sampling


@dataclass(frozen=True)
class GenerateRequest:
    """What one `generate` asks of a folder: exactly one of a prompt (text), token ids, an
    interactive chat or a prompts file, with the options that go with it. Made whole or not at all:
    every clash between the options is refused in one line on creation (as `diffexport generate`
    words it), before a folder is read or a runtime opened."""
    prompt: str | None = None
    ids: str | None = None  # comma-separated token ids
    interactive: bool = False
    prompts_file: str | None = None
    max_new_tokens: int = 64
    chat: bool = False
    system: str | None = None
    stop: tuple[str, ...] = ()
    batch_size: int | None = None  # a prompts file's (None: 8)
    sort_by_length: bool = False
    greedy: bool = False
    sample: bool = False
    temperature: float | None = None  # None: not given (the folder's search, else the default)
    top_k: int | None = None
    top_p: float | None = None
    repetition_penalty: float | None = None
    seed: int = 0
    num_beams: int = 1
    num_return_sequences: int | None = None
    length_penalty: float | None = None
    early_stopping: bool = True

    def __post_init__(self):
        object.__setattr__(self, "stop", tuple(self.stop))
        given = [name for name, value in (("prompt", self.prompt), ("ids", self.ids),
                                          ("interactive", self.interactive or None),
                                          ("prompts_file", self.prompts_file)) if value is not None]
        if len(given) != 1:
            raise DiffExportError(f"give one of a prompt, ids, an interactive chat or a prompts file, not "
                                  f"{' and '.join(given) or 'none'}")
        if self.max_new_tokens < 1:
            raise DiffExportError(f"--max-new-tokens must be >= 1, got {self.max_new_tokens}")
        if (self.chat or self.system is not None) and self.ids is not None:
            raise DiffExportError("--chat and --system template a text prompt: give --prompt, not --ids")
        if self.system is not None and not (self.chat or self.interactive):
            raise DiffExportError("--system is a turn of the chat template: add --chat")
        if any(not stop for stop in self.stop):
            raise DiffExportError("--stop needs non-empty text")
        if (self.batch_size is not None or self.sort_by_length) and self.prompts_file is None:
            raise DiffExportError(f"{'--batch-size' if self.batch_size is not None else '--sort-by-length'} "
                                  "groups the prompts of --prompts-file")
        if self.interactive and self.chat:
            raise DiffExportError("--interactive is a chat already (every line a user turn): drop --chat")
        self.search  # the beam search's own clashes
        if self.prompts_file is not None and self.batch < 1:
            raise DiffExportError(f"the batch size must be >= 1, got {self.batch}")
        if self.stop and self.ids is not None:
            raise DiffExportError("--stop matches generated text: give --prompt (the folder's tokenizer), not --ids")

    @property
    def batch(self) -> int:
        return 8 if self.batch_size is None else self.batch_size

    @property
    def search(self) -> BeamSearch | None:
        """The beam search asked for (None: none), refused where it clashes (beam_search_options)."""
        return beam_search_options(self.num_beams, self.num_return_sequences, self.length_penalty,
                                   self.early_stopping, sample=self.sample, repetition_penalty=self.repetition_penalty,
                                   stop=self.stop, interactive=self.interactive,
                                   batched=self.batch_size is not None or self.sort_by_length)

    def sampling(self, config: dict, log: Callable[[str], None] | None = None) -> Sampling:
        """The draw over the folder's genai_config search values (folder_sampling)."""
        return folder_sampling(config, greedy=self.greedy, sample=self.sample, num_beams=self.num_beams,
                               temperature=self.temperature, top_k=self.top_k, top_p=self.top_p,
                               repetition_penalty=self.repetition_penalty, seed=self.seed, log=log)


class ChatHistory:
    """A conversation's turns, put through the chat template as a whole each turn. When the
    conversation and the answer's room pass the context, the oldest turns are dropped (the system
    turn stays); a turn too long on its own is refused and forgotten."""

    def __init__(self, tokenizer, folder: Path, context: int, max_new_tokens: int, system: str | None = None,
                 log: Callable[[str], None] | None = None):
        self.tokenizer, self.folder, self.context, self.max_new_tokens = tokenizer, folder, context, max_new_tokens
        self.system = [{"role": "system", "content": system}] if system else []
        self.turns: list[dict] = []  # user and assistant turns, oldest first
        self.log = log or (lambda _: None)

    def _ids(self) -> list[int]:
        return [int(t) for t in self.tokenizer.encode(conversation_text(self.tokenizer, self.folder,
                                                                        self.system + self.turns))]

    def ask(self, text: str) -> list[int] | None:
        """The conversation with this user turn, as the prompt's token ids (None: the turn alone does not
        fit the context with the answer's room; it is not kept)."""
        self.turns.append({"role": "user", "content": text})
        ids = self._ids()
        while len(ids) + self.max_new_tokens > self.context and len(self.turns) > 1:
            self.turns = self.turns[2:]  # the oldest user turn and its answer
            self.log(f"dropped the oldest turn: the conversation and --max-new-tokens passed the context "
                     f"{self.context}")
            ids = self._ids()
        if len(ids) + self.max_new_tokens > self.context:
            self.log(f"error: this turn ({len(ids)} tokens with the template) + --max-new-tokens {self.max_new_tokens} "
                     f"exceeds the context length {self.context}: not answered")
            self.turns.pop()
            return None
        return ids

    def answered(self, text: str) -> None:
        self.turns.append({"role": "assistant", "content": text})


class ChatSession:
    """A chat with a decoder folder on one runtime: every user turn goes through the chat template
    with the whole conversation (ChatHistory), and is answered on the runtime's chat session, which
    keeps its cache between turns, so only what changed is read."""

    def __init__(self, runtime: Runtime, config: dict, sampling: Sampling, max_new_tokens: int, *,
                 system: str | None = None, stop: list[str] | tuple = (), log: Callable[[str], None] | None = None):
        self.runtime, self.folder, self.config = runtime.open(), runtime.folder, config
        self.sampling, self.max_new_tokens = sampling, max_new_tokens
        self.stop, self.log = list(stop), log or (lambda _: None)
        self.tokenizer = folder_tokenizer(self.folder)
        self.eos = set(eos_token_ids(config))
        self.history = ChatHistory(self.tokenizer, self.folder, decoder_folder.context_length(config), max_new_tokens,
                                   system, log=self.log)
        self.session = runtime.chat_session(sampling)

    def turn(self, text: str, on_text: Callable[[str], None]):
        """Answer one user turn, streaming the answer's text to on_text -> the run (None: the turn
        does not fit the context with the answer's room, and was not answered)."""
        ids = self.history.ask(text)
        if ids is None:
            return None
        answer = StopText(self.stop, self.tokenizer.create_stream().decode)

        def show(token: int) -> bool:
            if token in self.eos:
                return False
            on_text(answer.push(token))
            return answer.done

        start = time.perf_counter()
        run = self.session.turn(ids, self.max_new_tokens, stop_after=show)
        on_text(answer.flush())
        self.history.answered(answer.text)
        self.log(f"{len(run.tokens)} new tokens in {time.perf_counter() - start:.1f} s "
                 f"({run.decode_tokens_per_s:.1f} tokens/s decode; conversation {len(ids)} tokens, "
                 f"{run.prompt_tokens} read this turn; stopped: {run.stop})")
        return run


def beam_search_options(num_beams: int = 1, num_return_sequences: int | None = None,
                        length_penalty: float | None = None, early_stopping: bool = True, *, sample: bool = False,
                        repetition_penalty: float | None = None, stop: list[str] | tuple = (),
                        interactive: bool = False, batched: bool = False):
    """The beam search asked for, as a BeamSearch (None: num_beams 1, no beam search), refusing what
    beam search does not combine with here (batched: a batch size or length sorting was asked)."""

    given = [flag for flag, value in (("--num-return-sequences", num_return_sequences),
                                      ("--length-penalty", length_penalty),
                                      ("--no-early-stopping", None if early_stopping else True)) if value is not None]
    if num_beams == 1:
        if given:
            raise DiffExportError(f"{given[0]} is a beam search option: add --num-beams N (N >= 2)")
        return None
    if num_beams < 1:
        raise DiffExportError(f"--num-beams must be >= 1, got {num_beams}")
    clashes = [(sample, "--sample: beam search is deterministic; drop --sample or --num-beams"),
               (repetition_penalty not in (None, 1.0), "--repetition-penalty is not combined with --num-beams here"),
               (bool(stop), "--stop ends one streamed answer: beam search ranks whole hypotheses, drop --stop"),
               (interactive, "--interactive streams a chat: drop --num-beams"),
               (batched, "--batch-size/--sort-by-length: beam search runs one prompt at a time (its beams are the "
                         "batch)")]
    for clash, message in clashes:
        if clash:
            raise DiffExportError(message)
    return BeamSearch(num_beams, 1 if num_return_sequences is None else num_return_sequences,
                      1.0 if length_penalty is None else length_penalty, early_stopping)


def beam_answers(tokenizer, run) -> list[dict]:
    """A BeamRun's hypotheses as answers: the text (with a tokenizer), the new tokens, why each ended."""
    return [{**({} if tokenizer is None else {"completion": tokenizer.decode(tokens)}), "tokens": tokens, "stop": stop}
            for tokens, stop in zip(run.sequences, run.stops)]


@dataclass
class PromptRows:
    """A prompts file read against a folder: its lines, each prompt's token ids, new-token limit and
    stop strings, and the folder's tokenizer (None when every prompt is token ids)."""
    path: Path
    lines: list
    ids: list[list[int]]
    limits: list[int]
    stops: list[list[str]]
    tokenizer: object | None


def read_prompt_rows(folder: Path, config: dict, path: Path, max_new_tokens: int, *, chat: bool = False,
                     system: str | None = None, stop: list[str] | tuple = ()) -> PromptRows:
    """Every prompt of a prompts file (diffexport/generation/prompts.py) as token ids within the context, with
    its own max_new_tokens and stop strings where the line gives them, else the caller's."""

    lines = prompts_file.read_prompts(path, decoder_folder.vocab_size(config))
    texts = any(p.text is not None for p in lines)
    if chat and not texts:
        raise DiffExportError("--chat templates text prompts: the prompts file gives token ids only")
    if stop and not texts:
        raise DiffExportError("--stop matches generated text: the prompts file gives token ids only")
    tokenizer = folder_tokenizer(folder) if texts else None
    context = decoder_folder.context_length(config)
    ids, limits = [], [max_new_tokens if p.max_new_tokens is None else p.max_new_tokens for p in lines]
    for p, limit in zip(lines, limits):
        row = encode(tokenizer, folder, p.text, chat, system) if p.text is not None else p.ids
        check_room(row, limit, context, f"{path} line {p.line}",
                   "--max-new-tokens" if p.max_new_tokens is None else "its max_new_tokens")
        ids.append(row)
    stops = [list(stop) if p.stop is None else p.stop for p in lines]
    return PromptRows(Path(path), lines, ids, limits, stops, tokenizer)


def answer_prompt_rows(runtime: Runtime, config: dict, rows: PromptRows, sampling: Sampling, *, search=None,
                       batch_size: int = 8, sort_by_length: bool = False, log: Callable[[str], None] | None = None):
    """Answer every prompt on `runtime` -> each answer (line, id, completion with a tokenizer, tokens,
    stop), in the file's order, each as soon as it and every earlier one are done. Prompts run
    batch_size at a time (sort_by_length: longest first), or one at a time with a beam search;
    progress goes to log."""
    log = log or (lambda _: None)
    if search is not None:
        yield from _answer_with_beams(runtime, rows, search, log)
        return
    yield from _answer_in_batches(runtime, config, rows, sampling, batch_size, sort_by_length, log)


def _answer_with_beams(runtime: Runtime, rows: PromptRows, search, log):
    if any(p.stop for p in rows.lines):
        line = next(p.line for p in rows.lines if p.stop)
        raise DiffExportError(f"{rows.path} line {line}: stop ends one streamed answer, beam search "
                              "ranks whole hypotheses: drop its stop")
    searcher = runtime.beam_searcher(search, rows.ids, max(len(r) + limit for r, limit in zip(rows.ids, rows.limits)))
    start = time.perf_counter()
    for number, (p, row, limit) in enumerate(zip(rows.lines, rows.ids, rows.limits), 1):
        run = searcher(row, limit)
        answers = beam_answers(rows.tokenizer, run)
        answer = {"line": p.line, **({} if p.id is None else {"id": p.id}), **answers[0]}
        if len(answers) > 1:
            answer["beams"] = answers
        yield answer
        log(f"prompt {number}/{len(rows.ids)}: {len(row)} tokens, {run.steps} steps of {search.num_beams} beams "
            f"in {run.seconds:.1f} s (stopped: {run.stops[0]})")
    log(f"{runtime.name} beam search: {len(rows.ids)} prompts in {time.perf_counter() - start:.1f} s")


def _answer_in_batches(runtime: Runtime, config, rows: PromptRows, sampling, batch_size, sort_by_length, log):
    if batch_size < 1:
        raise DiffExportError(f"the batch size must be >= 1, got {batch_size}")
    eos, ids, tokenizer, stops = set(eos_token_ids(config)), rows.ids, rows.tokenizer, rows.stops
    texts_by_prompt: dict[int, StopText] = {}  # stop strings: each answer's text, ended at one

    def stop_after(index: int, token: int) -> bool:
        if not stops[index]:
            return False
        if index not in texts_by_prompt:
            texts_by_prompt[index] = StopText(stops[index], tokenizer.create_stream().decode)
        texts_by_prompt[index].push(token)
        return texts_by_prompt[index].done

    own_limits = any(p.max_new_tokens is not None for p in rows.lines)
    batches = runtime.generate_in_batches(ids, max(rows.limits), sampling, batch_size, sort_by_length=sort_by_length,
                                          stop_after=stop_after if any(stops) else None,
                                          limits=rows.limits if own_limits else None)
    count = -(-len(ids) // batch_size)
    new = seconds = 0
    start = time.perf_counter()
    done: dict[int, dict] = {}  # finished, not yet given: answers keep the file's order
    given = 0
    for number, (indices, run) in enumerate(batches, 1):
        for index, tokens, stop in zip(indices, run.tokens, run.stops):
            p = rows.lines[index]
            answer = {"line": p.line, **({} if p.id is None else {"id": p.id})}
            text = texts_by_prompt.pop(index, None)
            if stop == "stop_string":  # the text before the stop string
                answer["completion"] = text.text
            elif tokenizer is not None:  # the text without the end-of-sequence token that stopped it
                answer["completion"] = tokenizer.decode(tokens[:-1] if stop == "eos" and tokens[-1] in eos else tokens)
            answer.update(tokens=tokens, stop=stop)
            done[index] = answer
        while given in done:
            yield done.pop(given)
            given += 1
        new, seconds = new + run.new_tokens, seconds + run.seconds
        prompts = f"{len(run.tokens)} prompt{'' if len(run.tokens) == 1 else 's'}"
        longest = max(len(ids[i]) for i in indices)
        log(f"batch {number}/{count}: {prompts} (longest {longest} token{'' if longest == 1 else 's'}), "
            f"{run.new_tokens} new tokens in "
            f"{run.seconds:.1f} s (prefill {run.prefill_seconds:.1f} s, then {run.decode_tokens_per_s:.1f} tokens/s)")
    log(f"{runtime.name}: {len(ids)} prompts ({sum(map(len, ids))} tokens) in {count} batches of up to "
        f"{batch_size}, {new} new tokens in {time.perf_counter() - start:.1f} s "
        f"({new / seconds if seconds > 0 else float('nan'):.1f} new tokens/s)")
