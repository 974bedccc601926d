"""`diffexport check`: an exported ONNX model in ONNX Runtime against the eager PyTorch model.

Seeded random token ids at several (batch, sequence) shapes go through both; every output is
compared under the dtype-aware rule of diffexport.tolerances. The inputs and the eager outputs
are saved in polygraphy's JSON formats, with the `polygraphy run` command that repeats the
comparison independently of this tool.
"""

from __future__ import annotations

import dataclasses
import json
import os
import shlex
from pathlib import Path
from typing import Callable

import numpy as np
import torch

from diffexport import fingerprint, layouts, reference, tolerances
from diffexport.backends.base import DecoderRunner
from diffexport.checkpoint import LoadedModel
from diffexport.errors import DiffExportError
from diffexport.format.metadata import check_export_metadata, read_export_metadata  # noqa: F401 (API)
from diffexport.format import names
from diffexport.format.names import DTYPES, META_PREFIX, PREFILL_INPUT_NAMES as INPUT_NAMES
from diffexport.files import atomic_write, load_onnx
from diffexport.generation import BeamSearch, Sampling

DEFAULT_SHAPES = ((1, 1), (1, 17), (2, 33), (3, 64))
MAX_CHECK_SHAPE = (64, 16384)  # batch, sequence: beyond, the references' N x N maps outgrow a workstation  # batch x sequence: 1, odd lengths, batch > 1
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
    exported = json.loads(meta["config"])
    if meta.get("family") != config.family:
        raise DiffExportError(f"{onnx_path.name} holds a {meta.get('family')} model but the checkpoint is "
                              f"{config.family}: pass the checkpoint it was exported from")
    ours = config.to_dict()
    differing = [f"{k} {exported.get(k)!r} vs {ours.get(k)!r}" for k in sorted(set(exported) | set(ours))
                 if exported.get(k) != ours.get(k)]
    if differing:
        raise DiffExportError(f"{onnx_path.name} was exported from a different configuration ("
                              f"{'; '.join(differing[:3])}): pass the checkpoint it was exported from")


def check_same_model(meta: dict[str, str], loaded: LoadedModel, onnx_path: Path) -> None:
    """The checkpoint must be the one the ONNX file was exported from: its configuration, then its weights."""
    check_same_config(meta, loaded.config, onnx_path)
    if fingerprint.weights_fingerprint(loaded.model, meta["dtype"]) != meta.get("weights"):
        raise DiffExportError(f"{onnx_path.name} was exported from other weights than this checkpoint "
                              "(same configuration, different values): pass the checkpoint it was exported from")


def _eager_models(loaded: LoadedModel, dtype: str, device: str):
    """(model in the export dtype, fp32 model on the same rounded weights or None for fp32)."""
    model = loaded.model.eval()
    low = model.to(device=device, dtype=DTYPES[dtype])
    if dtype == "float32":
        return low, None
    import copy

    return low, copy.deepcopy(low).float()


def _run_eager(model, ids: np.ndarray, device: str, outputs: list[str]) -> dict[str, np.ndarray]:
    with torch.no_grad():
        result = model(torch.from_numpy(ids).to(device), return_hidden=len(outputs) > 1)
    tensors = result if isinstance(result, tuple) else (result,)
    return {name: t.float().cpu().numpy() for name, t in zip(outputs, tensors)}


def save_dir_for(options: CheckOptions, default: Path) -> Path:
    """Where the polygraphy files go, validated before any work: a real folder (or one to create
    in a writable folder), never a symbolic link."""
    from diffexport.files import check_output_path

    save_dir = Path(options.save_dir) if options.save_dir else default
    if save_dir.is_symlink() or (save_dir.exists() and not save_dir.is_dir()):
        raise DiffExportError(f"{save_dir} is a symbolic link or not a folder: the check files are written only "
                              "into a real folder (pass --save-dir)")
    check_output_path(save_dir)
    return save_dir


def _save_polygraphy(save_dir: Path, feeds: list[dict], eager: list[dict[str, np.ndarray]], dtype: str,
                     runner_name: str = EAGER_RUNNER):
    try:
        from polygraphy.comparator import RunResults
        from polygraphy.comparator.struct import IterationResult
        from polygraphy.json import save_json
        from polygraphy.logger import G_LOGGER
    except ImportError:
        raise DiffExportError("polygraphy is not installed: pip install 'diffexport[onnx]'") from None
    G_LOGGER.module_severity = G_LOGGER.ERROR  # its "Saving ..." lines would drown our report
    save_dir.mkdir(parents=True, exist_ok=True)  # validated by save_dir_for before any work
    inputs_path, outputs_path = save_dir / "inputs.json", save_dir / "eager_outputs.json"
    np_dtype = np.float16 if dtype == "float16" else np.float32  # numpy has no bfloat16
    # Each file goes to a temporary name and is renamed over the target: a symbolic link already
    # sitting at a target name is replaced, never written through.
    atomic_write(inputs_path, lambda tmp: save_json(feeds, tmp, description="diffexport check inputs"))
    iterations = [IterationResult({k: v.astype(np_dtype) for k, v in outs.items()}, runner_name=runner_name)
                  for outs in eager]
    atomic_write(outputs_path, lambda tmp: RunResults([(runner_name, iterations)]).save(tmp))
    return inputs_path, outputs_path


REFERENCES = ("auto", "diffexport", "transformers", "both")


