"""Q/DQ quantisation for TensorRT: every weight MatMul gets QuantizeLinear/DequantizeLinear pairs on
its activation input (one calibrated scale per tensor) and on its weight (one scale per output
channel for int8), in INT8 or FP8 (E4M3). TensorRT fuses each pair into an INT8/FP8 matmul.

The calibration and the graph rewrite are onnxruntime's static quantiser (quantize_static, QDQ
format); diffexport picks the nodes, feeds it calibration batches, checks and writes the result.
DiffAttention nodes are not quantised: their inputs and outputs stay in the export's precision,
which is what the plugin (or the lowered body) takes; the plugin's own low-bit path is the
separate `diffexport trt --logit-bits`. Scales are symmetric (zero point 0), as TensorRT requires.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import time
from pathlib import Path
from typing import Callable

import numpy as np

from diffexport.core.errors import DiffExportError
from diffexport.core.files import load_onnx
from diffexport.format.metadata_keys import DTYPE, QDQ, stored_key, stored_metadata
from diffexport.passes import calibration
from diffexport.passes.weight_quant import (
    _log_default,
    check_input,
    initializer_bytes,
    materialise_transposed_weights,
    publish,
    quantisable_matmuls,
    resolve_paths,
    stamp,
)

FORMATS = ("int8", "fp8")
META_KEY = stored_key(QDQ)
# FP8 QuantizeLinear, and fp16/bf16 scales, exist from opset 19; onnxruntime's own upgrade of older
# graphs drops model-local functions (our DiffAttention body), so the export must already be 19+.
MIN_OPSET_19 = 19


@dataclasses.dataclass
class QDQOptions(calibration.CalibrationFields):
    format: str = "int8"
    force: bool = False  # replace an output that is already there (else it is refused)

    def validate(self) -> None:
        if self.format not in FORMATS:
            raise DiffExportError(f"--qdq {self.format}: use int8 or fp8")
        self.validate_calibration("--qdq")

    @property
    def calibration_method(self) -> str:
        # onnxruntime calibrates FP8 from activation histograms only; INT8 takes the observed
        # absolute maximum, as TensorRT's and ModelOpt's default INT8 calibration does.
        return "distribution" if self.format == "fp8" else "minmax"

    def describe(self) -> str:
        return f"{self.format} Q/DQ, {self.calibration_method} calibration"


@dataclasses.dataclass
class QDQSummary:
    output: Path
    quantised: int  # MatMul nodes given Q/DQ pairs
    skipped: list[str]
    calibration: str  # what the ranges came from
    bytes_before: int
    bytes_after: int
    options: QDQOptions
    seconds: float

    def lines(self) -> list[str]:
        out = [f"quantised     {self.quantised} MatMul nodes with Q/DQ pairs ({self.options.describe()})",
               f"calibrated    on {self.calibration}",
               f"weights       {self.bytes_before / 1e6:,.1f} MB -> {self.bytes_after / 1e6:,.1f} MB (stored "
               f"{'as int8' if self.options.format == 'int8' else 'as fp8'}, dequantised by TensorRT's fused matmuls)"]
        if self.skipped:
            out.append(f"kept          {len(self.skipped)} MatMul weight(s) as they were: "
                       f"{'; '.join(self.skipped[:3])}")
        out.append(f"wrote         {self.output} in {self.seconds:.1f}s; build it with `diffexport trt "
                   f"{self.output}{' --targets SM89' if self.options.format == 'fp8' else ''}`")
        return out


def _quantise(model_path: Path, names: list[str], data: list[np.ndarray], options: QDQOptions, scratch: Path,
              external: bool):
    """onnxruntime's quantize_static on the file; returns the quantised ModelProto."""
    import onnx
    from onnxruntime.quantization import CalibrationMethod, QuantFormat, QuantType, quantize_static

    logging.getLogger().setLevel(max(logging.getLogger().level, logging.ERROR))  # its pre-processing advice
    qtype = QuantType.QInt8 if options.format == "int8" else QuantType.QFLOAT8E4M3FN
    method = CalibrationMethod.MinMax if options.format == "int8" else CalibrationMethod.Distribution
    out = scratch / "qdq.onnx"
    graph = load_onnx(model_path, weights=False)
    quantize_static(str(model_path), str(out), calibration.reader(graph, data, "calibrating"),
                    quant_format=QuantFormat.QDQ, op_types_to_quantize=["MatMul"], nodes_to_quantize=names,
                    per_channel=options.format == "int8", activation_type=qtype, weight_type=qtype,
                    calibrate_method=method, use_external_data_format=external,
                    extra_options={"ActivationSymmetric": True, "WeightSymmetric": True,
                                   # inputs only: a Q/DQ on the output would quantise what reaches
                                   # DiffAttention and the residual stream, which TensorRT needs not
                                   "OpTypesToExcludeOutputQuantization": ["MatMul"],
                                   # [K, N] weights: one scale per output column
                                   "QDQOpTypePerChannelSupportToAxis": {"MatMul": 1}})
    return onnx.load(str(out))


