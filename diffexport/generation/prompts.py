"""Prompts files for `diffexport generate --prompts-file F`: JSON Lines, one prompt per line.

  {"prompt": "text"}             text, encoded by the folder's tokenizer (--chat: as a user turn)
  {"ids": [1, 2, 3]}             token ids as they are
  either may carry "id": a string or integer of the caller's, given back with the answer, and
  its own limits in place of the command line's:
  "max_new_tokens": 32           this prompt's --max-new-tokens
  "stop": "\n\n" or ["a", "b"]    this prompt's --stop strings (text prompts; [] for none)

Blank lines are skipped. Anything else (another key, both prompt and ids, an empty prompt, ids
outside the vocabulary, a line that is not a JSON object) is refused with its line number before
any prompt runs. The file is read whole, so it is limited in size like the other text inputs.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

from diffexport.core.errors import DiffExportError
from diffexport.core.files import read_text_input

KEYS = frozenset({"prompt", "ids", "id", "max_new_tokens", "stop"})
MAX_STOPS = 16  # stop strings per line, as many as --stop takes in practice and then some


@dataclasses.dataclass
class PromptLine:
    line: int  # 1-based line number in the file
    text: str | None  # exactly one of text and ids
    ids: list[int] | None
    id: str | int | None = None  # the caller's own id, given back
    max_new_tokens: int | None = None  # None: the command line's
    stop: list[str] | None = None  # None: the command line's; [] none at all


def read_prompts(path: str | Path, vocab_size: int) -> list[PromptLine]:
    lines = read_text_input(path, "prompts file", "a JSON Lines file of prompts", "split it").splitlines()
    prompts = [_parse(number, text, vocab_size, path) for number, text in enumerate(lines, 1) if text.strip()]
    if not prompts:
        raise DiffExportError(f"{path} holds no prompt: one JSON object per line, "
                              '{"prompt": "text"} or {"ids": [1, 2, 3]}')
    return prompts


def _parse(number: int, text: str, vocab_size: int, path) -> PromptLine:
    where = f"{path} line {number}"
    try:
        value = json.loads(text)
    except ValueError as exc:
        raise DiffExportError(f"{where}: not JSON ({str(exc).splitlines()[0][:80]})") from None
    except RecursionError:  # nesting deeper than the parser's stack: no prompt is shaped like that
        raise DiffExportError(f"{where}: not JSON (nested too deeply)") from None
    if not isinstance(value, dict):
        raise DiffExportError(f'{where}: give an object, {{"prompt": "text"}} or {{"ids": [1, 2, 3]}}')
    unknown = sorted(set(value) - KEYS)
    if unknown:
        raise DiffExportError(f"{where}: unknown key {unknown[0]!r} (a prompt line takes prompt or ids, and id, "
                              "max_new_tokens, stop)")
    if ("prompt" in value) == ("ids" in value):
        raise DiffExportError(f"{where}: give exactly one of prompt (text) and ids (token ids)")
    caller_id = value.get("id")
    if caller_id is not None and (isinstance(caller_id, bool) or not isinstance(caller_id, (str, int))):
        raise DiffExportError(f"{where}: id must be a string or an integer")
    limit = value.get("max_new_tokens")
    if limit is not None and (isinstance(limit, bool) or not isinstance(limit, int) or limit < 1):
        raise DiffExportError(f"{where}: max_new_tokens must be an integer >= 1, got {limit!r}")
    stop = value.get("stop")
    if stop is not None:
        stop = [stop] if isinstance(stop, str) else stop
        if not isinstance(stop, list) or len(stop) > MAX_STOPS or not all(isinstance(s, str) and s for s in stop):
            raise DiffExportError(f"{where}: stop must be a non-empty string or a list of at most {MAX_STOPS} of them")
        if "ids" in value and stop:
            raise DiffExportError(f"{where}: stop matches generated text: give a text prompt, not ids")
    if "prompt" in value:
        if not isinstance(value["prompt"], str) or not value["prompt"]:
            raise DiffExportError(f"{where}: prompt must be non-empty text")
        return PromptLine(number, value["prompt"], None, caller_id, limit, stop)
    ids = value["ids"]
    if not isinstance(ids, list) or not ids or \
            not all(isinstance(t, int) and not isinstance(t, bool) and 0 <= t < vocab_size for t in ids):
        raise DiffExportError(f"{where}: ids must be a non-empty list of token ids in [0, {vocab_size})")
    return PromptLine(number, None, ids, caller_id, limit, stop)
