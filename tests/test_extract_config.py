"""What the run configuration holds and when it is checked: everything that changes a feature's bits is
configuration (a resume with another value is refused), and everything the configuration and the device
allow is checked before OUT is written, so a corrected command is never refused as "a different
configuration" of a run that never extracted anything."""

from __future__ import annotations

import json

import pytest
from typer.testing import CliRunner

import vlfast.extraction.config as extract_config
import vlfast.extraction.model.runner as model_runner
from vlfast.cli.main import app
from vlfast.extraction import FeatureCache, RunConfigMismatch
from vlfast.extraction.api import extract

runner = CliRunner()


@pytest.fixture
def no_model_load(monkeypatch):
    """Fail the test if the pipeline builds a model."""
    monkeypatch.setattr(model_runner, "load", lambda *a, **k: pytest.fail("the model was loaded"))


# ------------------------------------------------------------------------------ --no-patch is configuration


def test_a_resume_with_another_patch_setting_is_refused(two, tiny_qwen3_vl, tmp_path, monkeypatch):
    """Patched and unpatched convs give features that differ in their last bits: one OUT never mixes them."""
    patched, unpatched = tmp_path / "patched", tmp_path / "unpatched"
    extract(two, patched, model=str(tiny_qwen3_vl), num_workers=0)
    extract(two, unpatched, model=str(tiny_qwen3_vl), num_workers=0, patch_convs=False)
    assert FeatureCache(unpatched).run_config["patch_convs"] is False
    (two / "rgb.jpg").rename(two / "new.jpg")  # something left to do, so only the configuration can stop it

    monkeypatch.setattr(model_runner, "load", lambda *a, **k: pytest.fail("model loaded before the refusal"))
    with pytest.raises(RunConfigMismatch, match="patch_convs"):
        extract(two, patched, model=str(tiny_qwen3_vl), num_workers=0, patch_convs=False)
    with pytest.raises(RunConfigMismatch, match="patch_convs"):
        extract(two, unpatched, model=str(tiny_qwen3_vl), num_workers=0)
    r = runner.invoke(app, ["extract", str(two), str(patched), "-m", str(tiny_qwen3_vl), "--no-patch"])
    assert r.exit_code == 2 and "patch_convs" in r.output and "--overwrite" in r.output, r.output


def test_the_default_patched_config_is_recorded(two, tiny_qwen3_vl, tmp_path):
    """patch_convs is configuration, recorded for a patched run as for an unpatched one (one format: every
    OUT records every key)."""
    out = tmp_path / "out"
    extract(two, out, model=str(tiny_qwen3_vl), num_workers=0)
    assert json.loads((out / "run.json").read_text())["config"]["patch_convs"] is True


# ---------------------------------------------------------------- checked before OUT is written (exit 2)


def _cli(two, out, *args):
    return runner.invoke(app, ["extract", str(two), str(out), "--workers", "0", *args])


@pytest.mark.parametrize("layers", ["99", "-1,-8", "3"])
def test_layers_past_the_llm_are_refused_before_out_is_written(two, tiny_qwen3_vl, tmp_path, layers):
    """The tiny LLM has 2 layers: hidden states 0..2, or -3..-1."""
    out = tmp_path / "out"
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(model_runner, "load", lambda *a, **k: pytest.fail("model loaded before the refusal"))
        r = _cli(two, out, "-m", str(tiny_qwen3_vl), "--features", "llm", "--layers", layers)
    assert r.exit_code == 2, r.output
    assert "--layers" in r.output and "2 layers" in r.output and "-3 to -1" in r.output, r.output
    assert not out.exists()


def test_the_corrected_layers_run(two, tiny_qwen3_vl, tmp_path):
    """The first and last valid indices on each side pass the check, and equal the forward's own view."""
    out = tmp_path / "out"
    r = _cli(two, out, "-m", str(tiny_qwen3_vl), "--features", "llm", "--layers", "-3,2", "--json")
    assert r.exit_code == 0, r.output
    assert sorted(FeatureCache(out)["rgb.jpg"]) == ["llm.last.layer0", "llm.last.layer2"]


@pytest.mark.parametrize("flag", [("--layers", "1"), ("--pool", "mean")])
def test_llm_flags_without_llm_features_are_refused(two, tiny_qwen3_vl, tmp_path, no_model_load, flag):
    """--layers and --pool select LLM hidden states: with vision features only they were ignored silently."""
    out = tmp_path / "out"
    r = _cli(two, out, "-m", str(tiny_qwen3_vl), "--features", "vision", *flag)
    assert r.exit_code == 2 and flag[0] in r.output and "add llm to --features" in r.output, r.output
    assert not out.exists()


def test_llm_features_of_a_reference_are_refused_before_out_is_written(two, tmp_path, no_model_load):
    out = tmp_path / "out"
    r = _cli(two, out, "-m", "ref:qwen3-vl-2b", "--features", "vision,llm")
    assert r.exit_code == 2 and "vision tower only" in r.output and "--features" in r.output, r.output
    assert not out.exists()


@pytest.mark.parametrize(
    "device, says", [("cuda", "no CUDA GPU"), ("cuda:3", "no CUDA GPU"), ("gpu0", "not a device")]
)
def test_a_device_this_machine_lacks_is_refused_before_out_is_written(
    two, tiny_qwen3_vl, tmp_path, monkeypatch, no_model_load, device, says
):
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)  # so the test also holds on a GPU host
    out = tmp_path / "out"
    r = _cli(two, out, "-m", str(tiny_qwen3_vl), "--device", device)
    assert r.exit_code == 2 and "--device" in r.output and says in r.output, r.output
    assert not out.exists()


