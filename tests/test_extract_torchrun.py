"""`vlfast extract` under a real launcher: torchrun with 2 CPU ranks splits, writes and reads back as one."""

from __future__ import annotations

import os
import subprocess
import sys

import torch

from vlfast.extraction import FeatureCache
from vlfast.extraction.pipeline import extract
from vlfast.extraction.synthetic import make_images, make_video


def test_torchrun_two_ranks_equal_one_process(tiny_qwen3_vl, tmp_path):
    inputs = tmp_path / "in"
    make_images(inputs / "img", [(96, 64), (64, 96), (80, 80), (128, 64), (64, 64)])
    make_video(inputs / "vid" / "clip.mp4", frames=6, fps=4, width=64, height=48)
    cmd = [
        sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
        "-m", "vlfast.cli.main", "extract", str(inputs), str(tmp_path / "ranks"),
        "--model", str(tiny_qwen3_vl), "--workers", "0", "--json",
    ]  # fmt: skip
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=env)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-4000:]
    # Both ranks print their JSON summary to one pipe (interleaved); the output folder is the record.
    written_by = {path.name.split("-")[1] for path in (tmp_path / "ranks" / "shards").glob("*.safetensors")}
    assert written_by == {"r00000", "r00001"}, written_by

    single = extract(inputs, tmp_path / "one", model=str(tiny_qwen3_vl), num_workers=0, progress=False)
    assert single.extracted == 6
    ranks, one = FeatureCache(tmp_path / "ranks"), FeatureCache(tmp_path / "one")
    assert sorted(ranks.ids()) == sorted(one.ids())  # no gaps, no duplicates
    for sample_id in one.ids():
        for name, value in one[sample_id].items():
            assert torch.equal(ranks[sample_id][name], value), (sample_id, name)
