"""Object storage as extraction input: fsspec URLs (``s3://bucket/key``, ``memory://...``) read in place.

INPUT, a folder's files and a manifest's ``path`` values may be URLs with a scheme (``s3://``, ``gs://``,
``memory://``, ``file://``...). Local paths never reach this module, so a purely local run imports no fsspec.

* :func:`load_url` lists a folder URL as :func:`~vlfast.extraction.sources.inputs.load_inputs` scans a local
  folder (recursive, hidden entries skipped, ids relative to the folder), takes a single media URL (its
  id is the URL), or reads a manifest at a URL (its relative paths are relative to its URL). The INPUT is probed first: an unreachable endpoint, a missing bucket or refused
  credentials raise :class:`RemoteInputError` naming the URL before any work.
* :func:`attach` gives each manifest sample whose path is a URL a :class:`RemoteFile` (its id, when the
  manifest has none, is the URL) after probing each bucket once; a missing object is found by the decode
  worker and recorded like a missing local file.
* :class:`RemoteFile` is what the decode workers open, as they open a tar member: images are read whole,
  videos through fsspec's seekable file object for PyAV.
* :func:`list_shards` lists WebDataset shards at URLs with :mod:`vlfast.extraction.sources.webdataset`'s own
  listing, over a :class:`RangeReader`; a shard member at a URL is then read by :func:`read_range` /
  :func:`open_range`, ranged requests over just its bytes.

Transient failures (a connection reset, a 5xx or SlowDown, a timeout: :func:`is_transient`) are retried by
the client where it has retries of its own (S3: botocore's ``retries`` config, :data:`S3_RETRIES` unless
``config_kwargs`` or ``AWS_MAX_ATTEMPTS`` / ``AWS_RETRY_MODE`` set one, plus s3fs's own loop over
connection errors; gcsfs and adlfs retry by themselves) and by :func:`_retrying` here for other stores
(plain HTTP). What still fails is :class:`TransientReadError`, which the sample's error record marks
"transient": not done, tried again by the next run.

Credentials come from the environment and fsspec's configuration, plus ``storage_options`` (passed to
``fsspec.filesystem``). They are never shown: a :class:`RemoteFile`'s repr and every message name the URL
only, and any option value that a library error echoes is masked.
"""

from __future__ import annotations

import dataclasses
import errno
import io
import json
import os
import random
import re
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from vlfast._files import ByteWindow
from vlfast.errors import InputRefused

if TYPE_CHECKING:
    from vlfast.extraction.sources.inputs import InputProblem, Sample

__all__ = [
    "RemoteFile",
    "RemoteInputError",
    "TransientReadError",
    "attach",
    "is_transient",
    "is_url",
    "list_shards",
    "load_url",
    "probe_out",
]

_SCHEME = re.compile(r"^([A-Za-z][A-Za-z0-9+.-]*)://")
# Stores whose first path component is a bucket: probed once per bucket before any work.
_BUCKET_PROTOCOLS = frozenset({"s3", "s3a", "gs", "gcs", "az", "abfs", "abfss", "oss", "r2"})
_INSTALL = {"s3": "s3fs", "s3a": "s3fs", "gs": "gcsfs", "gcs": "gcsfs", "az": "adlfs", "abfs": "adlfs"}


class RemoteInputError(InputRefused):
    """An INPUT URL that cannot be read at all (endpoint unreachable, bucket missing, access refused)."""


# How the reason of a sample that failed that way begins: its error record is then "transient" (not done).
TRANSIENT_PREFIX = "transient storage error"


class TransientReadError(Exception):
    """Reading a sample's input failed for a reason that says nothing about the sample (see
    :func:`is_transient`), after the retries. Its message starts with ``TRANSIENT_PREFIX``, which makes the
    error record "transient". Not an OSError, so the decoders' handlers of bad data let it through."""


# S3 retries when the user configured none: botocore's "standard" mode retries throttling (SlowDown, 503),
# 5xx, timeouts and connection errors with full-jitter exponential backoff (<= 1, 2, 4, 8, 16 s between
# the 6 attempts); botocore's own default would be "legacy" with 5.
S3_RETRIES = {"mode": "standard", "max_attempts": 6}
# Stores whose fsspec client retries by itself (s3fs/botocore, gcsfs, adlfs/azure-core); others get ours.
_CLIENT_RETRIES = frozenset({"s3", "s3a", "gs", "gcs", "az", "abfs", "abfss"})
OWN_ATTEMPTS = 5  # our own retries (plain HTTP...): waits of <= 0.5, 1, 2, 4 s between attempts

