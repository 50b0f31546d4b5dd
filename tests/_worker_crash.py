"""Which test a pytest-xdist worker was in when it died (issue 46: at load 9-22 the suite printed only
``[gw1] node down: Not properly terminated``).

xdist names a test only while its scheduler counts one as pending on that worker: a worker that dies in a
fixture's teardown after its last test, or in the session's own, is named by nothing. So each worker keeps
one line in a file of its own, rewritten as each test starts and ends (two small writes a test); when a node
goes down with an error, the controller reads that line and says, in the terminal and in the summary, which
test was running, or which had just finished. Registered by tests/conftest.py; without xdist it does nothing.
"""

from __future__ import annotations

import shutil
import tempfile
from pathlib import Path

import pytest

KEY = "vlfast_current_test_dir"  # the controller's folder, handed to each worker in its workerinput


class WorkerCrashes:
    def __init__(self, config: pytest.Config):
        self.config = config
        self.deaths: list[str] = []
        workerinput = getattr(config, "workerinput", None)
        if workerinput is not None:  # a worker: where to write, if the controller said
            folder = workerinput.get(KEY)
            self.file = Path(folder) / workerinput["workerid"] if folder else None
            self.folder = None
        elif getattr(config.option, "numprocesses", None):  # the controller of an xdist run
            self.folder = Path(tempfile.mkdtemp(prefix="vlfast-xdist-"))
            self.file = None
            config.add_cleanup(lambda: shutil.rmtree(self.folder, ignore_errors=True))
        else:
            self.folder = self.file = None

    def _note(self, line: str) -> None:
        if self.file is not None:
            self.file.write_text(line)

    @pytest.hookimpl(wrapper=True)
    def pytest_runtest_protocol(self, item, nextitem):
        self._note(f"running {item.nodeid}")
        try:
            return (yield)
        finally:
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
        self.deaths.append(line)
        reporter = self.config.pluginmanager.get_plugin("terminalreporter")
        if reporter is not None:
            reporter.write_line(f"[{worker}] {line}", red=True, bold=True)

    def pytest_terminal_summary(self, terminalreporter) -> None:
        if self.deaths:
            terminalreporter.write_sep("=", "workers that died")
            for line in self.deaths:
                terminalreporter.write_line(line)
