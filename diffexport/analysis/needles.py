"""The multi-needle retrieval task evaluated on a model: accuracy and attention per (needles,
questions, depth) cell, the attention profile over the document, and the text report. The task's
documents are inputs/needle_task.py.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field

import torch

from diffexport.analysis.fused import REFERENCE
from diffexport.analysis.probe import AttentionProbe
from diffexport.core.errors import DiffExportError
from diffexport.inputs.needle_task import (
    DEFAULT_DEPTHS,
    DEFAULT_NEEDLES,
    DEFAULT_QUERIES,
    Sample,
    check_vocab,
    collate,
    grid,
    make_sample,
)


@dataclass
class CellResult:
    n_needles: int
    n_queries: int
    depth: float
    accuracy: float
    answer_attention: float  # attention mass on the asked needle, from the question (mean of layers, heads)
    noise_attention: float  # attention mass on the rest of the document
    per_layer_answer: list[float] = field(default_factory=list)
    per_layer_noise: list[float] = field(default_factory=list)


@dataclass
class RetrievalResult:
    context_len: int
    samples: int
    cells: list[CellResult]
    profiles: dict[float, list[float]]  # depth -> mean attention over document positions (last layer, binned)

    def accuracy(self) -> float:
        return sum(c.accuracy for c in self.cells) / len(self.cells)

    def by_depth(self) -> dict[float, tuple[float, float, float]]:
        """depth -> (accuracy, answer attention, noise attention), averaged over (N, R)."""
        out = {}
        for depth in sorted({c.depth for c in self.cells}):
            cells = [c for c in self.cells if c.depth == depth]
            out[depth] = tuple(sum(getattr(c, k) for c in cells) / len(cells)
                               for k in ("accuracy", "answer_attention", "noise_attention"))
        return out


PROFILE_BINS = 32


def _cells(needles, queries, depths, context_len: int, samples: int, seed: int):
    """(N, R, depth, documents) for every cell of the grid: fresh seeded documents, the same for a
    given seed whatever runs them."""
    rng = random.Random(seed)
    for n, r, depth in grid(needles, queries, depths):
        yield n, r, depth, [make_sample(rng, context_len, n, r, depth) for _ in range(samples)]


def _answer_accuracy(logits: torch.Tensor, batch: list[Sample]) -> float:
    """Share of asked cities whose next-token argmax is the needle's number."""
    index = torch.tensor([s.answer_positions for s in batch], device=logits.device)
    predicted = logits.gather(1, index[:, :, None].expand(-1, -1, logits.shape[-1])).argmax(-1)
    expected = torch.tensor([s.answers for s in batch], device=logits.device)
    return (predicted == expected).float().mean().item()


def _check(model, samples: int) -> torch.device:
    check_vocab(model.config.vocab_size)
    if samples < 1:
        raise DiffExportError(f"samples per cell must be at least 1, got {samples}")
    model.eval()
    return next(model.parameters()).device


@torch.no_grad()
def accuracy(model, *, needles=DEFAULT_NEEDLES, queries=DEFAULT_QUERIES, depths=DEFAULT_DEPTHS,
             context_len: int = 128, samples: int = 32, seed: int = 1234, quant=None, attention=None,
             progress=None) -> float:
    """Mean accuracy over the grid's cells: evaluate()'s accuracy on the same documents, with
    `attention` (diffexport.analysis.fused.Attention: the torch reference by default, or the fused
    kernel, which has no maps to observe) running the quantised logits."""

    device = _check(model, samples)
    attention = attention or REFERENCE
    scores, total = [], len(grid(needles, queries, depths))
    for _, _, _, batch in _cells(needles, queries, depths, context_len, samples, seed):
        with attention(model, quant):
            logits = model(collate(batch)[0].to(device))
        scores.append(_answer_accuracy(logits, batch))
        if progress is not None:
            progress(len(scores), total)
    return sum(scores) / len(scores)


