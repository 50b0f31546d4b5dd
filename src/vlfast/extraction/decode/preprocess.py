"""Turning one sample into the vision tower's input, with the model's own preprocessing.

Images go through transformers' image processor built from the checkpoint (``AutoImageProcessor``) or,
for a ``ref:`` tower, from the family's published defaults. Videos cannot use transformers' video
processors without torchvision, so they are decoded with PyAV and processed here by the same rules,
written as data in :class:`ProcessorConfig` and proven against transformers' own functions in the tests:

- frame indices: ``Qwen3VLVideoProcessor.sample_frames`` (fps or count, min/max frames) or, for Qwen2-VL
  families, ``Qwen2VLVideoProcessor.sample_frames`` (counts rounded to the temporal patch);
- size: the video ``smart_resize`` (total pixel budget over all frames, optional per-frame cap);
- resize: ``F.interpolate(uint8, bicubic, antialias=True)``, the kernel torchvision's ``resize`` runs on
  CPU uint8 tensors; then ``(x - 255*mean) / (255*std)`` in float32, as transformers fuses it;
- patchify: an odd frame count is padded with the last frame; rows ordered (t, h/2, w/2, 2, 2), columns
  (C, T, P, P), exactly ``Qwen3VLVideoProcessor.patchify``.

Bad inputs raise :class:`SampleError` with a reason a person can act on; the pipeline records it and
goes on.
"""

from __future__ import annotations

import contextlib
import errno
import io
import json
import math
import os
import stat
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F

from vlfast.errors import InputRefused
from vlfast.extraction.decode.truncation import container_truncation
from vlfast.extraction.objstore import is_transient, transient_error
from vlfast.extraction.sources.remote import RemoteFile
from vlfast.extraction.sources.sample import Sample
from vlfast.extraction.sources.webdataset import TarMember

__all__ = [
    "Preprocessor",
    "ProcessorConfig",
    "SampleError",
    "build_processor_config",
    "load_image",
    "normalize_video_patches",
    "patchify_video",
    "read_video",
    "sample_frame_indices",
    "video_resize_shape",
]

OPENAI_CLIP_MEAN = [0.48145466, 0.4578275, 0.40821073]
OPENAI_CLIP_STD = [0.26862954, 0.26130258, 0.27577711]
MAX_ASPECT_RATIO = 200  # Qwen's smart_resize rejects anything longer than 200:1


class SampleError(Exception):
    """This sample cannot be extracted; the message is the reason written to the errors file."""


@dataclass(frozen=True)
class ProcessorConfig:
    """Every number preprocessing uses; recorded in the run config so a run is reproducible."""

    source: str  # where the numbers come from: the checkpoint's files read, or the family defaults
    image_processor: str  # class of the image processor built for images, e.g. "Qwen2VLImageProcessorPil"
    patch_size: int
    temporal_patch_size: int
    merge_size: int
    image_min_pixels: int
    image_max_pixels: int
    image_mean: tuple[float, ...]
    image_std: tuple[float, ...]
    video_min_pixels: int
    video_max_pixels: int
    video_mean: tuple[float, ...]
    video_std: tuple[float, ...]
    frame_sampling: str  # "qwen3-vl" or "qwen2-vl": whose sample_frames rule
    fps: float | None = 2.0
    num_frames: int | None = None
    min_frames: int = 4
    max_frames: int = 768
    cap_pixels_per_frame: bool = False
    max_video_tokens: int = 768
    rescale_factor: float = 1 / 255
    video_resize: str = "torch.nn.functional.interpolate(uint8, bicubic, antialias=True)"
    frames_list_fps: float = 24.0  # timestamps of a clip given as frame images (transformers' default)
    image_kwargs: dict[str, Any] = field(default_factory=dict)  # passed to the image processor

    def __post_init__(self) -> None:
        for name in ("patch_size", "temporal_patch_size", "merge_size", "min_frames", "max_frames"):
            v = getattr(self, name)
            if not isinstance(v, int) or v < 1:
                raise InputRefused(f"{name} must be a positive int, got {v!r}")
        if self.frame_sampling not in ("qwen3-vl", "qwen2-vl"):
            raise InputRefused(
                f"frame_sampling must be 'qwen3-vl' or 'qwen2-vl', got {self.frame_sampling!r}"
            )
        if (self.fps is None) == (self.num_frames is None):
            raise InputRefused("give exactly one of fps and num_frames for video sampling")
        if self.fps is not None and self.fps <= 0:
            raise InputRefused(f"fps must be positive, got {self.fps}")
        if self.num_frames is not None and self.num_frames < 1:
            raise InputRefused(f"num_frames must be >= 1, got {self.num_frames}")
        if not 0 < self.image_min_pixels <= self.image_max_pixels:
            raise InputRefused("need 0 < image_min_pixels <= image_max_pixels")
        if not 0 < self.video_min_pixels <= self.video_max_pixels:
            raise InputRefused("need 0 < video_min_pixels <= video_max_pixels")

    @property
    def factor(self) -> int:
        return self.patch_size * self.merge_size

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        for k, v in d.items():
            if isinstance(v, tuple):
                d[k] = list(v)
        return d


