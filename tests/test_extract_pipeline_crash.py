"""A run killed mid-way (os._exit, no cleanup) and resumed gives exactly what an uninterrupted run gives."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import torch

from vlfast.extraction import FeatureCache
from vlfast.extraction.api import extract

KILL_AFTER = 5  # forwards


def test_killed_run_resumes_to_identical_features(media_dir, tiny_qwen3_vl, tmp_path):
    out, ref = tmp_path / "crashed", tmp_path / "reference"
    kw = dict(features="vision,vision_mean", num_workers=0, max_batch_samples=1, shard_max_samples=2)
    script = textwrap.dedent(
        f"""
        import os
        from vlfast.extraction.api import extract
        from vlfast.extraction.engines.base import Hooks
        from vlfast.extraction.engines.local import LocalEngine
        calls = []
        def die(batch):
            calls.append(1)
            if len(calls) > {KILL_AFTER}:
                os._exit(9)
        extract({str(media_dir)!r}, {str(out)!r}, model={str(tiny_qwen3_vl)!r}, engine=LocalEngine(Hooks(forward=die)), **{kw!r})
        """
    )
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 9, proc.stderr[-2000:]
    partial = len(FeatureCache(out))
    assert 0 < partial <= KILL_AFTER  # only whole shards survive

    resumed = extract(media_dir, out, model=str(tiny_qwen3_vl), **kw)
    assert resumed.skipped >= partial and resumed.extracted > 0
    extract(media_dir, ref, model=str(tiny_qwen3_vl), **kw)
    a, b = FeatureCache(out), FeatureCache(ref)
    assert sorted(a.ids()) == sorted(b.ids())
    assert sorted(e["id"] for e in a.errors()) == sorted(e["id"] for e in b.errors())
    for sid in b.ids():
        fa, fb = a[sid], b[sid]
        assert fa.keys() == fb.keys()
        for name in fb:
            assert torch.equal(fa[name], fb[name]), (sid, name)
