"""Decode workers for ``extract``: an ordered map over sample indices in forked processes that survives
workers that die or hang.

``torch.utils.data.DataLoader`` cannot do this: when one of its workers dies (the OOM killer, a segfault)
it names no sample, so every resume dies at the same place, and a hung decoder stalls it forever.
``WorkerPool`` knows which task each worker is running (tasks run first in, first out per worker), so:

* a worker that dies is replaced; the sample it was running is re-run once, alone, in a fresh worker and,
  if that worker dies too, comes back as an error record naming the signal;
* a sample that runs past ``timeout`` seconds has its worker killed and comes back as an error record (no
  retry: a hang is a property of the file);
* results come back in index order.

Transport: results are pickled with ``ForkingPickler``, on which torch registers its shared-memory
reductions, so a tensor crosses as a file descriptor. The descriptors travel inside the same socket message
as the pickle (SCM_RIGHTS), not through multiprocessing's resource sharer, a thread of the sender that dies
with the worker: the results a worker sent just before dying, the ones that tell which sample killed it,
would be unreadable.
"""

from __future__ import annotations

import array
import contextlib
import ctypes
import heapq
import multiprocessing
import multiprocessing.connection
import multiprocessing.context
import multiprocessing.process
import os
import signal
import socket
import struct
import sys
import threading
import time
import traceback
from collections import deque
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from multiprocessing.reduction import ForkingPickler
from typing import Any

import torch
import torch.multiprocessing  # noqa: F401 - registers torch's shared-memory reductions on ForkingPickler

from vlfast.errors import InputRefused

__all__ = ["PoolStats", "WorkerPool", "death_reason", "unexpected_item"]

# A worker's message: kind, task index, number of file descriptors sent right after it, then the pickle.
_HEADER = struct.Struct("<Bqi")
_RESULT, _INIT_FAILED = 0, 1
_TASK = struct.Struct("<q")  # parent -> worker: the index to run; end of file means stop
_FDS_PER_MSG = 200  # descriptors per sendmsg; Linux accepts at most 253 (SCM_MAX_FD)
_CLOEXEC = getattr(socket, "MSG_CMSG_CLOEXEC", 0)  # received descriptors must not leak into exec'd decoders
_PR_SET_PDEATHSIG = 1

_SIGNAL_NOTES = {
    signal.SIGKILL: ", often the out-of-memory killer",
    **dict.fromkeys((signal.SIGSEGV, signal.SIGBUS, signal.SIGILL, signal.SIGFPE), ": the decoder crashed"),
    signal.SIGABRT: ": the decoder aborted",
}


def death_reason(exitcode: int | None) -> str:
    """The error record's reason for a sample whose worker died: the signal by name, or the exit code."""
    if exitcode is None:
        how = "exited"
    elif exitcode < 0:
        try:
            sig = signal.Signals(-exitcode)
            how = f"killed by signal {-exitcode} ({sig.name}){_SIGNAL_NOTES.get(sig, '')}"
        except ValueError:
            how = f"killed by signal {-exitcode}"
    else:
        how = f"exited with code {exitcode}"
    return f"worker died while decoding this sample: {how}"


def unexpected_item(i: int, e: BaseException, what: str = "") -> dict[str, Any]:
    """The item for a sample whose ``fn`` raised (or whose result could not cross), with the traceback:
    ``unexpected`` tells a bug from a record of bad media."""
    return {
        "i": i,
        "ok": False,
        "unexpected": True,
        "reason": f"unexpected {type(e).__name__}{what}: {e}",
        "traceback": "".join(traceback.format_exception(type(e), e, e.__traceback__)),
    }


@dataclass
class PoolStats:
    """What went wrong in a run, for logs and summaries."""

    started: int = 0  # worker processes started, replacements included
    restarts: int = 0  # of those, the ones that replaced a dead or stopped worker
    deaths: int = 0  # workers that died on their own (signal or exit), not stopped by the pool
    timeouts: int = 0  # samples whose worker was stopped for running past the timeout
    retried: int = 0  # samples re-run alone after their worker died
    recovered: int = 0  # of those, the ones whose re-run answered (its worker survived)


class _FdCollector:
    """Stands in for multiprocessing's "spawning Popen" while a worker pickles a result: torch's fd
    reduction (``DupFd``) hands it the descriptors, which are sent with the message."""

    def __init__(self) -> None:
        self.fds: list[int] = []

    def duplicate_for_child(self, fd: int) -> int:  # the storage owns fd and outlives the send: no dup
        self.fds.append(fd)
        return len(self.fds) - 1

    def DupFd(self, index: int) -> _PassedFd:  # noqa: N802 - the name multiprocessing calls
        return _PassedFd(index)


