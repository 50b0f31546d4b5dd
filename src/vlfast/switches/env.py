"""What the switches' variables say: ``VLFAST_PATCH``, ``VLFAST_PREPROCESS`` and ``VLFAST_RECORD`` read from the
environment, and the one line a value not understood gets on stderr.

Values: ``1``/``true``/``yes``/``on`` switch on (``VLFAST_PATCH``: Conv3d modules); ``all`` patches every eligible
Conv1d/2d/3d (``VLFAST_PATCH`` only); unset, empty or ``0``/``false``/``no``/``off`` leave the process alone. Any
other value switches nothing on and says so once; ``VLFAST_RECORD`` takes it as the path of a file to append
to. Imports nothing: vlfast's ``.pth`` file reads these at interpreter start-up.
"""

from __future__ import annotations

import os
import sys

__all__ = ["PATCH_VAR", "PREPROCESS_VAR", "RECORD_VAR", "env_setting", "preprocess_setting", "record_setting"]

PATCH_VAR = "VLFAST_PATCH"
PREPROCESS_VAR = "VLFAST_PREPROCESS"
RECORD_VAR = "VLFAST_RECORD"
OFF = ("", "0", "false", "no", "off")
ON = ("1", "true", "yes", "on", "all")
_warned = False
_preprocess_warned = False


def _switch(var: str, environ: dict | None, accepted: tuple[str, ...], warn) -> str | None:
    """The normalised value of switch ``var``; None when it is off or not one of ``accepted`` (then ``warn``)."""
    raw = (environ if environ is not None else os.environ).get(var, "")
    value = raw.strip().lower()
    if value in OFF:
        return None
    if value not in accepted:
        warn(raw)
        return None
    return value


def env_setting(environ: dict | None = None) -> str | None:
    """``VLFAST_PATCH``: ``None`` when the switch is off (or not understood), else the normalised value."""
    return _switch(PATCH_VAR, environ, ON, _warn_unknown)


def preprocess_setting(environ: dict | None = None) -> bool:
    """Whether ``VLFAST_PREPROCESS`` is on; a value not understood is off, said once on stderr."""
    return (
        _switch(PREPROCESS_VAR, environ, tuple(v for v in ON if v != "all"), _warn_unknown_preprocess)
        is not None
    )


def record_setting(environ: dict | None = None) -> str | None:
    """``VLFAST_RECORD`` as given (stripped): "1" and the like (stderr) or a file's path; None when off."""
    raw = (environ if environ is not None else os.environ).get(RECORD_VAR, "").strip()
    return None if raw.lower() in OFF else raw


def _warn_unknown_preprocess(raw: str) -> None:
    global _preprocess_warned
    if not _preprocess_warned:
        _preprocess_warned = True
        print(
            f"vlfast: ignoring {PREPROCESS_VAR}={raw!r}, image processors are left as they are: use 1, true, "
            "yes or on, or 0, false, no, off",
            file=sys.stderr,
        )


def _warn_unknown(raw: str) -> None:
    global _warned
    if not _warned:
        _warned = True
        print(
            f"vlfast: ignoring {PATCH_VAR}={raw!r}, nothing is patched: use 1, true, yes or on (Conv3d), "
            f"all (every eligible conv), or 0, false, no, off",
            file=sys.stderr,
        )
