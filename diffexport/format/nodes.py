"""DiffAttention nodes in an ONNX graph: which nodes are ours, and their contract attributes."""

from __future__ import annotations

import onnx

from diffexport.core import contract
from diffexport.core.contract import DiffAttentionAttrs
from diffexport.core.errors import DiffExportError

# Node attributes that select or configure the TensorRT plugin, not the contract's math.
PLUGIN_FIELDS = contract.PLUGIN_SELECTOR_ATTRIBUTES + tuple(a.name for a in contract.PLUGIN_ONLY_ATTRIBUTES)


def plugin_selectors(key_mask: bool) -> dict[str, str]:
    """What every writer of a DiffAttention node (the export, fusion, TensorRT's preparation)
    stamps on it for TensorRT's ONNX parser to pick our plugin: the namespace, and the plugin
    version that takes key_mask (KV-cache decoders) or not."""
    version = contract.KEY_MASK_PLUGIN_VERSION if key_mask else contract.PLUGIN_VERSION
    return dict(zip(contract.PLUGIN_SELECTOR_ATTRIBUTES, (contract.PLUGIN_NAMESPACE, version)))


def is_diff_attention(node: onnx.NodeProto) -> bool:
    return node.op_type == contract.OP_NAME and node.domain == contract.ONNX_DOMAIN


def node_attrs(node: onnx.NodeProto) -> DiffAttentionAttrs:
    """The contract attributes of a DiffAttention node (plugin fields left aside), validated."""
    values = {a.name: onnx.helper.get_attribute_value(a) for a in node.attribute if a.name not in PLUGIN_FIELDS}
    try:
        return DiffAttentionAttrs.from_mapping(values)
    except DiffExportError as exc:
        raise DiffExportError(f"DiffAttention node {node.name or '(unnamed)'}: {exc}") from None
