"""FeatureStore: the crash-safe, resumable, rank-sharded writer behind ``vlfast extract``.

On-disk layout of an output folder OUT (format version 1)::

    OUT/run.json                                    run configuration (model, dtype, processor, versions...)
    OUT/shards/shard-r{rank:05d}-{seq:06d}.safetensors   per-sample tensors, keys "{row}/{feature}"
    OUT/index/part-r{rank:05d}-{seq:06d}.parquet         one index part per shard: THE COMMIT MARKER
    OUT/errors/errors-r{rank:05d}.jsonl             one JSON line per failed or duplicate sample
    OUT/locks/rank-{rank:05d}.lock                  flock of the one process writing that rank

A shard is committed in this order: write ``shards/.tmp-...`` -> fsync -> ``os.replace`` to its final name ->
fsync the folder -> write its index part the same way. A shard without an index part (a crash between the
two renames) and any ``.tmp-*`` file are garbage: readers never look at them and the next FeatureStore on
that folder deletes them. So a crash at any instant loses at most the samples still buffered in memory,
and those are re-extracted on resume. Nothing committed is ever rewritten.

Index part schema (all parts share it; ``pyarrow.dataset.dataset(OUT / "index")`` reads them as one table;
temp files start with "." and are skipped by pyarrow's default ``ignore_prefixes``)::

    id        string        sample id (unique across the whole folder)
    shard     string        shard path relative to OUT, e.g. "shards/shard-r00001-000042.safetensors"
    row       int32         the sample's row in the shard; its tensors are the entries "{row}/{name}"
    rank      int32         rank that wrote it
    features  list<struct<name: string, dtype: string, shape: list<int64>, offset: int64, nbytes: int64>>
              one entry per tensor; offset = absolute byte offset of the tensor data in the shard file
              (so non-Python readers can seek straight to it), dtype = torch name ("bfloat16", ...)
    grid_thw  list<list<int64>>  the (k, 3) grid: feature "grid_thw", else "*grid_thw", else meta; or null
    meta      string        JSON of the per-sample metadata given to ``add`` (path, prompt, n_tokens, ...)

Equality after a resume is per sample: shard boundaries and row numbers may differ from an uninterrupted
run, but every id's tensors (bytes, dtype, shape) and meta are identical.
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import json
import os
import re
import shutil
import struct
import time
import warnings
from collections.abc import Collection, Mapping, Sequence
from pathlib import Path
from typing import Any

import torch

FORMAT_VERSION = 1
RUN_FILE = "run.json"
SHARD_DIR = "shards"
INDEX_DIR = "index"
ERROR_DIR = "errors"
LOCK_DIR = "locks"
# Top-level run-config keys allowed to differ on resume: library versions change when a user upgrades
# mid-job, which does not change what the extraction means. Callers can pass their own set.
DEFAULT_VOLATILE_KEYS: tuple[str, ...] = ("versions", "library_versions", "created", "host")

_SHARD_RE = re.compile(r"^shard-r(\d{5})-(\d{6})\.safetensors$")
_PART_RE = re.compile(r"^part-r(\d{5})-(\d{6})\.parquet$")
_TMP_RE = re.compile(r"^\.tmp-r(\d{5})-")

# Dtypes safetensors can store; checked in ``add`` so a bad tensor fails at the sample, not at flush.
_DTYPES: dict[torch.dtype, str] = {
    torch.float64: "float64",
    torch.float32: "float32",
    torch.float16: "float16",
    torch.bfloat16: "bfloat16",
    torch.int64: "int64",
    torch.int32: "int32",
    torch.int16: "int16",
    torch.int8: "int8",
    torch.uint8: "uint8",
    torch.bool: "bool",
}
for _name in ("float8_e4m3fn", "float8_e5m2"):
    if hasattr(torch, _name):
        _DTYPES[getattr(torch, _name)] = _name
DTYPE_BY_NAME: dict[str, torch.dtype] = {v: k for k, v in _DTYPES.items()}

DUPLICATE_KIND = "duplicate"


class RunConfigMismatch(ValueError):
    """OUT already holds a run whose configuration differs from the one requested."""

    def __init__(self, out: Path, diffs: list[tuple[str, Any, Any]]):
        self.out = out
        self.diffs = diffs
        lines = [f"  {key}: {old!r} in {out / RUN_FILE} vs {new!r} now" for key, old, new in diffs]
        super().__init__(
            f"{out} already holds an extraction with a different configuration:\n"
            + "\n".join(lines)
            + "\nResuming would mix incompatible features. Use a new OUT, or pass --overwrite "
            "(FeatureStore(..., overwrite=True)) to delete the existing shards and start again."
        )


# ----------------------------------------------------------------------------------------------------
# scale-out helpers


def partition(ids: Sequence[str], rank: int, world_size: int) -> list[str]:
    """The ids rank ``rank`` of ``world_size`` owns, in input order.

    An id's owner is a hash of the id alone (blake2b, not Python's salted ``hash``), so the split does not
    depend on list order or on what other ranks see: ranks that list files in different orders still
    divide the work with no gaps or duplicates, and a repeated id always lands on the same rank, where
    FeatureStore records the repeat as a "duplicate id" error. Partition the FULL id list and then drop
    ``done_ids()``; partitioning only the remaining ids would depend on when each rank looked.
    """
    if not isinstance(world_size, int) or world_size < 1:
        raise ValueError(f"world_size must be a positive int, got {world_size!r}")
    if not isinstance(rank, int) or not 0 <= rank < world_size:
        raise ValueError(f"rank must be in [0, {world_size}), got {rank!r}")
    if world_size == 1:
        return list(ids)
    return [i for i in ids if owner_rank(i, world_size) == rank]


def owner_rank(sample_id: str, world_size: int) -> int:
    digest = hashlib.blake2b(sample_id.encode("utf-8"), digest_size=8).digest()
    return int.from_bytes(digest, "big") % world_size


def dist_info() -> tuple[int, int]:
    """(rank, world_size): torch.distributed if initialised, else env RANK/WORLD_SIZE (torchrun), else (0, 1)."""
    dist = torch.distributed
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    try:
        rank, world = int(os.environ.get("RANK", "0")), int(os.environ.get("WORLD_SIZE", "1"))
    except ValueError as e:
        raise ValueError(f"RANK/WORLD_SIZE must be integers: {e}") from None
    if world < 1 or not 0 <= rank < world:
        raise ValueError(f"inconsistent RANK={rank} WORLD_SIZE={world} in the environment")
    return rank, world


# ----------------------------------------------------------------------------------------------------
# file helpers


def _fsync_dir(path: Path) -> None:
    # The rename is only durable once the folder entry is; without this a power loss can undo it.
    if os.name == "nt":  # Windows cannot open a folder as a file; NTFS journals the rename itself
        return
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _fsync_file(path: Path) -> None:
    with open(path, "rb+") as f:
        os.fsync(f.fileno())


def _atomic_write_bytes(path: Path, data: bytes, tmp_tag: str) -> None:
    tmp = path.parent / f".tmp-{tmp_tag}-{path.name}"
    with open(tmp, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    _fsync_dir(path.parent)


def _try_lock(path: Path) -> int | None:
    """Exclusive, non-blocking advisory lock on ``path``: the open fd, or None if another process holds it.

    flock locks die with their process, so a SIGKILLed run never leaves a stale lock behind.
    """
    try:
        import fcntl
    except ImportError:  # pragma: no cover - no flock on Windows: run unguarded
        return -1
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError as e:
        os.close(fd)
        if e.errno in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES):
            return None
        # Some network filesystems (Lustre without -o flock, old NFS) do not do locks at all: run
        # unguarded rather than refuse to run.
        warnings.warn(
            f"cannot lock {path} ({e}); running without the one-writer-per-rank guard", stacklevel=3
        )
        return -1
    return fd


def _unlock(fd: int | None) -> None:
    if fd is not None and fd >= 0:
        os.close(fd)  # closing the descriptor releases the flock


def library_versions() -> dict[str, str | None]:
    """Versions of what shapes the bytes on disk; read from package metadata, so nothing heavy is imported."""
    import platform
    from importlib import metadata

    out: dict[str, str | None] = {"python": platform.python_version()}
    for dist in ("vlfast", "torch", "transformers", "safetensors", "pyarrow", "numpy"):
        try:
            out[dist] = metadata.version(dist)
        except metadata.PackageNotFoundError:
            out[dist] = None
    return out


def _grid_of(feats: Mapping[str, torch.Tensor], meta_json: str) -> list[list[int]] | None:
    """The sample's (k, 3) grid for the index: the "grid_thw" feature, else one named "*grid_thw"
    (image_grid_thw, video_grid_thw), else meta["grid_thw"]."""
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


def _canonical(obj: Any) -> Any:
    """JSON round trip: tuples become lists, keys become strings, so stored and new configs compare equal."""
    try:
        return json.loads(json.dumps(obj, sort_keys=True))
    except (TypeError, ValueError) as e:
        raise TypeError(f"run_config must be JSON-serialisable: {e}") from None


def _flat_diff(old: Any, new: Any, prefix: str = "") -> list[tuple[str, Any, Any]]:
    if isinstance(old, dict) and isinstance(new, dict):
        out: list[tuple[str, Any, Any]] = []
        for key in sorted(set(old) | set(new)):
            sub = f"{prefix}.{key}" if prefix else key
            if key not in old:
                out.append((sub, "<missing>", new[key]))
            elif key not in new:
                out.append((sub, old[key], "<missing>"))
            else:
                out.extend(_flat_diff(old[key], new[key], sub))
        return out
    return [] if old == new else [(prefix or "<root>", old, new)]


def _is_volatile(key: str, volatile: Collection[str]) -> bool:
    parts = key.split(".")
    return any(".".join(parts[: i + 1]) in volatile for i in range(len(parts)))


def read_run_file(out: Path) -> dict:
    path = out / RUN_FILE
    try:
        doc = json.loads(path.read_text())
    except FileNotFoundError:
        raise FileNotFoundError(
            f"{path} not found: {out} is not a vlfast extraction folder (run `vlfast extract` first)"
        ) from None
    except json.JSONDecodeError as e:
        raise ValueError(
            f"{path} is not valid JSON ({e}); the folder is damaged, re-run with a new OUT"
        ) from None
    if not isinstance(doc, dict) or doc.get("format") != "vlfast-features":
        raise ValueError(f"{path} is not a vlfast run file")
    if doc.get("format_version", 0) > FORMAT_VERSION:
        raise ValueError(
            f"{out} was written by a newer vlfast (format {doc['format_version']} > {FORMAT_VERSION}); upgrade vlfast"
        )
    return doc


def committed_parts(out: Path) -> list[Path]:
    """Committed index parts, sorted by (rank, seq)."""
    index = out / INDEX_DIR
    if not index.is_dir():
        return []
    return sorted(p for p in index.iterdir() if _PART_RE.match(p.name))


def read_index_part(part: Path, columns: Sequence[str] | None = None):
    """One index part as an Arrow table; an unreadable part is named with what to do about it."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    try:
        return pq.read_table(part, columns=list(columns) if columns is not None else None)
    except (OSError, pa.ArrowException) as e:
        # Parts are written atomically, so this is damage from outside (disk, copy, a hand edit).
        shard = (
            part.parent.parent
            / SHARD_DIR
            / part.name.replace("part-", "shard-").replace(".parquet", ".safetensors")
        )
        raise ValueError(
            f"index part {part} is unreadable ({e}). Delete it and {shard} to extract those samples again "
            "on the next run."
        ) from None


