"""Dtype-aware comparison of a runtime's output with an eager reference (docs/NUMERICS policy).

fp32: max |out - ref| <= 1e-5 * max(1, max|ref|).
fp16 / bf16 (flash-attention's rule): max |out - ref| <= 2 * max |baseline - ref| + atol, where
ref is the computation in fp32 on the same low-precision weights and baseline is plain PyTorch
in the low-precision dtype; plus a cosine floor, because differential attention subtracts two
similar maps and relative errors of small outputs mean nothing.
NaN or inf never passes.
"""

from __future__ import annotations

import dataclasses
import json
import math

import numpy as np

from diffexport.core.errors import DiffExportError

FP32_RTOL_OF_SCALE = 1e-5
LOWPREC_ATOL_OF_SCALE = {"float16": 1e-3, "bfloat16": 8e-3}
MIN_COSINE = {"float32": 0.99999, "float16": 0.9999, "bfloat16": 0.999}
UNIT_ROUNDOFF = {"float32": 2.0**-24, "float16": 2.0**-11, "bfloat16": 2.0**-8}


@dataclasses.dataclass
class Comparison:
    name: str
    max_abs: float
    mean_abs: float
    cosine: float
    bound: float  # what max_abs had to stay under
    baseline_max_abs: float | None
    finite: bool
    min_cosine: float
    user_bounds: tuple[float, float] | None = None  # (atol, rtol): the user's elementwise rule replaces ours
    outside: int = 0  # elements outside the user's bounds

    @property
    def passed(self) -> bool:
        if self.user_bounds is not None:
            return self.finite and self.outside == 0
        return self.finite and self.max_abs <= self.bound and self.cosine >= self.min_cosine

    def line(self) -> str:
        base = "" if self.baseline_max_abs is None else f"  (torch low-precision baseline {self.baseline_max_abs:.2e})"
        verdict = "PASS" if self.passed else ("FAIL (non-finite)" if not self.finite else "FAIL")
        if self.user_bounds is not None:
            atol, rtol = self.user_bounds
            return (f"{self.name:<18s} max abs {self.max_abs:.2e}  mean abs {self.mean_abs:.2e}  cosine "
                    f"{self.cosine:.7f}  |out-ref| <= {atol:g} + {rtol:g}*|ref| (user bounds): "
                    f"{self.outside} elements outside  {verdict}")
        return (f"{self.name:<18s} max abs {self.max_abs:.2e} (bound {self.bound:.2e})  mean abs {self.mean_abs:.2e}"
                f"  cosine {self.cosine:.7f}{base}  {verdict}")


def _cosine(a: np.ndarray, b: np.ndarray) -> float:
    denom = float(np.linalg.norm(a) * np.linalg.norm(b))
    return float(np.dot(a, b) / denom) if denom > 0 else (1.0 if not a.any() and not b.any() else 0.0)


def compare(name: str, out: np.ndarray, ref: np.ndarray, dtype: str, baseline: np.ndarray | None = None,
            user_bounds: tuple[float, float] | None = None) -> Comparison:
    """Compare `out` (the runtime) with `ref`; `baseline` is required for fp16/bf16 unless the user
    gave bounds: user_bounds (atol, rtol) is polygraphy's elementwise |out - ref| <= atol + rtol*|ref|,
    which then replaces the dtype rule (NaN and inf still never pass)."""
    out64, ref64 = np.asarray(out, np.float64).ravel(), np.asarray(ref, np.float64).ravel()
    if out64.shape != ref64.shape:
        raise ValueError(f"{name}: shapes differ, {np.shape(out)} vs {np.shape(ref)}")
    finite = bool(np.isfinite(out64).all())
    diff = np.abs(out64 - ref64)
    scale = max(1.0, float(np.abs(ref64).max(initial=0.0)))
    stats = dict(name=name, max_abs=float(diff.max(initial=0.0)) if finite else float("inf"),
                 mean_abs=float(diff.mean()) if finite else float("inf"),
                 cosine=_cosine(out64, ref64) if finite else 0.0, finite=finite)
    base_err = None
    if user_bounds is not None:
        atol, rtol = user_bounds
        outside = int((diff > atol + rtol * np.abs(ref64)).sum()) if finite else int(out64.size)
        return Comparison(**stats, bound=atol, baseline_max_abs=None, min_cosine=0.0, user_bounds=(atol, rtol),
                          outside=outside)
    if dtype == "float32":
        bound = FP32_RTOL_OF_SCALE * scale
    else:
        if baseline is None:
            raise ValueError(f"{name}: a {dtype} comparison needs the low-precision baseline")
        base_err = float(np.abs(np.asarray(baseline, np.float64).ravel() - ref64).max(initial=0.0))
        bound = 2 * base_err + LOWPREC_ATOL_OF_SCALE[dtype] * scale
    return Comparison(**stats, bound=bound, baseline_max_abs=base_err, min_cosine=MIN_COSINE[dtype])


