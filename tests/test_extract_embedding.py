"""`vlfast extract --features embedding`: Qwen3-VL-Embedding's recipe, against an independent reference.

The reference (tests/_embedding_reference.py) computes one row at a time with transformers' own tokenizer,
image processor and ``Qwen3VLModel``, rewriting only what needs torchvision; its self-checks here compare it
with transformers' ``Qwen3VLProcessor`` and qwen-vl-utils' own code. The parity tests then compare
``extract(features="embedding")`` with it on a manifest holding every kind of row: images, videos, text, each
with and without text and instructions, batched together.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from typer.testing import CliRunner

from _embedding_reference import (
    MAX_LENGTH,
    MAX_PIXELS,
    MAX_TOTAL_PIXELS,
    MIN_PIXELS,
    conversation,
    fetch_image,
    model_inputs,
    read_video,
    reference_embed,
    reference_embed_batch,
    reference_hidden,
    tv_resize,
    video_wrapper_replaced,
)
from _transformers_support import qwen3_vl_processor
from vlfast.errors import InputRefused

# Every row of the parity tests must come out this close to the reference, in float32: the reference's own
# one-at-a-time and batched embeddings of these rows agree to 1 - cos <= 2e-7 (measured), and swapping the
# video resize kernel (torchvision's float path for the uint8 one) moves them by <= 3e-7.
COS_FP32 = 0.99999

# bfloat16 against the float32 reference. Measured with the reference on these rows: bfloat16 vs float32
# cosines 0.999974 to 0.999987 one row at a time, 0.999970 to 0.999986 in one padded batch, and the two
# bfloat16 computations 0.999988 to 1.0 apart (how much batching moves a bf16 run). A bound of 1 - cos <=
# 1e-4 is three times the largest spread measured (3.0e-5), and still below what a wrong recipe does to
# these rows: another instruction moves them by 3.7e-4 to 7e-2, another row's embedding is >= 5.8e-3 away.
COS_BF16 = 0.9999

INSTRUCTION = "Retrieve the item that matches"  # no final punctuation: the recipe adds "."
LONG_INSTRUCTION = "0123456789" * 1000  # 10,000 characters: digits are single tokens here, ~10,000 tokens


# ------------------------------------------------------------------------------------------ fixtures


@pytest.fixture(scope="module")
def setup(tmp_path_factory) -> SimpleNamespace:
    """The tiny embedding checkpoint, media (four images, two videos of different lengths and sizes) and a
    manifest of every kind of row (absolute paths)."""
    from vlfast.demo import make_images, make_tiny_qwen3_vl, make_video

    root = tmp_path_factory.mktemp("embedding")
    ckpt = make_tiny_qwen3_vl(root / "ckpt", embedding=True)
    imgs = make_images(root / "media", [(320, 240), (100, 180), (640, 64), (48, 48)])
    short = make_video(root / "media" / "short.mp4", frames=8, fps=4, width=64, height=48)  # 2 s: 4 frames
    long = make_video(root / "media" / "long.mp4", frames=40, fps=5, width=96, height=80, seed=3)  # 8 frames
    p = [str(x) for x in (*imgs, short, long)]
    rows = {
        "img": {"path": p[0]},
        "img-text": {"path": p[1], "text": "What happens in this picture?"},
        "img-own-instruction": {"path": p[2], "instruction": "Retrieve images relevant to the query."},
        "img-small-text": {"path": p[3], "text": "x"},
        "video": {"path": p[4]},
        "video-text": {"path": p[5], "text": "Describe this video."},
        "video-unpunctuated": {
            "path": p[4],
            "text": "What happens?",
            "instruction": "Find the matching clip",
        },
        "text": {"text": "A red bicycle leaning on a wall"},
        "text-unpunctuated": {"text": "user query", "instruction": "  Retrieve passages that answer it  "},
        "text-own-instruction": {"text": "¿Qué pasa?", "instruction": "Find it!"},
    }
    manifest = root / "rows.jsonl"
    _write_manifest(manifest, rows)
    return SimpleNamespace(root=root, ckpt=ckpt, rows=rows, manifest=manifest)


def _write_manifest(path: Path, rows: dict[str, dict]) -> Path:
    path.write_text("".join(json.dumps({"id": k, **row}) + "\n" for k, row in rows.items()), encoding="utf-8")
    return path


def _extract(setup, out: Path, manifest: Path | None = None, **options):
    from vlfast.extraction import extract

    kwargs = dict(
        model=str(setup.ckpt),
        features="embedding",
        dtype="float32",
        device="cpu",
        num_workers=0,
        max_batch_samples=8,
        max_batch_tokens=1 << 16,  # so that the token budget, too, lets rows of every kind share a batch
    )
    return extract(str(manifest or setup.manifest), str(out), **{**kwargs, **options})


def _embeddings(out: Path) -> dict[str, torch.Tensor]:
    from vlfast.extraction import FeatureCache

    cache = FeatureCache(out)
    return {sid: cache[sid]["embedding"] for sid in cache.ids()}


@pytest.fixture(scope="module")
def reference(setup) -> dict[str, torch.Tensor]:
    """Each row's float32 reference embedding, one forward per row."""
    return {k: reference_embed(setup.ckpt, row) for k, row in setup.rows.items()}


