"""ONNX Runtime sessions for exported models: provider choice and one-line errors for bad files. At the
bottom of the package (core): backends run artifacts through it, and the passes that verify themselves
by running a graph (fusion, optimize) use it without reaching up to the backends."""

from __future__ import annotations

from pathlib import Path

from diffexport.core.errors import DiffExportError
from diffexport.core.files import require_file

PROVIDERS = {"cpu": "CPUExecutionProvider", "cuda": "CUDAExecutionProvider"}


def _import_ort():
    try:
        import onnxruntime
    except ImportError:
        raise DiffExportError("onnxruntime is not installed: pip install 'diffexport[onnx]' "
                              "(or onnxruntime-gpu for the CUDA provider)") from None
    return onnxruntime


def ortvalue_over(array):
    """An OrtValue over a contiguous numpy array's own memory (no copy): what a session writes into
    it through an IOBinding lands in the array."""
    return _import_ort().OrtValue.ortvalue_from_numpy(array)


def resolve_provider(provider: str = "auto") -> str:
    """'auto': the CUDA provider when onnxruntime-gpu and a GPU are present, else the CPU one."""
    ort = _import_ort()
    available = ort.get_available_providers()
    if provider == "auto":
        import torch

        provider = "cuda" if PROVIDERS["cuda"] in available and torch.cuda.is_available() else "cpu"
    if provider not in PROVIDERS:
        raise DiffExportError(f"unknown provider {provider!r}; choose one of {['auto', *PROVIDERS]}")
    if PROVIDERS[provider] not in available:
        raise DiffExportError(f"this onnxruntime has no {PROVIDERS[provider]} (it has {available}); "
                              "install onnxruntime-gpu for CUDA")
    return provider


def open_session(source, provider: str = "cpu", threads: int | None = None):
    """An InferenceSession on a file path or an in-memory ModelProto; corrupt, foreign or
    unsupported models give one clear line."""
    ort = _import_ort()
    if hasattr(source, "SerializeToString"):
        model, path = source.SerializeToString(), Path("the in-memory model")
    else:
        path = Path(source)
        require_file(path, "give an .onnx file")
        model = str(path)
    options = ort.SessionOptions()
    options.log_severity_level = 4  # failures reach the user through our message, not ORT's log
    if threads:
        options.intra_op_num_threads = threads
    providers = [PROVIDERS[provider]] + ([PROVIDERS["cpu"]] if provider != "cpu" else [])
    try:
        return ort.InferenceSession(model, options, providers=providers)
    except Exception as exc:  # onnxruntime raises its own Fail/InvalidGraph/NotImplemented types
        detail = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        if "NOT_IMPLEMENTED" in detail or "Could not find an implementation" in detail:
            raise DiffExportError(f"onnxruntime's {PROVIDERS[provider]} cannot run {path.name}: {detail} "
                                  "(bfloat16 models need the CUDA provider or TensorRT)") from None
        raise DiffExportError(f"{path} is not a valid ONNX model for onnxruntime: {detail}") from None
