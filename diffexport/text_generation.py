"""Text generation with a KV-cache decoder folder, as an API: the folder's tokenizer and chat
template, prompts as token ids within the context, and the draw (the caller's options over the
folder's genai_config search values). `diffexport generate` is a thin layer over these.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Callable

from diffexport.errors import DiffExportError
from diffexport.generation import Sampling

MAX_CHAT_TEMPLATE_BYTES = 1024**2  # chat templates are a few kB


def folder_tokenizer(folder: Path):
    """onnxruntime-genai's tokenizer of a decoder folder (one line when the folder has none)."""
    from diffexport.backends.decoding import import_genai
    from diffexport.export.decoder import has_tokenizer

    if not has_tokenizer(folder):
        raise DiffExportError(f"{folder} has no tokenizer: give token ids, or re-export with --tokenizer DIR")
    og = import_genai()
    try:
        return og.Tokenizer(og.Model(str(folder)))
    except Exception as exc:  # onnxruntime-genai's own errors on a broken tokenizer
        raise DiffExportError(f"the tokenizer in {folder} failed: {str(exc).splitlines()[0][:160]}") from None


def conversation_text(tokenizer, folder: Path, messages: list[dict]) -> str:
    """A conversation (role/content turns) in the tokenizer's chat template, ready for the
    assistant's answer: tokenizer_config.json's chat_template, or the folder's chat_template.jinja
    (where newer transformers save it)."""
    template, template_str = folder / "chat_template.jinja", None
    if template.is_symlink():  # onnxruntime-genai would read it through the link itself
        raise DiffExportError(f"{template} is a symbolic link: a decoder folder holds its chat template itself")
    if template.is_file():
        if template.stat().st_size > MAX_CHAT_TEMPLATE_BYTES:
            raise DiffExportError(f"{template} is larger than 1 MiB: not a chat template")
        template_str = template.read_text(errors="replace")
    try:
        return tokenizer.apply_chat_template(json.dumps(messages), template_str=template_str, add_generation_prompt=True)
    except RuntimeError as exc:
        if "empty chat template" in str(exc).lower():
            raise DiffExportError(f"the tokenizer in {folder} has no chat template (tokenizer_config.json's "
                                  "chat_template or chat_template.jinja): drop --chat and give the prompt as it is "
                                  "to be read") from None
        raise


def chat_text(tokenizer, folder: Path, prompt: str, system: str | None) -> str:
    """The prompt as one user turn (after an optional system turn) in the tokenizer's chat template,
    ready for the assistant's answer."""
    messages = ([{"role": "system", "content": system}] if system else []) + [{"role": "user", "content": prompt}]
    return conversation_text(tokenizer, folder, messages)


def encode(tokenizer, folder: Path, text: str, chat: bool = False, system: str | None = None) -> list[int]:
    """Text -> token ids (chat: as a user turn of the chat template, after `system`)."""
    try:
        text = chat_text(tokenizer, folder, text, system) if chat else text
        ids = [int(t) for t in tokenizer.encode(text)]
    except DiffExportError:
        raise
    except Exception as exc:  # onnxruntime-genai's own errors on a broken tokenizer
        raise DiffExportError(f"the tokenizer in {folder} failed: {str(exc).splitlines()[0][:160]}") from None
    if not ids:
        raise DiffExportError("the prompt encodes to no tokens")
    return ids


def check_room(ids: list[int], max_new_tokens: int, context: int, where: str = "prompt",
               limit: str = "--max-new-tokens") -> None:
    """The prompt and the tokens asked for must fit the folder's context length."""
    if len(ids) + max_new_tokens > context:
        raise DiffExportError(f"{where} ({len(ids)} tokens) + {limit} {max_new_tokens} exceeds the "
                              f"context length {context}")


def parse_ids(text: str, vocab_size: int) -> list[int]:
    """'1,2,3' -> token ids within the vocabulary (one-line errors otherwise)."""
    try:
        ids = [int(t) for t in text.split(",") if t.strip()]
    except ValueError:
        raise DiffExportError(f"--ids must be comma-separated integers, got {text!r}") from None
    bad = [t for t in ids if not 0 <= t < vocab_size]
    if not ids or bad:
        raise DiffExportError(f"--ids needs token ids in [0, {vocab_size}), got {bad[:3] or 'none'}")
    return ids


def prompt_ids(folder: Path, config: dict, max_new_tokens: int, *, ids: str | None = None, prompt: str | None = None,
               chat: bool = False, system: str | None = None) -> tuple[list[int], object]:
    """The prompt (`ids` as '1,2,3', else the text `prompt`) as token ids that leave room for
    max_new_tokens in the context, and the tokenizer (None for ids); config: the folder's genai config."""
    if ids is not None:
        tokens, tokenizer = parse_ids(ids, int(config["model"]["vocab_size"])), None
    else:
        tokenizer = folder_tokenizer(folder)
        tokens = encode(tokenizer, folder, prompt, chat, system)
    check_room(tokens, max_new_tokens, int(config["model"]["context_length"]))
    return tokens, tokenizer


