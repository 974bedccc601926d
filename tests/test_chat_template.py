"""A folder's chat template rendered within bounds (diffexport/generation/chat_template.py, issue 43 item 7):
the same text transformers renders for real templates, and one line, in bounded time and memory,
for templates that loop, grow or reach outside the sandbox."""

import json

import pytest

from diffexport.core.errors import DiffExportError
from diffexport.generation.chat_template import MAX_RENDER_CPU_SECONDS, render_chat

# a Llama-3-style template: special tokens, a system turn, raise_exception, loop controls, tojson
LLAMA_STYLE = (
    "{{ bos_token }}{% for m in messages %}"
    "{% if m['role'] not in ['system', 'user', 'assistant'] %}{{ raise_exception('unknown role ' + m['role']) }}{% "
    "endif %}"
    "{% if m['content'] == 'skip' %}{% continue %}{% endif %}"
    "<|start_header_id|>{{ m['role'] }}<|end_header_id|>\n\n{{ m['content'] | trim }}<|eot_id|>"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|start_header_id|>assistant<|end_header_id|>\n\n{% endif %}"
    "{{ {'meta': 'é'} | tojson }}"
)
CONVERSATION = [{"role": "system", "content": "be brief "}, {"role": "user", "content": "the cat sat"},
                {"role": "assistant", "content": "skip"}, {"role": "user", "content": "on the <mat> & more"}]


def _folder(tmp_path, template: str, config: dict | None = None):
    (tmp_path / "chat_template.jinja").write_text(template)
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(config or {"bos_token": "<s>",
                                                                         "eos_token": {"content": "</s>"}}))
    return tmp_path


def test_the_text_is_what_transformers_renders(tmp_path):
    transformers = pytest.importorskip("transformers")
    from helpers import byte_bpe_tokenizer

    byte_bpe_tokenizer(tmp_path)
    folder = _folder(tmp_path, LLAMA_STYLE, {**json.loads((tmp_path / "tokenizer_config.json").read_text()),
                                             "bos_token": "<s>"})
    ours = render_chat(folder, CONVERSATION)
    theirs = transformers.AutoTokenizer.from_pretrained(folder).apply_chat_template(
        CONVERSATION, chat_template=LLAMA_STYLE, tokenize=False, add_generation_prompt=True)
    assert ours == theirs and ours.startswith("<s><|start_header_id|>system") and '{"meta": "é"}' in ours
    assert "skip" not in ours and "on the <mat> & more" in ours


def test_tokenizer_config_template_and_refusals(tmp_path):
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"chat_template": [
        {"name": "tool_use", "template": "tools"}, {"name": "default", "template": "{{ messages[0]['content'] }}!"}]}))
    assert render_chat(tmp_path, [{"role": "user", "content": "hi"}]) == "hi!"
    (tmp_path / "tokenizer_config.json").write_text("{}")
    with pytest.raises(DiffExportError, match="has no chat template"):
        render_chat(tmp_path, [{"role": "user", "content": "hi"}])
    _folder(tmp_path, LLAMA_STYLE)
    with pytest.raises(DiffExportError, match="^the chat template refused the conversation: unknown role tool$"):
        render_chat(tmp_path, [{"role": "tool", "content": "x"}])


