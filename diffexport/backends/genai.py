"""Running a KV-cache decoder folder in onnxruntime-genai: its model opened on the folder's (or a
given) provider and threads, its search and sampling, its own cache (one generator per answer, a
chat session that keeps it between turns, right-padded batches, beam search), and its quirks kept
here: genai reads a prompt's trailing pad ids as padding (genai_pad_for), takes at most 32 beams,
applies its repetition penalty to padding (batches apply it themselves), and needs a top_k for a
top-p draw (format/decoder_folder.genai_top_k). Every folder is validated whole before genai reads
it. The onnxruntime step loop over the same folders is backends/step_loop.py.
"""

from __future__ import annotations

import dataclasses
import json
import time
from pathlib import Path
from typing import Callable, Iterator

import numpy as np

from diffexport.backends.base import (
    INTRA_OP_THREADS,
    BatchRun,
    BeamRun,
    DecodeRun,
    check_beam_memory,
    machine_threads,
    planned_batches,
    refuse_engine,
    shared_prefix,
)
from diffexport.core.eager_generation import BeamSearch, Sampling, penalize_repeats, seen_tokens
from diffexport.core.errors import DiffExportError
from diffexport.format import decoder_folder
from diffexport.format.genai_config import MAX_THREADS, read_genai_config
from diffexport.format.metadata_keys import DTYPE


def import_genai():
    try:
        import onnxruntime_genai
    except ImportError:
        raise DiffExportError("onnxruntime-genai is not installed: pip install 'diffexport[onnx]' "
                              "(or run with --backend onnxruntime)") from None
    return onnxruntime_genai


def genai_pad_for(config: dict, prompts: list[list[int]]) -> int | None:
    """A pad id for genai to use instead of the folder's, or None when the folder's will do.
    onnxruntime-genai takes a prompt's trailing pad ids for padding, even in a batch of one: it
    chooses the next token from the logits before them, so a prompt that ends with the pad id
    would be answered as if that token were not there. The substitute ends no prompt."""
    pad = decoder_folder.pad_token_id(config)
    last = {p[-1] for p in prompts}
    if pad not in last:
        return None
    candidates = [*decoder_folder.eos_token_ids(config), *range(decoder_folder.vocab_size(config))]
    return next(t for t in candidates if t not in last)


# what genai would otherwise take from the folder's genai_config "search" (which carries a checkpoint's
# generation_config.json values for apps that use genai directly): diffexport runs say every knob
_NO_EXTRAS = {"no_repeat_ngram_size": 0, "diversity_penalty": 0.0}


def _search_options(sampling: Sampling, max_length: int, config: dict, min_length: int = 0) -> dict:
    """genai's search options for our Sampling: the length limits (min_length 0: none) and the draw,
    every one set, so the folder's search defaults never change a run (top_k 0: no cut, as in genai).
    config: the folder's genai config (its vocab_size, for top-p without top-k: decoder_folder.genai_top_k)."""
    search = {"max_length": max_length, "min_length": min(min_length, max_length), "do_sample": not sampling.greedy,
              "num_beams": 1, "num_return_sequences": 1, "repetition_penalty": float(sampling.repetition_penalty),
              **_NO_EXTRAS}
    if not sampling.greedy:
        top_k = decoder_folder.genai_top_k(int(sampling.top_k), sampling.top_p, decoder_folder.vocab_size(config))
        search.update(temperature=float(sampling.temperature), top_k=top_k, top_p=float(sampling.top_p),
                      random_seed=sampling.seed)
    return search


def _genai_config(folder) -> dict:
    """The folder's genai_config.json, held to what diffexport writes (a caller's folder: a
    benchmark's has no diffexport metadata, but nothing genai would load, write or run either)."""

    return read_genai_config(folder)


