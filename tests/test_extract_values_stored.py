"""Values are stored as computed, or refused: a ``--store-dtype`` that cannot hold a sample's values (an
overflow to inf) records that sample as an error naming the range, and the run goes on. Never a silent inf.

A NaN or inf the model itself computed is stored as it came (extraction does not judge values, as before);
only what the cast to the store dtype changes into a non-finite value is refused. ``--verify`` checks
bytes against checksums, and says so: its OK is not a claim about the values.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch
from typer.testing import CliRunner

import vlfast.extraction.model.runner as model_runner
from vlfast.cli.main import app
from vlfast.extraction import FeatureCache
from vlfast.extraction.api import extract
from vlfast.extraction.model.features import cast_for_store


def test_cast_refuses_an_overflow_and_names_the_range() -> None:
    x = torch.tensor([[1.0, -2.0], [1.2e5, 3.0]])
    feats = {"vision": x, "grid_thw": torch.tensor([[1, 2, 2]])}
    stored, problem = cast_for_store(feats, torch.float16)
    assert stored is None
    assert problem.startswith("not storable as float16: ")
    assert "1.2e+05" in problem and "65504" in problem and "'vision'" in problem
    assert "--store-dtype bfloat16 or float32" in problem

    # bfloat16 holds it; integers are left alone; float32 to float32 is no cast at all.
    stored, problem = cast_for_store(feats, torch.bfloat16)
    assert (
        problem is None
        and stored["vision"].dtype == torch.bfloat16
        and stored["grid_thw"] is feats["grid_thw"]
    )
    assert cast_for_store(feats, torch.float32)[0]["vision"] is x
    big = {"v": torch.tensor([3.39e38, 3.4e38])}  # past bfloat16's largest: only float32 holds it
    assert "--store-dtype float32" in cast_for_store(big, torch.bfloat16)[1]


def test_cast_keeps_what_the_model_computed_and_what_rounds_into_range() -> None:
    # NaN and inf computed by the model are stored as computed, as before (not the cast's doing)...
    x = torch.tensor([float("nan"), float("inf"), -float("inf"), 1.0])
    stored, problem = cast_for_store({"v": x}, torch.float16)
    assert problem is None
    assert torch.equal(stored["v"].isnan(), x.isnan()) and torch.equal(stored["v"].isinf(), x.isinf())
    # ...but an overflow beside them is still the cast's.
    stored, problem = cast_for_store({"v": torch.tensor([float("nan"), 7e4])}, torch.float16)
    assert stored is None and "7e+04" in problem
    # Past float16's largest value but rounding to it (below 65520): held, no error.
    stored, problem = cast_for_store({"v": torch.tensor([65510.0, -65519.0])}, torch.float16)
    assert problem is None and stored["v"].tolist() == [65504.0, -65504.0]
    stored, problem = cast_for_store({"v": torch.tensor([65520.0])}, torch.float16)
    assert stored is None
    # Empty tensors cast fine.
    assert cast_for_store({"v": torch.empty(0, 4)}, torch.float16)[1] is None


@pytest.fixture
def few(media_dir, tmp_path) -> Path:
    folder = tmp_path / "in"
    folder.mkdir()
    for name in ("rgb.jpg", "clip.mp4"):
        shutil.copy(media_dir / "good" / name, folder / name)
    return folder


def test_an_overflowing_sample_is_recorded_and_the_run_goes_on(few, tiny_qwen3_vl, tmp_path, monkeypatch):
    """The clip's features are scaled past float16's range (the fault); the image's are left alone."""
    real = model_runner.compute_vision_features

    def scaled(tower, batch, names):
        feats = real(tower, batch, names)
        for f, grid in zip(feats, batch.grid_thw.tolist()):
            if grid[0] > 1:  # the video: frames in time
                for k in ("vision", "vision_mean"):
                    f[k] = f[k] * 1e9
        return feats

    monkeypatch.setattr(model_runner, "compute_vision_features", scaled)
    out = tmp_path / "out"
    s = extract(few, out, model=str(tiny_qwen3_vl), num_workers=0, store_dtype="float16")
    assert (s.extracted, s.failed) == (1, 1)
    assert list(s.errors) == ["not storable as float16"]
    cache = FeatureCache(out)
    assert cache.ids() == ["rgb.jpg"]
    assert all(torch.isfinite(t).all() for t in cache["rgb.jpg"].values())
    (err,) = cache.errors()
    assert err["id"] == "clip.mp4" and err["kind"] == "error"
    assert "exceeds float16's largest value 65504" in err["reason"] and "bfloat16 or float32" in err["reason"]

    r = CliRunner().invoke(app, ["out", "verify", str(out)])
    assert r.exit_code == 0, r.output
    assert "checksums OK: the stored bytes are the ones written" in r.output
    assert "every byte matches" not in r.output  # not a claim about the values
