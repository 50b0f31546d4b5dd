"""Integrity checks of an extraction folder: one index part with its shards, or the whole folder.

What is checked (docs/format.md, "Checksums: what covers what"): the index part's bytes against the hash in
its name, then Parquet's page checksums; each shard's presence, size and header bytes against what its part
recorded; with ``data=True``, every tensor's bytes against its xxh3-64 in the index (~1.5 GB/s here).
:func:`check_part` runs on resume; :func:`check_folder` is ``vlfast out verify OUT``. :class:`HashRecord`
(``OUT/checked.json``) lets a full check skip shards untouched since their last full check.
"""

from __future__ import annotations

import contextlib
import io
import json
import mmap
import os
import struct
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

if TYPE_CHECKING:
    import pyarrow as pa

from vlfast.extraction.ids import ArrowStrings
from vlfast.extraction.objstore import read_whole
from vlfast.extraction.store.format import (
    CHECK_FILE,
    COMPACT_RE,
    PART_RE,
    SHARD_DIR,
    SHARD_RE,
    DamagedFile,
    canonical_json,
    committed_parts,
    error_files,
    gc_paused,
    is_consolidated,
    is_local,
    open_index_part,
    part_meta,
    part_shards,
    read_error_file,
    read_header,
    read_part_groups,
    read_run_file,
    resolve_out,
    run_hash,
    shard_of_part,
    xxh3,
)
from vlfast.extraction.store.layout import Stray, find_strays

__all__ = [
    "CheckReport",
    "HashRecord",
    "PartCheck",
    "RemoteShard",
    "check_folder",
    "check_part",
    "open_shard",
]


@dataclass
class PartCheck:
    """The verdict on one index part and its shard."""

    part: Path
    shard: Path
    # ids the part indexes, an ArrowStrings (a list, from the shard header, when the part is unreadable)
    ids: Sequence[str]
    problem: str | None = None  # what is wrong with the part or shard as a whole
    bad: list[tuple[str, str]] = field(default_factory=list)  # (id, feature) whose bytes fail their checksum
    checked_bytes: int = 0  # tensor bytes hashed
    config: dict | None = None  # the run configuration the part was made with
    config_hash: str | None = None
    shards: list[str] = field(default_factory=list)  # the shards it points at, relative to OUT
    # each id's shard, relative to OUT (parallel to ids)
    row_shards: Sequence[str] = field(default_factory=list)
    # a consolidated part's damaged shards (relative to OUT) -> what is wrong: only their samples are redone
    bad_shards: dict[str, str] = field(default_factory=dict)

    @property
    def ok(self) -> bool:
        return self.problem is None and not self.bad and not self.bad_shards


def header_ids(shard: Path) -> list[str]:
    """Ids a shard's header lists, or [] when it cannot be read: to name the samples of an unreadable part
    or an uncovered shard."""
    try:
        with open_shard(shard) as f:
            _, _, header = f.header()
        ids = json.loads(header.get("__metadata__", {}).get("ids", "[]"))
    except (OSError, ValueError, AttributeError, TypeError):  # garbage: no header, or not safetensors'
        return []
    return ids if isinstance(ids, list) and all(isinstance(i, str) for i in ids) else []


class _Opened:
    def __enter__(self):
        return self

    def __exit__(self, *exc: object) -> None:
        pass


class _LocalShard(_Opened):
    """A local shard: one open file, its header read in place, its data hashed through a memory map."""

    def __init__(self, path: Path):
        self._f = open(path, "rb")  # noqa: SIM115 - closed by __exit__
        self.size = os.fstat(self._f.fileno()).st_size

    def header(self, parse: bool = True) -> tuple[int, bytes, dict]:
        self._f.seek(0)
        return read_header(self._f, self.size, parse=parse)

    def hash_tensors(self, feats: list[dict]) -> list[str]:
        """xxh3 of each feature's bytes (``offset``/``nbytes`` as the index gives them), in order."""
        if self.size == 0:
            return []
        with mmap.mmap(self._f.fileno(), 0, access=mmap.ACCESS_READ) as mm:
            view = memoryview(mm)
            try:
                return [xxh3(view[f["offset"] : f["offset"] + f["nbytes"]]) for f in feats]
            finally:
                view.release()

    def __exit__(self, *exc: object) -> None:
        self._f.close()


