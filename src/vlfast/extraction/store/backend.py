"""Where a FeatureStore's bytes go: a local folder or a folder on object storage, behind one interface.

:class:`LocalBackend` commits through a temp file, fsync, rename and an fsync of the folder, and guards each
rank with an flock; :class:`ObjectBackend` uploads each file whole, the commit markers with an exclusive
create, and deletes an orphan shard only once it is ``ORPHAN_AGE`` old. The commit protocol is specified in
docs/format.md ("Commits and crash safety", "OUT on object storage").
"""

from __future__ import annotations

import contextlib
import errno
import os
import re
import shutil
import tempfile
import time
import warnings
from collections.abc import Callable, Collection, Mapping
from pathlib import Path
from typing import Any

from vlfast._files import fsync_dir
from vlfast.extraction.interrupts import commit_section
from vlfast.extraction.store.format import (
    ERROR_DIR,
    INDEX_DIR,
    LISTING_DIR,
    LOCK_DIR,
    MOVE_HINT,
    QUARANTINE_DIR,
    SHARD_DIR,
    SHARD_RE,
    TMP_RE,
    DamagedFile,
    OutputFull,
    OutputInUse,
    OutputNotWritable,
    is_local,
    list_names,
    resolve_out,
)
from vlfast.extraction.store.layout import find_strays, uncovered_shards

__all__ = [
    "ORPHAN_AGE",
    "LocalBackend",
    "ObjectBackend",
    "backend_for",
    "keep_listings",
    "live_ranks",
    "not_writable",
    "rank_is_held",
]

# On object storage, a shard without its index part is deleted only once it is this old (seconds): younger,
# it may be a live writer's upload whose part is on its way (there are no locks to ask).
ORPHAN_AGE = 3600.0

_LOCK_RE = re.compile(r"rank-(\d+)\.lock")
_READ_ONLY = (errno.EROFS, errno.EACCES, errno.EPERM)


# ----------------------------------------------------------------------------------------------------
# locks (local folders only)


def try_lock(path: Path) -> int | None:
    """Exclusive, non-blocking flock on ``path``: the open fd, or None if another process holds it. flock
    locks die with their process, so a SIGKILLed run leaves no stale lock."""
    try:
        import fcntl
    except ImportError:  # pragma: no cover - no flock on Windows: run unguarded
        return -1
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o666)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError as e:
        os.close(fd)
        if e.errno in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES):
            return None
        # Some network filesystems (Lustre without -o flock, old NFS) have no locks: run unguarded.
        warnings.warn(
            f"cannot lock {path} ({e}); running without the one-writer-per-rank guard", stacklevel=3
        )
        return -1
    return fd


def unlock(fd: int | None) -> None:
    if fd is not None and fd >= 0:
        os.close(fd)  # closing the descriptor releases the flock


def lock_path(out: Path, rank: int) -> Path:
    return out / LOCK_DIR / f"rank-{rank:05d}.lock"


def rank_is_held(out: Any, rank: int) -> bool:
    """Whether a live process holds ``rank`` of the local folder ``out`` now (False on object storage)."""
    out = resolve_out(out)
    if not is_local(out):
        return False
    path = lock_path(out, rank)
    if not path.exists():
        return False
    fd = try_lock(path)
    unlock(fd)
    return fd is None


def live_ranks(out: Any) -> list[int]:
    """The ranks of the local folder ``out`` that a live process holds now ([] on object storage)."""
    out = resolve_out(out)
    if not is_local(out) or not (out / LOCK_DIR).is_dir():
        return []
    ranks = [int(m.group(1)) for p in (out / LOCK_DIR).iterdir() if (m := _LOCK_RE.fullmatch(p.name))]
    return [r for r in ranks if rank_is_held(out, r)]


# ----------------------------------------------------------------------------------------------------
# file helpers


