"""Checkpoints in both processor layouts: the published one and the one transformers 5 saves.

The published Hugging Face repositories keep the image processor in preprocessor_config.json and the video
processor in video_preprocessor_config.json. ``ProcessorMixin.save_pretrained`` in transformers 5 (so every
fine-tune saved with it) writes one processor_config.json with "image_processor" and "video_processor"
entries and no preprocessor_config.json. Both checkpoints here are written by transformers' own
``save_pretrained`` (``make_tiny_qwen3_vl(layout=...)``), with the same weights and numbers: vlfast must read
the same configuration from both and produce the same pixels and features.
"""

from __future__ import annotations

import importlib.util
import json
import shutil
from pathlib import Path

import pytest
import torch

from vlfast.extraction.sources import Sample
from vlfast.pixels.engine import Preprocessor, _processor_dicts, build_processor_config

pytest.importorskip("transformers")

IMAGES = ("rgb.jpg", "rgba.png", "palette.png", "gray.png", "cmyk.jpg", "tiny.png", "wide150.png")


@pytest.fixture(scope="module")
def saved_processor(tmp_path_factory) -> Path:
    """The tiny checkpoint as transformers 5 saves it: ``Qwen3VLProcessor.save_pretrained``."""
    from vlfast.demo import make_tiny_qwen3_vl

    return make_tiny_qwen3_vl(tmp_path_factory.mktemp("tiny-qwen3-vl-processor"), layout="processor")


def _without_source(cfg) -> dict:
    d = cfg.to_dict()
    d.pop("source")
    return d


def test_the_layouts_are_what_transformers_writes(tiny_qwen3_vl, saved_processor):
    hub = {p.name for p in tiny_qwen3_vl.iterdir()}
    assert {"preprocessor_config.json", "video_preprocessor_config.json"} <= hub
    assert "processor_config.json" not in hub
    saved = {p.name for p in saved_processor.iterdir()}
    assert "processor_config.json" in saved
    assert not saved & {"preprocessor_config.json", "video_preprocessor_config.json"}
    assert {"config.json", "model.safetensors", "tokenizer.json", "chat_template.jinja"} <= saved
    nested = json.loads((saved_processor / "processor_config.json").read_text())
    assert nested["processor_class"] == "Qwen3VLProcessor"
    assert nested["image_processor"]["image_processor_type"] == "Qwen2VLImageProcessor"
    assert nested["video_processor"]["video_processor_type"] == "Qwen3VLVideoProcessor"
    assert nested["video_processor"]["size"] == {"shortest_edge": 4096, "longest_edge": 25_165_824}
    # transformers' own readers find both processors in it
    from transformers import AutoImageProcessor
    from transformers.models.auto.video_processing_auto import get_video_processor_config

    assert AutoImageProcessor.from_pretrained(saved_processor, local_files_only=True).patch_size == 16
    assert get_video_processor_config(saved_processor, local_files_only=True)["fps"] == 2
    # saving it did not leave transformers' export of VideoProcessorMixin changed
    from transformers import processing_utils

    has_torchvision = importlib.util.find_spec("torchvision") is not None
    assert hasattr(processing_utils.transformers_module, "VideoProcessorMixin") == has_torchvision


def test_both_layouts_give_the_same_configuration(tiny_qwen3_vl, saved_processor):
    hub = build_processor_config(str(tiny_qwen3_vl), family="qwen3_vl")
    saved = build_processor_config(str(saved_processor), family="qwen3_vl")
    assert _without_source(hub) == _without_source(saved)
    assert hub.video_max_pixels == 25_165_824 and hub.image_min_pixels == 65_536 and hub.fps == 2.0
    assert hub.source == (
        f"{tiny_qwen3_vl / 'preprocessor_config.json'} and {tiny_qwen3_vl / 'video_preprocessor_config.json'}"
    )
    assert (
        saved.source == f"{saved_processor / 'processor_config.json'} (image_processor and video_processor)"
    )
    for fps, num_frames, budget in [(1.0, None, None), (None, 8, 16 * 128 * 128)]:
        a = build_processor_config(
            str(tiny_qwen3_vl), family="qwen3_vl", fps=fps, num_frames=num_frames, video_max_pixels=budget
        )
        b = build_processor_config(
            str(saved_processor), family="qwen3_vl", fps=fps, num_frames=num_frames, video_max_pixels=budget
        )
        assert _without_source(a) == _without_source(b)


