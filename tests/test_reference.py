"""The eager references (naive Eq. 1, FlashDiffAttn_1, FlashDiffAttn_2) against the float64 oracle."""

import math

import pytest
import torch
from helpers import assert_close_fp32, assert_close_lowprec, lowprec_baseline, make_inputs
from oracle import diff_attention_oracle

from diffexport.core.contract import DiffAttentionAttrs
from diffexport.kernel import reference
from diffexport.modeling.diff_v1 import lambda_init_schedule

REFS = sorted(reference.REFERENCES)
# (q_len, kv_len): single token, odd, decode-style q_len < kv_len, a non-multiple-of-tile length
LENGTHS = [(1, 1), (17, 17), (5, 23), (1, 9), (113, 113)]


def attrs_for(variant, ratio, causal, norm=None, heads=4, head_dim=8, **kw):
    norm = (variant == 1) if norm is None else norm
    return DiffAttentionAttrs(variant=variant, num_heads=heads, num_kv_heads=heads // ratio, head_dim=head_dim,
                              causal=causal, norm=int(norm), **kw)


def oracle(inputs, attrs):
    q, k, v, lam, w = (None if t is None else t.double().numpy() for t in inputs)
    return diff_attention_oracle(q, k, v, lam, w, **attrs.as_dict())


@pytest.mark.parametrize("ref", REFS)
@pytest.mark.parametrize("variant", [1, 2])
@pytest.mark.parametrize("ratio", [1, 2, 4])
@pytest.mark.parametrize("causal", [0, 1])
@pytest.mark.parametrize("lengths", LENGTHS)
def test_fp32_matches_oracle(ref, variant, ratio, causal, lengths, rng):
    attrs = attrs_for(variant, ratio, causal, output_scale=0.7 if variant == 1 else 1.0)
    inputs = make_inputs(attrs, 2, *lengths, rng=rng)
    out = reference.REFERENCES[ref](*inputs, attrs)
    assert out.shape == (2, lengths[0], attrs.num_heads * attrs.value_dim)
    assert_close_fp32(out, oracle(inputs, attrs), f"{ref} v{variant} gqa{ratio} causal{causal} {lengths}")


@pytest.mark.parametrize("ref", REFS)
@pytest.mark.parametrize("norm_weight", [True, False])
def test_epilogue_variants(ref, norm_weight, rng):
    """Norm with and without weight, explicit scale, batch 3, head_dim 64 (a kernel size)."""
    attrs = attrs_for(1, 2, 1, heads=2, head_dim=64, scale=0.05, norm_eps=1e-6, output_scale=0.35)
    inputs = make_inputs(attrs, 3, 19, 31, rng=rng, norm_weight=norm_weight)
    assert_close_fp32(reference.REFERENCES[ref](*inputs, attrs), oracle(inputs, attrs), ref)


@pytest.mark.parametrize("ref", REFS)
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("variant", [1, 2])
def test_lowprec_rule(ref, dtype, variant, rng):
    attrs = attrs_for(variant, 2, 1, heads=4, head_dim=16)
    inputs = make_inputs(attrs, 2, 33, 47, dtype=dtype, rng=rng)
    out = reference.REFERENCES[ref](*inputs, attrs)
    assert out.dtype == dtype
    baseline = lowprec_baseline(*inputs, attrs)
    assert_close_lowprec(out, baseline, oracle(inputs, attrs), f"{ref} {dtype} v{variant}",
                         min_cosine=0.9999 if dtype == torch.float16 else 0.999)


def test_gqa_each_map_attends_its_own_key(rng):
    """Flash semantics: with GQA, map 2 reads K2 of its group, never K1 (the naive-file trap)."""
    attrs = attrs_for(1, 2, 0, norm=0)
    q, k, v, lam, _ = make_inputs(attrs, 1, 6, 6, rng=rng)
    base = reference.flash_diff_attention_1(q, k, v, lam, None, attrs)
    k_swapped = k.view(1, 6, 2, 2, 8).flip(3).reshape(1, 6, -1)  # swap K1 and K2 inside each group
    assert (reference.flash_diff_attention_1(q, k_swapped, v, lam, None, attrs) - base).abs().max() > 1e-3


