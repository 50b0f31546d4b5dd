"""A local folder as extraction input: every image and video under it, recursively, ids relative to it.

Other suffixes (captions, metadata) and hidden files and folders are skipped. A symlink to a file is that
file (its id is the link's name). A media-named dangling symlink, symlink loop, unreadable folder or
non-UTF-8 name is an :class:`~vlfast.extraction.sources.sample.InputProblem`.
"""

from __future__ import annotations

import errno
import os
import stat
from pathlib import Path

from vlfast.extraction.sources.sample import (
    IMAGE_SUFFIXES,
    VIDEO_SUFFIXES,
    InputProblem,
    Sample,
    display_path,
    kind_of,
    storable,
)
from vlfast.extraction.sources.table import SampleTable

__all__ = ["is_media_name", "load_folder", "sorted_found"]


def is_media_name(name: str) -> bool:
    """Whether a folder entry's file name is one a scan takes: not hidden, an image or video suffix."""
    suffix = os.path.splitext(name)[1].lower()
    return not name.startswith(".") and (suffix in IMAGE_SUFFIXES or suffix in VIDEO_SUFFIXES)


def _unreadable_reason(path: Path) -> str | None:
    """Why a media-named entry is not a file that can be read (a pipe, a dangling link...), or None."""
    try:
        mode = os.stat(path).st_mode  # follows a symlink: a link to a file is that file
    except OSError as e:
        if e.errno == errno.ELOOP:
            return "symlink loop: the link never reaches a file; fix or remove it"
        if isinstance(e, FileNotFoundError) and path.is_symlink():
            target = display_path(os.readlink(path))
            return f"dangling symlink -> {target}: the target does not exist; fix or remove the link"
        return f"cannot be read ({e.strerror})"
    if not stat.S_ISREG(mode):
        return "not a regular file (a pipe, socket or device); give the media file itself"
    return None


def load_folder(root: Path) -> tuple[SampleTable, list[InputProblem]]:
    """The samples under ``root`` sorted by path components, and the problems."""
    if not root.is_dir():
        raise FileNotFoundError(f"input folder {display_path(root)} does not exist")
    found: list[tuple[tuple[str, ...], Sample | InputProblem]] = []

    def unreadable(e: OSError) -> None:
        key = Path(e.filename).relative_to(root).parts if e.filename else ()
        reason = f"folder cannot be read ({e.strerror}); its files are skipped"
        found.append((key, InputProblem(display_path(e.filename or root), reason)))

    # os.walk without followlinks lists a symlinked folder but never enters it, as Path.rglob does: a link
    # loop cannot trap the scan, and a folder linked twice is not extracted twice.
    for dirpath, dirnames, filenames in os.walk(root, onerror=unreadable):
        dirnames[:] = [d for d in dirnames if not d.startswith(".")]  # hidden folders are skipped whole
        for fname in filenames:
            if not is_media_name(fname):
                continue
            path = Path(dirpath, fname)
            rel = path.relative_to(root)
            sid = rel.as_posix()
            # Only the id is checked: a path from the OS opens as it is, even with non-UTF-8 bytes in it,
            # but the id (a name under root holding such bytes) must be stored as UTF-8.
            id_reason = storable(sid, (), None)
            reason = _unreadable_reason(path) or id_reason
            if reason is not None:
                shown_id = sid if id_reason is None else None
                found.append((rel.parts, InputProblem(display_path(path), reason, shown_id)))
            else:
                found.append((rel.parts, Sample(sid, kind_of(fname), (str(path),))))
    return sorted_found(found)


def sorted_found(
    found: list[tuple[tuple[str, ...], Sample | InputProblem]],
) -> tuple[SampleTable, list[InputProblem]]:
    """A scan's samples and problems, by path components (the order Path sorting gives)."""
    found.sort(key=lambda kv: kv[0])
    samples = SampleTable.of(x for _, x in found if isinstance(x, Sample))
    return samples, [x for _, x in found if isinstance(x, InputProblem)]
