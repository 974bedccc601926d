"""Rewrites that change how an exported computation is written, not what it computes, so that the
runtimes' own fusers recognise it. Each rule says which fuser wants it.

  rmsnorm_div   x * Reciprocal(Sqrt(v))  ->  x / Sqrt(v)
                torch.rsqrt exports as Sqrt then Reciprocal; onnxruntime's
                SimplifiedLayerNormalization fusion matches only the Div form, so every RMSNorm
                of the model stayed six nodes per layer in each decode step. The two forms differ
                by rounding only (one division against a reciprocal and a product).

Applied by the exporter to the main graph; the DiffAttention function body is written by us
(export/function_body.py) and is not rewritten.
"""

from __future__ import annotations


def _reciprocal_sqrt_product(op, x, v):
    return op.Mul(x, op.Reciprocal(op.Sqrt(v)))


def _quotient_by_sqrt(op, x, v):
    return op.Div(x, op.Sqrt(v))


def rules():
    from onnxscript.rewriter import pattern

    # commute: the product is matched in either operand order
    return pattern.RewriteRuleSet([pattern.RewriteRule(_reciprocal_sqrt_product, _quotient_by_sqrt, name="rmsnorm_div")],
                                  commute=True)


def apply(model_ir) -> int:
    """Rewrite `model_ir` (an onnx_ir model) in place; returns how many places were rewritten."""
    return rules().apply_to_model(model_ir)
