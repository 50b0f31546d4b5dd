"""Inputs at fsspec URLs (``s3://bucket/key``, ``memory://...``: INPUT, or a manifest's ``path`` values),
read in place through :mod:`vlfast.extraction.objstore`. A purely local run never imports fsspec.
Credentials are never shown: a :class:`RemoteFile`'s repr and every message name the URL only.
"""

from __future__ import annotations

import dataclasses
import functools
import io
import os
import shutil
import tempfile
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from vlfast.extraction import objstore
from vlfast.extraction.sources.folder import is_media_name, sorted_found
from vlfast.extraction.sources.kept import KeptListings, remote_manifest_identity
from vlfast.extraction.sources.manifest import load_manifest
from vlfast.extraction.sources.sample import (
    IMAGE_SUFFIXES,
    MANIFEST_SUFFIXES,
    VIDEO_SUFFIXES,
    EmptyInput,
    InputProblem,
    Sample,
    kind_of,
    require_samples,
    storable,
)
from vlfast.extraction.sources.table import SampleTable, SampleTableBuilder
from vlfast.extraction.sources.webdataset import is_shard_input, load_shards
from vlfast.pixels.media import SampleError

__all__ = ["RemoteFile", "attach", "load_url", "with_remote"]


@dataclass(frozen=True, slots=True)
class RemoteFile:
    """One sample's media at a URL, opened through fsspec in the decode worker. ``str()`` is the URL."""

    url: str
    options_json: str = field(default="{}", repr=False)  # JSON: hashable and picklable

    def __str__(self) -> str:
        return self.url

    def size(self) -> int:
        """Bytes of the object; FileNotFoundError when it does not exist, OSError when it cannot be read."""
        fs, path = objstore.filesystem(self.url, self.options_json)
        info = objstore.named_call(fs, lambda: fs.info(path), self.url, self.options_json, "access")
        if info.get("type") == "directory":
            raise IsADirectoryError(f"not a file: {self.url}")
        return int(info.get("size") or 0)

    def open(self) -> io.IOBase:
        """The object's bytes as a seekable binary file (PIL and PyAV take it); raises OSError."""
        fs, path = objstore.filesystem(self.url, self.options_json)
        try:
            return objstore.retrying(fs, lambda: fs.open(path, "rb"), self.url, self.options_json)
        except FileNotFoundError:
            raise FileNotFoundError(f"file not found: {self.url}") from None
        except OSError as e:
            reason = objstore.masked(objstore.error_reason(e), self.options_json)
            raise OSError(f"cannot open {self.url}: {reason}") from None

    def read_bytes(self) -> bytes:
        """The whole object (an image); TransientReadError when the store keeps failing transiently."""
        fs, path = objstore.filesystem(self.url, self.options_json)
        return objstore.named_call(fs, lambda: fs.cat_file(path), self.url, self.options_json)

    @property
    def at_url(self) -> bool:
        return True

    def checked_size(self) -> int:
        """Bytes of the object; SampleError where it is missing, unreadable or empty."""
        try:
            size = self.size()
        except OSError as e:  # the message names the URL, never the storage options
            raise SampleError(str(e)) from None
        if size == 0:
            raise SampleError(f"empty file (0 bytes): {self}")
        return size

    def read_failure(self, e: BaseException) -> Exception | None:
        """The store's TransientReadError where ``e`` is its transient failure mid-read."""
        return objstore.transient_error(str(self), e) if objstore.is_transient(e) else None


def load_url(
    url: str, storage_options: Mapping[str, Any] | None = None, kept: KeptListings | None = None
) -> tuple[SampleTable, list[InputProblem]]:
    """The samples of a folder URL (listed like a local folder), a manifest URL, WebDataset shards at a URL,
    or one image or video URL (its id is the URL). The INPUT is probed first: an unreachable endpoint, a
    missing bucket or refused credentials raise RemoteInputError naming the URL."""
    options = objstore.encode_options(storage_options)
    suffix = os.path.splitext(url.rstrip("/"))[1].lower()
    if is_shard_input(url):
        return require_samples("WebDataset shards", url, *load_shards(url, storage_options, kept))
    info = objstore.probe(url, options)
    if suffix in MANIFEST_SUFFIXES:  # copied to a temporary file and read as a local one
        identity = remote_manifest_identity(url, info) if kept is not None else None
        load = functools.partial(_read_remote_manifest, url, suffix, storage_options)
        return manifest_samples(url, load, kept, identity, dict(storage_options or {}))
    if info.get("type") != "directory":
        if suffix not in IMAGE_SUFFIXES | VIDEO_SUFFIXES:
            raise objstore.RemoteInputError(f"input {url} is neither a folder nor an image or video file")
        return SampleTable.of([Sample(url, kind_of(url), (url,), member=RemoteFile(url, options))]), []
    return _load_folder_url(url, options)


