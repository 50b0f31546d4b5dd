"""The switches that reach into users' processes (``VLFAST_PATCH``, ``VLFAST_PREPROCESS``, ``VLFAST_RECORD``,
``python -m vlfast.run``), in one place that imports only downward (patching, pixels); its modules:
docs/internals.md. Importing this package is free (no torch): the start-up hook imports ``patch`` through it.
"""

from __future__ import annotations

from vlfast._lazy import lazy_exports

_EXPORTS = {
    "install_from_env": "patch",
    **dict.fromkeys(["record_calls", "CallRecord"], "record"),
    **dict.fromkeys(["install_processor_switch", "swap_image_processor"], "preprocess"),
}

__all__ = list(_EXPORTS)

__getattr__, __dir__ = lazy_exports(globals(), _EXPORTS)
