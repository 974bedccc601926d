"""A KV-cache decoder folder (or its engine) against the eager model: prefill of padded prompts, then decode
steps, and optionally a text of the user's scored window by window.
"""

from __future__ import annotations

import os
import shlex
from pathlib import Path
from typing import Callable

import numpy as np
import torch

from diffexport.analysis import plots
from diffexport.analysis.probe import AttentionProbe
from diffexport.backends.base import DecoderRunner, check_beam_memory
from diffexport.backends.step_loop import open_onnxruntime_runtime
from diffexport.core.eager_generation import last_real, pad_batch
from diffexport.core.errors import DiffExportError
from diffexport.core.onnxruntime_session import resolve_provider
from diffexport.core.progress import Progress
from diffexport.format import metadata, model_card, names
from diffexport.format.decoder_folder import has_tokenizer
from diffexport.format.metadata_keys import DTYPE
from diffexport.modeling.checkpoint import LoadedModel
from diffexport.validation.compare import finish_report, judge, severity
from diffexport.validation.options import (
    DECODE_PROMPTS,
    DECODE_RIGHT_PADDED,
    DECODE_STEPS,
    CheckOptions,
    CheckReport,
    TextIds,
    check_decode_options,
    check_same_model,
    save_dir_for,
)
from diffexport.validation.references import eager_models, hf_greedy
from diffexport.validation.search import beam_check, sampling_check


def run_decoder_check(folder: str | os.PathLike, loaded: LoadedModel, options: CheckOptions | None = None,
                      log: Callable[[str], None] = print, steps: int = DECODE_STEPS) -> CheckReport:
    """A KV-cache folder in onnxruntime vs the eager model with its own cache: a padded batch of 3
    (DECODE_PROMPTS), prefill then `steps` greedy decode steps. Both are fed the eager greedy tokens (so every step's
    logits are comparable) and each step's logits meet the dtype rule; onnxruntime's own argmax must
    pick the eager token at every step, and for HF checkpoints transformers' generate() must too."""

    options = options or CheckOptions()
    plots.check_plot_path(options.plot)
    folder = Path(folder)
    save_dir = save_dir_for(options, folder.with_name(folder.name + ".check"))
    provider = resolve_provider(options.provider)
    check_decode_options(options, steps)
    text = None
    if options.text is not None:  # read (and refused) before anything runs; the folder's tokenizer by default

        own = str(folder) if has_tokenizer(folder) else None
        text = TextIds(options, loaded.config.vocab_size, 2, "a perplexity needs", tokenizer=own)
    runtime = open_onnxruntime_runtime(folder, provider=provider)  # the step loop's runtime: its runner is stepped
    runner = runtime.runner
    if max(DECODE_PROMPTS) + steps > runner.context:
        raise DiffExportError(f"--steps {steps} after a {max(DECODE_PROMPTS)}-token prompt passes the folder's context "
                              f"length {runner.context}: ask for at most {runner.context - max(DECODE_PROMPTS)} steps")
    if options.beams is not None:  # the beams' caches, before the greedy steps run

        check_beam_memory(runner.config, runner.meta[DTYPE], options.beams.num_beams, max(DECODE_PROMPTS) + steps)
    command = ["polygraphy run", shlex.quote(str(runner.model_path)), "--onnxrt", "--providers", provider]
    report = decode_check(runner, f"{folder}/", f"{runtime.name} {provider}", runtime.name, command, loaded, options,
                          save_dir, log, steps, device="cuda" if provider == "cuda" else "cpu",
                          genai=(folder, provider), text=text)
    # the folder's model card (ours only: a README.md the user wrote is never touched) records the verdict
    asked = f"diffexport check {folder.name}" + (f" --ckpt {Path(loaded.path).name}" if loaded.path else "")
    if model_card.update_results(folder, model_card.results_lines(report.verdict, report.lines, asked)):
        report.lines.append(f"card          {folder / model_card.CARD}: results section updated")
    return report


