"""The model zoo: preset configs shipped as JSON (top-level models/, packaged as diffexport._zoo).

A preset with "weights" names a folder of the zoo holding a trained model as a Hugging Face folder
(config.json, model.safetensors, tokenizer, chat template): `--preset NAME` loads it instead of
building random weights.
"""

from __future__ import annotations

import functools
import json
from importlib import resources
from pathlib import Path

from diffexport.core.errors import DiffExportError
from diffexport.core.files import check_output_path, staging_folder
from diffexport.core.lazy import lazy_import

families = lazy_import("diffexport.modeling.families")

DEFAULT_PRESET = "diff-v1-tiny"


def _zoo_root():
    try:
        return resources.files("diffexport._zoo")
    except ModuleNotFoundError:  # running from a source tree that was never installed
        return Path(__file__).resolve().parents[2] / "models"


def _zoo_files():
    return [f for f in _zoo_root().iterdir() if f.name.endswith(".json")]


@functools.lru_cache(maxsize=1)
def all_presets() -> dict[str, dict]:
    presets = {}
    for f in _zoo_files():
        entry = json.loads(f.read_text())
        presets[entry["name"]] = entry
    return dict(sorted(presets.items()))


def get_preset(name: str) -> dict:
    presets = all_presets()
    if name not in presets:
        raise DiffExportError(f"unknown preset {name!r}; available: {', '.join(presets)}")
    return presets[name]


def preset_weights(name: str) -> Path | None:
    """The zoo folder holding the preset's trained weights, or None (a random-weights preset)."""
    folder = get_preset(name).get("weights")
    if folder is None:
        return None
    if not isinstance(folder, str) or "/" in folder or folder.startswith("."):
        raise DiffExportError(f"preset {name!r}: its weights folder {folder!r} is not a folder name of the zoo")
    # the zoo is a namespace package when installed: its Traversable joins to a real folder
    path = _zoo_root().joinpath(folder)
    if not isinstance(path, Path) or not path.is_dir():
        raise DiffExportError(f"preset {name!r}: its weights folder {folder!r} is not in the installed zoo "
                              f"(reinstall diffexport)")
    return path


def preset_config(name: str):
    entry = get_preset(name)
    return families.config_from_dict(entry["family"], entry["config"])


def match_preset(cfg) -> str | None:
    """The preset whose config equals cfg (vocab and all), or None."""
    for name, entry in all_presets().items():
        if entry["family"] == cfg.family and families.config_from_dict(entry["family"], entry["config"]) == cfg:
            return name
    return None


def write_preset_folder(name: str, destination, replace: bool = False) -> Path:
    """A trained preset's folder (a Hugging Face DiffLlama folder: config, safetensors, tokenizer,
    chat template, generation config) copied to a new folder, for transformers and for the commands
    that take a checkpoint path; published whole or not at all."""
    source = preset_weights(name)
    if source is None:
        trained = [n for n, entry in all_presets().items() if "weights" in entry]
        raise DiffExportError(f"preset {name!r} has no trained weights to write (it builds random weights); "
                              f"trained presets: {', '.join(trained) or 'none'}")
    destination = Path(destination)
    check_output_path(destination, replace=replace)
    with staging_folder(destination, replace=replace) as tmp:
        for file in sorted(source.iterdir()):
            if file.is_file() and not file.is_symlink():
                (tmp / file.name).write_bytes(file.read_bytes())
    return destination
