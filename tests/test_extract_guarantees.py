"""What `vlfast extract` promises beyond the store: changed weights refused, refusals and "nothing to do"
before any model load or lock, plain exit-2 messages, counts that agree, outputs numpy can read."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from typer.testing import CliRunner

import vlfast.extraction.engines.base as engine_base
import vlfast.extraction.model.runner as model_runner
from vlfast.cli.main import app
from vlfast.extraction import FeatureCache, FeatureStore, RunConfigMismatch
from vlfast.extraction.api import extract

runner = CliRunner()


@pytest.fixture
def model_dir(tiny_qwen3_vl, tmp_path) -> Path:
    """A private copy of the tiny checkpoint that a test may save a "fine-tune" into."""
    return Path(shutil.copytree(tiny_qwen3_vl, tmp_path / "ckpt"))


@pytest.fixture
def few(media_dir, tmp_path) -> Path:
    folder = tmp_path / "in"
    folder.mkdir()
    for name in ("rgb.jpg", "gray.png", "clip.mp4"):
        shutil.copy(media_dir / "good" / name, folder / name)
    return folder


@pytest.fixture
def no_model_load(monkeypatch):
    """Fail the test if the pipeline builds a model."""

    def boom(*a, **kw):
        raise AssertionError("the model was loaded")

    monkeypatch.setattr(model_runner, "load", boom)


def _fine_tune(model_dir: Path, which: str) -> None:
    """Save a changed model into the same folder with transformers' own save_pretrained."""
    from transformers import AutoModelForImageTextToText

    model = AutoModelForImageTextToText.from_pretrained(model_dir, local_files_only=True)
    name, param = next(
        (n, p) for n, p in model.named_parameters() if ("visual" in n) == (which == "vision") and p.dim() == 2
    )
    with torch.no_grad():
        param.add_(0.01)
    model.save_pretrained(model_dir)


def test_changed_weights_in_the_same_folder_are_refused(model_dir, few, tmp_path, monkeypatch):
    out = tmp_path / "out"
    first = extract(few, out, model=str(model_dir), num_workers=0)
    # its cost: benchmarks/extract.py fingerprint
    assert first.extracted == 3 and first.fingerprint_seconds >= 0
    weights = FeatureCache(out).run_config["weights"]
    assert weights["scope"] == "vision tower" and weights["tensors"] > 0 and len(weights["xxh3_128"]) == 32

    _fine_tune(model_dir, "language")  # the LLM changed: vision features are still valid
    assert extract(few, out, model=str(model_dir), num_workers=0).nothing_to_do

    _fine_tune(model_dir, "vision")  # the tower changed: mixing would be silently wrong
    monkeypatch.setattr(model_runner, "load", lambda *a, **k: pytest.fail("model loaded before the refusal"))
    with pytest.raises(RunConfigMismatch, match=r"weights\.xxh3_128"):
        extract(few, out, model=str(model_dir), num_workers=0)
    r = runner.invoke(app, ["extract", str(few), str(out), "-m", str(model_dir), "--workers", "0"])
    assert r.exit_code == 2, r.output
    assert "--overwrite" in r.output and "overwrite=True" not in r.output and "weights.xxh3_128" in r.output


def test_llm_features_fingerprint_the_whole_model(model_dir, few, tmp_path):
    out = tmp_path / "out"
    extract(few, out, model=str(model_dir), features="llm", num_workers=0)
    assert FeatureCache(out).run_config["weights"]["scope"] == "whole model"
    _fine_tune(model_dir, "language")
    with pytest.raises(RunConfigMismatch, match="weights"):
        extract(few, out, model=str(model_dir), features="llm", num_workers=0)


def test_refusals_and_nothing_to_do_come_before_the_model(few, tiny_qwen3_vl, tmp_path, no_model_load):
    out = tmp_path / "out"
    with FeatureStore(out, {"model": "something else"}) as other:  # a run with something to keep
        other.add_error("x.jpg", "x.jpg", "cannot decode")
    r = runner.invoke(app, ["extract", str(few), str(out), "-m", str(tiny_qwen3_vl)])
    assert r.exit_code == 2 and "different configuration" in r.output and "--overwrite" in r.output

    (tmp_path / "file").write_text("x")
    r = runner.invoke(app, ["extract", str(few), str(tmp_path / "file"), "-m", str(tiny_qwen3_vl)])
    assert r.exit_code == 2 and "not a folder" in r.output

    empty = tmp_path / "empty"
    empty.mkdir()
    (empty / "notes.txt").write_text("no media here")
    r = runner.invoke(app, ["extract", str(empty), str(tmp_path / "o2"), "-m", str(tiny_qwen3_vl)])
    assert r.exit_code == 2 and "no" in r.output and ".jpg" in r.output, r.output
    assert not (tmp_path / "o2").exists()  # nothing written for an empty input


