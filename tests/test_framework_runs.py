"""scripts/framework_runs.py, the one command that trains a tiny Qwen3-VL under LlamaFactory, ms-swift and
axolotl's own launchers: its argument checks and the verdict it draws from a run's losses and record, on
fabricated runs. The runs themselves take venvs and minutes, outside the suite (docs/training.md, "Framework
runs")."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "framework_runs.py"


def _load():
    spec = importlib.util.spec_from_file_location("_framework_runs", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


fr = _load()


def _run(patched: bool, losses, record=None, rc=0):
    run = fr.Run("ms-swift", "4.6.0", "lora", patched, rc=rc, losses=list(losses), log="x.log")
    run.record = record or {"processes": 0, "gemm": 0, "stock": 0, "unpatched_calls": 0, "unpatched": [],
                            "replaced": []}  # fmt: skip
    return run


def _record(tmp_path: Path, *lines: dict) -> dict:
    path = tmp_path / "record.jsonl"
    path.write_text("".join(json.dumps(line) + "\n" for line in lines))
    return fr.summarize_record(path)


GEMM_LINE = {"gemm_calls": 3, "stock_calls": 0, "unpatched_calls": 0, "unpatched": [],
             "convs": [{"name": "model.visual.patch_embed.proj", "gemm": 3, "forward_replaced": None}]}  # fmt: skip


def test_help_and_refused_arguments(capsys):
    done = subprocess.run([sys.executable, str(SCRIPT), "--help"], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0 and "--only" in done.stdout and "--fresh" in done.stdout
    for bad, says in (
        ("--only=bogus", "unknown framework"),
        ("--modes=qlora", "--modes"),
        ("--steps=0", "--steps"),
    ):
        with pytest.raises(SystemExit) as exit_:
            fr.main([bad])
        assert exit_.value.code == 2 and says in capsys.readouterr().err, bad


def test_patched_run_on_the_gemm_with_equal_losses_passes(tmp_path):
    fast = _run(True, [11.97, 11.90, 11.84], _record(tmp_path, GEMM_LINE))
    ok, why, diff = fr.verdict(_run(False, [11.97, 11.90, 11.84]), fast, 3, 1e-5)
    assert ok and why == "GEMM" and diff == 0


@pytest.mark.parametrize(
    "line, says",
    [
        ({**GEMM_LINE, "stock_calls": 1}, "every call on the GEMM"),
        ({**GEMM_LINE, "gemm_calls": 0}, "every call on the GEMM"),
        ({**GEMM_LINE, "unpatched_calls": 2, "unpatched": [{"name": "Conv3d@5c5c50", "calls": 2}]},
         "every call on the GEMM"),
    ],
)  # fmt: skip
def test_a_stock_or_unpatched_call_fails(tmp_path, line, says):
    fast = _run(True, [1.0, 1.0, 1.0], _record(tmp_path, line))
    ok, why, _ = fr.verdict(_run(False, [1.0, 1.0, 1.0]), fast, 3, 1e-5)
    assert not ok and says in why


def test_a_framework_forward_is_accepted_only_named(tmp_path):
    """ms-swift on torch 2.9.x replaces nn.Conv3d.forward: vlfast's GEMM is not reached, the record names it."""
    name = "swift.model.utils._patch_conv3d.<locals>.forward"
    line = {"gemm_calls": 0, "stock_calls": 0, "unpatched_calls": 3,
            "unpatched": [{"name": "model.visual.patch_embed.proj", "calls": 3, "forward_replaced": name}],
            "convs": []}  # fmt: skip
    fast = _run(True, [1.0, 1.0, 1.0], _record(tmp_path, line))
    assert fast.record["replaced"] == [name]
    ok, why, _ = fr.verdict(_run(False, [1.0, 1.0, 1.0]), fast, 3, 1e-5)
    assert ok and name in why


