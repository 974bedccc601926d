"""Trace a DIFF model to ONNX: one DiffAttention node per attention, its function body attached.

Steps (each a small function below):
  trace     torch.onnx.export(dynamo=True) with the custom translation of our op, dynamic batch
            and sequence axes; or the legacy TorchScript exporter with a symbolic (fallback)
  finish    attach the model-local function, stamp plugin_namespace/plugin_version on the nodes,
            record what was exported in metadata_props (read back by `diffexport check`)
  publish   write into a temporary folder beside the output, run onnx.checker's full check on
            that file, then rename into place: an interrupted export leaves nothing half-written
"""

from __future__ import annotations

import contextlib
import dataclasses
import io
import json
import logging
import os
import time
import warnings
from pathlib import Path
from typing import Callable

import torch

from diffexport import __version__
from diffexport.core import contract, fingerprint
from diffexport.core.errors import DiffExportError
from diffexport.core.files import check_output_path, refuse_output_over_inputs, staging_model_file
from diffexport.core.progress import Progress
from diffexport.export import function_body
from diffexport.export.norm_form import divide_by_root
from diffexport.export.op_schema import register_schema
from diffexport.export.translation import translation_table
from diffexport.format.metadata_keys import (
    BODY_STYLE,
    CONFIG,
    DTYPE,
    FAMILY,
    OP_VERSION,
    OUTPUTS,
    SOURCE,
    SOURCE_NAME,
    SOURCE_REVISION,
    WEIGHTS,
    stored_key,
)
from diffexport.format.names import DTYPES, LOGITS
from diffexport.format.names import PREFILL_INPUT_NAMES as INPUT_NAMES
from diffexport.format.nodes import plugin_selectors
from diffexport.modeling.checkpoint import LoadedModel, check_range
from diffexport.modeling.families import DIFF_FAMILIES

HIDDEN = "last_hidden_state"
PROTOBUF_LIMIT = 2 * 1024**3  # a single .onnx protobuf cannot exceed 2 GiB
IR_VERSION = 10  # onnxruntime 1.20+ reads it; onnx >= 1.16 writes newer ones by default


@dataclasses.dataclass
class ExportOptions:
    dtype: str = "float32"
    body_style: str = function_body.DEFAULT_BODY_STYLE
    opset: int | None = None  # default: the body style's minimum (18 or 23)
    hidden: bool = False  # also output the last hidden state
    external_data: bool | None = None  # None: only when the weights pass the 2 GiB protobuf limit
    legacy: bool = False  # TorchScript exporter instead of dynamo
    force: bool = False  # replace an output that is already there (else it is refused, nothing overwritten)

    def resolved_opset(self) -> int:
        return function_body.MIN_OPSET[self.body_style] if self.opset is None else self.opset


@dataclasses.dataclass
class ExportSummary:
    path: Path
    data_path: Path | None
    nodes: int
    diff_attention_nodes: int
    parameters: int
    weight_bytes: int
    file_bytes: int
    opset: int
    dtype: str
    body_style: str
    exporter: str
    seconds: float

    def report(self) -> str:
        data = f" + {self.data_path.name}" if self.data_path else ""
        return "\n".join([
            f"exported      {self.path}{data} ({self.file_bytes / 1e6:.1f} MB, {self.dtype}, opset {self.opset}, "
            f"{self.exporter} exporter, {self.seconds:.1f}s)",
            f"graph         {self.nodes} nodes, "
            + (f"{self.diff_attention_nodes} {contract.OP_NAME} ({contract.ONNX_DOMAIN} v{contract.OP_VERSION}, "
               f"{self.body_style} function body)" if self.diff_attention_nodes else BASELINE_NOTE)
            + f", {self.parameters:,} parameters",
        ])


class _OutputsOf(torch.nn.Module):
    """input_ids -> logits (and the last hidden state): the graph's documented interface."""

    def __init__(self, model: torch.nn.Module, hidden: bool):
        super().__init__()
        self.model, self.hidden = model, hidden

    def forward(self, input_ids):
        return self.model(input_ids, return_hidden=self.hidden)


def _log_default(message: str) -> None:
    print(message, flush=True)


# ---------------------------------------------------------------- checks before any work

BASELINE_FAMILY = "transformer"  # the paper's baseline (and a plain HF Llama, read as it)
# What an export of the baseline says, in the prefill and the KV-cache export alike.
BASELINE_NOTE = ("a baseline Transformer (standard attention, no DiffAttention node: the op is for DIFF models); "
                 "exported as the baseline for side-by-side comparisons")


