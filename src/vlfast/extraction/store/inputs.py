"""What each committed sample's input was when it was read, kept beside the index: ``OUT/inputs/``.

A commit that has records writes ``inputs/inputs-r{rank}-{first}-{last}.parquet`` (first == last: the
shard's sequence number) before its index part; a store's close merges its rank's files into one. Each row
names its sample's id and shard (with the shard's header checksum), so a row counts only while a live index
part points at that very shard. A sample committed without a record reads as unknown, never as changed.
What each check sees is docs/extract.md's ("Inputs that change").
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import numpy as np

from vlfast.extraction.ids import hash_ids
from vlfast.extraction.objstore import is_url, read_whole
from vlfast.extraction.store.format import (
    SHARD_DIR,
    is_consolidated,
    is_local,
    list_names,
    parquet_bytes,
    part_meta,
    part_shards,
    read_index_part,
    read_part_footer,
    shard_of_part,
)

__all__ = [
    "INPUTS_DIR",
    "INPUTS_RE",
    "INPUT_SCHEME",
    "Recorded",
    "changed_on_disk",
    "file_stamp",
    "hash_files",
    "hash_range",
    "inputs_schema",
    "mark_stale",
    "merge_inputs",
    "recorded_keys",
    "write_inputs",
]

INPUTS_DIR = "inputs"
INPUTS_RE = re.compile(r"^inputs-r(\d{5})-(\d{6})-(\d{6})\.parquet$")
# how ``key`` and ``content`` are made (sources/identity.py); rows of another are not compared
INPUT_SCHEME = 1
MERGE_MIN_FILES = 8  # a store's close merges its rank's inputs files once there are this many
MERGED_ROWS = 1 << 14  # rows per row group of a merged inputs file (a group read: a few MB)
_BLOCK = 1 << 23  # bytes read at a time while hashing


def inputs_schema():
    """One row per committed sample of a shard: whose, where, and what its input was when read."""
    import pyarrow as pa

    return pa.schema(
        [
            ("id", pa.string()),
            ("shard", pa.string()),  # relative to OUT, as the index names it
            ("header", pa.string()),  # the shard's header xxh3, as its index part records it
            ("scheme", pa.uint8()),  # INPUT_SCHEME of the code that made key and content
            ("key", pa.uint64()),  # the entry: id, kind, where its bytes are, the texts the features read
            ("content", pa.uint64()),  # the same with the bytes' xxh3 in place of where; null if not hashed
            ("path", pa.string()),  # the file resolved (a clip's frames NUL-joined), a member's shard, a URL
            ("member", pa.string()),  # a tar member's name
            ("offset", pa.int64()),  # its data's offset in the shard
            ("size", pa.int64()),  # bytes read (a clip's frames together); null at a URL
            ("mtime_ns", pa.int64()),  # the file's (a member: its shard's; frames: the latest); null at a URL
            ("stamp", pa.string()),  # "size:mtime_ns:ctime_ns:inode" of each local file read, ";"-joined
            ("xxh3", pa.string()),  # xxh3-64 of the bytes read (16 hex digits); null if not hashed
        ]
    )


# ------------------------------------------------------------------------------------------ the inputs


def file_stamp(path: str) -> tuple[str, int, int]:
    """(stamp, size, mtime_ns) of a local file: the stamp "size:mtime_ns:ctime_ns:inode" moves with any write
    (the ctime), a copy or a rename over it (the inode). Raises OSError."""
    st = os.stat(path)
    return f"{st.st_size}:{st.st_mtime_ns}:{st.st_ctime_ns}:{st.st_ino}", st.st_size, st.st_mtime_ns


def hash_files(paths: Sequence[str]) -> str:
    """xxh3-64 of the files' bytes one after another (16 hex digits); raises OSError."""
    import xxhash

    h = xxhash.xxh3_64()
    for path in paths:
        with open(path, "rb") as f:
            while chunk := f.read(_BLOCK):
                h.update(chunk)
    return h.hexdigest()


