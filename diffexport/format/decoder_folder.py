"""A KV-cache decoder folder, defined once: what its genai_config.json holds (written by
`genai_config`, read back by `read_decoder_folder` into a typed `DecoderFolder`), the search
defaults and the rules their values follow, end-of-sequence ids, execution providers, the
tokenizer files a folder may carry, and the cache shape the runners allocate.

The export (export/decoder.py) writes folders through this module; the runners, validation,
generation, serving and the report read them through it, so a key of genai_config.json is named
in one place. genai_config.json itself is first held to what diffexport writes
(format/genai_config.py), then to the graph's own metadata.
"""

from __future__ import annotations

import json
import math
import os
from pathlib import Path
from typing import NamedTuple

from diffexport.core.eager_generation import Sampling
from diffexport.core.errors import DiffExportError
from diffexport.core.files import is_hub_cache_link
from diffexport.format import decoders
from diffexport.format.genai_config import MAX_CONTEXT, check_genai_config, load_genai_config
from diffexport.format.metadata import read_export_metadata
from diffexport.format.metadata_keys import ATTENTION, KV_CACHE
from diffexport.format.names import (
    ATTENTION_MASK,
    GENAI_CONFIG,
    INPUT_IDS,
    LOGITS,
    MODEL_FILE,
    PAST_KEY,
    PAST_VALUE,
    PRESENT_KEY,
    PRESENT_VALUE,
    TOKENIZER_MODELS,
)
from diffexport.format.tokenizer_rules import check_tokenizer_json, tokenizer_library_call

GENAI_PROVIDERS = ("cpu", "cuda")  # what genai_config.json may name (onnxruntime-genai's CPU and CUDA builds)


# Files a tokenizer folder may hold that onnxruntime-genai / transformers read (never code files).
# chat_template.jinja: where newer transformers save a chat template (a sandboxed template, read by
# `generate --chat`, not code).
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "tokenizer.model",
                   "vocab.json", "merges.txt", "added_tokens.json", "generation_config.json", "chat_template.jinja")
MAX_TOKENIZER_BYTES = 256 * 1024**2


def has_tokenizer(folder: Path) -> bool:
    """Whether a folder holds a tokenizer onnxruntime-genai / transformers can read."""
    return any((folder / name).is_file() for name in TOKENIZER_MODELS)


def cache_width(cfg) -> int:
    """W: the per-token width of a layer's key cache, equal to its value cache's in every family (a
    DIFF V1 kv head keeps two key maps of head_dim and one value of 2 x head_dim)."""
    return cfg.n_kv_heads * cfg.value_dim


def cache_heads(cfg, attention: str) -> int:
    """Heads of a layer's cache: 1 (token-major, one "head" of width W) for DiffAttention folders,
    for GroupQueryAttention folders one per key map and kv-group (DIFF V1: 2 x Hkv of head_dim, each
    kv-group's two keys, and its value's two halves), head_dim wide."""
    return decoders.cache_heads(decoders.decoder_format(attention), cfg.n_kv_heads * cfg.values_per_head)


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
    maps = cfg.attention_maps
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
    values = None if folder is None else small_json_object(folder / "generation_config.json")
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


def search_sampling(config: dict, *, greedy: bool = False, sample: bool = False, num_beams: int = 1,
                    temperature: float | None = None, top_k: int | None = None, top_p: float | None = None,
                    repetition_penalty: float | None = None, seed: int = 0) -> tuple[Sampling, list[str], bool]:
    """The draw: the caller's options (None: not given) over the folder's genai_config search values,
    as transformers' generate() takes a checkpoint's generation_config. A folder whose search samples
    (do_sample true, from its checkpoint's generation_config.json) samples with its temperature, top-k
    and top-p unless `greedy`; its repetition penalty applies either way. Otherwise greedy, or with
    `sample` temperature 1, no top-k or top-p cut. -> (the draw, what came from
    the folder, in words, for the caller to say; whether the folder's search samples)."""

    search = folder_search(config)
    folder_samples = search["do_sample"] and not greedy and num_beams == 1
    draws_greedily = not (sample or folder_samples)
    taken = []

    def pick(given, key: str, own):
        if given is not None:
            return given
        value = search[key] if folder_samples or key == "repetition_penalty" else own
        if value != own and not (draws_greedily and key != "repetition_penalty") and num_beams == 1:
            taken.append(f"{key.replace('_', ' ')} {value}")
        return value

    sampling = Sampling(greedy=draws_greedily, temperature=pick(temperature, "temperature", 1.0),
                        top_k=pick(top_k, "top_k", 0), top_p=pick(top_p, "top_p", 1.0), seed=seed,
                        repetition_penalty=pick(repetition_penalty, "repetition_penalty", 1.0))
    if folder_samples and not sample:
        taken.insert(0, "sampling")
    return sampling, taken, folder_samples


def small_json_object(path: Path) -> dict | None:
    """A checkpoint folder's optional JSON object (generation_config.json, config.json); None for a
    missing, linked, huge (over 1 MiB) or broken file, which is passed over."""
    if not path.is_file() or path.is_symlink() or path.stat().st_size > 1024**2:
        return None
    try:
        values = json.loads(path.read_text())
    except (OSError, ValueError, RecursionError):
        return None
    return values if isinstance(values, dict) else None