@pytest.fixture(scope="module")
def fp32_run(setup, tmp_path_factory) -> dict[str, torch.Tensor]:
    out = tmp_path_factory.mktemp("fp32") / "out"
    summary = _extract(setup, out)
    assert summary.extracted == len(setup.rows) and summary.failed == 0, summary
    return _embeddings(out)


def _cos(a: torch.Tensor, b: torch.Tensor) -> float:
    return float(F.cosine_similarity(a.double(), b.double(), dim=0))


def _assert_close_to(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor], bound: float) -> None:
    assert sorted(got) == sorted(want)
    far = {k: _cos(got[k], want[k]) for k in want if not _cos(got[k], want[k]) >= bound}
    assert not far, f"cosine below {bound}: {far}"


# ------------------------------------------------------------------------ the reference's self-checks


def test_tiny_embedding_checkpoint_is_what_qwen3_vl_embedding_publishes(setup, tiny_qwen3_vl):
    from safetensors import safe_open
    from transformers import AutoModelForImageTextToText
    from transformers.models.qwen3_vl.modeling_qwen3_vl import Qwen3VLModel

    config = json.loads((setup.ckpt / "config.json").read_text())
    assert config["architectures"] == ["Qwen3VLForEmbedding"] and config["model_type"] == "qwen3_vl"
    assert config["text_config"]["hidden_size"] == 128  # so that dim=64 truly cuts
    with safe_open(str(setup.ckpt / "model.safetensors"), "pt") as f:
        keys = list(f.keys())
    assert keys and all(k.startswith(("model.visual.", "model.language_model.")) for k in keys), keys
    model, info = AutoModelForImageTextToText.from_pretrained(str(setup.ckpt), output_loading_info=True)
    assert not info["unexpected_keys"] and set(info["missing_keys"]) <= {"lm_head.weight"}, info
    base, info = Qwen3VLModel.from_pretrained(str(setup.ckpt), output_loading_info=True)
    assert not (info["missing_keys"] or info["unexpected_keys"]), info
    for (name, a), b in zip(model.model.state_dict().items(), base.state_dict().values(), strict=True):
        assert torch.equal(a, b), name
    plain = json.loads((tiny_qwen3_vl / "config.json").read_text())  # the default is unchanged
    assert plain["architectures"] == ["Qwen3VLForConditionalGeneration"]
    assert plain["text_config"]["hidden_size"] == 64


def test_reference_text_tokens_are_the_chat_template(setup):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(setup.ckpt))
    rows = [row for row in setup.rows.values() if "path" not in row] + [{}, {"text": "q", "instruction": "»"}]
    for row in rows:
        messages = conversation(row, INSTRUCTION)
        ids = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, return_dict=True)
        inputs, (untruncated,) = model_inputs(setup.ckpt, [row], instruction=INSTRUCTION)
        assert inputs["input_ids"][0].tolist() == ids["input_ids"] and untruncated == len(ids["input_ids"])
        assert not inputs["mm_token_type_ids"].any()
    text = tok.decode(model_inputs(setup.ckpt, [{}])[0]["input_ids"][0])
    assert text == (
        "<|im_start|>system\nRepresent the user's input.<|im_end|>\n"
        "<|im_start|>user\nNULL<|im_end|>\n<|im_start|>assistant\n"
    )
    unpunctuated = tok.decode(model_inputs(setup.ckpt, [setup.rows["text-unpunctuated"]])[0]["input_ids"][0])
    assert "system\nRetrieve passages that answer it.<|im_end|>" in unpunctuated
    own = tok.decode(
        model_inputs(setup.ckpt, [setup.rows["text-own-instruction"]], instruction=INSTRUCTION)[0][
            "input_ids"
        ][0]
    )
    assert "system\nFind it!<|im_end|>" in own and INSTRUCTION not in own
    given = tok.decode(
        model_inputs(setup.ckpt, [setup.rows["text"]], instruction=INSTRUCTION)[0]["input_ids"][0]
    )
    assert f"system\n{INSTRUCTION}.<|im_end|>" in given


