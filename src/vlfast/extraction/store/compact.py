"""Compaction: one consolidated index part in place of a rank's many small ones.

A consolidated part holds the rows of several parts of one rank (pointing at the same shards) and names in
its metadata the shards it points at and the parts it supersedes. It is committed like any part, and only
then are those parts deleted; readers ignore superseded parts while they exist. A rank's parts have one
writer, which compacts them under its own lock when it closes; ``vlfast out compact OUT`` takes each rank's
lock in turn. The format is specified in docs/format.md.
"""

from __future__ import annotations

import contextlib
import os
import secrets
import time
from collections.abc import Collection, Iterator
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from vlfast._files import disk_full
from vlfast.extraction.store.backend import backend_for
from vlfast.extraction.store.format import (
    COMPACT_RE,
    FORMAT_VERSION,
    INDEX_DIR,
    META_CONFIG,
    META_CONFIG_HASH,
    META_FORMAT,
    META_OWNED_UNDER,
    META_SHARDS,
    META_SUPERSEDES,
    DamagedFile,
    OutputInUse,
    canonical_json,
    check_part_bytes,
    committed_parts,
    compact_part_name,
    consolidated_info,
    file_xxh3,
    gc_paused,
    index_schema,
    list_names,
    map_parts,
    open_index_part,
    part_meta,
    part_shards,
    part_span,
    read_part_groups,
    read_run_file,
    resolve_out,
    run_hash,
)

__all__ = [
    "Compaction",
    "commit_consolidated",
    "compact_folder",
    "compact_rank",
    "finish_deletions",
    "write_consolidated",
]

# FeatureStore.close compacts its rank once it has at least this many live parts (fewer cost little to open).
CLOSE_MIN_PARTS = 8


@dataclass
class Compaction:
    """What one rank's compaction did."""

    rank: int
    part: str | None = None  # the consolidated part committed, if any
    replaced: int = 0  # live parts it replaced
    samples: int = 0  # rows it holds
    deleted: int = 0  # superseded parts deleted (its own, and any a killed compaction left)
    skipped: str | None = None  # why nothing was compacted (a live writer holds the rank, ...)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def write_consolidated(
    out: Path, backend: Any, table, span: tuple[int, int, int], meta: dict[bytes, bytes], tag: str
) -> Path:
    """Commit ``table`` (the index schema) as the consolidated part of ``span`` (rank, first, last) with the
    key-value metadata ``meta`` (see :func:`commit_consolidated`)."""
    import pyarrow.parquet as pq

    table = _conform(table, index_schema())  # the shard column may have been read as a dictionary
    with _staged(out, backend, tag) as staged:
        pq.write_table(table.replace_schema_metadata(meta), staged, write_page_checksum=True)
        return commit_consolidated(out, backend, staged, span, tag)


@contextlib.contextmanager
def _staged(out: Any, backend: Any, tag: str) -> Iterator[Path]:
    """A local file to write a consolidated part into before its commit, removed afterwards unless committed."""
    staged = backend.stage(out / INDEX_DIR / "consolidated.parquet", tag)
    try:
        yield staged
    finally:
        backend.unstage(staged)


def commit_consolidated(out: Any, backend: Any, staged: Path, span: tuple[int, int, int], tag: str) -> Path:
    """Commit the Parquet file ``staged`` as the consolidated part of ``span``: named with its own xxh3,
    written whole or not at all, exclusively; hashed as it is read and moved or streamed up, never held in
    memory (140 MB at ten million samples)."""
    part = out / INDEX_DIR / compact_part_name(*span, file_xxh3(staged))
    with contextlib.suppress(FileExistsError):  # named by its own hash: an existing one has these bytes
        backend.commit_file(staged, part)  # <- the commit
    # Read back against its name (every byte, nothing decoded) before anything it supersedes is deleted.
    check_part_bytes(part)
    return part


def finish_deletions(out: Path, backend: Any, rank: int) -> int:
    """Delete the parts of ``rank`` that a sound consolidated part present supersedes (a kill between a
    compaction's commit and its deletions); returns how many. A damaged consolidated part deletes nothing."""
    index = out / INDEX_DIR
    names = set(list_names(index))
    doomed: set[str] = set()
    for name in sorted(names):
        span = part_span(name)
        if not COMPACT_RE.match(name) or span is None or span[0] != rank:
            continue
        info = consolidated_info(index / name)
        present = [n for n in (info[1] if info else []) if n in names and n not in doomed]
        if not present:
            continue
        try:
            check_part_bytes(index / name)
        except DamagedFile:
            continue
        doomed.update(present)
    if doomed:
        backend.remove([index / n for n in sorted(doomed)])
    return len(doomed)


_ROW_GROUP = 1 << 17  # rows per row group of a consolidated part, and at most held at once while compacting


