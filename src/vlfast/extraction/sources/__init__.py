"""Where samples come from: folders, manifests, WebDataset shards, object storage.

``sample`` is the leaf (:class:`Sample`, :class:`InputProblem`, what the store can hold); ``folder``,
``manifest``, ``webdataset`` and ``remote`` (inputs at URLs) are the sources; ``listing.load_inputs`` picks one
for an INPUT. Names load lazily, so importing :class:`Sample` does not import every source.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from vlfast._lazy import lazy_exports

_EXPORTS = {
    "EmptyInput": "vlfast.extraction.sources.sample",
    "InputProblem": "vlfast.extraction.sources.sample",
    "Sample": "vlfast.extraction.sources.sample",
    "load_inputs": "vlfast.extraction.sources.listing",
}

__all__ = list(_EXPORTS)

if TYPE_CHECKING:  # pragma: no cover
    from vlfast.extraction.sources.listing import load_inputs  # noqa: F401
    from vlfast.extraction.sources.sample import EmptyInput, InputProblem, Sample  # noqa: F401


__getattr__, __dir__ = lazy_exports(globals(), _EXPORTS)
