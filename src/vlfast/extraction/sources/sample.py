"""The leaf of extraction's inputs: what a sample is, what a bad input row is, and what the store can hold.

A *sample* is one image, one video file, or one clip of frame images, optionally with a text; for
``embedding`` also a text alone (kind ``"text"``, no paths). Ids key the feature store, so they must be
unique and storable. Nothing is silently dropped: a row or entry that cannot become a sample is an
:class:`InputProblem`, recorded in OUT/errors while the run goes on; an input giving nothing at all raises
(:func:`require_samples`). Imports nothing from the other sources: they all import this.
"""

from __future__ import annotations

import os
import re
import sys
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import PurePosixPath
from typing import Literal, TypeVar

from vlfast.errors import InputRefused
from vlfast.extraction.ids import MAX_ID_BYTES
from vlfast.pixels.media import Media, MediaObject

__all__ = [
    "IMAGE_SUFFIXES",
    "MANIFEST_SUFFIXES",
    "MAX_ID_BYTES",
    "SUPPORTED",
    "VIDEO_SUFFIXES",
    "EmptyInput",
    "InputProblem",
    "Kind",
    "Member",
    "Sample",
    "display_path",
    "is_posix_form",
    "kind_of",
    "posix_form",
    "require_samples",
    "quoted",
    "storable",
    "suffix_of",
    "unreadable_json",
]

IMAGE_SUFFIXES = frozenset(
    {".jpg", ".jpeg", ".png", ".webp", ".bmp", ".gif", ".tif", ".tiff", ".ppm", ".pgm", ".jfif"}
)
VIDEO_SUFFIXES = frozenset({".mp4", ".mkv", ".webm", ".avi", ".mov", ".m4v", ".mpg", ".mpeg", ".ts", ".flv"})
MANIFEST_SUFFIXES = frozenset({".jsonl", ".csv", ".parquet"})

Kind = Literal["image", "video", "frames", "text"]

_SHOWN_PROBLEMS = 5  # how many problems an input's refusal lists
# what an input of each kind that holds no sample and no problem is refused with ({} is its name)
_EMPTY = {
    "folder": "input folder {} holds no image or video file (hidden files are skipped and symlinked folders "
    "are not entered)",
    "WebDataset shards": "WebDataset shards {} hold no image or video member",
    "manifest": "manifest {} has no rows",
}
_SURROGATE = re.compile("[\ud800-\udfff]")
_Samples = TypeVar("_Samples", bound=Sequence["Sample"])


# A sample's bytes read in place (a TarMember, a RemoteFile); ``str()`` names it in error records.
Member = MediaObject


@dataclass(frozen=True, slots=True)  # slots: 15% less memory per sample in a listing of millions
class Sample:
    """One unit of extraction. ``paths`` holds one file, or the frames of a clip in order; for a tar member
    or a URL, its display name, and ``member`` says where its bytes are. ``text`` and ``instruction`` are
    what an ``embedding`` embeds with the media; a ``"text"`` sample has no paths and a non-empty ``text``."""

    id: str
    kind: Kind
    paths: tuple[str, ...]
    prompt: str | None = None
    member: Member | None = None
    text: str | None = None
    instruction: str | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.id, str) or not self.id:
            raise InputRefused(f"sample id must be a non-empty string, got {self.id!r}")
        if self.kind not in ("image", "video", "frames", "text"):
            raise InputRefused(
                f"sample {self.id!r}: kind must be image, video, frames or text, got {self.kind!r}"
            )
        for name in ("prompt", "text", "instruction"):
            if getattr(self, name) is not None and not isinstance(getattr(self, name), str):
                raise InputRefused(f"sample {self.id!r}: {name} must be a string or None")
        if self.kind == "text":
            if self.paths or self.member is not None or not self.text:
                raise InputRefused(f"sample {self.id!r}: a text sample has a non-empty text and no paths")
            return
        if not self.paths or not all(isinstance(p, str) and p for p in self.paths):
            raise InputRefused(f"sample {self.id!r}: paths must be non-empty strings, got {self.paths!r}")
        if self.kind != "frames" and len(self.paths) != 1:
            raise InputRefused(
                f"sample {self.id!r}: a {self.kind} has exactly one path, got {len(self.paths)}"
            )
        if self.member is not None and self.kind == "frames":
            raise InputRefused(
                f"sample {self.id!r}: a tar member or URL is one image or video, not a frame list"
            )

    @property
    def media(self) -> Media:
        """What decoding reads: its member, else its first file."""
        return self.member if self.member is not None else self.paths[0]

    @property
    def source(self) -> str:
        """The input as a user would name it in an error report."""
        if not self.paths:
            return f"text {quoted(self.text or '', 60)}"
        return self.paths[0] if len(self.paths) == 1 else f"{self.paths[0]} (+{len(self.paths) - 1} frames)"


@dataclass(frozen=True)
class InputProblem:
    """An input row or folder entry that cannot become a sample; recorded in OUT/errors, the run goes on."""

    where: str  # the file and line/row ("clips.jsonl line 7", "clips.csv row 3"), or a folder entry's path
    reason: str  # plain words saying what is wrong and what to do
    id: str | None = None  # the row's id when it is valid text, else None


class EmptyInput(InputRefused):
    """An input that holds no sample and no bad row: most likely the wrong input was named."""


def _suffix_list(suffixes: Iterable[str]) -> str:
    return " ".join(sorted(suffixes))


