"""Running a KV-cache decoder folder: onnxruntime-genai (its search, sampling and cache) or a plain
onnxruntime session loop (for users without onnxruntime-genai, and the reference when debugging).

Both stream token ids through `on_token` and return what they generated with timings, so
`diffexport generate`, `diffexport check` and tools/bench_decode.py share them. Several prompts go
as batches (generate_in_batches): genai pads them on the right, the onnxruntime loop on the left,
and greedy rows give what each prompt gives alone.
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import json
import os
import time
from pathlib import Path
from typing import Callable, Iterator

import numpy as np

from diffexport.backends.base import DecoderRunner
from diffexport.errors import DiffExportError
from diffexport.format import decoder_folder
from diffexport.format import names
from diffexport.format.genai_config import MAX_THREADS
from diffexport.generation import BeamSearch, Sampling, search_beams

@dataclasses.dataclass
class DecodeRun:
    tokens: list[int]  # new tokens (batch 1)
    prompt_tokens: int
    prefill_seconds: float  # prompt processed and first token chosen
    decode_seconds: float  # every later token
    stop: str  # "eos", "length" or "stop_string" (stop_after said so)

    @property
    def prompt_tokens_per_s(self) -> float:
        return self.prompt_tokens / self.prefill_seconds if self.prefill_seconds > 0 else float("nan")

    @property
    def decode_tokens_per_s(self) -> float:
        steps = len(self.tokens) - 1
        return steps / self.decode_seconds if steps > 0 and self.decode_seconds > 0 else float("nan")


def import_genai():
    try:
        import onnxruntime_genai
    except ImportError:
        raise DiffExportError("onnxruntime-genai is not installed: pip install 'diffexport[onnx]' "
                              "(or run with --backend onnxruntime)") from None
    return onnxruntime_genai


def empty_cache(batch: int, layers: int, heads: int, width: int, dtype) -> dict[str, np.ndarray]:
    """The cache before the prefill, keyed by present names: [batch, heads, 0, width] per layer."""
    empty = np.zeros((batch, heads, 0, width), dtype)
    return {name % i: empty for i in range(layers) for name in (names.PRESENT_KEY, names.PRESENT_VALUE)}


def step_feeds(ids: np.ndarray, mask: np.ndarray, cache: dict[str, np.ndarray], layers: int) -> dict[str, np.ndarray]:
    """One step's inputs: the tokens, the mask and last step's presents as this step's pasts."""
    feeds = {names.INPUT_IDS: ids, names.ATTENTION_MASK: mask}
    for i in range(layers):
        feeds[names.PAST_KEY % i] = cache[names.PRESENT_KEY % i]
        feeds[names.PAST_VALUE % i] = cache[names.PRESENT_VALUE % i]
    return feeds