class RemoteShard(_Opened):
    """A shard on object storage, read by byte ranges (objstore's ranged reader, ``policy`` as the caller
    needs): the header in one request (two if it is long), the data in windows of up to 64 MiB."""

    WINDOW = 64 << 20
    HEAD = 256 << 10  # bytes asked for first when reading the header

    def __init__(self, path: Any, size: int | None = None, *, policy: str = "raw"):
        from vlfast.extraction.objstore import ObjectRange

        self.object = ObjectRange.of(path, policy)
        self.size = self.object.size() if size is None else size

    def read(self, start: int, n: int, what: str = "") -> bytes:
        return self.object.read(start, start + n, what)

    def header(self, parse: bool = True) -> tuple[int, bytes, dict]:
        # One request for most headers: a shard of 1,024 samples has a header of about 100 KiB.
        head = self.read(0, min(self.size, self.HEAD), "the header")
        if len(head) >= 8:
            (n,) = struct.unpack("<Q", head[:8])
            if 8 + n > len(head) and n <= self.size - 8:
                head += self.read(len(head), 8 + n - len(head), "the header")
        return read_header(io.BytesIO(head), self.size, parse=parse)

    def hash_tensors(self, feats: list[dict]) -> list[str]:
        order = sorted(range(len(feats)), key=lambda k: feats[k]["offset"])
        out: list[str] = [""] * len(feats)
        k = 0
        while k < len(order):
            start = feats[order[k]]["offset"]
            end = k
            while end < len(order) and (
                feats[order[end]]["offset"] + feats[order[end]]["nbytes"] - start <= self.WINDOW or end == k
            ):
                end += 1
            stop = max(feats[order[j]]["offset"] + feats[order[j]]["nbytes"] for j in range(k, end))
            window = memoryview(self.read(start, stop - start))
            for j in order[k:end]:
                a = feats[j]["offset"] - start
                out[j] = xxh3(window[a : a + feats[j]["nbytes"]])
            k = end
        return out


def open_shard(path: Any, size: int | None = None) -> _LocalShard | RemoteShard:
    """A shard opened for checking: ``size``, ``header()`` and ``hash_tensors(features)``. ``size``: as a
    fresh listing gave it (else one request asks for it)."""
    return _LocalShard(path) if is_local(path) else RemoteShard(path, size)


def check_part(part: Path, *, data: bool = True) -> PartCheck:
    """Check one index part and every shard it points at; never raises for damage, only reports it. A
    consolidated part's shards are judged one by one (``PartCheck.bad_shards``), so damage in one costs
    that shard's samples only."""
    consolidated = is_consolidated(part)
    shard = part if consolidated else shard_of_part(part)
    try:
        # The ids and shards now; the feature entries a shard at a time, when a full check reads them.
        file = open_index_part(part)
        table = read_part_groups(file, part, None, ["id", "shard"])
    except DamagedFile as e:
        return PartCheck(part, shard, [] if consolidated else header_ids(shard), problem=str(e))
    meta = part_meta(table)
    ids = ArrowStrings.of_chunks(table.column("id"))  # a row group's ids a chunk: no copy of them all
    check = PartCheck(part, shard, ids, config=meta["config"], config_hash=meta["config_hash"])
    check.row_shards = ArrowStrings(table.column("shard"))
    expected = part_shards(part, meta)
    check.shards = sorted(expected)
    groups = _rows_by_shard(check.row_shards.array)
    stray = sorted(set(groups) - set(expected))
    if stray:
        what = "the shards its metadata lists" if consolidated else f"its own shard {shard.name}"
        check.problem = f"index part {part.name} points at {stray}, not at {what}"
        return check
    features = _Entries(file, part)
    out = part.parent.parent
    listed = _listed_sizes(out, len(expected))

    def one(item: tuple[str, tuple[int | None, str | None]]) -> tuple[str, _Verdict]:
        rel, (size, header_hash) = item
        rows = groups.get(rel, range(0))
        keep = np.arange(rows.start, rows.stop) if isinstance(rows, range) else rows
        verdict = _Verdict(check.part)
        verdict.problem = _check_shard(
            verdict,
            out / rel,
            # One shard's rows at a time as Python objects, and only when they are read: a consolidated
            # part's whole column at once costs a million dicts per million samples.
            lambda: _rows(ids.array, keep),
            lambda: features.rows(keep),
            size,
            header_hash,
            data,
            listed.get(rel.rsplit("/", 1)[-1]),
        )
        return rel, verdict

    items = list(expected.items())
    if listed and len(items) > 1:  # on object storage the shards' checks wait on requests: run them at once
        with ThreadPoolExecutor(min(_CHECK_THREADS, len(items)), thread_name_prefix="vlfast-check") as pool:
            verdicts = list(pool.map(one, items))
    else:
        verdicts = map(one, items)
    for rel, verdict in verdicts:
        check.bad.extend(verdict.bad)
        check.checked_bytes += verdict.checked_bytes
        if verdict.problem is not None:
            if not consolidated:
                check.problem = verdict.problem
                return check
            check.bad_shards[rel] = verdict.problem
    return check


