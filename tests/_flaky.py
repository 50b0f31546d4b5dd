"""A flaky object store for tests: a small HTTP proxy in front of a real server (moto's S3) that answers
some requests itself with a fault, as a throttled or overloaded store does, and forwards the rest.

Faults are decided per object (the request path without its query) by ``fault(method, path, n)``, where
``n`` counts that path's reads (GET and HEAD) so far, from 1: return None to forward, "503" to answer
503 SlowDown, "reset" to reset the connection (TCP RST) without an answer. Listings (a path with no key
after the bucket) and writes are always forwarded.
"""

from __future__ import annotations

import http.client
import io
import socket
import struct
import threading
from collections import Counter
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import urlsplit

SLOW_DOWN = (
    b'<?xml version="1.0" encoding="UTF-8"?>\n<Error><Code>SlowDown</Code>'
    b"<Message>Please reduce your request rate.</Message><RequestId>flaky</RequestId></Error>"
)
_HOP = {"connection", "keep-alive", "transfer-encoding", "proxy-connection", "te", "upgrade"}

Fault = Callable[[str, str, int], str | None]


def first(k: int, kind: str = "503", only: Callable[[str], bool] = lambda path: True) -> Fault:
    """Fail the first ``k`` reads of every object (whose path ``only`` accepts) with ``kind``."""
    return lambda method, path, n: kind if n <= k and only(path) else None


def always(kind: str = "503", only: Callable[[str], bool] = lambda path: True) -> Fault:
    """Fail every read of the objects ``only`` accepts: a store that keeps failing."""
    return lambda method, path, n: kind if only(path) else None


class FlakyStore:
    """The running proxy: ``endpoint`` to give the client, ``fault`` (replaceable while it runs),
    ``injected`` counts the faults answered by kind, ``reads`` the reads seen per path."""

    def __init__(self, upstream: str, fault: Fault | None):
        self.upstream = urlsplit(upstream)
        self.fault = fault
        self.injected: Counter[str] = Counter()
        self.reads: Counter[str] = Counter()
        self._lock = threading.Lock()
        store = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args) -> None:  # quiet
                pass

            def end_headers(self) -> None:
                # One request per connection, said in every answer so no client reuses one. With keep-alive a
                # request sent on a pooled connection now and then got no answer until s3fs's 15 s read
                # timeout (then a retry), which cost the suite 15-60 s at random.
                self.send_header("Connection", "close")
                super().end_headers()

            def _any(self) -> None:
                path = self.path.split("?", 1)[0]
                body = self.rfile.read(int(self.headers.get("Content-Length") or 0))
                is_read = self.command in ("GET", "HEAD") and "/" in path.strip("/")
                kind = None
                if is_read:
                    with store._lock:
                        store.reads[path] += 1
                        n = store.reads[path]
                        kind = store.fault(self.command, path, n) if store.fault else None
                        if kind:
                            store.injected[kind] += 1
                if kind == "reset":
                    self.connection.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
                    self.connection.close()  # RST: the client sees its connection reset by peer
                    self.wfile = io.BytesIO()  # what the handler still flushes goes nowhere
                    self.close_connection = True
                    return
                if kind == "503":
                    self.send_response(503, "Slow Down")
                    self.send_header("Content-Type", "application/xml")
                    self.send_header("Content-Length", str(len(SLOW_DOWN)))
                    self.end_headers()
                    if self.command != "HEAD":
                        self.wfile.write(SLOW_DOWN)
                    return
                up = http.client.HTTPConnection(store.upstream.hostname, store.upstream.port, timeout=30)
                try:
                    headers = {k: v for k, v in self.headers.items() if k.lower() not in _HOP}
                    up.request(self.command, self.path, body=body or None, headers=headers)
                    resp = up.getresponse()
                    data = resp.read()
                    self.send_response(resp.status, resp.reason)
                    for k, v in resp.getheaders():
                        if k.lower() not in _HOP and k.lower() != "content-length":
                            self.send_header(k, v)
                    # HEAD: the object's size, as the server said; else the body we relay
                    length = resp.getheader("Content-Length") if self.command == "HEAD" else len(data)
                    self.send_header("Content-Length", str(length or 0))
                    self.end_headers()
                    if self.command != "HEAD":
                        self.wfile.write(data)
                finally:
                    up.close()

            do_GET = do_HEAD = do_PUT = do_POST = do_DELETE = _any

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        self.server.handle_error = lambda request, address: None  # a reset connection is the point
        self.endpoint = f"http://127.0.0.1:{self.server.server_address[1]}"
        self._thread = threading.Thread(target=self.server.serve_forever, name="flaky-store", daemon=True)


@contextmanager
def flaky_store(upstream: str, fault: Fault | None = None) -> Iterator[FlakyStore]:
    """A :class:`FlakyStore` in front of ``upstream`` (an endpoint URL) for the duration."""
    store = FlakyStore(upstream, fault)
    store._thread.start()
    try:
        yield store
    finally:
        store.server.shutdown()
        store.server.server_close()
