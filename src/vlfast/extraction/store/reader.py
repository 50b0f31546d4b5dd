"""FeatureCache: read an extraction folder (all ranks' committed shards) as one torch Dataset.

Only committed data is visible: the cache follows the index parts (the commit markers, see docs/format.md)
and never lists shards. Tensors are read through safetensors' memory map; on object storage
(``FeatureCache("s3://bucket/out")``) each tensor is one ranged GET of exactly its bytes.

Checked on every read: each index part against the checksum in its name and run.json's configuration; once
per shard opened, its size, its header bytes against the checksum its part recorded and the header's
configuration hash against run.json's; on every lookup the sample's id against the header's. With
``verify=True`` every tensor read is also hashed; ``check()`` scans the whole folder (integrity.py).
"""

from __future__ import annotations

import bisect
import json
import operator
import os
import time
import warnings
from collections import OrderedDict
from collections.abc import Iterator, Sequence
from typing import Any

import torch

from vlfast.errors import InputRefused
from vlfast.extraction.objstore import StorageReadError
from vlfast.extraction.store.format import (
    DTYPE_BY_CODE,
    ERROR_DIR,
    FAILURE_KINDS,
    INDEX_DIR,
    MOVE_HINT,
    REDO_HINT,
    SHARD_DIR,
    DamagedFile,
    committed_parts,
    feature_entry,
    gc_paused,
    is_local,
    map_parts,
    open_index_part,
    part_meta,
    part_shards,
    read_errors,
    read_header,
    read_part_groups,
    read_run_file,
    resolve_out,
    run_hash,
    tensor_xxh3,
    xxh3,
)
from vlfast.extraction.store.integrity import CheckReport, RemoteShard, check_folder
from vlfast.extraction.store.layout import not_folders, uncovered_shards

_MAX_OPEN_SHARDS = 64  # open safetensors handles kept (each holds a file descriptor and a mapping)


