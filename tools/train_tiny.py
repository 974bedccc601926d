"""Train a small DIFF V1 model and its matching Transformer on the multi-needle retrieval task,
or (--text FILE) as byte-level language models on a real text.

Both models get the same data (same seed, same batches), the same recipe (AdamW, warm-up then
cosine decay, gradient clipping) and the same parameter budget: the baseline is
diffexport.modeling.families.baseline_for(diff config), i.e. twice the heads of the same head dim, so the
projections have identical shapes. Loss: cross-entropy on the answer tokens only; with --text,
next-byte cross-entropy on every position of random windows of the file's first nine tenths,
evaluated in bits per byte on its last tenth, which is written to OUT/heldout.txt for the analyses
(`diffexport stats OUT/diff.pt OUT/transformer.pt --text OUT/heldout.txt`).

    python tools/train_tiny.py --out-dir runs/tiny              # the smallest size, minutes on 2 CPU cores
    python tools/train_tiny.py --size small --out-dir runs/small   # wider/deeper; better on a GPU
    python tools/train_tiny.py --size small --head-dim 64 --device cuda --out-dir runs/small64
                                  # a pair whose attention the fused kernel takes (quant-sweep --attention kernel)
    python tools/train_tiny.py --text corpus.txt --context 256 --out-dir runs/text
                                  # byte-level language models (vocabulary 256) on a UTF-8 file

Writes OUT/diff.pt and OUT/transformer.pt (native diffexport checkpoints carrying a "task"
record, so `diffexport quant-sweep` and `diffexport retrieval` know what they were trained on)
and OUT/train_log.json. Deterministic: the same command on the same torch build and thread
count gives bit-identical weights (torch.use_deterministic_algorithms; one seeded generator). On
CUDA it asks for the same (cuBLAS in its deterministic workspace mode, deterministic attention
backward passes) on the same GPU model and driver, but only warns where an op has no
deterministic CUDA kernel rather than stopping the run: such a warning means runs may differ.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import random
import sys
import time
from pathlib import Path

import torch

from diffexport.analysis import needles
from diffexport.core.errors import DiffExportError
from diffexport.core.files import atomic_write, check_output_path, read_text_input
from diffexport.inputs import needle_task, streams
from diffexport.modeling.checkpoint import save_checkpoint, save_hf_folder
from diffexport.modeling.families import DiffV1Config, baseline_for, build_model

SIZES = {
    # d_model, layers, DIFF heads (the baseline gets twice as many), head_dim
    "tiny": dict(d_model=128, n_layers=2, n_heads=2, head_dim=32),
    "small": dict(d_model=256, n_layers=4, n_heads=4, head_dim=32),
    # --bpe-vocab's text model (the zoo's diff-text-tiny): deeper than tiny, GQA 2:1
    "text": dict(d_model=128, n_layers=4, n_heads=2, n_kv_heads=1, head_dim=32, ffn_hidden=384),
}


MAX_BATCH, MAX_THREADS = 65_536, 1024
MAX_BATCH_TOKENS = 1 << 22  # tokens in one training step: a few GB of activations at the largest size
BYTE_VOCAB = 256  # --text: UTF-8 bytes are the tokens (diffexport.inputs.streams reads a text the same way)
# --bpe-vocab: ids 0, 1, 2 (pad, begin, end), as the HF folders' config and generation_config say
SPECIAL_TOKENS = ("<pad>", "<s>", "</s>")
# the chat template written with --bpe-vocab: turns as Python comments, the assistant's answer after
# them, the form a model trained on Python source can continue
CHAT_TEMPLATE = ("{% for message in messages %}# {{ message['role'] }}: {{ message['content'] }}\n{% endfor %}"
                 "{% if add_generation_prompt %}# assistant:\n{% endif %}")
HELD_OUT = 0.1   # --text: the last tenth of the file (by characters) is never trained on


def diff_config(size: str, head_dim: int | None = None, vocab_size: int = needle_task.TASK_VOCAB,
                hf: bool = False) -> DiffV1Config:
    """hf: what a Hugging Face DiffLlama can say (head norm without weight, its eps the model's,
    tied embeddings), so the pair is written as DiffLlama and Llama folders."""
    shape = dict(SIZES[size])
    shape.setdefault("ffn_hidden", None)
    if hf:
        shape.update(head_norm_affine=False, tie_embeddings=True)
    if head_dim is not None:  # the same width in fewer, wider heads (d_model = 2 * heads * head_dim holds for both)
        shape["n_heads"] = shape["n_heads"] * shape["head_dim"] // head_dim
        shape["head_dim"] = head_dim
    return DiffV1Config(vocab_size=vocab_size, **shape)


def text_corpus(path: str, context: int) -> tuple[str, str]:
    """(training text, held-out text) of a UTF-8 file, split at a character so that both parts stay
    valid UTF-8; each part must hold more than one window of context + 1 bytes."""
    text = read_text_input(path, "text file", "a UTF-8 text file", "give an excerpt")
    cut = int(len(text) * (1 - HELD_OUT))
    train, held = text[:cut], text[cut:]
    if min(len(train.encode("utf-8")), len(held.encode("utf-8"))) <= context + 1:
        raise DiffExportError(f"{path} holds {len(text.encode('utf-8')):,} bytes: too few for windows of "
                              f"{context + 1} bytes in both its first nine tenths and its last tenth")
    return train, held


def bpe_tokenizer(train_text: str, vocab_size: int):
    """A byte-level BPE (the tokenizers library) learnt on the training text only: every byte is a
    token of its own before the merges, so any text encodes and the held-out tenth stays unseen."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=list(SPECIAL_TOKENS),
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(train_text.splitlines(keepends=True), trainer)
    return tok