# The textbook's worked example (FACTS.md): one head, D = 2, lambda = 0.4, not causal.
TEXTBOOK_Q = [[1, 0, 1, 0], [0, 2, 0, 1], [1, 1, 1, 0], [0, 0, 1, 1], [1, 0, 0, 1]]
TEXTBOOK_K = [[0, 1, 0, 1], [1, 0, 1, 0], [1, 1, 0, 0], [0, 0, 1, 1], [1, 0, 0.5, 0.5]]
TEXTBOOK_V = [[1, 0, 0, 0], [0, 1, 0, 0], [0, 0, 1, 0], [0, 0, 0, 1], [0.5, 0.5, 0.5, 0.5]]
PAPER_ROWS = [[0.1576, 0.2298, 0.2848, 0.1026], [0.2644, 0.0421, 0.3194, -0.0129],
              [0.1801, 0.1252, 0.3663, 0.0333], [0.1913, 0.1913, 0.2281, 0.1168],
              [0.1026, 0.2848, 0.2848, 0.1026]]
CLAMPED_ROWS = [[0.2626, 0.3830, 0.4746, 0.1710], [0.4269, 0.0679, 0.5156, 0.0104],
                [0.2909, 0.2021, 0.5917, 0.0848], [0.3189, 0.3189, 0.3801, 0.1947],
                [0.1710, 0.4746, 0.4746, 0.1710]]


def _textbook(**kw):
    attrs = DiffAttentionAttrs(variant=1, num_heads=1, num_kv_heads=1, head_dim=2, causal=0, norm=0)
    q, k, v = (torch.tensor([rows], dtype=torch.float64) for rows in (TEXTBOOK_Q, TEXTBOOK_K, TEXTBOOK_V))
    return reference.naive_diff_attention(q, k, v, torch.tensor([0.4], dtype=torch.float64), None, attrs, **kw)[0]


def test_textbook_example_paper_formula():
    assert torch.allclose(_textbook(), torch.tensor(PAPER_ROWS, dtype=torch.float64), atol=1e-4)


def test_textbook_example_clamp_renormalise_variant():
    out = _textbook(clamp_renormalise=True)
    assert torch.allclose(out, torch.tensor(CLAMPED_ROWS, dtype=torch.float64), atol=1.5e-4)
    # the paper's formula is the default, and it differs from the clamped variant
    assert (_textbook() - out).abs().max() > 0.1


def test_lambda_init_schedule_and_sign():
    assert lambda_init_schedule(0) == pytest.approx(0.2)
    assert lambda_init_schedule(1) == pytest.approx(0.8 - 0.6 * math.exp(-0.3))
    assert all(lambda_init_schedule(i) < lambda_init_schedule(i + 1) < 0.8 for i in range(40))


def test_causal_longer_query_than_keys_is_refused(rng):
    from diffexport.core import contract
    from diffexport.core.errors import DiffExportError

    attrs = attrs_for(1, 1, 1)
    q, k, v, lam, w = make_inputs(attrs, 1, 9, 4, rng=rng)
    with pytest.raises(DiffExportError, match="Sq <= Skv"):
        contract.check_shapes(attrs, q.shape, k.shape, v.shape, lam.shape, w.shape)


def test_the_oracle_below_the_contract_zeroes_rows_that_see_no_key(rng):
    """Causal with more queries than keys, which the contract refuses and the kernels' C ABI takes
    (tests/test_kernel_emulated.py: rows without keys): row i sees keys 0 .. i + Skv - Sq, none where
    that is negative, as FlashDiffAttn_1 computes. (Until 2026-11-29 the oracle's slice from a
    negative start counted from the end, so rows 1-3 here saw keys they should not.)"""
    attrs = attrs_for(1, 2, 1)
    inputs = make_inputs(attrs, 2, 9, 4, rng=rng)
    expected = oracle(inputs, attrs)
    assert (expected[:, :5] == 0).all() and (expected[:, 5:] != 0).any()
    assert_close_fp32(reference.flash_diff_attention_1(*inputs, attrs), expected, "9 queries, 4 keys")
