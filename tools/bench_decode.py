"""Decode throughput on CPU: our KV-cache folder in onnxruntime-genai and in a plain onnxruntime loop,
our eager generate and transformers' generate, side by side, with the memory-bandwidth bound.

    python tools/bench_decode.py [--prompt 128] [--new 128] [--anchor] [--write]

Models (batch 1, greedy, seeded random weights, every runtime on the same weights):
  diffllama-100m  an HF DiffLlama (hidden 768, 12 layers, 12 maps of 64 = 6 diff-heads, 32k vocab)
                  saved once, imported by diffexport, exported with --kv-cache (and again with
                  --attention gqa: onnxruntime's GroupQueryAttention, timed with the threads written)
  diff-v1-110m    our preset (same shape, tied embeddings); no transformers row (not an HF model)
  llama-100m      with --anchor: a plain Llama of the same size exported by onnxruntime-genai's own
                  model builder (`python -m onnxruntime_genai.models.builder -p fp32 -e cpu`)
Decode tokens/s counts the tokens after the first (prefill excluded); each runtime runs once per
round after a warm-up generation of 8 tokens, rounds interleaved, medians reported. onnxruntime-genai folders run
twice: with the session options their
writer put in genai_config.json (neither ours nor the builder's sets threads) and with
intra_op_num_threads = the machine's cores written into both (`diffexport onnx --kv-cache --threads`).
Bound: weight bytes each decode step reads (every initializer except an embedding table that only a
Gather reads) / read bandwidth, measured here as onnxruntime's own GEMV over a 512 MiB float32 weight
on all cores (median of 5).
--write replaces the section in docs/BENCHMARKS.md.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import benchdoc  # noqa: E402

from diffexport.backends import genai, step_loop  # noqa: E402
from diffexport.backends.speed import read_bandwidth, weight_bytes_per_token  # noqa: E402,F401 (the tools' names)
from diffexport.core.eager_generation import Sampling, generate  # noqa: E402
from diffexport.modeling.checkpoint import load_model  # noqa: E402
from diffexport.passes.decoder_formats import export_decoder  # noqa: E402

HIDDEN, LAYERS, VOCAB, FFN = 768, 12, 32000, 2048


def with_threads(folder: Path, root: Path, threads: int) -> Path:
    """A copy of a genai folder (files hard-linked) whose genai_config sets intra_op_num_threads."""
    copy = root / f"{folder.name}-t{threads}"
    copy.mkdir()
    for path in folder.iterdir():
        if path.name != "genai_config.json":
            os.link(path.resolve(), copy / path.name)  # a hard link: the folder reader refuses symbolic ones
    config = json.loads((folder / "genai_config.json").read_text())
    config["model"]["decoder"].setdefault("session_options", {})["intra_op_num_threads"] = threads
    (copy / "genai_config.json").write_text(json.dumps(config, indent=2))
    return copy


def tokenizer_folder(folder: Path) -> None:
    """A byte-level BPE tokenizer trained here: onnxruntime-genai's builder needs tokenizer files."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=400, special_tokens=["<pad>", "<s>", "</s>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(["the cat sat on the mat"] * 10, trainer)
    PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>",
                            pad_token="<pad>").save_pretrained(folder)


def hf_models(root: Path):
    import transformers

    torch.manual_seed(0)
    common = dict(vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=FFN, num_hidden_layers=LAYERS,
                  num_attention_heads=12, num_key_value_heads=12, head_dim=64, max_position_embeddings=2048,
                  bos_token_id=1, eos_token_id=2, pad_token_id=0)
    diff = transformers.DiffLlamaForCausalLM(transformers.DiffLlamaConfig(**common)).eval()
    diff.save_pretrained(root / "diffllama")
    llama = transformers.LlamaForCausalLM(transformers.LlamaConfig(**common)).eval()
    llama.save_pretrained(root / "llama")
    tokenizer_folder(root / "llama")
    return diff


