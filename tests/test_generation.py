"""Eager KV-cache decoding: cached steps equal full forwards, left padding is exact, greedy tokens equal
transformers' generate() for imported DiffLlama checkpoints, sampling is seeded and valid."""

import pytest
import torch

from diffexport.core.eager_generation import Sampling, choose_next, generate, left_pad
from diffexport.core.errors import DiffExportError
from diffexport.modeling.checkpoint import load_model
from diffexport.modeling.families import build_model
from diffexport.modeling.presets import preset_config

PRESETS = ("diff-v1-tiny", "diff-v2-tiny", "transformer-tiny")


def _model(preset, seed=3):
    cfg = preset_config(preset)
    if preset == "diff-v1-tiny":  # GQA and an affine head norm that is not all ones
        cfg.n_heads, cfg.n_kv_heads, cfg.head_dim = 4, 2, 16
    model = build_model(cfg, seed=seed).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.add_(0.1 * torch.randn(p.shape, generator=torch.Generator().manual_seed(seed)))
    return model


@pytest.mark.parametrize("preset", PRESETS)
def test_cached_steps_equal_full_forwards(preset, rng):
    model = _model(preset)
    ids = torch.randint(0, model.config.vocab_size, (2, 23), generator=rng)
    with torch.no_grad():
        full = model(ids)
        past, pieces = None, []
        for start, stop in ((0, 9), (9, 10), (10, 14), (14, 15), (15, 23)):  # prefill, 1-token and multi-token steps
            logits, past = model(ids[:, start:stop], past_key_values=past, use_cache=True)
            pieces.append(logits)
    assert all(k.shape == (2, 23, k.shape[-1]) for k, _ in past)
    err = (torch.cat(pieces, dim=1) - full).abs().max().item()
    assert err <= 1e-5 * max(1.0, full.abs().max().item()), err


@pytest.mark.parametrize("preset", PRESETS)
def test_left_padding_gives_the_unpadded_logits(preset, rng):
    """Row 0 is padded by 6 on the left; its real tokens must score as if alone, prefill and decode."""
    model = _model(preset)
    vocab = model.config.vocab_size
    short = torch.randint(0, vocab, (7,), generator=rng).tolist()
    long = torch.randint(0, vocab, (13,), generator=rng).tolist()
    ids, mask = left_pad([short, long], pad_token_id=vocab - 1)
    with torch.no_grad():
        out = generate(model, ids, mask, max_new_tokens=6)
        alone = generate(model, torch.tensor([short]), max_new_tokens=6)
        alone_long = generate(model, torch.tensor([long]), max_new_tokens=6)
    assert torch.equal(out.tokens[0], alone.tokens[0]) and torch.equal(out.tokens[1], alone_long.tokens[0])
    for step, (a, b) in enumerate(zip(out.step_logits, alone.step_logits)):
        assert torch.isfinite(a).all()
        assert (a[0] - b[0]).abs().max().item() <= 1e-5 * max(1.0, b.abs().max().item()), step


@pytest.mark.parametrize("heads,kv_heads", [(8, 4), (8, 2)])
def test_greedy_tokens_equal_transformers_generate(heads, kv_heads, tmp_path):
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(heads * 7 + kv_heads)
    cfg = transformers.DiffLlamaConfig(vocab_size=96, hidden_size=64, intermediate_size=112, num_hidden_layers=2,
                                       num_attention_heads=heads, num_key_value_heads=kv_heads, head_dim=16,
                                       pad_token_id=0, bos_token_id=1, eos_token_id=2)
    hf = transformers.DiffLlamaForCausalLM(cfg).eval()
    hf.save_pretrained(tmp_path / "hf")
    ours = load_model(tmp_path / "hf").model.eval()
    gen = torch.Generator().manual_seed(5)
    prompts = [torch.randint(3, 96, (n,), generator=gen).tolist() for n in (5, 11)]
    ids, mask = left_pad(prompts, pad_token_id=0)
    with torch.no_grad():
        expected = hf.generate(ids, attention_mask=mask, max_new_tokens=40, do_sample=False, min_new_tokens=40,
                               pad_token_id=0)[:, ids.shape[1]:]
        got = generate(model=ours, input_ids=ids, attention_mask=mask, max_new_tokens=40)
    assert torch.equal(got.tokens, expected)


def test_repetition_penalty_equals_transformers(tmp_path):
    """The penalty's rule against transformers' own logits processor (fresh logits of both signs,
    ids repeated), and greedy generate with it against transformers' generate, prompt by prompt (its
    batches would also penalise the pad id of padded rows; ours leave padding out)."""
    transformers = pytest.importorskip("transformers")
    from transformers.generation.logits_process import RepetitionPenaltyLogitsProcessor

    from diffexport.core.eager_generation import penalize_repeats, seen_tokens

    gen = torch.Generator().manual_seed(11)
    ids = torch.randint(0, 50, (3, 9), generator=gen)
    logits = torch.randn(3, 50, generator=gen) * 4
    expected = RepetitionPenaltyLogitsProcessor(1.3)(ids, logits.clone())
    assert torch.equal(penalize_repeats(logits, seen_tokens(ids, None, 50), 1.3), expected)
    mask = torch.ones_like(ids)
    mask[0, :4] = 0  # padding is not text: those ids stay unpenalised unless they recur after it
    only_real = seen_tokens(ids, mask, 50)
    assert torch.equal(only_real[0], seen_tokens(ids[:1, 4:], None, 50)[0])
    assert torch.equal(only_real[1:], seen_tokens(ids[1:], None, 50))

    torch.manual_seed(4)
    cfg = transformers.DiffLlamaConfig(vocab_size=96, hidden_size=64, intermediate_size=112, num_hidden_layers=2,
                                       num_attention_heads=8, num_key_value_heads=4, head_dim=16,
                                       pad_token_id=0, bos_token_id=1, eos_token_id=2)
    hf = transformers.DiffLlamaForCausalLM(cfg).eval()
    hf.save_pretrained(tmp_path / "hf")
    ours = load_model(tmp_path / "hf").model.eval()
    changed = False
    for n in (5, 11):
        prompt = torch.randint(3, 96, (1, n), generator=gen)
        with torch.no_grad():
            expected = hf.generate(prompt, max_new_tokens=30, do_sample=False, min_new_tokens=30, pad_token_id=0,
                                   repetition_penalty=1.3)[:, n:]
            got = generate(ours, prompt, max_new_tokens=30, sampling=Sampling(repetition_penalty=1.3))
            plain = generate(ours, prompt, max_new_tokens=30)
        assert torch.equal(got.tokens, expected)
        changed |= not torch.equal(plain.tokens, got.tokens)
    assert changed  # the penalty did something