class _Stream:
    """The rows of a rank's sound live parts, written into one Parquet file a row group at a time. Two
    passes, since the file's key-value metadata is given when its writer opens (pyarrow 15 cannot add it
    later): :meth:`gather` takes each part's footer metadata (a damaged part, or one of another
    configuration, stays as it is), then :meth:`write` streams the rows of the parts used."""

    def __init__(self, expected: str):
        self.expected = expected
        self.rows = 0
        self.shards: dict[str, list] = {}
        self.supersedes: list[str] = []
        self.config: bytes | None = None
        self.used: list[Path] = []
        self.owned_under: set[int | None] = set()  # what the parts used say of who owns their ids

    def gather(self, part: Path, table: Any | None) -> None:
        """Take in ``part`` (``table``: its schema as :func:`_schema_or_none` read it, None if damaged)."""
        if table is None:
            return
        meta = part_meta(table)
        if meta["config_hash"] != self.expected:
            return
        self.config = self.config or (table.schema.metadata or {}).get(META_CONFIG)
        self.shards.update({s: list(v) for s, v in part_shards(part, meta).items()})
        self.supersedes += [part.name, *meta["supersedes"]]
        self.owned_under.add(meta["owned_under"])
        self.used.append(part)

    def write(self, out: Any, meta: dict[bytes, bytes], dest: Path) -> None:
        """Write the consolidated file to ``dest`` with ``meta``. A part used that cannot be read now raises
        DamagedFile, and compaction leaves the parts as they are for the next check to judge."""
        import pyarrow.parquet as pq

        schema = index_schema()
        pending: list = []
        held = 0
        with pq.ParquetWriter(dest, schema.with_metadata(meta), write_page_checksum=True) as writer:
            # A part's row groups one at a time: an earlier consolidated part is never decoded whole.
            for part, file in zip(self.used, map_parts(out, open_index_part, self.used)):
                for g in range(file.num_row_groups):
                    table = read_part_groups(file, part, [g])
                    pending.append(_conform(table, schema))
                    held += table.num_rows
                    if held >= _ROW_GROUP:
                        self._flush(writer, pending, held)
                        pending, held = [], 0
            if pending:
                self._flush(writer, pending, held)

    def _flush(self, writer: Any, pending: list, held: int) -> None:
        import pyarrow as pa

        writer.write_table(pa.concat_tables(pending), row_group_size=max(held, 1))
        self.rows += held


def _schema_or_none(part: Path) -> Any:
    """``part``'s schema and key-value metadata (an empty table) once its bytes pass the checksum in its
    name, or None. Nothing is decoded (a consolidated part's ids cost 220 MB at ten million rows)."""
    try:
        return open_index_part(part).schema_arrow.empty_table()
    except DamagedFile:
        return None


def _conform(table: Any, schema: Any) -> Any:
    """``table`` as ``schema``: its columns in order and type, a column it lacks as nulls."""
    import pyarrow as pa

    names = table.column_names
    columns = [
        table.column(f.name).cast(f.type) if f.name in names else pa.nulls(table.num_rows, f.type)
        for f in schema
    ]
    return pa.Table.from_arrays(columns, schema=schema)


@gc_paused()
def compact_rank(
    out: Any,
    rank: int,
    backend: Any,
    *,
    min_parts: int = 2,
    tag: str | None = None,
    expected: str | None = None,
) -> Compaction:
    """Replace the live parts of ``rank`` by one consolidated part when there are at least ``min_parts``,
    then delete them (and whatever an earlier, killed compaction left). The caller holds the rank. A full
    disk raises the backend's OutputFull, the parts unchanged. ``expected``: the configuration hash the
    parts must carry, where the caller has it (else run.json is read for it)."""
    out = resolve_out(out)
    tag = tag or f"r{rank:05d}-{os.getpid()}"
    result = Compaction(rank)
    try:
        result.deleted = finish_deletions(out, backend, rank)
        candidates = [p for p in committed_parts(out) if (part_span(p.name) or (-1,))[0] == rank]
        if len(candidates) < max(2, min_parts):
            return result
        stream = _Stream(expected or run_hash(read_run_file(out)))
        for part, table in zip(candidates, map_parts(out, _schema_or_none, candidates)):
            stream.gather(part, table)
        used = stream.used
        if len(used) < max(2, min_parts) or stream.config is None:
            return result
        spans = [part_span(p.name) for p in used]
        meta = {
            META_FORMAT: str(FORMAT_VERSION).encode(),
            META_CONFIG: stream.config,
            META_CONFIG_HASH: stream.expected.encode(),
            META_SHARDS: canonical_json(dict(sorted(stream.shards.items()))).encode("utf-8"),
            META_SUPERSEDES: canonical_json(sorted(set(stream.supersedes))).encode("utf-8"),
        }
        if len(stream.owned_under) == 1 and None not in stream.owned_under:  # all its parts say the same
            meta[META_OWNED_UNDER] = str(next(iter(stream.owned_under))).encode()
        span = (rank, min(s[1] for s in spans), max(s[2] for s in spans))
        with _staged(out, backend, tag) as staged:
            try:
                stream.write(out, meta, staged)
            except DamagedFile:
                return result
            part = commit_consolidated(out, backend, staged, span, tag)
        # Only now, with the consolidated part committed and read back, go the parts it replaces.
        backend.remove([p for p in used if p.name != part.name])
        result.deleted += finish_deletions(out, backend, rank)
    except OSError as e:
        if disk_full(e):
            raise backend.full_error(e, f"compacting the index of rank {rank}") from None
        raise
    result.part, result.replaced, result.samples = part.name, len(used), stream.rows
    return result


def compact_folder(
    out: Any,
    storage_options: dict | None = None,
    *,
    min_parts: int = 2,
    ranks: Collection[int] | None = None,
) -> list[Compaction]:
    """``vlfast out compact OUT``: compact every rank's parts, or only ``ranks``. Locally each rank's lock is
    taken in turn: a rank a live process is writing is skipped, and says so."""
    out = resolve_out(out, storage_options)
    expected = run_hash(read_run_file(out))  # a vlfast folder, and of this vlfast's format
    present = {s[0] for n in list_names(out / INDEX_DIR) if (s := part_span(n)) is not None}
    ranks = sorted(present if ranks is None else present & set(ranks))
    session = time.strftime("%Y%m%dT%H%M%S", time.gmtime()) + secrets.token_hex(4)
    results = []
    for rank in ranks:
        backend = backend_for(out, session)
        try:
            backend.lock(rank)
        except OutputInUse:
            results.append(Compaction(rank, skipped="a live process is writing this rank"))
            continue
        try:
            results.append(compact_rank(out, rank, backend, min_parts=min_parts, expected=expected))
        finally:
            backend.release()
    return results
