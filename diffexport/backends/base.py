"""What every KV-cache decoder runner shares: the protocol the generation loop
(backends/decoding.py), the searches and `check` rely on, whatever runs the graph; the records a
run returns; the intra-op threads a run uses; how each batch of a plan draws.

The protocol is implemented by the onnxruntime loop (`decoding.OrtDecoder`) and the TensorRT
engine runner (`tensorrt.EngineDecoder`). onnxruntime-genai keeps its own cache behind its
Generator API, so it is driven through backends/genai.py, not this protocol, and returns the same
records.
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import os
from pathlib import Path
from typing import Protocol, runtime_checkable

import numpy as np

from diffexport.core.eager_generation import Sampling
from diffexport.core.errors import DiffExportError
from diffexport.format.genai_config import MAX_THREADS


@runtime_checkable
class DecoderRunner(Protocol):
    model_path: Path          # the graph or engine it runs
    meta: dict[str, str]      # the export's metadata (format/metadata.py)
    config: dict | None       # the folder's genai config (None: an engine opened without its folder)
    layers: int               # decoder layers, each with a past key and value
    context: int              # the longest sequence, past and new tokens, a step may see
    max_sequence: int | None  # the most new tokens one step takes (an engine's profile); None: up to context

    def empty_cache(self, batch: int) -> dict[str, np.ndarray]:
        """The cache before the first step, keyed by present names (format/names.py), past length 0."""
        ...

    def step(self, ids: np.ndarray, mask: np.ndarray,
             cache: dict[str, np.ndarray]) -> tuple[np.ndarray, dict[str, np.ndarray]]:
        """One forward: ids [B, S], mask [B, P+S] (0 = padding), last step's cache -> (logits
        [B, S, V], the new cache keyed by present names)."""
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
