"""Decode attention of a DIFF layer on the CPU through stock onnxruntime ops: which arrangement of
GroupQueryAttention reads the cache at a Llama's cost (issue 58, before the gqa pass changes).

    python tools/bench_gqa_routes.py [--lengths 128,1024,1920] [--spare 64,2048] [--rounds 40]
                                     [--threads 2] [--write]

Shape: the issue's ~100M DiffLlama, 12 layers, 6 DIFF heads = 12 maps of 64 over 4 kv heads of 64,
value heads 128 wide; batch 1, one new token after L cached, the cache in a buffer of T rows per layer
(onnxruntime-genai's shared past/present buffer: T = L + new tokens when the caller sets max_length,
the context, 2,048, when it does not), written in place (IOBinding binds each present to its past).
Routes, each as one graph of 12 layers:
  llama    GQA with 12 heads of 64 over 4 kv heads of 64: a Llama's attention, the anchor (its output
           is half of what a DIFF layer needs)
  shipped  what the gqa folders hold today: 12 maps as 128-wide heads with a zero half ([q1, 0] and
           [0, q2]) over 2 kv heads of [K1 | K2] keys and 128-wide values: twice the Llama's work
  pad      GQA as the Llama's (each map weighs its own 64-wide value half) returning its
           probabilities (qk_output), and the other value half as one MatMul of those probabilities
           (kv heads swapped, zero-padded to T) with the value buffer, read whole in place
  slice    the same, the value buffer's first L rows copied by a Slice instead of padding
  if       pad when T < 3 L, slice otherwise (an If per layer): bounded waste for any T
Each route's output is compared with numpy (softmax(q k^T / 8) v over the L + 1 cached rows, both
value halves for pad/slice/if) before timing; a route that differs is an error, not a row.
Sessions do not spin (allow_spinning 0: idle sessions would take the cores of the timed one); the
routes run interleaved, `--rounds` runs each, medians of the runs after the first five.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
from onnx import TensorProto, helper

sys.path.insert(0, str(Path(__file__).resolve().parent))
import benchdoc  # noqa: E402

LAYERS, MAPS, KV, D = 12, 12, 4, 64
ROUTES = ("llama", "shipped", "pad", "slice", "if")


def _shape(route: str) -> tuple[int, int, int]:
    """(query heads, kv heads, head size) of the route's GroupQueryAttention."""
    return (MAPS, KV // 2, 2 * D) if route == "shipped" else (MAPS, KV, D)


def _other_half(i: int, route: str) -> list:
    """Nodes: layer i's probabilities p{i} [1, 12, 1, L+1] -> the other value half x{i} [1, 4, 3, 64]."""
    nodes = [helper.make_node("Reshape", [f"p{i}", "by_kv"], [f"p4_{i}"]),
             helper.make_node("Gather", [f"p4_{i}", "swap"], [f"ps{i}"], axis=1),  # kv head g <-> g + 2
             helper.make_node("Shape", [f"p{i}"], [f"len{i}"], start=3)]

    def padded(out: str) -> list:
        return [helper.make_node("Shape", [f"prv{i}"], [f"rows{i}"], start=2, end=3),
                helper.make_node("Sub", [f"rows{i}", f"len{i}"], [f"padn{i}"]),
                helper.make_node("Concat", ["zero"] * 7 + [f"padn{i}"], [f"pads{i}"], axis=0),
                helper.make_node("Pad", [f"ps{i}", f"pads{i}"], [f"pp{i}"]),
                helper.make_node("MatMul", [f"pp{i}", f"prv{i}"], [out])]

    def sliced(out: str) -> list:
        return [helper.make_node("Slice", [f"prv{i}", "zero", f"len{i}", "axis2"], [f"vs{i}"]),
                helper.make_node("MatMul", [f"ps{i}", f"vs{i}"], [out])]

    if route == "pad":
        return nodes + padded(f"x{i}")
    if route == "slice":
        return nodes + sliced(f"x{i}")
    branch = {kind: helper.make_graph(make(f"x{i}{kind}"), f"{kind}{i}", [],
                                      [helper.make_tensor_value_info(f"x{i}{kind}", TensorProto.FLOAT, None)])
              for kind, make in (("pad", padded), ("slice", sliced))}
    return nodes + [helper.make_node("Shape", [f"prv{i}"], [f"rows_if{i}"], start=2, end=3),
                    helper.make_node("Mul", [f"len{i}", "three"], [f"len3_{i}"]),
                    helper.make_node("Less", [f"len3_{i}", f"rows_if{i}"], [f"few{i}"]),
                    helper.make_node("Squeeze", [f"few{i}"], [f"cond{i}"]),
                    helper.make_node("If", [f"cond{i}"], [f"x{i}"], then_branch=branch["slice"],
                                     else_branch=branch["pad"])]


def route_model(route: str, rows: int) -> onnx.ModelProto:
    heads, kv, size = _shape(route)
    f32 = TensorProto.FLOAT
    inputs = [helper.make_tensor_value_info("seqlens_k", TensorProto.INT32, [1]),
              helper.make_tensor_value_info("total", TensorProto.INT32, [])]
    nodes, outputs = [], []
    inits = [helper.make_tensor(name, TensorProto.INT64, [len(v)], v) for name, v in
             (("by_kv", [1, KV, MAPS // KV, -1]), ("swap", [2, 3, 0, 1]), ("zero", [0]), ("axis2", [2]),
              ("three", [3]))] if route not in ("llama", "shipped") else []
    for i in range(LAYERS):
        inputs += [helper.make_tensor_value_info(f"q{i}", f32, [1, 1, heads * size]),
                   helper.make_tensor_value_info(f"k{i}", f32, [1, 1, kv * size]),
                   helper.make_tensor_value_info(f"v{i}", f32, [1, 1, kv * size]),
                   helper.make_tensor_value_info(f"pk{i}", f32, [1, kv, rows, size]),
                   helper.make_tensor_value_info(f"pv{i}", f32, [1, kv, rows, size])]
        extra = {} if route in ("llama", "shipped") else {"qk_output": 2}
        outs = [f"o{i}", f"prk{i}", f"prv{i}"] + ([f"p{i}"] if extra else [])
        nodes.append(helper.make_node("GroupQueryAttention", [f"q{i}", f"k{i}", f"v{i}", f"pk{i}", f"pv{i}",
                                                              "seqlens_k", "total"], outs, domain="com.microsoft",
                                      num_heads=heads, kv_num_heads=kv, scale=1 / np.sqrt(D), **extra))
        outputs += [helper.make_tensor_value_info(name, f32, None) for name in (f"o{i}", f"prk{i}", f"prv{i}")]
        if extra:
            nodes += _other_half(i, route)
            outputs.append(helper.make_tensor_value_info(f"x{i}", f32, None))
    graph = helper.make_graph(nodes, route, inputs, outputs, inits)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 21),
                                                   helper.make_opsetid("com.microsoft", 1)])


