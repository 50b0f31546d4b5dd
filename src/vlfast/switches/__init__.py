"""The switches that reach into users' processes, in one place that imports only downward (patching, pixels).

- ``env``: what ``VLFAST_PATCH``, ``VLFAST_PREPROCESS`` and ``VLFAST_RECORD`` say (no imports).
- ``hook``: the import hook that runs a function right after a transformers module is first imported.
- ``patch``: :func:`install_from_env`, run at interpreter start-up by vlfast's ``.pth`` file: arms the three.
- ``preprocess``: ``VLFAST_PREPROCESS``'s swap of a processor's image processor for vlfast's pixels.
- ``record``: what ran, per patched conv, and the image processor's calls (``record_calls``, ``VLFAST_RECORD``).
- ``run``: ``python -m vlfast.run``, a script or module run with every transformers model patched.

Importing this package is free (no torch): the start-up hook imports ``patch`` through it.
"""

from __future__ import annotations

from vlfast._lazy import lazy_exports

_EXPORTS = {
    "install_from_env": "patch",
    "record_calls": "record",
    "CallRecord": "record",
    "install_processor_switch": "preprocess",
    "swap_image_processor": "preprocess",
}

__all__ = list(_EXPORTS)

__getattr__, __dir__ = lazy_exports(globals(), _EXPORTS)
