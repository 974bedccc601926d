"""Fusions for onnxruntime-only decoder graphs (`--attention gqa` folders), after the
GroupQueryAttention rewrite. Each is exact and each was measured on int4 decode (docs/BENCHMARKS.md):

  norms    every RMSNorm written out in standard ops (Pow, ReduceMean, Add, Sqrt, Reciprocal, Mul)
           becomes onnxruntime's SimplifiedLayerNormalization, and the residual Add before it joins
           it as SkipSimplifiedLayerNormalization: onnxscript's own ort_fusions rules, with
           onnxruntime's symbolic shape inference giving them the shapes they check. A norm left
           standing alone is written as ONNX RMSNormalization (opset 23, the same computation):
           onnxruntime registers SimplifiedLayerNormalization in the ONNX domain, which onnx.checker
           does not know.
  matmuls  MatMuls that read one input with constant weights of one type (q/k/v projections, gate
           and up) become one MatMul over the weights side by side and a Split: one weight stream
           and one kernel call instead of three or two, what onnxruntime-genai's model builder
           writes for Llama. Weight-only quantisation quantises each column on its own, so the
           packed weight quantises to the same values.
"""

from __future__ import annotations

import dataclasses
import logging

import numpy as np
import onnx
from onnx import helper, numpy_helper

# Initializers with more elements than this stand in as typed graph inputs while shapes are
# inferred: symbolic shape inference copies the model, and it needs only their shapes.
_SHAPE_ONLY_ELEMENTS = 1 << 16


@dataclasses.dataclass
class FusionCounts:
    skip_norms: int  # residual Add + RMSNorm -> SkipSimplifiedLayerNormalization
    norms: int  # RMSNorm alone -> SimplifiedLayerNormalization or RMSNormalization
    packed: int  # groups of MatMuls packed into one

    def describe(self) -> str:
        return (f"{self.skip_norms} residual+RMSNorm -> SkipSimplifiedLayerNormalization, {self.norms} more "
                f"RMSNorm fused, {self.packed} MatMul groups packed")


def fuse_for_onnxruntime(model: onnx.ModelProto) -> tuple[onnx.ModelProto, FusionCounts]:
    """The fused decoder graph (it holds contrib ops: onnxruntime only). Consumes `model`: its large
    weights move into the result one at a time, so the weights are never held twice."""
    import onnx_ir as ir
    from onnxscript.rewriter.ort_fusions import rms_normalization, skip_normalization

    light = _without_large_weights(model)
    _record_inferred_shapes(light)
    graph = ir.from_proto(light)
    del light
    norms = rms_normalization.fuse_rms_normalization(graph)
    skip_norms = skip_normalization.fuse_skip_rms_normalization(graph)
    fused = ir.to_proto(graph)
    del graph
    _move_large_weights(model, fused)
    for node in fused.graph.node:
        if node.op_type == "SimplifiedLayerNormalization" and node.domain in ("", "ai.onnx"):
            node.op_type = "RMSNormalization"  # same attributes (axis, epsilon, stash_type); one output
            del node.output[1:]
    packed = pack_shared_input_matmuls(fused)
    del fused.graph.value_info[:]  # onnxruntime infers again
    return fused, FusionCounts(skip_norms=skip_norms, norms=norms - skip_norms, packed=packed)


_PLACEHOLDER = "diffexport-weight-placeholder"  # never a file: the data is moved back before any read


def _is_large(tensor: onnx.TensorProto) -> bool:
    return int(np.prod(tensor.dims)) > _SHAPE_ONLY_ELEMENTS


def _without_large_weights(model: onnx.ModelProto) -> onnx.ModelProto:
    """A copy of the model whose large initializers are data-less external references (name, type
    and shape kept): the rewrite rules read only small constants."""
    light = onnx.ModelProto()
    for field in ("ir_version", "producer_name", "producer_version", "domain", "model_version", "doc_string"):
        setattr(light, field, getattr(model, field))
    light.opset_import.extend(model.opset_import)
    light.metadata_props.extend(model.metadata_props)
    light.functions.extend(model.functions)
    graph = light.graph
    graph.name = model.graph.name
    for field in ("node", "input", "output", "value_info"):
        getattr(graph, field).extend(getattr(model.graph, field))
    for tensor in model.graph.initializer:
        if _is_large(tensor):
            stub = graph.initializer.add(name=tensor.name, data_type=tensor.data_type, dims=tensor.dims)
            stub.data_location = onnx.TensorProto.EXTERNAL
            stub.external_data.add(key="location", value=_PLACEHOLDER)
        else:
            graph.initializer.append(tensor)
    return light