class FeatureCache(torch.utils.data.Dataset):
    """``len``, ``cache[i]`` or ``cache["id"]`` -> dict of tensors, iteration, ``id in cache``, ``meta(id)``.

    A map-style Dataset; each DataLoader worker process opens its own shard handles.
    """

    @gc_paused()
    def __init__(
        self,
        out: str | os.PathLike,
        features: Sequence[str] | None = None,
        *,
        verify: bool = False,
        storage_options: dict[str, Any] | None = None,
    ):
        """``features`` limits what each lookup reads (e.g. ``["vision_mean"]`` skips the token tensors);
        ``verify`` hashes every tensor read and raises :class:`DamagedFile` naming it if it does not match.
        ``out`` may be an fsspec URL (``s3://bucket/out``), opened with ``storage_options``."""
        self.out = resolve_out(out, storage_options)
        if isinstance(features, str):
            features = [features]
        self.features = None if features is None else frozenset(features)
        self.verify_reads = bool(verify)
        self._run = read_run_file(self.out)
        self._config_hash = expected = run_hash(self._run)
        _check_layout(self.out)
        rows, self._shard_bytes, self._header_hash = _read_parts(self.out, expected)
        if not rows.shard_names:
            _check_nothing_lost(self.out)  # no part: an empty OUT, or one whose index was lost?
        self._build_index(rows)
        self._handles: OrderedDict[int, Any] = OrderedDict()
        self._shard_ids: dict[int, list[str] | None] = {}  # shard -> ids from its header, read on first open
        # shard -> (inode, size, mtime, ctime) when its header passed: reopened unchanged, it is not read again
        self._header_ok: dict[int, tuple[int, int, int, int]] = {}

    def _build_index(self, rows: _Rows) -> None:
        """The lookups, held as data: the ids as an Arrow column, their hashes sorted for ``cache["id"]``, each
        sample's shard number and row in numpy arrays."""
        import numpy as np

        from vlfast.extraction.ids import ArrowStrings, SortedIds, first_copies, hash_ids, take

        all_ids = rows.ids
        hashes = hash_ids(all_ids)
        self._lookup = SortedIds(hashes, all_ids)  # .source: each sorted entry's position
        self._kept: np.ndarray | None = None  # each sample's row in `rows` when a repeat was left out
        if self._lookup.runs:  # a hash seen twice: an id committed twice, or a collision
            # Keep an id's first copy. Two only appear if two writers ran with the same rank at once.
            first = first_copies(all_ids, hashes)
            keep = np.flatnonzero(first == np.arange(len(all_ids)))
            repeated = np.flatnonzero(first != np.arange(len(all_ids)))
            if repeated.size:
                warnings.warn(
                    f"{self.out}: {repeated.size} ids committed more than once (kept the first), e.g. "
                    f"{take(all_ids, repeated[:3]).to_pylist()}",
                    stacklevel=3,
                )
                all_ids = take(all_ids, keep)
                self._lookup = SortedIds(hashes[keep], all_ids)
                self._kept = keep
        self._ids = ArrowStrings.of_chunks(all_ids) if self._kept is None else ArrowStrings(all_ids)
        self._shard_names = rows.shard_names
        self._shard_paths = [self.out / s for s in self._shard_names]
        self._pid = os.getpid()
        self._expected_bytes = [self._shard_bytes.get(s) for s in self._shard_names]
        self._expected_header = [self._header_hash.get(s) for s in self._shard_names]
        self._shard, self._row = rows.shards, rows.rows
        if self._kept is not None:
            self._shard, self._row = self._shard[self._kept], self._row[self._kept]
        self._rows = rows
        self._headers: OrderedDict[int, tuple[int, dict]] = OrderedDict()  # for info(): parsed shard headers

    def _stored(self, i: int) -> int:
        """The row in ``self._rows`` of sample ``i``."""
        return i if self._kept is None else int(self._kept[i])

    def _position(self, sample_id: str) -> int:
        i = self._lookup.find(sample_id)
        return -1 if i < 0 else int(self._lookup.source[i])

    # -- Dataset -------------------------------------------------------------------------------------

    def __len__(self) -> int:
        return len(self._ids)

    def ids(self) -> list[str]:
        return list(self._ids)

    def __contains__(self, sample_id: object) -> bool:
        return isinstance(sample_id, str) and self._position(sample_id) >= 0

    def _index(self, key: int | str) -> int:
        if isinstance(key, str):
            i = self._position(key)
            if i < 0:
                raise KeyError(f"id {key!r} is not in {self.out} (not extracted, failed, or not committed)")
            return i
        i = operator.index(key)
        n = len(self._ids)
        if not -n <= i < n:
            raise IndexError(f"index {i} out of range for {n} samples in {self.out}")
        return i % n

    def __getitem__(self, key: int | str) -> dict[str, torch.Tensor]:
        i = self._index(key)
        k, row = int(self._shard[i]), int(self._row[i])
        handle = self._handle(k, self._ids[i])
        # A mismatch with the header's ids: the folder was tampered with, or two writers shared a rank.
        if self._shard_ids[k] is not None and self._shard_ids[k][row] != self._ids[i]:
            raise DamagedFile(
                f"{self._shard_paths[k]} row {row} holds {self._shard_ids[k][row]!r}, but the index says "
                f"{self._ids[i]!r}: the folder is damaged. Re-run the extraction into a new OUT."
            )
        entries = self._rows.entries(self._stored(i))  # name -> checksum
        names = list(entries)
        if self.features is not None:
            missing = self.features.difference(names)
            if missing:
                raise KeyError(
                    f"sample {self._ids[i]!r} in {self.out} has no feature {sorted(missing)}; it has {names}"
                )
            names = [n for n in names if n in self.features]
        out = {}
        for n in names:
            try:
                t = handle.get_tensor(f"{row}/{n}")
            except ShardReadError:
                raise  # the store did not answer: not damage
            except Exception as e:  # noqa: BLE001 - safetensors raises its own types; name the file and sample
                raise DamagedFile(
                    f"cannot read feature {n!r} of sample {self._ids[i]!r} from {self._shard_paths[k]}: {e}"
                ) from None
            checksum = entries[n] if self.verify_reads else None
            if checksum is not None and tensor_xxh3(t) != checksum:
                raise DamagedFile(
                    f"feature {n!r} of sample {self._ids[i]!r} in {self._shard_paths[k]} is damaged: its "
                    f"bytes do not match their checksum. {REDO_HINT}"
                )
            out[n] = t
        return out

    def __iter__(self) -> Iterator[dict[str, torch.Tensor]]:
        for i in range(len(self)):
            yield self[i]

    def items(self) -> Iterator[tuple[str, dict[str, torch.Tensor]]]:
        for i, sid in enumerate(self._ids):
            yield sid, self[i]

    # -- metadata ------------------------------------------------------------------------------------

    def meta(self, sample_id: int | str) -> dict:
        text = self._rows.meta[self._stored(self._index(sample_id))]
        return {} if text is None else json.loads(text)

    def info(self, sample_id: int | str) -> dict:
        """The sample's index row: shard, row, and per feature dtype, shape, byte offset, size and checksum;
        for rows kept compact (:class:`_Rows`), made again from the shard's checked header."""
        i = self._index(sample_id)
        k, row = int(self._shard[i]), int(self._row[i])
        features = self._rows.given_entries(self._stored(i))
        if features is None:
            data_start, header = self._header(k, self._ids[i])
            features = []
            for name, checksum in self._rows.entries(self._stored(i)).items():
                entry = header.get(f"{row}/{name}")
                if not isinstance(entry, dict):
                    raise DamagedFile(
                        f"{self._shard_paths[k]} holds no feature {name!r} for row {row}, but the index says "
                        f"sample {self._ids[i]!r} has it. {REDO_HINT}"
                    )
                features.append(feature_entry(name, entry, data_start, checksum))
        # the shard as the index names it (relative to OUT)
        return {"id": self._ids[i], "shard": self._shard_names[k], "row": row, "features": features}

    def _header(self, k: int, sample_id: str) -> tuple[int, dict]:
        """Shard ``k``'s data start and parsed header, checked as a read checks them (its bytes against the
        checksum its part recorded pin the rows' ids and offsets); the last few kept."""
        got = self._headers.get(k)
        if got is not None:
            self._headers.move_to_end(k)
            return got
        h = self._handle(k, sample_id)
        if isinstance(h, _RangeShard):
            raw, got = h.raw_header, (h._data_start, h._header)
        else:
            with open(self._shard_paths[k], "rb") as f:
                data_start, raw, header = read_header(f, os.fstat(f.fileno()).st_size)
            got = (data_start, header)
        self._check_header(k, h, raw, sample_id)  # these bytes, not only those the open checked
        self._headers[k] = got
        if len(self._headers) > _MAX_OPEN_SHARDS:
            self._headers.popitem(last=False)
        return got

    @property
    def run_config(self) -> dict:
        return self._run.get("config", {})

    def errors(self) -> list[dict]:
        """The folder's error records as they stand (see ``read_errors``), without the failures of an id a
        later attempt extracted."""
        blocked = [p for p in not_folders(self.out) if p.name == ERROR_DIR]
        if blocked:
            raise DamagedFile(f"{blocked[0]} is not a folder: the error records cannot be read. {MOVE_HINT}")
        return [r for r in read_errors(self.out) if r.get("kind") not in FAILURE_KINDS or r["id"] not in self]

    def check(self, progress=None) -> CheckReport:
        """Read and hash every byte the folder's readers rely on (as ``vlfast out verify OUT``): a
        :class:`CheckReport` naming every bad sample by id (``report.ok`` when none)."""
        return check_folder(self.out, progress=progress)

    verify = check  # the name before issue 21

    def __repr__(self) -> str:
        return f"FeatureCache({str(self.out)!r}, samples={len(self)}, shards={len(self._shard_paths)})"

    # -- shard handles -------------------------------------------------------------------------------

    def _handle(self, k: int, sample_id: str):
        if self._pid != os.getpid():
            self._reopen_after_fork()
        h = self._handles.get(k)
        if h is not None:
            self._handles.move_to_end(k)
            return h
        from safetensors import safe_open

        path = self._shard_paths[k]
        stamp = None
        try:
            if is_local(path):
                st = path.stat()
                size, stamp = st.st_size, (st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns)
            else:
                size = RemoteShard(path).size
        except FileNotFoundError:
            raise FileNotFoundError(
                f"{path} (sample {sample_id!r}) is listed in {self.out}/index but missing; the folder was "
                f"modified after the run. {REDO_HINT}"
            ) from None
        expected = self._expected_bytes[k]
        if expected is not None and size != expected:
            raise DamagedFile(
                f"{path} is {size:,} bytes but was written with {expected:,} (truncated or replaced): sample "
                f"{sample_id!r} cannot be read. {REDO_HINT}"
            )
        try:
            if is_local(path):
                raw_header = None if self._header_ok.get(k) == stamp else _local_header(path, size)
                h = safe_open(path, framework="pt", device="cpu")
            else:
                h = _RangeShard(path, size)
                raw_header = h.raw_header
        except Exception as e:  # noqa: BLE001 - safetensors raises its own error types
            raise DamagedFile(
                f"{path} is unreadable ({e}): sample {sample_id!r} cannot be read. {REDO_HINT}"
            ) from None
        self._check_header(k, h, raw_header, sample_id)
        # A write in the check's own timestamp tick could keep the stamp: only an older one spares the read.
        if stamp is not None and raw_header is not None and stamp[3] < time.time_ns() - 1_000_000_000:
            self._header_ok[k] = stamp
        self._handles[k] = h
        if k not in self._shard_ids:
            ids = (h.metadata() or {}).get("ids")
            self._shard_ids[k] = json.loads(ids) if ids else None
        if len(self._handles) > _MAX_OPEN_SHARDS:
            self._handles.popitem(last=False)
        return h

    def _check_header(self, k: int, h: Any, raw_header: bytes | None, sample_id: str) -> None:
        """Refuse a shard that is not the one its index part was written with (a same-named shard of another
        run, same size and ids, would be served in full): the header's configuration hash against run.json's
        (names the cause), then the header bytes against the part's checksum. ``raw_header`` is None when the
        same file, unchanged since, passed in this process before."""
        path = self._shard_paths[k]
        written_with = (h.metadata() or {}).get("config_hash")
        if written_with is not None and written_with != self._config_hash:
            raise DamagedFile(
                f"{path} was made with another configuration than {self.out / 'run.json'} (a shard of another "
                f"run under this name?): sample {sample_id!r} cannot be read. {REDO_HINT}"
            )
        expected = self._expected_header[k]
        if expected is not None and raw_header is not None and xxh3(raw_header) != expected:
            raise DamagedFile(
                f"{path} is not the shard its index part was written with (its header fails the recorded "
                f"checksum: replaced or damaged): sample {sample_id!r} cannot be read. {REDO_HINT}"
            )

    def _reopen_after_fork(self) -> None:
        """A forked worker cannot use its parent's object-storage client (fsspec's async clients are not
        fork-safe): it makes its own, as a spawned worker does through pickling."""
        self._pid = os.getpid()
        self._handles.clear()
        if not is_local(self.out):
            self.out = resolve_out(str(self.out), dict(self.out.storage_options))
            self._shard_paths = [self.out / s for s in self._shard_names]

    def __getstate__(self) -> dict:
        # A spawned DataLoader worker receives a copy: each process opens its own mappings.
        state = self.__dict__.copy()
        state["_handles"] = OrderedDict()
        return state


