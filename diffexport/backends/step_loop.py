"""Running a KV-cache decoder folder in a plain onnxruntime session loop: the step loop with its
own cache (for users without onnxruntime-genai, the reference when debugging, and the loop an
engine's runner is driven through), batches padded on the left, beam search over it, and a chat
session that keeps its cache between turns.

It returns what onnxruntime-genai's functions (backends/genai.py) return, the records in
backends/base.py, so `diffexport generate`, `check` and the benchmarks use either. As a Runtime
(StepLoopRuntime) it serves any DecoderRunner: the onnxruntime session here, an engine's runner
(backends/tensorrt.py). Several prompts go as left-padded batches; greedy rows give what each
prompt gives alone.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Callable, Iterator

import numpy as np

from diffexport.backends.base import (
    INTRA_OP_THREADS,
    BatchRun,
    BeamRun,
    DecoderRunner,
    DecodeRun,
    batch_sampling,
    check_beam_memory,
    planned_batches,
    refuse_engine,
    shared_prefix,
)
from diffexport.core.eager_generation import BeamSearch, Sampling, choose_next, left_pad, search_beams, seen_tokens
from diffexport.core.errors import DiffExportError
from diffexport.core.onnxruntime_session import open_session, ortvalue_over, resolve_provider
from diffexport.format import decoder_folder, names
from diffexport.format.metadata_keys import DTYPE


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

        read = decoder_folder.read_decoder_folder(folder)
        self.model_path, self.config, self.meta = read
        if self.meta[DTYPE] == "bfloat16":  # numpy, which this loop feeds the cache as, has no bfloat16
            raise DiffExportError(f"{Path(folder).name} is a bfloat16 folder, which the onnxruntime loop cannot feed "
                                  "(numpy has no bfloat16): run it with onnxruntime-genai on CUDA (`generate --backend "
                                  "genai`), or build it with `diffexport trt` and check the engine")
        self.session = open_session(self.model_path, provider, threads or INTRA_OP_THREADS.get())
        self.layers, self.heads, self.width = read.layers, read.cache_heads, read.head_size  # heads 1: token-major
        self.context = read.context_length
        self.dtype = np.float16 if self.meta[DTYPE] == "float16" else np.float32
        past_type = next((i.type for i in self.session.get_inputs() if i.name == names.PAST_KEY % 0), "")
        self.cache_dtype = np.int8 if past_type == "tensor(int8)" else self.dtype  # `quantize --kv-cache int8`
        self.outputs = [o.name for o in self.session.get_outputs()]
        self.writes_in_place = read.format.shared_buffer
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
        return empty_cache(batch, self.layers, self.heads, self.width, self.cache_dtype)

    def _check_context(self, mask: np.ndarray) -> None:
        if mask.shape[1] > self.context:
            raise DiffExportError(f"{mask.shape[1]} tokens exceed the folder's context length {self.context} "
                                  "(re-export with a larger --context-length, or ask for fewer tokens)")

    def step(self, ids: np.ndarray, mask: np.ndarray, cache: dict[str, np.ndarray]):
        """-> (logits [B, S, V], the new cache keyed by present names)."""
        self._check_context(mask)
        feeds = step_feeds(ids.astype(np.int64), mask.astype(np.int64), cache, self.layers)
        out = self.session.run(self.outputs, feeds)
        return out[0], dict(zip(self.outputs[1:], out[1:]))

    def step_in_place(self, ids: np.ndarray, mask: np.ndarray, buffers: dict[str, np.ndarray]) -> np.ndarray:
        """-> logits [B, S, V]; the step's keys and values land in `buffers` (DecoderRunner says how).
        Each past and its present are bound to one buffer, as onnxruntime-genai binds its shared
        buffer: GroupQueryAttention then appends in place instead of copying the past."""
        if not self.writes_in_place:
            raise DiffExportError(f"{self.model_path.name} has no shared past/present buffer (a "
                                  f"{self.meta.attention} folder): step it with step()")
        self._check_context(mask)
        binding = self.session.io_binding()
        binding.bind_cpu_input(names.INPUT_IDS, np.ascontiguousarray(ids, np.int64))
        binding.bind_cpu_input(names.ATTENTION_MASK, np.ascontiguousarray(mask, np.int64))
        binding.bind_output(self.outputs[0])  # bound first: the outputs come back in binding order
        for i in range(self.layers):
            for past, present in ((names.PAST_KEY % i, names.PRESENT_KEY % i),
                                  (names.PAST_VALUE % i, names.PRESENT_VALUE % i)):
                buffer = buffers[present]
                if not buffer.flags.c_contiguous or buffer.shape[2] < mask.shape[1] or buffer.shape[0] != ids.shape[0]:
                    raise DiffExportError(f"internal: {present}'s buffer {buffer.shape} cannot hold batch "
                                          f"{ids.shape[0]} x {mask.shape[1]} tokens in place")
                value = ortvalue_over(buffer)
                binding.bind_ortvalue_input(past, value)
                binding.bind_ortvalue_output(present, value)
        self.session.run_with_iobinding(binding)
        return binding.get_outputs()[0].numpy()  # the logits only: copy_outputs_to_cpu would copy the cache too


def generate_stepped(folder, prompt: list[int], max_new_tokens: int, sampling: Sampling,
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


def prefill_chunks(runner: DecoderRunner, ids: np.ndarray, mask: np.ndarray, cache: dict,
                    done: int) -> tuple[dict, int]:
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
    cache, done = prefill_chunks(runner, ids, mask, cache, 0 if state is None else state["cached"])
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


def generate_batch_stepped(folder, prompts: list[list[int]], max_new_tokens: int, sampling: Sampling,
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


def beam_search_stepped(folder, prompt: list[int], max_new_tokens: int, search: BeamSearch,
                        runner: OrtDecoder | None = None, provider: str = "cpu") -> BeamRun:
    """eager_generation.search_beams over the onnxruntime loop (or an engine's runner: `--backend
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
            cache, done = prefill_chunks(runner, first, mask, runner.empty_cache(1), 0)
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
    # an engine checked alone: none
    ends = None if runner.config is None else decoder_folder.eos_token_ids(runner.config)
    found = search_beams(step, prompt, search, new_tokens, ends)
    return BeamRun([h.tokens for h in found], [h.stop for h in found], len(prompt), time.perf_counter() - start,
                   state["steps"] + 1)


class LoopSession:
    """GenaiSession's turns on the onnxruntime loop or an engine's runner (`--backend onnxruntime`,
    `tensorrt`): the cache of the conversation so far is kept, cut back to what the next
    conversation shares with the tokens it holds, and only the rest is run. Sampled turns draw from
    their own seeds (batch_sampling); greedy answers are generate_stepped's from scratch."""

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


class StepLoopRuntime:
    """A Runtime (backends/base.py) over any DecoderRunner, stepped by this module's loop: the
    onnxruntime session (`open_onnxruntime_runtime`) or a TensorRT engine (`tensorrt.open_engine_runtime`).
    The runner is opened once, at open() or the first call, and serves every call after."""

    def __init__(self, name: str, folder, provider: str | None, open_runner: Callable[[], DecoderRunner]):
        self.name, self.folder, self.provider = name, Path(folder), provider
        self._open_runner, self._runner = open_runner, None

    @property
    def runner(self) -> DecoderRunner:
        return self.open()._runner

    def open(self) -> "StepLoopRuntime":
        if self._runner is None:
            self._runner = self._open_runner()
        return self

    def generate(self, ids: list[int], max_new_tokens: int, sampling: Sampling, *,
                 on_token: Callable[[int], None] | None = None,
                 stop_after: Callable[[int], bool] | None = None) -> DecodeRun:
        return generate_stepped(self.folder, ids, max_new_tokens, sampling, runner=self.runner,
                                on_token=on_token, stop_after=stop_after)

    def generate_in_batches(self, prompts: list[list[int]], max_new_tokens: int, sampling: Sampling,
                            batch_size: int = 8, *, sort_by_length: bool = False,
                            stop_after: Callable[[int, int], bool] | None = None,
                            limits: list[int] | None = None) -> Iterator[tuple[list[int], BatchRun]]:
        for indices, batch, longest, draws, cut, rows in planned_batches(prompts, max_new_tokens, sampling, batch_size,
                                                                         sort_by_length, stop_after, limits):
            yield indices, generate_batch_stepped(self.folder, batch, longest, draws, runner=self.runner,
                                                  stop_after=cut, limits=rows)

    def beam_searcher(self, search: BeamSearch, prompts: list[list[int]],
                      longest: int) -> Callable[[list[int], int], BeamRun]:
        runner = self.runner
        if runner.config is not None:
            check_beam_memory(runner.config, runner.meta[DTYPE], search.num_beams, longest)
        return lambda ids, new: beam_search_stepped(self.folder, ids, new, search, runner)

    def chat_session(self, sampling: Sampling) -> "LoopSession":
        return LoopSession(self.runner, sampling)


def open_onnxruntime_runtime(folder, *, provider: str = "auto", engine: str | None = None,
                     plugin_lib: str | None = None) -> StepLoopRuntime:
    """The onnxruntime runtime: an OrtDecoder on the resolved provider ("auto": CUDA when
    onnxruntime-gpu and a GPU are present), stepped by this module's loop."""
    refuse_engine(engine)
    resolved = resolve_provider(provider)
    return StepLoopRuntime("onnxruntime", folder, resolved, lambda: OrtDecoder(folder, provider=resolved))
