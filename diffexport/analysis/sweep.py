"""The low-bit attention-logits sweep (the paper's Figure 8): quantise, then measure what changed.

For each bit width, every attention of the model runs with logits quantised as
diffexport.core.quantization defines them (the kernel's "qk" scheme by default). Against the
unquantised model (bits 16) on the same tokens it reports the cosine similarity of the output
logits (mean and worst over tokens) and the KL divergence KL(p_16 || p_bits) of the next-token
distributions (mean over tokens); and, when the checkpoint was trained on the needle task, the
retrieval accuracy at each bit width.

`attention` (diffexport.analysis.fused) says what computes the quantised attention: the torch
reference (every family, both schemes, any device) or the fused CUDA kernel's INT8-logits path.
Inputs move to the model's device.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from diffexport.analysis.fused import REFERENCE, Attention
from diffexport.core.errors import DiffExportError
from diffexport.core.quantization import UNQUANTISED_BITS, LogitQuant


@dataclass
class SweepPoint:
    bits: int
    cosine_mean: float
    cosine_min: float
    kl_mean: float
    task_accuracy: float | None = None
    attention: str = "reference"  # what computed the quantised attention: "reference" or "kernel"


class Damage:
    """Running logit cosine (mean, worst) and mean KL(reference || quantised) over token positions."""

    def __init__(self):
        self.cos_sum, self.cos_min, self.kl_sum, self.count = 0.0, float("inf"), 0.0, 0

    def add(self, out: torch.Tensor, ref: torch.Tensor, ref_logp: torch.Tensor) -> None:
        cos = torch.nn.functional.cosine_similarity(out, ref, dim=-1)
        kl = (ref_logp.exp() * (ref_logp - out.log_softmax(-1))).sum(-1)
        self.cos_sum += cos.sum().item()
        self.cos_min = min(self.cos_min, cos.min().item())
        self.kl_sum += kl.sum().item()
        self.count += cos.numel()

    def means(self) -> tuple[float, float, float]:
        """(cosine mean, cosine min, KL mean). KL is never negative: a sum of rounding below 0
        (an unquantised point against itself) is reported as the 0 it is."""
        return self.cos_sum / self.count, self.cos_min, max(0.0, self.kl_sum / self.count)


@torch.no_grad()
def sweep(model, bits_list, batches, *, scheme: str = "qk", smooth_k: bool = True,
          attention: Attention = REFERENCE, task_eval=None, masks=None, progress=None) -> list[SweepPoint]:
    """task_eval(quant, attention) -> accuracy, or None when the model has no task. masks: per
    batch, the positions to compare (e.g. only the task's answers); None compares every position."""
    settings = [LogitQuant(bits, scheme, smooth_k) for bits in bits_list]  # validates every value first
    unquantised = LogitQuant(UNQUANTISED_BITS, scheme, smooth_k)
    device = next(model.parameters()).device
    damage = {q.bits: Damage() for q in settings}
    for done, input_ids in enumerate(batches):
        keep = None if masks is None else masks[done].to(device)
        if keep is not None and not keep.any():
            continue
        input_ids = input_ids.to(device)
        with attention(model, unquantised):  # the same attention, unquantised: the reference
            ref = model(input_ids).float()
        ref = ref if keep is None else ref[keep]
        ref_logp = ref.log_softmax(-1)
        for quant in settings:
            with attention(model, quant):
                out = model(input_ids).float()
            damage[quant.bits].add(out if keep is None else out[keep], ref, ref_logp)
        if progress is not None:
            progress(done + 1)
    if damage[settings[0].bits].count == 0:
        raise DiffExportError("no positions to compare: the stream holds no task answers; use --positions all")
    points = []
    for quant in settings:
        accuracy = task_eval(quant, attention) if task_eval is not None else None
        points.append(SweepPoint(quant.bits, *damage[quant.bits].means(), accuracy, attention.name))
    return points


def render(named: dict[str, list[SweepPoint]], describe: str) -> str:
    lines = [f"attention logits quantised: {describe}; reference: the same model unquantised ({UNQUANTISED_BITS} bits)",
             f"  {'model':20s} {'bits':>4s} {'cos mean':>9s} {'cos min':>9s} {'KL mean':>9s} {'task acc':>9s}"]
    for name, points in named.items():
        for p in points:
            acc = "-" if p.task_accuracy is None else f"{p.task_accuracy:.3f}"
            lines.append(f"  {name:20s} {p.bits:4d} {p.cosine_mean:9.6f} {p.cosine_min:9.6f} {p.kl_mean:9.2e} "
                         f"{acc:>9s}")
    return "\n".join(lines)
