"""`diffexport inspect`: what an ONNX file holds and which runtimes can run it. Weights are not loaded."""

from __future__ import annotations

import collections
import json
import os
from pathlib import Path
from typing import Any

from diffexport.core import contract
from diffexport.core.files import external_file_state, load_onnx
from diffexport.core.lazy import lazy_import
from diffexport.format.metadata_keys import CONFIG, DTYPE, FAMILY, stored_key

decoder_folder = lazy_import("diffexport.format.decoder_folder")


def _dims(value) -> list[Any]:
    shape = value.type.tensor_type.shape
    return [d.dim_param or (d.dim_value if d.HasField("dim_value") else "?") for d in shape.dim]


def _io(values) -> list[dict]:
    import onnx

    return [{"name": v.name, "dtype": onnx.helper.tensor_dtype_to_np_dtype(v.type.tensor_type.elem_type).name
             if v.type.tensor_type.elem_type else "?", "shape": _dims(v)} for v in values]


def _weights(model, folder: Path) -> dict:
    import numpy as np
    import onnx

    count = nbytes = 0
    files: dict[str, bool] = {}
    for init in model.graph.initializer:
        numel = int(np.prod(init.dims)) if init.dims else 1
        count += numel
        nbytes += numel * onnx.helper.tensor_dtype_to_np_dtype(init.data_type).itemsize
        if init.data_location == onnx.TensorProto.EXTERNAL:
            location = next((e.value for e in init.external_data if e.key == "location"), "")
            files[location] = external_file_state(folder, location)
    return {"parameters": count, "bytes": nbytes, "external_data": files}


def _runtimes(nodes: list[dict], functions: set, plugin_nodes: int, contrib: list[str]) -> dict[str, str]:
    has_body = (contract.ONNX_DOMAIN, contract.OP_NAME) in functions
    versions = sorted({str(n["attributes"].get("plugin_version", contract.PLUGIN_VERSION)) for n in nodes})
    if not nodes and contrib:  # e.g. a KV-cache folder exported with --attention gqa
        return {"onnxruntime": f"yes (its contrib ops: {', '.join(contrib)})",
                "tensorrt_plugin": "not needed (no DiffAttention)",
                "tensorrt_native": f"no: onnxruntime's contrib ops {', '.join(contrib)} are not TensorRT's"}
    if not nodes:
        return {"onnxruntime": "yes (standard ops only)", "tensorrt_plugin": "not needed (no DiffAttention)",
                "tensorrt_native": "yes if TensorRT supports every op"}
    refusals = (contract.plugin_refusal(int(n["attributes"].get("head_dim", 0))) for n in nodes)
    refusal = next(filter(None, refusals), None)
    return {
        "onnxruntime": "yes: inlines the DiffAttention function body" if has_body else
                       "no: DiffAttention nodes without a function body (re-export with `diffexport onnx`)",
        "tensorrt_plugin": f"no: {refusal}; build with `diffexport trt --attention native`" if refusal else
                           (f"ready: {plugin_nodes}/{len(nodes)} nodes carry plugin_namespace for the "
                            f"DiffAttention plugin (namespace {contract.PLUGIN_NAMESPACE}, version "
                            f"{', '.join(versions)}"
                            f"{' with key_mask' if contract.KEY_MASK_PLUGIN_VERSION in versions else ''}"
                            f"{' on an 8-bit KV cache' if contract.KV_CACHE_PLUGIN_VERSION in versions else ''}"
                            f", libdiffexport_plugins.so); "
                            + ("TensorRT >= 10.7 picks it over the function body, 10.1-10.6 import the body "
                               "instead: use `diffexport trt` or the graph its --save-onnx writes"
                               if has_body else "no function body: TensorRT >= 10.1 with the plugin loaded"))
                           if plugin_nodes else
                           "no: the nodes carry no plugin_namespace",
        "tensorrt_native": "yes: without the plugin TensorRT's parser inlines the function body (checked with "
                           "TensorRT-RTX)" if has_body else "no: nothing to inline",
    }


