"""The command's process from its start to its end, as the user's own clock sees it.

Stated times (verify's estimate, doctor's footer) count from when the OS started the process: importing torch
and transformers alone takes 3-8 s on a 2-core CPU. At the end, the read-only commands that loaded them
(verify, doctor, profile) skip the interpreter's teardown (1.2 s of freeing modules after the last line): the
exit hooks still run; only the freeing is skipped, and only when no other Python thread is alive.
"""

from __future__ import annotations

import atexit
import contextlib
import os
import sys
import threading
import time


def _started_ago() -> float | None:
    """Seconds since the OS started this process (Linux), or None where that cannot be read."""
    try:
        with open("/proc/self/stat", "rb") as f:
            stat = f.read()
        # Field 22: the start in clock ticks since boot; field 3 is the first after the (spaced) name.
        ticks = int(stat.rsplit(b")", 1)[1].split()[19])
        return max(0.0, time.clock_gettime(time.CLOCK_BOOTTIME) - ticks / os.sysconf("SC_CLK_TCK"))
    except (OSError, ValueError, IndexError, AttributeError):  # no /proc, no CLOCK_BOOTTIME
        return None


_AGO = _started_ago()
# Where the OS's start time is unknown, the clock starts here (vlfast.cli's first import), ~0.1 s late.
_START = time.perf_counter() - (_AGO or 0.0)
FROM_PROCESS_START = _AGO is not None


def since_start() -> float:
    """Seconds since this process started."""
    return time.perf_counter() - _START


def since_start_words() -> str:
    """What :func:`since_start` counts from, for a line that states it."""
    return "since the process started" if FROM_PROCESS_START else "since vlfast's command line loaded"


_skip_teardown = False


def skip_teardown() -> None:
    """Let this process end without the interpreter's teardown (see the module's docstring)."""
    global _skip_teardown
    _skip_teardown = True


def end(code: int) -> None:
    """End the process with ``code``: at once when :func:`skip_teardown` was called and nothing else runs,
    after flushing output and running the exit hooks (``atexit``, ``weakref.finalize``)."""
    if not _skip_teardown or threading.active_count() > 1:
        sys.exit(code)
    atexit._run_exitfuncs()
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(OSError, ValueError):  # closed, or a closed pipe: nothing more to say there
            stream.flush()
    os._exit(code)
