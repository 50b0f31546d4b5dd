"""`vlfast extract` under a real launcher: torchrun with 2 CPU ranks splits, writes and reads back as one."""

from __future__ import annotations

import os
import signal
import subprocess
import sys

import torch

from vlfast.demo import make_images, make_video
from vlfast.extraction import FeatureCache
from vlfast.extraction.api import extract


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


DRIVER = """
import functools, os, sys, time
from vlfast.extraction.engines.base import Hooks
from vlfast.extraction.engines.local import LocalEngine

forwards = []
HOLD_AFTER = int(os.environ.get("HOLD_AFTER", "0"))

def forward(batch):
    forwards.append(len(batch))
    print(f"forward {len(forwards)} rank {os.environ.get('RANK', '0')}", flush=True)
    # With HOLD_AFTER=n, forwards after the n-th wait for the signal: a rank cannot run out of work before
    # the other has started (rank 0 holds only 4 of the 16 samples, under a second of forwards).
    time.sleep(300 if HOLD_AFTER and len(forwards) > HOLD_AFTER else 0.2)

LocalEngine.hooks = Hooks(forward=forward)
from vlfast.cli.main import main

sys.argv = ["vlfast", "extract", *sys.argv[1:]]
main()
"""


def test_sigterm_to_torchrun_commits_every_rank_and_resumes(tiny_qwen3_vl, tmp_path):
    """A scheduler's SIGTERM reaches torchrun, which passes it to its ranks: each commits what it extracted
    (nothing was committed before: --commit-every 3600), releases its lock and exits 143; the same command
    then finishes, equal to one uninterrupted process."""
    from _selftest import compare_caches
    from vlfast.extraction.store.writer import rank_is_held

    inputs = tmp_path / "in"
    make_images(inputs, [(32 + 8 * (k % 4), 32) for k in range(16)])
    (tmp_path / "driver.py").write_text(DRIVER)
    out = tmp_path / "ranks"
    cmd = [
        sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
        str(tmp_path / "driver.py"), str(inputs), str(out), "--model", str(tiny_qwen3_vl),
        "--workers", "0", "--batch-tokens", "64", "--commit-every", "3600",
    ]  # fmt: skip
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": os.pathsep.join(sys.path)}
    # Each rank holds at its third forward until the signal: on a loaded host (another test beside this one)
    # one rank can start seconds after the other, and a rank that has finished and exited 0 before the signal
    # comes is no test of what a SIGTERM does to it.
    launcher = subprocess.Popen(
        cmd, env=env | {"HOLD_AFTER": "2"}, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )
    seen: dict[str, int] = {}
    for line in launcher.stdout:  # both ranks print here
        if line.startswith("forward "):
            rank = line.split()[-1]
            seen[rank] = seen.get(rank, 0) + 1
        # Each rank at its second forward, so its first one is done and held: the hook prints before the
        # forward it precedes, and a rank SIGTERMed inside its first forward has nothing to commit, rightly.
        if len(seen) == 2 and min(seen.values()) >= 2:
            break
    assert len(seen) == 2 and min(seen.values()) >= 2, (seen, launcher.communicate()[1][-4000:])
    launcher.send_signal(signal.SIGTERM)
    _, stderr = launcher.communicate(timeout=120)
    assert launcher.returncode != 0
    assert stderr.count("terminated (SIGTERM)") == 2, stderr[-4000:]  # each rank said so
    written_by = {path.name.split("-")[1] for path in (out / "shards").glob("*.safetensors")}
    assert written_by == {"r00000", "r00001"}, (written_by, stderr[-4000:])
    assert not rank_is_held(out, 0) and not rank_is_held(out, 1)
    committed = len(FeatureCache(out))
    assert 2 <= committed < 16

    done = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=env)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-4000:]
    extract(inputs, tmp_path / "one", model=str(tiny_qwen3_vl), num_workers=0, progress=False)
    assert compare_caches(tmp_path / "one", out) == []
