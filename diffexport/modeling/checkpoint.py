"""Checkpoints users can trust: save, load, import, with one-line errors for every bad input.

Native formats:
  ckpt.pt      a plain dict {format, format_version, family, config, state_dict} written by
               torch.save and read with weights_only=True: no code from the file ever runs.
  safetensors  model.safetensors (tensors only) + config.json {format, format_version, family, config}.
Imports: Hugging Face DiffLlama directories (config.json + safetensors or .bin), and bare
state dicts (unilm-named or ours) given a config or a preset. Foreign layouts are permuted
into the canonical one here, once (diffexport.modeling.layouts).
"""

from __future__ import annotations

import dataclasses
import json
import os
import pickle
import pickletools
import warnings
import zipfile
from pathlib import Path
from typing import Any, Mapping

import torch

from diffexport.core.errors import DiffExportError
from diffexport.core.files import atomic_write
from diffexport.core.progress import Progress
from diffexport.modeling import hub, layouts
from diffexport.modeling.common import DecoderLM, ModelConfig
from diffexport.modeling.families import FAMILIES, build_model, config_from_dict
from diffexport.modeling.presets import preset_config, preset_weights

FORMAT = "diffexport.modeling.checkpoint"
FORMAT_VERSION = 1
LAYOUTS = ("auto", "native", "unilm")


@dataclasses.dataclass
class LoadedModel:
    model: DecoderLM
    config: ModelConfig
    # "native", "safetensors", "hf-diffllama", "hf-llama", "state-dict:native", "state-dict:unilm", "preset"
    source: str
    path: str | None = None
    task: dict | None = None  # what the weights were trained on, when the checkpoint says (tools/train_tiny.py)
    hub_id: str | None = None  # org/name when loaded from a Hugging Face Hub id (path: its cache snapshot)
    hub_revision: str | None = None  # the snapshot's commit


# ---------------------------------------------------------------- saving

def canonical_state_dict(model: DecoderLM) -> dict[str, torch.Tensor]:
    """The state dict we save: tied LM heads are stored once (as embed.weight)."""
    state = {k: v.detach() for k, v in model.state_dict().items()}
    if model.config.tie_embeddings:
        state.pop("lm_head.weight", None)
    return state


def _header(cfg: ModelConfig) -> dict[str, Any]:
    return {"format": FORMAT, "format_version": FORMAT_VERSION, "family": cfg.family, "config": cfg.to_dict()}


def save_checkpoint(model: DecoderLM, path: str | os.PathLike, *, task: Mapping | None = None) -> Path:
    """task: an optional plain record of the training task (e.g. {"name": "needles", "context_len": 128})."""
    path = Path(path)
    payload = {**_header(model.config), "state_dict": canonical_state_dict(model)}
    if task is not None:
        payload["task"] = dict(task)
    atomic_write(path, lambda tmp: torch.save(payload, tmp))
    return path


def save_safetensors(model: DecoderLM, directory: str | os.PathLike) -> Path:
    """Write directory/model.safetensors and directory/config.json."""
    from safetensors.torch import save_file

    directory = Path(directory)
    state = {k: v.contiguous() for k, v in canonical_state_dict(model).items()}
    atomic_write(directory / "model.safetensors", lambda tmp: save_file(state, tmp, metadata={"format": FORMAT}))
    atomic_write(directory / "config.json",
                  lambda tmp: Path(tmp).write_text(json.dumps(_header(model.config), indent=2) + "\n"))
    return directory


def save_hf_folder(model: DecoderLM, directory: str | os.PathLike, **config_extra) -> Path:
    """Write directory/config.json and model.safetensors as transformers' DiffLlamaForCausalLM
    (a V1 model) or LlamaForCausalLM (the baseline) saves them; config_extra adds config.json keys
    (token ids, max_position_embeddings)."""
    from safetensors.torch import save_file

    directory = Path(directory)
    hf_config, state = layouts.hf_export(model.config, canonical_state_dict(model))
    hf_config.update(config_extra)
    atomic_write(directory / "model.safetensors", lambda tmp: save_file(state, tmp, metadata={"format": "pt"}))
    atomic_write(directory / "config.json", lambda tmp: Path(tmp).write_text(json.dumps(hf_config, indent=2) + "\n"))
    return directory