def _qwen_vl_utils() -> dict:
    """qwen-vl-utils' own ``process_vision_info`` and what it calls, compiled from its installed source (its
    module imports torchvision at the top), with torchvision's two parts that it uses here stood in for:
    ``io.read_video`` (PyAV, as torchvision's is) and the tensor ``resize`` kernel (the reference's)."""
    import base64
    import copy
    import importlib.util
    import logging
    import os
    import time
    import typing
    import warnings
    from concurrent.futures import ThreadPoolExecutor
    from io import BytesIO

    import numpy as np
    from packaging import version
    from PIL import Image

    from test_extract_preprocess import _from_source

    spec = importlib.util.find_spec("qwen_vl_utils")
    if spec is None:
        pytest.skip("qwen-vl-utils is not installed (it is in the test extras)")

    def read(path, start_pts=0.0, end_pts=None, pts_unit="sec", output_format="TCHW"):
        assert (start_pts, end_pts, pts_unit, output_format) == (0.0, None, "sec", "TCHW")
        video, fps = read_video(path.removeprefix("file://"))
        return video, None, {"video_fps": fps}

    def resize(video, size, interpolation, antialias):
        assert interpolation == "bicubic" and antialias is True
        return tv_resize(video, *size)

    origin = Path(next(iter(spec.submodule_search_locations))) / "vision_process.py"
    names = {"round_by_factor", "ceil_by_factor", "floor_by_factor", "smart_resize", "to_rgb", "fetch_image"}
    names |= {"smart_nframes", "_read_video_torchvision", "fetch_video", "extract_vision_info"}
    names |= {"process_vision_info", "MAX_RATIO", "SPATIAL_MERGE_SIZE", "IMAGE_MIN_TOKEN_NUM"}
    names |= {"IMAGE_MAX_TOKEN_NUM", "VIDEO_MIN_TOKEN_NUM", "VIDEO_MAX_TOKEN_NUM", "FPS", "FRAME_FACTOR"}
    names |= {"FPS_MIN_FRAMES", "FPS_MAX_FRAMES", "MAX_NUM_WORKERS_FETCH_VIDEO", "MODEL_SEQ_LEN"}
    ns = dict(math=math, os=os, copy=copy, base64=base64, time=time, warnings=warnings, BytesIO=BytesIO)
    ns.update(
        np=np, torch=torch, Image=Image, version=version, requests=None, ThreadPoolExecutor=ThreadPoolExecutor
    )
    ns.update({n: getattr(typing, n) for n in ("Optional", "Union", "Tuple", "List", "Any", "Dict")})
    ns.update(logger=logging.getLogger("qwen_vl_utils"), get_video_reader_backend=lambda: "torchvision")
    ns.update(
        torchvision=SimpleNamespace(__version__="0.23.0"),
        io=SimpleNamespace(read_video=read),
        transforms=SimpleNamespace(functional=SimpleNamespace(resize=resize)),
        InterpolationMode=SimpleNamespace(BICUBIC="bicubic"),
    )
    vp = _from_source(origin, names, ns)
    vp["VIDEO_READER_BACKENDS"] = {"torchvision": vp["_read_video_torchvision"]}
    return vp


@pytest.fixture
def real_processor(setup, monkeypatch):
    """transformers' ``Qwen3VLProcessor`` built from the checkpoint, right padded as the reference's is.
    Its video processor calls torchvision for two things here: ``normalize`` (stood in for by torchvision's
    arithmetic, ``sub_(mean).div_(std)``) and ``grayscale_to_rgb`` (the identity on 3 channels)."""
    import transformers.image_processing_backends as backends
    import transformers.video_processing_utils as video_utils

    def normalize(t, mean, std, inplace=False):
        mean = torch.as_tensor(mean, dtype=t.dtype).view(-1, 1, 1)
        std = torch.as_tensor(std, dtype=t.dtype).view(-1, 1, 1)
        return (t if inplace else t.clone()).sub_(mean).div_(std)

    def grayscale_to_rgb(video):
        assert video.shape[-3] == 3
        return video

    tvf = SimpleNamespace(normalize=normalize, grayscale_to_rgb=grayscale_to_rgb)
    for module in (backends, video_utils):
        monkeypatch.setattr(module, "tvF", getattr(module, "tvF", tvf), raising=False)
    return qwen3_vl_processor(str(setup.ckpt), padding_side="right")


