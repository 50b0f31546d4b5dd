"""The ``vlfast`` command line: one file per command group, each a thin layer over the library.

Importing this package (every ``vlfast`` command does, first) makes torch's idle OpenMP threads sleep
instead of spinning, and MKL's matrix products give the same bits whatever the thread count: the one
place for every command that times or runs anything on a CPU.
"""

from __future__ import annotations

import os
import sys


def let_idle_threads_sleep() -> bool:
    """Make torch's idle OpenMP threads sleep at once instead of spinning; only works before torch loads.

    After each parallel op, OpenMP's idle threads (one per core) busy-wait for the next by default. On a
    shared machine they spin on the cores another process needs, and a preempted thread stalls the
    op's barrier: a busy neighbour made ``vlfast profile`` report an 8x slower tower and a 2.0x patch gain
    instead of 3.0x. ``vlfast extract``'s decode workers need those cores too (1.50x -> 1.92x the naive
    loop on 2 cores, ``benchmarks/extract.py pipeline``). Left alone when the user set it, or when torch is
    already imported (too late: OpenMP reads it once). Returns whether it was set.
    """
    if "OMP_WAIT_POLICY" in os.environ or "torch" in sys.modules:
        return False
    os.environ["OMP_WAIT_POLICY"] = "PASSIVE"
    return True


# MKL (torch's CPU BLAS on x86) picks its summation order by the thread count and the number of rows: on
# an Intel Xeon with AVX-512, a (37 x 1536) @ (1536 x 1024) float32 product differs in its last bits between
# 1 and 2 threads, and a 1-row product from the same row of a bigger one. Its strict reproducibility mode
# (MKL_CBWR, read at MKL's first call: once torch has run a product it is too late) keeps one order
# whatever the threads and rows, at no measured cost (a 3072 x 1536 x 1024 product: 45 against 46-50 ms),
# so a sample extracted by a torchrun rank with OMP_NUM_THREADS=1, a Ray actor, in another batch or on
# resume with other --workers is bit-identical to an uninterrupted run's. The Ray engine's workers get the same (vlfast.extraction.engines.ray.ENV).
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
