"""SIGKILL the store's crash driver (``python tests/_selftest.py OUT -v``) at random points."""

from __future__ import annotations

import os
import random
import signal
import subprocess
import sys
import time


def env() -> dict[str, str]:
    """This interpreter's environment, with its import path, for the driver's processes."""
    return os.environ | {"PYTHONPATH": os.pathsep.join(sys.path)}


def kill_at_random_points(
    cmd: list[str], rounds: int, rng: random.Random, jitter: float, during: str | None = None
) -> list[tuple[int, int]]:
    """Run ``cmd`` (the driver with ``-v``) ``rounds`` times, each SIGKILLed after a random number of added
    samples (up to a third of what it had pending) plus up to ``jitter`` seconds, so kills land anywhere:
    mid-add, mid-shard-write, between a shard and its index part, mid error record. Returns (samples pending
    at start, samples added when killed) per run. ``during``: a line the driver prints when a step begins
    ("compacting"): the kill then comes up to ``jitter`` seconds after the first such line past the target."""
    progress = []
    for _ in range(rounds):
        p = subprocess.Popen(cmd, env=env(), stdout=subprocess.PIPE, text=True)
        first = p.stdout.readline()
        assert first.startswith("pending "), first
        pending = int(first.split()[1])
        target, added = rng.randint(1, max(1, pending // 3)), 0
        while added < target or during is not None:
            line = p.stdout.readline()
            if during is not None and line.startswith(during):
                if added >= target:
                    break
                continue
            assert line.startswith("added "), f"driver ended early: {line!r}"
            added = int(line.split()[1])
        time.sleep(rng.uniform(0, jitter))
        assert p.poll() is None, "the run finished before the kill: the kill must land mid-run"
        os.kill(p.pid, signal.SIGKILL)
        p.wait(timeout=30)
        p.stdout.close()
        assert p.returncode == -signal.SIGKILL
        progress.append((pending, added))
    return progress