def _their_inputs(processor, vision: dict | None, rows: list[dict]) -> dict[str, torch.Tensor]:
    """What the reference's ``_preprocess_inputs`` builds for ``rows``: its conversations (the paths as
    ``file://`` with its per-item options; every video with the total pixel budget, as vlfast gives it),
    ``processor.apply_chat_template``, qwen-vl-utils' ``process_vision_info`` (``vision``; None: the images
    through the reference's ``fetch_image``), then the processor."""
    conversations = []
    for row in rows:
        messages = conversation(row)
        for item in messages[1]["content"]:
            if item["type"] == "video":
                item.update(
                    video="file://" + item["video"], fps=1, max_frames=64, total_pixels=MAX_TOTAL_PIXELS
                )
            elif item["type"] == "image":
                item.update(image="file://" + item["image"], min_pixels=MIN_PIXELS, max_pixels=MAX_PIXELS)
        conversations.append(messages)
    text = processor.apply_chat_template(conversations, add_generation_prompt=True, tokenize=False)
    if vision is None:
        items = [c for m in conversations for c in m[1]["content"] if c["type"] == "image"]
        images = [fetch_image(c["image"].removeprefix("file://")) for c in items] or None
        videos = metadata = None
        kwargs = {}
    else:
        images, video_inputs, kwargs = vision["process_vision_info"](
            conversations, image_patch_size=16, return_video_metadata=True, return_video_kwargs=True
        )
        videos, metadata = (list(x) for x in zip(*video_inputs)) if video_inputs else (None, None)
    return processor(
        text=text,
        images=images,
        videos=videos,
        video_metadata=metadata,
        truncation=True,
        max_length=MAX_LENGTH,
        padding=True,
        do_resize=False,
        return_tensors="pt",
        **kwargs,
    )


def _assert_same_inputs(theirs, ours) -> None:
    assert sorted(theirs) == sorted(ours)
    for key, value in ours.items():
        assert theirs[key].shape == value.shape, key
        torch.testing.assert_close(theirs[key], value, rtol=0, atol=0, msg=key)


def test_reference_images_match_qwen3vl_processor(setup, real_processor):
    """Image rows, alone and padded together: the reference's model inputs are the processor's, bit for bit,
    with images resized by qwen-vl-utils' own ``fetch_image`` where it is installed, else the reference's."""
    try:
        vision = _qwen_vl_utils()
    except pytest.skip.Exception:
        vision = None
    images = [row for row in setup.rows.values() if "path" in row and not row["path"].endswith(".mp4")]
    for rows in [*([row] for row in images), images]:
        _assert_same_inputs(_their_inputs(real_processor, vision, rows), model_inputs(setup.ckpt, rows)[0])
    if vision is not None:
        for row in images:
            ours = fetch_image(row["path"])
            theirs = vision["fetch_image"](
                {"image": "file://" + row["path"], "min_pixels": MIN_PIXELS, "max_pixels": MAX_PIXELS}, 16
            )
            assert ours.size == theirs.size and ours.tobytes() == theirs.tobytes()


def test_reference_videos_match_qwen_vl_utils_and_qwen3vl_processor(setup, real_processor):
    """Video rows (and all rows in one padded batch): qwen-vl-utils' own frame choice, sizes and metadata,
    then the processor's normalisation, patchify, timestamps and placeholder text, against the reference's
    rewrite of them; only the decoder and the resize kernel are the reference's on both sides."""
    vision = _qwen_vl_utils()
    videos = [row for row in setup.rows.values() if row.get("path", "").endswith(".mp4")]
    for rows in [*([row] for row in videos), list(setup.rows.values())]:
        _assert_same_inputs(_their_inputs(real_processor, vision, rows), model_inputs(setup.ckpt, rows)[0])
    grids = [model_inputs(setup.ckpt, [row])[0]["video_grid_thw"][0].tolist() for row in videos]
    assert [g[0] for g in grids] == [2, 4, 2]  # 4 and 8 frames: 2 s and 8 s at 1 fps, at least 4


def test_video_wrapper_is_the_installed_transformers_rule(setup, real_processor):
    """Where a video's expansion goes in a prompt: vlfast asks the installed ``Qwen3VLProcessor``
    (``video_wrapper_rule``), the reference knows it by release (5.18-5.24 keep the chat template's
    ``<|vision_start|>...<|vision_end|>`` around the frames' blocks, 5.25 replaces it). Both agree, and an
    ``llm`` prompt (``PromptBuilder``, no recipe around it) is the processor's input_ids for the same
    frames, bit for bit; the other rule would be 2 tokens off."""
    from transformers.video_utils import VideoMetadata

    from vlfast.demo import pattern
    from vlfast.extraction.decode.prompts import PromptBuilder
    from vlfast.pixels.settings import video_wrapper_rule

    rule = video_wrapper_rule()
    assert rule == ("replaced" if video_wrapper_replaced() else "kept")
    frames = np.stack([pattern(64, 96, 30 + k) for k in range(5)])  # multiples of 32: no resize
    indices = [0, 4, 8, 12, 16]
    meta = VideoMetadata(total_num_frames=17, fps=4.0, frames_indices=np.array(indices))
    messages = [
        {"role": "user", "content": [{"type": "video"}, {"type": "text", "text": "Describe this video."}]}
    ]
    text = real_processor.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    theirs = real_processor(
        text=[text],
        videos=[frames],
        video_metadata=[meta],
        do_resize=False,
        do_sample_frames=False,
        return_tensors="pt",
    )
    grid = theirs["video_grid_thw"][0].tolist()
    assert grid == [3, 4, 6]  # 5 frames padded to 6: 3 temporal patches, each a block of its own
    facts = {"frame_indices": indices, "video_fps": 4.0}
    ids = {
        wrapper: PromptBuilder(str(setup.ckpt), "qwen3_vl", 2, 2, wrapper)(
            "video", messages[0]["content"][1]["text"], grid, facts
        )
        for wrapper in ("kept", "replaced")
    }
    assert ids[rule].tolist() == theirs["input_ids"][0].tolist()
    other = "kept" if rule == "replaced" else "replaced"
    assert len(ids["kept"]) - len(ids["replaced"]) == 2 and ids[other].tolist() != ids[rule].tolist()


