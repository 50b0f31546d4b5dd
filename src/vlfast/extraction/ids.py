"""What a sample id may be, and which rank owns it: the rules the inputs and the store share.

Ids are what OUT keys on (docs/format.md, "On-disk layout"): UTF-8 text of at most :data:`MAX_ID_BYTES`
bytes. Which rank extracts an id is a hash of the id alone (:func:`owner_rank`), so ranks that list the
inputs in different orders still divide them with no gaps or duplicates.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable, Iterator, Sequence, Sized
from collections.abc import Set as AbstractSet
from typing import TYPE_CHECKING, Any

import numpy as np

if TYPE_CHECKING:
    import pyarrow as pa

from vlfast.errors import InputRefused

__all__ = [
    "MAX_ID_BYTES",
    "ArrowStrings",
    "IdSet",
    "check_id",
    "first_copies",
    "hash_bytes",
    "hash_ids",
    "hash_one",
    "mix",
    "mix_one",
    "owner_rank",
    "partition",
]

MAX_ID_BYTES = 4096  # an id is stored in Parquet, JSON and the shard header; longer ones are refused


def check_id(sample_id: Any) -> str:
    """``sample_id`` if the folder can store it, else InputRefused saying why."""
    if not isinstance(sample_id, str) or not sample_id:
        raise InputRefused(f"sample_id must be a non-empty str, got {sample_id!r}")
    try:
        n = len(sample_id.encode("utf-8"))
    except UnicodeEncodeError:
        raise InputRefused(f"sample id {sample_id!r} is not valid Unicode text (a lone surrogate)") from None
    if n > MAX_ID_BYTES:
        raise InputRefused(
            f"sample id of {n} bytes is longer than the {MAX_ID_BYTES}-byte limit: {sample_id[:60]!r}..."
        )
    return sample_id


def partition(ids: Sequence[str], rank: int, world_size: int) -> list[str]:
    """The ids rank ``rank`` of ``world_size`` owns, in input order.

    The owner is a blake2b hash of the id alone (not Python's salted ``hash``): a repeated id always lands
    on the same rank, where FeatureStore records it as a "duplicate id". Partition the FULL id list, then
    drop ``done_ids()``; partitioning only the remaining ids would depend on when each rank looked.
    """
    if not isinstance(world_size, int) or world_size < 1:
        raise InputRefused(f"world_size must be a positive int, got {world_size!r}")
    if not isinstance(rank, int) or not 0 <= rank < world_size:
        raise InputRefused(f"rank must be in [0, {world_size}), got {rank!r}")
    if world_size == 1:
        return list(ids)
    return [i for i in ids if owner_rank(i, world_size) == rank]


def owner_rank(sample_id: str, world_size: int) -> int:
    digest = hashlib.blake2b(sample_id.encode("utf-8", "surrogatepass"), digest_size=8).digest()
    return int.from_bytes(digest, "big") % world_size


# ids held as data: millions of ids in a few arrays instead of millions of Python objects (issue 22)

_CHUNK = 1 << 16  # ids converted to Python objects at a time when a column is iterated
_CONFIRM = 1 << 18  # hash hits confirmed against their ids at a time (a copy of this many ids a side)
_FIND = 1 << 21  # ids looked up at a time: ten million at once held three 80 MB copies of their hashes


# The hash is FNV-1a (64-bit) of the id's UTF-8 bytes: numpy computes it for a whole Arrow column at once
# (1.4 s for 10M ids here, against 4.4 s for a library hash per id). It is never stored, only used to sort
# and bisect; every hit is confirmed against the id itself.
_FNV_OFFSET, _FNV_PRIME, _MASK = 0xCBF29CE484222325, 0x100000001B3, (1 << 64) - 1
_SMALL = 4096  # fewer ids than this are hashed one by one


def _hash_one(sample_id: str) -> int:
    return hash_one(sample_id.encode("utf-8", "surrogatepass"))


def hash_ids(ids: Iterable[str] | pa.Array | pa.ChunkedArray) -> np.ndarray:
    """The 64-bit FNV-1a of each id's UTF-8 bytes, as uint64 in the ids' order (a long list of ``str`` is
    made an Arrow column first)."""
    import pyarrow as pa

    if not isinstance(ids, (pa.Array, pa.ChunkedArray)):
        ids = ids if isinstance(ids, list) else list(ids)
        if len(ids) < _SMALL:
            return np.fromiter(map(_hash_one, ids), dtype=np.uint64, count=len(ids))
        ids = pa.array(ids, pa.large_string())
    chunks = ids.chunks if isinstance(ids, pa.ChunkedArray) else [ids]
    if len(chunks) == 1:
        return _hash_column(_as_strings(chunks[0]))
    out, at = np.empty(sum(len(c) for c in chunks), np.uint64), 0
    for c in chunks:  # into one array as they come: a list of parts and their concatenation held both
        out[at : at + len(c)] = _hash_column(_as_strings(c))
        at += len(c)
    return out


def hash_bytes(column: pa.Array | pa.ChunkedArray) -> np.ndarray:
    """The same 64-bit FNV-1a of each value of a binary column (any bytes, not only UTF-8), as uint64."""
    import pyarrow as pa

    return _hash_column(_as_strings(column, pa.large_binary()))


def hash_one(data: bytes) -> int:
    """:func:`hash_bytes` of one value, without numpy (for one sample at a time)."""
    h = _FNV_OFFSET
    for byte in data:
        h = ((h ^ byte) * _FNV_PRIME) & _MASK
    return h


def mix_one(*hashes: int) -> int:
    """:func:`mix` of one row, without numpy (for one sample at a time)."""
    out = _FNV_OFFSET
    for h in hashes:
        out ^= h
        out ^= out >> 30
        out = (out * 0xBF58476D1CE4E5B9) & _MASK
        out ^= out >> 27
        out = (out * 0x94D049BB133111EB) & _MASK
        out ^= out >> 31
    return out


def mix(*hashes: np.ndarray) -> np.ndarray:
    """One uint64 per row from several (each an array, or a uint64 for all rows), each folded in through
    splitmix64's finaliser."""
    out = np.full(max((len(h) for h in hashes if np.ndim(h)), default=1), _FNV_OFFSET, np.uint64)
    with np.errstate(over="ignore"):
        for h in hashes:
            out ^= np.asarray(h, np.uint64)
            out ^= out >> np.uint64(30)
            out *= np.uint64(0xBF58476D1CE4E5B9)
            out ^= out >> np.uint64(27)
            out *= np.uint64(0x94D049BB133111EB)
            out ^= out >> np.uint64(31)
    return out


def _hash_column(column: pa.Array) -> np.ndarray:
    """FNV-1a of each string of a ``large_string`` column, vectorised over the ids: step ``j`` mixes in
    byte ``j`` of every id at least ``j + 1`` bytes long (longest first, so each step takes a prefix)."""
    n = len(column)
    if n == 0:
        return np.empty(0, np.uint64)
    buffers = column.buffers()
    offsets = np.frombuffer(buffers[1], dtype=np.int64, count=n + 1, offset=column.offset * 8)
    data = np.frombuffer(buffers[2], dtype=np.uint8) if buffers[2] is not None else np.empty(0, np.uint8)
    starts = offsets[:-1]
    lengths = offsets[1:] - starts
    order = np.argsort(-lengths, kind="stable")
    by_length, starts = lengths[order], starts[order]
    active = np.searchsorted(-by_length, -np.arange(int(by_length[0])), side="left")  # ids longer than j
    h = np.full(n, _FNV_OFFSET, np.uint64)
    prime = np.uint64(_FNV_PRIME)
    for j, count in enumerate(active.tolist()):
        part = h[:count]
        np.bitwise_xor(part, data[starts[:count] + j], out=part)
        np.multiply(part, prime, out=part)  # wraps modulo 2**64, as FNV does
    out = np.empty(n, np.uint64)
    out[order] = h
    return out


def _as_strings(ids: Iterable[str] | pa.Array | pa.ChunkedArray, kind: pa.DataType | None = None) -> pa.Array:
    """``ids`` as one ``large_string`` array (or of Arrow type ``kind``)."""
    import pyarrow as pa

    kind = kind or pa.large_string()
    if isinstance(ids, pa.ChunkedArray):
        ids = ids.combine_chunks() if ids.num_chunks else pa.array([], kind)
    if not isinstance(ids, pa.Array):
        ids = pa.array(ids if isinstance(ids, list) else list(ids), kind)
    return ids.cast(kind) if ids.type != kind else ids


class SortedIds:
    """Ids sorted by their hash without moving the ids: ``hash`` (uint64, ascending), ``source`` (each sorted
    entry's position in ``ids``) and ``ids`` (Arrow, as given; a ``ChunkedArray`` once merges appended to
    it). Lookups bisect the hashes and confirm each hit against the id itself."""

    __slots__ = ("hash", "ids", "runs", "source")

    def __init__(self, hashes: np.ndarray, ids: pa.Array | pa.ChunkedArray, *, consume: bool = False):
        """``consume``: ``hashes`` is sorted in place (80 MB less at the peak for ten million ids)."""
        order = np.argsort(hashes)  # ids are unique here: the order among equal hashes does not matter
        if consume:
            hashes.sort()  # the same values as hashes[order]: equal hashes are equal
        self.hash = hashes if consume else hashes[order]
        self.ids, self.source = ids, order.astype(_index_type(len(ids)), copy=False)
        self._runs()

    def _runs(self) -> None:  # whether any hash repeats: only then do lookups walk a run
        self.runs = bool(len(self.hash) > 1 and np.any(self.hash[1:] == self.hash[:-1]))

    def __len__(self) -> int:
        return len(self.hash)

    def id_at(self, i: int) -> str:
        """The id at sorted position ``i``."""
        return self.ids[int(self.source[i])].as_py()

    def with_ids(self, ids: pa.Array | pa.ChunkedArray, hashes: np.ndarray) -> SortedIds:
        """A new table: these entries plus ``ids`` (new ones, with their ``hashes``), appended without a
        copy, the hashes merged in one pass."""
        order = np.argsort(hashes)
        new_hashes = hashes[order]
        at = np.searchsorted(self.hash, new_hashes)
        merged = SortedIds.__new__(SortedIds)
        merged.ids = _appended(self.ids, ids)
        index = _index_type(len(merged.ids))
        merged.hash = np.insert(self.hash, at, new_hashes)
        merged.source = np.insert(
            self.source.astype(index, copy=False), at, (order + len(self.ids)).astype(index)
        )
        merged._runs()
        return merged

    def find(self, sample_id: str, h: int | None = None) -> int:
        """The sorted position of ``sample_id`` (its first copy), or -1."""
        key = np.uint64(_hash_one(sample_id) if h is None else h)
        i, n = int(self.hash.searchsorted(key)), len(self.hash)  # a numpy scalar: half bisect's time
        while i < n and self.hash[i] == key:
            if self.id_at(i) == sample_id:
                return i
            i += 1
        return -1

    def find_many(self, ids: pa.Array, hashes: np.ndarray) -> np.ndarray:
        """The sorted position of each of ``ids`` (with their ``hashes``), -1 where absent; vectorised."""
        n = len(self.hash)
        found = np.full(len(hashes), -1, np.int64)
        if n == 0 or len(hashes) == 0:
            return found
        for k in range(0, len(hashes), _FIND):  # a slice at a time: its sort's copies are a slice's size
            found[k : k + _FIND] = self._find_slice(ids, hashes, k, min(len(hashes), k + _FIND))
        return found

    def _find_slice(self, ids: pa.Array, hashes: np.ndarray, lo: int, hi: int) -> np.ndarray:
        import pyarrow.compute as pc

        n = len(self.hash)
        hashes = hashes[lo:hi]
        found = np.full(len(hashes), -1, np.int64)
        # Searched in hash order: a sorted search walks the table once (0.3 s for 10M ids into 5M here)
        # where unsorted ones jump about it (7.5 s).
        order = np.argsort(hashes)
        pos = np.empty(len(hashes), np.int64)
        pos[order] = np.searchsorted(self.hash, hashes[order], side="left")
        del order
        np.minimum(pos, n - 1, out=pos)
        hit = np.flatnonzero(self.hash[pos] == hashes)
        # Hits confirmed against the ids a slice at a time: both sides' ids are copied to be compared.
        for k in range(0, hit.size, _CONFIRM):
            part = hit[k : k + _CONFIRM]
            same = pc.equal(take(self.ids, self.source[pos[part]]), take(ids, part + lo))
            same = same.to_numpy(zero_copy_only=False)
            found[part[same]] = pos[part[same]]
            if self.runs:  # a hash shared by several ids: walk its run for the hits that did not match
                for j in part[~same]:
                    found[j] = self.find(ids[int(j) + lo].as_py(), int(hashes[j]))
        return found


_MAX_CHUNKS = 64  # chunks of ids a SortedIds keeps before combining them (one copy, rare)...
_MIN_CHUNK = 1 << 16  # ...when they hold fewer ids than this on average


def _index_type(n: int) -> type:
    return np.int32 if n < 2**31 else np.int64


def _appended(*columns: pa.Array | pa.ChunkedArray) -> pa.ChunkedArray:
    """``columns`` (``large_string``) as one ChunkedArray of their chunks (no copy), combined when many
    and small (:data:`_MAX_CHUNKS`)."""
    import pyarrow as pa

    chunks = [c for a in columns for c in (a.chunks if isinstance(a, pa.ChunkedArray) else [a]) if len(c)]
    joined = pa.chunked_array(chunks, pa.large_string())
    small = len(chunks) > _MAX_CHUNKS and len(joined) < _MIN_CHUNK * len(chunks)
    # Only many small chunks are combined: a consolidated part's column comes in row groups of 131,072
    # (77 at ten million ids), which lookups take from as they are; copying them was 220 MB more.
    return pa.chunked_array([joined.combine_chunks()]) if small else joined


def take(ids: pa.Array | pa.ChunkedArray, positions: np.ndarray) -> pa.Array:
    """``ids`` at ``positions`` as one array. A ChunkedArray is taken from chunk by chunk: some pyarrow
    versions combine every chunk (a copy of all the ids) to take a few."""
    import pyarrow as pa

    if isinstance(ids, pa.ChunkedArray):
        if ids.num_chunks == 1:
            ids = ids.chunk(0)
        else:
            bounds = np.cumsum([0] + [len(c) for c in ids.chunks])
            which = np.searchsorted(bounds, positions, side="right") - 1
            order = np.argsort(which, kind="stable")
            cuts = np.searchsorted(which[order], np.arange(ids.num_chunks + 1))
            pieces = [
                ids.chunk(c).take(pa.array(positions[order[cuts[c] : cuts[c + 1]]] - bounds[c]))
                for c in range(ids.num_chunks)
                if cuts[c + 1] > cuts[c]
            ]
            gathered = pa.concat_arrays(pieces) if pieces else pa.array([], ids.type)
            back = np.empty(len(order), np.int64)
            back[order] = np.arange(len(order))
            return gathered.take(pa.array(back))
    return ids.take(pa.array(positions))


def first_copies(ids: pa.Array, hashes: np.ndarray) -> np.ndarray:
    """For each entry, the position of the first entry with the same id (itself when it is the first)."""
    n = len(hashes)
    first = np.arange(n, dtype=np.int64)
    if n < 2:
        return first
    order = np.argsort(hashes)  # not stable (2.5x faster): a run of equal hashes is put in order below
    h = hashes[order]
    tied = np.flatnonzero(h[1:] == h[:-1])
    if tied.size == 0:
        return first
    # Entries in runs of equal hashes, sorted: settle each run by its ids (a repeat, or a rare collision).
    starts = np.flatnonzero(np.r_[True, h[1:] != h[:-1]])
    ends = np.r_[starts[1:], n]
    runs = np.flatnonzero(ends - starts > 1)  # only these: ten million runs of one are not walked in Python
    for s, e in zip(starts[runs].tolist(), ends[runs].tolist()):
        seen: dict[str, int] = {}
        for k in sorted(order[s:e].tolist()):  # in the given order within a run
            first[k] = seen.setdefault(ids[k].as_py(), k)
    return first


class IdSet(AbstractSet[str]):
    """A set of ids held as data: their hashes in a sorted numpy array and the ids in Arrow arrays (about 30
    bytes an id, against about 100 for a ``set`` of ``str``). Ids added one by one wait in a small ``set``
    until they are a 64th of the rest (at least 131,072), then are merged in (amortised linear; at ten
    million ids a 64th is about 14 MiB, an eighth was 110 MiB, for the same time). Columns given in bulk
    (an index part's ids) wait until the set is next read, then are merged at once: merging each of ten
    thousand parts re-sorted the whole set (63 s for a million ids in 977 parts).

    Exact: a hash hit is confirmed against the id. Equal to a ``set`` with the same ids; ``isin`` answers
    for a whole list at once. Arrays are never changed in place, so ``union`` and ``copy`` share them."""

    __slots__ = ("_pending", "_recent", "_sorted")
    _MIN_MERGE = 1 << 17

    def __init__(self, ids: Iterable[str] | pa.Array | pa.ChunkedArray = ()):
        self._sorted: SortedIds | None = None  # made on the first merge: an empty set imports no pyarrow
        self._recent: set[str] = set()
        self._pending: list[tuple[Any, np.ndarray | None]] = []  # (Arrow ids, their hashes or None)
        self.update(ids)

    def __contains__(self, sample_id: object) -> bool:
        if not isinstance(sample_id, str):
            return False
        self._settle()
        return sample_id in self._recent or (self._sorted is not None and self._sorted.find(sample_id) >= 0)

    def __len__(self) -> int:
        return self._stored() + len(self._recent)

    def _stored(self) -> int:
        self._settle()
        return 0 if self._sorted is None else len(self._sorted)

    def __iter__(self) -> Iterator[str]:
        for k in range(0, self._stored(), _CHUNK):
            yield from self._sorted.ids.slice(k, _CHUNK).to_pylist()
        yield from list(self._recent)

    def __repr__(self) -> str:
        return f"IdSet({len(self)} ids)"

    def isin(
        self, ids: Sequence[str] | pa.Array | pa.ChunkedArray, hashes: np.ndarray | None = None
    ) -> np.ndarray:
        """Whether each of ``ids`` is a member, as a bool array (``hashes``: their :func:`hash_ids`)."""
        self._settle()
        strings = _as_strings(ids)
        hashes = hash_ids(strings) if hashes is None else hashes
        member = np.zeros(len(strings), bool)
        if self._sorted is not None:
            member = self._sorted.find_many(strings, hashes) >= 0
        if self._recent:
            rest = np.flatnonzero(~member)
            if rest.size:
                values = take(strings, rest).to_pylist()
                member[rest] = np.fromiter(map(self._recent.__contains__, values), bool, len(values))
        return member

    def add(self, sample_id: str) -> None:
        if sample_id not in self:
            self._recent.add(sample_id)
            if len(self._recent) >= max(self._MIN_MERGE, self._stored() >> 6):
                self._merge()

    def update(self, *others: Iterable[str] | pa.Array | pa.ChunkedArray) -> None:
        for other in others:
            if isinstance(other, IdSet):
                other._settle()
                if other._sorted is not None:
                    hashes = np.empty(len(other._sorted), np.uint64)  # in the ids' order
                    hashes[other._sorted.source] = other._sorted.hash
                    self._pending.append((other._sorted.ids, hashes))
                self.update(other._recent)
            elif isinstance(other, ArrowStrings):
                self._pending.append((other.array, None))
            elif type(other).__module__.startswith("pyarrow"):
                self._pending.append((other, None))
            elif isinstance(other, Sized) and len(other) > _SMALL:
                column, kept = _column_of(list(other))
                self._pending.append((column, None))
                self._recent.update(kept)  # ids Arrow cannot hold are never in the arrays
            else:
                for sample_id in other:
                    self.add(sample_id)

    def union(self, *others: Iterable[str]) -> IdSet:
        """A new set: this one's arrays, shared, plus the others' ids."""
        new = self.copy()
        new.update(*others)
        return new

    def copy(self) -> IdSet:
        self._settle()
        new = IdSet.__new__(IdSet)
        new._sorted, new._recent, new._pending = self._sorted, set(self._recent), []
        return new

    def _settle(self) -> None:
        if self._pending:
            self._merge()

    def _merge(self) -> None:
        """Take the pending columns and the recent ids into the sorted arrays, each id once."""
        import pyarrow as pa

        pieces, self._pending = self._pending, []
        if self._recent:
            column, self._recent = _column_of(list(self._recent))
            pieces.append((column, None))
        chunks, hashes = [], []
        for ids, given in pieces:
            chunks += [_as_strings(c) for c in (ids.chunks if isinstance(ids, pa.ChunkedArray) else [ids])]
            hashes.append(hash_ids(ids) if given is None else given)
        del pieces
        ids = _appended(*chunks)
        del chunks
        if len(ids) == 0:
            return
        hashes = np.concatenate(hashes) if len(hashes) > 1 else hashes[0]
        if self._sorted is None:
            # Into an empty set: sorted once, in place; when no hash repeats there are no copies to drop.
            fresh = SortedIds(hashes, ids, consume=True)
            if not fresh.runs:
                self._sorted = fresh
                return
            hashes = np.empty_like(fresh.hash)  # back in the ids' order, for first_copies
            hashes[fresh.source] = fresh.hash
            del fresh
        first = first_copies(ids, hashes)
        new = np.flatnonzero(first == np.arange(len(ids)))
        del first
        old = self._sorted
        if old is not None:
            new = new[old.find_many(_subset(ids, new), hashes[new] if len(new) < len(ids) else hashes) < 0]
        if new.size == 0:
            return
        # Every id new: the column and its hashes as they are, not copies (a transient of their size).
        new_ids, new_hashes = _subset(ids, new), hashes[new] if len(new) < len(ids) else hashes
        del ids, hashes, new
        self._sorted = SortedIds(new_hashes, new_ids) if old is None else old.with_ids(new_ids, new_hashes)


def _subset(ids: pa.Array | pa.ChunkedArray, positions: np.ndarray) -> pa.Array | pa.ChunkedArray:
    """``ids`` at ``positions`` (ascending, distinct): the column itself when that is all of it."""
    return ids if len(positions) == len(ids) else take(ids, positions)


def _column_of(values: list[str]) -> tuple[pa.Array, set[str]]:
    """``values`` as an Arrow column, and apart those Arrow cannot hold (a lone surrogate, which only the
    Python API can give), which an ``IdSet`` keeps as ``str``."""
    try:
        return _as_strings(values), set()
    except UnicodeEncodeError:
        kept = {v for v in values if any("\ud800" <= c <= "\udfff" for c in v)}  # what UTF-8 cannot encode
        return _as_strings([v for v in values if v not in kept]), kept


class ArrowStrings(Sequence[str]):
    """A read-only sequence of ``str`` over an Arrow string column, converted a chunk at a time as it is
    iterated (a million ids cost their Arrow bytes, not a million ``str``). Equal to a list of the same."""

    __slots__ = ("array",)

    def __init__(self, array: pa.Array | pa.ChunkedArray):
        import pyarrow as pa

        if pa.types.is_dictionary(array.type):  # kept encoded: its values are read as they are asked for
            self.array = array.combine_chunks() if isinstance(array, pa.ChunkedArray) else array
        else:
            self.array = _as_strings(array)

    @classmethod
    def of_chunks(cls, array: pa.ChunkedArray) -> ArrowStrings:
        """Over a string ChunkedArray without combining its chunks (each only made ``large_string``). Its
        ``array`` is then a ChunkedArray, which not every caller of ``array`` takes."""
        import pyarrow as pa

        new = cls.__new__(cls)
        if array.type != pa.large_string():
            array = pa.chunked_array([c.cast(pa.large_string()) for c in array.chunks], pa.large_string())
        new.array = array
        return new

    def __len__(self) -> int:
        return len(self.array)

    def __getitem__(self, k):  # type: ignore[override]
        if not isinstance(k, slice):
            return self.array[k].as_py()
        if k.step not in (None, 1):
            return self.array.to_pylist()[k]
        start, stop, _ = k.indices(len(self.array))
        return self.array.slice(start, max(0, stop - start)).to_pylist()

    def __iter__(self) -> Iterator[str]:
        for k in range(0, len(self.array), _CHUNK):
            yield from self.array.slice(k, _CHUNK).to_pylist()

    def __eq__(self, other: object) -> bool:
        if isinstance(other, ArrowStrings):
            return self.array.equals(other.array)
        if isinstance(other, (list, tuple)):
            return len(other) == len(self) and all(a == b for a, b in zip(self, other))
        return NotImplemented

    __hash__ = None  # type: ignore[assignment]

    def __repr__(self) -> str:
        return f"ArrowStrings({len(self)} strings)"
