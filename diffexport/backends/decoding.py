"""Running a KV-cache decoder folder: onnxruntime-genai (its search, sampling and cache) or a plain
onnxruntime session loop (for users without onnxruntime-genai, and the reference when debugging).

Both stream token ids through `on_token` and return what they generated with timings, so
`diffexport generate`, `diffexport check` and tools/bench_decode.py share them.
"""

from __future__ import annotations

import dataclasses
import time
from pathlib import Path
from typing import Callable

import numpy as np

from diffexport.errors import DiffExportError
from diffexport.export import decoder
from diffexport.generation import Sampling

@dataclasses.dataclass
class DecodeRun:
    tokens: list[int]  # new tokens (batch 1)
    prompt_tokens: int
    prefill_seconds: float  # prompt processed and first token chosen
    decode_seconds: float  # every later token
    stop: str  # "eos" or "length"

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
    return {name % i: empty for i in range(layers) for name in (decoder.PRESENT_KEY, decoder.PRESENT_VALUE)}


def step_feeds(ids: np.ndarray, mask: np.ndarray, cache: dict[str, np.ndarray], layers: int) -> dict[str, np.ndarray]:
    """One step's inputs: the tokens, the mask and last step's presents as this step's pasts."""
    feeds = {decoder.INPUT_IDS: ids, decoder.ATTENTION_MASK: mask}
    for i in range(layers):
        feeds[decoder.PAST_KEY % i] = cache[decoder.PRESENT_KEY % i]
        feeds[decoder.PAST_VALUE % i] = cache[decoder.PRESENT_VALUE % i]
    return feeds