def _load_folder_url(url: str, options: str) -> tuple[SampleTable, list[InputProblem]]:
    """A folder at a URL, as :func:`~vlfast.extraction.sources.folder.load_folder` scans a local one."""
    fs, root = objstore.filesystem(url, options)
    root = root.rstrip("/")
    found: list[tuple[tuple[str, ...], Sample | InputProblem]] = []
    for path in fs.find(root, withdirs=False, detail=False):
        rel = path[len(root) :].lstrip("/") if path.startswith(root) else path
        parts = tuple(rel.split("/"))
        if any(p.startswith(".") for p in parts) or not is_media_name(parts[-1]):
            continue  # hidden files and folders, and other suffixes, as in a local scan
        file_url = fs.unstrip_protocol(path)
        if reason := storable(rel, (), None):
            found.append((parts, InputProblem(file_url, reason)))
        else:
            member = RemoteFile(file_url, options)
            found.append((parts, Sample(rel, kind_of(rel), (file_url,), member=member)))
    samples, problems = sorted_found(found)
    if not samples and not problems:
        raise EmptyInput(f"input folder {url} holds no image or video file (hidden files are skipped)")
    return samples, problems


def manifest_samples(
    name: str,
    load: Callable[[], tuple[SampleTable, list[InputProblem]]],
    kept: KeptListings | None,
    identity: list[Any] | None,
    storage_options: Mapping[str, Any] | None,
) -> tuple[SampleTable, list[InputProblem]]:
    """A manifest's samples: ``load()``'s, or the table ``kept`` keeps for ``identity``, with
    :func:`with_remote` applied; refused when it gives none (:func:`require_samples`)."""
    got = load() if kept is None else kept.table(identity, load)
    return require_samples("manifest", name, *with_remote(got, storage_options))


def _read_remote_manifest(
    url: str, suffix: str, storage_options: Mapping[str, Any] | None
) -> tuple[SampleTable, list[InputProblem]]:
    options = objstore.encode_options(storage_options)
    with tempfile.TemporaryDirectory(prefix="vlfast-manifest-") as tmp:
        local = Path(tmp) / f"manifest{suffix}"
        try:
            with RemoteFile(url, options).open() as src, local.open("wb") as dst:
                shutil.copyfileobj(src, dst, 1 << 20)
        except FileNotFoundError:
            raise FileNotFoundError(f"manifest {url} does not exist") from None
        except (OSError, objstore.TransientReadError) as e:
            raise objstore.RemoteInputError(f"manifest {url} cannot be read: {e}") from None
        return load_manifest(local, name=url, base=url.rsplit("/", 1)[0])


def attach(
    samples: Sequence[Sample], storage_options: Mapping[str, Any] | None = None
) -> tuple[SampleTable, list[InputProblem]]:
    """``samples`` with a :class:`RemoteFile` on each whose path is a URL (a frame list of URLs is a
    problem). Each bucket is probed once, so a bad endpoint or credentials raise before any work; a missing
    object is left to the worker to record."""
    options = objstore.encode_options(storage_options)
    out = SampleTableBuilder()
    problems: list[InputProblem] = []
    probed: set[str] = set()
    for s in samples:
        if s.member is not None or not any(objstore.is_url(p) for p in s.paths):
            out.append(s)
            continue
        if len(s.paths) > 1:
            problems.append(
                InputProblem(s.source, "a frame list of URLs is not supported yet; give a video URL", s.id)
            )
            continue
        url = s.paths[0]
        bucket = objstore.bucket_root(url)
        if bucket is not None and bucket not in probed:
            probed.add(bucket)
            objstore.probe(bucket, options)
        out.append(dataclasses.replace(s, member=RemoteFile(url, options)))
    return out.build(), problems


def with_remote(
    got: tuple[SampleTable, list[InputProblem]], storage_options: Mapping[str, Any] | None
) -> tuple[SampleTable, list[InputProblem]]:
    """``got`` with :func:`attach` applied when a sample's path is a URL (so fsspec only then)."""
    samples, problems = got
    if not samples.any_path(objstore.is_url):
        return samples, problems
    samples, more = attach(samples, storage_options)
    return samples, problems + more