_TRANSIENT_CODES = frozenset(
    {
        "SlowDown",
        "Throttling",
        "ThrottlingException",
        "ThrottledException",
        "RequestThrottled",
        "RequestThrottledException",
        "TooManyRequestsException",
        "RequestLimitExceeded",
        "BandwidthLimitExceeded",
        "RequestTimeout",
        "RequestTimeoutException",
        "PriorRequestNotComplete",
        "InternalError",
        "ServiceUnavailable",
    }
)
_TRANSIENT_ERRNOS = frozenset(
    getattr(errno, n)
    for n in (
        "ECONNRESET",
        "ECONNABORTED",
        "ECONNREFUSED",
        "ETIMEDOUT",
        "EPIPE",
        "EHOSTUNREACH",
        "ENETUNREACH",
        "ENETDOWN",
        "ENETRESET",
        "EAGAIN",
        "EBUSY",  # s3fs's translation of 503, SlowDown and ServiceUnavailable
        "EREMOTEIO",  # s3fs's translation of 500
    )
    if hasattr(errno, n)
)
# Network failures by class name, so that no client library is imported to classify: botocore's, urllib3's,
# aiohttp's and fsspec's (builtins ConnectionError and TimeoutError are checked by type).
_TRANSIENT_CLASSES = frozenset(
    {
        "HTTPClientError",
        "ConnectionClosedError",
        "EndpointConnectionError",
        "ReadTimeoutError",
        "ConnectTimeoutError",
        "IncompleteReadError",
        "ResponseStreamingError",
        "IncompleteRead",
        "ProtocolError",
        "ClientConnectionError",
        "ServerDisconnectedError",
        "ClientPayloadError",
        "ServerTimeoutError",
        "FSTimeoutError",
    }
)


def _transient_one(e: BaseException) -> bool:
    if isinstance(e, FileNotFoundError | PermissionError | IsADirectoryError | NotADirectoryError):
        return False
    if isinstance(e, ConnectionError | TimeoutError):
        return True
    if any(c.__name__ in _TRANSIENT_CLASSES for c in type(e).__mro__):
        return True
    response = getattr(e, "response", None)  # botocore's ClientError
    if isinstance(response, dict):
        code = str(response.get("Error", {}).get("Code", ""))
        status = response.get("ResponseMetadata", {}).get("HTTPStatusCode")
        if code in _TRANSIENT_CODES:
            return True
        if isinstance(status, int) and (status in (408, 429) or (status >= 500 and status != 501)):
            return True
    status = getattr(e, "status", None)  # aiohttp's ClientResponseError (fsspec's HTTP)
    if isinstance(status, int) and (status in (408, 429) or (status >= 500 and status != 501)):
        return True
    return isinstance(e, OSError) and e.errno in _TRANSIENT_ERRNOS


def is_transient(e: BaseException) -> bool:
    """Whether a failure to read from storage says nothing about what is stored: a connection reset or
    refused, a timeout, an HTTP 408, 429 or 5xx (SlowDown, ServiceUnavailable, InternalError), as any
    client in the exception's chain reports it. A missing object or refused access is not transient
    (unless caused by one of the above)."""
    seen: set[int] = set()
    stack = [e]
    while stack:
        x = stack.pop()
        if x is None or id(x) in seen or len(seen) > 16:
            continue
        seen.add(id(x))
        # a FileNotFoundError is not transient, unless a client guessed it from a transient cause
        # (fsspec's HTTP ``info`` reports a 503 on both HEAD and GET as not found)
        if _transient_one(x):
            return True
        stack.extend((x.__cause__, x.__context__))
    return False


def transient_error(url: str, e: BaseException, options_json: str = "{}") -> TransientReadError:
    """The TransientReadError for ``e`` while reading ``url``: names the URL, never the options."""
    reason = _masked(_reason(e), options_json)
    return TransientReadError(
        f"{TRANSIENT_PREFIX}: cannot read {url} ({type(e).__name__}: {reason}) after the storage client's "
        "retries; the next run tries it again"
    )


