"""The module paths of earlier tpcore (``tpcore.blocks``, ``tpcore.layers``, ``tpcore.policy``, ...).

Importing one gives the module that holds its names now, with one :class:`DeprecationWarning` naming
it; ``import tpcore`` installs the finder. Light: it imports nothing until an old path is imported.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import importlib.util
import sys
import warnings
from typing import Any

__all__ = ["MOVED_MODULES", "install"]

#: module paths of earlier tpcore -> the module that holds their names now
MOVED_MODULES = {
    "tpcore.auto": "tpcore.select.auto",
    "tpcore.blocks": "tpcore.authoring.blocks",
    "tpcore.check": "tpcore.tools.check",
    "tpcore.checkpoint": "tpcore.load.checkpoint",
    "tpcore.cli": "tpcore.tools.cli",
    "tpcore.comm": "tpcore.parallel.comm",
    "tpcore.conversion": "tpcore.load.conversion",
    "tpcore.demo": "tpcore.tools.demo",
    "tpcore.distributed": "tpcore.ranks.distributed",
    "tpcore.hookspecs": "tpcore.authoring.hookspecs",
    "tpcore.layers": "tpcore.parallel.layers",
    "tpcore.memfd": "tpcore.parallel.memfd",
    "tpcore.plugins": "tpcore.select.plugins",
    "tpcore.policy": "tpcore",
    "tpcore.precision": "tpcore.load.precision",
    "tpcore.process": "tpcore.ranks.process",
    "tpcore.pytest_plugin": "tpcore.testing.pytest_plugin",
    "tpcore.replacer": "tpcore.compat.parallelformers",
    "tpcore.reshapes": "tpcore.parallel.reshapes",
    "tpcore.rng": "tpcore.ranks.rng",
    "tpcore.safetensors_file": "tpcore.load.safetensors_file",
    "tpcore.samples": "tpcore.testing.samples",
    "tpcore.shares": "tpcore.cut.shares",
    "tpcore.shm": "tpcore.parallel.shm",
    "tpcore.skeleton": "tpcore.load.skeleton",
    "tpcore.slicer": "tpcore.compat.parallelformers",
    "tpcore.tp_plan": "tpcore.select.tp_plan",
    "tpcore.transfer": "tpcore.ranks.transfer",
    "tpcore.wire": "tpcore.ranks.wire",
    "tpcore.worker": "tpcore.ranks.worker",
    "tpcore.worker_errors": "tpcore.ranks.failures",
}


class _MovedModules(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Imports an old module path (:data:`MOVED_MODULES`) as the module that holds its names now."""

    def find_spec(self, name: str, path: Any = None, target: Any = None) -> importlib.machinery.ModuleSpec | None:
        if name not in MOVED_MODULES:
            return None
        return importlib.util.spec_from_loader(name, self)

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> Any:
        new = MOVED_MODULES[spec.name]
        where = "" if new == "tpcore" else f" (or {new})"
        warnings.warn(
            f"{spec.name} is deprecated; import its names from tpcore{where}", DeprecationWarning, stacklevel=2
        )
        module = importlib.import_module(new)
        sys.modules[spec.name] = module
        return module

    def exec_module(self, module: Any) -> None:
        """Nothing to run: the module it stands for ran when it was imported."""


def install() -> None:
    """Let ``import tpcore.<old path>`` find the module of :data:`MOVED_MODULES` (once per process)."""
    if not any(isinstance(finder, _MovedModules) for finder in sys.meta_path):
        sys.meta_path.append(_MovedModules())
