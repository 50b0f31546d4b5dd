"""Python warnings on a command's console as one line each: ``vlfast: warning: MESSAGE``.

Python's format points at vlfast's code (or ``contextlib.py``), which tells a user nothing they can act on; a
warning from another installed library is named as its (``warning from torch: ...``). Only the format
changes; ``VLFAST_DEBUG=1`` keeps Python's, with the location.
"""

from __future__ import annotations

import os
import warnings
from pathlib import PurePath

__all__ = ["one_line_warnings"]

_PACKAGE_DIRS = ("site-packages", "dist-packages")


def _library(filename: str) -> str | None:
    """The installed library whose file raised a warning; None for vlfast, the standard library, a script."""
    parts = PurePath(filename).parts
    for i, part in enumerate(parts[:-1]):
        if part in _PACKAGE_DIRS:
            name = parts[i + 1].removesuffix(".py")
            return None if name == "vlfast" else name
    return None


def _one_line(
    message: Warning | str, category: type[Warning], filename: str, lineno: int, line: str | None = None
) -> str:
    source = _library(filename)
    label = "warning" if source is None else f"warning from {source}"
    return f"vlfast: {label}: {' '.join(str(message).split())}\n"  # one line, whatever the message's breaks


def one_line_warnings() -> None:
    """Format every Python warning as one line without its source location (not under ``VLFAST_DEBUG``).
    Decode workers forked from the command inherit it."""
    if os.environ.get("VLFAST_DEBUG"):
        return
    warnings.formatwarning = _one_line
