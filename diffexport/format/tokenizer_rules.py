"""What a tokenizer.json from a stranger may ask of the tokenizer libraries: regular expressions
(pre-tokenizer Split, normalizer Replace) that cannot backtrack without end on a short text.

The tokenizer libraries (Hugging Face tokenizers, onnxruntime-extensions under onnxruntime-genai)
match these patterns in native code that nothing can interrupt: `(a+)+$` over a 40-character
prompt never finishes. So the patterns are read, before either library opens the file,
and refused where their structure allows exponential backtracking:
- a repeated group that itself holds a repetition of varying count, `(a+)+`, `(?:\\s*x)*` (a fixed
  count, `(\\d{3})+`, cannot split the same text two ways);
- a repeated group that holds an alternation, `(a|aa)+`, whose branches may match the same text;
- a counted repetition above MAX_COUNT, `a{100000}`, and a pattern longer than MAX_PATTERN_CHARS.
"Repeated" is any quantifier that allows more than one match (`*`, `+`, `{n,m}` with m > 1); an
optional group `(...)?` repeats nothing. The patterns of the tokenizers in use (GPT-2, Llama 3,
Qwen2, GPT-4o's) pass: each repeats only single characters and classes (tests/test_tokenizer_rules.py).
What is left is polynomial at worst (`\\s*\\s*$`): a prompt's text is bounded by the context
before it is tokenized (the context's tokens times the longest token's characters), and encoding
runs in a child process under a CPU-time limit (stoppable.call_bounded), where it can be stopped.
"""

from __future__ import annotations

import contextlib
import json
import os
import sys
import tempfile
from pathlib import Path

from diffexport.core.errors import DiffExportError
from diffexport.core.files import is_hub_cache_link

MAX_PATTERN_CHARS = 4096  # the patterns in use are under 300 characters
MAX_COUNT = 1000  # {n,m}: the patterns in use count to 3
# A tokenizer.model (SentencePiece) alone lists no vocabulary we read: its pieces are short (Llama 2's
# longest is 16 characters).
DEFAULT_TOKEN_CHARS = 64
MAX_TOKENIZER_JSON_BYTES = 256 * 1024**2  # as the tokenizer files' bound (export/decoder.py)


def _skip_escape(pattern: str, i: int) -> int:
    """The index after the escape that starts at pattern[i] == '\\'."""
    if i + 1 >= len(pattern):
        return i + 1
    kind = pattern[i + 1]
    if kind in "pPxk" and i + 2 < len(pattern) and pattern[i + 2] == "{":
        end = pattern.find("}", i + 3)
        return len(pattern) if end < 0 else end + 1
    if kind == "u":
        return min(len(pattern), i + 6)
    return i + 2


def _skip_class(pattern: str, i: int) -> int:
    """The index after the character class that starts at pattern[i] == '[' (nested classes too)."""
    depth, i = 1, i + 1
    if i < len(pattern) and pattern[i] == "^":
        i += 1
    if i < len(pattern) and pattern[i] == "]":  # a leading ] is a literal
        i += 1
    while i < len(pattern) and depth:
        char = pattern[i]
        if char == "\\":
            i = _skip_escape(pattern, i)
            continue
        if char == "[":
            depth += 1
        elif char == "]":
            depth -= 1
        i += 1
    return i


def _quantifier(pattern: str, i: int) -> tuple[int, int, float] | None:
    """(index after, the fewest and the most matches it allows) of a quantifier at pattern[i], else None."""
    char = pattern[i]
    if char in "*+":
        least, most = int(char == "+"), float("inf")
        i += 1
    elif char == "?":
        least, most = 0, 1
        i += 1
    elif char == "{":
        end = pattern.find("}", i)
        body = pattern[i + 1:end] if end > 0 else ""
        low, comma, high = body.partition(",")
        if not low.strip().isdigit() or (high.strip() and not high.strip().isdigit()):
            return None  # a literal {
        if int(low) > MAX_COUNT or (high.strip() and int(high) > MAX_COUNT):
            raise _Risk(f"a counted repetition {{{body}}} above {MAX_COUNT}")
        least, most = int(low), float("inf") if comma and not high.strip() else int(high or low)
        i = end + 1
    else:
        return None
    if i < len(pattern) and pattern[i] in "?+":  # lazy or possessive: the same count
        i += 1
    return i, least, most


