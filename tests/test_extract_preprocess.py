"""Preprocessing parity with transformers' own processors, and the bad-input cases.

Images run through transformers' image processor itself. Videos cannot (transformers' video processors
need torchvision, which does not install beside this torch), so each step of vlfast's video path is
checked against the corresponding transformers function called directly: frame sampling
(``Qwen3VLVideoProcessor.sample_frames``, ``Qwen2VLVideoProcessor.sample_frames``, and qwen-vl-utils'
``smart_nframes``: the same frames for every even count), sizes (a ``Qwen3VLVideoProcessor`` loaded from a
saved config, with and without the per-frame cap: its ``get_num_of_video_patches``, and its call on a clip's
frames in a process with the reference torchvision), patchify and the placeholder text
(``Qwen3VLProcessor.replace_video_token``). Where torchvision is installed, the whole video path is also
compared with ``Qwen3VLVideoProcessor`` itself, resize kernel included.
"""

from __future__ import annotations

import importlib.util
import json
import os
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from vlfast.extraction.sources import Sample
from vlfast.pixels.engine import Preprocessor, SampleError, build_processor_config, load_image
from vlfast.pixels.video import patchify_video, read_video, sample_frame_indices, video_resize_shape

pytest.importorskip("transformers")


@pytest.fixture(scope="module")
def cfg():
    return build_processor_config("ref:qwen3-vl-2b", family="qwen3_vl")


def _reference_image_processor(cfg):
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    return Qwen2VLImageProcessorPil(
        patch_size=16,
        merge_size=2,
        temporal_patch_size=2,
        image_mean=[0.5] * 3,
        image_std=[0.5] * 3,
        size={"shortest_edge": 65_536, "longest_edge": 16_777_216},
    )


def test_image_matches_transformers_processor(media_dir, cfg):
    """An OUT made with transformers' PIL processor (the class vlfast recorded where torchvision was absent,
    before its own torchvision path) goes on with that processor: its pixels, for every image mode."""
    from dataclasses import replace

    from PIL import Image

    ref = _reference_image_processor(cfg)
    pre = Preprocessor(replace(cfg, image_processor="Qwen2VLImageProcessorPil"))
    for name in ("rgb.jpg", "rgba.png", "palette.png", "gray.png", "cmyk.jpg", "tiny.png", "wide150.png"):
        path = media_dir / "good" / name
        pixels, grid, _ = pre.image(str(path))
        expected = ref(images=[Image.open(path)], return_tensors="pt")
        assert grid == tuple(expected["image_grid_thw"][0].tolist()), name
        torch.testing.assert_close(pixels, expected["pixel_values"], rtol=0, atol=0, msg=name)
        assert grid[0] == 1 and pixels.shape[1] == 3 * 2 * 16 * 16


def test_checkpoint_processor_is_the_checkpoints_own(tiny_qwen3_vl, media_dir):
    from transformers import AutoImageProcessor

    cfg = build_processor_config(str(tiny_qwen3_vl), family="qwen3_vl")
    assert cfg.image_mean == (0.5, 0.5, 0.5) and cfg.video_max_pixels == 25_165_824
    assert "video_preprocessor_config.json" in cfg.source
    pixels, grid, _ = Preprocessor(cfg, image_processor_dir=str(tiny_qwen3_vl)).image(
        str(media_dir / "good/rgb.jpg")
    )
    from PIL import Image

    proc = AutoImageProcessor.from_pretrained(tiny_qwen3_vl, local_files_only=True)
    # the class transformers builds, or (without torchvision) the torchvision twin whose operations vlfast does
    assert cfg.image_processor == type(proc).__name__.removesuffix("Pil") == "Qwen2VLImageProcessor"
    # recorded as the class built, the checkpoint's processor itself runs: the same pixels
    from dataclasses import replace

    built = Preprocessor(
        replace(cfg, image_processor=type(proc).__name__), image_processor_dir=str(tiny_qwen3_vl)
    )
    pixels, grid, _ = built.image(str(media_dir / "good/rgb.jpg"))
    expected = proc(images=[Image.open(media_dir / "good/rgb.jpg")], return_tensors="pt")["pixel_values"]
    torch.testing.assert_close(pixels, expected, rtol=0, atol=0)