# ---------------------------------------------------------------- reading files

def _corrupt(path: Path, detail: object) -> DiffExportError:
    text = str(detail).strip()
    if text.startswith("Weights only load failed"):
        # torch's own text advises weights_only=False ("will likely succeed"): for a stranger's
        # file that is the advice to run its code. Keep only what it found ("Unsupported operand 35").
        found = [ln.strip() for ln in text.splitlines()[1:] if ln.strip() and not ln.startswith(("Please", "Check"))]
        text = found[0] if found else "not a checkpoint torch can read without running code"
    first = text.splitlines()[0] if text else type(detail).__name__
    return DiffExportError(f"{path} is not a readable checkpoint (corrupt or truncated): {first}")


def _check_zip_crc(path: Path) -> None:
    """torch.load does not verify the CRC-32 of each archive member; flipped bytes in tensor data
    would load as silently different weights. zipfile's testzip reads every member once and does."""
    try:
        with zipfile.ZipFile(path) as archive:
            bad = archive.testzip()
    except (zipfile.BadZipFile, OSError, EOFError, ValueError, RuntimeError) as exc:
        raise _corrupt(path, exc) from None
    if bad is not None:
        raise DiffExportError(f"{path} is corrupt: checksum mismatch in archive member {bad}")


def _is_wellformed_pickle(path: Path, is_zip: bool) -> bool:
    """Parse (never run) the pickle opcodes, streaming (a big file is never read whole): tells a
    foreign-but-valid pickle from garbage."""
    try:
        if is_zip:
            with zipfile.ZipFile(path) as archive:
                name = next(n for n in archive.namelist() if n.endswith("data.pkl"))
                with archive.open(name) as stream:
                    return any(op.name == "STOP" for op, _, _ in pickletools.genops(_Bounded(stream)))
        with path.open("rb") as stream:
            return any(op.name == "STOP" for op, _, _ in pickletools.genops(_Bounded(stream)))
    except Exception:  # any parse failure (or the bound) means: not a well-formed pickle
        return False


class _Bounded:
    """A read-only stream that stops MAX_STRUCTURE_PICKLE_BYTES in: a 'line' opcode over gigabytes
    of garbage must not be read into memory whole."""

    def __init__(self, raw):
        self.raw, self.left = raw, MAX_STRUCTURE_PICKLE_BYTES

    def _take(self, data: bytes) -> bytes:
        self.left -= len(data)
        if self.left < 0:
            raise ValueError("pickle longer than a checkpoint's structure")
        return data

    def read(self, n: int = -1) -> bytes:
        return self._take(self.raw.read(self.left + 1 if n is None or n < 0 else min(n, self.left + 1)))

    def readline(self, n: int = -1) -> bytes:
        return self._take(self.raw.readline(self.left + 1 if n is None or n < 0 else min(n, self.left + 1)))


# data.pkl holds a checkpoint's structure only (names, shapes, storage keys): a few MB even for
# models of 100B parameters. A declared size beyond this is a deflate bomb, not a checkpoint.
MAX_STRUCTURE_PICKLE_BYTES = 256 << 20


def _check_zip_structure(path: Path) -> None:
    """The archive's own declarations, read before any member is inflated."""
    try:
        with zipfile.ZipFile(path) as archive:
            for info in archive.infolist():
                if info.filename.endswith("data.pkl") and info.file_size > MAX_STRUCTURE_PICKLE_BYTES:
                    raise DiffExportError(f"{path}: {info.filename} declares {info.file_size:,} bytes (at most "
                                          f"{MAX_STRUCTURE_PICKLE_BYTES:,} for a checkpoint's structure): refused "
                                          "unread")
    except (zipfile.BadZipFile, OSError, EOFError, ValueError) as exc:
        raise _corrupt(path, exc) from None


