"""Run a model with its attention written out: logits visible to observers, optionally low-bit.

`AttentionProbe(model, quant=..., on_logits=..., on_map=...)` is a context manager that swaps
every layer's attention `impl` for an explicit implementation (logits, masked softmax, maps)
and restores the original on exit. It works for every family: DIFF V1 and V2 (the contract's
inputs) and the baseline Transformer (q, k, v heads).

Observers:
  on_logits(layer, [S, ...], visible)  pre-softmax logits [B, heads, Sq, Skv] (softmax scale
                                       included; DIFF gives both maps), visible [Sq, Skv] or None
                                       ([B, 1, Sq, Skv] in a cached call with a key mask)
  on_map(layer, A)                     the effective attention map [B, heads, Sq, Skv]:
                                       softmax for a Transformer, A1 - lambda*A2 for DIFF
"""

from __future__ import annotations

import functools
from typing import Callable

from diffexport.core.errors import DiffExportError
from diffexport.core.quantization import LogitQuant
from diffexport.kernel import reference
from diffexport.kernel.reference import attention_logits, masked_softmax
from diffexport.modeling.families import FAMILIES


class AttentionProbe:
    def __init__(self, model, *, quant: LogitQuant | None = None,
                 on_logits: Callable | None = None, on_map: Callable | None = None):
        family = getattr(getattr(model, "config", None), "family", None)
        if family not in FAMILIES:
            raise DiffExportError(f"cannot probe attention of {type(model).__name__}: not a supported model "
                                  f"family ({', '.join(sorted(FAMILIES))})")
        self.model, self.family, self.differential = model, family, model.config.differential
        self.quant, self.on_logits, self.on_map = quant, on_logits, on_map
        self._saved: list = []

    def __enter__(self) -> "AttentionProbe":
        explicit = self._diff if self.differential else self._transformer
        for index, layer in enumerate(self.model.layers):
            self._saved.append(layer.attn.impl)
            layer.attn.impl = functools.partial(explicit, index)
        return self

    def __exit__(self, *exc) -> None:
        for layer, impl in zip(self.model.layers, self._saved):
            layer.attn.impl = impl
        self._saved = []

    def _observe(self, layer, logits, visible, amap) -> None:
        if self.on_logits is not None:
            self.on_logits(layer, logits, visible)
        if self.on_map is not None:
            self.on_map(layer, amap)

    def _diff(self, layer, query, key, value, lambda_full, norm_weight, attrs, key_mask=None):
        s1, s2, visible, diff_map, v = reference.explicit_diff_maps(query, key, value, lambda_full, attrs, self.quant,
                                                                    key_mask)
        self._observe(layer, [s1, s2], visible, diff_map)
        return reference.finish_heads(diff_map @ v, norm_weight, attrs, query.dtype)

    def _transformer(self, layer, q, k, v, *, causal: bool, scale: float):
        visible = reference.causal_mask(q.shape[2], k.shape[2], q.device) if causal else None
        s = attention_logits(q, k, scale, visible, self.quant)
        amap = masked_softmax(s, visible)
        self._observe(layer, [s], visible, amap)
        v = v.to(amap.dtype).repeat_interleave(q.shape[1] // k.shape[1], dim=1)
        return (amap @ v).to(q.dtype)
