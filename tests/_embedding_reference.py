"""Qwen3-VL-Embedding's recipe, one sample at a time, written apart from vlfast.extraction: the parity
reference of ``vlfast extract --features embedding``.

What it follows, and where (line numbers at the commits named):

- QwenLM/Qwen3-VL-Embedding 8ce3aab, src/models/qwen3_vl_embedding.py (``QE`` below):
  ``Qwen3VLEmbedder.format_model_input`` (L220-326: the conversation), ``_preprocess_inputs``
  (L329-361: chat template, ``process_vision_info(..., image_patch_size=16)``, then
  ``processor(..., truncation=True, max_length=8192, padding=True, do_resize=False)``), ``_pooling_last``
  (L364-370) and ``process`` (L373-393: one padded forward, right padding (L188), then L2 normalisation);
- qwen-vl-utils 0.0.14, qwen_vl_utils/vision_process.py (``VP`` below): ``smart_resize`` (L56-81),
  ``to_rgb`` (L84-90), ``fetch_image`` (L93-141), ``smart_nframes`` (L144-181), the torchvision reader's
  frame choice and metadata (L215-224) and ``fetch_video``'s sizing and resize (L448-475);
- transformers 5.24: ``Qwen3VLProcessor.replace_image_token`` / ``replace_video_token`` /
  ``_calculate_timestamps`` (models/qwen3_vl/processing_qwen3_vl.py L70-103, L173-184),
  ``ProcessorMixin.create_mm_token_type_ids`` (processing_utils.py L996), and ``Qwen3VLVideoProcessor``'s
  ``rescale_and_normalize`` (image_processing_backends.py L329-369: fused, ``(x - 255 mean) / (255 std)``
  in float32) and ``patchify`` (models/qwen3_vl/video_processing_qwen3_vl.py L225-263);
- where a video's expansion goes in the text, by the installed transformers' version
  (:func:`video_wrapper_replaced`): 5.18-5.24's ``ProcessorMixin.get_text_with_replacements`` replaces the
  ``<|video_pad|>`` alone, inside the chat template's ``<|vision_start|>...<|vision_end|>``; 5.25's
  ``Qwen3VLProcessor.get_text_with_replacements`` (processing_qwen3_vl.py L182-208) replaces that whole
  wrapper, each frame's block carrying its own. Written from the two releases' code, apart from vlfast's
  rule (which asks the installed processor), so each checks the other.

Images go through the checkpoint's own image processor (``AutoImageProcessor``, ``do_resize=False``), text
through its tokenizer and chat template, the model is ``AutoModelForImageTextToText.from_pretrained``'s
``Qwen3VLModel``. What needs torchvision there (absent here and in CI) is rewritten below: the video reader
(PyAV, as torchvision's ``read_video`` is), the frame resize (torchvision's v1 tensor resize), the video
processor's normalisation and patchify.

The one choice that is vlfast's, not the reference's: every video gets the total pixel budget
``10 * 768 * 32 * 32`` (QE L32 ``MAX_TOTAL_PIXELS``); QE passes it only for frame lists (L276) and video
files get qwen-vl-utils' default (``128000 * 32 * 32 * 0.9``, VP L450). The two agree while a video samples
at most 20 frames (per-frame cap 768 * 32 * 32 either way), as every video in the tests does.
"""

from __future__ import annotations

import functools
import math
import unicodedata
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F

__all__ = [
    "DEFAULT_INSTRUCTION",
    "MAX_LENGTH",
    "conversation",
    "fetch_image",
    "fetch_video",
    "model_inputs",
    "normalized_instruction",
    "reference_embed",
    "reference_embed_batch",
    "reference_hidden",
    "smart_nframes",
    "smart_resize",
    "tv_resize",
]

