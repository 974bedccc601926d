"""The ONNX model-local function `diffexport.DiffAttention`: the op spelled in standard ONNX ops.

ONNX Runtime (any execution provider) and polygraphy's ORT runner inline this body; TensorRT's
parser (10.7 and newer) takes our plugin instead when the node carries `plugin_namespace` and the
plugin is registered; for older parsers `diffexport trt` removes the body first. The same .onnx
file therefore runs in both.

One body serves every node of a model: it reads the node's attributes through attribute
references and derives everything else from the input shapes (TensorRT's parser keys local
functions by name only, so per-configuration overloads would be unsafe there):
  - V1 vs V2 needs no branch: keys are viewed as [B, Skv, Hkv, M, D] with M = 2 (K1, K2)
    or 1 (one key shared by both maps) taken from the key width, and broadcasting does the rest;
  - lambda [1] (V1) and [B, Sq, H] (V2) are both expanded to [B, Sq, H];
  - the causal mask is always bottom-right (query i sees key j <= i + Skv - Sq), OR-ed with
    `not causal`;
  - norm_weight is always an input (all ones where a model has none), so there is no presence
    test: TensorRT's parser can inline this body when our plugin is not loaded.
Everything is computed in fp32 (inputs are cast up, the output is cast back like the query):
fp16 softmax sums overflow at long key lengths.

Body styles:
  decomposed  MatMul/Softmax written out as Eq. 1 (opset 18): both maps in one batched MatMul,
              A1 - lambda*A2 formed before the single product with V. Runs on every runtime.
  attention   two opset-23 `Attention` calls (one per map, V of width Dv) with an explicit
              bottom-right boolean mask (onnxruntime's is_causal aligns top-left when Sq != Skv).
              Needs the whole model at opset >= 23.
"""

from __future__ import annotations

import onnx
from onnx import TensorProto, helper

from diffexport.core import contract
from diffexport.core.contract import DiffAttentionAttrs
from diffexport.core.errors import DiffExportError

BODY_STYLES = ("decomposed", "attention")
DEFAULT_BODY_STYLE = "decomposed"
MIN_OPSET = {"decomposed": 18, "attention": 23}
KV_CACHE_MIN_OPSET = 19  # version 3: DequantizeLinear of float8e4m3fn codes


class _Body:
    """A tiny node builder: `b.op("MatMul", x, y)` appends a node and returns its output name."""

    def __init__(self) -> None:
        self.nodes: list[onnx.NodeProto] = []
        self._count = 0

    def op(self, op_type: str, *inputs: str, outputs: int = 1, **attrs):
        names = [f"{op_type.lower()}_{self._count}_{i}" for i in range(outputs)]
        self._count += 1
        self.nodes.append(helper.make_node(op_type, list(inputs), names, **attrs))
        return names[0] if outputs == 1 else names

    def const_ints(self, values: list[int]) -> str:
        return self.op("Constant", value_ints=values)

    def const_float(self, value: float) -> str:
        return self.op("Constant", value_float=value)

    def attr_ref(self, name: str, kind: str) -> str:
        """A scalar tensor holding the node's attribute `name` (int64 or float)."""
        node = helper.make_node("Constant", [], [f"attr_{name}"])
        ref = onnx.AttributeProto(name=f"value_{kind}", ref_attr_name=name,
                                  type=onnx.AttributeProto.INT if kind == "int" else onnx.AttributeProto.FLOAT)
        node.attribute.append(ref)
        self.nodes.append(node)
        return f"attr_{name}"

    def dim(self, scalar: str) -> str:
        """A scalar int64 as a 1-element shape piece."""
        return self.op("Reshape", scalar, self.const_ints([1]))


def _attribute_defaults() -> list[onnx.AttributeProto]:
    """Attributes with a contract default are declared with it, so a node may omit them."""
    protos = []
    for spec in contract.ATTRIBUTES:
        if spec.default is not None:
            protos.append(helper.make_attribute(spec.name, spec.default))
    return protos


