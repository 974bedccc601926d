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
from diffexport.backends.step_loop import prefill_chunks
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


class InflightBatcher:
    """The running batch over `runner` (an OrtDecoder or an engine's runner), at most max_rows rows."""

    def __init__(self, runner: DecoderRunner, max_rows: int = 8):
        if max_rows < 1:
            raise DiffExportError(f"the batch needs at least one row, got {max_rows}")
        self.runner, self.max_rows = runner, max_rows
        self.eos = set(decoder_folder.eos_token_ids(runner.config))
        self.pad = decoder_folder.pad_token_id(runner.config)
        self.vocab = decoder_folder.vocab_size(runner.config)
        self.waiting: deque[InflightRequest] = deque()
        self.rows: list[_Row] = []
        self.cache: dict[str, np.ndarray] | None = None  # [rows, heads, past, width] per present name
        self.mask: np.ndarray | None = None  # [rows, past]: 1 for a token, 0 for left padding

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
        return bool(self.rows or self.waiting)

    def step(self) -> list[InflightRequest]:
        """Admit what waits (up to max_rows: each prefilled alone, its first token chosen), then
        decode one token for every row in one call -> the requests that ended in this step."""
        ended = []
        while self.waiting and len(self.rows) < self.max_rows:
            request = self.waiting.popleft()
            if self._admit(request):
                ended.append(request)
        if self.rows:
            ended += self._decode()
        return ended

    def clear(self) -> None:
        """Forget every request, running or waiting (after a failure the caller has told them of)."""
        self.waiting.clear()
        self.rows, self.cache, self.mask = [], None, None

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

    def _admit(self, request: InflightRequest) -> bool:
        """Prefill a request alone and choose its first token; lay its cache beside the running
        rows' unless it has already ended -> whether it ended."""
        sampling = request.sampling
        generator = None if sampling.greedy else torch.Generator().manual_seed(sampling.seed)
        ids = np.asarray([request.ids], np.int64)
        mask = np.ones_like(ids)
        seen = None
        if sampling.repetition_penalty != 1.0:
            seen = seen_tokens(torch.from_numpy(ids), None, self.vocab)
        cache, done = prefill_chunks(self.runner, ids, mask, self.runner.empty_cache(1), 0)
        logits, cache = self.runner.step(ids[:, done:], mask, cache)
        row = _Row(request, generator, seen, pending=self.pad)
        if self._take(row, self._choose(row, logits[0, -1])):
            return True
        self._join(row, cache, mask)
        return False

    def _join(self, row: _Row, cache: dict[str, np.ndarray], mask: np.ndarray) -> None:
        if self.cache is None:
            self.rows, self.cache, self.mask = [row], cache, mask
            return
        width = max(self.mask.shape[1], mask.shape[1])
        self.cache = {name: np.concatenate([_pad_right(self.cache[name], width), _pad_right(cache[name], width)])
                      for name in self.cache}
        self.mask = np.concatenate([_pad_right(self.mask, width, axis=1), _pad_right(mask, width, axis=1)])
        self.rows.append(row)

    def _decode(self) -> list[InflightRequest]:
        """One step of every row: each runs the token it was given last."""
        ids = np.asarray([[row.pending] for row in self.rows], np.int64)
        self.mask = np.concatenate([self.mask, np.ones((len(self.rows), 1), np.int64)], axis=1)
        logits, self.cache = self.runner.step(ids, self.mask, self.cache)
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
        if not keep:
            self.cache = self.mask = None
            return
        mask = self.mask[keep]
        used = mask.any(axis=0)
        self.mask = mask[:, used]
        self.cache = {name: value[keep][:, :, used] for name, value in self.cache.items()}


def _pad_right(array: np.ndarray, width: int, axis: int = 2) -> np.ndarray:
    """array with zeros after its end on `axis` up to `width` (a cache's past axis, or a mask's)."""
    missing = width - array.shape[axis]
    if missing == 0:
        return array
    shape = list(array.shape)
    shape[axis] = missing
    return np.concatenate([array, np.zeros(shape, array.dtype)], axis=axis)