SUPPORTED = (
    f"images: {_suffix_list(IMAGE_SUFFIXES)}; videos: {_suffix_list(VIDEO_SUFFIXES)}; "
    f"manifests: {_suffix_list(MANIFEST_SUFFIXES)} with a 'path' column; "
    "WebDataset: .tar shards or a quoted pattern like 'shards/{000000..000099}.tar'"
)


def is_posix_form(path: str) -> bool:
    """Whether ``PurePosixPath(path)`` keeps ``path`` as it is: no empty or ``.`` component to fold away."""
    folds = "//" in path or "/./" in path or path.startswith("./") or path.endswith(("/", "/."))
    return bool(path) and path != "." and not folds


def posix_form(path: str) -> str:
    """``PurePosixPath(path).as_posix()``, what an id taken from a path is; 5x quicker than pathlib where
    ``path`` is already in that form (the common case)."""
    return path if is_posix_form(path) else PurePosixPath(path).as_posix()


def suffix_of(path: str) -> str:
    """``PurePosixPath(path).suffix``, computed from the string when the path is already in posix form."""
    if not is_posix_form(path):
        return PurePosixPath(path).suffix
    name = path.rpartition("/")[2]
    i = name.rfind(".")
    return name[i:] if 0 < i < len(name) - 1 else ""


def kind_of(path: str) -> Kind:
    """A single file's kind, by its suffix: a video, else an image."""
    return "video" if suffix_of(path).lower() in VIDEO_SUFFIXES else "image"


def quoted(text: str, limit: int = 80) -> str:
    """``text`` safe to print and store: escapes (a non-UTF-8 byte shows as \\udcff), cut to ``limit``."""
    r = repr(text)
    return r if len(r) <= limit else r[: limit - 4] + "...'"


def display_path(path: str | os.PathLike) -> str:
    """A path as a problem's ``where``: non-UTF-8 bytes (surrogates) shown as \\xff."""
    text = os.fsdecode(path)
    try:
        raw = text.encode("utf-8", "surrogateescape")
    except UnicodeEncodeError:  # a lone surrogate that no byte made: show it escaped
        return text.encode("utf-8", "backslashreplace").decode("utf-8")
    return raw.decode("utf-8", "backslashreplace")


def unreadable_json(e: ValueError | RecursionError) -> str:
    """Why valid JSON could not be read all the same: an integer past Python's limit on digits (a plain
    ValueError) or nesting past the recursion limit."""
    if isinstance(e, RecursionError):
        return "JSON nested too deeply to read (lists or objects within each other); flatten it"
    digits = re.search(r"value has (\d+) digits", str(e))
    size = f"{int(digits.group(1)):,} digits" if digits else "too many digits"
    return (
        f"JSON that Python cannot read: an integer of {size} (its limit is "
        f"{sys.get_int_max_str_digits():,}); write the number in quotes, as text"
    )


def _text_problem(what: str, text: str) -> str | None:
    """Why ``text`` cannot be stored as UTF-8, or None."""
    m = _SURROGATE.search(text)
    if m is None:
        return None
    ch = ord(m.group())
    if 0xDC80 <= ch <= 0xDCFF:  # a byte that did not decode, escaped by surrogateescape or os.fsdecode
        byte = ch - 0xDC00
        return f"{what} holds bytes that are not valid UTF-8 (0x{byte:02x}); rename it or save it as UTF-8"
    return (
        f"{what} holds a lone surrogate (\\u{ch:04x}), which is not valid Unicode text and cannot be stored"
    )


def storable(
    sample_id: str,
    paths: Sequence[str],
    prompt: str | None,
    *,
    id_from_path: bool = False,
    texts: dict[str, str | None] | None = None,
) -> str | None:
    """Why a sample with these fields could not be stored or loaded, or None. The store writes ids as UTF-8
    and the loaders hand paths to the OS, so a lone surrogate or a NUL would crash far from the row."""
    what = "id (taken from the path)" if id_from_path else "id"
    if reason := _text_problem(what, sample_id):
        return reason
    n = len(sample_id.encode("utf-8"))
    if n > MAX_ID_BYTES:
        return f"{what} is {n} bytes in UTF-8, longer than the {MAX_ID_BYTES}-byte limit; give a shorter id"
    for p in paths:
        if reason := _text_problem(f"path {quoted(p)}", p):
            return reason
        if "\x00" in p:
            return f"path {quoted(p)} holds a NUL character, which no file name can hold"
    for name, value in {"prompt": prompt, **(texts or {})}.items():
        if value is not None and (reason := _text_problem(name, value)):
            return reason
    return None


def require_samples(
    kind: str, name: str, samples: _Samples, problems: list[InputProblem]
) -> tuple[_Samples, list[InputProblem]]:
    """``(samples, problems)``, refused (:class:`EmptyInput` without problems) when there is no sample."""
    if len(samples):
        return samples, problems
    if not problems:
        empty = _EMPTY.get(kind, _EMPTY["manifest"])  # any other kind is a manifest's, as callers name it
        raise EmptyInput(f"{empty.format(name)}; supported: {SUPPORTED}")
    first = "; ".join(f"{p.where}: {p.reason}" for p in problems[:_SHOWN_PROBLEMS])
    more = len(problems) - _SHOWN_PROBLEMS
    listed = f"{len(problems)} problem(s): {first}" + (f"; and {more} more" if more > 0 else "")
    raise InputRefused(f"{kind} {name} has no usable sample: {listed}")
