"""Fuse differential attention written out in standard ONNX ops into one DiffAttention node.

A rule is declarative: `match` returns the pieces or a reason, a numeric probe checks what
structure cannot prove (causal or not, a key or value shared by both maps), `rewrite` emits the
node. Every differential attention ends in a subtraction `X - lambda * Y`; the rules differ in
what X and Y are:

  eq1      X, Y = softmax maps A1, A2; the Sub feeds one MatMul with V   (the paper's Eq. 1)
  flash1   X, Y = A1 V, A2 V: two attention outputs over one V          (FlashDiffAttn_1)
  flash2   X, Y = Concat(A V_a, A' V_b): four attention outputs over V halves (FlashDiffAttn_2)

Scores are recognised as MatMul(q, kT) with constant scalar factors on q, kT or the product,
and an additive or Where mask. The node's inputs are built from q1, q2 [B, H, Sq, D], the
two kT [B, H, D, Skv] and V [B, H, Skv, Dv] with small layout adapters (Transpose/Reshape);
the adapters and the dead pattern are left to the cleanup pass and the runtime's optimiser.
GQA expansions in the source graph are kept (num_kv_heads = num_heads on the fused node), and
the per-head norm after the attention stays as standard ops (norm = 0, unit weight).
"""

from __future__ import annotations

import dataclasses
from typing import Callable

import numpy as np
import onnx
from onnx import helper, numpy_helper

from diffexport.core import contract
from diffexport.core.contract import VARIANT_V1, VARIANT_V2, DiffAttentionAttrs
from diffexport.core.errors import DiffExportError
from diffexport.core.onnxruntime_session import open_session
from diffexport.format.nodes import plugin_selectors


class NoMatch(Exception):
    """Why a rule did not fire at a node."""


@dataclasses.dataclass
class Branch:
    """One attention map: Softmax(scale * q kT [+ mask]) written out, or an opset-23 Attention node."""

    q: str
    scale: float | None  # None: 1/sqrt(D), Attention's default
    kt: str | None = None  # written-out form: kT [B, H, D, Skv]
    probs: str | None = None  # written-out form: the map itself (probed for the mask)
    attention: onnx.NodeProto | None = None  # Attention form: q, k [B, Hkv, Skv, D], v, optional mask
    half: int | None = None  # stacked maps: this map is half 0 or 1 of the head axis of q, k and P

    @property
    def k(self) -> str | None:
        return self.attention.input[1] if self.attention is not None else None

    @property
    def mask(self) -> str | None:
        node = self.attention
        return node.input[3] if node is not None and len(node.input) > 3 and node.input[3] else None

    def identity(self) -> tuple:
        """Two branches with equal identities compute the same map (no probe needed)."""
        if self.attention is None:
            return ("probs", self.probs)
        return ("attention", self.q, self.k, self.mask, self.scale, _attr(self.attention, "is_causal", 0))

@dataclasses.dataclass
class Match:
    rule: str
    anchor: onnx.NodeProto  # the node whose output the fused node replaces
    first: Branch
    second: Branch
    lam: str
    value: tuple[str, ...]  # V [B, H, Skv, Dv], or its two halves (FlashDiffAttn_2), joined by the rewrite
    extra_probe: list[tuple[str, str]]  # pairs of tensors that must be numerically equal
    out_perm: tuple[int, ...] = (0, 1, 2, 3)  # anchor axis i holds axis out_perm[i] of [B, H, Sq, Dv]


class Graph:
    """Read-only indexes over a ModelProto: producers, consumers, constants, static shapes."""

    def __init__(self, model: onnx.ModelProto):
        self.model = model
        self.producer = {o: n for n in model.graph.node for o in n.output}
        self.consumers: dict[str, list[onnx.NodeProto]] = {}
        for n in model.graph.node:
            for i in n.input:
                self.consumers.setdefault(i, []).append(n)
        self.initializers = {i.name: i for i in model.graph.initializer}
        self.shapes = {}  # static sizes as ints, symbolic ones as their names, unknown as None
        for v in [*model.graph.value_info, *model.graph.input, *model.graph.output]:
            if v.type.tensor_type.HasField("shape"):
                self.shapes[v.name] = [d.dim_value if d.HasField("dim_value") else (d.dim_param or None)
                                       for d in v.type.tensor_type.shape.dim]

    def const(self, name: str) -> np.ndarray | None:
        if name in self.initializers:
            return numpy_helper.to_array(self.initializers[name])
        node = self.producer.get(name)
        if node is not None and node.op_type == "Constant" and node.attribute:
            attr = node.attribute[0]
            if attr.name == "value":
                return numpy_helper.to_array(attr.t)
            if attr.name in ("value_float", "value_int"):
                return np.array(helper.get_attribute_value(attr))
        return None

    def scalar(self, name: str) -> float | None:
        value = self.const(name)
        return float(value.reshape(-1)[0]) if value is not None and value.size == 1 else None

    def op(self, name: str, *op_types: str) -> onnx.NodeProto:
        node = self.producer.get(name)
        if node is None or node.op_type not in op_types:
            found = "a graph input or initializer" if node is None else node.op_type
            raise NoMatch(f"{name} is {found}, not {'/'.join(op_types)}")
        return node

    def rank(self, name: str) -> int | None:
        shape = self.shapes.get(name)
        return None if shape is None else len(shape)


