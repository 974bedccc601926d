"""`diffexport report`: one self-contained HTML page about an exported artifact (a KV-cache folder or
a prefill .onnx file) that a team can read without a terminal: the model, the artifact, its check
against the eager reference, its speed on this machine beside a memory-bandwidth estimate, and the
commands that reproduce each number. build.py gathers, page.py renders."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Callable

from diffexport.core.errors import DiffExportError
from diffexport.core.files import atomic_write, check_output_path
from diffexport.format.decoder_folder import read_decoder_folder
from diffexport.format.metadata import read_export_metadata
from diffexport.modeling.checkpoint import LoadedModel
from diffexport.report.build import Report, artifact_facts, build_report, report_kind
from diffexport.report.page import render_html as render
from diffexport.validation.decoder import DECODE_STEPS
from diffexport.validation.options import CheckOptions, check_decode_options

__all__ = ["Report", "artifact_facts", "build_report", "default_output", "render_html", "write_report"]


def default_output(artifact: str | os.PathLike) -> Path:
    """ARTIFACT.report.html beside the artifact (a folder's name, a file's stem)."""
    artifact = Path(artifact)
    return artifact.with_name((artifact.name if artifact.is_dir() else artifact.stem) + ".report.html")


def render_html(report: Report) -> str:
    return render(report)


def write_report(artifact: str | os.PathLike, load_model: Callable[[dict], LoadedModel],
                 output: str | os.PathLike | None = None,
                 options: CheckOptions | None = None, *, force: bool = False, speed: bool = True,
                 steps: int | None = None, asked: str = "", log: Callable[[str], None] = print) -> tuple[Path, Report]:
    """Check `artifact`, measure it and write the page to `output` (default: default_output). The
    output is validated first (an existing page is replaced only with force, never through a link);
    load_model(the export's metadata) loads the reference model once the artifact was read. The
    page is written whole or not at all. -> (the page's path, the report)."""

    artifact = Path(artifact)
    output = Path(output) if output is not None else default_output(artifact)
    if output.suffix.lower() not in (".html", ".htm"):
        raise DiffExportError(f"the report is an HTML page: give an output name ending in .html, got {output.name}")
    check_output_path(output, replace=force, inputs=[artifact])
    if report_kind(artifact) == "decoder":

        meta = read_decoder_folder(artifact)[2]  # not a decoder folder: said before the checkpoint loads
        check_decode_options(options or CheckOptions(), DECODE_STEPS if steps is None else steps)
    else:
        meta = read_export_metadata(artifact)  # a foreign or corrupt file: said before the checkpoint loads
    report = build_report(artifact, load_model(meta), options, asked=asked, speed=speed, steps=steps, log=log)
    page = render_html(report)
    atomic_write(output, lambda tmp: Path(tmp).write_text(page, encoding="utf-8"))
    return output, report