class _Risk(Exception):
    pass


def regex_risk(pattern: str) -> str | None:
    """Why `pattern` could backtrack without end on a short text (the rules above), or None."""
    if len(pattern) > MAX_PATTERN_CHARS:
        return f"a pattern of {len(pattern)} characters (at most {MAX_PATTERN_CHARS})"
    # one frame per open group: does it hold a repetition, an alternation
    frames = [{"repeats": False, "alternates": False}]
    last_group = None  # the frame of a group that just closed (what a quantifier would repeat)
    i = 0
    try:
        while i < len(pattern):
            char = pattern[i]
            if char == "\\":
                i, last_group = _skip_escape(pattern, i), None
            elif char == "[":
                i, last_group = _skip_class(pattern, i), None
            elif char == "(":
                frames.append({"repeats": False, "alternates": False})
                i, last_group = i + 1, None
                if pattern.startswith("?", i):  # (?:, (?i:, (?=, (?!, (?<=, (?<name>, ...: flags, not atoms
                    i += 1
            elif char == ")":
                if len(frames) == 1:
                    return None  # unbalanced: the library refuses it itself
                last_group = frames.pop()
                frames[-1]["repeats"] |= last_group["repeats"]
                frames[-1]["alternates"] |= last_group["alternates"]
                i += 1
            elif char == "|":
                frames[-1]["alternates"] = True
                i, last_group = i + 1, None
            else:
                found = _quantifier(pattern, i)
                if found is None:
                    i, last_group = i + 1, None
                    continue
                i, least, most = found
                if most > 1:
                    if last_group is not None and last_group["repeats"]:
                        return "a repeated group that holds a repetition, as (a+)+"
                    if last_group is not None and last_group["alternates"]:
                        return "a repeated group that holds an alternation, as (a|aa)+"
                if most > least:  # a count that varies: text it may share with a neighbour's
                    frames[-1]["repeats"] = True
                last_group = None
    except _Risk as risk:
        return str(risk)
    return None


def _patterns(value) -> list[str]:
    """Every {"Regex": pattern} in a tokenizer.json's tree (pre-tokenizers, normalizers, decoders)."""
    found, stack = [], [value]
    while stack:
        item = stack.pop()
        if isinstance(item, dict):
            if isinstance(item.get("Regex"), str):
                found.append(item["Regex"])
            stack.extend(item.values())
        elif isinstance(item, list):
            stack.extend(item)
    return found


def _largest_id(tree) -> int | None:
    """The largest token id a tokenizer.json can give: its model's vocabulary (a token -> id map, or
    Unigram's list of pieces) and its added tokens. None where the file holds neither."""
    ids: list[int] = []
    model = tree.get("model") if isinstance(tree, dict) else None
    vocab = model.get("vocab") if isinstance(model, dict) else None
    if isinstance(vocab, dict):
        ids += [v for v in vocab.values() if isinstance(v, int) and not isinstance(v, bool)]
    elif isinstance(vocab, list) and vocab:
        ids.append(len(vocab) - 1)
    added = tree.get("added_tokens") if isinstance(tree, dict) else None
    if isinstance(added, list):
        ids += [t["id"] for t in added if isinstance(t, dict) and isinstance(t.get("id"), int)
                and not isinstance(t.get("id"), bool)]
    return max(ids) if ids else None


