"""vlfast.VisionPreprocessor: the image and video half of transformers' Qwen-VL processor, for data loaders.

Compared with the checkpoint's own AutoImageProcessor and AutoVideoProcessor (run with the real torchvision in
a process of their own: tests/_transformers_reference.py) on real JPEG, PNG and H.264 files, in one batch, and
used as a Dataset's preprocessing under a DataLoader with worker processes.
"""

from __future__ import annotations

import os

import pytest
import torch

import _transformers_reference as reference
from _transformers_support import qwen3_vl_processor
from vlfast import VisionPreprocessor
from vlfast.demo import make_video, pattern
from vlfast.errors import InputRefused
from vlfast.pixels.media import SampleError


@pytest.fixture(scope="module")
def media(tmp_path_factory):
    from PIL import Image

    d = tmp_path_factory.mktemp("loader-media")
    images = []
    for i, (w, h, suffix) in enumerate([(640, 480, "jpg"), (333, 517, "jpg"), (300, 200, "png")]):
        Image.fromarray(pattern(h, w, 40 + i)).save(d / f"im{i}.{suffix}")
        images.append(str(d / f"im{i}.{suffix}"))
    videos = [
        str(make_video(d / "a.mp4", frames=30, fps=10, width=320, height=240, seed=5)),
        str(make_video(d / "b.mp4", frames=24, fps=12, width=256, height=144, seed=6)),
    ]
    return images, videos


def test_a_batch_equals_the_checkpoints_own_processors(tiny_qwen3_vl, media, tmp_path):
    why = reference.unavailable()
    if why is not None:
        if os.environ.get("CI"):
            pytest.fail(f"the parity reference must run in CI: {why}")
        pytest.skip(why)
    images, videos = media
    ours = VisionPreprocessor(str(tiny_qwen3_vl), num_frames=8)(images=images, videos=videos)
    case = {
        "name": "batch",
        "kind": "batch",
        "checkpoint": str(tiny_qwen3_vl),
        "images": images,
        "videos": videos,
        "call": {"num_frames": 8},
    }
    expected = reference.reference_pixels([case], tmp_path)
    pixels, grids = expected["batch:pixel_values"]
    assert ours["image_grid_thw"].tolist() == grids and ours["image_grid_thw"].dtype == torch.long
    assert ours["pixel_values"].dtype == torch.float32 and torch.equal(ours["pixel_values"], pixels)
    pixels, grids = expected["batch:pixel_values_videos"]
    assert ours["video_grid_thw"].tolist() == grids
    assert torch.equal(ours["pixel_values_videos"], pixels)


def _collate(items):
    return {
        key: torch.cat([it[key] for it in items])
        for key in ("pixel_values", "image_grid_thw", "pixel_values_videos", "video_grid_thw")
    }


class _Examples(torch.utils.data.Dataset):
    def __init__(self, images, videos, pre):
        self.images, self.videos, self.pre = images, videos, pre

    def __len__(self):
        return len(self.images)

    def __getitem__(self, i):
        return self.pre(images=[self.images[i]], videos=[self.videos[i % len(self.videos)]])


@pytest.mark.parametrize("context", ["fork", "spawn"])
def test_it_runs_in_dataloader_workers(tiny_qwen3_vl, media, context):
    """Pickled to spawned workers (small: no processor object, no open file) or inherited by forked ones, it
    gives what it gives in the main process."""
    import pickle

    images, videos = media
    pre = VisionPreprocessor(str(tiny_qwen3_vl), num_frames=4)
    assert len(pickle.dumps(pre)) < 4096
    direct = _collate([pre(images=[p], videos=[videos[i % 2]]) for i, p in enumerate(images)])
    loader = torch.utils.data.DataLoader(
        _Examples(images, videos, pre),
        batch_size=3,
        num_workers=2,
        collate_fn=_collate,
        multiprocessing_context=context,
    )
    (batch,) = list(loader)
    for key, value in direct.items():
        assert torch.equal(batch[key], value), key


