"""A sample's media as decoding reads it (a file, a member of a tar shard, or a URL, read in place), and the
error a bad one raises: :class:`SampleError`, with a reason a person can act on, recorded by the engine."""

from __future__ import annotations

import errno
import os
import stat

from vlfast.extraction.sources.remote import RemoteFile
from vlfast.extraction.sources.sample import Sample
from vlfast.extraction.sources.webdataset import TarMember

__all__ = ["MAX_ASPECT_RATIO", "Media", "SampleError", "at_url", "checked_file", "checked_media", "media_of"]

MAX_ASPECT_RATIO = 200  # Qwen's smart_resize rejects anything longer than 200:1


class SampleError(Exception):
    """This sample cannot be extracted; the message is the reason written to the errors file."""


# A sample's media: a file path, a member of a WebDataset tar shard, or a URL, read in place.
Media = str | TarMember | RemoteFile


def media_of(sample: Sample) -> Media:
    return sample.member if sample.member is not None else sample.paths[0]


def at_url(media: Media) -> bool:
    """Whether ``media`` is read from storage over the network (where failures may be transient)."""
    return isinstance(media, RemoteFile) or (isinstance(media, TarMember) and media.at_url)


def checked_media(media: Media) -> int:
    """Size in bytes of a readable, non-empty file or tar member; SampleError saying why not otherwise."""
    if isinstance(media, RemoteFile):
        try:
            size = media.size()
        except OSError as e:  # the message names the URL, never the storage options
            raise SampleError(str(e)) from None
        if size == 0:
            raise SampleError(f"empty file (0 bytes): {media}")
        return size
    if not isinstance(media, TarMember):
        return checked_file(media).st_size
    if media.at_url:  # no request here: a ranged read past the object's end says "truncated shard" itself
        if media.size == 0:
            raise SampleError(f"empty file (0 bytes): {media}")
        return media.size
    shard_size = checked_file(media.shard).st_size
    if media.size == 0:
        raise SampleError(f"empty file (0 bytes): {media}")
    if shard_size < media.offset + media.size:  # cut since it was listed
        raise SampleError(
            f"truncated shard: {media.shard} ends at byte {shard_size:,}, inside member {media.name!r} "
            f"(bytes {media.offset:,} to {media.offset + media.size:,})"
        )
    return media.size


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