def check_family(loaded: LoadedModel) -> None:
    if loaded.config.family not in DIFF_FAMILIES and loaded.config.family != BASELINE_FAMILY:
        raise DiffExportError(f"{loaded.config.family!r} is not a DIFF model: diffexport exports "
                              f"{sorted(DIFF_FAMILIES)} (differential attention) checkpoints, and the baseline "
                              f"{BASELINE_FAMILY!r} for comparisons")


def check_target(out_path: Path, options: ExportOptions) -> None:
    """Options and output path, checked before any checkpoint is loaded."""
    if options.dtype not in DTYPES:
        raise DiffExportError(f"unsupported dtype {options.dtype!r}; choose one of {list(DTYPES)}")
    if options.body_style not in function_body.BODY_STYLES:
        raise DiffExportError(f"unknown function body style {options.body_style!r}; "
                              f"choose one of {list(function_body.BODY_STYLES)}")
    low = function_body.MIN_OPSET[options.body_style]
    if not low <= options.resolved_opset() <= 23:
        raise DiffExportError(f"opset {options.opset} is out of range for the {options.body_style} body: "
                              f"use {low}..23")
    if options.legacy and options.resolved_opset() > 20:
        raise DiffExportError("the legacy exporter stops at opset 20: drop --legacy or use the decomposed body")
    if out_path.suffix != ".onnx":
        raise DiffExportError(f"output {out_path} should end in .onnx")
    if out_path.is_dir():
        raise DiffExportError(f"output {out_path} is a folder: give a file name ending in .onnx")
    check_output_path(out_path, ("", ".data"), replace=options.force)


# ---------------------------------------------------------------- trace

@contextlib.contextmanager
def quiet_exporter():
    """The exporter's own chatter (torchvision notices, deprecations) is not for our users."""
    loggers = [logging.getLogger(name) for name in ("torch.onnx", "torch.export", "onnxscript")]
    levels = [lg.level for lg in loggers]
    for lg in loggers:
        lg.setLevel(logging.ERROR)
    try:
        with warnings.catch_warnings(), contextlib.redirect_stdout(io.StringIO()):
            warnings.simplefilter("ignore")
            yield
    finally:
        for lg, level in zip(loggers, levels):
            lg.setLevel(level)


def _example_ids(model) -> torch.Tensor:
    # 2 x 17: neither dimension is 0 or 1, which torch.export would specialise on.
    gen = torch.Generator().manual_seed(0)
    return torch.randint(0, model.config.vocab_size, (2, 17), generator=gen)


def _trace_dynamo(model, options: ExportOptions):

    register_schema()
    batch, seq = torch.export.Dim("batch"), torch.export.Dim("sequence")
    outputs = [LOGITS, HIDDEN] if options.hidden else [LOGITS]
    with quiet_exporter():
        program = torch.onnx.export(
            _OutputsOf(model, options.hidden), (_example_ids(model),), dynamo=True,
            opset_version=options.resolved_opset(), custom_translation_table=translation_table(),
            dynamic_shapes=({0: batch, 1: seq},), input_names=list(INPUT_NAMES), output_names=outputs,
            optimize=True, verbose=False)
    return program.model


def _trace_legacy(model, options: ExportOptions):
    """The TorchScript exporter (deprecated by torch, kept as a fallback) through a symbolic."""
    import onnx
    import onnx_ir as ir
    from torch.onnx import register_custom_op_symbolic

    register_custom_op_symbolic(contract.TORCH_OP, _legacy_symbolic, options.resolved_opset())
    outputs = [LOGITS, HIDDEN] if options.hidden else [LOGITS]
    axes = {name: {0: "batch", 1: "sequence"} for name in [*INPUT_NAMES, *outputs]}
    buffer = io.BytesIO()
    with quiet_exporter():
        torch.onnx.export(_OutputsOf(model, options.hidden), (_example_ids(model),), buffer, dynamo=False,
                          opset_version=options.resolved_opset(), input_names=list(INPUT_NAMES),
                          output_names=outputs, dynamic_axes=axes,
                          custom_opsets={contract.ONNX_DOMAIN: contract.OP_VERSION})
    return ir.serde.deserialize_model(onnx.load_from_string(buffer.getvalue()))


