"""Eager generation with a KV cache: the reference every exported decoder is checked against.

`generate(model, ids, ...)` runs one prefill over the prompt, then one token per step against
the cache (DecoderLM.forward with past_key_values), for every family: DIFF V1, V2 (and HF
DiffLlama imports, which load as V1) and the baseline Transformer. Left-padded batches come
with an attention_mask; greedy decoding reproduces transformers' `generate(do_sample=False)`
for imported DiffLlama checkpoints (tests/test_generation.py).

Sampling follows the usual order: temperature, then top-k, then top-p (nucleus), then a draw
from a seeded torch.Generator. A repetition penalty comes before all of it, greedy included, as
transformers and onnxruntime-genai apply it: every distinct id a row already holds (its prompt,
padding left out, and its new tokens) has its logit multiplied by the penalty when negative and
divided by it otherwise.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Callable

import torch

from diffexport.core.errors import DiffExportError

MAX_SEED = 2**31 - 1


@dataclasses.dataclass
class Sampling:
    """How the next token is chosen. greedy=True ignores temperature, top-k, top-p and seed; the
    repetition penalty applies either way."""

    greedy: bool = True
    temperature: float = 1.0
    top_k: int = 0  # 0: no top-k cut
    top_p: float = 1.0  # 1.0: no nucleus cut
    seed: int = 0
    repetition_penalty: float = 1.0  # 1.0: none; > 1 makes tokens already seen less likely

    def __post_init__(self) -> None:
        penalty = self.repetition_penalty
        if isinstance(penalty, bool) or not isinstance(penalty, (int, float)) or not math.isfinite(penalty) \
                or penalty <= 0:
            raise DiffExportError(f"repetition penalty must be a finite number > 0, got {penalty!r}")
        if not self.greedy:
            if not self.temperature > 0:
                raise DiffExportError(f"temperature must be > 0, got {self.temperature}")
            if self.top_k < 0:
                raise DiffExportError(f"top-k must be >= 0, got {self.top_k}")
            if not 0 < self.top_p <= 1:
                raise DiffExportError(f"top-p must be in (0, 1], got {self.top_p}")
            # one rule for every sampled draw (generate and check): onnxruntime-genai reads -1 as "a
            # random seed each run" and takes 32-bit seeds, so the draws are reproducible only here
            seed = self.seed
            if isinstance(seed, bool) or not isinstance(seed, int) or not 0 <= seed <= MAX_SEED:
                raise DiffExportError(f"--seed must be an integer in 0..{MAX_SEED} when sampling (the draws are "
                                      f"seeded, reproducibly), got {seed!r}")


def seen_tokens(ids: torch.Tensor, mask: torch.Tensor | None, vocab_size: int) -> torch.Tensor:
    """[B, T] ids (and their attention mask: padding is not text) -> [B, V] bool, which ids each row
    holds; a repetition penalty reads it, and the caller marks each new token in it."""
    ids = ids.to(torch.int64)
    if mask is not None:
        ids = torch.where(mask.bool(), ids, vocab_size)  # padding lands in a spare column, dropped below
    seen = torch.zeros(ids.shape[0], vocab_size + 1, dtype=torch.bool, device=ids.device)
    return seen.scatter_(1, ids.clamp(0, vocab_size), True)[:, :vocab_size]


def penalize_repeats(logits: torch.Tensor, seen: torch.Tensor, penalty: float) -> torch.Tensor:
    """logits [B, V] with every seen id's logit made less likely: times penalty when negative,
    divided by it otherwise (the CTRL rule, as transformers and onnxruntime-genai compute it, in fp32)."""
    if penalty == 1.0:
        return logits
    penalised = torch.where(logits < 0, logits * penalty, logits / penalty)
    return torch.where(seen, penalised, logits)


def choose_next(logits: torch.Tensor, sampling: Sampling, generator: torch.Generator | None,
                seen: torch.Tensor | None = None) -> torch.Tensor:
    """logits [B, V] (the last position) -> next token ids [B]. seen: seen_tokens' [B, V], needed
    when sampling has a repetition penalty."""
    if sampling.repetition_penalty != 1.0:
        if seen is None:
            raise DiffExportError("a repetition penalty needs the tokens each row has seen")
        logits = penalize_repeats(logits.float(), seen, sampling.repetition_penalty)
    if sampling.greedy:
        return logits.argmax(-1)
    return torch.multinomial(next_token_probs(logits, sampling), 1, generator=generator).squeeze(-1)


def next_token_probs(logits: torch.Tensor, sampling: Sampling) -> torch.Tensor:
    """logits [B, V] (a repetition penalty already applied) -> the distribution a sampled draw
    takes, float32: divided by the temperature, cut to the top k, then to the nucleus top p."""
    scores = logits.float()
    # the best score moved to 0 first: every scaled score is then in [-inf, 0], finite at the best,
    # however small the temperature (1e-45 overflowed the division to inf, and softmax to NaN)
    # (a temperature under float32's least normal number, which float32 would round to 0, divides as that number)
    scores = (scores - scores.amax(-1, keepdim=True)) / max(sampling.temperature, torch.finfo(torch.float32).tiny)
    if sampling.top_k:
        kth = scores.topk(min(sampling.top_k, scores.shape[-1]), dim=-1).values[:, -1:]
        scores = scores.masked_fill(scores < kth, float("-inf"))
    if sampling.top_p < 1:
        sorted_scores, order = scores.sort(dim=-1, descending=True)
        cumulative = sorted_scores.softmax(-1).cumsum(-1)
        drop = cumulative - sorted_scores.softmax(-1) >= sampling.top_p  # keep the token that crosses top_p
        drop[:, 0] = False  # and the most likely one always (a top_p below float32's least, 1e-300, is 0 there)
        scores = scores.scatter(-1, order, sorted_scores.masked_fill(drop, float("-inf")))
    return scores.softmax(-1)


@dataclasses.dataclass
class Generated:
    tokens: torch.Tensor  # [B, new] int64 (pad_token_id after a sequence ended)
    step_logits: list[torch.Tensor]  # per step, [B, V] fp32 logits of the position that chose the token


def left_pad(prompts: list[list[int]], pad_token_id: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """Prompts of different lengths -> (input_ids, attention_mask) [B, T], padded on the left."""
    return pad_batch(prompts, pad_token_id)


def pad_batch(prompts: list[list[int]], pad_token_id: int = 0,
              right_padded: frozenset[int] = frozenset()) -> tuple[torch.Tensor, torch.Tensor]:
    """Prompts of different lengths -> (input_ids, attention_mask) [B, T]: padded on the left, or on
    the right for the rows in right_padded (how onnxruntime-genai pads a batch: the new tokens then
    follow the padding, and the mask has a hole between prompt and answer)."""
    if not prompts or any(len(p) == 0 for p in prompts):
        raise DiffExportError("every prompt needs at least one token")
    width = max(len(p) for p in prompts)
    ids = torch.full((len(prompts), width), pad_token_id, dtype=torch.int64)
    mask = torch.zeros((len(prompts), width), dtype=torch.int64)
    for row, prompt in enumerate(prompts):
        span = slice(0, len(prompt)) if row in right_padded else slice(width - len(prompt), width)
        ids[row, span] = torch.tensor(prompt, dtype=torch.int64)
        mask[row, span] = 1
    return ids, mask


def last_real(mask: torch.Tensor) -> torch.Tensor:
    """[B, T] attention mask -> [B] index of each row's last real token (where its next token is chosen)."""
    return mask.shape[1] - 1 - mask.flip(1).argmax(1)