def _retrying(fs, call, url: str, options_json: str):
    """``call()``, tried up to :data:`OWN_ATTEMPTS` times while it fails transiently when ``fs``'s client
    has no retries of its own (else once: the client has retried already); TransientReadError when the
    last attempt fails transiently, the error itself otherwise."""
    protocols = {fs.protocol} if isinstance(fs.protocol, str) else set(fs.protocol)
    attempts = 1 if protocols & _CLIENT_RETRIES else OWN_ATTEMPTS
    for attempt in range(attempts):
        try:
            return call()
        except Exception as e:
            if not is_transient(e):
                raise
            if attempt == attempts - 1:
                raise transient_error(url, e, options_json) from e
            time.sleep(0.5 * 2**attempt * random.uniform(0.5, 1.0))  # jitter: ranks must not retry in step
    raise AssertionError("unreachable")


def is_url(source: Any) -> bool:
    """Whether ``source`` is text with a ``scheme://`` prefix (a local path never is)."""
    return isinstance(source, str) and _SCHEME.match(source) is not None


def _options_json(options: Mapping[str, Any] | None) -> str:
    if options is None:
        return "{}"
    if not isinstance(options, Mapping):
        raise InputRefused(f"storage_options must be a dict, got {type(options).__name__}")
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
    options = json.loads(options_json)
    if protocol in ("s3", "s3a"):
        config = options.setdefault("config_kwargs", {})
        if (
            isinstance(config, dict)
            and "retries" not in config
            and not (os.environ.get("AWS_MAX_ATTEMPTS") or os.environ.get("AWS_RETRY_MODE"))
        ):
            config["retries"] = dict(S3_RETRIES)
    try:
        fsspec.get_filesystem_class(protocol)
    except ImportError:
        package = _INSTALL.get(protocol, f"the fsspec package for {protocol}://")
        extra = "vlfast[s3]" if package == "s3fs" else package
        raise ImportError(f"reading {protocol}:// URLs needs {package}: pip install '{extra}'") from None
    except ValueError:
        raise RemoteInputError(f"{url}: fsspec knows no protocol {protocol!r}") from None
    return url_to_fs(url, **options)


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
            info = _retrying(fs, lambda: fs.info(path), self.url, self.options_json)
        except FileNotFoundError:
            raise FileNotFoundError(f"file not found: {self.url}") from None
        except TransientReadError:
            raise
        except Exception as e:  # network and permission errors come as many types
            raise OSError(f"cannot access {self.url}: {_masked(_reason(e), self.options_json)}") from None
        if info.get("type") == "directory":
            raise IsADirectoryError(f"not a file: {self.url}")
        return int(info.get("size") or 0)

    def open(self) -> io.IOBase:
        """The object's bytes as a seekable binary file (PIL and PyAV take it); raises OSError."""
        fs, path = _filesystem(self.url, self.options_json)
        try:
            return _retrying(fs, lambda: fs.open(path, "rb"), self.url, self.options_json)
        except FileNotFoundError:
            raise FileNotFoundError(f"file not found: {self.url}") from None
        except OSError as e:
            raise OSError(f"cannot open {self.url}: {_masked(_reason(e), self.options_json)}") from None

    def read_bytes(self) -> bytes:
        """The whole object (an image); TransientReadError when the store keeps failing transiently."""
        fs, path = _filesystem(self.url, self.options_json)
        try:
            return _retrying(fs, lambda: fs.cat_file(path), self.url, self.options_json)
        except FileNotFoundError:
            raise FileNotFoundError(f"file not found: {self.url}") from None
        except TransientReadError:
            raise
        except Exception as e:
            raise OSError(f"cannot read {self.url}: {_masked(_reason(e), self.options_json)}") from None


def _reason(e: BaseException) -> str:
    text = str(e).strip() or type(e).__name__
    return text if len(text) <= 300 else text[:297] + "..."


