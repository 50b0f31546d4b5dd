"""An OUT written by the code before issue 21's restructuring reads, checks and resumes with today's code.

The folder under tests/data/out_written_before_issue21 was written at commit 5e7f751 (see its README.md).
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import shutil
from pathlib import Path

import pytest
import torch

from vlfast.extraction import FeatureCache

DATA = Path(__file__).parent / "data" / "out_written_before_issue21"
CHECKPOINT = Path("/tmp/vlfast-compat-v2/ck")  # run.json records this absolute path; a resume compares it
FEATURES = "vision,vision_mean,llm"


def _digest(t: torch.Tensor) -> list:
    raw = t.contiguous().view(-1).view(torch.uint8).numpy().tobytes()
    return [str(t.dtype), list(t.shape), hashlib.sha256(raw).hexdigest()]


@pytest.fixture(scope="module")
def checkpoint() -> Path:
    """The deterministic tiny checkpoint the old OUT was written with, rebuilt at the path its run.json names."""
    from vlfast.demo import make_tiny_qwen3_vl

    CHECKPOINT.parent.mkdir(parents=True, exist_ok=True)
    with open(CHECKPOINT.parent / ".lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # two test sessions on one host build it once
        if not (CHECKPOINT / "model.safetensors").exists():
            tmp = CHECKPOINT.parent / f"ck.tmp{id(lock)}"
            shutil.rmtree(tmp, ignore_errors=True)
            make_tiny_qwen3_vl(tmp)
            tmp.rename(CHECKPOINT)
    return CHECKPOINT


@pytest.fixture
def old(tmp_path) -> Path:
    root = tmp_path / "old"
    shutil.copytree(DATA, root)
    return root


def test_old_out_reads_back_exactly(old):
    expected = json.loads((old / "expected.json").read_text())
    cache = FeatureCache(old / "out")
    assert sorted(cache.ids()) == sorted(expected)
    for sid, features in expected.items():
        got = cache[sid]
        assert {k: _digest(got[k]) for k in features} == features, sid


def test_old_out_passes_the_full_check(old):
    from vlfast.extraction.store.integrity import verify_folder

    report = verify_folder(old / "out")
    assert report.ok, report


@pytest.mark.cpu_kernels
def test_old_out_resumes_and_matches_a_fresh_run(old, checkpoint, monkeypatch):
    from vlfast import extract

    monkeypatch.chdir(old)
    summary = extract("all.jsonl", "out", model=str(checkpoint), features=FEATURES)
    assert summary.extracted == 2  # img2, img3: the rest was done (or recorded as an error) by the old code
    # the same configuration: the old OUT was made with transformers' PIL image processor (a new OUT's default
    # is the torchvision one's operations)
    extract("all.jsonl", "fresh", model=str(checkpoint), features=FEATURES, image_backend="pil")

    expected = json.loads((old / "expected.json").read_text())
    resumed, fresh = FeatureCache(old / "out"), FeatureCache(old / "fresh")
    assert sorted(resumed.ids()) == sorted(fresh.ids()) == ["clip", "img0", "img1", "img2", "img3"]
    for sid in ("img2", "img3"):  # computed today, in both folders: identical bytes
        a, b = resumed[sid], fresh[sid]
        assert {k: _digest(v) for k, v in a.items()} == {k: _digest(v) for k, v in b.items()}, sid
    for sid, features in expected.items():  # what the old code wrote is untouched by the resume
        assert {k: _digest(resumed[sid][k]) for k in features} == features, sid
    assert (
        json.loads((old / "out" / "run.json").read_text())["config"]
        == json.loads((DATA / "out" / "run.json").read_text())["config"]
    )


def test_old_out_resumes_with_a_copy_of_its_checkpoint_elsewhere(old, checkpoint, tmp_path, monkeypatch):
    """Issue 38 item 5: the old run.json records /tmp/vlfast-compat-v2/ck and its processor files by that
    path; a byte-identical copy at another path (a node-local copy) resumes it, and the record stays."""
    from vlfast import extract

    copy = Path(shutil.copytree(checkpoint, tmp_path / "node-local" / "ck"))
    monkeypatch.chdir(old)
    summary = extract("all.jsonl", "out", model=str(copy), features=FEATURES)
    assert summary.extracted == 2 and not summary.nothing_to_do
    assert (
        json.loads((old / "out" / "run.json").read_text())["config"]
        == json.loads((DATA / "out" / "run.json").read_text())["config"]
    )