# QE L24-32.
MAX_LENGTH = 8192
IMAGE_FACTOR = 16 * 2
MIN_PIXELS = 4 * IMAGE_FACTOR * IMAGE_FACTOR
MAX_PIXELS = 1800 * IMAGE_FACTOR * IMAGE_FACTOR
FPS = 1
MAX_FRAMES = 64
FRAME_MAX_PIXELS = 768 * IMAGE_FACTOR * IMAGE_FACTOR
MAX_TOTAL_PIXELS = 10 * FRAME_MAX_PIXELS
DEFAULT_INSTRUCTION = "Represent the user's input."  # QE L170
# VP L24-33.
MAX_RATIO = 200
FRAME_FACTOR = 2
FPS_MIN_FRAMES = 4
VIDEO_MIN_PIXELS = 128 * IMAGE_FACTOR * IMAGE_FACTOR  # VIDEO_MIN_TOKEN_NUM * image_factor**2 (VP L406)

VIDEO_SUFFIXES = {".mp4", ".mkv", ".webm", ".avi", ".mov", ".m4v", ".mpg", ".mpeg", ".ts", ".flv", ".wmv"}


# ------------------------------------------------------------------------------------------ conversation


def normalized_instruction(instruction: str | None) -> str | None:
    """QE L230-234: stripped, and a "." added unless it ends in Unicode punctuation; None when empty."""
    if instruction:
        instruction = instruction.strip()
        if instruction and not unicodedata.category(instruction[-1]).startswith("P"):
            instruction = instruction + "."
    return instruction or None


def is_video(path: str | Path) -> bool:
    return Path(path).suffix.lower() in VIDEO_SUFFIXES


def conversation(row: dict[str, Any], instruction: str | None = None) -> list[dict[str, Any]]:
    """QE ``format_model_input`` (L220-326) for one row ``{"path"?, "text"?, "instruction"?}``: the row's own
    instruction, else ``instruction`` (what ``extract(instruction=...)`` gives every row without one), else
    the default; then the video, the image, the text, or the text "NULL" when there is none of them."""
    system = normalized_instruction(row.get("instruction")) or normalized_instruction(instruction)
    content: list[dict[str, Any]] = []
    messages = [
        {"role": "system", "content": [{"type": "text", "text": system or DEFAULT_INSTRUCTION}]},
        {"role": "user", "content": content},
    ]
    path, text = row.get("path"), row.get("text")
    if path is None and text is None:  # L269-271
        content.append({"type": "text", "text": "NULL"})
        return messages
    if path is not None and is_video(path):  # L274-300: videos first
        content.append({"type": "video", "video": str(path)})
    elif path is not None:  # L303-320: then images
        content.append({"type": "image", "image": str(path)})
    if text is not None:  # L323-324: then texts
        content.append({"type": "text", "text": text})
    return messages


# ------------------------------------------------------------------------------------ qwen-vl-utils (VP)


def round_by_factor(number: float, factor: int) -> int:
    return round(number / factor) * factor


def ceil_by_factor(number: float, factor: int) -> int:
    return math.ceil(number / factor) * factor


def floor_by_factor(number: float, factor: int) -> int:
    return math.floor(number / factor) * factor


def smart_resize(
    height: int, width: int, factor: int, min_pixels: float, max_pixels: float
) -> tuple[int, int]:
    """VP L56-81."""
    assert max_pixels >= min_pixels
    if max(height, width) / min(height, width) > MAX_RATIO:
        raise ValueError(f"absolute aspect ratio must be smaller than {MAX_RATIO}")
    h_bar = max(factor, round_by_factor(height, factor))
    w_bar = max(factor, round_by_factor(width, factor))
    if h_bar * w_bar > max_pixels:
        beta = math.sqrt((height * width) / max_pixels)
        h_bar = floor_by_factor(height / beta, factor)
        w_bar = floor_by_factor(width / beta, factor)
    elif h_bar * w_bar < min_pixels:
        beta = math.sqrt(min_pixels / (height * width))
        h_bar = ceil_by_factor(height * beta, factor)
        w_bar = ceil_by_factor(width * beta, factor)
    return h_bar, w_bar


