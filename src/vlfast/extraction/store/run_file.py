"""run.json as vlfast writes it.

The writer writes run.json when it opens an OUT that has none; a finished OUT is answered "nothing to do"
without a store, so the read-only preflight puts a lost run.json back itself (``Out.restore_run_file``).
Readers need it: each part and shard header is checked against its configuration hash. The format is
docs/format.md's ("On-disk layout").
"""

from __future__ import annotations

import json
import time
from collections.abc import Collection, Mapping
from typing import Any

from vlfast.extraction.store.format import FORMAT_VERSION, config_hash, installed_versions, stable_config

__all__ = ["library_versions", "run_file_bytes"]


def library_versions() -> dict[str, str | None]:
    """Versions of what shapes the features and the bytes on disk (decoders included): run.json's and each
    shard's provenance, from package metadata."""
    return installed_versions(
        ("vlfast", "torch", "transformers", "av", "pillow", "safetensors", "pyarrow", "numpy")
    )


def run_file_bytes(
    run_config: Mapping[str, Any], volatile_keys: Collection[str], created_with: Mapping[str, Any]
) -> bytes:
    """run.json's bytes for ``run_config`` (canonical already), its volatile keys and the library versions
    of the writing process."""
    volatile = frozenset(volatile_keys)
    doc = {
        "format": "vlfast-features",
        "format_version": FORMAT_VERSION,
        "created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "volatile_keys": sorted(volatile),
        "config": dict(run_config),
        "config_hash": config_hash(stable_config(dict(run_config), volatile)),
        "created_with": dict(created_with),
    }
    return (json.dumps(doc, indent=2, sort_keys=True) + "\n").encode()