def test_recorded_image_processor_is_the_class_built(tiny_qwen3_vl, monkeypatch):
    """A new configuration records transformers' torchvision image processor (``Qwen2VLImageProcessor``, whose
    operations vlfast does itself), whichever backend transformers would pick here, and builds no transformers
    processor for it. The PIL class (an OUT made with it, or asked for) is built by name from the checkpoint's
    files, once for the configuration and the Preprocessor together; a class transformers does not build is
    refused."""
    from dataclasses import replace

    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    from vlfast.pixels import engine as preprocess

    calls = []
    real = Qwen2VLImageProcessorPil.from_pretrained.__func__

    def counting(cls, *args, **kwargs):
        calls.append(args[0])
        return real(cls, *args, **kwargs)

    monkeypatch.setattr(Qwen2VLImageProcessorPil, "from_pretrained", classmethod(counting))
    monkeypatch.setattr(preprocess, "_IMAGE_PROCESSORS", {})
    cfg = build_processor_config(str(tiny_qwen3_vl), family="qwen3_vl")
    assert cfg.image_processor == cfg.to_dict()["image_processor"] == "Qwen2VLImageProcessor"
    assert (
        build_processor_config("ref:qwen3-vl-2b", family="qwen3_vl").image_processor
        == "Qwen2VLImageProcessor"
    )
    assert calls == []
    pil = build_processor_config(
        str(tiny_qwen3_vl), family="qwen3_vl", image_processor="Qwen2VLImageProcessorPil"
    )
    assert pil.image_processor == "Qwen2VLImageProcessorPil" and len(calls) == 1
    proc = Preprocessor(pil, image_processor_dir=str(tiny_qwen3_vl)).image_processor()
    assert type(proc) is Qwen2VLImageProcessorPil
    assert len(calls) == 1  # the configuration's processor is the one the Preprocessor uses
    # a configuration recording a class this environment does not build is refused
    other = replace(cfg, image_processor="Qwen2VLImageProcessorFast")
    with pytest.raises(RuntimeError, match="configuration records"):
        Preprocessor(
            replace(other, image_processor="SomeOtherProcessorPil"), image_processor_dir=str(tiny_qwen3_vl)
        ).image_processor()


def test_preprocessor_pickles_without_its_image_processor(tiny_qwen3_vl, media_dir):
    import pickle

    cfg = build_processor_config(str(tiny_qwen3_vl), family="qwen3_vl")
    pre = Preprocessor(cfg, image_processor_dir=str(tiny_qwen3_vl))
    pixels, grid, _ = pre.image(str(media_dir / "good/rgb.jpg"))
    data = pickle.dumps(pre)
    assert b"transformers" not in data  # the processor is rebuilt (or taken from the cache), not sent
    clone = pickle.loads(data)
    assert (clone.cfg, clone.image_processor_dir, clone._image_processor) == (
        pre.cfg,
        pre.image_processor_dir,
        None,
    )
    again, grid_again, _ = clone.image(str(media_dir / "good/rgb.jpg"))
    assert grid_again == grid
    torch.testing.assert_close(again, pixels, rtol=0, atol=0)


def test_transparency_is_composited_on_white(tmp_path, cfg):
    """On white where the installed transformers composites it (5.21 and later); 5.18-5.20 drop it, and so
    does vlfast there (the clear black pixels stay black)."""
    from PIL import Image

    Image.new("RGBA", (256, 256), (0, 0, 0, 0)).save(tmp_path / "clear.png")
    pixels, _, _ = Preprocessor(cfg).image(str(tmp_path / "clear.png"))
    white = cfg.transparency == "white"
    assert torch.all(pixels == (1.0 if white else -1.0))  # normalised with mean = std = 0.5


def test_sixteen_bit_is_scaled_not_clipped(media_dir, cfg):
    pre = Preprocessor(cfg)
    p16, _, _ = pre.image(str(media_dir / "good/gray16.png"))
    p8, _, _ = pre.image(str(media_dir / "good/gray.png"))
    torch.testing.assert_close(p16, p8, rtol=0, atol=0)


def test_animated_gives_first_frame(media_dir):
    img = load_image(str(media_dir / "good/animated.gif"))
    assert img.size == (64, 64)


@pytest.mark.parametrize(
    ("name", "reason"),
    [
        ("zero.jpg", "empty file"),
        ("text.png", "not an image"),
        ("truncated.jpg", "truncated"),
        ("wide250.png", "aspect ratio"),
        ("missing.png", "file not found"),
    ],
)
def test_bad_images_raise_with_reason(media_dir, cfg, name, reason):
    with pytest.raises(SampleError, match=reason):
        Preprocessor(cfg).image(str(media_dir / "bad" / name))


# ---------------------------------------------------------------------------------------- video rules


def _qwen3_video_self(cfg):
    return SimpleNamespace(fps=cfg.fps, min_frames=cfg.min_frames, max_frames=cfg.max_frames)