@torch.no_grad()
def evaluate(model, *, needles=DEFAULT_NEEDLES, queries=DEFAULT_QUERIES, depths=DEFAULT_DEPTHS,
             context_len: int = 128, samples: int = 32, seed: int = 1234, quant=None,
             progress=None) -> RetrievalResult:
    """Accuracy and attention allocation per (N, R, depth), on fresh seeded documents.

    The attention of one query is the row of the effective map at its asked CITY position (softmax for a
    Transformer, A1 - lambda*A2 for DIFF), summed over the asked needle's 3 tokens (answer) and over
    the rest of the document (noise), averaged over heads and layers. A Transformer row sums to 1,
    a DIFF V1 row to 1 - lambda.
    """

    device = _check(model, samples)
    cells: list[CellResult] = []
    profile_sums: dict[float, torch.Tensor] = {}
    profile_counts: dict[float, int] = {}
    total = len(grid(needles, queries, depths))
    for done, (n, r, depth, batch) in enumerate(_cells(needles, queries, depths, context_len, samples, seed)):
        rows: dict[int, torch.Tensor] = {}
        index = torch.tensor([s.answer_positions for s in batch])

        def keep_rows(layer, amap, index=index.to(device), rows=rows):
            # amap [B, heads, T, T] -> the question rows [B, R, T], averaged over heads (kept on the CPU)
            picked = amap.float().mean(1).gather(1, index[:, :, None].expand(-1, -1, amap.shape[-1]))
            rows[layer] = picked.cpu()

        input_ids, _ = collate(batch)
        with AttentionProbe(model, quant=quant, on_map=keep_rows):
            logits = model(input_ids.to(device))
        accuracy = _answer_accuracy(logits, batch)

        answer_mask = torch.zeros(len(batch), r, input_ids.shape[1], dtype=torch.bool)
        doc_mask = torch.zeros_like(answer_mask)
        for b, s in enumerate(batch):
            doc_mask[b, :, s.context[0]:s.context[1]] = True
            for q, (start, end) in enumerate(s.answer_spans):
                answer_mask[b, q, start:end] = True
        noise_mask = doc_mask & ~answer_mask
        per_answer = [(rows[layer] * answer_mask).sum(-1).mean().item() for layer in sorted(rows)]
        per_noise = [(rows[layer] * noise_mask).sum(-1).mean().item() for layer in sorted(rows)]
        cells.append(CellResult(n, r, float(depth), accuracy, sum(per_answer) / len(per_answer),
                                sum(per_noise) / len(per_noise), per_answer, per_noise))

        last = rows[max(rows)][:, 0, 1:1 + context_len]  # first query's row over the document [B, ctx]
        binned = torch.nn.functional.adaptive_avg_pool1d(last[:, None, :], PROFILE_BINS)[:, 0].mean(0)
        profile_sums[float(depth)] = profile_sums.get(float(depth), 0) + binned
        profile_counts[float(depth)] = profile_counts.get(float(depth), 0) + 1
        if progress is not None:
            progress(done + 1, total)
    profiles = {d: (profile_sums[d] / profile_counts[d]).tolist() for d in sorted(profile_sums)}
    return RetrievalResult(context_len, samples, cells, profiles)


def render(named: dict[str, RetrievalResult], describe: str) -> str:
    """Accuracy per (N, R) and depth, then accuracy and attention allocation per depth (the paper's Table 3)."""
    lines = [f"multi-needle retrieval (attention logits {describe})"]
    for name, result in named.items():
        depths = sorted({c.depth for c in result.cells})
        lines.append(f"{name}: {result.context_len}-token documents, {result.samples} per cell, "
                     f"mean accuracy {result.accuracy():.3f}")
        lines.append("  accuracy  " + " ".join(f"{f'depth {d:g}%':>10s}" for d in depths))
        for n, r in sorted({(c.n_needles, c.n_queries) for c in result.cells}):
            row = {c.depth: c.accuracy for c in result.cells if (c.n_needles, c.n_queries) == (n, r)}
            lines.append(f"  N={n:<2d} R={r:<2d} " + " ".join(f"{row[d]:10.3f}" for d in depths))
        lines.append("  attention from the question (mean of layers and heads):")
        lines.append(f"  {'depth':>8s} {'accuracy':>9s} {'answer':>9s} {'noise':>9s}")
        for depth, (acc, answer, noise) in result.by_depth().items():
            lines.append(f"  {depth:7g}% {acc:9.3f} {answer:9.3f} {noise:9.3f}")
        lines.append("")
    return "\n".join(lines).rstrip()