def test_video_wrapper_is_recorded_where_a_prompt_holds_it(setup, tmp_path, monkeypatch):
    """run.json records the rule (``processor.video_wrapper``; absent: "kept") for a run whose prompts hold a
    video; a vision-only run of the same checkpoint keeps the default whatever transformers says, so it
    resumes under either rule. A resume under the other rule (another transformers: its facts are asked
    again) is refused, never mixed, and the CLI says which transformers resumes it as made."""
    from vlfast.extraction.store.format import FACTS_FILE
    from vlfast.extraction.store.resume import RunConfigMismatch
    from vlfast.pixels import settings as processor_config

    rule = processor_config.video_wrapper_rule()
    manifest = _write_manifest(tmp_path / "rows.jsonl", {"video": setup.rows["video"]})
    out, vision = tmp_path / "out", tmp_path / "vision"
    assert _extract(setup, out, manifest).extracted == 1
    recorded = json.loads((out / "run.json").read_text())["config"]["processor"]
    assert recorded.get("video_wrapper", "kept") == rule
    assert _extract(setup, vision, manifest, features="vision").extracted == 1
    recorded = json.loads((vision / "run.json").read_text())["config"]["processor"]
    assert recorded.get("video_wrapper", "kept") == "kept"
    other = "kept" if rule == "replaced" else "replaced"
    monkeypatch.setattr(processor_config, "video_wrapper_rule", lambda: other)
    for made in (out, vision):
        (made / FACTS_FILE).unlink()
    with pytest.raises(RunConfigMismatch, match="processor.video_wrapper"):
        _extract(setup, out, manifest)
    from vlfast.cli.main import app

    args = ["extract", str(manifest), str(out), "--model", str(setup.ckpt), "--features", "embedding"]
    r = CliRunner().invoke(app, [*args, "--workers", "0", "--device", "cpu", "--dtype", "float32"])
    assert r.exit_code == 2 and "processor.video_wrapper" in r.output, r.output
    assert "transformers of the rule it was made with" in " ".join(r.output.split()), r.output
    assert _extract(setup, vision, manifest, features="vision").extracted == 0  # resumed: nothing to do


def test_reference_resize_is_torchvisions_float_path():
    """qwen-vl-utils resizes with ``torchvision.transforms.functional.resize``, the v1 functional: on a uint8
    tensor that is ``_functional_tensor.resize``, interpolation in float32, clamped, rounded, cast back. The
    uint8 kernel (what transformers' v2 resize uses on CPU) is another computation: one level apart in some
    pixels of smooth frames, tens of levels where its first pass overshoots and clamps (noise, sharp edges)."""
    gen = torch.Generator().manual_seed(0)
    frames = torch.randint(0, 256, (2, 3, 48, 64), dtype=torch.uint8, generator=gen)
    ours = tv_resize(frames, 320, 448)
    floats = F.interpolate(
        frames.float(), size=[320, 448], mode="bicubic", align_corners=False, antialias=True
    )
    assert torch.equal(ours, floats.clamp(0, 255).round().to(torch.uint8))
    uint8 = F.interpolate(frames, size=[320, 448], mode="bicubic", align_corners=False, antialias=True)
    assert (ours.int() - uint8.int()).abs().max() > 1
    assert tv_resize(frames, 48, 64) is frames  # torchvision returns the input when the size is unchanged