def open_genai_model(folder, provider: str | None = None, pad_token_id: int | None = None):
    """onnxruntime-genai's Model over the folder, on the provider its genai_config names, or on
    `provider` ("cpu", "cuda") instead, with pad_token_id in place of the folder's when given (the
    folder is not edited); what genai refuses (no CUDA build, no GPU) is one line. Threads:
    intra_op_threads() when set (generate --threads), else the folder's; a folder that
    names no intra-op thread count (export's --threads) runs on this machine's physical cores:
    genai's own default is one thread (docs/BENCHMARKS.md, "Decode on CPU": diff-v1-110m at 18.6
    decode tokens/s as written, 28.0 with 2 threads, on the 2-core development machine)."""
    # the whole folder is validated before genai reads it: the config (nothing genai would load, write
    # or run) and its numbers against the graph's own metadata (buffers genai sizes from them)
    session = decoder_folder.read_decoder_folder(folder).session_options
    og = import_genai()
    threads = INTRA_OP_THREADS.get()  # the user's (generate --threads) over the folder's, over the machine's
    if threads is None and "intra_op_num_threads" not in session:
        threads = min(machine_threads(), MAX_THREADS)
    try:
        config = og.Config(str(folder))
        if threads is not None:
            config.overlay(json.dumps({"model": {"decoder": {"session_options": {"intra_op_num_threads": threads}}}}))
        if provider is not None:
            config.clear_providers()
            if provider != "cpu":
                config.append_provider(provider)
        if pad_token_id is not None:
            config.overlay(json.dumps({"model": {"pad_token_id": pad_token_id}}))
        return og.Model(config)
    except RuntimeError as exc:
        detail = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
        hint = (" (the CUDA provider needs the onnxruntime-genai-cuda package and a GPU)"
                if "cuda" in detail.lower() else "")
        raise DiffExportError(f"onnxruntime-genai cannot open {Path(folder).name}"
                              f"{'' if provider is None else ' on ' + provider}: {detail}{hint}") from None


def generate_genai(folder, prompt: list[int], max_new_tokens: int, sampling: Sampling,
                   on_token: Callable[[int], None] | None = None, model=None, min_new_tokens: int = 0,
                   provider: str | None = None, stop_after: Callable[[int], bool] | None = None) -> DecodeRun:
    """provider: None runs on what the folder's genai_config names; "cpu"/"cuda" override it.
    stop_after(token): True ends generation after that token (a stop string completed)."""
    og = import_genai()
    context = None
    if model is None:  # a model given is the caller's, pad id included
        read = decoder_folder.read_decoder_folder(folder)
        config, context = read.config, read.context_length
        model = open_genai_model(folder, provider, genai_pad_for(config, [prompt]))
    else:
        config = _genai_config(folder)
    if context is not None and len(prompt) > context:
        raise DiffExportError(f"the prompt's {len(prompt)} tokens exceed the folder's context length {context}")
    params = og.GeneratorParams(model)
    # genai refuses a max_length past the context; the ORT loop stops at the same place
    total = len(prompt) + max_new_tokens if context is None else min(len(prompt) + max_new_tokens, context)
    params.set_search_options(**_search_options(sampling, total, config,
                                                len(prompt) + min_new_tokens if min_new_tokens else 0))
    generator = og.Generator(model, params)
    start = time.perf_counter()
    generator.append_tokens(np.asarray(prompt, np.int32))
    ends = set(decoder_folder.eos_token_ids(config))
    tokens, first, stop = _genai_tokens(generator, total - len(prompt), ends, on_token, stop_after)
    end = time.perf_counter()
    return DecodeRun(tokens, len(prompt), (first or end) - start, end - (first or end), stop)


def _genai_tokens(generator, limit: int, eos: set[int], on_token: Callable[[int], None] | None,
                  stop_after: Callable[[int], bool] | None) -> tuple[list[int], float | None, str]:
    """A batch-1 genai generator stepped one token at a time, at most `limit` new tokens (within its
    max_length) -> (the tokens, when the first was chosen, why it stopped: "eos" with the end id
    kept, "stop_string" where stop_after(token) said so, else "length"), as the onnxruntime loop says."""
    tokens, first = [], None
    while len(tokens) < limit:
        generator.generate_next_token()
        token = int(generator.get_next_tokens()[0])
        tokens.append(token)
        first = first or time.perf_counter()
        if on_token is not None:
            on_token(token)
        if token in eos:
            return tokens, first, "eos"
        if stop_after is not None and stop_after(token):
            return tokens, first, "stop_string"
    return tokens, first, "length"


