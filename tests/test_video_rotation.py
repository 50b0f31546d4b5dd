"""A video's display matrix (a phone's portrait clip: stored landscape, shown turned): vlfast turns the frames
upright as torchcodec does, the reader transformers' video processors decode a path with (PyAV, which the
parity reference reads with here, does not turn them). The turn for each right angle was checked frame for
frame against transformers' processor with torchcodec 0.17 (scripts/decode_parity.py, in
benchmarks/torchcodec_env.sh's venv: torchcodec does not load beside the CPU torch the tests run on); here:
the same turns on every decode path, the choice recorded in run.json and kept by a resume, and a matrix
vlfast cannot turn refused as the sample's error."""

from __future__ import annotations

import json
from dataclasses import replace

import numpy as np
import pytest
import torch

from vlfast.demo import make_video
from vlfast.pixels.engine import build_processor_config
from vlfast.pixels.media import SampleError
from vlfast.pixels.video import read_video

# PyAV's set_display_rotation(degrees) -> np.rot90's k that torchcodec's frames equal (frame.rotation reads
# back 90, -180 and -90 for 90, 180 and 270)
TURNS = {0: 0, 90: 1, 180: 2, 270: 3}


@pytest.fixture(scope="module")
def clips(tmp_path_factory):
    d = tmp_path_factory.mktemp("rotated")
    made = {
        r: make_video(d / f"r{r}.mp4", frames=20, fps=10, width=96, height=64, seed=2, rotation=r)
        for r in TURNS
    }
    made["mirrored"] = make_video(d / "mirrored.mp4", frames=6, fps=10, width=96, height=64, hflip=True)
    made["tilted"] = make_video(d / "tilted.mp4", frames=6, fps=10, width=96, height=64, rotation=45)
    # GOPs of 5 frames: the sparse decode seeks past GOPs, so both decode paths are exercised
    made["seeking"] = make_video(
        d / "seeking.mp4", frames=40, fps=10, width=96, height=64, seed=3, rotation=90, options={"g": 5}
    )
    return made


@pytest.mark.parametrize("degrees", list(TURNS))
def test_frames_are_turned_as_torchcodec_turns_them(clips, degrees):
    cfg = build_processor_config("ref:qwen3-vl-2b", family="qwen3_vl", num_frames=8)
    assert cfg.video_rotation is True  # a new OUT's default, as images' EXIF orientation
    turned, meta = read_video(str(clips[degrees]), cfg)
    stored, _ = read_video(str(clips[degrees]), replace(cfg, video_rotation=False))
    assert stored.shape[-2:] == (64, 96)
    want = np.stack([np.rot90(f, TURNS[degrees]) for f in stored.permute(0, 2, 3, 1).numpy()])
    assert torch.equal(turned, torch.from_numpy(want).permute(0, 3, 1, 2))
    assert meta["frame_indices"] == read_video(str(clips[0]), cfg)[1]["frame_indices"]


def test_every_decode_path_turns_alike(clips, monkeypatch):
    """The sparse decode (seeking past GOPs) and the sequential one give the same turned frames."""
    from vlfast.pixels import video

    cfg = build_processor_config("ref:qwen3-vl-2b", family="qwen3_vl", num_frames=8)
    sparse, _ = read_video(str(clips["seeking"]), cfg)
    monkeypatch.setattr(video, "_decode_sparse", lambda *a, **k: None)  # the sequential fallback
    sequential, _ = read_video(str(clips["seeking"]), cfg)
    assert sparse.shape[-2:] == (96, 64) and torch.equal(sparse, sequential)


@pytest.mark.parametrize(
    ("clip", "needle"), [("mirrored", "mirrors its frames"), ("tilted", "by 45.0 degrees")]
)
def test_a_matrix_vlfast_cannot_turn_is_the_sample_s_error(clips, clip, needle):
    cfg = build_processor_config("ref:qwen3-vl-2b", family="qwen3_vl", num_frames=4)
    with pytest.raises(SampleError, match=needle):
        read_video(str(clips[clip]), cfg)
    stored, _ = read_video(str(clips[clip]), replace(cfg, video_rotation=False))  # as stored: no matrix read
    assert stored.shape[-2:] == (64, 96)


def test_the_choice_is_recorded_and_a_resume_keeps_it(clips, tiny_qwen3_vl, tmp_path):
    """A new OUT turns (run.json: "video_rotation": true) unless --no-exif-orientation; an OUT made before the
    choice was recorded (no such key) resumes taking frames as stored; the recipe takes them as stored, as its
    reference's readers do."""
    import shutil

    from typer.testing import CliRunner

    from vlfast.cli.main import app
    from vlfast.extraction.plan import recorded_setting

    folder = tmp_path / "in"
    folder.mkdir()
    shutil.copy(clips[90], folder / "portrait.mp4")
    for flag, expected in ((None, True), ("--no-exif-orientation", False)):
        out = tmp_path / f"out-{expected}"
        args = ["extract", str(folder), str(out), "--model", str(tiny_qwen3_vl), "--workers", "0"]
        args += ["--num-frames", "4", *([flag] if flag else [])]
        r = CliRunner().invoke(app, args)
        assert r.exit_code == 0, r.output
        recorded = json.loads((out / "run.json").read_text())["config"]["processor"]
        assert recorded.get("video_rotation", False) is expected
        assert "nothing to do" in CliRunner().invoke(app, args).output
    assert recorded_setting(None, "video_rotation") is None  # a new OUT: the EXIF choice decides
    assert (
        recorded_setting({"processor": {"exif_orientation": True, "video_rotation": False}}, "video_rotation")
        is False
    )
    assert (
        build_processor_config("ref:qwen3-vl-2b", family="qwen3_vl", video_rotation=False).video_rotation
        is False
    )


def test_a_forked_worker_frees_what_a_decode_left_behind(clips):
    """Reading a frame's display matrix ties the frame to its side data in a cycle, freed by the garbage
    collector, not at once. A frame converted to RGB by its own reformatter kept that reformatter's swscale
    context and its slice threads until then; freed in a forked DataLoader worker (no threads but the one
    that forked), the context waited forever for threads that were not there. The decode converts with a
    reformatter of its own, freed at once: a forked child collects the parent's garbage and exits."""
    import gc
    import os
    import time

    cfg = build_processor_config("ref:qwen3-vl-2b", family="qwen3_vl", num_frames=8)
    assert cfg.video_rotation is True
    gc.collect()
    gc.disable()  # what a decode leaves stays until the fork, as between two collections in a training loop
    try:
        read_video(str(clips["seeking"]), cfg)
        read_video(str(clips[90]), cfg)
        pid = os.fork()
        if pid == 0:  # the child: free the parent's garbage, as a worker's first collection does
            gc.collect()
            os._exit(0)
    finally:
        gc.enable()
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            break
        time.sleep(0.05)
    else:
        os.kill(pid, 9)
        os.waitpid(pid, 0)
        pytest.fail("the forked child hung freeing a frame the parent decoded")
    assert os.waitstatus_to_exitcode(status) == 0
