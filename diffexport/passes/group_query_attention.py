"""KV-cache decoders for onnxruntime: every DiffAttention node as onnxruntime's GroupQueryAttention.

Why: onnxruntime runs a DiffAttention node through its standard-op function body, about 60 small
kernels per layer and step, and its cache grows by a Concat (the whole cache copied each step)
followed by Transposes of every cached token into head-major MatMul operands. Its contrib kernel
`com.microsoft.GroupQueryAttention` reads a head-major (BNSH) cache in place, inside
onnxruntime-genai's shared past/present buffer. At int4 weights, where the matmuls no longer hide
the rest of a step, this is the difference docs/BENCHMARKS.md measures.

The mapping is exact (no approximation):
  V1  GQA with head size D, the 2H query maps map-major over 2*Hkv kv heads: kv head (m, g) holds
      map m's key of kv-group g and half m of its 2D value. GQA gives each map the product with its
      own value half (A) and, through qk_output, its probabilities; the other half is one MatMul of
      the probabilities (kv halves swapped) with the value buffer in place (X), so every logit is
      q1.K1 or q2.K2 and O = [A1 - lambda*X2, X1 - lambda*A2] over the halves: the Llama's attention
      work per cached token plus one product with half the value.
  V2  one key and one value of width D per kv-group, shared by both maps: GQA with head size D and
      the 2H query maps as they are.
  The logit scale is the op's (1/sqrt(D) by default), not GQA's 1/sqrt(head size). Then
  O1 - lambda*O2, the per-head RMSNorm (RMSNormalization, opset 23) with norm_weight*output_scale
  folded into one weight (norm=0: one Mul), and the [B, S, H*Dv] output the rest of the graph reads.
Rotary embedding inside GroupQueryAttention (do_rotary, when the rest of the graph rotates q and k
as the exporter writes it, and the rewrite is told the context length): the rotate-half subgraphs
go, GQA rotates the projections itself from cos/sin caches of the graph's own frequencies: every map
is a D-wide head rotated in halves, so every pair meets its own frequency, and the dot products are
those of the model. Positions: GQA's position_ids input,
each token's cache slot less the padding slots after its row's first real token. Rotary logits
depend only on the distance between query and key, so left padding (slots counted from the first
slot, as GQA counts a prompt) and a right-padded prompt (onnxruntime-genai's batches: padding
between prompt and answer, which GQA's own slot count would put between them) both give the
model's distances for every real token; the results agree to rounding (padded rows are masked or
zeroed either way). A prompt with padding inside it is not such a batch: its prompt step is
rotated by slot.
Cache: [B, kv heads, T, D] per layer (V1: 2 x Hkv), the same bytes per token as the token-major cache. GQA has
no key mask, so left padding becomes its attention_bias (a large negative number on padded keys,
finite so that a padded query row stays finite), a query row that sees no key gets zeros as the
contract says, and every row's seqlens_k is T - 1 (padded slots hold cache positions like real
tokens). Positions in the rest of the graph were taken from the past's shape; with a shared buffer
that shape is the buffer's, so those Shape nodes read [B, 1, T - S, W] from the attention mask.

Only graphs written by `diffexport onnx --kv-cache` are rewritten; anything else is refused with
the reason. The result has no DiffAttention node: it is for onnxruntime (CPU, CUDA), not TensorRT.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Callable

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

from diffexport.core import contract
from diffexport.core.contract import VARIANT_V1
from diffexport.core.errors import DiffExportError
from diffexport.format import names
from diffexport.format.nodes import is_diff_attention, live_nodes, names_read, node_attrs
from diffexport.passes.onnxruntime_fusions import fuse_for_onnxruntime

GQA_DOMAIN = "com.microsoft"
RMS_NORM_OPSET = 23  # RMSNormalization entered the default domain at opset 23
# Added to the logits of padded keys: exp() of it is exactly 0 next to any real logit, and it stays
# finite (a fully padded row gives a uniform average, not NaN that would reach the cache).
PAD_BIAS = {TensorProto.FLOAT: -1e30, TensorProto.FLOAT16: -3e4}
QK_OUTPUT_SOFTMAX = 2  # GroupQueryAttention's qk_output mode: the probabilities (onnxruntime >= 1.23)
SLICE_OVER = 3  # V1's other value half: copy the tokens' rows when the buffer holds over 3x as many


@dataclasses.dataclass
class GqaResult:
    model: onnx.ModelProto
    layers: int
    num_kv_heads: int
    head_size: int
    rotary: str  # "inside GroupQueryAttention" or why the graph's own rotary nodes stayed


@dataclasses.dataclass
class _Rope:
    """The graph's rotary frequencies (shared by every layer): Cos/Sin of positions * inv_freq."""
    cos: str  # [B, S, 1, D/2] as the rotate-half Muls read them
    sin: str
    inv_freq: np.ndarray  # [D/2] float32
    scale: float = 1.0  # YaRN's attention factor on cos and sin (1: none)