def _legacy_symbolic(g, query, key, value, lambda_full, norm_weight, key_mask, *attr_values):
    from torch.onnx import symbolic_helper

    if not symbolic_helper._is_none(key_mask):  # prefill graphs only: KV-cache decoders use dynamo
        raise DiffExportError("the legacy exporter writes version-1 DiffAttention nodes only (no key_mask)")
    attrs = {}
    for spec, value_ in zip(contract.ATTRIBUTES, attr_values):
        parsed = symbolic_helper._maybe_get_const(value_, "i" if spec.kind == "int" else "f")
        attrs[f"{spec.name}_{'i' if spec.kind == 'int' else 'f'}"] = parsed
    out = g.op(f"{contract.ONNX_DOMAIN}::{contract.OP_NAME}", query, key, value, lambda_full, norm_weight, **attrs)
    width = attrs["num_heads_i"] * attrs["head_dim_i"] * (2 if attrs["variant_i"] == 1 else 1)
    out.setType(query.type().with_sizes([None, None, width]))
    return out


# ---------------------------------------------------------------- finish

def norms_for_onnxruntime(model_ir, log: Callable[[str], None]) -> None:
    """RMSNorms as Div(x, Sqrt(...)), the form onnxruntime fuses at load (export/norm_form.py);
    run before attach_diff_attention adds the DiffAttention function, whose body stays as the
    contract writes it."""

    if model_ir.functions:
        raise DiffExportError("internal: the traced graph already holds functions; norms are rewritten before any")
    count = divide_by_root(model_ir)
    if count:
        log(f"norms         {count} RMSNorm(s) as x / sqrt(mean(x^2) + eps), which onnxruntime fuses at load")


def attach_diff_attention(model_ir, loaded: LoadedModel, options: ExportOptions, weights_id: str,
                          key_mask: bool = False, outputs: list[str] | None = None,
                          extra_meta: dict[str, str] | None = None) -> int:
    """Attach the function, plugin fields and metadata in place; return the DiffAttention count.
    key_mask: the graph's nodes pass the version-2 key_mask input (KV-cache decoders)."""
    import onnx_ir as ir

    opset = options.resolved_opset()
    function = ir.serde.deserialize_function(function_body.build_function(options.body_style, opset, key_mask))
    model_ir.functions[function.identifier()] = function
    model_ir.opset_imports[contract.ONNX_DOMAIN] = contract.op_version(key_mask)
    selectors = plugin_selectors(key_mask)
    count = 0
    for node in model_ir.graph.all_nodes():
        if node.domain == contract.ONNX_DOMAIN and node.op_type == contract.OP_NAME:
            if (len(node.inputs) == len(contract.ALL_INPUTS)) != key_mask:
                raise DiffExportError(f"internal: {node.name} has {len(node.inputs)} inputs, expected "
                                      f"{len(contract.ALL_INPUTS) if key_mask else len(contract.INPUTS)}")
            for name, value in selectors.items():
                node.attributes[name] = ir.AttrString(name, value)
            count += 1
    expected = loaded.config.n_layers
    if count != expected:
        raise DiffExportError(f"internal: expected {expected} {contract.OP_NAME} nodes, the trace has {count}")
    stamp_metadata(model_ir, loaded, options, weights_id, outputs or ([LOGITS, HIDDEN] if options.hidden else [LOGITS]),
                   {stored_key(OP_VERSION): str(contract.op_version(key_mask)), **(extra_meta or {})})
    return count


def stamp_metadata(model_ir, loaded: LoadedModel, options: ExportOptions, weights_id: str, outputs: list[str],
                   extra_meta: dict[str, str]) -> None:
    """Producer, IR version and what was exported (read back by `diffexport check`)."""

    model_ir.ir_version = IR_VERSION
    model_ir.producer_name, model_ir.producer_version = "diffexport", __version__
    model_ir.metadata_props.update({
        stored_key(FAMILY): loaded.config.family,
        stored_key(CONFIG): json.dumps(loaded.config.to_dict(), sort_keys=True),
        stored_key(DTYPE): options.dtype,
        stored_key(BODY_STYLE): options.body_style,
        stored_key(OUTPUTS): ",".join(outputs),
        stored_key(WEIGHTS): weights_id,
        # What `check` asks for when no model is named: the kind of source and its file or folder
        # name (not its path: an export is shared, the machine's layout is not), or its Hub id
        # and commit (the model card's base_model).
        stored_key(SOURCE): loaded.source,
        stored_key(SOURCE_NAME): loaded.hub_id or (Path(loaded.path).name if loaded.path else ""),
        **({stored_key(SOURCE_REVISION): loaded.hub_revision} if loaded.hub_revision else {}),
        **extra_meta,
    })


def model_in_dtype(loaded: LoadedModel, dtype_name: str):
    """(the model in eval mode and the export dtype, the fingerprint of its weights in that dtype)."""
    model = loaded.model.eval()
    if next(model.parameters()).dtype != DTYPES[dtype_name]:

        check_range(model.state_dict().items(), DTYPES[dtype_name], "the model")
        model = model.to(DTYPES[dtype_name])
    return model, fingerprint.weights_fingerprint(model, dtype_name)


