"""Object storage, the base layer of extraction: the ONLY module that imports fsspec.

Local paths never reach this module's filesystems, so a purely local run imports no fsspec. Here, once for
the package: what a URL is and its bucket, opening a filesystem with the storage options (as JSON: hashable
and picklable), probing a URL or OUT, and ranged reads of an object in place (a tar member at a URL).

Transient errors (:func:`is_transient`) are retried by the client where it has retries of its own (S3:
:data:`S3_RETRIES` unless the user configured some; gcsfs and adlfs retry by themselves) and by
:func:`retrying` here for other stores (plain HTTP). What still fails is :class:`TransientReadError`: the
sample's error record is "transient", tried again by the next run.

Credentials (the environment, fsspec's configuration, ``storage_options``) are never shown: every message
names the URL only, and any option value a library error echoes is masked.
"""

from __future__ import annotations

import errno
import functools
import inspect
import io
import json
import os
import random
import re
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any, TypeVar

from vlfast._files import ByteWindow
from vlfast.errors import InputRefused

__all__ = [
    "BUCKET_PROTOCOLS",
    "TRANSIENT_PREFIX",
    "RangeReader",
    "RemoteInputError",
    "TransientReadError",
    "bucket_root",
    "encode_options",
    "filesystem",
    "has_buckets",
    "is_local_fs",
    "is_transient",
    "is_url",
    "named_call",
    "open_range",
    "probe",
    "probe_out",
    "read_range",
    "read_whole",
    "refusal",
    "retrying",
    "transient_error",
    "url_path",
    "url_scheme",
]

T = TypeVar("T")


_SCHEME = re.compile(r"^([A-Za-z][A-Za-z0-9+.-]*)://")
# Stores whose first path component is a bucket: probed once per bucket before any work.
BUCKET_PROTOCOLS = frozenset({"s3", "s3a", "gs", "gcs", "az", "abfs", "abfss", "oss", "r2"})
_INSTALL = {"s3": "s3fs", "s3a": "s3fs", "gs": "gcsfs", "gcs": "gcsfs", "az": "adlfs", "abfs": "adlfs"}


def url_scheme(source: Any) -> str | None:
    """The lower-cased scheme of text with a ``scheme://`` prefix (``"s3"``), or None (a local path)."""
    m = _SCHEME.match(source) if isinstance(source, str) else None
    return m.group(1).lower() if m else None


def is_url(source: Any) -> bool:
    """Whether ``source`` is text with a ``scheme://`` prefix (a local path never is)."""
    return url_scheme(source) is not None


def url_path(url: str, storage_options: Mapping[str, Any] | None = None) -> Path:
    """OUT's URL as a path object: a ``pathlib.Path`` for ``file://`` (a local folder), else a
    ``upath.UPath`` on the URL's fsspec filesystem, opened with ``storage_options``."""
    if url_scheme(url) == "file":
        from urllib.parse import unquote, urlsplit

        return Path(unquote(urlsplit(url).path))
    try:
        from upath import UPath
    except ImportError:
        raise ImportError(
            f"OUT {url} is on object storage, which needs universal_pathlib and the fsspec backend of its "
            "scheme: pip install 'vlfast[s3]' (s3fs; gcsfs / adlfs for gs:// and az://)"
        ) from None
    return UPath(url, **(storage_options or {}))


def bucket_root(url: str) -> str | None:
    """``scheme://bucket`` as written in ``url`` for a store of :data:`BUCKET_PROTOCOLS`, else None."""
    if url_scheme(url) not in BUCKET_PROTOCOLS:
        return None
    m = re.match(r"^[^:]+://[^/]+", url)
    return m.group(0) if m else None


def _protocols(fs: Any) -> set[str]:
    return {fs.protocol} if isinstance(fs.protocol, str) else set(fs.protocol)


def is_local_fs(fs: Any) -> bool:
    """Whether an fsspec filesystem is fsspec's local one (``file://``)."""
    return not {"file", "local"}.isdisjoint(_protocols(fs))


