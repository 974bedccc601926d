"""Token streams for the analysis tools: the user's text, or a built-in synthetic stream.

  text + tokenizer   the text tokenised by a Hugging Face tokenizer (a local folder or hub name)
  text alone         UTF-8 bytes as token ids 0..255 (needs vocab_size >= 256)
  neither            documents of the needle retrieval task when the vocabulary holds the task's
                     tokens (what the trained pair saw), else uniform random token ids (seeded)
Every stream is cut into batches [batch, seq_len] of int64 ids below the model's vocab_size.
"""

from __future__ import annotations

import os
import random
from dataclasses import dataclass
from pathlib import Path

import torch

from diffexport.core.errors import DiffExportError
from diffexport.core.files import read_text_input
from diffexport.core.stoppable import call_bounded, cpu_seconds_for
from diffexport.format.decoder_folder import tokenizer_files
from diffexport.format.tokenizer_rules import tokenizer_library_call
from diffexport.inputs import needle_task
from diffexport.modeling import hub

# A checkpoint's task record for next-token training on a text file's UTF-8 bytes
# (tools/train_tiny.py --text): {"name": TEXT_TASK_NAME, "context_len": tokens per training window, ...}.
TEXT_TASK_NAME = "text"


def task_context_len(task: dict | None, name: str) -> int | None:
    """The context length a checkpoint's task record gives for task `name`, or None (another task,
    none, or a value that is not a positive whole number: a stranger's checkpoint may say anything)."""
    if not isinstance(task, dict) or task.get("name") != name:
        return None
    value = task.get("context_len")
    return value if isinstance(value, int) and not isinstance(value, bool) and 0 < value <= MAX_STREAM_SEQ else None


def tokenizer_folder(tokenizer: str) -> Path:
    """The local folder a --tokenizer names, its files held to the rules before any tokenizer library
    reads them: a Hub id becomes its cached snapshot of the allow-listed files (hub.FILES, as for a
    model), a link in the folder is refused unless it is huggingface_hub's own link into that
    repository's blobs/, and tokenizer.json's patterns pass the regular-expression guard. A name that
    is neither a folder here nor a Hub id org/name is refused (transformers would fetch it by itself)."""
    folder = hub.resolve(tokenizer, what="tokenizer")
    if not folder.is_dir():
        raise DiffExportError(f"cannot load tokenizer {tokenizer!r}: it is not a folder here"
                              + ("" if os.path.lexists(folder) else ", nor a Hugging Face Hub id org/name"))
    tokenizer_files(folder)  # the export's rules for a tokenizer folder: links, sizes, the pattern guard
    return folder


def text_ids(path: str, tokenizer: str | None, vocab_size: int) -> list[int]:
    text = read_text_input(path, "text file", "a text file", "give an excerpt")
    if not text.strip():
        raise DiffExportError(f"{path} is empty: give a text file with some content")
    if tokenizer is None:
        if vocab_size < 256:
            raise DiffExportError(f"without --tokenizer the text is read as bytes (ids 0..255), but this model's "
                                  f"vocabulary has only {vocab_size} tokens; give --tokenizer")
        return list(text.encode("utf-8"))
    try:
        from transformers import AutoTokenizer
    except ImportError:
        raise DiffExportError("--tokenizer needs transformers: pip install 'diffexport[hf]'") from None
    folder = tokenizer_folder(tokenizer)
    try:
        with tokenizer_library_call(f"loading tokenizer {tokenizer!r}"):
            tok = AutoTokenizer.from_pretrained(str(folder), trust_remote_code=False)  # a folder's own code never runs
    except DiffExportError:
        raise
    except Exception as exc:  # transformers raises many types for missing/bad tokenizers
        raise DiffExportError(f"cannot load tokenizer {tokenizer!r}: {str(exc).splitlines()[0]}") from None
    what = f"tokenizing {path} with {tokenizer!r}"
    try:  # in a child under a CPU-time limit: a tokenizer's patterns can backtrack for minutes (stoppable.py)
        ids = call_bounded(_hf_encode, tok, text, what, cpu_seconds=cpu_seconds_for(len(text)), what=what)
    except DiffExportError:
        raise
    except Exception as exc:  # a tokenizer's own errors on this text
        why = str(exc).splitlines()[0][:160]
        raise DiffExportError(f"tokenizer {tokenizer!r} cannot tokenize {path}: {why}") from None
    too_big = [i for i in ids if i >= vocab_size]
    if too_big:
        raise DiffExportError(f"tokenizer {tokenizer!r} gives ids up to {max(too_big)}, beyond this model's "
                              f"vocabulary of {vocab_size}: it is not this model's tokenizer")
    return ids