class OrtDecoder:
    """One onnxruntime session over the folder's model.onnx; `step` runs one forward with the cache
    (a DecoderRunner: backends/base.py)."""

    max_sequence = None  # any call up to the context length

    def __init__(self, folder: str | Path, provider: str = "cpu", threads: int | None = None):
        from diffexport.onnxruntime_session import open_session

        read = decoder_folder.read_decoder_folder(folder)
        self.model_path, self.config, self.meta = read
        if self.meta["dtype"] == "bfloat16":  # numpy, which this loop feeds the cache as, has no bfloat16
            raise DiffExportError(f"{Path(folder).name} is a bfloat16 folder, which the onnxruntime loop cannot feed "
                                  "(numpy has no bfloat16): run it with onnxruntime-genai on CUDA (`generate --backend "
                                  "genai`), or build it with `diffexport trt` and check the engine")
        self.session = open_session(self.model_path, provider, threads or INTRA_OP_THREADS.get())
        self.layers, self.heads, self.width = read.layers, read.cache_heads, read.head_size  # heads 1: token-major
        self.context = read.context_length
        self.dtype = np.float16 if self.meta["dtype"] == "float16" else np.float32
        self.outputs = [o.name for o in self.session.get_outputs()]
        expected = names.decoder_output_names(self.layers)
        if self.outputs != expected:
            raise DiffExportError(f"{self.model_path.name} outputs {self.outputs[:3]}... are not a KV-cache "
                                  f"decoder's {expected[:3]}...: re-export it")
        past = next((i.shape for i in self.session.get_inputs() if i.name == names.PAST_KEY % 0), None)
        if past is None or len(past) != 4 or past[1] != self.heads or past[3] != self.width:
            raise DiffExportError(f"{names.GENAI_CONFIG} says the cache is [batch, {self.heads}, past, {self.width}] "
                                  f"but {self.model_path.name} takes {names.PAST_KEY % 0} {past}: the files do not "
                                  "belong together (re-export the folder)")

    def empty_cache(self, batch: int) -> dict[str, np.ndarray]:
        return empty_cache(batch, self.layers, self.heads, self.width, self.dtype)

    def step(self, ids: np.ndarray, mask: np.ndarray, cache: dict[str, np.ndarray]):
        """-> (logits [B, S, V], the new cache keyed by present names)."""
        if mask.shape[1] > self.context:
            raise DiffExportError(f"{mask.shape[1]} tokens exceed the folder's context length {self.context} "
                                  "(re-export with a larger --context-length, or ask for fewer tokens)")
        feeds = step_feeds(ids.astype(np.int64), mask.astype(np.int64), cache, self.layers)
        out = self.session.run(self.outputs, feeds)
        return out[0], dict(zip(self.outputs[1:], out[1:]))


def generate_onnxruntime(folder, prompt: list[int], max_new_tokens: int, sampling: Sampling,
                         on_token: Callable[[int], None] | None = None, threads: int | None = None,
                         runner: OrtDecoder | None = None, ignore_eos: bool = False, provider: str = "cpu",
                         stop_after: Callable[[int], bool] | None = None) -> DecodeRun:
    """stop_after(token): True ends generation after that token (a stop string completed)."""
    runner = runner or OrtDecoder(folder, provider=provider, threads=threads)
    timing = {}
    tokens, stops = _step_loop(runner, [prompt], max_new_tokens, sampling, timing, ignore_eos,
                               on_step=None if on_token is None else lambda chosen: on_token(chosen[0]),
                               stop_after=None if stop_after is None else lambda _, token: stop_after(token))
    return DecodeRun(tokens[0], len(prompt), timing["first"] - timing["start"], timing["end"] - timing["first"],
                     stops[0])


def _prefill_chunks(runner: DecoderRunner, ids: np.ndarray, mask: np.ndarray, cache: dict, done: int) -> tuple[dict, int]:
    """Run all but the last chunk of the prompt's tokens after the first `done` (a runner with a
    longest call, an engine's profile, takes a longer prompt in such chunks: the graph's causal mask
    is bottom-right, so each chunk sees the cache and itself as one long call would) -> (the cache,
    how many tokens it holds); the caller's next step runs the rest."""
    chunk = runner.max_sequence or ids.shape[1] - done
    while ids.shape[1] - done > chunk:
        _, cache = runner.step(ids[:, done:done + chunk], mask[:, :done + chunk], cache)
        done += chunk
    return cache, done