def quantize_qdq(src: str | os.PathLike, dst: str | os.PathLike, options: QDQOptions | None = None,
                 log: Callable[[str], None] = _log_default) -> QDQSummary:
    """Calibrate and write a Q/DQ .onnx of a prefill export for TensorRT."""
    options = options or QDQOptions()
    options.validate()
    src, dst = Path(src), Path(dst)
    start = time.monotonic()
    _, model_path = resolve_paths(src, dst, options.force)
    model = load_onnx(model_path, weights=False)
    _, skipped = check_input(model, model_path)
    opset = next((o.version for o in model.opset_import if o.domain in ("", "ai.onnx")), 0)
    dtype = stored_metadata(model).get(DTYPE, "float32")
    if dtype == "bfloat16":
        raise DiffExportError("--qdq calibrates in onnxruntime, whose CPU provider does not run bfloat16 graphs: "
                              "quantise the fp16 (opset 19+) or fp32 export")
    if dtype == "float16" and options.format == "fp8":
        raise DiffExportError("--qdq fp8 calibrates from onnxruntime's activation histograms, which it cannot build "
                              "in float16: quantise the fp32 export (opset 19+), or use --qdq int8")
    why = ("FP8 QuantizeLinear" if options.format == "fp8" else
           f"{dtype} scales on QuantizeLinear" if dtype != "float32" else None)
    if why and opset < MIN_OPSET_19:
        raise DiffExportError(f"--qdq {options.format} of a {dtype} export needs opset {MIN_OPSET_19} or newer "
                              f"({why}); "
                              f"{model_path.name} is opset {opset}: re-export it with `diffexport onnx ... "
                              f"--opset {MIN_OPSET_19}`")
    batches, source = calibration.batches(options, calibration.vocab_size(model, model_path))
    external = any(t.data_location == 1 for t in model.graph.initializer)  # TensorProto.EXTERNAL
    before = initializer_bytes(model)
    del model
    record: dict = {}

    def make(tmp_dir: Path):
        import onnx

        scratch = tmp_dir / "calibration"
        scratch.mkdir()
        source_path, full = model_path, load_onnx(model_path)
        if materialise_transposed_weights(full):
            log("transposed    a tied LM head's weight into its own constant, so that it is quantised too")
            source_path = scratch / "input.onnx"
            onnx.save(full, str(source_path), save_as_external_data=external, location="input.onnx.data")
        names, _ = quantisable_matmuls(full)
        del full
        log(f"quantising    {len(names)} MatMul nodes of {model_path.name} ({options.describe()}) with onnxruntime "
            "quantize_static")
        quantised = _quantise(source_path, names, batches, options, scratch, external)
        _scales_in(quantised, dtype)
        count = len(_dequantised_weights(quantised))
        record.update(format=options.format, calibration=options.calibration_method, source=source,
                      samples=sum(len(b) for b in batches), seq_len=options.seq_len, quantised=count,
                      bytes_before=before, bytes_after=initializer_bytes(quantised))
        stamp(quantised, META_KEY, record)
        return quantised

    publish(None, src, dst, model_path, log, make=make, force=options.force)
    return QDQSummary(dst, record["quantised"], skipped, source, before, record["bytes_after"], options,
                      time.monotonic() - start)


def _scales_in(model, dtype: str) -> None:
    """onnxruntime writes float32 scales; in an fp16 graph QuantizeLinear's input and
    DequantizeLinear's output take the scale's type, so the scales become fp16 (bf16 exports are
    refused before calibration)."""
    if dtype != "float16":
        return
    import onnx
    from onnx import numpy_helper

    inits = {t.name: t for t in model.graph.initializer}
    for name in sorted({n.input[1] for n in model.graph.node if n.op_type in ("QuantizeLinear", "DequantizeLinear")}):
        init = inits.get(name)
        if init is not None and init.data_type == onnx.TensorProto.FLOAT:
            init.CopyFrom(numpy_helper.from_array(numpy_helper.to_array(init).astype(np.float16), name))


def _dequantised_weights(model) -> list[str]:
    """MatMul nodes whose weight input is a DequantizeLinear output (what TensorRT fuses)."""
    dequantised = {o for n in model.graph.node if n.op_type == "DequantizeLinear" for o in n.output}
    return [n.name for n in model.graph.node if n.op_type == "MatMul" and n.input[1] in dequantised]
