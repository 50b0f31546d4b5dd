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