def _step_loop(runner, prompts: list[list[int]], max_new_tokens: int, sampling: Sampling, timing: dict,
               ignore_eos: bool = False, on_step: Callable[[list[int]], None] | None = None,
               stop_after: Callable[[int, int], bool] | None = None, state: dict | None = None,
               limits: list[int] | None = None):
    """Left-padded prompts through runner.step with its cache, one token per row and step, until every
    row has stopped -> (new tokens per row, stop per row); timing gets start, first and end.
    stop_after(row, token): called with each live row's new token (not an end id); True ends the row
    there ("stop_string"). state (one prompt, a LoopSession's): its "cache" holds the prompt's first
    state["cached"] tokens, which are not run again; the final cache (the prompt and every new token
    but the last) is written back to it. limits: each row's own token limit (at most max_new_tokens);
    a row that reaches it stops there ("length")."""
    import torch

    from diffexport.generation import choose_next, left_pad, seen_tokens

    eos = set(decoder_folder.eos_token_ids(runner.config))
    generator = None if sampling.greedy else torch.Generator().manual_seed(sampling.seed)
    longest = max(len(p) for p in prompts)
    if longest > runner.context:
        raise DiffExportError(f"the prompt's {longest} tokens exceed the folder's context length {runner.context}")
    pad = decoder_folder.pad_token_id(runner.config)
    padded_ids, padded_mask = left_pad(prompts, pad_token_id=pad)
    ids, mask = padded_ids.numpy(), padded_mask.numpy()
    cache = runner.empty_cache(len(prompts)) if state is None else state["cache"]
    tokens = [[] for _ in prompts]
    stops, live = ["length"] * len(prompts), [True] * len(prompts)
    timing["start"] = time.perf_counter()
    cache, done = _prefill_chunks(runner, ids, mask, cache, 0 if state is None else state["cached"])
    ids = ids[:, done:]
    seen = None
    for _ in range(max_new_tokens):
        logits, cache = runner.step(ids, mask, cache)
        last = torch.from_numpy(logits[:, -1].astype(np.float32))
        if sampling.repetition_penalty != 1.0 and seen is None:
            seen = seen_tokens(padded_ids, padded_mask, last.shape[-1])
        chosen = choose_next(last, sampling, generator, seen).tolist()
        if seen is not None:
            seen[torch.arange(len(chosen)), torch.tensor(chosen)] = True
        for row, token in enumerate(chosen):
            if live[row]:
                tokens[row].append(token)
                if token in eos and not ignore_eos:
                    live[row], stops[row] = False, "eos"
                elif stop_after is not None and stop_after(row, token):
                    live[row], stops[row] = False, "stop_string"
                elif limits is not None and len(tokens[row]) >= limits[row]:
                    live[row] = False  # its own limit: stops stays "length"
        timing.setdefault("first", time.perf_counter())
        if on_step is not None:
            on_step(chosen)
        if not any(live) or mask.shape[1] + 1 >= runner.context:  # genai's max_length: the context is full
            break
        ids = np.asarray([[t if live[row] else pad] for row, t in enumerate(chosen)], np.int64)
        mask = np.concatenate([mask, np.ones((len(prompts), 1), np.int64)], axis=1)
    timing["end"] = time.perf_counter()
    if state is not None:
        state["cache"] = cache
    return tokens, stops


@dataclasses.dataclass
class BatchRun:
    tokens: list[list[int]]  # per prompt, its new tokens (the end-of-sequence token that stopped it included)
    stops: list[str]  # per prompt, "eos", "length" or "stop_string"
    prompt_tokens: int  # all prompts' tokens, padding left out
    seconds: float  # the whole batch, prompts and decode
    prefill_seconds: float  # the prompts processed and every row's first token chosen

    @property
    def new_tokens(self) -> int:
        return sum(len(t) for t in self.tokens)

    @property
    def decode_tokens_per_s(self) -> float:
        """Every row's tokens after its first, over the time after the prefill (rows that stopped early
        count what they generated)."""
        later = sum(max(len(t) - 1, 0) for t in self.tokens)
        decode = self.seconds - self.prefill_seconds
        return later / decode if later and decode > 0 else float("nan")


def generate_batch_onnxruntime(folder, prompts: list[list[int]], max_new_tokens: int, sampling: Sampling,
                               runner: OrtDecoder | None = None, provider: str = "cpu",
                               threads: int | None = None, stop_after: Callable[[int, int], bool] | None = None,
                               limits: list[int] | None = None) -> BatchRun:
    """Several prompts as one left-padded batch through the onnxruntime loop (or an engine's runner).
    Greedy rows give what each prompt gives alone; sampled rows draw from one generator, so a batch
    is reproducible, not equal to its prompts sampled one at a time."""
    runner = runner or OrtDecoder(folder, provider=provider, threads=threads)
    timing = {}
    tokens, stops = _step_loop(runner, prompts, max_new_tokens, sampling, timing, stop_after=stop_after,
                               limits=limits)
    return BatchRun(tokens, stops, sum(map(len, prompts)), timing["end"] - timing["start"],
                    timing["first"] - timing["start"])


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
    from diffexport.format.genai_config import read_genai_config

    return read_genai_config(folder)