def _common_prologue(b: _Body, attrs: DiffAttentionAttrs | None, kv_cache: bool = False) -> dict[str, str]:
    """Attributes (references, or constants when lowering one node), sizes and fp32 copies of the inputs
    (version 3: key and value dequantised from the cache's codes with their per-channel scales)."""
    if attrs is None:
        names = {a.name: b.attr_ref(a.name, a.kind) for a in contract.ATTRIBUTES if a.name != "variant"}
    else:
        names = {a.name: b.op("Constant", **{f"value_{a.kind}": getattr(attrs, a.name)})
                 for a in contract.ATTRIBUTES if a.name != "variant"}
    heads, kv_heads, head_dim = names["num_heads"], names["num_kv_heads"], names["head_dim"]
    v = {"H": b.dim(heads), "Hkv": b.dim(kv_heads), "D": b.dim(head_dim)}
    v["rep"] = b.dim(b.op("Div", heads, kv_heads))
    # effective logit scale: the attribute, or 1/sqrt(D) when it is 0
    d_float = b.op("Cast", head_dim, to=TensorProto.FLOAT)
    default_scale = b.op("Reciprocal", b.op("Sqrt", d_float))
    v["scale"] = b.op("Where", b.op("Greater", names["scale"], b.const_float(0.0)), names["scale"], default_scale)
    v["norm_eps"], v["output_scale"] = names["norm_eps"], names["output_scale"]
    v["norm_on"] = b.op("Cast", names["norm"], to=TensorProto.BOOL)
    v["causal_off"] = b.op("Not", b.op("Cast", names["causal"], to=TensorProto.BOOL))
    for name in ("query", "key", "value", "lambda_full"):
        v[name] = b.op("Cast", name, to=TensorProto.FLOAT)
    if kv_cache:  # code * scale[channel]; the scales are float32, so the result is too
        v["key"] = b.op("DequantizeLinear", "key", "k_scale", axis=2)
        v["value"] = b.op("DequantizeLinear", "value", "v_scale", axis=2)
    zero, one = b.const_ints([0]), b.const_ints([1])
    v["B"] = b.op("Slice", b.op("Shape", "query"), zero, one)
    v["Sq"] = b.op("Slice", b.op("Shape", "query"), one, b.const_ints([2]))
    # (version 3 asks the dequantised key: onnxruntime has no Shape kernel for float8 tensors)
    v["Skv"] = b.op("Slice", b.op("Shape", v["key"] if kv_cache else "key"), one, b.const_ints([2]))
    return v


def _visible_mask(b: _Body, v: dict[str, str], mask_axes: list[int]) -> str:
    """Boolean [Sq, Skv]: bottom-right causal visibility, all true when causal=0; with the version-2
    key_mask input, AND-ed with it unsqueezed at mask_axes (so it broadcasts over the logits)."""
    sq = b.op("Squeeze", v["Sq"], b.const_ints([0]))
    skv = b.op("Squeeze", v["Skv"], b.const_ints([0]))
    zero, step = b.op("Constant", value_int=0), b.op("Constant", value_int=1)
    rows = b.op("Add", b.op("Range", zero, sq, step), b.op("Sub", skv, sq))  # last visible key per query
    cols = b.op("Range", zero, skv, step)
    visible = b.op("LessOrEqual", b.op("Unsqueeze", cols, b.const_ints([0])),
                   b.op("Unsqueeze", rows, b.const_ints([1])))
    visible = b.op("Or", visible, v["causal_off"])
    if v.get("key_mask"):
        present = b.op("Unsqueeze", b.op("Cast", "key_mask", to=TensorProto.BOOL), b.const_ints(mask_axes))
        visible = b.op("And", visible, present)
    return visible


def _lambda_grouped(b: _Body, v: dict[str, str], trailing: list[int]) -> str:
    """lambda as [B, Hkv, rep, *trailing-shaped Sq dims]: V1 [1] and V2 [B, Sq, H] alike."""
    full = b.op("Expand", v["lambda_full"], b.op("Concat", v["B"], v["Sq"], v["H"], axis=0))
    per_head = b.op("Transpose", full, perm=[0, 2, 1])  # [B, H, Sq]
    shape = b.op("Concat", b.const_ints([0]), v["Hkv"], v["rep"], b.const_ints(trailing), axis=0)
    return b.op("Reshape", per_head, shape)


def _epilogue(b: _Body, v: dict[str, str], heads_out: str) -> None:
    """[B, H, Sq, Dv] fp32 -> RMSNorm (if norm), weight, output_scale -> [B, Sq, H*Dv] like the query."""
    mean_sq = b.op("ReduceMean", b.op("Mul", heads_out, heads_out), b.const_ints([-1]), keepdims=1)
    inv_rms = b.op("Reciprocal", b.op("Sqrt", b.op("Add", mean_sq, v["norm_eps"])))
    inv_rms = b.op("Where", v["norm_on"], inv_rms, b.const_float(1.0))
    weight = b.op("Cast", "norm_weight", to=TensorProto.FLOAT)
    scaled = b.op("Mul", b.op("Mul", b.op("Mul", heads_out, inv_rms), weight), v["output_scale"])
    bshd = b.op("Transpose", scaled, perm=[0, 2, 1, 3])  # [B, Sq, H, Dv]
    flat = b.op("Reshape", bshd, b.const_ints([0, 0, -1]))
    b.nodes.append(helper.make_node("CastLike", [flat, "query"], ["output"]))


