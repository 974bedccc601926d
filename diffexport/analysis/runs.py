"""The loops the analysis commands (stats, quant-sweep, linear-sweep) share: each model's token
stream, its task metric when it was trained on the needle task, and the positions a sweep compares,
each model with its own progress."""

from __future__ import annotations

import dataclasses
from typing import Callable

from diffexport.analysis import needles
from diffexport.core.errors import DiffExportError
from diffexport.core.progress import Progress
from diffexport.inputs import needle_task
from diffexport.inputs.streams import TEXT_TASK_NAME, stream_batches, task_context_len


@dataclasses.dataclass
class StreamOptions:
    text: str | None = None        # a text file to tokenise (else the built-in needle-task stream)
    tokenizer: str | None = None   # its tokenizer folder
    tokens: int = 8192             # tokens to stream
    seq_len: int | None = None     # sequence length (None: the checkpoint's task length, else 256)
    batch: int = 4
    seed: int = 0


def progress_bar(label: str, total: int):
    """(a Progress to enter, advance(done) that moves it to `done`)."""

    progress = Progress(label, total)
    return progress, (lambda done: progress.advance(done - progress.done))


def model_stream(loaded, options: StreamOptions):
    """The token batches a model is measured on: when none is given, the sequence length of its own
    training task (a needle-task document, or a text-trained model's window), else 256."""
    seq_len = options.seq_len
    if seq_len is None:
        needles_context = task_context_len(loaded.task, needle_task.TASK_NAME)
        text_context = task_context_len(loaded.task, TEXT_TASK_NAME)
        seq_len = (needle_task.stream_sequence_len(needles_context) if needles_context
                   else max(2, text_context) if text_context else 256)
    return stream_batches(loaded.config.vocab_size, text=options.text, tokenizer=options.tokenizer,
                          tokens=options.tokens, seq_len=seq_len, batch=options.batch, seed=options.seed)


def task_evaluator(name: str, loaded, task: str = "auto", samples: int = 32, seed: int = 0):
    """(quant, attention=None) -> needle retrieval accuracy, when the checkpoint was trained on that
    task (or task is "needles"); None otherwise. Each evaluation shows its own progress."""
    trained = loaded.task or {}
    wanted = task if task != "auto" else trained.get("name")
    if wanted != needle_task.TASK_NAME:
        return None
    context = task_context_len(trained, needle_task.TASK_NAME) or 128

    def evaluate(quant, attention=None):
        setting = f" ({quant.describe()} logits)" if quant is not None and quant.active else ""
        cells = needle_task.grid(needle_task.DEFAULT_NEEDLES, needle_task.DEFAULT_QUERIES, needle_task.DEFAULT_DEPTHS)
        progress, advance = progress_bar(f"{name}: task accuracy{setting}", len(cells))
        with progress:
            return needles.accuracy(loaded.model, context_len=context, samples=samples, seed=seed + 1,
                                    quant=quant, attention=attention, progress=lambda done, total: advance(done))
    return evaluate


def sweep_models(models: dict, label: str, run, stream_options: StreamOptions, *, positions: str = "auto",
                 task: str = "auto", samples: int = 32, log: Callable[[str], None] = print, note: str = "") -> dict:
    """For every model (label -> LoadedModel): its stream, task metric and compared positions, then
    run(name, loaded, stream, task_eval, masks, advance) -> its points. positions: "answers" (the
    needle task's answer tokens), "all", or "auto" (answers when the model has the task)."""
    results = {}
    for name, loaded in models.items():
        stream = model_stream(loaded, stream_options)
        task_eval = task_evaluator(name, loaded, task, samples, stream_options.seed)
        if positions == "answers" and stream.answer_masks is None:
            raise DiffExportError(f"{name}: --positions answers needs the built-in needle-task stream "
                                  f"(no --text, a vocabulary of at least 512)")
        answers_only = positions == "answers" or (positions == "auto" and task_eval is not None)
        masks = stream.answer_masks if answers_only else None  # auto without task answers: every position
        progress, advance = progress_bar(f"{name}: {label}", len(stream.batches))
        with progress:
            results[name] = run(name, loaded, stream, task_eval, masks, advance)
        compared = stream.tokens if masks is None else int(sum(m.sum() for m in masks))
        log(f"{name}: {stream.source}, {stream.tokens:,} tokens; cosine/KL over "
            f"{'the ' + format(compared, ',') + ' answer positions' if masks is not None else 'every position'}"
            f"{note}")
    return results
