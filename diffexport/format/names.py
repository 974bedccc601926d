"""Names every layer agrees on: a KV-cache decoder graph's inputs and outputs, the decoder folder's
files, the dtypes an export is written in, and the prefix of diffexport's ONNX metadata.

The decoder graph (docs/EXPORT.md):
  inputs   input_ids [B, S] int64, attention_mask [B, P+S] int64, past_key_values.{i}.key / .value
  outputs  logits [B, S, V], present.{i}.key / .value
"""

from __future__ import annotations

import torch

MODEL_FILE = "model.onnx"
GENAI_CONFIG = "genai_config.json"
PAST_KEY, PAST_VALUE = "past_key_values.%d.key", "past_key_values.%d.value"
PRESENT_KEY, PRESENT_VALUE = "present.%d.key", "present.%d.value"
INPUT_IDS, ATTENTION_MASK, LOGITS = "input_ids", "attention_mask", "logits"

# A prefill graph's (diffexport onnx without --kv-cache) only input.
PREFILL_INPUT_NAMES = (INPUT_IDS,)

# The dtypes an export is written in, by the name its metadata records.
DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}

PAST_PREFIX, PRESENT_PREFIX = PAST_KEY.split("%")[0], PRESENT_KEY.split("%")[0]  # "past_key_values.", "present."


def is_past(name: str) -> bool:
    """Whether a graph input is a layer's past key or value."""
    return name.startswith(PAST_PREFIX)


def cache_layers(input_names) -> int:
    """The layers whose past keys a decoder graph takes (0: not a KV-cache decoder)."""
    return sum(1 for name in input_names if is_past(name) and name.endswith(".key"))


def past_of(present: str) -> str:
    """The past input a present output is fed back into at the next step."""
    return PAST_PREFIX + present[len(PRESENT_PREFIX):]


def decoder_input_names(layers: int) -> list[str]:
    return [INPUT_IDS, ATTENTION_MASK] + [name % i for i in range(layers) for name in (PAST_KEY, PAST_VALUE)]


def decoder_output_names(layers: int) -> list[str]:
    return [LOGITS] + [name % i for i in range(layers) for name in (PRESENT_KEY, PRESENT_VALUE)]

# A TensorRT engine file (its build record sits beside it as NAME.json).
ENGINE_SUFFIXES = (".engine", ".plan", ".trt")

TOKENIZER_MODELS = ("tokenizer.json", "tokenizer.model")  # one of them makes a folder a tokenizer