def put_object(path: Any, data: bytes | Path, exclusive: bool) -> None:
    """One PUT of ``data`` (bytes, or a local file streamed up) to the object ``path``. ``exclusive``: fail
    with FileExistsError instead of replacing an object. s3fs sends S3's ``If-None-Match: *`` (also on a
    multipart upload's completion), so two racing writers cannot both win; other stores check first."""
    fs, key = path.fs, path.path
    mode = "create" if exclusive else "overwrite"

    def put() -> None:
        if isinstance(data, Path):
            fs.put_file(str(data), key, mode=mode)
        else:
            fs.pipe_file(key, data, mode=mode)

    try:
        try:
            put()
        except FileNotFoundError:
            from vlfast.extraction.objstore import has_buckets

            if has_buckets(fs):  # the bucket itself is gone: never create one behind the user's back
                raise
            fs.makedirs(fs._parent(key), exist_ok=True)  # a store with real folders (fsspec's local, SFTP)
            put()
    except FileExistsError:
        raise
    except OSError:
        fs.invalidate_cache(key)
        if exclusive and fs.exists(key):  # S3 answers PreconditionFailed, which s3fs maps to EINVAL
            raise FileExistsError(str(path)) from None
        raise
    fs.invalidate_cache(key)


def _orphaned(path: Any, now: float) -> bool:
    """Whether the object is older than ``ORPHAN_AGE`` (no: the store does not say its age)."""
    try:
        return now - path.fs.modified(path.path).timestamp() > ORPHAN_AGE
    except (NotImplementedError, FileNotFoundError, OSError, AttributeError):
        return False


def _space(folder: Path, e: BaseException) -> tuple[str, str]:
    """(why the write failed, the free space of ``folder``), for an OutputFull's message."""
    try:
        usage = shutil.disk_usage(folder)
        space = f"{usage.free / (1 << 20):,.1f} MiB free of {usage.total / (1 << 20):,.1f} MiB"
    except OSError:
        space = "free space unknown"
    why = (
        "disk quota exceeded"
        if getattr(e, "errno", None) == getattr(errno, "EDQUOT", None)
        else "no space left"
    )
    return why, space


def not_writable(out: Any, e: OSError) -> OutputNotWritable:
    """The error for an OUT that refused a write (``e``: read-only filesystem or permissions)."""
    return OutputNotWritable(
        f"cannot write to {out} ({e.strerror or e}): it is on a read-only filesystem or you lack permission. "
        "What it holds can still be read with vlfast.FeatureCache; to extract more, choose a writable OUT."
    )


def _clear_owned(folder: Path, owned: Callable[[str], bool]) -> None:
    """Delete what this format owns in ``folder``; through a symlinked folder (shards/ on a bigger disk),
    only its files, never the link: ignoring ``rmtree``'s refusal of a symlink once kept a whole old index
    alive under a new configuration. Errors propagate."""
    if folder.is_symlink():
        if not folder.exists():  # a dangling link holds nothing: drop it, mkdir makes a real folder
            folder.unlink()
            return
        for p in folder.iterdir():
            if owned(p.name):
                if p.is_dir() and not p.is_symlink():
                    shutil.rmtree(p)
                else:
                    p.unlink()
        return
    if folder.exists():
        shutil.rmtree(folder)


# ----------------------------------------------------------------------------------------------------
# error logs: one file per rank that grows by fsync'd appends, or one object per session


class LocalErrorLog:
    """A rank's errors file, appended to one fsync'd line at a time: a record is durable when written."""

    pending_since: float | None = None  # nothing ever waits for a commit

    def __init__(self, path: Path):
        self.path = path

    def append(self, line: str) -> None:
        with commit_section():
            fresh = not self.path.exists()
            with open(self.path, "ab+") as f:
                # A crash mid-append leaves a torn line without "\n": start ours on a new line.
                if f.tell() > 0:
                    f.seek(-1, os.SEEK_END)
                    if f.read(1) != b"\n":
                        line = "\n" + line
                f.write(line.encode("utf-8"))
                f.flush()
                os.fsync(f.fileno())
            if fresh:
                fsync_dir(self.path.parent)

    def commit(self) -> None:
        pass


class ObjectErrorLog:
    """Object storage cannot append: this session's error lines are uploaded again as one object on every
    commit. Lines a kill catches before their upload are lost, and their samples tried again."""

    def __init__(self, path: Any):
        self.path = path
        self._lines: list[str] = []
        self.pending_since: float | None = None  # when the oldest line not uploaded yet was added

    def append(self, line: str) -> None:
        self._lines.append(line)
        if self.pending_since is None:
            self.pending_since = time.monotonic()

    def commit(self) -> None:
        if self.pending_since is None:
            return
        put_object(self.path, "".join(self._lines).encode("utf-8"), exclusive=False)
        self.pending_since = None


# ----------------------------------------------------------------------------------------------------
# the backends


