"""The GEMM patch and what carries it to users' code.

- ``gemm``: the exact GEMM for stride == kernel convolutions (``patch``, ``unpatch``, eligibility).
- ``integrations``: ``patch_transformers()``, which patches every transformers model as it is built.

The switches that carry it into users' processes (``VLFAST_PATCH``, ``VLFAST_RECORD``, ``vlfast run``) are
:mod:`vlfast.switches`, above this package. Importing this package is free (no torch).
"""

from __future__ import annotations

from vlfast._lazy import lazy_exports

_EXPORTS = {
    **dict.fromkeys(["patch", "unpatch", "is_patched", "patched_modules", "eligibility"], "gemm"),
    **dict.fromkeys(["GemmConvForward", "PatchReport", "ConvEntry"], "gemm"),
    **dict.fromkeys(["patch_transformers", "unpatch_transformers", "discover_families"], "integrations"),
}

__all__ = list(_EXPORTS)


__getattr__, __dir__ = lazy_exports(globals(), _EXPORTS)