def decode_check(runner: DecoderRunner, subject: str, where: str, short: str, command: list[str], loaded: LoadedModel,
                  options: CheckOptions, save_dir: Path, log: Callable[[str], None], steps: int, device: str,
                  quant=None, genai: tuple[Path, str] | None = None, text: TextIds | None = None) -> CheckReport:
    """The step-by-step comparison for any decoder runner (OrtDecoder, EngineDecoder): what
    run_decoder_check says. quant: INT8/6/4 attention logits, applied to the eager model too.
    With options.beams, beam search too (beam_check); genai: (folder, provider) where
    onnxruntime-genai's own search is checked beside the runner's; text: --text's windows too
    (_text_check)."""

    meta, dtype = runner.meta, runner.meta[DTYPE]
    check_same_model(meta, loaded, runner.model_path)
    budget = metadata.quant_budget(meta)
    low, ref32 = eager_models(loaded, dtype, device)
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
    feeds, saved, comparisons, lines, observed = [], [], [], [], []
    eager_tokens, runner_tokens, near_ties, worst = [], [], [], None
    progress = Progress("decode steps", steps + 1)  # a big or quantised folder takes minutes here
    for step in range(steps + 1):
        progress.advance(1)
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
        c = judge("logits", f"logits {label}", logits[present], ref_np[present],
                   None if ref32 is None else base_np[present], dtype, options, budget)
        comparisons.append(("logits", c))
        if worst is None or severity(c) > severity(worst):
            worst = c
        if step in (0, 1):  # polygraphy: one prefill and one decode step, every input the graph takes
            feeds.append({**feed, **past_feed})
            saved.append({"logits": ref_np})
            observed.append({"logits": logits})
        last = last_real(step_mask[:, -step_ids.shape[1]:])  # a right-padded prompt ends before its padding
        rows = torch.arange(len(prompts))
        chosen = ref[rows, last.to(ref.device)].float().argmax(-1)
        eager_tokens.append(chosen.cpu().numpy())
        runner_tokens.append(logits[rows.numpy(), last.numpy()].argmax(-1))
        if ref32 is not None:  # reduced precision: a reference whose top two are closer than the logits' bound
            top2 = np.sort(ref[rows, last.to(ref.device)].float().cpu().numpy(), axis=-1)[:, -2:]
            near_ties.append((top2[:, 1] - top2[:, 0]) <= c.bound)
        if step == steps:
            break
        step_ids = chosen.cpu()[:, None]
        step_mask = torch.cat([step_mask, torch.ones_like(step_ids)], dim=1)
    progress.close()
    eager_tokens, runner_tokens = np.stack(eager_tokens, 1), np.stack(runner_tokens, 1)
    lines += [c.line() for _, c in comparisons if not c.passed][:5]
    lines.append(f"logits        {len(comparisons)} steps (prefill + {steps} decode), batch {len(prompts)} "
                 f"left- and right-padded; worst:")
    lines.append(worst.line())
    agree = int((eager_tokens == runner_tokens).all(axis=0).sum())
    # quantised weights change the function: their tokens may part ways, the budget judges them; a
    # reduced-precision graph may take the other of two tokens whose reference logits are closer than
    # the bound its logits were held to (a near-tie the tolerance allows), nowhere else
    ties = np.stack(near_ties, 1) if near_ties else np.zeros_like(eager_tokens, dtype=bool)
    parted = (eager_tokens != runner_tokens) & ~ties
    tokens_ok = not parted.any() or budget is not None
    verdict = f"(reported: quantised, {budget.what})" if budget is not None else ("PASS" if tokens_ok else "FAIL")
    tied = int(((eager_tokens != runner_tokens) & ties).any(axis=0).sum())
    at_ties = f", the others at near-ties (reference top-2 within the logits' bound): {tied}" if tied else ""
    lines.append(f"greedy tokens {short} == eager at {agree}/{eager_tokens.shape[1]} steps{at_ties}  {verdict}")
    if options.plot:
        rule = budget.what if budget is not None else f"{dtype} rule"
        title = f"{Path(subject.rstrip('/')).name}: {short} vs eager per step ({rule})"
        lines.append(f"plot          {plots.plot_decode_steps([c for _, c in comparisons], options.plot, title)}")
    # transformers' generate() continues from the last column: the rows it can pad (not the right-padded)
    left = [i for i in range(len(prompts)) if i not in DECODE_RIGHT_PADDED]
    hf_tokens = hf_greedy(loaded, ids[left], mask[left], steps + 1, log) if dtype == "float32" else None
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
    search_failures, inconclusive = [], []  # the sampling and beam checks, when asked for
    reference = low if ref32 is None else ref32
    if options.sampling is not None and genai is not None:
        sample_lines, sample_ok, sample_judged = sampling_check(genai, runner.config, reference, options.sampling,
                                                                options.draws, prompts, budget, log, options.plot)
        lines += sample_lines
        if not sample_ok:
            search_failures.append("sampled tokens genai vs eager")
        elif not sample_judged:
            inconclusive.append("sampled tokens genai vs eager (too few bins: see its line)")
    if options.beams is not None:
        beam_lines, beam_failures = beam_check(runner, short, loaded, reference, quant, options.beams, prompts,
                                                steps, dtype, budget, genai, log)
        lines += beam_lines
        search_failures += beam_failures
    failures = tuple(name for name, ok in (("greedy tokens vs eager", tokens_ok),
                                           ("greedy tokens vs transformers", hf_ok)) if not ok) + tuple(search_failures)
    report = finish_report(command, save_dir, feeds, saved, comparisons, lines, ["logits"], dtype, failures,
                           user_bounds=options.user_bounds, atol_comparisons=greedy_comparisons, observed=observed,
                           inconclusive=tuple(inconclusive))
    report.measures.update(decode_steps=len(greedy_comparisons), greedy=(agree, int(eager_tokens.shape[1])),
                           greedy_judged=budget is None)
    if hf_tokens is not None:
        report.measures["transformers_greedy"] = hf_ok
    if text is not None and text.count:
        report.measures["perplexity"] = text.perplexities()
    return report