def test_pil_images_and_the_pil_backend(tiny_qwen3_vl, media):
    """A PIL image is taken as it is (as transformers' processor takes it); the PIL backend runs transformers'
    PIL processor (other pixels, slightly)."""
    from PIL import Image

    images, _ = media
    pre = VisionPreprocessor(str(tiny_qwen3_vl))
    by_path = pre(images=images)
    by_pil = pre(images=[Image.open(p) for p in images])
    assert torch.equal(by_path["pixel_values"], by_pil["pixel_values"])
    assert set(by_path) == {"pixel_values", "image_grid_thw"}
    pil = VisionPreprocessor(str(tiny_qwen3_vl), image_backend="pil")(images=images)
    assert torch.equal(pil["image_grid_thw"], by_path["image_grid_thw"])
    diff = (pil["pixel_values"] - by_path["pixel_values"]).abs().max().item()
    assert 0 < diff < 0.05


def test_bad_input_is_named(tiny_qwen3_vl, tmp_path):
    bad = tmp_path / "bad.jpg"
    bad.write_bytes(b"\xff\xd8\xff\xe0 not a jpeg")
    pre = VisionPreprocessor("ref:qwen3-vl-2b")
    with pytest.raises(SampleError, match=f"^{bad}: unreadable or truncated image"):
        pre(images=[str(bad)])
    with pytest.raises(SampleError, match=f"^{bad}: "):
        pre(videos=[str(bad)])
    with pytest.raises(InputRefused, match="torchvision or pil"):
        VisionPreprocessor("ref:qwen3-vl-2b", image_backend="fast")


def test_uint8_pixels_finished_where_they_land(tiny_qwen3_vl, media):
    """pixels='uint8': a quarter of the bytes through the collator and the copy for videos, an eighth for images
    (each patch once: finish() makes the temporal repeat); finish() gives the float32 outputs bit for bit."""
    images, videos = media
    floats = VisionPreprocessor(str(tiny_qwen3_vl), num_frames=4)(images=images, videos=videos)
    pre = VisionPreprocessor(str(tiny_qwen3_vl), num_frames=4, pixels="uint8")
    raw = pre(images=images, videos=videos)
    assert raw["pixel_values"].dtype == raw["pixel_values_videos"].dtype == torch.uint8
    assert raw["pixel_values"].numel() * 2 == floats["pixel_values"].numel()  # temporal patch 2
    assert raw["pixel_values_videos"].numel() == floats["pixel_values_videos"].numel()
    done = pre.finish(raw, "cpu")
    assert set(done) == set(floats)
    for key, value in floats.items():
        assert done[key].dtype == value.dtype and torch.equal(done[key], value), key
    for dtype in (torch.bfloat16, torch.float16):  # written in the model's dtype: .to(dtype)'s rounding
        done = pre.finish(raw, "cpu", dtype=dtype)
        for key in ("pixel_values", "pixel_values_videos"):
            assert done[key].dtype == dtype and torch.equal(done[key], floats[key].to(dtype)), key
        again = pre.finish(floats, "cpu", dtype=dtype)  # float32 pixels given: cast
        assert torch.equal(again["pixel_values"], floats["pixel_values"].to(dtype))
    with pytest.raises(InputRefused, match="needs image_backend='torchvision'"):
        VisionPreprocessor(str(tiny_qwen3_vl), pixels="uint8", image_backend="pil")