@torch.no_grad()
def generate(model, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None, *,
             max_new_tokens: int = 32, sampling: Sampling | None = None,
             eos_token_id: int | list[int] | tuple[int, ...] | None = None,
             pad_token_id: int = 0, on_token: Callable[[torch.Tensor], None] | None = None) -> Generated:
    """Prefill input_ids [B, T] (padded when attention_mask says so), then decode with the cache."""
    if max_new_tokens < 1:
        raise DiffExportError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
    sampling = sampling or Sampling()
    generator = None if sampling.greedy else torch.Generator(device=input_ids.device).manual_seed(sampling.seed)
    B = input_ids.shape[0]
    if attention_mask is None:
        attention_mask = torch.ones_like(input_ids)
    past, ids, tokens, step_logits = None, input_ids, [], []
    finished = torch.zeros(B, dtype=torch.bool, device=input_ids.device)
    seen = None
    rows = torch.arange(B, device=input_ids.device)
    for _ in range(max_new_tokens):
        logits, past = model(ids, attention_mask=attention_mask, past_key_values=past, use_cache=True)
        # each row's last real token (a right-padded prompt ends before its padding)
        last = logits[rows, last_real(attention_mask[:, -ids.shape[1]:])].float()
        step_logits.append(last)
        if sampling.repetition_penalty != 1.0 and seen is None:
            seen = seen_tokens(input_ids, attention_mask, last.shape[-1])
        token = choose_next(last, sampling, generator, seen)
        if seen is not None:
            seen[rows, token] = True
        token = token.masked_fill(finished, pad_token_id)
        tokens.append(token)
        if on_token is not None:
            on_token(token)
        if eos_token_id is not None:  # one id, or several (any of them ends a sequence)
            ends = torch.as_tensor(eos_token_id, device=token.device).reshape(-1)
            finished |= torch.isin(token, ends)
            if bool(finished.all()):
                break
        ids = token[:, None]
        attention_mask = torch.cat([attention_mask, torch.ones_like(ids)], dim=1)
    return Generated(torch.stack(tokens, dim=1), step_logits)