def hf_values(folder: Path | None) -> dict:
    """bos/eos/pad ids and max_position_embeddings from an HF folder's generation_config.json and
    config.json (first found wins; links, huge or broken files are passed over)."""
    found: dict = {}
    if folder is None:
        return found
    for name in ("generation_config.json", "config.json"):
        values = small_json_object(folder / name)
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
    """The tokenizer files of a folder (regular files, or the links of a Hugging Face cache snapshot
    into its own blobs/; no other link is followed); a tokenizer.json whose regular expressions could
    run without end is refused (format/tokenizer_rules.py)."""

    files = []
    for name in TOKENIZER_FILES:
        path = folder / name
        if path.is_symlink() and not is_hub_cache_link(path):
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
            with tokenizer_library_call(f"reading {tok_json}"):
                size = Tokenizer.from_file(str(tok_json)).get_vocab_size(with_added_tokens=True)
        except DiffExportError:
            raise
        except Exception as exc:  # the tokenizers library's own parse errors
            why = str(exc).splitlines()[0][:120]
            raise DiffExportError(f"{tok_json} is not a readable tokenizer ({why})") from None
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


default_provider = decoders.default_provider  # its older home


# The numbers of a genai config that code above reads, each key named once (DecoderFolder's
# properties read them too). The config is one read_decoder_folder (or read_genai_config) checked.
def vocab_size(config: dict) -> int:
    return int(config["model"]["vocab_size"])


def context_length(config: dict) -> int:
    return int(config["model"]["context_length"])


def pad_token_id(config: dict) -> int:
    return int(config["model"].get("pad_token_id", 0))


def cache_shape(config: dict) -> tuple[int, int, int]:
    """(layers, cache heads, head size): what a runner allocates per token and layer, keys and values."""
    decoder = config["model"]["decoder"]
    return int(decoder["num_hidden_layers"]), int(decoder["num_key_value_heads"]), int(decoder["head_size"])


def session_options(config: dict) -> dict:
    return config["model"]["decoder"].get("session_options", {})


class DecoderFolder(NamedTuple):
    """A decoder folder as read_decoder_folder accepted it: the graph file, the genai config (held to
    what diffexport writes and to the graph) and the graph's diffexport metadata. Unpacks as
    (model_path, config, meta); the numbers runners need are typed properties."""
    model_path: Path
    config: dict
    meta: dict

    @property
    def folder(self) -> Path:
        return self.model_path.parent

    @property
    def format(self) -> decoders.DecoderFormat:
        return decoders.decoder_format(self.meta.get(ATTENTION))

    @property
    def vocab_size(self) -> int:
        return vocab_size(self.config)

    @property
    def context_length(self) -> int:
        return context_length(self.config)

    @property
    def pad_token_id(self) -> int:
        return pad_token_id(self.config)

    @property
    def eos_token_ids(self) -> tuple[int, ...]:
        return eos_token_ids(self.config)

    @property
    def layers(self) -> int:
        return cache_shape(self.config)[0]

    @property
    def cache_heads(self) -> int:
        """1: the token-major cache of DiffAttention folders; gqa folders: the kv heads (V1: 2 per kv-group)."""
        return cache_shape(self.config)[1]

    @property
    def head_size(self) -> int:
        return cache_shape(self.config)[2]

    @property
    def session_options(self) -> dict:
        return session_options(self.config)

    @property
    def providers(self) -> list[str]:
        return configured_providers(self.config)

    @property
    def search(self) -> dict:
        return folder_search(self.config)


def read_decoder_folder(folder: str | os.PathLike) -> DecoderFolder:
    """The KV-cache export in `folder`, validated (DecoderFolder); one-line errors otherwise."""
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
    if meta.get(KV_CACHE) != "1":
        raise DiffExportError(f"{model_path} is a prefill-only export, not a KV-cache decoder: "
                              "re-export with `diffexport onnx CKPT --kv-cache -o FOLDER`")
    check_genai_config(config, config_path)  # only what diffexport writes: nothing genai would load, write or run
    fmt = decoders.decoder_format(meta.get(ATTENTION))
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
        raise DiffExportError(f"{config_path}: model.context_length must be an integer in 2..{MAX_CONTEXT}, got "
                              f"{context!r}")
    return DecoderFolder(model_path, config, meta)


def _check_config_describes_the_graph(config: dict, meta: dict, fmt, config_path: Path) -> None:
    """The numbers genai_config.json gives onnxruntime-genai (vocabulary, layers, cache heads and
    width, hidden size, query maps) must be the ones the graph's own metadata implies: a folder
    edited to say otherwise (vocab_size 2**24 against a 512-id graph: buffers sized from the
    config) is refused before anything allocates from them."""

    cfg = meta.model_config  # validated by read_export_metadata
    heads = decoders.cache_heads(fmt, cfg.n_kv_heads * cfg.values_per_head)
    expected = {("model", "vocab_size"): cfg.vocab_size, ("decoder", "num_hidden_layers"): cfg.n_layers,
                ("decoder", "num_key_value_heads"): heads, ("decoder", "head_size"): cache_width(cfg) // heads,
                ("decoder", "hidden_size"): cfg.d_model,
                ("decoder", "num_attention_heads"): cfg.attention_maps}
    for (section, key), value in expected.items():
        given = (config["model"] if section == "model" else config["model"]["decoder"]).get(key)
        if key == "num_key_value_heads" and fmt.head_major_cache and cfg.values_per_head == 2 \
                and given == cfg.n_kv_heads:
            raise DiffExportError(f"{config_path}: a gqa folder of a DIFF V1 model from diffexport before 2026-11-28 "
                                  f"({given} cache heads of {2 * cfg.head_dim}; now {value} of {cfg.head_dim}, "
                                  "the layout that reads the cache at a Llama's cost): export it again")
        if given != value:
            raise DiffExportError(f"{config_path}: {section}.{key} is "
                                  f"{given!r}, but the graph's metadata says {value}: the files do not belong "
                                  "together (re-export the folder)")