def _refuse(why: str) -> DiffExportError:
    return DiffExportError(f"cannot rewrite for GroupQueryAttention: {why}")


class _Graph:
    """Producers/consumers of a graph and a builder of uniquely named nodes and constants."""

    def __init__(self, model: onnx.ModelProto):
        self.graph = model.graph
        self.nodes = list(self.graph.node)  # the objects every map below refers to (ids stay valid)
        self.producer = {o: n for n in self.nodes for o in n.output}
        self.consumers: dict[str, list[onnx.NodeProto]] = {}
        for n in self.nodes:
            for name in n.input:
                self.consumers.setdefault(name, []).append(n)
        self.initializers = {t.name: t for t in self.graph.initializer}
        taken = {n.name for n in self.nodes} | set(self.producer) | set(self.initializers) \
            | {i.name for i in self.graph.input}
        self._taken = taken
        self._count = 0

    def fresh(self, hint: str) -> str:
        while True:
            self._count += 1
            name = f"gqa/{hint}_{self._count}"
            if name not in self._taken:
                self._taken.add(name)
                return name

    def node(self, op: str, inputs: list[str], outputs: int | list[str] = 1, domain: str = "", **attrs):
        names = [self.fresh(op.lower()) for _ in range(outputs)] if isinstance(outputs, int) else outputs
        node = helper.make_node(op, inputs, names, name=self.fresh(op), domain=domain, **attrs)
        return node, (names[0] if len(names) == 1 else names)

    def const(self, array: np.ndarray, hint: str = "const") -> str:
        name = self.fresh(hint)
        self.graph.initializer.append(numpy_helper.from_array(np.asarray(array), name))
        return name

    def only_producer(self, name: str, op: str, what: str) -> onnx.NodeProto:
        node = self.producer.get(name)
        if node is None or node.op_type != op or node.domain not in ("", "ai.onnx"):
            raise _refuse(f"{what} is not made by {op} as `diffexport onnx --kv-cache` writes it")
        return node


def _value_type(graph: onnx.GraphProto, name: str) -> int:
    for value in list(graph.input) + list(graph.output) + list(graph.value_info):
        if value.name == name:
            return value.type.tensor_type.elem_type
    raise _refuse(f"no type recorded for {name}")


def _ints(g: _Graph, values: list[int]) -> str:
    return g.const(np.asarray(values, np.int64), "shape")


def rewrite_decoder(model: onnx.ModelProto, rotary_positions: int | None = None) -> GqaResult:
    """A copy of a KV-cache decoder graph with every DiffAttention node as GroupQueryAttention and a
    head-major cache interface (past/present [B, Hkv, T, head size]) for a shared buffer.
    rotary_positions: the context length (the rows of the cos/sin caches) to move the rotary
    embedding into GroupQueryAttention; None keeps the graph's own rotary nodes."""
    model = onnx.ModelProto.FromString(model.SerializeToString())
    g = _Graph(model)
    inputs = [i.name for i in model.graph.input]
    layers = names.cache_layers(inputs)
    if layers == 0 or inputs != names.decoder_input_names(layers):
        raise _refuse(f"the graph's inputs {inputs[:4]}... are not a KV-cache decoder's "
                      f"(export it with `diffexport onnx CKPT --kv-cache`)")
    attention = [n for n in g.nodes if is_diff_attention(n)]
    if len(attention) != layers:
        raise _refuse(f"{len(attention)} DiffAttention nodes for {layers} layers (the baseline Transformer has "
                      "none: its folder runs as it is)")
    dtype = _value_type(model.graph, names.PAST_KEY % 0)
    if dtype not in PAD_BIAS:
        raise _refuse(f"cache type {TensorProto.DataType.Name(dtype)}: GroupQueryAttention here takes float32 or "
                      "float16")

    new_nodes: list[onnx.NodeProto] = []
    lengths, bias, row_scale, past_shape = _shared_inputs(g, new_nodes, dtype)
    shared = len(new_nodes)
    replaced: dict[int, list[onnx.NodeProto]] = {}  # id(DiffAttention node) -> the nodes replacing it
    dead: set[int] = set()  # ids of the token-major cache plumbing's nodes
    kv_heads = head_size = None
    seen_layers = set()
    rope, rotary = _rope_plan(g, attention, rotary_positions)
    shared_v1: dict = {}  # the other value half's buffer rows and padding, made by the first V1 layer
    caches = _rope_caches(g, rope, dtype, rotary_positions) if rope else None
    for node in attention:
        attrs = node_attrs(node)
        if not attrs.causal:
            raise _refuse(f"node {node.name} is not causal; GroupQueryAttention decodes causally")
        if len(node.input) != len(contract.ALL_INPUTS) or node.input[5] != names.ATTENTION_MASK:
            raise _refuse(f"node {node.name} does not take the attention mask as its key_mask")
        query, key, value, lam, weight = node.input[:5]
        layer, new_key, key_plumbing = _cache_source(g, key, "key")
        layer_v, new_value, value_plumbing = _cache_source(g, value, "value")
        if layer != layer_v or layer in seen_layers:
            raise _refuse(f"node {node.name} reads the key of layer {layer} and the value of layer {layer_v}")
        seen_layers.add(layer)
        dead.update(id(n) for n in key_plumbing + value_plumbing)
        heads = attrs.num_kv_heads * (2 if attrs.variant == VARIANT_V1 else 1)  # V1: [K1s, K2s], [V lows, V highs]
        if attrs.value_dim * attrs.num_kv_heads != heads * attrs.head_dim:
            raise _refuse(f"node {node.name}: value head {attrs.value_dim} is not {heads // attrs.num_kv_heads} "
                          f"key heads of {attrs.head_dim}")
        if kv_heads not in (None, heads) or head_size not in (None, attrs.head_dim):
            raise _refuse("layers with different cache shapes (one genai_config describes all layers)")
        kv_heads, head_size = heads, attrs.head_dim
        replaced[id(node)] = _attention_nodes(g, node, attrs, dtype, query, new_key, new_value, lam, weight,
                                               layer, lengths, bias, row_scale, rope, caches, shared_v1)

    for n in g.nodes:
        if id(n) in replaced:
            new_nodes.extend(replaced[id(n)])
        elif id(n) not in dead:
            new_nodes.append(n)
    new_nodes[shared:shared] = _redirect_past_shapes(g, new_nodes, past_shape)
    del model.graph.node[:]
    model.graph.node.extend(live_nodes(new_nodes, [o.name for o in model.graph.output]))  # replaced nodes go
    _set_cache_types(model.graph, kv_heads, head_size)
    _finish_imports(model)
    _drop_unused_initializers(model.graph)
    return GqaResult(model, layers, kv_heads, head_size, rotary)


