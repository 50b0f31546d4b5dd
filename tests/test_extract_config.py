"""What the run configuration holds and when it is checked: everything that changes a feature's bits is
configuration (a resume with another value is refused), and everything the configuration and the device
allow is checked before OUT is written, so a corrected command is never refused as "a different
configuration" of a run that never extracted anything."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from typer.testing import CliRunner

import vlfast.extraction.pipeline as pipeline
from vlfast.cli.main import app
from vlfast.extraction import FeatureCache, RunConfigMismatch
from vlfast.extraction.pipeline import extract

runner = CliRunner()


@pytest.fixture
def few(media_dir, tmp_path) -> Path:
    folder = tmp_path / "in"
    folder.mkdir()
    for name in ("rgb.jpg", "gray.png"):
        shutil.copy(media_dir / "good" / name, folder / name)
    return folder


@pytest.fixture
def no_model_load(monkeypatch):
    """Fail the test if the pipeline builds a model."""
    monkeypatch.setattr(pipeline, "_load", lambda *a, **k: pytest.fail("the model was loaded"))


# ------------------------------------------------------------------------------ --no-patch is configuration


def test_a_resume_with_another_patch_setting_is_refused(few, tiny_qwen3_vl, tmp_path, monkeypatch):
    """Patched and unpatched convs give features that differ in their last bits: one OUT never mixes them."""
    patched, unpatched = tmp_path / "patched", tmp_path / "unpatched"
    extract(few, patched, model=str(tiny_qwen3_vl), num_workers=0)
    extract(few, unpatched, model=str(tiny_qwen3_vl), num_workers=0, patch_convs=False)
    assert FeatureCache(unpatched).run_config["patch_convs"] is False
    (few / "rgb.jpg").rename(few / "new.jpg")  # something left to do, so only the configuration can stop it

    monkeypatch.setattr(pipeline, "_load", lambda *a, **k: pytest.fail("model loaded before the refusal"))
    with pytest.raises(RunConfigMismatch, match="patch_convs"):
        extract(few, patched, model=str(tiny_qwen3_vl), num_workers=0, patch_convs=False)
    with pytest.raises(RunConfigMismatch, match="patch_convs"):
        extract(few, unpatched, model=str(tiny_qwen3_vl), num_workers=0)
    r = runner.invoke(app, ["extract", str(few), str(patched), "-m", str(tiny_qwen3_vl), "--no-patch"])
    assert r.exit_code == 2 and "patch_convs" in r.output and "--overwrite" in r.output, r.output


def test_the_default_patched_config_is_unchanged(few, tiny_qwen3_vl, tmp_path):
    """An OUT written with the default before patch_convs was configuration still resumes: the key is
    recorded only for unpatched runs (a patched run.json has no top-level patch_convs)."""
    out = tmp_path / "out"
    extract(few, out, model=str(tiny_qwen3_vl), num_workers=0)
    assert "patch_convs" not in json.loads((out / "run.json").read_text())["config"]
