"""What transformers answered about a model's files, kept in ``OUT/facts.json`` so that a finished OUT is
answered without importing it (most of the 6.75 s its "nothing to do" took on a 2-core CPU; docs/format.md,
"facts.json").

Each answer (a checkpoint's family, its vision tower's config, class and tensor names, the processor files
and image processor class) is recorded with the key it was asked under, and taken from the record only
where the key made now is equal: the model (``ref:NAME``, or the xxh3 of every top-level ``*.json`` of the
checkpoint), what is installed (Python, transformers, torch, torchvision and Pillow versions, and whether
torchvision and PIL are found: transformers' image backend) and vlfast's own source. A cache like
``checked.json``: ignored when absent, damaged (its own xxh3) or made under another key.
"""

from __future__ import annotations

import copy
import functools
import json
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

from vlfast.extraction.objstore import read_whole
from vlfast.extraction.store.format import FACTS_FILE, canonical_json, installed_versions, xxh3
from vlfast.models.ref import ModelRef

__all__ = ["FACTS_VERSION", "ModelFacts", "facts_key"]

FACTS_VERSION = 1  # the record's layout; a vlfast that changes what an answer means changes its source too
_FORMAT = "vlfast-facts"
# What transformers picks its answers by, beside the files (its image backend: torchvision's or PIL's).
_INSTALLED = ("transformers", "torch", "torchvision", "pillow")


class ModelFacts:
    """The answers about ``model`` (``ref:NAME`` or a checkpoint folder), from ``out``'s record where its key
    is this one (``read``: an ``--overwrite`` reads none), else asked; what was asked can be recorded
    (:meth:`save`). ``out`` None: everything asked, nothing recorded."""

    def __init__(self, model: str, out: Any = None, *, read: bool = True):
        self.model = model
        self.key = None if out is None else facts_key(model)
        self._recorded: dict[str, Any] = _read(out, self.key) if read and self.key is not None else {}
        self._asked: dict[str, Any] = {}

    @property
    def recorded(self) -> frozenset[str]:
        """The answers the record gave (the others were asked)."""
        return frozenset(self._recorded)

    def answer(self, name: str, ask: Callable[[], Any]) -> Any:
        """The answer ``name``: recorded, else ``ask()`` (which imports transformers), kept as JSON so that both
        ways give the same value; one JSON cannot hold is returned as asked and never recorded."""
        if name in self._recorded:
            return copy.deepcopy(self._recorded[name])
        if name not in self._asked:
            value = ask()
            if self.key is None:
                return value
            try:
                self._asked[name] = json.loads(json.dumps(value, allow_nan=False))
            except (TypeError, ValueError):
                return value
        return copy.deepcopy(self._asked[name])

    def save(self, out: Any, tmp_tag: str) -> bool:
        """Record in ``out`` what was asked here, beside what the record gave; whether it was written. Best
        effort: a read-only OUT or a full disk keeps no record. ``tmp_tag`` starts with the writer's rank."""
        if not self._asked or self.key is None:
            return False
        from vlfast.extraction.store.backend import backend_for

        doc: dict[str, Any] = {
            "format": _FORMAT,
            "key": self.key,
            "answers": {**self._recorded, **self._asked},
        }
        doc["xxh3"] = xxh3(canonical_json(doc).encode())
        data = (json.dumps(doc, indent=1, sort_keys=True) + "\n").encode()
        try:
            backend_for(out, tmp_tag).write(out / FACTS_FILE, data, tmp_tag)
        except (OSError, ValueError):
            return False
        self._recorded.update(self._asked)
        self._asked.clear()
        return True


def facts_key(model: str) -> dict[str, Any] | None:
    """What the answers about ``model`` are made from; None where it cannot be made (no such folder, no
    config.json): then every answer is asked, and says what is wrong."""
    if ModelRef.of(model).is_reference:
        source: dict[str, Any] = {"reference": model}
    else:
        import xxhash

        folder = Path(model)
        try:
            names = sorted(n for n in os.listdir(folder) if n.endswith(".json"))
            if "config.json" not in names:
                return None
            source = {"files": {n: xxhash.xxh3_128_hexdigest((folder / n).read_bytes()) for n in names}}
        except OSError:  # not a folder, unreadable, or a folder under a .json name
            return None
    key = {"version": FACTS_VERSION, "model": source, "installed": _installed(), "vlfast": _vlfast_source()}
    return json.loads(json.dumps(key))


@functools.cache
def _installed() -> dict[str, Any]:
    """The versions transformers' answers depend on (package metadata: nothing is imported)."""
    import importlib.util

    out: dict[str, Any] = installed_versions(_INSTALLED)
    for module in ("torchvision", "PIL"):
        try:
            out[f"{module} found"] = importlib.util.find_spec(module) is not None
        except (ImportError, ValueError):
            out[f"{module} found"] = False
    return out


@functools.cache
def _vlfast_source() -> str:
    """xxh3 of vlfast's source files, names and bytes (1.3 MB: a few milliseconds)."""
    import xxhash

    import vlfast

    root = Path(vlfast.__file__).parent
    digest = xxhash.xxh3_128()
    for path in sorted(root.rglob("*.py")):
        for part in (path.relative_to(root).as_posix().encode(), path.read_bytes()):
            digest.update(len(part).to_bytes(8, "little"))
            digest.update(part)
    return digest.hexdigest()


def _read(out: Any, key: dict[str, Any]) -> dict[str, Any]:
    """The recorded answers, if the record is whole and made under ``key``; else none."""
    try:
        doc = json.loads(read_whole(out / FACTS_FILE))
        check = doc.pop("xxh3")
        if check != xxh3(canonical_json(doc).encode()) or doc.get("format") != _FORMAT:
            return {}
        answers = doc["answers"]
        return dict(answers) if doc.get("key") == key and isinstance(answers, dict) else {}
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return {}  # none yet, damaged, or not ours: everything is asked
