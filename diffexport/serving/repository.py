"""A Triton model repository for a KV-cache decoder folder: REPO/NAME/config.pbtxt, REPO/NAME/1/model.py
(the Python backend's entry, which imports diffexport.serving.triton_model) and REPO/NAME/1/decoder/
(a copy of the folder: the repository is what a user copies into a Triton container).

The I/O is the contract of Triton's LLM backends (TensorRT-LLM's, which Triton's OpenAI-compatible
frontend sends to any model that is not vLLM's), so `/v2/models/NAME/generate`, `/generate_stream`,
gRPC streaming and that frontend work unchanged: a batch dimension of one request, inputs
text_input (when the folder has a tokenizer) or input_ids, and max_tokens, temperature (0: greedy),
top_k, top_p, seed, stream, stop_words, exclude_input_in_output, frequency_penalty and
presence_penalty (0 only); outputs text_output and output_ids (the generated ids, the
end-of-sequence id that stopped the answer left out).
"""

from __future__ import annotations

import os
import shutil
from dataclasses import dataclass
from pathlib import Path

from diffexport.core.errors import DiffExportError
from diffexport.core.files import check_output_path, staging_folder
from diffexport.format import decoder_folder
from diffexport.format.decoder_folder import has_tokenizer, read_decoder_folder

DECODER_DIR = "decoder"  # REPO/NAME/1/decoder: the copied folder
MODEL_FILE = "model.py"
MAX_INSTANCES = 64
MAX_BATCH = 32  # onnxruntime-genai 0.18 takes at most 32 rows per generator
# How the model batches its requests (serving/triton_model.py): rows join at the next step, or wait for a batch
SCHEDULERS = ("inflight", "batch")
NAME_CHARS = set("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789_-.")

# (name, Triton type, dims after the batch dimension, what it is): every input optional but the
# prompt (one of the first two)
INPUTS = (("text_input", "TYPE_STRING", "[ 1 ]", "the prompt as text (folders with a tokenizer)"),
          ("input_ids", "TYPE_INT64", "[ -1 ]", "the prompt as token ids"),
          ("max_tokens", "TYPE_INT32", "[ 1 ]", "new tokens at most (default 64, within the context)"),
          ("temperature", "TYPE_FP32", "[ 1 ]", "0: greedy; else sampling at this temperature"),
          ("top_k", "TYPE_INT32", "[ 1 ]", "sample among the k likeliest (0: no cut)"),
          ("top_p", "TYPE_FP32", "[ 1 ]", "sample within this probability mass"),
          ("seed", "TYPE_UINT64", "[ 1 ]", "the draw's seed"),
          ("stream", "TYPE_BOOL", "[ 1 ]", "true: one response per token, then the final flag"),
          ("stop_words", "TYPE_STRING", "[ -1 ]", "the answer ends before the first of these texts"),
          ("exclude_input_in_output", "TYPE_BOOL", "[ 1 ]", "false: the answer begins with the prompt (echo)"),
          ("frequency_penalty", "TYPE_FP32", "[ 1 ]", "0 only (the OpenAI frontend sends it when given)"),
          ("presence_penalty", "TYPE_FP32", "[ 1 ]", "0 only (the OpenAI frontend sends it when given)"))
OUTPUTS = (("text_output", "TYPE_STRING", "[ 1 ]"), ("output_ids", "TYPE_INT64", "[ -1 ]"))

MODEL_ENTRY = '''"""Triton's Python-backend entry for a diffexport decoder folder (written by `diffexport triton`).
The server's Python needs diffexport with onnxruntime-genai: pip install "diffexport[onnx]"."""
from diffexport.serving.triton_model import TritonPythonModel  # noqa: F401
'''


@dataclass
class Repository:
    path: Path  # REPO
    name: str  # the model's name in the repository (its URL: /v2/models/NAME)
    folder: Path  # REPO/NAME/1/decoder
    text: bool  # the folder has a tokenizer: text_input works
    gpu: bool  # the folder's genai_config names a GPU provider: a GPU instance


