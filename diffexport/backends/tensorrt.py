"""Build TensorRT engines from our ONNX files: TensorRT with the DiffAttention plugin, or either
TensorRT or TensorRT-RTX with attention lowered to TensorRT's own layers ("native").

Plugin path: the plugin library (plugins/tensorrt, libdiffexport_plugins.so) is loaded into
TensorRT's plugin registry; the parser maps each DiffAttention node (it carries plugin_namespace,
and the staged graph has no function body to import instead) to our plugin. `logit_bits` < 16
selects the INT8-logits kernel. Native path: every DiffAttention node is lowered to standard ONNX
ops first. Function path: the graph as it is; with no plugin registered the parser inlines the
model-local function. A parser prefers a registered creator of the node's name to the function, so
where this process has loaded our plugin (an earlier plugin build) the body is inlined here first.

TensorRT-RTX (module tensorrt_rtx) builds ahead of time on a CPU for chosen GPU architectures:
native only (its parser hands plugin nodes to our creator, then ends the process when it adds the
plugin layer, so we refuse that combination).
"""

from __future__ import annotations

import dataclasses
import importlib
import json
import os
import sys
import tempfile
import time
from pathlib import Path

import onnx
import onnx.inliner

from diffexport.backends.base import ENGINE_PAIRING
from diffexport.backends.step_loop import StepLoopRuntime, empty_cache, step_feeds
from diffexport.core import contract
from diffexport.core.errors import DiffExportError
from diffexport.core.files import atomic_write, check_output_path, load_onnx, require_file
from diffexport.format import decoder_folder, decoders, names
from diffexport.format.decoder_folder import read_decoder_folder
from diffexport.format.metadata import read_export_metadata
from diffexport.format.metadata_keys import ATTENTION, DTYPE, KV_CACHE, stored_metadata
from diffexport.format.nodes import is_diff_attention, node_attrs, plugin_selectors, reads_kv_cache_codes
from diffexport.passes.cleanup import cleanup
from diffexport.passes.lowering import lower_diff_attention

DEFAULT_RTX_TARGETS = ("SM80", "SM89")
PLUGIN_LIBRARY = "libdiffexport_plugins.so"
ATTENTION_MODES = ("plugin", "native", "function")
PRECISIONS = ("auto", "fp32", "fp16", "bf16")
PROTOBUF_LIMIT = 2**31 - 2**20  # serialized ModelProto bytes; bigger graphs go through a file with external data
ONNX_FLOAT = {onnx.TensorProto.FLOAT: "fp32", onnx.TensorProto.FLOAT16: "fp16", onnx.TensorProto.BFLOAT16: "bf16"}


def import_tensorrt(module: str = "auto"):
    """('tensorrt' | 'tensorrt_rtx', module); 'auto' prefers the full TensorRT."""
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


def plugin_library_candidates() -> list[Path]:
    env = os.environ.get("DIFFEXPORT_PLUGIN_LIB")
    if env:
        return [Path(env)]
    package = Path(__file__).resolve().parent.parent
    return [package.parent / "build" / "plugins" / "tensorrt" / PLUGIN_LIBRARY, package / "lib" / PLUGIN_LIBRARY]


def find_plugin_library(explicit: str | os.PathLike | None = None) -> Path:
    candidates = [Path(explicit)] if explicit else plugin_library_candidates()
    for path in candidates:
        if path.is_file():
            return path
    raise DiffExportError(f"DiffAttention plugin library not found (looked at {', '.join(map(str, candidates))}): "
                          "build it with `cmake -S . -B build -DTensorRT_ROOT=<TensorRT dir> && cmake --build build`, "
                          "pass --plugin-lib, or build with --attention native")


def has_key_mask(node: onnx.NodeProto) -> bool:
    """A version-2 DiffAttention node: its sixth input (key_mask) is given."""
    return len(node.input) > len(contract.INPUTS) and bool(node.input[len(contract.INPUTS)])


def load_plugin(trt, path: Path, key_mask: bool = False, kv_cache: bool = False) -> None:
    """Load the plugin library into TensorRT's registry and make sure our creators are there
    (version 2, for nodes with key_mask, and 3, for nodes on an 8-bit cache, when the graph has such nodes)."""
    registry = trt.get_plugin_registry()
    if not registry.load_library(str(path)):
        raise DiffExportError(f"TensorRT could not load the plugin library {path}")
    versions = ([contract.PLUGIN_VERSION] + ([contract.KEY_MASK_PLUGIN_VERSION] if key_mask else [])
                + ([contract.KV_CACHE_PLUGIN_VERSION] if kv_cache else []))
    for version in versions:
        if registry.get_creator(contract.PLUGIN_NAME, version, contract.PLUGIN_NAMESPACE) is None:
            raise DiffExportError(f"{path} holds no {contract.PLUGIN_NAMESPACE}::{contract.PLUGIN_NAME} "
                                  f"version {version} creator: rebuild it from this checkout")


