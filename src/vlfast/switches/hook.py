"""The import hook the switches arm: a finder that lets the normal finders locate one module (e.g.
``transformers.modeling_utils``) and wraps its loader, so that a function runs right after its first import."""

from __future__ import annotations

import importlib.abc
import sys
from collections.abc import Callable

__all__ = ["after_import"]


class _PatchAfterImport(importlib.abc.MetaPathFinder):
    """Finds ``target`` with the other finders and wraps its loader to call ``activate(value)`` once it ran."""

    def __init__(self, value: str, target: str, activate: Callable[[str], None]) -> None:
        self.value, self.target, self.activate = value, target, activate

    def find_spec(self, fullname, path, target=None):
        if fullname != self.target:
            return None
        for finder in sys.meta_path:
            if finder is self or not hasattr(finder, "find_spec"):
                continue
            spec = finder.find_spec(fullname, path, target)
            if spec is not None and spec.loader is not None:
                spec.loader = _Loader(spec.loader, self.value, self.activate)
                return spec
        return None


class _Loader(importlib.abc.Loader):
    def __init__(self, inner, value: str, activate: Callable[[str], None]) -> None:
        self.inner, self.value, self.activate = inner, value, activate

    def create_module(self, spec):
        return self.inner.create_module(spec)

    def exec_module(self, module):
        self.inner.exec_module(module)
        self.activate(self.value)


def after_import(target: str, value: str, activate: Callable[[str], None]) -> None:
    """``activate(value)`` now if ``target`` is imported already, else right after its first import (once:
    a second call for the same target arms nothing more)."""
    if target in sys.modules:
        activate(value)
    elif not any(getattr(f, "target", None) == target for f in sys.meta_path):
        sys.meta_path.insert(0, _PatchAfterImport(value, target, activate))
