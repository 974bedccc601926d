"""Parse and build ONNX graphs with a TensorRT-family builder: TensorRT, or TensorRT-RTX on a CPU.

TensorRT-RTX (module `tensorrt_rtx`) builds engines ahead of time for chosen GPU architectures
without a GPU: the check that a graph is TensorRT-parseable end to end. Graphs with DiffAttention
nodes need our plugin there; lower them first (diffexport.passes.lowering) to check the
plugin-free path.
"""

from __future__ import annotations

import dataclasses
import time

import onnx

from diffexport.errors import DiffExportError

DEFAULT_RTX_TARGETS = ("SM80", "SM89")


def import_tensorrt(module: str = "auto"):
    """('tensorrt' | 'tensorrt_rtx', module); 'auto' prefers the full TensorRT."""
    import importlib

    names = ["tensorrt", "tensorrt_rtx"] if module == "auto" else [module]
    for name in names:
        try:
            return name, importlib.import_module(name)
        except ImportError:
            continue
    raise DiffExportError("no TensorRT found: pip install tensorrt (with a GPU) or tensorrt-rtx-cu13 "
                          "(builds ahead of time on a CPU)")


def _collecting_logger(trt):
    """A logger that keeps TensorRT's errors for our one-line message instead of printing them."""

    class Collecting(trt.ILogger):
        def __init__(self):
            trt.ILogger.__init__(self)
            self.errors: list[str] = []

        def log(self, severity, msg):
            if severity in (trt.ILogger.Severity.ERROR, trt.ILogger.Severity.INTERNAL_ERROR):
                self.errors.append(msg)

    return Collecting()


@dataclasses.dataclass
class BuildResult:
    module: str
    targets: tuple[str, ...]
    layers: int
    engine_bytes: int
    seconds: float


def _profile_shapes(model: onnx.ModelProto, min_shape, opt_shape, max_shape):
    """Every graph input with dynamic dims gets the same (batch, sequence) profile."""
    shapes = {}
    for value in model.graph.input:
        dims = value.type.tensor_type.shape.dim
        if any(d.dim_param or not d.HasField("dim_value") for d in dims):
            if len(dims) != 2:
                raise DiffExportError(f"input {value.name} has {len(dims)} dims with dynamic ones; "
                                      "only [batch, sequence] inputs get an automatic profile")
            shapes[value.name] = (min_shape, opt_shape, max_shape)
    return shapes


def build_engine(model: onnx.ModelProto, *, module: str = "auto", targets=DEFAULT_RTX_TARGETS,
                 min_shape=(1, 1), opt_shape=(1, 64), max_shape=(2, 256)) -> BuildResult:
    """Parse `model` and build a serialized engine; parse errors name the failing node."""
    name, trt = import_tensorrt(module)
    logger = _collecting_logger(trt)
    builder = trt.Builder(logger)
    network = builder.create_network(0)
    parser = trt.OnnxParser(network, logger)
    if not parser.parse(model.SerializeToString()):
        errors = []
        for i in range(parser.num_errors):
            err = parser.get_error(i)
            errors.append(f"node {err.node_name() or err.node()} ({err.node_operator()}): {err.desc().strip()}")
        raise DiffExportError(f"{name} cannot parse the graph: " + "; ".join(errors or ["no detail"]))
    config = builder.create_builder_config()
    if name == "tensorrt_rtx":
        config.num_compute_capabilities = len(targets)
        for i, target in enumerate(targets):
            config.set_compute_capability(getattr(trt.ComputeCapability, target), i)
    profile = builder.create_optimization_profile()
    for input_name, shapes in _profile_shapes(model, min_shape, opt_shape, max_shape).items():
        profile.set_shape(input_name, *shapes)
    config.add_optimization_profile(profile)
    start = time.monotonic()
    engine = builder.build_serialized_network(network, config)
    if engine is None:
        detail = logger.errors[-1].splitlines()[0] if logger.errors else "no detail"
        raise DiffExportError(f"{name} parsed the graph but failed to build an engine for {list(targets)}: {detail}")
    return BuildResult(name, tuple(targets) if name == "tensorrt_rtx" else ("this GPU",), network.num_layers,
                       engine.nbytes, time.monotonic() - start)
