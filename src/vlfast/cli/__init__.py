"""The ``vlfast`` command line: one file per command group, each a thin layer over the library.

Importing this package (every ``vlfast`` command does, first) makes torch's idle OpenMP threads sleep
instead of spinning: the one place for every command that times or runs anything on a CPU.
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
    loop on 2 cores, ``benchmarks/extract.py``). Left alone when the user set it, or when torch is already
    imported (too late: OpenMP reads it once). Returns whether it was set.
    """
    if "OMP_WAIT_POLICY" in os.environ or "torch" in sys.modules:
        return False
    os.environ["OMP_WAIT_POLICY"] = "PASSIVE"
    return True


let_idle_threads_sleep()
