"""Judging outputs against the references under diffexport.core.tolerances, and saving the inputs and reference
outputs in polygraphy's JSON formats with the command that repeats a comparison.
"""

from __future__ import annotations

import math
import shlex
from pathlib import Path

import numpy as np

from diffexport.core import tolerances
from diffexport.core.errors import DiffExportError
from diffexport.core.files import atomic_write
from diffexport.format.names import PREFILL_INPUT_NAMES as INPUT_NAMES
from diffexport.validation.options import EAGER_RUNNER, CheckReport, TextIds


def _save_polygraphy(save_dir: Path, feeds: list[dict], eager: list[dict[str, np.ndarray]], dtype: str,
                     runner_name: str = EAGER_RUNNER):
    try:
        from polygraphy.comparator import RunResults
        from polygraphy.comparator.struct import IterationResult
        from polygraphy.json import save_json
        from polygraphy.logger import G_LOGGER
    except ImportError:
        raise DiffExportError("polygraphy is not installed: pip install 'diffexport[onnx]'") from None
    G_LOGGER.module_severity = G_LOGGER.ERROR  # its "Saving ..." lines would drown our report
    save_dir.mkdir(parents=True, exist_ok=True)  # validated by save_dir_for before any work
    inputs_path, outputs_path = save_dir / "inputs.json", save_dir / "eager_outputs.json"
    np_dtype = np.float16 if dtype == "float16" else np.float32  # numpy has no bfloat16
    # Each file goes to a temporary name and is renamed over the target: a symbolic link already
    # sitting at a target name is replaced, never written through.
    atomic_write(inputs_path, lambda tmp: save_json(feeds, tmp, description="diffexport check inputs"))
    iterations = [IterationResult({k: v.astype(np_dtype) for k, v in outs.items()}, runner_name=runner_name)
                  for outs in eager]
    atomic_write(outputs_path, lambda tmp: RunResults([(runner_name, iterations)]).save(tmp))
    return inputs_path, outputs_path


def judge(name: str, label: str, got, ref, base, dtype: str, options, budget):
    """One output against its reference: the budget of quantised weights when there is one (and
    the user gave no bounds of their own), else the dtype rule."""
    if budget is not None and options.user_bounds is None:
        return tolerances.compare_distributions(label, got, ref, budget, logits=name == "logits")
    return tolerances.compare(label, got, ref, dtype, baseline=base, user_bounds=options.user_bounds)


def severity(c) -> float:
    """How close a comparison came to failing (the worst one is reported)."""
    if isinstance(c, tolerances.DistributionComparison):
        return (c.mean_kl or 0.0) / c.budget.max_kl if c.finite else float("inf")
    return c.max_abs / max(c.bound, 1e-30)


def count_tokens(shapes) -> int:
    """The token ids a list of (batch, seq) calls takes."""
    return sum(batch * seq for batch, seq in shapes)


def compare_outputs(options, shapes, vocab, outputs, dtype, run, eager_low, eager_ref, note=None, label="", budget=None,
             text: TextIds | None = None, observed: list | None = None):
    """Seeded token ids (or --text's) per (batch, seq) through the runtime and eager; each output
    compared under the dtype rule (eager_ref None: fp32, eager_low is the reference), or under
    `budget` for a weight-quantised model. note(name, got, ids) may add a line. observed: a list
    that receives the runtime's outputs of each call (for finish_report)."""
    rng = np.random.default_rng(options.seed)
    feeds, saved, comparisons, lines = [], [], [], []
    for batch, seq in shapes:
        ids = rng.integers(0, vocab, size=(batch, seq), dtype=np.int64) if text is None else text.take(batch, seq)
        feeds.append({INPUT_NAMES[0]: ids})
        got = run(ids)
        if observed is not None:
            observed.append(got)
        base = eager_low(ids)
        ref = base if eager_ref is None else eager_ref(ids)
        saved.append(ref)
        for name in outputs:
            c = judge(name, f"{name} [{batch}x{seq}]{label}", got[name], ref[name],
                       None if eager_ref is None else base[name], dtype, options, budget)
            comparisons.append((name, c))
            lines.append(c.line())
            if note is not None:
                lines.append(note(name, got[name], ids))
        if text is not None and "logits" in outputs:
            text.score(ids, {"model": got["logits"], "reference": ref["logits"]})
    if text is not None and "logits" in outputs:
        lines.append(text.line("model", "reference"))
    return feeds, saved, comparisons, lines


def _exact(value: float) -> str:
    """A number as short as it prints ("100", "1e-05") where that reads back as the same float."""
    text = f"{float(value):g}"
    return text if float(text) == float(value) else repr(float(value))


def finish_report(runner: list[str], save_dir: Path, feeds, saved, comparisons, lines, outputs, dtype,
            other_failures: tuple[str, ...] = (), user_bounds: tuple[float, float] | None = None,
            runner_name: str = EAGER_RUNNER, atol_comparisons=None, observed: list | None = None,
            inconclusive: tuple[str, ...] = ()) -> CheckReport:
    """Save the polygraphy JSON files and build the report: verdict and the `polygraphy run` command.
    other_failures: checks besides the comparisons that failed (named in the verdict). observed:
    the runtime's outputs for each saved call, so that the printed atol covers every element
    polygraphy compares (a check may judge only some rows, e.g. not a prompt's padding).
    inconclusive: checks that could not have failed as run (named in the verdict): without a
    failure the verdict is then INCONCLUSIVE, never PASS, and the report does not pass."""
    inputs_path, outputs_path = _save_polygraphy(save_dir, feeds, saved, dtype, runner_name)
    if user_bounds is not None:  # the user's own numbers, printed so that they read back exactly
        bounds = ["--atol", _exact(user_bounds[0]), "--rtol", _exact(user_bounds[1])]
    else:
        atols = []
        for name in outputs:
            ref_max = max(float(np.abs(r[name]).max()) for r in saved)
            seen = max((float(np.abs(np.asarray(o[name], np.float64) - np.asarray(r[name], np.float64))
                              .max(initial=0.0)) for o, r in zip(observed or [], saved)), default=0.0)
            atol = tolerances.elementwise_atol([c for n, c in (atol_comparisons or comparisons) if n == name], dtype,
                                               ref_max, seen if math.isfinite(seen) else 0.0)  # NaN fails regardless
            atols.append(f"{name}:{tolerances.format_at_least(atol)}")
        bounds = ["--atol", *atols, "--rtol", "0"]
    command = " ".join([*runner, "--load-inputs", shlex.quote(str(inputs_path)),
                        "--load-outputs", shlex.quote(str(outputs_path)), *bounds])
    if not comparisons:  # nothing compared cannot pass
        inconclusive = (*inconclusive, "no comparison was made")
    failed = not all(c.passed for _, c in comparisons) or bool(other_failures)
    passed = not failed and not inconclusive
    also = f"; failed: {', '.join(other_failures)}" if other_failures else ""
    also += f"; not judged: {', '.join(inconclusive)}" if inconclusive else ""
    verdict = "FAIL" if failed else "INCONCLUSIVE" if inconclusive else "PASS"
    lines.append(f"result        {verdict}: {sum(c.passed for _, c in comparisons)}/"
                 f"{len(comparisons)} comparisons within tolerance{also}")
    lines.append(f"polygraphy    {command}")
    return CheckReport(passed, lines, command, inputs_path, outputs_path, comparisons=list(comparisons),
                       inconclusive=tuple(inconclusive))
