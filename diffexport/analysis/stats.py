"""Attention-logit and hidden-state magnitudes per layer (the paper's Table 5), on a token stream.

Attention logits are the pre-softmax values scale * q.k of every visible (unmasked) entry of
every head; a DIFF model contributes both maps. Hidden states are the residual stream after each
layer. For each layer and overall: the top-1, 2, 3, 10 and 100 largest magnitudes (exact) and the
median (from a log-spaced histogram: within 1% of the exact value).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from diffexport.analysis.probe import AttentionProbe

TOP_RANKS = (1, 2, 3, 10, 100)
_KEEP = max(TOP_RANKS)
_LOG_MIN, _LOG_MAX, _BINS = -8.0, 8.0, 4096  # 16 decades, 0.9% per bin


class MagnitudeTracker:
    """The largest magnitudes seen (exact) and a histogram of log10 magnitudes (for the median)."""

    def __init__(self):
        self.top = torch.empty(0)
        self.hist = torch.zeros(_BINS, dtype=torch.float64)
        self.count = 0

    def add(self, values: torch.Tensor) -> None:
        values = values.detach().float().abs().flatten()
        if values.numel() == 0:
            return
        if not torch.isfinite(values).all():
            raise ValueError("non-finite values while collecting statistics")
        # Reduced where the values are (a GPU too); only the top-k and the histogram come to the CPU.
        top = values.topk(min(_KEEP, values.numel())).values.cpu()
        self.top = torch.cat([self.top, top]).topk(min(_KEEP, self.top.numel() + top.numel())).values
        logs = values.clamp_min(10 ** _LOG_MIN).log10()
        self.hist += torch.histc(logs, _BINS, _LOG_MIN, _LOG_MAX).double().cpu()
        self.count += values.numel()

    def merge(self, other: "MagnitudeTracker") -> "MagnitudeTracker":
        merged = MagnitudeTracker()
        merged.top = torch.cat([self.top, other.top]).sort(descending=True).values[:_KEEP]
        merged.hist = self.hist + other.hist
        merged.count = self.count + other.count
        return merged

    def rank(self, k: int) -> float:
        """The k-th largest magnitude (NaN when fewer than k were seen)."""
        return float(self.top[k - 1]) if self.top.numel() >= k else math.nan

    def median(self) -> float:
        if self.count == 0:
            return math.nan
        cumulative = self.hist.cumsum(0)
        index = int(torch.searchsorted(cumulative, torch.tensor(self.count / 2, dtype=torch.float64)))
        width = (_LOG_MAX - _LOG_MIN) / _BINS
        return 10 ** (_LOG_MIN + (index + 0.5) * width)  # bin centre (geometric)

    def summary(self) -> dict[str, float]:
        out = {f"top{k}": self.rank(k) for k in TOP_RANKS}
        out["median"] = self.median()
        out["count"] = self.count
        return out


@dataclass
class MagnitudeStats:
    logits: list[MagnitudeTracker]  # per layer
    hidden: list[MagnitudeTracker]
    tokens: int

    def overall(self, kind: str) -> MagnitudeTracker:
        trackers = getattr(self, kind)
        total = trackers[0]
        for t in trackers[1:]:
            total = total.merge(t)
        return total

    def to_dict(self) -> dict:
        return {
            "tokens": self.tokens,
            "attention_logits": {"overall": self.overall("logits").summary(),
                                 "layers": [t.summary() for t in self.logits]},
            "hidden_states": {"overall": self.overall("hidden").summary(),
                              "layers": [t.summary() for t in self.hidden]},
        }


@torch.no_grad()
def collect(model, batches, progress=None) -> MagnitudeStats:
    """Run `model` on each input_ids batch [B, T] and gather the magnitudes."""

    n_layers = len(model.layers)
    logits = [MagnitudeTracker() for _ in range(n_layers)]
    hidden = [MagnitudeTracker() for _ in range(n_layers)]

    def on_logits(layer, maps, visible):
        for s in maps:
            logits[layer].add(s[..., visible] if visible is not None else s)

    hooks = [layer.register_forward_hook(lambda mod, inp, out, i=i: hidden[i].add(out[0]))  # (x, cache)
             for i, layer in enumerate(model.layers)]
    tokens = 0
    device = next(model.parameters()).device
    try:
        with AttentionProbe(model, on_logits=on_logits):
            for done, input_ids in enumerate(batches):
                model(input_ids.to(device))
                tokens += input_ids.numel()
                if progress is not None:
                    progress(done + 1)
    finally:
        for hook in hooks:
            hook.remove()
    return MagnitudeStats(logits, hidden, tokens)


def render(named: dict[str, MagnitudeStats]) -> str:
    """The text table: one block per model, a row per layer and an overall row, logits then hidden states."""
    cols = [f"top-{k}" for k in TOP_RANKS] + ["median"]
    lines = []
    for name, stats in named.items():
        for kind, title in (("logits", "attention logits"), ("hidden", "hidden states")):
            lines.append(f"{name}: {title} |x| over {stats.tokens:,} tokens")
            lines.append(f"  {'layer':>7s} " + " ".join(f"{c:>9s}" for c in cols))
            rows = [(str(i), t) for i, t in enumerate(getattr(stats, kind))] + [("all", stats.overall(kind))]
            for label, tracker in rows:
                s = tracker.summary()
                values = [s[f"top{k}"] for k in TOP_RANKS] + [s["median"]]
                lines.append(f"  {label:>7s} " + " ".join(f"{v:9.3g}" for v in values))
        lines.append("")
    return "\n".join(lines).rstrip()
