"""Cleanup after rewriting: constant folding, dead-node removal, shape inference, full check.

Model-local functions are NOT inlined here: DiffAttention must stay one node for TensorRT.
"""

from __future__ import annotations

import onnx

from diffexport.errors import DiffExportError


def cleanup(model: onnx.ModelProto) -> onnx.ModelProto:
    """Fold constants, drop unused nodes/initializers, infer shapes; the result passes onnx.checker's full check."""
    from onnxscript import optimizer

    from diffexport.export.op_schema import register_schema

    register_schema()  # shape inference and the checker must know DiffAttention
    metadata = list(model.metadata_props)
    folded = optimizer.optimize(model, inline=False)
    inferred = onnx.shape_inference.infer_shapes(folded, check_type=True, data_prop=True)
    if not inferred.metadata_props and metadata:
        inferred.metadata_props.extend(metadata)
    try:
        onnx.checker.check_model(inferred, full_check=True)
    except onnx.checker.ValidationError as exc:
        raise DiffExportError(f"the cleaned graph fails onnx.checker: {str(exc).splitlines()[0]}") from None
    return inferred