def _attr(node: onnx.NodeProto, name: str, default=None):
    for a in node.attribute:
        if a.name == name:
            return helper.get_attribute_value(a)
    return default


# ---------------------------------------------------------------- recognising one attention map

def _strip_scalar_mul(g: Graph, name: str) -> tuple[str, float]:
    """x * c, c * x or x / c with a constant scalar c -> (x, factor)."""
    node = g.producer.get(name)
    if node is not None and node.op_type in ("Mul", "Div"):
        for i, other in ((0, 1), (1, 0)):
            c = g.scalar(node.input[other])
            if c is not None and (node.op_type == "Mul" or i == 0):
                return node.input[i], (c if node.op_type == "Mul" else 1.0 / c)
    return name, 1.0


def branch_of(g: Graph, probs: str) -> Branch:
    """probs must be Softmax(scale * MatMul(q, kT) [+ mask]) over the key axis."""
    softmax = g.op(probs, "Softmax")
    axis, rank = _attr(softmax, "axis", -1), g.rank(probs)
    if not (axis == -1 or (rank is not None and axis == rank - 1)):
        raise NoMatch(f"Softmax {softmax.name} normalises axis {axis}, not the key axis (last)")
    scale, name = 1.0, softmax.input[0]
    for _ in range(8):  # mask and scale in any order, then the MatMul
        node = g.producer.get(name)
        if node is None:
            raise NoMatch(f"the scores of {softmax.name} do not come from a MatMul")
        if node.op_type == "MatMul":
            q, fq = _strip_scalar_mul(g, node.input[0])
            kt, fk = _strip_scalar_mul(g, node.input[1])
            return Branch(q=q, scale=scale * fq * fk, kt=kt, probs=softmax.output[0])
        if node.op_type in ("Mul", "Div"):
            name, factor = _strip_scalar_mul(g, name)
            if factor == 1.0 and name == node.output[0]:
                raise NoMatch(f"{node.op_type} {node.name} scales the scores by a non-constant")
            scale *= factor
        elif node.op_type == "Add":  # additive mask: follow the side that leads to the MatMul
            name = next((i for i in node.input if _leads_to_matmul(g, i)), None)
            if name is None:
                raise NoMatch(f"Add {node.name} before {softmax.name} has no MatMul side")
        elif node.op_type == "Where":  # Where(cond, fill, s) or Where(cond, s, fill)
            fills = [i for i in node.input[1:] if g.scalar(i) is not None]
            others = [i for i in node.input[1:] if g.scalar(i) is None]
            if len(fills) != 1 or len(others) != 1:
                raise NoMatch(f"Where {node.name} before {softmax.name} is not a mask with a constant fill")
            name = others[0]
        else:
            raise NoMatch(f"{node.op_type} {node.name} between the scores and {softmax.name} is not a scale or mask")
    raise NoMatch(f"too many ops between the scores and {softmax.name}")


def _leads_to_matmul(g: Graph, name: str, depth: int = 6) -> bool:
    node = g.producer.get(name)
    if node is None or depth == 0:
        return False
    if node.op_type == "MatMul":
        return True
    return node.op_type in ("Mul", "Div", "Where", "Add") and any(_leads_to_matmul(g, i, depth - 1)
                                                                  for i in node.input)


def _lambda_times(g: Graph, name: str) -> tuple[str, str]:
    """Mul(lambda, Y) in either order -> (lambda, Y); Y is the side that is not lambda-like."""
    node = g.op(name, "Mul")
    a, b = node.input
    # lambda is the operand that is not an attention map / output (it is a constant or a small tensor)
    for lam, other in ((a, b), (b, a)):
        if _is_attention_term(g, other):
            return lam, other
    raise NoMatch(f"Mul {node.name} multiplies no attention map or output")


def _is_attention_term(g: Graph, name: str) -> bool:
    node = g.producer.get(name)
    if node is None:
        return False
    if _probabilities(g, name) is not None or (node.op_type == "Attention" and node.domain in ("", "ai.onnx")):
        return True
    if node.op_type == "MatMul":
        return _probabilities(g, node.input[0]) is not None
    if node.op_type == "Concat":
        return all(_is_attention_term(g, i) for i in node.input)
    return False


def _probabilities(g: Graph, name: str) -> str | None:
    """The Softmax output behind `name`: itself, or through SDPA's guard Where(IsNaN(P), 0, P)."""
    node = g.producer.get(name)
    if node is None:
        return None
    if node.op_type == "Softmax":
        return name
    if node.op_type == "Where" and len(node.input) == 3:
        guard = g.producer.get(node.input[0])
        if guard is not None and guard.op_type == "IsNaN" and guard.input[0] == node.input[2] \
                and g.scalar(node.input[1]) == 0.0 and g.producer.get(node.input[2]) is not None \
                and g.producer[node.input[2]].op_type == "Softmax":
            return node.input[2]
    return None


