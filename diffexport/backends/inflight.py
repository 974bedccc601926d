"""In-flight (continuous) batching over any DecoderRunner: a request joins the running decode batch
at the next step instead of waiting for the batch to end, and a finished request leaves at once.

Each step first admits waiting requests (up to max_rows): each is prefilled alone, its first token
chosen, and its cache laid beside the running rows'. The shorter side is padded on the right, after
its tokens, to their common past length: the mask's zeros hide the padding, as in onnxruntime-genai's
right-padded batches, and a row's next token goes on from its own tokens (positions count its
tokens, never the padding: the DiffAttention graph's from the mask, the GroupQueryAttention one's
from the slot less the padding after a row's first token, so keys cached alone keep their
positions). Then every row decodes one token in one batched call. A row leaves when it ends: an
end id, its own token limit, the context, or its on_token asking to stop (a stop string, or a
client gone); the cache's columns that no row uses any more are cut.

While rows are running, a joining prompt is prefilled prefill_chunk tokens per step (the graph's
causal mask is bottom-right, so a chunk sees the cache and itself as one call would): a long prompt
delays the running rows' next tokens by one chunk's time per step, not by its whole prefill. With
nothing running it is prefilled at once.

Where the cache lives (the runner says: DecoderRunner.writes_in_place):
- GroupQueryAttention folders write each step's keys and values into the past they read, as in
  onnxruntime-genai's shared buffer. The rows' caches are one preallocated buffer per layer
  [max_rows + 1, heads, capacity, width]: rows 0..n-1 the running rows, the last one the joining
  prompt's; a step runs on the first n rows in place, a row joins by one copy of its prompt's cache,
  and only leaving rows move anything. Capacity grows by doubling up to the context.
- Other runners (DiffAttention folders, engines) return a new cache each step: arrays padded and
  concatenated when a row joins.

Greedy rows give what each prompt gives alone (generate_stepped): a row's prefill runs alone and
its decode steps are the step loop's left-padded batch. A sampled row draws from a generator of
its own, seeded by its sampling's seed, so its answer does not depend on what runs beside it.
"""

from __future__ import annotations

import dataclasses
from collections import deque
from typing import Callable

import numpy as np
import torch

from diffexport.backends.base import DecoderRunner
from diffexport.core.eager_generation import Sampling, choose_next, seen_tokens
from diffexport.core.errors import DiffExportError
from diffexport.format import decoder_folder


@dataclasses.dataclass
class InflightRequest:
    """One prompt's answer through the batcher. on_token(token) is called with each new token (end
    ids excepted) as it is chosen; True ends the answer there ("stop_string"). Once `stop` is set
    ("eos", "length" or "stop_string") the answer is whole."""
    ids: list[int]
    max_new_tokens: int
    sampling: Sampling = dataclasses.field(default_factory=Sampling)
    on_token: Callable[[int], bool] | None = None
    tokens: list[int] = dataclasses.field(default_factory=list)
    stop: str | None = None


@dataclasses.dataclass
class _Row:
    request: InflightRequest
    generator: torch.Generator | None
    seen: torch.Tensor | None  # [1, V]: the ids the row holds, for a repetition penalty
    pending: int  # the token chosen last, not yet run through the model


@dataclasses.dataclass
class _Joining:
    row: _Row
    ids: np.ndarray  # [1, L] the prompt
    done: int = 0  # its tokens in the cache so far


class _ReturnedCache:
    """The running rows' cache as the arrays the runner hands back each step (any runner)."""

    def __init__(self, runner: DecoderRunner):
        self.runner = runner
        self.rows: dict[str, np.ndarray] | None = None  # [rows, heads, past, width] per present name
        self.joining: dict[str, np.ndarray] | None = None  # [1, heads, done, width]

    @property
    def held(self) -> int:
        return 0 if self.rows is None else len(next(iter(self.rows.values())))

    def start(self) -> None:
        self.joining = self.runner.empty_cache(1)

    def prefill(self, ids: np.ndarray, mask: np.ndarray) -> np.ndarray:
        logits, self.joining = self.runner.step(ids, mask, self.joining)
        return logits

    def join(self, width: int) -> None:
        """The joining cache becomes the last row; every row padded on the right to `width` columns."""
        joining, self.joining = self.joining, None
        if self.rows is None:
            self.rows = joining
            return
        self.rows = {name: np.concatenate([_pad_right(self.rows[name], width), _pad_right(joining[name], width)])
                     for name in self.rows}

    def decode(self, ids: np.ndarray, mask: np.ndarray) -> np.ndarray:
        logits, self.rows = self.runner.step(ids, mask, self.rows)
        return logits

    def keep(self, rows: list[int], columns: np.ndarray) -> None:
        """Only these rows, and only the past's columns marked True."""
        if not rows:
            self.rows = None
            return
        self.rows = {name: value[rows] if columns.all() else value[rows][:, :, columns]
                     for name, value in self.rows.items()}


