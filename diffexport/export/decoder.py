"""KV-cache decoder export: a folder onnxruntime-genai runs as it is (`diffexport onnx --kv-cache -o OUTDIR`).

One graph serves prefill (past length 0) and decode (one or more new tokens):
  inputs   input_ids [B, S] int64, attention_mask [B, P+S] int64 (0 = left padding),
           past_key_values.{i}.key / .value [B, 1, P, W]
  outputs  logits [B, S, V], present.{i}.key / .value [B, 1, P+S, W]
The cache is token-major: W is the contract's key (value) width of all kv heads of a layer, so a
DiffAttention node reads `present` as it is (a free reshape of the unit axis) and no step
transposes or re-packs past tokens. For onnxruntime-genai this is one "kv head" of head_size W
(V1: keys 2*Hkv*D, values Hkv*2D: equal widths; V2 and the baseline Transformer: Hkv*D both).
Token positions come from the attention mask inside the graph (cumsum - 1), so left-padded batches
need no position_ids input. Each attention is ONE DiffAttention node of op version 2 (key_mask).

Folder: model.onnx (+ model.onnx.data when large), genai_config.json, tokenizer files (copied from an
HF checkpoint folder or --tokenizer). Written into a temporary folder beside OUTDIR, checked, renamed:
an interrupted export leaves nothing, and an existing OUTDIR is never touched.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import shutil
import tempfile
import time
from pathlib import Path
from typing import Callable

import torch

from diffexport import contract, layouts
from diffexport.checkpoint import LoadedModel
from diffexport.errors import DiffExportError
from diffexport.export import exporter
from diffexport.export.exporter import DTYPES, ExportOptions
from diffexport.files import check_output_path, make_output_folder, rename_into_place, temp_prefix
from diffexport.format import decoders, model_card
from diffexport.format.genai_config import MAX_CONTEXT, MAX_THREADS, check_genai_config, load_genai_config
from diffexport.format.metadata import read_export_metadata
from diffexport.format.names import (ATTENTION_MASK, GENAI_CONFIG, INPUT_IDS, LOGITS, MODEL_FILE, PAST_KEY,  # noqa: F401
                                     PAST_VALUE, PRESENT_KEY, PRESENT_VALUE)
from diffexport.format.names import TOKENIZER_MODELS  # noqa: F401 (its old home)
from diffexport.format.names import decoder_input_names as input_names  # noqa: F401 (their old home)
from diffexport.format.names import decoder_output_names as output_names  # noqa: F401
KV_FAMILIES = ("diff_v1", "diff_v2", "transformer")
# How a decoder folder's attention runs: format/decoders.py (its registry; kept here by name for the API).
ATTENTION_OPS = tuple(decoders.FORMATS)
GENAI_PROVIDERS = ("cpu", "cuda")  # what genai_config.json may name (onnxruntime-genai's CPU and CUDA builds)
DEFAULT_CONTEXT = 2048  # native checkpoints carry no context length
# A decoder format's post-export rewrite (its pass): (model path in the temporary folder, external
# data, context length, log), rewriting the file in place before the folder is published.
DecoderRewrite = Callable[[Path, bool, int, Callable[[str], None]], None]
# Files a tokenizer folder may hold that onnxruntime-genai / transformers read (never code files).
# chat_template.jinja: where newer transformers save a chat template (a sandboxed template, read by
# `generate --chat`, not code).
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "tokenizer.model",
                   "vocab.json", "merges.txt", "added_tokens.json", "generation_config.json", "chat_template.jinja")
MAX_TOKENIZER_BYTES = 256 * 1024**2


def has_tokenizer(folder: Path) -> bool:
    """Whether a folder holds a tokenizer onnxruntime-genai / transformers can read."""
    return any((folder / name).is_file() for name in TOKENIZER_MODELS)


@dataclasses.dataclass
class DecoderExportSummary:
    folder: Path
    layers: int
    diff_attention_nodes: int
    cache_width: int
    context_length: int
    tokenizer: bool
    file_bytes: int
    dtype: str
    seconds: float
    attention: str = decoders.DEFAULT
    cache_heads: int = 1
    provider: str = "cpu"

    def report(self) -> str:
        tok = "tokenizer files copied" if self.tokenizer else "no tokenizer: token ids only"
        cache = (f"cache [batch, {self.cache_heads}, past, {self.cache_width // self.cache_heads}] per layer for keys "
                 "and values")
        fmt = decoders.decoder_format(self.attention)
        if fmt.rewrite:
            graph = (f"graph         {self.diff_attention_nodes} {fmt.summary} over {self.layers} layers; {cache}"
                     + (", genai's shared past/present buffer" if fmt.shared_buffer else "")
                     + ("" if fmt.tensorrt else " (onnxruntime only)"))
        elif self.diff_attention_nodes:
            graph = (f"graph         {self.diff_attention_nodes} {contract.OP_NAME} (op v{contract.KEY_MASK_VERSION}, "
                     f"key_mask) over {self.layers} layers; {cache}")
        else:
            graph = f"graph         {exporter.BASELINE_NOTE}; {self.layers} layers; {cache}"
        return "\n".join([
            f"exported      {self.folder}/ ({self.file_bytes / 1e6:.1f} MB, {self.dtype}, KV-cache decoder, "
            f"{self.seconds:.1f}s)",
            graph,
            f"genai         {GENAI_CONFIG} (context {self.context_length}, {self.provider} provider), {tok}",
        ])


def cache_width(cfg) -> int:
    """W: the per-token width of a layer's key cache (equal to its value cache)."""
    if cfg.family == "diff_v1":
        key, value = 2 * cfg.n_kv_heads * cfg.head_dim, cfg.n_kv_heads * 2 * cfg.head_dim
    else:
        key = value = cfg.n_kv_heads * cfg.head_dim
    assert key == value
    return key