def _check_layout(out: Any) -> None:
    """Refuse a local OUT whose index/ or shards/ is not a folder, which would otherwise look empty."""
    blocked = [p for p in not_folders(out) if p.name in (INDEX_DIR, SHARD_DIR)]
    if blocked:
        raise DamagedFile(
            f"{blocked[0]} is {'a dangling link' if blocked[0].is_symlink() else 'a file'}, not a folder: the "
            f"samples of {out} cannot be read. {MOVE_HINT}"
        )


def _check_nothing_lost(out: Any) -> None:
    """An OUT without an index part is empty only if no shard lost its part (see store/layout.py): never 0
    samples silently. One listing of shards/, only when no part was found."""
    lost = sorted(name for name, leftover in uncovered_shards(out).items() if not leftover)
    if lost:
        more = f" and {len(lost) - 3} more" if len(lost) > 3 else ""
        raise DamagedFile(
            f"{out} has no index part, but {len(lost)} shard{'s' if len(lost) > 1 else ''} that no index part "
            f"covers ({', '.join(lost[:3])}{more}): its index was deleted or lost (or, for one shard, a run was "
            "killed before its first commit), and without it they cannot be read. Put the index parts back into "
            "OUT/index if you have them; or run the same `vlfast extract` again: it moves the shards aside to "
            "OUT/quarantine and extracts their samples again."
        )


