"""DIFF decode on CPU against its peers: our KV-cache folders, onnxruntime-genai's builder on a Llama of
the same shape, and mobius's DiffLlama folder, fp32 and int4, raced in one process.

    python tools/bench_peers.py [--prompts 128,1024,1920] [--new 64] [--rounds 3] [--threads 2]
                                [--work DIR] [--only NAME,...] [--profile 1024] [--write]

Models (random weights, seed 0, saved once): an HF DiffLlama and an HF Llama of one shape, 12 layers,
hidden 768, 12 heads over 4 kv heads of 64, FFN 2048, vocabulary 32,000, tied embeddings, context
2,048 (the issue's ~100M models). Folders, each fp32 and int4:
  llama     `python -m onnxruntime_genai.models.builder -p fp32|int4 -e cpu` on the Llama (the anchor)
  ours      `diffexport onnx DIFFLLAMA --kv-cache` (the CPU default's format), then `diffexport quantize`
            with its defaults for int4
  ours-<f>  the same in every other decoder format f (`--attention f`)
  ours-kv8  int4 only: `diffexport quantize` of ours with `--kv-cache int8 --calib synthetic` (the cache in
            int8, one calibrated scale per channel)
  ours-llama-attention  timing only, not a model (wrong tokens): ours with what DIFF adds to a Llama's
            attention cut from every layer (the other value half, the maps' combination, the per-head
            norm): GroupQueryAttention's own product goes straight to the output projection. Against
            the Llama, it is what the rest of our folder costs; against ours, what DIFF's extra costs.
  mobius    `mobius build --config DIFFLLAMA --runtime ort-genai` (mobius-onnx, the bench extra); its
            genai_config's model type "diffllama" set to "llama" (onnxruntime-genai 0.18 does not know
            the name); int4 by onnxruntime's MatMulNBitsQuantizer, block 32, accuracy level 4
Every folder runs in onnxruntime-genai with intra_op_num_threads written into its genai_config (a
copy; the files are hard links). Decode tokens/s counts the tokens after the first (prefill
excluded), `--new` tokens forced (min_length), greedy. For each prompt length, each round runs every
folder once (interleaved: drift of a shared machine hits every folder alike); medians are reported.
--profile N: onnxruntime's per-op profile of one decode step after N cached tokens, ours against the
builder's Llama, int4. --write replaces the section in docs/BENCHMARKS.md.
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
import benchdoc  # noqa: E402
from bench_decode import tokenizer_folder  # noqa: E402

from diffexport.backends import genai  # noqa: E402
from diffexport.format import decoders  # noqa: E402
from diffexport.format.nodes import live_nodes, sort_topologically  # noqa: E402
from diffexport.modeling.checkpoint import load_model  # noqa: E402
from diffexport.passes.decoder_formats import export_decoder  # noqa: E402
from diffexport.passes.weight_quant import WeightQuantOptions, quantize_weights  # noqa: E402

SHAPE = dict(vocab_size=32000, hidden_size=768, intermediate_size=2048, num_hidden_layers=12,
             num_attention_heads=12, num_key_value_heads=4, head_dim=64, max_position_embeddings=2048,
             bos_token_id=1, eos_token_id=2, pad_token_id=0, tie_word_embeddings=True)
PRECISIONS = ("fp32", "int4")
ANCHOR = "llama"


def quiet(_message: str) -> None:
    pass


def hf_checkpoints(work: Path) -> None:
    import torch
    import transformers

    for name, model_class, config_class in (("diffllama", transformers.DiffLlamaForCausalLM,
                                             transformers.DiffLlamaConfig),
                                            ("llama-hf", transformers.LlamaForCausalLM, transformers.LlamaConfig)):
        if (work / name / "config.json").is_file():
            continue
        torch.manual_seed(0)
        model_class(config_class(**SHAPE)).eval().save_pretrained(work / name)
        tokenizer_folder(work / name)


def run_quiet(command: list[str], log: Path) -> None:
    with open(log, "w") as out:
        done = subprocess.run(command, stdout=out, stderr=subprocess.STDOUT)
    if done.returncode:
        sys.exit(f"error: {' '.join(command[:4])} ... failed (exit {done.returncode}); see {log}")


def build_llama(work: Path, precision: str) -> Path:
    out = work / f"llama-{precision}"
    if not (out / "genai_config.json").is_file():
        run_quiet([sys.executable, "-m", "onnxruntime_genai.models.builder", "-i", str(work / "llama-hf"),
                   "-o", str(out),
                   "-p", precision, "-e", "cpu", "-c", str(work / "builder-cache")], work / f"llama-{precision}.log")
    return out


def build_mobius(work: Path, precision: str) -> Path:
    fp32 = work / "mobius-fp32"
    if not (fp32 / "genai_config.json").is_file():
        if shutil.which("mobius") is None:
            sys.exit("error: mobius is not installed: pip install -e '.[bench]' (or --only ours,... to leave it out)")
        run_quiet(["mobius", "build", "--config", str(work / "diffllama"), str(fp32), "--runtime", "ort-genai"],
                  work / "mobius-fp32.log")
        config_path = fp32 / "genai_config.json"
        config = json.loads(config_path.read_text())
        config["model"]["type"] = "llama"  # genai 0.18 has no "diffllama"; the graph is plain ops either way
        config_path.write_text(json.dumps(config, indent=2))
    if precision == "fp32":
        return fp32
    out = work / "mobius-int4"
    if not (out / "genai_config.json").is_file():
        import onnx
        from onnxruntime.quantization import matmul_nbits_quantizer as mnq

        model = onnx.load(fp32 / "model.onnx")
        config = mnq.DefaultWeightOnlyQuantConfig(block_size=32, is_symmetric=True, accuracy_level=4)
        quantiser = mnq.MatMulNBitsQuantizer(model, block_size=32, is_symmetric=True, accuracy_level=4,
                                             algo_config=config)
        quantiser.process()
        out.mkdir()
        onnx.save(quantiser.model.model, out / "model.onnx", save_as_external_data=True,
                  location="model.onnx.data")
        for path in fp32.iterdir():
            if path.suffix in (".json",) or path.name.startswith("tokenizer"):
                shutil.copy(path, out / path.name)
    return out


CPU_DEFAULT = decoders.default_format("cpu", "float32")  # what `diffexport onnx CKPT --kv-cache` writes


def build_ours(work: Path, attention: str, precision: str) -> Path:
    tag = "ours" if attention == CPU_DEFAULT else f"ours-{attention}"
    fp32 = work / f"{tag}-fp32"
    if not (fp32 / "genai_config.json").is_file():
        export_decoder(load_model(work / "diffllama"), fp32, attention=attention, log=quiet)
    if precision == "fp32":
        return fp32
    out = work / f"{tag}-int4"
    if not (out / "genai_config.json").is_file():
        quantize_weights(fp32, out, WeightQuantOptions(), log=quiet)
    return out


def build_ours_kv8(work: Path, precision: str) -> Path | None:
    """The int4 folder with GroupQueryAttention's cache in int8 (`quantize --kv-cache int8`), its scales
    calibrated on synthetic ids (the weights are random: there is no text to prefer)."""
    if precision != "int4":
        return None  # quantize writes the int8 cache beside quantised weights
    out = work / "ours-kv8-int4"
    if not (out / "genai_config.json").is_file():
        fp32 = build_ours(work, CPU_DEFAULT, "fp32")
        quantize_weights(fp32, out, WeightQuantOptions(kv_cache="int8", calib="synthetic"), log=quiet)
    return out


def build_ours_llama_attention(work: Path, precision: str) -> Path:
    """Timing only: ours with every layer's attention output taken from GroupQueryAttention's own product
    (heads [B, S, 12 x 64], the output projection's width), the nodes DIFF adds after it left dead."""
    import onnx
    from onnx import helper, numpy_helper

    out = work / f"ours-llama-attention-{precision}"
    if (out / "genai_config.json").is_file():
        return out
    source = build_ours(work, CPU_DEFAULT, precision)
    model = onnx.load(source / "model.onnx")
    graph = model.graph
    consumers = collections.defaultdict(list)
    for node in graph.node:
        for name in node.input:
            consumers[name].append(node)
    weights = {t.name for t in graph.initializer}
    flat = "ours_llama_attention/flat"
    graph.initializer.append(numpy_helper.from_array(np.array([0, 0, -1], np.int64), flat))
    cut = 0
    for node in list(graph.node):
        if node.op_type != "GroupQueryAttention":
            continue
        frontier, seen, projection_input = list(node.output), set(), None
        while frontier and projection_input is None:  # forward to the output projection (weights constant)
            name = frontier.pop(0)
            for reader in consumers[name]:
                if reader.op_type in ("MatMul", "MatMulNBits") and reader.input[1] in weights:
                    projection_input = reader.input[0]
                elif id(reader) not in seen:
                    seen.add(id(reader))
                    frontier += list(reader.output)
        if projection_input is None:
            sys.exit(f"error: no output projection after {node.name} in {source}")
        producer = next(n for n in graph.node if projection_input in n.output)
        graph.node.remove(producer)
        graph.node.append(helper.make_node("Reshape", [node.output[0], flat], [projection_input],
                                           name=f"ours_llama_attention/{cut}"))
        for attribute in list(node.attribute):
            if attribute.name == "qk_output":
                node.attribute.remove(attribute)
        del node.output[3:]
        cut += 1
    sort_topologically(graph)
    live = live_nodes(list(graph.node), [o.name for o in graph.output])
    del graph.node[:]
    graph.node.extend(live)
    out.mkdir()
    onnx.save(model, out / "model.onnx", save_as_external_data=precision == "fp32", location="model.onnx.data")
    for path in source.iterdir():
        if path.suffix == ".json" or path.name.startswith("tokenizer"):
            shutil.copy(path, out / path.name)
    return out


def with_threads(folder: Path, threads: int) -> Path:
    """A copy of a genai folder (files hard-linked) whose genai_config sets intra_op_num_threads."""
    copy = folder.parent / f"{folder.name}-t{threads}"
    copy.mkdir()
    for path in folder.iterdir():
        if path.is_file() and path.name != "genai_config.json":
            os.link(path, copy / path.name)
    config = json.loads((folder / "genai_config.json").read_text())
    config["model"]["decoder"].setdefault("session_options", {})["intra_op_num_threads"] = threads
    (copy / "genai_config.json").write_text(json.dumps(config, indent=2))
    return copy


def folders(work: Path, only: set[str] | None, threads: int) -> dict[tuple[str, str], Path]:
    """(name, precision) -> folder with the thread count written, built where missing."""
    makers = {ANCHOR: build_llama, "mobius": build_mobius}
    for fmt in decoders.FORMATS:
        makers["ours" if fmt == CPU_DEFAULT else f"ours-{fmt}"] = \
            (lambda w, p, fmt=fmt: build_ours(w, fmt, p))
    makers["ours-kv8"] = build_ours_kv8
    makers["ours-llama-attention"] = build_ours_llama_attention
    for old in work.glob(f"*-t{threads}"):  # earlier copies: their hard links would make onnx refuse the files
        shutil.rmtree(old)
    built = {}
    for name, make in makers.items():
        if only and name not in only and name != ANCHOR:
            continue
        for precision in PRECISIONS:
            print(f"building {name} {precision}", flush=True)
            folder = make(work, precision)
            if folder is not None:
                built[(name, precision)] = folder
    return {key: with_threads(folder, threads) for key, folder in built.items()}


def decode_rate(og, model, prompt: list[int], new: int) -> float:
    """Greedy, `new` tokens forced; tokens/s after the first. genai's own loop: the peers' folders hold
    search keys diffexport's folder reader refuses."""
    params = og.GeneratorParams(model)
    total = len(prompt) + new
    params.set_search_options(max_length=total, min_length=total, do_sample=False, batch_size=1)
    generator = og.Generator(model, params)
    generator.append_tokens(np.asarray(prompt, np.int32))
    first = time.perf_counter()  # append_tokens ran the prompt and chose the first new token
    made = 1
    while not generator.is_done():
        generator.generate_next_token()
        made += 1
    return (made - 1) / (time.perf_counter() - first)


def race(og, opened: dict, prompts: list[int], new: int, rounds: int) -> dict:
    """(name, precision, prompt) -> median decode tokens/s over interleaved rounds."""
    rng = np.random.default_rng(0)
    rates: dict[tuple, list[float]] = collections.defaultdict(list)
    for length in prompts:
        prompt = rng.integers(3, SHAPE["vocab_size"], size=length).tolist()
        for round_ in range(rounds):
            for (name, precision), (folder, model) in opened.items():
                rate = decode_rate(og, model, prompt, new)
                rates[(name, precision, length)].append(rate)
                print(f"prompt {length:5d} round {round_ + 1}/{rounds} {name:18s} {precision} {rate:7.1f} tok/s",
                      flush=True)
    return {key: statistics.median(values) for key, values in rates.items()}


def profile_step(folder: Path, past: int, threads: int, new: int, steps: int = 20) -> tuple[float, int, list]:
    """onnxruntime's profile of one decode step (1 new token after `past` cached): (us per step, nodes
    per step, [(op type, us per step, nodes per step)] by time). A shared-buffer folder's cache is
    the buffer genai allocates for a prompt of `past` tokens and `new` more (its max_length)."""
    import onnxruntime as ort

    config = json.loads((folder / "genai_config.json").read_text())
    decoder = config["model"]["decoder"]
    options = ort.SessionOptions()
    options.enable_profiling, options.intra_op_num_threads = True, threads
    options.profile_file_prefix = str(folder.parent / f"profile-{folder.name}")
    session = ort.InferenceSession(str(folder / decoder["filename"]), options, providers=["CPUExecutionProvider"])
    inputs = {i.name for i in session.get_inputs()}
    shared = config.get("search", {}).get("past_present_share_buffer", False)
    length = past + new if shared else past
    feeds = {"input_ids": np.array([[5]], np.int64), "attention_mask": np.ones((1, past + 1), np.int64)}
    if "position_ids" in inputs:
        feeds["position_ids"] = np.array([[past]], np.int64)
    rng = np.random.default_rng(0)
    shape = (1, decoder["num_key_value_heads"], length, decoder["head_size"])
    key_names = decoder["inputs"]["past_key_names"]
    value_names = decoder["inputs"]["past_value_names"]
    for i in range(decoder["num_hidden_layers"]):
        for pattern in (key_names, value_names):
            feeds[pattern % i] = rng.standard_normal(shape).astype(np.float32)
    feeds = {k: v for k, v in feeds.items() if k in inputs}
    for _ in range(steps):
        session.run(None, feeds)
    return benchdoc.op_profile(session, steps)


def folder_bytes(folder: Path) -> int:
    return sum(p.stat().st_size for p in folder.iterdir() if p.is_file() and p.name.startswith("model"))


def tables(rates: dict, names: list[str], prompts: list[int], sizes: dict) -> list[str]:
    lines = []
    for precision in PRECISIONS:
        head = " | ".join(f"prompt {p}" for p in prompts)
        lines += [f"**{precision}**: decode tokens/s, and the ratio to the builder's Llama (x) and to mobius (m)", "",
                  f"| folder | MB | {head} |", "|---|---:|" + "---:|" * len(prompts)]
        for name in names:
            if (name, precision, prompts[0]) not in rates:
                continue
            cells = []
            for length in prompts:
                rate = rates[(name, precision, length)]
                cell = f"{rate:.1f}, {rate / rates[(ANCHOR, precision, length)]:.2f}x"
                if ("mobius", precision, length) in rates and name != "mobius":
                    cell += f", {rate / rates[('mobius', precision, length)]:.2f}m"
                cells.append(cell)
            lines.append(f"| {name} | {sizes[(name, precision)] / 1e6:.0f} | " + " | ".join(cells) + " |")
        lines.append("")
    return lines


def profile_lines(title: str, profile, past: int, threads: int) -> list[str]:
    total, nodes, ops = profile
    lines = [f"{title}: {total / 1e3:.1f} ms of kernel time per step over {nodes} nodes (onnxruntime profile, "
             f"{threads} threads, {past} cached tokens).", "", "| op type | ms per step | nodes | share |",
             "|---|---:|---:|---:|"]
    return lines + [f"| {op} | {t / 1e3:.2f} | {n} | {100 * t / total:.1f}% |" for op, t, n in ops[:12]] + [""]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--prompts", default="128,1024,1920")
    parser.add_argument("--new", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--work", help="keep the built folders here (reused when the tool runs again)")
    parser.add_argument("--only", help="comma-separated folders besides the anchor (ours, ours-gqa, mobius, ...)")
    parser.add_argument("--profile", type=int, default=1024, help="cached tokens for the per-op profile (0: none)")
    parser.add_argument("--write", action="store_true")
    args = parser.parse_args()
    try:
        prompts = [int(p) for p in args.prompts.split(",")]
    except ValueError:
        parser.exit(2, f"error: --prompts {args.prompts!r}: give token counts separated by commas\n")
    if min(prompts) < 1 or min(args.new, args.rounds, args.threads) < 1 or args.profile < 0:
        parser.exit(2, "error: prompts, --new, --rounds and --threads must be at least 1, --profile at least 0\n")
    if max(prompts) + args.new > SHAPE["max_position_embeddings"]:
        parser.exit(2, f"error: prompt + new tokens past the context ({SHAPE['max_position_embeddings']})\n")
    if args.work and (Path(args.work).is_symlink() or (Path(args.work).exists() and not Path(args.work).is_dir())):
        parser.exit(2, f"error: --work {args.work} is not a folder (links are not followed)\n")
    only = set(args.only.split(",")) if args.only else None
    og = genai.import_genai()
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(args.work or tmp)
        work.mkdir(parents=True, exist_ok=True)
        hf_checkpoints(work)
        built = folders(work, only, args.threads)
        names = list(dict.fromkeys(name for name, _ in built))
        sizes = {key: folder_bytes(folder) for key, folder in built.items()}
        opened = {key: (folder, og.Model(str(folder))) for key, folder in built.items()}
        for _, model in opened.values():  # warm-up: first runs allocate
            decode_rate(og, model, [5] * 16, 8)
        rates = race(og, opened, prompts, args.new, args.rounds)
        profiles = []
        if args.profile:
            for name in ("ours", ANCHOR):
                if (name, "int4") in built:
                    title = "ours, int4 (the default folder)" if name == "ours" else "the builder's Llama, int4"
                    step = profile_step(built[(name, "int4")], args.profile, args.threads, args.new)
                    profiles += profile_lines(title, step,
                                              args.profile, args.threads)
        del opened
    body = "\n".join([
        "## DIFF decode on CPU against its peers", "",
        f"`python tools/bench_peers.py --prompts {args.prompts} --new {args.new} --rounds {args.rounds} "
        f"--threads {args.threads}{' --only ' + args.only if args.only else ''} --profile {args.profile} --write`", "",
        benchdoc.stamp(), "", f"onnxruntime-genai {og.__version__ if hasattr(og, '__version__') else '?'}; "
        f"{args.threads} intra-op threads written into every folder; {args.new} new tokens; medians of "
        f"{args.rounds} interleaved rounds. Models: DiffLlama and Llama, 12 layers, hidden 768, 12 heads over 4 kv "
        "heads, vocabulary 32,000, tied embeddings, random weights. MB: the folder's model files.", "",
        *tables(rates, names, prompts, sizes), *profiles])
    print(body)
    if args.write:
        print(f"wrote {benchdoc.write_section('peers', body)}")


if __name__ == "__main__":
    main()