def machine_threads() -> int:
    """The physical cores this process may run on (onnxruntime's own default for its sessions),
    read from Linux's CPU topology; the usable logical CPUs where that cannot be read."""
    cpus = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else list(range(os.cpu_count() or 1))
    cores = set()
    for cpu in cpus:
        topology = Path(f"/sys/devices/system/cpu/cpu{cpu}/topology")
        try:
            cores.add(((topology / "physical_package_id").read_text(), (topology / "core_id").read_text()))
        except OSError:
            return max(1, len(cpus))
    return max(1, len(cores))


INTRA_OP_THREADS: contextvars.ContextVar[int | None] = contextvars.ContextVar("diffexport_intra_op_threads",
                                                                             default=None)


@contextlib.contextmanager
def intra_op_threads(threads: int | None):
    """Within: the onnxruntime-genai models and onnxruntime decoder sessions opened here run on
    `threads` intra-op threads, whatever the folder's genai_config says (`generate --threads`).
    None changes nothing. A setting for the process's generation, as torch.set_num_threads is."""
    if threads is not None and (isinstance(threads, bool) or not isinstance(threads, int)
                                or not 1 <= threads <= MAX_THREADS):
        raise DiffExportError(f"--threads must be 1 to {MAX_THREADS}, got {threads}")
    token = INTRA_OP_THREADS.set(threads)
    try:
        yield
    finally:
        INTRA_OP_THREADS.reset(token)


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
    tokens, first, stop = _genai_tokens(generator, total - len(prompt), set(decoder_folder.eos_token_ids(config)), on_token,
                                        stop_after)
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


@dataclasses.dataclass
class BeamRun:
    sequences: list[list[int]]  # the new tokens of each returned hypothesis, best first, end token left out
    stops: list[str]  # "eos" or "length", per sequence
    prompt_tokens: int
    seconds: float  # the whole search, prompt included
    steps: int  # decode steps run (each advances every beam by one token)


def check_beam_memory(config: dict, dtype: str, beams: int, length: int) -> None:
    """Refuse, before the search starts, beams whose KV caches at `length` tokens (prompt and new
    tokens) would not fit in this machine's memory (a slip such as --num-beams 4000)."""
    from diffexport.modeling import host_memory_bytes

    layers, heads, head_size = decoder_folder.cache_shape(config)
    per_token = 2 * layers * heads * head_size * (4 if dtype == "float32" else 2)
    need = beams * length * per_token
    have = host_memory_bytes()
    if need > have:
        raise DiffExportError(f"{beams} beams of {length} tokens need {need / 2**30:.1f} GiB of KV cache, more than "
                              f"the {have / 2**30:.0f} GiB here: lower --num-beams or --max-new-tokens")


GENAI_MAX_BEAMS = 32  # onnxruntime-genai 0.18 refuses num_beams outside [1, 32]


def check_genai_beams(num_beams: int, remedy: str = "") -> None:
    """Refuse, before genai is asked, a beam count genai's search does not take (remedy: what the
    caller can do instead, appended to the message)."""
    if num_beams > GENAI_MAX_BEAMS:
        raise DiffExportError(f"onnxruntime-genai searches at most {GENAI_MAX_BEAMS} beams, got {num_beams}{remedy}")


