"""The demo (`diffexport demo`, README command 1) as a function: the whole path on one model, each
step's report shown as it comes. The model summary and the op's self-check against Eq. 1, the
prefill export checked in ONNX Runtime (CPU), then the KV-cache decoder folder, a generation from
a text prompt (onnxruntime-genai, or the plain loop where genai is missing) compared with eager
generate, and the folder's check. The files stay in the output folder, so every polygraphy command
shown runs as shown; a second demo replaces only an earlier demo's files.
"""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Callable

import torch

from diffexport.backends import genai, step_loop
from diffexport.core import eager_generation
from diffexport.core.errors import DiffExportError
from diffexport.export import ExportOptions, export_onnx
from diffexport.export.decoder import export_decoder_graph
from diffexport.format import decoder_folder, names
from diffexport.format.metadata import read_export_metadata
from diffexport.generation import text_generation
from diffexport.modeling import summary
from diffexport.modeling.checkpoint import LoadedModel
from diffexport.validation.decoder import run_decoder_check
from diffexport.validation.options import CheckOptions
from diffexport.validation.prefill import run_prefill_check

DEMO_PRESET = "diff-text-tiny"  # the demo's model when none is named: the zoo's trained text model
DEMO_PROMPT = "def fibonacci(n):"  # it was trained on Python source
DEMO_NEW_TOKENS = 24


def run_demo(loaded: LoadedModel, out_dir: str | Path, *, seed: int = 0, show: Callable[[str], None] = print,
             log: Callable[[str], None] = print) -> bool:
    """The demo on `loaded`, its files in out_dir -> whether every check passed. show: each step's
    report (the CLI's stdout); log: progress (its stderr)."""
    out_dir = Path(out_dir)
    show(summary.describe(loaded))
    op_ok, op_report = summary.self_check(loaded.model, seed=seed)  # the op vs eager Eq. 1, before exporting it
    show(op_report)
    exported = export_onnx(loaded, out_dir / "model.onnx", ExportOptions(force=earlier_demo_export(out_dir)), log=log)
    show(exported.report())
    report = run_prefill_check(exported.path, loaded, CheckOptions(provider="cpu", seed=seed), log=log)
    show(report.text())
    kv_ok = demo_generation(loaded, out_dir, seed, show, log)
    return report.passed and op_ok and kv_ok


def earlier_demo_export(out_dir: Path) -> bool:
    """Whether out_dir's model.onnx is an export of ours (an earlier demo's), which the demo replaces."""
    path = out_dir / "model.onnx"
    if path.is_symlink() or not path.is_file():
        return False
    try:
        read_export_metadata(path)
    except DiffExportError:
        return False
    return True


def demo_generation(loaded: LoadedModel, out_dir: Path, seed: int, show: Callable[[str], None],
                    log: Callable[[str], None]) -> bool:
    """The demo's second half: the KV-cache decoder folder, generated through onnxruntime-genai
    (from a text prompt where the model has a tokenizer), compared with eager generate, checked."""
    folder = out_dir / "model-kv"
    if folder.exists():  # replaced only when it holds nothing but an earlier demo's files
        ours = {names.MODEL_FILE, names.MODEL_FILE + ".data", names.GENAI_CONFIG, "README.md",
                *decoder_folder.TOKENIZER_FILES}
        if folder.is_symlink() or not folder.is_dir() or not {p.name for p in folder.iterdir()} <= ours:
            raise DiffExportError(f"{folder} exists and is not an earlier demo's output: move it or pick --out-dir")
        shutil.rmtree(folder)
    show(export_decoder_graph(loaded, folder, log=log).report())
    tokenizer = None
    if decoder_folder.has_tokenizer(folder):
        tokenizer = text_generation.folder_tokenizer(folder)
        prompt = text_generation.encode(tokenizer, folder, DEMO_PROMPT)
    else:
        prompt = [1, 2, 3, 4, 5, 6, 7, 8]
    try:
        run = genai.generate_genai(folder, prompt, DEMO_NEW_TOKENS, eager_generation.Sampling())
        backend = "onnxruntime-genai"
    except DiffExportError:  # onnxruntime-genai missing: the plain loop, said so
        run = step_loop.generate_stepped(folder, prompt, DEMO_NEW_TOKENS, eager_generation.Sampling())
        backend = "onnxruntime loop (onnxruntime-genai not installed)"
    eager = eager_generation.generate(loaded.model, torch.tensor([prompt]), max_new_tokens=len(run.tokens))
    same = eager.tokens[0].tolist() == run.tokens
    if tokenizer is not None:
        show(f"prompt        {DEMO_PROMPT!r}\ngenerated     {tokenizer.decode(run.tokens)!r}")
    show(f"generate      {backend}: {len(prompt)} prompt tokens -> {run.tokens} "
         f"({run.decode_tokens_per_s:.0f} tokens/s); eager generate {'identical' if same else 'DIFFERENT'}")
    report = run_decoder_check(folder, loaded, CheckOptions(provider="cpu", seed=seed), log=log)
    show(report.text())
    return same and report.passed
