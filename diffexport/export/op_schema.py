"""The DiffAttention ONNX schema and the torch-op -> ONNX-node translation, both read from the contract.

torch.onnx's dynamo exporter emits a custom-domain node once onnx knows a schema for it, so the
schema is registered (once per process) before exporting; `onnx.checker` and shape inference
then know the op too.
"""

from __future__ import annotations

import onnx
import onnx.defs
from onnx.defs import OpSchema

from diffexport import contract

_FLOAT_TYPES = ["tensor(float)", "tensor(float16)", "tensor(bfloat16)"]


def _schema() -> OpSchema:
    param = OpSchema.FormalParameter
    option = OpSchema.FormalParameterOption
    inputs = [param(t.name, "T" if t.dtype == "T" else "W", t.doc,
                    param_option=option.Optional if t.optional else option.Single)
              for t in contract.INPUTS]
    outputs = [param(t.name, "T", t.doc) for t in contract.OUTPUTS]
    kinds = {"int": OpSchema.AttrType.INT, "float": OpSchema.AttrType.FLOAT}
    attributes = [OpSchema.Attribute(a.name, kinds[a.kind], a.doc, required=a.default is None)
                  if a.default is None else
                  OpSchema.Attribute(a.name, onnx.helper.make_attribute(a.name, a.default), a.doc)
                  for a in contract.ATTRIBUTES]
    attributes += [OpSchema.Attribute(name, OpSchema.AttrType.STRING, doc, required=False)
                   for name, doc in (("plugin_namespace", "TensorRT plugin namespace"),
                                     ("plugin_version", "TensorRT plugin version"))]
    return OpSchema(contract.OP_NAME, contract.ONNX_DOMAIN, contract.OP_VERSION,
                    doc="Differential attention; see docs/OP_SPEC.md", inputs=inputs, outputs=outputs,
                    type_constraints=[("T", _FLOAT_TYPES, "activation dtype"),
                                      ("W", ["tensor(float)"], "norm weight dtype")],
                    attributes=attributes)


def register_schema() -> None:
    """Make the DiffAttention schema known to onnx (idempotent)."""
    if not onnx.defs.has(contract.OP_NAME, contract.OP_VERSION, contract.ONNX_DOMAIN):
        onnx.defs.register_schema(_schema())


def translation_table() -> dict:
    """custom_translation_table entry for torch.onnx.export: our torch op -> one DiffAttention node."""
    import onnxscript
    import torch

    import diffexport.op  # noqa: F401  (registers torch.ops.diffexport.diff_attention)

    domain = onnxscript.values.Opset(contract.ONNX_DOMAIN, contract.OP_VERSION)

    # The exporter binds the torch op's arguments to these parameters by name, so they are
    # spelled out; a test checks they follow contract.ATTRIBUTES.
    def diff_attention(query, key, value, lambda_full, norm_weight, variant, num_heads, num_kv_heads,
                       head_dim, causal, scale, norm, norm_eps, output_scale):
        return getattr(domain, contract.OP_NAME)(
            query, key, value, lambda_full, norm_weight, variant=variant, num_heads=num_heads,
            num_kv_heads=num_kv_heads, head_dim=head_dim, causal=causal, scale=scale, norm=norm,
            norm_eps=norm_eps, output_scale=output_scale)

    return {torch.ops.diffexport.diff_attention.default: diff_attention}
