"""The ONNX function body of DiffAttention, alone in a one-node model, in onnxruntime vs the NumPy oracle."""

import inspect
import itertools

import numpy as np
import pytest
import torch

onnx = pytest.importorskip("onnx")
ort = pytest.importorskip("onnxruntime")

from helpers import make_inputs, padding_mask  # noqa: E402
from onnx import TensorProto, helper  # noqa: E402
from oracle import diff_attention_oracle  # noqa: E402

from diffexport.core import contract  # noqa: E402
from diffexport.core.contract import DiffAttentionAttrs  # noqa: E402
from diffexport.export import function_body, op_schema, translation  # noqa: E402

ELEM = {torch.float32: TensorProto.FLOAT, torch.float16: TensorProto.FLOAT16}


def one_node_model(attrs: DiffAttentionAttrs, style: str, tensors: dict, dtype=torch.float32):
    """A model whose only node is DiffAttention, with the function attached (what the exporter ships)."""
    masked = tensors.get("key_mask") is not None
    fn = function_body.build_function(style, key_mask=masked)
    names = [n for n in contract.ALL_INPUT_NAMES if tensors.get(n) is not None]
    elem = {"norm_weight": TensorProto.FLOAT, "key_mask": TensorProto.INT64}
    node = helper.make_node(contract.OP_NAME, names, ["output"], domain=contract.ONNX_DOMAIN,
                            plugin_namespace=contract.PLUGIN_NAMESPACE, plugin_version=contract.PLUGIN_VERSION,
                            **attrs.as_dict())
    inputs = [helper.make_tensor_value_info(n, elem.get(n, ELEM[dtype]), [None] * tensors[n].dim()) for n in names]
    graph = helper.make_graph([node], "diff_attention", inputs,
                              [helper.make_tensor_value_info("output", ELEM[dtype], [None] * 3)])
    model = helper.make_model(graph, functions=[fn], ir_version=10,
                              opset_imports=[helper.make_opsetid("", fn.opset_import[0].version),
                                             helper.make_opsetid(contract.ONNX_DOMAIN, contract.op_version(masked))])
    onnx.checker.check_model(model, full_check=True)
    return model, names


def run_one_node(attrs, style, tensors, dtype=torch.float32):
    model, names = one_node_model(attrs, style, tensors, dtype)
    session = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    return session.run(None, {n: tensors[n].numpy() for n in names})[0]


def oracle(attrs, tensors):
    return diff_attention_oracle(*(None if tensors.get(n) is None else tensors[n].double().numpy()
                                   for n in contract.INPUT_NAMES), key_mask=tensors.get("key_mask"),
                                 **attrs.as_dict())


CASES = [  # variant, kv-groups, causal, (q_len, kv_len), norm (with its weight; V2 has none)
    (variant, hkv, causal, lengths, norm)
    for variant, hkv, causal, lengths, norm in itertools.product(
        (1, 2), (1, 2, 4), (0, 1), ((1, 1), (17, 17), (5, 33), (33, 5)), (1, 0))
    if not (causal and lengths[0] > lengths[1]) and not (variant == 2 and norm)
]


@pytest.mark.parametrize("style", function_body.BODY_STYLES)
@pytest.mark.parametrize("variant,hkv,causal,lengths,norm", CASES)
def test_body_matches_oracle_fp32(style, variant, hkv, causal, lengths, norm, rng):
    attrs = DiffAttentionAttrs(variant=variant, num_heads=4, num_kv_heads=hkv, head_dim=8, causal=causal,
                               norm=norm, output_scale=0.65 if variant == 1 else 1.0,
                               scale=0.0 if norm else 0.3)
    tensors = dict(zip(contract.INPUT_NAMES, make_inputs(attrs, 2, *lengths, rng=rng)))
    out = run_one_node(attrs, style, tensors)
    ref = oracle(attrs, tensors)
    assert np.isfinite(out).all()
    assert np.abs(out - ref).max() <= 1e-5 * max(1.0, np.abs(ref).max())