# Published preprocessing of each reference family (preprocessor_config.json and
# video_preprocessor_config.json of the Hugging Face checkpoints; transformers' class defaults where
# the checkpoint keeps them).
_FAMILY_DEFAULTS: dict[str, dict[str, Any]] = {
    "qwen3_vl": {
        "patch_size": 16,
        "image_min_pixels": 65_536,
        "image_max_pixels": 16_777_216,
        "image_mean": (0.5, 0.5, 0.5),
        "image_std": (0.5, 0.5, 0.5),
        "video_min_pixels": 4_096,
        "video_max_pixels": 25_165_824,
        "video_mean": (0.5, 0.5, 0.5),
        "video_std": (0.5, 0.5, 0.5),
        "frame_sampling": "qwen3-vl",
    },
    "qwen2_vl": {
        "patch_size": 14,
        "image_min_pixels": 3_136,
        "image_max_pixels": 12_845_056,
        "image_mean": tuple(OPENAI_CLIP_MEAN),
        "image_std": tuple(OPENAI_CLIP_STD),
        "video_min_pixels": 128 * 28 * 28,
        "video_max_pixels": 768 * 28 * 28,
        "video_mean": tuple(OPENAI_CLIP_MEAN),
        "video_std": tuple(OPENAI_CLIP_STD),
        "frame_sampling": "qwen2-vl",
    },
}
_FAMILY_DEFAULTS["qwen3_vl_moe"] = _FAMILY_DEFAULTS["qwen3_vl"]
_FAMILY_DEFAULTS["qwen2_5_vl"] = _FAMILY_DEFAULTS["qwen2_vl"]


def _size_pixels(cfg: dict[str, Any], default_min: int, default_max: int) -> tuple[int, int]:
    size = cfg.get("size") or {}
    lo = cfg.get("min_pixels") or size.get("shortest_edge") or size.get("min_pixels") or default_min
    hi = cfg.get("max_pixels") or size.get("longest_edge") or size.get("max_pixels") or default_max
    return int(lo), int(hi)


# A checkpoint's processor files come in two layouts. The published one (the Hugging Face repositories):
# preprocessor_config.json for the image processor and video_preprocessor_config.json for the video one.
# The one transformers >= 5 writes (``ProcessorMixin.save_pretrained``, hence every fine-tune saved with
# it): a single processor_config.json holding both as its "image_processor" and "video_processor" entries,
# and no preprocessor_config.json. transformers reads the nested entry first, then the separate file.
PROCESSOR_CONFIG = "processor_config.json"
IMAGE_PROCESSOR_CONFIG = "preprocessor_config.json"
VIDEO_PROCESSOR_CONFIG = "video_preprocessor_config.json"