def plugin_registered(trt) -> bool:
    """Whether this process has our plugin's creators in TensorRT's registry (any op version)."""
    registry = trt.get_plugin_registry()
    versions = (contract.PLUGIN_VERSION, contract.KEY_MASK_PLUGIN_VERSION, contract.KV_CACHE_PLUGIN_VERSION)
    return any(registry.get_creator(contract.PLUGIN_NAME, v, contract.PLUGIN_NAMESPACE) is not None for v in versions)


@dataclasses.dataclass
class EngineOptions:
    attention: str = "plugin"          # plugin | native (lowered by us) | function (inlined by the parser)
    precision: str = "auto"            # auto: the ONNX file's float type
    logit_bits: int = 16               # 16, or 8/6/4: the INT8-logits kernel (plugin only)
    smooth_k: bool = True
    plugin_lib: str | None = None
    module: str = "auto"               # tensorrt | tensorrt_rtx | auto
    targets: tuple[str, ...] = DEFAULT_RTX_TARGETS  # TensorRT-RTX ahead-of-time architectures
    min_shape: tuple[int, int] = (1, 1)  # (batch, sequence) of every dynamic [batch, seq] input
    opt_shape: tuple[int, int] = (1, 128)
    max_shape: tuple[int, int] = (4, 2048)
    opt_past: int = 128  # KV-cache graphs: past length at the optimum (its minimum is 0: the prefill)
    max_past: int = 2048  # KV-cache graphs: the longest past (at most the context length)
    timing_cache: str | None = None
    save_onnx: str | None = None       # also write the graph handed to the parser (for trtexec/polygraphy)
    progress: bool = True
    force: bool = False                # replace an engine (or --save-onnx graph) already there; else refused


@dataclasses.dataclass
class BuildResult:
    module: str
    version: str
    targets: tuple[str, ...]
    layers: int
    plugin_layers: int
    diff_attention_nodes: int
    precision: str
    attention: str
    logit_bits: int
    engine: bytes
    seconds: float

    @property
    def engine_bytes(self) -> int:
        return len(self.engine)

    def summary(self) -> list[str]:
        mode = self.attention + ("" if self.logit_bits >= 16 else f", {self.logit_bits}-bit logits")
        return [f"builder       {self.module} {self.version} for {', '.join(self.targets)}",
                f"attention     {self.diff_attention_nodes} DiffAttention nodes -> {mode} "
                f"({self.plugin_layers} plugin layers)",
                f"network       {self.layers} layers, {self.precision}",
                f"engine        {self.engine_bytes / 2**20:.2f} MiB, built in {self.seconds:.1f} s"]


def graph_precision(model: onnx.ModelProto) -> str:
    """The float type of the network's activations: the type of the first DiffAttention query, else
    of the float graph outputs."""
    types = {v.name: v.type.tensor_type.elem_type for v in list(model.graph.value_info) + list(model.graph.output)}
    for node in model.graph.node:
        if node.op_type == contract.OP_NAME and node.domain == contract.ONNX_DOMAIN and node.input[0] in types:
            return ONNX_FLOAT.get(types[node.input[0]], "fp32")
    floats = [ONNX_FLOAT[t] for t in (o.type.tensor_type.elem_type for o in model.graph.output) if t in ONNX_FLOAT]
    return floats[0] if floats else "fp32"


