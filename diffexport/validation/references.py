"""The references an artifact is compared with: the eager diffexport model (fp32 and the export's dtype) and, for
Hugging Face checkpoints, transformers' own model and its generate().
"""

from __future__ import annotations

import copy
import importlib.util
from typing import Callable

import numpy as np
import torch

from diffexport.core.eager_generation import BeamSearch
from diffexport.core.errors import DiffExportError
from diffexport.format.names import DTYPES
from diffexport.modeling import layouts
from diffexport.modeling.checkpoint import LoadedModel


def eager_models(loaded: LoadedModel, dtype: str, device: str):
    """(model in the export dtype, fp32 model on the same rounded weights or None for fp32)."""
    model = loaded.model.eval()
    low = model.to(device=device, dtype=DTYPES[dtype])
    if dtype == "float32":
        return low, None

    return low, copy.deepcopy(low).float()


def run_eager(model, ids: np.ndarray, device: str, outputs: list[str]) -> dict[str, np.ndarray]:
    with torch.no_grad():
        result = model(torch.from_numpy(ids).to(device), return_hidden=len(outputs) > 1)
    tensors = result if isinstance(result, tuple) else (result,)
    return {name: t.float().cpu().numpy() for name, t in zip(outputs, tensors)}


REFERENCES = ("auto", "diffexport", "transformers", "both")


def resolve_reference(choice: str, loaded: LoadedModel) -> tuple[bool, bool, str]:
    """(use diffexport's port, use transformers, the report's line saying which and why)."""
    if choice not in REFERENCES:
        raise DiffExportError(f"--reference {choice!r} is not one of {', '.join(REFERENCES)}")
    imported = layouts.hf_import_of(loaded.source)
    is_hf = imported is not None and loaded.path is not None
    library_model = f"transformers' {imported.transformers_class}" if imported else ""  # named only when used

    have = importlib.util.find_spec("transformers") is not None
    if choice in ("transformers", "both"):
        if not is_hf:
            raise DiffExportError(f"--reference {choice}: the checkpoint is {loaded.source}, not a Hugging Face "
                                  "DiffLlama (or Llama) folder; no library model exists for it, diffexport's port is "
                                  "its "
                                  "reference (--reference diffexport)")
        if not have:
            raise DiffExportError(f"--reference {choice} needs transformers: pip install 'diffexport[hf]'")
    if choice == "auto":
        choice = "both" if is_hf and have else "diffexport"
    port, library = choice in ("diffexport", "both"), choice in ("transformers", "both")
    if library and port:
        why = f"diffexport's port (eager PyTorch) and {library_model} (lines marked 'vs transformers')"
    elif library:
        why = f"{library_model} (lines marked 'vs transformers')"
    elif is_hf:
        why = "diffexport's port only (--reference diffexport" + ("" if have else "; transformers not installed") + ")"
    else:
        why = f"diffexport's port: the checkpoint is {loaded.source}, which no other library loads"
    return port, library, f"reference     {why}"


def _transformers_class(loaded: LoadedModel):
    """transformers' class of an HF import (DiffLlamaForCausalLM, LlamaForCausalLM)."""
    import transformers

    return getattr(transformers, layouts.hf_import_of(loaded.source).transformers_class)


def transformers_models(loaded: LoadedModel, dtype: str):
    """transformers' own model of an HF folder: (in the export dtype, fp32 on the same rounded weights or None)."""
    import transformers

    transformers.utils.logging.disable_progress_bar()  # its loading bars would land in our report
    hf = _transformers_class(loaded).from_pretrained(loaded.path, torch_dtype=torch.float32,
                                                     trust_remote_code=False).eval()
    if dtype == "float32":
        return hf, None

    low = hf.to(DTYPES[dtype])
    return low, copy.deepcopy(low).float()


def run_transformers(model, ids: np.ndarray) -> dict[str, np.ndarray]:
    with torch.no_grad():
        return {"logits": model(input_ids=torch.from_numpy(ids), use_cache=False).logits.float().numpy()}


# ---------------------------------------------------------------- KV-cache decoder folders


def hf_generator(loaded: LoadedModel):
    """transformers' own model of an HF folder, float32, for generate() (None when the checkpoint
    is not an HF import or transformers is absent)."""
    if layouts.hf_import_of(loaded.source) is None or not loaded.path:
        return None
    try:
        import transformers
    except ImportError:
        return None
    transformers.utils.logging.disable_progress_bar()
    return _transformers_class(loaded).from_pretrained(loaded.path, torch_dtype=torch.float32,
                                                       trust_remote_code=False).eval()


def _plain_generation_config(hf, eos_token_id):
    """Only the special ids: transformers fills what a generate() call leaves out from the model's
    generation_config (sampling, a repetition penalty, beams, banned words), and the eager
    reference searches plainly."""
    import transformers

    hf.generation_config = transformers.GenerationConfig(bos_token_id=hf.generation_config.bos_token_id,
                                                         eos_token_id=eos_token_id, pad_token_id=0)


def hf_greedy(loaded: LoadedModel, ids: torch.Tensor, mask: torch.Tensor, steps: int,
              log: Callable[[str], None] | None = None) -> np.ndarray | None:
    """transformers' own greedy tokens for an HF folder (None when transformers is absent); log
    announces the generation once transformers' model is loaded."""
    hf = hf_generator(loaded)
    if hf is None:
        return None
    if log is not None:
        log(f"transformers  greedy generate() of {steps} tokens for {ids.shape[0]} prompts, the independent reference")
    _plain_generation_config(hf, hf.generation_config.eos_token_id)
    with torch.no_grad():
        out = hf.generate(ids, attention_mask=mask, max_new_tokens=steps, min_new_tokens=steps, do_sample=False)
    return out[:, ids.shape[1]:].numpy()


def hf_beams(hf, prompt: list[int], search: BeamSearch, new: int, ends) -> list[tuple[list[int], str]]:
    """transformers' own beam search (hf: hf_generator's model), as (tokens, stop) per hypothesis,
    best first. Its ranking equals genai's only at length penalty 0."""
    _plain_generation_config(hf, list(ends) if ends else None)
    with torch.no_grad():
        out = hf.generate(torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt), dtype=torch.int64),
                          max_new_tokens=new, num_beams=search.num_beams, do_sample=False,
                          num_return_sequences=search.num_return_sequences, length_penalty=0.0,
                          early_stopping=search.early_stopping)
    found = []
    for row in out[:, len(prompt):].tolist():  # transformers keeps the end token and pads after it
        at = next((i for i, token in enumerate(row) if ends and token in ends), None)
        found.append((row, "length") if at is None else (row[:at], "eos"))
    return found
