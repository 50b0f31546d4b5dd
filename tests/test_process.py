"""`vlfast.cli._process`: stated times count from the process's start; read-only commands skip the teardown."""

from __future__ import annotations

import subprocess
import sys

import pytest


def _python(code: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="the OS's start time is read from /proc")
def test_the_clock_counts_from_the_process_start_not_from_the_import():
    out = _python(
        "import time; time.sleep(0.5)\n"
        "from vlfast.cli._process import FROM_PROCESS_START, since_start, since_start_words\n"
        "print(since_start(), FROM_PROCESS_START, since_start_words())"
    )
    assert out.returncode == 0, out.stderr
    seconds, known, *words = out.stdout.split()
    assert 0.5 <= float(seconds) < 60 and known == "True", out.stdout
    assert " ".join(words) == "since the process started"


def test_end_flushes_and_runs_the_exit_hooks_when_it_skips_the_teardown():
    out = _python(
        "import atexit, sys\n"
        "from vlfast.cli import _process\n"
        "atexit.register(lambda: sys.stderr.write('hook ran'))\n"
        "print('the answer', end='')  # still in the buffer\n"
        "_process.skip_teardown()\n"
        "_process.end(3)\n"
    )
    assert (out.returncode, out.stdout, out.stderr) == (3, "the answer", "hook ran")


def test_end_exits_as_usual_while_another_thread_runs():
    out = _python(
        "import threading, time\n"
        "from vlfast.cli import _process\n"
        "threading.Thread(target=lambda: (time.sleep(0.3), print('thread done', flush=True))).start()\n"
        "_process.skip_teardown()\n"
        "_process.end(0)\n"
    )
    assert out.returncode == 0 and "thread done" in out.stdout, out  # joined, not cut


def test_demo_checkpoint_states_its_time_with_start_up(tmp_path):
    """Its help said "seconds" and it took 46 s on a busy machine (issue 39): the help gives a measured figure
    with start-up in it, and the closing line the time since the process started."""
    from typer.testing import CliRunner

    from vlfast.cli.main import app

    runner = CliRunner()
    assert "start-up included" in " ".join(runner.invoke(app, ["demo-checkpoint", "-h"]).output.split())
    r = runner.invoke(app, ["demo-checkpoint", str(tmp_path / "ckpt")])
    assert r.exit_code == 0, r.output
    assert " s since the process started" in r.output, r.output