def fetch_image(path: str | Path):
    """VP ``fetch_image`` (L93-141) for a local file, with QE's min/max pixels (L316-319) and
    ``image_patch_size=16`` (QE L336): RGB (RGBA over white, VP L84-90), ``smart_resize`` to multiples of 32,
    PIL's ``resize`` with its default filter."""
    from PIL import Image

    with Image.open(path) as opened:
        if opened.mode == "RGBA":
            image = Image.new("RGB", opened.size, (255, 255, 255))
            image.paste(opened, mask=opened.split()[3])
        else:
            image = opened.convert("RGB")
    width, height = image.size
    h, w = smart_resize(height, width, IMAGE_FACTOR, MIN_PIXELS, MAX_PIXELS)
    return image.resize((w, h))


def smart_nframes(total_frames: int, video_fps: float, fps: float = FPS, max_frames: int = MAX_FRAMES) -> int:
    """VP L144-181 with ``ele = {"fps": fps, "max_frames": max_frames}`` (QE L290)."""
    min_frames = ceil_by_factor(FPS_MIN_FRAMES, FRAME_FACTOR)
    max_frames = floor_by_factor(max_frames, FRAME_FACTOR)
    nframes = total_frames / video_fps * fps
    nframes = min(min(max(nframes, min_frames), max_frames), total_frames)
    nframes = floor_by_factor(nframes, FRAME_FACTOR)
    if not (FRAME_FACTOR <= nframes <= total_frames):
        raise ValueError(f"nframes should in interval [{FRAME_FACTOR}, {total_frames}], but got {nframes}.")
    return nframes


def read_video(path: str | Path) -> tuple[torch.Tensor, float]:
    """Every frame, (T, 3, H, W) uint8 RGB, and the stream's average rate: what torchvision's
    ``io.read_video`` (PyAV underneath) gives VP's torchvision reader (L201-208)."""
    import av

    with av.open(str(path)) as container:
        stream = container.streams.video[0]
        fps = float(stream.average_rate)
        frames = [f.to_ndarray(format="rgb24") for f in container.decode(stream)]
    return torch.from_numpy(np.stack(frames)).permute(0, 3, 1, 2).contiguous(), fps


def tv_resize(video: torch.Tensor, height: int, width: int) -> torch.Tensor:
    """``torchvision.transforms.functional.resize(video, [h, w], BICUBIC, antialias=True)`` on a uint8
    tensor (VP L470-475): torchvision's v1 functional returns the input when the size is unchanged, else
    (``_functional_tensor.resize``) casts to float32, interpolates, clamps to [0, 255], rounds, casts back."""
    if list(video.shape[-2:]) == [height, width]:
        return video
    out = F.interpolate(
        video.to(torch.float32), size=[height, width], mode="bicubic", align_corners=False, antialias=True
    )
    return out.clamp(0, 255).round().to(torch.uint8)


def fetch_video(path: str | Path) -> tuple[torch.Tensor, dict[str, Any]]:
    """VP ``fetch_video`` (L403-480) for a file: frames chosen by ``smart_nframes`` and
    ``torch.linspace(0, total - 1, n).round()`` (L214-216), each resized to the same ``smart_resize`` size
    under the per-frame budget (L448-469; total pixels: see the module's docstring), resized bicubic with
    antialiasing, as float32 (T, 3, h, w); and the metadata the processor is given (L219-224)."""
    video, video_fps = read_video(path)
    total = video.shape[0]
    nframes = smart_nframes(total, video_fps)
    idx = torch.linspace(0, total - 1, nframes).round().long()
    video = video[idx]
    _, _, height, width = video.shape
    max_pixels = max(
        min(FRAME_MAX_PIXELS, MAX_TOTAL_PIXELS / nframes * FRAME_FACTOR), int(VIDEO_MIN_PIXELS * 1.05)
    )
    h, w = smart_resize(height, width, IMAGE_FACTOR, VIDEO_MIN_PIXELS, max_pixels)
    video = tv_resize(video, h, w).float()
    return video, {"fps": video_fps, "frames_indices": idx.tolist(), "total_num_frames": total}


