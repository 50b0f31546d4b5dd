"""The GEMM patch and what carries it to users' code.

- ``gemm``: the exact GEMM for stride == kernel convolutions (``patch``, ``unpatch``, eligibility).
- ``integrations``: ``patch_transformers()``, which patches every transformers model as it is built.
- ``autopatch``: the ``VLFAST_PATCH`` switch, run at interpreter start-up by vlfast's ``.pth`` file.
- ``record``: what ran, per patched conv: GEMM or stock and why (``record_calls``, ``VLFAST_RECORD``).

Importing this package is free (no torch): the start-up hook imports ``autopatch`` through it.
"""

from __future__ import annotations

from vlfast._lazy import lazy_exports

_EXPORTS = {
    "patch": "gemm",
    "unpatch": "gemm",
    "is_patched": "gemm",
    "patched_modules": "gemm",
    "eligibility": "gemm",
    "GemmConvForward": "gemm",
    "PatchReport": "gemm",
    "ConvEntry": "gemm",
    "record_calls": "record",
    "CallRecord": "record",
    "patch_transformers": "integrations",
    "unpatch_transformers": "integrations",
    "discover_families": "integrations",
}

__all__ = list(_EXPORTS)


__getattr__, __dir__ = lazy_exports(globals(), _EXPORTS)