class _StructureReader(pickle.Unpickler):
    """Reads data.pkl without importing or calling anything: every global becomes a placeholder,
    and each storage the file declares is recorded as (key, storage type name, element count)."""

    class _Global:
        def __init__(self, name: str):
            self.name = name

        def __call__(self, *args, **kwargs):
            return _StructureReader._Object()

    class _Object:
        def __setstate__(self, state):
            pass

        def __setitem__(self, key, value):
            pass

        def append(self, value):
            pass

        def extend(self, values):
            pass

    def __init__(self, stream):
        super().__init__(stream)
        self.storages: list[tuple[str, str, int]] = []

    def find_class(self, module, name):
        return self._Global(f"{module}.{name}")

    def persistent_load(self, pid):
        if isinstance(pid, tuple) and len(pid) == 5 and pid[0] == "storage":
            _, kind, key, _, numel = pid
            self.storages.append((str(key), getattr(kind, "name", ""), numel))
        return self._Object()


def _check_storage_sizes(path: Path) -> None:
    """Every storage data.pkl declares fits in its archive member, stored uncompressed. torch.load
    with mmap=True checks neither: a short member would load the bytes that follow it (the next
    tensor's) as weights, a deflated one its compressed bytes."""
    element_size = {f"torch.{name}": dtype.itemsize
                    for dtype, name in torch.storage._dtype_to_storage_type_map().items()}
    try:
        with zipfile.ZipFile(path) as archive:
            pkl = next(n for n in archive.namelist() if n.endswith("data.pkl"))
            with archive.open(pkl) as stream:
                reader = _StructureReader(stream)
                reader.load()
            members = {info.filename: info for info in archive.infolist()}
    except (pickle.UnpicklingError, zipfile.BadZipFile, OSError, EOFError, ValueError, StopIteration, TypeError,
            AttributeError, IndexError, KeyError, RecursionError) as exc:
        raise _corrupt(path, exc) from None
    prefix = pkl[: -len("data.pkl")]
    for key, kind, numel in reader.storages:
        info = members.get(f"{prefix}data/{key}")
        if info is None or kind not in element_size or not isinstance(numel, int) or numel < 0:
            continue  # torch.load reports these itself
        declared = numel * element_size[kind]
        if info.compress_type != zipfile.ZIP_STORED:
            raise DiffExportError(f"{path}: tensor storage {info.filename} is compressed; torch.save stores them "
                                  "uncompressed (re-save the checkpoint with torch.save)")
        if info.file_size < declared:
            raise _corrupt(path, f"tensor storage {info.filename} holds {info.file_size:,} bytes but its tensor "
                                 f"declares {declared:,}")


def _torch_load(path: Path) -> Any:
    """torch.load with weights_only=True; every failure becomes one line."""
    is_zip = zipfile.is_zipfile(path)
    if is_zip:
        _check_zip_structure(path)
        _check_zip_crc(path)
        _check_storage_sizes(path)
    try:
        # mmap keeps big checkpoints out of RAM until used; only the zip format supports it.
        with warnings.catch_warnings():  # torch warns about foreign pickle protocols: our error says it
            warnings.simplefilter("ignore")
            return torch.load(path, map_location="cpu", weights_only=True, mmap=is_zip)
    except pickle.UnpicklingError as exc:
        text = str(exc)
        detail = next((ln.strip() for ln in text.splitlines() if "global" in ln.lower()), "")
        if detail:  # the file names a Python callable or class: code we refuse to run
            raise DiffExportError(
                f"refusing to load {path}: it holds Python objects that weights_only=True forbids ({detail}); "
                "re-save it as a plain dict of tensors or as safetensors"
            ) from None
        if _is_wellformed_pickle(path, is_zip):  # e.g. a protocol-4 pickle with objects we cannot vet
            raise DiffExportError(
                f"refusing to load {path}: it is a pickle that weights_only=True cannot read safely; "
                "re-save it with torch.save as a plain dict of tensors, or as safetensors"
            ) from None
        raise _corrupt(path, exc) from None
    except (RuntimeError, EOFError, ValueError, zipfile.BadZipFile, OSError, KeyError, TypeError,
            AttributeError, IndexError) as exc:
        raise _corrupt(path, exc) from None


