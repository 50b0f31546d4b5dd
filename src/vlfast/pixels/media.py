"""Media as decoding reads it (a file's path, or a :class:`MediaObject` read in place: a member of a tar shard,
a URL), and the error a bad one raises: :class:`SampleError`, with a reason a person can act on."""

from __future__ import annotations

import errno
import os
import stat
from typing import IO, Protocol, runtime_checkable

__all__ = [
    "MAX_ASPECT_RATIO",
    "Media",
    "MediaObject",
    "SampleError",
    "at_url",
    "checked_file",
    "checked_media",
    "read_failure",
]

MAX_ASPECT_RATIO = 200  # Qwen's smart_resize rejects anything longer than 200:1


class SampleError(Exception):
    """This sample cannot be extracted; the message is the reason written to the errors file."""


@runtime_checkable
class MediaObject(Protocol):
    """Media read in place (a member of a tar shard, an object at a URL). ``str()`` names it in errors."""

    @property
    def at_url(self) -> bool:
        """Whether it is read from storage over the network (where failures may be transient)."""
        ...

    def open(self) -> IO[bytes]:
        """Its bytes as a seekable binary file (PIL and PyAV take it); raises OSError."""
        ...

    def read_bytes(self) -> bytes: ...

    def checked_size(self) -> int:
        """Its size in bytes, non-zero; SampleError saying why it cannot be read otherwise."""
        ...

    def read_failure(self, e: BaseException) -> Exception | None:
        """The storage's error for ``e`` where the failure is the storage's and may pass (a connection reset, a
        timeout), not the media's; None where it is not."""
        ...


# Media: a file path, or an object read in place.
Media = str | MediaObject


def at_url(media: Media) -> bool:
    """Whether ``media`` is read from storage over the network (where failures may be transient)."""
    return not isinstance(media, str) and media.at_url


def checked_media(media: Media) -> int:
    """Size in bytes of a readable, non-empty file or object; SampleError saying why not otherwise."""
    return checked_file(media).st_size if isinstance(media, str) else media.checked_size()


def read_failure(media: Media, e: BaseException) -> Exception | None:
    """The storage's error where ``e``, raised reading ``media``, is the storage's transient failure."""
    return None if isinstance(media, str) else media.read_failure(e)


def checked_file(path: str) -> os.stat_result:
    """The file's stat, or SampleError saying why there is no readable file at ``path``."""
    try:
        st = os.stat(path)
    except OSError as e:
        if e.errno == errno.ELOOP:
            raise SampleError(f"symlink loop: {path}") from None
        if os.path.islink(path):
            try:
                target = os.readlink(path)
            except OSError:
                target = "?"
            raise SampleError(f"dangling symlink: {path} -> {target}") from None
        if e.errno in (errno.ENOENT, errno.ENOTDIR, errno.ENAMETOOLONG):
            raise SampleError(f"file not found: {path}") from None
        raise SampleError(f"cannot access {path}: {e.strerror or e}") from None
    if not stat.S_ISREG(st.st_mode):
        raise SampleError(f"not a file: {path}")
    if st.st_size == 0:
        raise SampleError(f"empty file (0 bytes): {path}")
    return st