def test_output_in_use_is_exit_2_before_the_model(few, tiny_qwen3_vl, tmp_path, monkeypatch):
    out = tmp_path / "out"
    extract(few / "rgb.jpg", out, model=str(tiny_qwen3_vl), num_workers=0)  # a first run of one file
    # Another process is writing rank 0 of this OUT (same configuration): hold its lock here.
    cfg = json.loads((out / "run.json").read_text())["config"]
    holder = FeatureStore(out, cfg, volatile_keys=("versions", "runtime"))
    monkeypatch.setattr(model_runner, "load", lambda *a, **k: pytest.fail("model loaded before the refusal"))
    try:
        r = runner.invoke(app, ["extract", str(few), str(out), "-m", str(tiny_qwen3_vl), "--workers", "0"])
    finally:
        holder.close()
    assert r.exit_code == 2, r.output
    assert "output in use" in r.output and "already writing rank 0" in r.output and "torchrun" in r.output


def test_counts_agree_across_bar_summary_and_json(media_dir, tiny_qwen3_vl, tmp_path, monkeypatch):
    rows = [
        {"id": "a", "path": str(media_dir / "good" / "rgb.jpg")},
        {"id": "a", "path": str(media_dir / "good" / "gray.png")},  # a repeated id
        {"id": "b", "path": str(media_dir / "bad" / "zero.jpg")},  # a bad file
        {"id": "c", "path": 7},  # a bad row
        {"id": "d", "path": str(media_dir / "good" / "clip.mp4")},
    ]
    manifest = tmp_path / "m.jsonl"
    manifest.write_text("\n".join(json.dumps(r) for r in rows) + "\n{not json\n")
    bars = []

    class Recorder(engine_base.Progress):
        def __init__(self, enabled, total, label):
            super().__init__(False, total, label)
            self.total = total
            bars.append(self)

    monkeypatch.setattr(engine_base, "Progress", Recorder)
    out = tmp_path / "out"
    s = extract(manifest, out, model=str(tiny_qwen3_vl), num_workers=0, progress=True)
    assert (s.total, s.assigned, s.skipped, s.extracted, s.failed) == (6, 6, 0, 2, 4)
    assert bars[-1].total == s.assigned - s.skipped and bars[-1].done == s.extracted + s.failed == 6
    assert bars[-1].errors == s.failed == sum(s.errors.values())
    assert s.errors["duplicate id"] == 1 and s.errors["empty file (0 bytes)"] == 1, s.errors

    r = runner.invoke(app, ["extract", str(manifest), str(out), "-m", str(tiny_qwen3_vl), "--json"])
    again = json.loads(r.stdout)
    assert r.exit_code == 0 and again["nothing_to_do"] and again["skipped"] == again["assigned"] == 6

    # Lose the committed sample "d": the resume redoes exactly that, and the books still balance.
    cache = FeatureCache(out)
    shard = out / cache.info("d")["shard"]
    shard.write_bytes(shard.read_bytes()[:-10])
    with pytest.warns(UserWarning, match="truncated"):
        s = extract(manifest, out, model=str(tiny_qwen3_vl), num_workers=0, progress=True)
    assert s.skipped + s.extracted + s.failed == s.assigned == 6 and s.extracted >= 1 and s.quarantined
    assert bars[-1].done == s.extracted + s.failed