def rewrite_decoder_file(model_path: Path, external: bool, context_length: int,
                         log: Callable[[str], None]) -> None:
    """The gqa format's post-export rewrite (export.decoder.DecoderRewrite): the checked DiffAttention
    graph at model_path, rewritten and fused for onnxruntime in place, inside the export's temporary
    folder, then checked again."""

    model = onnx.load(str(model_path))  # weights too: they are written again below
    result = rewrite_decoder(model, rotary_positions=context_length)
    del model
    log(f"rewriting     {result.layers} DiffAttention -> GroupQueryAttention (cache [batch, {result.num_kv_heads}, "
        f"past, {result.head_size}], shared buffer; rotary {result.rotary})")
    fused, counts = fuse_for_onnxruntime(result.model)
    del result
    log(f"fusing        {counts.describe()}")
    data = model_path.with_name(model_path.name + ".data")
    if data.exists():
        data.unlink()  # onnx appends to an existing data file; its weights are in memory now
    onnx.save(fused, str(model_path), save_as_external_data=external, location=data.name)
    try:
        onnx.checker.check_model(str(model_path), full_check=True)
    except onnx.checker.ValidationError as exc:
        raise DiffExportError(f"internal: the GroupQueryAttention graph fails onnx.checker: {str(exc).splitlines()[0]}")


