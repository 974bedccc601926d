"""The model card (README.md) of a decoder folder, in the Hugging Face Hub's format: a YAML header
(library, tags, base model where known), then what was exported, from what and with which
diffexport, the folder's format and precision, how to run it (onnxruntime-genai in Python,
`diffexport generate`), and a results section that `diffexport check` fills in.

Our cards carry MARKER. A README.md without it is the user's: it is never written over, and check
leaves it alone. The results section lies between RESULTS_START and RESULTS_END.
"""

from __future__ import annotations

import datetime
import json
import os
import re
from pathlib import Path

from diffexport import __version__
from diffexport.core.files import atomic_write
from diffexport.core.lazy import lazy_import
from diffexport.format import decoders
from diffexport.format.metadata_keys import (
    ATTENTION,
    QDQ,
    SOURCE,
    SOURCE_NAME,
    SOURCE_REVISION,
    WEIGHT_QUANT,
)

genai_config = lazy_import("diffexport.format.genai_config")
metadata = lazy_import("diffexport.format.metadata")
names = lazy_import("diffexport.format.names")

CARD = "README.md"
MARKER = "<!-- diffexport model card: written by diffexport; remove this line to keep the file as your own -->"
RESULTS_START, RESULTS_END = "<!-- diffexport:results -->", "<!-- /diffexport:results -->"
NOT_CHECKED = ("Not checked yet. `diffexport check FOLDER --ckpt CHECKPOINT` compares this folder with the eager "
               "model and writes its verdict here.")
MAX_CARD_BYTES = 1 << 20
HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]{0,95}/[\w.-]{1,96}$")


def decoder_card(folder: str | os.PathLike, model_file: str, name: str | None = None) -> str:
    """The card of a decoder folder written by export or quantize (its graph's metadata and its
    genai_config.json, both read as diffexport wrote them); name: the folder's final name (the
    card is written in a temporary folder before the rename)."""
    folder = Path(folder)
    meta = metadata.read_export_metadata(folder / model_file)
    config = genai_config.load_genai_config(folder)
    model_cfg = meta.model_config
    family = meta.family
    source, source_name = meta.get(SOURCE, ""), meta.get(SOURCE_NAME, "")
    revision = meta.get(SOURCE_REVISION)  # the Hub snapshot's commit, for an export from a hub id
    context = config["model"]["context_length"]
    providers = [k for p in config["model"]["decoder"].get("session_options", {}).get("provider_options", [])
                 for k in p] or ["cpu"]
    fmt = decoders.decoder_format(meta.get(ATTENTION))
    form = "one DiffAttention node per layer; onnxruntime and TensorRT run it" if fmt.tensorrt else \
        f"{fmt.summary}; onnxruntime only: for TensorRT, export with `--attention {decoders.DEFAULT}`"
    weights = "the export dtype"
    record = meta.record(WEIGHT_QUANT)
    if record is not None:
        weights = f"int{record.get('bits', '?')} MatMulNBits (block {record.get('block_size', '?')}, " \
                  f"{record.get('method', '?')})"
    if meta.record(QDQ) is not None:
        weights = "Q/DQ (calibrated, for TensorRT)"
    tokenizer = any((folder / name).is_file() for name in names.TOKENIZER_MODELS)
    base = source_name if HUB_ID.match(source_name or "") else None
    header = ["---", "library_name: onnxruntime-genai", "pipeline_tag: text-generation", "tags:", "- diffexport",
              "- differential-transformer", "- onnx", "- onnxruntime-genai", f"- {yaml_scalar(family)}"]
    if base:
        header.append(f"base_model: {yaml_scalar(base)}")
    header.append("---")
    prompt = '--prompt "Hello"' if tokenizer else "--ids 1,2,3"
    layers, heads, width = model_cfg.n_layers, model_cfg.n_heads, model_cfg.d_model
    # Every value read from the graph's metadata or the folder is a stranger's text: written as plain
    # Markdown text or a code span, never as markup (a source name of `<script>` or a newline and ---).
    body = [
        MARKER, "",
        f"# {markdown_text(name or folder.name)}: a {markdown_text(family)} KV-cache decoder for onnxruntime-genai", "",
        f"Exported by diffexport {__version__} from {markdown_text(source) or 'a model'}"
        f"{f' {code_span(source_name)}' if source_name else ''}"
        f"{f' (revision {code_span(revision)})' if revision else ''}: {markdown_text(layers)} layers, "
        f"{markdown_text(heads)} {'differential ' if model_cfg.differential else ''}heads, width "
        f"{markdown_text(width)}, "
        f"vocabulary {markdown_text(config['model']['vocab_size'])}.", "",
        "| | |", "|---|---|",
        f"| attention | {code_span(fmt.name)} ({form}) |",
        f"| dtype | {markdown_text(meta['dtype'])} |",
        f"| weights | {markdown_text(weights)} |",
        f"| context length | {markdown_text(context)} tokens |",
        f"| execution provider | {markdown_text(', '.join(map(str, providers)))} |",
        f"| tokenizer | {'included' if tokenizer else 'none: prompts are token ids'} |", "",
        "## Run it", "",
        "```python",
        "import onnxruntime_genai as og",
        "",
        'model = og.Model("FOLDER")',
        *(["tokenizer = og.Tokenizer(model)", 'ids = tokenizer.encode("Hello")'] if tokenizer else ["ids = [1, 2, 3]"]),
        "params = og.GeneratorParams(model)",
        "params.set_search_options(max_length=64)",
        "generator = og.Generator(model, params)",
        "generator.append_tokens(ids)",
        "while not generator.is_done():",
        "    generator.generate_next_token()",
        "print(tokenizer.decode(generator.get_sequence(0)))" if tokenizer else "print(generator.get_sequence(0))",
        "```", "",
        "```",
        f"diffexport generate FOLDER {prompt} --max-new-tokens 32",
        "diffexport triton FOLDER -o repo --serve      # Triton Inference Server",
        "```", "",
        "## Check results", "", RESULTS_START, NOT_CHECKED, RESULTS_END, ""]
    return "\n".join(header + [""] + body)


