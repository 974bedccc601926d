"""A decoder folder's genai_config.json, read once and held to what diffexport writes.

onnxruntime-genai acts on more of this file than diffexport needs: it loads the library that
`session_options.custom_ops_library` names, writes profiles where `enable_profiling` points, runs
the stage graphs of `model.type: decoder-pipeline`, and starts as many threads as it is told. A
folder is often a stranger's download, so the file is read with a bounded size and nesting, and
every key must be one diffexport writes (format/decoder_folder.py's genai_config), with the values it
writes: anything else is refused in one line before onnxruntime-genai sees the folder.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

from diffexport.core.errors import DiffExportError
from diffexport.format.names import GENAI_CONFIG

MAX_BYTES = 1024**2  # what diffexport writes is about 1 kB
MAX_THREADS = 1024  # intra-op threads a folder may ask for (genai starts them all): export's --threads bound
MAX_CONTEXT = 1 << 20  # tokens a folder may hold (export and read): the gqa format's rotary caches grow with it
MAX_VOCAB = 1 << 24  # ids a vocabulary may hold (the largest released ones hold about 2^18)
PROVIDERS = ("cuda",)  # provider_options entries diffexport writes (cpu: none)

# The keys diffexport writes, level by level; a folder with any other is refused.
MODEL_KEYS = {"bos_token_id", "context_length", "decoder", "eos_token_id", "pad_token_id", "type", "vocab_size"}
DECODER_KEYS = {"session_options", "filename", "head_size", "hidden_size", "inputs", "outputs",
                "num_attention_heads", "num_hidden_layers", "num_key_value_heads"}
SESSION_KEYS = {"log_id", "provider_options", "intra_op_num_threads"}
SEARCH_KEYS = {"do_sample", "temperature", "top_k", "top_p", "repetition_penalty", "num_beams", "num_return_sequences",
               "length_penalty", "early_stopping", "max_length", "min_length", "no_repeat_ngram_size",
               "past_present_share_buffer"}
MODEL_TYPES = ("llama",)  # genai's decoder-only class, the graph being diffexport's
PROVIDERS_RULE = ('model.decoder.session_options.provider_options must be a list of {provider: options} objects as '
                  'diffexport writes them, [] or [{"cuda": {}}] (provider options can load libraries and write files)')


def _int_in(value, low: int, high: int) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and low <= value <= high


def _keys(where: str, obj, allowed: set[str], path: Path) -> dict:
    if not isinstance(obj, dict):
        raise DiffExportError(f"{path} is not a readable genai config ({where} is not an object)")
    unknown = sorted(set(obj) - allowed)
    if unknown:
        raise DiffExportError(f"{path}: {where}.{unknown[0]} is not a key diffexport writes: refused "
                              "(onnxruntime-genai "
                              "would act on it; re-export the folder with `diffexport onnx --kv-cache`)")
    return obj


def check_genai_config(config, path: Path) -> dict:
    """`config` (the parsed file at `path`) if every key is one diffexport writes and the values that
    would make onnxruntime-genai load, write, run or allocate something are the ones it writes."""
    _keys("the file", config, {"model", "search"}, path)
    model = _keys("model", config.get("model"), MODEL_KEYS, path)
    decoder = _keys("model.decoder", model.get("decoder"), DECODER_KEYS, path)
    session = decoder.get("session_options", {})
    if not isinstance(session, dict):
        raise DiffExportError(f"{path}: {PROVIDERS_RULE}")
    _keys("model.decoder.session_options", session, SESSION_KEYS, path)
    _keys("search", config.get("search", {}), SEARCH_KEYS, path)
    if model.get("type") not in MODEL_TYPES:
        raise DiffExportError(f"{path}: model.type {model.get('type')!r} is not {MODEL_TYPES[0]!r}, the one diffexport "
                              "writes: refused (another type runs other graphs than the validated one)")
    providers = session.get("provider_options", [])
    if not isinstance(providers, list) or not all(
            isinstance(entry, dict) and len(entry) == 1 and all(name in PROVIDERS and options == {}
                                                               for name, options in entry.items())
            for entry in providers):
        raise DiffExportError(f"{path}: {PROVIDERS_RULE}")
    if "intra_op_num_threads" in session and not _int_in(session["intra_op_num_threads"], 1, MAX_THREADS):
        raise DiffExportError(f"{path}: model.decoder.session_options.intra_op_num_threads must be an integer in "
                              f"1..{MAX_THREADS}, got {session['intra_op_num_threads']!r}")
    if "log_id" in session and not isinstance(session["log_id"], str):
        raise DiffExportError(f"{path}: model.decoder.session_options.log_id must be a string")
    vocab = model.get("vocab_size")
    if not _int_in(vocab, 1, MAX_VOCAB):
        raise DiffExportError(f"{path}: model.vocab_size must be an integer in 1..{MAX_VOCAB}, got {vocab!r}")
    for key in ("bos_token_id", "pad_token_id"):
        if key in model and not _int_in(model[key], 0, vocab - 1):
            raise DiffExportError(f"{path}: model.{key} must be a token id in 0..{vocab - 1}, got {model[key]!r}")
    return config


def read_genai_config(folder: str | os.PathLike) -> dict:
    """The folder's genai_config.json, parsed (load_genai_config) and checked (check_genai_config)."""
    return check_genai_config(load_genai_config(folder), Path(folder) / GENAI_CONFIG)


def load_genai_config(folder: str | os.PathLike) -> dict:
    """The folder's genai_config.json parsed with bounded size and nesting, not yet checked; one-line
    errors otherwise (a link is refused, not followed)."""
    path = Path(folder) / GENAI_CONFIG
    if path.is_symlink():
        raise DiffExportError(f"{path} is a symbolic link: a decoder folder holds its genai_config.json itself")
    if not path.is_file():
        raise DiffExportError(f"{Path(folder)} has no {GENAI_CONFIG}: not a KV-cache export "
                              "(export one with `diffexport onnx CKPT --kv-cache -o FOLDER`)")
    if path.stat().st_size > MAX_BYTES:
        raise DiffExportError(f"{path} is larger than 1 MiB: not a genai config")
    try:
        config = json.loads(path.read_text())
    except (OSError, ValueError, RecursionError):  # RecursionError: nesting deeper than the parser's stack
        raise DiffExportError(f"{path} is not a readable genai config") from None
    if not isinstance(config, dict):
        raise DiffExportError(f"{path} is not a readable genai config")
    return config
