"""Shard listings kept in OUT, so that a resume, and every rank, lists a WebDataset shard without reading it.

Listing a shard reads every member header: about 40 ms for a local shard of 1,000 samples (ten minutes for
10,000 shards, on every rank and every resume), and the whole object for a remote shard of small images. What
the listing finds (each member's name, type, data offset and size, whether the shard is cut short and how, and
the bytes of the small prompt members) is kept as one file per shard in ``OUT/listings/`` (docs/extract.md,
"On-disk layout") and used instead when the shard is the same:

* a local shard is the same when its resolved path, size, modification time, change time and inode are; a
  shard changed less than :data:`SETTLE_S` ago is not kept (a timestamp tick could hide a second change);
* a shard at a URL is the same when its URL, size and ETag (as its folder's listing gives them) are; a
  store that gives no ETag keeps nothing.

A kept listing is a cache, never the truth: its name is a hash of that identity, the file repeats the
identity, gzip's CRC covers every byte, and the members must fit the shard's size; a file that fails any of
this is ignored, the shard listed again and the file replaced. The listings are written after OUT is
claimed, never by a run that is refused (:meth:`KeptListings.fresh` is what the run writes), each shard's
by one rank, and without fsync: a torn write fails its CRC and costs one listing.
"""

from __future__ import annotations

import base64
import gzip
import hashlib
import json
import os
import tarfile
import threading
import time
import zlib
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from vlfast.extraction.objstore import read_whole

__all__ = ["LISTING_DIR", "SETTLE_S", "KeptListings", "ListedMember", "local_identity", "remote_identity"]

LISTING_DIR = "listings"
FORMAT = 1  # of a listing file; part of the name, so another format is simply not found
SETTLE_S = 2.0  # a shard changed more recently is listed but not kept
_ETAG_KEYS = ("ETag", "etag", "Etag")


class ListedMember:
    """A tar member as a listing needs it: name, type, data offset and size, sparse or not (what grouping,
    checks and reading in place use; a ``TarInfo`` holds a dozen fields more)."""

    __slots__ = ("name", "offset_data", "size", "type", "sparse")

    def __init__(self, name: str, offset_data: int, size: int, type: bytes, sparse: bool = False):
        self.name, self.offset_data, self.size, self.type, self.sparse = name, offset_data, size, type, sparse

    @classmethod
    def of(cls, info: tarfile.TarInfo) -> ListedMember:
        return cls(info.name, info.offset_data, info.size, info.type, info.sparse is not None)

    def isreg(self) -> bool:
        return self.type in tarfile.REGULAR_TYPES

    def issparse(self) -> bool:
        return self.sparse


Listing = tuple[
    list[ListedMember], "str | None", dict[int, bytes]
]  # members, how it is cut short, prompt bytes


def local_identity(path: str, st: os.stat_result) -> list[Any] | None:
    """The identity of a local shard (``st``: its ``os.stat``), or None when it changed too recently to be
    kept."""
    if time.time_ns() - max(st.st_mtime_ns, st.st_ctime_ns) < SETTLE_S * 1e9:
        return None
    return ["file", os.path.realpath(path), st.st_size, st.st_mtime_ns, st.st_ctime_ns, st.st_ino]


def remote_identity(url: str, entry: Mapping[str, Any]) -> list[Any] | None:
    """The identity of a shard at a URL from its folder listing's entry, or None without an ETag."""
    etag = next((entry[k] for k in _ETAG_KEYS if entry.get(k)), None)
    if etag is None or entry.get("size") is None:
        return None
    return ["url", url, int(entry["size"]), str(etag)]


def listing_name(identity: Sequence[Any]) -> str:
    digest = hashlib.sha256(json.dumps([FORMAT, *identity]).encode()).hexdigest()
    return f"{digest[:32]}.json.gz"


def encode(identity: Sequence[Any], listing: Listing) -> bytes:
    members, cut, texts = listing
    doc = {
        "format": FORMAT,
        "identity": list(identity),
        "cut": cut,
        "names": [m.name for m in members],
        "offsets": [m.offset_data for m in members],
        "sizes": [m.size for m in members],
        "types": [m.type.decode("latin-1") for m in members],
        "sparse": [i for i, m in enumerate(members) if m.sparse],
        "texts": {str(k): base64.b64encode(v).decode() for k, v in texts.items()},
    }
    return gzip.compress(json.dumps(doc, separators=(",", ":")).encode(), compresslevel=1, mtime=0)