@pytest.mark.parametrize("style", function_body.BODY_STYLES)
@pytest.mark.parametrize("variant,hkv,q_len,kv_len,pads", [
    (1, 2, 7, 7, [3, 0]),      # prefill of a left-padded batch: padded query rows see no key -> zeros
    (1, 1, 1, 13, [5, 0]),     # one decode step against a cache
    (2, 2, 4, 19, [18, 2]),    # a row with one present key; multi-token step
    (1, 4, 17, 17, [17, 0]),   # a sequence of padding only: its output is all zeros
    (2, 1, 33, 33, [0, 0]),    # all present: same as version 1
    (1, 2, 7, 7, [(4, 7), 0]),     # prefill of a right-padded prompt: padding rows last (genai's batches)
    (2, 2, 3, 15, [(5, 9), 2]),    # steps after it: a hole of padding keys between prompt and answer
])
def test_body_with_key_mask_matches_oracle(style, variant, hkv, q_len, kv_len, pads, rng):
    attrs = DiffAttentionAttrs(variant=variant, num_heads=4, num_kv_heads=hkv, head_dim=8, causal=1,
                               norm=int(variant == 1), output_scale=0.7 if variant == 1 else 1.0)
    tensors = dict(zip(contract.INPUT_NAMES, make_inputs(attrs, 2, q_len, kv_len, rng=rng)))
    tensors["key_mask"] = padding_mask(2, kv_len, pads)
    model, _ = one_node_model(attrs, style, tensors)
    assert len(model.graph.node[0].input) == 6 and model.functions[0].input[-1] == "key_mask"
    out = run_one_node(attrs, style, tensors)
    ref = oracle(attrs, tensors)
    assert np.isfinite(out).all()
    assert np.abs(out - ref).max() <= 1e-5 * max(1.0, np.abs(ref).max())
    if pads[0] == kv_len:  # a sequence of padding only
        assert not out[0].any()
    # the eager references and the op agree with the oracle too
    from diffexport.kernel import op, reference

    inputs = [tensors[n] for n in contract.INPUT_NAMES]
    for fn in (reference.naive_diff_attention, reference.flash_diff_attention_1):
        got = fn(*inputs, attrs, key_mask=tensors["key_mask"])
        assert torch.isfinite(got).all()
        assert np.abs(got.double().numpy() - ref).max() <= 1e-5 * max(1, np.abs(ref).max())
    got = op.call(*inputs, attrs, key_mask=tensors["key_mask"])
    assert np.abs(got.double().numpy() - ref).max() <= 1e-5 * max(1.0, np.abs(ref).max())


@pytest.mark.parametrize("style", function_body.BODY_STYLES)
def test_body_fp16_keeps_fp32_accuracy(style, rng):
    """fp16 inputs: the body computes in fp32, so only the final rounding to fp16 remains."""
    attrs = DiffAttentionAttrs(variant=1, num_heads=4, num_kv_heads=2, head_dim=16, output_scale=0.5)
    tensors = dict(zip(contract.INPUT_NAMES, make_inputs(attrs, 2, 37, 37, rng=rng, dtype=torch.float16)))
    out = run_one_node(attrs, style, tensors, dtype=torch.float16)
    assert out.dtype == np.float16
    ref = oracle(attrs, tensors)
    assert np.abs(out.astype(np.float64) - ref).max() <= 2.0**-11 * np.abs(ref).max() + 1e-4


def test_contract_defaults_apply_when_the_node_omits_them(rng):
    """A node carrying only the required attributes runs with the contract's defaults."""
    attrs = DiffAttentionAttrs(variant=1, num_heads=2, num_kv_heads=1, head_dim=8)
    tensors = dict(zip(contract.INPUT_NAMES, make_inputs(attrs, 1, 9, 9, rng=rng)))
    model, names = one_node_model(attrs, "decomposed", tensors)
    node = model.graph.node[0]
    keep = [a for a in node.attribute if a.name in ("num_heads", "num_kv_heads", "head_dim")]
    del node.attribute[:]
    node.attribute.extend(keep)
    session = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    out = session.run(None, {n: tensors[n].numpy() for n in names})[0]
    assert np.abs(out - oracle(attrs, tensors)).max() <= 1e-5 * 10