TEXT_TOKENS = 4096  # the most of a --text that a decoder check scores (2,048 decode steps)


TEXT_WINDOW = 1024  # tokens per window (the context, when shorter), each from an empty cache


def _text_check(runner: DecoderRunner, short: str, text: TextIds, eager, low, ref32, dtype: str, options: CheckOptions,
                budget, log: Callable[[str], None]) -> tuple[list[str], list]:
    """--text through a decoder as generation feeds it: consecutive windows of the text, each
    from an empty cache, its first half as a prefill (in the runner's longest calls) and the rest
    one decode step a token. Every position's logits are held to the eager model's over the whole
    window in one call without a cache (the dtype rule, or the budget of quantised weights), and
    the perplexity of both is reported. -> (report lines, comparisons: prefill and decode per window)."""

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
                c = judge("logits", f"logits text window {number} {part}", got[rows], ref[rows],
                           None if ref32 is None else base[rows], dtype, options, budget)
                comparisons.append(("logits", c))
                if worst is None or severity(c) > severity(worst):
                    worst = c
            text.score(row, {short: got[None], "eager": ref[None]})
    lines += [c.line() for _, c in comparisons if not c.passed][:5]
    kept = "" if len(ids) == len(text.ids) else f" (the first {len(ids)} of {len(text.ids)})"
    lines.append(f"text          {sum(map(len, windows))} tokens{kept} in {len(windows)} window(s) of up to {size}, "
                 f"{len(comparisons)} comparisons (prefill and decode steps per window); worst:")
    lines.append(worst.line())
    lines.append(text.line(short, "eager"))
    return lines, comparisons