class _PassedFd:
    """A descriptor sent beside the pickle; torch's rebuild ``detach``-es and owns it."""

    def __init__(self, index: int) -> None:
        self.index = index

    def detach(self) -> int:
        fds = _receiving.fds
        fd, fds[self.index] = fds[self.index], -1
        if fd < 0:
            raise OSError(f"file descriptor {self.index} of this message was already taken")
        return fd


_receiving = threading.local()  # the descriptors of the message being unpickled, for _PassedFd.detach


def _pack(kind: int, i: int, obj: Any) -> tuple[bytes, list[int]]:
    """The message for ``obj`` and the descriptors to send after it (keep obj alive until written)."""
    collector = _FdCollector()
    multiprocessing.context.set_spawning_popen(collector)
    try:
        data = ForkingPickler.dumps(obj)
    finally:
        multiprocessing.context.set_spawning_popen(None)
    return _HEADER.pack(kind, i, len(collector.fds)) + data, collector.fds


def _write(
    conn: multiprocessing.connection.Connection, sock: socket.socket, msg: bytes, fds: list[int]
) -> None:
    conn.send_bytes(msg)
    for k in range(0, len(fds), _FDS_PER_MSG):
        chunk = array.array("i", fds[k : k + _FDS_PER_MSG])
        sock.sendmsg([b"\0"], [(socket.SOL_SOCKET, socket.SCM_RIGHTS, chunk)])


def _recv_fds(sock: socket.socket, n: int) -> list[int]:
    fds: list[int] = []
    try:
        while len(fds) < n:
            want = min(_FDS_PER_MSG, n - len(fds))  # the sender's chunking: one chunk per recvmsg
            data, ancdata, flags, _ = sock.recvmsg(1, socket.CMSG_SPACE(want * 4), _CLOEXEC)
            for level, kind, payload in ancdata:
                if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
                    got = array.array("i")
                    got.frombytes(payload[: len(payload) - len(payload) % got.itemsize])
                    fds.extend(got)
            if not data:
                raise EOFError("the worker closed its pipe while sending a result")
            if flags & socket.MSG_CTRUNC:
                raise OSError("file descriptors were truncated in transit")
    except BaseException:
        for fd in fds:
            os.close(fd)
        raise
    return fds


def _recv(conn: multiprocessing.connection.Connection, sock: socket.socket) -> tuple[int, int, Any]:
    """One message: (kind, index, object); EOFError/OSError if the pipe broke. An object that arrived whole
    but cannot be unpickled becomes an error record."""
    msg = conn.recv_bytes()
    kind, i, nfds = _HEADER.unpack_from(msg)
    fds = _recv_fds(sock, nfds)
    _receiving.fds = fds
    try:
        obj = ForkingPickler.loads(memoryview(msg)[_HEADER.size :])
    except Exception as e:  # noqa: BLE001 - one unreadable result must not end the run
        obj = unexpected_item(i, e, " receiving the result")
    finally:
        _receiving.fds = None
        for fd in fds:  # the ones no rebuild took
            if fd >= 0:
                os.close(fd)
    return kind, i, obj


def _die_with_parent(parent_pid: int) -> None:
    """Ask Linux to SIGKILL this process when its parent dies, so a hung worker never outlives a killed
    run (elsewhere workers stop at end of file on their pipe, which a hung one never reads)."""
    if sys.platform.startswith("linux"):
        with contextlib.suppress(OSError, AttributeError):  # fail soft: no libc, no prctl
            ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, int(signal.SIGKILL), 0, 0, 0)
    if os.getppid() != parent_pid:  # the parent died before prctl ran: nobody would send the signal
        os._exit(1)