def _refusal(label: str, e: BaseException, options_json: str, missing: str | None = None) -> Exception:
    """The exception that says why a request about an input failed, naming ``label`` (the URL, or what it
    is to the input) and never the options. ``missing`` replaces the default not-found message."""
    if isinstance(e, FileNotFoundError):
        return FileNotFoundError(
            missing or f"{label} does not exist (or its bucket does not, or the credentials cannot see it)"
        )
    reason = _masked(_reason(e), options_json)
    if isinstance(e, PermissionError):  # s3fs: a wrong secret or unknown key id (403), or no permission
        return RemoteInputError(
            f"{label}: access refused ({reason}); check the credentials "
            "(environment, fsspec configuration or --storage-options)"
        )
    # unreachable endpoint, bad credentials: each client raises its own types
    return RemoteInputError(
        f"{label} cannot be reached ({type(e).__name__}: {reason}); check the endpoint and the credentials"
    )


def _probe(
    url: str, options_json: str, label: str | None = None, missing: str | None = None
) -> dict[str, Any]:
    """``fs.info`` of ``url``, or RemoteInputError / FileNotFoundError naming the URL (never the options)."""
    fs, path = _filesystem(url, options_json)
    fs.invalidate_cache()  # a run sees the store as it is now, not a listing this process cached earlier
    try:
        return fs.info(path)
    except Exception as e:
        raise _refusal(label or f"input {url}", e, options_json, missing) from None


def load_url(
    url: str, storage_options: Mapping[str, Any] | None = None
) -> tuple[list[Sample], list[InputProblem]]:
    """The samples of a folder URL (listed like a local folder), a manifest URL, WebDataset shards at a URL
    (a ``.tar`` or a brace pattern, see :func:`list_shards`), or one image or video URL."""
    from vlfast.extraction.sources.inputs import (
        IMAGE_SUFFIXES,
        MANIFEST_SUFFIXES,
        VIDEO_SUFFIXES,
        EmptyInput,
        InputProblem,
        Sample,
        _kind_of,
        _storable,
    )
    from vlfast.extraction.sources.webdataset import is_shard_input

    options = _options_json(storage_options)
    suffix = os.path.splitext(url.rstrip("/"))[1].lower()
    if is_shard_input(url):
        from vlfast.extraction.sources.inputs import _required
        from vlfast.extraction.sources.webdataset import load_shards

        samples, problems = load_shards(url, storage_options)
        _required("WebDataset shards", url, samples, problems)
        return samples, problems
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

    from vlfast.extraction.sources.inputs import _read_manifest, _required, _with_remote

    options = _options_json(storage_options)
    with tempfile.TemporaryDirectory(prefix="vlfast-manifest-") as tmp:
        local = Path(tmp) / f"manifest{suffix}"
        try:
            with RemoteFile(url, options).open() as src, local.open("wb") as dst:
                shutil.copyfileobj(src, dst, 1 << 20)
        except FileNotFoundError:
            raise FileNotFoundError(f"manifest {url} does not exist") from None
        except (OSError, TransientReadError) as e:
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
    from vlfast.extraction.sources.inputs import InputProblem

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


def has_buckets(fs: Any) -> bool:
    """Whether an fsspec filesystem's first path component is a bucket (S3, GCS, Azure...)."""
    protocols = {fs.protocol} if isinstance(fs.protocol, str) else set(fs.protocol)
    return bool(protocols & _BUCKET_PROTOCOLS)


# s3fs sends S3's If-None-Match on an exclusive create from 2024.12 on; before, mode="create" was a
# check-then-write, so two writers racing for one name could both win and the commit was not atomic.
S3FS_EXCLUSIVE_CREATE = (2024, 12)


def _check_exclusive_create(fs: Any, url: str) -> None:
    """Refuse an S3 OUT with an s3fs too old to create objects exclusively (the commit relies on it)."""
    if type(fs).__module__.split(".")[0] != "s3fs":
        return
    import s3fs

    version = s3fs.__version__
    numbers = tuple(int(x) for x in re.findall(r"\d+", version)[:2])
    if numbers < S3FS_EXCLUSIVE_CREATE:
        raise InputRefused(
            f"output {url}: s3fs {version} cannot create an object only if it is absent (S3's "
            "If-None-Match, s3fs 2024.12 and later), which the commit to object storage needs to be atomic: "
            "pip install 's3fs>=2024.12'"
        )