def prepare_graph(model: onnx.ModelProto, options: EngineOptions) -> tuple[onnx.ModelProto, int]:
    """The graph the parser gets (a copy): lowered for native, plugin fields stamped for the plugin."""
    if options.attention not in ATTENTION_MODES:
        raise DiffExportError(f"--attention must be one of {', '.join(ATTENTION_MODES)}")
    if options.logit_bits not in (16, 8, 6, 4):
        raise DiffExportError(f"--logit-bits must be 8, 6 or 4 (16 = not quantised), got {options.logit_bits}")
    nodes = [n for n in model.graph.node if n.op_type == contract.OP_NAME and n.domain == contract.ONNX_DOMAIN]
    if options.attention != "plugin" and options.logit_bits < 16:
        raise DiffExportError("--int8/--logit-bits need the plugin's INT8-logits kernel: use --attention plugin")
    if options.attention == "function":
        return model, len(nodes)
    if options.attention == "native":

        return (cleanup(lower_diff_attention(model).model) if nodes else model), len(nodes)
    if not nodes:
        raise DiffExportError("the graph has no DiffAttention node for the plugin: export it with `diffexport onnx` "
                              "(or fuse it with `diffexport optimize`), or build with --attention native")
    staged = onnx.ModelProto()
    staged.CopyFrom(model)  # no serialisation: models past protobuf's 2 GiB limit copy too
    for node in staged.graph.node:
        if node.op_type != contract.OP_NAME or node.domain != contract.ONNX_DOMAIN:
            continue
        dropped = ("logit_bits", "smooth_k", *contract.PLUGIN_SELECTOR_ATTRIBUTES)
        keep = [a for a in node.attribute if a.name not in dropped]
        del node.attribute[:]
        node.attribute.extend(keep)
        # Every plugin-only field is written, also at its default: the parser warns about creator
        # fields a node lacks.
        if reads_kv_cache_codes(node) and options.logit_bits < 16:
            raise DiffExportError("--int8/--logit-bits do not combine with an 8-bit KV cache (its per-channel key "
                                  "scales do not factor out of an integer Q.K): build this folder without them")
        selectors = plugin_selectors(has_key_mask(node), reads_kv_cache_codes(node))
        node.attribute.extend([*(onnx.helper.make_attribute(name, value) for name, value in selectors.items()),
                               onnx.helper.make_attribute("logit_bits", options.logit_bits),
                               onnx.helper.make_attribute("smooth_k", int(options.smooth_k))])
    # Without its function body the node can only become the plugin. TensorRT 10.0-10.6 (JetPack 6's
    # 10.3 among them) import a node that has a model-local function as that function even when a
    # plugin of the name is registered; 10.7 and newer prefer the plugin. The saved graph
    # (--save-onnx) is then the one to hand to trtexec or polygraphy on any TensorRT 10.
    functions = [f for f in staged.functions if (f.domain, f.name) != (contract.ONNX_DOMAIN, contract.OP_NAME)]
    del staged.functions[:]
    staged.functions.extend(functions)
    return staged, len(nodes)


def _serialized_size(model: onnx.ModelProto) -> int:
    try:
        return model.ByteSize()
    except (ValueError, OverflowError):  # some protobuf builds refuse to size messages past 2 GiB
        return PROTOBUF_LIMIT + 1


def save_graph(model: onnx.ModelProto, path: Path) -> None:
    """Write a graph atomically, weights in path.data when it is past the protobuf limit."""

    large = _serialized_size(model) > PROTOBUF_LIMIT
    data = path.with_name(path.name + ".data")

    def write(tmp):
        if large:
            # the weights land beside tmp under their final name; the graph file is renamed last
            onnx.save_model(model, tmp, save_as_external_data=True, all_tensors_to_one_file=True,
                            location=data.name, size_threshold=1024)
        else:
            onnx.save_model(model, tmp)

    atomic_write(path, write)


def _parse(parser, graph: onnx.ModelProto, save_to: Path | None) -> bool:
    """Parse from memory, or past the protobuf limit from a file with external data (save_to, else
    a temporary one). Writing external data empties the graph's tensors: it is written once, last."""
    if _serialized_size(graph) <= PROTOBUF_LIMIT:
        if save_to is not None:
            save_graph(graph, save_to)
        return parser.parse(graph.SerializeToString())
    if save_to is not None:
        save_graph(graph, save_to)
        return parser.parse_from_file(str(save_to))

    with tempfile.TemporaryDirectory(prefix="diffexport-trt-") as folder:
        path = Path(folder) / "model.onnx"
        save_graph(graph, path)
        return parser.parse_from_file(str(path))


def _dim_ranges(options: EngineOptions) -> dict[str, tuple[int, int, int]]:
    """(min, opt, max) of every named dynamic dim our exports use."""
    (b0, s0), (b1, s1), (b2, s2) = options.min_shape, options.opt_shape, options.max_shape
    p1, p2 = options.opt_past, options.max_past
    return {"batch": (b0, b1, b2), "sequence": (s0, s1, s2), "past_sequence": (0, p1, p2),
            "total_sequence": (s0, s1 + p1, s2 + p2)}


