"""Moved to the `diffexport.validation` package (one module per kind of check); this module keeps the old
names importable, private ones included.
"""

from __future__ import annotations

from diffexport.format.metadata import check_export_metadata, read_export_metadata  # noqa: F401
from diffexport.format.names import DTYPES, META_PREFIX  # noqa: F401
from diffexport.format.names import PREFILL_INPUT_NAMES as INPUT_NAMES  # noqa: F401
from diffexport.validation.options import DEFAULT_SHAPES  # noqa: F401
from diffexport.validation.options import MAX_CHECK_SHAPE  # noqa: F401
from diffexport.validation.options import EAGER_RUNNER  # noqa: F401
from diffexport.validation.options import DECODE_STEPS  # noqa: F401
from diffexport.validation.options import DECODE_PROMPTS  # noqa: F401
from diffexport.validation.options import DECODE_RIGHT_PADDED  # noqa: F401
from diffexport.validation.options import CheckOptions  # noqa: F401
from diffexport.validation.options import CheckReport  # noqa: F401
from diffexport.validation.options import parse_shapes  # noqa: F401
from diffexport.validation.options import check_same_config  # noqa: F401
from diffexport.validation.options import check_same_model  # noqa: F401
from diffexport.validation.options import save_dir_for  # noqa: F401
from diffexport.validation.options import TextIds  # noqa: F401
from diffexport.validation.options import CHECK_DRAWS  # noqa: F401
from diffexport.validation.options import check_decode_options  # noqa: F401
from diffexport.validation.references import eager_models as _eager_models  # noqa: F401
from diffexport.validation.references import run_eager as _run_eager  # noqa: F401
from diffexport.validation.references import REFERENCES  # noqa: F401
from diffexport.validation.references import resolve_reference  # noqa: F401
from diffexport.validation.references import _transformers_class  # noqa: F401
from diffexport.validation.references import transformers_models as _transformers_models  # noqa: F401
from diffexport.validation.references import run_transformers as _run_transformers  # noqa: F401
from diffexport.validation.references import hf_generator as _hf_generator  # noqa: F401
from diffexport.validation.references import _plain_generation_config  # noqa: F401
from diffexport.validation.references import hf_greedy as _hf_greedy  # noqa: F401
from diffexport.validation.references import hf_beams as _hf_beams  # noqa: F401
from diffexport.validation.compare import _save_polygraphy  # noqa: F401
from diffexport.validation.compare import judge as _judge  # noqa: F401
from diffexport.validation.compare import severity as _severity  # noqa: F401
from diffexport.validation.compare import count_tokens as _tokens  # noqa: F401
from diffexport.validation.compare import compare_outputs as _compare  # noqa: F401
from diffexport.validation.compare import finish_report as _finish  # noqa: F401
from diffexport.validation.search import beam_check as _beam_check  # noqa: F401
from diffexport.validation.search import SAMPLING_P_VALUE  # noqa: F401
from diffexport.validation.search import SAMPLING_MIN_EXPECTED  # noqa: F401
from diffexport.validation.search import sampling_check as _sampling_check  # noqa: F401
from diffexport.validation.search import _chi_square  # noqa: F401
from diffexport.validation.decoder import run_decoder_check  # noqa: F401
from diffexport.validation.decoder import decode_check as _decode_check  # noqa: F401
from diffexport.validation.decoder import TEXT_TOKENS  # noqa: F401
from diffexport.validation.decoder import TEXT_WINDOW  # noqa: F401
from diffexport.validation.decoder import _text_check  # noqa: F401
from diffexport.validation.prefill import run_check  # noqa: F401
from diffexport.validation.engine import run_engine_check  # noqa: F401
from diffexport.validation.engine import _engine_logit_quant  # noqa: F401
from diffexport.validation.against import ORT_DTYPES  # noqa: F401
from diffexport.validation.against import run_against  # noqa: F401