def test_sampling_is_seeded_and_respects_top_k_and_top_p():
    logits = torch.tensor([[4.0, 3.0, 2.0, 1.0, 0.0]] * 2)
    draws = [choose_next(logits, Sampling(greedy=False, top_k=2, seed=0), torch.Generator().manual_seed(s))
             for s in range(40)]
    assert {int(t) for d in draws for t in d} <= {0, 1}
    # top_p just above p(token 0) keeps tokens 0 and 1 only
    p0 = logits.softmax(-1)[0, 0].item()
    draws = [choose_next(logits, Sampling(greedy=False, top_p=p0 + 1e-3), torch.Generator().manual_seed(s))
             for s in range(40)]
    assert {int(t) for d in draws for t in d} == {0, 1}
    a = choose_next(logits, Sampling(greedy=False), torch.Generator().manual_seed(9))
    b = choose_next(logits, Sampling(greedy=False), torch.Generator().manual_seed(9))
    assert torch.equal(a, b)


def test_extreme_temperatures_and_nucleus_still_give_a_distribution():
    """A temperature of 1e-45 (or a denormal) overflowed logits / T to inf and softmax to NaN, and a
    top-p of 1e-300 (0 in float32) dropped every token (issue 43: a traceback on the onnxruntime
    loop while genai answered): both now give the limit, the most likely token, and a moderate
    temperature gives softmax(logits / T) as before."""
    from diffexport.core.eager_generation import next_token_probs

    logits = torch.randn(3, 97, generator=torch.Generator().manual_seed(5)) * 4
    best = logits.argmax(-1)
    for sampling in (Sampling(greedy=False, temperature=1e-45), Sampling(greedy=False, temperature=5e-324, top_k=3),
                     Sampling(greedy=False, top_p=1e-300), Sampling(greedy=False, temperature=1e-45, top_p=1e-300)):
        probs = next_token_probs(logits, sampling)
        assert torch.isfinite(probs).all() and torch.equal(probs.argmax(-1), best)
        assert torch.allclose(probs.max(-1).values, torch.ones(3))
    moderate = next_token_probs(logits, Sampling(greedy=False, temperature=0.7))
    torch.testing.assert_close(moderate, (logits.double() / 0.7).softmax(-1).float(), atol=1e-6, rtol=1e-5)


def test_stop_text_holds_back_what_could_begin_a_stop_string():
    from diffexport.core.eager_generation import StopText

    pieces = ["Hel", "lo", " wor", "ld", "\n", "\n", "Next"]
    text = StopText(["\n\n", "world!"], pieces.__getitem__)
    shown = [text.push(i) for i in range(len(pieces))]
    # " wor" could begin "world!", "\n" could begin "\n\n": held back until they cannot
    assert shown == ["Hel", "lo", " ", "", "world", "", ""] and text.done and text.text == "Hello world"
    assert text.push(0) == "" and text.text == "Hello world"  # after the stop nothing more is taken
    free = StopText(["END"], pieces.__getitem__)
    shown = [free.push(i) for i in range(len(pieces))] + [free.flush()]
    assert "".join(shown) == "".join(pieces) and not free.done
    first = StopText(["a", "xyz"], ["bab"].__getitem__)  # the earliest stop wins, inside one token
    assert first.push(0) == "b" and first.done and first.text == "b"
    with pytest.raises(DiffExportError, match="non-empty"):
        StopText(["ok", ""], str)


@pytest.mark.parametrize("kwargs,pattern", [
    (dict(greedy=False, temperature=0.0), "temperature"),
    (dict(greedy=False, top_k=-1), "top-k"),
    (dict(greedy=False, top_p=0.0), "top-p"),
    (dict(repetition_penalty=0.0), "repetition penalty"),
    (dict(repetition_penalty=float("nan")), "repetition penalty"),
    (dict(repetition_penalty=True), "repetition penalty"),
])
def test_bad_sampling_options(kwargs, pattern):
    with pytest.raises(DiffExportError, match=pattern):
        Sampling(**kwargs)


def test_bad_generation_requests():
    model = _model("diff-v1-tiny")
    with pytest.raises(DiffExportError, match="max_new_tokens"):
        generate(model, torch.tensor([[1, 2]]), max_new_tokens=0)
    with pytest.raises(DiffExportError, match="needs the tokens each row has seen"):
        choose_next(torch.zeros(1, 4), Sampling(repetition_penalty=1.2), None)
    with pytest.raises(DiffExportError, match="attention_mask shape"):
        model(torch.tensor([[1, 2]]), attention_mask=torch.ones(1, 3, dtype=torch.int64))
    with pytest.raises(DiffExportError, match="at least one token"):
        left_pad([[1], []])
