"""A TensorRT engine (single graph or KV-cache decoder) against the eager model, on the GPU.
"""

from __future__ import annotations

import os
import shlex
from pathlib import Path
from typing import Callable

import torch

from diffexport.analysis import plots
from diffexport.analysis.probe import AttentionProbe
from diffexport.backends.tensorrt import (
    EngineDecoder,
    decoder_profile_problem,
    find_plugin_library,
    open_engine,
    read_engine_record,
    sidecar_path,
)
from diffexport.core import tolerances
from diffexport.core.errors import DiffExportError
from diffexport.core.quantization import LogitQuant
from diffexport.format import metadata
from diffexport.format.metadata import check_export_metadata
from diffexport.format.metadata_keys import DTYPE, KV_CACHE, OUTPUTS
from diffexport.format.names import PREFILL_INPUT_NAMES as INPUT_NAMES
from diffexport.modeling.checkpoint import LoadedModel
from diffexport.validation.compare import compare_outputs, count_tokens, finish_report
from diffexport.validation.decoder import decode_check
from diffexport.validation.options import (
    DECODE_PROMPTS,
    DECODE_STEPS,
    CheckOptions,
    CheckReport,
    TextIds,
    check_decode_options,
    check_same_model,
    save_dir_for,
)
from diffexport.validation.references import eager_models, run_eager


