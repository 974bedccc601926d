"""The protocol every KV-cache decoder runner follows: what the generation loop
(backends/decoding.py), the searches and `check` may rely on, whatever runs the graph.

Implemented by the onnxruntime loop (`decoding.OrtDecoder`) and the TensorRT engine runner
(`tensorrt.EngineDecoder`). onnxruntime-genai keeps its own cache behind its Generator API, so it
is driven through decoding.py's genai functions, not this protocol.
"""

from __future__ import annotations

from pathlib import Path
from typing import Protocol, runtime_checkable

import numpy as np


@runtime_checkable
class DecoderRunner(Protocol):
    model_path: Path          # the graph or engine it runs
    meta: dict[str, str]      # the export's metadata (format/metadata.py)
    config: dict | None       # the folder's genai config (None: an engine opened without its folder)
    layers: int               # decoder layers, each with a past key and value
    context: int              # the longest sequence, past and new tokens, a step may see
    max_sequence: int | None  # the most new tokens one step takes (an engine's profile); None: up to context

    def empty_cache(self, batch: int) -> dict[str, np.ndarray]:
        """The cache before the first step, keyed by present names (format/names.py), past length 0."""
        ...

    def step(self, ids: np.ndarray, mask: np.ndarray,
             cache: dict[str, np.ndarray]) -> tuple[np.ndarray, dict[str, np.ndarray]]:
        """One forward: ids [B, S], mask [B, P+S] (0 = padding), last step's cache -> (logits
        [B, S, V], the new cache keyed by present names)."""
        ...
