"""`diffexport triton` (serving.repository.write_repository, serving.server.start_server): its
options and printing.
"""

from __future__ import annotations

import argparse
import signal

from diffexport.cli.common import Command, add_force
from diffexport.core.errors import DiffExportError
from diffexport.core.lazy import lazy_import
from diffexport.core.stoppable import interrupt

repository = lazy_import("diffexport.serving.repository")
triton_server = lazy_import("diffexport.serving.server")


def cmd_triton(args) -> int:
    """Write a Triton Inference Server model repository for a --kv-cache folder (streamed, batched); --serve starts the
    server."""
    if args.serve:  # before the repository is written
        triton_server.check_ports(args.http_port, args.grpc_port, args.metrics_port)
        triton_server.check_ports_free(args.http_port, args.grpc_port, args.metrics_port)
    elif args.metrics_port is not None:
        raise DiffExportError("--metrics-port is for --serve (a copied repository's server takes Triton's own "
                              "--metrics-port)")
    repo = repository.write_repository(args.folder, args.output, args.name, args.max_batch, args.instances, args.force,
                                       scheduler=args.scheduler)
    prompt = "text_input (or input_ids)" if repo.text else "input_ids"
    print(f"wrote         {repo.path}/{repo.name}/ (config.pbtxt, 1/model.py, 1/decoder/): "
          f"{'a GPU' if repo.gpu else 'CPU'} instance x {args.instances}, up to {args.max_batch} rows decoded together "
          f"({args.scheduler} scheduler)")
    print(f"requests      {prompt}, max_tokens, temperature (0: greedy), top_k, top_p, seed, stream -> "
          "text_output, output_ids")
    if not args.serve:
        print(f"serve it      diffexport triton {args.folder} -o {args.output} --force --serve, or copy {repo.path} "
              "into a Triton container (docs/DEPLOYMENT.md)")
        return 0

    signal.signal(signal.SIGHUP, interrupt)  # the terminal closed: stop the server as Ctrl-C does
    print("starting      tritonserver (127.0.0.1 only)", flush=True)
    server = triton_server.start_server(repo.path, args.http_port, args.grpc_port, metrics_port=args.metrics_port)
    print(f"log           {server.log}")
    if server.metrics_url:
        print(f"metrics       {server.metrics_url} (Prometheus: Triton's nv_* and the model's diffexport_*)")
    print(f"ready         {server.url}/v2/models/{repo.name}/generate (and generate_stream); gRPC on "
          f"127.0.0.1:{args.grpc_port}. Ctrl-C stops it.", flush=True)
    try:
        server.process.wait()
    except KeyboardInterrupt:
        pass
    crashed = server.ended_on_its_own()
    status = server.stop()
    if crashed:
        raise DiffExportError(crashed)
    if status not in (0, -signal.SIGKILL):  # SIGKILL: ours, after STOP_SECONDS
        raise DiffExportError(f"tritonserver failed while stopping (exit {status}) (log: {server.log})")
    print(f"stopped       tritonserver{' (killed: it did not end in time)' if status else ''}")
    return 0


def _triton_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("folder", help="a folder `diffexport onnx --kv-cache -o` (or quantize) wrote")
    p.add_argument("-o", "--output", required=True, help="the model repository folder to write")
    p.add_argument("--name", help="the model's name in the repository and its URLs (default: the folder's name)")
    p.add_argument("--max-batch", type=int, default=8,
                   help="requests decoded together (1-32, default 8); more wait for a free row")
    p.add_argument("--scheduler", default="inflight",
                   help="inflight (default): a request joins the running batch at the next decode step and leaves it "
                        "when it ends; batch: waiting requests with the same draw run as one onnxruntime-genai batch, "
                        "and requests that arrive meanwhile wait for the next")
    p.add_argument("--instances", type=int, default=1, help="model instances, each with its own copy (default 1)")
    add_force(p)
    p.add_argument("--serve", action="store_true",
                   help="then start tritonserver on it (the one on PATH, else nvidia-pytriton's) until Ctrl-C")
    p.add_argument("--http-port", type=int, default=8000, help="--serve: HTTP port on 127.0.0.1 (default 8000)")
    p.add_argument("--grpc-port", type=int, default=8001, help="--serve: gRPC port on 127.0.0.1 (default 8001)")
    p.add_argument("--metrics-port", type=int,
                   help="--serve: Triton's Prometheus metrics on this port of 127.0.0.1, the model's own added "
                        "(time to first token, inter-token latency, tokens, waiting requests, batch rows); default: "
                        "no metrics endpoint")


COMMANDS = [Command("triton", cmd_triton, _triton_arguments)]
