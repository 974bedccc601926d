"""What a check is asked and what it answers: CheckOptions, CheckReport, the default shapes and decode prompts, the
checks of options and of the model against an export that run before anything loads.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import numpy as np

from diffexport.analysis import plots
from diffexport.core import fingerprint
from diffexport.core.eager_generation import BeamSearch, Sampling
from diffexport.core.errors import DiffExportError
from diffexport.core.files import check_output_path
from diffexport.format.metadata import ExportMetadata
from diffexport.format.metadata_keys import CONFIG, DTYPE, FAMILY, SOURCE, SOURCE_NAME, WEIGHTS
from diffexport.inputs.streams import text_ids
from diffexport.modeling.checkpoint import LoadedModel
from diffexport.modeling.presets import match_preset

DEFAULT_SHAPES = ((1, 1), (1, 17), (2, 33), (3, 64))  # batch x sequence: 1, odd lengths, batch > 1
MAX_CHECK_SHAPE = (64, 16384)  # batch, sequence: beyond, the references' N x N maps outgrow a workstation


EAGER_RUNNER = "eager-pytorch"


DECODE_STEPS = 32  # KV-cache decoders (folders and their engines): decode steps after the prefill


# A batch of 3: the first left-padded by 7 (as transformers and our loops pad), the third
# right-padded by 5 (as onnxruntime-genai pads a batch: the new tokens follow the padding).
DECODE_PROMPTS = (9, 16, 11)


DECODE_RIGHT_PADDED = frozenset({2})


@dataclasses.dataclass
class CheckOptions:
    shapes: tuple[tuple[int, int], ...] = DEFAULT_SHAPES
    provider: str = "auto"
    seed: int = 0
    save_dir: Path | None = None  # default: <model>.check/ beside the model
    reference: str = "auto"  # diffexport | transformers | both | auto (both for HF checkpoints when importable)
    plugin_lib: str | None = None  # engines: the plugin library to load (never the one an engine's sidecar names)
    atol: float | None = None  # user bounds (polygraphy's elementwise rule) instead of the dtype rule
    rtol: float | None = None
    text: str | None = None  # token ids from this UTF-8 text instead of random ids; perplexity reported
    tokenizer: str | None = None  # Hugging Face tokenizer for `text` (else its bytes are the ids)
    plot: str | None = None  # KV-cache folders: a PNG of the comparison step by step
    beams: BeamSearch | None = None  # KV-cache folders and their engines: also beam search against eager
    sampling: Sampling | None = None  # KV-cache folders: also genai's sampled draws against the eager distribution
    draws: int = 2000  # per prompt, with `sampling`

    @property
    def user_bounds(self) -> tuple[float, float] | None:
        if self.atol is None and self.rtol is None:
            return None
        return (self.atol or 0.0, self.rtol or 0.0)


@dataclasses.dataclass
class CheckReport:
    passed: bool
    lines: list[str]
    polygraphy_command: str
    inputs_path: Path
    outputs_path: Path
    comparisons: list = dataclasses.field(default_factory=list)  # (output name, comparison), in the order judged
    # numbers a page shows beside the lines: decode_steps (the first comparisons are the greedy
    # steps), greedy (agreeing steps, steps), transformers_greedy (bool), perplexity (runtime -> value)
    measures: dict = dataclasses.field(default_factory=dict)
    # checks that could not have failed as they were run (too few bins or draws): the report then
    # neither passes nor fails on them, it says what to change (verdict "INCONCLUSIVE")
    inconclusive: tuple[str, ...] = ()

    @property
    def verdict(self) -> str:
        return "PASS" if self.passed else "INCONCLUSIVE" if self.inconclusive else "FAIL"

    def text(self) -> str:
        return "\n".join(self.lines)


def parse_shapes(text: str) -> tuple[tuple[int, int], ...]:
    """'1x1,2x33' -> ((1, 1), (2, 33))."""
    shapes = []
    for item in text.split(","):
        try:
            batch, seq = (int(x) for x in item.lower().split("x"))
        except ValueError:
            raise DiffExportError(f"bad shape {item!r} in --shapes: write BATCHxSEQ pairs like 1x1,2x33") from None
        if batch < 1 or seq < 1:
            raise DiffExportError(f"bad shape {item!r} in --shapes: batch and sequence must be >= 1")
        if batch > MAX_CHECK_SHAPE[0] or seq > MAX_CHECK_SHAPE[1]:
            raise DiffExportError(f"bad shape {item!r} in --shapes: at most {MAX_CHECK_SHAPE[0]} sequences of "
                                  f"{MAX_CHECK_SHAPE[1]} tokens (the eager reference holds every attention map)")
        shapes.append((batch, seq))
    return tuple(shapes)


def check_same_config(meta: dict[str, str], config, onnx_path: Path) -> None:
    """The model's configuration must be the one the ONNX file was exported from: say which field
    differs (a preset's shapes are known before any weight is built: cli's check asks this first)."""
    exported = json.loads(meta[CONFIG])  # the stored dict: a field of another version shows as differing
    if meta.get(FAMILY) != config.family:
        raise DiffExportError(f"{onnx_path.name} holds a {meta.get(FAMILY)} model but the checkpoint is "
                              f"{config.family}: pass the checkpoint it was exported from")
    ours = config.to_dict()
    differing = [f"{k} {exported.get(k)!r} vs {ours.get(k)!r}" for k in sorted(set(exported) | set(ours))
                 if exported.get(k) != ours.get(k)]
    if differing:
        raise DiffExportError(f"{onnx_path.name} was exported from a different configuration ("
                              f"{'; '.join(differing[:3])}): pass the checkpoint it was exported from")


def name_the_source(meta: dict[str, str], onnx_path: Path) -> str:
    """What to pass when `check` was given no model: the checkpoint the export records (exports
    since 0.4 name its kind and file), and a preset only where the export's configuration is one."""

    source, name = meta.get(SOURCE, ""), meta.get(SOURCE_NAME, "")
    try:
        preset = match_preset(ExportMetadata(meta).model_config)
    except (KeyError, ValueError, DiffExportError):
        preset = None
    hint = f"name the model {onnx_path.name} was exported from: "
    if source == "preset" and preset:
        return hint + f"it records a preset's seeded weights, so --preset {preset} [--seed N]"
    hint += "--ckpt CHECKPOINT"
    if source:
        hint += f" (it records a {source} checkpoint{f' named {name!r}' if name else ''})"
    if preset and not source:  # an export older than the source record
        hint += f", or --preset {preset} [--seed N] if it was exported from that preset's seeded weights"
    return hint


