"""EXIF orientation as transformers applies it to an image given by path (issue 38, item 4).

transformers' ``load_image`` (what its image processors and ``apply_chat_template`` call for a path or URL)
applies ``PIL.ImageOps.exif_transpose``; vlfast does the same by default, records it in run.json
(``processor.exif_orientation``), and an OUT made without it (every OUT before this change) resumes as it
was made. The Qwen3-VL-Embedding recipe follows its reference, qwen-vl-utils, which does not apply it.
"""

from __future__ import annotations

import json
import warnings
from dataclasses import replace

import pytest
import torch

from vlfast.pixels.engine import Preprocessor, _image_processor, build_processor_config

ORIENTATION = 0x0112  # the EXIF tag


def _jpeg(path, orientation: int, h: int = 160, w: int = 320, seed: int = 1):
    from PIL import Image

    from vlfast.demo import pattern

    exif = Image.Exif()
    if orientation:
        exif[ORIENTATION] = orientation
    Image.fromarray(pattern(h, w, seed)).save(path, "JPEG", quality=95, exif=exif)
    return path


@pytest.mark.parametrize("orientation", range(1, 9))
def test_pixels_equal_the_transformers_processor_given_the_path(tmp_path, orientation):
    path = str(_jpeg(tmp_path / f"o{orientation}.jpg", orientation, h=256, w=512))
    default = build_processor_config("ref:qwen3-vl-2b", family="qwen3_vl")
    assert default.exif_orientation
    # transformers' PIL processor is the one that takes a path here (no torchvision): the PIL path compared
    # with it; the torchvision path (vlfast's default) turns the image the same way (its pixels are compared
    # with transformers' torchvision processor in test_preprocess_parity.py)
    cfg = replace(default, image_processor="Qwen2VLImageProcessorPil")
    pre = Preprocessor(cfg)
    pixels, grid, meta = pre.image(path)
    tv_pixels, tv_grid, tv_meta = Preprocessor(default).image(path)
    assert (tv_grid, tv_meta) == (grid, meta)
    # the JPEG decoded by libjpeg-turbo and turned as exif_transpose turns it: the same pixels as PIL's turn
    from PIL import Image, ImageOps

    from vlfast.pixels.image import jpeg_rgb

    assert jpeg_rgb(path, True) is not None  # the libjpeg-turbo path ran
    turned = ImageOps.exif_transpose(Image.open(path))
    assert torch.equal(Preprocessor(default).pil_image(turned)[0], tv_pixels)
    numbers = dict(
        patch_size=cfg.patch_size,
        temporal_patch_size=cfg.temporal_patch_size,
        merge_size=cfg.merge_size,
        image_mean=cfg.image_mean,
        image_std=cfg.image_std,
    )
    theirs = _image_processor(None, **numbers)(images=[path], size=pre._size(), return_tensors="pt")
    assert [list(grid)] == theirs["image_grid_thw"].tolist()
    assert torch.equal(pixels, theirs["pixel_values"].to(torch.float32))
    rotated = orientation >= 5  # 5-8 turn the image a quarter: height and width swap
    assert (meta["width"], meta["height"]) == ((256, 512) if rotated else (512, 256))
    assert grid == ((1, 32, 16) if rotated else (1, 16, 32))


def test_without_it_the_stored_pixels_are_taken_as_they_are(tmp_path):
    path = str(_jpeg(tmp_path / "o6.jpg", 6))
    cfg = build_processor_config("ref:qwen3-vl-2b", family="qwen3_vl", exif_orientation=False)
    _, grid, meta = Preprocessor(cfg).image(path)
    assert (meta["width"], meta["height"]) == (320, 160)
    assert cfg.to_dict()["exif_orientation"] is False  # recorded: every OUT records every setting
    assert build_processor_config("ref:qwen3-vl-2b", family="qwen3_vl").to_dict()["exif_orientation"] is True


def _extract(source, out, model, **options):
    import vlfast

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return vlfast.extract(str(source), str(out), model=str(model), num_workers=0, **options)


def _processor(out) -> dict:
    return json.loads((out / "run.json").read_text())["config"]["processor"]


def _grids(out) -> dict[str, list]:
    import vlfast

    cache = vlfast.FeatureCache(str(out))
    return {i: cache[i]["grid_thw"].tolist()[0] for i in cache.ids()}  # (t, h, w) of its one image


@pytest.fixture(scope="module")
def made_without_it(tmp_path_factory, tiny_qwen3_vl):
    """An OUT of one rotated JPEG made with exif_orientation=False: what every OUT before the setting holds."""
    root = tmp_path_factory.mktemp("exif")
    (root / "in").mkdir()
    _jpeg(root / "in" / "a.jpg", 6, h=64, w=128)
    _extract(root / "in", root / "old", tiny_qwen3_vl, exif_orientation=False)
    return root


