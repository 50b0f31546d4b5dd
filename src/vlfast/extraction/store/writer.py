"""FeatureStore: the crash-safe, resumable, rank-sharded writer behind ``vlfast extract``.

What it writes and in which order is specified in docs/format.md ("On-disk layout", "Commits and crash
safety", "OUT on object storage"): a shard, then its index part (the commit marker), each whole or not at
all, so a crash loses at most the buffered samples, and nothing committed is ever rewritten. Where the bytes
go is the backend's (backend.py), chosen once when the store opens.

On resume every committed part is checked before it is relied on (integrity.py): a part of another
configuration is refused; a damaged part or shard is moved to ``OUT/quarantine/`` and its samples redone.
"""

from __future__ import annotations

import contextlib
import datetime
import json
import os
import secrets
import threading
import time
import warnings
from collections.abc import Collection, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from vlfast._files import disk_full, honour_umask
from vlfast.errors import InputRefused
from vlfast.extraction.ids import IdSet
from vlfast.extraction.interrupts import commit_section
from vlfast.extraction.store.backend import backend_for, keep_listings, not_writable, rank_is_held
from vlfast.extraction.store.compact import CLOSE_MIN_PARTS, Compaction, compact_rank
from vlfast.extraction.store.format import (
    CHECK_FILE,
    DTYPES,
    DUPLICATE_KIND,
    ERROR_DIR,
    ERROR_KIND,
    FACTS_FILE,
    FAILURE_KINDS,
    FORMAT_VERSION,
    INDEX_DIR,
    INPUT_KIND,
    META_CONFIG,
    META_CONFIG_HASH,
    META_FORMAT,
    META_OWNED_UNDER,
    META_SHARD_BYTES,
    META_SHARD_HEADER,
    QUARANTINE_DIR,
    RUN_FILE,
    SHARD_DIR,
    SHARD_RE,
    TMP_RE,
    TRANSIENT_KIND,
    TRANSIENT_PREFIX,
    DamagedFile,
    OutputFull,
    canonical_json,
    check_id,
    committed_parts,
    config_hash,
    done_by_error,
    error_key,
    error_line,
    feature_entry,
    gc_paused,
    index_schema,
    is_consolidated,
    is_part_name,
    list_names,
    others_only,
    parquet_bytes,
    parse_retry,
    part_name,
    part_span,
    read_errors,
    read_header,
    read_index_part,
    referenced_shards,
    release_arrow_memory,
    resolve_out,
    split_parts,
    stable_config,
    tensor_xxh3,
    xxh3,
)
from vlfast.extraction.store.inputs import INPUTS_DIR, INPUTS_RE, mark_stale, merge_inputs, write_inputs
from vlfast.extraction.store.integrity import HashRecord, PartCheck, check_part, header_ids
from vlfast.extraction.store.layout import refuse_misplaced
from vlfast.extraction.store.repair import quarantine_consolidated, write_reason
from vlfast.extraction.store.resume import (
    DEFAULT_VOLATILE_KEYS,
    RunConfigMismatch,
    canonical_config,
    check_run_config,
    config_diffs,
    dist_info,
    owner_rank,
    read_state,
)
from vlfast.extraction.store.run_file import library_versions, run_file_bytes

if TYPE_CHECKING:  # pragma: no cover
    from vlfast.extraction.store.facts import ModelFacts

# dist_info, rank_is_held and read_state: tests and tests/_selftest.py import them from here
__all__ = ["FeatureStore", "dist_info", "rank_is_held", "read_state"]


# torch.dtype -> its name: what safetensors can store, checked in ``add`` so a bad tensor fails at the sample.
# float8 is recent: only the dtypes this torch has.
_DTYPES: dict[torch.dtype, str] = {
    getattr(torch, n): n for n in DTYPES if isinstance(getattr(torch, n, None), torch.dtype)
}


def _id_array(ids: Any) -> Any:
    """Ids as an Arrow string array for lookups (None when there are none)."""
    import pyarrow as pa

    ids = list(ids)
    return pa.array(sorted(set(ids)), pa.string()) if ids else None


def _gathered(ids: Any) -> list[str]:
    """The union of every rank's ``ids`` (an Arrow array or None)."""
    mine = [] if ids is None else ids.to_pylist()
    every: list[Any] = [None] * torch.distributed.get_world_size()
    torch.distributed.all_gather_object(every, mine)
    return [sid for got in every for sid in got]