def _worker_main(pool: WorkerPool, worker_id: int, conn: multiprocessing.connection.Connection) -> None:
    _die_with_parent(pool._owner)
    # Ctrl-C and a scheduler's SIGTERM often reach every process: the parent decides.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    pool._forget_in_child()
    # GNU OpenMP is not fork-safe: a forked child hangs in its first parallel op unless on one thread.
    torch.set_num_threads(1)
    sock = socket.fromfd(conn.fileno(), socket.AF_UNIX, socket.SOCK_STREAM)
    if pool.worker_init is not None:
        try:
            pool.worker_init(worker_id)
        except BaseException as e:  # noqa: BLE001 - reported to the parent, which raises it
            _write(conn, sock, *_pack(_INIT_FAILED, -1, f"{type(e).__name__}: {e}"))
            return
    fn = pool.fn
    while True:
        try:
            (i,) = _TASK.unpack(conn.recv_bytes())
        except (EOFError, OSError):
            return  # the parent closed the pipe (close()) or died
        try:
            result = fn(i)
        except BaseException as e:  # noqa: BLE001 - fn should not raise; if it does, that sample fails
            result = unexpected_item(i, e)
        try:
            msg, fds = _pack(_RESULT, i, result)
        except Exception as e:  # noqa: BLE001 - an unpicklable result (e.g. a CUDA tensor) fails its sample
            msg, fds = _pack(_RESULT, i, unexpected_item(i, e, " sending the result"))
        try:
            _write(conn, sock, msg, fds)
        except OSError:
            return  # the parent closed the pipe or died
        del result, msg, fds  # free the shared memory now, not when the next sample replaces it


@dataclass(eq=False)
class _Worker:
    """One worker process as the parent sees it."""

    slot: int
    proc: multiprocessing.process.BaseProcess
    conn: multiprocessing.connection.Connection
    sock: socket.socket
    tasks: deque[tuple[int, float]] = field(default_factory=deque)  # (index, sent at): the head is running
    free_since: float = 0.0  # when its previous result arrived (or it started)
    isolated: bool = False  # re-running a task whose worker died: nothing else until it answers
    exitcode: int | None = None  # once reaped

    def head_started(self) -> float:  # tasks run in order: when sent, or when the previous one answered
        return max(self.tasks[0][1], self.free_since)