# ------------------------------------------------------------------------------ the processor's steps


def video_patches(video: torch.Tensor, vp: Any) -> tuple[torch.Tensor, list[int]]:
    """``Qwen3VLVideoProcessor`` with ``do_resize=False`` on one float (T, 3, h, w) video: fused rescale and
    normalise in float32, the last frame repeated to a multiple of ``temporal_patch_size``, its patchify."""
    mean = torch.tensor(vp.image_mean) * (1.0 / vp.rescale_factor)  # image_processing_backends L340-341
    std = torch.tensor(vp.image_std) * (1.0 / vp.rescale_factor)
    x = (video.to(torch.float32) - mean.view(3, 1, 1)) / std.view(3, 1, 1)  # tvF.normalize: sub_, div_
    p, m, tp = vp.patch_size, vp.merge_size, vp.temporal_patch_size
    if pad := -x.shape[0] % tp:  # video_processing_qwen3_vl L236-239
        x = torch.cat([x, x[-1:].expand(pad, -1, -1, -1)])
    t, c, h, w = x.shape
    gt, gh, gw = t // tp, h // p, w // p
    x = x.view(gt, tp, c, gh // m, m, p, gw // m, m, p)  # L244-261, batch dimension dropped
    x = x.permute(0, 3, 6, 4, 7, 2, 1, 5, 8)
    return x.reshape(gt * gh * gw, c * tp * p * p), [gt, gh, gw]


def timestamps(indices: list[int], video_fps: float, merge_size: int) -> list[float]:
    """``Qwen3VLProcessor._calculate_timestamps``: one per temporal patch, the mean of its first and last
    frame's time."""
    indices = list(indices)
    if len(indices) % merge_size:
        indices += [indices[-1]] * (merge_size - len(indices) % merge_size)
    times = [i / video_fps for i in indices]
    return [(times[i] + times[i + merge_size - 1]) / 2 for i in range(0, len(times), merge_size)]


def video_wrapper_replaced() -> bool:
    """Whether the installed transformers replaces the chat template's wrapper around a video (5.25 and
    later) or keeps it (5.18-5.24): see the module's docstring."""
    import transformers
    from packaging.version import Version

    return Version(transformers.__version__).release >= (5, 25)


@functools.lru_cache(maxsize=4)
def _load(ckpt: str, dtype: torch.dtype) -> tuple[Any, Any, Any, Any]:
    from transformers import AutoImageProcessor, AutoModelForImageTextToText, AutoTokenizer
    from transformers.models.qwen3_vl.video_processing_qwen3_vl import Qwen3VLVideoProcessor

    tokenizer = AutoTokenizer.from_pretrained(ckpt, padding_side="right")  # QE L187-189
    image_processor = AutoImageProcessor.from_pretrained(ckpt)
    video_processor = Qwen3VLVideoProcessor.from_pretrained(ckpt)
    model = AutoModelForImageTextToText.from_pretrained(ckpt, dtype=dtype).model.eval()
    return tokenizer, image_processor, video_processor, model


def model_inputs(
    ckpt: str | Path, rows: list[dict[str, Any]], *, instruction: str | None = None
) -> tuple[dict[str, torch.Tensor], list[int]]:
    """What QE's ``_preprocess_inputs`` (L329-361) hands the model for ``rows`` (right padded), and each row's
    token count before truncation to ``MAX_LENGTH``."""
    tokenizer, image_processor, video_processor, _ = _load(str(ckpt), torch.float32)
    image_token, video_token = "<|image_pad|>", "<|video_pad|>"
    texts, images, videos, video_grids = [], [], [], []
    for row in rows:
        messages = conversation(row, instruction)
        text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
        for item in messages[1]["content"]:
            if item["type"] == "video":
                frames, meta = fetch_video(item["video"])
                patches, grid = video_patches(frames, video_processor)
                videos.append(patches)
                video_grids.append(grid)
                per_frame = grid[1] * grid[2] // video_processor.merge_size**2
                stamps = timestamps(meta["frames_indices"], meta["fps"], video_processor.temporal_patch_size)
                expanded = "".join(
                    f"<{t:.1f} seconds><|vision_start|>" + video_token * per_frame + "<|vision_end|>"
                    for t in stamps
                )
                assert text.count(video_token) == 1
                wrapper = "<|vision_start|>" + video_token + "<|vision_end|>"
                if video_wrapper_replaced() and wrapper in text:
                    text = text.replace(wrapper, expanded)
                else:
                    text = text.replace(video_token, expanded)
            elif item["type"] == "image":
                images.append(fetch_image(item["image"]))
        texts.append(text)
    out: dict[str, torch.Tensor] = {}
    if images:
        processed = image_processor(images=images, do_resize=False, return_tensors="pt")
        out["pixel_values"] = processed["pixel_values"]
        out["image_grid_thw"] = processed["image_grid_thw"]
        merge = image_processor.merge_size**2
        grids = iter(processed["image_grid_thw"].tolist())
        for k, text in enumerate(texts):  # one image per row at most, in row order
            if image_token in text:
                n = math.prod(next(grids)) // merge
                texts[k] = text.replace(image_token, image_token * n)
    if videos:
        out["pixel_values_videos"] = torch.cat(videos)
        out["video_grid_thw"] = torch.tensor(video_grids)
    untruncated = [len(ids) for ids in tokenizer(texts)["input_ids"]]
    enc = tokenizer(texts, truncation=True, max_length=MAX_LENGTH, padding=True, return_tensors="pt")
    ids = enc["input_ids"]
    out["input_ids"], out["attention_mask"] = ids, enc["attention_mask"]
    image_id, video_id = tokenizer.convert_tokens_to_ids([image_token, video_token])
    out["mm_token_type_ids"] = (ids == image_id).long() + 2 * (ids == video_id).long()  # 1 image, 2 video
    return out, untruncated


def _forward(ckpt: str | Path, inputs: dict[str, torch.Tensor], dtype: torch.dtype) -> torch.Tensor:
    """The pooled last hidden state (QE L364-370, L386-391), (B, D) in the model's dtype."""
    model = _load(str(ckpt), dtype)[3]
    with torch.no_grad():
        hidden = model(**inputs, use_cache=False).last_hidden_state
    mask = inputs["attention_mask"]
    col = mask.shape[1] - mask.flip(dims=[1]).argmax(dim=1) - 1
    return hidden[torch.arange(hidden.shape[0]), col]


def reference_hidden(
    ckpt: str | Path,
    row: dict[str, Any],
    dtype: torch.dtype = torch.float32,
    *,
    instruction: str | None = None,
) -> torch.Tensor:
    """The unnormalised embedding of one row (no padding): float32 (D,)."""
    inputs, _ = model_inputs(ckpt, [row], instruction=instruction)
    assert bool(inputs["attention_mask"].all())
    return _forward(ckpt, inputs, dtype)[0].float()


def reference_embed(
    ckpt: str | Path,
    row: dict[str, Any],
    dtype: torch.dtype = torch.float32,
    *,
    instruction: str | None = None,
    dim: int | None = None,
) -> torch.Tensor:
    """The L2-normalised embedding of one row, one forward of its own: float32 (D,), or its first ``dim``
    values re-normalised (Matryoshka)."""
    hidden = reference_hidden(ckpt, row, dtype, instruction=instruction)
    return F.normalize(hidden[:dim] if dim else hidden, p=2, dim=-1)


def reference_embed_batch(
    ckpt: str | Path,
    rows: list[dict[str, Any]],
    dtype: torch.dtype = torch.float32,
    *,
    instruction: str | None = None,
) -> torch.Tensor:
    """QE ``process(rows)``: ONE forward over all rows, right padded; float32 (B, D), L2-normalised."""
    inputs, _ = model_inputs(ckpt, rows, instruction=instruction)
    return F.normalize(_forward(ckpt, inputs, dtype).float(), p=2, dim=-1)