def decode(data: bytes, identity: Sequence[Any], size: int) -> Listing | None:
    """The listing ``data`` holds if it is whole, for ``identity``, and fits a shard of ``size`` bytes."""
    try:
        doc = json.loads(gzip.decompress(data))
        if doc["format"] != FORMAT or doc["identity"] != list(identity):
            return None
        names, offsets, sizes, types = doc["names"], doc["offsets"], doc["sizes"], doc["types"]
        if not len(names) == len(offsets) == len(sizes) == len(types):
            return None
        sparse = set(doc["sparse"])
        members = [
            ListedMember(n, o, s, t.encode("latin-1"), i in sparse)
            for i, (n, o, s, t) in enumerate(zip(names, offsets, sizes, types))
        ]
        last = 0
        for m in members:
            ok = type(m.name) is str and type(m.offset_data) is int and type(m.size) is int
            if not ok or m.offset_data < last or m.size < 0 or len(m.type) != 1:
                return None
            last = m.offset_data
        # a cut shard's last member may run past its end; a whole one's may not
        if members and doc["cut"] is None and members[-1].offset_data + members[-1].size > size:
            return None
        if not all(m.offset_data <= size for m in members):
            return None
        cut = doc["cut"]
        if cut is not None and type(cut) is not str:
            return None
        offsets_set = {m.offset_data for m in members}
        texts = {int(k): base64.b64decode(v, validate=True) for k, v in doc["texts"].items()}
        if not texts.keys() <= offsets_set:
            return None
        return members, cut, texts
    except (OSError, EOFError, zlib.error, ValueError, KeyError, TypeError, AttributeError, UnicodeError):
        return None  # gzip's CRC or length, JSON, a field missing or of another type


class KeptListings:
    """The listings kept in one OUT: :meth:`get` reads one (``read(name)`` gives a file's bytes or None),
    :meth:`keep` notes a fresh one for the run to write (:attr:`fresh`: name -> bytes), only for the shards
    this rank owns (their position in the pattern modulo ``world_size``). Safe from several threads."""

    def __init__(self, read: Callable[[str], bytes | None], rank: int = 0, world_size: int = 1):
        self._read, self.rank, self.world_size = read, rank, world_size
        self.fresh: dict[str, bytes] = {}
        self.used = 0  # shards whose kept listing was used
        self.damaged: list[str] = []  # kept listings found unusable (replaced by this run's)
        self._lock = threading.Lock()

    @classmethod
    def of_folder(cls, folder: Any, rank: int = 0, world_size: int = 1) -> KeptListings:
        """The listings kept in ``folder`` (a Path, or a UPath: one GET per listing). A listing that is not
        there, or cannot be read, is a miss: the shard is listed as if none had been kept."""

        def read(name: str) -> bytes | None:
            try:
                return read_whole(folder / name)  # one GET on object storage
            except Exception:
                return None

        return cls(read, rank, world_size)

    def get(self, identity: Sequence[Any] | None, size: int) -> Listing | None:
        if identity is None:
            return None
        name = listing_name(identity)
        data = self._read(name)
        if data is None:
            return None
        listing = decode(data, identity, size)
        with self._lock:
            if listing is None:
                self.damaged.append(name)
            else:
                self.used += 1
        return listing

    def listing(
        self, identity: Sequence[Any] | None, size: int, position: int, scan: Callable[[], Listing]
    ) -> Listing:
        """The shard's kept listing if there is a sound one for ``identity``, else ``scan()``'s, offered to
        be kept (``position``: the shard's place in the pattern)."""
        listing = self.get(identity, size)
        if listing is None:
            listing = scan()
            self.keep(identity, listing, position)
        return listing

    def keep(self, identity: Sequence[Any] | None, listing: Listing, position: int) -> None:
        if identity is None or position % self.world_size != self.rank:
            return
        data = encode(identity, listing)
        with self._lock:
            self.fresh[listing_name(identity)] = data
