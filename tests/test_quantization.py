"""The logit quantiser (diffexport.core.quantization) against hand-computed cases: the definition the kernel mirrors."""

import pytest
import torch

from diffexport.core.errors import DiffExportError
from diffexport.core.quantization import (
    KEY_BLOCK,
    QUERY_BLOCK,
    LogitQuant,
    absmax_codes,
    check_bits,
    qk_int_logits,
    qmax_for,
    quantise_logit_rows,
    quantise_tokens,
    smooth_keys,
)


def test_integer_ranges():
    assert [qmax_for(b) for b in (8, 6, 4, 2, 16)] == [127, 31, 7, 1, 32767]


@pytest.mark.parametrize("bad", [1, 17, 0, -8, 8.0, True, "8"])
def test_bits_out_of_range_refused(bad):
    with pytest.raises(DiffExportError, match="2 to 16"):
        check_bits(bad)


def test_setting_validates_scheme_and_says_what_it_is():
    with pytest.raises(DiffExportError, match="scheme"):
        LogitQuant(8, "per-tensor")
    assert LogitQuant(16).active is False and LogitQuant(16).describe() == "not quantised"
    assert LogitQuant(6, "qk", True).describe() == "6-bit qk, K-smoothing"
    assert LogitQuant(4, "logits").describe() == "4-bit logits"


def test_codes_round_half_to_even_and_scale_is_absmax_over_qmax():
    # 3 bits: qmax 3; absmax 3 -> inv exactly 1, so x*inv are the ties themselves
    codes, scale = absmax_codes(torch.tensor([0.5, 1.5, 2.5, -3.0, -0.5]), 3, (0,))
    assert codes.tolist() == [0.0, 2.0, 2.0, -3.0, -0.0]
    assert scale.item() == 1.0
    # 4 bits: qmax 7, absmax 1 -> inv 7: 3.5 -> 4 (even), 1.75 -> 2, 0.882 -> 1
    codes, scale = absmax_codes(torch.tensor([0.5, -1.0, 0.25, 0.126]), 4, (0,))
    assert codes.tolist() == [4.0, -7.0, 2.0, 1.0]
    assert scale.item() == pytest.approx(1 / 7)


def test_all_zero_block_gives_zero_codes_and_a_finite_scale():
    codes, scale = absmax_codes(torch.zeros(2, 5), 8, (1,))
    assert (codes == 0).all() and torch.isfinite(scale).all() and (scale > 0).all()


def test_codes_never_leave_the_grid():
    x = torch.randn(4, 1000) * torch.logspace(-3, 3, 1000)
    for bits in (2, 4, 6, 8):
        codes, _ = absmax_codes(x, bits, (1,))
        assert codes.abs().max() <= qmax_for(bits)
        assert (codes == codes.round()).all()


def test_token_blocks_have_their_own_scales_and_a_short_last_block():
    torch.manual_seed(0)
    S = 2 * QUERY_BLOCK + 3  # two full blocks and a short one
    x = torch.randn(1, 2, S, 8)
    x[0, 0, QUERY_BLOCK + 5, 2] = 50.0  # an outlier in block 1 of head 0 only
    codes, scales = quantise_tokens(x, 8, QUERY_BLOCK)
    assert scales.shape == (1, 2, 3)
    for h in range(2):
        for blk, (lo, hi) in enumerate([(0, QUERY_BLOCK), (QUERY_BLOCK, 2 * QUERY_BLOCK), (2 * QUERY_BLOCK, S)]):
            assert scales[0, h, blk].item() == pytest.approx(x[0, h, lo:hi].abs().max().item() / 127)
    assert scales[0, 0, 1] > 10 * scales[0, 0, 0]  # the outlier stays in its block
    torch.testing.assert_close(codes * scales.repeat_interleave(QUERY_BLOCK, 2)[:, :, :S, None], x, atol=0.21, rtol=0)


def test_qk_logits_hand_computed():
    q = torch.tensor([[1.0, 2.0]]).view(1, 1, 1, 2)
    k = torch.tensor([[2.0, -1.0], [0.5, 0.5]]).view(1, 1, 2, 2)
    # q: absmax 2, inv 63.5: codes [64 (63.5, half to even), 127]; k: absmax 2: [[127, -64], [32, 32]]
    # sums: 64*127 - 127*64 = 0; 64*32 + 127*32 = 6112; times (2/127)*(2/127)
    out = qk_int_logits(q, k, 8, smooth_k=False)
    torch.testing.assert_close(out.view(-1), torch.tensor([0.0, 6112 * (2 / 127) * (2 / 127)]))
    # smoothing: K mean [1.25, -0.25]: K' = [[.75, -.75], [-.75, .75]], codes [[127,-127],[-127,127]]
    # sums: 64*127 - 127*127 = -8001 and +8001, times (2/127)*(0.75/127)
    out = qk_int_logits(q, k, 8, smooth_k=True)
    s = 8001 * (2 / 127) * (0.75 / 127)
    torch.testing.assert_close(out.view(-1), torch.tensor([-s, s]))


def test_smoothing_leaves_softmax_unchanged():
    torch.manual_seed(1)
    # keys with a large common offset
    q, k = torch.randn(2, 3, 17, 16).double(), torch.randn(2, 3, 33, 16).double() + 4.0
    exact = (q @ k.transpose(-1, -2)).softmax(-1)
    smoothed = k - k.mean(dim=2, keepdim=True)
    torch.testing.assert_close((q @ smoothed.transpose(-1, -2)).softmax(-1), exact, atol=1e-12, rtol=0)
    torch.testing.assert_close(smooth_keys(k), smoothed.float())  # the quantiser's version, in fp32


def test_qk_logits_gqa_reads_its_group_and_converges_with_bits():
    torch.manual_seed(2)
    q, k = torch.randn(1, 4, 70, 32), torch.randn(1, 2, KEY_BLOCK + 9, 32)
    exact = q @ k.repeat_interleave(2, dim=1).transpose(-1, -2)
    errors = [(qk_int_logits(q, k, b, smooth_k=False) - exact).abs().max().item() for b in (4, 6, 8, 12)]
    assert errors == sorted(errors, reverse=True) and errors[-1] < 0.05
    # 8-bit error bound: each operand off by at most half a step
    assert errors[2] < 32 * (q.abs().max() * k.abs().max()).item() / 127


def test_logit_rows_hand_computed_and_masked_entries_ignored():
    s = torch.tensor([[0.1, -2.0, 1.0, 100.0]])
    visible = torch.tensor([[True, True, True, False]])
    # visible absmax 2, 4 bits: inv 3.5 -> 0.35 -> 0, -7, 3.5 -> 4; dequant * 2/7
    out = quantise_logit_rows(s, 4, visible)
    torch.testing.assert_close(out, torch.tensor([[0.0, -2.0, 8 / 7, 100.0]]))