def _shared_inputs(g: _Graph, nodes: list, dtype: int):
    """(seqlens_k [B] int32 = T - 1, total_sequence_length int32 = T, query_seqlens [B] int32 = S,
    position_ids [B, S] int64 for GQA's rotary), attention_bias [B, 1, S, T], the row scale
    [B, S, 1, 1, 1] (0 for a query row that sees no key) and the pieces of the token-major past
    shape [B, 1, T - S, W], all from the attention mask."""
    mask = names.ATTENTION_MASK
    n, batch = g.node("Shape", [mask], start=0, end=1)
    nodes.append(n)
    n, total = g.node("Shape", [mask], start=1, end=2)
    nodes.append(n)
    n, seq = g.node("Shape", [names.INPUT_IDS], start=1, end=2)
    nodes.append(n)
    n, last = g.node("Sub", [total, _ints(g, [1])])
    nodes.append(n)
    n, last_b = g.node("Expand", [last, batch])
    nodes.append(n)
    n, seqlens_k = g.node("Cast", [last_b], to=TensorProto.INT32)
    nodes.append(n)
    n, total_scalar = g.node("Squeeze", [total, _ints(g, [0])])
    nodes.append(n)
    n, total_length = g.node("Cast", [total_scalar], to=TensorProto.INT32)
    nodes.append(n)
    # every row's chunk is S tokens: GQA takes chunks after the prompt (S > 1 with a past) for
    # batches only when told so (its query_seqlens input)
    n, seq_b = g.node("Expand", [seq, batch])
    nodes.append(n)
    n, query_seqlens = g.node("Cast", [seq_b], to=TensorProto.INT32)
    nodes.append(n)
    # bias: 0 where the mask is 1, PAD_BIAS where it is 0; [B, T] -> [B, 1, S, T]
    n, padded = g.node("Equal", [mask, g.const(np.zeros((), np.int64), "zero")])
    nodes.append(n)
    np_type = helper.tensor_dtype_to_np_dtype(dtype)
    n, flat = g.node("Where", [padded, g.const(np.asarray(PAD_BIAS[dtype], np_type), "pad_bias"),
                              g.const(np.zeros((), np_type), "no_bias")])
    nodes.append(n)
    n, bias4 = g.node("Unsqueeze", [flat, _ints(g, [1, 2])])
    nodes.append(n)
    n, bias_shape = g.node("Concat", [batch, _ints(g, [1]), seq, total], axis=0)
    nodes.append(n)
    n, bias = g.node("Expand", [bias4, bias_shape])
    nodes.append(n)
    n, past_len = g.node("Sub", [total, seq])
    nodes.append(n)
    # the contract's rule for a query row that sees no key (a left-padding row): output zeros, as
    # the function body and the kernel give (GQA would average the masked keys)
    n, count = g.node("CumSum", [mask, g.const(np.asarray(1, np.int64), "axis")])
    nodes.append(n)
    n, row_count = g.node("Slice", [count, past_len, total, _ints(g, [1])])
    nodes.append(n)
    n, sees = g.node("Greater", [row_count, g.const(np.zeros((), np.int64), "zero")])
    nodes.append(n)
    n, sees_t = g.node("Cast", [sees], to=dtype)
    nodes.append(n)
    n, row_scale = g.node("Unsqueeze", [sees_t, _ints(g, [2, 3, 4])])
    nodes.append(n)  # [B, S, 1, 1, 1]
    # rotary positions: the slot up to a row's first real token (a prompt is rotated by slot, from
    # position 0), then the leading padding plus the real count - 1: the slot less the padding
    # slots after the first real token (a right-padded prompt's answer goes on from the prompt)
    n, before_first = g.node("Equal", [count, g.const(np.zeros((), np.int64), "zero")])
    nodes.append(n)
    n, before_count = g.node("Cast", [before_first], to=TensorProto.INT64)
    nodes.append(n)
    n, leading = g.node("ReduceSum", [before_count, _ints(g, [1])], keepdims=1)
    nodes.append(n)
    n, shifted = g.node("Add", [count, leading])
    nodes.append(n)
    n, real_positions = g.node("Sub", [shifted, g.const(np.asarray(1, np.int64), "one")])
    nodes.append(n)
    n, mask_shape = g.node("Shape", [mask])
    nodes.append(n)
    n, ones = g.node("ConstantOfShape", [mask_shape], value=numpy_helper.from_array(np.ones(1, np.int64)))
    nodes.append(n)
    n, slot_count = g.node("CumSum", [ones, g.const(np.asarray(1, np.int64), "axis")])
    nodes.append(n)
    n, slots = g.node("Sub", [slot_count, g.const(np.asarray(1, np.int64), "one")])
    nodes.append(n)
    n, positions = g.node("Where", [before_first, slots, real_positions])
    nodes.append(n)
    n, position_ids = g.node("Slice", [positions, past_len, total, _ints(g, [1])])
    nodes.append(n)
    return (seqlens_k, total_length, query_seqlens, position_ids), bias, row_scale, (batch, past_len)


def _cache_source(g: _Graph, name: str, kind: str):
    """The exporter's cache plumbing behind a DiffAttention key/value input:
    Squeeze(present, [1]) <- Concat(past, Unsqueeze(new, 1), axis=2) -> (layer, new [B, S, W], nodes)."""
    squeeze = g.only_producer(name, "Squeeze", f"the DiffAttention {kind} input {name}")
    present = squeeze.input[0]
    concat = g.only_producer(present, "Concat", f"{present}")
    past, fresh = (list(concat.input) + ["", ""])[:2]
    pattern = names.PRESENT_KEY if kind == "key" else names.PRESENT_VALUE
    past_pattern = names.PAST_KEY if kind == "key" else names.PAST_VALUE
    layer = next((i for i in range(len(g.graph.input)) if pattern % i == present), None)
    if layer is None or past != past_pattern % layer or len(concat.input) != 2:
        raise _refuse(f"{present} is not Concat({past_pattern % (layer or 0)}, new {kind}s)")
    unsqueeze = g.only_producer(fresh, "Unsqueeze", f"the new {kind}s of layer {layer}")
    others = [c for c in g.consumers.get(present, []) if c is not squeeze]
    if others or len(g.consumers.get(fresh, [])) != 1 or len(g.consumers.get(name, [])) != 1:
        raise _refuse(f"layer {layer}'s {kind} cache is read by more than its attention")
    return layer, unsqueeze.input[0], [squeeze, concat, unsqueeze]