def _profile_shapes(model: onnx.ModelProto, options: EngineOptions):
    """Every dynamic dim gets the range of its name: batch and sequence from --min/--opt/--max, and for
    KV-cache decoders past_sequence (0 .. --max-past) and total_sequence (sequence + past)."""
    ranges = _dim_ranges(options)
    shapes = {}
    for value in model.graph.input:
        dims = value.type.tensor_type.shape.dim
        if not any(d.dim_param or not d.HasField("dim_value") for d in dims):
            continue
        if len(dims) == 2 and not all(d.dim_param in ranges for d in dims):  # an older or foreign [B, S] input
            shapes[value.name] = (options.min_shape, options.opt_shape, options.max_shape)
            continue
        per_dim = []
        for d in dims:
            if d.HasField("dim_value"):
                per_dim.append((d.dim_value,) * 3)
            elif d.dim_param in ranges:
                per_dim.append(ranges[d.dim_param])
            else:
                raise DiffExportError(f"input {value.name} has a dynamic dim {d.dim_param or '?'!r} with no profile "
                                      f"range (known: {', '.join(ranges)})")
        shapes[value.name] = tuple(tuple(r[i] for r in per_dim) for i in range(3))
    return shapes


def _check_profile(options: EngineOptions) -> None:
    for lo, mid, hi, what in zip(options.min_shape, options.opt_shape, options.max_shape, ("batch", "sequence")):
        if not 1 <= lo <= mid <= hi:
            raise DiffExportError(f"profile {what}: need 1 <= min <= opt <= max, got {lo}, {mid}, {hi}")
    if not 0 <= options.opt_past <= options.max_past:
        raise DiffExportError(f"profile past length: need 0 <= --opt-past <= --max-past, got {options.opt_past}, "
                              f"{options.max_past}")


def _progress_monitor(trt):
    """Build phases on stderr, one line each (TensorRT reports them through IProgressMonitor)."""
    if not hasattr(trt, "IProgressMonitor"):
        return None

    class Phases(trt.IProgressMonitor):
        def __init__(self):
            trt.IProgressMonitor.__init__(self)

        def phase_start(self, phase_name, parent_phase, num_steps):
            if parent_phase is None:
                print(f"  {phase_name} ...", file=sys.stderr, flush=True)

        def step_complete(self, phase_name, step):
            return True

        def phase_finish(self, phase_name):
            pass

    return Phases()


def _check_fp8_targets(model: onnx.ModelProto, targets) -> None:
    """FP8 tensor cores start with Ada (SM89): say so before the builder fails inside its compiler."""
    fp8 = {onnx.TensorProto.FLOAT8E4M3FN, onnx.TensorProto.FLOAT8E5M2}
    if not any(t.data_type in fp8 for t in model.graph.initializer):
        return
    older = [t for t in targets if t.upper().startswith("SM") and t[2:].isdigit() and int(t[2:]) < 89]
    if older:
        raise DiffExportError(f"the graph holds FP8 Q/DQ, which needs SM89 (Ada) or newer, but the targets include "
                              f"{', '.join(older)}: pass e.g. --targets SM89 SM120")


def check_decoder_format(attention: str | None, where: str = "the ONNX file") -> None:
    """A decoder folder's graph written in a format TensorRT lacks (format/decoders.py) is refused.
    attention: the graph's `diffexport.attention` metadata (None: not a decoder folder's graph)."""
    fmt = decoders.decoder_format(attention)
    if not fmt.tensorrt:
        raise DiffExportError(f"{where} {fmt.tensorrt_refusal}")


