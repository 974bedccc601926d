"""Validation: every artifact diffexport writes, checked against an eager reference (and against
transformers for Hugging Face checkpoints), with polygraphy files that repeat each comparison. One
module per kind of check (prefill, engine, decoder, search, against), the options and references
they share, and `check_artifact`, which routes a path to the right one. This layer imports
backends and format, never the reverse.
"""

from __future__ import annotations

from diffexport.validation.against import run_against  # noqa: F401
from diffexport.validation.decoder import run_decoder_check  # noqa: F401
from diffexport.validation.engine import run_engine_check  # noqa: F401
from diffexport.validation.options import (  # noqa: F401
    CHECK_DRAWS,
    DECODE_STEPS,
    DEFAULT_SHAPES,
    MAX_CHECK_SHAPE,
    CheckOptions,
    CheckReport,
    check_decode_options,
    check_same_config,
    check_same_model,
    parse_shapes,
)
from diffexport.validation.prefill import run_check  # noqa: F401
from diffexport.validation.artifact import artifact_kind, check_artifact  # noqa: F401
from diffexport.validation.references import REFERENCES, resolve_reference  # noqa: F401
