"""Weight-only quantisation for ONNX Runtime and onnxruntime-genai: MatMul weights to INT4/INT8
MatMulNBits through onnxruntime's own quantiser (onnxruntime.quantization). DiffAttention nodes and
their function body are left as they are: they hold no weights, and the plugin/body take the
activations in the export's precision.

Works on a prefill export (one .onnx file) and on a KV-cache folder (model.onnx quantised,
genai_config.json and the tokenizer carried over, so onnxruntime-genai runs the result).
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
import os
import shutil
import sys
import time
import warnings
from pathlib import Path
from typing import Callable

from diffexport.core.errors import DiffExportError
from diffexport.core.files import check_output_path, load_onnx, require_file, staging_folder, staging_model_file
from diffexport.core.onnxruntime_session import open_session
from diffexport.core.progress import Progress
from diffexport.export import exporter
from diffexport.format import model_card
from diffexport.format import names as format_names
from diffexport.format.decoder_folder import read_decoder_folder
from diffexport.format.metadata_keys import WEIGHT_QUANT, WEIGHT_RECORDS, stored_key
from diffexport.format.nodes import sort_topologically
from diffexport.passes import calibration, kv_cache_quant
from diffexport.passes.onnxruntime_fusions import pack_shared_input_matmuls

BITS = (4, 8)
BLOCK_SIZES = (16, 32, 64, 128, 256)
METHODS = ("rtn", "hqq", "gptq")  # gptq calibrates on --calib batches
META_KEY = stored_key(WEIGHT_QUANT)
QUANT_META_KEYS = tuple(map(stored_key, WEIGHT_RECORDS))  # weight-only here, Q/DQ in passes/qdq.py
# Ops that mean a graph already holds quantised weights: quantising again would stack two errors.
QUANTISED_OPS = {"MatMulNBits", "DequantizeLinear", "QuantizeLinear", "MatMulInteger", "QLinearMatMul",
                 "GatherBlockQuantized", "DynamicQuantizeLinear"}


@dataclasses.dataclass
class WeightQuantOptions(calibration.CalibrationFields):
    bits: int = 4
    block_size: int = 32
    method: str = "rtn"
    symmetric: bool = True
    # 4: the matmul runs on int8 activations (ONNX Runtime's fast CPU path, what onnxruntime-genai's
    # model builder picks for CPU int4); 0 leaves ONNX Runtime's default (fp32 compute).
    accuracy_level: int = 4
    force: bool = False  # replace an output that is already there (else it is refused)
    kv_cache: str | None = None  # "int8": GroupQueryAttention's cache too, calibrated (passes/kv_cache_quant.py)

    def validate(self) -> None:
        if self.bits not in BITS:
            raise DiffExportError(f"--weights int{self.bits}: MatMulNBits takes int4 or int8")
        if self.block_size not in BLOCK_SIZES:
            raise DiffExportError(f"--block-size {self.block_size}: use one of {', '.join(map(str, BLOCK_SIZES))}")
        if self.method not in METHODS:
            raise DiffExportError(f"--method {self.method}: use one of {', '.join(METHODS)}")
        if self.method in ("hqq", "gptq") and self.bits != 4:
            raise DiffExportError(f"--method {self.method} quantises to int4 only (onnxruntime's "
                                  f"{self.method.upper()}): use --weights int4 or --method rtn")
        if self.kv_cache not in (None, "int8"):
            raise DiffExportError(f"--kv-cache {self.kv_cache}: the cache quantises to int8")
        self.validate_calibration("--method gptq" if self.method == "gptq" else
                                  "--kv-cache int8" if self.kv_cache else None)
        if self.accuracy_level not in (0, 1, 2, 3, 4):
            raise DiffExportError(f"accuracy level {self.accuracy_level}: use 0..4")

    def describe(self) -> str:
        return (f"int{self.bits}, block {self.block_size}, {self.method}, "
                f"{'symmetric' if self.symmetric else 'asymmetric'}"
                + (f"; {self.kv_cache} KV cache" if self.kv_cache else ""))


@dataclasses.dataclass
class WeightQuantSummary:
    output: Path
    quantised: int  # MatMul nodes turned into MatMulNBits
    skipped: list[str]  # MatMul nodes with a weight left as it was, and why
    bytes_before: int  # weight bytes (initializers) before and after
    bytes_after: int
    options: WeightQuantOptions
    seconds: float

    def lines(self) -> list[str]:
        ratio = self.bytes_before / max(self.bytes_after, 1)
        out = [f"quantised     {self.quantised} MatMul weights to MatMulNBits ({self.options.describe()})",
               f"weights       {self.bytes_before / 1e6:,.1f} MB -> {self.bytes_after / 1e6:,.1f} MB ({ratio:.2f}x "
               "smaller)"]
        if self.skipped:
            out.append(f"kept          {len(self.skipped)} MatMul weight(s) as they were: "
                       f"{'; '.join(self.skipped[:3])}")
        out.append(f"wrote         {self.output} in {self.seconds:.1f}s")
        return out


def _log_default(message: str) -> None:
    print(message, file=sys.stderr)


def materialise_transposed_weights(model) -> int:
    """MatMul(x, Transpose(W)) with W a 2-D float initializer, as a tied LM head reads the embedding
    table (the exporter folds that Transpose for small tables only), gets its own transposed copy
    of W: the quantisers take only a constant [K, N] weight, and a runtime Transpose would
    otherwise leave the largest matmul in float. W stays for the Gather that reads it. Returns how
    many weights were materialised; the model is changed in place."""
    from onnx import TensorProto, numpy_helper

    inits = {t.name: t for t in model.graph.initializer}
    floats = (TensorProto.FLOAT, TensorProto.FLOAT16, TensorProto.BFLOAT16)
    consumers: dict[str, list] = {}
    for node in model.graph.node:
        for name in node.input:
            consumers.setdefault(name, []).append(node)
    graph_outputs = {o.name for o in model.graph.output}
    done = 0
    for node in list(model.graph.node):
        if node.op_type != "Transpose" or node.domain not in ("", "ai.onnx") or node.input[0] not in inits:
            continue
        weight = inits[node.input[0]]
        perm = next((list(a.ints) for a in node.attribute if a.name == "perm"), [1, 0])
        users = consumers.get(node.output[0], [])
        if (len(weight.dims) != 2 or weight.data_type not in floats or perm != [1, 0] or not users
                or node.output[0] in graph_outputs
                or not all(u.op_type == "MatMul" and list(u.input).index(node.output[0]) == 1 for u in users)):
            continue
        name = f"{weight.name}.transposed"
        while name in inits:
            name += "_"
        if weight.data_type == TensorProto.BFLOAT16:  # numpy has no bfloat16: move the raw 16-bit words
            import numpy as np

            words = np.frombuffer(numpy_helper.to_array(weight).tobytes(), np.uint16).reshape(list(weight.dims))
            copy = TensorProto(name=name, data_type=weight.data_type, dims=list(weight.dims)[::-1],
                               raw_data=np.ascontiguousarray(words.T).tobytes())
        else:
            copy = numpy_helper.from_array(numpy_helper.to_array(weight).T.copy(), name)
        model.graph.initializer.append(copy)
        inits[name] = copy
        for user in users:
            user.input[1] = name
        model.graph.node.remove(node)
        done += 1
    return done


def quantisable_matmuls(model) -> tuple[list[str], list[str]]:
    """(names of MatMul nodes whose B input is a 2-D float weight, reasons for the other weight
    MatMuls). MatMulNBits takes a constant [K, N] B; K need not divide the block (it is padded)."""
    from onnx import TensorProto

    inits = {t.name: t for t in model.graph.initializer}
    floats = (TensorProto.FLOAT, TensorProto.FLOAT16, TensorProto.BFLOAT16)
    # a weight read through Transpose (a tied LM head) counts: materialise_transposed_weights gives it a constant
    transposed = {n.output[0]: n.input[0] for n in model.graph.node
                  if n.op_type == "Transpose" and n.input[0] in inits and len(inits[n.input[0]].dims) == 2
                  and next((list(a.ints) for a in n.attribute if a.name == "perm"), [1, 0]) == [1, 0]}
    names, skipped = [], []
    for node in model.graph.node:
        if node.op_type != "MatMul" or node.domain not in ("", "ai.onnx"):
            continue
        source = node.input[1] if node.input[1] in inits else transposed.get(node.input[1])
        if source is None:
            continue
        weight = inits[source]
        if len(weight.dims) != 2:
            skipped.append(f"{node.name} ({len(weight.dims)}-D weight)")
        elif weight.data_type not in floats:
            skipped.append(f"{node.name} (weight type {TensorProto.DataType.Name(weight.data_type)})")
        else:
            names.append(node.name)
    return names, skipped


def initializer_bytes(model) -> int:
    from onnx.external_data_helper import uses_external_data

    total = 0
    for t in model.graph.initializer:
        if uses_external_data(t):
            total += next((int(e.value) for e in t.external_data if e.key == "length"), 0)
        else:
            total += len(t.raw_data) or t.ByteSize()
    return total


def check_input(model, path: Path) -> tuple[list[str], list[str]]:
    present = {n.op_type for n in model.graph.node} & QUANTISED_OPS
    if present or any(p.key in QUANT_META_KEYS for p in model.metadata_props):
        raise DiffExportError(f"{path} is already quantised ({', '.join(sorted(present)) or META_KEY}): quantise "
                              "the unquantised export instead")
    names, skipped = quantisable_matmuls(model)
    if not names:
        raise DiffExportError(f"{path} has no MatMul with a constant 2-D float weight: nothing to quantise"
                              + (f" ({'; '.join(skipped[:2])})" if skipped else ""))
    nodes = [n.name for n in model.graph.node]
    if len(set(nodes)) != len(nodes) or not all(nodes):
        raise DiffExportError(f"{path}: its nodes need unique names for the quantiser (run `diffexport optimize` "
                              "on it first)")
    return names, skipped


def _quantise(model, names: list[str], options: WeightQuantOptions, data=None):
    """onnxruntime's MatMulNBitsQuantizer, a chunk of nodes at a time so that progress shows (GPTQ:
    all at once, calibrated on `data`)."""
    from onnxruntime.quantization import matmul_nbits_quantizer as mnq

    logging.getLogger("onnxruntime.quantization.matmul_nbits_quantizer").setLevel(logging.WARNING)
    if options.method == "gptq":
        config = mnq.GPTQWeightOnlyQuantConfig(calibration_data_reader=calibration.reader(model, data, "calibrating"))
        quantiser = mnq.MatMulNBitsQuantizer(model, bits=4, block_size=options.block_size,
                                             is_symmetric=options.symmetric,
                                             accuracy_level=options.accuracy_level or None,
                                             nodes_to_include=names, algo_config=config)
        with contextlib.redirect_stdout(sys.stderr):  # its progress bar prints to stdout
            quantiser.process()
        model = quantiser.model.model
        if not any(o.domain == "com.microsoft" for o in model.opset_import):  # its GPTQ path omits it
            model.opset_import.add(domain="com.microsoft", version=1)
        return model
    if options.method == "hqq":
        config = mnq.HQQWeightOnlyQuantConfig(block_size=options.block_size, bits=options.bits)
    else:
        config = mnq.DefaultWeightOnlyQuantConfig(block_size=options.block_size, is_symmetric=options.symmetric,
                                                  bits=options.bits, accuracy_level=options.accuracy_level or None)
    chunk = max(1, len(names) // 20)
    with Progress("quantising", len(names), min_total=40) as progress:
        for start in range(0, len(names), chunk):
            part = names[start:start + chunk]
            quantiser = mnq.MatMulNBitsQuantizer(model, bits=options.bits, block_size=options.block_size,
                                                 is_symmetric=options.symmetric,
                                                 accuracy_level=options.accuracy_level or None,
                                                 nodes_to_include=part, algo_config=config)
            with warnings.catch_warnings():  # its HQQ path warns about numpy views it only reads
                warnings.simplefilter("ignore", UserWarning)
                quantiser.process()
            model = quantiser.model.model
            progress.advance(len(part))
    return model


def _calibrate_cache(model, model_path: Path, options: WeightQuantOptions, log) -> tuple[tuple, str]:
    """The largest key and value magnitudes per layer and channel over the calibration sequences,
    run by onnxruntime on the float folder (kv_cache_quant.cache_ranges), and their source."""
    nodes = kv_cache_quant.check_quantisable(model, model_path)
    data, source = calibration.batches(options, calibration.vocab_size(model, model_path))
    log(f"calibrating   the KV cache on {source}")
    past = next(i for i in model.graph.input if i.name == format_names.PAST_KEY % 0)
    head_size = past.type.tensor_type.shape.dim[3].dim_value
    session = open_session(model_path, "cpu", None)
    feeds = [calibration.feeds(model, ids) for ids in data]
    ranges = kv_cache_quant.cache_ranges(session, feeds, len(nodes), kv_cache_quant.rotary_half(nodes[0], head_size))
    return ranges, source


def stamp(model, key: str, record: dict) -> None:
    """The quantiser's record as metadata (replacing one of the same key)."""
    set_metadata(model, key, json.dumps(record, sort_keys=True))