def test_attention_body_needs_opset_23():
    from diffexport.core.errors import DiffExportError

    with pytest.raises(DiffExportError, match="opset >= 23"):
        function_body.build_function("attention", opset=18)
    with pytest.raises(DiffExportError, match="unknown function body"):
        function_body.build_function("fused")


def test_translation_follows_the_contract():
    fn = next(iter(translation.translation_table().values()))
    params = list(inspect.signature(fn).parameters)
    assert params == [*contract.ALL_INPUT_NAMES, *contract.ATTRIBUTE_NAMES]


def test_version_2_schema_adds_only_the_optional_key_mask():
    op_schema.register_schema()
    v1 = onnx.defs.get_schema(contract.OP_NAME, contract.OP_VERSION, contract.ONNX_DOMAIN)
    v2 = onnx.defs.get_schema(contract.OP_NAME, contract.KEY_MASK_VERSION, contract.ONNX_DOMAIN)
    assert [i.name for i in v2.inputs] == [i.name for i in v1.inputs] + ["key_mask"]
    assert v2.inputs[-1].option == onnx.defs.OpSchema.FormalParameterOption.Optional
    allowed = {c.type_param_str: list(c.allowed_type_strs) for c in v2.type_constraints}
    assert allowed[v2.inputs[-1].type_str] == ["tensor(int64)"]


def test_schema_is_registered_once_and_types_the_weight_fp32():
    op_schema.register_schema()
    op_schema.register_schema()
    schema = onnx.defs.get_schema(contract.OP_NAME, contract.OP_VERSION, contract.ONNX_DOMAIN)
    assert [i.name for i in schema.inputs] == list(contract.INPUT_NAMES)
    weight = schema.inputs[contract.INPUT_NAMES.index("norm_weight")]
    allowed = {c.type_param_str: list(c.allowed_type_strs) for c in schema.type_constraints}
    assert allowed[weight.type_str] == ["tensor(float)"]
    assert set(schema.attributes) >= set(contract.ATTRIBUTE_NAMES) | {"plugin_namespace", "plugin_version"}


KV_CODE_ELEM = {"int8": TensorProto.INT8, "fp8": TensorProto.FLOAT8E4M3FN}


def kv_cache_model(attrs: DiffAttentionAttrs, style: str, fmt: str, dtype=torch.float32):
    """One version-3 node (key and value an 8-bit cache's codes, with their scales) and its function."""
    fn = function_body.build_function(style, kv_cache=True)
    names = list(contract.KV_CACHE_INPUT_NAMES)
    elem = {"norm_weight": TensorProto.FLOAT, "key_mask": TensorProto.INT64, "k_scale": TensorProto.FLOAT,
            "v_scale": TensorProto.FLOAT, "key": KV_CODE_ELEM[fmt], "value": KV_CODE_ELEM[fmt]}
    ranks = {"lambda_full": 1 if attrs.variant == 1 else 3, "norm_weight": 1, "key_mask": 2, "k_scale": 1, "v_scale": 1}
    node = helper.make_node(contract.OP_NAME, names, ["output"], domain=contract.ONNX_DOMAIN,
                            plugin_namespace=contract.PLUGIN_NAMESPACE,
                            plugin_version=contract.KV_CACHE_PLUGIN_VERSION, **attrs.as_dict())
    inputs = [helper.make_tensor_value_info(n, elem.get(n, ELEM[dtype]), [None] * ranks.get(n, 3)) for n in names]
    graph = helper.make_graph([node], "diff_attention", inputs,
                              [helper.make_tensor_value_info("output", ELEM[dtype], [None] * 3)])
    model = helper.make_model(graph, functions=[fn], ir_version=10,
                              opset_imports=[helper.make_opsetid("", fn.opset_import[0].version),
                                             helper.make_opsetid(contract.ONNX_DOMAIN, contract.KV_CACHE_VERSION)])
    onnx.checker.check_model(model, full_check=True)
    return model


