"""A checkpoint is known by its content, not by how its path is spelled (issue 38 item 5): the same folder
through a relative path, another working directory or a symlink, and a byte-identical copy elsewhere (a
node-local copy), resume; a changed one is refused as before. Paths are recorded resolved."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from vlfast.extraction import FeatureCache, RunConfigMismatch
from vlfast.extraction.api import extract


def _run(inputs, out, model, **kw):
    return extract(str(inputs), str(out), model=str(model), num_workers=0, **kw)


def test_the_same_checkpoint_by_any_spelling_resumes(two, tiny_qwen3_vl, tmp_path, monkeypatch):
    ckpt = Path(shutil.copytree(tiny_qwen3_vl, tmp_path / "work" / "ck"))
    (tmp_path / "link").symlink_to(ckpt, target_is_directory=True)
    out = tmp_path / "out"
    monkeypatch.chdir(tmp_path / "work")
    assert _run(two, out, "ck").extracted == 2
    recorded = json.loads((out / "run.json").read_text())["config"]
    assert recorded["model"] == str(ckpt.resolve())
    assert recorded["processor"]["source"].startswith(str(ckpt.resolve()) + "/")  # resolved, not "ck/..."

    (two / "more.png").write_bytes((two / "gray.png").read_bytes())
    spellings = [str(ckpt), "work/../work/ck", "./work/ck/", str(tmp_path / "link"), "link"]
    monkeypatch.chdir(tmp_path)
    assert _run(two, out, "work/ck").extracted == 1  # another working directory
    for spelling in spellings:
        summary = _run(two, out, spelling)
        assert summary.nothing_to_do, spelling
    assert json.loads((out / "run.json").read_text())["config"] == recorded


def test_a_byte_identical_copy_elsewhere_resumes_a_changed_one_is_refused(two, tiny_qwen3_vl, tmp_path):
    shared, local = tmp_path / "shared" / "ck", tmp_path / "node-local" / "ck"
    shutil.copytree(tiny_qwen3_vl, shared)
    shutil.copytree(tiny_qwen3_vl, local)
    out = tmp_path / "out"
    _run(two, out, shared)
    (two / "more.png").write_bytes((two / "gray.png").read_bytes())
    assert _run(two, out, local).extracted == 1
    assert sorted(FeatureCache(out).ids()) == ["gray.png", "more.png", "rgb.jpg"]

    tuned = Path(shutil.copytree(tiny_qwen3_vl, tmp_path / "tuned" / "ck"))
    from transformers import AutoModelForImageTextToText

    model = AutoModelForImageTextToText.from_pretrained(tuned, local_files_only=True)
    import torch

    with torch.no_grad():
        next(p for n, p in model.named_parameters() if "visual" in n and p.dim() == 2).add_(0.01)
    model.save_pretrained(tuned)
    (two / "new.png").write_bytes((two / "rgb.jpg").read_bytes())
    with pytest.raises(RunConfigMismatch) as e:
        _run(two, out, tuned)
    message = str(e.value)
    assert "weights.xxh3_128" in message and "model:" in message, message  # both named, as before
