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

from diffexport.core.errors import DiffExportError

# Initializers with more elements than this stand in as typed graph inputs while shapes are
# inferred: symbolic shape inference copies the model, and it needs only their shapes.
_SHAPE_ONLY_ELEMENTS = 1 << 16


@dataclasses.dataclass
class FusionCounts:
    skip_norms: int  # residual Add + RMSNorm -> SkipSimplifiedLayerNormalization
    norms: int  # RMSNorm alone -> SimplifiedLayerNormalization or RMSNormalization
    packed: int  # groups of MatMuls packed into one
    projections: int = 0  # GroupQueryAttentions whose inputs' column moves are folded into their projection
    quick_gelus: int = 0  # x * Sigmoid(x) -> QuickGelu

    def describe(self) -> str:
        return (f"{self.skip_norms} residual+RMSNorm -> SkipSimplifiedLayerNormalization, {self.norms} more "
                f"RMSNorm fused, {self.packed} MatMul groups packed, {self.projections} attentions' input column "
                f"moves folded into their projection, {self.quick_gelus} SiLU -> QuickGelu")


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
    projections = fold_gqa_projections(fused)
    quick_gelus = fuse_quick_gelu(fused)
    del fused.graph.value_info[:]  # onnxruntime infers again
    return fused, FusionCounts(skip_norms=skip_norms, norms=norms - skip_norms, packed=packed,
                               projections=projections, quick_gelus=quick_gelus)


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
    from onnxruntime.tools.symbolic_shape_infer import SymbolicShapeInference, get_attribute, get_shape_from_sympy_shape

    class ShapeInference(SymbolicShapeInference):
        """onnxruntime's inference, which leaves GroupQueryAttention's probabilities output (qk_output,
        [B, num_heads, S, total]) without a shape and then calls the whole graph incomplete."""

        def _infer_GroupQueryAttention(self, node):  # noqa: N802 (onnxruntime's name for the op's rule)
            super()._infer_GroupQueryAttention(node)
            query = self._try_get_shape(node, 0)
            if len(node.output) > 3 and node.output[3] and query is not None:
                total = get_shape_from_sympy_shape([self._new_symbolic_dim_from_output(node, 3, 3)])[0]
                dtype = self.known_vi_[node.input[0]].type.tensor_type.elem_type
                shape = [query[0], get_attribute(node, "num_heads"), query[1], total]
                self.known_vi_[node.output[3]].CopyFrom(helper.make_tensor_value_info(node.output[3], dtype, shape))

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
    try:  # SymbolicShapeInference.infer_shapes's steps, without its dump of the model into the working folder
        inference = ShapeInference(2**31 - 1, True, False, 0)
        inference._preprocess(skeleton)
        complete = False
        while inference.run_:
            complete = inference._infer_impl()
        inference._update_output_from_vi()
    finally:
        logger.setLevel(level)
    if not complete:
        raise DiffExportError("internal: onnxruntime's shape inference left tensors of the fused graph unknown")
    inferred = inference.out_mp_
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


# Ops that move or zero whole columns of one token's features: a chain of them from a projection's
# output to an input of GroupQueryAttention is a fixed column map, which the weight can hold.
_COLUMN_OPS = {"Reshape", "Transpose", "Mul"}


def _single_reader_chain(graph_nodes, start: str, producers: dict, readers: dict) -> tuple[list, str] | None:
    """From a GQA input back through Reshape/Transpose/constant-Mul nodes, each output read once:
    (the chain's nodes, first to last, and the tensor it starts from), or None."""
    chain, name = [], start
    while name in producers and producers[name].op_type in _COLUMN_OPS and readers.get(name, 0) == 1:
        node = producers[name]
        chain.append(node)
        name = node.input[0]
    return chain[::-1], name