def sample_first_tokens_genai(model, config: dict, prompt: list[int], sampling: Sampling, draws: int,
                              rows: int = 32, on_draws: Callable[[int], None] | None = None) -> list[int]:
    """onnxruntime-genai's draws of the token after `prompt`: `draws` copies of the prompt, `rows`
    to a generator (genai 0.18 takes at most 32; each row draws on its own), the generators seeded
    sampling.seed, +1, ... (a repetition penalty is genai's own, over the prompt). model:
    open_genai_model's, with a pad id the prompt does not end with (genai_pad_for); config: the
    folder's genai config; on_draws(n): told after each generator's n draws."""
    og = import_genai()
    tokens, batch = [], 0
    while len(tokens) < draws:
        count = min(rows, draws - len(tokens))
        params = og.GeneratorParams(model)
        params.set_search_options(**_search_options(dataclasses.replace(sampling, seed=sampling.seed + batch),
                                                    len(prompt) + 1, config), batch_size=count)
        generator = og.Generator(model, params)
        generator.append_tokens(np.tile(np.asarray(prompt, np.int32), (count, 1)))
        generator.generate_next_token()
        tokens += [int(t) for t in generator.get_next_tokens()]
        batch += 1
        if on_draws is not None:
            on_draws(count)
    return tokens


GENAI_MAX_BEAMS = 32  # onnxruntime-genai 0.18 refuses num_beams outside [1, 32]


def check_genai_beams(num_beams: int, remedy: str = "") -> None:
    """Refuse, before genai is asked, a beam count genai's search does not take (remedy: what the
    caller can do instead, appended to the message)."""
    if num_beams > GENAI_MAX_BEAMS:
        raise DiffExportError(f"onnxruntime-genai searches at most {GENAI_MAX_BEAMS} beams, got {num_beams}{remedy}")


def beam_search_genai(folder, prompt: list[int], max_new_tokens: int, search: BeamSearch,
                      provider: str | None = None, model=None) -> BeamRun:
    """onnxruntime-genai's beam search over the folder (eager_generation.beam_search is its eager
    reference): the prompt runs once per beam, every step reorders the cache. A sequence shorter
    than the length limit ended with an end token (genai returns it without that token)."""
    check_genai_beams(search.num_beams)
    og = import_genai()
    total = len(prompt) + max_new_tokens
    if model is None:  # a model given is the caller's (with genai_pad_for's pad id), who keeps within the context
        read = decoder_folder.read_decoder_folder(folder)
        config, context = read.config, read.context_length
        if len(prompt) >= context:
            raise DiffExportError(f"the prompt's {len(prompt)} tokens leave no room in the folder's context "
                                  f"length {context}")
        total = min(total, context)
        model = open_genai_model(folder, provider, genai_pad_for(config, [prompt]))
    params = og.GeneratorParams(model)
    params.set_search_options(max_length=total, min_length=0, do_sample=False, num_beams=search.num_beams,
                              num_return_sequences=search.num_return_sequences, repetition_penalty=1.0,
                              length_penalty=float(search.length_penalty), early_stopping=search.early_stopping,
                              **_NO_EXTRAS)
    start = time.perf_counter()
    generator = og.Generator(model, params)
    generator.append_tokens(np.asarray(prompt, np.int32))
    steps = 0
    while not generator.is_done():
        generator.generate_next_token()
        steps += 1
    seconds = time.perf_counter() - start
    sequences = [[int(t) for t in generator.get_sequence(i)[len(prompt):]] for i in range(search.num_return_sequences)]
    stops = ["length" if len(prompt) + len(s) >= total else "eos" for s in sequences]
    return BeamRun(sequences, stops, len(prompt), seconds, steps)