@pytest.mark.parametrize("steps", [(True, True), (True, False), (False, True), (False, False)])
@pytest.mark.parametrize("repeat", [1, 2])
def test_the_blocked_normalisation_equals_the_plain_one(monkeypatch, steps, repeat):
    """rescale_normalize normalises up to 8 MB of rows at a time on the CPU into a block of its own, then
    copies it into the output's temporal slots, in memory asked for huge pages: every block boundary (one
    row, a part block, a block and one), a channel-transposed (strided) input as the image path hands it, and
    a failing or absent madvise give the bits of the plain whole-tensor computation, transformers' order (the
    float image, rescale and normalise, then the temporal repeat)."""
    import vlfast.pixels.video as video

    do_rescale, do_normalize = steps
    mean, std, factor = (0.48145466, 0.4578275, 0.40821073), (0.26862954, 0.26130258, 0.27577711), 1 / 255
    monkeypatch.setattr(video, "_CPU_BLOCK_BYTES", 3 * 64 * 4 * 5)  # five rows a block
    for n, strided in ((1, False), (4, False), (5, True), (6, False), (11, True), (400, False), (400, True)):
        x = torch.randint(0, 256, (n, 3, 64), dtype=torch.uint8, generator=torch.Generator().manual_seed(n))
        if strided:  # the channels last in memory: (n, 64, 3) viewed as (n, 3, 64)
            x = x.transpose(1, 2).contiguous().transpose(1, 2)
        want = x.to(torch.float32)
        if do_normalize:
            m, s = video.fused_mean_std(mean, std, factor, do_rescale, (1, 3, 1))
            want = (want - m) / s
        elif do_rescale:
            want = want * factor
        want = want[:, :, None].expand(-1, -1, repeat, -1).reshape(n, -1)
        for madvise in (video._madvise, None, lambda *a: -1):
            monkeypatch.setattr(video, "_madvise", madvise)
            got = video.rescale_normalize(x, mean, std, factor, do_rescale, do_normalize, repeat=repeat)
            assert got.dtype == torch.float32 and got.shape == want.shape
            assert torch.equal(got, want), (n, strided, madvise)


def test_a_large_output_asks_for_huge_pages(monkeypatch):
    """An output of 4 MB or more is madvised (on Linux), 2 MB-aligned inside its own memory (and so is a
    normalised block of 4 MB or more before it is copied into the output); its values are those of the
    plain computation."""
    import vlfast.pixels.video as video

    if video._madvise is None:
        pytest.skip("no madvise on this platform")
    calls = []
    monkeypatch.setattr(
        video, "_madvise", lambda start, size, advice: calls.append((start, size, advice)) or 0
    )
    x = torch.randint(0, 256, (1400, 3, 256), dtype=torch.uint8)
    got = video.rescale_normalize(x, (0.5,) * 3, (0.5,) * 3, 1 / 255, True, True, repeat=2)
    assert torch.equal(got[:, :256], (x[:, 0].float() - 127.5) / 127.5)
    assert len(calls) == 2  # the 8.6 MB output, then the 4.3 MB block
    assert all(
        advice == 14 and start % (2 << 20) == 0 and size % (2 << 20) == 0 for start, size, advice in calls
    )
    inside = [
        got.data_ptr() <= start and start + size <= got.data_ptr() + got.numel() * 4
        for start, size, _ in calls
    ]
    assert inside.count(True) == 1
    calls.clear()
    video.rescale_normalize(x[:10], (0.5,) * 3, (0.5,) * 3, 1 / 255, True, True, repeat=2)
    assert calls == []  # small outputs are left as they are


def test_deferred_patches_of_another_width_are_refused(tiny_qwen3_vl):
    """The model side takes the temporal repeat from the uint8 patches' width: P*P (an image, each patch once)
    or T*P*P (the frames there); any other width is a bug upstream, said, not normalised into wrong rows."""
    from vlfast.pixels.video import normalize_patches, temporal_repeat

    cfg = VisionPreprocessor(str(tiny_qwen3_vl)).config
    p2, tp = cfg.patch_size**2, cfg.temporal_patch_size
    assert temporal_repeat(torch.zeros(4, 3, p2, dtype=torch.uint8), cfg) == tp
    assert temporal_repeat(torch.zeros(4, 3, tp * p2, dtype=torch.uint8), cfg) == 1
    with pytest.raises(ValueError, match=f"expected {tp * p2} or {p2}"):
        normalize_patches(torch.zeros(4, 3, p2 + 1, dtype=torch.uint8), cfg)