@pytest.mark.parametrize("layout", ["hub", "processor"])
def test_the_dicts_are_transformers_own(tiny_qwen3_vl, saved_processor, layout):
    """What vlfast reads is what transformers' loaders return, and the fallback for a transformers without
    them reads the same."""
    from transformers.image_processing_base import ImageProcessingMixin
    from transformers.models.auto.video_processing_auto import get_video_processor_config

    path = tiny_qwen3_vl if layout == "hub" else saved_processor
    image, _, video, _ = _processor_dicts(path)
    assert image == ImageProcessingMixin.get_image_processor_dict(str(path), local_files_only=True)[0]
    assert video == get_video_processor_config(str(path), local_files_only=True)
    assert _processor_dicts(path, use_transformers=False) == _processor_dicts(path)


def test_mixed_and_missing_processor_files(tiny_qwen3_vl, saved_processor, tmp_path):
    """Per processor, transformers' order: processor_config.json's entry, then the processor's own file."""
    nested = json.loads((saved_processor / "processor_config.json").read_text())
    reference = _without_source(build_processor_config(str(tiny_qwen3_vl), family="qwen3_vl"))

    def checkpoint(name: str, files: dict[str, object]) -> Path:
        d = tmp_path / name
        shutil.copytree(tiny_qwen3_vl, d)
        for f in ("preprocessor_config.json", "video_preprocessor_config.json"):
            (d / f).unlink()
        for f, content in files.items():
            if isinstance(content, Path):
                shutil.copy(content, d / f)
            else:
                (d / f).write_text(json.dumps(content))
        return d

    # an image entry in processor_config.json, the video processor in its own file
    d = checkpoint(
        "image-nested",
        {
            "processor_config.json": {
                "processor_class": "Qwen3VLProcessor",
                "image_processor": nested["image_processor"],
            },
            "video_preprocessor_config.json": tiny_qwen3_vl / "video_preprocessor_config.json",
        },
    )
    cfg = build_processor_config(str(d), family="qwen3_vl")
    assert (
        cfg.source
        == f"{d / 'processor_config.json'} (image_processor) and {d / 'video_preprocessor_config.json'}"
    )
    assert _without_source(cfg) == reference
    # an older processor_config.json without entries: the separate files count
    d = checkpoint(
        "legacy",
        {
            "processor_config.json": {"processor_class": "Qwen3VLProcessor"},
            "preprocessor_config.json": tiny_qwen3_vl / "preprocessor_config.json",
        },
    )
    cfg = build_processor_config(str(d), family="qwen3_vl")
    # no video processor file: transformers' AutoVideoProcessor reads preprocessor_config.json for videos too,
    # and so does vlfast (its budget, over all frames for Qwen3-VL)
    image_file = d / "preprocessor_config.json"
    assert cfg.source == f"{image_file} and {image_file} (as transformers reads it for videos)"
    assert (cfg.video_min_pixels, cfg.video_max_pixels) == (cfg.image_min_pixels, cfg.image_max_pixels)
    # neither: refused, naming both layouts
    d = checkpoint("none", {})
    with pytest.raises(FileNotFoundError, match="no preprocessor_config.json, nor a processor_config.json"):
        build_processor_config(str(d), family="qwen3_vl")
    (d / "processor_config.json").write_text("{not json")
    with pytest.raises(ValueError, match="not valid JSON"):
        build_processor_config(str(d), family="qwen3_vl")


def test_both_layouts_give_the_same_pixels(tiny_qwen3_vl, saved_processor, media_dir):
    pres = [
        Preprocessor(build_processor_config(str(p), family="qwen3_vl"), image_processor_dir=str(p))
        for p in (tiny_qwen3_vl, saved_processor)
    ]
    assert pres[0].cfg.image_processor == pres[1].cfg.image_processor == "Qwen2VLImageProcessor"
    for name in IMAGES:
        path = str(media_dir / "good" / name)
        (a, grid_a, _), (b, grid_b, _) = (pre.image(path) for pre in pres)
        assert grid_a == grid_b, name
        torch.testing.assert_close(a, b, rtol=0, atol=0, msg=name)
    clip = Sample("clip", "video", (str(media_dir / "good/clip.mp4"),))
    (a, grid_a, meta_a), (b, grid_b, meta_b) = (pre(clip) for pre in pres)
    assert (grid_a, meta_a) == (grid_b, meta_b)
    torch.testing.assert_close(a, b, rtol=0, atol=0)