def test_reference_embeddings_are_the_processor_inputs_through_the_model(setup, real_processor, reference):
    """The reference's forward and pooling: the processor's inputs through ``Qwen3VLModel``, the last
    non-padding token's hidden state, L2-normalised, as the reference's ``process`` does for a padded batch;
    and its one padded forward over all rows agrees with one row at a time."""
    from transformers import AutoModelForImageTextToText

    vision = _qwen_vl_utils()
    rows = list(setup.rows.values())
    inputs = _their_inputs(real_processor, vision, rows)
    model = AutoModelForImageTextToText.from_pretrained(str(setup.ckpt)).model.eval()
    with torch.no_grad():
        hidden = model(**inputs).last_hidden_state
    mask = inputs["attention_mask"]
    last = mask.shape[1] - mask.flip(dims=[1]).argmax(dim=1) - 1
    theirs = F.normalize(hidden[torch.arange(len(rows)), last], p=2, dim=-1)
    ours = reference_embed_batch(setup.ckpt, rows)
    torch.testing.assert_close(ours, theirs, rtol=0, atol=1e-6)
    one_at_a_time = torch.stack([reference[k] for k in setup.rows])
    cos = (ours * one_at_a_time).sum(-1)
    assert bool((cos >= 1 - 1e-6).all()), cos
    assert int(mask.sum(1).min()) < mask.shape[1]  # the batch was padded: lengths differ


def test_reference_truncates_right_at_8192_tokens(setup):
    row = {"text": "a query"}
    inputs, (untruncated,) = model_inputs(setup.ckpt, [row], instruction=LONG_INSTRUCTION)
    assert inputs["input_ids"].shape == (1, MAX_LENGTH) and untruncated > 10_000
    full, _ = model_inputs(setup.ckpt, [{"text": "a query", "instruction": LONG_INSTRUCTION}])
    assert torch.equal(full["input_ids"], inputs["input_ids"])  # the instruction's start, kept; its end cut


# ------------------------------------------------------------------------------- parity with extract


def test_every_row_matches_the_reference(fp32_run, reference):
    for sid, emb in fp32_run.items():
        assert emb.dtype == torch.float32 and emb.shape == (128,), (sid, emb.dtype, emb.shape)
        assert abs(float(emb.norm()) - 1) < 1e-5, sid
    _assert_close_to(fp32_run, reference, COS_FP32)
    # and the rows are told apart: no two share an embedding
    ids = sorted(fp32_run)
    assert all(_cos(fp32_run[a], fp32_run[b]) < 0.9999 for a in ids for b in ids if a < b)


def test_batching_changes_nothing(setup, fp32_run, tmp_path):
    _extract(setup, tmp_path / "one", max_batch_samples=1)
    _assert_close_to(_embeddings(tmp_path / "one"), fp32_run, COS_FP32)


def test_matryoshka_dim_is_the_first_dims_renormalised(setup, fp32_run, tmp_path):
    _extract(setup, tmp_path / "d64", dim=64)
    got = _embeddings(tmp_path / "d64")
    for sid, emb in got.items():
        assert emb.dtype == torch.float32 and emb.shape == (64,), (sid, emb.shape)
        assert abs(float(emb.norm()) - 1) < 1e-5, sid
    # the first 64 of the unnormalised vector, re-normalised: the same direction as the first 64 of the
    # normalised one, which alone is shorter than 1 (a real cut)
    want = {k: F.normalize(reference_hidden(setup.ckpt, row)[:64], dim=0) for k, row in setup.rows.items()}
    _assert_close_to(got, want, COS_FP32)
    _assert_close_to(got, {k: F.normalize(v[:64], dim=0) for k, v in fp32_run.items()}, COS_FP32)
    assert all(float(v[:64].norm()) < 0.99 for v in fp32_run.values())


def test_bfloat16_within_its_measured_spread(setup, fp32_run, reference, tmp_path):
    _extract(setup, tmp_path / "bf16", dtype="bfloat16")
    got = _embeddings(tmp_path / "bf16")
    assert all(v.dtype == torch.float32 and v.shape == (128,) for v in got.values())
    _assert_close_to(got, reference, COS_BF16)
    assert max(1 - _cos(got[k], fp32_run[k]) for k in got) > 1e-6  # it did run in bfloat16


def test_instruction_applies_to_rows_without_their_own(setup, fp32_run, tmp_path):
    _extract(setup, tmp_path / "instr", instruction=INSTRUCTION)
    got = _embeddings(tmp_path / "instr")
    want = {k: reference_embed(setup.ckpt, row, instruction=INSTRUCTION) for k, row in setup.rows.items()}
    _assert_close_to(got, want, COS_FP32)
    own = {k for k, row in setup.rows.items() if row.get("instruction")}
    assert own and own < set(got)
    for sid in got:  # a row's own instruction wins; the others changed
        if sid in own:
            assert _cos(got[sid], fp32_run[sid]) >= COS_FP32, sid
        else:
            assert _cos(got[sid], fp32_run[sid]) < 0.9999, sid