@pytest.mark.parametrize("video_fps", [1.0, 2.5, 24.0, 29.97, 60.0])
@pytest.mark.parametrize("total", [1, 2, 3, 7, 48, 301, 5000])
def test_qwen3_frame_sampling_matches_transformers(cfg, total, video_fps):
    from transformers.models.qwen3_vl.video_processing_qwen3_vl import Qwen3VLVideoProcessor
    from transformers.video_utils import VideoMetadata

    meta = VideoMetadata(total_num_frames=total, fps=video_fps)
    expected = Qwen3VLVideoProcessor.sample_frames(_qwen3_video_self(cfg), meta)
    np.testing.assert_array_equal(sample_frame_indices(total, video_fps, cfg), expected)
    fixed = build_processor_config("ref:qwen3-vl-2b", family="qwen3_vl", num_frames=8)
    meta = VideoMetadata(total_num_frames=total, fps=video_fps)
    expected = Qwen3VLVideoProcessor.sample_frames(_qwen3_video_self(fixed), meta, num_frames=8)
    np.testing.assert_array_equal(sample_frame_indices(total, video_fps, fixed), expected)


def _from_source(path: str | Path, names: set[str], ns: dict) -> dict:
    """Compile just the named top-level functions and constants (``"Class.method"`` for a method) of a
    module that cannot be imported here (it imports torchvision at the top), from its installed source,
    so the check runs the library's own code. ``ns`` supplies what they use; returns it, filled."""
    import ast

    def candidates(tree: ast.Module):  # (the name it is asked for by, statement)
        for node in tree.body:
            if isinstance(node, ast.ClassDef):
                for fn in node.body:
                    if isinstance(fn, ast.FunctionDef):
                        yield f"{node.name}.{fn.name}", fn
            elif isinstance(node, ast.FunctionDef):
                yield node.name, node
            elif isinstance(node, ast.Assign):
                yield from ((getattr(t, "id", None), node) for t in node.targets)

    body = [
        node for name, node in candidates(ast.parse(Path(path).read_text(encoding="utf-8"))) if name in names
    ]
    for fn in body:
        if isinstance(fn, ast.FunctionDef):
            fn.decorator_list = []
    exec(compile(ast.Module(body=body, type_ignores=[]), str(path), "exec"), ns)  # noqa: S102
    return ns


@pytest.mark.parametrize("total", [4, 9, 48, 301, 2000])
def test_qwen2_frame_sampling_matches_transformers(total):
    import math

    from transformers.video_utils import VideoMetadata

    origin = importlib.util.find_spec("transformers.models.qwen2_vl.video_processing_qwen2_vl").origin
    ns = {"math": math, "np": np, "torch": torch, "VideoMetadata": object}
    sample_frames = _from_source(origin, {"Qwen2VLVideoProcessor.sample_frames"}, ns)["sample_frames"]
    cfg = build_processor_config("ref:qwen2.5-vl-7b", family="qwen2_5_vl")
    fake = SimpleNamespace(num_frames=None, fps=2, temporal_patch_size=2, min_frames=4, max_frames=768)
    expected = sample_frames(fake, VideoMetadata(total_num_frames=total, fps=24.0))
    np.testing.assert_array_equal(sample_frame_indices(total, 24.0, cfg), np.asarray(expected))


def _qwen_vl_utils_smart_nframes():
    """qwen-vl-utils' ``smart_nframes``, with the helpers and constants it uses, compiled from its
    installed source (its module imports torchvision at the top)."""
    import logging
    import math

    spec = importlib.util.find_spec("qwen_vl_utils")
    if spec is None:
        pytest.skip("qwen-vl-utils is not installed (it is in the test extras)")
    origin = Path(next(iter(spec.submodule_search_locations))) / "vision_process.py"
    names = {"round_by_factor", "ceil_by_factor", "floor_by_factor", "smart_nframes"}
    names |= {"FPS", "FRAME_FACTOR", "FPS_MIN_FRAMES", "FPS_MAX_FRAMES"}
    ns = {"math": math, "logger": logging.getLogger("qwen_vl_utils")}
    ns.update(Dict=dict, Any=object, Union=object)  # its annotations
    return _from_source(origin, names, ns)["smart_nframes"]