def probe_out(out: Any) -> None:
    """An OUT on object storage must be reachable with the credentials given, and its bucket must exist
    (OUT itself need not): else RemoteInputError / FileNotFoundError naming the URL, before any work."""
    url = str(out)
    options_json = _options_json(getattr(out, "storage_options", None))
    fs, path = out.fs, out.path
    _check_exclusive_create(fs, url)
    fs.invalidate_cache()
    bucket = path.strip("/").split("/", 1)[0] if has_buckets(fs) else None
    try:
        if bucket is None:
            fs.exists(path)
        else:
            fs.ls(bucket, detail=False)  # one request; a missing bucket raises FileNotFoundError
    except Exception as e:
        missing = f"output {url}: its bucket {bucket!r} does not exist (or the credentials cannot see it); create it first"
        raise _refusal(f"output {url}", e, options_json, missing) from None


# ------------------------------------------------------------------------------------------- ranged reads


class StorageReadError(OSError):
    """Stored bytes could not be read (network, credentials, throttling): it says nothing about the bytes,
    so it is never reported as damage."""


# What a failed ranged read becomes, per caller (ObjectRange's ``policy``):
# "input"    a sample's input (a tar member): a transient failure is retried where the client has no
#            retries of its own, then TransientReadError; a missing object FileNotFoundError naming the
#            URL; anything else OSError naming the URL, never the options.
# "storage"  bytes of the extraction folder read back (a tensor): a missing object FileNotFoundError as
#            the client raises it; anything else StorageReadError naming what was read and the URL.
# "raw"      the client's own exception, for a check that classifies failures itself (integrity).
RANGE_POLICIES = ("input", "storage", "raw")


def _fetch(fs, path: str, url: str, options_json: str, start: int, end: int) -> bytes:
    """Bytes ``[start, end)`` of an object (fewer at its end) under the "input" policy: one ranged request."""
    try:
        return _retrying(fs, lambda: fs.cat_file(path, start=start, end=end), url, options_json)
    except FileNotFoundError:
        raise FileNotFoundError(f"file not found: {url}") from None
    except TransientReadError:
        raise
    except Exception as e:  # network and permission errors come as many types
        raise OSError(f"cannot read {url}: {_masked(_reason(e), options_json)}") from None


def _short(url: str, what: str, start: int, got: int, end: int) -> OSError:
    return OSError(
        f"truncated shard: {url} ends at byte {start + got:,}, inside {what} (bytes up to {end:,}): it "
        "changed since it was listed; run again to list it anew"
    )


class ObjectRange:
    """One object on storage, read by byte ranges: each :meth:`read` is one ranged request for exactly the
    bytes asked (fewer at the object's end), never more. ``policy`` (one of :data:`RANGE_POLICIES`) is what
    a failure becomes for this caller. A store that ignores the range (a plain HTTP server may send the
    whole file, whose first bytes would pass for the ones asked) is refused under every policy."""

    def __init__(self, fs, path: str, url: str, options_json: str = "{}", *, policy: str = "input"):
        if policy not in RANGE_POLICIES:
            raise ValueError(f"policy must be one of {RANGE_POLICIES}, got {policy!r}")
        self.fs, self.path, self.url, self.options_json, self.policy = fs, path, url, options_json, policy

    @classmethod
    def of(cls, upath: Any, policy: str) -> ObjectRange:
        """The object at a ``upath.UPath`` (its filesystem, key and URL)."""
        return cls(upath.fs, upath.path, str(upath), policy=policy)

    def size(self) -> int:
        """The object's size, asked of the store itself (never of fsspec's listings cache: another writer
        may have replaced it since the last listing)."""
        self.fs.invalidate_cache(self.path)
        return int(self.fs.size(self.path))

    def read(self, start: int, end: int, what: str = "") -> bytes:
        """Bytes ``[start, end)`` (fewer at the object's end); ``what`` names them in a StorageReadError."""
        if end <= start:
            return b""
        if self.policy == "input":
            data = _fetch(self.fs, self.path, self.url, self.options_json, start, end)
        elif self.policy == "raw":
            data = self.fs.cat_file(self.path, start=start, end=end)
        else:
            try:
                data = self.fs.cat_file(self.path, start=start, end=end)
            except FileNotFoundError:
                raise
            except Exception as e:  # noqa: BLE001 - each client raises its own types
                raise StorageReadError(
                    f"cannot read {what or f'bytes {start:,} to {end:,}'} from {self.url}: "
                    f"{type(e).__name__}: {_masked(_reason(e), self.options_json)}"
                ) from None
        if len(data) > end - start:
            raise OSError(
                f"cannot read {self.url} in place: asked for bytes {start:,} to {end:,}, the store sent "
                f"{len(data):,} bytes; ranged requests are needed, which this server does not serve"
            )
        return data