# polygraphy reruns the graph in a session of its own, whose reductions may add up in another
# order: the printed atol leaves this much (relative) above the largest difference seen here.
RERUN_MARGIN = 1e-3


def elementwise_atol(comparisons: list[Comparison], dtype: str, ref_max: float, observed_max: float = 0.0) -> float:
    """An atol for polygraphy's elementwise check against the saved reference (cast to `dtype`):
    the largest bound, or the largest difference seen on the saved calls' whole outputs (padding
    rows included; polygraphy compares every element) if that is larger, with the rerun margin,
    plus the rounding of the reference into `dtype`."""
    worst = max(max(c.bound for c in comparisons), observed_max)
    return worst * (1 + RERUN_MARGIN) + UNIT_ROUNDOFF[dtype] * max(1.0, ref_max)


def format_at_least(x: float, digits: int = 3) -> str:
    """x in `digits` significant digits, rounded up: a printed bound is never below the one computed
    (0.30824 prints as 0.309, where "%.3g" gives 0.308 and the printed command fails)."""
    text = f"{x:.{digits}g}"
    if not math.isfinite(x) or x <= 0 or float(text) >= x:
        return text
    step = 10.0 ** (math.floor(math.log10(x)) - (digits - 1))
    value = math.ceil(x / step) * step
    text = f"{value:.{digits}g}"
    while float(text) < x:  # the product above can land a hair low in binary
        value += step
        text = f"{value:.{digits}g}"
    return text


# ---------------------------------------------------------------- quantised weights
# A weight-quantised model is not the same function as its source, so elementwise bounds do not
# apply: it is judged on what a user of its next-token distribution sees. Budgets (docs/NUMERICS.md,
# "Quantised weights"): mean KL(reference || quantised) of next-token distributions in nats per
# token, and a logit cosine floor. Top-1 agreement is reported, not judged: on models whose
# reference is unsure (near-tied logits, e.g. untrained weights) it flips without harm.


@dataclasses.dataclass(frozen=True)
class QuantBudget:
    max_kl: float
    min_cosine: float
    what: str = "quantised weights"  # what was quantised, for the report

    def describe(self) -> str:
        return f"mean KL <= {self.max_kl:g} nats/token, cosine >= {self.min_cosine:g}"


# KL is the accuracy budget; the cosine floor only catches a broken graph (a wrong scale or zero
# point gives cosines far below it), so it sits well under what RTN reaches even on random weights.
WEIGHT_QUANT_BUDGETS = {8: QuantBudget(max_kl=0.005, min_cosine=0.995, what="int8 weights"),
                        4: QuantBudget(max_kl=0.05, min_cosine=0.95, what="int4 weights")}
# An int8 KV cache (GroupQueryAttention, one calibrated scale per channel) rounds every cached key
# and value once; its own budget is int8 weights', and it adds to the weights' budget when both are.
KV_CACHE_BUDGETS = {8: QuantBudget(max_kl=0.005, min_cosine=0.995, what="an int8 KV cache")}
# Q/DQ graphs for TensorRT quantise the activations entering every weight matmul too (one
# calibrated scale per tensor), which costs more than int8 weights alone: "about 2% perplexity".
QDQ_BUDGETS = {"int8": QuantBudget(max_kl=0.02, min_cosine=0.98, what="int8 Q/DQ weights and activations"),
               "fp8": QuantBudget(max_kl=0.02, min_cosine=0.98, what="fp8 Q/DQ weights and activations")}


@dataclasses.dataclass
class DistributionComparison:
    name: str
    max_abs: float
    cosine: float
    mean_kl: float | None  # None for outputs that are not logits
    top1: float | None
    finite: bool
    budget: QuantBudget

    @property
    def bound(self) -> float:  # polygraphy's elementwise rerun reproduces the error observed here
        return self.max_abs

    @property
    def passed(self) -> bool:
        kl_ok = self.mean_kl is None or self.mean_kl <= self.budget.max_kl
        return self.finite and kl_ok and self.cosine >= self.budget.min_cosine

    def line(self) -> str:
        verdict = "PASS" if self.passed else ("FAIL (non-finite)" if not self.finite else "FAIL")
        kl = "" if self.mean_kl is None else \
            f"  KL {self.mean_kl:.2e} (budget {self.budget.max_kl:g})  top-1 {self.top1:.1%}"
        return (f"{self.name:<18s} max abs {self.max_abs:.2e}  cosine {self.cosine:.7f} (floor "
                f"{self.budget.min_cosine:g}){kl}  {verdict}")


