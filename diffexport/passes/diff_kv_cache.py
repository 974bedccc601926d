"""An 8-bit KV cache for DiffAttention folders (the decoders TensorRT and the fused CUDA kernel run):
`diffexport quantize FOLDER --kv-cache int8` writes op version 3 (docs/OP_SPEC.md).

int8 only: a decoder graph appends the new tokens' codes to the cache with Concat, and ONNX's
Concat takes no float8 tensors (through opset 24), so an fp8 cache cannot be written as an ONNX
decoder. The op, the plugin and the kernel read fp8 codes too, for runtimes that keep the cache
themselves.

Per layer, the float cache becomes a cache of codes (diffexport/core/kv_cache_codes.py):
  present.{i}.key   = Concat(past codes, QuantizeLinear(clip(new keys - k_shift), k_scale, axis=3))
  present.{i}.value = Concat(past codes, QuantizeLinear(clip(new values), v_scale, axis=3))
and the layer's DiffAttention node reads those codes with k_scale and v_scale as inputs 6 and 7
(plugin version "3"): the plugin's split-KV kernel reads the codes (half the bytes of an fp16
cache, a quarter of a float32 one's); the function body dequantises them (onnxruntime). The clip
keeps codes on the definition's grid (+-127; fp8's +-448 is QuantizeLinear's own saturation).

Scales come from the folder's own prefill on calibration tokens (onnxruntime on the CPU), read from
the present caches. K's shift is each channel's mean key. Keys are stored after the rotary
embedding, which turns each channel pair (j, j + D/2) of a D-wide key map by an angle that depends
on the position, so a channel can hold any share of its pair's length at a position calibration did
not see. Both channels therefore take the pair's largest length, plus the shift's magnitude: a bound
no position can exceed. Values are not rotated and take their own largest magnitude.
"""

from __future__ import annotations

import dataclasses
import json
import time
from pathlib import Path
from typing import Callable

import numpy as np
import onnx
import torch
from onnx import TensorProto, helper, numpy_helper

from diffexport.core import contract, kv_cache_codes, tolerances
from diffexport.core.errors import DiffExportError
from diffexport.core.files import load_onnx
from diffexport.core.lazy import lazy_import
from diffexport.core.onnxruntime_session import open_session
from diffexport.export import function_body
from diffexport.format import decoders, names
from diffexport.format.decoder_folder import read_decoder_folder
from diffexport.format.metadata_keys import ATTENTION, CONFIG, KV_CACHE_QUANT, OP_VERSION, stored_key, stored_metadata
from diffexport.format.nodes import plugin_selectors, sort_topologically
from diffexport.passes import calibration, kv_cache_quant, weight_quant

ort = lazy_import("onnxruntime")

CODE_TYPES = {"int8": TensorProto.INT8}  # the formats a decoder graph can hold (module docstring)
META_KEY = stored_key(KV_CACHE_QUANT)
FLOAT_CACHES = (TensorProto.FLOAT, TensorProto.FLOAT16)  # what onnxruntime calibrates on the CPU


@dataclasses.dataclass
class KvCacheOptions(calibration.CalibrationFields):
    format: str = "int8"  # kv_cache_codes.FORMATS
    smooth_k: bool = True
    force: bool = False

    def validate(self) -> None:
        kv_cache_codes.check_format(self.format)
        if self.format not in CODE_TYPES:
            raise DiffExportError(f"--kv-cache {self.format}: a decoder folder appends its cache with ONNX's Concat, "
                                  "which takes no float8 tensors; use --kv-cache int8 (the fused kernel and the "
                                  "plugin read fp8 caches that a runtime keeps itself)")
        self.validate_calibration("--kv-cache on a DiffAttention folder")


@dataclasses.dataclass
class LayerCache:
    """One layer's cache rewrite: its DiffAttention node and the Concat nodes writing its present caches."""

    node: onnx.NodeProto
    concats: dict[str, onnx.NodeProto]  # "key" / "value" -> the Concat producing present.{i}.<kind>