def build_engine(model: onnx.ModelProto, options: EngineOptions | None = None) -> BuildResult:
    """Parse and build; parse errors name the failing node, build errors say what TensorRT said."""
    options = options or EngineOptions()
    _check_profile(options)
    check_decoder_format(stored_metadata(model).get(ATTENTION))
    # before TensorRT loads, not inside its parser (the plugin's creator refuses it there)
    if options.attention == "plugin":
        refusal = next(filter(None, (contract.plugin_refusal(node_attrs(n).head_dim) for n in model.graph.node
                                     if is_diff_attention(n))), None)
        if refusal:
            raise DiffExportError(f"the DiffAttention plugin cannot run this graph ({refusal}): build it with "
                                  "--attention native (TensorRT runs the function body)")
    name, trt = import_tensorrt(options.module)
    if name == "tensorrt_rtx" and options.attention == "plugin":
        raise DiffExportError("TensorRT-RTX cannot build graphs with plugin layers (its ONNX parser aborts): "
                              "use --attention native, or install tensorrt to use the DiffAttention plugin")
    precision = graph_precision(model)
    if options.precision not in ("auto", precision):
        raise DiffExportError(f"the ONNX file is {precision} and TensorRT builds strongly typed networks: export it "
                              f"with `diffexport onnx --{options.precision}` (fp32 = no flag) to get "
                              f"{options.precision}")
    graph, n_attention = prepare_graph(model, options)
    if options.attention == "function" and n_attention and plugin_registered(trt):
        # the parser would hand the nodes to the plugin this process loaded, not inline their body
        graph = onnx.inliner.inline_local_functions(graph)
    if options.attention == "plugin":
        attention = [n for n in graph.graph.node if n.op_type == contract.OP_NAME]
        load_plugin(trt, find_plugin_library(options.plugin_lib), any(map(has_key_mask, attention)),
                    any(map(reads_kv_cache_codes, attention)))

    logger = _collecting_logger(trt)
    builder = trt.Builder(logger)
    network = builder.create_network(0)
    parser = trt.OnnxParser(network, logger)
    if not _parse(parser, graph, Path(options.save_onnx) if options.save_onnx else None):
        errors = []
        for i in range(parser.num_errors):
            err = parser.get_error(i)
            errors.append(f"node {err.node_name() or err.node()} ({err.node_operator()}): {err.desc().strip()}")
        # The plugin's creator says why it refused a node (a field out of range, say) through the logger.
        errors = [e.splitlines()[0] for e in logger.errors if e.startswith("DiffAttention plugin:")] + errors
        raise DiffExportError(f"{name} cannot parse the graph: " + "; ".join(errors or ["no detail"]))
    plugin_layers = sum(1 for i in range(network.num_layers)
                        if "PLUGIN" in str(network.get_layer(i).type).upper())
    if options.attention == "plugin" and plugin_layers < n_attention:
        raise DiffExportError(f"{n_attention} DiffAttention nodes but {plugin_layers} plugin layers: the parser did "
                              "not map every node to the plugin")

    config = builder.create_builder_config()
    if name == "tensorrt_rtx":
        _check_fp8_targets(model, options.targets)
        config.num_compute_capabilities = len(options.targets)
        for i, target in enumerate(options.targets):
            try:
                config.set_compute_capability(getattr(trt.ComputeCapability, target), i)
            except AttributeError:
                raise DiffExportError(f"TensorRT-RTX has no target {target}") from None
    profile = builder.create_optimization_profile()
    for input_name, shapes in _profile_shapes(graph, options).items():
        profile.set_shape(input_name, *shapes)
    config.add_optimization_profile(profile)
    cache_path = Path(options.timing_cache) if options.timing_cache else None
    if cache_path is not None:
        cache = config.create_timing_cache(cache_path.read_bytes() if cache_path.is_file() else b"")
        config.set_timing_cache(cache, ignore_mismatch=False)
    monitor = _progress_monitor(trt) if options.progress else None
    if monitor is not None:
        config.progress_monitor = monitor
    start = time.monotonic()
    engine = builder.build_serialized_network(network, config)
    if engine is None:
        detail = logger.errors[-1].splitlines()[0] if logger.errors else "no detail"
        raise DiffExportError(f"{name} parsed the graph but failed to build an engine: {detail}")
    seconds = time.monotonic() - start
    if cache_path is not None:

        data = bytes(config.get_timing_cache().serialize())
        atomic_write(cache_path, lambda tmp: Path(tmp).write_bytes(data))
    targets = tuple(options.targets) if name == "tensorrt_rtx" else ("this GPU",)
    return BuildResult(name, getattr(trt, "__version__", "?"), targets, network.num_layers, plugin_layers, n_attention,
                       precision, options.attention, options.logit_bits, bytes(engine), seconds)


# ------------------------------------------------------------------ engine files and their record