def inspect_onnx(path: str | os.PathLike) -> dict:
    """A JSON-able description of the model at `path`, or of the decoder in a KV-cache folder
    (with what its genai_config.json says: context length, execution provider)."""
    import onnx

    path, folder = Path(path), None
    if path.is_dir():
        read = decoder_folder.read_decoder_folder(path)
        path, folder = read.model_path, {"context_length": read.context_length, "providers": read.providers}
    model = load_onnx(path, weights=False)
    histogram = collections.Counter(f"{n.domain + '::' if n.domain else ''}{n.op_type}" for n in model.graph.node)
    diff_nodes = []
    plugin_nodes = 0
    for node in model.graph.node:
        if node.op_type == contract.OP_NAME and node.domain == contract.ONNX_DOMAIN:
            attrs = {a.name: onnx.helper.get_attribute_value(a) for a in node.attribute}
            order = [*contract.ATTRIBUTE_NAMES, "plugin_namespace", "plugin_version"]
            attrs = {k: v.decode() if isinstance(v, bytes) else v
                     for k, v in sorted(attrs.items(), key=lambda kv: order.index(kv[0]) if kv[0] in order else 99)}
            plugin_nodes += "plugin_namespace" in attrs
            diff_nodes.append({"name": node.name, "inputs": list(node.input), "attributes": attrs})
    functions = {(f.domain, f.name) for f in model.functions}
    contrib = sorted({n.op_type for n in model.graph.node if n.domain == "com.microsoft"})
    runtimes = _runtimes(diff_nodes, functions, plugin_nodes, contrib)
    if any(v["dtype"] == "bfloat16" for v in _io(model.graph.input) + _io(model.graph.output)):
        runtimes["onnxruntime"] += "; bfloat16: CUDA provider only (the CPU provider has no bfloat16 kernels)"
    return {
        "path": str(path),
        "ir_version": model.ir_version,
        "producer": f"{model.producer_name} {model.producer_version}".strip(),
        "opsets": {o.domain or "ai.onnx": o.version for o in model.opset_import},
        "inputs": _io(model.graph.input),
        "outputs": _io(model.graph.output),
        "nodes": len(model.graph.node),
        "histogram": dict(histogram.most_common()),
        "functions": [f"{d}.{n}" for d, n in sorted(functions)],
        "diff_attention": diff_nodes,
        "weights": _weights(model, path.parent),
        "metadata": {p.key: p.value for p in model.metadata_props if p.key.startswith("diffexport.")},
        "runtimes": runtimes,
        "decoder_folder": folder,
    }


def _describe_exported_model(metadata: dict) -> str | None:
    """What diffexport's export metadata says the model is (family, dtype, sizes, RoPE), in one line;
    None without it. The metadata comes from the file: shown, not trusted (anything odd is shown as is)."""
    family = metadata.get(stored_key(FAMILY))
    if family is None:
        return None
    try:
        config = json.loads(metadata.get(stored_key(CONFIG), "{}"))
    except ValueError:
        config = None
    if not isinstance(config, dict):
        return f"{family} {metadata.get(stored_key(DTYPE), '?')} (its config metadata is not readable)"
    text = (f"{family} {metadata.get(stored_key(DTYPE), '?')}, {config.get('n_layers', '?')} layers, "
            f"d_model {config.get('d_model', '?')}, vocab {config.get('vocab_size', '?')}; "
            f"rope theta {config.get('rope_theta', '?')}")
    scaling = config.get("rope_scaling")
    if isinstance(scaling, dict):
        params = ", ".join(f"{k} {str(v).lower() if isinstance(v, bool) else v}" for k, v in scaling.items()
                           if k != "rope_type")
        text += f", {scaling.get('rope_type', '?')} scaling ({params})"
    return text


def render(info: dict) -> str:
    """Plain text of inspect_onnx's result."""
    lines = [f"file          {info['path']} (IR {info['ir_version']}, producer {info['producer'] or '?'})",
             "opsets        " + ", ".join(f"{d} {v}" for d, v in info["opsets"].items())]
    for kind in ("inputs", "outputs"):
        for value in info[kind]:
            shape = "[" + ", ".join(str(d) for d in value["shape"]) + "]"
            lines.append(f"{kind[:-1]:<13s} {value['name']} {value['dtype']} {shape}")
    w = info["weights"]
    external = ", ".join(f"{f}{'' if state == 'present' else f' ({state})'}"
                         for f, state in w["external_data"].items()) or "none"
    lines.append(f"weights       {w['parameters']:,} values, {w['bytes'] / 1e6:.1f} MB; external data: {external}")
    top = ", ".join(f"{op} {n}" for op, n in list(info["histogram"].items())[:12])
    more = len(info["histogram"]) - 12
    lines.append(f"nodes         {info['nodes']}: {top}" + (f", ... {more} more op types" if more > 0 else ""))
    lines.append(f"functions     {', '.join(info['functions']) or 'none'}")
    model_line = _describe_exported_model(info["metadata"])
    if model_line:
        lines.append(f"model         {model_line}")
    lines.append(f"DiffAttention {len(info['diff_attention'])} node(s)")
    for node in info["diff_attention"]:
        attrs = " ".join(f"{k}={v:g}" if isinstance(v, float) else f"{k}={v}" for k, v in node["attributes"].items())
        lines.append(f"  {node['name']}: {attrs}")
    for runtime, verdict in info["runtimes"].items():
        lines.append(f"{runtime:<16s} {verdict}")
    if info["decoder_folder"]:
        folder = info["decoder_folder"]
        lines.append(f"genai         KV-cache folder: context {folder['context_length']:,} tokens, "
                     f"provider {', '.join(folder['providers'])} (genai_config.json)")
    return "\n".join(lines)


def to_json(info: dict) -> str:
    return json.dumps(info, indent=2)
