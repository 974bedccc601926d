"""A decoder folder's chat template, rendered within bounds.

A chat template is a Jinja program from whoever made the folder. Rendered by onnxruntime-genai's
native engine, `{% for i in range(10**8) %}` took 3 GB and a nested loop with no output never
ended: nothing can stop native code. So diffexport renders it itself, as transformers does (Jinja's
immutable sandbox, trim_blocks and lstrip_blocks, loop controls, raise_exception, strftime_now,
tojson without HTML escaping), in Python that a tracer can stop:
- at MAX_RENDER_CPU_SECONDS of this thread's CPU time (not wall-clock time: a busy machine, or the
  server's other threads, never make a valid template fail);
- at MAX_RENDER_GROWTH of memory the process gained while rendering (a string doubled in a loop);
- at MAX_RENDER_CHARS of output, and at string or list products and sums past it;
- at integer products and powers past MAX_NUMBER_BITS (`10 ** 10 ** 10`);
- before a call whose width or count could pass MAX_RENDER_CHARS: an integer argument past it to a
  filter, method or function (`center(10**9)`, `indent`, `ljust`, `wordwrap`), a width or
  precision past it in a `%` or str.format format (`"%999999999d"`, `"{:>999999999}"`), since one
  C call would build that string before any other bound could look;
- at the sandbox's own bounds (range() of at most 100,000 items; no attribute that reaches Python).
The rendered text then goes to the folder's tokenizer, as genai's rendering did.
"""

from __future__ import annotations

import datetime
import functools
import json
import os
import re
import string
import sys
import time
from pathlib import Path

from diffexport.core.errors import DiffExportError

MAX_TEMPLATE_BYTES = 1024**2  # chat templates are a few kB
MAX_RENDER_CPU_SECONDS = 2.0  # a conversation renders in milliseconds
MAX_RENDER_CHARS = 4 * 1024**2  # the conversation (bounded by the context anyway) and the template's text
MAX_RENDER_GROWTH = 256 * 1024**2  # resident memory the process may gain while rendering (a few MB is plenty)
MAX_NUMBER_BITS = 1 << 16  # a product or power of integers (a template counts to thousands at most)
SPECIAL_TOKENS = ("bos_token", "eos_token", "pad_token", "unk_token")


class _Stop(Exception):
    """A bound was reached (the message says which)."""


def _resident_bytes() -> int:
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return 0  # not Linux: the time bound still holds


# a %-format's conversion specifier: flags, then width and precision (digits or *)
PERCENT_SPEC = re.compile(r"%(?:\([^)]*\))?[-#0 +]*(\d*|\*)(?:\.(\d*|\*))?")


def _check_counts(values) -> None:
    """Integer arguments that would make one C call build a string past MAX_RENDER_CHARS."""
    for value in values:
        if isinstance(value, int) and not isinstance(value, bool) and abs(value) > MAX_RENDER_CHARS:
            raise _Stop(f"a width or count of {value:,}")
        if isinstance(value, (tuple, list)):
            _check_counts([v for v in value if not isinstance(v, (tuple, list, dict))])
        elif isinstance(value, dict):
            _check_counts([v for v in value.values() if not isinstance(v, (tuple, list, dict))])


def _check_numbers(numbers) -> None:
    for number in numbers:
        if number.isdigit() and int(number) > MAX_RENDER_CHARS:
            raise _Stop(f"a width or precision of {int(number):,} in a format")


def _check_percent_format(text: str) -> None:
    _check_numbers([n for match in PERCENT_SPEC.finditer(text.replace("%%", "")) for n in match.groups() if n])


def _check_str_format(text: str) -> None:
    try:
        specs = [spec for _, field, spec, _ in string.Formatter().parse(text) if field is not None and spec]
    except ValueError:
        return  # str.format raises its own error on this text
    _check_numbers([n for spec in specs for n in re.findall(r"\d+", spec)])


def _bounded_filter(name: str, filter_function):
    @functools.wraps(filter_function)  # keeps Jinja's pass_context / pass_environment marks
    def bounded(*args, **kwargs):
        _check_counts([*args[1:], *kwargs.values()])  # args[0]: the value filtered, or Jinja's own context
        if name == "format" and args and isinstance(args[0], str):  # `fmt|format(...)` is fmt % (...)
            _check_percent_format(args[0])
        return filter_function(*args, **kwargs)

    return bounded


