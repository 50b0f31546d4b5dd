"""run.json as vlfast writes it, and its rebuild where a finished OUT lost it.

The writer writes run.json when it opens an OUT that has none (``FeatureStore``); a finished OUT is answered
"nothing to do" without a store, so the read-only preflight (``RunPlan.finished``) puts a lost run.json back
itself, from the configuration the request and every index part agree on (``read_state`` has compared them
by then). Readers (``FeatureCache``, export) need it: it is the configuration hash each part and shard
header is checked against. The format is docs/format.md's ("On-disk layout").
"""

from __future__ import annotations

import json
import time
from collections.abc import Collection, Mapping
from typing import Any

from vlfast.extraction.store.backend import backend_for
from vlfast.extraction.store.format import (
    FORMAT_VERSION,
    RUN_FILE,
    config_hash,
    installed_versions,
    stable_config,
)
from vlfast.extraction.store.resume import canonical_config

__all__ = ["library_versions", "restore_run_file", "run_file_bytes"]


def library_versions() -> dict[str, str | None]:
    """Versions of what shapes the features and the bytes on disk (decoders included): run.json's and each
    shard's provenance, the one list; read from package metadata, so nothing heavy is imported."""
    return installed_versions(
        ("vlfast", "torch", "transformers", "av", "pillow", "safetensors", "pyarrow", "numpy")
    )


def run_file_bytes(
    run_config: Mapping[str, Any], volatile_keys: Collection[str], created_with: Mapping[str, Any]
) -> bytes:
    """run.json's bytes for ``run_config`` (canonical: the JSON round trip already made), its volatile keys
    and the library versions of the writing process (``writer.library_versions``)."""
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


def restore_run_file(
    out: Any,
    run_config: Mapping[str, Any],
    volatile_keys: Collection[str],
    created_with: Mapping[str, Any],
    tag: str,
) -> bool:
    """Write run.json into ``out`` if it has none (whole or not at all, as the writer does); whether it was
    written. Best effort, like the preflight's caches: a read-only OUT keeps none and says nothing here (its
    readers say how to get it back)."""
    path = out / RUN_FILE
    if path.exists():
        return False
    data = run_file_bytes(canonical_config(dict(run_config)), volatile_keys, created_with)
    try:
        backend_for(out, tag).write(path, data, tag)
    except OSError:
        return False
    return True
