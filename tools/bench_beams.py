"""Beam search on CPU: what N beams cost against greedy decoding, on each runtime of
`diffexport generate --num-beams`.

    python tools/bench_beams.py [--prompt 128] [--new 64] [--beams 1,4,8] [--rounds 3] [--write]

Model: diff-v1-110m with seeded random weights, fp32, its DiffAttention and --attention gqa
folders, onnxruntime with intra_op_num_threads = the machine's cores. One prompt of --prompt random
ids; every search runs --new steps (no end id is reachable: the end id is moved to one the model
never picks, so every run does the same work). Runtimes: onnxruntime-genai's own search
(genai.beam_search_genai), eager_generation.search_beams over the onnxruntime loop
(step_loop.beam_search_stepped) and over the eager model (eager_generation.beam_search); 1 beam is
greedy decoding through the same code. All runtimes must return the same hypotheses (checked).
Cells: median seconds of --rounds interleaved rounds after a warm-up, and beam tokens/s (beams x
new tokens / s). --write replaces the section in docs/BENCHMARKS.md.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import bench_context  # noqa: E402
import bench_decode  # noqa: E402
import benchdoc  # noqa: E402

from diffexport.backends import genai, step_loop  # noqa: E402
from diffexport.core.eager_generation import BeamSearch, beam_search  # noqa: E402
from diffexport.modeling.checkpoint import load_model  # noqa: E402

PRESET = "diff-v1-110m"


def unreachable_end(folder: Path, end: int) -> None:
    """Point the folder's end id at `end` (one no search picks), so every search runs to the limit."""
    path = folder / "genai_config.json"
    config = json.loads(path.read_text())
    config["model"]["eos_token_id"] = end
    path.write_text(json.dumps(config))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--prompt", type=int, default=128)
    parser.add_argument("--new", type=int, default=64)
    parser.add_argument("--beams", default="1,4,8", help="comma-separated beam counts")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--write", action="store_true")
    args = parser.parse_args()
    beams = [int(b) for b in args.beams.split(",")]
    if args.prompt < 1 or args.new < 1 or min(beams) < 1 or args.prompt + args.new > 2048:
        parser.error("--prompt, --new and every beam count >= 1; prompt and new tokens within the 2048-token context")
    cores = os.cpu_count() or 1
    torch.set_num_threads(cores)
    prompt = np.random.default_rng(0).integers(3, bench_decode.VOCAB, size=args.prompt).tolist()
    loaded = load_model(None, preset=PRESET, seed=0)
    model = loaded.model.eval()
    searches = {n: BeamSearch(n) for n in beams}
    with tempfile.TemporaryDirectory() as tmp:
        folders = bench_context.genai_folders(loaded, Path(tmp), "fp32", False, cores)
        # an end id no search picks: the smallest id outside every step's 2 x beams candidates is hard to
        # know in advance, so take the eager searches' tokens and choose an id none of them holds
        seen = {t for n in beams for h in beam_search(model, prompt, BeamSearch(n, n), args.new) for t in h.tokens}
        end = next(i for i in range(bench_decode.VOCAB - 1, 0, -1) if i not in seen)
        plain = {"DiffAttention folder": Path(tmp) / "diffattention", "--attention gqa folder": Path(tmp) / "gqa"}
        for label, folder in folders.items():  # genai's (threads set, model linked) and the loop's own
            unreachable_end(folder, end)
            unreachable_end(plain[label], end)
        runtimes = {}
        for label, folder in folders.items():
            genai_model = genai.open_genai_model(folder)
            runner = step_loop.OrtDecoder(plain[label], threads=cores)
            runtimes[f"onnxruntime-genai, {label}"] = \
                lambda s, f=folder, m=genai_model: genai.beam_search_genai(f, prompt, args.new, s, model=m).sequences
            runtimes[f"onnxruntime loop, {label}"] = \
                lambda s, f=folder, r=runner: step_loop.beam_search_stepped(f, prompt, args.new, s, r).sequences
        runtimes["eager PyTorch"] = lambda s: [h.tokens for h in beam_search(model, prompt, s, args.new, end)]
        expected = {n: [h.tokens for h in beam_search(model, prompt, s, args.new, end)] for n, s in searches.items()}
        for label, run in runtimes.items():  # warm-up, and every runtime's hypotheses checked
            for n, search in searches.items():
                assert run(search) == expected[n], f"{label}, {n} beams: not the eager hypotheses"
        times: dict[tuple[str, int], list[float]] = {(label, n): [] for label in runtimes for n in beams}
        for round_ in range(args.rounds):
            order = list(runtimes) if round_ % 2 == 0 else list(runtimes)[::-1]
            for label in order:
                for n, search in searches.items():
                    start = time.perf_counter()
                    runtimes[label](search)
                    times[(label, n)].append(time.perf_counter() - start)
            print(f"round {round_ + 1}/{args.rounds} done", flush=True)
    median = {key: statistics.median(values) for key, values in times.items()}
    head = "| runtime | " + " | ".join(f"{n} beam{'s' if n > 1 else ''}: s (beam tokens/s)" for n in beams)
    more = [n for n in beams if n > 1]
    head += "".join(f" | {n} beams / 1 beam time" for n in more) if 1 in beams else ""
    table = [head + " |", "|---|" + "---:|" * (len(beams) + (len(more) if 1 in beams else 0))]
    for label in runtimes:
        cells = [f"{median[(label, n)]:.2f} ({n * args.new / median[(label, n)]:.0f})" for n in beams]
        if 1 in beams:
            cells += [f"{median[(label, n)] / median[(label, 1)]:.2f}x" for n in more]
        table.append(f"| {label} | " + " | ".join(cells) + " |")
    body = "\n".join([
        "## Beam search on CPU (fp32, batch 1)", "",
        f"`python tools/bench_beams.py --prompt {args.prompt} --new {args.new} --beams {args.beams} "
        f"--rounds {args.rounds} --write`", "", benchdoc.stamp(), "",
        f"{PRESET} fp32 (seeded random weights), a {args.prompt}-token prompt, {args.new} new tokens per search "
        f"(the end id moved to one no search picks, so every search runs every step), onnxruntime with "
        f"intra_op_num_threads = {cores}, torch with {cores} threads; medians of {args.rounds} interleaved rounds "
        "after a warm-up. Every runtime returned the eager reference's hypotheses for every beam count. Beam "
        "tokens/s: beams x new tokens / s, the prompt included in the time.", "", *table])
    print(body)
    if args.write:
        print(f"wrote {benchdoc.write_section('beam-search', body)}")


if __name__ == "__main__":
    main()