def longest_token_chars(tree) -> int:
    """The most characters one token of a tokenizer.json stands for: its vocabulary's and added
    tokens' longest text (byte-level pieces count a character per byte, so a text's characters are
    at most its tokens times this). DEFAULT_TOKEN_CHARS where the file lists no vocabulary."""
    pieces: list = []
    model = tree.get("model") if isinstance(tree, dict) else None
    vocab = model.get("vocab") if isinstance(model, dict) else None
    if isinstance(vocab, dict):
        pieces += list(vocab)
    elif isinstance(vocab, list):  # Unigram: [piece, score] pairs
        pieces += [p[0] for p in vocab if isinstance(p, list) and p and isinstance(p[0], str)]
    added = tree.get("added_tokens") if isinstance(tree, dict) else None
    if isinstance(added, list):
        pieces += [t["content"] for t in added if isinstance(t, dict) and isinstance(t.get("content"), str)]
    return max((len(p) for p in pieces), default=DEFAULT_TOKEN_CHARS) or 1


def check_tokenizer_json(path: str | Path, vocab_size: int | None = None) -> int:
    """Refuse, in one line, a tokenizer.json whose regular expressions could run without end
    (regex_risk), before a tokenizer library opens it; with vocab_size, one that can give an id at
    or past the model's vocabulary (read from the file, no tokenizer library needed). -> the most
    characters a token stands for (longest_token_chars), which bounds a prompt's text before it is
    tokenized. A missing file passes (nothing to run; DEFAULT_TOKEN_CHARS)."""
    path = Path(path)
    if not path.is_file() or (path.is_symlink() and not is_hub_cache_link(path)):
        return DEFAULT_TOKEN_CHARS  # other links are refused by the tokenizer folder's rules (tokenizer_files)
    if path.stat().st_size > MAX_TOKENIZER_JSON_BYTES:
        raise DiffExportError(f"{path} is larger than {MAX_TOKENIZER_JSON_BYTES >> 20} MiB: not a tokenizer file")
    try:
        tree = json.loads(path.read_bytes())
    except (ValueError, RecursionError) as exc:
        raise DiffExportError(f"{path} is not a readable tokenizer ({str(exc).splitlines()[0][:120]})") from None
    for pattern in _patterns(tree):
        risk = regex_risk(pattern)
        if risk:
            shown = pattern if len(pattern) <= 60 else pattern[:57] + "..."
            raise DiffExportError(f"{path} has a regular expression {shown!r} with {risk}: it could run without end "
                                  "on a short text, so it is not opened (tokenizers of GPT-2, Llama and Qwen have "
                                  "none)")
    largest = _largest_id(tree)
    if vocab_size is not None and largest is not None and largest >= vocab_size:
        raise DiffExportError(f"{path} gives token ids up to {largest}, past the model's vocabulary of {vocab_size}: "
                              "it is not this model's tokenizer")
    return longest_token_chars(tree)


@contextlib.contextmanager
def tokenizer_library_call(what: str):
    """Around a tokenizer library's native code on a stranger's tokenizer (loading it, encoding
    with it): a Rust panic there (pyo3's PanicException, which is no Exception: a TemplateProcessing
    naming a special token it does not list, a truncation stride past its length) becomes one
    DiffExportError line naming `what`, not a traceback. The panic hook's own lines on stderr are
    held back; whatever else the call writes there is passed on after it."""
    sys.stderr.flush()
    saved = os.dup(2)
    panicked = False
    with tempfile.TemporaryFile() as held:
        os.dup2(held.fileno(), 2)
        try:
            yield
        except (KeyboardInterrupt, SystemExit, GeneratorExit, DiffExportError):
            raise
        except BaseException as exc:
            if type(exc).__name__ != "PanicException":
                raise
            panicked = True
            detail = str(exc).splitlines()[0][:160] if str(exc) else "a panic"
            raise DiffExportError(f"{what} failed inside the tokenizers library ({detail}): the tokenizer's files "
                                  "are broken or hostile") from None
        finally:
            sys.stderr.flush()
            os.dup2(saved, 2)
            os.close(saved)
            if not panicked:
                held.seek(0)
                passed_on = held.read()
                if passed_on:
                    sys.stderr.write(passed_on.decode(errors="replace"))
                    sys.stderr.flush()