def _token_shape(shape_name: str, width: int, inits: dict, producers: dict,
                 zero_copies: bool = True) -> list[int] | None:
    """The per-token shape a Reshape gives `width` columns: [1, 1, ...] from a constant shape that
    keeps batch and sequence (0, 0, ... without allowzero), or from Concat(batch, sequence, constants...) whose
    trailing constants hold exactly `width` columns (the exporter's head views); else None."""
    if shape_name in inits:
        shape = [int(d) for d in numpy_helper.to_array(inits[shape_name])]
        if shape[:2] != [0, 0] or not zero_copies:  # allowzero: a 0 is a 0, not the input's dimension
            return None
        tail = shape[2:]
    else:
        concat = producers.get(shape_name)
        if concat is None or concat.op_type != "Concat":
            return None
        tail = []
        for name in reversed(concat.input):
            if name not in inits or int(np.prod(tail or [1])) == width:
                break
            tail = [int(d) for d in numpy_helper.to_array(inits[name]).reshape(-1)] + tail
    if tail.count(-1) == 1:
        known = int(np.prod([d for d in tail if d != -1]))
        tail = [width // known if d == -1 else d for d in tail] if known and width % known == 0 else []
    if not tail or min(tail) <= 0 or int(np.prod(tail)) != width:
        return None
    return [1, 1, *tail]


def _column_map(chain: list, width: int, inits: dict, producers: dict) -> tuple[np.ndarray, list[int]] | None:
    """Where each output column of `chain` comes from, for one token: index into the `width` input
    columns, or -1 for a column the chain zeroes; and the chain's output shape for that token
    ([1, 1, ...]). None when the chain is not such a map (it mixes tokens, or scales by anything but
    0 or 1)."""
    probe = np.arange(1, width + 1, dtype=np.float64).reshape(1, 1, width)  # batch 1, one token
    for node in chain:
        attrs = {a.name: helper.get_attribute_value(a) for a in node.attribute}
        if node.op_type == "Reshape":
            shape = _token_shape(node.input[1], probe.size, inits, producers, zero_copies=not attrs.get("allowzero", 0))
            if shape is None:  # batch and sequence not kept as they are: not per token
                return None
            probe = probe.reshape(shape)
        elif node.op_type == "Transpose":
            perm = list(attrs.get("perm", []))
            if perm[:2] != [0, 1]:
                return None
            probe = probe.transpose(perm)
        else:  # Mul by a constant of zeros and ones
            const = next((i for i in node.input if i in inits), None)
            other = next((i for i in node.input if i not in inits), None)
            if const is None or other is None or node.input[0] != other:
                return None
            factor = numpy_helper.to_array(inits[const]).astype(np.float64)
            if not np.isin(factor, (0.0, 1.0)).all():
                return None
            probe = probe * factor
            if probe.shape[:2] != (1, 1):
                return None
    return probe.reshape(-1).astype(np.int64) - 1, list(probe.shape)


def fold_gqa_projections(model: onnx.ModelProto) -> int:
    """In place: where GroupQueryAttention's query, key and value are the three parts of one packed
    projection (MatMul + Split), each reaching it through Reshape/Transpose nodes that only move a
    token's columns (the DIFF map layout: keys in rotary halves, the heads' views), the columns are
    moved in the weight instead and those nodes go. A 0/1 Mul that spreads the queries over the map
    slots stays, behind one Reshape: zero columns in the weight would cost more than the Mul
    (MatMulNBits over 768 more columns per layer: +56% of the q|k|v matmul's time on this CPU,
    int4 and fp32 alike, against a few microseconds for three small nodes). When no part keeps a
    Mul, GQA reads the packed projection itself (key and value inputs empty) and the Split goes
    too. Exact: each column is a copy of a weight column. Returns the attentions folded."""
    graph = model.graph
    inits = {t.name: t for t in graph.initializer}
    producers = {o: n for n in graph.node for o in n.output}
    readers: dict[str, int] = {}
    for node in graph.node:
        for name in node.input:
            readers[name] = readers.get(name, 0) + 1
    for output in graph.output:
        readers[output.name] = readers.get(output.name, 0) + 1
    dropped: set[int] = set()
    replaced: dict[int, list[onnx.NodeProto]] = {}
    folded = 0
    for gqa in [n for n in graph.node if n.op_type == "GroupQueryAttention" and n.domain == "com.microsoft"]:
        if len(gqa.input) < 3 or not all(gqa.input[:3]):
            continue
        chains = [_single_reader_chain(graph.node, name, producers, readers) for name in gqa.input[:3]]
        split = producers.get(chains[0][1])
        if (split is None or split.op_type != "Split" or list(split.output) != [c[1] for c in chains]
                or any(readers.get(o, 0) != 1 for o in split.output) or len(split.input) < 2
                or split.input[1] not in inits):
            continue
        matmul = producers.get(split.input[0])
        axis = next((helper.get_attribute_value(a) for a in split.attribute if a.name == "axis"), 0)
        if (matmul is None or matmul.op_type != "MatMul" or matmul.input[1] not in inits or axis != -1
                or readers.get(split.input[0], 0) != 1 or readers.get(matmul.input[1], 0) != 1):
            continue
        weight = numpy_helper.to_array(inits[matmul.input[1]])
        sizes = [int(s) for s in numpy_helper.to_array(inits[split.input[1]])]
        if weight.ndim != 2 or sum(sizes) != weight.shape[1]:
            continue
        # each chain: the column moves before its first Mul (folded), and the rest (kept)
        cuts = [next((i for i, n in enumerate(chain) if n.op_type == "Mul"), len(chain)) for chain, _ in chains]
        moves = [_column_map(chain[:cut], size, inits, producers) for (chain, _), cut, size in zip(chains, cuts, sizes)]
        if any(m is None or (m[0] < 0).any() for m in moves):
            continue
        parts = np.split(weight, np.cumsum(sizes)[:-1], axis=1)
        name = f"{matmul.name or matmul.output[0]}/gqa_folded"
        moved = np.concatenate([part[:, mapping] for part, (mapping, _) in zip(parts, moves)], axis=1)
        graph.initializer.append(numpy_helper.from_array(moved, f"{name}/weight"))
        new_matmul = helper.make_node("MatMul", [matmul.input[0], f"{name}/weight"], [f"{name}/out"], name=name)
        dropped.update(id(n) for (chain, _), cut in zip(chains, cuts) for n in chain[:cut])
        if all(cut == len(chain) for (chain, _), cut in zip(chains, cuts)):  # nothing kept: GQA's packed input
            replaced[id(matmul)] = [new_matmul]
            dropped.add(id(split))
            gqa.input[0], gqa.input[1], gqa.input[2] = f"{name}/out", "", ""
        else:
            split.input[0] = new_matmul.output[0]
            replaced[id(matmul)] = [new_matmul]
            for slot, ((chain, _), cut, (_, shape)) in enumerate(zip(chains, cuts, moves)):
                if cut == len(chain):
                    gqa.input[slot] = split.output[slot]
                    continue
                view = f"{name}/view{slot}"
                graph.initializer.append(numpy_helper.from_array(np.asarray([0, 0, *shape[2:]], np.int64),
                                                                 f"{view}/shape"))
                reshape = helper.make_node("Reshape", [split.output[slot], f"{view}/shape"], [view], name=view)
                replaced[id(split)] = replaced.get(id(split), [split]) + [reshape]
                kept = chain[cut]
                kept.input[list(kept.input).index(chain[cut - 1].output[0] if cut else split.output[slot])] = view
        folded += 1
    if folded:
        order = [new for n in graph.node if id(n) not in dropped for new in replaced.get(id(n), [n])]
        del graph.node[:]
        graph.node.extend(order)
        used = {i for n in graph.node for i in n.input}
        keep = [t for t in graph.initializer if t.name in used]
        del graph.initializer[:]
        graph.initializer.extend(keep)
    return folded


def fuse_quick_gelu(model: onnx.ModelProto) -> int:
    """In place: x * Sigmoid(x) (SiLU, the SwiGLU gate) as onnxruntime's QuickGelu with alpha 1, one
    kernel instead of two, as onnxruntime-genai's builder writes it. Returns the SiLUs fused."""
    graph = model.graph
    producers = {o: n for n in graph.node for o in n.output}
    readers: dict[str, int] = {}
    for node in graph.node:
        for name in node.input:
            readers[name] = readers.get(name, 0) + 1
    replaced: dict[int, list[onnx.NodeProto]] = {}
    fused = 0
    for mul in graph.node:
        if mul.op_type != "Mul" or mul.domain not in ("", "ai.onnx") or len(mul.input) != 2:
            continue
        for gate, x in ((mul.input[0], mul.input[1]), (mul.input[1], mul.input[0])):
            sigmoid = producers.get(gate)
            if (sigmoid is not None and sigmoid.op_type == "Sigmoid" and sigmoid.input[0] == x
                    and readers.get(gate, 0) == 1 and id(sigmoid) not in replaced):
                replaced[id(sigmoid)] = []
                replaced[id(mul)] = [helper.make_node("QuickGelu", [x], [mul.output[0]], name=f"{mul.name}/quick_gelu",
                                                      domain="com.microsoft", alpha=1.0)]
                fused += 1
                break
    if fused:
        order = [new for n in graph.node for new in replaced.get(id(n), [n])]
        del graph.node[:]
        graph.node.extend(order)
    return fused
