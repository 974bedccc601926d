"""DiffAttention nodes in an ONNX graph: which nodes are ours, and their contract attributes; what a node
reads (its subgraphs' outer names too), the nodes some outputs depend on, and a graph's nodes in an
order that respects what they read."""

from __future__ import annotations

import onnx

from diffexport.core import contract
from diffexport.core.contract import DiffAttentionAttrs
from diffexport.core.errors import DiffExportError

# Node attributes that select or configure the TensorRT plugin, not the contract's math.
PLUGIN_FIELDS = contract.PLUGIN_SELECTOR_ATTRIBUTES + tuple(a.name for a in contract.PLUGIN_ONLY_ATTRIBUTES)


def plugin_selectors(key_mask: bool, kv_cache: bool = False) -> dict[str, str]:
    """What every writer of a DiffAttention node (the export, fusion, TensorRT's preparation, the
    8-bit cache pass) stamps on it for TensorRT's ONNX parser to pick our plugin: the namespace, and
    the plugin version that takes key_mask (KV-cache decoders) or not, or an 8-bit cache (version 3)."""
    version = (contract.KV_CACHE_PLUGIN_VERSION if kv_cache else
               contract.KEY_MASK_PLUGIN_VERSION if key_mask else contract.PLUGIN_VERSION)
    return dict(zip(contract.PLUGIN_SELECTOR_ATTRIBUTES, (contract.PLUGIN_NAMESPACE, version)))


def reads_kv_cache_codes(node: onnx.NodeProto) -> bool:
    """A version-3 DiffAttention node: it has all eight inputs (key and value an 8-bit cache's codes)."""
    return len(node.input) == len(contract.KV_CACHE_INPUTS) and all(node.input)


def is_diff_attention(node: onnx.NodeProto) -> bool:
    return node.op_type == contract.OP_NAME and node.domain == contract.ONNX_DOMAIN


def node_attrs(node: onnx.NodeProto) -> DiffAttentionAttrs:
    """The contract attributes of a DiffAttention node (plugin fields left aside), validated."""
    values = {a.name: onnx.helper.get_attribute_value(a) for a in node.attribute if a.name not in PLUGIN_FIELDS}
    try:
        return DiffAttentionAttrs.from_mapping(values)
    except DiffExportError as exc:
        raise DiffExportError(f"DiffAttention node {node.name or '(unnamed)'}: {exc}") from None


def names_read(node: onnx.NodeProto) -> list[str]:
    """A node's inputs and the outer names its subgraphs (If branches) read."""
    read = list(node.input)
    for attr in node.attribute:
        if attr.type == onnx.AttributeProto.GRAPH:
            made = {o for n in attr.g.node for o in n.output}
            read += [i for n in attr.g.node for i in names_read(n) if i not in made]
    return read


def live_nodes(nodes: list, outputs: list[str]) -> list:
    """The nodes that `outputs` depend on (their subgraphs' reads included), in their order."""
    needed, keep = set(outputs), []
    for n in reversed(nodes):
        if any(o in needed for o in n.output):
            keep.append(n)
            needed.update(i for i in names_read(n) if i)
    return keep[::-1]


def sort_topologically(graph: onnx.GraphProto) -> None:
    """In place: every node after the producers of what it reads, its subgraphs' reads included
    (onnxruntime's quantisers sort by node inputs alone and can put an If before what its branches
    read, which onnx.checker refuses). Stable: an already sorted graph keeps its order."""
    producer = {o: i for i, n in enumerate(graph.node) for o in n.output}
    nodes = list(graph.node)
    placed, order, visiting = set(), [], set()

    def place(i: int) -> None:
        stack = [(i, False)]
        while stack:
            index, expanded = stack.pop()
            if index in placed:
                continue
            if expanded:
                placed.add(index)
                order.append(nodes[index])
                continue
            if index in visiting:  # pushed twice before placed (or a cycle, which onnx.checker names)
                continue
            visiting.add(index)
            stack.append((index, True))
            for name in reversed(names_read(nodes[index])):
                source = producer.get(name)
                if source is not None and source not in placed:
                    stack.append((source, False))

    for i in range(len(nodes)):
        place(i)
    del graph.node[:]
    graph.node.extend(order)