def test_recorded_and_an_out_made_without_it_resumes_as_made(made_without_it, tmp_path, tiny_qwen3_vl):
    images, old = made_without_it / "in", made_without_it / "old"
    assert _processor(old)["exif_orientation"] is False
    (as_stored,) = _grids(old).values()

    new = tmp_path / "new"
    _extract(images, new, tiny_qwen3_vl)
    assert _processor(new)["exif_orientation"] is True
    (upright,) = _grids(new).values()
    assert upright[0] == as_stored[0] and upright[1:] == as_stored[1:][::-1]

    # the same call without the option resumes it as it was made, also for the samples it adds
    _jpeg(images / "b.jpg", 6, h=64, w=128, seed=2)
    summary = _extract(images, old, tiny_qwen3_vl)
    assert summary.extracted == 1 and _processor(old)["exif_orientation"] is False
    assert all(g == as_stored for g in _grids(old).values())


def test_asking_for_it_on_an_out_made_without_it_is_refused(made_without_it, tiny_qwen3_vl):
    from vlfast.extraction.store.resume import RunConfigMismatch

    old = made_without_it / "old"
    before = sorted(p.name for p in old.rglob("*"))
    with pytest.raises(RunConfigMismatch, match="processor.exif_orientation"):
        _extract(made_without_it / "in", old, tiny_qwen3_vl, exif_orientation=True)
    assert sorted(p.name for p in old.rglob("*")) == before


def _rotated_mp4(path, width=64, height=32):
    """An H.264 clip whose track header says to show it turned 90 degrees (a phone's portrait video)."""
    import struct

    import av
    import numpy as np

    with av.open(str(path), "w") as c:
        s = c.add_stream("libx264", rate=5)
        s.width, s.height, s.pix_fmt = width, height, "yuv420p"
        for k in range(4):
            frame = np.zeros((height, width, 3), np.uint8)
            frame[:, : width // 4 * (k + 1)] = 200  # a bar that grows to the right
            for p in s.encode(av.VideoFrame.from_ndarray(frame, format="rgb24")):
                c.mux(p)
        for p in s.encode():
            c.mux(p)
    data = bytearray(path.read_bytes())
    at = data.find(b"tkhd") + 4  # the box's payload: version 0, so 32-bit times and duration
    assert data[at] == 0
    matrix = at + 4 + 12 + 4 + 4 + 8 + 8
    data[matrix : matrix + 36] = struct.pack(">9i", 0, 0x10000, 0, -0x10000, 0, 0, 0, 0, 0x40000000)
    path.write_bytes(bytes(data))
    return path


def test_a_videos_rotation_is_applied_as_transformers_reader_applies_it(tmp_path):
    """docs/extract.md: a video's frames are turned by its display matrix, as torchcodec (transformers' reader
    for a path) turns them (tests/test_video_rotation.py); taken as stored they are what transformers'
    read_video_pyav gives."""
    from dataclasses import replace

    import av
    import numpy as np
    from transformers.video_utils import read_video_pyav

    from vlfast.pixels.video import read_video

    path = _rotated_mp4(tmp_path / "portrait.mp4")
    with av.open(str(path)) as c:
        turn = next(c.decode(video=0)).rotation
    assert turn in (90, -90)  # the container says to turn it
    cfg = build_processor_config("ref:qwen3-vl-2b", family="qwen3_vl", num_frames=4)
    stored, _ = read_video(str(path), replace(cfg, video_rotation=False))
    assert stored.shape == (4, 3, 32, 64)
    theirs, _ = read_video_pyav(str(path), lambda metadata, **kw: [0, 1, 2, 3])
    assert torch.equal(stored.permute(0, 2, 3, 1), torch.from_numpy(theirs))
    turned, _ = read_video(str(path), cfg)
    assert turned.shape == (4, 3, 64, 32)
    want = np.stack([np.rot90(f, 1 if turn == 90 else 3) for f in theirs])
    assert torch.equal(turned.permute(0, 2, 3, 1), torch.from_numpy(want))


def test_the_flags_and_the_refusal_say_how_to_resume_as_made(made_without_it, tiny_qwen3_vl):
    from typer.testing import CliRunner

    from vlfast.cli.main import app

    old = made_without_it / "old"
    args = ["extract", str(made_without_it / "in"), str(old), "-m", str(tiny_qwen3_vl)]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        r = CliRunner().invoke(app, [*args, "--exif-orientation"])
    assert r.exit_code == 2, r.output
    text = " ".join(r.output.split())
    assert (
        "processor.exif_orientation" in text
        and "neither --exif-orientation nor --no-exif-orientation" in text
    )
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        r = CliRunner().invoke(app, [*args, "--no-exif-orientation"])
    assert r.exit_code == 0 and "nothing to do" in r.output, r.output