class _DecoderStep(torch.nn.Module):
    """(input_ids, attention_mask, past...) -> (logits, present...): the graph's documented interface."""

    def __init__(self, model):
        super().__init__()
        self.model = model

    def forward(self, input_ids, attention_mask, *past_flat):
        past = [(past_flat[2 * i], past_flat[2 * i + 1]) for i in range(len(past_flat) // 2)]  # [B, 1, P, W]
        logits, presents = self.model(input_ids, attention_mask=attention_mask, past_key_values=past, use_cache=True)
        return (logits, *[t for kv in presents for t in kv])


def _trace(model, options: ExportOptions, dtype: torch.dtype):
    from diffexport.export.op_schema import register_schema, translation_table

    register_schema()
    cfg = model.config
    gen = torch.Generator().manual_seed(0)
    B, S, P = 2, 5, 3  # none is 0 or 1, which torch.export would specialise on
    ids = torch.randint(0, cfg.vocab_size, (B, S), generator=gen)
    mask = torch.ones(B, P + S, dtype=torch.int64)
    width = cache_width(cfg)
    past = [torch.zeros(B, 1, P, width, dtype=dtype) for _ in range(2 * cfg.n_layers)]
    batch, seq, total, past_len = (torch.export.Dim(n) for n in ("batch", "sequence", "total_sequence", "past_sequence"))
    # torch.export groups *past_flat into one entry of the input structure
    shapes = ({0: batch, 1: seq}, {0: batch, 1: total}, tuple({0: batch, 2: past_len} for _ in past))
    with exporter._quiet_exporter():
        program = torch.onnx.export(
            _DecoderStep(model), (ids, mask, *past), dynamo=True, opset_version=options.resolved_opset(),
            custom_translation_table=translation_table(), dynamic_shapes=shapes,
            input_names=input_names(cfg.n_layers), output_names=output_names(cfg.n_layers), optimize=True,
            verbose=False)
    return program.model


def cache_heads(cfg, attention: str) -> int:
    """Heads of a layer's cache: 1 (token-major, one "head" of width W) for DiffAttention folders,
    the kv-groups (head-major, W / Hkv each) for GroupQueryAttention folders."""
    return decoders.cache_heads(decoders.decoder_format(attention), cfg.n_kv_heads)


def genai_config(cfg, dtype: str, context_length: int, special: dict, threads: int | None = None,
                 attention: str = decoders.DEFAULT, provider: str = "cpu", search: dict | None = None) -> dict:
    """What onnxruntime-genai reads: the decoder's I/O names, cache shape, search defaults (search:
    a checkpoint's generation_config.json values, hf_search's, over SEARCH_DEFAULTS).
    threads: intra-op threads of genai's session (unset: genai's own default, which may be 1).
    attention "gqa": the cache is [B, Hkv, T, W / Hkv] in one shared past/present buffer.
    provider: the execution provider genai's session uses (cpu: none named, genai's default)."""
    heads = cache_heads(cfg, attention)
    width = cache_width(cfg) // heads
    session = {"log_id": "onnxruntime-genai", "provider_options": [] if provider == "cpu" else [{provider: {}}]}
    if threads:
        session["intra_op_num_threads"] = threads
    maps = 2 * cfg.n_heads if cfg.family != "transformer" else cfg.n_heads
    eos = special.get("eos_token_id", cfg.vocab_size - 1)
    search = {**SEARCH_DEFAULTS, **(search or {})}
    search["top_k"] = genai_top_k(search["top_k"], search["top_p"], cfg.vocab_size)  # for apps' own sampling
    return {
        "model": {
            "bos_token_id": special.get("bos_token_id", 1),
            "context_length": context_length,
            "decoder": {
                "session_options": session,
                "filename": MODEL_FILE,
                "head_size": width,
                "hidden_size": cfg.d_model,
                "inputs": {"input_ids": INPUT_IDS, "attention_mask": ATTENTION_MASK,
                           "past_key_names": PAST_KEY, "past_value_names": PAST_VALUE},
                "outputs": {"logits": LOGITS, "present_key_names": PRESENT_KEY, "present_value_names": PRESENT_VALUE},
                "num_attention_heads": maps,
                "num_hidden_layers": cfg.n_layers,
                "num_key_value_heads": heads,  # 1: the token-major cache, one "head" of width W (docs/EXPORT.md)
            },
            # without a tokenizer: the last id, where GPT-2-style vocabularies keep end-of-text
            "eos_token_id": eos,
            # genai reads a prompt's trailing pad ids as padding (and takes the logits before them), so
            # a checkpoint without a pad id pads with end-of-sequence, as transformers does, not with
            # id 0, which ends real prompts (Llama 3's "!")
            "pad_token_id": special.get("pad_token_id", eos[0] if isinstance(eos, list) else eos),
            "type": "llama",  # genai's decoder-only model class; the graph is ours
            "vocab_size": cfg.vocab_size,
        },
        "search": {
            **search,
            "max_length": context_length, "min_length": 0, "no_repeat_ngram_size": 0,
            "past_present_share_buffer": decoders.decoder_format(attention).shared_buffer,
        },
    }  # genai refuses unknown keys: what diffexport knows lives in model.onnx's metadata


def genai_top_k(top_k: int, top_p: float, vocab_size: int) -> int:
    """The top_k to give onnxruntime-genai for a draw with top_k and top_p (0: no top-k cut).
    genai 0.18's top-p-only sampler (top_k 0) draws from a wider nucleus than transformers' and
    eager generate's temperature -> top-k -> top-p (`check --sample --top-p 0.3` saw 14% of draws
    outside it: it cuts at p of an upper bound on the total mass, tools/genai_nucleus.py); its
    top-k + top-p sampler follows that order, and a k of the whole vocabulary cuts nothing, so top-p
    alone goes through it. A k past the vocabulary cuts nothing, as in transformers (genai refuses it)."""
    return vocab_size if top_k == 0 and top_p < 1 else min(top_k, vocab_size)


# genai's search defaults where a checkpoint names none: transformers' GenerationConfig defaults (top_k
# 50 included, as onnxruntime-genai's model builder writes), so an app that turns on do_sample gets
# what transformers would sample
SEARCH_DEFAULTS = {"do_sample": False, "temperature": 1.0, "top_k": 50, "top_p": 1.0, "repetition_penalty": 1.0,
                   "num_beams": 1, "num_return_sequences": 1, "length_penalty": 1.0, "early_stopping": True}


def _finite(v) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


def _whole(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


# what each search value must be: generation_config.json is read from the checkpoint, genai_config.json
# from a folder, both from strangers
SEARCH_RULES = {
    "do_sample": (lambda v: isinstance(v, bool), "true or false"),
    "temperature": (lambda v: _finite(v) and v > 0, "a number > 0"),
    "top_k": (lambda v: _whole(v) and v >= 0, "an integer >= 0"),
    "top_p": (lambda v: _finite(v) and 0 < v <= 1, "a number in (0, 1]"),
    "repetition_penalty": (lambda v: _finite(v) and v > 0, "a number > 0"),
    "num_beams": (lambda v: _whole(v) and v >= 1, "an integer >= 1"),
    "num_return_sequences": (lambda v: _whole(v) and v >= 1, "an integer >= 1"),
    "length_penalty": (_finite, "a finite number"),
    "early_stopping": (lambda v: isinstance(v, bool), "true or false"),
}


def hf_search(folder: Path | None) -> tuple[dict, list[str]]:
    """The search values of an HF folder's generation_config.json (sampling, penalties, beams), as
    genai's search block takes them, and a note for each value passed over (of another type or
    range; transformers' early_stopping "never" is one). No file, a link, a huge or broken one: none."""
    values = None if folder is None else _small_json_object(folder / "generation_config.json")
    if values is None:
        return {}, []
    found, skipped = {}, []
    for key, (valid, what) in SEARCH_RULES.items():
        if key in values and values[key] is not None:
            if valid(values[key]):
                found[key] = values[key]
            else:
                skipped.append(f"{key}={values[key]!r} (genai takes {what})")
    if found.get("num_return_sequences", 1) > found.get("num_beams", 1):
        skipped.append(f"num_return_sequences={found.pop('num_return_sequences')} (more than num_beams)")
    return found, skipped


def folder_search(config: dict) -> dict:
    """A folder's genai_config "search" values (SEARCH_DEFAULTS where absent), checked: one-line error
    naming the value otherwise."""
    search = config.get("search", {})
    if not isinstance(search, dict):
        raise DiffExportError(f"{GENAI_CONFIG}: search must be an object")
    values = {}
    for key, (valid, what) in SEARCH_RULES.items():
        value = search.get(key, SEARCH_DEFAULTS[key])
        if not valid(value):
            raise DiffExportError(f"{GENAI_CONFIG}: search.{key} must be {what}, got {value!r}")
        values[key] = value
    return values


def _small_json_object(path: Path) -> dict | None:
    """A checkpoint folder's optional JSON object (generation_config.json, config.json); None for a
    missing, linked, huge (over 1 MiB) or broken file, which is passed over."""
    if not path.is_file() or path.is_symlink() or path.stat().st_size > 1024**2:
        return None
    try:
        values = json.loads(path.read_text())
    except (OSError, ValueError, RecursionError):
        return None
    return values if isinstance(values, dict) else None


def _hf_values(folder: Path | None) -> dict:
    """bos/eos/pad ids and max_position_embeddings from an HF folder's generation_config.json and
    config.json (first found wins; links, huge or broken files are passed over)."""
    found: dict = {}
    if folder is None:
        return found
    for name in ("generation_config.json", "config.json"):
        values = _small_json_object(folder / name)
        if values is None:
            continue
        for key in ("bos_token_id", "eos_token_id", "pad_token_id", "max_position_embeddings"):
            value = values.get(key)
            ids = value if isinstance(value, list) else [value]
            if key in found or not _are_token_ids(ids):
                continue
            ids = list(dict.fromkeys(ids))
            # several end ids (Llama 3 chat models end a turn with <|eot_id|>, not the first one):
            # genai stops at any id of a list, so eos keeps them all; the others take the first
            found[key] = ids if key == "eos_token_id" and len(ids) > 1 else ids[0]
    return found


def _are_token_ids(values: list) -> bool:
    return bool(values) and all(isinstance(v, int) and not isinstance(v, bool) and v >= 0 for v in values)


def eos_token_ids(config: dict) -> tuple[int, ...]:
    """The end-of-sequence ids a genai config names (an int or a list of ints, as genai reads it)."""
    value = config["model"].get("eos_token_id")
    values = value if isinstance(value, list) else [value]
    if not _are_token_ids(values):
        raise DiffExportError(f"{GENAI_CONFIG}: model.eos_token_id must be a token id or a list of them, got {value!r}")
    return tuple(values)


def tokenizer_files(folder: Path) -> list[Path]:
    """The tokenizer files of a folder (regular files only; links are not followed); a tokenizer.json
    whose regular expressions could run without end is refused (format/tokenizer_rules.py)."""
    from diffexport.format.tokenizer_rules import check_tokenizer_json

    files = []
    for name in TOKENIZER_FILES:
        path = folder / name
        if path.is_symlink():
            raise DiffExportError(f"{path} is a symbolic link: copy the real file into the folder")
        if path.is_file():
            if path.stat().st_size > MAX_TOKENIZER_BYTES:
                raise DiffExportError(f"{path} is larger than {MAX_TOKENIZER_BYTES >> 20} MiB: not a tokenizer file")
            files.append(path)
    check_tokenizer_json(folder / "tokenizer.json")
    return files


def check_tokenizer(folder: Path, vocab_size: int) -> list[Path]:
    """Tokenizer files to copy, after checking the tokenizer's ids fit the model's vocabulary."""
    if not folder.is_dir():
        raise DiffExportError(f"tokenizer {folder} is not a folder")
    files = tokenizer_files(folder)
    if not any(f.name in TOKENIZER_MODELS for f in files):
        raise DiffExportError(f"{folder} has no tokenizer.json or tokenizer.model")
    tok_json = folder / "tokenizer.json"
    if tok_json.is_file():
        try:
            from tokenizers import Tokenizer
        except ImportError:
            raise DiffExportError("checking a tokenizer needs the tokenizers package: pip install tokenizers") from None
        try:
            size = Tokenizer.from_file(str(tok_json)).get_vocab_size(with_added_tokens=True)
        except Exception as exc:  # the tokenizers library's own parse errors
            raise DiffExportError(f"{tok_json} is not a readable tokenizer ({str(exc).splitlines()[0][:120]})") from None
        if size > vocab_size:
            raise DiffExportError(f"tokenizer {folder} has {size} tokens but the model's vocabulary is {vocab_size}: "
                                  "it is not this model's tokenizer")
    return files


def configured_providers(config: dict) -> list[str]:
    """The execution providers a folder's genai config names (what genai_config() wrote:
    no provider options means onnxruntime-genai's CPU provider)."""
    session = config["model"]["decoder"].get("session_options")
    options = session.get("provider_options") if isinstance(session, dict) else None
    if not isinstance(options, list) or not all(isinstance(e, dict) and all(isinstance(k, str) for k in e)
                                                for e in options):
        raise DiffExportError("genai_config.json: decoder.session_options.provider_options must be a list of "
                              "{provider: options} objects")
    return [name for entry in options for name in entry] or ["cpu"]


def default_provider(dtype: str) -> str:
    """The provider a folder's genai_config names unless told: bf16 folders run on CUDA only
    (onnxruntime's CPU provider has no bfloat16 kernels)."""
    return "cuda" if dtype == "bfloat16" else "cpu"


def check_target(out_dir: Path, options: ExportOptions, context_length: int | None,
                 threads: int | None = None, attention: str = decoders.DEFAULT, provider: str | None = None) -> None:
    fmt = decoders.decoder_format(attention)  # an unknown format: one line, before anything else
    if options.dtype not in ("float32", "float16", "bfloat16"):
        raise DiffExportError(f"--kv-cache exports float32, float16 or bfloat16, not {options.dtype}")
    if provider not in (None, *GENAI_PROVIDERS):
        raise DiffExportError(f"unknown provider {provider!r} for genai_config.json; choose one of {list(GENAI_PROVIDERS)}")
    if options.dtype == "bfloat16" and provider == "cpu":
        raise DiffExportError("a bfloat16 folder cannot name the CPU provider: onnxruntime's CPU provider has no "
                              "bfloat16 kernels (export --fp16 or fp32 for the CPU; bf16 is for CUDA and TensorRT)")
    if options.dtype not in fmt.dtypes:
        raise DiffExportError(fmt.dtype_refusal)
    if options.hidden:
        raise DiffExportError("--kv-cache graphs output logits and the cache; drop --hidden")
    if options.legacy:
        raise DiffExportError("--kv-cache needs the dynamo exporter; drop --legacy")
    if out_dir.suffix == ".onnx":
        raise DiffExportError(f"--kv-cache writes a folder (model.onnx, {GENAI_CONFIG}, tokenizer): "
                              f"give a folder name, not {out_dir.name}")
    if out_dir.exists() and not out_dir.is_dir() and not out_dir.is_symlink():
        raise DiffExportError(f"{out_dir} is a file: --kv-cache writes a folder, give a folder name")
    check_output_path(out_dir, replace=options.force)
    if context_length is not None and not 2 <= context_length <= MAX_CONTEXT:
        raise DiffExportError(f"--context-length must be in 2..{MAX_CONTEXT:,}, got {context_length:,}")
    if threads is not None and not 1 <= threads <= MAX_THREADS:
        raise DiffExportError(f"--threads must be in 1..{MAX_THREADS}, got {threads}")


def export_decoder(loaded: LoadedModel, out_dir: str | os.PathLike, options: ExportOptions | None = None, *,
                   tokenizer: str | os.PathLike | None = None, context_length: int | None = None,
                   threads: int | None = None, attention: str = decoders.DEFAULT, provider: str | None = None,
                   rewrite: DecoderRewrite | None = None,
                   log: Callable[[str], None] = print) -> DecoderExportSummary:
    """Export `loaded` as a KV-cache decoder folder for onnxruntime-genai (and plain onnxruntime).
    A format whose entry names a rewrite (attention "gqa": every DiffAttention node as onnxruntime's
    GroupQueryAttention) needs that pass handed in as `rewrite`, since passes sit above the export:
    diffexport.passes.decoder_formats.export_decoder does that for every format."""
    options = options or ExportOptions()
    out_dir = Path(out_dir)
    check_target(out_dir, options, context_length, threads, attention, provider)
    provider = provider or default_provider(options.dtype)
    cfg = loaded.config
    if cfg.family not in KV_FAMILIES:
        raise DiffExportError(f"--kv-cache exports {list(KV_FAMILIES)} models, not {cfg.family!r}")
    fmt = decoders.decoder_format(attention)
    if fmt.rewrite and rewrite is None:
        raise DiffExportError(f"the {fmt.name} format's graph is written by a pass after the export: call "
                              "diffexport.passes.decoder_formats.export_decoder, or `diffexport onnx --kv-cache "
                              f"--attention {fmt.name}`")
    if rewrite is not None and not fmt.rewrite:
        raise DiffExportError(f"the {fmt.name} format has no post-export rewrite, but one was handed in")
    if fmt.rewrite and cfg.family == "transformer":
        raise DiffExportError(f"--attention {fmt.name} rewrites DiffAttention nodes; the baseline Transformer has none "
                              "(export it without --attention)")
    source_dir = Path(loaded.path) if layouts.hf_import_of(loaded.source) and loaded.path else None
    if tokenizer is not None:  # named by the user (a folder or a Hub id): a tokenizer of this vocabulary
        from diffexport import hub

        tokenizer = hub.resolve(tokenizer, what="tokenizer")
        tok_files = check_tokenizer(Path(tokenizer), cfg.vocab_size)
    elif source_dir is not None and has_tokenizer(source_dir):
        tok_files = check_tokenizer(source_dir, cfg.vocab_size)  # an HF folder with its own tokenizer
    else:
        tok_files = []
    special = {**_hf_values(source_dir), **_hf_values(None if tokenizer is None else Path(tokenizer))}
    for key in ("bos_token_id", "eos_token_id", "pad_token_id"):  # genai_config's reader refuses them after
        value = special.get(key)
        outside = [v for v in (value if isinstance(value, list) else [value]) if v is not None and v >= cfg.vocab_size]
        if outside:
            raise DiffExportError(f"{key} {outside[0]} (from the checkpoint's or tokenizer's generation_config.json or "
                                  f"config.json) is outside the model's vocabulary of {cfg.vocab_size} ids: fix the "
                                  "file; nothing was written")
    search, skipped = hf_search(source_dir)
    if search:
        log("search        from generation_config.json: " + ", ".join(f"{k} {json.dumps(v)}" for k, v in search.items()))
    for note in skipped:
        log(f"search        generation_config.json: passed over {note}")
    if context_length is None:
        context = special.get("max_position_embeddings")
        context_length = context if isinstance(context, int) and context >= 2 else DEFAULT_CONTEXT
        if context_length > MAX_CONTEXT:  # before tracing: the gqa format's rotary caches grow with it
            raise DiffExportError(f"the checkpoint's max_position_embeddings {context_length:,} is past the "
                                  f"{MAX_CONTEXT:,} tokens a folder may hold: give --context-length N (at most "
                                  f"{MAX_CONTEXT:,})")
    start = time.monotonic()
    model, weights_id = exporter.model_in_dtype(loaded, options.dtype)
    dtype = DTYPES[options.dtype]
    log(f"tracing       {cfg.family} KV-cache decoder ({model.num_parameters():,} parameters, {options.dtype}), "
        f"opset {options.resolved_opset()}")
    with torch.no_grad():
        model_ir = _trace(model, options, dtype)
    if not fmt.fuses_norms:  # else the format's own fusion writes the fused norms (onnxruntime_fusions)
        exporter.norms_for_onnxruntime(model_ir, log)
    is_diff = cfg.family != "transformer"
    meta = {exporter.META_PREFIX + "kv_cache": "1", exporter.META_PREFIX + "cache_width": str(cache_width(cfg)),
            exporter.META_PREFIX + "attention": attention}
    if is_diff:
        count = exporter._finish(model_ir, loaded, options, weights_id, key_mask=True,
                                 outputs=output_names(cfg.n_layers), extra_meta=meta)
    else:  # the baseline Transformer (side-by-side comparisons): no DiffAttention node, the same metadata
        count = 0
        exporter.stamp_metadata(model_ir, loaded, options, weights_id, output_names(cfg.n_layers), meta)
    external = exporter.wants_external(model_ir, options)
    make_output_folder(out_dir.parent)
    tmp_dir = Path(tempfile.mkdtemp(dir=out_dir.parent, prefix=temp_prefix(out_dir.name), suffix=".tmp"))
    try:
        log(f"writing       {out_dir}/" + (" with external data" if external else ""))
        exporter.save_checked(model_ir, tmp_dir / MODEL_FILE, external, log)
        del model_ir
        if rewrite is not None:  # the format's pass, on the checked graph inside the temporary folder
            rewrite(tmp_dir / MODEL_FILE, external, context_length, log)
        config = genai_config(cfg, options.dtype, context_length, special, threads, attention, provider, search)
        (tmp_dir / GENAI_CONFIG).write_text(json.dumps(config, indent=2) + "\n")
        for path in tok_files:
            shutil.copyfile(path, tmp_dir / path.name, follow_symlinks=False)
        (tmp_dir / model_card.CARD).write_text(model_card.decoder_card(tmp_dir, MODEL_FILE, out_dir.name))
        os.chmod(tmp_dir, 0o777 & ~_umask())
        rename_into_place(tmp_dir, out_dir, options.force)  # without force: fails, leaving nothing, if out_dir appeared
    except BaseException:
        shutil.rmtree(tmp_dir, ignore_errors=True)
        raise
    size = sum(p.stat().st_size for p in out_dir.iterdir())
    return DecoderExportSummary(folder=out_dir, layers=cfg.n_layers, diff_attention_nodes=count,
                                cache_width=cache_width(cfg), context_length=context_length, tokenizer=bool(tok_files),
                                file_bytes=size, dtype=options.dtype, seconds=time.monotonic() - start,
                                attention=attention, cache_heads=cache_heads(cfg, attention), provider=provider)


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


def read_decoder_folder(folder: str | os.PathLike) -> tuple[Path, dict, dict]:
    """(model path, genai config, diffexport metadata) of a KV-cache export; one-line errors otherwise."""
    folder = Path(folder)
    if not folder.is_dir():
        raise DiffExportError(f"{folder} is not a folder: give the folder `diffexport onnx --kv-cache -o` wrote")
    config_path = folder / GENAI_CONFIG
    config = load_genai_config(folder)
    try:
        decoder = config["model"]["decoder"]
        model_path = folder / decoder["filename"]
    except (KeyError, TypeError):
        raise DiffExportError(f"{config_path} is not a readable genai config") from None
    if not isinstance(decoder["filename"], str) or Path(decoder["filename"]).name != decoder["filename"]:
        raise DiffExportError(f"{config_path}: decoder filename must name a file inside the folder")
    if model_path.is_symlink():
        raise DiffExportError(f"{model_path} is a symbolic link: a decoder folder holds its model file itself")
    meta = read_export_metadata(model_path)
    if meta.get("kv_cache") != "1":
        raise DiffExportError(f"{model_path} is a prefill-only export, not a KV-cache decoder: "
                              "re-export with `diffexport onnx CKPT --kv-cache -o FOLDER`")
    check_genai_config(config, config_path)  # only what diffexport writes: nothing genai would load, write or run
    fmt = decoders.decoder_format(meta.get("attention"))
    shared = config.get("search", {}).get("past_present_share_buffer", False)
    if shared is not fmt.shared_buffer:  # genai would lay the cache out unlike the graph's
        raise DiffExportError(f"{config_path}: search.past_present_share_buffer must be "
                              f"{str(fmt.shared_buffer).lower()} for a {fmt.name} folder, got {shared!r}")
    for key in ("num_hidden_layers", "num_key_value_heads", "head_size"):  # the cache shape runners allocate
        value = decoder.get(key)
        if not isinstance(value, int) or isinstance(value, bool) or not 1 <= value <= 1 << 20:
            raise DiffExportError(f"{config_path}: decoder.{key} must be an integer in 1..{1 << 20}, got {value!r}")
    _check_config_describes_the_graph(config, meta, fmt, config_path)
    eos_token_ids(config)
    context = config["model"].get("context_length")  # how far the ORT loop may go (gqa: the rotary caches' rows)
    if not isinstance(context, int) or isinstance(context, bool) or not 2 <= context <= MAX_CONTEXT:
        raise DiffExportError(f"{config_path}: model.context_length must be an integer in 2..{MAX_CONTEXT}, got {context!r}")
    return model_path, config, meta


def _check_config_describes_the_graph(config: dict, meta: dict, fmt, config_path: Path) -> None:
    """The numbers genai_config.json gives onnxruntime-genai (vocabulary, layers, cache heads and
    width, hidden size, query maps) must be the ones the graph's own metadata implies: a folder
    edited to say otherwise (vocab_size 2**24 against a 512-id graph: buffers sized from the
    config) is refused before anything allocates from them (issue 43)."""
    from diffexport.modeling import config_from_dict

    cfg = config_from_dict(meta["family"], json.loads(meta["config"]))  # validated by read_export_metadata
    heads = decoders.cache_heads(fmt, cfg.n_kv_heads)
    expected = {("model", "vocab_size"): cfg.vocab_size, ("decoder", "num_hidden_layers"): cfg.n_layers,
                ("decoder", "num_key_value_heads"): heads, ("decoder", "head_size"): cache_width(cfg) // heads,
                ("decoder", "hidden_size"): cfg.d_model,
                ("decoder", "num_attention_heads"): 2 * cfg.n_heads if cfg.family != "transformer" else cfg.n_heads}
    for (section, key), value in expected.items():
        given = (config["model"] if section == "model" else config["model"]["decoder"]).get(key)
        if given != value:
            raise DiffExportError(f"{config_path}: {section}.{key} is "
                                  f"{given!r}, but the graph's metadata says {value}: the files do not belong "
                                  "together (re-export the folder)")