_CHECK_THREADS = 16  # shards of one part checked at once on object storage


@dataclass
class _Verdict:
    """What the check of one shard found: its problem, its damaged tensors, the bytes it hashed."""

    part: Path
    problem: str | None = None
    bad: list[tuple[str, str]] = field(default_factory=list)
    checked_bytes: int = 0


def _listed_sizes(out: Any, shards: int) -> dict[str, int]:
    """On object storage, every shard's size from one fresh listing of the shard folder instead of one
    request per shard; {} locally or for a part of one shard."""
    if is_local(out) or shards < 2:
        return {}
    folder = out / SHARD_DIR
    try:
        entries = folder.fs.ls(folder.path, detail=True, refresh=True)
    except FileNotFoundError:
        return {}
    return {
        e["name"].rstrip("/").rsplit("/", 1)[-1]: int(e["size"]) for e in entries if e.get("size") is not None
    }


class _Entries:
    """The feature entries of an opened index part's rows, decoded a row group at a time as a shard's check
    asks for them; the last few row groups are kept (a shard's rows are consecutive, checked in order)."""

    KEEP = 4  # row groups decoded and kept (shards checked in threads on object storage touch a few)

    def __init__(self, file: Any, part: Path):
        meta = file.metadata
        self._file, self._part = file, part
        self._starts = np.cumsum([0] + [meta.row_group(g).num_rows for g in range(meta.num_row_groups)])
        self._groups: OrderedDict[int, Any] = OrderedDict()
        self._lock = threading.Lock()  # shards may be checked in threads

    def _group(self, g: int) -> Any:
        with self._lock:
            column = self._groups.get(g)
            if column is None:
                column = (
                    read_part_groups(self._file, self._part, [g], ["features"]).column(0).combine_chunks()
                )
                self._groups[g] = column
                if len(self._groups) > self.KEEP:
                    self._groups.popitem(last=False)
            else:
                self._groups.move_to_end(g)
            return column

    def rows(self, keep: np.ndarray) -> list:
        """The entries of rows ``keep`` (ascending) as Python objects."""
        out: list = []
        groups = np.searchsorted(self._starts, keep, side="right") - 1
        for g in np.unique(groups).tolist():
            local = keep[groups == g] - self._starts[g]
            out += _rows(self._group(g), local)
        return out


def _rows_by_shard(shards: pa.Array) -> dict[str, range | np.ndarray]:
    """Each shard name -> the positions of its rows, ascending: a ``range`` when consecutive, as every writer
    and compaction leaves them (an array per row held 120 MB more at ten million rows), else an array."""
    import pyarrow as pa

    encoded = shards if pa.types.is_dictionary(shards.type) else shards.dictionary_encode()
    codes = encoded.indices.to_numpy(zero_copy_only=False)
    names = encoded.dictionary.to_pylist()
    if len(codes) == 0:
        return {}
    starts = np.flatnonzero(np.r_[True, codes[1:] != codes[:-1]])  # runs of one code, as first_copies finds
    ends = np.r_[starts[1:], len(codes)]
    run_codes = codes[starts]
    if len(np.unique(run_codes)) == len(run_codes):  # each shard's rows in one run
        return {names[c]: range(s, e) for c, s, e in zip(run_codes.tolist(), starts.tolist(), ends.tolist())}
    order = np.argsort(codes, kind="stable")
    bounds = np.searchsorted(codes[order], np.arange(len(names) + 1))
    return {
        name: order[bounds[k] : bounds[k + 1]] for k, name in enumerate(names) if bounds[k + 1] > bounds[k]
    }


