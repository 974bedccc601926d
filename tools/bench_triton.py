"""Serving with Triton Inference Server: concurrent streaming clients against `diffexport triton`
repositories of one folder, one per scheduler (in-flight batching, and the per-batch scheduler).

    python tools/bench_triton.py [--schedulers inflight batch] [--clients 1 8 16] [--requests 2]
                                 [--prompt 64 512] [--new 16 256] [--max-batch 8]
                                 [--attention gqa|diffattention] [--client threads|aiperf]
                                 [--aiperf EXE] [--write]

Model: diff-v1-110m (seeded random weights), exported with --kv-cache (--attention as given),
intra_op_num_threads = the machine's cores. For each scheduler a repository is written and served
by the real tritonserver (the `serve` extra) on 127.0.0.1; after a warm-up request, C clients (each
C of --clients) send --requests greedy /generate_stream requests each, one after another: prompts of
a length drawn in --prompt's range (input_ids) for a number of new tokens drawn in --new's range, the
same draws for every scheduler (rows may stop earlier at an end id: every received id counts).
Reported per run: requests/s and output tokens/s over the wall time, time to first token (request
sent -> first streamed id) and inter-token latency (the gaps between a request's later ids), p50
and p99. --write replaces the section in docs/BENCHMARKS.md.

--client aiperf: the clients are NVIDIA's LLM benchmark client instead (aiperf, its `template`
endpoint posting Triton's generate_stream payload; install it in its own environment, it pins what
the serve extra does not: `python -m venv ~/aiperf && ~/aiperf/bin/pip install aiperf`, then
--aiperf ~/aiperf/bin/aiperf). aiperf sends text and counts tokens with a tokenizer, so the folder
gets a byte-level BPE of the model's vocabulary trained here on the Python standard library's
sources; aiperf draws the prompts (--random-seed 0, uniform over --prompt's and --new's ranges, the
same for both schedulers), and its own definitions apply: TTFT per request, and inter-token latency
per request ((latency - TTFT) / (tokens - 1)) before the percentiles. Its section is separate.
"""

from __future__ import annotations

import argparse
import http.client
import json
import os
import resource
import shutil
import socket
import subprocess
import sys
import sysconfig
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
from diffexport.serving.repository import SCHEDULERS, write_repository  # noqa: E402
from diffexport.serving.server import start_server  # noqa: E402

PRESET = "diff-v1-110m"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def ask(port: int, ids: list[int], new: int) -> tuple[int, float, float | None, list[float]]:
    """One greedy /generate_stream request -> (new ids received, seconds, time to first id, gaps between
    the later ids)."""
    start = time.perf_counter()
    connection = http.client.HTTPConnection("127.0.0.1", port, timeout=600)
    arrivals, count = [], 0
    try:
        connection.request("POST", "/v2/models/diff/generate_stream",
                           json.dumps({"input_ids": ids, "max_tokens": new, "temperature": 0, "stream": True}))
        reply = connection.getresponse()
        if reply.status != 200:
            raise SystemExit(f"error: the server answered {reply.status}: {reply.read()[:300]!r}")
        for line in reply:
            if not line.startswith(b"data: "):
                continue
            event = json.loads(line[len(b"data: "):])
            if "error" in event:
                raise SystemExit(f"error: the server answered: {event['error']}")
            ids = event.get("output_ids", [])
            got = len(ids) if isinstance(ids, list) else 1  # one id comes as a number
            if got:
                arrivals.append(time.perf_counter())
                count += got
    finally:
        connection.close()
    end = time.perf_counter()
    first = arrivals[0] - start if arrivals else None
    return count, end - start, first, list(np.diff(arrivals))


def percentile(values: list[float], q: float) -> float:
    return float(np.percentile(values, q)) if values else float("nan")