def test_losses_steps_exit_codes_and_the_control_decide(tmp_path):
    rec = _record(tmp_path, GEMM_LINE)
    cases = [
        (_run(False, [1.0, 1.0, 1.0]), _run(True, [1.0, 1.0, 1.001], rec), "losses differ"),
        (_run(False, [1.0, 1.0]), _run(True, [1.0, 1.0, 1.0], rec), "2 of 3 losses"),
        (_run(False, [1.0, 1.0, 1.0], rc=1), _run(True, [1.0, 1.0, 1.0], rec), "exited 1"),
        (_run(False, [1.0, 1.0, 1.0]), _run(True, [1.0, 1.0, 1.0]), "no record line"),
        (_run(False, [1.0, 1.0, 1.0], rec), _run(True, [1.0, 1.0, 1.0], rec), "control ran vlfast's GEMM"),
    ]
    for stock, fast, says in cases:
        ok, why, _ = fr.verdict(stock, fast, 3, 1e-5)
        assert not ok and says in why, (says, why)


def test_full_training_must_move_the_patch_embed(tmp_path):
    stock, fast = _run(False, [1.0, 1.0, 1.0]), _run(True, [1.0, 1.0, 1.0], _record(tmp_path, GEMM_LINE))
    moved = {"moved_unpatched": 3e-3, "moved_patched": 3e-3, "patched_vs_unpatched": 3e-5}
    assert fr.verdict(stock, fast, 3, 1e-5, moved)[0]
    for frozen in ({**moved, "moved_patched": 0.0}, {}):
        ok, why, _ = fr.verdict(stock, fast, 3, 1e-5, frozen)
        assert not ok and "vision tower frozen" in why


def test_records_of_several_processes_add_up(tmp_path):
    worker = {"gemm_calls": 0, "stock_calls": 0, "unpatched_calls": 0, "unpatched": [], "convs": []}
    summary = _record(tmp_path, GEMM_LINE, worker, GEMM_LINE)
    assert summary["processes"] == 3 and summary["gemm"] == 6 and summary["stock"] == 0
    assert fr.summarize_record(tmp_path / "missing.jsonl")["processes"] == 0


def test_torchvision_pin_and_this_interpreter():
    assert fr.torchvision_for("2.13.0") == "0.28.0" and fr.torchvision_for("2.9.1") == "0.24.1"
    minor = f"{sys.version_info.major}.{sys.version_info.minor}"
    assert fr.find_python(minor) == (sys.executable, "this interpreter")


def test_the_preprocess_run_passes_only_with_every_image_call_by_vlfast(tmp_path):
    """The third run (VLFAST_PREPROCESS=1 beside VLFAST_PATCH=1): the patched run's losses and a record whose
    image processor calls were all answered by vlfast; a swap that never happened, or calls that ran
    transformers' code, fail it by name."""
    patched = _run(True, [2.0, 1.5, 1.0], _record(tmp_path, GEMM_LINE))
    images = {"vlfast": 6, "stock": {}}
    both = _run(True, [2.0, 1.5, 1.0], _record(tmp_path, {**GEMM_LINE, "image_processor_calls": images}))
    ok, why, diff = fr.preprocess_verdict(patched, both, 3, 1e-5)
    assert ok and diff == 0.0 and "6 image processor calls by vlfast, 0 stock" in why
    none = _run(True, [2.0, 1.5, 1.0], _record(tmp_path, GEMM_LINE))
    ok, why, _ = fr.preprocess_verdict(patched, none, 3, 1e-5)
    assert not ok and "no image processor call answered by vlfast" in why
    stock = {"vlfast": 4, "stock": {"max_pixels=1 in a call": 2}}
    mixed = _run(True, [2.0, 1.5, 1.0], _record(tmp_path, {**GEMM_LINE, "image_processor_calls": stock}))
    ok, why, _ = fr.preprocess_verdict(patched, mixed, 3, 1e-5)
    assert not ok and "max_pixels=1 in a call" in why
    moved = _run(True, [2.0, 1.5, 1.1], _record(tmp_path, {**GEMM_LINE, "image_processor_calls": images}))
    ok, why, _ = fr.preprocess_verdict(patched, moved, 3, 1e-5)
    assert not ok and "losses differ from the patched run's" in why
