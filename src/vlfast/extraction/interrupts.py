"""SIGTERM handled like Ctrl-C, and neither one cutting a commit in half.

Slurm, Kubernetes and spot preemption end a job with SIGTERM, then SIGKILL 30-120 s later; Python's default
is to die on the spot, losing up to ``commit_every`` seconds of work. While an extract runs, SIGTERM raises
:class:`Terminated`, a ``KeyboardInterrupt``, so the run unwinds as on Ctrl-C: stores commit what they
buffered and release their locks.

Either signal arriving inside a commit waits until the commit ends: raising in the middle of one would leave
the store's buffer and its index out of step, and the commit on the way out would write samples twice.
"""

from __future__ import annotations

import contextlib
import signal
import sys
import threading
from collections.abc import Callable, Iterator
from typing import Any

__all__ = [
    "EXIT_TERMINATED",
    "Terminated",
    "commit_section",
    "deferred",
    "raise_if_terminated",
    "sigterm_handler",
    "sigterm_like_sigint",
]

EXIT_TERMINATED = 128 + signal.SIGTERM  # 143: what a shell reports for a process SIGTERM ended

_Handler = Callable[[int, Any], Any]
_depth = 0  # commit sections the main thread is inside
_pending: list[tuple[_Handler, int]] = []  # handlers held back until the outermost section ends
# Terminated exceptions Python dropped inside sigterm_like_sigint: one raised where it cannot propagate (a
# finalizer, logging's at-fork hook) goes to sys.unraisablehook, and the run would go on to exit 0.
# raise_if_terminated() and the block's end raise it again.
_dropped: list[BaseException] = []


class Terminated(KeyboardInterrupt):
    """SIGTERM arrived: the run stops as on Ctrl-C, committing what is done and releasing its locks."""

    def __init__(self) -> None:
        super().__init__("terminated by SIGTERM")


def _main_thread() -> bool:
    return threading.current_thread() is threading.main_thread()


@contextlib.contextmanager
def commit_section() -> Iterator[None]:
    """Hold SIGTERM and SIGINT (as handled by :func:`deferred`) until the block ends. Signals are handled in
    the main thread only, so elsewhere this does nothing."""
    global _depth
    if not _main_thread():
        yield
        return
    _depth += 1
    try:
        yield
    finally:
        _depth -= 1
    # Reached only when the block succeeded: after a failure a held signal runs after the next section.
    if _depth == 0 and _pending:
        handler, signum = _pending[-1]
        _pending.clear()
        handler(signum, None)


def deferred(handler: _Handler) -> _Handler:
    """``handler`` as a signal handler that waits for the commit section in progress, if any."""

    def run(signum: int, frame: Any) -> Any:
        if _depth:
            _pending.append((handler, signum))
            return None
        return handler(signum, frame)

    return run


def _raise_terminated(signum: int, frame: Any) -> None:
    raise Terminated()


def raise_if_terminated() -> None:
    """Raise :class:`Terminated` if a SIGTERM's exception was dropped by Python in this block (see
    ``_dropped``). Call it where the run loops, between batches."""
    if _dropped and _main_thread():
        _raise_dropped()


def _raise_dropped() -> None:
    dropped = _dropped[-1]
    _dropped.clear()
    raise Terminated() if isinstance(dropped, Terminated) else KeyboardInterrupt()


@contextlib.contextmanager
def _noting_dropped() -> Iterator[None]:
    previous = sys.unraisablehook

    def hook(unraisable: Any) -> None:
        if isinstance(unraisable.exc_value, KeyboardInterrupt):  # Terminated, or Ctrl-C's
            _dropped.append(unraisable.exc_value)
        previous(unraisable)

    sys.unraisablehook = hook
    try:
        yield
    finally:
        sys.unraisablehook = previous


def _raise_interrupt(signum: int, frame: Any) -> None:
    raise KeyboardInterrupt()


def sigterm_handler() -> _Handler:
    """The handler :func:`sigterm_like_sigint` installs: raise :class:`Terminated`, after any commit."""
    return deferred(_raise_terminated)


@contextlib.contextmanager
def sigterm_like_sigint() -> Iterator[None]:
    """While the block runs in the main thread, SIGTERM raises :class:`Terminated` and Ctrl-C its
    ``KeyboardInterrupt``, both after any commit in progress. A handler someone else installed is left
    alone; the previous handlers come back at the end."""
    if not _main_thread():
        yield
        return
    previous: dict[int, Any] = {}
    if signal.getsignal(signal.SIGTERM) in (signal.SIG_DFL, None):
        previous[signal.SIGTERM] = signal.signal(signal.SIGTERM, sigterm_handler())
    if signal.getsignal(signal.SIGINT) is signal.default_int_handler:
        previous[signal.SIGINT] = signal.signal(signal.SIGINT, deferred(_raise_interrupt))
    _dropped.clear()
    try:
        with _noting_dropped():
            yield
    except BaseException:
        _dropped.clear()  # the run unwinds anyway
        raise
    finally:
        for signum, handler in previous.items():
            signal.signal(signum, handler)
    if _dropped:  # the block ended normally, yet a signal's exception was dropped on the way
        _raise_dropped()
