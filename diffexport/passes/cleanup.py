"""Cleanup after rewriting: constant folding, dead-node removal, shape inference, full check.

Model-local functions are NOT inlined here: DiffAttention must stay one node for TensorRT.
"""

from __future__ import annotations

import onnx

from diffexport.core.errors import DiffExportError
from diffexport.core.lazy import lazy_import

op_schema = lazy_import("diffexport.export.op_schema")

# onnxscript rules left out of the cleanup, with the reason.
SKIPPED_REWRITE_RULES = {
    # A two-output pattern: onnxscript matches it by walking the whole graph once per node, so the
    # cleanup grew quadratically (10k nodes: 26 s, 100k: minutes). Merging two Slices into one
    # Split changes no result and nothing downstream of us depends on it.
    "SlicesSplit",
}


def _optimize(model: onnx.ModelProto) -> onnx.ModelProto:
    """onnxscript.optimizer.optimize(model, inline=False) composed from onnxscript's public pieces,
    so that SKIPPED_REWRITE_RULES can stay out: linear in the node count."""
    import onnx_ir as ir
    from onnx_ir.passes import common
    from onnxscript import optimizer, rewriter

    defaults = getattr(rewriter, "_DEFAULT_REWRITE_RULES", None)
    if defaults is None:  # an onnxscript that moved its rule list: its optimizer, quadratic but correct
        return optimizer.optimize(model, inline=False)
    rules = [rule for rule in defaults if rule.name not in SKIPPED_REWRITE_RULES]
    model_ir = ir.serde.deserialize_model(model)
    for _ in range(2):  # as onnxscript's optimizer: folding exposes rewrites and the other way round
        optimizer.fold_constants(model_ir)
        model_ir = rewriter.rewrite(model_ir, pattern_rewrite_rules=rules)
    ir.passes.Sequential(
        common.RemoveUnusedNodesPass(),
        common.LiftConstantsToInitializersPass(lift_all_constants=True, size_limit=0),
        common.LiftSubgraphInitializersToMainGraphPass(),
        common.DeduplicateInitializersPass(),
        common.CommonSubexpressionEliminationPass(),
        common.OutputFixPass(),
        common.NameFixPass(),
    )(model_ir)
    return ir.serde.serialize_model(model_ir)


def cleanup(model: onnx.ModelProto) -> onnx.ModelProto:
    """Fold constants, drop unused nodes/initializers, infer shapes; the result passes onnx.checker's full check."""
    op_schema.register_schema()  # shape inference and the checker must know DiffAttention
    metadata = list(model.metadata_props)
    folded = _optimize(model)
    inferred = onnx.shape_inference.infer_shapes(folded, check_type=True, data_prop=True)
    if not inferred.metadata_props and metadata:
        inferred.metadata_props.extend(metadata)
    try:
        onnx.checker.check_model(inferred, full_check=True)
    except onnx.checker.ValidationError as exc:
        raise DiffExportError(f"the cleaned graph fails onnx.checker: {str(exc).splitlines()[0]}") from None
    return inferred
