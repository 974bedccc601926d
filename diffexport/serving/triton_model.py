"""The model Triton's Python backend runs for a decoder folder (REPO/NAME/1/model.py imports
TritonPythonModel from here). Two parts:

- DecoderService: the requests, decoded together by one worker thread, with one of two schedulers.
  "inflight" (the default): a request joins the running batch at the next decode step and leaves
  it the moment it ends (backends.inflight.InflightBatcher over the folder's onnxruntime session),
  so an answer never waits for someone else's; each row draws with its own options and seed.
  "batch": the oldest request and every waiting one with the same draw, up to max_batch, run as one
  onnxruntime-genai batch (backends.genai.generate_batch_genai, what `diffexport generate
  --prompts-file` runs); genai 0.18 cannot add rows to a running generator, so requests that arrive
  meanwhile wait for the next batch (kept for comparison: docs/BENCHMARKS.md). Either way greedy
  rows give what each prompt gives alone, and a row that ends (its end token, its own max_tokens,
  its client gone) stops sending while the others go on. Nothing here imports Triton: tests drive
  it in-process.
- TritonPythonModel: Triton's side. It reads each request's tensors, refuses a bad one with a
  one-line error response, and answers through the request's response sender (decoupled: one
  response per token when stream is true, then the final flag; else one response).

The folder is read by the reader `generate` uses when the model loads, as when the repository
was written: a folder changed since is refused again.
"""

from __future__ import annotations

import json
import math
import threading
import time
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

from diffexport.core.eager_generation import MAX_SEED, Sampling, StopText
from diffexport.core.errors import DiffExportError
from diffexport.core.lazy import lazy_import
from diffexport.serving.metrics import Recorder, TritonRecorder
from diffexport.serving.repository import SCHEDULERS

decoder_folder = lazy_import("diffexport.format.decoder_folder")
genai = lazy_import("diffexport.backends.genai")
inflight = lazy_import("diffexport.backends.inflight")
step_loop = lazy_import("diffexport.backends.step_loop")
text_generation = lazy_import("diffexport.generation.text_generation")

DEFAULT_MAX_TOKENS = 64
MAX_TEXT_BYTES = 1 << 20  # a prompt's text; the context bounds its tokens
MAX_TEMPERATURE = 100.0
MAX_STOP_WORDS, MAX_STOP_BYTES = 16, 256  # OpenAI's API takes 4 stop sequences


def _client_text(value, name: str, limit: int) -> str:
    """A client's bytes (or str) as text of at most `limit` UTF-8 bytes, sized before decoding."""
    size = f"{limit >> 20} MiB" if limit >= 1 << 20 else f"{limit} bytes"
    if isinstance(value, bytes):
        if len(value) > limit:
            raise DiffExportError(f"{name} holds a text larger than {size}")
        try:
            value = value.decode("utf-8")
        except UnicodeDecodeError:
            raise DiffExportError(f"{name} is not UTF-8") from None
    if not isinstance(value, str) or len(value.encode()) > limit:
        raise DiffExportError(f"{name} must be text of at most {size}")
    return value


@dataclass
class Request:
    ids: list[int]
    max_tokens: int
    sampling: Sampling
    stream: bool
    send: Callable[[list[int], str | None, bool], None]  # (new ids, their text or None, final)
    fail: Callable[[str], None]  # a one-line error; ends the request
    cancelled: Callable[[], bool] = lambda: False  # the client has gone
    arrived: float = field(default_factory=time.monotonic)  # for the time to its first token
    stops: tuple[str, ...] = ()  # stop_words: the answer ends before the first of them
    echo: str | None = None  # exclude_input_in_output false: the prompt's text, sent before the answer
    shown: StopText | None = None  # the answer's text so far (set by the worker's sender)