def run_clients(port: int, jobs: list[tuple[list[int], int]], clients: int) -> dict:
    """The jobs through `clients` concurrent clients -> the run's numbers."""
    start = time.perf_counter()
    with ThreadPoolExecutor(clients) as pool:
        results = list(pool.map(lambda job: ask(port, *job), jobs))
    wall = time.perf_counter() - start
    firsts = [first for _, _, first, _ in results if first is not None]
    gaps = [gap for *_, later in results for gap in later]
    return {"requests": len(jobs), "tokens": sum(n for n, *_ in results), "wall": wall,
            "ttft50": percentile(firsts, 50), "ttft99": percentile(firsts, 99),
            "itl50": percentile(gaps, 50), "itl99": percentile(gaps, 99)}


# Triton's generate_stream payload from aiperf's template endpoint (Jinja; tojson keeps the prompt a JSON string)
AIPERF_PAYLOAD = '{"text_input": {{ text|tojson }}, "max_tokens": {{ max_tokens }}, "stream": true, "temperature": 0}'


def train_tokenizer(folder: Path, vocab_size: int) -> Path:
    """A byte-level BPE of `vocab_size` ids (every id decodes), trained on the Python standard
    library's sources (no download), saved as a Hugging Face tokenizer folder."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=["<unk>", "<s>", "</s>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    sources = sorted(Path(sysconfig.get_paths()["stdlib"]).glob("*.py"))
    tokenizer.train_from_iterator((path.read_text(errors="replace") for path in sources), trainer)
    if tokenizer.get_vocab_size() != vocab_size:
        raise SystemExit(f"error: the tokenizer trained to {tokenizer.get_vocab_size()} ids, not {vocab_size}")
    PreTrainedTokenizerFast(tokenizer_object=tokenizer, bos_token="<s>", eos_token="</s>",
                            unk_token="<unk>").save_pretrained(folder)
    return folder


def run_aiperf(exe: str, port: int, tokenizer: Path, clients: int, count: int, prompt: list[int], new: list[int],
               out: Path) -> dict:
    """`count` requests through aiperf at concurrency `clients` -> the run's numbers (aiperf's JSON export),
    and the CPU seconds aiperf itself used (it shares this machine with the server)."""
    template = out.parent / "aiperf-payload.jinja"
    template.write_text(AIPERF_PAYLOAD)
    mean_in, mean_new = (prompt[0] + prompt[1]) / 2, (new[0] + new[1]) / 2
    # aiperf draws uniformly over [mean * (1 - r), mean * (1 + r)]: r from the ranges
    ratios = {"input": (prompt[1] - prompt[0]) / (prompt[1] + prompt[0]),
              "output": (new[1] - new[0]) / (new[1] + new[0])}
    command = [exe, "profile", "--model", "diff", "--url", f"http://127.0.0.1:{port}", "--endpoint-type", "template",
               "--custom-endpoint", "/v2/models/diff/generate_stream", "--streaming",
               "--extra-inputs", f"payload_template:{template}", "--extra-inputs", "response_field:text_output",
               "--tokenizer", str(tokenizer), "--isl", str(round(mean_in)), "--osl", str(round(mean_new)),
               "--random-range-ratio", json.dumps(ratios), "--concurrency", str(clients),
               "--request-count", str(count), "--random-seed", "0", "--request-timeout-seconds", "1800",
               "--ui", "none", "--no-server-metrics", "--no-gpu-telemetry", "--output-artifact-dir", str(out)]
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    done = subprocess.run(command, capture_output=True, text=True)
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    if done.returncode != 0:
        raise SystemExit(f"error: aiperf failed ({done.returncode}): {(done.stderr or done.stdout)[-600:]}")
    report = json.loads((out / "profile_export_aiperf.json").read_text())
    if report.get("error_summary"):
        raise SystemExit(f"error: aiperf counted failed requests: {report['error_summary']}")

    def metric(name: str, stat: str = "avg") -> float:
        return float(report[name][stat])

    return {"requests": int(metric("request_count")), "tokens": int(metric("total_output_tokens")),
            "wall": metric("benchmark_duration"),
            "ttft50": metric("time_to_first_token", "p50") / 1e3, "ttft99": metric("time_to_first_token", "p99") / 1e3,
            "itl50": metric("inter_token_latency", "p50") / 1e3, "itl99": metric("inter_token_latency", "p99") / 1e3,
            "client_cpu": (after.ru_utime + after.ru_stime) - (before.ru_utime + before.ru_stime)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--schedulers", nargs="+", default=list(SCHEDULERS), choices=list(SCHEDULERS))
    parser.add_argument("--clients", type=int, nargs="+", default=[1, 8, 16])
    parser.add_argument("--requests", type=int, default=2, help="requests per client, one after another")
    parser.add_argument("--prompt", type=int, nargs=2, default=[64, 512], metavar=("MIN", "MAX"))
    parser.add_argument("--new", type=int, nargs=2, default=[16, 256], metavar=("MIN", "MAX"))
    parser.add_argument("--max-batch", type=int, default=8)
    parser.add_argument("--attention", default="gqa", choices=["gqa", "diffattention"])
    parser.add_argument("--client", default="threads", choices=["threads", "aiperf"],
                        help="who sends the requests: this tool's threads (input_ids) or NVIDIA's aiperf (text)")
    parser.add_argument("--aiperf", default="aiperf", help="--client aiperf: its executable")
    parser.add_argument("--write", action="store_true")
    args = parser.parse_args()
    if not 1 <= args.max_batch <= 32 or min(args.clients) < 1 or args.requests < 1 or min(args.prompt) < 1 \
            or min(args.new) < 1 or args.prompt[0] > args.prompt[1] or args.new[0] > args.new[1] \
            or args.prompt[1] + args.new[1] > 2048:
        parser.error("--max-batch 1..32, --clients/--requests >= 1, MIN <= MAX, prompt + new within the 2048-token "
                     "context")
    aiperf = shutil.which(args.aiperf) if args.client == "aiperf" else None
    if args.client == "aiperf" and aiperf is None:
        parser.error(f"{args.aiperf} not found: install aiperf in its own environment (python -m venv ~/aiperf && "
                     "~/aiperf/bin/pip install aiperf) and give --aiperf ~/aiperf/bin/aiperf")
    cores = os.cpu_count() or 1
    rng = np.random.default_rng(0)
    draws = {clients: [(rng.integers(3, bench_decode.VOCAB, size=int(rng.integers(args.prompt[0], args.prompt[1] + 1)))
                        .tolist(), int(rng.integers(args.new[0], args.new[1] + 1)))
                       for _ in range(clients * args.requests)] for clients in args.clients}
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        print(f"exporting {PRESET} ({args.attention}) in {root}", flush=True)
        loaded = load_model(None, preset=PRESET, seed=0)
        tokenizer = train_tokenizer(root / "tokenizer", loaded.config.vocab_size) if aiperf else None
        folder = export_decoder(loaded, root / "kv", threads=cores, attention=args.attention, tokenizer=tokenizer,
                                log=lambda _: None).folder
        for scheduler in args.schedulers:
            repo = write_repository(folder, root / f"repo-{scheduler}", name="diff", max_batch=args.max_batch,
                                    scheduler=scheduler)
            with start_server(repo.path, free_port(), free_port()) as server:
                ask(server.http_port, draws[args.clients[0]][0][0], 4)  # warm-up: the model's first run
                for clients in args.clients:
                    run = run_aiperf(aiperf, server.http_port, tokenizer, clients, clients * args.requests,
                                     args.prompt, args.new, root / f"aiperf-{scheduler}-{clients}") if aiperf \
                        else run_clients(server.http_port, draws[clients], clients)
                    rows.append((scheduler, clients, run))
                    print(f"{scheduler:8s} {clients:2d} clients: {run['requests'] / run['wall']:.2f} req/s, "
                          f"{run['tokens'] / run['wall']:.1f} tok/s; TTFT p50 {run['ttft50']:.2f} s p99 "
                          f"{run['ttft99']:.2f} s; ITL p50 {run['itl50'] * 1e3:.0f} ms p99 {run['itl99'] * 1e3:.0f} ms",
                          flush=True)
    extra = " aiperf CPU s |" if aiperf else ""
    table = ["| scheduler | clients | requests | output tokens | wall s | requests/s | output tokens/s | "
             f"TTFT p50 s | TTFT p99 s | ITL p50 ms | ITL p99 ms |{extra}",
             "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|" + ("---:|" if aiperf else "")]
    for scheduler, clients, run in rows:
        table.append(f"| {scheduler} | {clients} | {run['requests']} | {run['tokens']} | {run['wall']:.1f} | "
                     f"{run['requests'] / run['wall']:.2f} | {run['tokens'] / run['wall']:.1f} | {run['ttft50']:.2f} | "
                     f"{run['ttft99']:.2f} | {run['itl50'] * 1e3:.0f} | {run['itl99'] * 1e3:.0f} |"
                     + (f" {run['client_cpu']:.0f} |" if aiperf else ""))
    ratios = []
    by = {(scheduler, clients): run for scheduler, clients, run in rows}
    for clients in args.clients:
        if ("inflight", clients) in by and ("batch", clients) in by:
            new, old = by[("inflight", clients)], by[("batch", clients)]
            ratios.append(f"| {clients} | {(new['tokens'] / new['wall']) / (old['tokens'] / old['wall']):.2f}x | "
                          f"{new['ttft99'] / old['ttft99']:.2f}x |")
    if ratios:
        ratios = ["", "| clients | output tokens/s, inflight / batch (target >= 1.3x at 8, 16) | "
                  "TTFT p99, inflight / batch (target <= 0.5x at 8, 16) |", "|---:|---:|---:|", *ratios]
    client = f" --client aiperf --aiperf {args.aiperf}" if aiperf else ""
    if aiperf:
        title, key = "## Serving with Triton on CPU, measured by aiperf (NVIDIA's LLM benchmark client)", \
            "serve-triton-aiperf"
        how = (f"C concurrent aiperf clients (aiperf {aiperf_version(aiperf)}, `--endpoint-type template` posting "
               f"Triton's generate_stream payload `{AIPERF_PAYLOAD}`) send {args.requests} x C greedy text requests, "
               f"prompts of {args.prompt[0]}-{args.prompt[1]} tokens for {args.new[0]}-{args.new[1]} new tokens drawn "
               "by aiperf (--random-seed 0, the same for both schedulers), tokens counted by the folder's tokenizer "
               "(a byte-level BPE of the model's 32,000 ids trained on the Python standard library). aiperf's "
               "definitions: wall is its benchmark duration, TTFT per request, ITL per request ((latency - TTFT) / "
               "(tokens - 1)) before the percentiles. aiperf runs on the same 2 cores as the server: its own CPU "
               "time (start-up included) is the last column.")
    else:
        title, key = "## Serving with Triton on CPU (concurrent streaming clients, greedy)", "serve-triton"
        how = (f"C clients each send {args.requests} greedy /generate_stream requests one after another, prompts of "
               f"{args.prompt[0]}-{args.prompt[1]} tokens for {args.new[0]}-{args.new[1]} new tokens (drawn once, "
               "the same for both schedulers). Wall time from the first request sent to the last id received; "
               "TTFT: request sent -> its first id; ITL: the gaps between its later ids.")
    body = "\n".join([
        title, "",
        f"`python tools/bench_triton.py --schedulers {' '.join(args.schedulers)} --clients "
        f"{' '.join(map(str, args.clients))} --requests {args.requests} --prompt {args.prompt[0]} {args.prompt[1]} "
        f"--new {args.new[0]} {args.new[1]} --max-batch {args.max_batch} --attention {args.attention}{client} --write`",
        "", benchdoc.stamp(), "",
        f"{PRESET}, fp32, `--attention {args.attention}` folder, intra_op_num_threads = {cores}, served by "
        f"tritonserver (nvidia-pytriton's) through `diffexport triton --max-batch {args.max_batch} --scheduler S`; "
        + how, "", *table, *ratios])
    print(body)
    if args.write:
        print(f"wrote {benchdoc.write_section(key, body)}")


def aiperf_version(exe: str) -> str:
    """The installed aiperf's version, asked of the Python beside its executable."""
    python = Path(exe).resolve().parent / "python"
    done = subprocess.run([str(python), "-c", "import importlib.metadata as m; print(m.version('aiperf'))"],
                          capture_output=True, text=True)
    return done.stdout.strip() or "unknown"


if __name__ == "__main__":
    main()