@pytest.mark.parametrize("video_fps", [1.0, 2.5, 24.0, 29.97, 60.0])
@pytest.mark.parametrize("total", [2, 3, 7, 48, 301, 5000])
def test_frame_sampling_against_qwen_vl_utils(cfg, total, video_fps):
    """qwen-vl-utils (``smart_nframes``, then ``torch.linspace(0, total - 1, n).round()`` in its readers)
    picks the very frames vlfast does (transformers' Qwen3-VL rule) whenever that rule gives an even count.
    Where it gives an odd count, qwen-vl-utils floors it to even, and transformers, hence vlfast, keeps it
    and pads with the last frame: the one documented difference. For Qwen2/2.5-VL both floor to even, so
    the counts agree, but transformers spaces the frames by ``arange(0, total, total / n)``."""
    smart_nframes = _qwen_vl_utils_smart_nframes()

    def theirs(n: int) -> np.ndarray:
        return torch.linspace(0, total - 1, n).round().long().numpy()

    ours = sample_frame_indices(total, video_fps, cfg)
    n_theirs = smart_nframes({"fps": cfg.fps}, total_frames=total, video_fps=video_fps)
    if len(ours) % 2 == 0:
        assert n_theirs == len(ours)
        np.testing.assert_array_equal(ours, theirs(n_theirs))
    else:
        assert n_theirs == len(ours) - 1
    for n in (4, 8, 16):
        if n <= total:
            fixed = build_processor_config("ref:qwen3-vl-2b", family="qwen3_vl", num_frames=n)
            assert smart_nframes({"nframes": n}, total_frames=total, video_fps=video_fps) == n
            np.testing.assert_array_equal(sample_frame_indices(total, video_fps, fixed), theirs(n))
    qwen2 = build_processor_config("ref:qwen2.5-vl-7b", family="qwen2_5_vl")
    assert len(sample_frame_indices(total, video_fps, qwen2)) == n_theirs


VIDEO_SIZES = [(2, 48, 64), (4, 240, 320), (16, 720, 1280), (768, 1080, 1920), (4, 20, 900)]


def _small(n: int, h: int, w: int) -> bool:
    """Small enough to encode as a clip and run through transformers' processor on its frames."""
    return n * h * w <= 4 * 240 * 320


@pytest.fixture(scope="module")
def saved_video_processors(cfg, tmp_path_factory):
    """{cap: a folder holding ``Qwen3VLVideoProcessor``'s saved config with cfg's budgets}: what a checkpoint
    holds, loaded with ``from_pretrained`` as transformers loads one."""
    from transformers.models.qwen3_vl.video_processing_qwen3_vl import Qwen3VLVideoProcessor

    folders = {}
    for cap in (False, True):
        folder = tmp_path_factory.mktemp(f"video_processor_cap_{cap}")
        size = {"shortest_edge": cfg.video_min_pixels, "longest_edge": cfg.video_max_pixels}
        Qwen3VLVideoProcessor(size=size, cap_pixels_per_frame=cap, max_video_tokens=768).save_pretrained(
            folder
        )
        folders[cap] = folder
    return folders


@pytest.fixture(scope="module")
def processed_clips(saved_video_processors, tmp_path_factory):
    """{(cap, n, h, w): video_grid_thw} from transformers' ``Qwen3VLVideoProcessor``, loaded from the saved
    config, called on the frames of a clip of n frames (all of them: ``num_frames=n``), for the small sizes;
    in a process of its own with the reference torchvision (tests/_transformers_reference.py); None where
    that torchvision is absent."""
    from _transformers_reference import reference_pixels, unavailable
    from vlfast.demo import make_video

    if unavailable():
        return None
    work = tmp_path_factory.mktemp("clips")
    cases, keys = [], {}
    for n, h, w in filter(lambda size: _small(*size), VIDEO_SIZES):
        clip = make_video(work / f"{n}x{h}x{w}.mp4", frames=n, fps=2, width=w, height=h, seed=n)
        for cap, folder in saved_video_processors.items():
            name = f"{cap}-{n}-{h}-{w}"
            keys[name] = (cap, n, h, w)
            cases.append(
                {
                    "name": name,
                    "kind": "video",
                    "path": str(clip),
                    "processor": "Qwen3VLVideoProcessor",
                    "checkpoint": str(folder),
                    "call": {"num_frames": n},
                }
            )
    got = reference_pixels(cases, work / "reference")
    return {keys[name]: grid for name, (_, grid) in got.items()}


