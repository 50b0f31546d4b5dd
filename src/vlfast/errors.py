"""vlfast's refusals: the exceptions it raises on purpose when the input or the request cannot be served.

Imports nothing of ours (every layer raises them). The CLI answers a ``VlfastError`` with its message
and exit 2; any other exception that leaves the library is a bug, exit 3.
"""

from __future__ import annotations

__all__ = ["InputRefused", "VlfastError"]


class VlfastError(Exception):
    """Base of every refusal vlfast raises on purpose: the message names the input and what to do."""


class InputRefused(VlfastError, ValueError, TypeError):
    """A value, file, option or configuration vlfast will not take.

    A ValueError and a TypeError as well, because vlfast raised those for these refusals before: a caller
    that caught either still catches it.
    """