def beam_search_genai(folder, prompt: list[int], max_new_tokens: int, search: BeamSearch,
                      provider: str | None = None, model=None) -> BeamRun:
    """onnxruntime-genai's beam search over the folder (generation.beam_search is its eager
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


def beam_search_onnxruntime(folder, prompt: list[int], max_new_tokens: int, search: BeamSearch,
                            runner: OrtDecoder | None = None, provider: str = "cpu") -> BeamRun:
    """generation.search_beams over the onnxruntime loop (or an engine's runner: `--backend
    tensorrt`): the prompt runs once and its cache is copied to every beam; each step takes the
    cache rows in the beams' order. The length limit is genai's: the prompt and the new tokens
    stop at the context."""
    runner = runner or OrtDecoder(folder, provider=provider)
    if len(prompt) >= runner.context:
        raise DiffExportError(f"the prompt's {len(prompt)} tokens leave no room in the folder's context "
                              f"length {runner.context}")
    new_tokens = min(len(prompt) + max_new_tokens, runner.context) - len(prompt)
    state = {"steps": 0}

    def step(ids: list[list[int]], order: list[int] | None):
        import torch

        if order is None:
            first = np.asarray(ids[:1], np.int64)
            mask = np.ones_like(first)
            cache, done = _prefill_chunks(runner, first, mask, runner.empty_cache(1), 0)
            logits, cache = runner.step(first[:, done:], mask, cache)
            copies = np.zeros(len(ids), np.int64)  # the prompt's cache, once per beam
            state["cache"] = {name: value[copies] for name, value in cache.items()}
            state["mask"] = np.ones((len(ids), first.shape[1]), np.int64)
            logits = np.repeat(logits[:, -1:], len(ids), axis=0)
        else:
            cache = state["cache"] if order == list(range(len(order))) else \
                {name: value[np.asarray(order)] for name, value in state["cache"].items()}  # rows as the beams
            state["mask"] = np.concatenate([state["mask"], np.ones((len(ids), 1), np.int64)], axis=1)
            logits, state["cache"] = runner.step(np.asarray(ids, np.int64), state["mask"], cache)
            state["steps"] += 1
        return torch.from_numpy(logits[:, -1].astype(np.float32))

    start = time.perf_counter()
    ends = None if runner.config is None else decoder_folder.eos_token_ids(runner.config)  # an engine checked alone: none
    found = search_beams(step, prompt, search, new_tokens, ends)
    return BeamRun([h.tokens for h in found], [h.stop for h in found], len(prompt), time.perf_counter() - start,
                   state["steps"] + 1)


def shared_prefix(held: list[int], ids: list[int]) -> int:
    """How many leading tokens two sequences share."""
    return next((k for k, (a, b) in enumerate(zip(held, ids)) if a != b), min(len(held), len(ids)))


class LoopSession:
    """GenaiSession's turns on the onnxruntime loop or an engine's runner (`--backend onnxruntime`,
    `tensorrt`): the cache of the conversation so far is kept, cut back to what the next
    conversation shares with the tokens it holds, and only the rest is run. Sampled turns draw from
    their own seeds (batch_sampling); greedy answers are generate_onnxruntime's from scratch."""

    def __init__(self, runner, sampling: Sampling):
        self.runner, self.sampling = runner, sampling
        self.fed: list[int] = []  # the tokens whose keys and values the cache holds, in order
        self.cache = None
        self.turns = 0

    def turn(self, ids: list[int], max_new_tokens: int, on_token: Callable[[int], None] | None = None,
             stop_after: Callable[[int], bool] | None = None) -> DecodeRun:
        if not ids or len(ids) >= self.runner.context:
            raise DiffExportError(f"a turn needs 1 to {self.runner.context - 1} tokens (the context), got {len(ids)}")
        common = min(shared_prefix(self.fed, ids), len(ids) - 1)  # the last token's logits choose the answer
        cache = self.runner.empty_cache(1) if self.cache is None else \
            {name: past[:, :, :common] for name, past in self.cache.items()}  # [1, heads, tokens, width]
        cached = common if self.cache is not None else 0
        state = {"cache": cache, "cached": cached}
        timing: dict = {}
        tokens, stops = _step_loop(self.runner, [ids], max_new_tokens, batch_sampling(self.sampling, self.turns),
                                   timing, on_step=None if on_token is None else lambda chosen: on_token(chosen[0]),
                                   stop_after=None if stop_after is None else lambda _, token: stop_after(token),
                                   state=state)
        self.cache, self.fed, self.turns = state["cache"], list(ids) + tokens[0][:-1], self.turns + 1
        return DecodeRun(tokens[0], len(ids) - cached, timing["first"] - timing["start"],
                         timing["end"] - timing["first"], stops[0])


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

        from diffexport.generation import penalize_repeats, seen_tokens

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


def batch_plan(prompts: list[list[int]], batch_size: int, by_length: bool = False) -> list[list[int]]:
    """The prompts' indices, batch_size at a time: in order, or by_length longest first (ties in
    order), so that each batch pads its prompts to a length near their own (a batch costs its
    longest prompt in every row)."""
    if batch_size < 1:
        raise DiffExportError(f"the batch size must be >= 1, got {batch_size}")
    order = sorted(range(len(prompts)), key=lambda i: -len(prompts[i])) if by_length else list(range(len(prompts)))
    return [order[first:first + batch_size] for first in range(0, len(order), batch_size)]


def generate_in_batches(folder, prompts: list[list[int]], max_new_tokens: int, sampling: Sampling,
                        batch_size: int = 8, backend: str = "genai", provider: str | None = None,
                        runner: OrtDecoder | None = None, sort_by_length: bool = False,
                        stop_after: Callable[[int, int], bool] | None = None,
                        limits: list[int] | None = None) -> Iterator[tuple[list[int], BatchRun]]:
    """Prompts batch_size at a time (batch_plan: in order, or longest first with sort_by_length):
    yields (the batch's prompt indices, its run, row k answering prompts[indices[k]]). backend
    "genai" (provider None: the folder's) or "onnxruntime" (runner: an OrtDecoder, or an engine's
    runner; else one on provider). stop_after(prompt index, token): True ends that prompt's answer
    after the token (a stop string completed). limits: each prompt's own max_new_tokens (a batch
    runs to its rows' longest, each row cut at its own)."""
    plan = batch_plan(prompts, batch_size, sort_by_length)
    if backend == "genai":
        config = decoder_folder.read_decoder_folder(folder)[1]
        pad = genai_pad_for(config, prompts)  # one model for every batch: a pad id that ends no prompt
        model = open_genai_model(folder, provider, pad)
    else:
        runner = runner or OrtDecoder(folder, provider=provider or "cpu")
    for number, indices in enumerate(plan):
        batch, cut = [prompts[i] for i in indices], _by_prompt(stop_after, indices)
        draws = batch_sampling(sampling, number)
        rows = None if limits is None else [limits[i] for i in indices]
        longest = max_new_tokens if rows is None else max(rows)
        if backend == "genai":
            yield indices, generate_batch_genai(folder, batch, longest, draws, model=model, pad_token_id=pad,
                                                stop_after=cut, limits=rows)
        else:
            yield indices, generate_batch_onnxruntime(folder, batch, longest, draws, runner=runner,
                                                      stop_after=cut, limits=rows)


def batch_sampling(sampling: Sampling, number: int) -> Sampling:
    """The sampling of a plan's batch (or a chat's turn) `number`: its own seed after the first (the
    seed itself), so that row k of every batch does not reuse the same draws; greedy unchanged."""
    if sampling.greedy or number == 0:
        return sampling
    seed = int(np.random.SeedSequence([sampling.seed, number]).generate_state(1)[0]) & 0x7FFFFFFF  # genai: int32
    return dataclasses.replace(sampling, seed=seed)


def _by_prompt(stop_after, indices: list[int]):
    """A batch's stop_after(row, token) over the caller's stop_after(prompt index, token)."""
    return None if stop_after is None else lambda row, token: stop_after(indices[row], token)
