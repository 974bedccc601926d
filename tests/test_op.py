"""diffexport::diff_attention: schema = contract, numerics = oracle, fake impl, autograd, bad shapes."""

import pytest
import torch
from helpers import assert_close_fp32, make_inputs
from oracle import diff_attention_oracle

from diffexport.core import contract
from diffexport.core.contract import DiffAttentionAttrs
from diffexport.core.errors import DiffExportError
from diffexport.kernel import op, reference


def test_schema_follows_the_contract():
    schema = torch.ops.diffexport.diff_attention.default._schema
    names = [a.name for a in schema.arguments]
    assert names == list(contract.ALL_INPUT_NAMES) + list(contract.ATTRIBUTE_NAMES)
    assert contract.TORCH_OP == "diffexport::diff_attention"
    optional = [a.name for a in schema.arguments if str(a.type).startswith("Optional")]
    assert optional == [t.name for t in contract.ALL_INPUTS if t.optional]


def test_registered_once_and_reimport_is_harmless():
    import importlib

    before = torch.ops.diffexport.diff_attention.default
    importlib.import_module("diffexport.kernel.op")
    assert torch.ops.diffexport.diff_attention.default is before


@pytest.mark.parametrize("variant,ratio,causal,lengths", [
    (1, 1, 1, (17, 17)), (1, 2, 1, (3, 11)), (1, 4, 0, (9, 5)), (2, 2, 1, (1, 7)), (2, 1, 0, (13, 13)),
])
def test_op_matches_oracle(variant, ratio, causal, lengths, rng):
    attrs = DiffAttentionAttrs(variant=variant, num_heads=4, num_kv_heads=4 // ratio, head_dim=8, causal=causal,
                               norm=int(variant == 1), output_scale=0.6)
    inputs = make_inputs(attrs, 2, *lengths, rng=rng)
    out = op.call(*inputs, attrs)
    q, k, v, lam, w = (None if t is None else t.double().numpy() for t in inputs)
    assert_close_fp32(out, diff_attention_oracle(q, k, v, lam, w, **attrs.as_dict()))


@pytest.mark.parametrize("masked", [False, True])
@pytest.mark.parametrize("variant", [1, 2])
def test_opcheck(variant, masked, rng):
    """torch's own checks: schema, fake (meta) implementation, autograd registration, AOT dispatch."""
    attrs = DiffAttentionAttrs(variant=variant, num_heads=2, num_kv_heads=1, head_dim=8, causal=1,
                               norm=int(variant == 1), output_scale=0.8)
    q, k, v, lam, w = make_inputs(attrs, 2, 5, 7, rng=rng)
    key_mask = torch.tensor([[0, 0, 1, 1, 1, 1, 1], [1] * 7]) if masked else None
    for t in (q, k, v, lam):
        t.requires_grad_(True)
    torch.library.opcheck(torch.ops.diffexport.diff_attention.default,
                          (q, k, v, lam, w, key_mask, *attrs.as_dict().values()))


def test_fake_impl_gives_output_shape():
    from torch._subclasses.fake_tensor import FakeTensorMode

    attrs = DiffAttentionAttrs(variant=1, num_heads=3, num_kv_heads=1, head_dim=16)
    with FakeTensorMode():
        q = torch.empty(2, 5, 2 * 3 * 16)
        k = torch.empty(2, 9, 2 * 16)
        v = torch.empty(2, 9, 32)
        out = op.call(q, k, v, torch.empty(1), None, attrs)
    assert tuple(out.shape) == (2, 5, 3 * 32)


def test_gradients_match_naive_autograd(rng):
    attrs = DiffAttentionAttrs(variant=1, num_heads=2, num_kv_heads=1, head_dim=4, causal=1, output_scale=0.7)
    inputs = [t.double() for t in make_inputs(attrs, 2, 4, 6, rng=rng)]
    leaves_a = [t.clone().requires_grad_(True) for t in inputs]
    leaves_b = [t.clone().requires_grad_(True) for t in inputs]
    grad_out = torch.randn(2, 4, 2 * 8, generator=rng, dtype=torch.float64)
    (op.call(*leaves_a, attrs) * grad_out).sum().backward()
    (reference.naive_diff_attention(*leaves_b, attrs) * grad_out).sum().backward()
    for a, b in zip(leaves_a, leaves_b):
        assert a.grad is not None and torch.allclose(a.grad, b.grad, atol=1e-10), "gradient mismatch"
    assert torch.autograd.gradcheck(lambda *xs: op.call(*xs, attrs), leaves_a)