class StopText:
    """One row's generated text as its tokens arrive, ended at the first of the stop strings: `push`
    returns the text that can be shown now (a tail that could still begin a stop string is held
    back), `done` says a stop string was completed, `text` is everything before it. No stop
    strings: the text as it comes."""

    def __init__(self, stops: list[str], decode: Callable[[int], str]):
        if any(not isinstance(s, str) or not s for s in stops):
            raise DiffExportError("stop strings must be non-empty text")
        self.stops, self.decode = list(stops), decode
        self.longest = max((len(s) for s in stops), default=1)
        self.buffer, self.shown, self.done = "", 0, False

    def push(self, token: int) -> str:
        if self.done:
            return ""
        start = max(0, len(self.buffer) - self.longest + 1)  # a new match ends in the new text
        self.buffer += self.decode(token)
        hits = [i for i in (self.buffer.find(s, start) for s in self.stops) if i >= 0]
        if hits:
            self.done = True
            self.buffer = self.buffer[:min(hits)]
            return self._release(len(self.buffer))
        held = next((n for n in range(min(self.longest - 1, len(self.buffer)), 0, -1)
                     if any(s.startswith(self.buffer[-n:]) for s in self.stops)), 0)
        return self._release(len(self.buffer) - held)

    def flush(self) -> str:
        """The held-back tail, once generation has ended without a stop string."""
        return self._release(len(self.buffer))

    @property
    def text(self) -> str:
        return self.buffer

    def _release(self, upto: int) -> str:
        out, self.shown = self.buffer[self.shown:max(upto, self.shown)], max(upto, self.shown)
        return out


MAX_BEAMS = 256  # searches run 1 to 64 beams; 10**5 beams ran past 2 minutes on a tiny model