def test_extract_reads_a_checkpoint_saved_by_transformers(
    tiny_qwen3_vl, saved_processor, media_dir, tmp_path
):
    """``vlfast extract --model DIR`` on the transformers 5 layout: the features of the published layout."""
    from vlfast.extraction import FeatureCache
    from vlfast.extraction.api import extract

    good = media_dir / "good"
    samples = [Sample(n, "image", (str(good / n),)) for n in ("rgb.jpg", "tiny.png")]
    samples.append(Sample("clip", "video", (str(good / "clip.mp4"),)))
    caches = []
    for name, model in (("hub", tiny_qwen3_vl), ("saved", saved_processor)):
        out = tmp_path / name
        summary = extract(samples, out, model=str(model), num_workers=0, device="cpu")
        assert summary.extracted == 3 and summary.failed == 0
        caches.append(FeatureCache(out))
    for s in samples:
        a, b = caches[0][s.id], caches[1][s.id]
        assert a.keys() == b.keys() and any(isinstance(v, torch.Tensor) for v in a.values())
        for k in a:
            if isinstance(a[k], torch.Tensor):
                torch.testing.assert_close(a[k], b[k], rtol=0, atol=0, msg=f"{s.id} {k}")


def test_video_path_matches_transformers_on_the_saved_layout(saved_processor):
    """transformers' ``Qwen3VLVideoProcessor`` as loaded from processor_config.json, against vlfast's video
    path: the same pixels. Needs torchvision (transformers' video processors do); skipped without it."""
    pytest.importorskip("torchvision")
    import numpy as np
    from transformers import AutoVideoProcessor

    from vlfast.demo import pattern
    from vlfast.pixels.video import patchify_video

    processor = AutoVideoProcessor.from_pretrained(str(saved_processor), local_files_only=True)
    cfg = build_processor_config(str(saved_processor), family="qwen3_vl")
    video = np.stack([pattern(240, 320, 20 + k) for k in range(8)])
    kwargs = {"size": {"shortest_edge": cfg.video_min_pixels, "longest_edge": cfg.video_max_pixels}}
    ref = processor(videos=[video], do_sample_frames=False, return_tensors="pt", **kwargs)
    ours, grid = patchify_video(torch.from_numpy(video).permute(0, 3, 1, 2), cfg)
    assert list(grid) == ref["video_grid_thw"][0].tolist()
    torch.testing.assert_close(ours, ref["pixel_values_videos"], rtol=0, atol=0)


def test_a_resumed_run_keeps_its_image_processor(saved_processor, media_dir, tmp_path, monkeypatch):
    """Installing torchvision mid-run makes AutoImageProcessor pick its torchvision backend (slightly other
    pixels than the PIL one). A new OUT records the torchvision class, whose operations vlfast does itself
    whatever is installed, so its resume goes on; an OUT made with the PIL class (vlfast before its own
    torchvision path, or --image-backend pil) goes on with the PIL class, built by name."""
    import transformers
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    from vlfast.extraction.api import extract
    from vlfast.extraction.store import facts
    from vlfast.pixels import engine as preprocess

    samples = [Sample("rgb", "image", (str(media_dir / "good/rgb.jpg"),))]
    out = tmp_path / "out"
    first = extract(samples, out, model=str(saved_processor), num_workers=0, device="cpu")
    recorded = json.loads((out / "run.json").read_text())["config"]["processor"]["image_processor"]
    assert recorded == "Qwen2VLImageProcessor" and first.extracted == 1

    class OtherBackend(Qwen2VLImageProcessorPil):  # stands in for the class another environment builds
        pass

    def from_pretrained(cls, path, **kwargs):
        return OtherBackend(
            **json.loads((Path(path) / "processor_config.json").read_text())["image_processor"]
        )

    monkeypatch.setattr(transformers.AutoImageProcessor, "from_pretrained", classmethod(from_pretrained))
    monkeypatch.setattr(preprocess, "_IMAGE_PROCESSORS", {})
    # What installing torchvision also changes: the key of the answers OUT/facts.json recorded (the class
    # among them), so transformers is asked again rather than the record trusted (store/facts.py)
    installed = {**facts._installed(), "torchvision": "0.28.0", "torchvision found": True}
    monkeypatch.setattr(facts, "_installed", lambda: installed)
    samples.append(Sample("tiny", "image", (str(media_dir / "good/tiny.png"),)))
    assert extract(samples, out, model=str(saved_processor), num_workers=0, device="cpu").extracted == 1

    # An OUT made with transformers' PIL processor goes on with that class, built from the checkpoint's files
    # whatever transformers would pick now (OtherBackend here)
    kept = preprocess.build_processor_config(
        str(saved_processor), family="qwen3_vl", image_processor="Qwen2VLImageProcessorPil"
    )
    assert kept.image_processor == "Qwen2VLImageProcessorPil"
    proc = Preprocessor(kept, image_processor_dir=str(saved_processor)).image_processor()
    assert type(proc) is Qwen2VLImageProcessorPil