def _read_parts(out: Any, expected: str) -> tuple[_Rows, dict[str, int | None], dict[str, str | None]]:
    """Every live index part's rows, a row group at a time, with each shard's size and header checksum as
    written. A part that disappears while read (replaced by a compaction) makes the listing be taken again."""
    for attempt in range(5):
        rows, sizes, headers = _Rows(), {}, {}
        try:
            parts = committed_parts(out)
            for part, file in zip(parts, map_parts(out, _reader(attempt), parts)):
                meta = part_meta(file.schema_arrow.empty_table())
                if meta["config_hash"] is not None and meta["config_hash"] != expected:
                    raise DamagedFile(
                        f"index part {part} was made with another configuration than {out / 'run.json'}: the "
                        "folder mixes two runs. Run `vlfast out verify` on it to see what else differs."
                    )
                for shard, (size, header) in part_shards(part, meta).items():
                    sizes[shard], headers[shard] = size, header
                for g in range(file.num_row_groups):
                    rows.add(read_part_groups(file, part, [g]))
                del file
        except _Relist:
            continue
        rows.finish()
        return rows, sizes, headers
    raise AssertionError("unreachable")  # the last attempt raises instead of listing again


class _Relist(Exception):
    pass


def _reader(attempt: int) -> Any:
    def read(part: Any) -> Any:
        try:
            return open_index_part(part)
        except DamagedFile:
            if attempt < 4 and not part.exists():
                raise _Relist from None
            raise

    return read