def _json_object(file: Path) -> dict[str, Any]:
    try:
        data = json.loads(file.read_text(encoding="utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise InputRefused(f"{file} is not valid JSON: {e}") from None
    if not isinstance(data, dict):
        raise InputRefused(f"{file} holds a JSON {type(data).__name__}, not an object")
    return data


def _processor_dicts(path: Path, *, use_transformers: bool = True) -> tuple[dict, str, dict, str | None]:
    """(image processor dict, where from, video processor dict or {}, where from or None) of a checkpoint.

    The dicts are those transformers itself loads (``ImageProcessingMixin.get_image_processor_dict`` and
    ``get_video_processor_config``) where it has these functions, else read here in the same order. Only a
    video processor's own entry or file counts: transformers would fall back to the image processor's file
    for videos, vlfast keeps the family's published video defaults instead.
    """
    nested_file = path / PROCESSOR_CONFIG
    image_file, video_file = path / IMAGE_PROCESSOR_CONFIG, path / VIDEO_PROCESSOR_CONFIG
    nested = _json_object(nested_file) if nested_file.is_file() else {}
    if isinstance(nested.get("image_processor"), dict):
        image_from, image_cfg = f"{nested_file} (image_processor)", nested["image_processor"]
    elif image_file.is_file():
        image_from, image_cfg = str(image_file), _json_object(image_file)
    else:
        raise FileNotFoundError(
            f"{path} has no preprocessor_config.json, nor a processor_config.json with an image_processor "
            "entry: copy preprocessor_config.json and video_preprocessor_config.json from the model's "
            "Hugging Face repository into it, or save the model's processor into it with transformers' "
            "save_pretrained"
        )
    if isinstance(nested.get("video_processor"), dict):
        video_from, video_cfg = f"{nested_file} (video_processor)", nested["video_processor"]
    elif video_file.is_file():
        video_from, video_cfg = str(video_file), _json_object(video_file)
    else:
        video_from, video_cfg = None, {}
    if use_transformers:
        try:
            from transformers.image_processing_base import ImageProcessingMixin
            from transformers.models.auto.video_processing_auto import get_video_processor_config
        except ImportError:  # an older transformers: the files as read above
            pass
        else:
            image_cfg, _ = ImageProcessingMixin.get_image_processor_dict(str(path), local_files_only=True)
            if video_from is not None:
                video_cfg = get_video_processor_config(str(path), local_files_only=True)
    return image_cfg, image_from, video_cfg, video_from


# Image processors built, by what determines them: build_processor_config builds the one it records, and
# the Preprocessor of the same run uses that very object instead of loading it again.
_IMAGE_PROCESSORS: dict[tuple, Any] = {}


def _image_processor(
    model_dir: str | None,
    *,
    patch_size: int,
    temporal_patch_size: int,
    merge_size: int,
    image_mean: tuple[float, ...],
    image_std: tuple[float, ...],
):
    """transformers' image processor: the checkpoint's own (``AutoImageProcessor``, which picks the backend
    by what is installed: the PIL one without torchvision), or, with no checkpoint, the PIL one with these
    numbers. Cached per checkpoint (its processor files' identity) or numbers."""
    if model_dir is not None:
        files = []
        for name in (PROCESSOR_CONFIG, IMAGE_PROCESSOR_CONFIG):
            try:
                st = os.stat(Path(model_dir, name))
            except OSError:
                continue
            files.append((name, st.st_ino, st.st_size, st.st_mtime_ns))
        key: tuple = ("checkpoint", os.path.realpath(model_dir), tuple(files))
    else:
        key = ("defaults", patch_size, temporal_patch_size, merge_size, tuple(image_mean), tuple(image_std))
    proc = _IMAGE_PROCESSORS.get(key)
    if proc is None:
        if model_dir is not None:
            from transformers import AutoImageProcessor

            proc = AutoImageProcessor.from_pretrained(model_dir, local_files_only=True)
        else:
            from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

            proc = Qwen2VLImageProcessorPil(
                patch_size=patch_size,
                temporal_patch_size=temporal_patch_size,
                merge_size=merge_size,
                image_mean=list(image_mean),
                image_std=list(image_std),
            )
        while len(_IMAGE_PROCESSORS) >= 8:
            _IMAGE_PROCESSORS.pop(next(iter(_IMAGE_PROCESSORS)))
        _IMAGE_PROCESSORS[key] = proc
    return proc


def build_processor_config(
    model: str,
    *,
    family: str,
    fps: float | None = None,
    num_frames: int | None = None,
    min_pixels: int | None = None,
    max_pixels: int | None = None,
    video_max_pixels: int | None = None,
) -> ProcessorConfig:
    """The preprocessing numbers for ``model``: its checkpoint's processor files, or the family's defaults.

    A checkpoint's files may be in the published layout (preprocessor_config.json and
    video_preprocessor_config.json) or in the one transformers 5 saves (one processor_config.json);
    ``source`` names what was read. The image processor is built here (it is cheap) and its class recorded
    as ``image_processor``, so a run resumed after transformers would pick another backend is refused.
    ``fps`` and ``num_frames`` are exclusive; with neither the processor's own default (2 fps) applies.
    """
    if fps is not None and num_frames is not None:
        raise InputRefused("give either fps or num_frames for video sampling, not both")
    defaults = _FAMILY_DEFAULTS.get(family)
    if defaults is None:
        raise InputRefused(
            f"no published preprocessing known for the {family!r} family; vlfast extract supports Qwen2-VL, "
            "Qwen2.5-VL and Qwen3-VL(-MoE) processors"
        )
    values: dict[str, Any] = dict(defaults)
    video_cfg: dict[str, Any] = {}
    if model.startswith("ref:"):
        source = f"published {family} defaults (vlfast.extraction.decode.preprocess._FAMILY_DEFAULTS)"
    else:
        image_cfg, image_from, video_cfg, video_from = _processor_dicts(Path(model))
        if video_from is None:
            source = f"{image_from} (video: {family} defaults)"
        elif image_from.endswith(" (image_processor)") and video_from.endswith(" (video_processor)"):
            source = f"{image_from.removesuffix(' (image_processor)')} (image_processor and video_processor)"
        else:
            source = f"{image_from} and {video_from}"
        lo, hi = _size_pixels(image_cfg, values["image_min_pixels"], values["image_max_pixels"])
        values.update(
            image_min_pixels=lo,
            image_max_pixels=hi,
            image_mean=tuple(image_cfg.get("image_mean", values["image_mean"])),
            image_std=tuple(image_cfg.get("image_std", values["image_std"])),
            patch_size=int(image_cfg.get("patch_size", values["patch_size"])),
        )
        if video_cfg:
            lo, hi = _size_pixels(video_cfg, values["video_min_pixels"], values["video_max_pixels"])
            values.update(
                video_min_pixels=lo,
                video_max_pixels=hi,
                video_mean=tuple(video_cfg.get("image_mean", values["video_mean"])),
                video_std=tuple(video_cfg.get("image_std", values["video_std"])),
            )
        values["temporal_patch_size"] = int(image_cfg.get("temporal_patch_size", 2))
        values["merge_size"] = int(image_cfg.get("merge_size", 2))
        values["rescale_factor"] = float(image_cfg.get("rescale_factor", 1 / 255))
    if min_pixels is not None:
        values["image_min_pixels"] = int(min_pixels)
    if max_pixels is not None:
        values["image_max_pixels"] = int(max_pixels)
    if video_max_pixels is not None:
        values["video_max_pixels"] = int(video_max_pixels)
    if num_frames is None and fps is None:
        fps = video_cfg.get("fps", 2.0) if video_cfg.get("num_frames") is None else None
        num_frames = video_cfg.get("num_frames")
    numbers = {
        "patch_size": values["patch_size"],
        "temporal_patch_size": values.get("temporal_patch_size", 2),
        "merge_size": values.get("merge_size", 2),
        "image_mean": tuple(float(x) for x in values["image_mean"]),
        "image_std": tuple(float(x) for x in values["image_std"]),
    }
    image_processor = _image_processor(None if model.startswith("ref:") else model, **numbers)
    return ProcessorConfig(
        source=source,
        image_processor=type(image_processor).__name__,
        **numbers,
        image_min_pixels=values["image_min_pixels"],
        image_max_pixels=values["image_max_pixels"],
        video_min_pixels=values["video_min_pixels"],
        video_max_pixels=values["video_max_pixels"],
        video_mean=tuple(float(x) for x in values["video_mean"]),
        video_std=tuple(float(x) for x in values["video_std"]),
        frame_sampling=values["frame_sampling"],
        fps=None if fps is None else float(fps),
        num_frames=None if num_frames is None else int(num_frames),
        min_frames=int(video_cfg.get("min_frames", 4)),
        max_frames=int(video_cfg.get("max_frames", 768)),
        cap_pixels_per_frame=bool(video_cfg.get("cap_pixels_per_frame") or False),
        max_video_tokens=int(video_cfg.get("max_video_tokens", 768)),
        rescale_factor=values.get("rescale_factor", 1 / 255),
    )


# --------------------------------------------------------------------------------------------- files

# A sample's media: a file path, a member of a WebDataset tar shard, or a URL, read in place.
Media = str | TarMember | RemoteFile


def _media(sample: Sample) -> Media:
    return sample.member if sample.member is not None else sample.paths[0]


def _at_url(media: Media) -> bool:
    """Whether ``media`` is read from storage over the network (where failures may be transient)."""
    return isinstance(media, RemoteFile) or (isinstance(media, TarMember) and media.at_url)


def _checked_media(media: Media) -> int:
    """Size in bytes of a readable, non-empty file or tar member; SampleError saying why not otherwise."""
    if isinstance(media, RemoteFile):
        try:
            size = media.size()
        except OSError as e:  # the message names the URL, never the storage options
            raise SampleError(str(e)) from None
        if size == 0:
            raise SampleError(f"empty file (0 bytes): {media}")
        return size
    if not isinstance(media, TarMember):
        return _checked_file(media).st_size
    if media.at_url:  # no request here: a ranged read past the object's end says "truncated shard" itself
        if media.size == 0:
            raise SampleError(f"empty file (0 bytes): {media}")
        return media.size
    shard_size = _checked_file(media.shard).st_size
    if media.size == 0:
        raise SampleError(f"empty file (0 bytes): {media}")
    if shard_size < media.offset + media.size:  # cut since it was listed
        raise SampleError(
            f"truncated shard: {media.shard} ends at byte {shard_size:,}, inside member {media.name!r} "
            f"(bytes {media.offset:,} to {media.offset + media.size:,})"
        )
    return media.size


def _checked_file(path: str) -> os.stat_result:
    """The file's stat, or SampleError saying why there is no readable file at ``path``."""
    try:
        st = os.stat(path)
    except OSError as e:
        if e.errno == errno.ELOOP:
            raise SampleError(f"symlink loop: {path}") from None
        if os.path.islink(path):
            try:
                target = os.readlink(path)
            except OSError:
                target = "?"
            raise SampleError(f"dangling symlink: {path} -> {target}") from None
        if e.errno in (errno.ENOENT, errno.ENOTDIR, errno.ENAMETOOLONG):
            raise SampleError(f"file not found: {path}") from None
        raise SampleError(f"cannot access {path}: {e.strerror or e}") from None
    if not stat.S_ISREG(st.st_mode):
        raise SampleError(f"not a file: {path}")
    if st.st_size == 0:
        raise SampleError(f"empty file (0 bytes): {path}")
    return st


# --------------------------------------------------------------------------------------------- images


def load_image(path: Media):
    """Open an image (a file, or a tar shard's member) as PIL, normalising what transformers' processors
    mishandle; raise SampleError.

    Animated images give their first frame. 16-bit and float images are scaled to 8 bits (PIL's
    ``convert`` would clip them to white); CMYK goes to RGB; palette, LA and RGBA images are left to the
    processor, which composites transparency on white.
    """
    from PIL import Image, UnidentifiedImageError

    _checked_media(path)
    try:
        # A member or URL is read whole (an image is small): the image then holds no open file.
        img = Image.open(Path(path) if isinstance(path, str) else io.BytesIO(path.read_bytes()))
        img.seek(0)
        img.load()
    except UnidentifiedImageError:
        raise SampleError(f"not an image PIL can read: {path}") from None
    except Image.DecompressionBombError as e:
        raise SampleError(f"image too large (decompression bomb guard): {e}") from None
    except (OSError, SyntaxError, ValueError) as e:  # truncated or corrupt data
        raise SampleError(f"unreadable or truncated image: {e}") from None
    w, h = img.size
    if w < 1 or h < 1:
        raise SampleError(f"image has no pixels ({w}x{h})")
    if max(w, h) / min(w, h) > MAX_ASPECT_RATIO:
        raise SampleError(
            f"aspect ratio {max(w, h) / min(w, h):.0f}:1 of a {w}x{h} image exceeds Qwen's {MAX_ASPECT_RATIO}:1 limit"
        )
    mode = img.mode
    if mode in ("I;16", "I;16B", "I;16L", "I;16N", "I", "F"):
        arr = np.asarray(img, dtype=np.float64)
        # 16-bit data fills 0..65535; 32-bit int/float images are scaled by their own range.
        top = 65535.0 if mode.startswith("I;16") or arr.max(initial=0) <= 65535 else float(arr.max())
        top = 255.0 if arr.max(initial=0) <= 255 and mode == "F" else top
        img = Image.fromarray(np.clip(np.round(arr / top * 255.0), 0, 255).astype(np.uint8))
    elif mode == "CMYK":
        img = img.convert("RGB")
    elif mode not in ("RGB", "RGBA", "L", "LA", "P", "PA", "1"):
        img = img.convert("RGBA" if "A" in mode else "RGB")
    return img


def _rgb_array(img) -> np.ndarray:
    """(H, W, 3) uint8, transparency composited on white like transformers' convert_to_rgb."""
    from PIL import Image

    if img.mode != "RGB":
        rgba = img.convert("RGBA")
        background = Image.new("RGBA", rgba.size, (255, 255, 255))
        img = Image.alpha_composite(background, rgba).convert("RGB")
    return np.asarray(img, dtype=np.uint8)


# --------------------------------------------------------------------------------------------- videos


def sample_frame_indices(total: int, video_fps: float | None, cfg: ProcessorConfig) -> np.ndarray:
    """Which frames of a ``total``-frame video to keep, by the rule ``cfg.frame_sampling`` names."""
    if total < 1:
        raise SampleError("video has no frames")
    if cfg.frame_sampling == "qwen3-vl":  # Qwen3VLVideoProcessor.sample_frames
        n = cfg.num_frames
        if n is None:
            rate = video_fps or 24.0
            n = int(total / rate * cfg.fps)
            n = min(max(n, cfg.min_frames), cfg.max_frames, total)
        return np.linspace(0, total - 1, n).round().astype(int)
    t = cfg.temporal_patch_size  # Qwen2VLVideoProcessor.sample_frames
    if cfg.num_frames is not None:
        n = round(cfg.num_frames / t) * t
    else:
        rate = video_fps or 24.0
        max_frames = math.floor(min(cfg.max_frames, total) / t) * t
        n = min(max(total / rate * cfg.fps, cfg.min_frames), max_frames, total)
        n = math.floor(n / t) * t
    if n > total or n < 1:
        raise SampleError(f"cannot sample {n} frames from a {total}-frame video (rule qwen2-vl)")
    return torch.arange(0, total, total / n).int().numpy()


def video_resize_shape(num_frames: int, height: int, width: int, cfg: ProcessorConfig) -> tuple[int, int]:
    """(h, w) of every frame after resizing: the video ``smart_resize`` with the total pixel budget."""
    factor, tf = cfg.factor, cfg.temporal_patch_size
    max_pixels = cfg.video_max_pixels
    if cfg.cap_pixels_per_frame:
        frame_cap = cfg.max_video_tokens * factor * factor
        per_frame = max(min(frame_cap, cfg.video_max_pixels // num_frames), int(cfg.video_min_pixels * 1.05))
        max_pixels = per_frame * num_frames
    if height < factor or width < factor:
        scale = max(factor / height, factor / width)
        height, width = int(height * scale), int(width * scale)
    if max(height, width) / min(height, width) > MAX_ASPECT_RATIO:
        raise SampleError(f"video aspect ratio {max(height, width) / min(height, width):.0f}:1 exceeds 200:1")
    h_bar = round(height / factor) * factor
    w_bar = round(width / factor) * factor
    t_bar = round(num_frames / tf) * tf
    if t_bar * h_bar * w_bar > max_pixels:
        beta = math.sqrt((num_frames * height * width) / max_pixels)
        h_bar = max(factor, math.floor(height / beta / factor) * factor)
        w_bar = max(factor, math.floor(width / beta / factor) * factor)
    elif t_bar * h_bar * w_bar < cfg.video_min_pixels:
        beta = math.sqrt(cfg.video_min_pixels / (num_frames * height * width))
        h_bar = math.ceil(height * beta / factor) * factor
        w_bar = math.ceil(width * beta / factor) * factor
    return h_bar, w_bar


def normalize_video_patches(patches: torch.Tensor, cfg: ProcessorConfig) -> torch.Tensor:
    """uint8 patches (N, C, T*P*P) -> float32 pixel_values (N, C*T*P*P), on whatever device they are.

    ``(x - 255 mean) / (255 std)`` per channel, as transformers' fused rescale+normalise computes it
    (float32 subtraction and division are exact IEEE operations, so any device gives the same bits).
    """
    shape = (1, 3, 1)
    mean = torch.tensor(cfg.video_mean, dtype=torch.float32).view(shape) * (1.0 / cfg.rescale_factor)
    std = torch.tensor(cfg.video_std, dtype=torch.float32).view(shape) * (1.0 / cfg.rescale_factor)
    mean, std = mean.to(patches.device), std.to(patches.device)
    return ((patches.to(torch.float32) - mean) / std).reshape(patches.shape[0], -1)


def patchify_video(
    frames: torch.Tensor, cfg: ProcessorConfig, *, normalize: bool = True
) -> tuple[torch.Tensor, tuple[int, int, int]]:
    """(T, 3, H, W) uint8 frames -> pixel_values (t*h*w, C*T*P*P) float32 and grid (t, h, w).

    Resize, rescale+normalise and patchify exactly as transformers' Qwen-VL video processors, in a
    cheaper order with bit-identical results: frames may be channels-last (as decoded; the uint8 resize
    kernel is fastest on that layout), and the patch permutation is done on uint8 before normalising,
    which is elementwise per channel and so commutes with it. With ``normalize=False`` the uint8 patches
    (N, C, T*P*P) are returned for :func:`normalize_video_patches` to finish later (4x fewer bytes to
    move between processes and to the device).
    """
    n = frames.shape[0]
    # smart_resize refuses fewer frames than the temporal patch; a one-frame clip is treated as the
    # processor treats an image: the frame repeated.
    h, w = video_resize_shape(max(n, cfg.temporal_patch_size), frames.shape[-2], frames.shape[-1], cfg)
    if (h, w) != tuple(frames.shape[-2:]):
        frames = F.interpolate(frames, size=(h, w), mode="bicubic", align_corners=False, antialias=True)
    tp, p, m = cfg.temporal_patch_size, cfg.patch_size, cfg.merge_size
    if pad := -n % tp:
        frames = torch.cat((frames, frames[-1:].expand(pad, -1, -1, -1)), dim=0)
    gt, gh, gw = frames.shape[0] // tp, h // p, w // p
    patches = frames.reshape(gt, tp, 3, gh // m, m, p, gw // m, m, p)
    # (gt, gh/m, gw/m, m, m, C, tp, p, p): rows (t, h/2, w/2, 2, 2), columns (C, T, P, P)
    patches = patches.permute(0, 3, 6, 4, 7, 2, 1, 5, 8).reshape(gt * gh * gw, 3, tp * p * p)
    if not normalize:
        return patches, (gt, gh, gw)
    return normalize_video_patches(patches, cfg), (gt, gh, gw)


def _video_failure(path: Media, size: int, reason: str, *, cut: bool = False) -> SampleError:
    """The SampleError for a video that failed with ``reason``: "truncated or corrupt video" when the file
    is shorter than its own container says (whatever FFmpeg made of that), or when ``cut`` says the failure
    looks like it (the end of the file met while opening; a failure after the container opened: a demuxer
    reading past the data, a seek back to the start refused, a packet the decoder rejects); otherwise
    ``reason`` as it is (no video stream, no decodable frames, "unreadable or corrupt video")."""
    where = container_truncation(path, size)
    if where is not None:
        return SampleError(f"truncated or corrupt video: {where} ({reason})")
    if cut:
        return SampleError(f"truncated or corrupt video: {reason}")
    return SampleError(reason)


def _packet_pts(container, stream, *, rewind: bool = True) -> list[int | None]:
    """Presentation timestamps of the stream's packets in decode order, read without decoding anything."""
    pts = [packet.pts for packet in container.demux(stream) if packet.size > 0]
    if rewind:
        container.seek(0)
    return pts


# What PyAV raises for data it cannot read: FFmpegError (InvalidDataError is also a ValueError, EOFError
# an EOFError), and OSError, ValueError, IndexError, EOFError, RuntimeError from its Python layer.
_DECODE_ERRORS: tuple[type[BaseException], ...] = (OSError, ValueError, IndexError, EOFError, RuntimeError)


def read_video(path: Media, cfg: ProcessorConfig) -> tuple[torch.Tensor, dict[str, Any]]:
    """Decode the sampled frames of a video (a file, or a tar shard's member read in place) with PyAV:
    (T, 3, H, W) uint8 and sampling metadata."""
    import av

    size = _checked_media(path)
    step = None  # what was being done when it failed; None: opening the container
    try:
        with contextlib.ExitStack() as files:
            source = str(path) if isinstance(path, str) else files.enter_context(path.open())
            container = files.enter_context(av.open(source))
            if not container.streams.video:
                raise SampleError(f"no video stream in {path}")
            stream = container.streams.video[0]
            rate = stream.average_rate or stream.guessed_rate
            video_fps = float(rate) if rate else None
            step = "reading its packets"
            pts = _packet_pts(container, stream, rewind=False)
            if (
                not pts
            ):  # a stream header and no packet: seeking in it fails with an OS error that says nothing
                raise SampleError(f"video has no frames: its video stream holds no packets ({path})")
            step = "seeking back to its start"
            container.seek(0)
            # The container's own count, as transformers' read_video_pyav samples by; containers without
            # one (webm, some mkv) are counted by packets.
            total = int(stream.frames or 0) or len(pts)
            indices = sample_frame_indices(total, video_fps, cfg)
            step = "decoding it"
            frames = _decode_sparse(container, stream, indices, pts)
            if frames is None:  # timestamps unusable, or a frame did not come back: decode them all
                container.seek(0)
                frames = _decode_at(container, stream, indices)
            if len(frames) < len(indices):
                # The container promised more frames than decode: re-sample over those that exist.
                container.seek(0)
                all_frames = _decode_at(container, stream, None)
                if not all_frames:
                    raise SampleError(f"no decodable frames in {path}")
                total = len(all_frames)
                indices = sample_frame_indices(total, video_fps, cfg)
                frames = [all_frames[i] for i in indices]
    except SampleError as e:
        raise _video_failure(path, size, str(e)) from None
    except (av.error.FFmpegError, *_DECODE_ERRORS) as e:
        if _at_url(path) and is_transient(e):  # the store failed mid-stream, not the video
            raise transient_error(str(path), e) from e
        if step is None and not isinstance(e, EOFError):  # not a container FFmpeg can open
            raise _video_failure(path, size, f"unreadable or corrupt video: {e}") from None
        raise _video_failure(path, size, f"{step or 'opening it'} failed: {e}", cut=True) from None
    if not frames:
        raise _video_failure(path, size, f"no decodable frames in {path}")
    video = torch.from_numpy(np.stack(frames)).permute(0, 3, 1, 2)  # (T, 3, H, W), channels-last strides
    return video, {"video_fps": video_fps, "total_frames": total, "frame_indices": indices.tolist()}


def _decode_sparse(container, stream, indices: np.ndarray, pts: list[int | None]) -> list[np.ndarray] | None:
    """RGB frames at ``indices`` without decoding the frames nothing refers to; None to fall back.

    A frame's index is its rank in presentation order, which the packets' timestamps give before any
    decoding. Packets of unwanted frames are sent with ``skip_frame = NONREF``: the decoder drops them
    only if no other frame is predicted from them (H.264/HEVC B-frames outside the pyramid, MPEG-4 B-VOPs),
    so every wanted frame decodes from exactly the references it would in a full decode, bit for bit.
    Decoders without the option decode everything. On 10 s of 30 fps H.264 (x264 defaults) with 8
    frames sampled this decodes about half the frames and takes ~30% less time. Returns None, for the
    caller's sequential decode, when timestamps are missing or repeated or a wanted frame did not come back.
    """
    if not pts or None in pts or len(set(pts)) != len(pts):
        return None
    rank = {t: k for k, t in enumerate(sorted(pts))}
    wanted = set(indices.tolist())
    got: dict[int, np.ndarray] = {}
    ctx = stream.codec_context
    try:
        for packet in container.demux(stream):
            if packet.pts is not None:  # the final flush packet has none, and keeps the last setting
                ctx.skip_frame = "DEFAULT" if rank.get(packet.pts) in wanted else "NONREF"
            for frame in ctx.decode(packet):
                k = rank.get(frame.pts)
                if k in wanted and k not in got:
                    got[k] = frame.to_ndarray(format="rgb24")
            if len(got) == len(wanted):
                break
    finally:
        ctx.skip_frame = "DEFAULT"
    if len(got) < len(wanted):
        return None
    return [got[k] for k in indices.tolist()]


def _decode_at(container, stream, indices: np.ndarray | None) -> list[np.ndarray]:
    """RGB frames at ``indices`` (repeats allowed) in one sequential decode; all frames when None."""
    wanted: dict[int, int] | None = None
    if indices is not None:
        wanted = {}
        for i in indices.tolist():
            wanted[i] = wanted.get(i, 0) + 1
        last = max(wanted)
    out: list[np.ndarray] = []
    for i, frame in enumerate(container.decode(stream)):
        if wanted is None:
            out.append(frame.to_ndarray(format="rgb24"))
            continue
        if i in wanted:
            rgb = frame.to_ndarray(format="rgb24")
            out.extend([rgb] * wanted[i])
        if i >= last:
            break
    return out


# ----------------------------------------------------------------------------------------- the worker


@dataclass
class Preprocessor:
    """Callable run in DataLoader workers: a sample in, tensors (or a SampleError) out.

    Holds only picklable state: the transformers image processor is built lazily (or taken from the one
    :func:`build_processor_config` built) and is not pickled with it. It must be of the class
    ``cfg.image_processor`` records; another one (transformers picks its backend by what is installed, and
    the backends differ slightly in pixels) is refused rather than mixed into a run.
    """

    cfg: ProcessorConfig
    image_processor_dir: str | None = None  # checkpoint to load the image processor from; None: defaults
    defer_video_normalize: bool = False  # videos as uint8 (N, C, T*P*P): see normalize_video_patches
    _image_processor: Any = field(default=None, init=False, repr=False)

    def __getstate__(self) -> dict[str, Any]:
        state = dict(self.__dict__)
        state["_image_processor"] = None
        return state

    def image_processor(self):
        if self._image_processor is None:
            cfg = self.cfg
            proc = _image_processor(
                self.image_processor_dir,
                patch_size=cfg.patch_size,
                temporal_patch_size=cfg.temporal_patch_size,
                merge_size=cfg.merge_size,
                image_mean=cfg.image_mean,
                image_std=cfg.image_std,
            )
            built = type(proc).__name__
            if built != cfg.image_processor:
                raise RuntimeError(
                    f"the image processor is a {built} here, but the configuration records "
                    f"{cfg.image_processor}: transformers picks the backend by what is installed "
                    "(torchvision or not) and they differ slightly in pixels; build the configuration again "
                    "in this environment (a resumed run then refuses the change), or restore the one it was "
                    "built in"
                )
            self._image_processor = proc
        return self._image_processor

    def _size(self) -> dict[str, int]:
        return {"shortest_edge": self.cfg.image_min_pixels, "longest_edge": self.cfg.image_max_pixels}

    def image(self, path: Media) -> tuple[torch.Tensor, tuple[int, int, int], dict[str, Any]]:
        img = load_image(path)
        meta = {"width": img.size[0], "height": img.size[1], "mode": img.mode}
        try:
            out = self.image_processor()(images=[img], size=self._size(), return_tensors="pt")
        except ValueError as e:  # e.g. smart_resize's aspect-ratio check
            raise SampleError(f"the image processor refused {path}: {e}") from None
        grid = tuple(int(x) for x in out["image_grid_thw"][0].tolist())
        return out["pixel_values"].to(torch.float32), grid, meta  # (t*h*w, C*T*P*P)

    def video(self, sample: Sample) -> tuple[torch.Tensor, tuple[int, int, int], dict[str, Any]]:
        if sample.kind == "video":
            frames, meta = read_video(_media(sample), self.cfg)
        else:
            arrays = [_rgb_array(load_image(p)) for p in sample.paths]
            shapes = {a.shape for a in arrays}
            if len(shapes) != 1:
                raise SampleError(f"frames of one clip differ in size: {sorted(shapes)}")
            frames = torch.from_numpy(np.stack(arrays)).permute(0, 3, 1, 2)  # channels-last strides
            meta = {
                "video_fps": self.cfg.frames_list_fps,
                "total_frames": len(arrays),
                "frame_indices": list(range(len(arrays))),
            }
        meta.update(height=int(frames.shape[-2]), width=int(frames.shape[-1]))
        pixels, grid = patchify_video(frames, self.cfg, normalize=not self.defer_video_normalize)
        return pixels, grid, meta

    def __call__(self, sample: Sample) -> tuple[torch.Tensor, tuple[int, int, int], dict[str, Any]]:
        """``(pixel_values (N, C*T*P*P) float32, grid (t, h, w), meta)``; raises SampleError.

        With ``defer_video_normalize`` a video's pixel_values are uint8 (N, C, T*P*P) instead.
        """
        if sample.kind == "image":
            return self.image(_media(sample))
        return self.video(sample)
