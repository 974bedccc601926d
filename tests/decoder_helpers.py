"""What the decoder-folder tests share: the prompt they generate from, and eager's and genai's tokens."""

import numpy as np
import pytest
import torch

from diffexport.backends import genai
from diffexport.core.eager_generation import Sampling, generate

PROMPT = [5, 17, 42, 99, 3, 250, 7]
NEW_TOKENS = 36


def genai_tokens(folder, prompt=PROMPT, n=NEW_TOKENS):
    pytest.importorskip("onnxruntime_genai")
    tokens = genai.generate_genai(folder, prompt, n, Sampling()).tokens
    assert len(tokens) >= 32, f"only {len(tokens)} tokens before end-of-sequence: compare at least 32"
    return tokens


def eager_tokens(loaded, prompt=PROMPT, n=NEW_TOKENS, eos=None):
    return generate(loaded.model.eval(), torch.tensor([prompt]), max_new_tokens=n, eos_token_id=eos).tokens[0].tolist()


def text_perplexity(model, ids, window):
    """An independent perplexity: each window of the ids in one eager forward, next-token NLL in float64."""
    nll, count = 0.0, 0
    for start in range(0, len(ids), window):
        part = torch.tensor([ids[start:start + window]])
        if part.shape[1] < 2:
            continue
        with torch.no_grad():
            logp = torch.log_softmax(model(part)[0, :-1].double(), -1)
        nll -= float(logp.gather(-1, part[0, 1:, None]).sum())
        count += part.shape[1] - 1
    return float(np.exp(nll / count)), count