class Run:
    """One route's session over fresh random caches, bound in place; run() is one decode step."""

    def __init__(self, route: str, length: int, rows: int, threads: int, seed: int = 0):
        options = ort.SessionOptions()
        options.intra_op_num_threads = threads
        options.add_session_config_entry("session.intra_op.allow_spinning", "0")
        options.log_severity_level = 3
        self.route, self.length = route, length
        self.session = ort.InferenceSession(route_model(route, rows).SerializeToString(), options,
                                            providers=["CPUExecutionProvider"])
        heads, kv, size = _shape(route)
        rng = np.random.default_rng(seed)
        self.binding, self.arrays, self.bound = self.session.io_binding(), {}, []  # bound: outputs in bind order

        def bind(name, array):
            self.arrays[name] = array
            self.binding.bind_cpu_input(name, array)

        bind("seqlens_k", np.array([length], np.int32))
        bind("total", np.array(length + 1, np.int32))
        for i in range(LAYERS):
            for name, width in (("q", heads), ("k", kv), ("v", kv)):
                bind(f"{name}{i}", rng.standard_normal((1, 1, width * size)).astype(np.float32))
            for past, present in (("pk", "prk"), ("pv", "prv")):
                buffer = rng.standard_normal((1, kv, rows, size)).astype(np.float32)
                bind(f"{past}{i}", buffer)
                self.binding.bind_output(f"{present}{i}", "cpu", 0, np.float32, list(buffer.shape),
                                         buffer.ctypes.data)
                self.bound.append(f"{present}{i}")
            for name in [f"o{i}"] + ([f"x{i}"] if route not in ("llama", "shipped") else []):
                self.binding.bind_output(name, "cpu")
                self.bound.append(name)

    def run(self) -> float:
        start = time.perf_counter()
        self.session.run_with_iobinding(self.binding)
        return time.perf_counter() - start

    def check(self) -> float:
        """Largest difference of layer 0's outputs from numpy's attention (after one run)."""
        self.run()
        got = dict(zip(self.bound, (v.numpy() for v in self.binding.get_outputs())))
        heads, kv, size = _shape(self.route)
        n = self.length + 1
        q = self.arrays["q0"].reshape(heads, size)
        keys = self.arrays["pk0"][0, :, :n]  # the new row written in place by the run
        values = self.arrays["pv0"][0, :, :n]
        group = heads // kv
        worst = 0.0
        for j in range(heads):
            logits = keys[j // group] @ q[j] / np.sqrt(D)  # shipped: dense 128-wide here, the same cost as [q1, 0]
            p = np.exp(logits - logits.max())
            p /= p.sum()
            worst = max(worst, float(np.abs(p @ values[j // group] - got["o0"].reshape(heads, size)[j]).max()))
            if self.route not in ("llama", "shipped"):
                other = (j // group + KV // 2) % KV
                x = got["x0"].reshape(KV, group, D)[other, j % group]
                worst = max(worst, float(np.abs(p @ values[other] - x).max()))
        return worst


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--lengths", default="128,1024,1920", help="cached tokens L")
    parser.add_argument("--spare", default="64,2048", help="buffer rows T: L + N for a number N, or a number >= 2048 "
                        "for a buffer of that many rows")
    parser.add_argument("--rounds", type=int, default=40)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--write", action="store_true")
    args = parser.parse_args()
    lengths = [int(x) for x in args.lengths.split(",")]
    spares = [int(x) for x in args.spare.split(",")]
    rows = []
    for spare in spares:
        for length in lengths:
            buffer = spare if spare >= 2048 else length + spare
            if buffer <= length:
                continue
            runs = {route: Run(route, length, buffer, args.threads) for route in ROUTES}
            for route, run in runs.items():
                worst = run.check()
                if not worst < 1e-4:  # NaN fails too
                    raise SystemExit(f"error: route {route} differs from numpy by {worst} (L {length}, T {buffer})")
            times = {route: [] for route in ROUTES}
            for _ in range(args.rounds):
                for route, run in runs.items():
                    times[route].append(run.run())
            medians = {route: float(np.median(t[5:])) * 1e3 for route, t in times.items()}
            rows.append((length, buffer, medians))
            print(f"L {length:5d} T {buffer:5d}: " + "  ".join(f"{r} {m:.2f} ms" for r, m in medians.items()),
                  flush=True)
    table = ["| cached L | buffer T | " + " | ".join(ROUTES) + " |", "|---:|---:|" + "---:|" * len(ROUTES)]
    for length, buffer, medians in rows:
        cells = [f"{medians[r]:.2f} ({medians[r] / medians['llama']:.2f}x)" for r in ROUTES]
        table.append(f"| {length} | {buffer} | " + " | ".join(cells) + " |")
    body = "\n".join([
        "## DIFF decode attention through stock onnxruntime ops (12 layers, CPU)", "",
        f"`python tools/bench_gqa_routes.py --lengths {args.lengths} --spare {args.spare} --rounds {args.rounds} "
        f"--threads {args.threads} --write`", "", benchdoc.stamp(), "",
        f"onnxruntime {ort.__version__}, {args.threads} threads; ms per decode step for 12 layers (one token after L "
        "cached, caches in buffers of T rows written in place), median, and the ratio to the Llama's "
        "GroupQueryAttention of the same shape (12 heads of 64 over 4 kv heads). Routes: tools/bench_gqa_routes.py; "
        "every route's outputs matched numpy's attention (to 1e-4) before it was timed.", "", *table])
    print(body)
    if args.write:
        print(f"wrote {benchdoc.write_section('gqa-routes', body)}")


if __name__ == "__main__":
    main()