def _attention_nodes(g: _Graph, node, attrs, dtype, query, new_key, new_value, lam, weight, layer,
                     lengths, bias, row_scale, rope: _Rope | None, caches, shared: dict) -> list:
    seqlens_k, total_length, query_seqlens, position_ids = lengths
    H, D = attrs.num_heads, attrs.head_dim
    v1 = attrs.variant == VARIANT_V1
    np_type = helper.tensor_dtype_to_np_dtype(dtype)
    nodes = []
    if rope is not None:  # the heads [B, S, n, D] before the rotate-half nodes: GQA rotates them
        query, new_key = _unrotated(g, query, rope), _unrotated(g, new_key, rope)
        if not v1:
            n, query = g.node("Reshape", [query, _ints(g, [0, 0, -1])])
            nodes.append(n)
            n, new_key = g.node("Reshape", [new_key, _ints(g, [0, 0, -1])])
            nodes.append(n)
    if v1:  # maps and kv heads map-major: (h, map, D) -> (map, h, D); values (g, half, D)
        query = _map_major(g, nodes, query, H, D)
        new_key = _map_major(g, nodes, new_key, attrs.num_kv_heads, D)
        new_value = _map_major(g, nodes, new_value, attrs.num_kv_heads, D)
    cos_cache, sin_cache = caches or ("", "")
    outputs = [g.fresh("maps"), names.PRESENT_KEY % layer, names.PRESENT_VALUE % layer]
    if v1:
        outputs.append(g.fresh("probabilities"))
    n, gqa_out = g.node(
        "GroupQueryAttention", [query, new_key, new_value, names.PAST_KEY % layer, names.PAST_VALUE % layer,
                                seqlens_k, total_length, cos_cache, sin_cache, position_ids if rope else "", bias,
                                "", "", "", "", "", query_seqlens],
        outputs, domain=GQA_DOMAIN, num_heads=2 * H, kv_num_heads=attrs.num_kv_heads * (2 if v1 else 1),
        scale=attrs.effective_scale, do_rotary=int(rope is not None), rotary_interleaved=0,
        **({"qk_output": QK_OUTPUT_SOFTMAX} if v1 else {}))
    nodes.append(n)
    maps = gqa_out[0]
    if v1:
        diff_all = _v1_combined(g, nodes, gqa_out, lam, H, attrs.num_kv_heads, D, dtype, shared)
    else:  # lambda per token and head
        n, per_map = g.node("Reshape", [maps, _ints(g, [0, 0, H, 2, D])])
        nodes.append(n)
        n, (o1, o2) = g.node("Split", [per_map], 2, axis=3, num_outputs=2)
        nodes.append(n)
        n, lam4 = g.node("Reshape", [lam, _ints(g, [0, 0, H, 1, 1])])
        nodes.append(n)
        n, weighted = g.node("Mul", [lam4, o2])
        nodes.append(n)
        n, diff_all = g.node("Sub", [o1, weighted])
        nodes.append(n)
    n, diff = g.node("Mul", [diff_all, row_scale])
    nodes.append(n)
    folded = numpy_helper.to_array(g.initializers[weight]).astype(np.float32) * np.float32(attrs.output_scale) \
        if weight in g.initializers else None
    if folded is None:
        raise _refuse(f"node {node.name}: norm_weight {weight} is not a constant")
    scale = g.const(folded.astype(np_type), "head_norm_weight")
    if attrs.norm:
        n, normed = g.node("RMSNormalization", [diff, scale], axis=-1, epsilon=attrs.norm_eps)
    else:
        n, normed = g.node("Mul", [diff, scale])
    nodes.append(n)
    n, _ = g.node("Reshape", [normed, _ints(g, [0, 0, -1])], [node.output[0]])
    nodes.append(n)
    return nodes


def _map_major(g: _Graph, nodes: list, x: str, heads: int, size: int) -> str:
    """[B, S, heads * 2 * size] in (head, map, size) order -> (map, head, size): columns moved only
    (fold_gqa_projections moves them in the projection's weight)."""
    n, x5 = g.node("Reshape", [x, _ints(g, [0, 0, heads, 2, size])])
    nodes.append(n)
    n, moved = g.node("Transpose", [x5], perm=[0, 1, 3, 2, 4])
    nodes.append(n)
    n, flat = g.node("Reshape", [moved, _ints(g, [0, 0, -1])])
    nodes.append(n)
    return flat