def _safetensors_load(path: Path) -> dict[str, torch.Tensor]:
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    try:
        return load_file(path)
    except (SafetensorError, OSError, ValueError, RuntimeError) as exc:
        raise _corrupt(path, exc) from None


def _read_json(path: Path) -> dict:
    try:
        data = json.loads(path.read_text())
    except FileNotFoundError:
        raise DiffExportError(f"{path} not found: a checkpoint directory or .safetensors file needs its "
                              "config.json") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise DiffExportError(f"{path} is not valid JSON: {exc}") from None
    except RecursionError:
        raise DiffExportError(f"{path} is not valid JSON: nested too deeply") from None
    if not isinstance(data, dict):
        raise DiffExportError(f"{path} must hold a JSON object")
    return data


# ---------------------------------------------------------------- building from a state dict

def _check_header(header: Mapping, where: str) -> ModelConfig:
    version = header.get("format_version")
    if version != FORMAT_VERSION:
        raise DiffExportError(f"{where}: unknown format_version {version!r}; this diffexport reads version "
                              f"{FORMAT_VERSION} (upgrade diffexport, or re-save the checkpoint)")
    family = header.get("family")
    if family not in FAMILIES:
        raise DiffExportError(f"{where}: family {family!r} is not a supported model family "
                              f"({', '.join(sorted(FAMILIES))})")
    return config_from_dict(family, header.get("config"))


READABLE_DTYPES = (torch.float32, torch.float16, torch.bfloat16, torch.float64)


def _check_tensor_kind(name: str, t, where: str) -> None:
    """A dense CPU tensor of a float dtype we read: anything else is named, before any conversion."""
    if not isinstance(t, torch.Tensor):
        raise DiffExportError(f"{where}: {name} is a {type(t).__name__}, not a tensor")
    if t.layout != torch.strided or t.is_meta or t.device.type != "cpu":
        kind = "meta" if t.is_meta else (str(t.layout).removeprefix("torch.") if t.layout != torch.strided
                                         else t.device.type)
        raise DiffExportError(f"{where}: {name} is a {kind} tensor; diffexport reads dense CPU tensors "
                              f"(save with .to_dense().cpu())")
    if t.dtype not in READABLE_DTYPES:
        raise DiffExportError(f"{where}: {name} has dtype {str(t.dtype).removeprefix('torch.')}; diffexport reads "
                              f"float32, float16, bfloat16 and float64 weights (dequantise fp8/int weights first)")


def read_tensors(state, where: str) -> dict[str, torch.Tensor]:
    """The loader's first step after reading a file: a mapping of names to tensors of kinds we
    read, checked before any layout conversion touches them (shapes come later, against the
    config, in model_from_state)."""
    if not isinstance(state, Mapping):
        raise DiffExportError(f"{where}: state_dict must be a mapping of names to tensors")
    for name, t in state.items():
        if not isinstance(name, str):
            raise DiffExportError(f"{where}: state_dict key {name!r} is not a string")
        _check_tensor_kind(name, t, where)
    return dict(state)


def _check_tensor(name: str, t, ref: torch.Tensor, where: str) -> None:
    _check_tensor_kind(name, t, where)
    if tuple(t.shape) != tuple(ref.shape):
        raise DiffExportError(f"{where}: wrong shape for {name}: got {list(t.shape)}, "
                              f"expected {list(ref.shape)} for this config")
    if not torch.isfinite(t).all():
        raise DiffExportError(f"{where}: {name} contains NaN or infinity")


