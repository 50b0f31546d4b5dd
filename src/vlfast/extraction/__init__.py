"""Large-scale, resumable, multi-GPU feature extraction and its output format.

``FeatureStore`` writes, ``FeatureCache`` reads, ``export`` writes one vector per sample as a Parquet or
Lance table, ``extract`` runs a model over inputs, ``extract_ray`` the same as Ray Data stages. Names load
lazily so reading a cache never imports the pipeline's dependencies, nor anything Ray.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from vlfast._lazy import lazy_exports

_EXPORTS = {
    "FeatureStore": "vlfast.extraction.store.writer",
    "RunConfigMismatch": "vlfast.extraction.store.resume",
    "partition": "vlfast.extraction.store.resume",
    "dist_info": "vlfast.extraction.store.resume",
    "FeatureCache": "vlfast.extraction.store.reader",
    "extract": "vlfast.extraction.api",
    "extract_ray": "vlfast.extraction.api",  # imports ray only when called
    "export": "vlfast.extraction.store.export",  # imports lance only for format="lance"
}

__all__ = list(_EXPORTS)

if TYPE_CHECKING:  # pragma: no cover
    from vlfast.extraction.store.export import export  # noqa: F401
    from vlfast.extraction.store.reader import FeatureCache  # noqa: F401
    from vlfast.extraction.store.resume import RunConfigMismatch, dist_info, partition  # noqa: F401
    from vlfast.extraction.store.writer import FeatureStore  # noqa: F401


__getattr__, __dir__ = lazy_exports(globals(), _EXPORTS)
