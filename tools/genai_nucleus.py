"""Where onnxruntime-genai's top-p-only sampler (top_k 0) draws from, against the exact nucleus.

diffexport gives genai top_k = the vocabulary with a top-p draw (format.decoder_folder.genai_top_k)
because `check --sample --top-p 0.3` saw genai's top-p-only draws land outside transformers'
nucleus. Reading genai's source (src/sampling_distribution.h, FindNucleus) gave the reason: it
sorts candidates in growing batches and stops at the first prefix whose mass reaches p of an upper
bound on the total, prefix + (V - i - 1) * exp(current logit), instead of p of the total itself,
so it keeps more tokens than the nucleus (exactly the nucleus only for vocabularies of 64 or
fewer, where it sums them all). This tool measures that on the installed genai: for a few prompts
to a random-weight diff-v1-tiny folder it draws the first token many times with top_k 0, then
prints the size of the exact nucleus and of the bound one, the share of draws in each, and a
chi-square of the draws against the bound nucleus renormalised. When genai draws all in the
exact nucleus, the workaround can go.

    python tools/genai_nucleus.py [--top-p 0.3] [--draws 4000] [--prompts 3]
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from diffexport.backends import genai  # noqa: E402
from diffexport.core.eager_generation import Sampling, next_token_probs  # noqa: E402
from diffexport.export.decoder import export_decoder_graph  # noqa: E402
from diffexport.modeling.checkpoint import load_model  # noqa: E402

ROWS = 32  # genai 0.18 takes at most 32 rows to a generator; each row draws on its own


def bound_nucleus(logits: np.ndarray, p: float, temperature: float) -> np.ndarray:
    """The token ids genai's FindNucleus keeps, in float32 as it computes: batches of 16, 64, ...
    sorted candidates, stopping where the prefix reaches p of prefix + the tail's upper bound."""
    if len(logits) <= 64:  # genai sums the whole (small) vocabulary instead: the exact nucleus
        return exact_nucleus(logits, p, temperature)
    scores = logits.astype(np.float32)
    vocab = len(scores)
    order = np.argsort(-scores, kind="stable")
    top = scores.max()
    prefix, sorted_count, k, cut = np.float32(0), 0, min(16, vocab), 0
    while True:
        cut = k
        for i in range(sorted_count, k):
            weight = np.float32(np.exp((scores[order[i]] - top) / temperature))
            prefix += weight
            if prefix >= p * (prefix + np.float32(vocab - i - 1) * weight):
                cut = i + 1
                break
        sorted_count = k
        if cut < k or k == vocab:
            break
        k = min(4 * k, vocab)
    return order[:cut]


def exact_nucleus(logits: np.ndarray, p: float, temperature: float) -> np.ndarray:
    """transformers' nucleus, the support of eager generate's draw (eager_generation.next_token_probs)."""
    probs = next_token_probs(torch.from_numpy(logits)[None], Sampling(greedy=False, temperature=temperature, top_p=p))
    return torch.nonzero(probs[0] > 0).flatten().numpy()


def softmax(logits: np.ndarray, temperature: float) -> np.ndarray:
    weights = np.exp((logits - logits.max()) / temperature)
    return weights / weights.sum()


def genai_draws(model, prompt: list[int], p: float, temperature: float, draws: int) -> np.ndarray:
    import onnxruntime_genai as og

    tokens, seed = [], 0
    while len(tokens) < draws:
        params = og.GeneratorParams(model)
        params.set_search_options(max_length=len(prompt) + 1, do_sample=True, top_k=0, top_p=p,
                                  temperature=temperature, random_seed=seed, batch_size=ROWS)
        generator = og.Generator(model, params)
        generator.append_tokens(np.tile(np.asarray(prompt, np.int32), (ROWS, 1)))
        generator.generate_next_token()
        tokens += [int(t) for t in generator.get_next_tokens()]
        seed += 1
    return np.asarray(tokens[:draws])


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--top-p", type=float, default=0.3)
    parser.add_argument("--temperature", type=float, default=1.0)
    parser.add_argument("--draws", type=int, default=4000)
    parser.add_argument("--prompts", type=int, default=3)
    args = parser.parse_args()
    import onnxruntime_genai as og

    loaded = load_model(preset="diff-v1-tiny", seed=0)
    model = loaded.model.eval()
    vocab = loaded.config.vocab_size
    rng = np.random.default_rng(3)
    print(f"onnxruntime-genai {og.__version__}, diff-v1-tiny (vocab {vocab}, random weights), top_k 0, "
          f"top_p {args.top_p}, temperature {args.temperature}, {args.draws} draws per prompt")
    print("| prompt | exact nucleus | bound nucleus | draws in exact | draws in bound | chi2 vs bound (dof) |")
    print("|---:|---:|---:|---:|---:|---:|")
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp) / "folder"
        export_decoder_graph(loaded, folder, log=lambda *a: None)
        config = genai._genai_config(folder)
        for index in range(args.prompts):
            prompt = rng.integers(0, vocab, size=7).tolist()
            with torch.no_grad():
                logits = model(torch.tensor([prompt]))[0, -1].double().numpy()
            exact = exact_nucleus(logits, args.top_p, args.temperature)
            bound = bound_nucleus(logits, args.top_p, args.temperature)
            genai_model = genai.open_genai_model(folder, None, genai.genai_pad_for(config, [prompt]))
            draws = genai_draws(genai_model, prompt, args.top_p, args.temperature, args.draws)
            probs = softmax(logits, args.temperature)[bound]
            expected = probs / probs.sum() * len(draws)
            observed = np.array([(draws == token).sum() for token in bound])
            chi2 = float(((observed - expected) ** 2 / expected).sum())
            print(f"| {index + 1} | {len(exact)} | {len(bound)} | {np.isin(draws, exact).mean():.3f} | "
                  f"{np.isin(draws, bound).mean():.3f} | {chi2:.0f} ({len(bound) - 1}) |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
