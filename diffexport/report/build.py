"""What `diffexport report` gathers about an artifact: the model, the artifact, a check against the
eager reference (run now, through validation), a short speed measurement on this machine, and the
commands that reproduce each number. Data only: page.py turns it into HTML."""

from __future__ import annotations

import dataclasses
import datetime
import os
import platform
import shlex
from pathlib import Path
from typing import Callable

from diffexport import __version__
from diffexport.backends import speed as speed_module
from diffexport.backends.base import machine_threads
from diffexport.backends.speed import cpu_name
from diffexport.core.errors import DiffExportError
from diffexport.core.progress import Progress
from diffexport.format.metadata_keys import ATTENTION, DTYPE, OP_VERSION, WEIGHT_RECORDS
from diffexport.modeling.checkpoint import LoadedModel
from diffexport.modeling.summary import model_facts
from diffexport.validation.artifact import artifact_kind
from diffexport.validation.decoder import DECODE_STEPS, run_decoder_check
from diffexport.validation.inspect_onnx import inspect_onnx
from diffexport.validation.options import CheckOptions, CheckReport
from diffexport.validation.prefill import run_prefill_check


@dataclasses.dataclass
class Report:
    artifact: Path
    kind: str  # "decoder" (a KV-cache folder) or "onnx" (a prefill file)
    model: dict  # summary.model_facts
    artifact_facts: dict  # inspect_onnx's description, plus files, format and quantisation
    check: CheckReport
    speed: object | None  # backends.speed.SpeedMeasure, None when not measured
    commands: list[tuple[str, str]]  # (what it reproduces, the command)
    created: str
    machine: str
    version: str = __version__


def report_kind(artifact: Path) -> str:
    """"decoder" or "onnx": what a report covers (an engine is refused in one line)."""

    kind = artifact_kind(artifact)
    if kind == "engine":
        raise DiffExportError(f"{artifact.name}: a report covers a KV-cache folder or an .onnx file; for a TensorRT "
                              "engine run `diffexport check` on the GPU that built it")
    return kind


def _files(artifact: Path) -> list[tuple[str, int, str]]:
    """(name, bytes, what) of the artifact's files, links shown as links and never followed."""
    paths = sorted(artifact.iterdir()) if artifact.is_dir() else [artifact, *sorted(
        p for p in artifact.parent.glob(artifact.name + "*") if p != artifact and p.suffix == ".data")]
    rows = []
    for path in paths:
        info = path.lstat()
        kind = "link (not followed)" if path.is_symlink() else ("folder" if path.is_dir() else "file")
        what = kind if kind != "file" else _FILE_ROLES.get(path.name) or _FILE_ROLES.get(path.suffix, "file")
        rows.append((path.name, 0 if kind != "file" else info.st_size, what))
    return rows


# what each file of an artifact is, by name or suffix (the Files table's "what" column)
_FILE_ROLES = {"model.onnx": "the graph (ONNX)", ".onnx": "the graph (ONNX)", ".data": "the weights (ONNX external "
                                                                                       "data)",
               "genai_config.json": "onnxruntime-genai's configuration", "tokenizer.json": "the tokenizer",
               "tokenizer_config.json": "the tokenizer's settings", "special_tokens_map.json": "the special tokens",
               "tokenizer.model": "the tokenizer (SentencePiece)", "vocab.json": "the tokenizer's vocabulary",
               "merges.txt": "the tokenizer's merges", "added_tokens.json": "tokens added to the vocabulary",
               "generation_config.json": "the checkpoint's generation defaults",
               "chat_template.jinja": "the chat template",
               "README.md": "the model card"}


def artifact_facts(artifact: Path) -> dict:
    """inspect_onnx's description of the artifact, with its files, decoder format and quantisation."""

    info = inspect_onnx(artifact)
    meta = {key.removeprefix("diffexport."): value for key, value in info["metadata"].items()}
    info["files"] = _files(artifact)
    info["dtype"] = meta.get(DTYPE, "?")
    info["op_version"] = meta.get(OP_VERSION, "?")
    info["decoder_format"] = meta.get(ATTENTION) if artifact.is_dir() else None
    quant = [f"{key}: {meta[key]}" for key in WEIGHT_RECORDS if key in meta]
    info["quantisation"] = quant or ["none (weights in " + info["dtype"] + ")"]
    return info


def _machine() -> str:
    return f"{cpu_name()}, {machine_threads()} cores, {platform.system()} {platform.machine()}"


def _commands(artifact: Path, kind: str, loaded: LoadedModel, preset: str | None, check: CheckReport,
              options: CheckOptions, asked: str) -> list[tuple[str, str]]:
    source = (f"--ckpt {shlex.quote(loaded.path)}" if loaded.path else
              f"--preset {preset}" if preset and loaded.source == "preset" else "--ckpt CHECKPOINT")
    extra = "".join(f" {flag} {shlex.quote(str(value))}" for flag, value in
                    (("--text", options.text), ("--tokenizer", options.tokenizer)) if value is not None)
    if options.seed:
        extra += f" --seed {options.seed}"
    commands = [("this page", asked),
                ("the check (every number of the check section)",
                 f"diffexport check {shlex.quote(str(artifact))} {source}{extra}"),
                ("the check's saved comparison, without diffexport", check.polygraphy_command)]
    if kind == "decoder":
        commands.append(("generation from this folder", f"diffexport generate {shlex.quote(str(artifact))} "
                                                         "--ids 1,2,3 --max-new-tokens 32"))
        commands.append(("the speed section's numbers for this folder (the same prompt, tokens and rounds)",
                         "python -c 'from diffexport.backends.speed import measure_decoder; "
                         f"print(measure_decoder({str(artifact)!r}))'"))
    commands.append(("what the file holds", f"diffexport inspect {shlex.quote(str(artifact))}"))
    return commands


def build_report(artifact: str | os.PathLike, loaded: LoadedModel, options: CheckOptions | None = None, *,
                 asked: str = "", speed: bool = True, steps: int | None = None,
                 log: Callable[[str], None] = print) -> Report:
    """Run the check of `artifact` (a KV-cache folder or a prefill .onnx file) against `loaded`,
    measure its speed on this machine's CPU unless speed is False, and gather what the page
    shows. asked: the command line that made the report (shown on the page)."""

    artifact = Path(artifact)
    kind = report_kind(artifact)
    options = options or CheckOptions()
    facts = artifact_facts(artifact)  # a foreign or corrupt artifact is refused before the check runs
    model = model_facts(loaded)
    if kind == "decoder":
        check = run_decoder_check(artifact, loaded, options, log=log, steps=DECODE_STEPS if steps is None else steps)
    else:
        check = run_prefill_check(artifact, loaded, options, log=log)
    measured = None
    if speed:
        with Progress("speed", 3) as progress:
            step = lambda done, total: progress.advance(1)  # noqa: E731
            if kind == "decoder":
                measured = speed_module.measure_decoder(artifact, progress=step)
            else:
                measured = speed_module.measure_prefill(artifact, loaded.config.vocab_size, progress=step)
        log(f"speed         prompt {measured.prompt_tokens_per_s:.1f} tokens/s"
            + ("" if kind != "decoder" else f", decode {measured.decode_tokens_per_s:.1f} tokens/s "
               f"(memory-bandwidth estimate {measured.decode_bound:.1f})"))
    created = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    return Report(artifact, kind, model, facts, check, measured,
                  _commands(artifact, kind, loaded, model["preset"], check, options, asked or "diffexport report "
                                                                                              f"{artifact}"),
                  created, _machine())