class LocalBackend:
    """A local folder: temp file + fsync + rename + fsync of the folder for every file, flock per rank."""

    def __init__(self, out: Path, session: str):
        self.out = out
        self.instance = str(os.getpid())  # what tells this process's files apart (temp names, quarantine)
        self._lock: int | None = None
        self._rank: int | None = None

    def check_folder(self) -> None:
        if self.out.exists() and not self.out.is_dir():
            raise NotADirectoryError(f"{self.out} exists and is not a folder; choose another OUT")

    def lock(self, rank: int) -> None:
        """Hold ``rank``: a second process writing it (two runs without torchrun, or a stale run still alive)
        would overwrite shard names, so it is refused."""
        self._rank = rank
        try:
            (self.out / LOCK_DIR).mkdir(parents=True, exist_ok=True)
            self._lock = try_lock(lock_path(self.out, rank))
        except OSError as e:
            if e.errno in _READ_ONLY:
                raise not_writable(self.out, e) from None
            if e.errno in (errno.EEXIST, errno.ENOTDIR):  # a file where the folder belongs
                raise DamagedFile(f"{self.out / LOCK_DIR} is not a folder. {MOVE_HINT}") from None
            raise
        if self._lock is None:
            raise OutputInUse(
                f"another process is already writing rank {rank} into {self.out} (lock "
                f"{lock_path(self.out, rank)}). Wait for it or stop it; to run several processes, launch them "
                "with torchrun so each gets its own RANK."
            )

    def release(self) -> None:
        unlock(self._lock)
        self._lock = None

    def make_folders(self) -> None:
        for sub in (SHARD_DIR, INDEX_DIR, ERROR_DIR):
            (self.out / sub).mkdir(exist_ok=True)

    def write(self, path: Path, data: bytes, tmp_tag: str, *, exclusive: bool = False) -> None:
        """Write ``data`` to ``path`` whole or not at all (a rename replaces: ``exclusive`` is for object
        storage)."""
        tmp = path.parent / f".tmp-{tmp_tag}-{path.name}"
        try:
            with open(tmp, "wb") as f:
                f.write(data)
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, path)
        except BaseException:
            tmp.unlink(missing_ok=True)  # ours and never renamed: garbage that would hold space (a full disk)
            raise
        fsync_dir(path.parent)

    def write_cache(self, folder: Path, files: Mapping[str, bytes], tmp_tag: str) -> None:
        """Write ``files`` (name -> bytes) into ``folder``, each whole or not at all, without fsync: for a
        cache whose reader checks every file (kept listings), where a torn write costs a miss."""
        folder.mkdir(exist_ok=True)
        for name, data in files.items():
            tmp = folder / f".tmp-{tmp_tag}-{name}"
            try:
                if hasattr(data, "write_file"):  # a kept table writes itself, without a copy in memory
                    data.write_file(tmp)
                else:
                    tmp.write_bytes(data)
                os.replace(tmp, folder / name)
            except BaseException:
                tmp.unlink(missing_ok=True)
                raise

    def remove(self, paths: list[Path]) -> None:
        """Delete ``paths`` (missing ones are skipped), then make the deletions durable."""
        for p in paths:
            p.unlink(missing_ok=True)
        for folder in {p.parent for p in paths}:
            fsync_dir(folder)

    def stage(self, shard: Path, tag: str) -> Path:
        """Where a shard is written before its commit: a temp folder of this rank beside it, so the temp file
        safetensors' ``save_file`` makes next to its target (no rank in its name) is this rank's garbage."""
        folder = shard.parent / f".tmp-{tag}-{os.getpid()}.d"
        folder.mkdir(exist_ok=True)
        return folder / shard.name

    def unstage(self, staged: Path) -> None:
        """Remove what staging left: the staged file unless renamed, and its folder once empty."""
        staged.unlink(missing_ok=True)
        with contextlib.suppress(OSError):  # another shard of this process staged there meanwhile
            staged.parent.rmdir()

    def sync(self, f: Any) -> None:
        os.fsync(f.fileno())

    def commit_file(self, staged: Path, path: Path) -> None:
        """Give the staged file (:meth:`stage`) the name ``path``, whole or not at all (a rename replaces: a
        same-named index part has the same bytes)."""
        with open(staged, "rb+") as f:
            os.fsync(f.fileno())
        os.replace(staged, path)
        fsync_dir(path.parent)

    def publish(self, staged: Path, shard: Path, next_name: Callable[[], Path]) -> Path:
        """Give the staged shard its final name (a rename, then an fsync of the folder)."""
        os.replace(staged, shard)
        fsync_dir(shard.parent)
        return shard

    def error_log(self, tag: str, session: str) -> LocalErrorLog:
        return LocalErrorLog(self.out / ERROR_DIR / f"errors-{tag}.jsonl")

    def clear(self, owned: Mapping[str, Callable[[str], bool]], files: tuple[str, ...]) -> None:
        """Delete what the format owns, folder by folder in the order given, then ``files`` in order."""
        for sub, owns in owned.items():
            _clear_owned(self.out / sub, owns)
        for name in files:
            (self.out / name).unlink(missing_ok=True)

    def quarantine(self, dest: Path, sources: tuple[Path, ...]) -> None:
        """Move ``sources`` (in order) into the folder ``dest``, which holds its reason.json already."""
        moved = set()
        for src in sources:
            with contextlib.suppress(FileNotFoundError):  # another rank moved it first, or it was missing
                shutil.move(src, dest / src.name)
                moved.add(src.parent)
        if moved:
            for folder in (*sorted(moved), dest):
                fsync_dir(folder)

    def make_quarantine(self, dest: Path) -> None:
        dest.mkdir(parents=True, exist_ok=True)

    def quarantined_shards(self) -> list[str]:
        quarantine = self.out / QUARANTINE_DIR
        return [p.name for p in quarantine.glob("*/shard-*.safetensors")] if quarantine.is_dir() else []

    def clean_garbage(
        self, owns_rank: Callable[[int], bool], set_aside: Callable[[list[Path]], None]
    ) -> None:
        """Delete temp files and shards without an index part (a crash between the two renames) of the ranks
        ``owns_rank`` gives this store, unless a live process holds that rank. An uncovered shard no crash
        explains (``layout.uncovered_shards``) goes to ``set_aside`` instead, never deleted."""
        index = self.out / INDEX_DIR
        uncovered = uncovered_shards(self.out)
        garbage: dict[int, list[Path]] = {}
        lost: dict[int, list[Path]] = {}
        listings = self.out / LISTING_DIR
        for folder in (self.out / SHARD_DIR, index, self.out, *([listings] if listings.is_dir() else [])):
            for p in folder.iterdir():
                m = TMP_RE.match(p.name)
                if m and (p.is_file() or (p.is_dir() and not p.is_symlink())):
                    garbage.setdefault(int(m.group(1)), []).append(p)
        for name, leftover in uncovered.items():
            # A leftover (its part never written) is uncommitted: its samples are redone. A folder under a
            # shard's name is no shard a run wrote: never deleted with what it holds.
            leftover = leftover and not (self.out / SHARD_DIR / name).is_dir()
            (garbage if leftover else lost).setdefault(int(SHARD_RE.match(name).group(1)), []).append(
                self.out / SHARD_DIR / name
            )
        for r in sorted({*garbage, *lost}):
            if not owns_rank(r):
                continue
            lock = self._lock if r == self._rank else try_lock(lock_path(self.out, r))
            if lock is None:
                continue  # a process of an earlier run is still writing rank r: its files are not garbage
            try:
                for p in garbage.get(r, []):
                    if p.is_dir() and not p.is_symlink():  # a staging folder (stage), with what it holds
                        shutil.rmtree(p, ignore_errors=True)
                    else:
                        p.unlink(missing_ok=True)
                if lost.get(r):
                    set_aside(lost[r])
            finally:
                if r != self._rank:
                    unlock(lock)

    def full_error(self, e: BaseException, doing: str) -> OutputFull:
        """The OutputFull for ``e``: the folder that is full, its free space, and how to go on."""
        why, space = _space(self.out, e)
        return OutputFull(
            errno.ENOSPC,
            f"{self.out} is full ({why} on its disk; {space}) while {doing}. Everything committed is intact and "
            "the partial file was removed. Free space (or point OUT/shards at a bigger disk with a symlink), "
            "then run the same command again to resume.",
        )


