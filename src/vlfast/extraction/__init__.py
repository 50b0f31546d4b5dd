"""Large-scale, resumable, multi-GPU feature extraction and its output format.

``FeatureStore`` writes (store.py), ``FeatureCache`` reads (cache.py), ``extract`` runs a model over inputs
(pipeline.py), ``extract_ray`` the same as Ray Data stages (ray_engine.py). Names load lazily so reading a
cache never imports the pipeline's dependencies, nor anything Ray.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

_EXPORTS = {
    "FeatureStore": "vlfast.extraction.store",
    "RunConfigMismatch": "vlfast.extraction.resume",
    "partition": "vlfast.extraction.resume",
    "dist_info": "vlfast.extraction.resume",
    "FeatureCache": "vlfast.extraction.cache",
    "extract": "vlfast.extraction.pipeline",
    "extract_ray": "vlfast.extraction.ray_engine",  # imports ray only when called
}

__all__ = list(_EXPORTS)

if TYPE_CHECKING:  # pragma: no cover
    from vlfast.extraction.cache import FeatureCache  # noqa: F401
    from vlfast.extraction.resume import RunConfigMismatch, dist_info, partition  # noqa: F401
    from vlfast.extraction.store import FeatureStore  # noqa: F401


def __getattr__(name: str):
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'vlfast.extraction' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(__all__)
