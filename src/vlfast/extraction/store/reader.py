"""FeatureCache: read an extraction folder (all ranks' committed shards) as one torch Dataset.

Only committed data is visible: the cache reads the index parts (the commit markers, see docs/extract.md) and
never lists shards, so temp files and orphan shards left by a crash are invisible. Tensors are read
through safetensors' memory map: looking up one sample reads that sample's bytes, not the shard. On
object storage (``FeatureCache("s3://bucket/out")``) each tensor is one ranged GET of exactly its bytes.

What is checked on every read: each index part against the checksum in its name and the configuration in
run.json; once per shard opened, its size against what was written (a truncated shard is named, with the
sample asked for), its header bytes against the checksum its index part recorded and the header's
configuration hash against run.json's (a same-named shard of another run, same size and ids, is refused),
and on every lookup the sample's id against the header's. With ``verify=True`` every tensor read is also
hashed and compared with its checksum; ``check()`` scans the whole folder (integrity.py).
"""

from __future__ import annotations

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
    FAILURE_KINDS,
    REDO_HINT,
    DamagedFile,
    committed_parts,
    config_hash,
    gc_paused,
    index_schema,
    is_local,
    map_parts,
    part_meta,
    part_shards,
    read_errors,
    read_header,
    read_index_part,
    read_run_file,
    resolve_out,
    stable_config,
    tensor_xxh3,
    torch_dtype,
    xxh3,
)
from vlfast.extraction.store.integrity import CheckReport, RemoteShard, check_folder

_MAX_OPEN_SHARDS = 64  # open safetensors handles kept (each holds a file descriptor and a mapping)


