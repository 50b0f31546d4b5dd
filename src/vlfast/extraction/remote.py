"""Object storage as extraction input: fsspec URLs (``s3://bucket/key``, ``memory://...``) read in place.

INPUT, a folder's files and a manifest's ``path`` values may be URLs with a scheme (``s3://``, ``gs://``,
``memory://``, ``file://``...). Local paths never reach this module, so a purely local run imports no fsspec.

* :func:`load_url` lists a folder URL as :func:`~vlfast.extraction.inputs.load_inputs` scans a local
  folder (recursive, hidden entries skipped, ids relative to the folder), takes a single media URL (its
  id is the URL), or reads a manifest at a URL (its relative paths are relative to its URL). The INPUT is probed first: an unreachable endpoint, a missing bucket or refused
  credentials raise :class:`RemoteInputError` naming the URL before any work.
* :func:`attach` gives each manifest sample whose path is a URL a :class:`RemoteFile` (its id, when the
  manifest has none, is the URL) after probing each bucket once; a missing object is found by the decode
  worker and recorded like a missing local file.
* :class:`RemoteFile` is what the decode workers open, as they open a tar member: images are read whole,
  videos through fsspec's seekable file object for PyAV.

Credentials come from the environment and fsspec's configuration, plus ``storage_options`` (passed to
``fsspec.filesystem``). They are never shown: a :class:`RemoteFile`'s repr and every message name the URL
only, and any option value that a library error echoes is masked.
"""

from __future__ import annotations

import dataclasses
import io
import json
import os
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from vlfast.extraction.inputs import InputProblem, Sample

__all__ = ["RemoteFile", "RemoteInputError", "attach", "is_url", "load_url", "probe_out"]

_SCHEME = re.compile(r"^([A-Za-z][A-Za-z0-9+.-]*)://")
# Stores whose first path component is a bucket: probed once per bucket before any work.
_BUCKET_PROTOCOLS = frozenset({"s3", "s3a", "gs", "gcs", "az", "abfs", "abfss", "oss", "r2"})
_INSTALL = {"s3": "s3fs", "s3a": "s3fs", "gs": "gcsfs", "gcs": "gcsfs", "az": "adlfs", "abfs": "adlfs"}


class RemoteInputError(ValueError):
    """An INPUT URL that cannot be read at all (endpoint unreachable, bucket missing, access refused)."""


def is_url(source: Any) -> bool:
    """Whether ``source`` is text with a ``scheme://`` prefix (a local path never is)."""
    return isinstance(source, str) and _SCHEME.match(source) is not None


def _options_json(options: Mapping[str, Any] | None) -> str:
    if options is None:
        return "{}"
    if not isinstance(options, Mapping):
        raise TypeError(f"storage_options must be a dict, got {type(options).__name__}")
    return json.dumps(dict(options), sort_keys=True)


def _secrets(options_json: str) -> list[str]:
    """Every text value in the options (nested too): what a message must never show."""
    out: list[str] = []

    def walk(v: Any) -> None:
        if isinstance(v, str) and len(v) >= 4:
            out.append(v)
        elif isinstance(v, dict):
            for x in v.values():
                walk(x)
        elif isinstance(v, list):
            for x in v:
                walk(x)

    walk(json.loads(options_json))
    return out


def _masked(text: str, options_json: str) -> str:
    for secret in _secrets(options_json):
        text = text.replace(secret, "***")
    return text


def _filesystem(url: str, options_json: str):
    """(fsspec filesystem, path within it). fsspec caches instances per process (and drops them in a forked
    worker, whose event loop thread did not survive the fork)."""
    try:
        import fsspec
        from fsspec.core import url_to_fs
    except ImportError:
        raise ImportError("reading URLs needs fsspec: pip install 'vlfast[s3]'") from None
    protocol = _SCHEME.match(url).group(1).lower()  # type: ignore[union-attr]
    try:
        fsspec.get_filesystem_class(protocol)
    except ImportError:
        package = _INSTALL.get(protocol, f"the fsspec package for {protocol}://")
        extra = "vlfast[s3]" if package == "s3fs" else package
        raise ImportError(f"reading {protocol}:// URLs needs {package}: pip install '{extra}'") from None
    except ValueError:
        raise RemoteInputError(f"{url}: fsspec knows no protocol {protocol!r}") from None
    return url_to_fs(url, **json.loads(options_json))