@pytest.mark.parametrize("cap", [False, True])
@pytest.mark.parametrize(("n", "h", "w"), VIDEO_SIZES)
def test_video_sizes_match_transformers(cfg, saved_video_processors, processed_clips, cap, n, h, w):
    """vlfast's video size (and patch count) against transformers' ``Qwen3VLVideoProcessor`` loaded from a
    saved config (with and without the per-frame cap), through its public API: its
    ``get_num_of_video_patches`` for every size, and its call on a clip's frames for the small ones (where
    the reference torchvision is installed: README command 2)."""
    from dataclasses import replace

    from transformers.models.qwen3_vl.video_processing_qwen3_vl import Qwen3VLVideoProcessor

    c = replace(cfg, cap_pixels_per_frame=cap)
    processor = Qwen3VLVideoProcessor.from_pretrained(saved_video_processors[cap], local_files_only=True)
    assert processor.cap_pixels_per_frame is cap
    expected = processor.get_num_of_video_patches(n, h, w)
    rh, rw = video_resize_shape(n, h, w, c)
    assert (n + n % 2) // 2 * (rh // 16) * (rw // 16) == expected
    if _small(n, h, w):  # the whole path on the small ones
        pixels, (gt, gh, gw) = patchify_video(torch.zeros(n, 3, h, w, dtype=torch.uint8), c)
        assert gt * gh * gw == expected == pixels.shape[0]
        if processed_clips is not None:
            assert processed_clips[(cap, n, h, w)] == [gt, gh, gw]


@pytest.mark.parametrize("n", [1, 2, 3, 4])
def test_patchify_matches_transformers(cfg, n):
    from transformers.models.qwen3_vl.video_processing_qwen3_vl import Qwen3VLVideoProcessor

    gen = torch.Generator().manual_seed(n)
    frames = torch.randint(0, 256, (n, 3, 64, 96), dtype=torch.uint8, generator=gen)  # no resize needed
    small = type(cfg)(**{**cfg.__dict__, "video_min_pixels": 32 * 32})
    ours, grid = patchify_video(frames, small)
    # transformers: fused rescale+normalise as tvF.normalize(x, 255*mean, 255*std), then its patchify
    mean = torch.tensor([127.5] * 3).view(1, 3, 1, 1)
    video = ((frames.float() - mean) / mean)[None]
    if n == 1:  # transformers refuses one frame; vlfast repeats it like an image
        video = torch.cat([video, video], dim=1)
    expected, gt, gh, gw = Qwen3VLVideoProcessor.patchify(
        None, video, patch_size=16, merge_size=2, temporal_patch_size=2
    )
    assert grid == (gt, gh, gw)
    torch.testing.assert_close(ours, expected[0], rtol=0, atol=0)


def test_two_equal_frames_match_the_image_processor(tmp_path, cfg):
    """A still repeated is what the image processor makes of an image (same T=2 layout)."""
    from PIL import Image

    from vlfast.demo import pattern

    arr = pattern(256, 256, 7)  # 65,536 pixels, multiple of 32: neither path resizes
    Image.fromarray(arr).save(tmp_path / "still.png")
    img_pixels, img_grid, _ = Preprocessor(cfg).image(str(tmp_path / "still.png"))
    frames = torch.from_numpy(np.stack([arr, arr])).permute(0, 3, 1, 2).contiguous()
    vid_pixels, vid_grid = patchify_video(frames, cfg)
    assert img_grid == vid_grid
    torch.testing.assert_close(vid_pixels, img_pixels, rtol=0, atol=1e-6)


@pytest.mark.parametrize(
    ("frames", "height", "width", "budget"),
    [
        (8, 240, 320, None),  # resized to 256x320: the common case
        (3, 100, 150, None),  # odd count (padded with the last frame), upscaled to the minimum
        (4, 64, 96, None),  # no resize at all
        (16, 480, 640, 16 * 128 * 128),  # the total pixel budget over all frames shrinks each frame
    ],
)
def test_video_matches_transformers_video_processor(tiny_qwen3_vl, frames, height, width, budget):
    """End to end against ``Qwen3VLVideoProcessor`` itself, built from the checkpoint: same frames in,
    same pixel_values_videos and grid out, bit for bit. Needs torchvision (transformers' video processors
    do); verified with torch 2.14.1 + torchvision 0.29.1, skipped where it is absent
    (test_preprocess_parity.py runs the same classes with .reference/'s torchvision: docs/internals.md)."""
    pytest.importorskip("torchvision")
    from transformers import AutoVideoProcessor

    from vlfast.demo import pattern

    processor = AutoVideoProcessor.from_pretrained(str(tiny_qwen3_vl), local_files_only=True)
    cfg = build_processor_config(str(tiny_qwen3_vl), family="qwen3_vl", video_max_pixels=budget)
    video = np.stack([pattern(height, width, 20 + k) for k in range(frames)])  # (T, H, W, 3) uint8
    kwargs = {"size": {"shortest_edge": cfg.video_min_pixels, "longest_edge": cfg.video_max_pixels}}
    ref = processor(videos=[video], do_sample_frames=False, return_tensors="pt", **kwargs)
    ours, grid = patchify_video(torch.from_numpy(video).permute(0, 3, 1, 2), cfg)
    assert list(grid) == ref["video_grid_thw"][0].tolist()
    torch.testing.assert_close(ours, ref["pixel_values_videos"], rtol=0, atol=0)


