"""A synthetic multi-needle retrieval task: the paper's section 3.4 protocol, scaled down.

A document is filler "sentences" with N needles `NUMBER CITY .` ("NUMBER is the magic number of
CITY") inserted; R of the cities are then asked, `? CITY`, and the model must answer that
city's number as the next token. The first asked
needle sits at a chosen depth (0% = start of the context, 100% = end); the others at random
places. Everything is generated from a seed: no downloads, no tokenizer.

Token ids (the task needs vocab_size >= TASK_VOCAB):
  0 pad, 1 bos, 3 ".", 4 "?"; cities 8..39; numbers 72..103; filler words 200..511.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field

import torch

from diffexport.errors import DiffExportError

PAD, BOS, DOT, ASK = 0, 1, 3, 4
CITY_FIRST, N_CITIES = 8, 32  # ids 8..71 are reserved for cities, 32 in use
NUMBER_FIRST, N_NUMBERS = 72, 32  # ids 72..199 are reserved for numbers, 32 in use (chance 1/32)
FILLER_FIRST, N_FILLER = 200, 312
TASK_VOCAB = FILLER_FIRST + N_FILLER  # 512
NEEDLE_LEN = 3  # CITY NUMBER .
QUERY_LEN = 3  # ? CITY NUMBER
TASK_NAME = "needles"


@dataclass
class Sample:
    tokens: list[int]
    answer_positions: list[int]  # positions whose next-token prediction is an answer (the asked CITY tokens)
    answers: list[int]  # the number tokens expected there
    answer_spans: list[tuple[int, int]]  # [start, end) of each asked needle in the document
    context: tuple[int, int]  # [start, end) of the document (needles + filler)
    n_needles: int
    depth: float | None = None


def check_vocab(vocab_size: int) -> None:
    if vocab_size < TASK_VOCAB:
        raise DiffExportError(f"the needle task needs a model vocabulary of at least {TASK_VOCAB} tokens, "
                              f"this model has {vocab_size}")


def _filler(rng: random.Random, length: int) -> list[int]:
    """Filler "sentences": 3-9 random words then '.', cut to `length` tokens."""
    out: list[int] = []
    while len(out) < length:
        out += [FILLER_FIRST + rng.randrange(N_FILLER) for _ in range(rng.randint(3, 9))] + [DOT]
    return out[:length]


def make_sample(rng: random.Random, context_len: int, n_needles: int, n_queries: int,
                depth: float | None = None) -> Sample:
    """One document of exactly `context_len` tokens (needles included) and its R questions.

    depth (0..100) places the first asked needle; None places every needle at random.
    """
    if not 1 <= n_queries <= n_needles <= N_CITIES:
        raise DiffExportError(f"need 1 <= queries ({n_queries}) <= needles ({n_needles}) <= {N_CITIES}")
    if depth is not None and not 0 <= depth <= 100:
        raise DiffExportError(f"needle depth must be a percentage from 0 to 100, got {depth:g}")
    n_filler = context_len - NEEDLE_LEN * n_needles
    if n_filler < 0:
        raise DiffExportError(f"context of {context_len} tokens cannot hold {n_needles} needles "
                              f"({NEEDLE_LEN} tokens each)")
    cities = rng.sample(range(N_CITIES), n_needles)
    numbers = rng.sample(range(N_NUMBERS), n_needles)
    filler = _filler(rng, n_filler)
    # insertion points into the filler; ties keep needle order
    slots = [rng.randint(0, n_filler) for _ in range(n_needles)]
    if depth is not None:
        slots[0] = round(depth / 100 * n_filler)
    order = sorted(range(n_needles), key=lambda i: (slots[i], i))
    doc: list[int] = []
    starts: dict[int, int] = {}
    cursor = 0
    for i in order:
        doc += filler[cursor:slots[i]]
        cursor = slots[i]
        starts[i] = 1 + len(doc)  # +1: BOS comes first
        doc += [NUMBER_FIRST + numbers[i], CITY_FIRST + cities[i], DOT]
    doc += filler[cursor:]
    tokens = [BOS] + doc
    positions, answers, spans = [], [], []
    for i in range(n_queries):  # the first n_queries needles are the asked ones (cities are random)
        tokens += [ASK, CITY_FIRST + cities[i]]
        positions.append(len(tokens) - 1)
        answers.append(NUMBER_FIRST + numbers[i])
        tokens.append(NUMBER_FIRST + numbers[i])
        spans.append((starts[i], starts[i] + NEEDLE_LEN))
    return Sample(tokens, positions, answers, spans, (1, 1 + context_len), n_needles, depth)


def stream_sequence_len(context_len: int) -> int:
    """Tokens of one packed sequence of the built-in stream: BOS, the document, up to two questions."""
    return 1 + context_len + 2 * QUERY_LEN


def stream_context_len(seq_len: int) -> int:
    """The document length that fills a packed sequence of `seq_len` tokens (inverse of the above)."""
    return seq_len - 1 - 2 * QUERY_LEN


DEFAULT_NEEDLES, DEFAULT_QUERIES, DEFAULT_DEPTHS = (1, 2, 4, 6), (1, 2), (0, 25, 50, 75, 100)


def grid(needles, queries, depths) -> list[tuple[int, int, float]]:
    """The evaluated (N, R, depth) cells: every R <= N. Counts outside 1..32 and a grid with no cell
    (every R above every N, or no depth) are refused."""
    bad = [v for v in (*needles, *queries) if not 1 <= v <= N_CITIES]
    if bad:
        raise DiffExportError(f"needle and question counts must be in 1..{N_CITIES}, got {bad[0]}")
    cells = [(n, r, d) for n in needles for r in queries if r <= n for d in depths]
    if not cells:
        raise DiffExportError(f"no cell to evaluate: every question count ({', '.join(map(str, queries))}) exceeds every "
                              f"needle count ({', '.join(map(str, needles))}), or no depth was given")
    return cells


def collate(samples: list[Sample]):
    """(input_ids [B, T-1], targets [B, T-1] with -100 outside answers); samples must share a length."""
    if len({len(s.tokens) for s in samples}) != 1:
        raise DiffExportError("samples of one batch must have the same length")
    tokens = torch.tensor([s.tokens for s in samples], dtype=torch.long)
    targets = torch.full_like(tokens[:, 1:], -100)
    for b, s in enumerate(samples):
        for pos, ans in zip(s.answer_positions, s.answers):
            targets[b, pos] = ans
    return tokens[:, :-1], targets


def training_batch(rng: random.Random, batch: int, context_len: int, max_needles: int = 6, max_queries: int = 4):
    """A batch with random needle counts (R..max_needles), questions R (1..max_queries, one per batch), random places."""
    n_queries = rng.randint(1, max_queries)
    samples = [make_sample(rng, context_len, rng.randint(n_queries, max(n_queries, max_needles)), n_queries)
               for _ in range(batch)]
    return collate(samples)


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
    from diffexport.analysis.fused import REFERENCE

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
    from diffexport.analysis.probe import AttentionProbe

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
