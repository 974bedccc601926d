"""Which attention the analysis runs with low-bit logits: the torch reference or the fused kernel.

`Attention("reference")` is AttentionProbe: the quantisation of diffexport.core.quantization written
out in fp32 torch ops, for every family and scheme, on any device. `Attention("kernel")` swaps
every DIFF layer's attention for the fused CUDA kernel (diffexport.kernel.kernels) with its INT8-logits
path: the arithmetic a deployed engine runs, fp16 accumulation and ex2 included. The kernel
implements the "qk" scheme only (Q and K quantised per block to 2..8 bits, K-smoothing optional),
head dims 64 and 128, DIFF V1 and V2; `kernel_unsupported` says why a model or setting is not
one it takes. Its unquantised point (16 bits) is the same kernel with fp16/bf16 logits, so a
kernel sweep isolates what the logit quantisation costs on the deployed path.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch

from diffexport.analysis.probe import AttentionProbe
from diffexport.core.errors import DiffExportError
from diffexport.core.quantization import UNQUANTISED_BITS, LogitQuant
from diffexport.kernel import kernels
from diffexport.modeling.families import DIFF_FAMILIES

ATTENTIONS = ("reference", "kernel")


def quant_unsupported(quant: LogitQuant | None) -> str | None:
    """Why the fused kernel cannot quantise logits as `quant` says, or None when it can (no model needed:
    the CLI asks before it loads one)."""

    if quant is not None and quant.active:
        if quant.scheme != "qk":
            return f"the fused kernel quantises Q and K (scheme qk), not the {quant.scheme!r} scheme"
        if quant.bits > kernels.MAX_INT8_BITS:
            return (f"the INT8-logits kernel takes 2..{kernels.MAX_INT8_BITS} bits (or {UNQUANTISED_BITS}, "
                    f"not quantised), not {quant.bits}")
    return None


def kernel_unsupported(model, quant: LogitQuant | None = None) -> str | None:
    """Why the fused kernel cannot run this model's attention with `quant`, or None when it can
    (the library and the device are the launcher's to check)."""

    config = model.config
    if config.family not in DIFF_FAMILIES:
        return f"the fused kernel computes DIFF attention only, not the {config.family} family"
    if config.head_dim not in kernels.HEAD_DIMS:
        return (f"the fused kernel supports head_dim {' or '.join(map(str, kernels.HEAD_DIMS))}, "
                f"this model has {config.head_dim}")
    return quant_unsupported(quant)


class FusedAttention:
    """Context manager: every DIFF layer's attention runs `launch` (default kernels.diff_attention)
    with the logit bits of `quant`; the original implementations come back on exit."""

    def __init__(self, model, quant: LogitQuant | None = None, *, launch: Callable | None = None):
        reason = kernel_unsupported(model, quant)
        if reason:
            raise DiffExportError(reason)
        if launch is None:

            launch = kernels.diff_attention
        self.model, self.launch = model, launch
        quantised = quant is not None and quant.active
        self.logit_bits = quant.bits if quantised else 0
        self.smooth_k = quant.smooth_k if quantised else True
        self._saved: list = []

    def __enter__(self) -> "FusedAttention":
        for layer in self.model.layers:
            self._saved.append(layer.attn.impl)
            layer.attn.impl = self._attend
        return self

    def __exit__(self, *exc) -> None:
        for layer, impl in zip(self.model.layers, self._saved):
            layer.attn.impl = impl
        self._saved = []

    def _attend(self, query, key, value, lambda_full, norm_weight, attrs, key_mask=None):
        if norm_weight is None:  # DIFF V2 has no per-head norm; the contract still takes a weight
            norm_weight = torch.ones(attrs.head_dim, dtype=torch.float32, device=query.device)
        # The kernel wants rows with unit stride and 16-byte aligned starts: fresh tensors have them.
        return self.launch(query.contiguous(), key.contiguous(), value.contiguous(), lambda_full.contiguous(),
                           norm_weight.float().contiguous(), attrs, logit_bits=self.logit_bits,
                           smooth_k=self.smooth_k, key_mask=key_mask)


@dataclass(frozen=True)
class Attention:
    """What computes attention under a logit quantisation: "reference" or "kernel" (with `launch`,
    the kernel's launcher: kernels.diff_attention by default; the tests pass the CPU emulator)."""

    name: str = "reference"
    launch: Callable | None = None

    def __post_init__(self) -> None:
        if self.name not in ATTENTIONS:
            raise DiffExportError(f"unknown attention {self.name!r}; choose one of {', '.join(ATTENTIONS)}")

    def __call__(self, model, quant: LogitQuant | None):
        """The context manager that runs `model` with this attention and `quant`."""
        if self.name == "kernel":
            return FusedAttention(model, quant, launch=self.launch)

        return AttentionProbe(model, quant=quant)


REFERENCE = Attention("reference")


def choose(requested: str, model, quants: list[LogitQuant], device: torch.device) -> tuple[Attention, str]:
    """(the attention to run, why) for --attention auto|reference|kernel.

    auto: the kernel when the model is on CUDA, the kernel takes the model and every setting, and
    the library loads; else the reference. kernel: the same, or an error saying what is missing."""

    if requested not in ("auto", *ATTENTIONS):
        raise DiffExportError(f"unknown attention {requested!r}; choose auto, {', '.join(ATTENTIONS)}")
    if requested == "reference":
        return REFERENCE, "asked for"
    reason = next((r for r in (kernel_unsupported(model, q) for q in quants) if r), None)
    if reason is None and device.type != "cuda":
        reason = f"the fused kernel runs on CUDA tensors; the model is on {device.type} (use --device cuda)"
    if reason is None:
        try:
            kernels.load_library()
        except DiffExportError as exc:
            reason = str(exc)
    if reason is None:
        return Attention("kernel"), "the fused kernel (libdiffexport_kernels) on " + str(device)
    if requested == "kernel":
        raise DiffExportError(f"--attention kernel: {reason}")
    return REFERENCE, reason