class OrtDecoder:
    """One onnxruntime session over the folder's model.onnx; `step` runs one forward with the cache."""

    def __init__(self, folder: str | Path, provider: str = "cpu", threads: int | None = None):
        from diffexport.backends.onnxruntime import open_session

        self.model_path, self.config, self.meta = decoder.read_decoder_folder(folder)
        if self.meta["dtype"] == "bfloat16":  # numpy, which this loop feeds the cache as, has no bfloat16
            raise DiffExportError(f"{Path(folder).name} is a bfloat16 folder, which the onnxruntime loop cannot feed "
                                  "(numpy has no bfloat16): run it with onnxruntime-genai on CUDA (`generate --backend "
                                  "genai`), or build it with `diffexport trt` and check the engine")
        self.session = open_session(self.model_path, provider, threads)
        self.layers = int(self.config["model"]["decoder"]["num_hidden_layers"])
        self.heads = int(self.config["model"]["decoder"]["num_key_value_heads"])  # 1: token-major cache
        self.width = int(self.config["model"]["decoder"]["head_size"])
        self.context = int(self.config["model"]["context_length"])
        self.dtype = np.float16 if self.meta["dtype"] == "float16" else np.float32
        self.outputs = [o.name for o in self.session.get_outputs()]
        expected = decoder.output_names(self.layers)
        if self.outputs != expected:
            raise DiffExportError(f"{self.model_path.name} outputs {self.outputs[:3]}... are not a KV-cache "
                                  f"decoder's {expected[:3]}...: re-export it")
        past = next((i.shape for i in self.session.get_inputs() if i.name == decoder.PAST_KEY % 0), None)
        if past is None or len(past) != 4 or past[1] != self.heads or past[3] != self.width:
            raise DiffExportError(f"{decoder.GENAI_CONFIG} says the cache is [batch, {self.heads}, past, {self.width}] "
                                  f"but {self.model_path.name} takes {decoder.PAST_KEY % 0} {past}: the files do not "
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


def _choose(logits: np.ndarray, sampling: Sampling, generator) -> int:
    import torch

    from diffexport.generation import choose_next

    return int(choose_next(torch.from_numpy(logits.astype(np.float32))[None], sampling, generator)[0])


def generate_onnxruntime(folder, prompt: list[int], max_new_tokens: int, sampling: Sampling,
                         on_token: Callable[[int], None] | None = None, threads: int | None = None,
                         runner: OrtDecoder | None = None, ignore_eos: bool = False, provider: str = "cpu") -> DecodeRun:
    import torch

    runner = runner or OrtDecoder(folder, provider=provider, threads=threads)
    eos = set(decoder.eos_token_ids(runner.config))
    generator = None if sampling.greedy else torch.Generator().manual_seed(sampling.seed)
    if len(prompt) > runner.context:
        raise DiffExportError(f"the prompt's {len(prompt)} tokens exceed the folder's context length {runner.context}")
    ids = np.asarray([prompt], np.int64)
    cache = runner.empty_cache(1)
    tokens, stop = [], "length"
    start = time.perf_counter()
    first = None
    # a runner with a longest call (an engine's profile) takes a longer prompt in chunks: the graph's
    # causal mask is bottom-right, so each chunk sees the cache and itself as one long call would
    chunk, done = getattr(runner, "max_sequence", None) or len(prompt), 0
    while len(prompt) - done > chunk:
        _, cache = runner.step(ids[:, done:done + chunk], np.ones((1, done + chunk), np.int64), cache)
        done += chunk
    ids, mask = ids[:, done:], np.ones((1, len(prompt)), np.int64)
    for _ in range(max_new_tokens):
        logits, cache = runner.step(ids, mask, cache)
        token = _choose(logits[0, -1], sampling, generator)
        tokens.append(token)
        if first is None:
            first = time.perf_counter()
        if on_token is not None:
            on_token(token)
        if token in eos and not ignore_eos:
            stop = "eos"
            break
        if mask.shape[1] + 1 >= runner.context:  # genai's max_length: prompt + new tokens fill the context
            break
        ids = np.asarray([[token]], np.int64)
        mask = np.concatenate([mask, np.ones((1, 1), np.int64)], axis=1)
    end = time.perf_counter()
    return DecodeRun(tokens, len(prompt), first - start, end - first, stop)


def open_genai_model(folder, provider: str | None = None):
    """onnxruntime-genai's Model over the folder, on the provider its genai_config names, or on
    `provider` ("cpu", "cuda") instead; what genai refuses (no CUDA build, no GPU) is one line."""
    og = import_genai()
    try:
        if provider is None:
            return og.Model(str(folder))
        config = og.Config(str(folder))
        config.clear_providers()
        if provider != "cpu":
            config.append_provider(provider)
        return og.Model(config)
    except RuntimeError as exc:
        detail = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
        hint = (" (the CUDA provider needs the onnxruntime-genai-cuda package and a GPU)"
                if "cuda" in detail.lower() else "")
        raise DiffExportError(f"onnxruntime-genai cannot open {Path(folder).name}"
                              f"{'' if provider is None else ' on ' + provider}: {detail}{hint}") from None


def generate_genai(folder, prompt: list[int], max_new_tokens: int, sampling: Sampling,
                   on_token: Callable[[int], None] | None = None, model=None, min_new_tokens: int = 0,
                   provider: str | None = None) -> DecodeRun:
    """provider: None runs on what the folder's genai_config names; "cpu"/"cuda" override it."""
    og = import_genai()
    context = None
    if model is None:
        context = decoder.read_decoder_folder(folder)[1]["model"]["context_length"]
        model = open_genai_model(folder, provider)
    if context is not None and len(prompt) > context:
        raise DiffExportError(f"the prompt's {len(prompt)} tokens exceed the folder's context length {context}")
    params = og.GeneratorParams(model)
    # genai refuses a max_length past the context; the ORT loop stops at the same place
    total = len(prompt) + max_new_tokens if context is None else min(len(prompt) + max_new_tokens, context)
    search = {"max_length": total, "do_sample": not sampling.greedy}
    if min_new_tokens:
        search["min_length"] = min(len(prompt) + min_new_tokens, total)
    if not sampling.greedy:
        search.update(temperature=sampling.temperature, top_p=sampling.top_p, random_seed=sampling.seed)
        if sampling.top_k:
            search["top_k"] = sampling.top_k
    params.set_search_options(**search)
    generator = og.Generator(model, params)
    tokens = []
    start = time.perf_counter()
    generator.append_tokens(np.asarray(prompt, np.int32))
    first = None
    while not generator.is_done():
        generator.generate_next_token()
        token = int(generator.get_next_tokens()[0])
        tokens.append(token)
        if first is None:
            first = time.perf_counter()
        if on_token is not None:
            on_token(token)
    end = time.perf_counter()
    stop = "length" if len(prompt) + len(tokens) >= total else "eos"
    return DecodeRun(tokens, len(prompt), (first or end) - start, end - (first or end), stop)
