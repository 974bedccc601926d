"""The documents of a synthetic multi-needle retrieval task: the paper's section 3.4 protocol, scaled down.

A document is filler "sentences" with N needles `NUMBER CITY .` ("NUMBER is the magic number of
CITY") inserted; R of the cities are then asked, `? CITY`, and the model must answer that
city's number as the next token. The first asked
needle sits at a chosen depth (0% = start of the context, 100% = end); the others at random
places. Everything is generated from a seed: no downloads, no tokenizer.

Token ids (the task needs vocab_size >= TASK_VOCAB):
  0 pad, 1 bos, 3 ".", 4 "?"; cities 8..39; numbers 72..103; filler words 200..511.

Only the task's data lives here (training batches, the built-in analysis stream, calibration's
synthetic stream read it); its evaluation on a model is analysis/needles.py.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

import torch

from diffexport.core.errors import DiffExportError

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
        raise DiffExportError(f"no cell to evaluate: every question count ({', '.join(map(str, queries))}) exceeds "
                              "every "
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
    """A batch with random needle counts (R..max_needles), questions R (1..max_queries, one per batch), random
    places."""
    n_queries = rng.randint(1, max_queries)
    samples = [make_sample(rng, context_len, rng.randint(n_queries, max(n_queries, max_needles)), n_queries)
               for _ in range(batch)]
    return collate(samples)