def read_errors(out: Path) -> list[dict]:
    """All ranks' error records. A torn last line (crash mid-append) is skipped; exact repeats (a duplicate
    recorded again after a resume) are dropped."""
    folder = out / ERROR_DIR
    if not folder.is_dir():
        return []
    records, seen = [], set()
    for path in sorted(folder.glob("errors-r*.jsonl")):
        for line in path.read_text(encoding="utf-8", errors="replace").splitlines():
            try:
                rec = json.loads(line)
            except json.JSONDecodeError:
                continue
            if not isinstance(rec, dict) or "id" not in rec:
                continue
            key = (rec.get("id"), rec.get("source"), rec.get("reason"), rec.get("kind"))
            if key in seen:
                continue
            seen.add(key)
            records.append(rec)
    return records


def _safetensors_data_start(path: Path) -> tuple[int, dict]:
    """(absolute offset of the data section, header dict) of a safetensors file."""
    with open(path, "rb") as f:
        (n,) = struct.unpack("<Q", f.read(8))
        header = json.loads(f.read(n))
    return 8 + n, header


# ----------------------------------------------------------------------------------------------------
# the writer


class FeatureStore:
    """Buffered writer of per-sample feature tensors into OUT, one per rank.

    ``add`` buffers a sample; when the buffer reaches ``shard_max_bytes`` or ``shard_max_samples`` it is
    committed as one shard (see the module docstring for the commit protocol). Memory use is bounded by
    one shard's worth of tensors, whatever the number of samples.
    """

    def __init__(
        self,
        out: str | os.PathLike,
        run_config: Mapping[str, Any],
        *,
        rank: int = 0,
        world_size: int = 1,
        shard_max_bytes: int = 256 << 20,
        shard_max_samples: int = 1024,
        overwrite: bool = False,
        volatile_keys: Collection[str] = DEFAULT_VOLATILE_KEYS,
    ):
        if not isinstance(run_config, Mapping):
            raise TypeError(f"run_config must be a dict, got {type(run_config).__name__}")
        if not isinstance(world_size, int) or world_size < 1:
            raise ValueError(f"world_size must be a positive int, got {world_size!r}")
        if not isinstance(rank, int) or not 0 <= rank < world_size:
            raise ValueError(f"rank must be in [0, {world_size}), got {rank!r}")
        if shard_max_bytes < 1 or shard_max_samples < 1:
            raise ValueError("shard_max_bytes and shard_max_samples must be >= 1")
        self.out = Path(out)
        self.rank, self.world_size = rank, world_size
        self.shard_max_bytes, self.shard_max_samples = int(shard_max_bytes), int(shard_max_samples)
        self.volatile_keys = frozenset(volatile_keys)
        self.run_config = _canonical(dict(run_config))
        if self.out.exists() and not self.out.is_dir():
            raise NotADirectoryError(f"{self.out} exists and is not a folder; choose another OUT")

        self._tag = f"r{rank:05d}"
        (self.out / LOCK_DIR).mkdir(parents=True, exist_ok=True)
        # Two processes writing the same rank would overwrite each other's shard names (two runs without
        # torchrun, or a stale run still alive): refuse the second one.
        self._lock = _try_lock(self._lock_path(rank))
        if self._lock is None:
            raise RuntimeError(
                f"another process is already writing rank {rank} into {self.out} (lock "
                f"{self._lock_path(rank)}). Wait for it or stop it; to run several processes, launch them "
                "with torchrun so each gets its own RANK."
            )
        try:
            if overwrite:
                self._overwrite()
            for sub in (SHARD_DIR, INDEX_DIR, ERROR_DIR):
                (self.out / sub).mkdir(exist_ok=True)
            self._write_or_check_run_file()
            self._clean_garbage()
            self._parts_read: set[str] = set()  # index parts already in _committed
            self._committed: set[str] = set()
            self._refresh_committed()
            errors = read_errors(self.out)
            self._errored: set[str] = {r["id"] for r in errors if r.get("kind") != DUPLICATE_KIND}
            self._error_keys: set[tuple] = {
                (r["id"], r.get("source"), r.get("reason"), r.get("kind")) for r in errors
            }
            self._seq = self._next_seq()
            self._versions = library_versions()
            self._buffer: list[tuple[str, dict[str, torch.Tensor], str]] = []
            self._buffer_ids: set[str] = set()
            self._buffer_bytes = 0
            self._num_errors = 0
            self._num_added = 0
            self._closed = False
            self._error_file = self.out / ERROR_DIR / f"errors-{self._tag}.jsonl"
        except BaseException:
            self._release()
            raise

    # -- setup ---------------------------------------------------------------------------------------

    def _overwrite(self) -> None:
        # Only rank 0 deletes, and only what this format owns, so a mistyped OUT never loses unrelated files.
        if self.rank == 0:
            # Commit markers first, run.json last: a kill mid-way leaves orphan shards (cleaned on the next
            # start) under the old config, never index parts pointing at deleted shards, and never old data
            # that a run with the new config would take for its own.
            for sub in (INDEX_DIR, SHARD_DIR, ERROR_DIR):
                shutil.rmtree(self.out / sub, ignore_errors=True)
            (self.out / RUN_FILE).unlink(missing_ok=True)
        dist = torch.distributed
        if self.world_size > 1:
            if not (dist.is_available() and dist.is_initialized()):
                raise ValueError(
                    f"overwrite with {self.world_size} ranks needs torch.distributed initialised (torchrun) so "
                    f"rank 0 can clear {self.out} before the others write; or delete {self.out} before launching"
                )
            dist.barrier()  # other ranks must not write before rank 0 has cleared the folder

    def _write_or_check_run_file(self) -> None:
        path = self.out / RUN_FILE
        if path.exists():
            doc = read_run_file(self.out)
            diffs = [
                d
                for d in _flat_diff(doc.get("config", {}), self.run_config)
                if not _is_volatile(d[0], self.volatile_keys)
            ]
            if diffs:
                raise RunConfigMismatch(self.out, diffs)
            return
        doc = {
            "format": "vlfast-features",
            "format_version": FORMAT_VERSION,
            "created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
            "volatile_keys": sorted(self.volatile_keys),
            "config": self.run_config,
            "created_with": library_versions(),
        }
        # Several ranks may race here; each writes the same config through its own temp file, so the
        # last rename wins with identical content.
        _atomic_write_bytes(
            path,
            (json.dumps(doc, indent=2, sort_keys=True) + "\n").encode(),
            f"r{self.rank:05d}-{os.getpid()}",
        )

    def _lock_path(self, rank: int) -> Path:
        return self.out / LOCK_DIR / f"rank-{rank:05d}.lock"

    def _release(self) -> None:
        _unlock(getattr(self, "_lock", None))
        self._lock = None

    def __del__(self) -> None:
        # An abandoned store must not keep its rank locked for the rest of the process; buffered samples
        # are NOT flushed here (that needs close()), so they are redone on resume.
        with contextlib.suppress(Exception):  # at interpreter shutdown os may be torn down already
            self._release()

    def _owns_rank(self, r: int) -> bool:
        # Garbage of rank r is cleaned by one live rank: r itself if it is live, else r % world_size, so a
        # resume with fewer ranks still cleans the old ranks' leftovers and no rank deletes a live temp file.
        return r % self.world_size == self.rank

    def _clean_garbage(self) -> None:
        index = self.out / INDEX_DIR
        committed = {m.group(1, 2) for p in index.iterdir() if (m := _PART_RE.match(p.name))}
        garbage: dict[int, list[Path]] = {}
        for folder in (self.out / SHARD_DIR, index, self.out):
            for p in folder.iterdir():
                m = _TMP_RE.match(p.name)
                if m and p.is_file():
                    garbage.setdefault(int(m.group(1)), []).append(p)
        for p in (self.out / SHARD_DIR).iterdir():
            m = _SHARD_RE.match(p.name)
            if m and m.group(1, 2) not in committed:
                # shard renamed but its index part never written: uncommitted, its samples will be redone
                garbage.setdefault(int(m.group(1)), []).append(p)
        for r, paths in garbage.items():
            if not self._owns_rank(r):
                continue
            lock = self._lock if r == self.rank else _try_lock(self._lock_path(r))
            if lock is None:
                continue  # a process of an earlier run is still writing rank r: its files are not garbage
            try:
                for p in paths:
                    p.unlink(missing_ok=True)
            finally:
                if r != self.rank:
                    _unlock(lock)

    def _next_seq(self) -> int:
        seqs = [-1]
        for folder, rx in ((self.out / SHARD_DIR, _SHARD_RE), (self.out / INDEX_DIR, _PART_RE)):
            for p in folder.iterdir():
                m = rx.match(p.name)
                if m and int(m.group(1)) == self.rank:
                    seqs.append(int(m.group(2)))
        return max(seqs) + 1

    def _refresh_committed(self) -> None:
        for part in committed_parts(self.out):
            if part.name in self._parts_read:
                continue
            self._committed.update(read_index_part(part, ["id"]).column("id").to_pylist())
            self._parts_read.add(part.name)

    # -- public API ----------------------------------------------------------------------------------

    def done_ids(self) -> set[str]:
        """Ids committed by any rank plus ids recorded as (non-duplicate) errors: skip these on resume.

        A "duplicate id" error does not make an id done: the id's first occurrence may still be in an
        uncommitted buffer, and it must be redone after a crash.
        """
        self._refresh_committed()
        errored = {r["id"] for r in read_errors(self.out) if r.get("kind") != DUPLICATE_KIND}
        return self._committed | errored | self._errored | self._buffer_ids

    def plan(self, ids: Sequence[str], sources: Sequence[str] | None = None) -> list[int]:
        """Positions in ``ids`` (the FULL input list, same on every rank) this rank still has to extract.

        Applies ``partition`` for this store's rank, drops ``done_ids()``, and records every repeat of an
        id after its first occurrence as a "duplicate id" error (once: a resumed run writes nothing new).
        Returned in input order, so the caller maps positions back to its samples.
        """
        if sources is not None and len(sources) != len(ids):
            raise ValueError(f"sources has {len(sources)} entries for {len(ids)} ids")
        done = self.done_ids()
        first: dict[str, int] = {}
        todo: list[int] = []
        for k, sid in enumerate(ids):
            if self.world_size > 1 and owner_rank(sid, self.world_size) != self.rank:
                continue
            if sid in first:
                source = str(sources[k]) if sources is not None else ""
                reason = f"duplicate id: input entry {k} repeats entry {first[sid]}"
                self.add_error(sid, source, reason, kind=DUPLICATE_KIND)
                continue
            first[sid] = k
            if sid not in done:
                todo.append(k)
        return todo

    @property
    def num_errors(self) -> int:
        """Errors recorded by this store (this rank, this session), duplicates included: for --max-errors."""
        return self._num_errors

    @property
    def num_added(self) -> int:
        """Samples accepted by ``add`` in this session (committed or still buffered)."""
        return self._num_added

    def add(self, sample_id: str, features: Mapping[str, torch.Tensor], meta: Mapping | None = None) -> None:
        """Buffer one sample. A repeated id is recorded as a "duplicate id" error instead of overwriting."""
        self._check_open()
        if not isinstance(sample_id, str) or not sample_id:
            raise TypeError(f"sample_id must be a non-empty str, got {sample_id!r}")
        if not isinstance(features, Mapping) or not features:
            raise TypeError(f"features for {sample_id!r} must be a non-empty dict of name -> tensor")
        source = str(meta.get("path", meta.get("source", ""))) if isinstance(meta, Mapping) else ""
        if sample_id in self._buffer_ids or sample_id in self._committed:
            self.add_error(sample_id, source, "duplicate id: already extracted", kind=DUPLICATE_KIND)
            return
        if sample_id in self._errored:
            self.add_error(
                sample_id, source, "duplicate id: already recorded as an error", kind=DUPLICATE_KIND
            )
            return
        tensors: dict[str, torch.Tensor] = {}
        nbytes = 0
        for name, t in features.items():
            if not isinstance(name, str) or not name:
                raise TypeError(f"feature names must be non-empty str, got {name!r} for {sample_id!r}")
            if not isinstance(t, torch.Tensor):
                raise TypeError(
                    f"feature {name!r} of {sample_id!r} is a {type(t).__name__}, not a torch.Tensor"
                )
            if t.dtype not in _DTYPES:
                raise TypeError(
                    f"feature {name!r} of {sample_id!r} has dtype {t.dtype}, which safetensors cannot store; "
                    f"convert it to one of {sorted(_DTYPES.values())}"
                )
            if t.is_sparse or t.layout != torch.strided:
                raise TypeError(f"feature {name!r} of {sample_id!r} must be a dense tensor")
            src = t.detach()
            if src.device.type != "cpu":
                t = src.to("cpu").contiguous()  # a fresh copy that nobody else holds
            else:
                # Snapshot: the caller may reuse or modify its tensor after add, pass one tensor twice
                # (safetensors refuses shared memory), or pass a view that would keep a whole batch alive.
                t = src.clone(memory_format=torch.contiguous_format)
            tensors[name] = t
            nbytes += t.nbytes
        try:
            meta_json = json.dumps(dict(meta) if meta is not None else {}, sort_keys=True, ensure_ascii=False)
        except (TypeError, ValueError) as e:
            raise TypeError(f"meta of {sample_id!r} must be JSON-serialisable: {e}") from None

        if self._buffer and self._buffer_bytes + nbytes > self.shard_max_bytes:
            self.flush()
        self._buffer.append((sample_id, tensors, meta_json))
        self._buffer_ids.add(sample_id)
        self._buffer_bytes += nbytes
        self._num_added += 1
        if len(self._buffer) >= self.shard_max_samples or self._buffer_bytes >= self.shard_max_bytes:
            self.flush()

    def add_error(self, sample_id: str, source: str, reason: str, *, kind: str | None = None) -> None:
        """Record a failed sample durably (one fsync'd JSON line); the id then counts as done.

        ``kind`` is "error" or "duplicate"; by default a reason starting with "duplicate" means "duplicate".
        A duplicate record does not make its id done (the first occurrence may not be committed yet).
        Recording the same (id, source, reason) again, as a resumed run does, writes nothing.
        """
        self._check_open()
        if kind is None:
            kind = DUPLICATE_KIND if str(reason).lower().startswith("duplicate") else "error"
        if kind not in ("error", DUPLICATE_KIND):
            raise ValueError(f"kind must be 'error' or {DUPLICATE_KIND!r}, got {kind!r}")
        key = (str(sample_id), str(source), str(reason), kind)
        if key in self._error_keys:
            return
        rec = {
            "id": str(sample_id),
            "source": str(source),
            "reason": str(reason),
            "kind": kind,
            "rank": self.rank,
            "time": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        }
        line = json.dumps(rec, ensure_ascii=False) + "\n"
        fresh = not self._error_file.exists()
        with open(self._error_file, "ab+") as f:
            # A crash mid-append leaves a torn line without "\n"; start ours on a new line so it parses.
            if f.tell() > 0:
                f.seek(-1, os.SEEK_END)
                if f.read(1) != b"\n":
                    line = "\n" + line
            f.write(line.encode("utf-8"))
            f.flush()
            os.fsync(f.fileno())
        if fresh:
            _fsync_dir(self._error_file.parent)
        self._error_keys.add(key)
        self._num_errors += 1
        if kind != DUPLICATE_KIND:
            self._errored.add(str(sample_id))

    def flush(self) -> None:
        """Commit the buffered samples as one shard now (no-op when the buffer is empty)."""
        if not self._buffer:
            return
        name = f"{self._tag}-{self._seq:06d}"
        shard = self.out / SHARD_DIR / f"shard-{name}.safetensors"
        part = self.out / INDEX_DIR / f"part-{name}.parquet"
        self._write_shard(shard)
        self._write_index_part(shard, part)
        self._committed.update(sid for sid, _, _ in self._buffer)
        self._parts_read.add(part.name)
        self._buffer, self._buffer_ids, self._buffer_bytes = [], set(), 0
        self._seq += 1

    def close(self) -> None:
        """Commit what is buffered. Safe to call twice."""
        if self._closed:
            return
        try:
            self.flush()
        finally:
            self._closed = True
            self._release()

    def __enter__(self) -> FeatureStore:
        return self

    def __exit__(self, *exc: object) -> None:
        # Flush even on an exception (e.g. --max-errors reached, Ctrl-C): buffered samples are complete
        # and correct, so keeping them means less to redo.
        self.close()

    # -- internals -----------------------------------------------------------------------------------

    def _check_open(self) -> None:
        if self._closed:
            raise RuntimeError(f"FeatureStore for {self.out} is closed")

    def _write_shard(self, shard: Path) -> None:
        from safetensors.torch import save_file

        tensors = {
            f"{row}/{name}": t for row, (_, feats, _) in enumerate(self._buffer) for name, t in feats.items()
        }
        # The id list in the header makes a shard self-describing (an index could be rebuilt from shards).
        metadata = {
            "format": "pt",
            "vlfast_format": str(FORMAT_VERSION),
            "rank": str(self.rank),
            "ids": json.dumps([sid for sid, _, _ in self._buffer], ensure_ascii=False),
            "versions": json.dumps(self._versions, sort_keys=True),  # provenance per shard, across resumes
        }
        tmp = shard.parent / f".tmp-{self._tag}-{os.getpid()}-{shard.name}"
        save_file(tensors, tmp, metadata=metadata)
        _fsync_file(tmp)
        os.replace(tmp, shard)
        _fsync_dir(shard.parent)

    def _write_index_part(self, shard: Path, part: Path) -> None:
        import pyarrow as pa
        import pyarrow.parquet as pq

        data_start, header = _safetensors_data_start(shard)
        rows: dict[str, list] = {
            k: [] for k in ("id", "shard", "row", "rank", "features", "grid_thw", "meta")
        }
        rel = f"{SHARD_DIR}/{shard.name}"
        for row, (sid, feats, meta_json) in enumerate(self._buffer):
            entries = []
            for fname, t in feats.items():
                start, end = header[f"{row}/{fname}"]["data_offsets"]
                entries.append(
                    {
                        "name": fname,
                        "dtype": _DTYPES[t.dtype],
                        "shape": list(t.shape),
                        "offset": data_start + start,
                        "nbytes": end - start,
                    }
                )
            rows["id"].append(sid)
            rows["shard"].append(rel)
            rows["row"].append(row)
            rows["rank"].append(self.rank)
            rows["features"].append(entries)
            rows["grid_thw"].append(_grid_of(feats, meta_json))
            rows["meta"].append(meta_json)
        table = pa.table(rows, schema=index_schema())
        tmp = part.parent / f".tmp-{self._tag}-{os.getpid()}-{part.name}"
        pq.write_table(table, tmp)
        _fsync_file(tmp)
        os.replace(tmp, part)  # <- the commit point
        _fsync_dir(part.parent)


def index_schema():
    """Arrow schema of every index part (see the module docstring)."""
    import pyarrow as pa

    feature = pa.struct(
        [
            ("name", pa.string()),
            ("dtype", pa.string()),
            ("shape", pa.list_(pa.int64())),
            ("offset", pa.int64()),
            ("nbytes", pa.int64()),
        ]
    )
    return pa.schema(
        [
            ("id", pa.string()),
            ("shard", pa.string()),
            ("row", pa.int32()),
            ("rank", pa.int32()),
            ("features", pa.list_(feature)),
            ("grid_thw", pa.list_(pa.list_(pa.int64()))),
            ("meta", pa.string()),
        ]
    )
