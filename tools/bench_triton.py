"""Serving throughput with Triton Inference Server: concurrent clients against `diffexport triton`
repositories of one folder that batch up to B waiting requests, B = 1 (requests in turn) and more.

    python tools/bench_triton.py [--max-batch 1 8] [--clients 8] [--requests 2] [--prompt 128]
                                 [--new 64] [--attention gqa|diffattention] [--write]

Model: diff-v1-110m (seeded random weights), exported with --kv-cache (--attention as given; gqa is
the faster folder for batches, docs/BENCHMARKS.md "Batched decode on CPU"), intra_op_num_threads =
the machine's cores. For each B a repository is written and served by the real tritonserver (the
`serve` extra) on 127.0.0.1; after a warm-up request, `--clients` threads each send `--requests`
greedy /generate requests of a different `--prompt`-token prompt (input_ids) for `--new` tokens
(rows may stop earlier at an end id: every received id is counted). Reported: new tokens/s over the
whole wall time (prompts included, as a server's user sees it), and the median and slowest request
latency. --write replaces the section in docs/BENCHMARKS.md.
"""

from __future__ import annotations

import argparse
import http.client
import json
import os
import socket
import statistics
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
import bench_decode  # noqa: E402
import benchdoc  # noqa: E402

from diffexport.modeling.checkpoint import load_model  # noqa: E402
from diffexport.passes.decoder_formats import export_decoder  # noqa: E402
from diffexport.serving.repository import write_repository  # noqa: E402
from diffexport.serving.server import start_server  # noqa: E402

PRESET = "diff-v1-110m"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def ask(port: int, ids: list[int], new: int) -> tuple[int, float]:
    """One greedy /generate request -> (new ids received, seconds)."""
    start = time.perf_counter()
    connection = http.client.HTTPConnection("127.0.0.1", port, timeout=600)
    try:
        connection.request("POST", "/v2/models/diff/generate",
                           json.dumps({"input_ids": ids, "max_tokens": new, "temperature": 0}))
        reply = connection.getresponse()
        body = json.loads(reply.read())
    finally:
        connection.close()
    if reply.status != 200:
        raise SystemExit(f"error: the server answered {reply.status}: {body}")
    return len(body["output_ids"]), time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--max-batch", type=int, nargs="+", default=[1, 8])
    parser.add_argument("--clients", type=int, default=8)
    parser.add_argument("--requests", type=int, default=2, help="requests per client")
    parser.add_argument("--prompt", type=int, default=128)
    parser.add_argument("--new", type=int, default=64)
    parser.add_argument("--attention", default="gqa", choices=["gqa", "diffattention"])
    parser.add_argument("--write", action="store_true")
    args = parser.parse_args()
    if min(args.max_batch) < 1 or max(args.max_batch) > 32 or args.clients < 1 or args.requests < 1 \
            or args.prompt < 1 or args.new < 1 or args.prompt + args.new > 2048:
        parser.error("--max-batch 1..32, --clients/--requests >= 1, prompt + new within the 2048-token context")
    cores = os.cpu_count() or 1
    rng = np.random.default_rng(0)
    jobs = rng.integers(3, bench_decode.VOCAB, size=(args.clients * args.requests, args.prompt)).tolist()
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        print(f"exporting {PRESET} ({args.attention}) in {root}", flush=True)
        folder = export_decoder(load_model(None, preset=PRESET, seed=0), root / "kv", threads=cores,
                                attention=args.attention, log=lambda _: None).folder
        for batch in args.max_batch:
            repo = write_repository(folder, root / f"repo-{batch}", name="diff", max_batch=batch)
            with start_server(repo.path, free_port(), free_port()) as server:
                ask(server.http_port, jobs[0], 4)  # warm-up: the model's first run
                start = time.perf_counter()
                with ThreadPoolExecutor(args.clients) as pool:
                    results = list(pool.map(lambda ids: ask(server.http_port, ids, args.new), jobs))
                wall = time.perf_counter() - start
            tokens = sum(n for n, _ in results)
            latencies = sorted(s for _, s in results)
            rows.append((batch, tokens, wall, statistics.median(latencies), latencies[-1]))
            print(f"max batch {batch:2d}: {tokens} new tokens in {wall:.1f} s = {tokens / wall:.1f} tok/s; "
                  f"latency median {rows[-1][3]:.1f} s, slowest {rows[-1][4]:.1f} s", flush=True)
    first = rows[0][1] / rows[0][2]
    table = ["| max batch | new tokens | wall s | new tokens/s | vs max batch " + str(rows[0][0]) +
             " | latency median s | slowest s |", "|---:|---:|---:|---:|---:|---:|---:|"]
    for batch, tokens, wall, median, slowest in rows:
        table.append(f"| {batch} | {tokens} | {wall:.1f} | {tokens / wall:.1f} | {tokens / wall / first:.2f}x | "
                     f"{median:.1f} | {slowest:.1f} |")
    body = "\n".join([
        "## Serving with Triton on CPU (concurrent clients, greedy)", "",
        f"`python tools/bench_triton.py --max-batch {' '.join(map(str, args.max_batch))} --clients {args.clients} "
        f"--requests {args.requests} --prompt {args.prompt} --new {args.new} --attention {args.attention} --write`",
        "", benchdoc.stamp(), "",
        f"{PRESET}, fp32, `--attention {args.attention}` folder, intra_op_num_threads = {cores}, served by "
        f"tritonserver (nvidia-pytriton's) through `diffexport triton --max-batch B`; {args.clients} clients "
        f"each send {args.requests} greedy /generate requests of a different {args.prompt}-token prompt for "
        f"{args.new} new tokens at most, all at once. New tokens/s over the whole wall time (prompts "
        "included); latency per request, queueing included.", "", *table])
    print(body)
    if args.write:
        print(f"wrote {benchdoc.write_section('serve-triton', body)}")


if __name__ == "__main__":
    main()
