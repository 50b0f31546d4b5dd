"""How a video file is shorter than its own container says: the reason recorded for a cut-off video.

FFmpeg reports a cut-off file in many ways, none of which tells a user the file is truncated. After a video
fails to decode, these walks over the container's top-level structure say whether, and where, it ends early.
"""

from __future__ import annotations

import os
import struct
from typing import Any

__all__ = ["container_truncation"]


def _ebml_vint(data: bytes, pos: int, *, keep_marker: bool) -> tuple[int, int] | None:
    """(value, position after it) of the EBML variable-length integer at ``pos``; None if cut or invalid.
    An ID keeps its length marker; a size drops it (an all-ones size, "unknown", is returned as -1)."""
    if pos >= len(data) or data[pos] == 0:
        return None
    length = 9 - data[pos].bit_length()
    if pos + length > len(data):
        return None
    raw = int.from_bytes(data[pos : pos + length], "big")
    if keep_marker:
        return raw, pos + length
    value = raw & ((1 << (7 * length)) - 1)
    return (-1 if value == (1 << (7 * length)) - 1 else value), pos + length


_MP4_FIRST_BOXES = (b"ftyp", b"styp", b"moov", b"mdat", b"free", b"skip", b"wide")


def _mp4_truncation(f, path: str, size: int) -> str | None:
    """ISO-BMFF (mp4, mov, m4v, 3gp): the top-level boxes must fit the file, and one must be the index."""
    kinds, pos = [], 0
    while pos < size:
        f.seek(pos)
        header = f.read(16)
        length, kind = struct.unpack(">I4s", header[:8]) if len(header) >= 8 else (None, b"")
        if length == 1:
            length = struct.unpack(">Q", header[8:16])[0] if len(header) >= 16 else None
        elif length == 0:  # the last box, to the end of the file
            length = size - pos
        if length is None:
            return f"{path} ends at byte {size}, inside the header of an mp4 box"
        if length < 8 or not all(32 <= c < 127 or c == 0xA9 for c in kind):
            return None  # not a box header: corrupt, not recognisably cut
        if pos + length > size:
            name = kind.decode("latin-1")
            return f"{path} ends at byte {size}, inside its mp4 '{name}' box that runs to byte {pos + length}"
        kinds.append(kind)
        pos += length
    if b"moov" not in kinds and b"moof" not in kinds:
        return f"{path} has no mp4 'moov' box: it ends at byte {size}, before its index"
    return None


def _matroska_truncation(f, path: str, size: int) -> str | None:
    """Matroska / WebM: the EBML header, then the Segment, whose size the muxer writes when it finishes."""
    head = f.read(64)
    ebml = _ebml_vint(head, 4, keep_marker=False)
    if ebml is None or ebml[0] < 0:
        return None
    start = ebml[1] + ebml[0]
    f.seek(start)
    seg = f.read(12)
    if start >= size:
        return f"{path} ends at byte {size}, before its Matroska Segment"
    ident = _ebml_vint(seg, 0, keep_marker=True)
    length = None if ident is None or ident[0] != 0x18538067 else _ebml_vint(seg, ident[1], keep_marker=False)
    if length is None and start + len(seg) >= size and b"\x18\x53\x80\x67".startswith(seg[:4]):
        return f"{path} ends at byte {size}, inside the header of its Matroska Segment"
    if length is None or length[0] < 0:  # not a Segment, or a live-written one of unknown size
        return None
    end = start + length[1] + length[0]
    if end > size:
        return f"{path} ends at byte {size}, inside its Matroska Segment that runs to byte {end}"
    return None


def _riff_truncation(f, path: str, size: int) -> str | None:
    """AVI: its RIFF chunks (more than one past 1 GB) must fit the file."""
    pos = 0
    while pos + 8 <= size:
        f.seek(pos)
        tag, length = struct.unpack("<4sI", f.read(8))
        if tag != b"RIFF":
            return None
        if pos + 8 + length > size:
            return f"{path} ends at byte {size}, inside its RIFF chunk that runs to byte {pos + 8 + length}"
        pos += 8 + length + (length & 1)
    return None


def container_truncation(path: str | os.PathLike | Any, size: int) -> str | None:
    """How the file is shorter than its own container says, or None when that cannot be told.

    Reads only top-level headers: ISO-BMFF boxes (mp4, mov, m4v, 3gp), the Matroska/WebM Segment, the RIFF
    chunks of an AVI; other containers give None. ``path`` may also be anything with an ``open()`` giving a
    seekable binary file.
    """
    try:
        with open(path, "rb") if isinstance(path, (str, os.PathLike)) else path.open() as f:
            head = f.read(8)
            f.seek(0)
            if len(head) == 8 and head[4:8] in _MP4_FIRST_BOXES:
                return _mp4_truncation(f, path, size)
            if head[:4] == b"\x1a\x45\xdf\xa3":
                return _matroska_truncation(f, path, size)
            if head[:4] == b"RIFF":
                return _riff_truncation(f, path, size)
    except (OSError, struct.error):
        pass
    return None