class _SharedBuffers:
    """The running rows' cache in buffers the runner writes in place (the module says how)."""

    def __init__(self, runner: DecoderRunner, max_rows: int):
        self.runner, self.slot = runner, max_rows  # the joining prompt's row
        self.buffers: dict[str, np.ndarray] = {}
        self.count = 0  # running rows
        self.joining_width = 0

    @property
    def held(self) -> int:
        return self.count

    @property
    def capacity(self) -> int:
        return next(iter(self.buffers.values())).shape[2] if self.buffers else 0

    def _reserve(self, width: int) -> None:
        capacity = self.capacity
        if width <= capacity:
            return
        grown = min(self.runner.context, max(width, 2 * capacity, 64))
        empty = self.runner.empty_cache(1)  # for the heads, width and type of each layer's cache
        old, self.buffers = self.buffers, {}
        for name, past in empty.items():
            # zeros, not garbage: padded columns are masked by a finite bias, so what they hold must be finite
            self.buffers[name] = np.zeros((self.slot + 1, past.shape[1], grown, past.shape[3]), past.dtype)
            if name in old:
                self.buffers[name][:, :, :capacity] = old[name]

    def _rows(self, start: int, stop: int) -> dict[str, np.ndarray]:
        return {name: buffer[start:stop] for name, buffer in self.buffers.items()}

    def start(self) -> None:
        self.joining_width = 0

    def prefill(self, ids: np.ndarray, mask: np.ndarray) -> np.ndarray:
        self._reserve(mask.shape[1])
        self.joining_width = mask.shape[1]
        return self.runner.step_in_place(ids, mask, self._rows(self.slot, self.slot + 1))

    def join(self, width: int) -> None:
        self._reserve(width)
        for buffer in self.buffers.values():
            buffer[self.count, :, :self.joining_width] = buffer[self.slot, :, :self.joining_width]
        self.count += 1

    def decode(self, ids: np.ndarray, mask: np.ndarray) -> np.ndarray:
        self._reserve(mask.shape[1])
        return self.runner.step_in_place(ids, mask, self._rows(0, self.count))

    def keep(self, rows: list[int], columns: np.ndarray) -> None:
        """Rows move down to 0..len(rows)-1 in order, each with only its used columns; row i is read
        (a copy, by the index) before row j <= i is written, and no later source lies below j."""
        moved = not columns.all()
        used = np.flatnonzero(columns)
        for target, source in enumerate(rows):
            if moved or target != source:
                for buffer in self.buffers.values():
                    buffer[target, :, :used.size] = buffer[source][:, used]
        self.count = len(rows)


