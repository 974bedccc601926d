"""The model zoo: preset configs shipped as JSON (top-level models/, packaged as diffexport._zoo)."""

from __future__ import annotations

import functools
import json
from importlib import resources
from pathlib import Path

from diffexport.errors import DiffExportError

DEFAULT_PRESET = "diff-v1-tiny"


def _zoo_files():
    try:
        root = resources.files("diffexport._zoo")
    except ModuleNotFoundError:  # running from a source tree that was never installed
        root = Path(__file__).resolve().parent.parent / "models"
    return [f for f in root.iterdir() if f.name.endswith(".json")]


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


def preset_config(name: str):
    from diffexport.modeling import config_from_dict

    entry = get_preset(name)
    return config_from_dict(entry["family"], entry["config"])


def match_preset(cfg) -> str | None:
    """The preset whose config equals cfg (vocab and all), or None."""
    from diffexport.modeling import config_from_dict

    for name, entry in all_presets().items():
        if entry["family"] == cfg.family and config_from_dict(entry["family"], entry["config"]) == cfg:
            return name
    return None
