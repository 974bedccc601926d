"""How fast an artifact runs on this machine, beside the bound this machine sets: the read
bandwidth of onnxruntime's own GEMV, the weight bytes a decode step reads, and a short measured
generation (prompt and decode tokens/s, medians after a warm-up). Used by `diffexport report`
and the decode benchmarks in tools/.

The bound: a batch-1 decode step reads every weight once (a GEMV per matrix), so tokens/s can not
pass read bandwidth / weight bytes. The bandwidth is measured, not taken from a data sheet: a
torch sum of the same bytes reads slower than onnxruntime's kernels here, which made decode
exceed its "bound" (docs/BENCHMARKS.md, "Decode on CPU").
"""

from __future__ import annotations

import dataclasses
import os
import platform
import statistics
import time
from pathlib import Path

import numpy as np

from diffexport.backends.base import machine_threads
from diffexport.backends.genai import generate_genai, open_genai_model
from diffexport.core.eager_generation import Sampling
from diffexport.core.onnxruntime_session import open_session
from diffexport.format.decoder_folder import read_decoder_folder
from diffexport.format.genai_config import MAX_THREADS
from diffexport.format.names import PREFILL_INPUT_NAMES


def cpu_name() -> str:
    """The CPU's model name (Linux's /proc/cpuinfo), else what the platform says."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def read_bandwidth(threads: int | None = None, repeats: int = 5) -> float:
    """Bytes/s that onnxruntime's CPU MatMul streams from a weight: a GEMV [1, 8192] x [8192, 16384]
    float32 (512 MiB, far past any cache), median of `repeats` after a warm-up."""
    import onnxruntime as ort
    from onnx import TensorProto, helper, numpy_helper

    k, n = 8192, 16384
    weight = numpy_helper.from_array(np.full((k, n), 1e-3, np.float32), "w")
    graph = helper.make_graph([helper.make_node("MatMul", ["x", "w"], ["y"])], "gemv",
                              [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, k])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, n])], [weight])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    options = ort.SessionOptions()
    options.intra_op_num_threads = threads or os.cpu_count() or 1
    session = ort.InferenceSession(model.SerializeToString(), options, providers=["CPUExecutionProvider"])
    del model, graph, weight
    x = {"x": np.ones((1, k), np.float32)}
    session.run(None, x)
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        session.run(None, x)
        times.append(time.perf_counter() - start)
    return k * n * 4 / statistics.median(times)


def weight_bytes_per_token(model_path: str | os.PathLike) -> int:
    """Bytes of the weights a decode step reads, as stored (fp32, fp16, or int4 packed in uint8 with
    its scales): every initializer except one only Gather nodes read (an untied embedding table,
    one row per token). model_path: an .onnx file or a folder holding model.onnx."""
    import onnx
    from onnx.external_data_helper import uses_external_data

    path = Path(model_path)
    model = onnx.load(str(path / "model.onnx" if path.is_dir() else path), load_external_data=False)
    consumers: dict[str, set] = {}
    for node in model.graph.node:
        for name in node.input:
            consumers.setdefault(name, set()).add(node.op_type)
    total = 0
    for t in model.graph.initializer:
        if t.name in consumers and consumers[t.name] <= {"Gather"}:
            continue
        if uses_external_data(t):
            total += next(int(e.value) for e in t.external_data if e.key == "length")
        else:
            total += len(t.raw_data) or t.ByteSize()
    return total


@dataclasses.dataclass
class SpeedMeasure:
    """A short greedy generation, batch 1, measured `rounds` times after a warm-up (medians)."""
    runtime: str
    prompt_tokens: int
    new_tokens: int
    rounds: int
    prompt_tokens_per_s: float
    decode_tokens_per_s: float
    prompt_spread: tuple[float, float]  # the rounds' lowest and highest, beside the median
    decode_spread: tuple[float, float]
    read_bytes_per_s: float  # read_bandwidth(), median of a probe before and after the rounds
    weight_bytes: int  # a decode step's weight reads
    threads: int

    @property
    def decode_bound(self) -> float:
        """Decode tokens/s this machine's read bandwidth allows (batch 1: every weight read per token)."""
        return self.read_bytes_per_s / self.weight_bytes if self.weight_bytes else float("nan")


def measure_decoder(folder: str | os.PathLike, prompt_tokens: int = 64, new_tokens: int = 32, rounds: int = 3,
                    seed: int = 0, progress=None) -> SpeedMeasure:
    """A decoder folder in onnxruntime-genai on the CPU, with the threads `generate` gives it: a seeded
    random prompt of `prompt_tokens` ids, exactly `new_tokens` greedy tokens, `rounds` rounds after
    a warm-up. progress(done, total) is called after each round."""
    read = read_decoder_folder(folder)
    vocab, context = read.vocab_size, read.context_length
    prompt_tokens = max(1, min(prompt_tokens, context - new_tokens - 1))
    prompt = np.random.default_rng(seed).integers(0, vocab, size=prompt_tokens).tolist()
    model = open_genai_model(folder, "cpu")
    threads = read.session_options.get("intra_op_num_threads") or min(machine_threads(), MAX_THREADS)
    probes = [read_bandwidth()]
    generate_genai(folder, prompt[:8], 4, Sampling(), model=model)  # warm-up: sessions, allocator
    runs = []
    for number in range(rounds):
        runs.append(generate_genai(folder, prompt, new_tokens, Sampling(), model=model, min_new_tokens=new_tokens))
        if progress is not None:
            progress(number + 1, rounds)
    probes.append(read_bandwidth())
    prompt_rates = [r.prompt_tokens_per_s for r in runs]
    decode_rates = [r.decode_tokens_per_s for r in runs]
    return SpeedMeasure("onnxruntime-genai (CPU)", prompt_tokens, new_tokens, rounds, statistics.median(prompt_rates),
                        statistics.median(decode_rates), (min(prompt_rates), max(prompt_rates)),
                        (min(decode_rates), max(decode_rates)), statistics.median(probes),
                        weight_bytes_per_token(folder), int(threads))


def measure_prefill(onnx_path: str | os.PathLike, vocab: int, prompt_tokens: int = 64, rounds: int = 3,
                    seed: int = 0, progress=None) -> SpeedMeasure:
    """A prefill .onnx file in onnxruntime on the CPU (the machine's cores): one call over a seeded
    random prompt of `prompt_tokens` ids, `rounds` times after a warm-up. A prefill file has no
    cache, so there is no decode rate: its decode fields are NaN and the bound is the one a decode
    step of the same weights would have."""
    session = open_session(onnx_path, "cpu")
    ids = np.random.default_rng(seed).integers(0, vocab, size=(1, prompt_tokens), dtype=np.int64)
    feed = {PREFILL_INPUT_NAMES[0]: ids}
    probes = [read_bandwidth()]
    session.run(None, feed)
    rates = []
    for number in range(rounds):
        start = time.perf_counter()
        session.run(None, feed)
        rates.append(prompt_tokens / (time.perf_counter() - start))
        if progress is not None:
            progress(number + 1, rounds)
    probes.append(read_bandwidth())
    nan = float("nan")
    return SpeedMeasure("onnxruntime (CPU)", prompt_tokens, 0, rounds, statistics.median(rates), nan,
                        (min(rates), max(rates)), (nan, nan), statistics.median(probes),
                        weight_bytes_per_token(onnx_path), machine_threads())
