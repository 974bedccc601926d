"""`diffexport::diff_attention`: the DiffAttention contract as a torch.library custom op.

Registered once, when this module is first imported. Arguments are the contract's inputs
followed by its attributes, in contract order (a test checks the schema against
diffexport.core.contract). The default implementation is the FlashDiffAttn_1 reference (two
attention calls, flash_attn or SDPA); on CUDA the fused kernel (diffexport.kernel.kernels) takes over
when its library is built and supports the call ($DIFFEXPORT_ATTENTION chooses); the fake implementation gives export
and torch.compile
the output shape. Gradients come from re-running that reference under autograd, so models
that call the op also train.
"""

from __future__ import annotations

from typing import Optional

import torch

from diffexport.core import contract
from diffexport.core.contract import DiffAttentionAttrs
from diffexport.core.errors import DiffExportError
from diffexport.kernel import kernels
from diffexport.kernel.reference import flash_diff_attention_1


def attrs_from_args(variant, num_heads, num_kv_heads, head_dim, causal, scale, norm, norm_eps,
                    output_scale) -> DiffAttentionAttrs:
    return DiffAttentionAttrs(variant=variant, num_heads=num_heads, num_kv_heads=num_kv_heads,
                              head_dim=head_dim, causal=causal, scale=scale, norm=norm,
                              norm_eps=norm_eps, output_scale=output_scale)


def _shape(t: Optional[torch.Tensor]):
    return None if t is None else tuple(t.shape)


@torch.library.custom_op(contract.TORCH_OP, mutates_args=())
def diff_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    lambda_full: torch.Tensor,
    norm_weight: torch.Tensor,
    key_mask: Optional[torch.Tensor],
    variant: int,
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
    causal: int,
    scale: float,
    norm: int,
    norm_eps: float,
    output_scale: float,
) -> torch.Tensor:
    attrs = attrs_from_args(variant, num_heads, num_kv_heads, head_dim, causal, scale, norm,
                            norm_eps, output_scale)
    return _reference(query, key, value, lambda_full, norm_weight, key_mask, attrs)


def _reference(query, key, value, lambda_full, norm_weight, key_mask, attrs: DiffAttentionAttrs) -> torch.Tensor:
    contract.check_shapes(attrs, _shape(query), _shape(key), _shape(value), _shape(lambda_full),
                          _shape(norm_weight), _shape(key_mask))
    if norm_weight.dtype not in (torch.float32, torch.float64):
        raise DiffExportError(f"norm_weight must be float32 (the norm runs in fp32), got {norm_weight.dtype}")
    if key_mask is not None and key_mask.dtype != torch.int64:
        raise DiffExportError(f"key_mask must be int64 (1 = present, 0 = padding), got {key_mask.dtype}")
    return flash_diff_attention_1(query, key, value, lambda_full, norm_weight, attrs, key_mask=key_mask)


@diff_attention.register_kernel("cuda")
def _diff_attention_cuda(query, key, value, lambda_full, norm_weight, key_mask, variant, num_heads, num_kv_heads,
                         head_dim, causal, scale, norm, norm_eps, output_scale):
    attrs = attrs_from_args(variant, num_heads, num_kv_heads, head_dim, causal, scale, norm, norm_eps,
                            output_scale)
    if kernels.use_fused(query, key, value, lambda_full, norm_weight, attrs, key_mask):
        return kernels.diff_attention(query, key, value, lambda_full, norm_weight, attrs, key_mask=key_mask)
    return _reference(query, key, value, lambda_full, norm_weight, key_mask, attrs)


@diff_attention.register_fake
def _diff_attention_fake(query, key, value, lambda_full, norm_weight, key_mask, variant, num_heads,
                         num_kv_heads, head_dim, causal, scale, norm, norm_eps, output_scale):
    attrs = attrs_from_args(variant, num_heads, num_kv_heads, head_dim, causal, scale, norm,
                            norm_eps, output_scale)
    # Widths are static and checked here; batch and lengths may be symbolic during export.
    torch._check(query.shape[-1] == 2 * attrs.num_heads * attrs.head_dim)
    torch._check(key.shape[-1] == attrs.key_width)
    torch._check(value.shape[-1] == attrs.num_kv_heads * attrs.value_dim)
    return query.new_empty(query.shape[0], query.shape[1], attrs.num_heads * attrs.value_dim)


def _setup_context(ctx, inputs, output):
    query, key, value, lambda_full, norm_weight, key_mask, *attr_values = inputs
    ctx.save_for_backward(query, key, value, lambda_full, norm_weight)
    ctx.key_mask = key_mask
    ctx.attrs = attrs_from_args(*attr_values)


def _backward(ctx, grad_output):
    saved = ctx.saved_tensors
    with torch.enable_grad():
        leaves = [None if t is None else t.detach().requires_grad_(True) for t in saved]
        out = flash_diff_attention_1(*leaves, ctx.attrs, key_mask=ctx.key_mask)
        wanted = [t for t in leaves if t is not None]
        grads = iter(torch.autograd.grad(out, wanted, grad_output, allow_unused=True))
    tensor_grads = [None if t is None else next(grads) for t in leaves]
    return (*tensor_grads, None, *([None] * len(contract.ATTRIBUTES)))


diff_attention.register_autograd(_backward, setup_context=_setup_context)


def call(query, key, value, lambda_full, norm_weight, attrs: DiffAttentionAttrs,
         key_mask: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Call the registered op with a DiffAttentionAttrs (what the models use)."""
    return torch.ops.diffexport.diff_attention(query, key, value, lambda_full, norm_weight, key_mask,
                                               *attrs.as_dict().values())