def test_the_processor_s_image_processor_swapped(tiny_qwen3_vl, media):
    """processor.image_processor = pre.as_image_processor(processor.image_processor): a processor call (what
    TRL's collators and a Dataset under HF Trainer make) then returns VisionPreprocessor's pixel_values, equal
    to transformers' torchvision processor (test_a_batch_equals_the_checkpoints_own_processors), with the
    placeholder count and input_ids the unswapped processor gives; paths, PIL images, uint8 arrays and
    tensors alike; a pixel setting passed to the call is refused, not ignored; it pickles for workers."""
    import pickle

    import numpy as np
    from PIL import Image

    images, _ = media
    proc = qwen3_vl_processor(str(tiny_qwen3_vl))
    stock = type(proc.image_processor)
    text = ["<|vision_start|><|image_pad|><|vision_end|>a", "<|vision_start|><|image_pad|><|vision_end|>b"]
    pils = [Image.open(images[0]).convert("RGB"), Image.open(images[1]).convert("RGB")]
    want = proc(text=text, images=pils, return_tensors="pt", padding=True)
    pre = VisionPreprocessor(str(tiny_qwen3_vl))
    proc.image_processor = pre.as_image_processor(proc.image_processor)
    assert isinstance(proc.image_processor, stock) and type(proc.image_processor) is not stock
    got = proc(text=text, images=pils, return_tensors="pt", padding=True)
    assert torch.equal(got["input_ids"], want["input_ids"])
    assert torch.equal(got["image_grid_thw"], want["image_grid_thw"])
    ours = pre(images=pils)
    assert torch.equal(got["pixel_values"], ours["pixel_values"])
    assert not torch.equal(got["pixel_values"], want["pixel_values"])  # the PIL processor's pixels differ
    swapped = proc.image_processor
    for same in (
        np.asarray(pils[0]),
        torch.from_numpy(np.asarray(pils[0])).permute(2, 0, 1),
        pils[0],
    ):
        one = swapped(same, return_tensors="pt")["pixel_values"]
        assert torch.equal(one, pre(images=[pils[0]])["pixel_values"])
    with pytest.raises(InputRefused, match="max_pixels=1000 in a call"):
        proc(text=text, images=pils, return_tensors="pt", max_pixels=1000)
    with pytest.raises(InputRefused, match="an array of shape"):
        swapped(np.zeros((4, 4, 3), dtype=np.float32))
    again = pickle.loads(pickle.dumps(swapped))
    assert type(again).__name__ == type(swapped).__name__
    assert torch.equal(again(pils, return_tensors="pt")["pixel_values"], ours["pixel_values"])
    with pytest.raises(InputRefused, match="pass the image processor"):
        VisionPreprocessor("ref:qwen3-vl-2b").as_image_processor()


def test_several_images_are_normalised_into_one_tensor_without_a_concatenation(monkeypatch, media):
    """A call with several images (a collator's list) writes each image's float32 rows straight into one
    tensor: the same bits as each image alone, concatenated; torch.cat never runs. Also where images and
    videos normalise differently (the deferred patches then come back float32 from the worker path)."""
    import dataclasses

    from PIL import Image

    images, _ = media
    inputs = [*images, Image.open(images[1]).convert("RGB")]  # paths (JPEG, PNG) and a decoded image
    for differ in (False, True):
        pre = VisionPreprocessor("ref:qwen3-vl-2b")
        if differ:
            pre._pre = dataclasses.replace(
                pre._pre, cfg=dataclasses.replace(pre._pre.cfg, video_std=(0.3,) * 3)
            )
        alone = [pre(images=[x]) for x in inputs]
        want = torch.cat([a["pixel_values"] for a in alone])
        with monkeypatch.context() as mp:
            mp.setattr(torch, "cat", lambda *a, **k: pytest.fail("torch.cat ran"))
            got = pre(images=inputs)
        assert got["pixel_values"].dtype == torch.float32 and torch.equal(got["pixel_values"], want), differ
        assert got["image_grid_thw"].tolist() == [a["image_grid_thw"][0].tolist() for a in alone]