def token_byte_lengths(tok) -> torch.Tensor:
    """UTF-8 bytes each id stands for: a byte-level token's characters are one byte each (special
    tokens, never in the text, count 0)."""
    lengths = torch.zeros(tok.get_vocab_size(), dtype=torch.float64)
    for token, i in tok.get_vocab().items():
        lengths[i] = 0 if token in SPECIAL_TOKENS else len(token)
    return lengths


def byte_ids(data: bytes) -> torch.Tensor:
    return torch.frombuffer(bytearray(data), dtype=torch.uint8).long()


def text_batch(rng: random.Random, ids: torch.Tensor, batch: int, context: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Random windows: inputs [batch, context] and their next bytes."""
    starts = [rng.randrange(len(ids) - context) for _ in range(batch)]
    windows = torch.stack([ids[s:s + context + 1] for s in starts])
    return windows[:, :-1], windows[:, 1:]


@torch.no_grad()
def bits_per_byte(model, ids: torch.Tensor, context: int, batch: int, device: str, max_windows: int = 256,
                  token_bytes: torch.Tensor | None = None) -> float:
    """Next-token cross-entropy in bits per UTF-8 byte of the targets, over consecutive windows of
    `ids` (at most max_windows); token_bytes: the bytes each id stands for (None: ids are bytes)."""
    n = min(max_windows, (len(ids) - 1) // context)
    inputs = ids[: n * context].view(n, context)
    targets = ids[1: n * context + 1].view(n, context)
    total = 0.0
    for x, y in zip(inputs.split(batch), targets.split(batch)):
        logits = model(x.to(device)).float()
        total += torch.nn.functional.cross_entropy(logits.flatten(0, 1), y.to(device).flatten(), reduction="sum").item()
    scored = float(n * context) if token_bytes is None else token_bytes[targets].sum().item()
    return total / scored / math.log(2)


def write_hf_folder(model, folder: Path, tok, context: int) -> None:
    """The model as a Hugging Face folder (DiffLlama or, the twin, Llama) with its tokenizer, chat
    template and generation config: what `diffexport onnx FOLDER --kv-cache` and transformers read."""
    from transformers import GenerationConfig, PreTrainedTokenizerFast

    ids = dict(pad_token_id=0, bos_token_id=1, eos_token_id=2)
    save_hf_folder(model, folder, max_position_embeddings=context, **ids)
    pad, bos, eos = SPECIAL_TOKENS
    PreTrainedTokenizerFast(tokenizer_object=tok, pad_token=pad, bos_token=bos, eos_token=eos,
                            model_max_length=context, chat_template=CHAT_TEMPLATE).save_pretrained(folder)
    GenerationConfig(**ids).save_pretrained(folder)


def lr_at(step: int, steps: int, peak: float, warmup: int) -> float:
    if step < warmup:
        return peak * (step + 1) / warmup
    progress = (step - warmup) / max(1, steps - warmup)
    return peak * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * progress)))


def train_one(model, args, log, name: str, next_batch, metric: str) -> list[dict]:
    """Train in place on next_batch(rng) -> (inputs, targets; -100 = no loss); returns the
    loss/accuracy history (`metric` names the accuracy in the log)."""
    for layer in model.layers:  # plain torch ops: autograd without re-running the op's reference
        if hasattr(layer.attn, "attrs"):
            layer.attn.impl = "flash_diff_1"
    model.train()
    decay = [p for n, p in model.named_parameters() if p.ndim >= 2]
    no_decay = [p for n, p in model.named_parameters() if p.ndim < 2]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": args.weight_decay},
                             {"params": no_decay, "weight_decay": 0.0}], lr=args.lr, betas=(0.9, 0.95))
    rng = random.Random(args.seed)  # the same batches for both models
    history, start = [], time.monotonic()
    running_loss = running_acc = 0.0
    for step in range(args.steps):
        for group in opt.param_groups:
            group["lr"] = lr_at(step, args.steps, args.lr, args.warmup)
        input_ids, targets = next_batch(rng)
        input_ids, targets = input_ids.to(args.device), targets.to(args.device)
        logits = model(input_ids)
        loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1), targets.flatten(), ignore_index=-100)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        with torch.no_grad():
            answered = targets != -100
            acc = (logits.argmax(-1)[answered] == targets[answered]).float().mean().item()
        running_loss += loss.item()
        running_acc += acc
        if (step + 1) % args.log_every == 0 or step + 1 == args.steps:
            n = args.log_every if (step + 1) % args.log_every == 0 else (step + 1) % args.log_every
            entry = {"step": step + 1, "loss": running_loss / n, "train_accuracy": running_acc / n,
                     "seconds": round(time.monotonic() - start, 1)}
            history.append(entry)
            log(f"{name:12s} step {step + 1:5d}/{args.steps}  loss {entry['loss']:.3f}  "
                f"{metric} {entry['train_accuracy']:.3f}  {entry['seconds']:.0f}s")
            running_loss = running_acc = 0.0
    model.eval()
    for layer in model.layers:
        if hasattr(layer.attn, "attrs"):
            layer.attn.impl = "op"
    return history


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size", default="tiny", choices=sorted(SIZES))
    parser.add_argument("--out-dir", required=True)
    parser.add_argument("--steps", type=int, default=5000)
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--context", type=int, default=64, help="document tokens per sample (needles included); "
                                                                    "with --text, bytes per training window")
    parser.add_argument("--text", help="train byte-level language models on this UTF-8 file instead of the needle task")
    parser.add_argument("--bpe-vocab", type=int, help="with --text: tokens from a byte-level BPE of this many ids "
                                                      "learnt "
                                                      "on the training part, and the pair written as Hugging Face "
                                                      "DiffLlama/Llama folders OUT/diff, OUT/transformer (tokenizer, "
                                                      "chat template; needs transformers)")
    parser.add_argument("--max-needles", type=int, default=6, help="needles per training document: 1..this")
    parser.add_argument("--max-queries", type=int, default=4, help="questions per training document: 1..this "
                                                                     "(more answers per document: denser supervision)")
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--warmup", type=int, default=100)
    parser.add_argument("--weight-decay", type=float, default=0.1)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--threads", type=int, default=2, help="torch CPU threads (part of what makes runs repeatable)")
    parser.add_argument("--log-every", type=int, default=100)
    parser.add_argument("--only", choices=["diff", "transformer"], help="train one of the pair")
    parser.add_argument("--head-dim", type=int, choices=[32, 64, 128],
                        help="head dim (default: the size's, 32); the fused kernel takes 64 and 128")
    parser.add_argument("--device", default="cpu", choices=["cpu", "cuda"], help="where to train (default cpu)")
    args = parser.parse_args(argv)

    def refuse(message: str):  # one line, exit 2, as the CLI refuses
        parser.exit(2, f"error: {message}\n")

    shape = SIZES[args.size]
    for flag, value, low, high in (("--batch", args.batch, 1, MAX_BATCH), ("--threads", args.threads, 1, MAX_THREADS),
                                   ("--steps", args.steps, 1, 10_000_000),
                                   ("--log-every", args.log_every, 1, 10_000_000),
                                   ("--warmup", args.warmup, 0, 10_000_000), ("--max-needles", args.max_needles, 1, 64),
                                   ("--max-queries", args.max_queries, 1, 64)):
        if not low <= value <= high:
            refuse(f"{flag} must be {low} to {high:,}, got {value}")
    if not (args.lr > 0 and args.weight_decay >= 0):  # also refuses nan
        refuse("--lr must be above 0 and --weight-decay at least 0")
    if args.batch * args.context > MAX_BATCH_TOKENS:  # memory for one step grows with both
        refuse(f"--batch {args.batch} x --context {args.context} is {args.batch * args.context:,} tokens a step; "
               f"at most {MAX_BATCH_TOKENS:,}")
    out = Path(args.out_dir)
    if out.is_symlink() or (out.exists() and not out.is_dir()):
        refuse(f"--out-dir {out} is {'a symbolic link' if out.is_symlink() else 'a file'}: give a folder (links are "
               "not followed)")
    if args.head_dim is not None and (shape["n_heads"] * shape["head_dim"]) % args.head_dim:
        parser.error(f"--head-dim {args.head_dim} does not divide size {args.size}'s "
                     f"{shape['n_heads']} x {shape['head_dim']} head width")
    if args.device == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda: torch sees no CUDA device")

    if args.text is not None:  # read and checked before anything is written
        if not 2 <= args.context <= streams.MAX_STREAM_SEQ:
            parser.error(f"--context must be 2 to {streams.MAX_STREAM_SEQ:,} with --text")
        if args.bpe_vocab is not None and not len(SPECIAL_TOKENS) + 256 < args.bpe_vocab <= 1 << 16:
            parser.error(f"--bpe-vocab must be {len(SPECIAL_TOKENS) + 257} to 65,536 (the 256 bytes, the special "
                         f"tokens, then merges)")
        try:
            train_text, held_text = text_corpus(args.text, args.context)
        except DiffExportError as exc:
            parser.exit(2, f"error: {exc}\n")
    elif args.bpe_vocab is not None:
        parser.error("--bpe-vocab goes with --text")

    torch.set_num_threads(args.threads)
    # cuBLAS is deterministic only with a fixed workspace; set before CUDA starts (a user's value wins)
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    torch.use_deterministic_algorithms(True, warn_only=args.device == "cuda")
    outputs = [out / "heldout.txt", out / (f"train_log-{args.only}.json" if args.only else "train_log.json")]
    outputs += [out / (name if args.bpe_vocab else f"{name}.pt") for name in ("diff", "transformer")]
    try:
        for path in outputs:  # an earlier run's files are replaced; a link is never written through
            check_output_path(path, replace=True)
        out.mkdir(parents=True, exist_ok=True)
    except (DiffExportError, OSError) as exc:
        refuse(str(exc))

    def log(message):
        print(message, file=sys.stderr, flush=True)

    token_bytes = tok = None
    if args.text is not None:
        atomic_write(out / "heldout.txt", lambda tmp: Path(tmp).write_text(held_text, encoding="utf-8"))
        train_bytes, held_bytes = len(train_text.encode("utf-8")), len(held_text.encode("utf-8"))
        if args.bpe_vocab is None:
            train_ids, held_ids = byte_ids(train_text.encode("utf-8")), byte_ids(held_text.encode("utf-8"))
            vocab, metric = BYTE_VOCAB, "next-byte accuracy"
        else:
            tok = bpe_tokenizer(train_text, args.bpe_vocab)
            train_ids = torch.tensor(tok.encode(train_text).ids)
            held_ids = torch.tensor(tok.encode(held_text).ids)
            token_bytes = token_byte_lengths(tok)
            vocab, metric = tok.get_vocab_size(), "next-token accuracy"
            log(f"byte-level BPE of {vocab:,} ids: {train_bytes / len(train_ids):.2f} bytes per training token")
        log(f"text {args.text}: {train_bytes:,} training bytes, {held_bytes:,} held out -> {out / 'heldout.txt'}")

        def next_batch(rng):
            return text_batch(rng, train_ids, args.batch, args.context)
        cfg = diff_config(args.size, args.head_dim, vocab, hf=tok is not None)
        task = {"name": streams.TEXT_TASK_NAME, "context_len": args.context, "source": Path(args.text).name,
                "train_bytes": train_bytes, "heldout_bytes": held_bytes}
    else:
        def next_batch(rng):
            return needle_task.training_batch(rng, args.batch, args.context, args.max_needles, args.max_queries)
        metric = "answer accuracy"
        cfg = diff_config(args.size, args.head_dim)
        task = {"name": needle_task.TASK_NAME, "context_len": args.context}
    configs = {"diff": cfg, "transformer": baseline_for(cfg)}
    report = {"args": vars(args), "torch": torch.__version__, "models": {}}
    for name, model_cfg in configs.items():
        if args.only and name != args.only:
            continue
        model = build_model(model_cfg, seed=args.seed).train().to(args.device)  # seeded on the CPU: same start
        log(f"{name}: {model_cfg.family}, {model.num_parameters():,} parameters on {args.device}")
        history = train_one(model, args, log, name, next_batch, metric)
        entry = {"family": model_cfg.family, "parameters": model.num_parameters(), "history": history}
        if args.text is not None:
            entry["heldout_bits_per_byte"] = bits_per_byte(model, held_ids, args.context, args.batch, args.device,
                                                           token_bytes=token_bytes)
            if tok is None:
                path = save_checkpoint(model.cpu(), out / f"{name}.pt", task=task)  # a checkpoint loads anywhere
            else:
                path = out / name
                write_hf_folder(model.cpu(), path, tok, args.context)
            log(f"{name:12s} held-out {entry['heldout_bits_per_byte']:.3f} bits per byte -> {path}")
        else:
            entry["eval_accuracy"] = needles.evaluate(model, context_len=args.context, samples=16,
                                                      seed=args.seed + 1).accuracy()
            path = save_checkpoint(model.cpu(), out / f"{name}.pt", task=task)  # a checkpoint loads anywhere
            log(f"{name:12s} held-out retrieval accuracy {entry['eval_accuracy']:.3f} -> {path}")
        report["models"][name] = entry
    atomic_write(outputs[1], lambda tmp: Path(tmp).write_text(json.dumps(report, indent=2) + "\n"))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