@dataclass(frozen=True)
class RemoteFile:
    """One sample's media at a URL, opened through fsspec in the decode worker. ``str()`` is the URL; the
    storage options are kept out of the repr."""

    url: str
    options_json: str = field(default="{}", repr=False)  # JSON: hashable and picklable

    def __str__(self) -> str:
        return self.url

    def size(self) -> int:
        """Bytes of the object; FileNotFoundError when it does not exist, OSError when it cannot be read."""
        fs, path = _filesystem(self.url, self.options_json)
        try:
            info = fs.info(path)
        except FileNotFoundError:
            raise FileNotFoundError(f"file not found: {self.url}") from None
        except Exception as e:  # network and permission errors come as many types
            raise OSError(f"cannot access {self.url}: {_masked(_reason(e), self.options_json)}") from None
        if info.get("type") == "directory":
            raise IsADirectoryError(f"not a file: {self.url}")
        return int(info.get("size") or 0)

    def open(self) -> io.IOBase:
        """The object's bytes as a seekable binary file (PIL and PyAV take it); raises OSError."""
        fs, path = _filesystem(self.url, self.options_json)
        try:
            return fs.open(path, "rb")
        except FileNotFoundError:
            raise FileNotFoundError(f"file not found: {self.url}") from None
        except OSError as e:
            raise OSError(f"cannot open {self.url}: {_masked(_reason(e), self.options_json)}") from None

    def read_bytes(self) -> bytes:
        with self.open() as f:
            return f.read()


def _reason(e: BaseException) -> str:
    text = str(e).strip() or type(e).__name__
    return text if len(text) <= 300 else text[:297] + "..."


def _probe(url: str, options_json: str) -> dict[str, Any]:
    """``fs.info`` of ``url``, or RemoteInputError / FileNotFoundError naming the URL (never the options)."""
    fs, path = _filesystem(url, options_json)
    fs.invalidate_cache()  # a run sees the store as it is now, not a listing this process cached earlier
    try:
        return fs.info(path)
    except FileNotFoundError:
        raise FileNotFoundError(
            f"input {url} does not exist (or its bucket does not, or the credentials cannot see it)"
        ) from None
    except PermissionError as e:
        raise RemoteInputError(
            f"input {url}: access refused ({_masked(_reason(e), options_json)}); check the credentials "
            "(environment, fsspec configuration or --storage-options)"
        ) from None
    except Exception as e:  # unreachable endpoint, bad credentials: each client raises its own types
        raise RemoteInputError(
            f"input {url} cannot be reached ({type(e).__name__}: {_masked(_reason(e), options_json)}); "
            "check the endpoint and the credentials"
        ) from None


def load_url(
    url: str, storage_options: Mapping[str, Any] | None = None
) -> tuple[list[Sample], list[InputProblem]]:
    """The samples of a folder URL (listed like a local folder), a manifest URL, or one image or video URL."""
    from vlfast.extraction.inputs import (
        IMAGE_SUFFIXES,
        MANIFEST_SUFFIXES,
        VIDEO_SUFFIXES,
        EmptyInput,
        InputProblem,
        Sample,
        _kind_of,
        _storable,
    )
    from vlfast.extraction.webdataset import is_shard_input

    options = _options_json(storage_options)
    suffix = os.path.splitext(url.rstrip("/"))[1].lower()
    if is_shard_input(url):
        raise RemoteInputError(f"input {url}: WebDataset shards at a URL are not supported yet")
    info = _probe(url, options)
    if suffix in MANIFEST_SUFFIXES:
        return _remote_manifest(url, suffix, storage_options)
    media = IMAGE_SUFFIXES | VIDEO_SUFFIXES
    if info.get("type") != "directory":
        if suffix not in media:
            raise RemoteInputError(f"input {url} is neither a folder nor an image or video file")
        return [Sample(url, _kind_of(url), (url,), member=RemoteFile(url, options))], []
    fs, root = _filesystem(url, options)
    root = root.rstrip("/")
    found: list[tuple[tuple[str, ...], Sample | InputProblem]] = []
    for path in fs.find(root, withdirs=False, detail=False):
        rel = path[len(root) :].lstrip("/") if path.startswith(root) else path
        parts = tuple(rel.split("/"))
        if any(p.startswith(".") for p in parts):  # hidden files and folders, as in a local scan
            continue
        if os.path.splitext(parts[-1])[1].lower() not in media:
            continue
        file_url = fs.unstrip_protocol(path)
        reason = _storable(rel, (), None)
        if reason:
            found.append((parts, InputProblem(file_url, reason)))
        else:
            member = RemoteFile(file_url, options)
            found.append((parts, Sample(rel, _kind_of(rel), (file_url,), member=member)))
    found.sort(key=lambda kv: kv[0])
    samples = [x for _, x in found if isinstance(x, Sample)]
    problems = [x for _, x in found if not isinstance(x, Sample)]
    if not samples and not problems:
        raise EmptyInput(f"input folder {url} holds no image or video file (hidden files are skipped)")
    return samples, problems  # type: ignore[return-value]