def test_resize_is_torchvision_uint8_bicubic(cfg):
    """The resize step is F.interpolate on uint8 (torchvision's CPU kernel for uint8 bicubic)."""
    frames = torch.randint(
        0, 256, (2, 3, 100, 150), dtype=torch.uint8, generator=torch.Generator().manual_seed(0)
    )
    small = type(cfg)(**{**cfg.__dict__, "video_min_pixels": 32 * 32, "video_max_pixels": 2 * 64 * 96})
    ours, (gt, gh, gw) = patchify_video(frames, small)
    resized = torch.nn.functional.interpolate(frames, size=(gh * 16, gw * 16), mode="bicubic", antialias=True)
    again, _ = patchify_video(resized, small)
    torch.testing.assert_close(ours, again, rtol=0, atol=0)
    # decoded frames arrive channels-last; the layout must not change a single value
    channels_last, _ = patchify_video(frames.contiguous(memory_format=torch.channels_last), small)
    torch.testing.assert_close(channels_last, ours, rtol=0, atol=0)


# ---------------------------------------------------------------------------------------------- PyAV


def test_read_video_samples_by_fps(media_dir, cfg):
    frames, meta = read_video(str(media_dir / "good/clip.mp4"), cfg)
    assert meta["total_frames"] == 10 and meta["video_fps"] == 5.0
    assert meta["frame_indices"] == [0, 3, 6, 9]  # 2 s at 2 fps = 4 frames, min 4
    assert frames.shape == (4, 3, 64, 96) and frames.dtype == torch.uint8


def _encode(path: Path, codec: str, frames: int = 45, **options) -> Path:
    """A 64x48, 15 fps clip in any codec and container PyAV writes, or a skip where this build lacks it."""
    import av

    from vlfast.demo import make_video

    if codec not in av.codecs_available:
        pytest.skip(f"{codec} is not in this PyAV build")
    return make_video(path, frames=frames, fps=15, width=64, height=48, seed=7, codec=codec, options=options)


def _reference_frames(path: Path, indices: list[int]) -> np.ndarray:
    """The frames transformers' own PyAV reader returns for these indices (it decodes every frame)."""
    from transformers.video_utils import read_video_pyav

    frames, _ = read_video_pyav(str(path), sample_indices_fn=lambda metadata, **_: np.array(indices))
    return frames


@pytest.mark.parametrize(
    ("name", "codec", "options"),
    [
        ("x264.mp4", "libx264", {}),  # x264 defaults: B-frames with a reference pyramid
        ("x264_nopyramid.mkv", "libx264", {"x264-params": "b-pyramid=none:bframes=3"}),  # mkv: no count
        ("x264_ionly.mp4", "libx264", {"x264-params": "keyint=1"}),
        ("hevc.mp4", "libx265", {"x265-params": "log-level=none"}),
        ("mpeg4_b.avi", "mpeg4", {"bf": 2}),
        ("vp9.webm", "libvpx-vp9", {}),
    ],
)
def test_sparse_decode_matches_a_full_decode(tmp_path, cfg, name, codec, options):
    """Frames decoded while skipping unwanted non-reference frames equal transformers' full decode, bit for
    bit, whatever the codec, container, reordering or sampling (repeats included)."""
    import av

    from vlfast.pixels.video import _decode_at, _decode_sparse, _packet_pts

    path = _encode(tmp_path / name, codec, **options)
    with av.open(str(path)) as container:
        stream = container.streams.video[0]
        pts = _packet_pts(container, stream)
        full = _decode_at(container, stream, None)
        total = len(full)
        for indices in ([0, total - 1], [1, 5, 9, 13], [2, 2, 3, 40], list(range(0, total, 7)), [total - 2]):
            container.seek(0)
            got = _decode_sparse(container, stream, np.array(indices), pts)
            assert got is not None, "timestamps are usable: the sparse path must not fall back"
            assert len(got) == len(indices)
            for k, frame in zip(indices, got):
                assert np.array_equal(frame, full[k]), (name, indices, k)
    if "mkv" not in name:  # read_video_pyav samples by the container's frame count, which mkv lacks
        frames, meta = read_video(str(path), cfg)
        ref = _reference_frames(path, meta["frame_indices"])
        assert np.array_equal(frames.permute(0, 2, 3, 1).numpy(), ref)