class ObjectBackend:
    """A folder on object storage: no renames and no locks. Each file is one (atomic) PUT of its final name;
    shards and index parts are created exclusively, a shard staged in a local temp file first."""

    def __init__(self, out: Any, session: str):
        self.out = out
        self.instance = session  # what tells this process's files apart (quarantine)
        self._rank = 0

    def check_folder(self) -> None:
        pass

    def lock(self, rank: int) -> None:
        self._rank = rank  # no locks: a second writer of a rank takes the next free shard names

    def release(self) -> None:
        pass

    def make_folders(self) -> None:
        pass  # an object store has no folders to make

    def write(self, path: Any, data: bytes, tmp_tag: str, *, exclusive: bool = False) -> None:
        """One PUT; ``exclusive`` refuses to replace an existing object (FileExistsError)."""
        put_object(path, data, exclusive)

    def write_cache(self, folder: Any, files: Mapping[str, bytes], tmp_tag: str) -> None:
        """One PUT per file, 16 at once (see :meth:`LocalBackend.write_cache`)."""
        from concurrent.futures import ThreadPoolExecutor

        with ThreadPoolExecutor(min(16, len(files)) or 1, thread_name_prefix="vlfast-cache") as pool:
            list(pool.map(lambda item: _put_cache(folder / item[0], item[1]), files.items()))

    def remove(self, paths: list[Any]) -> None:
        """Delete the objects ``paths`` (missing ones are skipped)."""
        for p in paths:
            with contextlib.suppress(FileNotFoundError):
                self.out.fs.rm(p.path)
            self.out.fs.invalidate_cache(p.path)

    def stage(self, shard: Any, tag: str) -> Path:
        return Path(tempfile.mkdtemp(prefix=f"vlfast-{tag}-")) / "shard.safetensors"

    def unstage(self, staged: Path) -> None:
        shutil.rmtree(staged.parent, ignore_errors=True)  # the local copy, and any temp safetensors left

    def sync(self, f: Any) -> None:
        pass  # the upload reads the file back; nothing on this disk needs to survive a crash

    def commit_file(self, staged: Path, path: Any) -> None:
        """Stream the staged file up to ``path`` in one exclusive create (FileExistsError if it exists)."""
        put_object(path, staged, exclusive=True)

    def publish(self, staged: Path, shard: Any, next_name: Callable[[], Any]) -> Any:
        """Upload the staged shard in one exclusive create, taking the next name while the name is taken (a
        second writer of this rank, or an orphan not yet cleaned)."""
        for _ in range(1000):
            try:
                put_object(shard, staged, exclusive=True)
                return shard
            except FileExistsError:
                shard = next_name()
        raise RuntimeError(f"{self.out}: 1000 shard names of rank {self._rank} in a row are taken")

    def error_log(self, tag: str, session: str) -> ObjectErrorLog:
        return ObjectErrorLog(self.out / ERROR_DIR / f"errors-{tag}-{session}.jsonl")

    def clear(self, owned: Mapping[str, Callable[[str], bool]], files: tuple[str, ...]) -> None:
        for sub, owns in owned.items():
            folder = self.out / sub
            doomed = [(folder / n).path for n in list_names(folder) if owns(n)]
            if doomed:
                self.out.fs.rm(doomed, recursive=True)
        for name in files:
            with contextlib.suppress(FileNotFoundError):
                self.out.fs.rm((self.out / name).path)

    def quarantine(self, dest: Any, sources: tuple[Any, ...]) -> None:
        fs = self.out.fs
        for src in sources:
            # An object, or a prefix with objects under it (a "folder" where a part belongs): each object is
            # copied, then deleted (no move on a store; fsspec's recursive move stumbles on the prefix itself).
            fs.invalidate_cache(src.path)
            try:
                keys = fs.find(src.path)
            except FileNotFoundError:
                keys = []
            for key in keys:
                rest = key[len(src.path) :].lstrip("/")
                target = (dest / src.name).path + (f"/{rest}" if rest else "")
                with contextlib.suppress(FileNotFoundError):  # another rank moved it first
                    fs.mv(key, target)
            fs.invalidate_cache(src.path)

    def make_quarantine(self, dest: Any) -> None:
        pass

    def quarantined_shards(self) -> list[str]:
        with contextlib.suppress(FileNotFoundError):
            return [k.rsplit("/", 1)[-1] for k in self.out.fs.find((self.out / QUARANTINE_DIR).path)]
        return []

    def clean_garbage(self, owns_rank: Callable[[int], bool], set_aside: Callable[[list[Any]], None]) -> None:
        """Delete shards whose index part never came (a writer killed between its two uploads); hand the
        uncovered shards no kill explains (``layout.uncovered_shards``) to ``set_aside``, never deleted.
        Without locks a young orphan cannot be told from a live writer's upload whose part is on its way, so
        only orphans older than ``ORPHAN_AGE`` seconds go. Readers never see orphans: they follow parts only.
        """
        now = time.time()
        lost = []
        for name, leftover in uncovered_shards(self.out).items():
            if not owns_rank(int(SHARD_RE.match(name).group(1))):
                continue
            shard = self.out / SHARD_DIR / name
            if not _orphaned(shard, now):
                continue
            if leftover:
                with contextlib.suppress(FileNotFoundError):
                    self.out.fs.rm(shard.path)
            else:
                lost.append(shard)
        if lost:
            set_aside(lost)

    def full_error(self, e: BaseException, doing: str) -> OutputFull:
        folder = Path(tempfile.gettempdir())
        why, space = _space(folder, e)
        return OutputFull(
            errno.ENOSPC,
            f"the local temp folder {folder} is full ({why}; {space}) while {doing} for {self.out}: shards of "
            "an OUT on object storage are staged there before their upload. Everything committed is intact. "
            "Set TMPDIR to a folder with room, then run the same command again to resume.",
        )