def check_same_model(meta: dict[str, str], loaded: LoadedModel, onnx_path: Path) -> None:
    """The checkpoint must be the one the ONNX file was exported from: its configuration, then its weights."""
    check_same_config(meta, loaded.config, onnx_path)
    if fingerprint.weights_fingerprint(loaded.model, meta[DTYPE]) != meta.get(WEIGHTS):
        raise DiffExportError(f"{onnx_path.name} was exported from other weights than this checkpoint "
                              "(same configuration, different values): pass the checkpoint it was exported from")


def save_dir_for(options: CheckOptions, default: Path) -> Path:
    """Where the polygraphy files go, validated before any work: a real folder (or one to create
    in a writable folder), never a symbolic link."""

    save_dir = Path(options.save_dir) if options.save_dir else default
    if save_dir.is_symlink() or (save_dir.exists() and not save_dir.is_dir()):
        raise DiffExportError(f"{save_dir} is a symbolic link or not a folder: the check files are written only "
                              "into a real folder (pass --save-dir)")
    check_output_path(save_dir)
    return save_dir


class TextIds:
    """--text: consecutive [batch, seq] slices of the text's token ids, and the perplexity each
    runtime reaches on them (next-token NLL over every position that has a next token).
    need: the tokens the check takes (for: what needs them, in the refusal); tokenizer: the one
    to read the text with when not options.tokenizer (a decoder folder's own)."""

    def __init__(self, options: CheckOptions, vocab: int, need: int, for_what: str = "the --shapes need",
                 tokenizer: str | None = None):

        tokenizer = tokenizer if options.tokenizer is None else options.tokenizer
        self.ids = text_ids(options.text, tokenizer, vocab)
        if len(self.ids) < need:
            raise DiffExportError(f"{options.text} has {len(self.ids)} tokens; {for_what} {need}: give more "
                                  "text" + (" or smaller --shapes" if "--shapes" in for_what else ""))
        self.source = f"{options.text} ({'tokenizer ' + tokenizer if tokenizer else 'UTF-8 bytes'})"
        self.used = 0
        self.nll: dict[str, float] = {}
        self.count = 0

    def take(self, batch: int, seq: int) -> np.ndarray:
        out = np.asarray(self.ids[self.used:self.used + batch * seq], np.int64).reshape(batch, seq)
        self.used += batch * seq
        return out

    def score(self, ids: np.ndarray, logits: dict[str, np.ndarray]) -> None:
        """logits: runtime name -> [batch, seq, vocab] on `ids`."""
        if ids.shape[1] < 2:
            return
        target = ids[:, 1:]
        for name, values in logits.items():
            x = np.asarray(values[:, :-1], np.float64)
            logp = x - np.logaddexp.reduce(x, axis=-1, keepdims=True)
            self.nll[name] = self.nll.get(name, 0.0) - float(np.take_along_axis(logp, target[..., None], -1).sum())
        self.count += target.size

    def perplexities(self) -> dict[str, float]:
        """Runtime name -> perplexity over the tokens scored so far (empty before any)."""
        return {name: float(np.exp(nll / self.count)) for name, nll in self.nll.items()} if self.count else {}

    def line(self, model: str, reference: str) -> str:
        if not self.count:
            return f"perplexity    no --shapes sequence of 2 or more tokens to score {self.source} on"
        ppl = self.perplexities()
        change = ppl[model] / ppl[reference] - 1
        return (f"perplexity    {model} {ppl[model]:.2f}, {reference} {ppl[reference]:.2f} ({change:+.2%}) on "
                f"{self.count} next tokens of {self.source} (reported, not judged)")