def model_from_state(cfg: ModelConfig, state: Mapping, where: str, dtype: torch.dtype | None = None) -> DecoderLM:
    """Check names, shapes and dtypes against cfg, then load without a second copy of the weights."""
    if not isinstance(state, Mapping):
        raise DiffExportError(f"{where}: state_dict must be a mapping of names to tensors")
    model = build_model(cfg, device="meta")
    expected = {k: v for k, v in model.state_dict().items()
                if not (cfg.tie_embeddings and k == "lm_head.weight")}
    missing = sorted(set(expected) - set(state))
    unexpected = sorted(set(state) - set(expected) - ({"lm_head.weight"} if cfg.tie_embeddings else set()))
    if missing:
        raise DiffExportError(f"{where}: missing key(s) {', '.join(missing[:3])}"
                              f"{f' (+{len(missing) - 3} more)' if len(missing) > 3 else ''} for a {cfg.family} "
                              f"model with this config")
    if unexpected:
        raise DiffExportError(f"{where}: unexpected key(s) {', '.join(unexpected[:3])}"
                              f"{f' (+{len(unexpected) - 3} more)' if len(unexpected) > 3 else ''}")
    total = sum(ref.numel() for ref in expected.values())
    with Progress("checking weights", total, min_total=1e8) as progress:
        for name, ref in expected.items():
            _check_tensor(name, state[name], ref, where)
            progress.advance(ref.numel())
    target = dtype or state["embed.weight"].dtype
    check_range(((k, state[k]) for k in expected), target, where)
    weights = {k: state[k].to(target) for k in expected}
    if cfg.tie_embeddings:
        weights["lm_head.weight"] = weights["embed.weight"]
    model.load_state_dict(weights, strict=True, assign=True)
    if cfg.tie_embeddings:  # assign=True sets two Parameters: make them one again
        model.lm_head.weight = model.embed.weight
    return model.eval()


def check_range(named_tensors, dtype: torch.dtype, where: str) -> None:
    """Finite weights that the target dtype cannot hold would become inf when cast (fp16 stops at
    65504): refuse, naming the tensor, instead of exporting infinities."""
    if not dtype.is_floating_point:
        return
    limit = torch.finfo(dtype).max
    for name, tensor in named_tensors:
        if tensor.is_floating_point() and torch.finfo(tensor.dtype).max > limit and tensor.numel():
            peak = float(tensor.detach().abs().max())
            if peak > limit:
                kind = str(dtype).replace("torch.", "")
                raise DiffExportError(f"{where}: {name} holds values up to {peak:.4g}, beyond {kind}'s range "
                                      f"({limit:.4g}): export in float32 or bfloat16")


def _require_diff(state: Mapping, where: str) -> None:
    if not any(k.endswith(("lambda_q1", "lambda_proj.weight")) for k in state):
        raise DiffExportError(f"{where}: not a DIFF model: no differential-attention parameters "
                              f"(lambda_q1 / lambda_proj) in its state dict")


# ---------------------------------------------------------------- the entry point