def is_ours(path: Path) -> bool:
    """Whether `path` is a card diffexport wrote (a regular file, not a link, of a card's size, with MARKER)."""
    try:
        if path.is_symlink() or not path.is_file() or path.stat().st_size > MAX_CARD_BYTES:
            return False
        return MARKER in path.read_text(errors="replace")
    except OSError:
        return False


def update_results(folder: str | os.PathLike, lines: list[str]) -> bool:
    """Put `lines` in the results section of the folder's card, atomically; False (nothing written)
    when the folder has no card of ours or its results markers are gone."""
    path = Path(folder) / CARD
    if not is_ours(path):
        return False
    text = path.read_text(errors="replace")
    start, end = text.find(RESULTS_START), text.find(RESULTS_END)
    if start < 0 or end < start:
        return False
    new = text[:start + len(RESULTS_START)] + "\n" + "\n".join(lines) + "\n" + text[end:]
    try:
        atomic_write(path, lambda tmp: Path(tmp).write_text(new))
    except OSError:  # a folder the checker may read but not write
        return False
    return True


def results_lines(verdict: bool | str, report_lines: list[str], command: str) -> list[str]:
    """The results section for a check's report (verdict: passed or not, or the check's own word:
    PASS, FAIL, INCONCLUSIVE)."""

    shown = report_lines[:60]
    verdict = verdict if isinstance(verdict, str) else "PASS" if verdict else "FAIL"
    fence = "`" * max(3, 1 + max((len(run) for line in shown for run in re.findall(r"`+", line)), default=0))
    return [f"**{markdown_text(verdict)}** on {datetime.date.today().isoformat()}, diffexport {__version__}: "
            f"{code_span(command)}", "", fence, *shown, *(["..."] if len(report_lines) > len(shown) else []), fence]


# -- a stranger's text in a card -------------------------------------------------------------------

# what can start markup inside a line (emphasis, links, code, a table's cell); the rest of Markdown's
# punctuation matters only at a line's start, where no value of a card stands
MARKDOWN_SPECIAL = re.compile(r"([\\`*_\[\]|])")


def _one_line(value) -> str:
    return " ".join(str(value).split())


def markdown_text(value) -> str:
    """`value` as literal Markdown text inside a line: HTML's <, > and & as entities, the punctuation
    that starts markup there backslash-escaped (a table's | included)."""
    text = _one_line(value).replace("&", "&amp;").replace("<", "&lt;").replace(">", "&gt;")
    return MARKDOWN_SPECIAL.sub(r"\\\1", text)


def code_span(value) -> str:
    """`value` as a Markdown code span on one line (where HTML is not read): fenced by more backticks
    than any run inside it, padded where it starts or ends with one. A table's | is escaped as
    GitHub's tables need even inside code."""
    text = _one_line(value).replace("|", "\\|")
    fence = "`" * (1 + max((len(run) for run in re.findall(r"`+", text)), default=0))
    pad = " " if text.startswith("`") or text.endswith("`") else ""
    return f"{fence}{pad}{text}{pad}{fence}"


YAML_WORDS = {"true", "false", "yes", "no", "on", "off", "null", "~", "y", "n"}  # read as other types
PLAIN_YAML = re.compile(r"^[A-Za-z][A-Za-z0-9_./-]*$")  # a name YAML reads as that string, unquoted


def yaml_scalar(value) -> str:
    """`value` as one YAML scalar: a plain name (an org/name id, a family) as it is, anything else
    double-quoted (JSON's string syntax, which YAML reads as such), so that a newline, a `---` or a
    `: ` in it cannot end the value or the front matter."""
    text = str(value)
    return text if PLAIN_YAML.match(text) and text.lower() not in YAML_WORDS else json.dumps(text, ensure_ascii=True)
