"""Which test a pytest-xdist worker was in when it died (issue 46: at load 9-22 the suite printed only
``[gw1] node down: Not properly terminated``).

xdist names a test only while its scheduler counts one as pending on that worker: a worker that dies in a
fixture's teardown after its last test, or in the session's own, is named by nothing. So each worker keeps
one line in a file of its own, rewritten as each test starts and ends (two small writes a test); when a node
goes down with an error, the controller reads that line and says, in the terminal and in the summary, which
test was running, or which had just finished. Registered by tests/conftest.py; without xdist it does nothing.

And why, where it was pytest-timeout: its thread method dumps the stacks into the test's captured output and
ends the worker with os._exit, so the dump dies with it (a Ray test at load 10 did, 2026-12-02). Each worker
asks faulthandler to write every thread's stack into a file of its own 5 s before the test's time limit
(a C thread: it writes even while Python is stuck); a dead worker's file is printed with its line.
"""

from __future__ import annotations

import faulthandler
import shutil
import tempfile
from pathlib import Path

import pytest

KEY = "vlfast_current_test_dir"  # the controller's folder, handed to each worker in its workerinput
_STACK_LINES = 120  # of a dead worker's stack dump, printed


def _time_limit(item) -> float | None:
    """The test's pytest-timeout limit in seconds (its marker's, else the ini's), None where there is none."""
    marker = item.get_closest_marker("timeout")
    value = (
        marker.args[0]
        if marker is not None and marker.args
        else marker.kwargs.get("timeout")
        if marker
        else None
    )
    if value is None:
        try:
            value = item.config.getini("timeout")
        except ValueError:  # pytest-timeout not installed
            return None
    try:
        limit = float(value)
    except (TypeError, ValueError):
        return None
    return limit if limit > 2 else None


class WorkerCrashes:
    def __init__(self, config: pytest.Config):
        self.config = config
        self.deaths: list[str] = []
        workerinput = getattr(config, "workerinput", None)
        if workerinput is not None:  # a worker: where to write, if the controller said
            folder = workerinput.get(KEY)
            self.file = Path(folder) / workerinput["workerid"] if folder else None
            self.folder = None
            self.stacks = self.file.with_suffix(".stacks").open("w") if self.file else None
        elif getattr(config.option, "numprocesses", None):  # the controller of an xdist run
            self.folder = Path(tempfile.mkdtemp(prefix="vlfast-xdist-"))
            self.file = self.stacks = None
            config.add_cleanup(lambda: shutil.rmtree(self.folder, ignore_errors=True))
        else:
            self.folder = self.file = self.stacks = None

    def _note(self, line: str) -> None:
        if self.file is not None:
            self.file.write_text(line)

    @pytest.hookimpl(wrapper=True)
    def pytest_runtest_protocol(self, item, nextitem):
        self._note(f"running {item.nodeid}")
        limit = _time_limit(item) if self.stacks is not None else None
        if limit:
            self.stacks.seek(0)
            self.stacks.truncate()
            self.stacks.write(
                f"every thread's stack {min(5.0, limit / 2):g} s before {item.nodeid}'s limit ({limit:g} s):\n"
            )
            self.stacks.flush()
            faulthandler.dump_traceback_later(limit - min(5.0, limit / 2), file=self.stacks)
        try:
            return (yield)
        finally:
            if limit:
                faulthandler.cancel_dump_traceback_later()
            self._note(f"after {item.nodeid} had finished")

    @pytest.hookimpl(optionalhook=True)
    def pytest_configure_node(self, node) -> None:
        if self.folder is not None:
            node.workerinput[KEY] = str(self.folder)

    @pytest.hookimpl(optionalhook=True)
    def pytest_testnodedown(self, node, error) -> None:
        if error is None or self.folder is None:  # a worker that finished its share
            return
        worker = node.gateway.id
        try:
            where = (self.folder / worker).read_text().strip() or "before its first test"
        except OSError:
            where = "before its first test"
        line = f"worker {worker} died ({error}) {where}"
        try:
            stacks = (self.folder / f"{worker}.stacks").read_text().splitlines()
        except OSError:
            stacks = []
        if len(stacks) > 1 and where.startswith("running"):  # the dump ran: the test outlived its time
            shown = stacks[:_STACK_LINES] + (
                [f"... {len(stacks) - _STACK_LINES} more lines"] if len(stacks) > _STACK_LINES else []
            )
            line += "\n  " + "\n  ".join(shown)
        self.deaths.append(line)
        reporter = self.config.pluginmanager.get_plugin("terminalreporter")
        if reporter is not None:
            reporter.write_line(f"[{worker}] {line}", red=True, bold=True)

    def pytest_terminal_summary(self, terminalreporter) -> None:
        if self.deaths:
            terminalreporter.write_sep("=", "workers that died")
            for line in self.deaths:
                terminalreporter.write_line(line)
