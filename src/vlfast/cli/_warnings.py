"""Python warnings on a command's console as one line each: ``vlfast: warning: MESSAGE``.

Python's own format (``/site-packages/vlfast/extraction/store/writer.py:469: UserWarning: ...`` and the
source line under it) points at vlfast's code, or at ``contextlib.py`` where a warning is raised in a
``with`` block's exit, which tells a user nothing they can act on: the message itself says what happened and
what to do. A warning raised by another installed library is named as its (``warning from torch: ...``).
``VLFAST_DEBUG=1`` keeps Python's format, with the location, as it keeps tracebacks.

Only the format changes (``warnings.formatwarning``): where a warning goes, and whether a filter or
``catch_warnings(record=True)`` takes it, stay Python's.
"""

from __future__ import annotations

import os
import warnings
from pathlib import PurePath

__all__ = ["one_line_warnings"]

_PACKAGE_DIRS = ("site-packages", "dist-packages")


def _library(filename: str) -> str | None:
    """The installed library whose file raised a warning, or None for vlfast's own, the standard library's
    and a script's (whose message is vlfast's or the user's own)."""
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
