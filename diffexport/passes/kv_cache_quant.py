"""An 8-bit KV cache for gqa folders: onnxruntime's GroupQueryAttention keeps its shared cache as
int8 with one calibrated scale per channel (k_quant_type / v_quant_type PER_CHANNEL,
kv_cache_bit_width 8, the k_scale / v_scale inputs). The cache then takes a quarter of a float32
cache's bytes, and a decode step reads a quarter of them.

Scales: the folder runs the calibration sequences (a prefill each, from an empty cache) and the
present caches give each channel's largest magnitude over every token, divided by 127. Keys are
stored after GroupQueryAttention's rotary embedding, which turns each pair of channels (i, i + half
the head; the rotate-half layout) by an angle that depends on the position: a channel of a pair
can hold any share of the pair's length at a position calibration did not see. So both channels of
a pair get the scale of the pair's largest length, sqrt(k_i^2 + k_{i+h}^2), which no position can
exceed. Values are not rotated: their own largest magnitude. A channel that calibration never
saw move keeps a tiny scale (it quantises zero to zero).

Only gqa folders have such a cache (the DiffAttention op has no quantised-cache inputs); the
quantised folder is onnxruntime-only, as a gqa folder already is.
"""

from __future__ import annotations

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

from diffexport.core.errors import DiffExportError
from diffexport.format import names
from diffexport.format.metadata_keys import KV_CACHE_QUANT, stored_key

BITS = (8,)
META_KEY = stored_key(KV_CACHE_QUANT)
QMAX = 127.0
_TINY = 1e-8  # the scale of a channel calibration saw at zero: any positive number quantises 0 to 0
K_SCALE_INPUT, V_SCALE_INPUT = 12, 13  # GroupQueryAttention's input slots


def attention_nodes(model: onnx.ModelProto) -> list[onnx.NodeProto]:
    return [n for n in model.graph.node if n.op_type == "GroupQueryAttention" and n.domain == "com.microsoft"]


def check_quantisable(model: onnx.ModelProto, path) -> list[onnx.NodeProto]:
    """The graph's GroupQueryAttention nodes, one per layer with a float cache; else a one-line refusal."""
    nodes = attention_nodes(model)
    if not nodes:
        raise DiffExportError(f"{path}: --kv-cache int8 quantises GroupQueryAttention's cache, and this graph has "
                              "none: export the folder with `diffexport onnx CKPT --kv-cache` (the CPU default, "
                              "--attention gqa)")
    layers = names.cache_layers([i.name for i in model.graph.input])
    types = {i.name: i.type.tensor_type.elem_type for i in model.graph.input}
    if len(nodes) != layers or types.get(names.PAST_KEY % 0) != TensorProto.FLOAT:
        raise DiffExportError(f"{path}: --kv-cache int8 takes a float32 gqa folder whose cache is not quantised yet "
                              f"({len(nodes)} GroupQueryAttention nodes for {layers} layers)")
    return nodes


def cache_ranges(session, feeds_list: list[dict], layers: int,
                 rotary_half: int | None) -> tuple[np.ndarray, np.ndarray]:
    """Per layer and channel [layers, kv heads * head size]: the largest key (pair length, see the
    module) and value magnitudes over the calibration runs."""
    keys = values = None
    outputs = [o.name for o in session.get_outputs()]
    for feeds in feeds_list:
        results = dict(zip(outputs, session.run(None, feeds)))
        k = np.stack([results[names.PRESENT_KEY % i] for i in range(layers)])  # [L, B, H, T, D]
        v = np.stack([results[names.PRESENT_VALUE % i] for i in range(layers)])
        if rotary_half:  # both channels of a rotary pair take the pair's length
            k = pair_lengths(k, rotary_half)
        k_max = np.abs(k).max(axis=(1, 3))  # over batch and tokens: [L, H, D]
        v_max = np.abs(v).max(axis=(1, 3))
        keys = k_max if keys is None else np.maximum(keys, k_max)
        values = v_max if values is None else np.maximum(values, v_max)
    if keys is None:
        raise DiffExportError("--kv-cache int8: no calibration sequence ran")
    if not (np.isfinite(keys).all() and np.isfinite(values).all()):
        raise DiffExportError("--kv-cache int8: the calibration run gave a non-finite cache value")
    return keys.reshape(layers, -1), values.reshape(layers, -1)


def pair_lengths(k: np.ndarray, half: int) -> np.ndarray:
    """Over the last axis (a head in the rotate-half layout): each channel of a rotary pair (i, i + half)
    replaced by the pair's length, which no rotation exceeds; channels past 2 * half by their magnitude.
    (passes/diff_kv_cache.py bounds its keys the same way.)"""
    first, second = k[..., :half].astype(np.float64), k[..., half:2 * half].astype(np.float64)
    length = np.sqrt(first ** 2 + second ** 2)
    return np.concatenate([length, length, np.abs(k[..., 2 * half:])], axis=-1)


