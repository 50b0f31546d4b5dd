"""A pytest-xdist worker that dies is named with the test it was in (tests/_worker_crash.py), also where xdist
itself names none: a worker that dies after its last test, as the session ends."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).parent
SUITE = """
import os, signal

def test_dies():
    os.kill(os.getpid(), signal.SIGKILL)

def test_passes():
    os.environ["DIE_AS_THE_SESSION_ENDS"] = "1"
"""
CONFTEST = """
import os, signal
from _worker_crash import WorkerCrashes

def pytest_configure(config):
    config.pluginmanager.register(WorkerCrashes(config), "vlfast-worker-crashes")

def pytest_sessionfinish(session):
    if os.environ.get("DIE_AS_THE_SESSION_ENDS"):  # the worker that ran test_passes, its tests all done
        os.kill(os.getpid(), signal.SIGKILL)
"""


def test_a_dead_worker_is_named_with_its_test(tmp_path):
    (tmp_path / "conftest.py").write_text(CONFTEST)
    (tmp_path / "test_die.py").write_text(SUITE)
    env = os.environ | {
        "PYTHONPATH": os.pathsep.join(filter(None, [str(HERE), os.environ.get("PYTHONPATH")]))
    }
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "pytest",
            "-n",
            "2",
            "-p",
            "no:cacheprovider",
            "-p",
            "no:randomly",
            "test_die.py",
        ],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    out = done.stdout + done.stderr
    assert done.returncode != 0, out
    assert "died (Not properly terminated) running test_die.py::test_dies" in out, out
    # xdist's own report names no test here: nothing was pending on that worker
    assert "died (Not properly terminated) after test_die.py::test_passes had finished" in out, out
    assert "= workers that died =" in out, out


HANGS = """
import time
import pytest

def hang_here():
    time.sleep(60)

@pytest.mark.timeout(6)
def test_hangs():
    hang_here()
"""


def test_a_worker_ended_by_its_time_limit_shows_where_it_hung(tmp_path):
    """pytest-timeout's thread method ends the worker with os._exit after writing the stacks into the test's
    captured output, which dies with it: the worker's own faulthandler dump, 3 s before the limit here, is
    what the controller prints, naming the function the test was stuck in."""
    (tmp_path / "conftest.py").write_text(CONFTEST)
    (tmp_path / "test_hang.py").write_text(HANGS)
    env = os.environ | {
        "PYTHONPATH": os.pathsep.join(filter(None, [str(HERE), os.environ.get("PYTHONPATH")]))
    }
    cmd = [sys.executable, "-m", "pytest", "-n", "1", "-p", "no:cacheprovider", "-o", "timeout_method=thread"]
    done = subprocess.run(
        [*cmd, "test_hang.py"], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120
    )
    out = done.stdout + done.stderr
    assert done.returncode != 0, out
    assert "running test_hang.py::test_hangs" in out, out
    assert "every thread's stack 3 s before test_hang.py::test_hangs's limit (6 s)" in out, out
    assert "in hang_here" in out, out