class FeatureCache(torch.utils.data.Dataset):
    """``len``, ``cache[i]`` or ``cache["id"]`` -> dict of tensors, iteration, ``id in cache``, ``meta(id)``.

    Works as a map-style Dataset with a DataLoader (including worker processes: open shard handles are
    not carried across processes, each worker opens its own).
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
        ``out`` may be an fsspec URL (``s3://bucket/out``), opened with ``storage_options``; its samples
        are then read by byte range, one request per tensor."""
        import pyarrow as pa

        self.out = resolve_out(out, storage_options)
        if isinstance(features, str):
            features = [features]
        self.features = None if features is None else frozenset(features)
        self.verify_reads = bool(verify)
        self._run = read_run_file(self.out)
        self._config_hash = expected = config_hash(
            stable_config(self._run.get("config", {}), self._run.get("volatile_keys", []))
        )
        tables, self._shard_bytes, self._header_hash = _read_parts(self.out, expected)
        if tables:
            table = pa.concat_tables(tables, promote_options="default")
        else:
            table = index_schema().empty_table()
        self._build_index(table)
        self._handles: OrderedDict[int, Any] = OrderedDict()
        self._shard_ids: dict[int, list[str] | None] = {}  # shard -> ids from its header, read on first open
        # shard -> (inode, size, mtime, ctime) when its header passed: a shard opened again past the open
        # handles' limit, unchanged since, is not read twice (any write moves its ctime)
        self._header_ok: dict[int, tuple[int, int, int, int]] = {}

    def _build_index(self, table: Any) -> None:
        """The lookups, held as data (see :class:`~vlfast.extraction.ids.IdSet`): the ids as an Arrow column,
        their hashes sorted for ``cache["id"]``, each sample's shard number and row in numpy arrays."""
        import numpy as np
        import pyarrow as pa

        from vlfast.extraction.ids import ArrowStrings, SortedIds, first_copies, hash_ids

        all_ids = ArrowStrings(table.column("id")).array
        hashes = hash_ids(all_ids)
        self._lookup = SortedIds(hashes, all_ids)  # .source: each sorted entry's position
        keep = np.arange(len(all_ids))
        repeated = keep[:0]
        if self._lookup.runs:  # a hash seen twice: an id committed twice, or a collision
            # Keep the first copy of an id. Two copies only appear if two writers ran with the same rank at once.
            first = first_copies(all_ids, hashes)
            repeated = np.flatnonzero(first != keep)
            keep = np.flatnonzero(first == keep)
        if repeated.size:
            warnings.warn(
                f"{self.out}: {repeated.size} ids committed more than once (kept the first), e.g. "
                f"{all_ids.take(repeated[:3]).to_pylist()}",
                stacklevel=3,
            )
            all_ids = all_ids.take(keep)
            self._lookup = SortedIds(hashes[keep], all_ids)
        self._ids = ArrowStrings(all_ids)
        shards = table.column("shard").combine_chunks()  # read as a dictionary; chunks' ones are unified
        if not pa.types.is_dictionary(shards.type):
            shards = shards.dictionary_encode()
        names = shards.dictionary.to_pylist()
        rank = np.empty(len(names), np.int64)  # shard numbers in name order
        rank[np.argsort(np.array(names, dtype=object))] = np.arange(len(names))
        self._shard_names = sorted(names)
        self._shard_paths = [self.out / s for s in self._shard_names]
        self._pid = os.getpid()
        self._expected_bytes = [self._shard_bytes.get(s) for s in self._shard_names]
        self._expected_header = [self._header_hash.get(s) for s in self._shard_names]
        codes = shards.indices.to_numpy(zero_copy_only=False)
        kept = keep if repeated.size else slice(None)  # every row: no copies of the columns to select them
        self._shard = rank[codes[kept]] if len(names) else np.empty(0, np.int64)
        self._row = table.column("row").to_numpy()[kept]
        columns = table.select(["features", "meta"])
        if repeated.size:
            columns = columns.take(keep)
        # Kept in the chunks Parquet gave (a lookup finds its chunk by bisection): combining them would copy
        # about 110 bytes a sample at the peak of opening.
        self._features = columns.column("features") if keep.size else None
        self._meta = columns.column("meta") if keep.size else None

    def _position(self, sample_id: str) -> int:
        """The position of ``sample_id``, or -1."""
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
        # The shard header names its ids: a mismatch means the folder was tampered with or two writers
        # shared a rank; fail loudly rather than return another sample's features.
        if self._shard_ids[k] is not None and self._shard_ids[k][row] != self._ids[i]:
            raise DamagedFile(
                f"{self._shard_paths[k]} row {row} holds {self._shard_ids[k][row]!r}, but the index says "
                f"{self._ids[i]!r}: the folder is damaged. Re-run the extraction into a new OUT."
            )
        entries = {f["name"]: f for f in self._features[i].as_py()}
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
            checksum = entries[n].get("xxh3") if self.verify_reads else None
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
        return json.loads(self._meta[self._index(sample_id)].as_py())

    def info(self, sample_id: int | str) -> dict:
        """The sample's index row: shard, row, and per feature dtype, shape, byte offset and size."""
        i = self._index(sample_id)
        return {
            "id": self._ids[i],
            "shard": self._shard_names[self._shard[i]],  # as the index names it (relative to OUT)
            "row": int(self._row[i]),
            "features": self._features[i].as_py(),
        }

    @property
    def run_config(self) -> dict:
        return self._run.get("config", {})

    def errors(self) -> list[dict]:
        """The folder's error records as they stand: of each id's failures only the latest attempt, and none
        for an id that a later attempt extracted (see ``read_errors``)."""
        return [r for r in read_errors(self.out) if r.get("kind") not in FAILURE_KINDS or r["id"] not in self]

    def check(self, progress=None) -> CheckReport:
        """Read and hash every byte the folder's readers rely on: a :class:`CheckReport` naming every bad
        sample by id (``report.ok`` when none). The same scan as ``vlfast extract --verify OUT``. (Checksums,
        not numerics: ``vlfast.verify`` is the numerical comparison of a patched model.)"""
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
        # A write in the same timestamp tick as the check could leave the stamp as it was: only an older one
        # spares the next open the header read.
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
        """Refuse a shard that is not the one its index part was written with: a same-named shard of another
        run (other weights: same size, same ids) would otherwise be served in full. Two checks, both on
        bytes already read: the header's configuration hash against run.json's (names the cause), then the
        header bytes against the checksum the part recorded (any other change to offsets, dtypes, ids).
        ``raw_header`` is None when the same file, unchanged since, passed in this process before."""
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
        """A forked DataLoader worker cannot use its parent's object-storage client (fsspec's async clients
        refuse: "not fork-safe"); it gets its own, as a spawned worker does through pickling."""
        self._pid = os.getpid()
        self._handles.clear()
        if not is_local(self.out):
            self.out = resolve_out(str(self.out), dict(self.out.storage_options))
            self._shard_paths = [self.out / s for s in self._shard_names]

    def __getstate__(self) -> dict:
        # DataLoader workers (spawn) receive a copy: drop open mappings, each process opens its own.
        state = self.__dict__.copy()
        state["_handles"] = OrderedDict()
        return state


