"""RMSNorm written as x / sqrt(mean(x^2) + eps): the standard-op form onnxruntime fuses when it loads.

torch's exporter writes `x * rsqrt(v)` as Mul(x, Reciprocal(Sqrt(v))). onnxruntime's
SimplifiedLayerNormFusion, which every session runs at the default optimisation level (so inside
onnxruntime-genai too), matches only Pow -> ReduceMean -> Add -> Sqrt -> Div -> Mul, so every
layer norm of a DiffAttention graph ran as six kernels. Div(x, Sqrt(v)) is the same computation
with one rounding instead of two, still standard ONNX: TensorRT and other runtimes read it as
before. Applied to the graphs `diffexport onnx` writes, except `--attention gqa` folders, whose
own fusion (passes/onnxruntime_fusions.py) matches torch's form and writes the fused contrib ops
itself. It lives in the export because it decides which form the export writes: it runs on the
traced graph before the DiffAttention function is attached, not on a finished file.
"""

from __future__ import annotations


def _times_reciprocal_root(op, x, v):
    return op.Mul(x, op.Reciprocal(op.Sqrt(v)))


def _divided_by_root(op, x, v):
    return op.Div(x, op.Sqrt(v))


def divide_by_root(model_ir) -> int:
    """Rewrite Mul(x, Reciprocal(Sqrt(v))) as Div(x, Sqrt(v)) in place (either Mul operand order; a
    Reciprocal read elsewhere too is left alone); returns how many were rewritten."""
    from onnxscript.rewriter import pattern

    rule = pattern.RewriteRule(_times_reciprocal_root, _divided_by_root, name="DivideByRoot")
    return pattern.RewriteRuleSet([rule], commute=True).apply_to_model(model_ir)