class WorkerPool:
    """Ordered map of fn over range(n) in worker processes that survives dead and hung workers.

    ``iter(pool)`` yields ``fn(i)`` for i = 0 .. n-1 in order; a sample whose worker died twice or ran past
    ``timeout`` yields ``{"i": i, "ok": False, "reason": ...}`` instead, and so does one whose ``fn`` raised.
    Each worker holds at most ``prefetch`` tasks and at most ``num_workers * prefetch`` results are in
    flight or buffered. Workers are forked, inheriting what the caller built (an image processor), and run
    ``worker_init(worker_id)`` first (ids 0 .. num_workers-1; a replacement takes its predecessor's id), and
    are started lazily.

    ``timeout`` (seconds, None for none) counts from when a worker starts a task; results that arrived
    while the consumer was busy are read before any deadline is judged. ``num_workers=0`` calls ``fn`` in
    the calling process: no isolation, no timeout, no ``worker_init``.

    Use it as a context manager or call :meth:`close` (breaking out of the loop early is fine; finishing
    the loop, an exception inside it, or garbage collection also closes). Iterate it once, from one thread:
    Linux delivers the parent-death signal when the thread that forked a worker exits. A replacement worker
    forked mid-run shares the parent's memory of that moment copy-on-write until it exits.
    """

    def __init__(
        self,
        fn: Callable[[int], dict[str, Any]],
        n: int,
        *,
        num_workers: int,
        timeout: float | None = 120.0,
        prefetch: int = 8,
        worker_init: Callable[[int], None] | None = None,
        retry_dead: bool = True,
    ) -> None:
        self._closed = True  # until fully built: __del__ must not act on a half-made pool
        for name, value, least in (("n", n, 0), ("num_workers", num_workers, 0), ("prefetch", prefetch, 1)):
            if not isinstance(value, int) or value < least:
                kind = "positive" if least else "non-negative"
                raise InputRefused(f"{name} must be a {kind} int, got {value!r}")
        if timeout is not None and not timeout > 0:
            raise InputRefused(f"timeout must be positive seconds or None, got {timeout!r}")
        if num_workers > 0 and "fork" not in multiprocessing.get_all_start_methods():
            raise RuntimeError("worker processes need the 'fork' start method here; use num_workers=0")
        self.fn, self.n, self.num_workers, self.prefetch = fn, n, num_workers, prefetch
        self.timeout, self.worker_init, self.retry_dead = timeout, worker_init, retry_dead
        self.stats = PoolStats()
        self._owner = os.getpid()
        self._ctx = multiprocessing.get_context("fork") if num_workers > 0 else None
        self._workers: dict[int, _Worker] = {}  # by slot (= worker id)
        self._used_slots: set[int] = set()
        self._done: dict[int, dict[str, Any]] = {}  # results not yet yielded, by index
        self._pending: list[int] = []  # heap: tasks taken back from a lost worker, to hand out again
        self._isolate: deque[int] = deque()  # tasks to re-run alone in a fresh worker
        self._retried: set[int] = set()
        self._next_new = 0  # lowest index never handed out
        self._next_out = 0  # lowest index not yet yielded
        self._forking_end: multiprocessing.connection.Connection | None = None
        self._iterated = False
        self._closed = False

    def __iter__(self) -> Iterator[dict[str, Any]]:
        if self._closed:
            raise RuntimeError("this WorkerPool is closed")
        if self._iterated:
            raise RuntimeError("a WorkerPool can be iterated once")
        self._iterated = True
        return self._in_process() if self.num_workers == 0 else self._pooled()

    def __len__(self) -> int:
        return self.n

    def worker_pids(self) -> list[int]:
        """Pids of the live worker processes."""
        return [w.proc.pid for w in self._workers.values() if w.proc.is_alive()]

    def close(self) -> None:
        """Stop and reap every worker and drop buffered results. Idempotent."""
        if self._closed or os.getpid() != self._owner:
            return
        self._closed = True
        workers = list(self._workers.values())
        self._workers.clear()
        self._done.clear()
        for w in workers:  # end of file stops an idle worker; a busy one is killed below
            w.conn.close()
            w.sock.close()
        for w in workers:
            if w.tasks and w.proc.is_alive():
                w.proc.kill()
        for w in workers:
            w.proc.join(timeout=1.0)
            if w.proc.is_alive():
                w.proc.kill()
                w.proc.join()
            w.proc.close()

    def __enter__(self) -> WorkerPool:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __del__(self) -> None:
        try:  # noqa: SIM105 - contextlib itself may be gone at interpreter exit
            self.close()
        except Exception:  # noqa: BLE001 - at interpreter exit modules may be half torn down
            pass

    def _in_process(self) -> Iterator[dict[str, Any]]:
        try:
            for i in range(self.n):
                try:
                    item = self.fn(i)
                except Exception as e:  # noqa: BLE001 - same contract as in a worker
                    item = unexpected_item(i, e)
                yield item
        finally:
            self._closed = True

    def _pooled(self) -> Iterator[dict[str, Any]]:
        try:
            for i in range(self.n):
                self._next_out = i
                while True:
                    self._collect()
                    self._assign()  # also once i is in: keep workers busy while the consumer computes
                    if i in self._done:
                        break
                    self._block()
                yield self._done.pop(i)
        finally:
            self.close()

    def _block(self) -> None:
        """Sleep until a worker sends something or dies, or until the nearest deadline."""
        objs = [x for w in self._workers.values() for x in (w.conn, w.proc.sentinel)]
        if not objs:
            raise RuntimeError("internal error: a result is awaited but no worker is running")
        wait_s = None
        if self.timeout is not None:
            starts = [w.head_started() for w in self._workers.values() if w.tasks]
            if starts:
                wait_s = max(0.0, min(starts) + self.timeout - time.monotonic())
        multiprocessing.connection.wait(objs, wait_s)

    def _collect(self) -> None:
        """Read every result that has arrived, then handle dead workers, then overdue tasks (in that order,
        so a slow consumer causes no false timeout)."""
        for w in list(self._workers.values()):
            dead = not w.proc.is_alive()  # checked first: all a dead worker sent is then in the pipe
            if not self._drain(w) or dead:
                self._lost(w)
        if self.timeout is None:
            return
        now = time.monotonic()
        for w in list(self._workers.values()):
            if w.tasks and now - w.head_started() >= self.timeout and not w.conn.poll():
                self._stop_overdue(w)

    def _drain(self, w: _Worker) -> bool:
        """Read what ``w`` has sent; False once its pipe is broken (it died or is exiting)."""
        while True:
            try:
                if not w.conn.poll():
                    return True
                kind, i, obj = _recv(w.conn, w.sock)
            except (EOFError, OSError):
                return False
            if kind == _INIT_FAILED:
                raise RuntimeError(f"worker_init failed in decode worker {w.slot}: {obj}")
            head, _ = w.tasks.popleft() if w.tasks else (None, 0.0)
            if head != i:
                raise RuntimeError(f"internal error: worker {w.slot} answered task {i}, expected {head}")
            w.free_since = time.monotonic()
            if w.isolated:
                w.isolated = False
                self.stats.recovered += 1
            self._done[i] = obj

    def _lost(self, w: _Worker) -> None:
        """``w`` died: its oldest outstanding task is the one it was running."""
        self._remove(w)
        self.stats.deaths += 1
        if not w.tasks:
            return  # died idle (killed from outside): nothing to blame, a worker is started when needed
        i, _ = w.tasks.popleft()
        if self.retry_dead and i not in self._retried:
            self._retried.add(i)
            self.stats.retried += 1
            self._isolate.append(i)
        else:
            self._done[i] = {"i": i, "ok": False, "reason": death_reason(w.exitcode)}
        self._requeue(w)

    def _stop_overdue(self, w: _Worker) -> None:
        w.proc.kill()
        self._remove(w, drain=True)  # it may have answered just before the kill: then that answer stands
        if w.tasks and w.head_started() + self.timeout <= time.monotonic():
            i, _ = w.tasks.popleft()
            self.stats.timeouts += 1
            why = f"decoding took longer than {self.timeout:g} s (--decode-timeout; raise it for long videos)"
            self._done[i] = {"i": i, "ok": False, "reason": f"{why}; the worker was stopped"}
        self._requeue(w)

    def _remove(self, w: _Worker, drain: bool = False) -> None:
        del self._workers[w.slot]
        w.proc.join(timeout=5.0)
        if w.proc.is_alive():  # closed its pipe yet still running: do not wait on it any longer
            w.proc.kill()
            w.proc.join()
        w.exitcode = w.proc.exitcode
        if drain:
            self._drain(w)
        w.conn.close()
        w.sock.close()
        w.proc.close()

    def _requeue(self, w: _Worker) -> None:  # never started: not at fault, run again anywhere
        for i, _ in w.tasks:
            heapq.heappush(self._pending, i)
        w.tasks.clear()

    def _assign(self) -> None:
        """Re-runs first, each alone in a fresh worker; then taken-back and new tasks, lowest index first,
        to a new worker while a slot is free, else to the least loaded one."""
        while self._isolate and (slot := self._free_slot()) is not None:
            w = self._spawn(slot)
            w.isolated = True
            self._give(w, self._isolate.popleft())
        while (i := self._peek_task()) is not None:
            slot = self._free_slot()
            if slot is not None:
                w = self._spawn(slot)
            else:
                ready = [w for w in self._workers.values() if not w.isolated and len(w.tasks) < self.prefetch]
                if not ready:
                    return
                w = min(ready, key=lambda w: len(w.tasks))
            if self._pending and self._pending[0] == i:
                heapq.heappop(self._pending)
            else:
                self._next_new += 1
            self._give(w, i)

    def _peek_task(self) -> int | None:
        if self._pending:
            return self._pending[0]
        window = self.num_workers * self.prefetch  # bounds results in flight plus buffered out of order
        if self._next_new < self.n and self._next_new - self._next_out < window:
            return self._next_new
        return None

    def _free_slot(self) -> int | None:
        return next((s for s in range(self.num_workers) if s not in self._workers), None)

    def _give(self, w: _Worker, i: int) -> None:
        w.tasks.append((i, time.monotonic()))
        with contextlib.suppress(OSError):
            w.conn.send_bytes(_TASK.pack(i))  # fails only if the worker died: _collect sees to it

    def _spawn(self, slot: int) -> _Worker:
        parent_end, child_end = self._ctx.Pipe(duplex=True)
        proc = self._ctx.Process(
            target=_worker_main, args=(self, slot, child_end), name=f"vlfast-decode-{slot}", daemon=True
        )
        self._forking_end = parent_end  # closed in the child by _forget_in_child
        try:
            proc.start()
        finally:
            self._forking_end = None
            child_end.close()
        w = _Worker(
            slot, proc, parent_end, socket.fromfd(parent_end.fileno(), socket.AF_UNIX, socket.SOCK_STREAM)
        )
        w.free_since = time.monotonic()
        self._workers[slot] = w
        self.stats.started += 1
        if slot in self._used_slots:
            self.stats.restarts += 1
        self._used_slots.add(slot)
        return w

    def _forget_in_child(self) -> None:
        """In a new worker: drop the parent's ends of every pipe (so end of file reaches each worker when the
        parent goes) and the parent's buffered results (shared memory)."""
        self._closed = True  # this copy must never stop the parent's workers
        for w in self._workers.values():
            w.conn.close()
            w.sock.close()
        if self._forking_end is not None:
            self._forking_end.close()
        self._workers.clear()
        self._done.clear()
