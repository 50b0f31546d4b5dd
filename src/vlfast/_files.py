"""File helpers: how vlfast writes a user's file or folder, the mode a new file gets, and a seekable window of bytes.

``write_atomically`` is the one way vlfast writes what a user asked for (``tokens rewrite``, ``tokens fix``,
``export``, ``demo-checkpoint``). ``refuse_same_files`` and ``is_inside`` tell an output that is an input by
identity (device and inode), before anything is opened for writing. safetensors creates its files with mode
0600, unreadable by teammates on shared storage: ``honour_umask`` gives ``0666 & ~umask``, as ``open`` does.
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import io
import os
import secrets
import shutil
from collections.abc import Callable, Mapping
from pathlib import Path

from vlfast.errors import InputRefused

PathLike = str | os.PathLike


def _umask() -> int:
    # Linux reports it without changing it (cheap: once per written file); elsewhere set-and-restore.
    try:
        with open("/proc/self/status", encoding="ascii") as f:
            for line in f:
                if line.startswith("Umask:"):
                    return int(line.split()[1], 8)
    except (OSError, ValueError):
        pass
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def honour_umask(path: str | os.PathLike) -> None:
    """Give ``path`` the permissions a plain ``open(path, "w")`` would have: 0666 minus the umask."""
    os.chmod(path, 0o666 & ~_umask())


def same_file(a: PathLike, b: PathLike) -> bool:
    """Whether ``a`` and ``b`` name one existing file or folder (same device and inode); False when either
    does not exist."""
    try:
        sa, sb = os.stat(a), os.stat(b)
    except (OSError, ValueError):
        return False
    return (sa.st_dev, sa.st_ino) == (sb.st_dev, sb.st_ino)


def is_inside(path: PathLike, folder: PathLike) -> bool:
    """Whether ``path`` (which need not exist) lies under ``folder``: one of its resolved parents is
    ``folder`` by identity."""
    return any(same_file(parent, folder) for parent in Path(os.path.realpath(path)).parents)


def refuse_same_files(outputs: Mapping[str, PathLike | None], inputs: Mapping[str, PathLike | None]) -> None:
    """Refuse (InputRefused, naming both) an output that is an input, or another output, by identity or by
    resolved name; keys are what the user called them (``--out``, ``--dataset``). None entries are unused."""
    given = {k: v for k, v in outputs.items() if v is not None}

    def same(a: PathLike, b: PathLike) -> bool:
        return same_file(a, b) or os.path.realpath(a) == os.path.realpath(b)

    for k, (out_flag, out) in enumerate(given.items()):
        for in_flag, src in inputs.items():
            if src is not None and same(out, src):
                raise InputRefused(
                    f"{out_flag} {os.fspath(out)} is the same file as {in_flag} {os.fspath(src)}: vlfast never "
                    f"writes over its input; name a new {out_flag}"
                )
        for other_flag, other in list(given.items())[:k]:
            if same(out, other):
                raise InputRefused(
                    f"{out_flag} {os.fspath(out)} is the same file as {other_flag} {os.fspath(other)}: one "
                    "output would replace the other; name two files"
                )


# renameat2(2) flags (Linux 3.15+): a rename that refuses an existing target, and an atomic swap.
_RENAME_NOREPLACE, _RENAME_EXCHANGE = 1, 2
_AT_FDCWD = -100


def temp_name(dest: Path, tag: str) -> Path:
    """The hidden name beside ``dest`` that ``write_atomically`` writes under: ``.NAME.vlfast-TAG-PID-XXXXXXXX``."""
    return dest.parent / f".{dest.name}.vlfast-{tag}-{os.getpid()}-{secrets.token_hex(4)}"


def write_atomically(
    dest: PathLike, write: Callable[[Path], object], *, overwrite: bool = False, tag: str = "write"
) -> None:
    """``write(tmp)`` a file or folder at a hidden temp name beside ``dest``, make it durable, then rename
    it to ``dest``: readers see nothing, the previous ``dest``, or the whole new one. On failure the temp
    and the folders made above ``dest`` are removed (a SIGKILL leaves the temp behind under its hidden
    name). An existing ``dest`` is replaced only with ``overwrite``, except an empty folder (if it gains
    files meanwhile, nothing is replaced)."""
    dest = Path(dest)
    tmp = temp_name(dest, tag)
    made = _make_parents(dest)
    try:
        write(tmp)
        _fsync_tree(tmp)
        _place(tmp, dest, overwrite)
    except BaseException:
        _remove(tmp)
        for folder in reversed(made):  # the folders made for it, unless something else went in meanwhile
            with contextlib.suppress(OSError):
                folder.rmdir()
        raise
    fsync_dir(dest.parent)


def _make_parents(dest: Path) -> list[Path]:
    """Make the missing folders above ``dest`` (returned outermost first), refusing a file in the way."""
    missing, parent = [], dest.parent
    while not (parent.exists() or parent.is_symlink()):
        missing.append(parent)
        parent = parent.parent
    if not parent.is_dir():
        what = "a broken symlink" if parent.is_symlink() and not parent.exists() else "a file"
        raise NotADirectoryError(f"{dest}: {parent} is {what}, not a folder")
    for folder in reversed(missing):
        folder.mkdir(exist_ok=True)
    return missing[::-1]


def _exists_refused(dest: Path) -> InputRefused:
    return InputRefused(
        f"{dest} exists (or appeared while it was being written): nothing was replaced; name a new destination"
    )


def _place(tmp: Path, dest: Path, overwrite: bool) -> None:
    """Rename ``tmp`` to ``dest``, refused if ``dest`` exists (without ``overwrite``); a folder replaces
    the previous one by an atomic swap (renameat2) where there is one, else by two renames (``dest``
    briefly absent, never partial)."""
    if not overwrite and tmp.is_dir() and dest.is_dir() and not dest.is_symlink():
        try:
            os.rename(tmp, dest)  # replaces an empty folder only: one with files fails
        except OSError as e:
            if e.errno in (errno.ENOTEMPTY, errno.EEXIST):
                raise _exists_refused(dest) from None
            raise
        return
    exists = dest.exists() or dest.is_symlink()
    if not overwrite or not exists:
        try:
            if _renameat2(tmp, dest, _RENAME_NOREPLACE):
                return
        except FileExistsError:
            raise _exists_refused(dest) from None
        if not overwrite and (dest.exists() or dest.is_symlink()):
            raise _exists_refused(dest)
    if not tmp.is_dir() or not exists:
        os.replace(tmp, dest)
        return
    if _renameat2(tmp, dest, _RENAME_EXCHANGE):
        _remove(tmp)  # now the previous folder
        return
    aside = tmp.with_name(tmp.name + "-old")
    os.rename(dest, aside)
    os.rename(tmp, dest)
    _remove(aside)


def _renameat2(src: Path, dst: Path, flags: int) -> bool:
    """Linux's renameat2; False where the C library or the filesystem lacks it (the caller falls back)."""
    try:
        fn = ctypes.CDLL(None, use_errno=True).renameat2
    except (AttributeError, OSError):
        return False
    fn.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_int, ctypes.c_char_p, ctypes.c_uint]
    if fn(_AT_FDCWD, os.fsencode(src), _AT_FDCWD, os.fsencode(dst), flags) == 0:
        return True
    err = ctypes.get_errno()
    if err in (errno.ENOSYS, errno.EINVAL, errno.ENOTSUP, errno.EOPNOTSUPP):
        return False
    raise OSError(err, os.strerror(err), str(dst))