def load_model(path: str | os.PathLike | None = None, *, preset: str | None = None,
               config: ModelConfig | None = None, layout: str = "auto", seed: int = 0,
               dtype: torch.dtype | None = None, device: str = "cpu") -> LoadedModel:
    """Load any supported checkpoint (or build a seeded preset when only `preset` is given;
    device="meta" then builds shapes only, for summaries of presets too big to materialise)."""

    if layout not in LAYOUTS:
        raise DiffExportError(f"unknown layout {layout!r}; choose one of {', '.join(LAYOUTS)}")
    if preset is not None and config is not None:
        raise DiffExportError("give either a preset or a config, not both")
    given_cfg = config if config is not None else (preset_config(preset) if preset else None)
    trained = preset_weights(preset) if path is None and preset is not None and config is None else None
    if trained is not None:
        return load_model(trained, dtype=dtype)  # a trained preset: its zoo folder
    if path is None:
        if given_cfg is None:
            raise DiffExportError("nothing to load: give a checkpoint path or --preset NAME")
        model = build_model(given_cfg, seed=seed, dtype=dtype or torch.float32, device=device)
        return LoadedModel(model, given_cfg, "preset" if device != "meta" else "preset (shapes only)")


    repo = hub.hub_repo(path)
    path = hub.resolve(path)  # a Hugging Face Hub id (org/name[@revision]) becomes its local snapshot
    if repo is not None:  # snapshots/COMMIT: the id and the commit are what an export records
        return dataclasses.replace(load_model(path, layout=layout, dtype=dtype), hub_id=repo, hub_revision=path.name)
    if not path.exists():
        raise DiffExportError(f"checkpoint not found: {path}")
    if not path.is_dir() and not path.is_file():  # a FIFO would hang, /dev/zero grow without end
        raise DiffExportError(f"{path} is not a regular file or folder (a device, FIFO or socket): give a checkpoint "
                              "file")
    if path.is_dir():
        return _load_directory(path, dtype)
    if path.suffix == ".safetensors":
        return _load_safetensors(path, path.parent / "config.json", dtype)
    if path.suffix == ".json":
        raise DiffExportError(f"{path} is a config file: give the checkpoint (or its directory) instead")
    if path.suffix in (".onnx", ".engine", ".plan", ".trt"):
        raise DiffExportError(f"{path} is an exported model, not a checkpoint: give the checkpoint it came from "
                              "(check takes the exported file first, then --ckpt CHECKPOINT)")

    obj = _torch_load(path)
    if isinstance(obj, Mapping) and "format" in obj:
        if obj["format"] != FORMAT:
            raise DiffExportError(f"{path}: unknown checkpoint format {obj['format']!r} (expected {FORMAT!r})")
        cfg = _check_header(obj, str(path))
        model = model_from_state(cfg, read_tensors(obj.get("state_dict"), str(path)), str(path), dtype)
        task = obj.get("task")
        return LoadedModel(model, cfg, "native", str(path), task if isinstance(task, dict) else None)
    if isinstance(obj, Mapping) and obj and all(isinstance(v, torch.Tensor) for v in obj.values()):
        return _load_bare_state(read_tensors(obj, str(path)), given_cfg, layout, str(path), dtype)
    raise DiffExportError(f"{path} is not a diffexport checkpoint: expected a dict with 'format': {FORMAT!r} "
                          f"or a bare state dict of tensors")


def from_module(model: torch.nn.Module, dtype: torch.dtype | None = None) -> LoadedModel:
    """An in-memory model as a LoadedModel: one of ours (diffexport.modeling), or transformers'
    DiffLlamaForCausalLM (or LlamaForCausalLM, the baseline) converted exactly as an HF folder is
    (its weights copied, the module left as it was). Without a folder on disk, `check` compares with
    diffexport's port only."""
    if isinstance(model, DecoderLM):
        return LoadedModel(model, model.config, "in-memory")
    hf_config = getattr(model, "config", None)
    imported = layouts.HF_IMPORTS.get(getattr(hf_config, "model_type", None))
    if imported is not None and hasattr(model, "state_dict"):
        cfg = config_from_dict(imported.family, imported.config(hf_config.to_dict()))
        where = f"the in-memory {layouts.HF_NAMES[imported.model_type]}"
        state = read_tensors({k: v.detach().cpu() for k, v in model.state_dict().items()}, where)
        return LoadedModel(model_from_state(cfg, imported.state(state, cfg), where, dtype), cfg,
                           f"{imported.source} (in memory)")
    raise DiffExportError(f"{type(model).__name__} is not a model diffexport knows: pass a diffexport model "
                          "(diffexport.modeling), a transformers DiffLlamaForCausalLM or (the baseline) "
                          "LlamaForCausalLM")