def _local_header(path: Any, size: int) -> bytes:
    """A local shard's raw header (8-byte length + JSON), as its index part hashed it: one small read."""
    with open(path, "rb") as f:
        return read_header(f, size, strict=False)[1]


# A shard on object storage could not be read (network, credentials, throttling): not damage.
ShardReadError = StorageReadError


class _RangeShard:
    """A shard on object storage with safe_open's reading interface: the header read once, each tensor with
    one ranged GET of exactly its bytes."""

    def __init__(self, path: Any, size: int):
        self._shard = RemoteShard(path, size, policy="storage")  # size just asked
        self._fs = self._shard.object.fs  # the client its reads go through
        self._data_start, self.raw_header, self._header = self._shard.header()

    def metadata(self) -> dict[str, str] | None:
        return self._header.get("__metadata__")

    def get_tensor(self, name: str) -> torch.Tensor:
        entry = self._header[name]
        start, end = (self._data_start + x for x in entry["data_offsets"])
        if end > self._shard.size:
            raise InputRefused(f"tensor {name!r} ends at byte {end:,}, past the shard's {self._shard.size:,}")
        dtype = getattr(torch, DTYPE_BY_CODE[entry["dtype"]])
        data = bytearray(self._shard.read(start, end - start, repr(name)))
        if len(data) != end - start:
            raise InputRefused(f"tensor {name!r}: {len(data):,} bytes read of {end - start:,}")
        if not data:
            return torch.empty(entry["shape"], dtype=dtype)
        return torch.frombuffer(data, dtype=dtype).reshape(entry["shape"])


