"""Search checks of a decoder: every hypothesis of a beam search against transformers' or the eager model's, and
onnxruntime-genai's sampling against the eager distribution (chi-square).
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Callable

import torch

from diffexport.analysis import plots
from diffexport.analysis.probe import AttentionProbe
from diffexport.backends import genai as genai_backend
from diffexport.backends import step_loop
from diffexport.backends.base import DecoderRunner
from diffexport.core.eager_generation import (
    BeamSearch,
    Sampling,
    beam_search,
    hypothesis_score,
    next_token_probs,
    penalize_repeats,
    seen_tokens,
)
from diffexport.core.errors import DiffExportError
from diffexport.core.progress import Progress
from diffexport.format import decoder_folder
from diffexport.modeling import layouts
from diffexport.modeling.checkpoint import LoadedModel
from diffexport.validation.references import hf_beams, hf_generator


def beam_check(runner: DecoderRunner, short: str, loaded: LoadedModel, model, quant, search: BeamSearch,
                prompts: list[list[int]], steps: int, dtype: str, budget, genai: tuple[Path, str] | None,
                log: Callable[[str], None]) -> tuple[list[str], list[str]]:
    """Beam search on the runner (the loop `generate --backend onnxruntime|tensorrt` runs) and in
    onnxruntime-genai's own search (folders) against eager_generation.beam_search on the eager model,
    each prompt alone, every hypothesis compared in rank order; for HF checkpoints at length
    penalty 0, transformers' generate(num_beams=N) too. Where a runtime's hypothesis differs,
    the eager model rescores it: the gap to the eager hypothesis of that rank says whether the two
    parted at a near-tie (a gap of ~0) or the runtime found a worse one. Judged for float32 graphs;
    reduced precision or quantised weights may part beams at near-ties, so there they are reported.
    -> (report lines, failure names)."""

    def on_eager(fn):
        if quant is None:
            return fn()
        with AttentionProbe(model, quant=quant):
            return fn()

    ends = None if runner.config is None else decoder_folder.eos_token_ids(runner.config)
    new = min(steps, min(runner.context - len(p) for p in prompts))
    runtimes = {short: lambda prompt: step_loop.beam_search_stepped(None, prompt, new, search, runner=runner)}
    lines = []
    if genai is not None:
        folder, provider = genai
        try:
            genai_backend.check_genai_beams(search.num_beams)
            model_genai = genai_backend.open_genai_model(folder, provider,
                                                         genai_backend.genai_pad_for(runner.config, prompts))
        except DiffExportError as exc:  # not installed, or no build for this provider: the loop is still checked
            lines.append(f"beams         onnxruntime-genai's own search not checked: {exc}")
        else:
            runtimes["genai"] = lambda prompt: genai_backend.beam_search_genai(folder, prompt, new, search,
                                                                               model=model_genai)
    rule = "early stopping" if search.early_stopping else "no early stopping"
    log(f"beams         {search.num_beams} beams (length penalty {search.length_penalty:g}, {rule}) on "
        f"{', '.join(runtimes)} vs eager: {len(prompts)} prompts alone, up to {new} new tokens, "
        f"{search.num_return_sequences} hypotheses each; end ids "
        f"{', '.join(map(str, ends)) if ends else 'none (an engine checked without its folder)'}")
    hf = None
    if layouts.hf_import_of(loaded.source) is not None and dtype == "float32" and quant is None:
        if search.length_penalty == 0:
            hf = hf_generator(loaded)
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
            found = hf_beams(hf, prompt, search, new, ends)
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
        verdict = "PASS" if ok else ("FAIL" if judged else f"(reported: quantised, {budget.what})"
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


def sampling_check(genai: tuple[Path, str], config: dict, model, sampling: Sampling, draws: int,
                    prompts: list[list[int]], budget, log: Callable[[str], None],
                    plot: str | None = None) -> tuple[list[str], bool, bool]:
    """onnxruntime-genai's sampled first tokens after each prompt against the distribution eager
    generate draws from (eager_generation.next_token_probs: temperature, top-k, top-p, after the
    repetition penalty): no draw may fall outside the eager support, except a token at the cut
    within the logits' tolerance of the last kept one, and a chi-square test over the support (bins of
    at least SAMPLING_MIN_EXPECTED expected draws, the tail merged) must not reject at
    SAMPLING_P_VALUE. Draws are seeded, so a verdict repeats. Quantised folders are reported.
    The onnxruntime loop draws with eager's own code (eager_generation.choose_next), so only genai is tested.
    A prompt whose draws make fewer than two bins (a near-deterministic distribution, or too few
    draws) leaves the test nothing to judge: it is inconclusive, never a PASS, and its line says how
    many draws (or what temperature) would make it a test.
    plot: check's --plot; the draws then go to plots.sampling_plot_path(plot).
    -> (lines, no draw failed, every prompt was judged)."""

    folder, provider = genai
    try:
        genai_model = genai_backend.open_genai_model(folder, provider, genai_backend.genai_pad_for(config, prompts))
    except DiffExportError as exc:
        return [f"sampling      onnxruntime-genai's sampling not checked: {exc}"], True, False
    log(f"sampling      genai: {draws} draws of the first token after each of {len(prompts)} prompts (temperature "
        f"{sampling.temperature:g}, top-k {sampling.top_k}, top-p {sampling.top_p:g}, repetition penalty "
        f"{sampling.repetition_penalty:g}, seed {sampling.seed}) vs the eager distribution")
    lines, ok, judged, drawn = [], True, True, []
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
        got = genai_backend.sample_first_tokens_genai(genai_model, config, prompt, sampling, draws,
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
        testable = bins >= 2 or strays > 0  # a stray fails on its own; one bin is no test
        ok = ok and (passed or budget is not None)
        judged = judged and (testable or budget is not None)
        if budget is not None:
            verdict = f"(reported: quantised, {budget.what})"
        elif not testable:
            verdict = f"INCONCLUSIVE: {_too_few_bins(probs[support], draws)}"
        else:
            verdict = "PASS" if passed else "FAIL"
        lines.append(f"sampled tokens genai prompt {index + 1}: {draws} draws over {int((probs > 0).sum())} eager "
                     f"candidates, {strays} outside "
                     f"them{f' ({int(counts[at_cut].sum())} at the cut)' if at_cut.any() else ''}; "
                     f"chi-square {statistic:.1f} over {bins} bins, p {p_value:.2g}  {verdict}")
    progress.close()
    if plot is not None:

        title = (f"{Path(folder).name}: genai's draws vs eager (temperature {sampling.temperature:g}, "
                 f"top-k {sampling.top_k}, top-p {sampling.top_p:g})")
        lines.append(f"plot          {plots.plot_sampled_draws(drawn, plots.sampling_plot_path(plot), title)}")
    return lines, ok, judged


def _too_few_bins(probs: torch.Tensor, draws: int) -> str:
    """Why a chi-square of `draws` over this distribution has fewer than two bins, and the change
    that gives it two: the tokens past the likeliest must expect SAMPLING_MIN_EXPECTED draws."""
    tail = float(probs.sum() - probs.max())
    if tail <= 0:
        return ("one token holds all the eager probability: nothing to test; raise --temperature "
                "or lower --top-k/--top-p cuts")
    needed = math.ceil(SAMPLING_MIN_EXPECTED / tail)
    return (f"the likeliest token holds {1 - tail:.4%} of the probability, so {draws} draws give the rest fewer than "
            f"{SAMPLING_MIN_EXPECTED} expected: no test; use --draws {needed} or more, or a higher --temperature")


def _chi_square(observed: torch.Tensor, expected: torch.Tensor) -> tuple[float, int, float]:
    """Pearson's chi-square of draws against their expected counts, tokens grouped into bins of at
    least SAMPLING_MIN_EXPECTED expected draws: the likeliest first, each bin closed once it expects
    enough, a short remainder folded into the last bin (so a near-flat distribution still makes many
    bins). -> (statistic, bins, p-value); one bin leaves nothing to test (p 1)."""
    order = expected.argsort(descending=True)
    observed, expected = observed[order].tolist(), expected[order].tolist()
    obs, exp, run_obs, run_exp = [], [], 0.0, 0.0
    for o, e in zip(observed, expected):
        run_obs, run_exp = run_obs + o, run_exp + e
        if run_exp >= SAMPLING_MIN_EXPECTED:
            obs.append(run_obs)
            exp.append(run_exp)
            run_obs = run_exp = 0.0
    if exp:
        obs[-1] += run_obs
        exp[-1] += run_exp
    else:
        obs, exp = [run_obs], [run_exp]
    obs, exp = torch.tensor(obs, dtype=torch.float64), torch.tensor(exp, dtype=torch.float64)
    if len(exp) < 2:
        return 0.0, len(exp), 1.0
    statistic = float(((obs - exp) ** 2 / exp.clamp_min(1e-300)).sum())
    dof = len(exp) - 1
    p_value = float(torch.special.gammaincc(torch.tensor(dof / 2, dtype=torch.float64),
                                            torch.tensor(statistic / 2, dtype=torch.float64)))
    return statistic, len(exp), p_value