@pytest.fixture(scope="module")
def odd_images(tmp_path_factory) -> dict[str, str]:
    """Images whose conversion to RGB is the processor's to make: transparency (an alpha band, a palette's, a
    colour key's), 16-bit, CMYK, bilevel, and a transparent PNG turned by its EXIF orientation."""
    import numpy as np
    from PIL import Image

    d = tmp_path_factory.mktemp("odd-modes")
    rgb = pattern(96, 128, 11)
    alpha = (np.arange(128)[None, :].repeat(96, 0) * 2).astype(np.uint8)
    gray = Image.fromarray(rgb).convert("L")
    exif = Image.Exif()
    exif[0x0112] = 6
    made = {
        "rgba.png": (Image.fromarray(np.dstack([rgb, alpha]), "RGBA"), {}),
        "la.png": (Image.fromarray(np.dstack([rgb, alpha]), "RGBA").convert("LA"), {}),
        "palette_transparent.png": (Image.fromarray(rgb).convert("P"), {"transparency": 0}),
        "rgb_colour_key.png": (Image.fromarray(rgb), {"transparency": tuple(int(v) for v in rgb[0, 0])}),
        "gray_colour_key.png": (gray, {"transparency": int(gray.getpixel((0, 0)))}),
        "sixteen_bit.png": (Image.fromarray(rgb[..., 1].astype(np.uint16) * 200), {}),
        "cmyk.jpg": (Image.fromarray(rgb).convert("CMYK"), {"quality": 90}),
        "bilevel.png": (Image.fromarray(rgb).convert("1"), {}),
        "rgba_rotated.png": (Image.fromarray(np.dstack([rgb, alpha]), "RGBA"), {"exif": exif}),
    }
    out = {}
    for name, (img, kw) in made.items():
        img.save(d / name, **kw)
        out[name] = str(d / name)
    return out


def test_every_mode_gives_transformers_pixels_by_path_and_as_pil(tiny_qwen3_vl, odd_images, tmp_path):
    """A path is read as transformers' torchvision processor reads one (its fetch_images: decoded to RGB, EXIF
    turns applied, an alpha band, a palette's or colour key's transparency dropped); a PIL image is converted
    as its processor converts it (transparency on white with transformers >= 5.21; 16-bit clipped by PIL,
    where vlfast extract scales it): both equal the checkpoint's own processor for the same input, and so
    does the swapped image processor, which no longer refuses a 16-bit image. A 16-bit file by path, which
    transformers decodes otherwise by what is installed, is refused, naming it."""
    from PIL import Image, ImageOps

    why = reference.unavailable()
    if why is not None:
        if os.environ.get("CI"):
            pytest.fail(f"the parity reference must run in CI: {why}")
        pytest.skip(why)
    cases = [
        {
            "name": f"{name}:{how}",
            "kind": "image",
            "path": path,
            "processor": "AutoImageProcessor",
            "checkpoint": str(tiny_qwen3_vl),
            "as_pil": how == "pil",
            "as_tensor": how == "path",
        }
        for name, path in odd_images.items()
        for how in ("path", "pil")
        if (name, how) != ("sixteen_bit.png", "path")
    ]
    expected = reference.reference_pixels(cases, tmp_path)
    pre = VisionPreprocessor(str(tiny_qwen3_vl))
    swapped = pre.as_image_processor()
    for case in cases:
        want, grid = expected[case["name"]]
        if case["as_pil"]:
            image = ImageOps.exif_transpose(Image.open(case["path"]))
            through_swap = swapped(images=[image], return_tensors="pt")
            assert torch.equal(through_swap["pixel_values"], want), case["name"]
        else:
            image = case["path"]
        got = pre(images=[image])
        assert got["image_grid_thw"][0].tolist() == grid, case["name"]
        assert torch.equal(got["pixel_values"], want), case["name"]
    with pytest.raises(
        SampleError, match=r"sixteen_bit.png: an image of mode I;16 \(16-bit or float\) given by path"
    ):
        pre(images=[odd_images["sixteen_bit.png"]])