def test_a_missing_gpu_index_is_named(monkeypatch):
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    assert extract_config.device_problem(torch.device("cuda:1")) is None
    assert "cuda:0..cuda:1" in extract_config.device_problem(torch.device("cuda:2"))


def test_a_run_json_nothing_depends_on_is_replaced(two, tiny_qwen3_vl, tmp_path):
    """A run that stopped after writing run.json and before keeping anything (a failed model load, an
    older vlfast that validated late) leaves no run to resume: the corrected command takes OUT over."""
    from vlfast.extraction import FeatureStore

    out = tmp_path / "out"
    FeatureStore(out, {"model": "the failed run's"}).close()
    summary = extract(two, out, model=str(tiny_qwen3_vl), num_workers=0)
    assert summary.extracted == 2
    assert FeatureCache(out).run_config["model"] == str(tiny_qwen3_vl.resolve())


def test_a_run_json_with_records_or_a_live_writer_is_still_refused(two, tiny_qwen3_vl, tmp_path):
    from vlfast.extraction import FeatureStore

    recorded = tmp_path / "recorded"
    with FeatureStore(recorded, {"model": "another"}) as store:
        store.add_error("a.jpg", "a.jpg", "cannot decode")  # a record: that run has something to keep
    with pytest.raises(RunConfigMismatch):
        extract(two, recorded, model=str(tiny_qwen3_vl), num_workers=0)

    live = tmp_path / "live"
    # a run that is running and has committed nothing yet
    with FeatureStore(live, {"model": "another"}, rank=1, world_size=2), pytest.raises(RunConfigMismatch):
        extract(two, live, model=str(tiny_qwen3_vl), num_workers=0)


# ------------------------------------------------------------------- one dtype policy for every command


@pytest.mark.parametrize(
    ("given", "dtype"), [("bf16", "bfloat16"), ("fp16", "float16"), ("float32", "float32")]
)
def test_extract_takes_the_dtype_spellings_doctor_takes(given, dtype):
    import torch

    from vlfast.diagnosis.facts import dtype_name
    from vlfast.extraction.config import ExtractConfig

    assert ExtractConfig(model="ref:qwen3-vl-2b", dtype=given).torch_dtype == getattr(torch, dtype)
    assert dtype_name(given) == dtype
    assert ExtractConfig(model="ref:qwen3-vl-2b", store_dtype=given).stored_as == getattr(torch, dtype)


@pytest.mark.parametrize("flag", ["--dtype", "--store-dtype"])
def test_float64_is_refused_before_out_is_written(two, tmp_path, no_model_load, flag):
    out = tmp_path / "out"
    r = _cli(two, out, "-m", "ref:qwen3-vl-2b", flag, "float64")
    assert r.exit_code == 2 and "float64" in r.output and "float16" in r.output, r.output
    assert not out.exists()


def test_extract_dispatches_a_validated_config_and_its_plan_to_any_engine(two, tmp_path, no_model_load):
    """The Engine protocol: ``configure`` may adjust the checked configuration, ``run`` gets it with the plan."""
    import dataclasses

    from vlfast.extraction.engines.base import Engine

    seen = []

    class Recorder:
        name = "recorder"

        def configure(self, config):
            return dataclasses.replace(config, max_batch_samples=3)

        def run(self, plan, config):
            seen.append((sorted(s.id for s in plan.samples), config.budget.max_samples))
            return plan.summary(config)

    assert isinstance(Recorder(), Engine)
    s = extract(two, tmp_path / "out", engine=Recorder(), model="ref:qwen3-vl-2b")
    assert seen == [(["gray.png", "rgb.jpg"], 3)] and (s.total, s.assigned) == (2, 2)
    assert not (tmp_path / "out").exists()  # the engine writes OUT, not extract


def test_a_misspelt_option_is_named_with_its_fix_before_out_is_written(two, tmp_path, no_model_load):
    from vlfast import extract

    with pytest.raises(TypeError, match="'featurs'; did you mean 'features'"):
        extract(two, tmp_path / "out", model="ref:qwen3-vl-2b", featurs="vision")
    assert not (tmp_path / "out").exists()


def test_how_out_is_written_is_checked_once_by_the_config():
    """ExtractConfig checks how OUT is written (FeatureStore checked it again, once) and hands every engine's
    store those options as one set (``writing()``), instead of each engine relaying them field by field."""
    from vlfast.extraction.config import ExtractConfig

    for bad in (
        {"commit_every": 0},
        {"commit_every": -1.0},
        {"shard_max_samples": 0},
        {"shard_max_bytes": 0},
    ):
        with pytest.raises(ValueError, match=next(iter(bad))):
            ExtractConfig(model="ref:qwen3-vl-2b", device="cpu", **bad)
    with pytest.raises(ValueError, match="resume_check"):
        ExtractConfig(model="ref:qwen3-vl-2b", device="cpu", resume_check="some")
    config = ExtractConfig(
        model="ref:qwen3-vl-2b", device="cpu", retry_errors="transient", overwrite=True, commit_every=5.0
    )
    assert config.writing() == {
        "shard_max_bytes": 256 << 20,
        "shard_max_samples": 1024,
        "commit_every": 5.0,
        "overwrite": True,
        "resume_check": "full",
        "retry_errors": frozenset({"transient"}),  # parsed once, here
    }
    assert config.writing(overwrite=False, resume_check="quick")["overwrite"] is False  # a Ray model actor's
