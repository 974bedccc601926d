"""Lower every DiffAttention node to standard ONNX ops, specialised to that node.

For runtimes that run neither our plugin nor model-local functions: each node gets a body with
its attributes as constants, inlined in place; the cleanup pass then folds the attribute plumbing.
"""

from __future__ import annotations

import dataclasses

import onnx
import onnx.inliner

from diffexport.core import contract
from diffexport.core.errors import DiffExportError
from diffexport.export.function_body import BODY_STYLES, MIN_OPSET, build_specialised_function
from diffexport.format.nodes import is_diff_attention, node_attrs

_LOWERED_DOMAIN = "diffexport.lowered"  # private: gone again once inlined


@dataclasses.dataclass
class LoweringResult:
    model: onnx.ModelProto
    lowered: int


def _default_opset(model: onnx.ModelProto) -> int:
    return next((o.version for o in model.opset_import if o.domain in ("", "ai.onnx")), 0)


def lower_diff_attention(model: onnx.ModelProto, style: str = "decomposed") -> LoweringResult:
    """A copy of `model` with every DiffAttention node replaced by its specialised standard-op body."""
    if style not in BODY_STYLES:
        raise DiffExportError(f"unknown body style {style!r}; choose one of {list(BODY_STYLES)}")
    opset = _default_opset(model)
    if opset < MIN_OPSET[style]:
        raise DiffExportError(f"lowering to the {style} body needs the model at opset >= {MIN_OPSET[style]}, "
                              f"it imports opset {opset}")
    model = onnx.ModelProto.FromString(model.SerializeToString())
    selected = []
    for index, node in enumerate(model.graph.node):
        if not is_diff_attention(node):
            continue
        attrs = node_attrs(node)
        inputs = list(node.input)
        while len(inputs) > len(contract.INPUTS) and not inputs[-1]:  # trailing empty = optional input absent
            inputs.pop()
        counts = (len(contract.INPUTS), len(contract.ALL_INPUTS), len(contract.KV_CACHE_INPUTS))
        if len(inputs) not in counts or not all(inputs):
            raise DiffExportError(f"DiffAttention node {node.name or index} has inputs {list(node.input)}; "
                                  f"the contract needs {list(contract.INPUT_NAMES)} "
                                  f"(version 2: + {[t.name for t in contract.OPTIONAL_INPUTS]}, version 3: + "
                                  f"{[t.name for t in contract.KV_SCALES]} too)")
        del node.input[:]
        node.input.extend(inputs)
        name = f"DiffAttention_{index}"
        key_mask, kv_cache = len(inputs) >= len(contract.ALL_INPUTS), len(inputs) == len(contract.KV_CACHE_INPUTS)
        model.functions.append(build_specialised_function(attrs, style, opset, _LOWERED_DOMAIN, name, key_mask,
                                                          kv_cache))
        del node.attribute[:]
        node.op_type, node.domain = name, _LOWERED_DOMAIN
        selected.append((_LOWERED_DOMAIN, name))
    if not selected:
        return LoweringResult(model, 0)
    model.opset_import.append(onnx.helper.make_opsetid(_LOWERED_DOMAIN, 1))
    model = onnx.inliner.inline_selected_functions(model, selected, exclude=False)
    _drop_unused(model)
    return LoweringResult(model, len(selected))


def _drop_unused(model: onnx.ModelProto) -> None:
    """Remove the generic function and opset imports no node refers to any more."""
    used = {n.domain for n in model.graph.node} | {n.domain for f in model.functions for n in f.node}
    keep = [f for f in model.functions if f.domain in used and f.domain != _LOWERED_DOMAIN]
    del model.functions[:]
    model.functions.extend(keep)
    imports = [o for o in model.opset_import if o.domain in ("", "ai.onnx") or o.domain in used]
    del model.opset_import[:]
    model.opset_import.extend(imports)