def has_buckets(fs: Any) -> bool:
    """Whether an fsspec filesystem's first path component is a bucket (S3, GCS, Azure...)."""
    return bool(_protocols(fs) & BUCKET_PROTOCOLS)


TRANSIENT_PREFIX = "transient storage error"  # how such a reason begins (add_error infers the kind from it)


class RemoteInputError(InputRefused):
    """A URL that cannot be read at all (endpoint unreachable, bucket missing, access refused)."""


class TransientReadError(Exception):
    """Reading a sample's input failed for a reason that says nothing about the sample, after the retries.
    Its message starts with ``TRANSIENT_PREFIX`` (the record's kind). Not an OSError, so the decoders'
    handlers of bad data let it through."""


# S3 retries when the user configured none: botocore's "standard" mode retries throttling, 5xx, timeouts and
# connection errors with full-jitter exponential backoff (botocore's own default is "legacy" with 5).
S3_RETRIES = {"mode": "standard", "max_attempts": 6}
# Stores whose fsspec client retries by itself (s3fs/botocore, gcsfs, adlfs/azure-core); others get ours.
_CLIENT_RETRIES = frozenset({"s3", "s3a", "gs", "gcs", "az", "abfs", "abfss"})
OWN_ATTEMPTS = 5  # our own retries (plain HTTP...): waits of <= 0.5, 1, 2, 4 s between attempts


def _names(text: str) -> frozenset[str]:
    return frozenset(text.split())


# Error codes of S3-like services that say "try again"
_TRANSIENT_CODES = _names(
    "SlowDown Throttling ThrottlingException ThrottledException RequestThrottled RequestThrottledException "
    "TooManyRequestsException RequestLimitExceeded BandwidthLimitExceeded RequestTimeout "
    "RequestTimeoutException PriorRequestNotComplete InternalError ServiceUnavailable"
)
# EBUSY is s3fs's translation of 503, SlowDown and ServiceUnavailable; EREMOTEIO, of 500.
_TRANSIENT_ERRNOS = frozenset(
    getattr(errno, n)
    for n in _names(
        "ECONNRESET ECONNABORTED ECONNREFUSED ETIMEDOUT EPIPE EHOSTUNREACH ENETUNREACH ENETDOWN ENETRESET EAGAIN "
        "EBUSY EREMOTEIO"
    )
    if hasattr(errno, n)
)
# Network failures by class name, so that no client library is imported to classify: botocore's, urllib3's,
# aiohttp's and fsspec's (builtins ConnectionError and TimeoutError are checked by type).
_TRANSIENT_CLASSES = _names(
    "HTTPClientError ConnectionClosedError EndpointConnectionError ReadTimeoutError ConnectTimeoutError "
    "IncompleteReadError ResponseStreamingError IncompleteRead ProtocolError ClientConnectionError "
    "ServerDisconnectedError ClientPayloadError ServerTimeoutError FSTimeoutError"
)


def _transient_status(status: Any) -> bool:
    return isinstance(status, int) and (status in (408, 429) or (status >= 500 and status != 501))


def _transient_one(e: BaseException) -> bool:
    if isinstance(e, FileNotFoundError | PermissionError | IsADirectoryError | NotADirectoryError):
        return False
    if isinstance(e, ConnectionError | TimeoutError):
        return True
    if any(c.__name__ in _TRANSIENT_CLASSES for c in type(e).__mro__):
        return True
    response = getattr(e, "response", None)  # botocore's ClientError
    if isinstance(response, dict) and (
        str(response.get("Error", {}).get("Code", "")) in _TRANSIENT_CODES
        or _transient_status(response.get("ResponseMetadata", {}).get("HTTPStatusCode"))
    ):
        return True
    if _transient_status(getattr(e, "status", None)):  # aiohttp's ClientResponseError (fsspec's HTTP)
        return True
    return isinstance(e, OSError) and e.errno in _TRANSIENT_ERRNOS