def profile_step(folder: Path, past: int, threads: int, steps: int = 30) -> tuple[float, int, list]:
    """onnxruntime's own profile of one decode step (1 new token, `past` cached): (us per step, nodes per
    step, [(op type, us per step, nodes per step)] sorted by time)."""
    import onnxruntime as ort

    config = json.loads((folder / "genai_config.json").read_text())  # ours or the builder's: no metadata check
    model_path = folder / config["model"]["decoder"]["filename"]
    options = ort.SessionOptions()
    options.enable_profiling, options.intra_op_num_threads = True, threads
    options.profile_file_prefix = str(folder.parent / "decode-profile")
    session = ort.InferenceSession(str(model_path), options, providers=["CPUExecutionProvider"])
    decoder = config["model"]["decoder"]
    feeds = {"input_ids": np.array([[5]], np.int64), "attention_mask": np.ones((1, past + 1), np.int64)}
    rng = np.random.default_rng(0)
    shape = (1, decoder["num_key_value_heads"], past, decoder["head_size"])
    for i in range(decoder["num_hidden_layers"]):
        for name in ("key", "value"):
            feeds[f"past_key_values.{i}.{name}"] = rng.standard_normal(shape, np.float32)
    for _ in range(steps):
        session.run(None, feeds)
    return benchdoc.op_profile(session, steps)


def time_genai(folder, prompt, new):
    og = genai.import_genai()
    model = og.Model(str(folder))  # the anchor has no diffexport metadata: no folder validation here
    genai.generate_genai(folder, prompt[:16], 8, Sampling(), model=model)  # warm-up
    return genai.generate_genai(folder, prompt, new, Sampling(), model=model, min_new_tokens=new)


def time_ort(folder, prompt, new, threads=None):
    runner = step_loop.OrtDecoder(folder, threads=threads)
    step_loop.generate_stepped(folder, prompt[:16], 8, Sampling(), runner=runner)
    return step_loop.generate_stepped(folder, prompt, new, Sampling(), runner=runner, ignore_eos=True)


def time_eager(model, prompt, new):
    ids = torch.tensor([prompt])
    generate(model, ids[:, :16], max_new_tokens=8)
    start = time.perf_counter()
    first = []
    generate(model, ids, max_new_tokens=new, on_token=lambda t: first.append(time.perf_counter()))
    return len(prompt), first[0] - start, first[-1] - first[0], new