def attention_layers(model: onnx.ModelProto, path) -> list[LayerCache]:
    """Each layer's DiffAttention node (version 2, reading its present caches) and cache Concats;
    else one line saying which folder this pass takes."""
    nodes = [n for n in model.graph.node if n.op_type == contract.OP_NAME and n.domain == contract.ONNX_DOMAIN]
    inputs = {i.name: i for i in model.graph.input}
    layers = names.cache_layers(list(inputs))
    if not nodes or len(nodes) != layers:
        raise DiffExportError(f"{path}: --kv-cache int8|fp8 without --weights takes a DiffAttention decoder folder "
                              f"(`diffexport onnx CKPT --kv-cache --attention diffattention`); this graph has "
                              f"{len(nodes)} DiffAttention nodes for {layers} cache layers")
    past_type = inputs[names.PAST_KEY % 0].type.tensor_type.elem_type
    if past_type in CODE_TYPES.values():
        raise DiffExportError(f"{path}: its cache is int8 codes already (quantised by --kv-cache): quantise the float "
                              "folder it came from")
    if past_type not in FLOAT_CACHES:
        raise DiffExportError(f"{path}: its cache is {helper.tensor_dtype_to_string(past_type)}, not a float32 or "
                              "float16 one this pass can calibrate on the CPU (a bfloat16 folder has no onnxruntime "
                              "CPU kernels: export the folder in float16 or float32)")
    producer = {o: n for n in model.graph.node for o in n.output}
    by_present = {}
    for node in nodes:
        if len(node.input) != len(contract.ALL_INPUTS):
            raise DiffExportError(f"{path}: DiffAttention {node.name} is not a version-2 decoder node")
        reads = [producer.get(node.input[slot]) for slot in (1, 2)]
        present = [r.input[0] if r is not None and r.op_type in ("Squeeze", "Reshape") else "" for r in reads]
        by_present[present[0]] = (node, present[1])
    result = []
    for layer in range(layers):
        node, value = by_present.get(names.PRESENT_KEY % layer, (None, None))
        concats = {kind: producer.get(fmt % layer) for kind, fmt in (("key", names.PRESENT_KEY),
                                                                      ("value", names.PRESENT_VALUE))}
        past = {"key": names.PAST_KEY % layer, "value": names.PAST_VALUE % layer}
        if (node is None or value != names.PRESENT_VALUE % layer
                or any(c is None or c.op_type != "Concat" or c.input[0] != past[k] for k, c in concats.items())):
            raise DiffExportError(f"{path}: layer {layer}'s DiffAttention does not read Concat(past, new) caches "
                                  "(a folder written by `diffexport onnx --kv-cache` does)")
        result.append(LayerCache(node, concats))
    return result


def takes(path) -> bool:
    """Whether `path` is a decoder folder whose graph keeps its DiffAttention nodes (no format rewrite):
    the folders this pass quantises (others: the gqa folders' own --kv-cache, with --weights)."""
    folder = Path(path)
    if not folder.is_dir():
        return False
    meta = read_decoder_folder(folder).meta
    return not decoders.decoder_format(meta.get(ATTENTION)).rewrite


def head_dim(layer: LayerCache) -> int:
    return next(helper.get_attribute_value(a) for a in layer.node.attribute if a.name == "head_dim")


def calibrate(session, feeds_list: list[dict], layers: int, key_head_dim: int, fmt: str,
              smooth_k: bool) -> list[kv_cache_codes.KvCacheScales]:
    """Each layer's scales from the present caches of the calibration prefills (module docstring)."""
    outputs = [o.name for o in session.get_outputs()]
    half = key_head_dim // 2
    pair_max = value_max = key_sum = None
    tokens = 0
    for feeds in feeds_list:
        results = dict(zip(outputs, session.run(None, feeds)))
        k = np.stack([results[names.PRESENT_KEY % i] for i in range(layers)]).astype(np.float64)  # [L, B, 1, T, W]
        v = np.stack([results[names.PRESENT_VALUE % i] for i in range(layers)]).astype(np.float64)
        k = k.reshape(*k.shape[:4], -1, key_head_dim)  # [L, B, 1, T, maps, D]
        pairs = kv_cache_quant.pair_lengths(k, half).max(axis=(1, 2, 3)).reshape(layers, -1)
        sums = k.sum(axis=(1, 2, 3)).reshape(layers, -1)
        peaks = np.abs(v).max(axis=(1, 2, 3))
        pair_max = pairs if pair_max is None else np.maximum(pair_max, pairs)
        value_max = peaks if value_max is None else np.maximum(value_max, peaks)
        key_sum = sums if key_sum is None else key_sum + sums
        tokens += int(np.prod(k.shape[1:4]))
    if not tokens:
        raise DiffExportError("--kv-cache: no calibration sequence ran")
    if not (np.isfinite(pair_max).all() and np.isfinite(value_max).all() and np.isfinite(key_sum).all()):
        raise DiffExportError("--kv-cache: the calibration run gave a non-finite cache value")
    top, tiny = kv_cache_codes.LARGEST_CODE[fmt], 1e-12
    scales = []
    for layer in range(layers):
        shift = key_sum[layer] / tokens if smooth_k else np.zeros_like(key_sum[layer])
        k_scale = np.maximum((pair_max[layer] + np.abs(shift)) / top, tiny)
        v_scale = np.maximum(value_max[layer] / top, tiny)
        as_tensor = torch.from_numpy
        scales.append(kv_cache_codes.KvCacheScales(fmt, as_tensor(k_scale.astype(np.float32)),
                                                   as_tensor(v_scale.astype(np.float32)),
                                                   as_tensor(shift.astype(np.float32))))
    return scales