def strays_to_move(out: Any, owns_rank: Callable[[int], bool]) -> list[str]:
    """What a store of ``out`` would move aside or remove on opening (store/layout.py), read only: a shard no
    index part covers of a rank ``owns_rank`` gives it (on object storage only once ``ORPHAN_AGE`` old). A
    finished OUT with any is not "nothing to do". (A file where a folder belongs is refused before this is
    asked: ``layout.refuse_misplaced``.)"""
    now = time.time()
    return [
        stray.rel
        for stray in find_strays(out)
        if stray.kind == "uncovered"
        and owns_rank(stray.rank)
        and (is_local(out) or _orphaned(stray.path, now))
    ]


def backend_for(out: Any, session: str) -> LocalBackend | ObjectBackend:
    """The backend of a resolved OUT (see ``format.resolve_out``): chosen once, by its filesystem."""
    return LocalBackend(out, session) if is_local(out) else ObjectBackend(out, session)


def _put_cache(path: Any, data: Any) -> None:
    """One PUT of a kept file: bytes as they are; an object that writes itself (a manifest's table, hundreds
    of MB at ten million rows) through a local temp file, never copied in memory."""
    if not hasattr(data, "write_file"):
        put_object(path, data, False)
        return
    with tempfile.TemporaryDirectory(prefix="vlfast-kept-") as tmp:
        local = Path(tmp) / "kept"
        data.write_file(local)
        put_object(path, local, False)