class GenaiSession:
    """One conversation through onnxruntime-genai that keeps its KV cache between turns. Each turn
    gives the whole conversation's ids; the session rewinds its generator to what they share with
    the sequence it holds (prompt and answer so far) and appends only the rest, so a chat's turn
    costs its new tokens, not the conversation. Batch 1; the generator's max_length is the context
    and its random draws go on from turn to turn (reproducible for the same turns and seed)."""

    def __init__(self, folder, sampling: Sampling, model=None, provider: str | None = None,
                 pad_token_id: int | None = None):
        og = import_genai()
        if model is None:
            self.config = decoder_folder.read_decoder_folder(folder)[1]
        else:  # the caller opened the folder (a benchmark's copy links its weights)
            self.config = _genai_config(folder)
        self.context = decoder_folder.context_length(self.config)
        self.eos = set(decoder_folder.eos_token_ids(self.config))
        self.pad = decoder_folder.pad_token_id(self.config) if pad_token_id is None else pad_token_id
        self.model = model or open_genai_model(folder, provider, pad_token_id)
        params = og.GeneratorParams(self.model)
        params.set_search_options(**_search_options(sampling, self.context, self.config))
        self.generator = og.Generator(self.model, params)
        self.held: list[int] = []  # the generator's sequence

    def turn(self, ids: list[int], max_new_tokens: int, on_token: Callable[[int], None] | None = None,
             stop_after: Callable[[int], bool] | None = None) -> DecodeRun:
        """Answer the conversation `ids` (at most max_new_tokens, within the context): greedy tokens
        are what generate_genai gives the same ids from scratch. prompt_tokens: the tokens appended."""
        if not ids or len(ids) >= self.context:
            raise DiffExportError(f"a turn needs 1 to {self.context - 1} tokens (the context), got {len(ids)}")
        if ids[-1] == self.pad:  # genai would take it for padding (genai_pad_for)
            raise DiffExportError(f"the conversation ends with the pad id {self.pad}: open the session with "
                                  "pad_token_id=genai_pad_for(config, [ids])")
        common = shared_prefix(self.held, ids)
        # at least the last token is appended (its logits choose the answer), and the generator is always
        # rewound: the last token it generated was never run through the model, and genai 0.18's
        # append after a generation counts it in the mask without feeding it (seen: a 64-token append
        # gave a 65-wide mask, an error in the DiffAttention folder and wrong logits in the gqa one)
        common = min(common, len(ids) - 1, max(len(self.held) - 1, 0))
        if self.held:
            try:
                self.generator.rewind_to(common)
            except RuntimeError as exc:
                # genai's plain (not shared-buffer) cache, the DiffAttention folder's, ends one token
                # earlier after a generation: the past of its last run
                if "greater than the current length" not in str(exc) or common == 0:
                    raise
                common -= 1
                self.generator.rewind_to(common)
        start = time.perf_counter()
        self.generator.append_tokens(np.asarray(ids[common:], np.int32))
        tokens, first, stop = _genai_tokens(self.generator, min(max_new_tokens, self.context - len(ids)), self.eos,
                                            on_token, stop_after)
        end = time.perf_counter()
        # genai's own sequence, not ids + tokens: it leaves out the end id that finished the search
        self.held = [int(t) for t in self.generator.get_sequence(0)]
        return DecodeRun(tokens, len(ids) - common, (first or end) - start, end - (first or end), stop)