def hash_range(path: str, offset: int, size: int) -> str:
    """xxh3-64 of ``size`` bytes of a local file from ``offset`` (a tar member's data); EOFError if the file
    ends before them, OSError if it cannot be read."""
    import xxhash

    h = xxhash.xxh3_64()
    with open(path, "rb") as f:
        f.seek(offset)
        left = size
        while left > 0:
            chunk = f.read(min(_BLOCK, left))
            if not chunk:
                raise EOFError(f"{path} ends inside the {size} bytes at offset {offset}")
            h.update(chunk)
            left -= len(chunk)
    return h.hexdigest()


# ------------------------------------------------------------------------------------------ writing


def _name(rank: int, first: int, last: int) -> str:
    return f"inputs-r{rank:05d}-{first:06d}-{last:06d}.parquet"


def write_inputs(
    out: Any,
    backend: Any,
    rank: int,
    seq: int,
    ids: Sequence[str],
    shard: str,
    header: str,
    records: Sequence[Mapping[str, Any] | None],
    tag: str,
) -> None:
    """The inputs file of one commit (rows of ``ids``, in shard ``shard`` whose header xxh3 is ``header``),
    written whole before the commit's index part; nothing when no sample has a record."""
    if not any(r is not None for r in records):
        return
    schema = inputs_schema()
    rows = {"id": list(ids), "shard": [shard] * len(ids), "header": [header] * len(ids)}
    for name in schema.names:
        if name not in rows:  # the record's own fields
            rows[name] = [None if r is None else r.get(name) for r in records]
    folder = out / INPUTS_DIR
    if is_local(out):
        folder.mkdir(exist_ok=True)
    backend.write(folder / _name(rank, seq, seq), parquet_bytes(rows, schema), tag)


def merge_inputs(out: Any, backend: Any, rank: int, tag: str, min_files: int = MERGE_MIN_FILES) -> int:
    """Merge rank ``rank``'s inputs files into one once there are ``min_files``, keeping the rows of live
    shards only (the merged file first, then the deletions: a kill between leaves rows twice, which readers
    take as one). Returns how many files it merged."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    from vlfast.extraction.store.format import committed_parts

    files = [n for n in _files(out) if int(INPUTS_RE.match(n).group(1)) == rank]
    if len(files) < min_files:
        return 0
    live = live_shards(committed_parts(out))
    seqs = [int(INPUTS_RE.match(n).group(k)) for n in files for k in (2, 3)]
    merged = _name(rank, min(seqs), max(seqs))
    staged = backend.stage(out / INPUTS_DIR / merged, tag)
    try:
        with pq.ParquetWriter(staged, inputs_schema(), write_page_checksum=True) as writer:
            # rows gathered into row groups of MERGED_ROWS: a read of the merged file costs a few of them
            pending: list[Any] = []
            for name in files:
                for table in _groups(out / INPUTS_DIR / name, None):
                    keep = _live_rows(table, live)
                    if keep.any():  # in the schema's types: shard and header were read as dictionaries
                        pending.append(table.filter(pa.array(keep)).cast(inputs_schema()))
                    if sum(len(t) for t in pending) >= MERGED_ROWS:
                        writer.write_table(pa.concat_tables(pending).combine_chunks())
                        pending = []
            if pending:
                writer.write_table(pa.concat_tables(pending).combine_chunks())
        if merged in files:  # a merge of the same span cut short before: replaced
            backend.remove([out / INPUTS_DIR / merged])
        backend.commit_file(staged, out / INPUTS_DIR / merged)
    finally:
        backend.unstage(staged)
    backend.remove([out / INPUTS_DIR / name for name in files if name != merged])
    return len(files)


# ------------------------------------------------------------------------------------------ reading


def _files(out: Any) -> list[str]:
    return sorted(n for n in list_names(out / INPUTS_DIR) if INPUTS_RE.match(n))


def live_shards(parts: Sequence[Path]) -> dict[str, str | None]:
    """Shard (relative to OUT) -> its header xxh3, for every shard ``parts`` point at (from their footers)."""
    live: dict[str, str | None] = {}
    for part in parts:
        raw = read_part_footer(part)
        if raw is None:
            continue
        for shard, (_, header) in part_shards(part, part_meta(SimpleNamespace(metadata=raw))).items():
            live[shard] = header
    return live


def _groups(path: Any, columns: Sequence[str] | None) -> Iterator[Any]:
    """An inputs file's row groups (``columns`` of them, with shard and header; all when None); none if it
    cannot be read (a damaged record is no record)."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    wanted = None if columns is None else ["shard", "header", *columns]
    try:
        file = pq.ParquetFile(
            str(path) if is_local(path) else pa.BufferReader(read_whole(path)),
            page_checksum_verification=True,
            read_dictionary=["shard", "header"],
        )
        for g in range(file.num_row_groups):
            yield file.read_row_group(g, columns=wanted, use_threads=False)
    except (OSError, pa.ArrowException, KeyError):
        return


