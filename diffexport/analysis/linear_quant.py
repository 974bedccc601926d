"""DIFF versus Transformer under the deployment quantisation of their linear layers.

Every nn.Linear of the eager model (attention projections, MLP, LM head; the embedding table stays
float, as in the exported graphs) runs fake-quantised with torch's own fake-quantisation ops:

  int8, int4  weights only, symmetric round-to-nearest in blocks of --block-size along the input
              dimension: what `diffexport quantize --weights int8|int4` writes (MatMulNBits, RTN)
  w8a8        int8 weights, one scale per output channel, and int8 activations at every linear
              input, one scale per tensor from the absolute maximum seen on calibration batches:
              what `diffexport quantize --qdq int8` writes for TensorRT (min-max calibration)

Against the same model unquantised on the same tokens it reports the logit cosine (mean and
worst over tokens), the mean KL(p_float || p_quantised) of the next-token distributions, and the
needle-task accuracy for checkpoints trained on it. The paper's claim (Table 5, section 3.6):
DIFF has fewer activation outliers, so per-tensor activation scales (w8a8) should cost it less.
"""

from __future__ import annotations

import dataclasses
import types

import torch

from diffexport.analysis.sweep import Damage
from diffexport.core.errors import DiffExportError

SCHEMES = ("int8", "int4", "w8a8")
BLOCK_SIZES = (16, 32, 64, 128, 256)


@dataclasses.dataclass(frozen=True)
class LinearQuant:
    scheme: str
    block_size: int = 32

    def __post_init__(self):
        if self.scheme not in SCHEMES:
            raise DiffExportError(f"scheme {self.scheme!r}: use one of {', '.join(SCHEMES)}")
        if self.block_size not in BLOCK_SIZES:
            raise DiffExportError(f"--block-size {self.block_size}: use one of {', '.join(map(str, BLOCK_SIZES))}")

    @property
    def describe(self) -> str:
        if self.scheme == "w8a8":
            return "w8a8: int8 weights per output channel, int8 activations per tensor (calibrated absmax)"
        return f"{self.scheme} weights, symmetric RTN, block {self.block_size}"

    def weight(self, w: torch.Tensor) -> torch.Tensor:
        """The fake-quantised copy of a [out, in] weight."""
        w32 = w.detach().float()
        if self.scheme == "w8a8":
            scale = (w32.abs().amax(dim=1) / 127).clamp_min(1e-12)
            zero = torch.zeros_like(scale, dtype=torch.int32)
            return torch.fake_quantize_per_channel_affine(w32, scale, zero, 0, -127, 127).to(w.dtype)
        levels = 127 if self.scheme == "int8" else 7
        out_features, in_features = w32.shape
        pad = -in_features % self.block_size
        blocks = torch.nn.functional.pad(w32, (0, pad)).reshape(-1, self.block_size)
        scale = (blocks.abs().amax(dim=1) / levels).clamp_min(1e-12)
        zero = torch.zeros_like(scale, dtype=torch.int32)
        quantised = torch.fake_quantize_per_channel_affine(blocks, scale, zero, 0, -levels, levels)
        return quantised.reshape(out_features, in_features + pad)[:, :in_features].to(w.dtype)


def linears(model) -> list[tuple[str, torch.nn.Linear]]:
    return [(name, m) for name, m in model.named_modules() if isinstance(m, torch.nn.Linear)]


class ActivationRanges:
    """Context: records the absolute maximum of every linear's input over the batches run inside
    it (the min-max calibration of `--qdq int8`, symmetric)."""

    def __init__(self, model):
        self.model, self.absmax, self._hooks = model, {}, []

    def __enter__(self) -> "ActivationRanges":
        for name, module in linears(self.model):
            def record(_module, inputs, name=name):
                peak = inputs[0].detach().abs().max().item()
                self.absmax[name] = max(self.absmax.get(name, 0.0), peak)
            self._hooks.append(module.register_forward_pre_hook(record))
        return self

    def __exit__(self, *exc) -> None:
        for hook in self._hooks:
            hook.remove()
        self._hooks.clear()