def _v1_combined(g: _Graph, nodes: list, gqa_out: list, lam: str, H: int, kv_groups: int, D: int, dtype: int,
                 shared: dict) -> str:
    """O1 - lambda*O2 of every DIFF V1 head, [B, S, H, 1, 2D], from GroupQueryAttention at the maps'
    own width. Kv head (m, g) holds map m's key of group g and half m of its value, so GQA gives each
    map the product with its own value half (A); the other half is its probabilities (qk_output)
    times the value buffer with the kv halves swapped, one MatMul in place (X). The buffer's rows past
    the tokens get exact zero weights: they are read (probabilities padded to the buffer) while the
    buffer holds under SLICE_OVER times the tokens, else the tokens' rows are copied first (an If)."""
    maps, _, present_value, probabilities = gqa_out
    if not shared:  # one length test for every layer: all buffers have the same rows
        n, tokens = g.node("Shape", [probabilities], start=3)
        nodes.append(n)
        n, rows = g.node("Shape", [present_value], start=2, end=3)
        nodes.append(n)
        n, spare = g.node("Sub", [rows, tokens])
        nodes.append(n)
        n, pads = g.node("Concat", [_ints(g, [0] * 7), spare], axis=0)
        nodes.append(n)
        n, tripled = g.node("Mul", [tokens, _ints(g, [SLICE_OVER])])
        nodes.append(n)
        n, roomy = g.node("Less", [tripled, rows])
        nodes.append(n)
        n, copy_rows = g.node("Squeeze", [roomy, _ints(g, [0])])
        nodes.append(n)
        shared.update(tokens=tokens, pads=pads, copy_rows=copy_rows)
    # probabilities [B, 2H, S, T] -> [B, 2Hkv, (H/Hkv) S, T]; then kv heads (m, g) <- (1 - m, g)
    n, by_kv = g.node("Reshape", [probabilities, _ints(g, [0, 2 * kv_groups, -1, 0])])
    nodes.append(n)
    swap = list(range(kv_groups, 2 * kv_groups)) + list(range(kv_groups))
    n, swapped = g.node("Gather", [by_kv, _ints(g, swap)], axis=1)
    nodes.append(n)

    def branch(kind: str) -> onnx.GraphProto:
        out = g.fresh(f"other_{kind}")
        if kind == "slice":
            start, axis, rows = g.fresh("start"), g.fresh("axis"), g.fresh("rows")
            body = [helper.make_node("Constant", [], [start], value=numpy_helper.from_array(np.zeros(1, np.int64))),
                    helper.make_node("Constant", [], [axis], value=numpy_helper.from_array(np.full(1, 2, np.int64))),
                    helper.make_node("Slice", [present_value, start, shared["tokens"], axis], [rows])]
            weights = swapped
        else:
            rows, weights = present_value, g.fresh("padded")
            body = [helper.make_node("Pad", [swapped, shared["pads"]], [weights])]
        if dtype == TensorProto.FLOAT:
            body.append(helper.make_node("MatMul", [weights, rows], [out]))
        else:  # a float32 product, as GroupQueryAttention accumulates its own half
            wide = [g.fresh("wide"), g.fresh("wide"), g.fresh("wide")]
            body += [helper.make_node("Cast", [weights], [wide[0]], to=TensorProto.FLOAT),
                     helper.make_node("Cast", [rows], [wide[1]], to=TensorProto.FLOAT),
                     helper.make_node("MatMul", wide[:2], [wide[2]]),
                     helper.make_node("Cast", [wide[2]], [out], to=dtype)]
        return helper.make_graph(body, g.fresh(kind), [], [helper.make_tensor_value_info(out, dtype, None)])
    n, other = g.node("If", [shared["copy_rows"]], then_branch=branch("slice"), else_branch=branch("pad"))
    nodes.append(n)
    # X' [B, 2Hkv, (H/Hkv) S, D] -> [B, S, H, map, D], X'[m] = P(map 1 - m) V(half m); A likewise
    n, other5 = g.node("Reshape", [other, _ints(g, [0, 2, H, -1, D])])
    nodes.append(n)
    n, other_t = g.node("Transpose", [other5], perm=[0, 3, 2, 1, 4])
    nodes.append(n)
    n, own5 = g.node("Reshape", [maps, _ints(g, [0, 0, 2, H, D])])
    nodes.append(n)
    n, own_t = g.node("Transpose", [own5], perm=[0, 1, 3, 2, 4])
    nodes.append(n)
    n, sources = g.node("Concat", [own_t, other_t], axis=3)  # [B, S, H, 4, D]: A0 A1 X'0 X'1
    nodes.append(n)
    # low half A0 - lambda X'0, high half X'1 - lambda A1, as one MatMul; lambda depends on weights
    # only, so onnxruntime folds the coefficients when the session opens
    n, negated = g.node("Neg", [lam])
    nodes.append(n)
    n, neg_1 = g.node("Reshape", [negated, _ints(g, [1])])
    nodes.append(n)
    np_type = helper.tensor_dtype_to_np_dtype(dtype)
    one, zero = g.const(np.ones(1, np_type), "one"), g.const(np.zeros(1, np_type), "zero")
    n, flat = g.node("Concat", [one, zero, neg_1, zero, zero, neg_1, zero, one], axis=0)
    nodes.append(n)
    n, coefficients = g.node("Reshape", [flat, _ints(g, [2, 4])])
    nodes.append(n)
    n, halves = g.node("MatMul", [coefficients, sources])
    nodes.append(n)
    n, combined = g.node("Reshape", [halves, _ints(g, [0, 0, H, 1, 2 * D])])
    nodes.append(n)
    return combined