def _rows(column: Any, keep: np.ndarray) -> list:
    if len(keep) == 0:
        return []
    if keep[-1] - keep[0] + 1 == len(keep):
        return column.slice(int(keep[0]), len(keep)).to_pylist()
    return column.take(keep).to_pylist()


def _check_shard(
    check: _Verdict,
    shard: Path,
    ids_of: Callable[[], list[str]],
    rows_of: Callable[[], list],
    shard_bytes: int | None,
    header_hash: str | None,
    data: bool,
    listed_size: int | None = None,
) -> str | None:
    """One shard against what its part recorded: its problem as a whole, if any; damaged tensors go to
    ``check.bad`` (and, in a consolidated part, make the shard bad).

    A header whose bytes match the part's checksum is not compared with the index again (half of a full
    check's time at ten million samples): both are pinned, and were checked against each other when
    written. With ``data``, each tensor's bytes are hashed at the offsets the index gives."""
    if header_hash is None:
        return f"shard {shard}: its index part records no checksum of its header"
    try:
        with open_shard(shard, listed_size) as f:
            size = f.size
            if shard_bytes is not None and size != shard_bytes:
                return f"shard {shard} is {size:,} bytes but was written with {shard_bytes:,}: truncated or replaced"
            _, raw_header, _ = f.header(parse=False)
            if xxh3(raw_header) != header_hash:
                return f"shard {shard} has a damaged header (checksum mismatch)"
            if not data:
                return None
            ids, rows = ids_of(), rows_of()
            if size > 0:
                flat = [(sid, feat) for sid, feats in zip(ids, rows) for feat in feats]
                digests = f.hash_tensors([feat for _, feat in flat])
                bad = [(sid, feat["name"]) for (sid, feat), d in zip(flat, digests) if d != feat["xxh3"]]
                check.checked_bytes += sum(feat["nbytes"] for _, feat in flat)
                check.bad.extend(bad)
                if bad and is_consolidated(check.part):
                    return f"shard {shard}: {len(bad)} tensors fail their checksum: {bad[:5]}"
    except FileNotFoundError:
        return f"shard {shard} is missing"
    except (OSError, ValueError) as e:
        return f"shard {shard} is unreadable: {e}"
    return None


@dataclass
class CheckReport:
    """What ``vlfast out verify OUT`` found. ``ok`` when nothing is damaged."""

    out: str
    parts: int = 0  # index parts (a consolidated one points at many shards)
    shards: int = 0
    samples: int = 0
    bytes_checked: int = 0
    seconds: float = 0.0
    bad_samples: list[dict[str, str]] = field(default_factory=list)  # {"id", "shard", "feature", "reason"}
    bad_parts: list[dict[str, Any]] = field(default_factory=list)  # {"part", "shard", "reason", "samples"}
    damaged_error_lines: int = 0  # error records whose checksum fails (their samples will be redone)
    other_config_parts: list[str] = field(default_factory=list)  # parts made with another configuration
    # what is not where the format puts it (store/layout.py): {"path", "problem", "kind"}
    strays: list[dict[str, Any]] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not (
            self.bad_samples
            or self.bad_parts
            or self.damaged_error_lines
            or self.other_config_parts
            or self.strays
        )

    def to_dict(self) -> dict[str, Any]:
        return {**asdict(self), "ok": self.ok}


