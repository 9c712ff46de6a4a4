"""Runs code right after a module is imported, without importing it first (a worker must not
import torch before the script does)."""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import sys
from collections.abc import Callable, Sequence
from types import ModuleType
from typing import Any


def when_imported(name: str, then: Callable[[ModuleType], None]) -> None:
    """Calls ``then(module)`` now if module ``name`` (a full name, ``torch.optim.optimizer``) is
    imported, else right after it executes, before anyone else gets it.

    Example:
        >>> when_imported("json", lambda module: print(module.__name__))
        json
    """
    module = sys.modules.get(name)
    if module is not None:
        then(module)
    else:
        sys.meta_path.insert(0, _AfterImport(name, then))


class _AfterImport(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """The finder, then loader, of :func:`when_imported`: wraps the module's own loader once."""

    def __init__(self, name: str, then: Callable[[ModuleType], None]) -> None:
        self.name = name
        self.then = then
        self.loader: Any = None

    def find_spec(self, name: str, path: Sequence[str] | None, target: ModuleType | None = None) -> Any:
        if name != self.name:
            return None
        sys.meta_path.remove(self)
        spec = importlib.machinery.PathFinder.find_spec(name, path)
        if spec is None or spec.loader is None:
            return spec
        self.loader, spec.loader = spec.loader, self
        return spec

    def create_module(self, spec: Any) -> ModuleType | None:
        return self.loader.create_module(spec)

    def exec_module(self, module: ModuleType) -> None:
        self.loader.exec_module(module)
        self.then(module)