def _decomposed(b: _Body, v: dict[str, str]) -> None:
    # q: [B, Sq, H*2*D] -> [B, Hkv, rep, 2, Sq, D]   (diff-head h = g*rep + r, maps 2h, 2h+1)
    q_shape = b.op("Concat", b.const_ints([0, 0]), v["Hkv"], v["rep"], b.const_ints([2]), v["D"], axis=0)
    q = b.op("Transpose", b.op("Reshape", v["query"], q_shape), perm=[0, 2, 3, 4, 1, 5])
    q = b.op("Mul", q, v["scale"])
    # k: [B, Skv, Hkv*M*D] -> [B, Hkv, 1, M, D, Skv]   (M = 2 for V1, 1 for V2: broadcast over maps)
    k_shape = b.op("Concat", b.const_ints([0, 0]), v["Hkv"], b.const_ints([-1]), v["D"], axis=0)
    k = b.op("Transpose", b.op("Reshape", v["key"], k_shape), perm=[0, 2, 3, 4, 1])
    k = b.op("Unsqueeze", k, b.const_ints([2]))
    logits = b.op("MatMul", q, k)  # [B, Hkv, rep, 2, Sq, Skv]
    visible = _visible_mask(b, v, [1, 2, 3, 4])  # [Sq, Skv], or [B, 1, 1, 1, Sq, Skv] with key_mask
    logits = b.op("Where", visible, logits, b.const_float(float("-inf")))
    probs = b.op("Softmax", logits, axis=-1)
    if v.get("key_mask"):  # a row that sees no key (all -inf, NaN after Softmax) gives zeros
        probs = b.op("Where", visible, probs, b.const_float(0.0))
    p1, p2 = b.op("Split", probs, axis=3, num_outputs=2, outputs=2)  # each [B, Hkv, rep, 1, Sq, Skv]
    lam = _lambda_grouped(b, v, [1, -1, 1])  # [B, Hkv, rep, 1, Sq, 1]
    diff = b.op("Sub", p1, b.op("Mul", lam, p2))
    # v: [B, Skv, Hkv*Dv] -> [B, Hkv, 1, 1, Skv, Dv]
    val = b.op("Reshape", v["value"], b.op("Concat", b.const_ints([0, 0]), v["Hkv"], b.const_ints([-1]), axis=0))
    val = b.op("Unsqueeze", b.op("Transpose", val, perm=[0, 2, 1, 3]), b.const_ints([2, 3]))
    out = b.op("MatMul", diff, val)  # [B, Hkv, rep, 1, Sq, Dv]
    heads = b.op("Reshape", out, b.op("Concat", b.const_ints([0]), v["H"], v["Sq"], b.const_ints([-1]), axis=0))
    _epilogue(b, v, heads)


def _attention(b: _Body, v: dict[str, str]) -> None:
    # q: [B, Sq, H*2*D] -> [B, H, 2, Sq, D] -> maps [B, H, Sq, D]
    q_shape = b.op("Concat", b.const_ints([0, 0]), v["H"], b.const_ints([2]), v["D"], axis=0)
    q = b.op("Transpose", b.op("Reshape", v["query"], q_shape), perm=[0, 2, 3, 1, 4])
    q = b.op("Mul", q, v["scale"])
    q1, q2 = (b.op("Squeeze", t, b.const_ints([2])) for t in b.op("Split", q, axis=2, num_outputs=2, outputs=2))
    # k: [B, Skv, Hkv*M*D] -> [B, Hkv, M, Skv, D]; map 2 reads key M-1 (its own for V1, the shared one for V2)
    k_shape = b.op("Concat", b.const_ints([0, 0]), v["Hkv"], b.const_ints([-1]), v["D"], axis=0)
    k = b.op("Transpose", b.op("Reshape", v["key"], k_shape), perm=[0, 2, 3, 1, 4])
    maps = b.op("Slice", b.op("Shape", k), b.const_ints([2]), b.const_ints([3]))
    k2_index = b.op("Squeeze", b.op("Sub", maps, b.const_ints([1])), b.const_ints([0]))
    k1 = b.op("Gather", k, b.op("Constant", value_int=0), axis=2)
    k2 = b.op("Gather", k, k2_index, axis=2)
    val = b.op("Reshape", v["value"], b.op("Concat", b.const_ints([0, 0]), v["Hkv"], b.const_ints([-1]), axis=0))
    val = b.op("Transpose", val, perm=[0, 2, 1, 3])  # [B, Hkv, Skv, Dv]
    mask = _visible_mask(b, v, [1, 2])  # [Sq, Skv], or [B, 1, Sq, Skv] with key_mask
    o1 = b.op("Attention", q1, k1, val, mask, scale=1.0)
    o2 = b.op("Attention", q2, k2, val, mask, scale=1.0)
    lam = _lambda_grouped(b, v, [-1, 1])  # [B, Hkv, rep, Sq, 1]
    lam = b.op("Reshape", lam, b.op("Concat", b.const_ints([0]), v["H"], b.const_ints([-1, 1]), axis=0))
    diff = b.op("Sub", o1, b.op("Mul", lam, o2))
    if v.get("key_mask"):  # a row that sees no key gives zeros
        seen = b.op("ReduceMax", b.op("Cast", mask, to=TensorProto.FLOAT), b.const_ints([-1]), keepdims=1)
        diff = b.op("Where", b.op("Cast", seen, to=TensorProto.BOOL), diff, b.const_float(0.0))
    _epilogue(b, v, diff)


