"""The references on a CUDA GPU: torch SDPA's backends (flash, cuDNN, efficient) and flash_attn
when importable, in fp16/bf16, against the float64 oracle. Marked gpu: skipped without CUDA."""

import pytest
import torch
from helpers import assert_close_lowprec, lowprec_baseline, make_inputs
from oracle import diff_attention_oracle

from diffexport.core.contract import DiffAttentionAttrs
from diffexport.kernel import reference

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("backend", ["flash", "cudnn", "efficient"])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("variant,ratio,causal,lengths", [
    (1, 1, 1, (113, 113)), (1, 2, 0, (17, 1023)), (1, 4, 1, (1, 4097)), (2, 2, 1, (113, 113)),
])
def test_flash_diff_2_on_sdpa_backends(backend, dtype, variant, ratio, causal, lengths, rng):
    """FlashDiffAttn_2 keeps head_dim_v == head_dim_qk, which every SDPA backend accepts."""
    from torch.nn.attention import sdpa_kernel

    attrs = DiffAttentionAttrs(variant=variant, num_heads=4, num_kv_heads=4 // ratio, head_dim=64,
                               causal=causal, norm=int(variant == 1), output_scale=0.6)
    cpu_inputs = make_inputs(attrs, 2, *lengths, dtype=dtype, rng=rng)
    inputs = [None if t is None else t.cuda() for t in cpu_inputs]
    torch.cuda.synchronize()
    try:
        with sdpa_kernel([reference.sdpa_backend(backend)]):
            out = reference.flash_diff_attention_2(*inputs, attrs)
    except RuntimeError as exc:  # a backend that cannot take this shape/mask says so: not our failure
        pytest.skip(f"SDPA {backend} refused: {str(exc).splitlines()[0]}")
    q, k, v, lam, w = (None if t is None else t.double().numpy() for t in cpu_inputs)
    ref = diff_attention_oracle(q, k, v, lam, w, **attrs.as_dict())
    baseline = lowprec_baseline(*inputs, attrs)
    assert_close_lowprec(out.cpu(), baseline.cpu(), ref, f"{backend} {dtype}",
                         min_cosine=0.9999 if dtype == torch.float16 else 0.999)


@pytest.mark.parametrize("ref_name", ["flash_diff_1", "flash_diff_2", "naive"])
def test_long_keys_fp16_no_overflow(ref_name, rng):
    """32k keys in fp16: softmax sums must not overflow (decode-shaped so the oracle stays cheap)."""
    attrs = DiffAttentionAttrs(variant=1, num_heads=2, num_kv_heads=1, head_dim=64, causal=1, output_scale=0.5)
    cpu_inputs = make_inputs(attrs, 1, 3, 32768, dtype=torch.float16, rng=rng)
    inputs = [None if t is None else t.cuda() for t in cpu_inputs]
    out = reference.REFERENCES[ref_name](*inputs, attrs).cpu()
    q, k, v, lam, w = (None if t is None else t.double().numpy() for t in cpu_inputs)
    ref = diff_attention_oracle(q, k, v, lam, w, **attrs.as_dict())
    assert_close_lowprec(out, lowprec_baseline(*inputs, attrs).cpu(), ref, ref_name)


def test_flash_attn_is_used_when_importable(rng):
    pytest.importorskip("flash_attn")
    q = torch.randn(1, 2, 8, 64, device="cuda", dtype=torch.float16)
    assert reference.attention_backend(q, q) == "flash_attn"
    assert reference.attention_backend(q, torch.randn(1, 2, 8, 128, device="cuda", dtype=torch.float16)) == "sdpa"


def test_analysis_on_cuda_matches_the_cpu(tmp_path):
    """stats and retrieval with --device cuda: the same magnitudes and accuracies as on the CPU
    (fp32 both; the statistics reduce on the GPU and come back small)."""
    import json

    from helpers import run_cli

    for argv, read in ((["stats", "--tokens", "1024", "--seq-len", "128"],
                        lambda d: d["diff-v1-tiny"]["attention_logits"]["overall"]["top1"]),
                       (["retrieval", "--needles", "1", "2", "--queries", "1", "--depths", "0", "100", "--samples", "4",
                         "--context", "64"], lambda d: d["diff-v1-tiny"]["cells"][-1]["answer_attention"])):
        got = run_cli(*argv, "--json", "--device", "cuda")
        want = run_cli(*argv, "--json", "--device", "cpu")
        assert got.returncode == 0 and want.returncode == 0, got.stderr + want.stderr
        assert read(json.loads(got.stdout)) == pytest.approx(read(json.loads(want.stdout)), rel=1e-3, abs=1e-5)