@dataclasses.dataclass
class BeamSearch:
    """Beam search as onnxruntime-genai runs it (the folders' runtime), so the eager reference and
    the deployed folder pick the same beams. A finished hypothesis scores sum(log p) / L^penalty
    with L its whole length, prompt included, its end token left out (transformers >= 4.4x counts
    only the new tokens, so the two rank finished beams alike only at length_penalty 0 or when no
    beam ends early). early_stopping: stop once num_beams hypotheses have ended; otherwise also
    wait while the best running beam could still beat the worst ended one."""

    num_beams: int
    num_return_sequences: int = 1
    length_penalty: float = 1.0
    early_stopping: bool = True

    def __post_init__(self) -> None:
        for name in ("num_beams", "num_return_sequences"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= MAX_BEAMS:
                raise DiffExportError(f"{name.replace('_', ' ')} must be an integer in 1..{MAX_BEAMS}, got {value!r}")
        if self.num_return_sequences > self.num_beams:
            raise DiffExportError(f"{self.num_return_sequences} sequences to return need at least as many beams, "
                                  f"got {self.num_beams}")
        penalty = self.length_penalty
        if isinstance(penalty, bool) or not isinstance(penalty, (int, float)) or not math.isfinite(penalty):
            raise DiffExportError(f"length penalty must be a finite number, got {penalty!r}")


@dataclasses.dataclass
class Hypothesis:
    tokens: list[int]  # the new tokens, the end token left out
    score: float  # sum of log-probabilities / (prompt + new tokens) ** length_penalty
    stop: str  # "eos" or "length"


class _Hypotheses:
    """The best `size` ended hypotheses, best first (a new one enters only if it beats the worst)."""

    def __init__(self, size: int, length_penalty: float):
        self.size, self.length_penalty, self.items = size, length_penalty, []

    def add(self, tokens: list[int], sum_logprobs: float, length: int, stop: str) -> None:
        score = sum_logprobs / float(length) ** self.length_penalty
        if len(self.items) == self.size and score <= self.items[-1].score:
            return
        at = next((i for i, h in enumerate(self.items) if score > h.score), len(self.items))
        self.items.insert(at, Hypothesis(tokens, score, stop))
        del self.items[self.size:]

    def can_improve(self, best_sum_logprobs: float, length: int) -> bool:
        return self.items[-1].score < best_sum_logprobs / float(length) ** self.length_penalty


def search_beams(step: Callable[[list[list[int]], list[int] | None], torch.Tensor], prompt: list[int],
                 search: BeamSearch, max_new_tokens: int, eos_token_id=None) -> list[Hypothesis]:
    """The search, for any runtime: step(ids, order) reorders the runtime's cache rows by `order`
    (the source beam of each row; None on the first call, where ids are num_beams copies of the
    prompt), runs ids [num_beams, t] and returns each row's last-position logits [num_beams, V].
    Each step keeps the 2*num_beams best (beam, token) pairs of sum(log p), ends those of the first
    num_beams that pick an end token and continues the first num_beams others."""
    if max_new_tokens < 1:
        raise DiffExportError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
    if not prompt:
        raise DiffExportError("the prompt needs at least one token")
    beams = search.num_beams
    ends = set() if eos_token_id is None else set(torch.as_tensor(eos_token_id).reshape(-1).tolist())
    ended = _Hypotheses(beams, search.length_penalty)
    sums = torch.full((beams,), -1e9, dtype=torch.float32)
    sums[0] = 0.0  # identical rows: only the first may start, or every beam would pick the same tokens
    new = [[] for _ in range(beams)]
    length, done = len(prompt), False
    logits = step([list(prompt) for _ in range(beams)], None)
    while True:
        scores = torch.log_softmax(logits.float().cpu(), dim=-1) + sums[:, None]
        vocab = scores.shape[-1]
        top, where = scores.reshape(-1).topk(2 * beams)
        kept = []  # (sum of log p, token, source beam)
        for rank, (score, index) in enumerate(zip(top.tolist(), where.tolist())):
            token, source = index % vocab, index // vocab
            if token in ends:
                if rank < beams:
                    ended.add(list(new[source]), score, length, "eos")
            else:
                kept.append((score, token, source))
            if len(kept) == beams:
                break
        if len(kept) < beams:  # more end ids than 2*num_beams - num_beams candidates can spare
            raise DiffExportError(f"{len(ends)} end ids leave fewer than {beams} running beams: use more beams")
        if len(ended.items) == beams and (search.early_stopping or not ended.can_improve(max(top.tolist()), length)):
            done = True
            break
        new = [new[source] + [token] for _, token, source in kept]
        sums = torch.tensor([score for score, _, _ in kept], dtype=torch.float32)
        length += 1
        if length - len(prompt) >= max_new_tokens:
            break
        logits = step([[token] for _, token, _ in kept], [source for _, _, source in kept])
    if not done:  # the length limit: the running beams join the ended ones
        for row in range(beams):
            ended.add(new[row], float(sums[row]), length, "length")
    return ended.items[:search.num_return_sequences]


@torch.no_grad()
def hypothesis_score(model, prompt: list[int], hypothesis: list[int], stop: str, length_penalty: float,
                     eos_token_id: int | list[int] | tuple[int, ...] | None = None) -> float:
    """What the model scores a hypothesis as search_beams does, in one pass without a cache:
    sum(log p) of its tokens (and of its likeliest end id when it ended on one) / length^penalty,
    the length counting the prompt. `check` rescores a runtime's beams with it where they part
    from the reference's."""
    device = next(model.parameters()).device
    ids = torch.tensor([list(prompt) + list(hypothesis)], dtype=torch.int64, device=device)
    logits, _ = model(ids, attention_mask=torch.ones_like(ids), use_cache=True)
    logp = torch.log_softmax(logits[0].float(), dim=-1)
    total = float(logp[len(prompt) - 1:-1].gather(1, ids[0, len(prompt):, None]).sum()) if hypothesis else 0.0
    if stop == "eos":
        if eos_token_id is None:
            raise DiffExportError("a hypothesis that ended on an end id needs the end ids to be scored")
        ends = torch.as_tensor(eos_token_id, device=device).reshape(-1)
        total += float(logp[-1, ends].max())
    return total / float(len(prompt) + len(hypothesis)) ** length_penalty


@torch.no_grad()
def beam_search(model, prompt: list[int], search: BeamSearch, max_new_tokens: int,
                eos_token_id: int | list[int] | tuple[int, ...] | None = None) -> list[Hypothesis]:
    """One prompt's best `search.num_return_sequences` hypotheses, best first, from the eager model:
    the prompt runs once, its cache is copied to every beam, and each step reorders the rows."""
    device = next(model.parameters()).device
    state = {}

    def step(ids: list[list[int]], order: list[int] | None) -> torch.Tensor:
        rows = ids[:1] if order is None else ids
        if order is not None and order != list(range(len(order))):  # rows as the beams (unchanged: no copy)
            index = torch.tensor(order, device=device)
            state["past"] = [tuple(t.index_select(0, index) for t in layer) for layer in state["past"]]
        tokens = torch.tensor(rows, dtype=torch.int64, device=device)
        state["mask"] = torch.ones_like(tokens) if order is None else \
            torch.cat([state["mask"], torch.ones_like(tokens)], dim=1)
        logits, state["past"] = model(tokens, attention_mask=state["mask"], past_key_values=state.get("past"),
                                      use_cache=True)
        if order is None:  # one prompt run, its cache copied to every beam
            copies = torch.zeros(len(ids), dtype=torch.int64, device=device)
            state["past"] = [tuple(t.index_select(0, copies) for t in layer) for layer in state["past"]]
            state["mask"] = state["mask"].expand(len(ids), -1)
            return logits[:, -1].float().expand(len(ids), -1)
        return logits[:, -1].float()

    return search_beams(step, prompt, search, max_new_tokens, eos_token_id)
