"""The DiffAttention ONNX schema, read from the contract (the torch op's translation: `translation`).

torch.onnx's dynamo exporter emits a custom-domain node once onnx knows a schema for it, so the
schema is registered (once per process) before exporting; `onnx.checker` and shape inference
then know the op too.
"""

from __future__ import annotations

import onnx
import onnx.defs
from onnx.defs import OpSchema

from diffexport.core import contract

_FLOAT_TYPES = ["tensor(float)", "tensor(float16)", "tensor(bfloat16)"]


_TYPE_VARS = {"T": "T", "float32": "W", "int64": "M"}
_SPECS = {contract.OP_VERSION: contract.INPUTS, contract.KEY_MASK_VERSION: contract.ALL_INPUTS,
          contract.KV_CACHE_VERSION: contract.KV_CACHE_INPUTS}


def _schema(version: int) -> OpSchema:
    param = OpSchema.FormalParameter
    option = OpSchema.FormalParameterOption
    kv_cache = version == contract.KV_CACHE_VERSION  # key and value are an 8-bit cache's codes ("C")
    inputs = [param(t.name, "C" if kv_cache and t.name in ("key", "value") else _TYPE_VARS[t.dtype], t.doc,
                    param_option=option.Optional if t.optional and not kv_cache else option.Single)
              for t in _SPECS[version]]
    outputs = [param(t.name, "T", t.doc) for t in contract.OUTPUTS]
    kinds = {"int": OpSchema.AttrType.INT, "float": OpSchema.AttrType.FLOAT}
    attributes = [OpSchema.Attribute(a.name, kinds[a.kind], a.doc, required=a.default is None)
                  if a.default is None else
                  OpSchema.Attribute(a.name, onnx.helper.make_attribute(a.name, a.default), a.doc)
                  for a in contract.ATTRIBUTES]
    attributes += [OpSchema.Attribute(name, OpSchema.AttrType.STRING, doc, required=False)
                   for name, doc in (("plugin_namespace", "TensorRT plugin namespace"),
                                     ("plugin_version", "TensorRT plugin version"))]
    constraints = [("T", _FLOAT_TYPES, "activation dtype"), ("W", ["tensor(float)"], "norm weight dtype")]
    if version >= contract.KEY_MASK_VERSION:
        constraints.append(("M", ["tensor(int64)"], "key mask dtype"))
    if kv_cache:
        constraints.append(("C", [f"tensor({t})" for t in contract.KV_CODE_TYPES], "8-bit KV cache code dtype"))
    return OpSchema(contract.OP_NAME, contract.ONNX_DOMAIN, version,
                    doc="Differential attention; see docs/OP_SPEC.md", inputs=inputs, outputs=outputs,
                    type_constraints=constraints, attributes=attributes)


def register_schema() -> None:
    """Make the DiffAttention schemas (version 1, 2 with key_mask, 3 on an 8-bit KV cache) known to onnx
    (idempotent)."""
    for version in _SPECS:
        # has() answers for any version <= the one asked: compare since_version exactly
        if (not onnx.defs.has(contract.OP_NAME, version, contract.ONNX_DOMAIN)
                or onnx.defs.get_schema(contract.OP_NAME, version, contract.ONNX_DOMAIN).since_version != version):
            onnx.defs.register_schema(_schema(version))