def is_transient(e: BaseException) -> bool:
    """Whether a failure to read from storage says nothing about what is stored: a connection reset or
    refused, a timeout, an HTTP 408, 429 or 5xx, as any client in the exception's chain reports it. A
    missing object or refused access is not transient (unless caused by one of the above)."""
    seen: set[int] = set()
    stack = [e]
    while stack:
        x = stack.pop()
        if x is None or id(x) in seen or len(seen) > 16:
            continue
        seen.add(id(x))
        # a FileNotFoundError may come of a transient cause (fsspec's HTTP ``info`` reports a 503 so)
        if _transient_one(x):
            return True
        stack.extend((x.__cause__, x.__context__))
    return False


def transient_error(url: str, e: BaseException, options_json: str = "{}") -> TransientReadError:
    """The TransientReadError for ``e`` while reading ``url``: names the URL, never the options."""
    reason = masked(error_reason(e), options_json)
    return TransientReadError(
        f"{TRANSIENT_PREFIX}: cannot read {url} ({type(e).__name__}: {reason}) after the storage client's "
        "retries; the next run tries it again"
    )


def error_reason(e: BaseException) -> str:
    """A library error's text for a message, cut to 300 characters (pass it through :func:`masked`)."""
    text = str(e).strip() or type(e).__name__
    return text if len(text) <= 300 else text[:297] + "..."


def refusal(label: str, e: BaseException, options_json: str, missing: str | None = None) -> Exception:
    """The exception that says why a request about an input failed, naming ``label`` and never the
    options. ``missing`` replaces the default not-found message."""
    if isinstance(e, FileNotFoundError):
        return FileNotFoundError(
            missing or f"{label} does not exist (or its bucket does not, or the credentials cannot see it)"
        )
    reason = masked(error_reason(e), options_json)
    if isinstance(e, PermissionError):  # s3fs: a wrong secret or unknown key id (403), or no permission
        return RemoteInputError(
            f"{label}: access refused ({reason}); check the credentials "
            "(environment, fsspec configuration or --storage-options)"
        )
    # unreachable endpoint, bad credentials: each client raises its own types
    return RemoteInputError(
        f"{label} cannot be reached ({type(e).__name__}: {reason}); check the endpoint and the credentials"
    )


def encode_options(options: Mapping[str, Any] | None) -> str:
    """Storage options as JSON text: what :func:`filesystem` takes, hashable and picklable."""
    if options is None:
        return "{}"
    if not isinstance(options, Mapping):
        raise InputRefused(f"storage_options must be a dict, got {type(options).__name__}")
    return json.dumps(dict(options), sort_keys=True)


def masked(text: str, options_json: str) -> str:
    """``text`` with every text value of the options (nested too), what a message must never show,
    replaced by ``***``."""
    stack = [json.loads(options_json)]
    while stack:
        v = stack.pop()
        if isinstance(v, str) and len(v) >= 4:
            text = text.replace(v, "***")
        elif isinstance(v, dict | list):
            stack.extend(reversed(v.values() if isinstance(v, dict) else v))
    return text


def filesystem(url: str, options_json: str):
    """(fsspec filesystem, path within it). fsspec caches instances per process (and drops them in a forked
    worker, whose event loop thread did not survive the fork)."""
    try:
        import fsspec
        from fsspec.core import url_to_fs
    except ImportError:
        raise ImportError("reading URLs needs fsspec: pip install 'vlfast[s3]'") from None
    protocol = url_scheme(url)
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
        package = _INSTALL.get(protocol, f"the fsspec package for {protocol}://")  # type: ignore[arg-type]
        extra = "vlfast[s3]" if package == "s3fs" else package
        raise ImportError(f"reading {protocol}:// URLs needs {package}: pip install '{extra}'") from None
    except ValueError:
        raise RemoteInputError(f"{url}: fsspec knows no protocol {protocol!r}") from None
    return url_to_fs(url, **options)