def set_metadata(model, key: str, value: str) -> None:
    """One metadata entry, replacing one of the same key."""
    for prop in list(model.metadata_props):
        if prop.key == key:
            model.metadata_props.remove(prop)
    model.metadata_props.add(key=key, value=value)


def _write(model, tmp_model: Path, log) -> None:
    import onnx_ir as ir

    sort_topologically(model.graph)
    model_ir = ir.serde.deserialize_model(model)
    exporter.save_checked(model_ir, tmp_model, exporter.wants_external(model_ir, exporter.ExportOptions()), log)


def resolve_paths(src: Path, dst: Path, force: bool = False) -> tuple[bool, Path]:
    """(is a KV-cache folder, the model file inside) for a quantiser's input; the output is refused
    here, before any work, when it would overwrite anything (unless force) or the input itself."""
    if src.is_dir():

        model_path, _, _ = read_decoder_folder(src)
        if dst.exists() and not dst.is_dir() and not dst.is_symlink():
            raise DiffExportError(f"{dst} is a file: a folder is quantised into a folder, give a folder name")
        check_output_path(dst, replace=force, inputs=[src])
        return True, model_path
    require_file(src, "give an exported .onnx file or a --kv-cache folder")
    if dst.suffix != ".onnx":
        raise DiffExportError(f"-o {dst}: name the quantised model *.onnx")
    if dst.resolve() == src.resolve() or dst.with_name(dst.name + ".data").resolve() == src.resolve():
        raise DiffExportError(f"-o {dst} would overwrite the input: write the quantised model elsewhere")
    check_output_path(dst, ("", ".data"), replace=force, inputs=[src])
    return False, src