def _live_rows(table: Any, live: Mapping[str, str | None]) -> np.ndarray:
    """Which rows name a shard a live part points at, with the header checksum that part records."""
    shard, header = table.column("shard").combine_chunks(), table.column("header").combine_chunks()
    names, headers = shard.dictionary.to_pylist(), header.dictionary.to_pylist()
    at_header = {h: j for j, h in enumerate(headers)}
    ok_shard = np.array([n in live for n in names] + [False], bool)
    want = np.array([at_header.get(live.get(n), -2) for n in names] + [-2], np.int64)
    rows_shard = np.asarray(shard.indices.fill_null(len(names)), np.int64)
    rows_header = np.asarray(header.indices.fill_null(-3), np.int64)
    return ok_shard[rows_shard] & (want[rows_shard] == rows_header)


class Recorded:
    """What the inputs files record for the live shards, sorted: ``values`` (entry keys or content keys) and
    ``unknown`` (id hashes of the rows of live shards without a record of this scheme: never called changed)."""

    def __init__(self, values: np.ndarray, unknown: np.ndarray):
        self.values, self.unknown = values, unknown

    @staticmethod
    def has(sorted_values: np.ndarray, values: np.ndarray) -> np.ndarray:
        """Whether each of ``values`` is in ``sorted_values`` (bool array), looked up in their own sorted
        order: in input order, ten million lookups in 80 MB of keys miss the cache at each step (23 s)."""
        if not len(sorted_values) or not len(values):
            return np.zeros(len(values), bool)
        order = np.argsort(values)
        ordered = values[order]
        at = np.searchsorted(sorted_values, ordered).clip(max=len(sorted_values) - 1)
        out = np.empty(len(values), bool)
        out[order] = sorted_values[at] == ordered
        return out


def _sorted(arrays: list[np.ndarray]) -> np.ndarray:
    out = np.concatenate(arrays) if arrays else np.empty(0, np.uint64)
    out.sort()
    return out


def recorded_keys(out: Any, parts: Sequence[Path], field: str = "key") -> Recorded:
    """The ``field`` ("key" or "content") recorded for the shards ``parts`` point at, and the id hashes of
    those shards' samples without a record; empty when ``out`` records nothing."""
    import pyarrow as pa
    import pyarrow.compute as pc

    files = _files(out)
    if not files or not parts:
        return Recorded(np.empty(0, np.uint64), np.empty(0, np.uint64))
    live = live_shards(parts)
    found: list[np.ndarray] = []
    covered: set[str] = set()
    for name in files:
        for table in _groups(out / INPUTS_DIR / name, ("scheme", field)):
            keep = _live_rows(table, live)
            keep &= pc.fill_null(table.column("scheme"), 0).to_numpy(zero_copy_only=False) == INPUT_SCHEME
            if not keep.any():
                continue
            rows = table.filter(pa.array(keep))
            covered.update(rows.column("shard").combine_chunks().dictionary.to_pylist())
            values = rows.column(field).combine_chunks().drop_null()
            found.append(values.to_numpy(zero_copy_only=False).astype(np.uint64))
    if not found:
        return Recorded(np.empty(0, np.uint64), np.empty(0, np.uint64))
    return Recorded(_sorted(found), _sorted(_unrecorded(parts, set(live) - covered)))


def _unrecorded(parts: Sequence[Path], shards: set[str]) -> list[np.ndarray]:
    """The id hashes of the rows of ``parts`` in ``shards`` (shards without a record)."""
    import pyarrow as pa
    import pyarrow.compute as pc

    hashes: list[np.ndarray] = []
    if not shards:
        return hashes
    for part in parts:
        if not is_consolidated(part):
            if f"{SHARD_DIR}/{shard_of_part(part).name}" in shards:
                hashes.append(hash_ids(read_index_part(part, ["id"]).column("id")))
            continue
        table = read_index_part(part, ["id", "shard"])
        mask = pc.is_in(table.column("shard").cast(pa.string()), value_set=pa.array(sorted(shards)))
        if pc.any(mask).as_py():
            hashes.append(hash_ids(table.column("id").filter(mask)))
    return hashes


