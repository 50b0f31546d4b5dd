"""Shard listings kept in OUT, so that a resume, and every rank, lists a WebDataset shard without reading it.

Listing a shard reads every member header (40 ms for a local shard of 1,000 samples; the whole object for a
remote shard of small images). The listing is kept per shard in ``OUT/listings/`` (docs/format.md) and used
while the shard is the same: a local one by resolved path, size, mtime, ctime and inode (not kept within
:data:`SETTLE_S` of a change: a timestamp tick could hide a second one); one at a URL by URL, size and ETag.
A kept listing is a cache, never the truth: its name hashes that identity, the file repeats it, gzip's CRC
covers every byte and the members must fit the shard; a file that fails is ignored and replaced. Written
after OUT is claimed, each shard's by one rank, without fsync (a torn write costs one listing).

A manifest's table is kept alike (:class:`KeptTable`: an Arrow IPC stream, then a JSON trailer with the
identity and the stream's xxh3-128) and memory-mapped by a resume instead of parsing every row again (ten
million JSONL rows: about 90 s), so the ranks of one node share its pages.
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

__all__ = [
    "SETTLE_S",
    "KeptListings",
    "KeptTable",
    "ListedMember",
    "local_identity",
    "manifest_identity",
    "remote_identity",
    "remote_manifest_identity",
]

FORMAT = 1  # of a listing file; part of the name, so another format is simply not found
SETTLE_S = 2.0  # a shard changed more recently is listed but not kept
_ETAG_KEYS = ("ETag", "etag", "Etag")


class ListedMember:
    """A tar member as a listing needs it (a ``TarInfo`` holds a dozen fields more)."""

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


# members, how it is cut short, prompt bytes
Listing = tuple[list[ListedMember], "str | None", dict[int, bytes]]


def local_identity(path: str, st: os.stat_result) -> list[Any] | None:
    """The identity of a local shard (``st``: its ``os.stat``), or None when it changed too recently."""
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
    """``<shard's hash>-<identity's hash>.json.gz``: the first part is the shard's path or URL alone, so the
    listing of a changed shard replaces its earlier one (see ``store.backend.keep_listings``)."""
    where = hashlib.sha256(json.dumps([FORMAT, *identity[:2]]).encode()).hexdigest()
    digest = hashlib.sha256(json.dumps([FORMAT, *identity]).encode()).hexdigest()
    return f"{where[:16]}-{digest[:32]}.json.gz"


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
            if not ok or not last <= m.offset_data <= size or m.size < 0 or len(m.type) != 1:
                return None
            last = m.offset_data
        cut = doc["cut"]
        if cut is not None and type(cut) is not str:
            return None
        # a cut shard's last member may run past its end; a whole one's may not
        if members and cut is None and members[-1].offset_data + members[-1].size > size:
            return None
        texts = {int(k): base64.b64decode(v, validate=True) for k, v in doc["texts"].items()}
        if not texts.keys() <= {m.offset_data for m in members}:
            return None
        return members, cut, texts
    except (OSError, EOFError, zlib.error, ValueError, KeyError, TypeError, AttributeError, UnicodeError):
        return None  # gzip's CRC or length, JSON, a field missing or of another type


TABLE_FORMAT = 1  # of a kept manifest table; bump it when the manifest parsing rules change what rows become
_TABLE_MAGIC = b"VLFTABL1"


def manifest_identity(path: os.PathLike | str, base: Any) -> list[Any] | None:
    """The identity of a local manifest read with relative paths resolved against ``base``, or None."""
    try:
        st = os.stat(path)
    except OSError:
        return None
    file = local_identity(os.fspath(path), st)
    return None if file is None else ["manifest", _parser(), str(base), *file]


def remote_manifest_identity(url: str, entry: Mapping[str, Any]) -> list[Any] | None:
    """The identity of a manifest at a URL from its ``info`` entry, or None without an ETag."""
    file = remote_identity(url, entry)
    return None if file is None else ["manifest", _parser(), url, *file]


def _parser() -> str:
    """This format and vlfast's version: a release may read rows differently, so its tables are its own."""
    from vlfast import __version__

    return f"{TABLE_FORMAT}/{__version__}"


def table_name(identity: Sequence[Any]) -> str:
    """``manifest-<path's hash>-<identity's hash>.arrow``: a new version of the same manifest shares the
    first part, so its table replaces the earlier one (see ``store.backend.keep_listings``)."""
    where = hashlib.sha256(json.dumps(list(identity[:5])).encode()).hexdigest()[:16]  # up to its path
    return f"manifest-{where}-{hashlib.sha256(json.dumps(list(identity)).encode()).hexdigest()[:32]}.arrow"


class KeptTable:
    """A manifest's table to be kept, held (not a serialised copy) until the store's backend writes it once
    OUT is claimed (:meth:`write_file`; on object storage a local temp file, then uploaded)."""

    def __init__(self, identity: Sequence[Any], table: Any, problems: Sequence[Any]):
        self.identity, self.table, self.problems = list(identity), table, list(problems)

    def write_file(self, path: os.PathLike | str) -> None:
        """Write the file at ``path``: the stream first, straight from the table's buffers, then the trailer."""
        import pyarrow as pa
        import xxhash

        batch, extras = self.table.to_arrow()
        with pa.OSFile(os.fspath(path), "wb") as sink:
            with pa.ipc.new_stream(sink, batch.schema) as writer:
                writer.write_batch(batch)
            n = sink.tell()
        with pa.memory_map(os.fspath(path)) as m:
            digest = xxhash.xxh3_128_hexdigest(memoryview(m.read_buffer(n)))
        doc = {
            "format": TABLE_FORMAT,
            "identity": self.identity,
            "stream_bytes": n,
            "xxh3_128": digest,
            **extras,
            "problems": [[p.where, p.reason, p.id] for p in self.problems],
        }
        body = json.dumps(doc, separators=(",", ":")).encode()
        # the trailer's own hash: with the stream's inside it, every byte of the file is covered
        with open(path, "ab") as f:
            f.write(body + xxhash.xxh3_128_digest(body) + len(body).to_bytes(8, "little") + _TABLE_MAGIC)