def _zeros(name: str, code_type: int, width: int) -> onnx.TensorProto:
    return helper.make_tensor(name, code_type, [width], [0] * width)


def quantise_cache(model: onnx.ModelProto, layers: list[LayerCache], scales: list[kv_cache_codes.KvCacheScales],
                   body_style: str) -> None:
    """In place: the graph's caches become codes, each DiffAttention a version-3 node (module docstring)."""
    fmt = scales[0].fmt
    code_type, top = CODE_TYPES[fmt], kv_cache_codes.LARGEST_CODE[fmt]
    init, new_nodes = model.graph.initializer, []
    for index, (layer, cache) in enumerate(zip(layers, scales)):
        for kind, scale in (("key", cache.k_scale), ("value", cache.v_scale)):
            concat = layer.concats[kind]
            prefix = f"kv_cache.{index}.{kind}"
            scale_np = scale.numpy().astype(np.float32)
            init.extend([numpy_helper.from_array(scale_np, f"{prefix}.scale"),
                         numpy_helper.from_array(top * scale_np, f"{prefix}.bound"),
                         numpy_helper.from_array(-top * scale_np, f"{prefix}.neg_bound"),
                         _zeros(f"{prefix}.zero", code_type, scale_np.size)])
            x = f"{prefix}.float"
            new_nodes.append(helper.make_node("Cast", [concat.input[1]], [x], to=TensorProto.FLOAT, name=x))
            if kind == "key":
                init.append(numpy_helper.from_array(cache.k_shift.numpy().astype(np.float32), f"{prefix}.shift"))
                new_nodes.append(helper.make_node("Sub", [x, f"{prefix}.shift"], [f"{prefix}.shifted"],
                                                  name=f"{prefix}.shifted"))
                x = f"{prefix}.shifted"
            new_nodes += [
                helper.make_node("Min", [x, f"{prefix}.bound"], [f"{prefix}.below"], name=f"{prefix}.below"),
                helper.make_node("Max", [f"{prefix}.below", f"{prefix}.neg_bound"], [f"{prefix}.clipped"],
                                 name=f"{prefix}.clipped"),
                helper.make_node("QuantizeLinear", [f"{prefix}.clipped", f"{prefix}.scale", f"{prefix}.zero"],
                                 [f"{prefix}.codes"], axis=3, name=f"{prefix}.codes")]
            concat.input[1] = f"{prefix}.codes"
        layer.node.input.extend([f"kv_cache.{index}.key.scale", f"kv_cache.{index}.value.scale"])
        selectors = plugin_selectors(key_mask=True, kv_cache=True)
        for attr in layer.node.attribute:
            if attr.name in selectors:
                attr.s = selectors[attr.name].encode()
    model.graph.node.extend(new_nodes)
    # what now holds codes: the caches and the node's views of them (their recorded types too)
    code_views = {name for layer in layers for name in layer.node.input[1:3]}
    for value in list(model.graph.input) + list(model.graph.output) + list(model.graph.value_info):
        if names.is_past(value.name) or value.name.startswith(names.PRESENT_PREFIX) or value.name in code_views:
            value.type.tensor_type.elem_type = code_type
    opset = max(function_body.KV_CACHE_MIN_OPSET, *(o.version for o in model.opset_import if o.domain == ""))
    for entry in model.opset_import:
        if entry.domain == "":
            entry.version = opset
        elif entry.domain == contract.ONNX_DOMAIN:
            entry.version = contract.KV_CACHE_VERSION
    for position, fn in enumerate(model.functions):
        if fn.domain == contract.ONNX_DOMAIN and fn.name == contract.OP_NAME:
            model.functions[position].CopyFrom(function_body.build_function(body_style, opset, kv_cache=True))
    sort_topologically(model.graph)


def body_style(model: onnx.ModelProto) -> str:
    """The style of the folder's DiffAttention function body (attention: opset-23 Attention calls)."""
    fn = next((f for f in model.functions if f.domain == contract.ONNX_DOMAIN and f.name == contract.OP_NAME), None)
    return "attention" if fn is not None and any(n.op_type == "Attention" for n in fn.node) else "decomposed"


def record(options: KvCacheOptions, source: str) -> dict:
    return {"bits": 8, "format": options.format, "smooth_k": options.smooth_k,
            "scales": "per channel (keys: per rotary pair, shifted by their mean)" if options.smooth_k
            else "per channel (keys: per rotary pair)", "calibration": source}