def config_pbtxt(name: str, max_batch: int, instances: int, gpu: bool, scheduler: str = "inflight") -> str:
    """config.pbtxt: the Python backend, decoupled (tokens stream as they come), a batch dimension
    of one request (the contract's [1, 1] tensors; no Triton batching: the model batches the
    requests itself, up to max_batch rows, with its scheduler: serving/triton_model.py)."""
    def tensor(n, t, dims, optional=None):
        return "  {\n" + f'    name: "{n}"\n    data_type: {t}\n    dims: {dims}\n' + \
               ("    optional: true\n" if optional else "") + "  }"

    inputs = ",\n".join(tensor(n, t, d, True) for n, t, d, _ in INPUTS)
    outputs = ",\n".join(tensor(n, t, d) for n, t, d in OUTPUTS)
    kind = "KIND_GPU" if gpu else "KIND_CPU"
    return (f'name: "{name}"\nbackend: "python"\nmax_batch_size: 1\n'
            "model_transaction_policy {\n  decoupled: true\n}\n"
            f"input [\n{inputs}\n]\noutput [\n{outputs}\n]\n"
            f"instance_group [\n  {{\n    count: {instances}\n    kind: {kind}\n  }}\n]\n"
            'parameters: {\n  key: "max_batch"\n  value: { string_value: "' + str(max_batch) + '" }\n}\n'
            'parameters: {\n  key: "scheduler"\n  value: { string_value: "' + scheduler + '" }\n}\n'
            'parameters: {\n  key: "decoder_folder"\n  value: { string_value: "' + DECODER_DIR + '" }\n}\n')


def check_settings(name: str, max_batch: int, instances: int) -> None:
    if not name or len(name) > 128 or set(name) - NAME_CHARS or name.startswith("."):
        raise DiffExportError(f"model name {name[:40]!r}: use up to 128 letters, digits, '_', '-' or '.' "
                              "(it is a folder of the repository and part of the URL)")
    if not 1 <= max_batch <= MAX_BATCH:
        raise DiffExportError(f"--max-batch must be 1 to {MAX_BATCH} (onnxruntime-genai's rows per generator), "
                              f"got {max_batch}")
    if not 1 <= instances <= MAX_INSTANCES:
        raise DiffExportError(f"--instances must be 1 to {MAX_INSTANCES}, got {instances}")


def folder_uses_gpu(config: dict) -> bool:
    """Whether the folder's genai_config names a GPU execution provider (cuda, dml, ...)."""
    providers = decoder_folder.session_options(config).get("provider_options", [])
    return any(isinstance(p, dict) and any(k.lower() != "cpu" for k in p) for p in providers)


def write_repository(folder: str | os.PathLike, out: str | os.PathLike, name: str | None = None,
                     max_batch: int = 8, instances: int = 1, force: bool = False,
                     scheduler: str = "inflight") -> Repository:
    """REPO (`out`) holding the decoder folder as model `name` (default: the folder's name). The
    folder is read by the reader `generate` uses: what it refuses (a library to load, a pipeline of
    other graphs, a profile path, links) is refused here before anything is written. The
    repository is written beside its destination and renamed into place; an existing REPO is
    replaced only with force, never through a link."""

    folder = Path(folder)
    _, config, meta = read_decoder_folder(folder)
    name = name or folder.resolve().name
    check_settings(name, max_batch, instances)
    if scheduler not in SCHEDULERS:
        raise DiffExportError(f"unknown --scheduler {scheduler!r}; choose one of {list(SCHEDULERS)}")
    if scheduler == "inflight" and meta.dtype == "bfloat16":
        raise DiffExportError("--scheduler inflight steps the folder in an onnxruntime session, which cannot feed a "
                              "bfloat16 cache: use --scheduler batch (onnxruntime-genai) for this folder")
    out = Path(out)
    check_output_path(out, replace=force, inputs=[folder])
    with staging_folder(out, force) as tmp:  # an existing REPO is replaced only with force
        version = tmp / name / "1"
        (version / DECODER_DIR).mkdir(parents=True)
        for item in sorted(folder.iterdir()):  # what read_decoder_folder accepted, files only, never through a link
            if item.is_symlink() or not item.is_file():
                continue
            shutil.copyfile(item, version / DECODER_DIR / item.name, follow_symlinks=False)
        gpu = folder_uses_gpu(config)
        (tmp / name / "config.pbtxt").write_text(config_pbtxt(name, max_batch, instances, gpu, scheduler))
        (version / MODEL_FILE).write_text(MODEL_ENTRY)
    return Repository(out, name, out / name / "1" / DECODER_DIR, has_tokenizer(folder), gpu)
