"""What a run does when its own code or its host misbehaves: a bug while decoding is never recorded as the
sample's error (that would make it done); SIGTERM commits what is done, releases locks and exits 143."""

from __future__ import annotations

from pathlib import Path

import pytest
from typer.testing import CliRunner

import vlfast.extraction.pipeline as pipeline
from vlfast.cli.main import app
from vlfast.extraction import FeatureCache
from vlfast.extraction.pipeline import UNEXPECTED_IN_A_ROW, UnexpectedSampleErrors, extract
from vlfast.extraction.synthetic import make_images

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
            images, out, model=str(tiny_qwen3_vl), num_workers=workers, _decode_hook=_refactor_bug(buggy)
        )
    assert (s.extracted, s.failed, s.unexpected, s.stopped) == (6, 1, 2, None)
    assert s.skipped + s.extracted + s.failed + s.unexpected == s.assigned == 9
    cache = FeatureCache(out)
    assert buggy.isdisjoint(cache.ids())
    assert [e["id"] for e in cache.errors()] == ["zz-bad.png"]  # only the bad media
    again = extract(images, out, model=str(tiny_qwen3_vl), num_workers=workers)
    assert (again.skipped, again.extracted, again.failed, again.unexpected) == (7, 2, 0, 0)
    assert buggy <= set(FeatureCache(out).ids())


def test_a_bug_on_every_sample_stops_the_run_with_its_traceback(images, tiny_qwen3_vl, tmp_path):
    out = tmp_path / "out"
    ids = sorted(p.name for p in images.iterdir())
    # The first two decode; then the bug hits every sample: the run stops at the third in a row.
    bug = _refactor_bug(set(ids[2:]))
    with pytest.raises(UnexpectedSampleErrors) as e:
        extract(images, out, model=str(tiny_qwen3_vl), num_workers=1, _decode_hook=bug)
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


def test_a_bug_is_exit_3_with_its_traceback_and_undone_samples_exit_1(
    images, tiny_qwen3_vl, tmp_path, monkeypatch
):
    base = ["extract", str(images), "-m", str(tiny_qwen3_vl), "--workers", "0"]
    real = pipeline.extract
    monkeypatch.setattr(pipeline, "extract", lambda *a, **k: real(*a, **k, _decode_hook=_refactor_bug(None)))
    r = runner.invoke(app, [*base[:2], str(tmp_path / "a"), *base[2:]])
    assert r.exit_code == 3, r.output
    assert "stopped by a bug" in r.output and "no_such_attribute" in r.output

    one = {sorted(p.name for p in images.iterdir())[3]}
    monkeypatch.setattr(pipeline, "extract", lambda *a, **k: real(*a, **k, _decode_hook=_refactor_bug(one)))
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