# ----------------------------------------------------------------------------------------------------
# what FeatureCache keeps of its index rows

_COALESCE = 1 << 16  # rows of ids gathered into one chunk (parts of a thousand rows are not one each)
_TEXT_BLOCK = 1024  # rows of meta compressed together: a row read at random decompresses its block (~0.05 ms)


class _Rows:
    """What :class:`FeatureCache` keeps of its index rows, taken in a row group at a time (the peak is one
    decoded row group above what is kept): the ids as Arrow chunks of at least 65,536 rows, the meta strings
    compressed (:class:`_PackedText`), each row's shard number and row as int32, and each row's feature names
    and checksums: for a row group whose rows all name the same features with a 16-digit checksum each (every
    vlfast run's), one tuple of names and a uint64 per entry (8 bytes a feature where Parquet's list of
    structs decodes to about 80); for another, its entries as Parquet gave them."""

    def __init__(self) -> None:
        import pyarrow as pa

        self._ids, self._meta = _Chunks(pa.large_string()), _PackedText()
        self._shards: list[Any] = []
        self._rows: list[Any] = []
        self._shard_number: dict[str, int] = {}  # in the order first seen
        self._starts: list[int] = []  # first row of each row group taken in
        self._layouts: list[_Same | _Given] = []
        self._n = 0

    def add(self, table: Any) -> None:
        """Take in ``table`` (rows of the index schema)."""
        import numpy as np
        import pyarrow as pa

        n = table.num_rows
        if n == 0:
            return
        self._ids.append(table.column("id"))
        self._meta.append(table.column("meta") if "meta" in table.column_names else pa.nulls(n, pa.string()))
        shard = table.column("shard").combine_chunks()
        if not pa.types.is_dictionary(shard.type):
            shard = shard.dictionary_encode()
        number = self._shard_number
        lut = np.array([number.setdefault(v, len(number)) for v in shard.dictionary.to_pylist()], np.int32)
        self._shards.append(lut[shard.indices.to_numpy(zero_copy_only=False)])
        self._rows.append(table.column("row").to_numpy().astype(np.int32))
        features = table.column("features").combine_chunks()
        self._starts.append(self._n)
        self._layouts.append(_Same.of(features) or _Given(features))
        self._n += n

    def finish(self) -> None:
        import numpy as np

        self.ids, self.meta = self._ids.finish(), self._meta.finish()
        names = list(self._shard_number)
        rank = np.empty(len(names), np.int32)  # shard numbers in name order
        rank[np.argsort(np.array(names, dtype=object))] = np.arange(len(names), dtype=np.int32)
        self.shard_names = sorted(names)
        self.shards = rank[np.concatenate(self._shards)] if self._shards else np.empty(0, np.int32)
        self.rows = np.concatenate(self._rows) if self._rows else np.empty(0, np.int32)
        del self._shards, self._rows, self._ids, self._meta

    def _layout(self, r: int) -> tuple[_Same | _Given, int]:
        k = bisect.bisect_right(self._starts, r) - 1
        return self._layouts[k], r - self._starts[k]

    def entries(self, r: int) -> dict[str, str | None]:
        """Row ``r``'s features: name -> checksum (None where the index has none), in the index's order."""
        layout, j = self._layout(r)
        return layout.entries(j)

    def given_entries(self, r: int) -> list[dict] | None:
        """Row ``r``'s feature entries as Parquet gave them, or None where only names and checksums are kept."""
        layout, j = self._layout(r)
        return layout.column[j].as_py() if isinstance(layout, _Given) else None


