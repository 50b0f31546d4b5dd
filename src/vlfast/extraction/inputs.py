"""What to extract: samples read from a folder or a manifest, with their ids checked for duplicates.

A *sample* is one image, one video file, or one clip given as a list of frame images. Ids are what the
feature store keys on, so they must be unique: a folder's ids are paths relative to it, a manifest's are
its ``id`` column (or the path when the column is absent). A repeated id keeps its first row; the others
are returned as :class:`Duplicate` records for the errors file, never silently dropped.
"""

from __future__ import annotations

import csv
import json
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

__all__ = [
    "IMAGE_SUFFIXES",
    "VIDEO_SUFFIXES",
    "Duplicate",
    "Sample",
    "dedupe",
    "read_inputs",
    "read_manifest",
    "scan_folder",
]

IMAGE_SUFFIXES = frozenset(
    {".jpg", ".jpeg", ".png", ".webp", ".bmp", ".gif", ".tif", ".tiff", ".ppm", ".pgm", ".jfif"}
)
VIDEO_SUFFIXES = frozenset({".mp4", ".mkv", ".webm", ".avi", ".mov", ".m4v", ".mpg", ".mpeg", ".ts", ".flv"})
MANIFEST_SUFFIXES = frozenset({".jsonl", ".csv", ".parquet"})

Kind = Literal["image", "video", "frames"]


@dataclass(frozen=True)
class Sample:
    """One unit of extraction. ``paths`` holds one file, or the frames of a clip in order."""

    id: str
    kind: Kind
    paths: tuple[str, ...]
    prompt: str | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.id, str) or not self.id:
            raise ValueError(f"sample id must be a non-empty string, got {self.id!r}")
        if self.kind not in ("image", "video", "frames"):
            raise ValueError(f"sample {self.id!r}: kind must be image, video or frames, got {self.kind!r}")
        if not self.paths or not all(isinstance(p, str) and p for p in self.paths):
            raise ValueError(f"sample {self.id!r}: paths must be non-empty strings, got {self.paths!r}")
        if self.kind != "frames" and len(self.paths) != 1:
            raise ValueError(f"sample {self.id!r}: a {self.kind} has exactly one path, got {len(self.paths)}")
        if self.prompt is not None and not isinstance(self.prompt, str):
            raise TypeError(f"sample {self.id!r}: prompt must be a string or None")

    @property
    def source(self) -> str:
        """The input as a user would name it in an error report."""
        return self.paths[0] if len(self.paths) == 1 else f"{self.paths[0]} (+{len(self.paths) - 1} frames)"


@dataclass(frozen=True)
class Duplicate:
    """A row whose id was already taken by an earlier row (which is the one extracted)."""

    id: str
    source: str
    first_source: str

    @property
    def reason(self) -> str:
        return f"duplicate id: already given to {self.first_source}; this row is skipped"


def _kind_of(path: str) -> Kind:
    return "video" if Path(path).suffix.lower() in VIDEO_SUFFIXES else "image"


def scan_folder(root: str | Path) -> list[Sample]:
    """Every image and video under ``root`` (recursive, sorted, hidden files skipped); ids are relative paths.

    Files with other suffixes are ignored: a folder often holds captions or metadata beside the media.
    A file with a media suffix but other content is kept and fails later with a recorded reason.
    """
    root = Path(root)
    if not root.is_dir():
        raise FileNotFoundError(f"input folder {root} does not exist")
    samples = []
    for path in sorted(root.rglob("*")):
        rel = path.relative_to(root)
        if any(part.startswith(".") for part in rel.parts) or not path.is_file():
            continue
        suffix = path.suffix.lower()
        if suffix in IMAGE_SUFFIXES or suffix in VIDEO_SUFFIXES:
            samples.append(Sample(rel.as_posix(), _kind_of(path.name), (str(path),)))
    return samples


