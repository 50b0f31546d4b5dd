"""Compaction: one consolidated index part in place of a rank's many small ones.

A consolidated part holds the rows of several committed parts of one rank (the same schema; its rows point
at the same shard files, which are never rewritten) and says in its Parquet metadata which shards it points
at (with each one's size and header checksum, as the parts it replaces recorded them) and which parts it
supersedes. It is committed like any part (temp file, fsync, rename; on object storage one exclusive
upload), and only then are the parts it supersedes deleted. Readers ignore superseded parts while they still
exist, so a kill between the commit and the deletions leaves a folder that reads each sample once; the next
compaction of that rank finishes the deletions. The format is specified in docs/extract.md ("On-disk
layout", "Commits and crash safety").

Why one rank at a time: a rank's parts are written by one process (the lock locally; the launcher on
object storage), so the process that wrote them can compact them under its own lock when it closes, without
waiting for or coordinating with the other ranks, and ``vlfast extract --compact OUT`` takes each rank's lock
in turn (skipping a rank a live process holds).
"""

from __future__ import annotations

import contextlib
import json
import os
import secrets
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from vlfast.extraction.store.backend import backend_for, disk_full
from vlfast.extraction.store.format import (
    COMPACT_RE,
    FORMAT_VERSION,
    INDEX_DIR,
    META_CONFIG,
    META_CONFIG_HASH,
    META_FORMAT,
    META_SHARDS,
    META_SUPERSEDES,
    RUN_FILE,
    DamagedFile,
    OutputInUse,
    canonical_json,
    committed_parts,
    compact_part_name,
    config_hash,
    consolidated_info,
    gc_paused,
    list_names,
    part_meta,
    part_shards,
    part_span,
    read_index_part,
    read_run_file,
    resolve_out,
    stable_config,
    xxh3,
)

__all__ = ["Compaction", "compact_folder", "compact_rank", "finish_deletions", "write_consolidated"]

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
    key-value metadata ``meta``: named with its own xxh3, written whole or not at all, exclusively. run.json
    says format 3 first, so a vlfast too old to know consolidated parts refuses the folder instead of taking
    their shards for orphans."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    _require_format_3(out, backend, tag)
    sink = pa.BufferOutputStream()
    pq.write_table(table.replace_schema_metadata(meta), sink, write_page_checksum=True)
    data = sink.getvalue().to_pybytes()
    part = out / INDEX_DIR / compact_part_name(*span, xxh3(data))
    with contextlib.suppress(FileExistsError):  # named by its own hash: an existing one has these bytes
        backend.write(part, data, tag, exclusive=True)  # <- the commit
    read_index_part(part)  # read back against its name before anything it supersedes is deleted
    return part


def _require_format_3(out: Path, backend: Any, tag: str) -> None:
    doc = read_run_file(out)
    if doc.get("format_version", 0) >= FORMAT_VERSION:
        return
    doc["format_version"] = FORMAT_VERSION  # nothing else changes: the same configuration, the same hash
    backend.write(out / RUN_FILE, (json.dumps(doc, indent=2, sort_keys=True) + "\n").encode(), tag)


def finish_deletions(out: Path, backend: Any, rank: int) -> int:
    """Delete the parts of ``rank`` that a sound consolidated part present supersedes (left by a kill between
    a compaction's commit and its deletions); returns how many. A consolidated part that fails its checksum
    deletes nothing: the parts it replaced are what rebuilds it."""
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
            read_index_part(index / name)
        except DamagedFile:
            continue
        doomed.update(present)
    if doomed:
        backend.remove([index / n for n in sorted(doomed)])
    return len(doomed)


def _gather(out: Path, rank: int, expected: str) -> tuple[list, dict, list[str], bytes | None, list[Path]]:
    """The sound live parts of ``rank``: (tables, shards, names superseded, config bytes, parts). A damaged
    part, one of another configuration or one without a configuration (format 1) stays as it is."""
    tables, shards, supersedes, config, used = [], {}, [], None, []
    for part in committed_parts(out):
        span = part_span(part.name)
        if span is None or span[0] != rank:
            continue
        try:
            table = read_index_part(part)
        except DamagedFile:
            continue
        meta = part_meta(table)
        if meta["config_hash"] != expected:
            continue
        config = config or (table.schema.metadata or {}).get(META_CONFIG)
        shards.update({s: list(v) for s, v in part_shards(part, meta).items()})
        supersedes += [part.name, *meta["supersedes"]]
        tables.append(table.replace_schema_metadata(None))
        used.append(part)
    return tables, shards, supersedes, config, used


@gc_paused()
def compact_rank(
    out: Any, rank: int, backend: Any, *, min_parts: int = 2, tag: str | None = None
) -> Compaction:
    """Replace the live parts of ``rank`` by one consolidated part when there are at least ``min_parts``,
    then delete them (and whatever an earlier, killed compaction left). The caller holds the rank (its lock
    locally). A full disk raises the backend's OutputFull: the parts stay and the folder reads as before."""
    import pyarrow as pa

    out = resolve_out(out)
    tag = tag or f"r{rank:05d}-{os.getpid()}"
    result = Compaction(rank)
    try:
        result.deleted = finish_deletions(out, backend, rank)
        run = read_run_file(out)
        expected = config_hash(stable_config(run.get("config", {}), run.get("volatile_keys", [])))
        tables, shards, supersedes, config, used = _gather(out, rank, expected)
        if len(used) < max(2, min_parts) or config is None:
            return result
        spans = [part_span(p.name) for p in used]
        table = pa.concat_tables(tables, promote_options="default")
        meta = {
            META_FORMAT: str(FORMAT_VERSION).encode(),
            META_CONFIG: config,
            META_CONFIG_HASH: expected.encode(),
            META_SHARDS: canonical_json(dict(sorted(shards.items()))).encode("utf-8"),
            META_SUPERSEDES: canonical_json(sorted(set(supersedes))).encode("utf-8"),
        }
        span = (rank, min(s[1] for s in spans), max(s[2] for s in spans))
        part = write_consolidated(out, backend, table, span, meta, tag)
        # Only now, with the consolidated part committed and read back, go the parts it replaces.
        backend.remove([p for p in used if p.name != part.name])
        result.deleted += finish_deletions(out, backend, rank)
    except OSError as e:
        if disk_full(e):
            raise backend.full_error(e, f"compacting the index of rank {rank}") from None
        raise
    result.part, result.replaced, result.samples = part.name, len(used), table.num_rows
    return result


def compact_folder(out: Any, storage_options: dict | None = None, *, min_parts: int = 2) -> list[Compaction]:
    """``vlfast extract --compact OUT``: compact every rank's parts (for folders written before compaction
    existed, or whose runs were stopped before they closed). Locally each rank's lock is taken in turn: a
    rank a live process is writing is skipped, and says so."""
    out = resolve_out(out, storage_options)
    read_run_file(out)  # a vlfast folder, and not a newer vlfast's
    ranks = sorted({s[0] for n in list_names(out / INDEX_DIR) if (s := part_span(n)) is not None})
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
            results.append(compact_rank(out, rank, backend, min_parts=min_parts))
        finally:
            backend.release()
    return results