def compare_distributions(name: str, out: np.ndarray, ref: np.ndarray, budget: QuantBudget,
                          logits: bool) -> DistributionComparison:
    """A quantised model's output against its unquantised reference under `budget`; for logits
    ([..., vocab]) the next-token distributions are compared too."""
    out64, ref64 = np.asarray(out, np.float64), np.asarray(ref, np.float64)
    if out64.shape != ref64.shape:
        raise ValueError(f"{name}: shapes differ, {out64.shape} vs {ref64.shape}")
    finite = bool(np.isfinite(out64).all())
    if not finite:
        return DistributionComparison(name, float("inf"), 0.0, None, None, False, budget)
    kl = top1 = None
    if logits:
        log_p = ref64 - np.logaddexp.reduce(ref64, axis=-1, keepdims=True)
        log_q = out64 - np.logaddexp.reduce(out64, axis=-1, keepdims=True)
        kl = max(0.0, float((np.exp(log_p) * (log_p - log_q)).sum(-1).mean()))  # >= 0; below is rounding
        top1 = float((out64.argmax(-1) == ref64.argmax(-1)).mean())
    return DistributionComparison(name, float(np.abs(out64 - ref64).max(initial=0.0)),
                                  _cosine(out64.ravel(), ref64.ravel()), kl, top1, True, budget)


def _record(text: str, what: str) -> dict:
    try:
        record = json.loads(text)
    except (ValueError, RecursionError):
        record = None
    if not isinstance(record, dict):
        raise DiffExportError(f"the {what} metadata is not a quantisation record")
    return record


def _bits_budget(record: str | None, what: str, budgets: dict, writes: str) -> QuantBudget | None:
    """The budget in `budgets` for the bits of a quantisation record (None: no record)."""
    if record is None:
        return None
    try:
        bits = int(_record(record, what)["bits"])
    except (ValueError, KeyError, TypeError):
        raise DiffExportError(f"the {what} metadata is not a quantisation record") from None
    if bits not in budgets:
        raise DiffExportError(f"no accuracy budget for {what.replace('_', ' ')} of int{bits} (diffexport quantize "
                              f"writes {writes})")
    return budgets[bits]


def weight_quant_budget(record: str | None) -> QuantBudget | None:
    """The budget for an export's `weight_quant` metadata (None: not weight-quantised)."""
    return _bits_budget(record, "weight_quant", WEIGHT_QUANT_BUDGETS, "int4 and int8 weights")


def qdq_budget(record: str | None) -> QuantBudget | None:
    """The budget for an export's `qdq` metadata (None: no Q/DQ quantisation)."""
    if record is None:
        return None
    fmt = _record(record, "qdq").get("format")
    if fmt not in QDQ_BUDGETS:
        raise DiffExportError(f"no accuracy budget for Q/DQ format {fmt!r} (diffexport quantize writes int8 and fp8)")
    return QDQ_BUDGETS[fmt]


def quant_budget(*, weights: str | None = None, qdq: str | None = None,
                 kv_cache: str | None = None) -> QuantBudget | None:
    """The budget an export's quantisation records (as stored: JSON text, None where absent) call
    for: None when neither its weights, its activations nor its cache were quantised by
    `diffexport quantize`. format/metadata.quant_budget reads them from an export's metadata."""
    weights, qdq = weight_quant_budget(weights), qdq_budget(qdq)
    if weights is not None and qdq is not None:
        raise DiffExportError("the export declares both weight-only and Q/DQ quantisation; diffexport quantize "
                              "writes one or the other: re-quantise the unquantised export")
    cache = kv_cache_budget(kv_cache)
    if cache is None or (weights or qdq) is None:
        return weights or qdq or cache
    both = weights or qdq
    return QuantBudget(max_kl=both.max_kl + cache.max_kl, min_cosine=both.min_cosine - (1 - cache.min_cosine),
                       what=f"{both.what} and {cache.what}")


def kv_cache_budget(record: str | None) -> QuantBudget | None:
    """The budget for an export's `kv_cache_quant` metadata (None: a float cache)."""
    return _bits_budget(record, "kv_cache_quant", KV_CACHE_BUDGETS, "an int8 KV cache")
