"""What identifies an input entry, as one 64-bit key: its id, kind, where its bytes are (a local path with
its folder resolved, a URL, a tar member's shard, name, offset and size, a clip's frames) and the texts the
features read.

A committed sample records its entry's key (:func:`sample_key`) and its content's key (:func:`content_key`:
the bytes' xxh3 in place of where they are). A resume computes the keys of every entry it would skip
(:func:`entry_keys`); one whose key was not recorded has changed since. docs/extract.md ("Inputs that
change") says what each check reads.
"""

from __future__ import annotations

import functools
import os

import numpy as np

from vlfast.extraction.ids import hash_one, mix_one
from vlfast.extraction.objstore import is_url
from vlfast.extraction.sources.sample import Sample
from vlfast.extraction.sources.table import KINDS, SampleTable, place_bytes

__all__ = ["KEY_SCHEME", "content_key", "entry_keys", "resolve_path", "sample_key", "texts_used"]

# Recorded in each index part beside the keys: keys made another way are not compared (unknown, not changed).
KEY_SCHEME = "1"
_CHUNK = 1 << 18  # entries whose keys are made at a time (their transient arrays: about 25 MB)


def texts_used(llm: bool, embedding: bool) -> tuple[str, ...]:
    """The row texts that reach the features: an embedding's text and instruction, an ``llm`` prompt."""
    if embedding:
        return ("text", "instruction")
    return ("prompt",) if llm else ()


def resolve_path(path: str) -> str:
    """A local path with its folder resolved (the file's own name kept, so a symlinked file stays itself);
    ``"dir/"`` gives the resolved folder with a trailing ``/``. A URL is kept."""
    if is_url(path):
        return path
    head, sep, tail = path.rpartition("/")
    folder = os.path.realpath(head) if head else ("/" if sep else os.path.realpath("."))
    return f"{folder.rstrip('/')}/{tail}"


_resolved_folder = functools.lru_cache(maxsize=1 << 12)(resolve_path)  # a folder resolved once per process


def entry_keys(
    table: SampleTable,
    texts: tuple[str, ...],
    positions: np.ndarray | None = None,
    id_hashes: np.ndarray | None = None,
) -> np.ndarray:
    """The key of each entry of ``table`` (uint64, in order), or of those at ``positions``; ``id_hashes``:
    :func:`~vlfast.extraction.ids.hash_ids` of the same entries' ids, when the caller has them."""
    resolve = functools.lru_cache(maxsize=1 << 16)(resolve_path)
    base, n = 0, len(table)
    if positions is not None:
        n = len(positions)
        if n and positions[-1] - positions[0] + 1 == n and bool((np.diff(positions) == 1).all()):
            base = int(positions[0])  # a run of rows (the usual case): read in place, not copied
        elif n:
            table = table.take(positions)
    out = np.empty(n, np.uint64)
    for at in range(0, n, _CHUNK):
        given = None if id_hashes is None else id_hashes[at : at + _CHUNK]
        stop = base + min(n, at + _CHUNK)
        out[at : at + _CHUNK] = table.identity_keys(texts, resolve, base + at, stop, id_hashes=given)
    return out


def sample_key(sample: Sample, texts: tuple[str, ...]) -> int:
    """The key of one sample, as :func:`entry_keys` gives it (tests/test_extract_input_identity.py)."""
    return _one_key(sample, texts, _place(sample))


def content_key(sample: Sample, texts: tuple[str, ...], digest: str) -> int:
    """The key of one sample with its bytes' xxh3 (16 hex digits) in place of where they are."""
    return _one_key(sample, texts, hash_one(b"xxh3:" + digest.encode()))


def _encode(text: str) -> bytes:
    return text.encode("utf-8", "surrogatepass")  # as the table encodes it: both sides of a key alike


def _one_key(sample: Sample, texts: tuple[str, ...], place: int) -> int:
    """:meth:`SampleTable.identity_keys` of one sample whose place hashes to ``place``."""
    fields = [hash_one(_encode(sample.id)), KINDS.index(sample.kind), place]
    for name in texts:
        value = getattr(sample, name)
        fields.append(mix_one(0, 0) if value is None else mix_one(1, hash_one(_encode(value))))
    return mix_one(*fields)


def _place(sample: Sample) -> int:
    """The hash of where a sample's bytes are, as :meth:`SampleTable.identity_keys` makes it."""
    if sample.kind in ("text", "frames") or sample.member is not None:
        return hash_one(place_bytes(sample.kind, sample.paths, sample.member, resolve_path))
    head, sep, tail = sample.paths[0].rpartition("/")
    return mix_one(hash_one(_encode(_resolved_folder(head + sep))), hash_one(_encode(tail)))