def test_long_instruction_is_truncated_at_8192_tokens_and_recorded(setup, tmp_path):
    """Accepted, not refused: the sequence is cut at 8,192 tokens, on the right, as the reference's
    processor cuts it, and the sample's meta says from how many."""
    from vlfast.extraction import FeatureCache

    rows = {
        "given": {"text": "a query"},
        "own": {"text": "another query", "instruction": LONG_INSTRUCTION[::-1]},
        "short": {"text": "a query", "instruction": "Short."},
    }
    manifest = _write_manifest(tmp_path / "long.jsonl", rows)
    summary = _extract(setup, tmp_path / "out", manifest, instruction=LONG_INSTRUCTION)
    assert summary.extracted == 3 and summary.failed == 0, summary
    cache = FeatureCache(tmp_path / "out")
    for sid, row in rows.items():
        want = reference_embed(setup.ckpt, row, instruction=LONG_INSTRUCTION)
        assert _cos(cache[sid]["embedding"], want) >= COS_FP32, sid
        _, (untruncated,) = model_inputs(setup.ckpt, [row], instruction=LONG_INSTRUCTION)
        meta = cache.meta(sid)
        if untruncated > MAX_LENGTH:
            assert meta.get("truncated_from") == untruncated, (sid, meta)
        else:
            assert meta.get("truncated_from") is None, (sid, meta)


# ------------------------------------------------------------------------------ refusals and bad rows


def test_a_row_with_empty_text_and_no_media_is_recorded(setup, tmp_path):
    from vlfast.extraction import FeatureCache

    manifest = _write_manifest(tmp_path / "rows.jsonl", {"empty": {"text": ""}, "ok": {"text": "fine"}})
    summary = _extract(setup, tmp_path / "out", manifest)
    assert summary.extracted == 1 and summary.failed == 1, summary
    cache = FeatureCache(tmp_path / "out")
    assert cache.ids() == ["ok"]
    (error,) = cache.errors()
    assert error["id"] == "empty" and error["kind"] == "input", error
    assert "rows.jsonl line 1" in error["source"] and "text" in error["reason"], error


@pytest.mark.parametrize("dim", [256, 129, 63, 32, 0, -64])
def test_dim_outside_64_to_the_model_width_is_refused(setup, tmp_path, dim):
    out = tmp_path / "out"
    with pytest.raises(InputRefused, match="dim"):
        _extract(setup, out, dim=dim)
    assert not out.exists()


def test_embedding_needs_a_language_model(setup, tmp_path):
    out = tmp_path / "out"
    with pytest.raises(InputRefused, match="embedding") as refused:
        _extract(setup, out, model="ref:qwen3-vl-2b")
    assert "unknown feature" not in str(refused.value)  # refused for the tower alone, not the name
    assert not out.exists()


@pytest.mark.parametrize(
    ("args", "needle"),
    [
        (["--dim", "32"], "dim"),
        (["--dim", "256"], "dim"),
        (["--model", "ref:qwen3-vl-2b"], "embedding"),
    ],
)
def test_cli_refusals_exit_2_and_write_nothing(setup, tmp_path, args, needle):
    from vlfast.cli.main import app

    out = tmp_path / "out"
    base = ["extract", str(setup.manifest), str(out), "--model", str(setup.ckpt), "--features", "embedding"]
    r = CliRunner().invoke(app, [*base, "--workers", "0", "--device", "cpu", *args])
    assert r.exit_code == 2 and needle in r.output, r.output
    assert "No such option" not in r.output and "unknown feature" not in r.output, r.output
    assert not out.exists()


def test_cli_extracts_embeddings_with_instruction_and_dim(setup, tmp_path):
    from vlfast.cli.main import app

    rows = {"text": setup.rows["text"], "img-text": setup.rows["img-text"]}
    manifest = _write_manifest(tmp_path / "rows.jsonl", rows)
    out = tmp_path / "out"
    args = ["extract", str(manifest), str(out), "--model", str(setup.ckpt), "--features", "embedding"]
    args += ["--instruction", INSTRUCTION, "--dim", "64", "--workers", "0", "--device", "cpu"]
    args += ["--dtype", "float32"]
    r = CliRunner().invoke(app, args)
    assert r.exit_code == 0, r.output
    got = _embeddings(out)
    want = {k: reference_embed(setup.ckpt, row, instruction=INSTRUCTION, dim=64) for k, row in rows.items()}
    _assert_close_to(got, want, COS_FP32)