def run_engine_check(engine_path: str | os.PathLike, loaded: LoadedModel, options: CheckOptions | None = None,
                     log: Callable[[str], None] = print, steps: int | None = None) -> CheckReport:
    """A TensorRT engine built by `diffexport trt` against the eager model, on the GPU.

    With INT8 logits the reference applies the same quantisation (diffexport/core/quantization.py)
    to the eager model's attention, and the unquantised agreement is reported beside it.
    An engine of a KV-cache folder is stepped as the folder's check steps it (`steps` decode steps,
    DECODE_STEPS when None); a prefill engine takes no `steps` (its calls are `options.shapes`).
    """

    options = options or CheckOptions()
    engine_path = Path(engine_path)
    record = read_engine_record(engine_path)
    save_dir = save_dir_for(options, engine_path.with_suffix(".check"))
    meta = check_export_metadata(record["onnx_metadata"], sidecar_path(engine_path))
    dtype = meta[DTYPE]
    decoder = meta.get(KV_CACHE) == "1"
    if options.plot is not None and not decoder:
        raise DiffExportError("--plot draws a KV-cache check step by step: this engine is a prefill graph")
    if steps is not None and not decoder:
        raise DiffExportError("--steps counts the decode steps of a KV-cache folder's engine: this engine is a "
                              "prefill graph; use --shapes")
    steps = DECODE_STEPS if steps is None else steps
    if options.beams is not None and not decoder:
        raise DiffExportError("--num-beams checks beam search on a KV-cache folder's engine: this engine is a "
                              "prefill graph")
    if options.sampling is not None:
        raise DiffExportError("--sample checks onnxruntime-genai's sampling: check the engine's folder with it")
    check_decode_options(options, steps)
    plots.check_plot_path(options.plot)
    check_same_model(meta, loaded, engine_path)
    if decoder:  # the calls the check will make, held against the profile before anything runs

        batch, longest = len(DECODE_PROMPTS), max(DECODE_PROMPTS)
        calls = [(batch, longest, 0), (batch, 1, longest + steps - 1)]
        if options.beams is not None:  # every beam a row of the batch
            calls.append((options.beams.num_beams, 1, longest + steps - 1))
        if options.text is not None:  # one row; its windows keep within the profile's calls and past
            calls.append((1, 1, 1))
        for rows, sequence, past in calls:
            problem = decoder_profile_problem(record, engine_path, rows, sequence, past)
            if problem:
                raise DiffExportError(f"the check's {problem}")
    # The sidecar says which library the build used, but a library is code: it is loaded only from
    # where the user says (--plugin-lib, $DIFFEXPORT_PLUGIN_LIB) or from this install's own build.
    plugin_lib = None
    if record.get("attention") == "plugin":

        plugin_lib = str(find_plugin_library(options.plugin_lib))
    if not torch.cuda.is_available():
        raise DiffExportError("checking a TensorRT engine needs an NVIDIA GPU (torch sees none)")
    quant = _engine_logit_quant(record, loaded)
    plugin = ["--plugins", shlex.quote(plugin_lib)] if plugin_lib else []
    runner = ["polygraphy run", shlex.quote(str(engine_path)), "--model-type", "engine", "--trt", *plugin]
    if decoder:

        stepper = EngineDecoder(engine_path, record, meta, open_engine(engine_path.read_bytes(), record["module"],
                                                                       plugin_lib))
        text = None if options.text is None else \
            TextIds(options, loaded.config.vocab_size, 2, "a perplexity needs")
        return decode_check(stepper, engine_path.name, f"{record['module']} (attention {record['attention']})",
                             "engine", runner, loaded, options, save_dir, log, steps, device="cuda", quant=quant,
                             text=text)
    low_max, seq_max = record["profile"]["max"]
    low_min, seq_min = record["profile"]["min"]
    shapes = [s for s in options.shapes if low_min <= s[0] <= low_max and seq_min <= s[1] <= seq_max]
    if not shapes:
        raise DiffExportError(f"no --shapes inside the engine's profile (batch {low_min}..{low_max}, "
                              f"sequence {seq_min}..{seq_max})")
    outputs = meta.get(OUTPUTS, "logits").split(",")
    low, ref32 = eager_models(loaded, dtype, "cuda")
    log(f"checking      {engine_path.name} ({dtype}, attention {record['attention']}"
        f"{'' if quant is None else ', ' + quant.describe() + ' logits'}) against eager PyTorch"
        f"{'' if quant is None else ' with the same logit quantisation'} (cuda)")
    budget = metadata.quant_budget(meta)  # Q/DQ matmuls (or quantised weights) change the function
    if budget is not None:
        log(f"budget        {budget.what}: {budget.describe()}, not the {dtype} rule (docs/QUANTIZATION.md)")

    def eager(model, ids):
        if quant is None:
            return run_eager(model, ids, "cuda", outputs)
        with AttentionProbe(model, quant=quant):
            return run_eager(model, ids, "cuda", outputs)

    def unquantised(name, got, ids):  # how far the quantised engine is from the unquantised model
        plain = run_eager(ref32 if ref32 is not None else low, ids, "cuda", outputs)[name]
        cos = tolerances.compare("", got, plain, "float32").cosine
        return f"{'':18s} vs unquantised eager: cosine {cos:.6f} (reported, not a pass criterion)"

    run = open_engine(engine_path.read_bytes(), record["module"], plugin_lib)
    observed = []
    feeds, saved, comparisons, lines = compare_outputs(
        options, shapes, loaded.config.vocab_size, outputs, dtype, lambda ids: run({INPUT_NAMES[0]: ids}),
        lambda ids: eager(low, ids), None if ref32 is None else (lambda ids: eager(ref32, ids)),
        note=None if quant is None else unquantised, budget=budget,
        text=None if options.text is None else TextIds(options, loaded.config.vocab_size, count_tokens(shapes)),
        observed=observed)
    return finish_report(runner, save_dir, feeds, saved, comparisons, lines,
                   outputs, dtype, user_bounds=options.user_bounds, observed=observed)


def _engine_logit_quant(record: dict, loaded: LoadedModel):
    """The attention-logit quantisation an engine was built with (None: 16 bits, or a model without
    DiffAttention, where the bits change nothing)."""

    bits = int(record.get("logit_bits", 16))
    if bits >= 16 or not loaded.config.differential:
        return None
    return LogitQuant(bits, "qk", bool(record.get("smooth_k", True)))
