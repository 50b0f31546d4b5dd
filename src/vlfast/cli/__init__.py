"""The ``vlfast`` command line: one file per command group, each a thin layer over the library.

Importing this package (every ``vlfast`` command does, first) makes torch's idle OpenMP threads sleep
instead of spinning, and MKL's matrix products give the same bits whatever the thread count.
"""

from __future__ import annotations

import os
import sys


def let_idle_threads_sleep() -> bool:
    """Make torch's idle OpenMP threads sleep at once instead of spinning; only works before torch loads.

    Spinning idle threads take the cores another process needs, and a preempted one stalls the op's
    barrier: a busy neighbour made ``vlfast profile`` report an 8x slower tower, and ``vlfast extract``'s
    decode workers need those cores (1.50x -> 1.92x the naive loop on 2 cores). Left alone when the user
    set it, or when torch is already imported (OpenMP reads it once). Returns whether it was set.
    """
    if "OMP_WAIT_POLICY" in os.environ or "torch" in sys.modules:
        return False
    os.environ["OMP_WAIT_POLICY"] = "PASSIVE"
    return True


# MKL (torch's CPU BLAS on x86) picks its summation order by the thread count and the number of rows (an
# AVX-512 Xeon's float32 product differs in its last bits between 1 and 2 threads). Its strict mode, read at
# MKL's first call, keeps one order at no measured cost, so a sample extracted by any rank, actor, batch or
# --workers is bit-identical to an uninterrupted run's. Ray's workers get it too (engines.ray.ENV).
SAME_BITS_ENV = {"MKL_CBWR": "AUTO,STRICT"}


def same_bits_for_any_thread_count() -> bool:
    """Set :data:`SAME_BITS_ENV` before torch (and MKL) loads; left alone where the user set it or torch is
    already imported. Returns whether it was set."""
    if "torch" in sys.modules or any(k in os.environ for k in SAME_BITS_ENV):
        return False
    os.environ.update(SAME_BITS_ENV)
    return True


let_idle_threads_sleep()
same_bits_for_any_thread_count()

# The clock every stated time counts from starts with the package (where the OS's start time is unknown).
from vlfast.cli import _process  # noqa: E402, F401