def _pv(g: Graph, name: str) -> tuple[Branch, str]:
    """MatMul(Softmax map, V) or an opset-23 Attention node -> (the map, V)."""
    node = g.op(name, "MatMul", "Attention")
    if node.op_type == "Attention":
        return branch_of_attention(g, node), node.input[2]
    probs = _probabilities(g, node.input[0])
    if probs is None:
        raise NoMatch(f"MatMul {node.name} does not multiply a Softmax map by V")
    return branch_of(g, probs), node.input[1]


def branch_of_attention(g: Graph, node: onnx.NodeProto) -> Branch:
    """An opset-23 Attention node over 4-D q, k, v with at most a mask (no KV cache, no softcap)."""
    if node.domain not in ("", "ai.onnx") or len(node.input) > 4 or len([o for o in node.output if o]) != 1:
        raise NoMatch(f"Attention {node.name} has a KV cache or extra outputs")
    if _attr(node, "softcap", 0.0) or _attr(node, "qk_matmul_output_mode", 0):
        raise NoMatch(f"Attention {node.name} uses softcap or a qk output mode")
    if any(g.rank(i) not in (4, None) for i in node.input[:3]):
        raise NoMatch(f"Attention {node.name} takes 3-D inputs; only [B, heads, S, D] is fused")
    q_len, k_len = (g.shapes.get(node.input[i], [None] * 4)[2] for i in (0, 1))
    if _attr(node, "is_causal", 0) and (q_len is None or q_len != k_len):
        raise NoMatch(f"Attention {node.name}: is_causal aligns top-left; fused only where q and k lengths are equal")
    scale = _attr(node, "scale")
    return Branch(q=node.input[0], scale=None if scale is None else float(scale), attention=node)


# ---------------------------------------------------------------- the rules

def _split_sub(g: Graph, sub: onnx.NodeProto) -> tuple[str, str, str]:
    """Sub(X, Mul(lambda, Y)) -> (X, Y, lambda); X must be an attention term itself."""
    first, scaled = sub.input
    if not _is_attention_term(g, first):
        producer = g.producer.get(first)
        if producer is not None and producer.op_type == "Mul" and any(_is_attention_term(g, i) for i in producer.input):
            raise NoMatch(f"Sub {sub.name}: lambda multiplies the first term (X - lambda*Y expected)")
        raise NoMatch(f"Sub {sub.name}: the first term is not an attention map or output")
    lam, second = _lambda_times(g, scaled)
    return first, second, lam


def rule_eq1(g: Graph, sub: onnx.NodeProto) -> Match:
    first, second, lam = _split_sub(g, sub)
    b1, b2 = branch_of(g, first), branch_of(g, second)
    users = g.consumers.get(sub.output[0], [])
    if len(users) != 1 or users[0].op_type != "MatMul" or users[0].input[0] != sub.output[0]:
        raise NoMatch(f"Sub {sub.name}: the map difference must feed exactly one MatMul with V")
    return Match("eq1", users[0], b1, b2, lam, (users[0].input[1],), [])


def rule_flash1(g: Graph, sub: onnx.NodeProto) -> Match:
    first, second, lam = _split_sub(g, sub)
    (b1, v1), (b2, v2) = _pv(g, first), _pv(g, second)
    return Match("flash1", sub, b1, b2, lam, (v1,), [(v1, v2)] if v1 != v2 else [])


def _same_map(a: Branch, b: Branch) -> list[tuple[str, str]]:
    """Probe pairs proving two branches are one map (none when their inputs are the same tensors)."""
    if a.identity() == b.identity():
        return []
    if a.probs is not None and b.probs is not None:
        return [(a.probs, b.probs)]
    raise NoMatch("the attention calls of one map read different q, k, mask or scale")


def rule_flash2(g: Graph, sub: onnx.NodeProto) -> Match:
    first, second, lam = _split_sub(g, sub)
    halves = []
    for term in (first, second):
        cat = g.op(term, "Concat")
        if len(cat.input) != 2 or _attr(cat, "axis") not in (-1, 3):
            raise NoMatch(f"Concat {cat.name} does not join two V halves on the last axis")
        halves.append([_pv(g, i) for i in cat.input])
    (b1, va), (b1b, vb) = halves[0]
    (b2, va2), (b2b, vb2) = halves[1]
    probe = _same_map(b1, b1b) + _same_map(b2, b2b) + [(x, y) for x, y in ((va, va2), (vb, vb2)) if x != y]
    return Match("flash2", sub, b1, b2, lam, (va, vb), probe)