def time_hf(model, prompt, new):
    ids = torch.tensor([prompt])
    with torch.no_grad():
        model.generate(ids[:, :16], max_new_tokens=8, do_sample=False, pad_token_id=0)
        start = time.perf_counter()
        model.generate(ids, max_new_tokens=1, min_new_tokens=1, do_sample=False, pad_token_id=0)
        prefill = time.perf_counter() - start
        start = time.perf_counter()
        model.generate(ids, max_new_tokens=new, min_new_tokens=new, do_sample=False, pad_token_id=0)
        total = time.perf_counter() - start
    return len(prompt), prefill, total - prefill, new


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--prompt", type=int, default=128)
    parser.add_argument("--new", type=int, default=128)
    parser.add_argument("--anchor", action="store_true", help="also build and run the plain Llama anchor")
    parser.add_argument("--rounds", type=int, default=3, help="interleaved rounds; the table shows medians")
    parser.add_argument("--write", action="store_true")
    args = parser.parse_args()
    rng = np.random.default_rng(0)
    prompt = rng.integers(3, VOCAB, size=args.prompt).tolist()
    bandwidth = read_bandwidth()
    cores = os.cpu_count() or 1
    rows = []

    runs: dict[tuple[str, str], list] = {}  # (model, runtime) -> per round (new, prefill tok/s, decode tok/s, bound)

    def add(model_name, runtime, result, weights):
        if isinstance(result, tuple):
            prompt_tokens, prefill, decode, new = result
        else:
            prompt_tokens, prefill, decode, new = (result.prompt_tokens, result.prefill_seconds,
                                                   result.decode_seconds, len(result.tokens))
        tps = (new - 1) / decode
        runs.setdefault((model_name, runtime), []).append((new, prompt_tokens / prefill, tps, bandwidth / weights))
        print(f"{model_name:15s} {runtime:32s} prefill {prompt_tokens / prefill:8.1f} tok/s  decode {tps:7.1f} tok/s  "
              f"(bound {bandwidth / weights:.1f})", flush=True)

    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        print(f"read bandwidth {bandwidth / 1e9:.1f} GB/s; building models in {root}", flush=True)
        hf_diff = hf_models(root)
        models = []
        for name, loaded in (("diffllama-100m", load_model(root / "diffllama")),
                             ("diff-v1-110m", load_model(None, preset="diff-v1-110m", seed=0))):
            folder = root / f"{name}-kv"
            export_decoder(loaded, folder, log=lambda _: None)
            gqa = root / f"{name}-kv-gqa"  # the same model with onnxruntime's GroupQueryAttention (docs/EXPORT.md)
            export_decoder(loaded, gqa, attention="gqa", log=lambda _: None)
            models.append((name, loaded, folder, with_threads(folder, root, cores), weight_bytes_per_token(folder),
                           with_threads(gqa, root, cores)))
        if args.anchor:
            out = root / "llama-genai"
            subprocess.run([sys.executable, "-m", "onnxruntime_genai.models.builder", "-i", str(root / "llama"),
                            "-o", str(out), "-p", "fp32", "-e", "cpu", "-c", str(root / "cache")], check=True,
                           capture_output=True)
            anchor = (out, with_threads(out, root, cores), weight_bytes_per_token(out))
        for round_ in range(args.rounds):  # interleaved rounds: drift of a shared machine hits every runtime alike
            print(f"round {round_ + 1}/{args.rounds}", flush=True)
            for name, loaded, folder, threaded, weights, gqa_threaded in models:
                add(name, "onnxruntime-genai (our folder)", time_genai(folder, prompt, args.new), weights)
                add(name, f"onnxruntime-genai, {cores} threads", time_genai(threaded, prompt, args.new), weights)
                add(name, f"onnxruntime-genai, {cores} threads, --attention gqa",
                    time_genai(gqa_threaded, prompt, args.new), weights)
                add(name, "onnxruntime loop (our folder)", time_ort(folder, prompt, args.new), weights)
                add(name, "diffexport eager generate", time_eager(loaded.model.eval(), prompt, args.new), weights)
                if name == "diffllama-100m":
                    add(name, "transformers generate", time_hf(hf_diff, prompt, args.new), weights)
            if args.anchor:
                add("llama-100m", "onnxruntime-genai (its builder)", time_genai(anchor[0], prompt, args.new), anchor[2])
                add("llama-100m", f"onnxruntime-genai, {cores} threads", time_genai(anchor[1], prompt, args.new),
                    anchor[2])
        profile = profile_step(models[1][2], args.prompt + args.new // 2, cores)
        if args.anchor:
            anchor_profile = profile_step(anchor[0], args.prompt + args.new // 2, cores)
    for (model_name, runtime), results in runs.items():
        rows.append((model_name, runtime, results[0][0], statistics.median(r[1] for r in results),
                     statistics.median(r[2] for r in results), results[0][3]))
    table = ["| model | runtime | new tokens | prefill tok/s | decode tok/s | bound tok/s | decode / bound |",
             "|---|---|---:|---:|---:|---:|---:|"]
    for model_name, runtime, new, prefill, tps, bound in rows:
        table.append(f"| {model_name} | {runtime} | {new} | {prefill:.0f} | {tps:.1f} | {bound:.1f} | "
                     f"{tps / bound:.2f} |")
    def profile_table(title, prof):
        total, nodes, ops = prof
        lines = [f"{title}: {total / 1e3:.1f} ms of kernel time per step over {nodes} nodes (onnxruntime profile, "
                 f"{cores} threads, past {args.prompt + args.new // 2} tokens).", "",
                 "| op type | ms per step | nodes | share |", "|---|---:|---:|---:|"]
        lines += [f"| {op} | {t / 1e3:.2f} | {n} | {100 * t / total:.1f}% |" for op, t, n in ops[:10]]
        return lines + [""]

    profiles = profile_table("Where one decode step of diff-v1-110m (our folder) spends its time", profile)
    if args.anchor:
        profiles += profile_table("The same for the builder's llama-100m", anchor_profile)
    body = "\n".join([
        "## Decode on CPU (KV cache, batch 1, greedy)", "",
        f"`python tools/bench_decode.py --prompt {args.prompt} --new {args.new}{' --anchor' if args.anchor else ''}"
        f" --rounds {args.rounds} --write`", "", benchdoc.stamp(), "",
        f"Medians of {args.rounds} interleaved rounds (every runtime once per round).", "",
        f"Read bandwidth measured by the tool: {bandwidth / 1e9:.1f} GB/s ({cores} cores); bound = that / the "
        "fp32 weight bytes a decode step reads (an untied embedding table, read one row per token, excluded).",
        "", *table, "", *profiles])
    print(body)
    if args.write:
        print(f"wrote {benchdoc.write_section('decode', body)}")


if __name__ == "__main__":
    main()