def _hf_encode(tok, text: str, what: str) -> list[int]:
    with tokenizer_library_call(what):
        return list(tok(text, add_special_tokens=False)["input_ids"])


def synthetic_ids(vocab_size: int, n_tokens: int, seq_len: int, seed: int) -> tuple[list[int], list[bool] | None, str]:
    """(ids, answer flags or None, description) of the built-in stream.

    With needle-task documents, flags[i] is True where the next token is an answer.
    """

    rng = random.Random(seed)
    context = needle_task.stream_context_len(seq_len)  # one document with up to two questions per sequence
    if vocab_size >= needle_task.TASK_VOCAB and context >= 2 * needle_task.NEEDLE_LEN:  # room for two asked needles
        ids: list[int] = []
        flags: list[bool] = []
        while len(ids) < n_tokens:
            n_queries = rng.randint(1, 2)
            n_needles = rng.randint(n_queries, min(6, max(n_queries, context // needle_task.NEEDLE_LEN)))
            sample = needle_task.make_sample(rng, context, n_needles, n_queries)
            answer_at = set(sample.answer_positions)
            ids += (sample.tokens + [needle_task.PAD] * seq_len)[:seq_len]
            flags += [i in answer_at for i in range(seq_len)]
        return ids[:n_tokens], flags[:n_tokens], "needle-task documents"
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(0, vocab_size, (n_tokens,), generator=gen).tolist(), None, "uniform random token ids"


def batches(ids: list[int], seq_len: int, batch: int, max_tokens: int | None = None) -> list[torch.Tensor]:
    """Cut ids into [batch, seq_len] tensors (the last batch may hold fewer sequences)."""
    if seq_len < 1 or batch < 1 or (max_tokens is not None and max_tokens < 1):
        raise DiffExportError("--tokens, --seq-len and --batch must be positive")
    if max_tokens is not None:
        ids = ids[:max_tokens]
    n_seqs = len(ids) // seq_len
    if n_seqs == 0:
        raise DiffExportError(f"the stream has {len(ids)} tokens, fewer than one sequence of {seq_len}: "
                              f"give more text or a smaller --seq-len")
    data = torch.tensor(ids[: n_seqs * seq_len], dtype=torch.long).view(n_seqs, seq_len)
    return list(data.split(batch))


@dataclass
class TokenStream:
    batches: list[torch.Tensor]  # [batch, seq_len] int64 each
    answer_masks: list[torch.Tensor] | None  # same shapes, True where the next token is a task answer
    source: str

    @property
    def tokens(self) -> int:
        return sum(b.numel() for b in self.batches)


MAX_STREAM_TOKENS = 1 << 22  # the analyses' defaults are 8,192 and 16,384 tokens
MAX_STREAM_SEQ = 16384  # the eager attention maps of one sequence grow with its square
MAX_STREAM_BATCH = 1024


def check_stream(tokens: int, seq_len: int, batch: int) -> None:
    """The analyses' --tokens, --seq-len and --batch, before any model runs or any id is drawn (a
    slip such as --tokens 10**12 otherwise runs without end)."""
    for flag, value, low, high in (("--tokens", tokens, 1, MAX_STREAM_TOKENS),
                                   ("--seq-len", seq_len, 2, MAX_STREAM_SEQ), ("--batch", batch, 1, MAX_STREAM_BATCH)):
        if isinstance(value, bool) or not isinstance(value, int) or not low <= value <= high:
            raise DiffExportError(f"{flag} must be {low:,} to {high:,}, got {value}")


def stream_batches(vocab_size: int, *, text: str | None, tokenizer: str | None, tokens: int, seq_len: int,
                   batch: int, seed: int) -> TokenStream:
    check_stream(tokens, seq_len, batch)
    flags = None
    if text is not None:
        ids = text_ids(text, tokenizer, vocab_size)
        source = f"{text} ({'tokenizer ' + tokenizer if tokenizer else 'UTF-8 bytes'})"
    else:
        ids, flags, source = synthetic_ids(vocab_size, tokens, seq_len, seed)
    cut = batches(ids, seq_len, batch, tokens)
    masks = None
    if flags is not None:
        masks = [m.bool() for m in batches([int(f) for f in flags], seq_len, batch, tokens)]
    return TokenStream(cut, masks, source)
