"""What every runtime shares. Two protocols:
- DecoderRunner: one forward of a KV-cache graph with the cache it is handed, whatever runs it
  (`step_loop.OrtDecoder`, `tensorrt.EngineDecoder`); the step loop (backends/step_loop.py), the
  searches and `check` rely on nothing else.
- Runtime: a decoder folder opened on one runtime, as text generation uses it (one answer,
  batches, beam search, a chat session). `step_loop.StepLoopRuntime` drives any DecoderRunner;
  onnxruntime-genai keeps its cache behind its own Generator API, so `genai.GenaiRuntime` drives
  it. backends/runtimes.py names them.
Also the records a run returns, the intra-op threads a run uses, how each batch of a plan draws,
and the memory a beam search's caches need.
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import os
from pathlib import Path
from typing import Callable, Iterator, Protocol, runtime_checkable

import numpy as np

from diffexport.core.eager_generation import BeamSearch, Sampling
from diffexport.core.errors import DiffExportError
from diffexport.format import decoder_folder
from diffexport.format.genai_config import MAX_THREADS
from diffexport.modeling.families import host_memory_bytes


@runtime_checkable
class DecoderRunner(Protocol):
    model_path: Path          # the graph or engine it runs
    meta: dict[str, str]      # the export's metadata (format/metadata.py)
    config: dict | None       # the folder's genai config (None: an engine opened without its folder)
    layers: int               # decoder layers, each with a past key and value
    context: int              # the longest sequence, past and new tokens, a step may see
    max_sequence: int | None  # the most new tokens one step takes (an engine's profile); None: up to context
    # step_in_place exists: the graph writes a step's keys and values into the past it reads (the
    # shared past/present buffer of GroupQueryAttention folders), so a cache is never copied
    writes_in_place: bool

    def empty_cache(self, batch: int) -> dict[str, np.ndarray]:
        """The cache before the first step, keyed by present names (format/names.py), past length 0."""
        ...

    def step(self, ids: np.ndarray, mask: np.ndarray,
             cache: dict[str, np.ndarray]) -> tuple[np.ndarray, dict[str, np.ndarray]]:
        """One forward: ids [B, S], mask [B, P+S] (0 = padding), last step's cache -> (logits
        [B, S, V], the new cache keyed by present names)."""
        ...

    def step_in_place(self, ids: np.ndarray, mask: np.ndarray, buffers: dict[str, np.ndarray]) -> np.ndarray:
        """One forward (writes_in_place runners only): ids [B, S], mask [B, P+S], buffers keyed by
        present names, contiguous [B, heads, capacity >= P+S, width] holding the past in their first
        P columns -> logits [B, S, V]; the step's keys and values are written into columns P..P+S-1."""
        ...


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


@dataclasses.dataclass
class BeamRun:
    sequences: list[list[int]]  # the new tokens of each returned hypothesis, best first, end token left out
    stops: list[str]  # "eos" or "length", per sequence
    prompt_tokens: int
    seconds: float  # the whole search, prompt included
    steps: int  # decode steps run (each advances every beam by one token)


def shared_prefix(held: list[int], ids: list[int]) -> int:
    """How many leading tokens two sequences share."""
    return next((k for k, (a, b) in enumerate(zip(held, ids)) if a != b), min(len(held), len(ids)))


def batch_sampling(sampling: Sampling, number: int) -> Sampling:
    """The sampling of a plan's batch (or a chat's turn) `number`: its own seed after the first (the
    seed itself), so that row k of every batch does not reuse the same draws; greedy unchanged."""
    if sampling.greedy or number == 0:
        return sampling
    seed = int(np.random.SeedSequence([sampling.seed, number]).generate_state(1)[0]) & 0x7FFFFFFF  # genai: int32
    return dataclasses.replace(sampling, seed=seed)


class ChatRuns(Protocol):
    """A conversation on one runtime that keeps its cache between turns: each turn gives the whole
    conversation's ids and reads only what the held sequence does not share with them."""

    def turn(self, ids: list[int], max_new_tokens: int, on_token: Callable[[int], None] | None = None,
             stop_after: Callable[[int], bool] | None = None) -> DecodeRun:
        ...