def rule_stacked(g: Graph, sub: onnx.NodeProto) -> Match:
    """Both maps in one attention over 2H heads (HF DiffLlama): Sub(half 0, lambda * half 1) of a head split."""
    first, scaled = sub.input
    split = g.op(first, "Split")
    if len(split.output) != 2 or split.output[0] != first:
        raise NoMatch(f"Split {split.name} is not a split of the heads in two, first half first")
    lam, second = _lambda_times_split(g, scaled, split)
    total = split.input[0]
    perm, parts, branch = _attention_output_layout(g, total)
    axis = _attr(split, "axis", 0)
    axis = axis + 4 if axis < 0 else axis
    if axis != perm.index(1):
        raise NoMatch(f"Split {split.name} cuts axis {axis}, not the head axis {perm.index(1)}")
    if len(split.input) > 1 and split.input[1]:
        sizes = g.const(split.input[1])
        if sizes is None or len(set(sizes.tolist())) != 1:
            raise NoMatch(f"Split {split.name} does not cut the heads in equal halves")
    first_map = dataclasses.replace(branch, half=0)
    second_map = dataclasses.replace(branch, half=1)
    return Match("stacked", sub, first_map, second_map, lam, parts, [], tuple(perm))


def _lambda_times_split(g: Graph, scaled: str, split: onnx.NodeProto) -> tuple[str, str]:
    node = g.op(scaled, "Mul")
    if split.output[1] not in node.input:
        raise NoMatch(f"Mul {node.name} does not scale the second half of {split.name}")
    lam = node.input[0] if node.input[1] == split.output[1] else node.input[1]
    return lam, split.output[1]


def _attention_output_layout(g: Graph, name: str) -> tuple[list[int], tuple[str, ...], Branch]:
    """name = [Transpose](P V) or Concat([Transpose](P Va), [Transpose](P Vb)) on the last axis.
    Returns (perm from [B, H, Sq, W], the V parts, the map)."""
    node = g.producer.get(name)
    terms = list(node.input) if node is not None and node.op_type == "Concat" else [name]
    if node is not None and node.op_type == "Concat" and _attr(node, "axis") not in (-1, 3):
        raise NoMatch(f"Concat {node.name} does not join value halves on the last axis")
    perms, parts, probs = set(), [], set()
    for term in terms:
        perm = [0, 1, 2, 3]
        producer = g.producer.get(term)
        if producer is not None and producer.op_type == "Transpose":
            perm = list(_attr(producer, "perm"))
            term = producer.input[0]
        branch, v = _pv(g, term)
        perms.add(tuple(perm))
        parts.append(v)
        probs.add(branch.identity())
    if len(perms) != 1 or len(probs) != 1:
        raise NoMatch("the attention outputs joined here come from different maps or layouts")
    perm = list(perms.pop())
    if perm[3] != 3:
        raise NoMatch("the value axis is not last in the attention output")
    return perm, tuple(parts), branch


RULES: dict[str, Callable[[Graph, onnx.NodeProto], Match]] = {
    "flash2": rule_flash2, "flash1": rule_flash1, "eq1": rule_eq1, "stacked": rule_stacked}


# ---------------------------------------------------------------- numeric probe

def probe_feeds(model: onnx.ModelProto, batch: int, seq: int, vocab: int = 2,
                rng: np.random.Generator | None = None) -> dict[str, np.ndarray]:
    """Seeded inputs for any graph: token ids below `vocab` (2 is valid for any embedding), masks
    of ones, positions 0..seq-1, normal floats; dimensions past (batch, seq) are 1."""
    rng = np.random.default_rng(0) if rng is None else rng
    feeds = {}
    initializers = {i.name for i in model.graph.initializer}
    for value in model.graph.input:
        if value.name in initializers:
            continue
        t = value.type.tensor_type
        rank = len(t.shape.dim)
        shape = [batch, seq][:rank] + [1] * max(0, rank - 2)
        dtype = helper.tensor_dtype_to_np_dtype(t.elem_type)
        if np.issubdtype(dtype, np.integer):
            if "mask" in value.name:
                feeds[value.name] = np.ones(shape, dtype)
            elif "position" in value.name:
                feeds[value.name] = np.broadcast_to(np.arange(seq, dtype=dtype), shape).copy()
            else:
                feeds[value.name] = rng.integers(0, vocab, size=shape).astype(dtype)
        else:
            feeds[value.name] = rng.standard_normal(shape).astype(dtype)
    return feeds


def probe(model: onnx.ModelProto, names: list[str], seq: int = 7) -> dict[str, np.ndarray]:
    """Values of intermediate tensors on a small seeded input, through onnxruntime."""
    probe_model = onnx.ModelProto.FromString(model.SerializeToString())
    del probe_model.graph.output[:]
    probe_model.graph.output.extend(helper.make_empty_tensor_value_info(n) for n in names)
    return dict(zip(names, open_session(probe_model).run(names, probe_feeds(model, 1, seq))))


def _causal_from_map(probs: np.ndarray) -> int:
    sq, skv = probs.shape[-2:]
    above = np.triu(np.ones((sq, skv), bool), k=1 + skv - sq)
    if np.all(probs[..., above] == 0) and np.all(probs[..., ~above] > 0):
        return 1
    if np.all(probs > 0):
        return 0
    raise NoMatch("the attention mask is neither causal (bottom-right) nor absent")


# ---------------------------------------------------------------- rewrite