def rotary_half(node: onnx.NodeProto, head_size: int) -> int | None:
    """Half the head when GroupQueryAttention rotates it in the rotate-half layout, else None."""
    attrs = {a.name: helper.get_attribute_value(a) for a in node.attribute}
    if not attrs.get("do_rotary", 0):
        return None
    if attrs.get("rotary_interleaved", 0):
        raise DiffExportError("--kv-cache int8: interleaved rotary keys are not calibrated here (diffexport's gqa "
                              "folders rotate halves)")
    return head_size // 2


def quantise_cache(model: onnx.ModelProto, key_max: np.ndarray, value_max: np.ndarray) -> None:
    """In place: every GroupQueryAttention keeps an int8 cache with these per-channel scales, and the
    graph's past/present caches are int8."""
    nodes = attention_nodes(model)
    cache_names = {name % i: i for i in range(len(nodes)) for name in (names.PAST_KEY, names.PAST_VALUE)}
    layer_of = {}
    for node in nodes:
        layer = cache_names.get(node.input[3])
        if layer is None or node.input[4] != names.PAST_VALUE % layer:
            raise DiffExportError(f"internal: GroupQueryAttention {node.name} does not read a layer's past cache")
        layer_of[id(node)] = layer
    for node in nodes:
        layer = layer_of[id(node)]
        inputs = list(node.input) + [""] * max(0, V_SCALE_INPUT + 1 - len(node.input))
        for slot, peaks, kind in ((K_SCALE_INPUT, key_max, "k"), (V_SCALE_INPUT, value_max, "v")):
            name = f"{kind}_cache_scale.{layer}"
            scale = np.maximum(peaks[layer] / QMAX, _TINY).astype(np.float32)
            model.graph.initializer.append(numpy_helper.from_array(scale, name))
            inputs[slot] = name
        del node.input[:]
        node.input.extend(inputs)
        for attr in list(node.attribute):
            if attr.name in ("k_quant_type", "v_quant_type", "kv_cache_bit_width"):
                node.attribute.remove(attr)
        node.attribute.extend([helper.make_attribute("k_quant_type", "PER_CHANNEL"),
                               helper.make_attribute("v_quant_type", "PER_CHANNEL"),
                               helper.make_attribute("kv_cache_bit_width", 8)])
        if len(node.output) > 3 and node.output[3]:  # DIFF V1: the other value half reads the cache itself
            _dequantised_reads(model, node.output[2], inputs[V_SCALE_INPUT])
    for value in list(model.graph.input) + list(model.graph.output):
        if names.is_past(value.name) or value.name.startswith(names.PRESENT_PREFIX):
            value.type.tensor_type.elem_type = TensorProto.INT8


def _dequantised_reads(model: onnx.ModelProto, present: str, scale: str) -> None:
    """In place: the If branches that multiply probabilities by the value cache `present` (a gqa V1
    folder's other value half) multiply them by its int8 rows as float32 (a Cast of the rows they
    read) and scale the product's columns: each channel's scale is a factor of one output column,
    so (P @ V_int8) * scale is P @ (V_int8 * scale) with one elementwise pass over the small product
    instead of the rows."""
    dims = next(v.type.tensor_type.shape.dim for v in model.graph.output if v.name == present)
    heads, width = dims[1].dim_value, dims[3].dim_value
    shaped = f"{scale}/per_head"
    model.graph.initializer.append(numpy_helper.from_array(np.asarray([1, heads, 1, width], np.int64),
                                                           f"{shaped}/shape"))
    model.graph.node.insert(0, helper.make_node("Reshape", [scale, f"{shaped}/shape"], [shaped], name=shaped))
    for node in model.graph.node:
        for attr in node.attribute:
            if attr.type != onnx.AttributeProto.GRAPH or not any(present in n.input for n in attr.g.node):
                continue
            body = attr.g
            matmul = next(n for n in body.node if n.op_type == "MatMul")
            rows, product = matmul.input[1], matmul.output[0]
            matmul.input[1], matmul.output[0] = f"{rows}/float", f"{product}/unscaled"
            position = list(body.node).index(matmul)
            body.node.insert(position + 1, helper.make_node("Mul", [f"{product}/unscaled", shaped], [product]))
            body.node.insert(position, helper.make_node("Cast", [rows], [f"{rows}/float"], to=TensorProto.FLOAT))