def decode_table(buffer: Any, identity: Sequence[Any]) -> tuple[Any, list[Any]] | None:
    """(table, problems) that a kept file's bytes ``buffer`` (a ``pyarrow.Buffer``) holds, if it is whole
    and for ``identity``; its columns stay in ``buffer`` (a memory map's pages, not a copy)."""
    import pyarrow as pa
    import xxhash

    from vlfast.extraction.sources.sample import InputProblem
    from vlfast.extraction.sources.table import SampleTable

    try:
        size = buffer.size
        if size < 16 or buffer.slice(size - 8).to_pybytes() != _TABLE_MAGIC:
            return None
        length = int.from_bytes(buffer.slice(size - 16, 8).to_pybytes(), "little")
        if length > size - 32:
            return None
        body = buffer.slice(size - 32 - length, length).to_pybytes()
        if xxhash.xxh3_128_digest(body) != buffer.slice(size - 32, 16).to_pybytes():
            return None
        doc = json.loads(body)
        n = doc["stream_bytes"]
        if doc["format"] != TABLE_FORMAT or doc["identity"] != list(identity) or n + length + 32 != size:
            return None
        stream = buffer.slice(0, n)
        if xxhash.xxh3_128_hexdigest(memoryview(stream)) != doc["xxh3_128"]:
            return None
        reader = pa.ipc.open_stream(pa.BufferReader(stream))
        batch = reader.read_next_batch()
        table = SampleTable.from_arrow(batch, {k: doc[k] for k in ("dirs", "frames", "optional")})
        problems = [
            InputProblem(str(w), str(r), None if i is None else str(i)) for w, r, i in doc["problems"]
        ]
        return table, problems
    except (OSError, ValueError, KeyError, TypeError, IndexError, StopIteration, pa.ArrowException):
        return None  # cut short, another file, a flipped bit: a miss, listed again


class KeptListings:
    """The listings kept in one OUT: :meth:`listing` reads one (``read(name)`` gives a file's bytes or None),
    or notes a fresh one for the run to write (:attr:`fresh`), for the shards this rank owns (position
    modulo ``world_size``). Thread-safe."""

    def __init__(
        self,
        read: Callable[[str], bytes | None],
        rank: int = 0,
        world_size: int = 1,
        read_mapped: Callable[[str], Any] | None = None,
    ):
        self._read, self.rank, self.world_size = read, rank, world_size
        # a kept file's bytes as a pyarrow Buffer: a memory map on local disk (default: ``read``'s bytes)
        self._read_mapped = read_mapped or self._mapped_from_read
        self.fresh: dict[str, bytes | KeptTable] = {}
        self.used = 0  # shards whose kept listing was used
        self.damaged: list[str] = []  # kept listings found unusable (replaced by this run's)
        self._lock = threading.Lock()

    @classmethod
    def of_folder(cls, folder: Any, rank: int = 0, world_size: int = 1) -> KeptListings:
        """The listings kept in ``folder`` (a Path or a UPath); one missing or unreadable is a miss."""

        def read(name: str) -> bytes | None:
            try:
                return read_whole(folder / name)  # one GET on object storage
            except Exception:
                return None

        def read_mapped(name: str) -> Any:
            import pyarrow as pa

            try:
                with pa.memory_map(os.fspath(folder / name)) as m:
                    return m.read_buffer()  # the map stays open while its buffer is referenced
            except (OSError, pa.ArrowException):
                return None

        # on object storage a kept table is one GET into memory, as ``read`` gives it
        local = getattr(folder, "fs", None) is None
        return cls(read, rank, world_size, read_mapped if local else None)

    def table(
        self, identity: Sequence[Any] | None, load: Callable[[], tuple[Any, list[Any]]]
    ) -> tuple[Any, list[Any]]:
        """A manifest's (table, problems): the kept one if sound, else ``load()``'s, offered to be kept."""
        if identity is not None:
            name = table_name(identity)
            buffer = self._read_mapped(name)
            got = None if buffer is None else self._counted(name, decode_table(buffer, identity))
            if got is not None:
                return got
        table, problems = load()
        if identity is not None and self.rank == 0 and table.can_keep():
            with self._lock:
                self.fresh[table_name(identity)] = KeptTable(identity, table, problems)
        return table, problems

    def _mapped_from_read(self, name: str) -> Any:
        import pyarrow as pa

        data = self._read(name)
        return None if data is None else pa.py_buffer(data)

    def _counted(self, name: str, got: Any) -> Any:
        """``got``, what the kept file ``name`` decoded to, counted as used or (None) damaged."""
        with self._lock:
            if got is None:
                self.damaged.append(name)
            else:
                self.used += 1
        return got

    def listing(
        self, identity: Sequence[Any] | None, size: int, position: int, scan: Callable[[], Listing]
    ) -> Listing:
        """The shard's kept listing if sound, else ``scan()``'s, offered to be kept."""
        if identity is None:
            return scan()
        name = listing_name(identity)
        data = self._read(name)
        got = None if data is None else self._counted(name, decode(data, identity, size))
        if got is not None:
            return got
        listing = scan()
        if position % self.world_size == self.rank:
            data = encode(identity, listing)
            with self._lock:
                self.fresh[name] = data
        return listing