def _load_bare_state(state: dict, cfg: ModelConfig | None, layout: str, where: str, dtype) -> LoadedModel:
    if cfg is None:
        raise DiffExportError(f"{where} is a bare state dict without a config: give --preset NAME or --config "
                              f"FILE (and --layout unilm for official-code names)")
    if cfg.differential:
        _require_diff(state, where)
    if layout == "auto":
        layout = "unilm" if layouts.looks_unilm(state) else "native"
    if layout == "unilm":
        if cfg.family != "diff_v1":
            raise DiffExportError(f"--layout unilm reads DIFF V1 checkpoints, not {cfg.family}")
        state = layouts.unilm_state(state, cfg)
    elif cfg.rope_interleaved:
        state = layouts.rope_to_halves(state, cfg)
    if cfg.rope_interleaved:  # the weights are now rotate-half
        cfg = dataclasses.replace(cfg, rope_interleaved=False)
    model = model_from_state(cfg, state, where, dtype)
    return LoadedModel(model, cfg, f"state-dict:{layout}", where)


def _load_safetensors(path: Path, config_path: Path, dtype) -> LoadedModel:
    header = _read_json(config_path)
    if header.get("format") != FORMAT:
        raise DiffExportError(f"{config_path} is not a diffexport config (no 'format': {FORMAT!r})")
    cfg = _check_header(header, str(config_path))
    model = model_from_state(cfg, read_tensors(_safetensors_load(path), str(path)), str(path), dtype)
    return LoadedModel(model, cfg, "safetensors", str(path))


def _load_directory(path: Path, dtype) -> LoadedModel:
    config_path = path / "config.json"
    if not config_path.exists() and (path / "genai_config.json").is_file():  # `info FOLDER`, `stats FOLDER`, ...
        raise DiffExportError(f"{path} is a KV-cache export folder, not a checkpoint: give the checkpoint it came from "
                              f"(`diffexport inspect {path}` describes the folder; check takes it first, then --ckpt)")
    header = _read_json(config_path)
    if header.get("format") == FORMAT:
        return _load_safetensors(path / "model.safetensors", config_path, dtype)
    model_type = header.get("model_type")
    imported = layouts.HF_IMPORTS.get(model_type) if isinstance(model_type, str) else None
    if imported is None:
        raise DiffExportError(f"{path}: not a DIFF model: config.json has model_type {model_type!r}; "
                              f"diffexport imports Hugging Face DiffLlama (model_type 'diffllama') and, as the "
                              f"baseline to compare with, Llama ('llama')")
    cfg = config_from_dict(imported.family, imported.config(header))
    state: dict[str, torch.Tensor] = {}
    shards = sorted(path.glob("*.safetensors"))
    for shard in shards:
        state.update(_safetensors_load(shard))
    if not shards:
        bins = sorted(path.glob("pytorch_model*.bin"))
        if not bins:
            raise DiffExportError(f"{path}: no *.safetensors or pytorch_model*.bin weights found")
        for shard in bins:
            part = _torch_load(shard)
            if not isinstance(part, Mapping):
                raise DiffExportError(f"{shard} does not hold a state dict")
            state.update(part)
    state = read_tensors(state, str(path))
    model = model_from_state(cfg, imported.state(state, cfg), str(path), dtype)
    return LoadedModel(model, cfg, imported.source, str(path))


def load_config_file(path: str | os.PathLike) -> ModelConfig:
    """A JSON config for bare state dicts: {"family": ..., "config": {...}} or a preset-style entry."""
    data = _read_json(Path(path))
    if "family" not in data or "config" not in data:
        raise DiffExportError(f"{path}: a config file needs 'family' and 'config' keys")
    return config_from_dict(data["family"], data["config"])