@pytest.mark.parametrize("change,message", [
    (dict(query=(2, 5, 63)), "query width"),
    (dict(key=(2, 7, 16)), "key width"),
    (dict(value=(2, 7, 8)), "value width"),
    (dict(key=(3, 7, 32)), "batch sizes differ"),
    (dict(value=(2, 6, 32)), "key length"),
    (dict(lambda_full=(2,)), "lambda_full shape"),
    (dict(norm_weight=(16,)), "norm_weight shape"),
    (dict(query=(2, 5, 4, 16)), "must be 3-D"),
])
def test_bad_shapes_are_refused(change, message):
    attrs = DiffAttentionAttrs(variant=1, num_heads=2, num_kv_heads=1, head_dim=16)
    shapes = dict(query=(2, 5, 64), key=(2, 7, 32), value=(2, 7, 32), lambda_full=(1,), norm_weight=(32,))
    shapes.update(change)
    tensors = {name: torch.randn(*shape) for name, shape in shapes.items()}
    with pytest.raises(DiffExportError, match=message):
        op.call(tensors["query"], tensors["key"], tensors["value"], tensors["lambda_full"],
                tensors["norm_weight"], attrs)


@pytest.mark.parametrize("norm", [0, 1])
def test_norm_weight_is_always_required(norm):
    """Five inputs always (all-ones weight where a model has none): the plugin's input list is fixed."""
    attrs = DiffAttentionAttrs(variant=1, num_heads=2, num_kv_heads=1, head_dim=16, norm=norm)
    q, k, v, lam = torch.randn(2, 5, 64), torch.randn(2, 5, 32), torch.randn(2, 5, 32), torch.tensor([0.5])
    with pytest.raises(DiffExportError, match="norm_weight is required"):
        op.call(q, k, v, lam, None, attrs)


def test_norm_weight_must_be_float32():
    """The contract types norm_weight float32 whatever the activation dtype (docs/OP_SPEC.md)."""
    attrs = DiffAttentionAttrs(variant=1, num_heads=2, num_kv_heads=1, head_dim=16)
    q, k, v = torch.randn(2, 5, 64).half(), torch.randn(2, 5, 32).half(), torch.randn(2, 5, 32).half()
    lam = torch.tensor([0.5]).half()
    with pytest.raises(DiffExportError, match="norm_weight must be float32"):
        op.call(q, k, v, lam, torch.ones(32).half(), attrs)
    assert op.call(q, k, v, lam, torch.ones(32), attrs).dtype == torch.float16


@pytest.mark.parametrize("values,message", [
    (dict(variant=3), "variant"),
    (dict(num_kv_heads=3), "must divide"),
    (dict(head_dim=0), "head_dim"),
    (dict(causal=2), "causal"),
    (dict(scale=-1.0), "scale"),
    (dict(norm_eps=0.0), "norm_eps"),
    (dict(output_scale=float("nan")), "finite"),
    (dict(variant=2, norm=1), "no per-head norm"),
    (dict(bogus=1), "unknown"),
])
def test_bad_attributes_are_refused(values, message):
    base = dict(variant=1, num_heads=4, num_kv_heads=2, head_dim=8)
    with pytest.raises(DiffExportError, match=message):
        DiffAttentionAttrs.from_mapping({**base, **values})


def test_missing_required_attribute():
    with pytest.raises(DiffExportError, match="required"):
        DiffAttentionAttrs.from_mapping(dict(variant=1, num_heads=4))


def test_op_spec_lists_the_contract():
    from pathlib import Path

    spec = (Path(__file__).parent.parent / "docs" / "OP_SPEC.md").read_text()
    for name in contract.INPUT_NAMES + contract.ATTRIBUTE_NAMES + tuple(t.name for t in contract.OUTPUTS):
        assert f"`{name}`" in spec, f"{name} missing from docs/OP_SPEC.md"
    assert f"version {contract.OP_VERSION}" in spec and f"domain `{contract.ONNX_DOMAIN}`" in spec