def test_arrays_tensors_and_nesting_as_transformers_takes_them_and_clear_refusals(media):
    """Images as transformers' processor takes them: uint8 arrays (H, W, C), (C, H, W) and (H, W), tensors,
    one image not in a list, nested lists flattened; each gives what the PIL image gives. Anything else is
    refused with InputRefused naming its kind (a float array, None, bytes; a video as decoded frames or an
    empty list), where it used to fail deep inside with a TypeError."""
    import numpy as np
    from PIL import Image

    images, _ = media
    pre = VisionPreprocessor("ref:qwen3-vl-2b")
    rgb = Image.open(images[0]).convert("RGB")
    gray = rgb.convert("L")
    want, want_gray = pre(images=[rgb])["pixel_values"], pre(images=[gray])["pixel_values"]
    arr = np.asarray(rgb)
    for given, expected in (
        ([arr], want),
        ([arr.transpose(2, 0, 1)], want),
        ([torch.from_numpy(arr).permute(2, 0, 1)], want),
        (rgb, want),
        ([[rgb], [rgb]], torch.cat([want, want])),
        ([np.asarray(gray)], want_gray),
    ):
        assert torch.equal(pre(images=given)["pixel_values"], expected)
    for given, needle in (
        ([arr.astype(np.float32) / 255], "an array of shape \\(480, 640, 3\\) and dtype float32"),
        ([None], "an input of type NoneType"),
        ([b"\\xff\\xd8"], "an input of type bytes"),
    ):
        with pytest.raises(InputRefused, match=f"^VisionPreprocessor: {needle}"):
            pre(images=given)
    for video, needle in (
        (torch.zeros(4, 3, 32, 32, dtype=torch.uint8), "a Tensor"),
        ([rgb, rgb], "a list of Image"),
        ([], "an empty list"),
    ):
        with pytest.raises(InputRefused, match=f"^VisionPreprocessor: a video given as {needle}: pass"):
            pre(videos=[video])


def test_a_swapped_processor_answers_a_calls_size_only_when_it_is_its_own():
    """``size=`` in a call is answered only as the exact dict of this preprocessor's two edges; any other
    spelling (pairs that ``dict()`` would accept, an extra key, another budget) is refused with both values,
    never answered under settings it did not ask for (a cut once let pairs through)."""
    import numpy as np
    from PIL import Image
    from transformers import Qwen2VLImageProcessor

    pre = VisionPreprocessor("ref:qwen2-vl-7b")
    ip = pre.as_image_processor(Qwen2VLImageProcessor())
    lo, hi = pre.config.image_min_pixels, pre.config.image_max_pixels
    image = Image.fromarray(np.full((56, 56, 3), 128, np.uint8))
    own = ip(image, return_tensors="pt", size={"shortest_edge": lo, "longest_edge": hi})
    assert tuple(own["pixel_values"].shape) == (16, 1176)
    for size in (
        [("shortest_edge", lo), ("longest_edge", hi)],
        (("longest_edge", hi), ("shortest_edge", lo)),
        {"shortest_edge": lo, "longest_edge": hi, "height": 56},
        {"shortest_edge": lo, "longest_edge": hi + 1},
        {"longest_edge": hi},
    ):
        with pytest.raises(InputRefused, match="in a call, where this VisionPreprocessor has") as e:
            ip(image, return_tensors="pt", size=size)
        assert f"shortest_edge={lo}, longest_edge={hi}" in str(e.value)
