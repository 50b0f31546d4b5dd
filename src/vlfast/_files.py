"""File helpers: the mode every other program would give a new file, and a seekable window of bytes.

safetensors' writer creates its files with mode 0600, so shards and fixed checkpoints written on shared
storage were unreadable by teammates. ``honour_umask`` gives a written file ``0666 & ~umask``, as ``open``
does. ``ByteWindow`` is the seekable file interface of a tar member, read in place from a local shard or by
ranged requests from one at a URL.
"""

from __future__ import annotations

import io
import os


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


class ByteWindow(io.RawIOBase):
    """A read-only, seekable view of ``size`` bytes: subclasses say how to fill a buffer (``readinto``) from
    position ``self._pos``; seeking is bookkeeping. ``name`` is what PyAV hands FFmpeg, whose format probe
    weighs the file extension."""

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