@gc_paused()
def check_folder(out: str | os.PathLike, progress: Callable[[int, int], None] | None = None) -> CheckReport:
    """Check everything a reader of ``out`` relies on, reading every byte; report every bad sample by id."""
    out = resolve_out(out)
    started = time.perf_counter()
    report = CheckReport(str(out))
    expected_hash = run_hash(read_run_file(out))
    report.strays = [stray.to_dict() for stray in find_strays(out)]
    record = HashRecord(out, "r00000-verify")
    try:
        parts = committed_parts(out)
        for k, part in enumerate(parts):
            check = check_part(part, data=True)
            # A damaged part loses its record (even with its stamp unchanged: decay), a sound one gains it.
            if check.ok:
                record.hashed(part, check.shards)
            else:
                record.forget(part)
            report.parts += 1
            report.shards += len(check.shards)
            report.samples += len(check.ids)
            report.bytes_checked += check.checked_bytes
            _report_damage(report, check)
            if check.config_hash is not None and check.config_hash != expected_hash:
                report.other_config_parts.append(part.name)
            if progress is not None:
                progress(k + 1, len(parts))
    finally:
        record.save()
    for path in error_files(out):
        try:
            report.damaged_error_lines += read_error_file(path)[1]
        except OSError as e:  # a folder under an errors file's name, say: a stray, reported as such
            report.strays.append(Stray(path, f"unreadable ({e})", "not_a_file").to_dict())
    report.seconds = time.perf_counter() - started
    return report


def _report_damage(report: CheckReport, check: PartCheck) -> None:
    """Add what ``check`` found wrong to ``report``: bad parts and shards with their samples, bad tensors."""
    # shards/NAME: not relative_to, which keeps a URL's scheme on universal_pathlib 0.2
    own = f"{check.shard.parent.name}/{check.shard.name}"
    if check.problem is not None:
        report.bad_parts.append(
            {"part": check.part.name, "shard": own, "reason": check.problem, "samples": len(check.ids)}
        )
        report.bad_samples.extend(
            {"id": sid, "shard": own, "feature": "*", "reason": check.problem} for sid in check.ids
        )
    shard_of = dict(zip(check.ids, check.row_shards)) if check.bad and check.row_shards else {}
    for rel, problem in check.bad_shards.items():
        ids = [sid for sid, s in zip(check.ids, check.row_shards) if s == rel]
        report.bad_parts.append(
            {"part": check.part.name, "shard": rel, "reason": problem, "samples": len(ids)}
        )
        if "fail their checksum" not in problem:
            report.bad_samples.extend(
                {"id": sid, "shard": rel, "feature": "*", "reason": problem} for sid in ids
            )
    for sid, feature in check.bad:
        report.bad_samples.append(
            {
                "id": sid,
                "shard": shard_of.get(sid, own),
                "feature": feature,
                "reason": "bytes do not match their checksum",
            }
        )


# ----------------------------------------------------------------------------------------------------
# the record of full checks


