"""The torch op's translation for torch.onnx.export: torch.ops.diffexport.diff_attention -> one
DiffAttention node, its attributes and inputs read from the contract (the node's schema: `op_schema`).
"""

from __future__ import annotations

import torch

import diffexport.kernel.op  # noqa: F401  (registers torch.ops.diffexport.diff_attention)
from diffexport.core import contract


def translation_table() -> dict:
    """custom_translation_table entry for torch.onnx.export: our torch op -> one DiffAttention node."""
    import onnxscript  # the onnx extra's, imported when an export runs

    v1 = onnxscript.values.Opset(contract.ONNX_DOMAIN, contract.OP_VERSION)
    v2 = onnxscript.values.Opset(contract.ONNX_DOMAIN, contract.KEY_MASK_VERSION)

    # The exporter binds the torch op's arguments to these parameters by name, so they are
    # spelled out; a test checks they follow contract.ATTRIBUTES.
    def diff_attention(query, key, value, lambda_full, norm_weight, key_mask, variant, num_heads, num_kv_heads,
                       head_dim, causal, scale, norm, norm_eps, output_scale):
        inputs = (query, key, value, lambda_full, norm_weight) + (() if key_mask is None else (key_mask,))
        domain = v1 if key_mask is None else v2  # a version-1 node has no key_mask
        return getattr(domain, contract.OP_NAME)(
            *inputs, variant=variant, num_heads=num_heads,
            num_kv_heads=num_kv_heads, head_dim=head_dim, causal=causal, scale=scale, norm=norm,
            norm_eps=norm_eps, output_scale=output_scale)

    return {torch.ops.diffexport.diff_attention.default: diff_attention}