class RangeReader(ByteWindow):
    """A read-only, seekable view of the ``size`` bytes at ``offset`` of an object, fetched with ranged
    requests (:class:`ObjectRange`, ``policy``) that never reach past the view's end.

    Reads are served from one buffer; a miss fetches at least a block from the read position. The block
    doubles (64 KiB up to 8 MiB) while misses land within one block of the last buffer's end, and drops
    back to 64 KiB after a longer jump. So listing a shard of small images reads it front to back in a few
    large requests, listing a shard of large videos hops from header to header with one small request
    each, and a decoder reading a video front to back gets large requests. (fsspec's own file objects use
    one fixed block, 50 MiB for s3fs: up to that many bytes per hop over a large member.)"""

    MIN_BLOCK, MAX_BLOCK = 64 << 10, 8 << 20

    def __init__(
        self,
        fs,
        path: str,
        url: str,
        options_json: str,
        offset: int,
        size: int,
        name: str,
        *,
        policy: str = "input",
    ):
        super().__init__(size, name)
        self._object = ObjectRange(fs, path, url, options_json, policy=policy)
        self._url, self._offset = url, offset
        self._buf, self._buf_at, self._block = b"", 0, self.MIN_BLOCK
        self.requests = self.fetched = 0  # what it cost, for measurements

    def _fill(self, want: int) -> None:
        dense = self.requests > 0 and 0 <= self._pos - (self._buf_at + len(self._buf)) < self._block
        self._block = min(2 * self._block, self.MAX_BLOCK) if dense else self.MIN_BLOCK
        end = min(self._size, self._pos + max(want, self._block))
        start = self._offset + self._pos
        data = self._object.read(start, self._offset + end, self.name)
        self.requests += 1
        self.fetched += len(data)
        if len(data) < end - self._pos:
            raise _short(self._url, self.name, start, len(data), self._offset + end)
        self._buf, self._buf_at = data, self._pos

    def readinto(self, buffer) -> int:
        """Fills ``buffer`` up to the view's end: never a short read, which tarfile would take for a cut."""
        with memoryview(buffer) as view:
            n, done = max(0, min(len(view), self._size - self._pos)), 0
            while done < n:
                i = self._pos - self._buf_at
                if not 0 <= i < len(self._buf):
                    self._fill(n - done)
                    i = 0
                k = min(n - done, len(self._buf) - i)
                view[done : done + k] = self._buf[i : i + k]
                done += k
                self._pos += k
        return done


_RangeReader = RangeReader  # the name before issue 21


def open_range(url: str, options_json: str, offset: int, size: int, name: str) -> io.BufferedReader:
    """The ``size`` bytes at ``offset`` of the object at ``url`` as a seekable binary file (a tar member,
    for PyAV): ranged requests over just those bytes ("input" policy), nothing written to disk."""
    fs, path = _filesystem(url, options_json)
    return io.BufferedReader(RangeReader(fs, path, url, options_json, offset, size, name), 1 << 16)


def read_range(url: str, options_json: str, offset: int, size: int, name: str) -> bytes:
    """The ``size`` bytes at ``offset`` of the object at ``url``, in one ranged request (an image member),
    under the "input" policy."""
    fs, path = _filesystem(url, options_json)
    data = ObjectRange(fs, path, url, options_json).read(offset, offset + size, name)
    if len(data) < size:
        raise _short(url, name, offset, len(data), offset + size)
    return data


# ------------------------------------------------------------------------------- WebDataset shards at URLs


_LIST_THREADS = 8  # shards listed at once: a listing waits on requests more than on the CPU


