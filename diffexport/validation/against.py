"""One ONNX graph against another (e.g. optimize's output against its input) in ONNX Runtime, on the same inputs.
"""

from __future__ import annotations

import os
import shlex
from pathlib import Path
from typing import Callable

import numpy as np

from diffexport.core.errors import DiffExportError
from diffexport.core.files import load_onnx
from diffexport.core.onnxruntime_session import open_session, resolve_provider
from diffexport.format import metadata, metadata_keys
from diffexport.format.names import PREFILL_INPUT_NAMES as INPUT_NAMES
from diffexport.passes.fusion import probe_feeds
from diffexport.validation.compare import count_tokens, finish_report, judge
from diffexport.validation.options import (
    CheckOptions,
    CheckReport,
    TextIds,
    save_dir_for,
)

# ---------------------------------------------------------------- one ONNX graph against another

ORT_DTYPES = {"tensor(float)": "float32", "tensor(float16)": "float16", "tensor(bfloat16)": "bfloat16"}


def run_against(model_path: str | os.PathLike, against_path: str | os.PathLike, options: CheckOptions | None = None,
                log: Callable[[str], None] = print) -> CheckReport:
    """`check MODEL --against OTHER`: both graphs in onnxruntime on the same seeded inputs (e.g. a
    graph `diffexport optimize` wrote against its input), every shared output compared. fp32:
    the fp32 rule; fp16/bf16: |model - other| <= atol(dtype) * max(1, |other|) and the cosine floor
    (two low-precision graphs leave no fp32 reference to measure rounding against); --atol/--rtol
    replace the rule."""

    options = options or CheckOptions()
    model_path, against_path = Path(model_path), Path(against_path)
    save_dir = save_dir_for(options, model_path.with_suffix(".check"))
    provider = resolve_provider(options.provider)
    session, other = open_session(model_path, provider), open_session(against_path, provider)
    ins = {(i.name, i.type) for i in session.get_inputs()}
    if ins != {(i.name, i.type) for i in other.get_inputs()}:
        raise DiffExportError(f"{model_path.name} and {against_path.name} take different inputs "
                              f"({sorted(n for n, _ in ins)} vs {sorted(i.name for i in other.get_inputs())}): "
                              "--against compares two versions of one model")
    theirs = {o.name: o for o in other.get_outputs()}
    outputs = [o.name for o in session.get_outputs() if o.name in theirs]
    if not outputs:
        raise DiffExportError(f"{model_path.name} and {against_path.name} share no output name")
    out_types = {ORT_DTYPES.get(o.type) for o in session.get_outputs() if o.name in outputs}
    if None in out_types or len(out_types) != 1:
        raise DiffExportError(f"outputs of {model_path.name} must all be float32, float16 or bfloat16 to compare")
    dtype = out_types.pop()
    last = theirs[outputs[0]].shape[-1] if theirs[outputs[0]].shape else None
    vocab = last if isinstance(last, int) and last > 1 else 2  # token ids valid for any embedding
    text = None
    if options.text is not None:  # the text is read (and refused) before any work
        if INPUT_NAMES[0] not in {i.name for i in session.get_inputs()}:
            raise DiffExportError(f"--text needs a graph that takes {INPUT_NAMES[0]}")
        text = TextIds(options, vocab, count_tokens(options.shapes))
    log(f"checking      {model_path.name} against {against_path.name} in onnxruntime {provider}, same inputs, "
        f"outputs {', '.join(outputs)} ({dtype})")

    graph = load_onnx(model_path, weights=False)
    # a weight-quantised model against its unquantised source: the budget, not the dtype rule
    def weight_records(model) -> dict[str, str]:
        stored = metadata_keys.stored_metadata(model)
        return {key: value for key, value in stored.items() if key in metadata_keys.WEIGHT_RECORDS}

    theirs_quantised = bool(weight_records(load_onnx(against_path, weights=False)))
    budget = None if theirs_quantised else metadata.quant_budget(weight_records(graph))
    if budget is not None:
        log(f"budget        {budget.what}: {budget.describe()}, not the {dtype} rule")
    rng = np.random.default_rng(options.seed)
    feeds, saved, comparisons, lines, observed = [], [], [], [], []
    for batch, seq in options.shapes:
        feed = probe_feeds(graph, batch, seq, vocab=vocab, rng=rng)
        if text is not None:
            feed[INPUT_NAMES[0]] = text.take(batch, seq)
        got = dict(zip(outputs, session.run(outputs, feed)))
        ref = dict(zip(outputs, other.run(outputs, feed)))
        if text is not None and "logits" in outputs:
            text.score(feed[INPUT_NAMES[0]], {model_path.name: got["logits"], against_path.name: ref["logits"]})
        feeds.append(feed)
        saved.append(ref)
        observed.append(got)
        for name in outputs:
            c = judge(name, f"{name} [{batch}x{seq}]", got[name], ref[name],
                       None if dtype == "float32" else ref[name], dtype, options, budget)
            comparisons.append((name, c))
            lines.append(c.line())
    if text is not None and "logits" in outputs:
        lines.append(text.line(model_path.name, against_path.name))
    runner = ["polygraphy run", shlex.quote(str(model_path)), "--onnxrt", "--providers", provider]
    return finish_report(runner, save_dir, feeds, saved, comparisons, lines, outputs, dtype,
                   user_bounds=options.user_bounds, runner_name=f"onnxrt-{against_path.stem}", observed=observed)