class _Chunks:
    """Arrow chunks taken in one by one, gathered into chunks of at least :data:`_COALESCE` rows."""

    def __init__(self, type_: Any):
        self.type, self.done, self.pending, self.held = type_, [], [], 0

    def append(self, column: Any) -> None:
        chunks = _chunks_as(column, self.type)
        self.pending += chunks
        self.held += sum(map(len, chunks))
        if self.held >= _COALESCE:
            self._flush()

    def _flush(self) -> None:
        import pyarrow as pa

        if self.pending:
            self.done.append(pa.concat_arrays(self.pending) if len(self.pending) > 1 else self.pending[0])
        self.pending, self.held = [], 0

    def finish(self) -> Any:
        import pyarrow as pa

        self._flush()
        return pa.chunked_array(self.done, self.type)


def _chunks_as(column: Any, type_: Any) -> list:
    """The chunks of ``column`` (an Array is one chunk), each cast to ``type_`` where it is another type."""
    import pyarrow as pa

    chunks = column.chunks if isinstance(column, pa.ChunkedArray) else [column]
    return [c if c.type == type_ else c.cast(type_) for c in chunks]


class _PackedText:
    """Strings (the index's meta: JSON repeating its keys row after row) kept zstd-compressed in blocks of
    :data:`_TEXT_BLOCK` rows: the scale benchmark's meta at a 50th of its Arrow size. A row read at random
    decompresses its block; the last block read is kept, so reading in order costs what it did."""

    def __init__(self) -> None:
        self._blocks: list[tuple[int, int, bytes, bytes, Any]] = []  # rows, text size, text, lengths, nulls
        self._pending: list[Any] = []
        self._held = 0
        self._n = 0
        self._last: tuple[int, bytes, Any, Any] | None = None  # block, its text, offsets, nulls

    def __len__(self) -> int:
        return self._n

    def append(self, column: Any) -> None:
        import pyarrow as pa

        chunks = _chunks_as(column, pa.string())
        self._pending += chunks
        self._held += sum(map(len, chunks))
        if self._held >= _TEXT_BLOCK:
            self._pack(final=False)

    def finish(self) -> _PackedText:
        self._pack(final=True)
        return self

    def _pack(self, final: bool) -> None:
        import pyarrow as pa

        if not self._pending:
            return
        whole = pa.concat_arrays(self._pending) if len(self._pending) > 1 else self._pending[0]
        start = 0
        while len(whole) - start >= _TEXT_BLOCK or (final and start < len(whole)):
            block = whole.slice(start, _TEXT_BLOCK)
            self._blocks.append(_compress_block(block))
            self._n += len(block)
            start += len(block)
        self._pending = [whole.slice(start)] if start < len(whole) else []
        self._held = len(whole) - start

    def __getitem__(self, i: int) -> str | None:
        b, j = divmod(i, _TEXT_BLOCK)
        if self._last is None or self._last[0] != b:
            self._last = (b, *_decompress_block(self._blocks[b]))
        _, text, offsets, nulls = self._last
        if nulls is not None and nulls[j]:
            return None
        return text[offsets[j] : offsets[j + 1]].decode("utf-8")

    def __getstate__(self) -> dict:
        return {**self.__dict__, "_last": None}


def _codec() -> Any:
    import pyarrow as pa

    return pa.Codec("zstd", compression_level=1)


def _compress_block(block: Any) -> tuple[int, int, bytes, bytes, Any]:
    """A string array of one block: its row count, text size, compressed text and lengths, null mask."""
    import numpy as np

    n = len(block)
    buffers = block.buffers()
    offsets = np.frombuffer(buffers[1], np.int32, n + 1, block.offset * 4)
    start, end = int(offsets[0]), int(offsets[-1])
    lengths = np.diff(offsets).astype(np.int32)
    nulls = block.is_null().to_numpy(zero_copy_only=False) if block.null_count else None
    codec = _codec()
    text = codec.compress(buffers[2].slice(start, end - start), asbytes=True) if end > start else b""
    return n, end - start, text, codec.compress(lengths.tobytes(), asbytes=True), nulls