def _rope_plan(g: _Graph, attention: list, rotary_positions: int | None) -> tuple[_Rope | None, str]:
    """The graph's rotary frequencies when every layer's q and k are rotated by the exporter's
    rotate-half subgraph (so GQA can rotate them instead); else None and why they stay."""
    if rotary_positions is None:
        return None, "kept in the graph (no context length given)"
    cos_nodes = [n for n in g.nodes if n.op_type == "Cos"]
    sin_nodes = [n for n in g.nodes if n.op_type == "Sin"]
    if len(cos_nodes) != 1 or len(sin_nodes) != 1 or cos_nodes[0].input[0] != sin_nodes[0].input[0]:
        return None, "kept in the graph (not one Cos/Sin pair of shared frequencies)"
    freqs = g.producer.get(cos_nodes[0].input[0])
    inv_freq = None
    if freqs is not None and freqs.op_type == "Mul":
        inv_freq = next((numpy_helper.to_array(g.initializers[i]) for i in freqs.input if i in g.initializers), None)
    if inv_freq is None or inv_freq.dtype != np.float32:
        return None, "kept in the graph (the frequencies are not positions * a float32 constant)"
    (cos, sin), scale = _scaled(g, cos_nodes[0].output[0], sin_nodes[0].output[0])
    rope = _Rope(_widened(g, cos), _widened(g, sin), inv_freq.reshape(-1), scale)
    for node in attention:
        attrs = node_attrs(node)
        key = _cache_source(g, node.input[1], "key")[1]
        for name in (node.input[0], key):
            source = _unrotated(g, name, rope)
            if source is None or inv_freq.size * 2 != attrs.head_dim:
                return None, f"kept in the graph ({name} of {node.name} is not rotated as the exporter writes it)"
    scaled = f", scaled by YaRN's {scale:g}" if scale != 1.0 else ""
    return rope, f"inside GroupQueryAttention (cos/sin caches of {rotary_positions} positions{scaled})"


def _scaled(g: _Graph, cos: str, sin: str) -> tuple[tuple[str, str], float]:
    """cos and sin after a YaRN attention factor (each read only by a Mul with one float32 scalar
    constant, the same for both) and that factor; else themselves and 1."""
    def scaled_by(name):
        readers = g.consumers.get(name, [])
        if len(readers) != 1 or readers[0].op_type != "Mul" or readers[0].domain not in ("", "ai.onnx"):
            return None
        other = [i for i in readers[0].input if i != name]
        if len(other) != 1 or other[0] not in g.initializers:
            return None
        value = numpy_helper.to_array(g.initializers[other[0]])
        return (readers[0].output[0], float(value)) if value.dtype == np.float32 and value.size == 1 else None
    cos_scaled, sin_scaled = scaled_by(cos), scaled_by(sin)
    if cos_scaled is None or sin_scaled is None or cos_scaled[1] != sin_scaled[1]:
        return (cos, sin), 1.0
    return (cos_scaled[0], sin_scaled[0]), cos_scaled[1]


def _widened(g: _Graph, name: str) -> str | None:
    """cos/sin [B, S, D/2] -> the [B, S, 1, D/2] the rotate-half Muls read (through a Cast for fp16)."""
    for consumer in g.consumers.get(name, []):
        if consumer.op_type == "Cast" and len(g.consumers.get(consumer.output[0], [])) == 1:
            consumer = g.consumers[consumer.output[0]][0]
        if consumer.op_type == "Unsqueeze" and consumer.input[1] in g.initializers and \
                numpy_helper.to_array(g.initializers[consumer.input[1]]).tolist() in ([2], [-2]):
            return consumer.output[0]
    return None


def _unrotated(g: _Graph, name: str, rope: _Rope) -> str | None:
    """The heads [B, S, n, D] that the exporter's rotate-half subgraph turns into `name` [B, S, n*D]:
    Reshape(Concat(a*cos - b*sin, b*cos + a*sin)) with (a, b) = Split(x [B, S, n, D]); None if not so.
    (The rotate-half nodes are left for the final dead-node sweep.)"""
    def made(tensor, op):
        node = g.producer.get(tensor)
        return node if node is not None and node.op_type == op and node.domain in ("", "ai.onnx") else None

    def product(tensor, x, factor):  # Mul(x, factor) in either order, read only by its Sub/Add
        node = made(tensor, "Mul")
        return node is not None and sorted(node.input) == sorted([x, factor]) and len(g.consumers[tensor]) == 1

    flat = made(name, "Reshape")
    concat = made(flat.input[0], "Concat") if flat is not None else None
    if concat is None or len(concat.input) != 2 or _axis(concat) not in (-1, 3):
        return None
    sub, add = made(concat.input[0], "Sub"), made(concat.input[1], "Add")
    if sub is None or add is None or rope.cos is None or rope.sin is None:
        return None
    first = g.producer.get(sub.input[0])
    a = next((i for i in (first.input if first is not None else []) if i != rope.cos), None)
    split = g.producer.get(a) if a is not None else None
    if split is None or split.op_type != "Split" or len(split.output) != 2 or list(split.output).index(a) != 0 \
            or _axis(split) not in (-1, 3) or (len(split.input) > 1 and split.input[1]):
        return None
    a, b = split.output
    ok = product(sub.input[0], a, rope.cos) and product(sub.input[1], b, rope.sin) and \
        any(product(add.input[i], b, rope.cos) and product(add.input[1 - i], a, rope.sin) for i in (0, 1)) and \
        all(len(g.consumers[t]) == 2 for t in (a, b)) and len(g.consumers[concat.output[0]]) == 1
    return split.input[0] if ok else None


