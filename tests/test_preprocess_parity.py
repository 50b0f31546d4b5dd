"""vlfast's pixel_values and grid_thw against transformers' own processor classes, on real encoded files.

Per family (Qwen2-VL, Qwen2.5-VL, Qwen3-VL; Qwen3-VL-MoE reads Qwen3-VL's processors), backend and mode: images
(JPEG and PNG of several sizes and aspect ratios, one with an EXIF orientation) through the image processor of
the recorded backend, videos (H.264 MP4 with B-frames, two sizes) sampled by frame count and by fps, with
``cap_pixels_per_frame`` off and on, from a checkpoint's processor files and from a ``ref:`` model's published
defaults. Equal means bit-equal: vlfast's video rules are transformers' operations in another order, and its
images go through transformers' processor itself. The reference runs in a process of its own with the real
torchvision (tests/_transformers_reference.py); the Qwen3-VL-Embedding recipe's reference is qwen-vl-utils,
compared in test_extract_embedding.py.
"""

from __future__ import annotations

import json
import os
import sys
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
import torch

import _transformers_reference as reference
from vlfast.demo import make_video, pattern
from vlfast.extraction.sources.sample import Sample
from vlfast.pixels.engine import Preprocessor, build_processor_config

# one xdist worker: the reference run (one interpreter, every case) is made once, not once a worker
pytestmark = [pytest.mark.timeout(600), pytest.mark.xdist_group("parity")]

CLIP_MEAN = [0.48145466, 0.4578275, 0.40821073]
CLIP_STD = [0.26862954, 0.26130258, 0.27577711]
QWEN2_IMAGE = {"min_pixels": 3136, "max_pixels": 12845056, "patch_size": 14, "temporal_patch_size": 2}
QWEN3_IMAGE = {"size": {"shortest_edge": 65536, "longest_edge": 16777216}, "patch_size": 16}


@pytest.fixture(scope="module")
def needs_reference():
    why = reference.unavailable()
    if why is not None:
        if os.environ.get("CI"):
            pytest.fail(f"the parity reference must run in CI: {why}")
        pytest.skip(why)


