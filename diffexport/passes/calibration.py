"""Calibration data for the quantisers that need it (`--qdq`, `--method gptq`): token ids from the
user's text or a seeded synthetic stream, cut into sequences, fed to onnxruntime's calibration
through its CalibrationDataReader. KV-cache graphs get an empty cache (the prefill step), so
both prefill exports and decoder folders calibrate on the same tokens."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import numpy as np

from diffexport.core.errors import DiffExportError
from diffexport.core.lazy import lazy_import
from diffexport.core.progress import Progress
from diffexport.format import names
from diffexport.format.metadata_keys import CONFIG, stored_metadata

streams = lazy_import("diffexport.inputs.streams")

SYNTHETIC = "synthetic"
BATCH = 8  # sequences per calibration forward pass (ranges and Hessians do not depend on it)


MAX_CALIBRATION_TOKENS = 1 << 20  # 4096 x 65536 synthetic took 5.3 GB and 2 minutes before GPTQ refused it


@dataclasses.dataclass
class CalibrationFields:
    """The calibration part of a quantiser's options."""
    calib: str | None = None  # "synthetic", or a UTF-8 text file
    tokenizer: str | None = None  # Hugging Face tokenizer for a text file (else its bytes are the ids)
    samples: int = 32  # calibration sequences
    seq_len: int = 128  # tokens per calibration sequence
    seed: int = 0  # synthetic calibration ids

    def validate_calibration(self, needed_by: str | None) -> None:
        """needed_by: the option that needs calibration data (None: nothing does, so none may be given)."""
        if needed_by is None:
            if self.calib is not None or self.tokenizer is not None:
                raise DiffExportError("--calib/--tokenizer belong to --qdq and --method gptq: round-to-nearest and "
                                      "HQQ weights need no calibration")
            return
        if self.calib is None:
            raise DiffExportError(f"{needed_by} needs calibration data: --calib TEXTFILE [--tokenizer T], or --calib "
                                  "synthetic (seeded token ids; a real text from the deployment domain is better)")
        if not 1 <= self.samples <= 4096:
            raise DiffExportError(f"--calib-samples {self.samples}: use 1..4096")
        if not 1 <= self.seq_len <= 65536:
            raise DiffExportError(f"--calib-seq-len {self.seq_len}: use 1..65536")
        if self.samples * self.seq_len > MAX_CALIBRATION_TOKENS:  # GPTQ's usual 128 x 2048 is 262,144
            raise DiffExportError(f"--calib-samples {self.samples} x --calib-seq-len {self.seq_len} is "
                                  f"{self.samples * self.seq_len:,} tokens; calibration takes at most "
                                  f"{MAX_CALIBRATION_TOKENS:,}")
        if self.tokenizer is not None and self.calib == SYNTHETIC:
            raise DiffExportError("--tokenizer goes with a --calib text file, not --calib synthetic")


def vocab_size(model, path: Path) -> int:
    """The export's vocabulary, from its diffexport config (calibration ids must lie below it)."""
    try:
        return int(json.loads(stored_metadata(model)[CONFIG])["vocab_size"])
    except (KeyError, ValueError, TypeError, RecursionError):
        raise DiffExportError(f"{path} carries no diffexport config, so calibration cannot choose token ids: "
                              "quantise an export written by `diffexport onnx`") from None


def batches(options: CalibrationFields, vocab: int) -> tuple[list[np.ndarray], str]:
    """Calibration inputs [batch, seq_len] int64, and where they came from."""
    if options.calib == SYNTHETIC:
        ids, _, source = streams.synthetic_ids(vocab, options.samples * options.seq_len, options.seq_len,
                                               options.seed)
        source = f"{options.samples} x {options.seq_len} synthetic tokens ({source}, seed {options.seed})"
    else:
        ids = streams.text_ids(options.calib, options.tokenizer, vocab)
        if len(ids) < options.seq_len:
            raise DiffExportError(f"{options.calib} has {len(ids)} tokens, fewer than one calibration sample of "
                                  f"{options.seq_len}: give more text or a smaller --calib-seq-len")
        samples = min(options.samples, len(ids) // options.seq_len)
        source = (f"{samples} x {options.seq_len} tokens of {options.calib} "
                  f"({'tokenizer ' + options.tokenizer if options.tokenizer else 'UTF-8 bytes'})")
        ids = ids[:samples * options.seq_len]
    data = np.asarray(ids, dtype=np.int64).reshape(-1, options.seq_len)
    return [data[i:i + BATCH] for i in range(0, len(data), BATCH)], source


def feeds(model, ids: np.ndarray) -> dict[str, np.ndarray]:
    """One calibration run's inputs: the ids, and for a KV-cache graph a mask of ones and an empty
    cache (the prefill step). An input we do not know is refused rather than guessed."""
    from onnx import helper


    batch, seq = ids.shape
    out = {}
    initializers = {t.name for t in model.graph.initializer}
    for value in model.graph.input:
        if value.name in initializers:
            continue
        t = value.type.tensor_type
        if value.name == names.INPUT_IDS:
            out[value.name] = ids
        elif value.name == names.ATTENTION_MASK:
            out[value.name] = np.ones((batch, seq), helper.tensor_dtype_to_np_dtype(t.elem_type))
        elif names.is_past(value.name) and len(t.shape.dim) == 4:
            dims = [d.dim_value if d.HasField("dim_value") else None for d in t.shape.dim]
            dtype = helper.tensor_dtype_to_np_dtype(t.elem_type)
            out[value.name] = np.zeros((batch, dims[1] or 1, 0, dims[3] or 1), dtype)
        else:
            raise DiffExportError(f"calibration does not know how to feed the graph input {value.name!r}: quantise "
                                  "an export written by `diffexport onnx`")
    return out


def reader(model, data: list[np.ndarray], label: str):
    """An onnxruntime CalibrationDataReader over `data` that shows progress; copies (GPTQ deep-copies
    its reader) start again from the first batch."""
    from onnxruntime.quantization import CalibrationDataReader

    prepared = [feeds(model, ids) for ids in data]
    total = sum(len(ids) for ids in data)

    class Reader(CalibrationDataReader):
        def __init__(self):
            self.pending = iter(prepared)
            self.progress = Progress(label, total, min_total=1)

        def get_next(self):
            feed = next(self.pending, None)
            if feed is None:
                self.progress.close()
                return None
            self.progress.advance(len(next(iter(feed.values()))))
            return feed

        def __deepcopy__(self, memo):
            return Reader()

    return Reader()