@dataclasses.dataclass
class KvCacheSummary:
    folder: Path
    layers: int
    format: str
    calibration: str
    logits_cosine: float
    seconds: float

    def lines(self) -> list[str]:
        return [f"kv cache      {self.format} codes, one scale per channel (keys: per rotary pair, shifted by "
                f"their mean), calibrated on {self.calibration}",
                f"graph         {self.layers} {contract.OP_NAME} nodes at op version {contract.KV_CACHE_VERSION} "
                f"(plugin version {contract.KV_CACHE_PLUGIN_VERSION})",
                f"verified      onnxruntime prefill + one decode step on held-out tokens, logits vs the float "
                "cache: cosine "
                f"{self.logits_cosine:.5f}",
                f"wrote         {self.folder} in {self.seconds:.1f} s"]


def two_steps(session, model: onnx.ModelProto, ids: np.ndarray) -> np.ndarray:
    """Logits of a prefill of ids[:, :-1] and one decode step of the last token, the cache carried
    between them as onnxruntime values; [B, S, V] for both steps together."""
    values = {k: ort.OrtValue.ortvalue_from_numpy(v) for k, v in calibration.feeds(model, ids[:, :-1]).items()}
    outputs = [o.name for o in session.get_outputs()]
    first = dict(zip(outputs, session.run_with_ort_values(outputs, values)))
    step = {names.INPUT_IDS: ort.OrtValue.ortvalue_from_numpy(np.ascontiguousarray(ids[:, -1:])),
            names.ATTENTION_MASK: ort.OrtValue.ortvalue_from_numpy(np.ones(ids.shape, np.int64))}
    step.update({names.past_of(name): first[name] for name in outputs if name.startswith(names.PRESENT_PREFIX)})
    second = dict(zip(outputs, session.run_with_ort_values(outputs, step)))
    return np.concatenate([first[names.LOGITS].numpy(), second[names.LOGITS].numpy()], axis=1)


def quantize_kv_cache(src, dst, options: KvCacheOptions, log: Callable[[str], None] = print) -> KvCacheSummary:
    """A DiffAttention decoder folder `src` with its cache as 8-bit codes, written to the new folder `dst`."""
    options.validate()
    src, dst = Path(src), Path(dst)
    start = time.monotonic()
    is_folder, model_path = weight_quant.resolve_paths(src, dst, options.force)
    if not is_folder:
        raise DiffExportError("--kv-cache quantises a KV-cache folder's cache: give the folder")
    model = load_onnx(model_path)
    layers = attention_layers(model, model_path)
    if CONFIG not in stored_metadata(model):
        raise DiffExportError(f"{model_path} carries no diffexport config: quantise an export of `diffexport onnx`")
    # the float graph's inputs, for feeding it after the rewrite (without a second copy of its weights)
    float_inputs = helper.make_model(helper.make_graph([], "inputs", list(model.graph.input), []))
    data, source = calibration.batches(options, calibration.vocab_size(model, model_path))
    log(f"calibrating   the KV cache ({options.format}) on {source}")
    float_session = open_session(model_path, "cpu", None)
    feeds = [calibration.feeds(model, ids) for ids in data]
    scales = calibrate(float_session, feeds, len(layers), head_dim(layers[0]), options.format, options.smooth_k)
    quantise_cache(model, layers, scales, body_style(model))
    weight_quant.stamp(model, META_KEY, record(options, source))
    weight_quant.set_metadata(model, stored_key(OP_VERSION), str(contract.KV_CACHE_VERSION))
    quantised = open_session(model, "cpu", None)
    # held out: synthetic tokens of another seed, which calibration did not see
    held_out = dataclasses.replace(options, calib=calibration.SYNTHETIC, samples=2, seq_len=65, seed=options.seed + 1)
    probe = calibration.batches(held_out, calibration.vocab_size(model, model_path))[0][0]
    before = two_steps(float_session, float_inputs, probe)
    after = two_steps(quantised, model, probe)
    cosine = float(np.dot(before.ravel(), after.ravel()) /
                   (np.linalg.norm(before.ravel()) * np.linalg.norm(after.ravel()) + 1e-30))
    if not np.isfinite(after).all():
        raise DiffExportError("--kv-cache: the quantised folder's logits are not finite (nothing written)")
    budget = tolerances.kv_cache_budget(json.dumps(record(options, source)))
    if cosine < budget.min_cosine:
        raise DiffExportError(f"--kv-cache {options.format}: the logits of a prefill and a decode step have cosine "
                              f"{cosine:.5f} against the float cache, below {budget.what}'s budget of "
                              f"{budget.min_cosine} (nothing written): calibrate on text like the deployment's "
                              "(--calib)")
    weight_quant.publish(model, src, dst, model_path, log, force=options.force)
    return KvCacheSummary(dst, len(layers), options.format, source, cosine, time.monotonic() - start)