def _check_style(style: str, opset: int | None, kv_cache: bool = False) -> int:
    if style not in BODY_STYLES:
        raise DiffExportError(f"unknown function body style {style!r}; choose one of {list(BODY_STYLES)}")
    low = max(MIN_OPSET[style], KV_CACHE_MIN_OPSET if kv_cache else 0)
    opset = low if opset is None else opset
    if opset < low:
        what = f"the {style} function body" + (" on an 8-bit KV cache" if kv_cache else "")
        raise DiffExportError(f"{what} needs opset >= {low}, got {opset}")
    return opset


def _input_names(key_mask: bool, kv_cache: bool = False) -> list[str]:
    if kv_cache:
        return list(contract.KV_CACHE_INPUT_NAMES)
    return list(contract.ALL_INPUT_NAMES if key_mask else contract.INPUT_NAMES)


def _body(b: _Body, style: str, attrs: DiffAttentionAttrs | None, key_mask: bool, kv_cache: bool = False) -> None:
    values = _common_prologue(b, attrs, kv_cache)
    if key_mask or kv_cache:
        values["key_mask"] = "key_mask"
    (_decomposed if style == "decomposed" else _attention)(b, values)


def build_function(style: str = DEFAULT_BODY_STYLE, opset: int | None = None,
                   key_mask: bool = False, kv_cache: bool = False) -> onnx.FunctionProto:
    """The FunctionProto `diffexport.DiffAttention` in the given body style, importing the model's
    default-domain opset (checkers require the function and the model to agree). key_mask=True:
    the version-2 body with the sixth input (every node of such a model passes it); kv_cache=True:
    the version-3 body, key and value an 8-bit cache's codes with k_scale and v_scale (opset >= 19)."""
    opset = _check_style(style, opset, kv_cache)
    b = _Body()
    _body(b, style, None, key_mask, kv_cache)
    required = [a.name for a in contract.ATTRIBUTES if a.default is None]
    version = contract.op_version(key_mask, kv_cache)
    return helper.make_function(
        contract.ONNX_DOMAIN, contract.OP_NAME,
        inputs=_input_names(key_mask, kv_cache), outputs=[t.name for t in contract.OUTPUTS], nodes=b.nodes,
        opset_imports=[helper.make_opsetid("", opset)], attributes=required,
        attribute_protos=_attribute_defaults(),
        doc_string=f"DiffAttention v{version} in standard ONNX ops ({style} body); see docs/OP_SPEC.md",
    )


def build_specialised_function(attrs: DiffAttentionAttrs, style: str, opset: int, domain: str,
                               name: str, key_mask: bool = False, kv_cache: bool = False) -> onnx.FunctionProto:
    """The body for ONE node with its attributes as constants: what the lowering pass inlines for
    runtimes without function support (constant folding then removes the attribute plumbing)."""
    opset = _check_style(style, opset, kv_cache)
    b = _Body()
    _body(b, style, attrs, key_mask, kv_cache)
    return helper.make_function(domain, name, inputs=_input_names(key_mask, kv_cache),
                                outputs=[t.name for t in contract.OUTPUTS],
                                nodes=b.nodes, opset_imports=[helper.make_opsetid("", opset)], attributes=[])