def _remote_manifest(
    url: str, suffix: str, storage_options: Mapping[str, Any] | None
) -> tuple[list[Sample], list[InputProblem]]:
    """A manifest at a URL, copied to a temporary file and read as a local one; its relative paths are
    relative to its URL's folder, its errors name the URL."""
    import shutil
    import tempfile
    from pathlib import Path

    from vlfast.extraction.inputs import _read_manifest, _required, _with_remote

    options = _options_json(storage_options)
    with tempfile.TemporaryDirectory(prefix="vlfast-manifest-") as tmp:
        local = Path(tmp) / f"manifest{suffix}"
        try:
            with RemoteFile(url, options).open() as src, local.open("wb") as dst:
                shutil.copyfileobj(src, dst, 1 << 20)
        except FileNotFoundError:
            raise FileNotFoundError(f"manifest {url} does not exist") from None
        except OSError as e:
            raise RemoteInputError(f"manifest {url} cannot be read: {e}") from None
        got = _read_manifest(local, name=url, base=url.rsplit("/", 1)[0])
    samples, problems = _with_remote(got, dict(storage_options or {}))
    _required("manifest", url, samples, problems)
    return samples, problems


def attach(
    samples: Sequence[Sample], storage_options: Mapping[str, Any] | None = None
) -> tuple[list[Sample], list[InputProblem]]:
    """``samples`` with a :class:`RemoteFile` on each whose path is a URL; a frame list of URLs is a
    problem (not supported yet). Each bucket is probed once: an unreachable endpoint, missing bucket or
    refused credentials raise before any work, while a missing object is left to the worker to record."""
    from vlfast.extraction.inputs import InputProblem

    options = _options_json(storage_options)
    out: list[Sample] = []
    problems: list[InputProblem] = []
    probed: set[str] = set()
    for s in samples:
        if s.member is not None or not any(is_url(p) for p in s.paths):
            out.append(s)
            continue
        if len(s.paths) > 1:
            problems.append(
                InputProblem(s.source, "a frame list of URLs is not supported yet; give a video URL", s.id)
            )
            continue
        url = s.paths[0]
        m = re.match(r"^([A-Za-z][A-Za-z0-9+.-]*)://([^/]+)", url)
        if m and m.group(1).lower() in _BUCKET_PROTOCOLS and m.group(0) not in probed:
            probed.add(m.group(0))
            _probe(m.group(0), options)
        out.append(dataclasses.replace(s, member=RemoteFile(url, options)))
    return out, problems


def probe_out(out: Any) -> None:
    """An OUT on object storage must be reachable with the credentials given, and its bucket must exist
    (OUT itself need not): else RemoteInputError / FileNotFoundError naming the URL, before any work."""
    url = str(out)
    options_json = _options_json(getattr(out, "storage_options", None))
    fs, path = out.fs, out.path
    fs.invalidate_cache()
    protocols = {fs.protocol} if isinstance(fs.protocol, str) else set(fs.protocol)
    bucket = path.strip("/").split("/", 1)[0] if protocols & _BUCKET_PROTOCOLS else None
    try:
        if bucket is None:
            fs.exists(path)
        else:
            fs.ls(bucket, detail=False)  # one request; a missing bucket raises FileNotFoundError
    except FileNotFoundError:
        raise FileNotFoundError(
            f"output {url}: its bucket {bucket!r} does not exist (or the credentials cannot see it); "
            "create it first"
        ) from None
    except PermissionError as e:
        raise RemoteInputError(
            f"output {url}: access refused ({_masked(_reason(e), options_json)}); check the credentials "
            "(environment, fsspec configuration or --storage-options)"
        ) from None
    except Exception as e:  # unreachable endpoint, bad credentials: each client raises its own types
        raise RemoteInputError(
            f"output {url} cannot be reached ({type(e).__name__}: {_masked(_reason(e), options_json)}); "
            "check the endpoint and the credentials"
        ) from None
