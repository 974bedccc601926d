"""The runtimes a decoder folder runs on, by name: the one place a runtime's name is read. Each
entry names the function that opens a Runtime (backends/base.py) from (folder, provider, engine,
plugin_lib), refusing the options it does not take; the CLI's --backend choices are this table's
keys. Polygraphy's runners and its runner selection are the model: a runtime is an object, opened
once, that every kind of generation (one answer, batches, beam search, a chat) goes through.

The entries are "module:function" and imported when a runtime is opened, so that reading the
names (the CLI's --help) loads none of the runtimes' libraries.
"""

from __future__ import annotations

import importlib
from pathlib import Path
from typing import TYPE_CHECKING

from diffexport.core.errors import DiffExportError

if TYPE_CHECKING:
    from diffexport.backends.base import Runtime

RUNTIMES: dict[str, str] = {
    # onnxruntime-genai: its own loop, cache and search (the default)
    "genai": "diffexport.backends.genai:open_genai_runtime",
    # a plain onnxruntime session, stepped by backends/step_loop.py
    "onnxruntime": "diffexport.backends.step_loop:open_onnxruntime_runtime",
    # the engine `diffexport trt FOLDER` built, on the GPU, stepped by the same loop
    "tensorrt": "diffexport.backends.tensorrt:open_engine_runtime",
}
DEFAULT_RUNTIME = "genai"


def open_runtime(name: str, folder: str | Path, *, provider: str = "auto", engine: str | None = None,
                 plugin_lib: str | None = None) -> Runtime:
    """The runtime `name` on a decoder folder. The options are checked now; what it runs (a session,
    an engine) is loaded at its open() or first call."""
    if name not in RUNTIMES:
        raise DiffExportError(f"unknown backend {name!r}; choose one of {list(RUNTIMES)}")
    module, function = RUNTIMES[name].split(":")
    return getattr(importlib.import_module(module), function)(folder, provider=provider, engine=engine,
                                                              plugin_lib=plugin_lib)
