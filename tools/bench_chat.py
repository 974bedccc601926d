"""A chat's turns on CPU through onnxruntime-genai: a session that keeps its KV cache between turns
(genai.GenaiSession, what `diffexport generate --interactive` runs) against reading the whole
conversation again each turn (a new generator per turn, what the onnxruntime loop does).

    python tools/bench_chat.py [--turns 8] [--user 64] [--new 32] [--rounds 3] [--write]

Model: diff-v1-110m with seeded random weights, exported with --attention gqa (fp32), genai with
intra_op_num_threads = the machine's cores. The conversation is token ids: a first user turn of
--user tokens, then per turn the model's greedy answer (--new tokens; a row that ends early ends
it) and another user turn of --user random tokens. Both ways answer the same ids with the same
model object and must give the same tokens (checked). Per turn: seconds to the answer's first
token (what the turn reads) and in all; medians of --rounds interleaved conversations after a
warm-up. --write replaces the section in docs/BENCHMARKS.md.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
import bench_context  # noqa: E402
import bench_decode  # noqa: E402
import benchdoc  # noqa: E402

from diffexport.backends import genai  # noqa: E402
from diffexport.core.eager_generation import Sampling  # noqa: E402
from diffexport.modeling.checkpoint import load_model  # noqa: E402

PRESET = "diff-v1-110m"
WAYS = ("session (cache kept)", "new generator per turn")


def conversation(session, folder, model, user_turns: list[list[int]], new: int) -> dict:
    """One chat both ways, turn by turn -> {way: [(first-token seconds, seconds)]}, tokens checked equal."""
    times: dict[str, list] = {way: [] for way in WAYS}
    ids: list[int] = []
    for number, user in enumerate(user_turns):
        ids = ids + user
        ways = WAYS if number % 2 == 0 else WAYS[::-1]  # alternate which goes first
        answers = {}
        for way in ways:
            run = session.turn(ids, new) if way == WAYS[0] else \
                genai.generate_genai(folder, ids, new, Sampling(), model=model)
            answers[way] = run.tokens
            times[way].append((run.prefill_seconds, run.prefill_seconds + run.decode_seconds))
        assert answers[WAYS[0]] == answers[WAYS[1]], f"turn {number + 1}: the two ways answered differently"
        ids = ids + answers[WAYS[0]]
    return times


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--turns", type=int, default=8)
    parser.add_argument("--user", type=int, default=64)
    parser.add_argument("--new", type=int, default=32)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--write", action="store_true")
    args = parser.parse_args()
    if args.turns < 2 or args.user < 1 or args.new < 1 or args.turns * (args.user + args.new) > 2048:
        parser.error("--turns >= 2, --user and --new >= 1, the whole chat within the 2048-token context")
    cores = os.cpu_count() or 1
    rng = np.random.default_rng(0)
    user_turns = [rng.integers(3, bench_decode.VOCAB, size=args.user).tolist() for _ in range(args.turns)]
    loaded = load_model(None, preset=PRESET, seed=0)
    results: dict[str, list[list]] = {way: [] for way in WAYS}
    with tempfile.TemporaryDirectory() as tmp:
        folder = bench_context.genai_folders(loaded, Path(tmp), "fp32", False, cores)["--attention gqa folder"]
        model = genai.open_genai_model(folder)
        conversation(genai.GenaiSession(folder, Sampling(), model=model), folder, model, user_turns[:2], 4)
        for round_ in range(args.rounds):
            times = conversation(genai.GenaiSession(folder, Sampling(), model=model), folder, model,
                                 user_turns, args.new)
            for way in WAYS:
                results[way].append(times[way])
            total = {way: sum(t for _, t in times[way]) for way in WAYS}
            print(f"round {round_ + 1}/{args.rounds}: " + ", ".join(f"{w} {total[w]:.2f} s" for w in WAYS), flush=True)
    median = {way: [(statistics.median(r[k][0] for r in results[way]), statistics.median(r[k][1] for r in results[way]))
                    for k in range(args.turns)] for way in WAYS}
    table = ["| turn | conversation tokens | " + " | ".join(f"{w}: first token s (all s)" for w in WAYS) +
             " | first-token speed-up |", "|---:|---:|---:|---:|---:|"]
    length = 0
    for k in range(args.turns):
        length += args.user
        kept, fresh = median[WAYS[0]][k], median[WAYS[1]][k]
        table.append(f"| {k + 1} | {length} | {kept[0]:.3f} ({kept[1]:.2f}) | {fresh[0]:.3f} ({fresh[1]:.2f}) | "
                     f"{fresh[0] / kept[0]:.2f}x |")
        length += args.new
    totals = {way: sum(t for _, t in median[way]) for way in WAYS}
    body = "\n".join([
        "## A chat's turns on CPU (onnxruntime-genai, greedy)", "",
        f"`python tools/bench_chat.py --turns {args.turns} --user {args.user} --new {args.new} --rounds {args.rounds} "
        "--write`", "", benchdoc.stamp(), "",
        f"{PRESET} fp32, --attention gqa folder, onnxruntime-genai with intra_op_num_threads = {cores}: a chat of "
        f"{args.turns} user turns of {args.user} tokens, each answered with {args.new} greedy tokens; medians of "
        f"{args.rounds} interleaved conversations. Both ways gave the same tokens at every turn. Conversation tokens: "
        "what the turn's prompt holds.", "", *table, "",
        f"Whole chat: {totals[WAYS[0]]:.2f} s with the cache kept, {totals[WAYS[1]]:.2f} s reading the conversation "
        f"again each turn ({totals[WAYS[1]] / totals[WAYS[0]]:.2f}x)."])
    print(body)
    if args.write:
        print(f"wrote {benchdoc.write_section('chat-turns', body)}")


if __name__ == "__main__":
    main()