def _grid_of(feats: Mapping[str, torch.Tensor], meta_json: str) -> list[list[int]] | None:
    """The sample's (k, 3) grid for the index: the "grid_thw" feature, else one named "*grid_thw", else
    meta["grid_thw"]."""
    grid = feats.get("grid_thw")
    if grid is None:
        grid = next((t for n, t in feats.items() if n.endswith("grid_thw")), None)
    if grid is not None:
        return grid.reshape(-1, grid.shape[-1]).tolist() if grid.dim() else None
    meta_grid = json.loads(meta_json).get("grid_thw") if "grid_thw" in meta_json else None
    try:
        return [[int(v) for v in row] for row in meta_grid] if meta_grid is not None else None
    except (TypeError, ValueError):
        return None


# ----------------------------------------------------------------------------------------------------
# the writer


class FeatureStore:
    """Buffered writer of per-sample feature tensors into OUT, one per rank.

    ``add`` buffers a sample; the buffer is committed as one shard when it reaches ``shard_max_bytes`` or
    ``shard_max_samples``, or its oldest sample has waited ``commit_every`` seconds. Memory use is bounded by
    one shard's worth of tensors. ``resume_check``: "full" hashes every committed tensor on opening, "quick"
    checks sizes, headers and ids only. An extract run's options come checked
    (:meth:`~vlfast.extraction.config.ExtractConfig.writing`), not checked again here.
    """

    @gc_paused()
    def __init__(
        self,
        out: str | os.PathLike,
        run_config: Mapping[str, Any],
        *,
        rank: int = 0,
        world_size: int = 1,
        shard_max_bytes: int = 256 << 20,
        shard_max_samples: int = 1024,
        commit_every: float | None = 60.0,
        overwrite: bool = False,
        volatile_keys: Collection[str] = DEFAULT_VOLATILE_KEYS,
        resume_check: str = "full",
        retry_errors: str | Collection[str] | None = None,
        compact_min_parts: int | None = CLOSE_MIN_PARTS,
        stale: Collection[str] = (),
    ):
        if not isinstance(run_config, Mapping):
            raise InputRefused(f"run_config must be a dict, got {type(run_config).__name__}")
        if not isinstance(world_size, int) or world_size < 1:
            raise InputRefused(f"world_size must be a positive int, got {world_size!r}")
        if not isinstance(rank, int) or not 0 <= rank < world_size:
            raise InputRefused(f"rank must be in [0, {world_size}), got {rank!r}")
        self.out = resolve_out(out)
        self._retry = parse_retry(retry_errors)  # recorded failures to try again
        self.rank, self.world_size = rank, world_size
        self.shard_max_bytes, self.shard_max_samples = int(shard_max_bytes), int(shard_max_samples)
        self.commit_every = commit_every
        self.compact_min_parts = compact_min_parts  # close() compacts at this many parts (0, None: never)
        self.compaction: Compaction | None = None  # what close() compacted
        self.volatile_keys = frozenset(volatile_keys)
        self.run_config = canonical_config(dict(run_config))
        self._stable = stable_config(self.run_config, self.volatile_keys)
        self.config_hash = config_hash(self._stable)
        self._tag = f"r{rank:05d}"
        self._session = time.strftime("%Y%m%dT%H%M%S", time.gmtime()) + secrets.token_hex(4)
        self._backend = backend_for(self.out, self._session)
        self._backend.check_folder()
        self.quarantined: list[dict[str, Any]] = []  # what this store moved aside, with why
        # A file where a folder belongs (locks/ included, so before the lock): refused.
        refuse_misplaced(self.out, overwrite=overwrite)
        self._backend.lock(rank)
        try:
            if overwrite:
                self._overwrite()
            self._backend.make_folders()
            try:
                self._write_or_check_run_file()
            except PermissionError as e:
                raise not_writable(self.out, e) from None
            self._read_out(resume_check, stale)
        except BaseException:
            self._release()
            raise

    def _read_out(self, resume_check: str, stale: Collection[str]) -> None:
        """With the rank locked: clean garbage, check what is committed, read the errors, start a buffer."""
        # Rank r's garbage is cleaned by rank r % world_size, so a resume with fewer ranks still cleans it.
        self._backend.clean_garbage(lambda r: r % self.world_size == self.rank, self._set_aside)
        self._bad_parts: set[str] = set()
        self._parts_read: set[str] = set()  # index parts already in _committed
        # Other ranks' parts holding only ids they own under this world size: unread while this store adds
        # only its own ids (see _widen); None once it has read everything.
        self._parts_skipped: set[str] | None = set() if self.world_size > 1 else None
        self._committed = IdSet()
        # Ids whose inputs changed since they were extracted: their shards are moved aside when checked.
        self._stale = _id_array(stale)
        self.superseded: list[dict[str, Any]] = []
        self._check_committed(resume_check)  # takes in the ids of the parts it found sound
        self._refresh_committed()
        errors = read_errors(self.out)
        self._errored: set[str] = {r["id"] for r in errors if done_by_error(r, self._retry)}
        self._error_keys: set[tuple] = {error_key(r) for r in errors}
        self._session_failures: set[tuple] = set()  # failure records this session wrote
        self._seq = self._next_seq()
        self._versions = library_versions()
        self._empty_buffer()
        self._num_errors = 0
        self._closed = False
        self._full = False  # a commit found the disk full: nothing more is written
        self._errors = self._backend.error_log(self._tag, self._session)  # this rank's error records

    def _empty_buffer(self) -> None:
        self._buffer: list[tuple[str, dict[str, torch.Tensor], str]] = []
        self._buffer_inputs: list[dict[str, Any] | None] = []  # each buffered sample's input record
        self._buffer_ids: set[str] = set()
        self._buffer_bytes = 0
        self._buffer_since: float | None = None  # when the oldest buffered sample was added

    # -- setup ---------------------------------------------------------------------------------------

    def _overwrite(self) -> None:
        # Only rank 0 deletes, and only what this format owns, so a mistyped OUT never loses unrelated files.
        if self.rank == 0:
            # Commit markers first, run.json last: a kill mid-way leaves orphan shards under the old config,
            # never parts pointing at deleted shards, nor old data a run of the new config takes for its own.
            owned = {
                INDEX_DIR: lambda n: bool(is_part_name(n) or TMP_RE.match(n)),
                SHARD_DIR: lambda n: bool(SHARD_RE.match(n) or TMP_RE.match(n)),
                ERROR_DIR: lambda n: n.startswith("errors-r") and n.endswith(".jsonl"),
                INPUTS_DIR: lambda n: bool(INPUTS_RE.match(n) or TMP_RE.match(n)),
                QUARANTINE_DIR: lambda n: True,
            }
            self._backend.clear(owned, (CHECK_FILE, FACTS_FILE, RUN_FILE))  # run.json last (see above)
        dist = torch.distributed
        if self.world_size > 1:
            if not (dist.is_available() and dist.is_initialized()):
                raise InputRefused(
                    f"overwrite with {self.world_size} ranks needs torch.distributed initialised (torchrun) so "
                    f"rank 0 can clear {self.out} before the others write; or delete {self.out} before launching"
                )
            dist.barrier()  # other ranks must not write before rank 0 has cleared the folder

    def _write_or_check_run_file(self) -> None:
        path = self.out / RUN_FILE
        if check_run_config(self.out, self.run_config, self.volatile_keys, held_rank=self.rank):
            return
        # Ranks may race here; each writes the same bytes through its own temp file.
        data = run_file_bytes(self.run_config, self.volatile_keys, library_versions())
        try:
            self._backend.write(path, data, f"r{self.rank:05d}-{os.getpid()}")
        except OSError as e:
            if disk_full(e):
                raise self._backend.full_error(e, f"writing {RUN_FILE}") from None
            raise

    def _check_committed(self, mode: str) -> None:
        """Check what a resume will rely on; refuse parts of another configuration, move damaged ones aside.

        A rank checks its own parts marked ``META_OWNED_UNDER`` this world size and the parts every rank
        reads (any not so marked); other ranks' marked parts are theirs to check. With torch.distributed
        initialised the ranks split the common parts and agree on the verdicts (one all_reduce), so each shard
        is read once; otherwise each rank checks them all, the same view without coordination.
        """
        every = committed_parts(self.out)
        own, parts = [], every
        if self._parts_skipped is not None:
            own, parts, others = split_parts(self.out, every, self.rank, self.world_size)
            self._parts_skipped = {p.name for p in others}
        dist = torch.distributed
        group = dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1
        split = group > 1 and group == self.world_size
        if split:  # ranks that see different folders (should not happen) each check everything
            t = torch.tensor([len(parts), -len(parts)], dtype=torch.int64)
            dist.all_reduce(t, op=dist.ReduceOp.MAX)
            split = int(t[0]) == -int(t[1])
        if split:  # a rank checks parts that may hold other ranks' ids whose inputs changed
            self._stale = _id_array(_gathered(self._stale))
        bad = [False] * len(parts)
        # "full" hashes every shard but those HashRecord vouches for (OUT/checked.json).
        record = HashRecord(self.out, self._tag) if mode == "full" else None
        try:
            for part in own:
                if not self._check_one(part, record):
                    self._bad_parts.add(part.name)
            for k, part in enumerate(parts):
                if split and k % self.world_size != self.rank:
                    continue
                bad[k] = not self._check_one(part, record)
            # Parts that appeared meanwhile (those a damaged consolidated part hid, or another rank's
            # commit): every rank checks them.
            seen = {p.name for p in every}
            for part in committed_parts(self.out):
                fresh = part.name not in seen and part.name not in self._parts_read
                if fresh and not self._skips(part) and not self._check_one(part, record):
                    self._bad_parts.add(part.name)
        finally:
            if record is not None:
                record.save()
        if split:
            flags = torch.tensor(bad, dtype=torch.uint8)
            torch.distributed.all_reduce(flags, op=torch.distributed.ReduceOp.MAX)
            bad = [bool(v) for v in flags.tolist()]
        self._bad_parts |= {p.name for p, b in zip(parts, bad) if b}

    def _skips(self, part: Path) -> bool:
        """Whether this store leaves ``part`` unread: another rank's, holding only ids that rank owns."""
        if self._parts_skipped is None:
            return False
        if part.name in self._parts_skipped:
            return True
        if others_only(part, self.rank, self.world_size):
            self._parts_skipped.add(part.name)
            return True
        return False

    def _widen(self) -> None:
        """From now on read every part: this store is asked about ids other ranks own (``done_ids()``, or
        ``add`` of an id another rank owns, which must be recorded as a duplicate if that rank has it)."""
        if self._parts_skipped is not None:
            self._parts_skipped = None
            self._refresh_committed()

    def _check_one(self, part: Path, record: HashRecord | None) -> bool:
        """Check one part (refusing another configuration's); take in its ids if sound, else move the damage
        aside (and take in the ids that stay committed). Returns whether it was sound."""
        data = record is not None and not record.vouches(part)
        check = check_part(part, data=data)
        if check.problem is None and check.config is not None and check.config_hash != self.config_hash:
            diffs = config_diffs(self.run_config, check.config, self.volatile_keys)
            raise RunConfigMismatch(self.out, diffs, where=str(part), foreign=part)
        if check.ok and self._stale is not None and mark_stale(check, self._stale):
            before = len(self.quarantined)
            self._quarantine(check)
            self.superseded += self.quarantined[before:]
            del self.quarantined[before:]
            return False
        if check.ok:  # its ids are read: no need to read the part again in _refresh_committed
            if data:
                record.hashed(part, check.shards)
            self._committed.update(check.ids)
            self._parts_read.add(part.name)
            return True
        if not part.exists():
            return True  # replaced meanwhile by another rank's compaction: its successor is read instead
        self._quarantine(check)
        return False

    def _quarantine(self, check: PartCheck) -> None:
        """Move a damaged part and its shard to OUT/quarantine/<part>/ (a consolidated part: repair.py); the
        shard first, so a kill in between leaves a part without its shard (moved aside next start), never an
        orphan shard that garbage cleaning would delete."""
        stamp = f"{time.strftime('%Y%m%dT%H%M%S')}-{self._backend.instance}"
        dest = self.out / QUARANTINE_DIR / f"{check.part.stem}-{stamp}"
        if is_consolidated(check.part):
            record, kept, new = quarantine_consolidated(self.out, self._backend, check, dest, self._tag)
            self._committed.update(kept)
            if new is not None:
                self._parts_read.add(new)
            reason = record["reason"]
        else:
            reason = check.problem or f"{len(check.bad)} tensors fail their checksum: {check.bad[:5]}"
            # A foreign file under a part's name may name a shard another part covers: that shard stays.
            own = not referenced_shards(self.out, exclude=check.part.name)(check.shard.name)
            record = {
                "part": check.part.name,
                "shard": check.shard.name if own else None,
                "reason": reason,
                "ids": list(check.ids) if own else [],
            }
            write_reason(self._backend, dest, record, self._tag)
            self._backend.quarantine(dest, (check.shard, check.part) if own else (check.part,))
        self.quarantined.append({**record, "moved_to": str(dest)})
        warnings.warn(
            f"{check.part.name}: {reason}; moved to {dest}, its {len(record['ids'])} samples will be extracted "
            "again",
            stacklevel=3,
        )

    def _set_aside(self, shards: list[Path]) -> None:
        """Move each shard no index part covers and no kill explains (see store/layout.py) to
        OUT/quarantine/<name>-<stamp>/, never deleting it, its samples named from its header."""
        reason = "no index part covers it: its index part was deleted or lost"
        stamp = f"{time.strftime('%Y%m%dT%H%M%S')}-{self._backend.instance}"
        for path in shards:
            rel = f"{path.parent.name}/{path.name}"
            dest = self.out / QUARANTINE_DIR / f"{path.name}-{stamp}"
            record = {"part": rel, "reason": reason, "ids": header_ids(path)}
            write_reason(self._backend, dest, record, self._tag)
            self._backend.quarantine(dest, (path,))
            self.quarantined.append({**record, "moved_to": str(dest)})
            warnings.warn(f"{rel}: {reason}; moved to {dest}", stacklevel=3)  # at _read_out

    def _release(self) -> None:
        backend = getattr(self, "_backend", None)
        if backend is not None:
            backend.release()

    def __del__(self) -> None:
        # An abandoned store must not keep its rank locked; its buffered samples are redone on resume.
        with contextlib.suppress(Exception):  # at interpreter shutdown os may be torn down already
            self._release()

    def _next_seq(self) -> int:
        # A quarantined shard's number is never reused either, so its name stays unique.
        shards = (*list_names(self.out / SHARD_DIR), *self._backend.quarantined_shards())
        spans = [(int(m.group(1)), int(m.group(2))) for n in shards if (m := SHARD_RE.match(n))]
        spans += [(s[0], s[2]) for n in list_names(self.out / INDEX_DIR) if (s := part_span(n)) is not None]
        return max((seq for rank, seq in spans if rank == self.rank), default=-1) + 1

    def _refresh_committed(self) -> None:
        for part in committed_parts(self.out):
            if part.name in self._parts_read or part.name in self._bad_parts or self._skips(part):
                continue
            try:
                self._committed.update(read_index_part(part, ["id"]).column("id"))
            except DamagedFile:
                continue  # committed by another rank after our check and already damaged: next resume's
            self._parts_read.add(part.name)

    # -- public API ----------------------------------------------------------------------------------

    def done_ids(self, *, mine: bool = False) -> IdSet:
        """Ids committed by any rank plus ids recorded as failed (not "duplicate id", "input" or "transient"
        records, nor failures ``retry_errors`` selects): skip these on resume. An
        :class:`~vlfast.extraction.ids.IdSet` sharing the store's arrays: no copy of millions of ids.

        ``mine=True``: complete only for the ids this rank owns among ``world_size`` ranks
        (:func:`~vlfast.extraction.ids.owner_rank`): other ranks' own parts are not read. It may hold other
        ids too.
        """
        if not mine:
            self._widen()
        self._refresh_committed()
        errored = {r["id"] for r in read_errors(self.out) if done_by_error(r, self._retry)}
        return self._committed.union(errored, self._errored, self._buffer_ids)

    def is_recorded(self, key: tuple) -> bool:
        """Whether the error record (id, source, reason, kind) is already in the errors files."""
        return key in self._error_keys

    @property
    def num_errors(self) -> int:
        """Errors recorded by this store (this rank, this session), duplicates included: for --max-errors."""
        return self._num_errors

    def add(
        self,
        sample_id: str,
        features: Mapping[str, torch.Tensor],
        meta: Mapping | None = None,
        *,
        input: Mapping[str, Any] | None = None,
    ) -> None:
        """Buffer one sample. A repeated id is recorded as a "duplicate id" error instead of overwriting.
        ``input``: what its input was when read (a row of ``OUT/inputs/``: ``inputs.inputs_schema``)."""
        self._check_open()
        check_id(sample_id)
        if not isinstance(features, Mapping) or not features:
            raise InputRefused(f"features for {sample_id!r} must be a non-empty dict of name -> tensor")
        source = str(meta.get("path", meta.get("source", ""))) if isinstance(meta, Mapping) else ""
        if self._parts_skipped is not None and owner_rank(sample_id, self.world_size) != self.rank:
            self._widen()  # another rank's id: it may have committed it, in a part not read so far
        done = sample_id in self._buffer_ids or sample_id in self._committed
        if done or sample_id in self._errored:
            why = "already extracted" if done else "already recorded as an error"
            self.add_error(sample_id, source, f"duplicate id: {why}", kind=DUPLICATE_KIND)
            return
        tensors: dict[str, torch.Tensor] = {}
        nbytes = 0
        for name, t in features.items():
            if not isinstance(name, str) or not name or "/" in name:
                raise InputRefused(
                    f"feature names must be non-empty str without '/', got {name!r} for {sample_id!r}"
                )
            if not isinstance(t, torch.Tensor):
                raise InputRefused(
                    f"feature {name!r} of {sample_id!r} is a {type(t).__name__}, not a torch.Tensor"
                )
            if t.dtype not in _DTYPES:
                raise InputRefused(
                    f"feature {name!r} of {sample_id!r} has dtype {t.dtype}, which safetensors cannot store; "
                    f"convert it to one of {sorted(_DTYPES.values())}"
                )
            if t.is_sparse or t.layout != torch.strided:
                raise InputRefused(f"feature {name!r} of {sample_id!r} must be a dense tensor")
            src = t.detach()
            if src.device.type != "cpu":
                t = src.to("cpu").contiguous()  # a fresh copy that nobody else holds
            else:
                # Snapshot: the caller may reuse its tensor, pass one twice (safetensors refuses shared
                # memory), or pass a view that would keep a whole batch alive.
                t = src.clone(memory_format=torch.contiguous_format)
            tensors[name] = t
            nbytes += t.nbytes
        try:
            meta_json = json.dumps(dict(meta) if meta is not None else {}, sort_keys=True, ensure_ascii=False)
            meta_json.encode("utf-8")
        except (TypeError, ValueError) as e:
            raise InputRefused(f"meta of {sample_id!r} must be JSON-serialisable text: {e}") from None

        if self._buffer and self._buffer_bytes + nbytes > self.shard_max_bytes:
            self.flush()
        self._buffer.append((sample_id, tensors, meta_json))
        self._buffer_inputs.append(None if input is None else dict(input))
        self._buffer_ids.add(sample_id)
        self._buffer_bytes += nbytes
        if self._buffer_since is None:
            self._buffer_since = time.monotonic()
        if len(self._buffer) >= self.shard_max_samples or self._buffer_bytes >= self.shard_max_bytes:
            self.flush()
        else:
            self.tick()

    def keep_listings(self, listings: Mapping[str, bytes]) -> int:
        """Write the input's shard listings into ``OUT/listings`` (see ``backend.keep_listings``)."""
        return keep_listings(self.out, listings, f"{self._tag}-{os.getpid()}")

    def keep_facts(self, facts: ModelFacts) -> bool:
        """Record what transformers answered about the model in ``OUT/facts.json``; best effort."""
        return facts.save(self.out, f"{self._tag}-{os.getpid()}")

    def tick(self) -> None:
        """Commit the buffer if its oldest sample has waited ``commit_every`` seconds. ``add`` and
        ``add_error`` call it; a caller that may wait long between them (a slow decode) can call it too."""
        if self.commit_every is None:
            return
        oldest = min(
            (t for t in (self._buffer_since, self._errors.pending_since) if t is not None), default=None
        )
        if oldest is not None and time.monotonic() - oldest >= self.commit_every:
            self.flush()

    def add_error(self, sample_id: str, source: str, reason: str, *, kind: str | None = None) -> None:
        """Record a failed sample durably (one fsync'd JSON line; on object storage with the next commit).

        ``kind``: "error" (the id then counts as done), "transient" (reading it from storage failed: the next
        run tries again), "duplicate" or "input" (an input row that is not a sample; ``sample_id`` names the
        row). By default a reason starting with "duplicate" means "duplicate", one starting with
        :data:`TRANSIENT_PREFIX` "transient". Recording a duplicate or input record again writes nothing; a
        failure is an attempt, which a later run's record of the same id supersedes (see ``read_errors``).
        """
        self._check_open()
        if kind is None and str(reason).lower().startswith("duplicate"):
            kind = DUPLICATE_KIND
        elif kind is None:
            kind = TRANSIENT_KIND if str(reason).startswith(TRANSIENT_PREFIX) else ERROR_KIND
        kinds = (*FAILURE_KINDS, DUPLICATE_KIND, INPUT_KIND)
        if kind not in kinds:
            raise InputRefused(f"kind must be one of {kinds}, got {kind!r}")
        key = (str(sample_id), str(source), str(reason), kind)
        if key in (self._session_failures if kind in FAILURE_KINDS else self._error_keys):
            return
        rec = {
            "id": str(sample_id),
            "source": str(source),
            "reason": str(reason),
            "kind": kind,
            "rank": self.rank,
            # microseconds: which of an id's attempts is the latest is read from this
            "time": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%S.%fZ"),
        }
        try:
            self._errors.append(error_line(rec))
        except OSError as e:
            if disk_full(e):
                self._full = True  # nothing more is written: close() must not try the shard too
                raise self._backend.full_error(e, f"recording an error in {self._errors.path}") from None
            raise
        self._error_keys.add(key)
        if kind in FAILURE_KINDS:
            self._session_failures.add(key)
        self._num_errors += 1
        if done_by_error(rec):
            self._errored.add(str(sample_id))
        self.tick()

    def flush(self) -> None:
        """Commit the buffered samples as one shard now (no-op when the buffer is empty), and on object
        storage the session's error records. SIGTERM and Ctrl-C wait until it is done. A full disk raises
        OutputFull; the store then commits nothing more (``close`` only releases the lock) and the buffered
        samples are redone by the next run."""
        if self._full:
            raise RuntimeError(f"FeatureStore for {self.out} stopped: its disk was full")
        with commit_section():
            try:
                self._flush()
            except Exception as e:
                if not disk_full(e):
                    raise
                self._full = True
                raise self._backend.full_error(e, "committing a shard") from None

    def _flush(self) -> None:
        self._errors.commit()  # on object storage the session's error records are one object, put anew
        if not self._buffer:
            return
        # Hashed on another thread while safetensors writes the same tensors: xxhash releases the GIL.
        checksums: list[dict[str, str]] = []
        hasher = threading.Thread(
            target=lambda: checksums.extend(
                {name: tensor_xxh3(t) for name, t in feats.items()} for _, feats, _ in self._buffer
            ),
            name="vlfast-checksums",
        )
        hasher.start()
        try:
            shard, written = self._write_shard()
        finally:
            hasher.join()
        if len(checksums) != len(self._buffer):
            raise RuntimeError(f"computing the checksums of {shard.name} failed; nothing was committed")
        self._write_index_part(shard, written, checksums)
        self._committed.update(sid for sid, _, _ in self._buffer)
        self._empty_buffer()
        self._seq += 1

    def close(self) -> None:
        """Commit what is buffered. Safe to call twice."""
        if self._closed:
            return
        try:
            if not self._full:
                self.flush()
                self._forget_committed()  # nothing more is added: compaction runs without the ids held
                if self.compact_min_parts:
                    self.compact(self.compact_min_parts)
                merge_inputs(self.out, self._backend, self.rank, f"{self._tag}-{os.getpid()}")
                release_arrow_memory()
        finally:
            self._closed = True
            self._forget_committed()
            self._release()

    def _forget_committed(self) -> None:
        """Drop the committed ids (10M ids: 323 MB). ``done_ids`` after ``close`` reads every part again."""
        self._committed, self._parts_read = IdSet(), set()
        if self._parts_skipped is not None:
            self._parts_skipped = set()

    def compact(self, min_parts: int = 2) -> Compaction:
        """Commit what is buffered, then replace this rank's live index parts by one consolidated part if
        there are at least ``min_parts`` (compact.py). A full disk raises OutputFull, the parts unchanged."""
        self.flush()
        with commit_section():
            try:
                self.compaction = compact_rank(
                    self.out,
                    self.rank,
                    self._backend,
                    min_parts=min_parts,
                    tag=f"{self._tag}-{os.getpid()}",
                    expected=self.config_hash,
                )
            except OutputFull:
                self._full = True
                raise
        # what it replaced is read: the consolidated part needs no reading by _refresh_committed
        if self.compaction.part is not None:
            self._parts_read.add(self.compaction.part)
        return self.compaction

    def __enter__(self) -> FeatureStore:
        return self

    def __exit__(self, *exc: object) -> None:
        # Flush even on an exception (--max-errors, Ctrl-C): buffered samples are complete and correct.
        self.close()

    # -- internals -----------------------------------------------------------------------------------

    def _check_open(self) -> None:
        if self._closed:
            raise RuntimeError(f"FeatureStore for {self.out} is closed")

    def _shard_path(self) -> Path:
        return self.out / SHARD_DIR / f"shard-{self._tag}-{self._seq:06d}.safetensors"

    def _write_shard(self) -> tuple[Path, tuple[int, str, int, dict]]:
        """Write the shard under its final name, staged and published by the backend: (its path, (size, xxh3
        of its header, data start, parsed header))."""
        from safetensors.torch import save_file

        tensors = {
            f"{row}/{name}": t for row, (_, feats, _) in enumerate(self._buffer) for name, t in feats.items()
        }
        # The ids in the header make a shard self-describing (an index could be rebuilt from shards).
        metadata = {
            "format": "pt",
            "vlfast_format": str(FORMAT_VERSION),
            "rank": str(self.rank),
            "ids": json.dumps([sid for sid, _, _ in self._buffer], ensure_ascii=False),
            "config_hash": self.config_hash,
            "versions": json.dumps(self._versions, sort_keys=True),  # provenance per shard, across resumes
        }
        tmp = self._backend.stage(self._shard_path(), self._tag)
        try:
            save_file(tensors, tmp, metadata=metadata)
            # safetensors creates its files 0600: teammates on shared storage could not read them
            honour_umask(tmp)
            with open(tmp, "rb+") as f:
                size = os.fstat(f.fileno()).st_size
                data_start, raw_header, header = read_header(f, size)
                self._backend.sync(f)
            written = (size, xxh3(raw_header), data_start, header)
            return self._backend.publish(tmp, self._shard_path(), self._next_shard_path), written
        finally:
            # After a failure never renamed (on a full disk, space to give back now), or object storage's copy.
            self._backend.unstage(tmp)

    def _next_shard_path(self) -> Path:
        """The name after a taken one (object storage: another writer of this rank, or an orphan)."""
        self._seq += 1
        return self._shard_path()

    def _write_index_part(
        self, shard: Path, written: tuple[int, str, int, dict], checksums: list[dict[str, str]]
    ) -> None:
        size, header_hash, data_start, header = written
        rows: dict[str, list] = {k: [] for k in index_schema().names}
        rel = f"{SHARD_DIR}/{shard.name}"
        for row, (sid, feats, meta_json) in enumerate(self._buffer):
            entries = [
                feature_entry(fname, header[f"{row}/{fname}"], data_start, checksums[row][fname])
                for fname in feats
            ]
            rows["id"].append(sid)
            rows["shard"].append(rel)
            rows["row"].append(row)
            rows["rank"].append(self.rank)
            rows["features"].append(entries)
            rows["grid_thw"].append(_grid_of(feats, meta_json))
            rows["meta"].append(meta_json)
        metadata = {
            META_FORMAT: str(FORMAT_VERSION).encode(),
            META_CONFIG: canonical_json(self._stable).encode("utf-8"),
            META_CONFIG_HASH: self.config_hash.encode(),
            META_SHARD_BYTES: str(size).encode(),
            META_SHARD_HEADER: header_hash.encode(),
        }
        n = self.world_size
        if n > 1 and all(owner_rank(sid, n) == self.rank for sid in rows["id"]):
            metadata[META_OWNED_UNDER] = str(n).encode()  # other ranks of a job this size need not read it
        data = parquet_bytes(rows, index_schema().with_metadata(metadata))
        part = self.out / INDEX_DIR / part_name(self.rank, self._seq, xxh3(data))
        # Each sample's input record (store/inputs.py), before the commit, so a committed part's samples
        # have theirs (a kill in between leaves rows no part points at)
        tag = f"{self._tag}-{os.getpid()}"
        records = self._buffer_inputs
        write_inputs(
            self.out, self._backend, self.rank, self._seq, rows["id"], rel, header_hash, records, tag
        )
        with contextlib.suppress(FileExistsError):  # named by its own hash: an existing one has these bytes
            self._backend.write(part, data, f"{self._tag}-{os.getpid()}", exclusive=True)  # <- the commit
        self._parts_read.add(part.name)
