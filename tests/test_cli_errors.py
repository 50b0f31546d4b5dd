"""Refusals vs bugs: vlfast's own refusals are exit 2 with their message; any other exception that leaves
the library (a TypeError or ValueError from a bug, ours or a dependency's) is exit 3 with a hint to
set VLFAST_DEBUG=1, which then shows the traceback."""

from __future__ import annotations

import pytest
from typer.testing import CliRunner

import vlfast.extraction.plan as extract_plan
from vlfast.cli.main import app
from vlfast.errors import InputRefused, VlfastError

runner = CliRunner()


@pytest.fixture
def one_image(media_dir):
    return str(media_dir / "good" / "rgb.jpg")


def test_refusals_are_one_family_that_old_callers_still_catch():
    import vlfast

    assert vlfast.VlfastError is VlfastError and vlfast.InputRefused is InputRefused
    from vlfast.extraction.objstore import RemoteInputError
    from vlfast.extraction.sources import EmptyInput
    from vlfast.extraction.store.format import DamagedFile, OutputInUse, OutputNotWritable
    from vlfast.extraction.store.resume import RunConfigMismatch

    for cls in (EmptyInput, DamagedFile, RemoteInputError, RunConfigMismatch):
        assert issubclass(cls, InputRefused) and issubclass(cls, ValueError), cls
    assert issubclass(OutputInUse, VlfastError) and issubclass(OutputInUse, RuntimeError)
    assert issubclass(OutputNotWritable, VlfastError) and issubclass(OutputNotWritable, PermissionError)
    # vlfast raised TypeError for some of these refusals before: `except TypeError` still catches them
    with pytest.raises(TypeError):
        from vlfast.extraction.model.features import FeatureSpec

        FeatureSpec(layers=("last",))


def test_a_refusal_is_exit_2(one_image, tmp_path):
    r = runner.invoke(app, ["extract", one_image, str(tmp_path / "o"), "-m", "ref:no-such-model"])
    assert r.exit_code == 2, r.output
    assert "invalid input" in r.output and "unknown reference" in r.output
    assert "VLFAST_DEBUG" not in r.output  # the message says what to do; no traceback hint


@pytest.mark.parametrize("bug", [TypeError("unsupported operand type(s)"), ValueError("too many values")])
def test_a_bug_is_exit_3_with_the_traceback_hint(one_image, tmp_path, monkeypatch, bug):
    """A TypeError or ValueError that vlfast did not raise as a refusal is not the user's mistake."""

    def broken(*a, **k):
        raise bug

    monkeypatch.setattr(extract_plan, "load_inputs", broken)
    monkeypatch.delenv("VLFAST_DEBUG", raising=False)
    r = runner.invoke(app, ["extract", one_image, str(tmp_path / "o"), "-m", "ref:qwen3-vl-2b"])
    assert r.exit_code == 3, r.output
    assert f"unexpected {type(bug).__name__}" in r.output and str(bug) in r.output
    assert "VLFAST_DEBUG=1" in r.output and "invalid input" not in r.output

    monkeypatch.setenv("VLFAST_DEBUG", "1")
    r = runner.invoke(app, ["extract", one_image, str(tmp_path / "o"), "-m", "ref:qwen3-vl-2b"])
    assert r.exception is bug  # re-raised as it is, traceback and all


@pytest.mark.parametrize("config", ['{"model_type": "no-such-family"}', "{not json"])
def test_a_checkpoint_transformers_cannot_read_is_a_refusal(one_image, tmp_path, config):
    """transformers raises ValueError for these: the user's files, so exit 2 naming them, not a bug."""
    ckpt = tmp_path / "ckpt"
    ckpt.mkdir()
    (ckpt / "config.json").write_text(config)
    r = runner.invoke(app, ["extract", one_image, str(tmp_path / "o"), "-m", str(ckpt)])
    assert r.exit_code == 2, r.output
    assert "config.json cannot be read by transformers" in r.output and not (tmp_path / "o").exists()