def _decompress_block(block: tuple[int, int, bytes, bytes, Any]) -> tuple[bytes, Any, Any]:
    import numpy as np

    n, size, text, lengths, nulls = block
    codec = _codec()
    offsets = np.zeros(n + 1, np.int64)
    np.cumsum(np.frombuffer(codec.decompress(lengths, 4 * n, asbytes=True), np.int32), out=offsets[1:])
    return (codec.decompress(text, size, asbytes=True) if size else b""), offsets, nulls


class _Given:
    """A row group's feature entries as Parquet gave them (a list of structs per row)."""

    __slots__ = ("column",)

    def __init__(self, column: Any):
        self.column = column

    def entries(self, j: int) -> dict[str, str | None]:
        return {f["name"]: f.get("xxh3") for f in self.column[j].as_py()}


class _Same:
    """A row group whose rows all name the same features in the same order, each with a checksum of 16
    hex digits: the names once, the checksums as uint64 (rows x features)."""

    __slots__ = ("names", "sums")

    def __init__(self, names: tuple[str, ...], sums: Any):
        self.names, self.sums = names, sums

    @staticmethod
    def of(features: Any) -> _Same | None:
        """``features`` (a list-of-structs column) kept this way, or None where it cannot be."""
        import numpy as np
        import pyarrow.compute as pc

        n = len(features)
        if features.null_count:
            return None
        offsets = features.offsets.to_numpy()
        k = int(offsets[1] - offsets[0]) if n else 0
        if np.any(np.diff(offsets) != k):
            return None
        entries = features.flatten()  # n * k structs, the column's slice taken into account
        fields = dict(zip([f.name for f in entries.type], entries.flatten()))
        names, sums = fields.get("name"), fields.get("xxh3")
        if names is None or sums is None or names.null_count:
            return None
        first = tuple(names.slice(0, k).to_pylist())
        if len(set(first)) != k:
            return None
        codes = pc.dictionary_encode(names).indices.to_numpy(zero_copy_only=False)  # first seen: 0..k-1
        if not np.array_equal(codes, np.tile(np.arange(k, dtype=codes.dtype), n)):
            return None
        values = _hex64(sums)
        return None if values is None else _Same(first, values.reshape(n, k))

    def entries(self, j: int) -> dict[str, str | None]:
        return {name: f"{int(v):016x}" for name, v in zip(self.names, self.sums[j])}


# "0"-"9", "a"-"f" -> their value; anything else (upper case included: it would not print back) 255
_NIBBLE = bytes((c - 48) if 48 <= c <= 57 else (c - 87) if 97 <= c <= 102 else 255 for c in range(256))


def _hex64(values: Any) -> Any:
    """Each of ``values`` (text of exactly 16 lower-case hex digits, no nulls) as a uint64; None otherwise."""
    import numpy as np
    import pyarrow as pa

    n = len(values)
    if values.null_count:
        return None
    if n == 0:
        return np.empty(0, np.uint64)
    values = values.cast(pa.large_string())
    buffers = values.buffers()
    offsets = np.frombuffer(buffers[1], np.int64, n + 1, values.offset * 8)
    if np.any(np.diff(offsets) != 16):
        return None
    data = np.frombuffer(buffers[2], np.uint8, 16 * n, int(offsets[0])).reshape(n, 16)
    nibbles = np.frombuffer(_NIBBLE, np.uint8)[data]
    if np.any(nibbles > 15):
        return None
    out = np.zeros(n, np.uint64)
    for c in range(16):
        out <<= np.uint64(4)
        out |= nibbles[:, c]
    return out