# A kept file is named ``<key>-<32 hex digits of its identity>.<suffix>``: the key is what it is of (a shard's
# path or URL, a manifest's). Before, a listing was ``<32 hex>.json.gz``.
_KEPT = re.compile(r"^(.+)-[0-9a-f]{32}(\.[a-z.]+)$")
_KEPT_BEFORE = re.compile(r"^[0-9a-f]{32}\.json\.gz$")


def superseded(names: Collection[str], written: Collection[str]) -> list[str]:
    """The kept files among ``names`` that the files ``written`` replace: other versions of the same key and
    suffix, and listings named the way no version reads now."""
    keys = {(m.group(1), m.group(2)) for n in written if (m := _KEPT.match(n))}
    old = []
    for name in names:
        m = _KEPT.match(name)
        if name not in written and ((m and (m.group(1), m.group(2)) in keys) or _KEPT_BEFORE.match(name)):
            old.append(name)
    return old


def keep_listings(out: Any, listings: Mapping[str, Any], tmp_tag: str) -> int:
    """Write an input's shard listings and manifest tables (name -> bytes, or an object that writes itself:
    :mod:`vlfast.extraction.sources.kept`) into ``OUT/listings``, then delete what they replace; how many
    were written. A cache: a write that fails is skipped and costs the next run a listing. ``tmp_tag``
    starts with the writer's rank, whose garbage cleaning covers it."""
    if not listings:
        return 0
    backend = backend_for(out, "")
    folder = out / LISTING_DIR
    try:
        backend.write_cache(folder, listings, tmp_tag)
    except Exception:
        return 0
    with contextlib.suppress(Exception):  # a cache: what is not deleted now is deleted by a later run
        old = superseded(list_names(folder), set(listings))
        if old:
            backend.remove([folder / n for n in old])
    return len(listings)