class HashRecord:
    """Which committed parts passed a full check, and whether their shards are untouched since.

    Open it BEFORE hashing: it stamps every shard then, so a shard changed during the hash is hashed again
    next time. Locally a stamp counts only if the shard's ctime is older than a probe file created first,
    even with coarse timestamps; on object storage a store whose listing gives no ETag is never vouched for.
    Bytes that decay leaving the stamp as it was are found by ``--verify`` only. Saving is best effort.
    """

    def __init__(self, out: Any, tag: str):
        self.out = out
        self._local = is_local(out)
        self._probe: Path | None = None
        since: int | None = None
        if self._local:
            probe = out / f".tmp-{tag}-{os.getpid()}-{CHECK_FILE}"  # a temp name the store's cleaning knows
            with contextlib.suppress(OSError):  # read-only: rely on an earlier record, write none
                # O_RDWR, not open(probe, "wb")'s write-only: a stale probe left write-only fails as read-only
                # would, and a FIFO there opens at once instead of waiting for a reader
                fd = os.open(probe, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o666)
                try:
                    since = os.fstat(fd).st_ctime_ns
                finally:
                    os.close(fd)
                self._probe = probe
        self._stamps = _shard_stamps(out, since)
        old = self._read()
        self._entries = {p: st for p, st in old.items() if self._current(p, st)}
        self._changed = len(self._entries) != len(old)
        self._forgotten: set[str] = set()

    def vouches(self, part: Path) -> bool:
        """Whether ``part``'s shard passed a full check and is untouched since (no need to hash it again)."""
        return part.name in self._entries

    def _current(self, part_name: str, stamp: str) -> bool:
        """Whether the recorded ``stamp`` of a part is still its shards' stamp now."""
        if COMPACT_RE.match(part_name):
            names = [x.split("=", 1)[0] for x in stamp.split(";")]
            return stamp == self._stamp_of(names)
        return stamp == self._stamps.get(_shard_name(part_name))

    def _stamp_of(self, shards: list[str]) -> str | None:
        """A consolidated part's stamp: every shard's (names, not paths), or None if one has none."""
        stamps = [(n, self._stamps.get(n)) for n in sorted(shards)]
        return ";".join(f"{n}={st}" for n, st in stamps) if all(st for _, st in stamps) else None

    def hashed(self, part: Path, shards: list[str] | None = None) -> None:
        """``part`` and its shards (relative to OUT; required for a consolidated part) passed a full check."""
        if is_consolidated(part):
            stamp = self._stamp_of([s.rsplit("/", 1)[-1] for s in shards or []]) if shards else None
        else:
            stamp = self._stamps.get(_shard_name(part.name))
        if stamp is not None and self._entries.get(part.name) != stamp:
            self._entries[part.name] = stamp
            self._changed = True

    def forget(self, part: Path) -> None:
        """``part`` failed a full check: no record may vouch for it, whatever its stamp."""
        self._forgotten.add(part.name)
        self._entries.pop(part.name, None)
        self._changed = True

    def save(self) -> None:
        """Write the record, merged with what another process recorded meanwhile (a race can lose entries,
        never add one); best effort."""
        try:
            if self._changed:
                merged = {
                    p: st
                    for p, st in self._read().items()
                    if self._current(p, st) and p not in self._forgotten
                }
                merged.update(self._entries)
                doc = {"format": "vlfast-checked", "parts": dict(sorted(merged.items()))}
                doc["xxh3"] = xxh3(canonical_json(doc).encode())
                data = (json.dumps(doc, indent=0, sort_keys=True) + "\n").encode()
                path = self.out / CHECK_FILE
                if self._local:
                    if self._probe is None:
                        return
                    with open(self._probe, "wb") as f:
                        f.write(data)
                        f.flush()
                        os.fsync(f.fileno())
                    os.replace(self._probe, path)
                    self._probe = None
                else:
                    path.fs.pipe_file(path.path, data)
                    path.fs.invalidate_cache(path.path)
        except (OSError, ValueError):
            pass  # a record that cannot be written costs a rehash next time, nothing else
        finally:
            if self._probe is not None:
                self._probe.unlink(missing_ok=True)
                self._probe = None

    def _read(self) -> dict[str, str]:
        path = self.out / CHECK_FILE
        try:
            if not self._local:
                path.fs.invalidate_cache(path.path)
            doc = json.loads(read_whole(path))
            check = doc.pop("xxh3")
            if check != xxh3(canonical_json(doc).encode()) or doc.get("format") != "vlfast-checked":
                return {}
            return {str(p): str(st) for p, st in doc["parts"].items()}
        except (OSError, ValueError, KeyError, TypeError, AttributeError):
            return {}  # none yet, or damaged: everything is hashed


def _shard_name(part_name: str) -> str | None:
    m = PART_RE.match(part_name)
    return f"shard-r{m.group(1)}-{m.group(2)}.safetensors" if m else None


def _shard_stamps(out: Any, since: int | None) -> dict[str, str]:
    """Shard name -> its stamp, for the shards a record may vouch for (see :class:`HashRecord`)."""
    folder = out / SHARD_DIR
    stamps: dict[str, str] = {}
    if is_local(out):
        if since is None:
            return stamps
        try:
            names = [n for n in os.listdir(folder) if SHARD_RE.match(n)]
        except OSError:
            return stamps
        for name in names:
            try:
                st = os.stat(folder / name)
            except OSError:
                continue
            if st.st_ctime_ns < since:
                stamps[name] = f"{st.st_size}:{st.st_mtime_ns}:{st.st_ctime_ns}:{st.st_ino}"
        return stamps
    fs = folder.fs
    fs.invalidate_cache(folder.path)
    try:
        entries = fs.ls(folder.path, detail=True)
    except (FileNotFoundError, OSError):
        return stamps
    for e in entries:
        name = str(e.get("name", "")).rstrip("/").rsplit("/", 1)[-1]
        etag = e.get("ETag") or e.get("etag")
        if SHARD_RE.match(name) and etag and e.get("size") is not None:
            stamps[name] = f"{e['size']}:{str(etag).strip(chr(34))}"
    return stamps