CHECK_DRAWS = (100, 1_000_000)  # the sampling check's draws per prompt: enough for the test, bounded in time


def check_decode_options(options: CheckOptions, steps: int) -> None:
    """A decoder check's step count, beam search and sampling, before anything loads or runs."""
    if isinstance(steps, bool) or not isinstance(steps, int) or not 0 <= steps <= 1 << 20:
        raise DiffExportError(f"--steps must be a whole number of decode steps, 0 or more; got {steps}")
    if options.beams is not None and steps < 1:
        raise DiffExportError("beam search needs at least one decode step: give --steps 1 or more with --num-beams")
    if options.sampling is not None:
        draws = options.draws
        if isinstance(draws, bool) or not isinstance(draws, int) or not CHECK_DRAWS[0] <= draws <= CHECK_DRAWS[1]:
            raise DiffExportError(f"--draws must be {CHECK_DRAWS[0]} to {CHECK_DRAWS[1]:,}, got {draws}")
        if options.sampling.greedy:
            raise DiffExportError("the sampling check needs a sampling draw, not greedy decoding")
        if options.plot is not None:  # the draws' plot goes beside --plot under a name the user did not give

            extra = plots.sampling_plot_path(options.plot)
            if extra.exists() or extra.is_symlink():
                raise DiffExportError(f"{extra} exists, and --sample --plot {options.plot} would write the draws' plot "
                                      "there: move it, or choose another --plot name")