def resolve_reference(choice: str, loaded: LoadedModel) -> tuple[bool, bool, str]:
    """(use diffexport's port, use transformers, the report's line saying which and why)."""
    if choice not in REFERENCES:
        raise DiffExportError(f"--reference {choice!r} is not one of {', '.join(REFERENCES)}")
    imported = layouts.hf_import_of(loaded.source)
    is_hf = imported is not None and loaded.path is not None
    library_model = f"transformers' {imported.transformers_class}" if imported else ""  # named only when used
    import importlib.util

    have = importlib.util.find_spec("transformers") is not None
    if choice in ("transformers", "both"):
        if not is_hf:
            raise DiffExportError(f"--reference {choice}: the checkpoint is {loaded.source}, not a Hugging Face "
                                  "DiffLlama (or Llama) folder; no library model exists for it, diffexport's port is its "
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


def _transformers_models(loaded: LoadedModel, dtype: str):
    """transformers' own model of an HF folder: (in the export dtype, fp32 on the same rounded weights or None)."""
    import transformers

    transformers.utils.logging.disable_progress_bar()  # its loading bars would land in our report
    hf = _transformers_class(loaded).from_pretrained(loaded.path, torch_dtype=torch.float32).eval()
    if dtype == "float32":
        return hf, None
    import copy

    low = hf.to(DTYPES[dtype])
    return low, copy.deepcopy(low).float()


def _run_transformers(model, ids: np.ndarray) -> dict[str, np.ndarray]:
    with torch.no_grad():
        return {"logits": model(input_ids=torch.from_numpy(ids), use_cache=False).logits.float().numpy()}


def run_check(onnx_path: str | os.PathLike, loaded: LoadedModel, options: CheckOptions | None = None,
              log: Callable[[str], None] = print) -> CheckReport:
    from diffexport.backends.onnxruntime import open_session, resolve_provider

    options = options or CheckOptions()
    onnx_path = Path(onnx_path)
    port, library, reference_line = resolve_reference(options.reference, loaded)
    save_dir = save_dir_for(options, onnx_path.with_suffix(".check"))
    meta = read_export_metadata(onnx_path)
    dtype = meta["dtype"]
    check_same_model(meta, loaded, onnx_path)
    provider = resolve_provider(options.provider)
    session = open_session(onnx_path, provider)
    outputs = [o.name for o in session.get_outputs()]
    if outputs != meta.get("outputs", "").split(","):
        raise DiffExportError(f"{onnx_path.name} outputs {outputs} differ from its metadata: re-export it")
    device = "cuda" if provider == "cuda" else "cpu"
    budget = tolerances.quant_budget(meta)
    low, ref32 = _eager_models(loaded, dtype, device)
    head_dim = loaded.config.head_dim  # which library the attention calls reach, for the report
    value_dim = 2 * head_dim if loaded.config.family == "diff_v1" else head_dim
    probe_q = torch.empty(1, 1, 1, head_dim, device=device, dtype=DTYPES[dtype])
    probe_v = torch.empty(1, 1, 1, value_dim, device=device, dtype=DTYPES[dtype])
    eager_name = f"eager PyTorch ({reference.attention_backend(probe_q, probe_v)}, {device})"
    text = None if options.text is None else TextIds(options, loaded.config.vocab_size, _tokens(options.shapes))
    log(f"checking      {onnx_path.name} ({dtype}) in onnxruntime {provider} against {eager_name}")
    if budget is not None:
        log(f"budget        {budget.what}: {budget.describe()}, not the {dtype} rule (docs/QUANTIZATION.md)")

    def run(ids):
        return dict(zip(outputs, session.run(outputs, {INPUT_NAMES[0]: ids})))

    feeds, saved, comparisons, lines = _compare(
        options, options.shapes, loaded.config.vocab_size, outputs, dtype, run,
        lambda ids: _run_eager(low, ids, device, outputs),
        None if ref32 is None else (lambda ids: _run_eager(ref32, ids, device, outputs)), budget=budget, text=text)
    port_comparisons = comparisons  # the polygraphy files hold the port's outputs: their bounds go with them
    if not port:  # ... but with --reference transformers its lines are not the verdict
        comparisons, lines = [], []
    if library:  # the same seeded ids through transformers itself (logits: what it returns)
        hf_low, hf32 = _transformers_models(loaded, dtype)
        _, _, hf_comparisons, hf_lines = _compare(
            options, options.shapes, loaded.config.vocab_size, ["logits"], dtype, run,
            lambda ids: _run_transformers(hf_low, ids),
            None if hf32 is None else (lambda ids: _run_transformers(hf32, ids)), label=" vs transformers",
            budget=budget,
            text=None if text is None else TextIds(options, loaded.config.vocab_size, _tokens(options.shapes)))
        comparisons, lines = comparisons + hf_comparisons, lines + hf_lines
    lines.insert(0, reference_line)
    runner = ["polygraphy run", shlex.quote(str(onnx_path)), "--onnxrt", "--providers", provider]
    return _finish(runner, save_dir, feeds, saved, comparisons, lines,
                   outputs, dtype, user_bounds=options.user_bounds, atol_comparisons=port_comparisons)


def _judge(name: str, label: str, got, ref, base, dtype: str, options, budget):
    """One output against its reference: the budget of quantised weights when there is one (and
    the user gave no bounds of their own), else the dtype rule."""
    if budget is not None and options.user_bounds is None:
        return tolerances.compare_distributions(label, got, ref, budget, logits=name == "logits")
    return tolerances.compare(label, got, ref, dtype, baseline=base, user_bounds=options.user_bounds)


def _severity(c) -> float:
    """How close a comparison came to failing (the worst one is reported)."""
    if isinstance(c, tolerances.DistributionComparison):
        return (c.mean_kl or 0.0) / c.budget.max_kl if c.finite else float("inf")
    return c.max_abs / max(c.bound, 1e-30)


class TextIds:
    """--text: consecutive [batch, seq] slices of the text's token ids, and the perplexity each
    runtime reaches on them (next-token NLL over every position that has a next token).
    need: the tokens the check takes (for: what needs them, in the refusal); tokenizer: the one
    to read the text with when not options.tokenizer (a decoder folder's own)."""

    def __init__(self, options: CheckOptions, vocab: int, need: int, for_what: str = "the --shapes need",
                 tokenizer: str | None = None):
        from diffexport.analysis.streams import text_ids

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

    def line(self, model: str, reference: str) -> str:
        if not self.count:
            return f"perplexity    no --shapes sequence of 2 or more tokens to score {self.source} on"
        ppl = {name: float(np.exp(nll / self.count)) for name, nll in self.nll.items()}
        change = ppl[model] / ppl[reference] - 1
        return (f"perplexity    {model} {ppl[model]:#.4g}, {reference} {ppl[reference]:#.4g} ({change:+.2%}) on "
                f"{self.count} next tokens of {self.source} (reported, not judged)")


def _tokens(shapes) -> int:
    """The token ids a list of (batch, seq) calls takes."""
    return sum(batch * seq for batch, seq in shapes)


def _compare(options, shapes, vocab, outputs, dtype, run, eager_low, eager_ref, note=None, label="", budget=None,
             text: TextIds | None = None):
    """Seeded token ids (or --text's) per (batch, seq) through the runtime and eager; each output
    compared under the dtype rule (eager_ref None: fp32, eager_low is the reference), or under
    `budget` for a weight-quantised model. note(name, got, ids) may add a line."""
    rng = np.random.default_rng(options.seed)
    feeds, saved, comparisons, lines = [], [], [], []
    for batch, seq in shapes:
        ids = rng.integers(0, vocab, size=(batch, seq), dtype=np.int64) if text is None else text.take(batch, seq)
        feeds.append({INPUT_NAMES[0]: ids})
        got = run(ids)
        base = eager_low(ids)
        ref = base if eager_ref is None else eager_ref(ids)
        saved.append(ref)
        for name in outputs:
            c = _judge(name, f"{name} [{batch}x{seq}]{label}", got[name], ref[name],
                       None if eager_ref is None else base[name], dtype, options, budget)
            comparisons.append((name, c))
            lines.append(c.line())
            if note is not None:
                lines.append(note(name, got[name], ids))
        if text is not None and "logits" in outputs:
            text.score(ids, {"model": got["logits"], "reference": ref["logits"]})
    if text is not None and "logits" in outputs:
        lines.append(text.line("model", "reference"))
    return feeds, saved, comparisons, lines


def _finish(runner: list[str], save_dir: Path, feeds, saved, comparisons, lines, outputs, dtype,
            other_failures: tuple[str, ...] = (), user_bounds: tuple[float, float] | None = None,
            runner_name: str = EAGER_RUNNER, atol_comparisons=None) -> CheckReport:
    """Save the polygraphy JSON files and build the report: verdict and the `polygraphy run` command.
    other_failures: checks besides the comparisons that failed (named in the verdict)."""
    inputs_path, outputs_path = _save_polygraphy(save_dir, feeds, saved, dtype, runner_name)
    if user_bounds is not None:
        bounds = ["--atol", f"{user_bounds[0]:g}", "--rtol", f"{user_bounds[1]:g}"]
    else:
        atols = []
        for name in outputs:
            ref_max = max(float(np.abs(r[name]).max()) for r in saved)
            atol = tolerances.elementwise_atol([c for n, c in (atol_comparisons or comparisons) if n == name], dtype,
                                               ref_max)
            atols.append(f"{name}:{atol:.3g}")
        bounds = ["--atol", *atols, "--rtol", "0"]
    command = " ".join([*runner, "--load-inputs", shlex.quote(str(inputs_path)),
                        "--load-outputs", shlex.quote(str(outputs_path)), *bounds])
    passed = all(c.passed for _, c in comparisons) and not other_failures
    also = f"; failed: {', '.join(other_failures)}" if other_failures else ""
    lines.append(f"result        {'PASS' if passed else 'FAIL'}: {sum(c.passed for _, c in comparisons)}/"
                 f"{len(comparisons)} comparisons within tolerance{also}")
    lines.append(f"polygraphy    {command}")
    return CheckReport(passed, lines, command, inputs_path, outputs_path)


def run_engine_check(engine_path: str | os.PathLike, loaded: LoadedModel, options: CheckOptions | None = None,
                     log: Callable[[str], None] = print, steps: int | None = None) -> CheckReport:
    """A TensorRT engine built by `diffexport trt` against the eager model, on the GPU.

    With INT8 logits the reference applies the same quantisation (diffexport/quantization.py)
    to the eager model's attention, and the unquantised agreement is reported beside it.
    An engine of a KV-cache folder is stepped as the folder's check steps it (`steps` decode steps,
    DECODE_STEPS when None); a prefill engine takes no `steps` (its calls are `options.shapes`).
    """
    from diffexport.analysis import plots
    from diffexport.analysis.probe import AttentionProbe
    from diffexport.backends.tensorrt import open_engine, read_engine_record, sidecar_path

    options = options or CheckOptions()
    engine_path = Path(engine_path)
    record = read_engine_record(engine_path)
    save_dir = save_dir_for(options, engine_path.with_suffix(".check"))
    meta = check_export_metadata(record["onnx_metadata"], sidecar_path(engine_path))
    dtype = meta["dtype"]
    decoder = meta.get("kv_cache") == "1"
    if options.plot is not None and not decoder:
        raise DiffExportError("--plot draws a KV-cache check step by step: this engine is a prefill graph")
    if steps is not None and not decoder:
        raise DiffExportError("--steps counts the decode steps of a KV-cache folder's engine: this engine is a "
                              "prefill graph; use --shapes")
    steps = DECODE_STEPS if steps is None else steps
    if options.beams is not None and not decoder:
        raise DiffExportError("--num-beams checks beam search on a KV-cache folder's engine: this engine is a "
                              "prefill graph")
    if options.sampling is not None:
        raise DiffExportError("--sample checks onnxruntime-genai's sampling: check the engine's folder with it")
    check_decode_options(options, steps)
    plots.check_plot_path(options.plot)
    check_same_model(meta, loaded, engine_path)
    if decoder:  # the calls the check will make, held against the profile before anything runs
        from diffexport.backends.tensorrt import decoder_profile_problem

        batch, longest = len(DECODE_PROMPTS), max(DECODE_PROMPTS)
        calls = [(batch, longest, 0), (batch, 1, longest + steps - 1)]
        if options.beams is not None:  # every beam a row of the batch
            calls.append((options.beams.num_beams, 1, longest + steps - 1))
        if options.text is not None:  # one row; its windows keep within the profile's calls and past
            calls.append((1, 1, 1))
        for rows, sequence, past in calls:
            problem = decoder_profile_problem(record, engine_path, rows, sequence, past)
            if problem:
                raise DiffExportError(f"the check's {problem}")
    # The sidecar says which library the build used, but a library is code: it is loaded only from
    # where the user says (--plugin-lib, $DIFFEXPORT_PLUGIN_LIB) or from this install's own build.
    plugin_lib = None
    if record.get("attention") == "plugin":
        from diffexport.backends.tensorrt import find_plugin_library

        plugin_lib = str(find_plugin_library(options.plugin_lib))
    if not torch.cuda.is_available():
        raise DiffExportError("checking a TensorRT engine needs an NVIDIA GPU (torch sees none)")
    quant = _engine_logit_quant(record, loaded)
    plugin = ["--plugins", shlex.quote(plugin_lib)] if plugin_lib else []
    runner = ["polygraphy run", shlex.quote(str(engine_path)), "--model-type", "engine", "--trt", *plugin]
    if decoder:
        from diffexport.backends.tensorrt import EngineDecoder

        stepper = EngineDecoder(engine_path, record, meta, open_engine(engine_path.read_bytes(), record["module"],
                                                                       plugin_lib))
        text = None if options.text is None else \
            TextIds(options, loaded.config.vocab_size, 2, "a perplexity needs")
        return _decode_check(stepper, engine_path.name, f"{record['module']} (attention {record['attention']})",
                             "engine", runner, loaded, options, save_dir, log, steps, device="cuda", quant=quant,
                             text=text)
    low_max, seq_max = record["profile"]["max"]
    low_min, seq_min = record["profile"]["min"]
    shapes = [s for s in options.shapes if low_min <= s[0] <= low_max and seq_min <= s[1] <= seq_max]
    if not shapes:
        raise DiffExportError(f"no --shapes inside the engine's profile (batch {low_min}..{low_max}, "
                              f"sequence {seq_min}..{seq_max})")
    outputs = meta.get("outputs", "logits").split(",")
    low, ref32 = _eager_models(loaded, dtype, "cuda")
    log(f"checking      {engine_path.name} ({dtype}, attention {record['attention']}"
        f"{'' if quant is None else ', ' + quant.describe() + ' logits'}) against eager PyTorch"
        f"{'' if quant is None else ' with the same logit quantisation'} (cuda)")
    budget = tolerances.quant_budget(meta)  # Q/DQ matmuls (or quantised weights) change the function
    if budget is not None:
        log(f"budget        {budget.what}: {budget.describe()}, not the {dtype} rule (docs/QUANTIZATION.md)")

    def eager(model, ids):
        if quant is None:
            return _run_eager(model, ids, "cuda", outputs)
        with AttentionProbe(model, quant=quant):
            return _run_eager(model, ids, "cuda", outputs)

    def unquantised(name, got, ids):  # how far the quantised engine is from the unquantised model
        plain = _run_eager(ref32 if ref32 is not None else low, ids, "cuda", outputs)[name]
        cos = tolerances.compare("", got, plain, "float32").cosine
        return f"{'':18s} vs unquantised eager: cosine {cos:.6f} (reported, not a pass criterion)"

    run = open_engine(engine_path.read_bytes(), record["module"], plugin_lib)
    feeds, saved, comparisons, lines = _compare(
        options, shapes, loaded.config.vocab_size, outputs, dtype, lambda ids: run({INPUT_NAMES[0]: ids}),
        lambda ids: eager(low, ids), None if ref32 is None else (lambda ids: eager(ref32, ids)),
        note=None if quant is None else unquantised, budget=budget,
        text=None if options.text is None else TextIds(options, loaded.config.vocab_size, _tokens(shapes)))
    return _finish(runner, save_dir, feeds, saved, comparisons, lines,
                   outputs, dtype, user_bounds=options.user_bounds)


def _engine_logit_quant(record: dict, loaded: LoadedModel):
    """The attention-logit quantisation an engine was built with (None: 16 bits, or a model without
    DiffAttention, where the bits change nothing)."""
    from diffexport.quantization import LogitQuant

    bits = int(record.get("logit_bits", 16))
    if bits >= 16 or loaded.config.family == "transformer":
        return None
    return LogitQuant(bits, "qk", bool(record.get("smooth_k", True)))


# ---------------------------------------------------------------- KV-cache decoder folders


def _hf_generator(loaded: LoadedModel):
    """transformers' own model of an HF folder, float32, for generate() (None when the checkpoint
    is not an HF import or transformers is absent)."""
    if layouts.hf_import_of(loaded.source) is None or not loaded.path:
        return None
    try:
        import transformers
    except ImportError:
        return None
    transformers.utils.logging.disable_progress_bar()
    return _transformers_class(loaded).from_pretrained(loaded.path, torch_dtype=torch.float32).eval()


def _plain_generation_config(hf, eos_token_id):
    """Only the special ids: transformers fills what a generate() call leaves out from the model's
    generation_config (sampling, a repetition penalty, beams, banned words), and the eager
    reference searches plainly."""
    import transformers

    hf.generation_config = transformers.GenerationConfig(bos_token_id=hf.generation_config.bos_token_id,
                                                         eos_token_id=eos_token_id, pad_token_id=0)


def _hf_greedy(loaded: LoadedModel, ids: torch.Tensor, mask: torch.Tensor, steps: int) -> np.ndarray | None:
    """transformers' own greedy tokens for an HF folder (None when transformers is absent)."""
    hf = _hf_generator(loaded)
    if hf is None:
        return None
    _plain_generation_config(hf, hf.generation_config.eos_token_id)
    with torch.no_grad():
        out = hf.generate(ids, attention_mask=mask, max_new_tokens=steps, min_new_tokens=steps, do_sample=False)
    return out[:, ids.shape[1]:].numpy()


def _hf_beams(hf, prompt: list[int], search: BeamSearch, new: int, ends) -> list[tuple[list[int], str]]:
    """transformers' own beam search (hf: _hf_generator's model), as (tokens, stop) per hypothesis,
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


def run_decoder_check(folder: str | os.PathLike, loaded: LoadedModel, options: CheckOptions | None = None,
                      log: Callable[[str], None] = print, steps: int = DECODE_STEPS) -> CheckReport:
    """A KV-cache folder in onnxruntime vs the eager model with its own cache: a padded batch of 3
    (DECODE_PROMPTS), prefill then `steps` greedy decode steps. Both are fed the eager greedy tokens (so every step's
    logits are comparable) and each step's logits meet the dtype rule; onnxruntime's own argmax must
    pick the eager token at every step, and for HF checkpoints transformers' generate() must too."""
    from diffexport.backends.decoding import OrtDecoder
    from diffexport.backends.onnxruntime import resolve_provider

    from diffexport.analysis import plots

    options = options or CheckOptions()
    plots.check_plot_path(options.plot)
    folder = Path(folder)
    save_dir = save_dir_for(options, folder.with_name(folder.name + ".check"))
    provider = resolve_provider(options.provider)
    check_decode_options(options, steps)
    text = None
    if options.text is not None:  # read (and refused) before anything runs; the folder's tokenizer by default
        from diffexport.export.decoder import has_tokenizer

        own = str(folder) if has_tokenizer(folder) else None
        text = TextIds(options, loaded.config.vocab_size, 2, "a perplexity needs", tokenizer=own)
    runner = OrtDecoder(folder, provider)
    if max(DECODE_PROMPTS) + steps > runner.context:
        raise DiffExportError(f"--steps {steps} after a {max(DECODE_PROMPTS)}-token prompt passes the folder's context "
                              f"length {runner.context}: ask for at most {runner.context - max(DECODE_PROMPTS)} steps")
    if options.beams is not None:  # the beams' caches, before the greedy steps run
        from diffexport.backends.decoding import check_beam_memory

        check_beam_memory(runner.config, runner.meta["dtype"], options.beams.num_beams, max(DECODE_PROMPTS) + steps)
    command = ["polygraphy run", shlex.quote(str(runner.model_path)), "--onnxrt", "--providers", provider]
    return _decode_check(runner, f"{folder}/", f"onnxruntime {provider}", "onnxruntime", command, loaded, options,
                         save_dir, log, steps, device="cuda" if provider == "cuda" else "cpu",
                         genai=(folder, provider), text=text)


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
        if options.sampling.seed < 0:
            raise DiffExportError(f"--seed must be >= 0 with --sample (the draws are seeded), got {options.sampling.seed}")


def _decode_check(runner: DecoderRunner, subject: str, where: str, short: str, command: list[str], loaded: LoadedModel,
                  options: CheckOptions, save_dir: Path, log: Callable[[str], None], steps: int, device: str,
                  quant=None, genai: tuple[Path, str] | None = None, text: TextIds | None = None) -> CheckReport:
    """The step-by-step comparison for any decoder runner (OrtDecoder, EngineDecoder): what
    run_decoder_check says. quant: INT8/6/4 attention logits, applied to the eager model too.
    With options.beams, beam search too (_beam_check); genai: (folder, provider) where
    onnxruntime-genai's own search is checked beside the runner's; text: --text's windows too
    (_text_check)."""
    from diffexport.analysis import plots
    from diffexport.analysis.probe import AttentionProbe
    from diffexport.generation import last_real, pad_batch

    meta, dtype = runner.meta, runner.meta["dtype"]
    check_same_model(meta, loaded, runner.model_path)
    budget = tolerances.quant_budget(meta)
    low, ref32 = _eager_models(loaded, dtype, device)
    if budget is not None:
        log(f"budget        {budget.what}: {budget.describe()} per step, not the {dtype} rule; greedy "
            "tokens reported, not judged")
    log(f"checking      {subject} ({dtype}) in {where} against eager PyTorch"
        f"{'' if quant is None else ' with the same ' + quant.describe() + ' logits'} with its KV cache: "
        f"batch {len(DECODE_PROMPTS)} left- and right-padded, prefill + {steps} decode steps")

    def eager(model, ids, mask, past):
        if quant is None:
            return model(ids.to(device), attention_mask=mask.to(device), past_key_values=past, use_cache=True)
        with AttentionProbe(model, quant=quant):
            return model(ids.to(device), attention_mask=mask.to(device), past_key_values=past, use_cache=True)

    rng = np.random.default_rng(options.seed)
    vocab = loaded.config.vocab_size
    prompts = [rng.integers(0, vocab, size=n).tolist() for n in DECODE_PROMPTS]
    ids, mask = pad_batch(prompts, pad_token_id=0, right_padded=DECODE_RIGHT_PADDED)
    cache = runner.empty_cache(len(prompts))
    eager_past = {"low": None, "ref": None}
    step_ids, step_mask = ids, mask
    feeds, saved, comparisons, lines = [], [], [], []
    eager_tokens, runner_tokens, worst = [], [], None
    for step in range(steps + 1):
        feed = {names.INPUT_IDS: step_ids.numpy(), names.ATTENTION_MASK: step_mask.numpy()}
        past_feed = {names.past_of(name): value for name, value in cache.items()}
        logits, cache = runner.step(feed[names.INPUT_IDS], feed[names.ATTENTION_MASK], cache)
        with torch.no_grad():
            base, eager_past["low"] = eager(low, step_ids, step_mask, eager_past["low"])
            ref = base
            if ref32 is not None:
                ref, eager_past["ref"] = eager(ref32, step_ids, step_mask, eager_past["ref"])
        base_np, ref_np = base.float().cpu().numpy(), ref.float().cpu().numpy()
        # rows of padding (prefill of the padded sequence) carry no meaning: compare present tokens only
        present = step_mask[:, -step_ids.shape[1]:].numpy().astype(bool)
        label = "prefill" if step == 0 else f"step {step}"
        c = _judge("logits", f"logits {label}", logits[present], ref_np[present],
                   None if ref32 is None else base_np[present], dtype, options, budget)
        comparisons.append(("logits", c))
        if worst is None or _severity(c) > _severity(worst):
            worst = c
        if step in (0, 1):  # polygraphy: one prefill and one decode step, every input the graph takes
            feeds.append({**feed, **past_feed})
            saved.append({"logits": ref_np})
        last = last_real(step_mask[:, -step_ids.shape[1]:])  # a right-padded prompt ends before its padding
        rows = torch.arange(len(prompts))
        chosen = ref[rows, last.to(ref.device)].float().argmax(-1)
        eager_tokens.append(chosen.cpu().numpy())
        runner_tokens.append(logits[rows.numpy(), last.numpy()].argmax(-1))
        if step == steps:
            break
        step_ids = chosen.cpu()[:, None]
        step_mask = torch.cat([step_mask, torch.ones_like(step_ids)], dim=1)
    eager_tokens, runner_tokens = np.stack(eager_tokens, 1), np.stack(runner_tokens, 1)
    lines += [c.line() for _, c in comparisons if not c.passed][:5]
    lines.append(f"logits        {len(comparisons)} steps (prefill + {steps} decode), batch {len(prompts)} "
                 f"left- and right-padded; worst:")
    lines.append(worst.line())
    agree = int((eager_tokens == runner_tokens).all(axis=0).sum())
    # quantised weights change the function: their tokens may part ways, the budget judges them
    tokens_ok = agree == eager_tokens.shape[1] or budget is not None
    verdict = "(reported: quantised weights)" if budget is not None else ("PASS" if tokens_ok else "FAIL")
    lines.append(f"greedy tokens {short} == eager at {agree}/{eager_tokens.shape[1]} steps  {verdict}")
    if options.plot:
        rule = budget.what if budget is not None else f"{dtype} rule"
        title = f"{Path(subject.rstrip('/')).name}: {short} vs eager per step ({rule})"
        lines.append(f"plot          {plots.plot_decode_steps([c for _, c in comparisons], options.plot, title)}")
    # transformers' generate() continues from the last column: the rows it can pad (not the right-padded)
    left = [i for i in range(len(prompts)) if i not in DECODE_RIGHT_PADDED]
    hf_tokens = _hf_greedy(loaded, ids[left], mask[left], steps + 1) if dtype == "float32" else None
    hf_ok = True
    if hf_tokens is not None:
        hf_ok = bool(np.array_equal(hf_tokens, eager_tokens[left]))
        lines.append(f"greedy tokens transformers generate() == eager for {hf_tokens.shape[1]} tokens  "
                     f"{'PASS' if hf_ok else 'FAIL'}")
    greedy_comparisons = list(comparisons)  # the polygraphy files hold greedy steps: their bounds go with them
    if text is not None:
        text_lines, text_comparisons = _text_check(runner, short, text, eager, low, ref32, dtype, options, budget,
                                                   log)
        lines += text_lines
        comparisons += text_comparisons
    search_failures = []  # the sampling and beam checks, when asked for
    reference = low if ref32 is None else ref32
    if options.sampling is not None and genai is not None:
        sample_lines, sample_ok = _sampling_check(genai, runner.config, reference, options.sampling, options.draws,
                                                  prompts, budget, log, options.plot)
        lines += sample_lines
        if not sample_ok:
            search_failures.append("sampled tokens genai vs eager")
    if options.beams is not None:
        beam_lines, beam_failures = _beam_check(runner, short, loaded, reference, quant, options.beams, prompts,
                                                steps, dtype, budget, genai, log)
        lines += beam_lines
        search_failures += beam_failures
    failures = tuple(name for name, ok in (("greedy tokens vs eager", tokens_ok),
                                           ("greedy tokens vs transformers", hf_ok)) if not ok) + tuple(search_failures)
    return _finish(command, save_dir, feeds, saved, comparisons, lines, ["logits"], dtype, failures,
                   user_bounds=options.user_bounds, atol_comparisons=greedy_comparisons)


TEXT_TOKENS = 4096  # the most of a --text that a decoder check scores (2,048 decode steps)
TEXT_WINDOW = 1024  # tokens per window (the context, when shorter), each from an empty cache


def _text_check(runner: DecoderRunner, short: str, text: TextIds, eager, low, ref32, dtype: str, options: CheckOptions, budget,
                log: Callable[[str], None]) -> tuple[list[str], list]:
    """--text through a decoder as generation feeds it: consecutive windows of the text, each
    from an empty cache, its first half as a prefill (in the runner's longest calls) and the rest
    one decode step a token. Every position's logits are held to the eager model's over the whole
    window in one call without a cache (the dtype rule, or the budget of quantised weights), and
    the perplexity of both is reported. -> (report lines, comparisons: prefill and decode per window)."""
    from diffexport.progress import Progress

    ids = text.ids[:TEXT_TOKENS]
    size = min(TEXT_WINDOW, runner.context)
    windows = [w for w in (ids[i:i + size] for i in range(0, len(ids), size)) if len(w) >= 2]
    log(f"text          {sum(map(len, windows))} tokens of {text.source} in {len(windows)} window(s) of up to {size}: "
        "half prefill, half one-token decode steps, each window from an empty cache")
    comparisons, lines, worst = [], [], None
    with Progress("text", sum(map(len, windows)), min_total=256) as progress:
        for number, window in enumerate(windows, 1):
            row, half = np.asarray([window], np.int64), len(window) // 2
            chunk = runner.max_sequence or half  # an engine's profile bounds one call
            starts = [*range(0, half, chunk), *range(half, len(window))]
            cache, got = runner.empty_cache(1), []
            for start, end in zip(starts, [*starts[1:], len(window)]):
                logits, cache = runner.step(row[:, start:end], np.ones((1, end), np.int64), cache)
                got.append(logits[0])
                progress.advance(end - start)
            got = np.concatenate(got)
            with torch.no_grad():
                whole, mask = torch.from_numpy(row), torch.ones(1, len(window), dtype=torch.int64)
                base = eager(low, whole, mask, None)[0][0].float().cpu().numpy()
                ref = base if ref32 is None else eager(ref32, whole, mask, None)[0][0].float().cpu().numpy()
            for part, rows in (("prefill", slice(0, half)), ("decode", slice(half, None))):
                c = _judge("logits", f"logits text window {number} {part}", got[rows], ref[rows],
                           None if ref32 is None else base[rows], dtype, options, budget)
                comparisons.append(("logits", c))
                if worst is None or _severity(c) > _severity(worst):
                    worst = c
            text.score(row, {short: got[None], "eager": ref[None]})
    lines += [c.line() for _, c in comparisons if not c.passed][:5]
    kept = "" if len(ids) == len(text.ids) else f" (the first {len(ids)} of {len(text.ids)})"
    lines.append(f"text          {sum(map(len, windows))} tokens{kept} in {len(windows)} window(s) of up to {size}, "
                 f"{len(comparisons)} comparisons (prefill and decode steps per window); worst:")
    lines.append(worst.line())
    lines.append(text.line(short, "eager"))
    return lines, comparisons


def _beam_check(runner: DecoderRunner, short: str, loaded: LoadedModel, model, quant, search: BeamSearch,
                prompts: list[list[int]], steps: int, dtype: str, budget, genai: tuple[Path, str] | None,
                log: Callable[[str], None]) -> tuple[list[str], list[str]]:
    """Beam search on the runner (the loop `generate --backend onnxruntime|tensorrt` runs) and in
    onnxruntime-genai's own search (folders) against generation.beam_search on the eager model,
    each prompt alone, every hypothesis compared in rank order; for HF checkpoints at length
    penalty 0, transformers' generate(num_beams=N) too. Where a runtime's hypothesis differs,
    the eager model rescores it: the gap to the eager hypothesis of that rank says whether the two
    parted at a near-tie (a gap of ~0) or the runtime found a worse one. Judged for float32 graphs;
    reduced precision or quantised weights may part beams at near-ties, so there they are reported.
    -> (report lines, failure names)."""
    from diffexport.analysis.probe import AttentionProbe
    from diffexport.backends import decoding
    from diffexport.export import decoder
    from diffexport.generation import beam_search, hypothesis_score
    from diffexport.progress import Progress

    def on_eager(fn):
        if quant is None:
            return fn()
        with AttentionProbe(model, quant=quant):
            return fn()

    ends = None if runner.config is None else decoder.eos_token_ids(runner.config)
    new = min(steps, min(runner.context - len(p) for p in prompts))
    runtimes = {short: lambda prompt: decoding.beam_search_onnxruntime(None, prompt, new, search, runner=runner)}
    lines = []
    if genai is not None:
        folder, provider = genai
        try:
            decoding.check_genai_beams(search.num_beams)
            model_genai = decoding.open_genai_model(folder, provider, decoding.genai_pad_for(runner.config, prompts))
        except DiffExportError as exc:  # not installed, or no build for this provider: the loop is still checked
            lines.append(f"beams         onnxruntime-genai's own search not checked: {exc}")
        else:
            runtimes["genai"] = lambda prompt: decoding.beam_search_genai(folder, prompt, new, search,
                                                                          model=model_genai)
    rule = "early stopping" if search.early_stopping else "no early stopping"
    log(f"beams         {search.num_beams} beams (length penalty {search.length_penalty:g}, {rule}) on "
        f"{', '.join(runtimes)} vs eager: {len(prompts)} prompts alone, up to {new} new tokens, "
        f"{search.num_return_sequences} hypotheses each; end ids "
        f"{', '.join(map(str, ends)) if ends else 'none (an engine checked without its folder)'}")
    hf = None
    if layouts.hf_import_of(loaded.source) is not None and dtype == "float32" and quant is None:
        if search.length_penalty == 0:
            hf = _hf_generator(loaded)
        else:
            lines.append("beams         transformers' beam search divides by the new tokens, genai's by the whole "
                         "length: compared with it at --length-penalty 0 only")
    progress = Progress("beam search", len(prompts) * (len(runtimes) + 1 + (hf is not None)))
    hf_same = 0
    same = dict.fromkeys(runtimes, 0)
    gaps = dict.fromkeys(runtimes, 0.0)
    parted = []
    total = 0
    for index, prompt in enumerate(prompts):
        want = on_eager(lambda: beam_search(model, prompt, search, new, ends))
        progress.advance(1)
        total += len(want)
        if hf is not None:
            found = _hf_beams(hf, prompt, search, new, ends)
            progress.advance(1)
            hf_same += sum(1 for h, (tokens, stop) in zip(want, found) if (h.tokens, h.stop) == (tokens, stop))
        for name, run in runtimes.items():
            got = run(prompt)
            progress.advance(1)
            for rank, hypothesis in enumerate(want):
                if rank >= len(got.sequences):
                    gaps[name] = float("inf")
                    parted.append(f"{name} prompt {index + 1}: no hypothesis of rank {rank + 1}")
                    continue
                tokens, stop = got.sequences[rank], got.stops[rank]
                if tokens == hypothesis.tokens and stop == hypothesis.stop:
                    same[name] += 1
                    continue
                score = on_eager(lambda: hypothesis_score(model, prompt, tokens, stop, search.length_penalty, ends))
                gap = hypothesis.score - score
                gaps[name] = max(gaps[name], gap)
                at = next((i for i, (a, b) in enumerate(zip(tokens, hypothesis.tokens)) if a != b),
                          min(len(tokens), len(hypothesis.tokens)))
                parted.append(f"{name} prompt {index + 1} rank {rank + 1}: parts at new token {at + 1} "
                              f"({len(tokens)} tokens, {stop}; eager {len(hypothesis.tokens)}, {hypothesis.stop}); "
                              f"eager scores it {score:.5f}, its own {hypothesis.score:.5f} (gap {gap:.2e})")
    progress.close()
    judged = dtype == "float32" and budget is None
    failures = []
    for name in runtimes:
        ok = same[name] == total
        if not ok and judged:
            failures.append(f"beam hypotheses {name} vs eager")
        verdict = "PASS" if ok else ("FAIL" if judged else "(reported: quantised weights change the model)"
                                     if budget is not None else f"(reported: {dtype} may part beams at near-ties)")
        worst = "" if ok else f"; worst score gap under eager {gaps[name]:.2e}"
        lines.append(f"beam hypotheses {name} == eager: {same[name]}/{total}{worst}  {verdict}")
    if hf is not None:
        if hf_same != total:
            failures.append("beam hypotheses transformers vs eager")
        lines.append(f"beam hypotheses transformers generate() == eager: {hf_same}/{total}  "
                     f"{'PASS' if hf_same == total else 'FAIL'}")
    return [*parted[:5], *lines], failures


SAMPLING_P_VALUE = 1e-4  # below: genai's draws are not from the eager distribution (seeded, so reproducible)
SAMPLING_MIN_EXPECTED = 5  # draws a chi-square bin needs (Cochran's rule)


def _sampling_check(genai: tuple[Path, str], config: dict, model, sampling: Sampling, draws: int,
                    prompts: list[list[int]], budget, log: Callable[[str], None],
                    plot: str | None = None) -> tuple[list[str], bool]:
    """onnxruntime-genai's sampled first tokens after each prompt against the distribution eager
    generate draws from (generation.next_token_probs: temperature, top-k, top-p, after the
    repetition penalty): no draw may fall outside the eager support, except a token at the cut
    within the logits' tolerance of the last kept one, and a chi-square test over the support (bins of
    at least SAMPLING_MIN_EXPECTED expected draws, the tail merged) must not reject at
    SAMPLING_P_VALUE. Draws are seeded, so a verdict repeats. Quantised folders are reported.
    The onnxruntime loop draws with eager's own code (generation.choose_next), so only genai is tested.
    plot: check's --plot; the draws then go to plots.sampling_plot_path(plot)."""
    from diffexport.backends import decoding
    from diffexport.generation import next_token_probs, penalize_repeats, seen_tokens
    from diffexport.progress import Progress

    folder, provider = genai
    try:
        genai_model = decoding.open_genai_model(folder, provider, decoding.genai_pad_for(config, prompts))
    except DiffExportError as exc:
        return [f"sampling      onnxruntime-genai's sampling not checked: {exc}"], True
    log(f"sampling      genai: {draws} draws of the first token after each of {len(prompts)} prompts (temperature "
        f"{sampling.temperature:g}, top-k {sampling.top_k}, top-p {sampling.top_p:g}, repetition penalty "
        f"{sampling.repetition_penalty:g}, seed {sampling.seed}) vs the eager distribution")
    lines, ok, drawn = [], True, []
    device = next(model.parameters()).device
    progress = Progress("sampling", len(prompts) * draws, min_total=20_000)
    for index, prompt in enumerate(prompts):
        ids = torch.tensor([prompt], device=device)
        with torch.no_grad():
            logits = model(ids, attention_mask=torch.ones_like(ids), use_cache=True)[0][:, -1].float()
        if sampling.repetition_penalty != 1.0:
            logits = penalize_repeats(logits, seen_tokens(ids, None, logits.shape[-1]), sampling.repetition_penalty)
        probs = next_token_probs(logits, sampling)[0].double().cpu()
        scaled = (logits[0] / sampling.temperature).double().cpu()
        got = decoding.sample_first_tokens_genai(genai_model, config, prompt, sampling, draws,
                                                 on_draws=progress.advance)
        counts = torch.bincount(torch.tensor(got), minlength=probs.numel()).double()
        # a token just outside the cut may be inside it in the folder's logits: within their tolerance
        cut = float(scaled[probs > 0].min())
        slack = 1e-3 * max(1.0, abs(cut)) / min(1.0, sampling.temperature)
        outside = (probs == 0) & (counts > 0)
        at_cut = outside & (scaled >= cut - slack)
        strays = int(counts[outside & ~at_cut].sum())
        support = probs > 0  # draws at the cut left out of the test, the rest expected in proportion
        statistic, bins, p_value = _chi_square(counts[support], probs[support] * float(counts[support].sum()))
        drawn.append((probs, counts, draws, strays))
        passed = strays == 0 and p_value >= SAMPLING_P_VALUE
        ok = ok and (passed or budget is not None)
        lines.append(f"sampled tokens genai prompt {index + 1}: {draws} draws over {int((probs > 0).sum())} eager "
                     f"candidates, {strays} outside them{f' ({int(counts[at_cut].sum())} at the cut)' if at_cut.any() else ''}; "
                     f"chi-square {statistic:.1f} over {bins} bins, p {p_value:.2g}  "
                     f"{('PASS' if passed else 'FAIL') if budget is None else '(reported: quantised weights)'}")
    progress.close()
    if plot is not None:
        from diffexport.analysis import plots

        title = (f"{Path(folder).name}: genai's draws vs eager (temperature {sampling.temperature:g}, "
                 f"top-k {sampling.top_k}, top-p {sampling.top_p:g})")
        lines.append(f"plot          {plots.plot_sampled_draws(drawn, plots.sampling_plot_path(plot), title)}")
    return lines, ok


def _chi_square(observed: torch.Tensor, expected: torch.Tensor) -> tuple[float, int, float]:
    """Pearson's chi-square of draws against their expected counts: the likeliest tokens a bin each
    while a bin expects SAMPLING_MIN_EXPECTED draws, the rest one bin (folded into the last when it
    expects fewer). -> (statistic, bins, p-value); one bin leaves nothing to test (p 1)."""
    order = expected.argsort(descending=True)
    observed, expected = observed[order], expected[order]
    single = int((expected >= SAMPLING_MIN_EXPECTED).sum())
    obs, exp = list(observed[:single]), list(expected[:single])
    rest_obs, rest_exp = float(observed[single:].sum()), float(expected[single:].sum())
    if rest_exp >= SAMPLING_MIN_EXPECTED or not exp:
        obs.append(rest_obs)
        exp.append(rest_exp)
    else:
        obs[-1] += rest_obs
        exp[-1] += rest_exp
    obs, exp = torch.tensor([float(o) for o in obs], dtype=torch.float64), \
        torch.tensor([float(e) for e in exp], dtype=torch.float64)
    if len(exp) < 2:
        return 0.0, len(exp), 1.0
    statistic = float(((obs - exp) ** 2 / exp.clamp_min(1e-300)).sum())
    dof = len(exp) - 1
    p_value = float(torch.special.gammaincc(torch.tensor(dof / 2, dtype=torch.float64),
                                            torch.tensor(statistic / 2, dtype=torch.float64)))
    return statistic, len(exp), p_value


# ---------------------------------------------------------------- one ONNX graph against another

ORT_DTYPES = {"tensor(float)": "float32", "tensor(float16)": "float16", "tensor(bfloat16)": "bfloat16"}


def run_against(model_path: str | os.PathLike, against_path: str | os.PathLike, options: CheckOptions | None = None,
                log: Callable[[str], None] = print) -> CheckReport:
    """`check MODEL --against OTHER`: both graphs in onnxruntime on the same seeded inputs (e.g. a
    graph `diffexport optimize` wrote against its input), every shared output compared. fp32:
    the fp32 rule; fp16/bf16: |model - other| <= atol(dtype) * max(1, |other|) and the cosine floor
    (two low-precision graphs leave no fp32 reference to measure rounding against); --atol/--rtol
    replace the rule."""
    from diffexport.backends.onnxruntime import open_session, resolve_provider

    options = options or CheckOptions()
    model_path, against_path = Path(model_path), Path(against_path)
    save_dir = save_dir_for(options, model_path.with_suffix(".check"))
    provider = resolve_provider(options.provider)
    session, other = open_session(model_path, provider), open_session(against_path, provider)
    ins = {(i.name, i.type) for i in session.get_inputs()}
    if ins != {(i.name, i.type) for i in other.get_inputs()}:
        raise DiffExportError(f"{model_path.name} and {against_path.name} take different inputs "
                              f"({sorted(n for n, _ in ins)} vs {sorted(i.name for i in other.get_inputs())}): "
                              "--against compares two versions of one model")
    theirs = {o.name: o for o in other.get_outputs()}
    outputs = [o.name for o in session.get_outputs() if o.name in theirs]
    if not outputs:
        raise DiffExportError(f"{model_path.name} and {against_path.name} share no output name")
    out_types = {ORT_DTYPES.get(o.type) for o in session.get_outputs() if o.name in outputs}
    if None in out_types or len(out_types) != 1:
        raise DiffExportError(f"outputs of {model_path.name} must all be float32, float16 or bfloat16 to compare")
    dtype = out_types.pop()
    last = theirs[outputs[0]].shape[-1] if theirs[outputs[0]].shape else None
    vocab = last if isinstance(last, int) and last > 1 else 2  # token ids valid for any embedding
    text = None
    if options.text is not None:  # the text is read (and refused) before any work
        if INPUT_NAMES[0] not in {i.name for i in session.get_inputs()}:
            raise DiffExportError(f"--text needs a graph that takes {INPUT_NAMES[0]}")
        text = TextIds(options, vocab, _tokens(options.shapes))
    log(f"checking      {model_path.name} against {against_path.name} in onnxruntime {provider}, same inputs, "
        f"outputs {', '.join(outputs)} ({dtype})")
    from diffexport.passes.fusion import probe_feeds

    graph = load_onnx(model_path, weights=False)
    # a weight-quantised model against its unquantised source: the budget, not the dtype rule
    def quant_records(model) -> dict[str, str]:
        return {p.key[len(META_PREFIX):]: p.value for p in model.metadata_props
                if p.key in (META_PREFIX + "weight_quant", META_PREFIX + "qdq")}

    theirs_quantised = bool(quant_records(load_onnx(against_path, weights=False)))
    budget = None if theirs_quantised else tolerances.quant_budget(quant_records(graph))
    if budget is not None:
        log(f"budget        {budget.what}: {budget.describe()}, not the {dtype} rule")
    rng = np.random.default_rng(options.seed)
    feeds, saved, comparisons, lines = [], [], [], []
    for batch, seq in options.shapes:
        feed = probe_feeds(graph, batch, seq, vocab=vocab, rng=rng)
        if text is not None:
            feed[INPUT_NAMES[0]] = text.take(batch, seq)
        got = dict(zip(outputs, session.run(outputs, feed)))
        ref = dict(zip(outputs, other.run(outputs, feed)))
        if text is not None and "logits" in outputs:
            text.score(feed[INPUT_NAMES[0]], {model_path.name: got["logits"], against_path.name: ref["logits"]})
        feeds.append(feed)
        saved.append(ref)
        for name in outputs:
            c = _judge(name, f"{name} [{batch}x{seq}]", got[name], ref[name],
                       None if dtype == "float32" else ref[name], dtype, options, budget)
            comparisons.append((name, c))
            lines.append(c.line())
    if text is not None and "logits" in outputs:
        lines.append(text.line(model_path.name, against_path.name))
    runner = ["polygraphy run", shlex.quote(str(model_path)), "--onnxrt", "--providers", provider]
    return _finish(runner, save_dir, feeds, saved, comparisons, lines,
                   outputs, dtype, user_bounds=options.user_bounds, runner_name=f"onnxrt-{against_path.stem}")