def test_sparse_decode_needs_unique_timestamps(tmp_path):
    import av

    from vlfast.pixels.video import _decode_sparse

    path = _encode(tmp_path / "clip.mp4", "libx264", frames=10)
    with av.open(str(path)) as container:
        stream = container.streams.video[0]
        for pts in ([], [0, None, 1024], [0, 512, 512]):
            assert _decode_sparse(container, stream, np.array([0]), pts) is None


def test_video_edge_cases(media_dir, cfg):
    pre = Preprocessor(cfg)
    pixels, grid, meta = pre(Sample("one", "video", (str(media_dir / "good/one_frame.mp4"),)))
    assert grid[0] == 1 and meta["frame_indices"] == [0]
    pixels, grid, meta = pre(Sample("odd", "video", (str(media_dir / "good/odd.mp4"),)))
    assert meta["frame_indices"] == [0, 1, 2] and grid[0] == 2  # 3 frames padded with the last
    for name, reason in [
        ("corrupt.mp4", "corrupt|no video|no decodable|no frames"),
        ("empty.mp4", "empty file"),
    ]:
        with pytest.raises(SampleError, match=reason):
            pre(Sample(name, "video", (str(media_dir / "bad" / name),)))


def test_corrupt_video_reason(media_dir, cfg):
    with pytest.raises(SampleError, match="^unreadable or corrupt video: "):
        read_video(str(media_dir / "bad/corrupt.mp4"), cfg)  # junk after an ftyp box: not a cut file


@pytest.mark.parametrize(
    ("name", "codec"), [("clip.mp4", None), ("clip.mov", None), ("clip.mkv", None), ("clip.avi", "mpeg4")]
)
def test_truncated_video_reason(tmp_path, cfg, name, codec):
    """A video cut anywhere is either still decodable (what remains is extracted) or refused as
    "truncated or corrupt video", naming where the file ends inside its container; never another error
    (FFmpeg's own failures range from invalid data to end of file to a refused seek)."""
    from vlfast.demo import make_video

    whole = make_video(tmp_path / name, frames=30, fps=10, width=64, height=48, seed=9, codec=codec)
    data = whole.read_bytes()
    cut = tmp_path / f"cut{whole.suffix}"
    outcomes = {}
    for fraction in (0.05, 0.1, 0.25, 0.4, 0.5, 0.6, 0.75, 0.9, 0.95, 0.98):
        cut.write_bytes(data[: int(len(data) * fraction)])
        try:
            frames, meta = read_video(str(cut), cfg)
        except SampleError as e:
            assert str(e).startswith(f"truncated or corrupt video: {cut} ends at byte "), (fraction, str(e))
            outcomes[fraction] = "refused"
        else:
            assert frames.shape[0] == len(meta["frame_indices"]) >= 1
            outcomes[fraction] = "decoded"
        cut.unlink()
    if whole.suffix in (".mp4", ".mov"):  # the index comes last: a cut file lacks (part of) it
        assert {outcomes[f] for f in outcomes if f <= 0.9} == {"refused"}, outcomes
    assert outcomes[0.05] == "refused", outcomes
    frames, _ = read_video(str(whole), cfg)  # the whole file is fine
    from vlfast.pixels.truncation import container_truncation

    assert container_truncation(str(whole), len(data)) is None


def test_truncated_video_seek_failure_is_named(tmp_path, cfg):
    """The cuts FFmpeg opens with no packet in the stream, whose seek back to the start it then refuses
    with "[Errno 1] Operation not permitted": vlfast stops before the seek and says there are no frames.

    Which cut makes FFmpeg fail at which step shifts by a few bytes from one encode to the next (x264's
    output is not byte-stable across runs), so every cut through the index is tried: each refusal names
    the box it ends in, and the packet-less cut, wherever it falls, says so.
    """
    from vlfast.demo import make_video

    whole = make_video(tmp_path / "clip.mp4", frames=10, fps=5, width=96, height=64)
    data = whole.read_bytes()
    cut = tmp_path / "cut.mp4"
    seek_failures = []
    for size in range(int(len(data) * 0.8), len(data), 4):
        cut.write_bytes(data[:size])
        try:
            read_video(str(cut), cfg)
        except SampleError as e:
            message = str(e)
            assert message.startswith(f"truncated or corrupt video: {cut} ends at byte {size}"), message
            assert "inside its mp4 'moov' box" in message, message
            assert "Operation not permitted" not in message, message
            if "video has no frames" in message:
                seek_failures.append(size)
    assert seek_failures, "no cut left the stream without packets: the case is not exercised"