def _axis(node) -> int | None:
    return next((helper.get_attribute_value(a) for a in node.attribute if a.name == "axis"),
                0 if node.op_type == "Split" else None)


def _rope_caches(g: _Graph, rope: _Rope, dtype: int, positions: int) -> tuple[str, str]:
    """cos/sin caches [positions, head size / 2] in the cache's type: the graph's frequencies at every
    position (each map is a head of its own, rotated in halves)."""
    freqs = np.arange(positions, dtype=np.float32)[:, None] * rope.inv_freq[None, :]
    np_type = helper.tensor_dtype_to_np_dtype(dtype)
    scale = np.float32(rope.scale)  # scaled in fp32 before the cast, as the graph does
    return g.const((np.cos(freqs) * scale).astype(np_type), "cos_cache"), \
        g.const((np.sin(freqs) * scale).astype(np_type), "sin_cache")


def _redirect_past_shapes(g: _Graph, nodes: list, past_shape) -> list:
    """Shape(past) nodes read the token-major past shape [B, 1, T - S, W] computed from the mask:
    with a shared buffer the past's own shape is the buffer's, not the tokens seen so far."""
    batch, past_len = past_shape
    pasts = {i.name for i in g.graph.input if names.is_past(i.name)}
    shape_of: dict[str, str] = {}
    extra = []
    for n in nodes:
        for name in n.input:
            if name not in pasts or n.op_type == "GroupQueryAttention":
                continue
            if n.op_type != "Shape":
                raise _refuse(f"{name} is read by {n.op_type} {n.name}; only its shape may be read besides the cache")
            if name not in shape_of:
                width = next(d.dim_value for i in g.graph.input if i.name == name
                             for d in list(i.type.tensor_type.shape.dim)[3:4])
                node, shape_of[name] = g.node("Concat", [batch, _ints(g, [1]), past_len, _ints(g, [width])], axis=0)
                extra.append(node)
    for n in nodes:
        if n.op_type == "Shape" and n.input and n.input[0] in shape_of:
            fields = {a.name: helper.get_attribute_value(a) for a in n.attribute}
            start, end = fields.get("start", 0), fields.get("end", 4)
            source = shape_of[n.input[0]]
            del n.attribute[:]
            n.op_type = "Slice"
            del n.input[:]
            n.input.extend([source, _ints(g, [start]), _ints(g, [end])])
    return extra  # the nodes computing those shapes


def _set_cache_types(graph: onnx.GraphProto, kv_heads: int, head_size: int) -> None:
    """past [B, Hkv, past_sequence, head size], present [B, Hkv, total_sequence, head size]."""
    for value in list(graph.input) + list(graph.output):
        if value.name.startswith(("past_key_values.", "present.")):
            dims = value.type.tensor_type.shape.dim
            dims[1].Clear()
            dims[1].dim_value = kv_heads
            dims[3].Clear()
            dims[3].dim_value = head_size
            if value.name.startswith("present."):
                dims[2].Clear()
                dims[2].dim_param = "total_sequence"
    del graph.value_info[:]  # inferred for the token-major cache; onnxruntime infers again


def _finish_imports(model: onnx.ModelProto) -> None:
    for opset in model.opset_import:
        if opset.domain in ("", "ai.onnx"):
            opset.version = max(opset.version, RMS_NORM_OPSET)
    imports = [o for o in model.opset_import if o.domain != contract.ONNX_DOMAIN]
    del model.opset_import[:]
    model.opset_import.extend(imports + [helper.make_opsetid(GQA_DOMAIN, 1)])
    functions = [f for f in model.functions if f.domain != contract.ONNX_DOMAIN]
    del model.functions[:]
    model.functions.extend(functions)


def _drop_unused_initializers(graph: onnx.GraphProto) -> None:
    used = {name for n in graph.node for name in names_read(n)}
    keep = [t for t in graph.initializer if t.name in used]
    del graph.initializer[:]
    graph.initializer.extend(keep)