def publish(model, src: Path, dst: Path, model_path: Path, log, make=None, force: bool = False) -> None:
    """Write `model` to dst whole or not at all: through a temporary folder beside it, renamed at
    the end. For a folder, its other files (genai_config.json, tokenizer) are carried over.
    make(tmp_dir) -> model, when given, builds the model inside that folder first (scratch files
    left there are cleaned up with it)."""
    if src.is_dir():
        with staging_folder(dst, force) as tmp_dir:  # without force: fails, leaving nothing, if dst appeared
            _write_folder(model, src, dst, model_path, tmp_dir, log, make)
        return
    with staging_model_file(dst) as tmp_dir:
        if make is not None:
            model = make(tmp_dir)
        log(f"writing       {dst}")
        _write(model, tmp_dir / dst.name, log)
        del model


def _write_folder(model, src: Path, dst: Path, model_path: Path, tmp_dir: Path, log, make) -> None:
    """A quantised folder inside tmp_dir: the model, then the source folder's other files as they are."""
    if make is not None:
        model = make(tmp_dir)
    log(f"writing       {dst}/")
    _write(model, tmp_dir / model_path.name, log)
    del model
    for scratch in tmp_dir.iterdir():
        if scratch.is_dir():
            shutil.rmtree(scratch)
    for item in sorted(src.iterdir()):  # genai_config.json, tokenizer files, a card the user wrote: as they are
        if item.name in (model_path.name, model_path.name + ".data") or not item.is_file() or item.is_symlink() \
                or (item.name == model_card.CARD and model_card.is_ours(item)):
            continue
        shutil.copyfile(item, tmp_dir / item.name, follow_symlinks=False)
    if not (tmp_dir / model_card.CARD).exists():  # ours, for what this folder now holds
        (tmp_dir / model_card.CARD).write_text(model_card.decoder_card(tmp_dir, model_path.name, dst.name))