class DecoderService:
    """A decoder folder's requests, decoded together by one worker thread (the module says how)."""

    def __init__(self, folder: str | Path, max_batch: int = 8, scheduler: str = "inflight",
                 metrics: Recorder | None = None):
        if scheduler not in SCHEDULERS:
            raise DiffExportError(f"unknown scheduler {scheduler!r}; choose one of {list(SCHEDULERS)}")
        self.folder = Path(folder)
        read = decoder_folder.read_decoder_folder(self.folder)
        genai.import_genai()  # its tokenizer, and the batch scheduler's generator
        self.config, self.context, self.vocab, self.eos = read.config, read.context_length, read.vocab_size, \
            set(read.eos_token_ids)
        has_tokenizer = decoder_folder.has_tokenizer(self.folder)
        self.tokenizer = text_generation.folder_tokenizer(self.folder) if has_tokenizer else None
        self.max_batch = max_batch
        self._models: dict[int | None, object] = {}  # pad id -> genai model (genai_pad_for)
        self._waiting: deque[Request] = deque()
        self._running = 0  # the batch scheduler's rows now
        self._cond = threading.Condition()
        self._stopping = False
        self.scheduler = scheduler
        self.metrics = metrics or Recorder()
        loop = self._loop
        if scheduler == "inflight":  # the session opens now: a folder it cannot run fails the model's load
            provider = "cuda" if "cuda" in read.providers else "cpu"
            self._batcher = inflight.InflightBatcher(step_loop.OrtDecoder(self.folder, provider=provider), max_batch)
            loop = self._loop_inflight
        self._worker = threading.Thread(target=loop, name="diffexport-decoder", daemon=True)
        self._worker.start()

    # -- requests -------------------------------------------------------------------------------
    def prompt(self, text: bytes | str | None, ids) -> list[int]:
        """The prompt's ids from text (the folder's tokenizer) or ids; one-line refusals."""
        if (text is None) == (ids is None):
            raise DiffExportError("give the prompt as text_input or as input_ids (one of them)")
        if ids is not None:
            if len(ids) >= self.context:  # before any copy: a request's size is the client's choice
                raise DiffExportError(f"the prompt's {len(ids)} tokens leave no room in the context length "
                                      f"{self.context}")
            ids = [int(t) for t in ids]
            if not ids:
                raise DiffExportError("input_ids is empty")
            bad = next((t for t in ids if not 0 <= t < self.vocab), None)
            if bad is not None:
                raise DiffExportError(f"input_ids holds {bad}, outside the vocabulary [0, {self.vocab})")
            return ids
        if self.tokenizer is None:
            raise DiffExportError("this model has no tokenizer: give input_ids")
        return text_generation.encode(self.tokenizer, self.folder, _client_text(text, "text_input", MAX_TEXT_BYTES))

    def draw(self, temperature: float | None, top_k: int | None, top_p: float | None, seed: int | None) -> Sampling:
        """The request's draw over the folder's search defaults, as `diffexport generate` takes its
        options: temperature 0 is greedy, > 0 samples; what is not given comes from the folder."""
        if temperature is not None and not (math.isfinite(temperature) and 0 <= temperature <= MAX_TEMPERATURE):
            raise DiffExportError(f"temperature must be 0 (greedy) to {MAX_TEMPERATURE:g}, got {temperature}")
        if top_k is not None and not 0 <= top_k <= self.vocab:
            raise DiffExportError(f"top_k must be 0 (no cut) to the vocabulary's {self.vocab}, got {top_k}")
        if top_p is not None and not (math.isfinite(top_p) and 0 < top_p <= 1):
            raise DiffExportError(f"top_p must be in (0, 1], got {top_p}")
        if seed is not None and not 0 <= seed <= MAX_SEED:
            raise DiffExportError(f"seed must be 0 to {MAX_SEED}, got {seed}")
        greedy, sample = temperature == 0, temperature is not None and temperature > 0
        return text_generation.folder_sampling(self.config, greedy=greedy, sample=sample,
                               temperature=temperature if sample else None, top_k=top_k, top_p=top_p,
                               seed=0 if seed is None else seed)

    def stop_words(self, words) -> tuple[str, ...]:
        """stop_words as texts (UTF-8 bytes or str), bounded in number and size; they match the
        answer's text, so the folder needs its tokenizer. Empty strings (TensorRT-LLM clients send
        "" for none) are dropped."""
        if words is None:
            return ()
        if len(words) > MAX_STOP_WORDS:
            raise DiffExportError(f"stop_words holds {len(words)} texts; at most {MAX_STOP_WORDS}")
        texts = [word for word in (_client_text(w, "stop_words", MAX_STOP_BYTES) for w in words) if word]
        if texts and self.tokenizer is None:
            raise DiffExportError("stop_words match the answer's text: this model has no tokenizer")
        return tuple(texts)

    def echoed(self, exclude_input_in_output: bool | None, text, ids: list[int]) -> str | None:
        """The prompt's text to send before the answer (exclude_input_in_output false), else None."""
        if exclude_input_in_output is None or exclude_input_in_output:
            return None
        if isinstance(text, bytes):
            return text.decode("utf-8")  # checked by prompt()
        if isinstance(text, str):
            return text
        return "" if self.tokenizer is None else self.tokenizer.decode(ids)

    @staticmethod
    def check_penalty(name: str, value: float | None) -> None:
        """frequency_penalty / presence_penalty: the OpenAI frontend passes them on when a client
        sets them; this model has no such penalty, so only 0 (none) is taken."""
        if value is not None and value != 0:
            raise DiffExportError(f"{name} is not supported by this model (only 0); its folder's "
                                  "repetition_penalty applies")

    def check_length(self, ids: list[int], max_tokens: int | None) -> int:
        """max_tokens (default DEFAULT_MAX_TOKENS, cut to the room the context leaves)."""
        if max_tokens is not None and max_tokens < 1:
            raise DiffExportError(f"max_tokens must be >= 1, got {max_tokens}")
        if len(ids) >= self.context:
            raise DiffExportError(f"the prompt's {len(ids)} tokens leave no room in the context length {self.context}")
        if max_tokens is None:
            return min(DEFAULT_MAX_TOKENS, self.context - len(ids))
        if len(ids) + max_tokens > self.context:
            raise DiffExportError(f"the prompt ({len(ids)} tokens) + max_tokens {max_tokens} exceeds the context "
                                  f"length {self.context}")
        return max_tokens

    def submit(self, request: Request) -> None:
        with self._cond:
            if self._stopping:
                raise DiffExportError("the model is shutting down")
            self._waiting.append(request)
            self._cond.notify()
            self._report_load()

    def _report_load(self) -> None:
        """The waiting and running gauges, now (called with the lock held, or from the worker)."""
        if self.scheduler == "inflight":
            batcher = self._batcher
            waiting = len(batcher.waiting) + (batcher.joining is not None)
            self.metrics.load(len(self._waiting) + waiting, len(batcher.rows))
        else:
            self.metrics.load(len(self._waiting), self._running)

    def stop(self) -> None:
        """Ends the worker after its running batch (in-flight: its running step, and the rows still
        running get an error); requests still waiting get an error."""
        with self._cond:
            self._stopping = True
            left = list(self._waiting)
            self._waiting.clear()
            self._cond.notify()
        for request in left:
            request.fail("the model is shutting down")
        self._worker.join(timeout=60)

    # -- the worker -----------------------------------------------------------------------------
    def _next_batch(self) -> list[Request] | None:
        with self._cond:
            while not self._waiting and not self._stopping:
                self._cond.wait()
            if self._stopping:
                return None
            first = self._waiting.popleft()
            batch, kept = [first], deque()
            while self._waiting:
                request = self._waiting.popleft()
                same = request.sampling == first.sampling and len(batch) < self.max_batch
                (batch if same else kept).append(request)
            self._waiting = kept
            return batch

    def _loop(self) -> None:
        while (batch := self._next_batch()) is not None:
            for request in [r for r in batch if r.cancelled()]:  # its client left while it waited
                request.fail("the request was cancelled")
            batch = [r for r in batch if not r.cancelled()]
            if not batch:
                continue
            with self._cond:
                self._running = len(batch)
                self._report_load()
            try:
                self._run(batch)
            except Exception as exc:  # genai's own failure: every request of the batch hears it
                message = str(exc).splitlines()[0][:200] if str(exc) else type(exc).__name__
                for request in batch:
                    request.fail(f"generation failed: {message}")
            with self._cond:
                self._running = 0
                self._report_load()

    def _loop_inflight(self) -> None:
        batcher, live = self._batcher, {}  # id(the batcher's request) -> ours
        while True:
            with self._cond:
                while not self._waiting and not batcher.busy and not self._stopping:
                    self._cond.wait()
                if self._stopping:
                    for request in live.values():
                        request.fail("the model is shutting down")
                    return
                arrived = list(self._waiting)
                self._waiting.clear()
            for request in arrived:
                if request.cancelled():  # its client left while it waited
                    request.fail("the request was cancelled")
                    continue
                handle = inflight.InflightRequest(request.ids, request.max_tokens, request.sampling,
                                                  on_token=self._sender(request))
                try:  # checked when it was taken; a refusal here must still not end the worker
                    live[id(batcher.submit(handle))] = request
                except DiffExportError as exc:
                    request.fail(str(exc))
            try:
                ended = batcher.step()
            except Exception as exc:  # the session's own failure: every running request hears it
                message = str(exc).splitlines()[0][:200] if str(exc) else type(exc).__name__
                for request in live.values():
                    request.fail(f"generation failed: {message}")
                live.clear()
                batcher.clear()
                continue
            for handle in ended:
                self._finish(live.pop(id(handle)), handle.tokens, handle.stop)
            with self._cond:
                self._report_load()

    def _sender(self, request: Request) -> Callable[[int], bool]:
        """The row's on_token: each new token streamed (end ids excepted) -> whether the client has gone."""
        decode = self.tokenizer.create_stream().decode if self.tokenizer is not None and \
            (request.stream or request.stops) else None
        request.shown = StopText(list(request.stops), decode) if decode is not None else None
        last = [None]  # when its previous token came

        def on_token(token: int) -> bool:
            now, first = time.monotonic(), last[0] is None
            if first:
                self.metrics.first_token(now - request.arrived)
            else:
                self.metrics.token_gap(now - last[0])
            last[0] = now
            self.metrics.generated()
            piece = None if request.shown is None else request.shown.push(token)
            if request.stream:
                if request.echo is not None and first:  # the first response leads with the prompt
                    request.send([*request.ids, token], request.echo + (piece or ""), False)
                else:
                    request.send([token], piece, False)
            return request.cancelled() or (request.shown is not None and request.shown.done)
        return on_token

    def _finish(self, request: Request, tokens: list[int], stop: str) -> None:
        ids = tokens[:-1] if stop == "eos" and tokens and tokens[-1] in self.eos else tokens
        shown = request.shown
        if request.stream:
            tail = shown.flush() if shown is not None else ""  # text held back for a stop word that never came
            if tail:
                request.send([], tail, False)
            request.send([], None, True)
            return
        text = None if self.tokenizer is None else shown.text if request.stops else self.tokenizer.decode(ids)
        if request.echo is not None:
            ids, text = [*request.ids, *ids], None if text is None else request.echo + text
        request.send(ids, text, True)

    def _model(self, pad: int | None):
        if pad not in self._models:
            if len(self._models) >= 2:  # a substitute pad id is rare: keep the folder's and the latest
                self._models.pop(next(k for k in self._models if k is not None))
            self._models[pad] = genai.open_genai_model(self.folder, None, pad)
        return self._models[pad]

    def _run(self, batch: list[Request]) -> None:
        prompts = [r.ids for r in batch]
        pad = genai.genai_pad_for(self.config, prompts)
        senders = [self._sender(r) for r in batch]

        def on_token(row: int, token: int) -> bool:  # each running row's new token (end ids excepted)
            return senders[row](token)

        limits = [r.max_tokens for r in batch]
        run = genai.generate_batch_genai(self.folder, prompts, max(limits), batch[0].sampling, model=self._model(pad),
                                   pad_token_id=pad, stop_after=on_token, limits=limits)
        for request, tokens, stop in zip(batch, run.tokens, run.stops):
            self._finish(request, tokens, stop)