def folder_sampling(config: dict, *, greedy: bool = False, sample: bool = False, num_beams: int = 1,
                    temperature: float | None = None, top_k: int | None = None, top_p: float | None = None,
                    repetition_penalty: float | None = None, seed: int = 0,
                    log: Callable[[str], None] | None = None) -> Sampling:
    """The draw: the caller's options (None: not given) over the folder's genai_config search values,
    as transformers' generate() takes a checkpoint's generation_config. A folder whose search samples
    (do_sample true, from its checkpoint's generation_config.json) samples with its temperature, top-k
    and top-p unless `greedy`; its repetition penalty applies either way. Otherwise greedy, or with
    `sample` temperature 1, no top-k or top-p cut. What came from the folder is said through `log`."""
    from diffexport.export.decoder import folder_search

    search = folder_search(config)
    folder_samples = search["do_sample"] and not greedy and num_beams == 1
    draws_greedily = not (sample or folder_samples)
    taken = []

    def pick(given, key: str, own):
        if given is not None:
            return given
        value = search[key] if folder_samples or key == "repetition_penalty" else own
        if value != own and not (draws_greedily and key != "repetition_penalty") and num_beams == 1:
            taken.append(f"{key.replace('_', ' ')} {value}")
        return value

    sampling = Sampling(greedy=draws_greedily, temperature=pick(temperature, "temperature", 1.0),
                        top_k=pick(top_k, "top_k", 0), top_p=pick(top_p, "top_p", 1.0), seed=seed,
                        repetition_penalty=pick(repetition_penalty, "repetition_penalty", 1.0))
    if folder_samples and not sample:
        taken.insert(0, "sampling")
    if taken and log:
        log(f"from the folder's genai_config.json search: {', '.join(taken)} (the options override it"
            f"{'; --greedy decodes greedily' if folder_samples else ''})")
    return sampling


BACKENDS = ("genai", "onnxruntime", "tensorrt")


def open_backend(folder: Path, backend: str, provider: str = "auto", engine: str | None = None,
                 plugin_lib: str | None = None, *, step_runner: bool = True) -> tuple[object | None, str | None]:
    """What runs the folder for `backend` -> (runner, provider):
      tensorrt     the engine `diffexport trt FOLDER` built (a DecoderRunner: backends/base.py), no provider;
      onnxruntime  an OrtDecoder on the resolved provider (step_runner=False: no runner, the caller's
                   batch loop opens its own), and that provider;
      genai        no runner (genai keeps its own loop), and the provider to name (None: the folder's own)."""
    from diffexport.backends import decoding

    if backend not in BACKENDS:
        raise DiffExportError(f"unknown backend {backend!r}; choose one of {list(BACKENDS)}")
    if backend == "tensorrt":
        from diffexport.backends.tensorrt import open_decoder_engine

        return open_decoder_engine(engine, folder, plugin_lib), None
    if backend == "onnxruntime":
        from diffexport.backends.onnxruntime import resolve_provider

        resolved = resolve_provider(provider)
        return (decoding.OrtDecoder(folder, provider=resolved) if step_runner else None), resolved
    return None, None if provider == "auto" else provider


class ChatHistory:
    """A conversation's turns, put through the chat template as a whole each turn. When the
    conversation and the answer's room pass the context, the oldest turns are dropped (the system
    turn stays); a turn too long on its own is refused and forgotten."""

    def __init__(self, tokenizer, folder: Path, context: int, max_new_tokens: int, system: str | None = None,
                 log: Callable[[str], None] | None = None):
        self.tokenizer, self.folder, self.context, self.max_new_tokens = tokenizer, folder, context, max_new_tokens
        self.system = [{"role": "system", "content": system}] if system else []
        self.turns: list[dict] = []  # user and assistant turns, oldest first
        self.log = log or (lambda _: None)

    def _ids(self) -> list[int]:
        return [int(t) for t in self.tokenizer.encode(conversation_text(self.tokenizer, self.folder,
                                                                        self.system + self.turns))]

    def ask(self, text: str) -> list[int] | None:
        """The conversation with this user turn, as the prompt's token ids (None: the turn alone does not
        fit the context with the answer's room; it is not kept)."""
        self.turns.append({"role": "user", "content": text})
        ids = self._ids()
        while len(ids) + self.max_new_tokens > self.context and len(self.turns) > 1:
            self.turns = self.turns[2:]  # the oldest user turn and its answer
            self.log(f"dropped the oldest turn: the conversation and --max-new-tokens passed the context {self.context}")
            ids = self._ids()
        if len(ids) + self.max_new_tokens > self.context:
            self.log(f"error: this turn ({len(ids)} tokens with the template) + --max-new-tokens {self.max_new_tokens} "
                     f"exceeds the context length {self.context}: not answered")
            self.turns.pop()
            return None
        return ids

    def answered(self, text: str) -> None:
        self.turns.append({"role": "assistant", "content": text})