def quantize_weights(src: str | os.PathLike, dst: str | os.PathLike, options: WeightQuantOptions | None = None,
                     log: Callable[[str], None] = _log_default) -> WeightQuantSummary:
    """Quantise the MatMul weights of a prefill .onnx file or a KV-cache folder into `dst` (a new
    .onnx file, or a new folder for a folder)."""
    options = options or WeightQuantOptions()
    options.validate()
    src, dst = Path(src), Path(dst)
    start = time.monotonic()
    is_folder, model_path = resolve_paths(src, dst, options.force)
    model = load_onnx(model_path)
    cache_ranges = cache_source = None
    if options.kv_cache:  # calibrated on the float graph on disk, before its weights change
        if not is_folder:
            raise DiffExportError("--kv-cache int8 quantises a KV-cache folder's cache: give the folder")
        cache_ranges, cache_source = _calibrate_cache(model, model_path, options, log)
    before = initializer_bytes(model)
    if materialise_transposed_weights(model):
        log("transposed    a tied LM head's weight into its own constant, so that it is quantised too")
    # one weight stream and one MatMulNBits call per shared input (q/k/v, gate/up): MatMulNBits graphs
    # are onnxruntime-only anyway, and each column quantises on its own, so the values are the same

    packed = pack_shared_input_matmuls(model)
    names, skipped = check_input(model, model_path)
    if packed:
        log(f"packed        {packed} groups of MatMuls that read one input into one MatMul each")
    data, source = None, None
    if options.method == "gptq":
        data, source = calibration.batches(options, calibration.vocab_size(model, model_path))
        log(f"calibrating   on {source}")
    log(f"quantising    {len(names)} MatMul weights of {model_path.name} ({options.describe()}) with onnxruntime "
        "MatMulNBitsQuantizer")
    model = _quantise(model, names, options, data)
    count = sum(n.op_type == "MatMulNBits" for n in model.graph.node)
    if cache_ranges is not None:
        kv_cache_quant.quantise_cache(model, *cache_ranges)
        stamp(model, kv_cache_quant.META_KEY, {"bits": 8, "scales": "per channel (keys: per rotary pair)",
                                               "calibration": cache_source})
        log(f"kv cache      int8, one scale per channel, calibrated on {cache_source}")
    after = initializer_bytes(model)
    stamp(model, META_KEY, {"bits": options.bits, "block_size": options.block_size, "method": options.method,
                            "symmetric": options.symmetric, "accuracy_level": options.accuracy_level,
                            "quantised": count, "bytes_before": before, "bytes_after": after,
                            **({"calibration": source} if source else {})})
    publish(model, src, dst, model_path, log, force=options.force)
    return WeightQuantSummary(dst, count, skipped, before, after, options, time.monotonic() - start)