def _fsync_tree(path: Path) -> None:
    """Every file and folder under ``path`` durable before the rename makes it the destination."""
    if path.is_file():
        _fsync(path)
        return
    for folder, _, files in os.walk(path):
        for name in files:
            _fsync(Path(folder, name))
        fsync_dir(Path(folder))


def _fsync(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


_NO_SPACE = (errno.ENOSPC, getattr(errno, "EDQUOT", errno.ENOSPC))  # a full disk, a spent quota


def disk_full(e: BaseException) -> bool:
    """Whether a write failed for want of space: ENOSPC or EDQUOT, as an OSError or as safetensors' own
    error (a Rust io::Error it reports as text: "No space left on device (os error 28)")."""
    if isinstance(e, OSError):
        return e.errno in _NO_SPACE
    text = str(e)
    return type(e).__name__ == "SafetensorError" and any(f"os error {c})" in text for c in _NO_SPACE)


def fsync_dir(path: Path) -> None:
    """fsync the folder ``path``: a rename into it is only durable once its entry is."""
    if os.name != "nt":  # Windows cannot open a folder as a file; NTFS journals the rename itself
        _fsync(path)


def _remove(path: Path) -> None:
    with contextlib.suppress(FileNotFoundError):
        if path.is_dir() and not path.is_symlink():
            shutil.rmtree(path)
        else:
            path.unlink()


class ByteWindow(io.RawIOBase):
    """A read-only, seekable view of ``size`` bytes (a tar member, local or at a URL): subclasses fill a
    buffer (``readinto``) from ``self._pos``. ``name`` is what PyAV hands FFmpeg, whose probe weighs the
    file extension."""

    def __init__(self, size: int, name: str):
        super().__init__()
        self._size, self._pos = size, 0
        self.name = name

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def seek(self, offset: int, whence: int = io.SEEK_SET) -> int:
        base = {io.SEEK_SET: 0, io.SEEK_CUR: self._pos, io.SEEK_END: self._size}.get(whence)
        if base is None:
            raise ValueError(f"invalid whence {whence}")
        if base + offset < 0:
            raise OSError(f"negative seek position {base + offset}")
        self._pos = base + offset
        return self._pos

    def tell(self) -> int:
        return self._pos
