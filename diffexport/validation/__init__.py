"""Validation: every artifact diffexport writes, checked against an eager reference (and against
transformers for Hugging Face checkpoints), with polygraphy files that repeat each comparison. One
module per kind of check (prefill, engine, decoder, search, against), the options and references
they share, and `artifact.check_artifact`, which routes a path to the right one. This layer imports
backends and format, never the reverse.
"""