def retrying(fs, call: Callable[[], T], url: str, options_json: str) -> T:
    """``call()``, tried up to :data:`OWN_ATTEMPTS` times while it fails transiently when ``fs``'s client
    has no retries of its own (else once); TransientReadError when the last attempt fails transiently."""
    attempts = 1 if _protocols(fs) & _CLIENT_RETRIES else OWN_ATTEMPTS
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


def probe(
    url: str, options_json: str, label: str | None = None, missing: str | None = None
) -> dict[str, Any]:
    """``fs.info`` of ``url``, or RemoteInputError / FileNotFoundError naming the URL (never the options)."""
    fs, path = filesystem(url, options_json)
    fs.invalidate_cache()  # a run sees the store as it is now, not a listing this process cached earlier
    try:
        return fs.info(path)
    except Exception as e:
        raise refusal(label or f"input {url}", e, options_json, missing) from None


# s3fs sends S3's If-None-Match on an exclusive create from 2024.12 on; before, it was a check-then-write.
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
    options_json = encode_options(getattr(out, "storage_options", None))
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
        raise refusal(f"output {url}", e, options_json, missing) from None


class StorageReadError(OSError):
    """Stored bytes could not be read (network, credentials, throttling): it says nothing about the bytes,
    so it is never reported as damage."""


# What a failed ranged read becomes, per caller (ObjectRange's ``policy``):
# "input"    a sample's input (a tar member): as :func:`named_call` says.
# "storage"  bytes of the extraction folder read back: FileNotFoundError as the client raises it; anything
#            else StorageReadError naming what was read and the URL.
# "raw"      the client's own exception, for a check that classifies failures itself (integrity).
RANGE_POLICIES = ("input", "storage", "raw")


def read_whole(path: Any) -> bytes:
    """A file's bytes: a local path's own ``read_bytes``; an object (a UPath) in one GET (fsspec's file
    objects, and s3fs's ``cat_file`` unless told otherwise, ask for the size first: two requests)."""
    fs = getattr(path, "fs", None)
    if fs is None or is_local_fs(fs):
        return path.read_bytes()
    return fs.cat_file(path.path, **_one_request(type(fs)))


@functools.cache
def _one_request(cls: type) -> dict[str, Any]:
    """The keyword that makes ``cls.cat_file`` one request (s3fs's ``max_concurrency=1``), if it has one."""
    try:
        params = inspect.signature(getattr(cls, "_cat_file", cls.cat_file)).parameters
    except (TypeError, ValueError):
        return {}
    return {"max_concurrency": 1} if "max_concurrency" in params else {}


def named_call(fs, call: Callable[[], T], url: str, options_json: str, doing: str = "read") -> T:
    """``call()`` (one request about ``url``) through :func:`retrying`, its failures named for ``url``:
    FileNotFoundError ("file not found"), TransientReadError as it comes, anything else OSError ("cannot
    {doing} {url}: ..." with the credentials masked)."""
    try:
        return retrying(fs, call, url, options_json)
    except FileNotFoundError:
        raise FileNotFoundError(f"file not found: {url}") from None
    except TransientReadError:
        raise
    except Exception as e:  # network and permission errors come as many types
        raise OSError(f"cannot {doing} {url}: {masked(error_reason(e), options_json)}") from None


def _fetch(fs, path: str, url: str, options_json: str, start: int, end: int) -> bytes:
    """Bytes ``[start, end)`` of an object (fewer at its end) under the "input" policy: one ranged request."""
    return named_call(fs, lambda: fs.cat_file(path, start=start, end=end), url, options_json)


def _short(url: str, what: str, start: int, got: int, end: int) -> OSError:
    return OSError(
        f"truncated shard: {url} ends at byte {start + got:,}, inside {what} (bytes up to {end:,}): it "
        "changed since it was listed; run again to list it anew"
    )


