"""What a run does when its own code or its host misbehaves: a bug while decoding is never recorded as the
sample's error (that would make it done); SIGTERM commits what is done, releases locks and exits 143."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
from typer.testing import CliRunner

from _selftest import compare_caches
from vlfast.cli.main import app
from vlfast.demo import make_images
from vlfast.extraction import FeatureCache
from vlfast.extraction.api import UNEXPECTED_IN_A_ROW, UnexpectedSampleErrors, extract
from vlfast.extraction.engines.base import Hooks
from vlfast.extraction.engines.local import LocalEngine

runner = CliRunner()


@pytest.fixture
def images(tmp_path) -> Path:
    folder = tmp_path / "in"
    make_images(folder, [(32 + 8 * (k % 3), 32) for k in range(8)])
    (folder / "zz-bad.png").write_text("not an image")  # bad media: recorded, done
    return folder


def _refactor_bug(ids: set[str] | None):
    """A decode step that raises AttributeError (a refactor's typo) on ``ids``, or on every sample."""

    def decode(sample):
        if ids is None or sample.id in ids:
            sample.no_such_attribute  # noqa: B018 - the bug under test

    return decode


@pytest.mark.parametrize("workers", [0, 1])
def test_a_bug_while_decoding_leaves_the_sample_undone(images, tiny_qwen3_vl, tmp_path, workers):
    """Two samples hit an AttributeError, not in a row: the run goes on, nothing is recorded for them, they
    are not done, and the same call without the bug extracts them (and only them)."""
    ids = sorted(p.name for p in images.iterdir())
    buggy = {ids[1], ids[4]}
    out = tmp_path / "out"
    with pytest.warns(RuntimeWarning, match="unexpected AttributeError"):
        s = extract(
            images,
            out,
            model=str(tiny_qwen3_vl),
            num_workers=workers,
            engine=LocalEngine(Hooks(decode=_refactor_bug(buggy))),
        )
    assert (s.extracted, s.failed, s.unexpected, s.stopped) == (6, 1, 2, None)
    assert s.skipped + s.extracted + s.failed + s.unexpected == s.assigned == 9
    cache = FeatureCache(out)
    assert buggy.isdisjoint(cache.ids())
    assert [e["id"] for e in cache.errors()] == ["zz-bad.png"]  # only the bad media
    again = extract(images, out, model=str(tiny_qwen3_vl), num_workers=workers)
    assert (again.skipped, again.extracted, again.failed, again.unexpected) == (7, 2, 0, 0)
    assert buggy <= set(FeatureCache(out).ids())


# warned, as promised (and asserted where it matters): not noise in the suite's output
@pytest.mark.filterwarnings("ignore:.*failed with an unexpected error.*:RuntimeWarning")
def test_a_bug_on_every_sample_stops_the_run_with_its_traceback(images, tiny_qwen3_vl, tmp_path):
    out = tmp_path / "out"
    ids = sorted(p.name for p in images.iterdir())
    # The first two decode; then the bug hits every sample: the run stops at the third in a row.
    bug = _refactor_bug(set(ids[2:]))
    with pytest.raises(UnexpectedSampleErrors) as e:
        extract(images, out, model=str(tiny_qwen3_vl), num_workers=1, engine=LocalEngine(Hooks(decode=bug)))
    message = str(e.value)
    assert (
        f"{UNEXPECTED_IN_A_ROW} samples in a row" in message and ids[2 + UNEXPECTED_IN_A_ROW - 1] in message
    )
    assert "Traceback" in message and "no_such_attribute" in message and "in decode" in message
    cache = FeatureCache(out)
    assert set(cache.ids()) <= set(ids[:2])  # what was extracted before the stop is committed
    assert cache.errors() == []  # and no sample was recorded as failed

    r = runner.invoke(app, ["extract", str(images), str(out), "-m", str(tiny_qwen3_vl), "--workers", "1"])
    assert r.exit_code == 0, r.output  # without the bug the same command finishes the rest


# warned, as promised (and asserted where it matters): not noise in the suite's output
@pytest.mark.filterwarnings("ignore:.*failed with an unexpected error.*:RuntimeWarning")
def test_a_bug_is_exit_3_with_its_traceback_and_undone_samples_exit_1(
    images, tiny_qwen3_vl, tmp_path, monkeypatch
):
    base = ["extract", str(images), "-m", str(tiny_qwen3_vl), "--workers", "0"]
    monkeypatch.setattr(LocalEngine, "hooks", Hooks(decode=_refactor_bug(None)))
    r = runner.invoke(app, [*base[:2], str(tmp_path / "a"), *base[2:]])
    assert r.exit_code == 3, r.output
    assert "stopped by a bug" in r.output and "no_such_attribute" in r.output

    one = {sorted(p.name for p in images.iterdir())[3]}
    monkeypatch.setattr(LocalEngine, "hooks", Hooks(decode=_refactor_bug(one)))
    r = runner.invoke(app, [*base[:2], str(tmp_path / "b"), *base[2:]])
    assert r.exit_code == 1, r.output
    assert "1 samples failed with an unexpected error" in r.output


def test_summary_prints_error_kinds_as_a_table(media_dir, tiny_qwen3_vl, tmp_path):
    r = runner.invoke(
        app,
        ["extract", str(media_dir / "bad"), str(tmp_path / "o"), "-m", str(tiny_qwen3_vl), "--workers", "0"],
    )
    assert r.exit_code == 0, r.output
    assert "{" not in r.output  # no Python dict
    lines = r.output.splitlines()
    header = next(k for k, line in enumerate(lines) if "error kind" in line)
    assert "samples" in lines[header]
    rows = {}
    for line in lines[header + 1 :]:
        kind, _, count = line.strip().rpartition(" ")
        if not count.isdigit():
            break
        rows[kind.strip()] = int(count)
    assert sum(rows.values()) == len(FeatureCache(tmp_path / "o").errors())
    assert "empty file (0 bytes)" in rows


# ------------------------------------------------------------------------------------------- SIGTERM

DRIVER = textwrap.dedent(
    """
    # `vlfast extract` with a slow forward that says when it runs, so a test can signal it mid-run; with
    # HOLD_AFTER=N and HOLD_UNTIL=PATH it waits after forward N until PATH exists (the test makes it once its
    # signal is sent), so a loaded machine cannot finish the run before the signal lands, and a forward that
    # runs outside the main thread does not keep the signal's effect waiting
    import functools, os, sys, time
    from vlfast.extraction.engines.base import Hooks
    from vlfast.extraction.engines.local import LocalEngine

    forwards = []
    hold = int(os.environ.get("HOLD_AFTER", "0"))

    def forward(batch):
        forwards.append(len(batch))
        print(f"forward {len(forwards)}", flush=True)
        time.sleep(0.1)
        if hold and len(forwards) == hold:
            for _ in range(1200):  # two minutes at most: the test's hang guard says the rest
                if os.path.exists(os.environ["HOLD_UNTIL"]):
                    break
                time.sleep(0.1)

    LocalEngine.hooks = Hooks(forward=forward)
    from vlfast.cli.main import main

    sys.argv = ["vlfast", "extract", *sys.argv[1:]]
    main()
    """
)


def _env() -> dict[str, str]:
    return os.environ | {"PYTHONPATH": os.pathsep.join(sys.path)}


def _wait_for_forward(p: subprocess.Popen, n: int) -> None:
    for line in p.stdout:
        if line.startswith("forward ") and int(line.split()[1]) >= n:
            return
    raise AssertionError(f"the run ended before forward {n}: exit {p.wait()}")


def test_sigterm_commits_what_is_done_and_the_same_command_resumes(tiny_qwen3_vl, tmp_path):
    """SIGTERM mid-run with nothing committed yet (--commit-every 3600): the run commits what it extracted,
    releases its lock, says so and exits 143; the same command then extracts only the rest, and OUT ends
    byte-identical to an uninterrupted run."""
    from vlfast.extraction.store.writer import rank_is_held

    inputs = tmp_path / "in"
    make_images(inputs, [(32 + 8 * (k % 4), 32) for k in range(24)])
    (inputs / "zz-bad.png").write_text("not an image")
    (tmp_path / "driver.py").write_text(DRIVER)

    def cmd(out: Path) -> list[str]:
        return [
            sys.executable, str(tmp_path / "driver.py"), str(inputs), str(out), "-m", str(tiny_qwen3_vl),
            "--workers", "1", "--batch-tokens", "64", "--commit-every", "3600",
        ]  # fmt: skip

    # The uninterrupted run, in this process (the signal is what needs a process of its own): same options.
    assert extract(
        inputs, tmp_path / "ref", model=str(tiny_qwen3_vl), num_workers=1, max_batch_tokens=64
    ).failed

    out = tmp_path / "out"
    held = {"HOLD_AFTER": "6", "HOLD_UNTIL": str(tmp_path / "signalled")}
    p = subprocess.Popen(
        cmd(out), env=_env() | held, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )
    _wait_for_forward(p, 6)
    p.send_signal(signal.SIGTERM)
    (tmp_path / "signalled").touch()
    _, stderr = p.communicate(timeout=120)  # a hang guard, not a speed bound: CI hosts are loaded
    assert p.returncode == 143, stderr[-3000:]
    assert "terminated (SIGTERM)" in stderr and "run the same command to resume" in stderr
    committed = len(FeatureCache(out))
    assert 5 <= committed < 24  # at least the forwards that had finished when the signal came
    assert not rank_is_held(out, 0)

    again = subprocess.run(cmd(out), env=_env(), capture_output=True, text=True, timeout=600)
    assert again.returncode == 0, again.stderr[-3000:]
    assert f"{committed} already in OUT" in again.stdout or f"{committed + 1} already in OUT" in again.stdout
    assert compare_caches(tmp_path / "ref", out) == []


@pytest.fixture
def python_signal_defaults():
    """Python's own SIGTERM and SIGINT handlers, whatever an earlier test left: ray.init in this process
    installs a SIGTERM handler of its own (one that exits), which sigterm_like_sigint rightly leaves alone."""
    saved = (
        signal.signal(signal.SIGTERM, signal.SIG_DFL),
        signal.signal(signal.SIGINT, signal.default_int_handler),
    )
    yield
    signal.signal(signal.SIGTERM, saved[0])
    signal.signal(signal.SIGINT, saved[1])


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT])
def test_a_signal_inside_a_commit_waits_for_it(tmp_path, signum, python_signal_defaults):
    """SIGTERM or Ctrl-C while a shard is being committed: the commit completes, then the run unwinds. Raised
    in the middle, it would leave a shard without its index part and the buffer still full."""
    import torch

    from vlfast.extraction.interrupts import Terminated, sigterm_like_sigint
    from vlfast.extraction.store.writer import FeatureStore

    out = tmp_path / "o"
    with sigterm_like_sigint():
        store = FeatureStore(out, {"task": "test"}, commit_every=None)
        store.add("a", {"x": torch.ones(3)})
        real = store._write_index_part

        def signalled(*args, **kwargs):
            os.kill(os.getpid(), signum)  # handled at the next bytecode: inside the commit
            time.sleep(0.05)
            return real(*args, **kwargs)

        store._write_index_part = signalled
        with pytest.raises(Terminated if signum == signal.SIGTERM else KeyboardInterrupt):
            store.close()
    assert signal.getsignal(signal.SIGTERM) is signal.SIG_DFL  # handlers restored
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler
    assert sorted(FeatureCache(out).ids()) == ["a"]


@pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning")  # the drop it makes
def test_a_sigterm_python_drops_still_stops_the_run(python_signal_defaults):
    """SIGTERM landing where Python drops exceptions (a finalizer; logging's at-fork hook after each decode
    worker's fork) printed 'Exception ignored' and the run went on to exit 0. It is raised again where the
    run loops, and at the block's end."""
    import gc

    from vlfast.extraction.interrupts import Terminated, raise_if_terminated, sigterm_like_sigint

    class Finalized:
        def __del__(self):
            os.kill(os.getpid(), signal.SIGTERM)  # the handler runs here: its exception is dropped
            time.sleep(0.05)

    with pytest.raises(Terminated), sigterm_like_sigint():
        Finalized()
        gc.collect()
        raise_if_terminated()
        pytest.fail("the loop went on")
    with pytest.raises(Terminated), sigterm_like_sigint():  # no loop check: the block's end raises it
        Finalized()
        gc.collect()
    with sigterm_like_sigint():  # a new block starts clean
        raise_if_terminated()
    with pytest.raises(Terminated), sigterm_like_sigint():  # one that propagated is not raised twice
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(0.05)
    with sigterm_like_sigint():
        raise_if_terminated()
