"""Modules named at the top of a file and imported at their first use (Polygraphy's
mod.lazy_import is the model). The command line names everything a command runs this way, so that
`diffexport --help`, and a command refused for a missing input, load no heavy library, while each
file still lists what it depends on at its top.
"""

from __future__ import annotations

import importlib
import types


class LazyModule(types.ModuleType):
    """Stands for the module `name` until an attribute is read, then imports it and hands on."""

    def __init__(self, name: str):
        super().__init__(name)
        self.__dict__["_lazy_module"] = None

    def _load(self) -> types.ModuleType:
        module = self.__dict__["_lazy_module"]
        if module is None:
            module = self.__dict__["_lazy_module"] = importlib.import_module(self.__name__)
        return module

    def __getattr__(self, attr: str):
        return getattr(self._load(), attr)

    def __dir__(self):
        return dir(self._load())


def lazy_import(name: str) -> types.ModuleType:
    """The module `name`, imported when first used (tests/test_layers.py counts it as an import)."""
    return LazyModule(name)