def generate_batch_genai(folder, prompts: list[list[int]], max_new_tokens: int, sampling: Sampling,
                         model=None, provider: str | None = None, pad_token_id: int | None = None,
                         min_new_tokens: int = 0, stop_after: Callable[[int, int], bool] | None = None,
                         limits: list[int] | None = None) -> BatchRun:
    """Several prompts as one batch through onnxruntime-genai, right-padded as genai pads (its
    trailing pad ids are the padding; genai_pad_for says when the folder's pad id cannot be that).
    model: one the caller opened (open_genai_model), with pad_token_id if it was given one.
    Greedy rows give what each prompt gives alone; sampled rows draw from genai's one generator.
    stop_after(row, token): called with each running row's new token (not an end id); True ends the
    row there ("stop_string"; genai steps on until every row has ended, its tokens are cut).
    limits: each row's own token limit (at most max_new_tokens), cut the same way ("length")."""
    og = import_genai()
    if model is None:
        config = decoder_folder.read_decoder_folder(folder)[1]
    else:  # the caller opened the folder (a benchmark's builder model has no diffexport metadata)
        config = _genai_config(folder)
    context = decoder_folder.context_length(config)
    eos = set(decoder_folder.eos_token_ids(config))
    width = max(len(p) for p in prompts)
    if width > context:
        raise DiffExportError(f"the prompt's {width} tokens exceed the folder's context length {context}")
    if model is None:
        pad_token_id = genai_pad_for(config, prompts)
        model = open_genai_model(folder, provider, pad_token_id)
    pad = decoder_folder.pad_token_id(config) if pad_token_id is None else pad_token_id
    if any(p[-1] == pad for p in prompts):
        raise DiffExportError(f"a prompt ends with the model's pad id {pad}, which genai would take for padding: "
                              "open the model with open_genai_model(folder, pad_token_id=genai_pad_for(...))")
    ids = np.full((len(prompts), width), pad, np.int32)
    for row, prompt in enumerate(prompts):
        ids[row, :len(prompt)] = prompt
    params = og.GeneratorParams(model)
    total = min(width + max_new_tokens, context)
    # genai's own repetition penalty reads each row's whole sequence, so it would also penalise the
    # pad id of a padded row (the pad is often the eos): the penalty is applied here instead, on
    # each row's real tokens, and genai's is left at 1
    penalty = sampling.repetition_penalty
    options = _search_options(dataclasses.replace(sampling, repetition_penalty=1.0), total, config,
                              width + min_new_tokens if min_new_tokens else 0)  # min: every row the same count
    params.set_search_options(**options, batch_size=len(prompts))
    seen = None
    if penalty != 1.0:
        import torch


        real = torch.arange(width)[None, :] < torch.tensor([len(p) for p in prompts])[:, None]  # right padding
        seen = seen_tokens(torch.from_numpy(ids), real, decoder_folder.vocab_size(config))
    start = time.perf_counter()
    generator = og.Generator(model, params)
    generator.append_tokens(ids)
    first, steps = None, 0
    running, cut = [True] * len(prompts), [None] * len(prompts)  # cut: (new tokens kept, why), a row ended early
    while not generator.is_done():
        if seen is not None:
            logits = generator.get_logits()  # [B, 1, V] float32
            generator.set_logits(penalize_repeats(torch.from_numpy(np.array(logits, np.float32)), seen[:, None],
                                                  penalty).numpy())
        generator.generate_next_token()
        steps += 1
        first = first or time.perf_counter()
        if seen is None and stop_after is None and limits is None:
            continue
        chosen = [int(t) for t in generator.get_next_tokens()]
        if seen is not None:
            seen[torch.arange(len(prompts)), torch.tensor(chosen)] = True
        if stop_after is not None or limits is not None:
            for row, token in enumerate(chosen):
                if running[row] and token in eos:
                    running[row] = False
                elif running[row] and stop_after is not None and stop_after(row, token):
                    running[row], cut[row] = False, (steps, "stop_string")
                elif running[row] and limits is not None and steps >= limits[row]:
                    running[row], cut[row] = False, (steps, "length")
            if not any(running):
                break
    finish = time.perf_counter()
    tokens, stops = [], []
    for row in range(len(prompts)):
        # every row's new tokens start after the padded width; a finished row goes on with padding
        new = [int(t) for t in generator.get_sequence(row)[width:]]
        end = next((k for k, t in enumerate(new) if t in eos), None)
        if cut[row] is not None:
            tokens.append(new[:cut[row][0]])
            stops.append(cut[row][1])
            continue
        tokens.append(new if end is None else new[:end + 1])
        stops.append("length" if end is None else "eos")
    return BatchRun(tokens, stops, sum(map(len, prompts)), finish - start, (first or finish) - start)