def save_checked(model_ir, tmp_model: Path, external: bool, log: Callable[[str], None]) -> None:
    """Write the graph (weights beside it when external), then onnx.checker's full check on the file."""
    import onnx

    _save(model_ir, tmp_model, external, log)
    log("checking      onnx.checker full check")
    try:
        onnx.checker.check_model(str(tmp_model), full_check=True)
    except onnx.checker.ValidationError as exc:
        raise DiffExportError(f"internal: the exported graph fails onnx.checker: {str(exc).splitlines()[0]}")


def wants_external(model_ir, options: ExportOptions) -> bool:
    """External data when asked, or when the weights would pass protobuf's 2 GiB limit."""
    if options.external_data is not None:
        return options.external_data
    return _weight_bytes(model_ir) > PROTOBUF_LIMIT - 64 * 1024**2


# ---------------------------------------------------------------- publish

def _weight_bytes(model_ir) -> int:
    return sum(v.const_value.nbytes for v in model_ir.graph.initializers.values() if v.const_value is not None)


def _save(model_ir, tmp_model: Path, external: bool, log: Callable[[str], None]) -> None:
    import onnx_ir as ir

    if not external:
        ir.save(model_ir, tmp_model)
        return
    total = len(model_ir.graph.initializers)
    with Progress("writing weights", total, min_total=1) as progress:
        ir.save(model_ir, tmp_model, external_data=tmp_model.name + ".data",
                callback=lambda tensor, info: progress.advance(1))


def _references(model_path: Path, data_name: str) -> bool:
    """Whether the ONNX file at model_path keeps weights in data_name (False when unreadable)."""
    import onnx

    if not model_path.is_file() or model_path.is_symlink():
        return False
    try:
        model = onnx.load(str(model_path), load_external_data=False)
    except Exception:  # not an ONNX file: then the data file is not its either
        return False
    return any(e.key == "location" and e.value == data_name
               for init in model.graph.initializer for e in init.external_data)


def export_onnx(loaded: LoadedModel, out_path: str | os.PathLike, options: ExportOptions | None = None,
                log: Callable[[str], None] = _log_default) -> ExportSummary:
    """Export `loaded` to `out_path` and return what was written."""
    import onnx

    options = options or ExportOptions()
    out_path = Path(out_path)
    check_target(out_path, options)
    refuse_output_over_inputs(out_path, [loaded.path])
    check_family(loaded)
    start = time.monotonic()
    model, weights_id = model_in_dtype(loaded, options.dtype)
    exporter = "legacy" if options.legacy else "dynamo"
    log(f"tracing       {loaded.config.family} ({model.num_parameters():,} parameters, {options.dtype}) "
        f"with the {exporter} exporter, opset {options.resolved_opset()}")
    with torch.no_grad():
        model_ir = (_trace_legacy if options.legacy else _trace_dynamo)(model, options)
    norms_for_onnxruntime(model_ir, log)
    if not loaded.config.differential:  # the baseline: the summary's graph line says so
        count = 0
        stamp_metadata(model_ir, loaded, options, weights_id, [LOGITS, HIDDEN] if options.hidden else [LOGITS], {})
    else:
        count = attach_diff_attention(model_ir, loaded, options, weights_id)
    nbytes = _weight_bytes(model_ir)
    external = wants_external(model_ir, options)
    log(f"writing       {out_path}" + (" with external data" if external else ""))
    stale = out_path.with_name(out_path.name + ".data")
    # Only the data file of the export this one replaces is removed: one that the previous file
    # did not reference is someone else's and stays.
    replaces_data = not external and stale.is_file() and not stale.is_symlink() and _references(out_path, stale.name)
    with staging_model_file(out_path) as tmp_dir:
        save_checked(model_ir, tmp_dir / out_path.name, external, log)
        del model_ir
    data_path = stale if external else None
    if replaces_data:  # the older export's weights beside this file would be stale
        stale.unlink(missing_ok=True)
    graph = onnx.load(str(out_path), load_external_data=False).graph
    file_bytes = out_path.stat().st_size + (data_path.stat().st_size if data_path else 0)
    return ExportSummary(path=out_path, data_path=data_path, nodes=len(graph.node), diff_attention_nodes=count,
                         parameters=model.num_parameters(), weight_bytes=nbytes, file_bytes=file_bytes,
                         opset=options.resolved_opset(), dtype=options.dtype, body_style=options.body_style,
                         exporter=exporter, seconds=time.monotonic() - start)