class InflightBatcher:
    """The running batch over `runner` (an OrtDecoder or an engine's runner), at most max_rows rows;
    a joining prompt is prefilled prefill_chunk tokens per step while rows run."""

    def __init__(self, runner: DecoderRunner, max_rows: int = 8, prefill_chunk: int = 128):
        if max_rows < 1:
            raise DiffExportError(f"the batch needs at least one row, got {max_rows}")
        if prefill_chunk < 1:
            raise DiffExportError(f"prefill_chunk must be >= 1 token, got {prefill_chunk}")
        self.runner, self.max_rows, self.prefill_chunk = runner, max_rows, prefill_chunk
        self.eos = set(decoder_folder.eos_token_ids(runner.config))
        self.pad = decoder_folder.pad_token_id(runner.config)
        self.vocab = decoder_folder.vocab_size(runner.config)
        self.waiting: deque[InflightRequest] = deque()
        self.rows: list[_Row] = []
        self.joining: _Joining | None = None
        self.cache = _SharedBuffers(runner, max_rows) if runner.writes_in_place else _ReturnedCache(runner)
        self.mask: np.ndarray | None = None  # [rows, past]: 1 for a token, 0 for padding

    def submit(self, request: InflightRequest) -> InflightRequest:
        """Queue a request; it joins the running batch at the next step with a free row."""
        if not request.ids or len(request.ids) >= self.runner.context:
            raise DiffExportError(f"a prompt needs 1 to {self.runner.context - 1} tokens (the context), "
                                  f"got {len(request.ids)}")
        if any(not 0 <= t < self.vocab for t in request.ids):
            raise DiffExportError(f"a prompt's ids must lie in [0, {self.vocab})")
        if request.max_new_tokens < 1:
            raise DiffExportError(f"max_new_tokens must be >= 1, got {request.max_new_tokens}")
        self.waiting.append(request)
        return request

    @property
    def busy(self) -> bool:
        return bool(self.rows or self.waiting or self.joining)

    def step(self) -> list[InflightRequest]:
        """Admit what waits while rows are free (each prefilled alone, its first token chosen; one
        chunk of a prompt per step while rows run), then decode one token for every row in one
        call -> the requests that ended in this step."""
        ended = []
        while len(self.rows) < self.max_rows and (self.joining or self.waiting):
            if self.joining is None:
                self.joining = self._start(self.waiting.popleft())
            if not self._prefill(self.joining, whole=not self.rows):
                break  # the rest of its prompt after the running rows' step
            row, self.joining = self.joining.row, None
            if row.request.stop is not None:
                ended.append(row.request)
        if self.rows:
            ended += self._decode()
        return ended

    def clear(self) -> None:
        """Forget every request, running or waiting (after a failure the caller has told them of)."""
        self.waiting.clear()
        self.rows, self.joining, self.mask = [], None, None
        self.cache.keep([], np.zeros(0, bool))

    def run(self) -> None:
        """Step until nothing runs or waits."""
        while self.busy:
            self.step()

    def _choose(self, row: _Row, logits: np.ndarray) -> int:
        last = torch.from_numpy(np.ascontiguousarray(logits, np.float32))[None]
        return int(choose_next(last, row.request.sampling, row.generator, row.seen)[0])

    def _take(self, row: _Row, token: int) -> bool:
        """Record a chosen token -> whether the row has ended."""
        request = row.request
        request.tokens.append(token)
        if row.seen is not None:
            row.seen[0, token] = True
        if token in self.eos:
            request.stop = "eos"
        elif request.on_token is not None and request.on_token(token):
            request.stop = "stop_string"
        elif len(request.tokens) >= request.max_new_tokens or len(request.ids) + len(request.tokens) >= \
                self.runner.context:
            request.stop = "length"
        else:
            row.pending = token
            return False
        return True

    def _start(self, request: InflightRequest) -> _Joining:
        sampling = request.sampling
        generator = None if sampling.greedy else torch.Generator().manual_seed(sampling.seed)
        ids = np.asarray([request.ids], np.int64)
        seen = None
        if sampling.repetition_penalty != 1.0:
            seen = seen_tokens(torch.from_numpy(ids), None, self.vocab)
        self.cache.start()
        return _Joining(_Row(request, generator, seen, pending=self.pad), ids)

    def _prefill(self, joining: _Joining, whole: bool) -> bool:
        """Run the joining prompt's next chunk (whole: all of it; each call within the runner's
        longest) -> whether its prompt is done: its first token chosen, and unless that ended it,
        the row laid beside the running rows."""
        total = joining.ids.shape[1]
        longest = self.runner.max_sequence or total
        while True:
            size = min(total - joining.done, longest, total if whole else self.prefill_chunk)
            end = joining.done + size
            logits = self.cache.prefill(joining.ids[:, joining.done:end], np.ones((1, end), np.int64))
            joining.done = end
            if end == total:
                break
            if not whole:
                return False
        row = joining.row
        if self._take(row, self._choose(row, logits[0, -1])):
            return True  # ended at its first token: its cache is never joined (the next start drops it)
        width = total if self.mask is None else max(self.mask.shape[1], total)
        mask = np.ones((1, total), np.int64)
        self.mask = mask if self.mask is None else \
            np.concatenate([_pad_right(self.mask, width, axis=1), _pad_right(mask, width, axis=1)])
        self.cache.join(width)
        self.rows.append(row)
        return True

    def _decode(self) -> list[InflightRequest]:
        """One step of every row: each runs the token it was given last."""
        ids = np.asarray([[row.pending] for row in self.rows], np.int64)
        self.mask = np.concatenate([self.mask, np.ones((len(self.rows), 1), np.int64)], axis=1)
        logits = self.cache.decode(ids, self.mask)
        ended, keep = [], []
        for index, row in enumerate(self.rows):
            if self._take(row, self._choose(row, logits[index, -1])):
                ended.append(row.request)
            else:
                keep.append(index)
        if len(keep) < len(self.rows):
            self._keep(keep)
        return ended

    def _keep(self, keep: list[int]) -> None:
        """Drop the ended rows, and the columns no remaining row uses (padding in every row: every
        row starts with a token, so such a column lies after each row's first token, and cutting
        it moves no row's positions)."""
        self.rows = [self.rows[i] for i in keep]
        mask = self.mask[keep]
        used = mask.any(axis=0)
        self.mask = mask[:, used] if keep else None
        self.cache.keep(keep, used)


def _pad_right(array: np.ndarray, width: int, axis: int = 2) -> np.ndarray:
    """array with zeros after its end on `axis` up to `width` (a cache's past axis, or a mask's)."""
    missing = width - array.shape[axis]
    if missing == 0:
        return array
    shape = list(array.shape)
    shape[axis] = missing
    return np.concatenate([array, np.zeros(shape, array.dtype)], axis=axis)