def changed_on_disk(out: Any, parts: Sequence[Path], keys_now: np.ndarray) -> tuple[list[str], int, int]:
    """The full check of recorded local inputs: (ids whose bytes differ from those recorded, inputs stat'ed,
    inputs hashed), for rows of live shards whose entry key is in ``keys_now`` (sorted). An unchanged stamp
    vouches for the bytes; an input that cannot be read now is not called changed."""
    import pyarrow as pa

    changed: list[str] = []
    stated = hashed = 0
    live = live_shards(parts) if parts else {}
    fields = ("id", "path", "member", "offset", "size", "stamp", "xxh3")
    for name in _files(out) if live else []:
        for table in _groups(out / INPUTS_DIR / name, ("scheme", "key", *fields)):
            scheme = table.column("scheme").combine_chunks().fill_null(0).to_numpy(zero_copy_only=False)
            keys = table.column("key").combine_chunks().fill_null(0).to_numpy(zero_copy_only=False)
            keep = _live_rows(table, live) & (scheme == INPUT_SCHEME) & Recorded.has(keys_now, keys)
            if not keep.any():
                continue
            rows = table.filter(pa.array(keep))
            for sid, path, member, offset, size, stamp, digest in zip(
                *(rows.column(f).to_pylist() for f in fields)
            ):
                if path is None or digest is None:  # at a URL, or not read: nothing to compare
                    continue
                if member is None and "\x00" not in path:  # one local file: the common case, kept quick
                    try:
                        now = file_stamp(path)[0]
                    except OSError:
                        continue
                    stated += 1
                    if now == stamp:
                        continue
                verdict = _differs(path, member, offset, size, stamp, digest)
                if verdict is None:
                    continue
                stated += member is not None or "\x00" in path
                hashed += verdict[1]
                if verdict[0]:
                    changed.append(sid)
    return changed, stated, hashed


def _differs(
    path: str, member: str | None, offset: int | None, size: int | None, stamp: str | None, digest: str
) -> tuple[bool, bool] | None:
    """(whether a recorded local input's bytes differ now, whether they were hashed to tell); None when it
    cannot be read now."""
    if is_url(path):
        return None
    paths = [path] if member is not None else path.split("\x00")
    try:
        stamps = [file_stamp(p) for p in paths]
    except OSError:
        return None
    if ";".join(s[0] for s in stamps) == stamp:
        return False, False
    if member is None and sum(s[1] for s in stamps) != size:
        return True, False
    try:
        now = hash_range(path, offset, size) if member is not None else hash_files(paths)
    except EOFError:
        return True, True  # the shard now ends inside the member: not the member read
    except OSError:
        return None
    return now != digest, True


# ------------------------------------------------------------------------------------------ the writer's move


def mark_stale(check: Any, stale: Any) -> int:
    """Make a sound part's ``check`` fail for what holds ids of ``stale`` (ids whose inputs changed): its
    shard, or in a consolidated part the shards holding them, which the writer then moves aside so their
    samples are extracted again. Returns how many of its ids are stale (0: the check is left as it was)."""
    import pyarrow as pa
    import pyarrow.compute as pc

    from vlfast.extraction.ids import ArrowStrings

    ids = check.ids.array if isinstance(check.ids, ArrowStrings) else pa.array(list(check.ids), pa.string())
    hit = np.asarray(pc.is_in(ids, value_set=stale).to_numpy(zero_copy_only=False), bool)
    n = int(hit.sum())
    if not n:
        return 0
    first = ids.filter(pa.array(hit)).slice(0, 3).to_pylist()
    reason = (
        f"the input of {n} of its samples changed since they were extracted (e.g. {json.dumps(first)}): "
        "moved aside so that they are extracted again"
    )
    if is_consolidated(check.part):  # only the shards holding them
        check.bad_shards = {check.row_shards[k]: reason for k in np.flatnonzero(hit).tolist()}
    else:
        check.problem = reason
    return n