@pytest.fixture(scope="module")
def files(tmp_path_factory) -> dict[str, Path]:
    """Real encoded files: JPEGs and PNGs of several sizes and aspect ratios, an EXIF-rotated JPEG, MP4s."""
    from PIL import Image

    d = tmp_path_factory.mktemp("parity-media")
    out: dict[str, Path] = {}
    for name, (w, h), fmt in [
        ("photo_640x480.jpg", (640, 480), "JPEG"),
        ("wide_1000x300.png", (1000, 300), "PNG"),
        ("odd_333x517.jpg", (333, 517), "JPEG"),
        ("tiny_50x40.png", (50, 40), "PNG"),
        ("hd_1920x1080.jpg", (1920, 1080), "JPEG"),
    ]:
        img = Image.fromarray(pattern(h, w, len(out)))
        img.save(d / name, fmt, **({"quality": 90} if fmt == "JPEG" else {}))
        out[name] = d / name
    rgba = np.dstack([pattern(240, 320, 7), (pattern(240, 320, 8)[..., 0] // 2 + 64)])
    Image.fromarray(rgba, "RGBA").save(d / "alpha_320x240.png")  # composited on white by both
    out["alpha_320x240.png"] = d / "alpha_320x240.png"
    # a colour key (PNG's tRNS chunk): an RGB image that transformers >= 5.21 composites on white
    key = pattern(200, 260, 10)
    Image.fromarray(key).save(d / "colour_key_260x200.png", transparency=tuple(int(v) for v in key[0, 0]))
    out["colour_key_260x200.png"] = d / "colour_key_260x200.png"
    exif = Image.Exif()
    exif[0x0112] = 6  # rotated 90 degrees: transformers' load_image turns it upright
    Image.fromarray(pattern(300, 400, 9)).save(d / "rotated.jpg", "JPEG", exif=exif)
    out["rotated.jpg"] = d / "rotated.jpg"
    # x264's defaults: B-frames (decode order differs from display order), as cameras and encoders make them
    out["hd.mp4"] = make_video(d / "hd.mp4", frames=24, fps=12, width=1280, height=720, seed=3)
    out["small.mp4"] = make_video(d / "small.mp4", frames=45, fps=30, width=640, height=360, seed=4)
    return out


@pytest.fixture(scope="module")
def qwen2_checkpoint(tmp_path_factory) -> Path:
    """A Qwen2-VL checkpoint's processor files as the published repositories have them: preprocessor_config.json
    alone (no video_preprocessor_config.json), which transformers also reads for videos."""
    d = tmp_path_factory.mktemp("qwen2-ckpt")
    (d / "config.json").write_text(json.dumps({"model_type": "qwen2_vl"}))
    cfg = {
        "image_processor_type": "Qwen2VLImageProcessor",
        "processor_class": "Qwen2VLProcessor",
        **QWEN2_IMAGE,
        "merge_size": 2,
        "image_mean": CLIP_MEAN,
        "image_std": CLIP_STD,
        # a smaller budget than the published one, so the HD clip is resized per frame here too
        "max_pixels": 602112,
    }
    (d / "preprocessor_config.json").write_text(json.dumps(cfg))
    return d


def _vlfast(model: str, family: str, kind: str, path: Path, **options):
    cfg = build_processor_config(model, family=family, **options)
    pre = Preprocessor(cfg, image_processor_dir=None if model.startswith("ref:") else model)
    pixels, grid, _ = pre(Sample(id=path.name, kind=kind, paths=(str(path),)))
    return cfg, pixels, list(grid)


def _assert_equal(name: str, ours: torch.Tensor, grid: list[int], expected) -> None:
    ref_pixels, ref_grid = expected
    assert grid == ref_grid, f"{name}: grid {grid} against transformers' {ref_grid}"
    assert ours.dtype == torch.float32 and ours.shape == ref_pixels.shape, name
    worst = (ours - ref_pixels.to(torch.float32)).abs().max().item()
    assert torch.equal(ours, ref_pixels.to(torch.float32)), f"{name}: max abs diff {worst}"


MODES = {"8-frames": {"num_frames": 8}, "2-fps": {"fps": 2.0}}
CLIPS = ("hd.mp4", "small.mp4")
# The published Qwen3-VL repositories' video_preprocessor_config.json (vlfast's ref: defaults); Qwen2-VL's and
# Qwen2.5-VL's have none: their ref: defaults are Qwen2VLVideoProcessor's own.
QWEN3_VIDEO = {"size": {"shortest_edge": 4096, "longest_edge": 25_165_824}, "fps": 2, "patch_size": 16}
REF_VIDEOS = {  # ref: model -> (family, transformers' video processor class, its settings)
    "ref:qwen2-vl-7b": ("qwen2_vl", "Qwen2VLVideoProcessor", {}),
    "ref:qwen2.5-vl-7b": ("qwen2_5_vl", "Qwen2VLVideoProcessor", {}),
    "ref:qwen3-vl-2b": ("qwen3_vl", "Qwen3VLVideoProcessor", QWEN3_VIDEO),
    "ref:qwen3-vl-30b-a3b": ("qwen3_vl_moe", "Qwen3VLVideoProcessor", QWEN3_VIDEO),
}
# checkpoint -> (family, the video processor class transformers builds from it)
CHECKPOINT_VIDEOS = {
    "qwen3_vl": ("qwen3_vl", "Qwen3VLVideoProcessor"),
    "qwen2_vl": ("qwen2_vl", "Qwen2VLVideoProcessor"),
    # the settings that change pixels, changed in the checkpoint's files: bilinear and rescaled only ...
    "qwen3_vl-bilinear-unnormalized": ("qwen3_vl", "Qwen3VLVideoProcessor"),
    # ... nearest, and neither rescaled nor normalised
    "qwen3_vl-nearest-raw": ("qwen3_vl", "Qwen3VLVideoProcessor"),
}
CHANGED_SETTINGS = {
    "qwen3_vl-bilinear-unnormalized": {"resample": 2, "do_normalize": False},
    "qwen3_vl-nearest-raw": {"resample": 0, "do_normalize": False, "do_rescale": False},
}
IMAGES = (
    "photo_640x480.jpg",
    "wide_1000x300.png",
    "odd_333x517.jpg",
    "tiny_50x40.png",
    "hd_1920x1080.jpg",
    "rotated.jpg",
    "alpha_320x240.png",
    "colour_key_260x200.png",
)
# Transparency: transformers' load_image, for a path, drops the alpha channel (convert("RGB")); its processor,
# given the PIL image, composites it on white, as qwen-vl-utils does, and so does vlfast: the reference gets it so
GIVEN_AS_PIL = {"alpha_320x240.png", "colour_key_260x200.png"}
REF_IMAGES = {  # ref: model -> (family, the class's numbers as vlfast's published defaults give them)
    "ref:qwen2-vl-7b": ("qwen2_vl", {**QWEN2_IMAGE, "image_mean": CLIP_MEAN, "image_std": CLIP_STD}),
    "ref:qwen2.5-vl-7b": ("qwen2_5_vl", {**QWEN2_IMAGE, "image_mean": CLIP_MEAN, "image_std": CLIP_STD}),
    "ref:qwen3-vl-2b": ("qwen3_vl", {**QWEN3_IMAGE, "image_mean": [0.5] * 3, "image_std": [0.5] * 3}),
}


@pytest.fixture(scope="module")
def checkpoints(tiny_qwen3_vl, qwen2_checkpoint, tmp_path_factory) -> dict[str, Path]:
    out = {"qwen3_vl": tiny_qwen3_vl, "qwen2_vl": qwen2_checkpoint}
    for name, changed in CHANGED_SETTINGS.items():
        d = tmp_path_factory.mktemp(name)
        for f in ("config.json", "preprocessor_config.json", "video_preprocessor_config.json"):
            cfg = json.loads((tiny_qwen3_vl / f).read_text())
            (d / f).write_text(json.dumps(cfg if f == "config.json" else {**cfg, **changed}))
        out[name] = d
    return out


@pytest.fixture(scope="module")
def expected(needs_reference, files, checkpoints, tmp_path_factory) -> dict:
    """Every case's reference output, from one run of transformers' processors (one interpreter start)."""
    cases = []
    for model, (_, cls, init) in REF_VIDEOS.items():
        for mode, call in MODES.items():
            for cap in CAPS:
                if model in SHARED and (mode != "8-frames" or cap):
                    continue
                for clip in CLIPS:
                    cases.append(
                        {
                            "name": f"{model}-{mode}-{cap}-{clip}",
                            "kind": "video",
                            "path": str(files[clip]),
                            "processor": cls,
                            "init": init,
                            "call": {**call, "cap_pixels_per_frame": cap},
                        }
                    )
    for name, (_, cls) in CHECKPOINT_VIDEOS.items():
        for mode, call in MODES.items():
            for clip in CLIPS:
                cases.append(
                    {
                        "name": f"{name}-checkpoint-{mode}-{clip}",
                        "kind": "video",
                        "path": str(files[clip]),
                        "processor": "AutoVideoProcessor",
                        "checkpoint": str(checkpoints[name]),
                        "expect_class": cls,
                        "call": dict(call),
                    }
                )
    recorded = build_processor_config("ref:qwen3-vl-2b", family="qwen3_vl").image_processor
    for image in IMAGES:
        # the recorded backend (transformers' own processor runs in vlfast), and the torchvision one (whose
        # operations vlfast does itself)
        for backend in sorted({recorded, "Qwen2VLImageProcessor"}):
            for model, (_, init) in REF_IMAGES.items():
                # a ref: model's class built with the family's numbers; vlfast passes the budget as size
                cases.append(
                    {
                        "name": f"{model}-{backend}-{image}",
                        "kind": "image",
                        "path": str(files[image]),
                        "processor": backend,
                        "init": init,
                        "as_pil": image in GIVEN_AS_PIL,
                    }
                )
            for name, ckpt in checkpoints.items():
                cases.append(
                    {
                        "name": f"{name}-checkpoint-{backend}-{image}",
                        "kind": "image",
                        "path": str(files[image]),
                        "processor": backend,
                        "checkpoint": str(ckpt),
                        "as_pil": image in GIVEN_AS_PIL,
                    }
                )
    return reference.reference_pixels(cases, tmp_path_factory.mktemp("reference"))


CAPS = (False, True)
# Qwen2.5-VL and Qwen3-VL-MoE read the same processor classes with the same defaults as Qwen2-VL and Qwen3-VL
# (their family is what differs): every mode and cap for those two, one each for these
SHARED = ("ref:qwen2.5-vl-7b", "ref:qwen3-vl-30b-a3b")
REF_VIDEO_CASES = [
    pytest.param(model, mode, cap, id=f"{model}-{mode}-{'capped' if cap else 'uncapped'}")
    for model in REF_VIDEOS
    for mode in MODES
    for cap in CAPS
    if model not in SHARED or (mode == "8-frames" and not cap)
]


@pytest.mark.parametrize(("model", "mode", "cap"), REF_VIDEO_CASES)
def test_ref_videos_equal_transformers(expected, files, model, mode, cap):
    """A ``ref:`` model's videos against the family's video processor class with its defaults: Qwen2-VL and
    Qwen2.5-VL bound each frame by the budget (a 1280x720 clip at 8 frames: (4, 40, 72), not vlfast's former
    (4, 14, 26)), Qwen3-VL budgets over all frames."""
    family = REF_VIDEOS[model][0]
    # vlfast reads cap_pixels_per_frame from the processor's settings; a ref: model has the class defaults
    cfg = replace(build_processor_config(model, family=family, **MODES[mode]), cap_pixels_per_frame=cap)
    grids = {}
    for clip in CLIPS:
        pixels, grid, _ = Preprocessor(cfg)(Sample(id=clip, kind="video", paths=(str(files[clip]),)))
        _assert_equal(
            f"{model} {mode} cap={cap} {clip}", pixels, list(grid), expected[f"{model}-{mode}-{cap}-{clip}"]
        )
        grids[clip] = list(grid)
    if family.startswith("qwen2") and not cap and mode == "8-frames":
        assert grids["hd.mp4"] == [4, 40, 72]  # 1280x720 within 768*28*28 pixels per frame
        assert grids["small.mp4"] == [4, 26, 46]  # 640x360: no smaller


@pytest.mark.parametrize("mode", list(MODES))
@pytest.mark.parametrize("name", list(CHECKPOINT_VIDEOS))
def test_checkpoint_videos_equal_transformers(expected, files, checkpoints, name, mode):
    """A checkpoint's processor files against AutoVideoProcessor built from them: Qwen3-VL's
    video_preprocessor_config.json, one with the settings that change pixels changed (resample bilinear or
    nearest, no normalisation, no rescaling), and a Qwen2-VL checkpoint with preprocessor_config.json alone,
    whose settings transformers then reads for videos too (so vlfast does)."""
    family = CHECKPOINT_VIDEOS[name][0]
    for clip in CLIPS:
        cfg, pixels, grid = _vlfast(str(checkpoints[name]), family, "video", files[clip], **MODES[mode])
        _assert_equal(f"{name} {mode} {clip}", pixels, grid, expected[f"{name}-checkpoint-{mode}-{clip}"])
    changed = CHANGED_SETTINGS.get(name, {})
    assert {k: v for k, v in cfg.to_dict().items() if k.removeprefix("video_") in changed} == {
        f"{prefix}{k}": v for k, v in changed.items() for prefix in ("", "video_")
    }


@pytest.mark.parametrize("backend", ["recorded", "Qwen2VLImageProcessor"])
@pytest.mark.parametrize("image", IMAGES)
def test_images_equal_transformers(expected, files, checkpoints, image, backend):
    """Images of several sizes and aspect ratios (an EXIF-rotated JPEG, a PNG with transparency), per family,
    from checkpoints and ref: defaults, against the image processor class vlfast records, built by transformers
    the same way: the recorded backend (here the PIL one, which vlfast calls), and the torchvision one, whose
    operations vlfast does itself (also with the normalisation deferred to the model side, as extract does)."""
    from vlfast.pixels.video import normalize_patches

    setups = [(m, f, m) for m, (f, _) in REF_IMAGES.items()]
    setups += [
        (str(ckpt), CHECKPOINT_VIDEOS[name][0], f"{name}-checkpoint") for name, ckpt in checkpoints.items()
    ]
    for model, family, key in setups:
        cfg = build_processor_config(model, family=family)
        if backend != "recorded":
            cfg = replace(cfg, image_processor=backend)
        pre = Preprocessor(cfg, image_processor_dir=None if model.startswith("ref:") else model)
        sample = Sample(id=image, kind="image", paths=(str(files[image]),))
        pixels, grid, _ = pre(sample)
        want = expected[f"{key}-{cfg.image_processor}-{image}"]
        _assert_equal(f"{key} {cfg.image_processor} {image}", pixels, list(grid), want)
        if backend != "recorded":
            # without simplejpeg (an optional dependency) JPEGs are decoded by PIL: the same pixels
            with pytest.MonkeyPatch.context() as mp:
                mp.setitem(sys.modules, "simplejpeg", None)
                by_pil, _, _ = Preprocessor(cfg, image_processor_dir=pre.image_processor_dir)(sample)
            _assert_equal(f"{key} {backend} PIL-decoded {image}", by_pil, list(grid), want)
            deferred, _, _ = replace(pre, defer_video_normalize=True)(sample)
            if deferred.dtype == torch.uint8:  # finished as the model side finishes every uint8 input
                deferred = normalize_patches(deferred, cfg)
            _assert_equal(f"{key} {backend} deferred {image}", deferred, list(grid), want)


def test_qwen2_video_sizing_is_per_frame():
    """The sizes the issue measured, without the reference: 1280x720 and 640x360 clips at 8 frames."""
    from vlfast.pixels.video import video_resize_shape

    cfg = build_processor_config("ref:qwen2-vl-7b", family="qwen2_vl", num_frames=8)
    assert cfg.video_sizing == "qwen2-vl" and cfg.max_video_tokens == 128_000
    assert [x // 14 for x in video_resize_shape(8, 720, 1280, cfg)] == [40, 72]
    assert [x // 14 for x in video_resize_shape(8, 360, 640, cfg)] == [26, 46]
    qwen3 = build_processor_config("ref:qwen3-vl-2b", family="qwen3_vl", num_frames=8)
    assert [x // 16 for x in video_resize_shape(8, 720, 1280, qwen3)] == [
        44,
        80,
    ]  # 8 x 704 x 1280 within the total


def test_a_changed_pixel_setting_refuses_the_resume(tiny_qwen3_vl, two, tmp_path):
    """resample (and the do_* flags) come from the checkpoint's processor files and change pixels: they are in
    run.json where they differ from the defaults, and a resume under another value is refused (exit 2, naming
    it), instead of one OUT holding two preprocessings."""
    import shutil

    from typer.testing import CliRunner

    from vlfast.cli.main import app

    ckpt = tmp_path / "ckpt"
    shutil.copytree(tiny_qwen3_vl, ckpt)
    out = tmp_path / "out"
    args = ["extract", str(two), str(out), "--model", str(ckpt), "--workers", "0"]
    assert CliRunner().invoke(app, args).exit_code == 0
    recorded = json.loads((out / "run.json").read_text())["config"]["processor"]
    assert recorded["resample"] == 3  # recorded: every OUT records every setting
    for f, key in (
        ("preprocessor_config.json", "resample"),
        ("video_preprocessor_config.json", "video_resample"),
    ):
        settings = json.loads((ckpt / f).read_text())
        (ckpt / f).write_text(json.dumps({**settings, "resample": 0}))
        r = CliRunner().invoke(app, args)
        assert r.exit_code == 2, r.output
        assert f"processor.{key}" in r.output and "already holds an extraction" in r.output, r.output
        (ckpt / f).write_text(json.dumps(settings))
    assert "nothing to do" in CliRunner().invoke(app, args).output


def test_transparency_follows_transformers_rule_and_is_recorded(tiny_qwen3_vl, two, tmp_path, monkeypatch):
    """transformers' processors made a transparent image RGB by dropping the transparency up to 5.20 and by
    compositing it on white from 5.21: vlfast asks the installed transformers' own convert_to_rgb, converts as
    it does, and records the rule in run.json where it is "dropped" (absent: on white, as every OUT before);
    a resume under the other rule is refused (exit 2, naming it)."""
    import numpy as np
    import transformers
    from packaging.version import Version
    from PIL import Image
    from typer.testing import CliRunner

    from vlfast.cli.main import app
    from vlfast.extraction.store.format import FACTS_FILE
    from vlfast.pixels import settings as processor_config
    from vlfast.pixels.image import rgb_tensor
    from vlfast.pixels.settings import transparency_rule

    rule = transparency_rule()
    assert rule == ("white" if Version(transformers.__version__) >= Version("5.21") else "dropped")
    other = "dropped" if rule == "white" else "white"
    rgba = Image.fromarray(np.dstack([pattern(20, 30, 1), np.full((20, 30), 100, np.uint8)]), "RGBA")
    dropped = rgb_tensor(rgba, "dropped").permute(1, 2, 0).numpy()
    assert np.array_equal(dropped, np.asarray(rgba.convert("RGB")))  # 5.18-5.20's convert_to_rgb
    white = rgb_tensor(rgba, "white").permute(1, 2, 0).numpy()
    assert (white >= dropped).all() and not np.array_equal(white, dropped)
    out = tmp_path / "out"
    args = ["extract", str(two), str(out), "--model", str(tiny_qwen3_vl), "--workers", "0"]
    assert CliRunner().invoke(app, args).exit_code == 0
    recorded = json.loads((out / "run.json").read_text())["config"]["processor"]
    assert recorded["transparency"] == rule
    # another transformers (its facts key differs: the record is asked again) with the other rule
    monkeypatch.setattr(processor_config, "transparency_rule", lambda: other)
    (out / FACTS_FILE).unlink()
    r = CliRunner().invoke(app, args)
    assert r.exit_code == 2 and "processor.transparency" in r.output, r.output
    assert "transformers of the rule it was made with" in " ".join(r.output.split()), r.output
    fresh = tmp_path / "fresh"
    assert CliRunner().invoke(app, [*args[:2], str(fresh), *args[3:]]).exit_code == 0
    recorded = json.loads((fresh / "run.json").read_text())["config"]["processor"]
    assert recorded.get("transparency", "white") == other


def test_the_image_backend_is_chosen_recorded_and_kept(tiny_qwen3_vl, two, tmp_path):
    """--image-backend pil: transformers' PIL processor runs and is recorded; the same command without the
    option resumes as made; the other backend on that OUT is refused (exit 2), saying how to resume it."""
    from typer.testing import CliRunner

    from vlfast.cli.main import app

    out = tmp_path / "out"
    args = ["extract", str(two), str(out), "--model", str(tiny_qwen3_vl), "--workers", "0"]
    assert CliRunner().invoke(app, [*args, "--image-backend", "pil"]).exit_code == 0
    recorded = json.loads((out / "run.json").read_text())["config"]["processor"]["image_processor"]
    assert recorded == "Qwen2VLImageProcessorPil"
    assert "nothing to do" in CliRunner().invoke(app, args).output
    r = CliRunner().invoke(app, [*args, "--image-backend", "torchvision"])
    assert r.exit_code == 2 and "processor.image_processor" in r.output, r.output
    assert "leave out --image-backend" in " ".join(r.output.split()), r.output
    r = CliRunner().invoke(app, [*args, "--image-backend", "tv"])
    assert r.exit_code == 2 and "torchvision or pil" in r.output, r.output
