"""A single-graph export in ONNX Runtime against the eager model at several (batch, sequence) shapes.
"""

from __future__ import annotations

import os
import shlex
from pathlib import Path
from typing import Callable

import torch

from diffexport.core.errors import DiffExportError
from diffexport.core.onnxruntime_session import open_session, resolve_provider
from diffexport.format import metadata
from diffexport.format.metadata import read_export_metadata
from diffexport.format.metadata_keys import DTYPE, OUTPUTS
from diffexport.format.names import DTYPES
from diffexport.format.names import PREFILL_INPUT_NAMES as INPUT_NAMES
from diffexport.kernel import reference
from diffexport.modeling.checkpoint import LoadedModel
from diffexport.validation.compare import compare_outputs, count_tokens, finish_report
from diffexport.validation.options import (
    CheckOptions,
    CheckReport,
    TextIds,
    check_same_model,
    save_dir_for,
)
from diffexport.validation.references import (
    eager_models,
    resolve_reference,
    run_eager,
    run_transformers,
    transformers_models,
)


def run_prefill_check(onnx_path: str | os.PathLike, loaded: LoadedModel, options: CheckOptions | None = None,
                      log: Callable[[str], None] = print) -> CheckReport:

    options = options or CheckOptions()
    onnx_path = Path(onnx_path)
    port, library, reference_line = resolve_reference(options.reference, loaded)
    save_dir = save_dir_for(options, onnx_path.with_suffix(".check"))
    meta = read_export_metadata(onnx_path)
    dtype = meta[DTYPE]
    check_same_model(meta, loaded, onnx_path)
    provider = resolve_provider(options.provider)
    session = open_session(onnx_path, provider)
    outputs = [o.name for o in session.get_outputs()]
    if outputs != meta.get(OUTPUTS, "").split(","):
        raise DiffExportError(f"{onnx_path.name} outputs {outputs} differ from its metadata: re-export it")
    device = "cuda" if provider == "cuda" else "cpu"
    budget = metadata.quant_budget(meta)
    low, ref32 = eager_models(loaded, dtype, device)
    head_dim = loaded.config.head_dim  # which library the attention calls reach, for the report
    value_dim = loaded.config.value_dim
    probe_q = torch.empty(1, 1, 1, head_dim, device=device, dtype=DTYPES[dtype])
    probe_v = torch.empty(1, 1, 1, value_dim, device=device, dtype=DTYPES[dtype])
    eager_name = f"eager PyTorch ({reference.attention_backend(probe_q, probe_v)}, {device})"
    text = None if options.text is None else TextIds(options, loaded.config.vocab_size, count_tokens(options.shapes))
    log(f"checking      {onnx_path.name} ({dtype}) in onnxruntime {provider} against {eager_name}")
    if budget is not None:
        log(f"budget        {budget.what}: {budget.describe()}, not the {dtype} rule (docs/QUANTIZATION.md)")

    def run(ids):
        return dict(zip(outputs, session.run(outputs, {INPUT_NAMES[0]: ids})))

    observed = []
    feeds, saved, comparisons, lines = compare_outputs(
        options, options.shapes, loaded.config.vocab_size, outputs, dtype, run,
        lambda ids: run_eager(low, ids, device, outputs),
        None if ref32 is None else (lambda ids: run_eager(ref32, ids, device, outputs)), budget=budget, text=text,
        observed=observed)
    port_comparisons = comparisons  # the polygraphy files hold the port's outputs: their bounds go with them
    if not port:  # ... but with --reference transformers its lines are not the verdict
        comparisons, lines = [], []
    if library:  # the same seeded ids through transformers itself (logits: what it returns)
        hf_low, hf32 = transformers_models(loaded, dtype)
        _, _, hf_comparisons, hf_lines = compare_outputs(
            options, options.shapes, loaded.config.vocab_size, ["logits"], dtype, run,
            lambda ids: run_transformers(hf_low, ids),
            None if hf32 is None else (lambda ids: run_transformers(hf32, ids)), label=" vs transformers",
            budget=budget,
            text=None if text is None else TextIds(options, loaded.config.vocab_size, count_tokens(options.shapes)))
        comparisons, lines = comparisons + hf_comparisons, lines + hf_lines
    lines.insert(0, reference_line)
    runner = ["polygraphy run", shlex.quote(str(onnx_path)), "--onnxrt", "--providers", provider]
    report = finish_report(runner, save_dir, feeds, saved, comparisons, lines,
                           outputs, dtype, user_bounds=options.user_bounds, atol_comparisons=port_comparisons,
                           observed=observed)
    if text is not None and text.count:
        report.measures["perplexity"] = text.perplexities()
    return report
