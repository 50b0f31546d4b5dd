"""The GEMM patch and what carries it to users' code.

- ``gemm``: the exact GEMM for stride == kernel convolutions (``patch``, ``unpatch``, eligibility).
- ``integrations``: ``patch_transformers()``, which patches every transformers model as it is built.
- ``autopatch``: the ``VLFAST_PATCH`` switch, run at interpreter start-up by vlfast's ``.pth`` file.
- ``verification``: ``verify``, the numerical proof that the patch changes nothing on a given model.

Importing this package is free (no torch): the start-up hook imports ``autopatch`` through it.
"""

from __future__ import annotations

import importlib

_EXPORTS = {
    "patch": "gemm",
    "unpatch": "gemm",
    "is_patched": "gemm",
    "patched_modules": "gemm",
    "eligibility": "gemm",
    "GemmConvForward": "gemm",
    "PatchReport": "gemm",
    "ConvEntry": "gemm",
    "patch_transformers": "integrations",
    "unpatch_transformers": "integrations",
    "discover_families": "integrations",
    "verify": "verification",
    "VerifyReport": "verification",
}

__all__ = list(_EXPORTS)


def __getattr__(name: str):
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'vlfast.patching' has no attribute {name!r}")
    return getattr(importlib.import_module(f"{__name__}.{module}"), name)


def __dir__() -> list[str]:
    return sorted(__all__)