def test_vlfast_decodes_each_row_to_the_references_model_inputs_bit_for_bit(setup):
    """Before any forward: for every row, vlfast's decode stage gives the token ids and pixel values the
    reference hands the model, exactly (images: qwen-vl-utils' sizes then the processor; videos: qwen-vl-utils'
    frames, sizes and torchvision's float resize, then the processor's normalisation and patchify)."""
    from vlfast.extraction.decode.stage import SampleDataset, prepare_decoding
    from vlfast.extraction.model.features import FeatureSpec
    from vlfast.extraction.sources.listing import load_inputs
    from vlfast.pixels.engine import build_processor_config
    from vlfast.pixels.settings import with_video_wrapper
    from vlfast.pixels.video import normalize_patches

    ckpt = str(setup.ckpt)
    # as the plan makes it for a run that builds prompts: with the installed transformers' video wrapper rule
    cfg = with_video_wrapper(build_processor_config(ckpt, family="qwen3_vl"), "qwen3_vl", True)
    spec = FeatureSpec(("embedding",))
    pre, prompts = prepare_decoding(ckpt, "qwen3_vl", cfg, True, True, embedding=spec.embedding_prompt())
    samples, problems = load_inputs(setup.manifest)
    assert problems == []
    dataset = SampleDataset(samples, pre, prompts, "")
    for i, s in enumerate(samples):
        item = dataset[i]
        theirs = model_inputs(setup.ckpt, [setup.rows[s.id]])[0]
        assert torch.equal(item.input_ids, theirs["input_ids"][0]), s.id
        if s.kind == "text":
            assert item.pixel_values.shape[0] == 0
            continue
        pixels = item.pixel_values
        if pixels.dtype == torch.uint8:
            pixels = normalize_patches(pixels, cfg)
        key = "pixel_values" if s.kind == "image" else "pixel_values_videos"
        assert torch.equal(pixels, theirs[key]), s.id
        grid_key = "image_grid_thw" if s.kind == "image" else "video_grid_thw"
        assert list(item.grid) == theirs[grid_key][0].tolist(), s.id


def test_odd_images_are_read_as_qwen_vl_utils_reads_them(setup, tmp_path):
    """The recipe's reference reads an image with qwen-vl-utils' to_rgb: RGBA pasted on white by its alpha,
    every other mode convert("RGB") (an LA image's alpha dropped, a 16-bit image clipped), where vlfast's
    own reading composites and scales: the recipe reads so (run.json: "image_reading": "qwen-vl-utils"),
    pixel for pixel; an OUT made reading as vlfast does resumes reading so."""
    import numpy as np
    from PIL import Image

    from vlfast.demo import pattern
    from vlfast.extraction.decode.stage import SampleDataset, prepare_decoding
    from vlfast.extraction.model.features import FeatureSpec
    from vlfast.extraction.plan import recorded_setting
    from vlfast.extraction.sources.listing import load_inputs
    from vlfast.pixels.engine import build_processor_config
    from vlfast.pixels.video import normalize_patches

    rgb = pattern(64, 96, 4)
    alpha = (np.arange(96)[None, :].repeat(64, 0) * 2).astype(np.uint8)
    made = {
        "rgba": (Image.fromarray(np.dstack([rgb, alpha]), "RGBA"), {}),
        "la": (Image.fromarray(np.dstack([rgb, alpha]), "RGBA").convert("LA"), {}),
        "palette-transparent": (Image.fromarray(rgb).convert("P"), {"transparency": 0}),
        "sixteen-bit": (Image.fromarray(rgb[..., 0].astype(np.uint16) * 200), {}),
    }
    rows = {}
    for name, (img, kw) in made.items():
        img.save(tmp_path / f"{name}.png", **kw)
        rows[name] = {"path": str(tmp_path / f"{name}.png")}
    manifest = _write_manifest(tmp_path / "rows.jsonl", rows)
    ckpt = str(setup.ckpt)
    cfg = build_processor_config(ckpt, family="qwen3_vl")
    assert cfg.image_reading == "qwen-vl-utils" and cfg.to_dict()["image_reading"] == "qwen-vl-utils"
    pre, prompts = prepare_decoding(
        ckpt, "qwen3_vl", cfg, True, True, embedding=FeatureSpec(("embedding",)).embedding_prompt()
    )
    samples, problems = load_inputs(manifest)
    assert problems == []
    dataset = SampleDataset(samples, pre, prompts, "")
    for i, s in enumerate(samples):
        pixels = dataset[i].pixel_values
        if pixels.dtype == torch.uint8:
            pixels = normalize_patches(pixels, cfg)
        theirs = model_inputs(setup.ckpt, [rows[s.id]])[0]["pixel_values"]
        assert torch.equal(pixels, theirs), s.id
    assert recorded_setting(None, "image_reading") is None  # a new OUT: the recipe decides
    old = build_processor_config(ckpt, family="qwen3_vl", image_reading="vlfast")
    assert recorded_setting({"processor": old.to_dict()}, "image_reading") == "vlfast"