class GenaiChat:
    """A chat on onnxruntime-genai: one GenaiSession kept between turns, opened again only when a
    conversation ends with the pad id the session was opened with (genai would read it as padding)."""

    def __init__(self, folder, config: dict, sampling: Sampling, provider: str | None):
        self.folder, self.config, self.sampling, self.provider = folder, config, sampling, provider
        self.session: GenaiSession | None = None

    def turn(self, ids: list[int], max_new_tokens: int, on_token: Callable[[int], None] | None = None,
             stop_after: Callable[[int], bool] | None = None) -> DecodeRun:
        if self.session is None or ids[-1] == self.session.pad:
            self.session = GenaiSession(self.folder, self.sampling, provider=self.provider,
                                        pad_token_id=genai_pad_for(self.config, [ids]))
        return self.session.turn(ids, max_new_tokens, on_token=on_token, stop_after=stop_after)


class GenaiRuntime:
    """A Runtime (backends/base.py) on onnxruntime-genai: its own search, cache and batching. A model
    is opened per call's prompts (genai reads a prompt's trailing pad ids as padding: genai_pad_for
    picks a pad id that ends none of them)."""

    name = "genai"

    def __init__(self, folder, provider: str | None = None):
        self.folder, self.provider = Path(folder), provider
        self.config = decoder_folder.read_decoder_folder(folder)[1]

    def open(self) -> "GenaiRuntime":
        return self  # a model is opened per call: its pad id depends on the prompts

    def generate(self, ids: list[int], max_new_tokens: int, sampling: Sampling, *,
                 on_token: Callable[[int], None] | None = None,
                 stop_after: Callable[[int], bool] | None = None) -> DecodeRun:
        return generate_genai(self.folder, ids, max_new_tokens, sampling, provider=self.provider,
                              on_token=on_token, stop_after=stop_after)

    def generate_in_batches(self, prompts: list[list[int]], max_new_tokens: int, sampling: Sampling,
                            batch_size: int = 8, *, sort_by_length: bool = False,
                            stop_after: Callable[[int, int], bool] | None = None,
                            limits: list[int] | None = None) -> Iterator[tuple[list[int], BatchRun]]:
        pad = genai_pad_for(self.config, prompts)  # one model for every batch: a pad id that ends no prompt
        model = open_genai_model(self.folder, self.provider, pad)
        for indices, batch, longest, draws, cut, rows in planned_batches(prompts, max_new_tokens, sampling, batch_size,
                                                                         sort_by_length, stop_after, limits):
            yield indices, generate_batch_genai(self.folder, batch, longest, draws, model=model, pad_token_id=pad,
                                                stop_after=cut, limits=rows)

    def beam_searcher(self, search: BeamSearch, prompts: list[list[int]],
                      longest: int) -> Callable[[list[int], int], BeamRun]:
        meta = decoder_folder.read_decoder_folder(self.folder)[2]
        check_beam_memory(self.config, meta[DTYPE], search.num_beams, longest)
        check_genai_beams(search.num_beams, ": lower --num-beams, or use --backend onnxruntime (diffexport's "
                                            "search over the onnxruntime loop has no such limit)")
        model = open_genai_model(self.folder, self.provider, genai_pad_for(self.config, prompts))
        return lambda ids, new: beam_search_genai(self.folder, ids, new, search, model=model)

    def chat_session(self, sampling: Sampling) -> GenaiChat:
        return GenaiChat(self.folder, self.config, sampling, self.provider)


def open_genai_runtime(folder, *, provider: str = "auto", engine: str | None = None,
                       plugin_lib: str | None = None) -> GenaiRuntime:
    """The onnxruntime-genai runtime; provider "auto": the one the folder's genai_config names."""
    import_genai()
    refuse_engine(engine)
    return GenaiRuntime(folder, None if provider == "auto" else provider)