BOUNDED = {
    "range(10**8)": ("{% for i in range(10**8) %}x{% endfor %}", "stopped at a width or count of 100,000,000"),
    "a nested loop with no output": ("{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}",
                                     f"stopped at more than {MAX_RENDER_CPU_SECONDS:g} s of CPU time"),
    "a string doubled in a loop": ("{% set ns = namespace(s='a') %}{% for i in range(60) %}{% set ns.s = ns.s ~ ns.s %}"
                                   "{% endfor %}{{ ns.s|length }}", "stopped at more than 256 MiB of memory"),
    "a product": ("{{ 'a' * 10**9 }}", "stopped at a product of 1,000,000,000 items"),
    "a power": ("{% set n = 10 ** 64 %}{{ n ** 64 ** 64 }}", "stopped at a number of about"),
    "a product of numbers": ("{% set ns = namespace(n=3) %}{% for i in range(40) %}{% set ns.n = ns.n * ns.n %}"
                             "{% endfor %}", "stopped at a number of about"),
    "endless output": ("{% for i in range(100000) %}{{ 'abcdefghij' * 100 }}{% endfor %}", "characters of output"),
    "Python's internals": ("{{ messages.__class__.__mro__ }}", "reached outside its sandbox"),
    # widths one C call would honour with gigabytes before the output bound could look (issue 59 item 6)
    "center": ("{{ 'x'|center(10**9) }}", "stopped at a width or count of 1,000,000,000"),
    "indent": ("{{ 'a\nb'|indent(10**9) }}", "stopped at a width or count of 1,000,000,000"),
    "wordwrap": ("{{ 'a b'|wordwrap(10**9) }}", "stopped at a width or count of 1,000,000,000"),
    "a str method": ("{{ 'x'.ljust(2 * 10**9) }}", "stopped at a width or count of 2,000,000,000"),
    "zfill": ("{{ '1'.zfill(10**9) }}", "stopped at a width or count of 1,000,000,000"),
    "a %-format width": ("{{ '%999999999d' % 1 }}", "stopped at a width or precision of 999,999,999 in a format"),
    "a %-format precision": ("{{ '%.999999999f' % 1.0 }}", "stopped at a width or precision of 999,999,999"),
    "a %-format * width": ("{{ '%*d' % (10**9, 1) }}", "stopped at a width or count of 1,000,000,000"),
    "the format filter": ("{{ '%999999999s'|format('a') }}", "stopped at a width or precision of 999,999,999"),
    "str.format": ("{{ '{:>999999999}'.format(1) }}", "stopped at a width or precision of 999,999,999"),
    "a nested str.format width": ("{{ '{:>{w}}'.format(1, w=10**9) }}", "stopped at a width or count of 1,000,000,000"),
    "format_map": ("{{ '{a:>{w}}'.format_map({'a': 1, 'w': 10**9}) }}", "stopped at a width or count of 1,000,000,000"),
    "bad syntax": ("{% for %}", "failed: TemplateSyntaxError"),
}


@pytest.mark.parametrize("name", BOUNDED)
def test_hostile_templates_are_one_line(tmp_path, name):
    template, message = BOUNDED[name]
    with pytest.raises(DiffExportError, match=message.replace("*", r"\*").replace("(", r"\(").replace(")", r"\)")):
        render_chat(_folder(tmp_path, template), [{"role": "user", "content": "hi"}])


def test_ordinary_widths_and_formats_still_render(tmp_path):
    template = "{{ '%5d|%-3s|%%'|format(7, 'a') }}{{ '{:>4}'.format(2) }}{{ 'x'|center(5) }}{{ '%.2f' % 1.5 }}"
    assert render_chat(_folder(tmp_path, template), [{"role": "user", "content": "hi"}]) == "    7|a  |%   2  x  1.50"


def test_the_bound_is_cpu_time_not_a_busy_machine(tmp_path, monkeypatch):
    """A valid template whose thread gets no CPU for longer than the bound (here it waits 2.5 s in a
    call, as a render waits on a loaded machine or behind the server's other threads) renders: the
    bound counts the rendering thread's CPU time. A bound in wall-clock seconds (2 s, the bound
    before) refused it."""
    import time

    from diffexport.generation import chat_template

    own = chat_template._special_tokens
    monkeypatch.setattr(chat_template, "_special_tokens",
                        lambda folder: {**own(folder), "wait": lambda: time.sleep(MAX_RENDER_CPU_SECONDS + 0.5) or ""})
    folder = _folder(tmp_path, "{{ wait() }}{% for i in range(2000) %}{% endfor %}ok")
    assert render_chat(folder, [{"role": "user", "content": "hi"}]) == "ok"


def test_generate_chat_with_a_looping_template_is_one_line(artifacts, tmp_path):
    """Through `generate --chat`, as a user would meet it: one line, exit 2, no answer."""
    from helpers import assert_one_line_error, cli_main

    kv = artifacts.copy(artifacts.cli_output("onnx", artifacts.hf_diffllama_with_chat_template(), "--kv-cache",
                                             output="kv"), tmp_path)
    (kv / "chat_template.jinja").write_text(BOUNDED["a nested loop with no output"][0])
    result = cli_main("generate", kv, "--prompt", "hi", "--chat", "--max-new-tokens", "2")
    assert_one_line_error(result, "was stopped at more than 2 s of CPU time")
    assert result.stdout == ""