@dataclasses.dataclass
class FusionReport:
    fired: dict[str, int]
    misses: list[str]  # "node: rule: reason", for the verbose flag

    @property
    def total(self) -> int:
        return sum(self.fired.values())


class _Emitter:
    def __init__(self, prefix: str):
        self.nodes: list[onnx.NodeProto] = []
        self.initializers: list[onnx.TensorProto] = []
        self.prefix = prefix

    def op(self, op_type, *inputs, output=None, outputs: int = 1, **attrs):
        names = [output] if output else [f"{self.prefix}_{op_type.lower()}_{len(self.nodes)}_{i}"
                                         for i in range(outputs)]
        self.nodes.append(helper.make_node(op_type, list(inputs), names,
                                           name=f"{self.prefix}/{op_type}_{len(self.nodes)}", **attrs))
        return names[0] if outputs == 1 else names

    def ints(self, values) -> str:
        name = f"{self.prefix}_const_{len(self.initializers)}"
        self.initializers.append(numpy_helper.from_array(np.array(values, np.int64), name))
        return name


def _pairs(e: _Emitter, a: str, b: str) -> str:
    """a, b [B, H, S, D] -> [B, S, H*2*D] with a and b adjacent per head (the contract's pairs)."""
    axis2 = e.ints([2])
    stacked = e.op("Concat", e.op("Unsqueeze", a, axis2), e.op("Unsqueeze", b, axis2), axis=2)
    return e.op("Reshape", e.op("Transpose", stacked, perm=[0, 3, 1, 2, 4]), e.ints([0, 0, -1]))


def _flat(e: _Emitter, x: str) -> str:
    """[B, H, S, W] -> [B, S, H*W]."""
    return e.op("Reshape", e.op("Transpose", x, perm=[0, 2, 1, 3]), e.ints([0, 0, -1]))