def test_store_dtype_and_reading_without_torch(few, tiny_qwen3_vl, tmp_path):
    out16, outbf = tmp_path / "f16", tmp_path / "bf16"
    extract(few, out16, model=str(tiny_qwen3_vl), num_workers=0, store_dtype="float16")
    c = FeatureCache(out16)
    assert (
        c["rgb.jpg"]["vision"].dtype == torch.float16 and c["rgb.jpg"]["vision_mean"].dtype == torch.float16
    )
    assert c["rgb.jpg"]["grid_thw"].dtype == torch.int64  # integers are left alone
    from safetensors.numpy import load_file

    arrays = load_file(out16 / c.info("rgb.jpg")["shard"])  # numpy alone reads float16 shards
    assert any(a.dtype == np.float16 for a in arrays.values())

    extract(few, outbf, model=str(tiny_qwen3_vl), num_workers=0, dtype="bfloat16")
    code = _doc_snippet() + f"\nprint(json.dumps(read(r'{outbf}', 'rgb.jpg', 'vision').tolist()))\n"
    env = {k: v for k, v in os.environ.items()} | {"PYTHONPATH": os.pathsep.join(sys.path)}
    script = tmp_path / "no_torch.py"
    script.write_text("import json, sys\nsys.modules['torch'] = None  # prove torch is not needed\n" + code)
    r = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, env=env, timeout=120)
    assert r.returncode == 0, r.stderr[-2000:]
    got = np.array(json.loads(r.stdout))
    want = FeatureCache(outbf)["rgb.jpg"]["vision"].float().numpy()
    assert np.array_equal(got, want)


def _doc_snippet() -> str:
    """The 'read bfloat16 without torch' recipe, taken from docs/format.md (the format reference, where the
    guide's recipe lives since issue 39) so the docs stay true."""
    text = (Path(__file__).resolve().parent.parent / "docs" / "format.md").read_text()
    start = text.index("```python\n# read a bfloat16 feature without torch")
    return text[start + len("```python\n") : text.index("```", start + 10)]


def test_read_only_out_nothing_to_do_and_refusal(few, tiny_qwen3_vl, tmp_path):
    """A finished OUT on a read-only filesystem: `vlfast extract` says nothing to do (no lock needed),
    FeatureCache reads it; with work left it exits 2 naming the problem. A real read-only bind mount in a
    private mount namespace (root, as CI runs); where that is impossible the simulated variant in
    test_extract_integrity covers the store."""
    out = tmp_path / "out"
    extract(few, out, model=str(tiny_qwen3_vl), num_workers=0)
    probe = f"mount --bind {out} {out} && mount -o remount,ro,bind {out} && ! touch {out}/.probe"
    if shutil.which("unshare") is None or subprocess.run(["unshare", "-m", "sh", "-c", probe]).returncode:
        pytest.skip("cannot make a private read-only bind mount here (needs unshare and root)")
    more = tmp_path / "more"
    shutil.copytree(few, more)
    shutil.copy(few / "rgb.jpg", more / "extra.jpg")
    vlfast = [sys.executable, "-m", "vlfast.cli.main", "extract"]
    script = " && ".join(
        [
            f"mount --bind {out} {out}",
            f"mount -o remount,ro,bind {out}",
            " ".join([*vlfast, str(few), str(out), "-m", str(tiny_qwen3_vl)]) + " > done.txt",
            " ".join([*vlfast, str(more), str(out), "-m", str(tiny_qwen3_vl)])
            + " 2> refused.txt; echo $? > rc.txt",
        ]
    )
    env = os.environ | {"PYTHONPATH": os.pathsep.join(sys.path)}
    r = subprocess.run(
        ["unshare", "-m", "sh", "-c", script], cwd=tmp_path, env=env, capture_output=True, text=True
    )
    assert r.returncode == 0, r.stderr[-2000:]
    assert "nothing to do" in (tmp_path / "done.txt").read_text()
    assert (tmp_path / "rc.txt").read_text().strip() == "2"
    assert "output not writable" in (tmp_path / "refused.txt").read_text()
    # FeatureCache on a read-only mount: test_extract_integrity.py::test_read_only_filesystem_for_real


