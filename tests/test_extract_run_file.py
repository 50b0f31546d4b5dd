"""run.json lost or damaged over sound parts (issue 38 item 6): lost is rebuilt, damaged gets advice that keeps
the committed samples, and neither is ever a TypeError (exit 3) nor advice to throw the work away."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from typer.testing import CliRunner

from vlfast.cli.main import app
from vlfast.errors import InputRefused
from vlfast.extraction import FeatureCache
from vlfast.extraction.api import extract
from vlfast.extraction.store.export import export

runner = CliRunner()


def _run(inputs: Path, out: Path, model: Path, **kw):
    return extract(str(inputs), str(out), model=str(model), num_workers=0, **kw)


def test_a_finished_out_without_run_json_gets_it_back(two, tiny_qwen3_vl, tmp_path):
    out = tmp_path / "out"
    _run(two, out, tiny_qwen3_vl)
    before = json.loads((out / "run.json").read_text())
    (out / "run.json").unlink()
    with pytest.raises(FileNotFoundError, match="run the same `vlfast extract`"):
        FeatureCache(out)  # says how to get it back, not "not an extraction folder"

    summary = _run(two, out, tiny_qwen3_vl)
    assert summary.nothing_to_do and summary.extracted == 0
    after = json.loads((out / "run.json").read_text())
    assert after["config_hash"] == before["config_hash"] and after["volatile_keys"] == before["volatile_keys"]
    assert sorted(FeatureCache(out).ids()) == ["gray.png", "rgb.jpg"]
    assert export(out, tmp_path / "v.parquet", feature="vision_mean").rows == 2


@pytest.mark.parametrize(
    "damage",
    ["not json", "format_version as text", "config not an object", "a value edited", "volatile_keys edited"],
)
def test_damaged_run_json_gets_advice_that_keeps_the_work(damage, two, tiny_qwen3_vl, tmp_path):
    out = tmp_path / "out"
    _run(two, out, tiny_qwen3_vl)
    path = out / "run.json"
    doc = json.loads(path.read_text())
    if damage == "not json":
        path.write_text(path.read_text()[:200])
    else:
        if damage == "format_version as text":
            doc["format_version"] = "2"
        elif damage == "config not an object":
            doc["config"] = "qwen"
        elif damage == "a value edited":
            doc["config"]["dtype"] = "bfloat16"
        else:
            doc["volatile_keys"] = ["weights", *doc["volatile_keys"]]
        path.write_text(json.dumps(doc))

    for attempt in (lambda: _run(two, out, tiny_qwen3_vl), lambda: FeatureCache(out)):
        with pytest.raises(InputRefused) as e:
            attempt()
        message = str(e.value)
        assert "run.json" in message and "aside" in message and "new OUT" not in message, message
        assert "nothing is extracted again" in message, message

    # The advice, followed: run.json moved aside, the same command; nothing is redone.
    path.rename(out / "run.json.damaged")
    summary = _run(two, out, tiny_qwen3_vl)
    assert summary.nothing_to_do and summary.extracted == 0
    assert sorted(FeatureCache(out).ids()) == ["gray.png", "rgb.jpg"]


def test_damaged_run_json_is_exit_2_with_advice_in_every_command(two, tiny_qwen3_vl, tmp_path):
    out = tmp_path / "out"
    _run(two, out, tiny_qwen3_vl)
    doc = json.loads((out / "run.json").read_text())
    doc["format_version"] = "2"
    (out / "run.json").write_text(json.dumps(doc))
    commands = [
        ["extract", str(two), str(out), "-m", str(tiny_qwen3_vl), "--workers", "0"],
        ["out", "verify", str(out)],
        ["out", "compact", str(out)],
        ["export", str(out), str(tmp_path / "v.parquet"), "--feature", "vision_mean"],
    ]
    for args in commands:
        r = runner.invoke(app, args)
        assert r.exit_code == 2, (args, r.output)
        assert "aside" in r.output and "unexpected" not in r.output, (args, r.output)


def test_run_json_of_another_run_over_sound_parts(two, tiny_qwen3_vl, tmp_path):
    """A run.json replaced by another run's (its own hash consistent): the parts, which agree with each other,
    are the work to keep; the advice says so in both directions instead of "move each part out"."""
    out, other = tmp_path / "out", tmp_path / "other"
    _run(two, out, tiny_qwen3_vl)
    _run(two, other, tiny_qwen3_vl, max_pixels=200_000)
    shutil.copy(other / "run.json", out / "run.json")

    with pytest.raises(InputRefused) as e:  # the command that wrote the parts
        _run(two, out, tiny_qwen3_vl)
    message = str(e.value)
    assert "aside" in message and "index parts" in message and "nothing is extracted again" in message, (
        message
    )

    with pytest.raises(InputRefused) as e:  # the command run.json now names
        _run(two, out, tiny_qwen3_vl, max_pixels=200_000)
    message = str(e.value)
    assert "aside" in message and "new OUT" in message and "Move " not in message, message