def _rewrite(g: Graph, m: Match, index: int, values: dict[str, np.ndarray]) -> tuple[list, list]:
    e = _Emitter(f"diff_attention_fused_{index}")
    # GQA written out before the scores (Unsqueeze/Expand/Reshape of K and V): read the kv heads instead
    sources = _unexpanded_sources(g, m)
    v_parts = sources["value"] if sources else list(m.value)
    v_name = v_parts[0] if len(v_parts) == 1 else e.op("Concat", *v_parts, axis=-1)
    dv = sum(values[v].shape[-1] for v in m.value)
    q1_val, q2_val = _map_array(values, m.first, m.first.q), _map_array(values, m.second, m.second.q)
    k1_val, k2_val = _key_array(values, m.first), _key_array(values, m.second)  # [B, Hk, Skv, D]
    if m.first.half is not None:  # stacked maps share one V tensor: both halves must hold the same values
        v_all = np.concatenate([values[v] for v in m.value], axis=-1)
        if not np.allclose(v_all[:, : v_all.shape[1] // 2], v_all[:, v_all.shape[1] // 2:], rtol=1e-5, atol=1e-6):
            raise NoMatch("the two maps of a diff-head read different values (not a contract layout)")
        v_name = _map_tensor(e, v_name, 0)
    heads, head_dim = q1_val.shape[1], q1_val.shape[-1]
    kv_heads = k1_val.shape[1] // (sources["rep"] if sources else 1)
    if q2_val.shape != q1_val.shape or k2_val.shape != k1_val.shape or k1_val.shape[-1] != head_dim \
            or heads % kv_heads or (kv_heads != heads and m.first.attention is None and not sources):
        raise NoMatch("q and k head counts or widths do not pair up")
    scales = [head_dim ** -0.5 if b.scale is None else b.scale for b in (m.first, m.second)]
    if abs(scales[0] - scales[1]) > 1e-6 * abs(scales[0]):
        raise NoMatch(f"the two maps use different scales ({scales[0]:g}, {scales[1]:g})")
    lam = values[m.lam]
    if lam.size > 1 and (lam.ndim != 4 or lam.shape[1] != heads or lam.shape[3] != 1):
        raise NoMatch(f"lambda of shape {list(lam.shape)} is neither a scalar nor per token and head [B, H, Sq, 1]")
    shared_k = np.array_equal(k1_val, k2_val)
    per_token = lam.size > 1
    if per_token and shared_k and dv == head_dim:
        variant = VARIANT_V2
    elif not per_token and dv == 2 * head_dim:
        variant = VARIANT_V1
    else:
        raise NoMatch(f"no contract variant fits: {'per-token' if per_token else 'scalar'} lambda, "
                      f"{'shared' if shared_k else 'separate'} keys, value width {dv} for head dim {head_dim}")
    causal = _causal_from_map(_visible(values, m.first))
    if _causal_from_map(_visible(values, m.second)) != causal:
        raise NoMatch("the two maps are masked differently")
    attrs = DiffAttentionAttrs(variant=variant, num_heads=heads, num_kv_heads=kv_heads, head_dim=head_dim,
                               causal=causal, scale=scales[0], norm=0, output_scale=1.0)
    q1, q2 = _map_tensor(e, m.first.q, m.first.half), _map_tensor(e, m.second.q, m.second.half)
    if sources:
        k1, k2 = (_map_tensor(e, k, b.half) for k, b in zip(sources["key"], (m.first, m.second)))
    else:
        k1, k2 = _key_tensor(e, m.first), _key_tensor(e, m.second)
    if variant == VARIANT_V1:
        key = _pairs(e, k1, k2)
        lam_in = e.op("Reshape", m.lam, e.ints([1]))
    else:
        key = _flat(e, k1)
        lam_in = e.op("Transpose", e.op("Squeeze", m.lam, e.ints([3])), perm=[0, 2, 1])  # [B,H,Sq,1] -> [B,Sq,H]
    weight = f"{e.prefix}_unit_weight"
    e.initializers.append(numpy_helper.from_array(np.ones(dv, np.float32), weight))
    fused = helper.make_node(contract.OP_NAME, [_pairs(e, q1, q2), key, _flat(e, v_name), lam_in, weight],
                             [f"{e.prefix}_out"], name=f"{e.prefix}/DiffAttention", domain=contract.ONNX_DOMAIN,
                             **plugin_selectors(key_mask=False), **attrs.as_dict())
    e.nodes.append(fused)
    split = e.op("Reshape", fused.output[0], e.ints([0, 0, heads, dv]))  # [B, Sq, H, Dv]
    to_anchor = [[0, 2, 1, 3].index(a) for a in m.out_perm]  # [B, Sq, H, Dv] -> the anchor's layout
    e.op("Transpose", split, perm=to_anchor, output=m.anchor.output[0])
    return e.nodes, e.initializers


def _map_array(values: dict[str, np.ndarray], branch: Branch, name: str) -> np.ndarray:
    """The probed tensor of one map: all of it, or its half of the head axis (axis 1)."""
    array = values[name]
    if branch.half is None:
        return array
    half = array.shape[1] // 2
    return array[:, :half] if branch.half == 0 else array[:, half:]


def _unexpand(g: Graph, name: str) -> tuple[str, int] | None:
    """Reshape(Expand(Unsqueeze(src, [2]), [B, Hkv, rep, S, D]), [B, Hkv*rep, S, D]) -> (src, rep):
    head h of the result is kv head h // rep of src, the contract's GQA grouping."""
    reshape = g.producer.get(name)
    expand = g.producer.get(reshape.input[0]) if reshape is not None and reshape.op_type == "Reshape" else None
    unsqueeze = g.producer.get(expand.input[0]) if expand is not None and expand.op_type == "Expand" else None
    if unsqueeze is None or unsqueeze.op_type != "Unsqueeze":
        return None
    axes = g.const(unsqueeze.input[1]) if len(unsqueeze.input) > 1 else _attr(unsqueeze, "axes")
    src, out = g.shapes.get(unsqueeze.input[0]), g.shapes.get(name)
    if axes is None or np.atleast_1d(axes).tolist() != [2] or not src or not out or len(src) != 4 or len(out) != 4:
        return None
    if not isinstance(src[1], int) or not isinstance(out[1], int) or out[1] % src[1] or src[2:] != out[2:]:
        return None
    return unsqueeze.input[0], out[1] // src[1]


def _unexpanded_sources(g: Graph, m: Match) -> dict | None:
    """The kv-head tensors behind expanded K (both maps) and V (every part), when all were expanded
    by one factor; None leaves the expansion in the graph."""
    keys = []
    for b in (m.first, m.second):
        name = b.k
        if b.attention is None:
            transpose = g.producer.get(b.kt)
            if transpose is None or transpose.op_type != "Transpose" or list(_attr(transpose, "perm")) != [0, 1, 3, 2]:
                return None
            name = transpose.input[0]
        keys.append(_unexpand(g, name))
    values = [_unexpand(g, v) for v in m.value]
    found = keys + values
    if any(f is None for f in found) or len({rep for _, rep in found}) != 1:
        return None
    rep = found[0][1]
    if m.first.half is not None and (g.shapes[keys[0][0]][1] % 2 or rep * g.shapes[keys[0][0]][1] % 2):
        return None  # stacked maps split the kv heads in two as well
    return {"key": [k for k, _ in keys], "value": [v for v, _ in values], "rep": rep}


def _key_array(values: dict[str, np.ndarray], branch: Branch) -> np.ndarray:
    """The map's keys as [B, Hk, Skv, D] (written-out scores hold kT)."""
    if branch.attention is not None:
        return _map_array(values, branch, branch.k)
    return np.swapaxes(_map_array(values, branch, branch.kt), -1, -2)


def _key_tensor(e: _Emitter, branch: Branch) -> str:
    if branch.attention is not None:
        return _map_tensor(e, branch.k, branch.half)
    return e.op("Transpose", _map_tensor(e, branch.kt, branch.half), perm=[0, 1, 3, 2])


def _visible(values: dict[str, np.ndarray], branch: Branch) -> np.ndarray:
    """What the map lets each query see, as positive entries: the probed map itself, or for an
    Attention node its is_causal (top-left) and mask, applied to a map of ones."""
    if branch.attention is None:
        return _map_array(values, branch, branch.probs)
    sq, skv = values[branch.q].shape[2], values[branch.k].shape[2]
    visible = np.ones((sq, skv), bool)
    if _attr(branch.attention, "is_causal", 0):
        visible &= np.tril(np.ones((sq, skv), bool))
    if branch.mask is not None:
        mask = values[branch.mask]
        mask = mask if mask.dtype == bool else mask > -1e30
        if mask.ndim == 4 and mask.shape[1] > 1 and branch.half is not None:
            mask = _map_array(values, branch, branch.mask) > (-1e30 if mask.dtype != bool else False)
        visible = visible & mask
    return visible.astype(np.float32)


def _map_tensor(e: _Emitter, name: str, half: int | None) -> str:
    if half is None:
        return name
    return e.op("Split", name, axis=1, num_outputs=2, outputs=2)[half]


def _candidate_anchors(g: Graph) -> list[onnx.NodeProto]:
    """Sub nodes with a Softmax or Attention within a few producers: where a differential attention may end."""
    found = []
    for node in g.model.graph.node:
        if node.op_type == "Sub" and any(_has_softmax_above(g, i, 6) for i in node.input):
            found.append(node)
    return found


def _has_softmax_above(g: Graph, name: str, depth: int) -> bool:
    node = g.producer.get(name)
    if node is None or depth == 0:
        return False
    return node.op_type in ("Softmax", "Attention") or any(_has_softmax_above(g, i, depth - 1) for i in node.input)


def fuse_diff_attention(model: onnx.ModelProto, rules=tuple(RULES)) -> tuple[onnx.ModelProto, FusionReport]:
    """Find differential attention and replace each by one DiffAttention node (not yet cleaned up)."""
    model = onnx.shape_inference.infer_shapes(model, data_prop=True)
    g = Graph(model)
    fired = {name: 0 for name in rules}
    misses: list[str] = []
    matches = []
    for sub in _candidate_anchors(g):
        reasons = []
        for name in rules:
            try:
                matches.append(RULES[name](g, sub))
                break
            except NoMatch as exc:
                reasons.append(f"{name}: {exc}")
        else:
            misses.append(f"{sub.name or sub.output[0]}: " + "; ".join(reasons))
    if not matches:
        return model, FusionReport(fired, misses)
    wanted = set()
    for m in matches:
        for b in (m.first, m.second):
            wanted |= {n for n in (b.q, b.kt, b.probs, b.k, b.mask) if n}
        wanted |= {m.lam, *m.value}
        for a, b in m.extra_probe:
            wanted |= {a, b}
    constants = {n: g.const(n) for n in wanted}
    values = probe(model, sorted(n for n, c in constants.items() if c is None))
    values.update({n: c for n, c in constants.items() if c is not None})
    replacements: dict[str, tuple[list, list]] = {}
    for index, m in enumerate(matches):
        try:
            for a, b in m.extra_probe:
                if not np.allclose(values[a], values[b], rtol=1e-5, atol=1e-6):
                    raise NoMatch(f"{a} and {b} should be the same tensor (one map's pieces), they differ")
            replacements[m.anchor.output[0]] = _rewrite(g, m, index, values)
            fired[m.rule] += 1
        except NoMatch as exc:
            misses.append(f"{m.anchor.name or m.anchor.output[0]}: {m.rule}: {exc}")
    if not replacements:
        return model, FusionReport(fired, misses)
    nodes = []
    for node in model.graph.node:
        if node.output and node.output[0] in replacements:
            new_nodes, inits = replacements[node.output[0]]
            nodes.extend(new_nodes)
            model.graph.initializer.extend(inits)
        else:
            nodes.append(node)
    del model.graph.node[:]
    model.graph.node.extend(nodes)
    return model, FusionReport(fired, misses)


def check_fusable_model(model: onnx.ModelProto) -> None:
    if any(n.op_type == contract.OP_NAME and n.domain == contract.ONNX_DOMAIN for n in model.graph.node):
        raise DiffExportError("the graph already has DiffAttention nodes: nothing to fuse (use `inspect`)")
    if any(n.op_type == "GroupQueryAttention" and n.domain == "com.microsoft" for n in model.graph.node):
        raise DiffExportError("the graph runs its attention as onnxruntime's GroupQueryAttention (a `--attention gqa` "
                              "export, or an onnxruntime-genai build): nothing to fuse (use `inspect`)")


# ---------------------------------------------------------------- epilogue: the per-head norm after the attention

def _only_consumer(g: Graph, name: str, op_type: str) -> onnx.NodeProto:
    users = g.consumers.get(name, [])
    if len(users) != 1 or users[0].op_type != op_type:
        raise NoMatch(f"{name} does not feed exactly one {op_type}")
    return users[0]


def _rms_chain(g: Graph, x: str) -> tuple[list[onnx.NodeProto], str, float, np.ndarray | None]:
    """x -> RMSNorm over the last axis, written out (Pow, ReduceMean, Add eps, Sqrt, Reciprocal, Mul) or as
    opset-23 RMSNormalization: (the nodes, the normed tensor, eps, the norm's own scale or None).
    Shape(x) consumers are allowed (they are moved to the final tensor, which has x's shape)."""
    users = [u for u in g.consumers.get(x, []) if u.op_type != "Shape"]
    if len(users) == 1 and users[0].op_type == "RMSNormalization":
        rms = users[0]
        gain = g.const(rms.input[1])
        if _attr(rms, "axis", -1) not in (-1, 3) or gain is None or _attr(rms, "stash_type", 1) != 1:
            raise NoMatch("RMSNormalization is not over the last axis in fp32 with a constant scale")
        return [rms], rms.output[0], float(_attr(rms, "epsilon", 1e-5)), gain.reshape(-1)
    square = next((u for u in users if (u.op_type == "Pow" and g.scalar(u.input[1]) == 2.0)
                   or (u.op_type == "Mul" and u.input[0] == u.input[1] == x)), None)
    scale = next((u for u in users if u.op_type == "Mul" and u is not square), None)
    if len(users) != 2 or square is None or scale is None:
        raise NoMatch("the attention output is not followed by an RMSNorm")
    mean = _only_consumer(g, square.output[0], "ReduceMean")
    axes = g.const(mean.input[1]) if len(mean.input) > 1 else _attr(mean, "axes")
    if axes is None or np.atleast_1d(axes).tolist() not in ([-1], [3]) or _attr(mean, "keepdims", 1) != 1:
        raise NoMatch("the RMSNorm does not average over the last axis")
    add = _only_consumer(g, mean.output[0], "Add")
    eps = next((g.scalar(i) for i in add.input if g.scalar(i) is not None), None)
    sqrt = _only_consumer(g, add.output[0], "Sqrt")
    recip = _only_consumer(g, sqrt.output[0], "Reciprocal")
    if eps is None or eps <= 0 or recip.output[0] not in scale.input:
        raise NoMatch("the RMSNorm's epsilon or reciprocal does not fit")
    return [square, mean, add, sqrt, recip, scale], scale.output[0], eps, None


def absorb_epilogues(model: onnx.ModelProto) -> tuple[onnx.ModelProto, int, list[str]]:
    """Move RMSNorm, per-channel weight and constant scale after fused nodes into the node
    (norm=1, norm_weight, output_scale), as the contract allows."""
    g = Graph(model)
    dead: set[int] = set()
    renames: dict[str, str] = {}
    misses: list[str] = []
    count = 0
    for node in model.graph.node:
        if node.op_type != contract.OP_NAME or node.domain != contract.ONNX_DOMAIN:
            continue
        attrs = {a.name: helper.get_attribute_value(a) for a in node.attribute}
        weight = g.const(node.input[4])
        if attrs.get("norm") or attrs.get("output_scale", 1.0) != 1.0 or weight is None or not np.all(weight == 1):
            continue
        try:
            tail = _only_consumer(g, node.output[0], "Reshape")
            users = g.consumers.get(tail.output[0], [])
            if len(users) == 1 and users[0].op_type == "Transpose":
                tail = users[0]
            chain, y, eps, norm_gain = _rms_chain(g, tail.output[0])
            dv = weight.shape[0]
            scale, gain = 1.0, np.ones(dv, np.float64)
            if norm_gain is not None:
                if norm_gain.size != dv:
                    raise NoMatch(f"RMSNormalization scale has {norm_gain.size} values, not {dv}")
                gain = gain * norm_gain
            while True:
                users = g.consumers.get(y, [])
                if len(users) != 1 or users[0].op_type != "Mul":
                    break
                other = next(i for i in users[0].input if i != y)
                value = g.const(other)
                if value is None:
                    break
                if value.size == 1:
                    scale *= float(value.reshape(-1)[0])
                elif value.shape[-1] == dv and value.size == dv:
                    gain = gain * value.reshape(-1)
                else:
                    break
                chain.append(users[0])
                y = users[0].output[0]
        except NoMatch as exc:
            misses.append(f"{node.name}: epilogue: {exc}")
            continue
        weight_name = f"{node.name.replace('/', '_')}_norm_weight"
        model.graph.initializer.append(numpy_helper.from_array(gain.astype(np.float32), weight_name))
        node.input[4] = weight_name
        for a in node.attribute:
            if a.name == "norm":
                a.i = 1
            elif a.name == "norm_eps":
                a.f = eps
            elif a.name == "output_scale":
                a.f = scale
        for shape_user in g.consumers.get(tail.output[0], []):
            if shape_user.op_type == "Shape":
                shape_user.input[0] = y
        renames[tail.output[0]] = y
        dead |= {id(n) for n in chain}
        count += 1
    kept = [n for n in model.graph.node if id(n) not in dead]
    for n in kept:
        for i, out in enumerate(n.output):
            if out in renames:
                n.output[i] = renames[out]
    del model.graph.node[:]
    model.graph.node.extend(kept)
    return model, count, misses