def _manifest_rows(path: Path) -> list[dict[str, Any]]:
    suffix = path.suffix.lower()
    if suffix == ".jsonl":
        rows = []
        with path.open(encoding="utf-8") as f:
            for lineno, line in enumerate(f, 1):
                if not line.strip():
                    continue
                try:
                    row = json.loads(line)
                except json.JSONDecodeError as e:
                    raise ValueError(f"{path}:{lineno}: not valid JSON ({e.msg})") from None
                if not isinstance(row, dict):
                    raise ValueError(f"{path}:{lineno}: each line must be a JSON object")
                rows.append(row)
        return rows
    if suffix == ".csv":
        with path.open(encoding="utf-8", newline="") as f:
            return list(csv.DictReader(f))
    if suffix == ".parquet":
        import pyarrow.parquet as pq

        return pq.read_table(path).to_pylist()
    raise ValueError(f"{path}: a manifest must end in .jsonl, .csv or .parquet")


def _paths_field(value: Any, where: str) -> list[str]:
    """A path, a list of frame paths, or (in CSV) a JSON list written as a string."""
    if isinstance(value, str) and value.lstrip().startswith("["):
        try:
            value = json.loads(value)
        except json.JSONDecodeError:
            raise ValueError(f"{where}: path looks like a list but is not valid JSON") from None
    if isinstance(value, str):
        return [value]
    if isinstance(value, (list, tuple)) and value and all(isinstance(v, str) for v in value):
        return list(value)
    raise ValueError(f"{where}: path must be a string or a non-empty list of strings, got {value!r}")


def read_manifest(path: str | Path) -> list[Sample]:
    """Samples from a JSONL, CSV or Parquet manifest with columns ``path`` and optionally ``id``, ``prompt``.

    ``path`` is an image, a video, or a list of frame images forming one clip (in CSV, a JSON list).
    Relative paths are resolved against the manifest's folder. Missing files are not checked here: they
    fail at load time and are recorded as errors, so one bad row never stops a run.
    """
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"manifest {path} does not exist")
    base = path.parent
    samples = []
    for i, row in enumerate(_manifest_rows(path)):
        where = f"{path} row {i + 1}"
        raw = row.get("path", row.get("paths"))
        if raw is None or raw == "":
            raise ValueError(f"{where}: no 'path' column value (columns: {sorted(row)})")
        paths = [p if Path(p).is_absolute() else str(base / p) for p in _paths_field(raw, where)]
        sid = row.get("id")
        sid = str(sid) if sid not in (None, "") else Path(_paths_field(raw, where)[0]).as_posix()
        prompt = row.get("prompt") or None
        kind: Kind = "frames" if len(paths) > 1 or isinstance(raw, list) else _kind_of(paths[0])
        if kind == "frames" and len(paths) == 1:
            kind = "image"  # a one-frame clip is an image
        samples.append(Sample(sid, kind, tuple(paths), None if prompt is None else str(prompt)))
    return samples


def read_inputs(source: str | Path | Sequence[Sample]) -> list[Sample]:
    """A folder, a manifest file, a single media file, or samples already built."""
    if isinstance(source, (list, tuple)):
        return [s if isinstance(s, Sample) else _coerce(s) for s in source]
    path = Path(source)
    if path.is_dir():
        return scan_folder(path)
    if path.suffix.lower() in MANIFEST_SUFFIXES:
        return read_manifest(path)
    if path.is_file() and (path.suffix.lower() in IMAGE_SUFFIXES | VIDEO_SUFFIXES):
        return [Sample(path.name, _kind_of(path.name), (str(path),))]
    raise FileNotFoundError(
        f"input {path} is neither a folder, a manifest (.jsonl, .csv, .parquet) nor an image or video file"
    )


def _coerce(item: Any) -> Sample:
    if isinstance(item, dict):
        paths = _paths_field(item.get("path", item.get("paths")), f"sample {item.get('id')!r}")
        kind: Kind = "frames" if len(paths) > 1 else _kind_of(paths[0])
        return Sample(str(item.get("id") or paths[0]), kind, tuple(paths), item.get("prompt"))
    raise TypeError(f"inputs must be a path, or a list of Sample or dict rows; got {type(item).__name__}")


def dedupe(samples: Iterable[Sample]) -> tuple[list[Sample], list[Duplicate]]:
    """Keep the first sample of each id; the rest become :class:`Duplicate` records (in input order)."""
    first: dict[str, Sample] = {}
    dups: list[Duplicate] = []
    for s in samples:
        if s.id in first:
            dups.append(Duplicate(s.id, s.source, first[s.id].source))
        else:
            first[s.id] = s
    return list(first.values()), dups
