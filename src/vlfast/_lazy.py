"""Package faces whose public names load their module on first use (PEP 562), so importing a package
costs nothing until a name is used."""

from __future__ import annotations

import importlib
from collections.abc import Callable
from typing import Any


def lazy_exports(namespace: dict[str, Any], exports: dict[str, str]) -> tuple[Callable, Callable]:
    """``__getattr__`` and ``__dir__`` for the package whose globals are ``namespace``; ``exports`` maps each
    public name to its module, absolute ("vlfast.models") or relative ("gemm"). A loaded name is kept."""
    package = namespace["__name__"]

    def __getattr__(name: str) -> Any:
        module = exports.get(name)
        if module is None:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        if not module.startswith("vlfast"):
            module = f"{package}.{module}"
        value = getattr(importlib.import_module(module), name)
        namespace[name] = value
        return value

    def __dir__() -> list[str]:
        return sorted(namespace["__all__"])

    return __getattr__, __dir__
