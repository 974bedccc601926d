"""`diffexport optimize`: fuse differential attention, attach the function body, clean up, verify.

Data flow: load -> cleanup (folds lambda from its parameters) -> fuse -> attach the DiffAttention
function body -> cleanup -> compare with the input graph in onnxruntime -> write atomically.
"""

from __future__ import annotations

import dataclasses
import json
import os
from pathlib import Path

import numpy as np
import onnx

from diffexport.core import contract
from diffexport.core.errors import DiffExportError
from diffexport.core.files import atomic_write, check_output_path, load_onnx
from diffexport.core.onnxruntime_session import open_session
from diffexport.export.exporter import IR_VERSION
from diffexport.export.function_body import DEFAULT_BODY_STYLE, build_function
from diffexport.format.metadata_keys import OPTIMIZE_REPORT, OPTIMIZED_FROM, stored_key
from diffexport.passes import fusion
from diffexport.passes.cleanup import cleanup
from diffexport.passes.lowering import lower_diff_attention


@dataclasses.dataclass
class OptimizeResult:
    model: onnx.ModelProto
    report: fusion.FusionReport
    max_abs: float | None  # fused vs original outputs on the probe input
    lowered: int = 0
    verified_batch: int | None = None
    absorbed: int = 0  # norm epilogues moved into the fused nodes


def attach_function(model: onnx.ModelProto, style: str = DEFAULT_BODY_STYLE) -> None:
    opset = next((o.version for o in model.opset_import if o.domain in ("", "ai.onnx")), 18)
    if not any(f.domain == contract.ONNX_DOMAIN and f.name == contract.OP_NAME for f in model.functions):
        model.functions.append(build_function(style, max(opset, 18)))
    if not any(o.domain == contract.ONNX_DOMAIN for o in model.opset_import):
        model.opset_import.append(onnx.helper.make_opsetid(contract.ONNX_DOMAIN, contract.OP_VERSION))
    model.ir_version = max(min(model.ir_version, IR_VERSION), 8)


def _outputs(model: onnx.ModelProto, feeds) -> list[np.ndarray]:
    return open_session(model).run(None, feeds)


def optimize_model(model: onnx.ModelProto, verify: bool = True, body: str = DEFAULT_BODY_STYLE) -> OptimizeResult:
    fusion.check_fusable_model(model)
    base = cleanup(model)
    fused, report = fusion.fuse_diff_attention(base)
    if report.total == 0:
        return OptimizeResult(model, report, None)
    attach_function(fused, body)
    fused, absorbed, misses = fusion.absorb_epilogues(cleanup(fused))
    report.misses.extend(misses)
    fused = cleanup(fused)
    if not verify:
        return OptimizeResult(fused, report, None, absorbed=absorbed)
    max_abs, batch = _verify(base, fused)
    return OptimizeResult(fused, report, max_abs, verified_batch=batch, absorbed=absorbed)


# How far the fused graph may move an output, relative to max(1, |output|): the fused body computes
# attention in fp32, so a low-precision source differs by its own rounding.
VERIFY_RTOL_OF_SCALE = {onnx.TensorProto.FLOAT: 1e-5, onnx.TensorProto.FLOAT16: 1e-2, onnx.TensorProto.BFLOAT16: 5e-2}


def _verify(base: onnx.ModelProto, fused: onnx.ModelProto) -> tuple[float, int]:
    """Outputs before vs after on seeded inputs; batch 2, or batch 1 where the input graph itself
    fails at batch 2 (HF DiffLlama exported at opset 23 does)."""
    rtols = [VERIFY_RTOL_OF_SCALE.get(o.type.tensor_type.elem_type, 1e-5) for o in base.graph.output]
    failure = None
    for batch in (2, 1):
        feeds = fusion.probe_feeds(base, batch, 9)
        try:
            before = _outputs(base, feeds)
        except Exception as exc:  # onnxruntime's own error types
            failure = str(exc).strip().splitlines()[0]
            continue
        after = _outputs(fused, feeds)
        max_abs = max(float(np.abs(a.astype(np.float64) - b).max()) for a, b in zip(before, after))
        bound = max(rtol * max(1.0, float(np.abs(a.astype(np.float64)).max())) for rtol, a in zip(rtols, before))
        if not max_abs <= bound:
            raise DiffExportError(f"the fused graph differs from the input by {max_abs:.2e} (> {bound:.1e}); "
                                  "nothing was written. Report this graph: a rule matched what it should not")
        return max_abs, batch
    raise DiffExportError(f"the input graph does not run in onnxruntime, so the fusion cannot be verified: {failure}")


def optimize_file(src: str | os.PathLike, dst: str | os.PathLike, expect_fused: int | None = None,
                  lower: bool = False, body: str = DEFAULT_BODY_STYLE, force: bool = False) -> OptimizeResult:

    src, dst = Path(src), Path(dst)
    check_output_path(dst, replace=force, inputs=[src])
    model = load_onnx(src)
    already = sum(n.op_type == contract.OP_NAME and n.domain == contract.ONNX_DOMAIN for n in model.graph.node)
    if already and lower:  # an export of ours: nothing to fuse, only lower
        result = OptimizeResult(model, fusion.FusionReport({}, []), None)
    else:
        result = optimize_model(model, body=body)
    if expect_fused is not None and result.report.total < expect_fused:
        raise DiffExportError(f"{result.report.total} differential attention(s) fused, expected {expect_fused} "
                              "(rerun with --verbose for the reasons)")
    if lower:
        lowered = lower_diff_attention(result.model, body)
        result.model, result.lowered = cleanup(lowered.model), lowered.lowered
    record_provenance(result, model, src, body)
    atomic_write(dst, lambda tmp: onnx.save(result.model, tmp))
    return result


def record_provenance(result: OptimizeResult, source: onnx.ModelProto, src: Path, body: str) -> None:
    """The output says where it came from and what was done: the input's metadata (a diffexport
    export stays checkable against its checkpoint), the input file, and the fusion report."""
    kept = {p.key: p.value for p in source.metadata_props}
    kept.update({p.key: p.value for p in result.model.metadata_props})
    report = result.report
    kept[stored_key(OPTIMIZED_FROM)] = src.name
    kept[stored_key(OPTIMIZE_REPORT)] = json.dumps({
        "fused": report.total, "rules": dict(report.fired), "absorbed_epilogues": result.absorbed,
        "lowered": result.lowered, "body": body, "verified_max_abs": result.max_abs,
        "verified_batch": result.verified_batch, "not_fused": len(report.misses)}, sort_keys=True)
    del result.model.metadata_props[:]
    for key, value in kept.items():
        result.model.metadata_props.add(key=key, value=value)