def _environment():
    try:
        from jinja2 import ext
        from jinja2.sandbox import ImmutableSandboxedEnvironment
    except ImportError:
        raise DiffExportError("chat templates need jinja2: pip install jinja2") from None

    class Bounded(ImmutableSandboxedEnvironment):
        intercepted_binops = frozenset({"*", "**", "+", "%"})

        def call(__self, __context, __obj, *args, **kwargs):  # noqa: N805 - Jinja's own signature
            _check_counts([*args, *kwargs.values()])
            return super().call(__context, __obj, *args, **kwargs)

        def wrap_str_format(self, value):
            wrapped = super().wrap_str_format(value)
            if wrapped is None:
                return None

            def bounded(*args, **kwargs):
                _check_str_format(value.__self__)
                _check_counts([*args, *kwargs.values()])
                return wrapped(*args, **kwargs)

            return bounded

        def call_binop(self, context, operator, left, right):
            if operator == "%" and isinstance(left, str):
                _check_percent_format(left)
                _check_counts([right])
            sized = (str, list, tuple)
            if (operator == "*" and isinstance(left, sized) and isinstance(right, int)
                    and len(left) * right > MAX_RENDER_CHARS):
                raise _Stop(f"a product of {len(left) * right:,} items")
            if (operator == "*" and isinstance(right, sized) and isinstance(left, int)
                    and len(right) * left > MAX_RENDER_CHARS):
                raise _Stop(f"a product of {len(right) * left:,} items")
            if operator == "+" and isinstance(left, sized) and isinstance(right, sized) and \
                    len(left) + len(right) > MAX_RENDER_CHARS:
                raise _Stop(f"a sum of {len(left) + len(right):,} items")
            if operator in ("*", "**") and isinstance(left, int) and isinstance(right, int):
                # a number's size: one C call that nothing interrupts computes it
                bits = (abs(left).bit_length() * max(right, 0) if operator == "**"
                        else abs(left).bit_length() + abs(right).bit_length())
                if bits > MAX_NUMBER_BITS:
                    raise _Stop(f"a number of about {bits:,} bits")
            return super().call_binop(context, operator, left, right)

    def raise_exception(message):
        raise DiffExportError(f"the chat template refused the conversation: {str(message)[:200]}")

    def tojson(value, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
        return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)

    env = Bounded(trim_blocks=True, lstrip_blocks=True, extensions=[ext.loopcontrols])
    env.filters["tojson"] = tojson
    env.filters = {name: _bounded_filter(name, f) for name, f in env.filters.items()}
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.datetime.now().strftime(fmt)
    return env


def folder_chat_template(folder: Path) -> str:
    """The folder's chat template: chat_template.jinja (where newer transformers save it), else
    tokenizer_config.json's chat_template (a string, or a list of named ones: "default")."""
    template = folder / "chat_template.jinja"
    if template.is_symlink():
        raise DiffExportError(f"{template} is a symbolic link: a decoder folder holds its chat template itself")
    if template.is_file():
        if template.stat().st_size > MAX_TEMPLATE_BYTES:
            raise DiffExportError(f"{template} is larger than 1 MiB: not a chat template")
        return template.read_text(errors="replace")
    value = _tokenizer_config(folder).get("chat_template")
    if isinstance(value, list):  # [{"name": ..., "template": ...}]
        value = next((t.get("template") for t in value if isinstance(t, dict) and t.get("name") == "default"), None)
    if not isinstance(value, str) or not value.strip():
        raise DiffExportError(f"the tokenizer in {folder} has no chat template (tokenizer_config.json's "
                              "chat_template or chat_template.jinja): drop --chat and give the prompt as it is "
                              "to be read")
    if len(value.encode()) > MAX_TEMPLATE_BYTES:
        raise DiffExportError(f"{folder / 'tokenizer_config.json'}'s chat_template is larger than 1 MiB: not a chat "
                              "template")
    return value


def _tokenizer_config(folder: Path) -> dict:
    path = folder / "tokenizer_config.json"
    if path.is_symlink() or not path.is_file():
        return {}  # a link is refused by the tokenizer folder's rules before this runs
    try:
        value = json.loads(path.read_bytes())
    except (ValueError, RecursionError):
        raise DiffExportError(f"{path} is not valid JSON") from None
    return value if isinstance(value, dict) else {}


def _special_tokens(folder: Path) -> dict[str, str]:
    """tokenizer_config.json's bos/eos/pad/unk tokens (a string, or {"content": string})."""
    config, found = _tokenizer_config(folder), {}
    for name in SPECIAL_TOKENS:
        value = config.get(name)
        value = value.get("content") if isinstance(value, dict) else value
        if isinstance(value, str):
            found[name] = value
    return found


def render_chat(folder: Path, messages: list[dict], add_generation_prompt: bool = True) -> str:
    """The conversation in the folder's chat template, within the bounds above; what fails or
    runs past a bound is one line."""
    from jinja2 import TemplateError
    from jinja2.sandbox import SecurityError

    folder = Path(folder)
    source = folder_chat_template(folder)
    env = _environment()
    start, resident = time.thread_time(), _resident_bytes()
    events = 0

    def trace(frame, event, arg):  # every line of the compiled template (and what it calls)
        nonlocal events
        events += 1
        if time.thread_time() - start > MAX_RENDER_CPU_SECONDS:
            raise _Stop(f"more than {MAX_RENDER_CPU_SECONDS:g} s of CPU time")
        if events % 4 == 0 and _resident_bytes() - resident > MAX_RENDER_GROWTH:
            raise _Stop(f"more than {MAX_RENDER_GROWTH >> 20} MiB of memory")
        return trace

    pieces, size = [], 0
    previous = sys.gettrace()
    sys.settrace(trace)
    try:
        template = env.from_string(source)
        for piece in template.generate(messages=messages, add_generation_prompt=add_generation_prompt,
                                       **_special_tokens(folder)):
            size += len(piece)
            if size > MAX_RENDER_CHARS:
                raise _Stop(f"more than {MAX_RENDER_CHARS:,} characters of output")
            pieces.append(piece)
    except _Stop as bound:
        raise DiffExportError(f"the chat template in {folder} was stopped at {bound}: a conversation renders in "
                              "milliseconds, so it is not used") from None
    except SecurityError as exc:
        raise DiffExportError(f"the chat template in {folder} reached outside its sandbox: {str(exc)[:160]}") from None
    except (TemplateError, TypeError, ValueError, OverflowError, ArithmeticError, LookupError) as exc:
        raise DiffExportError(f"the chat template in {folder} failed: {type(exc).__name__}: "
                              f"{str(exc).splitlines()[0][:160] if str(exc) else ''}") from None
    finally:
        sys.settrace(previous)
    return "".join(pieces)