@runtime_checkable
class Runtime(Protocol):
    """A decoder folder on one runtime, opened once (what it loads is loaded at the first call, or
    at open()); made by backends/runtimes.open_runtime, which refuses the options it does not take."""
    name: str                 # its name in runtimes.RUNTIMES (the CLI's --backend)
    folder: Path
    provider: str | None      # the execution provider it runs on (None: the folder's own, or a GPU engine)

    def open(self) -> "Runtime":
        """Load what it runs (a session, a model, an engine) now, not at the first call -> itself."""
        ...

    def generate(self, ids: list[int], max_new_tokens: int, sampling: Sampling, *,
                 on_token: Callable[[int], None] | None = None,
                 stop_after: Callable[[int], bool] | None = None) -> DecodeRun:
        """One prompt's answer; on_token(token), or stop_after(token) -> True to end it there."""
        ...

    def generate_in_batches(self, prompts: list[list[int]], max_new_tokens: int, sampling: Sampling,
                            batch_size: int = 8, *, sort_by_length: bool = False,
                            stop_after: Callable[[int, int], bool] | None = None,
                            limits: list[int] | None = None) -> Iterator[tuple[list[int], BatchRun]]:
        """Prompts batch_size at a time (batch_plan) -> (the batch's prompt indices, its run, row k
        answering prompts[indices[k]]). stop_after(prompt index, token): True ends that prompt's
        answer after the token. limits: each prompt's own max_new_tokens."""
        ...

    def beam_searcher(self, search: BeamSearch, prompts: list[list[int]],
                      longest: int) -> Callable[[list[int], int], BeamRun]:
        """(prompt ids, max new tokens -> BeamRun) for these prompts; longest: the most tokens a
        search holds (its caches are checked against this machine's memory first)."""
        ...

    def chat_session(self, sampling: Sampling) -> ChatRuns:
        ...


def batch_plan(prompts: list[list[int]], batch_size: int, by_length: bool = False) -> list[list[int]]:
    """The prompts' indices, batch_size at a time: in order, or by_length longest first (ties in
    order), so that each batch pads its prompts to a length near their own (a batch costs its
    longest prompt in every row)."""
    if batch_size < 1:
        raise DiffExportError(f"the batch size must be >= 1, got {batch_size}")
    order = sorted(range(len(prompts)), key=lambda i: -len(prompts[i])) if by_length else list(range(len(prompts)))
    return [order[first:first + batch_size] for first in range(0, len(order), batch_size)]


def by_prompt(stop_after: Callable[[int, int], bool] | None, indices: list[int]):
    """A batch's stop_after(row, token) over the caller's stop_after(prompt index, token)."""
    return None if stop_after is None else lambda row, token: stop_after(indices[row], token)


def planned_batches(prompts: list[list[int]], max_new_tokens: int, sampling: Sampling, batch_size: int,
                    sort_by_length: bool, stop_after: Callable[[int, int], bool] | None, limits: list[int] | None):
    """Each batch of a plan (batch_plan) as a runtime runs it: (its prompt indices, its prompts, its
    token limit, its draws (batch_sampling), its rows' stop_after, its rows' own limits or None)."""
    for number, indices in enumerate(batch_plan(prompts, batch_size, sort_by_length)):
        rows = None if limits is None else [limits[i] for i in indices]
        yield (indices, [prompts[i] for i in indices], max_new_tokens if rows is None else max(rows),
               batch_sampling(sampling, number), by_prompt(stop_after, indices), rows)


def check_beam_memory(config: dict, dtype: str, beams: int, length: int) -> None:
    """Refuse, before the search starts, beams whose KV caches at `length` tokens (prompt and new
    tokens) would not fit in this machine's memory (a slip such as --num-beams 4000)."""

    layers, heads, head_size = decoder_folder.cache_shape(config)
    per_token = 2 * layers * heads * head_size * (4 if dtype == "float32" else 2)
    need = beams * length * per_token
    have = host_memory_bytes()
    if need > have:
        raise DiffExportError(f"{beams} beams of {length} tokens need {need / 2**30:.1f} GiB of KV cache, more than "
                              f"the {have / 2**30:.0f} GiB here: lower --num-beams or --max-new-tokens")


# An engine without --backend tensorrt, or --backend tensorrt without an engine
ENGINE_PAIRING = ("--backend tensorrt runs the engine `diffexport trt FOLDER` built: give both --backend tensorrt "
                  "and --engine ENGINE")


def refuse_engine(engine: str | None) -> None:
    """An engine given to a runtime that runs the folder's ONNX graph."""
    if engine is not None:
        raise DiffExportError(ENGINE_PAIRING)
