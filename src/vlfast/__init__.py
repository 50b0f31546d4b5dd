"""vlfast: make Qwen-VL-family vision models fast and trustworthy.

Importing this package is cheap: it imports torch (already needed by any caller) but never initialises
CUDA nor imports transformers, pyarrow, av or other heavy optional packages; each public name loads its
module on first use.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from vlfast._lazy import lazy_exports

__version__ = "0.1.0"

# public name -> module that defines it. Modules are named apart from the functions they export
# (patching/patch, verification/verify, ...) so importing a submodule never shadows a function.
_EXPORTS = {
    **dict.fromkeys(["patch", "unpatch", "is_patched", "PatchReport"], "vlfast.patching.gemm"),
    "record_calls": "vlfast.switches.record",
    **dict.fromkeys(
        ["patch_transformers", "unpatch_transformers", "discover_families"], "vlfast.patching.integrations"
    ),
    **dict.fromkeys(["verify", "VerifyReport"], "vlfast.diagnosis.verification"),
    "load_model": "vlfast.models",
    "list_references": "vlfast.models.references",
    "doctor": "vlfast.diagnosis.doctor",
    "profile": "vlfast.diagnosis.profiler",
    **dict.fromkeys(["extract", "FeatureCache"], "vlfast.extraction"),
    "VisionPreprocessor": "vlfast.pixels.preprocessor",
    "audit_tokens": "vlfast.tokens",
    # what vlfast refuses on purpose (exit 2 in the CLI); anything else that escapes is a bug
    **dict.fromkeys(["VlfastError", "InputRefused"], "vlfast.errors"),
}

__all__ = ["__version__", *_EXPORTS]

if TYPE_CHECKING:  # pragma: no cover
    from vlfast.patching.gemm import PatchReport, is_patched, patch, unpatch  # noqa: F401


__getattr__, __dir__ = lazy_exports(globals(), _EXPORTS)