class QuantisedLinears:
    """Context: every nn.Linear of `model` computes with fake-quantised weights (and, for w8a8,
    fake-quantised inputs with the scales of `ranges`). The weights themselves are not touched: a
    tied LM head gets its own quantised copy while the embedding keeps reading the float table."""

    def __init__(self, model, quant: LinearQuant, ranges: dict[str, float] | None = None):
        if quant.scheme == "w8a8" and ranges is None:
            raise DiffExportError("w8a8 needs activation ranges: calibrate with ActivationRanges first")
        self.model, self.quant, self.ranges = model, quant, ranges
        self._patched: list[torch.nn.Linear] = []

    def __enter__(self) -> "QuantisedLinears":
        for name, module in linears(self.model):
            weight = self.quant.weight(module.weight)
            scale = None
            if self.quant.scheme == "w8a8":
                scale = max(self.ranges.get(name, 0.0), 1e-12) / 127

            def forward(this, x, weight=weight, scale=scale):
                if scale is not None:
                    x = torch.fake_quantize_per_tensor_affine(x.float(), scale, 0, -127, 127).to(x.dtype)
                return torch.nn.functional.linear(x, weight, this.bias)

            module.forward = types.MethodType(forward, module)
            self._patched.append(module)
        return self

    def __exit__(self, *exc) -> None:
        for module in self._patched:
            del module.forward  # the class's forward again
        self._patched.clear()


@dataclasses.dataclass
class LinearPoint:
    scheme: str
    cosine_mean: float
    cosine_min: float
    kl_mean: float
    task_accuracy: float | None = None


@torch.no_grad()
def sweep(model, quants: list[LinearQuant], batches, *, calibration=None, task_eval=None, masks=None,
          progress=None) -> list[LinearPoint]:
    """Each setting against the unquantised model on `batches`. calibration: the batches whose
    activation ranges w8a8 uses (default: `batches`). task_eval() -> accuracy, run inside each
    setting; None when the model has no task. masks: per batch, the positions compared."""
    ranges = None
    if any(q.scheme == "w8a8" for q in quants):
        with ActivationRanges(model) as recorder:
            for input_ids in calibration if calibration is not None else batches:
                model(input_ids)
        ranges = recorder.absmax
    damage = {q: Damage() for q in quants}
    for done, input_ids in enumerate(batches):
        keep = None if masks is None else masks[done]
        if keep is not None and not keep.any():
            continue
        ref = model(input_ids).float()
        ref = ref if keep is None else ref[keep]
        ref_logp = ref.log_softmax(-1)
        for quant in quants:
            with QuantisedLinears(model, quant, ranges):
                out = model(input_ids).float()
            damage[quant].add(out if keep is None else out[keep], ref, ref_logp)
        if progress is not None:
            progress(done + 1)
    if damage[quants[0]].count == 0:
        raise DiffExportError("no positions to compare: the stream holds no task answers; use --positions all")
    points = []
    baseline = task_eval() if task_eval is not None else None
    for quant in quants:
        accuracy = None
        if task_eval is not None:
            with QuantisedLinears(model, quant, ranges):
                accuracy = task_eval()
        points.append(LinearPoint(quant.scheme, *damage[quant].means(), accuracy))
    return [LinearPoint("float", 1.0, 1.0, 0.0, baseline)] + points


def render(named: dict[str, list[LinearPoint]], describe: list[str]) -> str:
    lines = ["linear layers quantised (reference: the same model unquantised):", *[f"  {d}" for d in describe],
             f"  {'model':20s} {'scheme':>6s} {'cos mean':>9s} {'cos min':>9s} {'KL mean':>9s} {'task acc':>9s}"]
    for name, points in named.items():
        for p in points:
            acc = "-" if p.task_accuracy is None else f"{p.task_accuracy:.3f}"
            lines.append(f"  {name:20s} {p.scheme:>6s} {p.cosine_mean:9.6f} {p.cosine_min:9.6f} {p.kl_mean:9.2e} "
                         f"{acc:>9s}")
    return "\n".join(lines)
