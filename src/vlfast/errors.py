"""vlfast's refusals, raised on purpose when the input or the request cannot be served (imports nothing of
ours: every layer raises them). The CLI answers one with its message and exit 2; anything else is a bug, exit 3.
"""

from __future__ import annotations

__all__ = ["InputRefused", "VlfastError"]


class VlfastError(Exception):
    """Base of every refusal vlfast raises on purpose: the message names the input and what to do."""


class InputRefused(VlfastError, ValueError, TypeError):
    """A value, file, option or configuration vlfast will not take; a ValueError and a TypeError too, as
    vlfast raised those for these refusals before."""