def _triton_recorder(model: str) -> Recorder | None:
    """Metrics that reach Triton's endpoint; None outside Triton's Python backend (tests)."""
    try:
        import triton_python_backend_utils as pb_utils
    except ImportError:
        return None
    return TritonRecorder(pb_utils, model)


class TritonPythonModel:
    """Triton's Python-backend interface over DecoderService."""

    def initialize(self, args: dict) -> None:
        config = json.loads(args["model_config"])
        params = {k: v.get("string_value", "") for k, v in config.get("parameters", {}).items()}
        folder = Path(args["model_repository"]) / str(args["model_version"]) / params.get("decoder_folder", "decoder")
        try:
            # a repository written before the scheduler was a choice ran the batch scheduler
            self.service = DecoderService(folder, int(params.get("max_batch", "8")), params.get("scheduler", "batch"),
                                          _triton_recorder(args.get("model_name", "model")))
        except DiffExportError as exc:  # the model fails to load with the reader's line
            raise RuntimeError(f"diffexport: {exc}") from None

    def execute(self, requests):
        import numpy as np
        import triton_python_backend_utils as pb_utils

        final = pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL
        service = self.service
        for request in requests:
            sender = request.get_response_sender()

            def fail(message: str, sender=sender) -> None:
                sender.send(pb_utils.InferenceResponse(error=pb_utils.TritonError(message)), flags=final)

            def send(ids, text, last, sender=sender, stream=False) -> None:
                if last and stream:
                    sender.send(flags=final)
                    return
                tensors = [pb_utils.Tensor("output_ids", np.asarray(ids, np.int64))]
                if service.tokenizer is not None:
                    encoded = np.asarray([(text or "").encode()], dtype=np.object_)
                    tensors.append(pb_utils.Tensor("text_output", encoded))
                sender.send(pb_utils.InferenceResponse(output_tensors=tensors), flags=final if last else 0)

            def value(name, kind):
                tensor = pb_utils.get_input_tensor_by_name(request, name)
                if tensor is None:
                    return None
                array = tensor.as_numpy().reshape(-1)
                if array.size != 1:
                    raise DiffExportError(f"{name} must hold one value, got {array.size}")
                return kind(array[0])

            try:
                text = pb_utils.get_input_tensor_by_name(request, "text_input")
                ids = pb_utils.get_input_tensor_by_name(request, "input_ids")
                if text is not None:
                    text = text.as_numpy().reshape(-1)
                    if text.size != 1:
                        raise DiffExportError(f"text_input must hold one prompt, got {text.size}")
                    text = text[0] if isinstance(text[0], (bytes, str)) else str(text[0])
                prompt = service.prompt(text, None if ids is None else ids.as_numpy().reshape(-1))
                max_tokens = service.check_length(prompt, value("max_tokens", int))
                sampling = service.draw(value("temperature", float), value("top_k", int), value("top_p", float),
                                        value("seed", int))
                for penalty in ("frequency_penalty", "presence_penalty"):
                    service.check_penalty(penalty, value(penalty, float))
                words = pb_utils.get_input_tensor_by_name(request, "stop_words")
                stops = service.stop_words(None if words is None else list(words.as_numpy().reshape(-1)))
                echo = service.echoed(value("exclude_input_in_output", bool), text, prompt)
                stream = bool(value("stream", bool))
                service.submit(Request(prompt, max_tokens, sampling, stream,
                                       lambda i, t, last, s=sender, st=stream: send(i, t, last, s, st), fail,
                                       sender.is_cancelled, stops=stops, echo=echo))
            except DiffExportError as exc:
                fail(str(exc))
        return None

    def finalize(self) -> None:
        self.service.stop()