class ObjectRange:
    """One object on storage, read by byte ranges: each :meth:`read` is one ranged request for exactly the
    bytes asked (fewer at the object's end). ``policy`` (one of :data:`RANGE_POLICIES`) is what a failure
    becomes. A store that ignores the range (a plain HTTP server may send the whole file) is refused."""

    def __init__(self, fs, path: str, url: str, options_json: str = "{}", *, policy: str = "input"):
        if policy not in RANGE_POLICIES:
            raise ValueError(f"policy must be one of {RANGE_POLICIES}, got {policy!r}")
        self.fs, self.path, self.url, self.options_json, self.policy = fs, path, url, options_json, policy

    @classmethod
    def of(cls, upath: Any, policy: str) -> ObjectRange:
        """The object at a ``upath.UPath`` (its filesystem, key and URL)."""
        return cls(upath.fs, upath.path, str(upath), policy=policy)

    def size(self) -> int:
        """The object's size, asked of the store itself (another writer may have replaced it since the
        last listing)."""
        self.fs.invalidate_cache(self.path)
        return int(self.fs.size(self.path))

    def read(self, start: int, end: int, what: str = "") -> bytes:
        """Bytes ``[start, end)`` (fewer at the object's end); ``what`` names them in a StorageReadError."""
        if end <= start:
            return b""
        if self.policy == "input":
            data = _fetch(self.fs, self.path, self.url, self.options_json, start, end)
        else:
            try:
                data = self.fs.cat_file(self.path, start=start, end=end)
            except Exception as e:  # noqa: BLE001 - each client raises its own types
                if self.policy == "raw" or isinstance(e, FileNotFoundError):
                    raise
                raise StorageReadError(
                    f"cannot read {what or f'bytes {start:,} to {end:,}'} from {self.url}: "
                    f"{type(e).__name__}: {masked(error_reason(e), self.options_json)}"
                ) from None
        if len(data) > end - start:
            raise OSError(
                f"cannot read {self.url} in place: asked for bytes {start:,} to {end:,}, the store sent "
                f"{len(data):,} bytes; ranged requests are needed, which this server does not serve"
            )
        return data


class RangeReader(ByteWindow):
    """A read-only, seekable view of the ``size`` bytes at ``offset`` of an object, fetched with ranged
    requests (``source``, an :class:`ObjectRange`) that never reach past the view's end.

    Reads are served from one buffer; a miss fetches at least a block from the read position. The block
    doubles (64 KiB up to 8 MiB) while misses land within one block of the last buffer's end, and drops
    back to 64 KiB after a longer jump: reading front to back gets large requests, hopping from header to
    header small ones (fsspec's own file objects use one fixed block, 50 MiB for s3fs)."""

    MIN_BLOCK, MAX_BLOCK = 64 << 10, 8 << 20

    def __init__(self, source: ObjectRange, offset: int, size: int, name: str):
        super().__init__(size, name)
        self._object, self._offset = source, offset
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
            raise _short(self._object.url, self.name, start, len(data), self._offset + end)
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


def open_range(url: str, options_json: str, offset: int, size: int, name: str) -> io.BufferedReader:
    """The ``size`` bytes at ``offset`` of the object at ``url`` as a seekable binary file (a tar member,
    for PyAV), read by ranged requests ("input" policy)."""
    fs, path = filesystem(url, options_json)
    source = ObjectRange(fs, path, url, options_json)
    return io.BufferedReader(RangeReader(source, offset, size, name), 1 << 16)


def read_range(url: str, options_json: str, offset: int, size: int, name: str) -> bytes:
    """The ``size`` bytes at ``offset`` of the object at ``url``, in one ranged request ("input" policy)."""
    fs, path = filesystem(url, options_json)
    data = ObjectRange(fs, path, url, options_json).read(offset, offset + size, name)
    if len(data) < size:
        raise _short(url, name, offset, len(data), offset + size)
    return data
