"""Model families and how to build them (seeded, without holding the weights twice), and the memory
they need."""

from __future__ import annotations

import os

import torch

from diffexport.core.errors import DiffExportError
from diffexport.modeling.common import DecoderLM, ModelConfig
from diffexport.modeling.diff_v1 import DiffV1Config, DiffV1LM
from diffexport.modeling.diff_v2 import DiffV2Config, DiffV2LM
from diffexport.modeling.transformer import TransformerConfig, TransformerLM, baseline_for

FAMILIES: dict[str, tuple[type[ModelConfig], type[DecoderLM]]] = {
    "diff_v1": (DiffV1Config, DiffV1LM),
    "diff_v2": (DiffV2Config, DiffV2LM),
    "transformer": (TransformerConfig, TransformerLM),
}
DIFF_FAMILIES = ("diff_v1", "diff_v2")


def config_from_dict(family: str, values) -> ModelConfig:
    if family not in FAMILIES:
        raise DiffExportError(f"unknown model family {family!r}; supported: {sorted(FAMILIES)}")
    return FAMILIES[family][0].from_dict(values)


def build_model(cfg: ModelConfig, *, device: str | torch.device = "cpu", seed: int | None = 0,
                dtype: torch.dtype = torch.float32) -> DecoderLM:
    """Build on the meta device, then allocate once on `device` (no second full copy of the weights).

    device="meta" returns the shape-only model (for summaries of huge presets). seed=None leaves
    the memory uninitialised, for callers that load a state_dict right after.
    """
    with torch.device("meta"):
        model = FAMILIES[cfg.family][1](cfg)
    if str(device) == "meta":
        return model
    check_fits_in_memory(model, dtype, device)
    model = model.to_empty(device=device)
    if cfg.tie_embeddings:  # to_empty re-creates parameters: tie again
        model.lm_head.weight = model.embed.weight
    if seed is not None:
        model.init_weights(seed)
    return model.to(dtype).eval()


def host_memory_bytes() -> int:
    """This machine's physical memory."""
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def check_fits_in_memory(model: torch.nn.Module, dtype: torch.dtype, device) -> None:
    """Refuse, before allocating, a model larger than this machine's memory (CPU) or the GPU's."""

    params = sum(p.numel() for p in model.parameters())
    need = params * max(4, torch.empty(0, dtype=dtype).element_size())  # fp32 while initialising
    if torch.device(device).type == "cuda":
        have = torch.cuda.get_device_properties(torch.device(device)).total_memory
    else:
        have = host_memory_bytes()
    if need > have:
        raise DiffExportError(f"this configuration has {params:,} parameters ({need / 2**30:.1f} GiB to build), "
                              f"more than the {have / 2**30:.0f} GiB here: check the config's sizes")


__all__ = ["FAMILIES", "DIFF_FAMILIES", "DiffV1Config", "DiffV1LM", "DiffV2Config", "DiffV2LM",
           "TransformerConfig", "TransformerLM", "baseline_for", "build_model", "config_from_dict"]