def list_shards(
    pattern: str, shards: Sequence[str], rels: Sequence[str], storage_options: Mapping[str, Any] | None
) -> list[tuple[list[Sample], list[InputProblem]]]:
    """Each shard URL's samples and problems (ids ``{rel}/{__key__}``), listed by the same code as a local
    shard (:func:`~vlfast.extraction.sources.webdataset._scan` and ``_entries``) over a :class:`RangeReader`,
    up to :data:`_LIST_THREADS` shards at once.

    Refused before any shard is read, naming ``pattern`` and never the credentials: an unreachable
    endpoint, a missing bucket or refused credentials (one request about the bucket), and shards that do
    not exist or are not files (one listing of each folder holding shards, see :func:`_shard_infos`). A
    shard that is not a plain tar raises ValueError naming it; one that cannot be read mid-listing,
    :class:`RemoteInputError`."""
    from concurrent.futures import ThreadPoolExecutor

    from vlfast.extraction.sources.webdataset import _refuse_missing

    options = _options_json(storage_options)
    bucket = re.match(r"^([^:]+)://[^/]*", pattern)
    if bucket and bucket.group(1).lower() in _BUCKET_PROTOCOLS:
        label = f"bucket {bucket.group(0)} of input {pattern}"
        _probe(bucket.group(0), options, label, f"{label} does not exist (or the credentials cannot see it)")
    fs, _ = _filesystem(shards[0], options)
    fs.invalidate_cache()
    paths = {s: fs._strip_protocol(s) for s in shards}
    pool = ThreadPoolExecutor(min(_LIST_THREADS, len(shards)), thread_name_prefix="vlfast-list")
    try:
        found = _shard_infos(fs, pattern, list(paths.values()), options, pool.map)
        missing = [s for s in shards if paths[s] not in found]
        not_files = [s for s in shards if paths[s] in found and found[paths[s]].get("type") != "file"]
        _refuse_missing(pattern, list(shards), missing, not_files)

        def one(shard: str, rel: str) -> tuple[list[Sample], list[InputProblem]]:
            return _list_one(fs, shard, paths[shard], rel, found[paths[shard]], options)

        return list(pool.map(one, shards, rels))
    finally:
        pool.shutdown(wait=True, cancel_futures=True)


def _shard_infos(fs, pattern: str, paths: list[str], options_json: str, map_) -> dict[str, dict[str, Any]]:
    """The entries (``fs.info``'s) of the shards that exist, by path: one listing per folder. A folder whose
    listing holds none of its shards is missing, or on a store that cannot list folders (plain HTTP): its
    first shard is asked for, and the others (``map_``: in parallel) only if that one exists. Shards listed
    without a size are asked for too."""

    def info(path: str) -> dict[str, Any] | None:
        try:
            return fs.info(path)
        except FileNotFoundError:
            return None
        except Exception as e:
            raise _refusal(f"input {pattern}", e, options_json) from None

    folders: dict[str, list[str]] = {}
    for path in paths:
        folders.setdefault(fs._parent(path), []).append(path)
    found: dict[str, dict[str, Any]] = {}
    for folder, wanted in folders.items():
        try:
            entries = fs.ls(folder, detail=True)
        except FileNotFoundError:
            entries = []
        except Exception as e:
            raise _refusal(f"input {pattern}", e, options_json) from None
        listed = {fs._strip_protocol(e["name"]).rstrip("/"): e for e in entries}
        found.update(listed)
        if any(path in listed for path in wanted):
            continue
        first = info(wanted[0])
        if first is not None:
            found[wanted[0]] = first
            found.update((p, i) for p, i in zip(wanted[1:], map_(info, wanted[1:])) if i is not None)
    # an HTTP index page lists files without their sizes: ask each one
    unsized = [p for p in paths if p in found and found[p].get("size") is None]
    found.update((p, i) for p, i in zip(unsized, map_(info, unsized)) if i is not None)
    return found


def _list_one(
    fs, shard: str, path: str, rel: str, entry: Mapping[str, Any], options_json: str
) -> tuple[list[Sample], list[InputProblem]]:
    """One shard listed by :mod:`~vlfast.extraction.sources.webdataset`'s own code over a :class:`RangeReader`;
    ``entry`` is its folder listing's entry (its size)."""
    from vlfast.extraction.sources.webdataset import _entries, _scan

    if entry.get("size") is None:
        raise RemoteInputError(
            f"shard {shard}: the store does not give its size, which reading its members in place needs"
        )
    size = int(entry["size"])
    with RangeReader(fs, path, shard, options_json, 0, size, shard) as f:
        try:
            members, cut, texts = _scan(f, size, shard)
        except (OSError, TransientReadError) as e:  # the message names the URL, never the options
            raise RemoteInputError(f"shard {shard} cannot be listed: {e}") from None
    return _entries(shard, rel, members, cut, texts, options_json)