def _read_parts(out: Any, expected: str) -> tuple[list, dict[str, int | None], dict[str, str | None]]:
    """Every live index part as a table, with each shard's size and header checksum as written. A part that
    disappears while it is read (a writer compacting its rank: the parts a consolidated part replaces are
    deleted once it is committed) makes the listing be taken again."""
    for attempt in range(5):
        tables, sizes, headers = [], {}, {}
        try:
            parts = committed_parts(out)
            for part, table in zip(parts, map_parts(out, _reader(attempt), parts)):
                meta = part_meta(table)
                if meta["config_hash"] is not None and meta["config_hash"] != expected:
                    raise DamagedFile(
                        f"index part {part} was made with another configuration than {out / 'run.json'}: the "
                        "folder mixes two runs. Run `vlfast extract --verify` on it to see what else differs."
                    )
                for shard, (size, header) in part_shards(part, meta).items():
                    sizes[shard], headers[shard] = size, header
                tables.append(table.replace_schema_metadata(None))
        except _Relist:
            continue
        return tables, sizes, headers
    raise AssertionError("unreachable")  # the last attempt raises instead of listing again


class _Relist(Exception):
    pass


def _reader(attempt: int) -> Any:
    def read(part: Any) -> Any:
        try:
            return read_index_part(part)
        except DamagedFile:
            if attempt < 4 and not part.exists():
                raise _Relist from None
            raise

    return read


def _local_header(path: Any, size: int) -> bytes:
    """A local shard's raw header (8-byte length + JSON), as its index part hashed it: one small read. A
    damaged length is not trusted for the read's size (the checksum then fails)."""
    with open(path, "rb") as f:
        return read_header(f, size, strict=False)[1]


# A shard on object storage could not be read (network, credentials, throttling): not damage.
ShardReadError = StorageReadError


class _RangeShard:
    """A shard on object storage with safe_open's reading interface: the header is read once, each tensor
    with one ranged GET of exactly its bytes, so a lookup never downloads the shard."""

    def __init__(self, path: Any, size: int):
        self._shard = RemoteShard(path, size, policy="storage")  # size just asked
        self._fs = self._shard.object.fs
        self._data_start, self.raw_header, self._header = self._shard.header()
        self._size = size

    def metadata(self) -> dict[str, str] | None:
        return self._header.get("__metadata__")

    def get_tensor(self, name: str) -> torch.Tensor:
        entry = self._header[name]
        start, end = (self._data_start + x for x in entry["data_offsets"])
        if end > self._size:
            raise InputRefused(f"tensor {name!r} ends at byte {end:,}, past the shard's {self._size:,}")
        dtype = torch_dtype(DTYPE_BY_CODE[entry["dtype"]])
        data = bytearray(self._shard.read(start, end - start, repr(name)))
        if len(data) != end - start:
            raise InputRefused(f"tensor {name!r}: {len(data):,} bytes read of {end - start:,}")
        if not data:
            return torch.empty(entry["shape"], dtype=dtype)
        return torch.frombuffer(data, dtype=dtype).reshape(entry["shape"])