def build_engine_file(model_path: str | os.PathLike, output: str | os.PathLike, options: EngineOptions, *,
                      max_given: bool = True, opt_given: bool = True, max_past: int | None = None) -> BuildResult:
    """Build `output` (and its .json record) from an exported ONNX file or a KV-cache decoder folder.
    A folder gives its graph, and its context length bounds the profile: without max_given the
    maximum is 4 x min(512, context/4), and the past goes up to the context less the sequence
    (max_past: a shorter one). Without opt_given, the optimum is cut to the maximum. The format is
    checked before the weights load."""

    output, model_path = Path(output), Path(model_path)
    if output.suffix not in names.ENGINE_SUFFIXES:
        raise DiffExportError(f"-o {output}: name the engine *.engine (or .plan/.trt)")
    check_output_path(output, ("", ".json"), replace=options.force, inputs=[model_path])
    if options.save_onnx:
        check_output_path(Path(options.save_onnx), ("", ".data"), replace=options.force, inputs=[model_path])
    if model_path.is_dir():  # a KV-cache decoder folder: its graph, past lengths up to the context length

        read = read_decoder_folder(model_path)
        model_path, context = read.model_path, read.context_length
        if not max_given:
            options.max_shape = (4, max(1, min(512, context // 4)))
        elif options.max_shape[1] > context:
            raise DiffExportError(f"--max sequence {options.max_shape[1]} exceeds the folder's context length "
                                  f"{context}: "
                                  f"give at most {context}")
        options.max_past = max_past if max_past is not None else context - options.max_shape[1]
        if options.max_past + options.max_shape[1] > context:
            raise DiffExportError(f"--max-past {options.max_past} + max sequence {options.max_shape[1]} exceeds the "
                                  f"context length {context}: lower --max-past or --max")
    elif max_past is not None:
        options.max_past = max_past
    options.opt_past = min(options.opt_past, options.max_past)
    if not opt_given:  # the default optimum never exceeds the maximum
        options.opt_shape = tuple(min(o, m) for o, m in zip(options.opt_shape, options.max_shape))
    meta = read_export_metadata(model_path)
    check_decoder_format(meta.get(ATTENTION), str(model_path))  # before the weights load (build_engine asks too)
    result = build_engine(load_onnx(model_path), options)  # TensorRT's build phases show on stderr while it runs
    write_engine(output, result, model_path, meta, options)
    return result


def sidecar_path(engine_path: Path) -> Path:
    return engine_path.with_name(engine_path.name + ".json")


def write_engine(engine_path: Path, result: BuildResult, onnx_path: Path, onnx_metadata: dict[str, str],
                 options: EngineOptions) -> Path:
    """The engine and, beside it, what it was built from and how (read by `diffexport check model.engine`)."""

    record = {
        "onnx": str(onnx_path), "onnx_metadata": onnx_metadata, "module": result.module, "version": result.version,
        "targets": list(result.targets), "attention": result.attention, "logit_bits": result.logit_bits,
        "smooth_k": bool(options.smooth_k), "precision": result.precision,
        "profile": {"min": list(options.min_shape), "opt": list(options.opt_shape), "max": list(options.max_shape),
                    **({"opt_past": options.opt_past, "max_past": options.max_past}
                       if onnx_metadata.get(KV_CACHE) == "1" else {})},
        "plugin_lib": str(find_plugin_library(options.plugin_lib)) if result.attention == "plugin" else None,
    }
    atomic_write(engine_path, lambda tmp: Path(tmp).write_bytes(result.engine))
    side = sidecar_path(engine_path)
    atomic_write(side, lambda tmp: Path(tmp).write_text(json.dumps(record, indent=1)))
    return side


def read_engine_record(engine_path: Path) -> dict:
    require_file(engine_path, "give an engine built by `diffexport trt`")
    side = sidecar_path(engine_path)
    if not side.is_file():
        raise DiffExportError(f"no {side.name} beside {engine_path.name}: build engines with `diffexport trt`, which "
                              "records the model and options they came from")
    try:
        record = json.loads(side.read_text())
        record["onnx_metadata"]["config"]  # noqa: B018 - the fields check needs
        for end in ("min", "max"):
            low, seq = record["profile"][end]
            if not all(isinstance(v, int) and not isinstance(v, bool) and v >= 1 for v in (low, seq)):
                raise ValueError(end)
    except (ValueError, KeyError, TypeError, RecursionError):
        raise DiffExportError(f"{side} is corrupt: rebuild the engine with `diffexport trt`") from None
    return record


class EngineRunner:
    """A deserialized engine on the current CUDA device: `runner(feeds)` -> fp32 numpy outputs.
    `input_shapes` (-1 where the profile decides) and `input_dtypes` (torch) describe what it takes;
    each feed is cast to its input's type (a KV cache kept in fp32 goes in as the engine's fp16)."""

    def __init__(self, engine: bytes, module: str, plugin_lib: str | None = None):
        import torch

        if not torch.cuda.is_available():
            raise DiffExportError("running a TensorRT engine needs an NVIDIA GPU (torch sees none)")
        self.name, trt = import_tensorrt(module)
        if plugin_lib:
            load_plugin(trt, find_plugin_library(plugin_lib))
        self._logger = _collecting_logger(trt)
        self._runtime = trt.Runtime(self._logger)
        self._engine = self._runtime.deserialize_cuda_engine(engine)
        if self._engine is None:
            raise DiffExportError(f"{self.name} cannot deserialize the engine (built by another TensorRT version or "
                                  f"for another GPU?): {self._last_error()}")
        self._context = self._engine.create_execution_context()
        self._torch_types = {trt.DataType.FLOAT: torch.float32, trt.DataType.HALF: torch.float16,
                             trt.DataType.BF16: torch.bfloat16, trt.DataType.INT64: torch.int64,
                             trt.DataType.INT32: torch.int32}
        tensors = [self._engine.get_tensor_name(i) for i in range(self._engine.num_io_tensors)]
        self.inputs = [t for t in tensors if self._engine.get_tensor_mode(t) == trt.TensorIOMode.INPUT]
        self.outputs = [t for t in tensors if t not in self.inputs]
        self.input_shapes = {t: tuple(self._engine.get_tensor_shape(t)) for t in self.inputs}
        self.input_dtypes = {t: self._torch_type(t) for t in self.inputs}
        self._empty = torch.empty(64, dtype=torch.uint8, device="cuda")  # the address of zero-sized tensors

    def _last_error(self) -> str:
        return self._logger.errors[-1].splitlines()[0] if self._logger.errors else "no detail"

    def _torch_type(self, tensor: str):
        dtype = self._torch_types.get(self._engine.get_tensor_dtype(tensor))
        if dtype is None:
            raise DiffExportError(f"the engine's tensor {tensor} has a type the check cannot feed or read")
        return dtype

    def __call__(self, feeds: dict) -> dict:
        import numpy as np
        import torch

        buffers = {}
        for tensor in self.inputs:
            if tensor not in feeds:
                raise DiffExportError(f"the engine wants an input {tensor!r} that the check does not provide")
            host = torch.from_numpy(np.ascontiguousarray(feeds[tensor]))
            buffers[tensor] = host.to(device="cuda", dtype=self.input_dtypes[tensor])
            self._context.set_input_shape(tensor, tuple(buffers[tensor].shape))
        for tensor in self.outputs:
            buffers[tensor] = torch.empty(tuple(self._context.get_tensor_shape(tensor)), dtype=self._torch_type(tensor),
                                          device="cuda")
        for tensor, buffer in buffers.items():  # the prefill's empty past has no storage of its own
            self._context.set_tensor_address(tensor, buffer.data_ptr() if buffer.numel() else self._empty.data_ptr())
        stream = torch.cuda.current_stream()
        if not self._context.execute_async_v3(stream.cuda_stream):
            raise DiffExportError(f"the engine failed to run: {self._last_error()}")
        stream.synchronize()
        return {tensor: buffers[tensor].float().cpu().numpy() for tensor in self.outputs}


def open_engine(engine: bytes, module: str, plugin_lib: str | None = None) -> EngineRunner:
    """Deserialize an engine on the current CUDA device; call the result with feeds."""
    return EngineRunner(engine, module, plugin_lib)


def decoder_profile_problem(record: dict, engine_path: Path, batch: int, sequence: int, past: int) -> str | None:
    """None when a KV-cache engine's profile (its record) takes such a call, else what to rebuild with."""
    try:
        (min_batch, min_seq), (max_batch, max_seq) = record["profile"]["min"], record["profile"]["max"]
        max_past = record["profile"]["max_past"]
        if not isinstance(max_past, int) or isinstance(max_past, bool) or max_past < 0:
            raise ValueError(max_past)
    except (KeyError, TypeError, ValueError):
        raise DiffExportError(f"{sidecar_path(Path(engine_path))} has no valid KV-cache profile (max_past): rebuild "
                              "the engine with `diffexport trt FOLDER`") from None
    if min_batch <= batch <= max_batch and min_seq <= sequence <= max_seq and past <= max_past:
        return None
    return (f"batch {batch}, sequence {sequence}, past {past} is outside {Path(engine_path).name}'s profile (batch "
            f"{min_batch}..{max_batch}, sequence {min_seq}..{max_seq}, past 0..{max_past}): rebuild it with "
            f"`diffexport trt FOLDER --min 1x1 --max {max(batch, max_batch)}x{max(sequence, max_seq)} "
            f"--max-past {max(past, max_past)}`")


class EngineDecoder:
    """A KV-cache decoder engine (`diffexport trt FOLDER`) stepped the way step_loop.OrtDecoder steps
    the folder (both are DecoderRunners: backends/base.py), so `check` runs one loop for both: the
    cache stays on the host between steps in the model dtype, and each call is held against the
    engine's profile before it runs.
    `run`: an EngineRunner (anything with its call, input_shapes and input_dtypes). For generation:
    `config`, the folder's genai config, and `context`, the longest sequence the profile allows."""

    writes_in_place = False

    def __init__(self, engine_path: Path, record: dict, meta: dict[str, str], run, config: dict | None = None):
        import numpy as np

        self.model_path, self.meta, self._run = Path(engine_path), meta, run
        self.layers = names.cache_layers(run.input_shapes)
        shape = run.input_shapes.get(names.PAST_KEY % 0)
        if not self.layers or shape is None or len(shape) != 4 or min(shape[1], shape[3]) < 1:
            raise DiffExportError(f"{self.model_path.name} takes no KV cache like a decoder folder's "
                                  f"({names.PAST_KEY % 0}: {shape}): rebuild it from the folder with `diffexport trt`")
        self.heads, self.width = int(shape[1]), int(shape[3])
        self.dtype = np.float16 if meta[DTYPE] == "float16" else np.float32
        self._record = record
        decoder_profile_problem(record, self.model_path, 1, 1, 0)  # a record without past lengths fails here
        self.max_sequence = int(record["profile"]["max"][1])  # the longest call: generate feeds prompts in such chunks
        self.config = config
        self.context = record["profile"]["max_past"] + 1
        if config is not None:
            self.context = min(self.context, decoder_folder.context_length(config))

    def empty_cache(self, batch: int) -> dict:

        return empty_cache(batch, self.layers, self.heads, self.width, self.dtype)

    def step(self, ids, mask, cache):
        """-> (logits [B, S, V] fp32, the new cache keyed by present names)."""

        problem = decoder_profile_problem(self._record, self.model_path, ids.shape[0], ids.shape[1],
                                          mask.shape[1] - ids.shape[1])
        if problem:
            raise DiffExportError(problem)
        out = self._run(step_feeds(ids, mask, cache, self.layers))
        present = {name % i: out[name % i].astype(self.dtype) for i in range(self.layers)
                   for name in (names.PRESENT_KEY, names.PRESENT_VALUE)}
        return out[names.LOGITS], present


def open_decoder_engine(engine_path: str | os.PathLike, folder: str | os.PathLike, plugin_lib: str | None = None):
    """The engine `diffexport trt FOLDER` built, ready to step on the GPU with the folder's genai
    config (end-of-text id, tokenizer) and the context its profile allows: a runner for
    step_loop.generate_stepped's loop. The engine's record must name the folder's model."""

    engine_path = Path(engine_path)
    record = read_engine_record(engine_path)
    _, config, meta = read_decoder_folder(folder)
    built_from = record["onnx_metadata"] if isinstance(record["onnx_metadata"], dict) else {}
    if built_from.get(KV_CACHE) != "1":
        raise DiffExportError(f"{engine_path.name} is a prefill engine: generation needs an engine built from a "
                              "KV-cache folder (`diffexport trt FOLDER`)")
    differing = [key for key in ("family", "config", "weights", "dtype") if built_from.get(key) != meta.get(key)]
    if differing:
        raise DiffExportError(f"{engine_path.name} was built from another model than {Path(folder).name} (its "
                              f"{', '.join(differing)} differ): give the folder the engine was built from")
    lib = str(find_plugin_library(plugin_lib)) if record.get("attention") == "plugin" else None
    engine = open_engine(engine_path.read_bytes(), record["module"], lib)
    return EngineDecoder(engine_path, record, meta, engine, config)


def open_engine_runtime(folder, *, provider: str = "auto", engine: str | None = None,
                        plugin_lib: str | None = None) -> StepLoopRuntime:
    """The TensorRT runtime: the engine `diffexport trt FOLDER` built (open_decoder_engine), on the
    GPU, stepped by the onnxruntime loop's code."""
    if engine is None:
        raise DiffExportError(ENGINE_PAIRING)
    if provider != "auto":
        raise DiffExportError("--provider chooses onnxruntime's execution provider: a TensorRT engine runs on the GPU")
    return StepLoopRuntime("tensorrt", folder, None, lambda: open_decoder_engine(engine, folder, plugin_lib))