def _flip_tensor_byte(out: Path, sample_id: str) -> None:
    info = FeatureCache(out).info(sample_id)
    feat = max(info["features"], key=lambda f: f["nbytes"])
    shard = out / info["shard"]
    data = bytearray(shard.read_bytes())
    data[feat["offset"] + feat["nbytes"] // 2] ^= 0x10
    shard.write_bytes(bytes(data))


@pytest.mark.filterwarnings("ignore:.*fail their checksum.*:UserWarning")  # the repair warns, as promised
def test_a_finished_out_is_checked_and_repaired(few, tiny_qwen3_vl, tmp_path, monkeypatch):
    """A byte flipped inside a tensor of a finished OUT: --verify finds it and says to run the same command;
    the same command then does not say "nothing to do" but moves the shard aside and redoes it. Later runs
    over the untouched OUT hash nothing again (OUT/checked.json), until a shard changes."""
    from vlfast.extraction.store import integrity

    out = tmp_path / "out"
    cmd = ["extract", str(few), str(out), "-m", str(tiny_qwen3_vl), "--workers", "0"]
    assert runner.invoke(app, cmd).exit_code == 0
    before = {
        sid: {k: v.clone() for k, v in FeatureCache(out)[sid].items()} for sid in FeatureCache(out).ids()
    }
    _flip_tensor_byte(out, "rgb.jpg")

    r = runner.invoke(app, ["out", "verify", str(out)])
    assert r.exit_code == 1 and "Run the same `vlfast extract` again" in r.output, r.output
    r = runner.invoke(app, cmd)
    assert r.exit_code == 0 and "nothing to do" not in r.output, r.output
    assert len(list((out / "quarantine").iterdir())) == 1
    assert runner.invoke(app, ["out", "verify", str(out)]).exit_code == 0
    cache = FeatureCache(out, verify=True)
    for sid, feats in before.items():
        assert all(torch.equal(cache[sid][k], v) for k, v in feats.items())

    hashed = []
    real = integrity.check_part

    def counting(part, *, data=True):
        if data:
            hashed.append(part.name)
        return real(part, data=data)

    monkeypatch.setattr("vlfast.extraction.store.resume.check_part", counting)
    r = runner.invoke(app, cmd)  # --verify just hashed everything and recorded it: nothing is hashed again
    assert "nothing to do" in r.output and hashed == [], (r.output, hashed)
    (out / "checked.json").unlink()
    r = runner.invoke(app, cmd)  # no record: the full check hashes every part, then records them
    assert "nothing to do" in r.output and hashed == [p.name for p in sorted((out / "index").iterdir())]
    hashed.clear()
    r = runner.invoke(app, cmd)
    assert "nothing to do" in r.output and hashed == [], (r.output, hashed)

    # A byte flipped with the shard's mtime put back: its ctime still moves, so the record lets it go.
    shard = out / FeatureCache(out).info("gray.png")["shard"]
    st = shard.stat()
    _flip_tensor_byte(out, "gray.png")
    os.utime(shard, ns=(st.st_atime_ns, st.st_mtime_ns))
    r = runner.invoke(app, cmd)
    assert r.exit_code == 0 and "nothing to do" not in r.output, r.output
    assert runner.invoke(app, ["out", "verify", str(out)]).exit_code == 0

    # --resume-check quick over a finished OUT checks sizes and headers only (documented): a flip inside a
    # tensor is then left for --verify.
    _flip_tensor_byte(out, "clip.mp4")
    assert "nothing to do" in runner.invoke(app, [*cmd, "--resume-check", "quick"]).output


def test_a_mixed_out_is_refused_not_done(few, tiny_qwen3_vl, tmp_path, monkeypatch):
    """An index part and its shard of another configuration added to a finished OUT under a free sequence
    number: the same command refuses (exit 2, naming the part and what to do) instead of "nothing to do"."""
    out, other = tmp_path / "out", tmp_path / "other"
    extract(few, out, model=str(tiny_qwen3_vl), num_workers=0)
    with FeatureStore(other, {"model": "another run"}, rank=1, world_size=2) as s:
        s.add("extra", {"x": torch.ones(3)})
    (part,) = (other / "index").iterdir()
    (shard,) = (other / "shards").iterdir()
    shutil.copy(part, out / "index" / part.name)
    shutil.copy(shard, out / "shards" / shard.name)

    monkeypatch.setattr(model_runner, "load", lambda *a, **k: pytest.fail("model loaded before the refusal"))
    r = runner.invoke(app, ["extract", str(few), str(out), "-m", str(tiny_qwen3_vl), "--workers", "0"])
    assert r.exit_code == 2, r.output
    assert part.name in r.output and shard.name in r.output and "mixes two extractions" in r.output
    r = runner.invoke(app, ["out", "verify", str(out)])
    assert r.exit_code == 1 and part.name in r.output and "refuses to resume" in r.output, r.output