@pytest.mark.parametrize("suffix", [".avi", ".mp4"])
def test_video_without_frames_says_so(tmp_path, cfg, suffix):
    """A whole file whose video stream holds no frame: FFmpeg refuses the seek back to its start with
    "[Errno 1] Operation not permitted" (AVI); the reason must say the video has no frames."""
    import av

    path = tmp_path / f"zero{suffix}"
    with av.open(str(path), "w") as container:
        stream = container.add_stream("mpeg4", rate=10)
        stream.width, stream.height, stream.pix_fmt = 64, 48, "yuv420p"
        container.start_encoding()  # the header is written, then no frame
    with pytest.raises(SampleError) as e:
        read_video(str(path), cfg)
    assert "no frames" in str(e.value) or "no video stream" in str(e.value), str(e.value)
    assert "Operation not permitted" not in str(e.value) and "truncated" not in str(e.value)


@pytest.mark.parametrize("kind", ["image", "video"])
def test_symlinks_and_folders_raise_with_reason(tmp_path, cfg, kind):
    suffix = ".jpg" if kind == "image" else ".mp4"
    dangling, loop_a, loop_b = (tmp_path / f"{n}{suffix}" for n in ("dangling", "loop_a", "loop_b"))
    os.symlink(f"nowhere{suffix}", dangling)
    os.symlink(loop_b.name, loop_a)
    os.symlink(loop_a.name, loop_b)
    (tmp_path / f"folder{suffix}").mkdir()
    pre = Preprocessor(cfg)
    cases = {
        dangling: f"dangling symlink: {dangling} -> nowhere{suffix}",
        loop_a: f"symlink loop: {loop_a}",
        tmp_path / f"folder{suffix}": f"not a file: {tmp_path / f'folder{suffix}'}",
        tmp_path / f"missing{suffix}": f"file not found: {tmp_path / f'missing{suffix}'}",
    }
    for path, reason in cases.items():
        with pytest.raises(SampleError) as e:
            pre(Sample("x", kind, (str(path),)))
        assert str(e.value) == reason
        with pytest.raises(SampleError) as e:
            (load_image if kind == "image" else lambda p: read_video(p, cfg))(str(path))
        assert str(e.value) == reason
    looped_folder = tmp_path / "loop_dir"
    os.symlink(looped_folder.name, looped_folder)
    with pytest.raises(SampleError, match="^symlink loop: "):
        pre(Sample("x", kind, (str(looped_folder / f"inside{suffix}"),)))


def test_frame_list_clip(media_dir, cfg, tmp_path):
    from PIL import Image

    from vlfast.demo import pattern

    paths = []
    for k in range(3):
        p = tmp_path / f"f{k}.png"
        Image.fromarray(pattern(64, 64, k)).save(p)
        paths.append(str(p))
    pixels, grid, meta = Preprocessor(cfg)(Sample("clip", "frames", tuple(paths)))
    assert grid[0] == 2 and meta["frame_indices"] == [0, 1, 2]
    Image.fromarray(pattern(32, 64, 9)).save(tmp_path / "odd_size.png")
    with pytest.raises(SampleError, match="differ in size"):
        Preprocessor(cfg)(Sample("bad", "frames", (paths[0], str(tmp_path / "odd_size.png"))))


def test_video_placeholder_matches_qwen3_processor(cfg):
    from transformers.models.qwen3_vl.processing_qwen3_vl import Qwen3VLProcessor
    from transformers.video_utils import VideoMetadata

    from vlfast.extraction.model.features import PromptBuilder

    indices = [0, 3, 6, 9, 12]
    meta = VideoMetadata(total_num_frames=13, fps=5.0, frames_indices=np.array(indices))
    fake = SimpleNamespace(
        video_processor=SimpleNamespace(merge_size=2, temporal_patch_size=2),
        video_token="<|video_pad|>",
        vision_start_token="<|vision_start|>",
        vision_end_token="<|vision_end|>",
    )
    fake._calculate_timestamps = lambda *a: Qwen3VLProcessor._calculate_timestamps(fake, *a)
    inputs = {"video_grid_thw": torch.tensor([[3, 4, 6]]), "video_metadata": [meta]}
    expected = Qwen3VLProcessor.replace_video_token(fake, inputs, 0)
    ours = PromptBuilder("unused", "qwen3_vl", 2, 2).placeholder(
        "video", (3, 4, 6), {"frame_indices": indices, "video_fps": 5.0}
    )
    assert ours == expected
    assert json.dumps(ours).count("seconds") == 3
