"""One entry for `diffexport check`: a path routed by the kind of artifact it is (a KV-cache decoder
folder, a TensorRT engine, a single ONNX graph, or a graph against another), each kind's options
checked and its export metadata read before the model is loaded.
"""

from __future__ import annotations

from pathlib import Path
from typing import Callable

from diffexport.backends.tensorrt import read_engine_record, sidecar_path
from diffexport.core.errors import DiffExportError
from diffexport.format.decoder_folder import read_decoder_folder
from diffexport.format.metadata import check_export_metadata, read_export_metadata
from diffexport.format.names import ENGINE_SUFFIXES
from diffexport.modeling.checkpoint import LoadedModel
from diffexport.validation.against import run_against
from diffexport.validation.decoder import run_decoder_check
from diffexport.validation.engine import run_engine_check
from diffexport.validation.options import DECODE_STEPS, CheckOptions, CheckReport, check_decode_options
from diffexport.validation.prefill import run_prefill_check

# Options that need a decoder (a folder; all but --sample, its engine too), in the order they are
# refused: each is said before anything loads.
DECODER_ONLY = (
    ("plot", ("onnx",), "--plot draws a KV-cache check step by step: give a --kv-cache folder (or its engine)"),
    ("steps", ("onnx",), "--steps counts the decode steps of a --kv-cache folder (or its engine); {name} is a "
                         "single graph: use --shapes"),
    ("sample", ("onnx", "engine"), "--sample checks onnxruntime-genai's sampling on a --kv-cache folder; {name} is "
                                   "not one"),
    ("num_beams", ("onnx",), "--num-beams checks beam search on a --kv-cache folder (or its engine); {name} is a "
                             "single graph"),
)
DECODER_SHAPES = ("--shapes sizes the calls to a single graph; a KV-cache decoder is checked on 3 padded prompts, "
                  "prefill + --steps N decode steps (--text FILE adds your own text)")


def artifact_kind(path: str | Path) -> str:
    """'decoder' (a folder), 'engine' (a TensorRT engine file) or 'onnx'."""
    path = Path(path)
    if path.is_dir():
        return "decoder"
    return "engine" if path.suffix in ENGINE_SUFFIXES else "onnx"


def check_artifact(path: str | Path, options_for: Callable[[dict | None], CheckOptions],
                   load_model: Callable[[dict], LoadedModel] | None, *, against: str | Path | None = None,
                   steps: int | None = None, shapes_given: bool = False, plot: bool = False, sample: bool = False,
                   num_beams: int | None = None, log: Callable[[str], None] | None = None) -> list[CheckReport]:
    """Check `path` against its reference -> the reports (two with `against`: graph against graph,
    then the model, unless load_model is None).
    options_for(the folder's genai_config, or None) builds the options; load_model(the export's
    metadata) loads the reference model, once every option and the artifact's metadata passed."""
    path, kind = Path(path), artifact_kind(path)
    asked = {"plot": plot, "steps": steps is not None, "sample": sample, "num_beams": num_beams is not None}
    for option, refused_on, message in DECODER_ONLY:
        if asked[option] and kind in refused_on:
            raise DiffExportError(message.format(name=path.name))
    if against is not None:  # one graph against another (e.g. optimize's output against its input), then the model
        options = options_for(None)
        reports = [run_against(path, against, options, log=log)]
        if load_model is None:
            return reports
        options.save_dir = Path(str(options.save_dir or path.with_suffix(".check")) + "-model")
        meta = read_export_metadata(path)  # the model comparison needs diffexport's metadata
        return reports + [run_prefill_check(path, load_model(meta), options, log=log)]
    if kind == "decoder":

        _, folder_config, meta = read_decoder_folder(path)  # not a decoder folder: said before the checkpoint loads
        if shapes_given:
            raise DiffExportError(DECODER_SHAPES)
        options, steps = options_for(folder_config), DECODE_STEPS if steps is None else steps
        check_decode_options(options, steps)  # bad options fail before the checkpoint loads
        return [run_decoder_check(path, load_model(meta), options, log=log, steps=steps)]
    if kind == "engine":

        record = read_engine_record(path)  # a missing record fails before the checkpoint loads
        if record.get("onnx_metadata", {}).get("kv_cache") == "1" and shapes_given:
            raise DiffExportError(DECODER_SHAPES)
        options = options_for(None)
        check_decode_options(options, DECODE_STEPS if steps is None else steps)
        meta = check_export_metadata(record["onnx_metadata"], sidecar_path(path))
        return [run_engine_check(path, load_model(meta), options, log=log, steps=steps)]
    meta = read_export_metadata(path)  # a corrupt or foreign file fails before the checkpoint loads
    options = options_for(None)
    return [run_prefill_check(path, load_model(meta), options, log=log)]