def _move_large_weights(source: onnx.ModelProto, fused: onnx.ModelProto) -> None:
    """Each placeholder in `fused` gets its weight from `source`, which lets go of it at once."""
    slots = {t.name: t for t in fused.graph.initializer
             if t.data_location == onnx.TensorProto.EXTERNAL and any(e.value == _PLACEHOLDER for e in t.external_data)}
    weights = source.graph.initializer
    for index in range(len(weights) - 1, -1, -1):
        slot = slots.pop(weights[index].name, None)
        if slot is not None:
            slot.CopyFrom(weights[index])
        del weights[index]
    if slots:  # a rule dropped a node that read it: the weight is no longer used
        keep = [t for t in fused.graph.initializer if t.name not in slots]
        del fused.graph.initializer[:]
        fused.graph.initializer.extend(keep)


def _record_inferred_shapes(model: onnx.ModelProto) -> None:
    """onnxruntime's symbolic shape inference into the model's value_info (the onnxscript rules check
    shapes), inferred on a skeleton whose large weights are typed graph inputs."""
    from onnxruntime.tools.symbolic_shape_infer import SymbolicShapeInference

    skeleton = onnx.ModelProto(ir_version=model.ir_version)
    skeleton.opset_import.extend(model.opset_import)
    skeleton.functions.extend(model.functions)
    graph = skeleton.graph
    graph.name = model.graph.name
    graph.node.extend(model.graph.node)
    graph.input.extend(model.graph.input)
    graph.output.extend(model.graph.output)
    for tensor in model.graph.initializer:
        if _is_large(tensor):
            graph.input.append(helper.make_tensor_value_info(tensor.name, tensor.data_type, list(tensor.dims)))
        else:
            graph.initializer.append(tensor)
    logger = logging.getLogger("onnxruntime.tools.symbolic_shape_infer")
    level = logger.level
    logger.setLevel(logging.ERROR)  # its notes on symbolic dims it cannot order are not the user's business
    try:
        inferred = SymbolicShapeInference.infer_shapes(skeleton, auto_merge=True)
    finally:
        logger.setLevel(level)
    del model.graph.value_info[:]
    model.graph.value_info.extend(inferred.graph.value_info)


def pack_shared_input_matmuls(model: onnx.ModelProto) -> int:
    """In place: MatMuls reading one input with 2-D constant weights of one type, each read by that
    MatMul alone, as one MatMul over the concatenated weights and a Split. Returns the groups packed."""
    graph = model.graph
    inits = {t.name: t for t in graph.initializer}
    readers: dict[str, int] = {}
    for node in graph.node:
        for name in node.input:
            readers[name] = readers.get(name, 0) + 1
    groups: dict[str, list[onnx.NodeProto]] = {}
    for node in graph.node:
        weight = inits.get(node.input[1]) if node.op_type == "MatMul" and node.domain in ("", "ai.onnx") else None
        if weight is not None and len(weight.dims) == 2 and readers[weight.name] == 1:
            groups.setdefault(node.input[0], []).append(node)
    replaced: dict[int, list[onnx.NodeProto]] = {}
    packed = 0
    for source, nodes in groups.items():
        weights = [inits[n.input[1]] for n in nodes]
        if len(nodes) < 2 or len({(w.data_type, w.dims[0]) for w in weights}) != 1:
            continue
        name = f"packed/{nodes[0].name or nodes[0].output[0]}"
        arrays = [numpy_helper.to_array(w) for w in weights]
        gone = {w.name for w in weights}
        for index in [i for i, t in enumerate(graph.initializer) if t.name in gone][::-1]:
            del graph.initializer[index]  # freed now, not after every group is packed
        graph.initializer.append(numpy_helper.from_array(np.concatenate(arrays, axis=1), f"{name}/weight"))
        sizes = numpy_helper.from_array(np.asarray([a.shape[1] for a in arrays], np.int64), f"{name}/sizes")
        del arrays
        graph.initializer.append(sizes)
        matmul = helper.make_node("MatMul", [source, f"{name}/weight"], [f"{name}/out"], name=name)
        split = helper.make_node("Split", [f"{name}/out", sizes.name], [n.output[0] for n in nodes],
                                 name=f"{name}/split", axis=-1)
        replaced[id(nodes[0])] = [matmul, split]
        for n in nodes[1:]:
            replaced[id(n)] = []
        packed += 1
    if packed:
        order = [new for n in graph.node for new in replaced.get(id(n), [n])]
        del graph.node[:]
        graph.node.extend(order)
    return packed