@pytest.mark.parametrize("style", function_body.BODY_STYLES)
@pytest.mark.parametrize("fmt", ["int8", "fp8"])
@pytest.mark.parametrize("variant", [1, 2])
def test_version_3_body_reads_an_8_bit_kv_cache(style, fmt, variant, rng):
    """Version 3 in onnxruntime: key and value as int8 / float8e4m3fn codes, dequantised by their
    per-channel scales, then version 2's math: the oracle on the values the codes stand for."""
    from diffexport.core.kv_cache_codes import KvCacheScales, decode

    attrs = DiffAttentionAttrs(variant=variant, num_heads=4, num_kv_heads=2, head_dim=8, causal=1,
                               norm=int(variant == 1), output_scale=0.7 if variant == 1 else 1.0)
    tensors = dict(zip(contract.INPUT_NAMES, make_inputs(attrs, 2, 3, 21, rng=rng)))
    tensors["key_mask"] = padding_mask(2, 21, [4, 0])
    scales = KvCacheScales.calibrate(tensors["key"], tensors["value"], fmt)
    codes = {"key": scales.quantise_keys(tensors["key"]), "value": scales.quantise_values(tensors["value"])}
    feeds = {**tensors, **codes, "k_scale": scales.k_scale, "v_scale": scales.v_scale}
    session = ort.InferenceSession(kv_cache_model(attrs, style, fmt).SerializeToString(),
                                   providers=["CPUExecutionProvider"])
    # numpy has no float8: its codes travel as an ORT value built from the torch tensor's bytes
    arrays = {n: feeds[n].numpy() if feeds[n].dtype != torch.float8_e4m3fn else
              ort.OrtValue.ortvalue_from_numpy_with_onnx_type(feeds[n].view(torch.uint8).numpy(),
                                                               TensorProto.FLOAT8E4M3FN)
              for n in contract.KV_CACHE_INPUT_NAMES}
    out = session.run(None, arrays)[0]
    dequantised = {**tensors, "key": decode(codes["key"], scales.k_scale),
                   "value": decode(codes["value"], scales.v_scale)}
    ref = oracle(attrs, dequantised)
    assert np.isfinite(out).all()
    assert np.abs(out - ref).max() <= 1e-5 * max(1.0, np.abs(ref).max())
    assert np.abs(out - oracle(attrs, tensors)).max() > 1e-5  # the codes, not the float cache, were read


def test_version_3_schema_takes_codes_and_their_scales():
    op_schema.register_schema()
    v2 = onnx.defs.get_schema(contract.OP_NAME, contract.KEY_MASK_VERSION, contract.ONNX_DOMAIN)
    v3 = onnx.defs.get_schema(contract.OP_NAME, contract.KV_CACHE_VERSION, contract.ONNX_DOMAIN)
    assert [i.name for i in v3.inputs] == [i.name for i in v2.inputs] + ["k_scale", "v_scale"]
    assert all(i.option == onnx.defs.OpSchema.FormalParameterOption.Single for i in v3.inputs)
    allowed = {c.type_param_str: list(c.allowed_type_strs) for c in v3.type_constraints}
    assert allowed[v3.inputs[1].type_str] == ["tensor(int8)", "tensor(float8e4m3fn)"]
    assert v3.inputs[2].type_str == v3.inputs[1].type_str and allowed[v3.inputs[-1].type_str] == ["tensor(float)"]
    from diffexport.core.errors import DiffExportError

    with pytest.raises(DiffExportError, match="on an 8-bit KV cache needs opset >= 19, got 18"):
        function_body.build_function("decomposed", opset=18, kv_cache=True)
