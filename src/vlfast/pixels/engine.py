"""The pixel engine: the settings built from a checkpoint (:func:`build_processor_config`), and one input (an
image, a video, a clip's frames: an :class:`Item`) made the vision tower's input by the model's own rules.

Videos cannot use transformers' video processors without torchvision, so they are decoded with PyAV and
processed by the same rules (:mod:`~vlfast.pixels.video`), proven against transformers' own functions in the
tests. Bad inputs raise :class:`SampleError` with a reason a person can act on.
"""

from __future__ import annotations

import io
import json
import math
import os
from dataclasses import dataclass, field
from numbers import Real
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

import numpy as np

from vlfast.errors import InputRefused
from vlfast.models.ref import Answers, ModelRef
from vlfast.pixels.media import MAX_ASPECT_RATIO, Media, SampleError, checked_media
from vlfast.pixels.recipe import RECIPE_PIXELS, is_embedding_checkpoint
from vlfast.pixels.settings import PIXEL_SETTINGS, TORCHVISION_IMAGE_PROCESSORS, ProcessorConfig

if TYPE_CHECKING:  # pragma: no cover
    import torch

__all__ = [
    "Clip",
    "Item",
    "Preprocessor",
    "ProcessorConfig",
    "SampleError",
    "build_processor_config",
    "conformed_image",
    "load_image",
]

OPENAI_CLIP_MEAN = [0.48145466, 0.4578275, 0.40821073]
OPENAI_CLIP_STD = [0.26862954, 0.26130258, 0.27577711]


# Published preprocessing of each family (the Hugging Face checkpoints' processor files; transformers'
# class defaults where the checkpoint keeps them).
_FAMILY_DEFAULTS: dict[str, dict[str, Any]] = {
    "qwen3_vl": {
        "patch_size": 16,
        "image_min_pixels": 65_536,
        "image_max_pixels": 16_777_216,
        "video_min_pixels": 4_096,
        "video_max_pixels": 25_165_824,
        **dict.fromkeys(("image_mean", "image_std", "video_mean", "video_std"), (0.5, 0.5, 0.5)),
        "frame_sampling": "qwen3-vl",
    },
    "qwen2_vl": {
        "patch_size": 14,
        "image_min_pixels": 3_136,
        "image_max_pixels": 12_845_056,
        "video_min_pixels": 128 * 28 * 28,
        "video_max_pixels": 768 * 28 * 28,
        **dict.fromkeys(("image_mean", "video_mean"), tuple(OPENAI_CLIP_MEAN)),
        **dict.fromkeys(("image_std", "video_std"), tuple(OPENAI_CLIP_STD)),
        "frame_sampling": "qwen2-vl",
        # Qwen2VLVideoProcessor: size.longest_edge bounds each frame; its max_video_tokens (used only with
        # cap_pixels_per_frame) is a context length, 128,000 by default
        "video_sizing": "qwen2-vl",
        "max_video_tokens": 128_000,
    },
}
_FAMILY_DEFAULTS["qwen3_vl_moe"] = _FAMILY_DEFAULTS["qwen3_vl"]
_FAMILY_DEFAULTS["qwen2_5_vl"] = _FAMILY_DEFAULTS["qwen2_vl"]


def _size_pixels(cfg: dict[str, Any], default_min: int, default_max: int) -> tuple[int, int]:
    size = cfg.get("size") or {}
    lo = cfg.get("min_pixels") or size.get("shortest_edge") or size.get("min_pixels") or default_min
    hi = cfg.get("max_pixels") or size.get("longest_edge") or size.get("max_pixels") or default_max
    return int(lo), int(hi)


# A checkpoint's processor files come in two layouts: the published one (preprocessor_config.json and
# video_preprocessor_config.json), and the one transformers >= 5's save_pretrained writes (one
# processor_config.json with "image_processor" and "video_processor" entries). The nested entry wins.
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


def _processor_dicts(
    path: Path, *, use_transformers: bool = True, facts: Answers | None = None
) -> tuple[dict, str, dict, str | None]:
    """(image processor dict, where from, video processor dict or {}, where from or None) of a checkpoint.

    The dicts are those transformers itself loads (``ImageProcessingMixin.get_image_processor_dict`` and
    ``get_video_processor_config``) where it has these functions, else read here in the same order; ``facts``
    gives them as recorded, where it may (see :mod:`~vlfast.extraction.store.facts`).
    """
    nested_file = path / PROCESSOR_CONFIG
    image_file, video_file = path / IMAGE_PROCESSOR_CONFIG, path / VIDEO_PROCESSOR_CONFIG
    nested = _json_object(nested_file) if nested_file.is_file() else {}

    def read(kind: str, file: Path) -> tuple[str | None, dict]:
        if isinstance(nested.get(kind), dict):
            return f"{nested_file} ({kind})", nested[kind]
        return (str(file), _json_object(file)) if file.is_file() else (None, {})

    image_from, image_cfg = read("image_processor", image_file)
    if image_from is None:
        raise FileNotFoundError(
            f"{path} has no preprocessor_config.json, nor a processor_config.json with an image_processor "
            "entry: copy preprocessor_config.json and video_preprocessor_config.json from the model's "
            "Hugging Face repository into it, or save the model's processor into it with transformers' "
            "save_pretrained"
        )
    video_from, video_cfg = read("video_processor", video_file)
    if video_from is None and use_transformers and image_file.is_file():
        # transformers' get_video_processor_config falls back to preprocessor_config.json: so does vlfast
        video_from = f"{image_file} (as transformers reads it for videos)"
        video_cfg = _json_object(image_file)
    if use_transformers:

        def ask() -> tuple[dict, dict]:
            try:
                from transformers.image_processing_base import ImageProcessingMixin
                from transformers.models.auto.video_processing_auto import get_video_processor_config
            except ImportError:  # an older transformers: the files as read above
                return image_cfg, video_cfg
            image, _ = ImageProcessingMixin.get_image_processor_dict(str(path), local_files_only=True)
            return image, get_video_processor_config(str(path), local_files_only=True) or video_cfg

        image_cfg, video_cfg = ask() if facts is None else facts.answer("processor files", ask)
    return image_cfg, image_from, video_cfg, video_from


# Image processors built, by what determines them: build_processor_config builds the one it records, and
# the Preprocessor of the same run uses that very object instead of loading it again.
_IMAGE_PROCESSORS: dict[tuple, Any] = {}


def _image_processor(
    model_dir: str | None,
    *,
    cls_name: str | None = None,
    patch_size: int,
    temporal_patch_size: int,
    merge_size: int,
    image_mean: tuple[float, ...],
    image_std: tuple[float, ...],
):
    """transformers' image processor: the checkpoint's own (``AutoImageProcessor``, whose backend depends on
    what is installed; ``cls_name`` "Qwen2VLImageProcessorPil" builds that one), or, with no checkpoint, the
    PIL one with these numbers. Cached per checkpoint (its processor files' identity) or numbers."""
    if model_dir is not None:
        files = []
        for name in (PROCESSOR_CONFIG, IMAGE_PROCESSOR_CONFIG):
            try:
                st = os.stat(Path(model_dir, name))
            except OSError:
                continue
            files.append((name, st.st_ino, st.st_size, st.st_mtime_ns))
        key: tuple = ("checkpoint", os.path.realpath(model_dir), tuple(files), cls_name)
    else:
        key = ("defaults", patch_size, temporal_patch_size, merge_size, tuple(image_mean), tuple(image_std))
    proc = _IMAGE_PROCESSORS.get(key)
    if proc is None:
        if model_dir is not None and cls_name != "Qwen2VLImageProcessorPil":
            from transformers import AutoImageProcessor

            proc = AutoImageProcessor.from_pretrained(model_dir, local_files_only=True)
        else:
            from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

            if model_dir is not None:
                proc = Qwen2VLImageProcessorPil.from_pretrained(model_dir, local_files_only=True)
            else:
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


def _pixel_settings(image_cfg: dict[str, Any], video_cfg: dict[str, Any]) -> dict[str, Any]:
    """The settings of the processors' files that change pixels (absent: PIXEL_SETTINGS' defaults, the Qwen-VL
    processor classes'), as ProcessorConfig fields (the video processor's named with "video_")."""
    out: dict[str, Any] = {}
    for name, default in PIXEL_SETTINGS.items():
        key = name.removeprefix("video_")
        value = out[name] = (video_cfg if name.startswith("video_") else image_cfg).get(key, default)
        if key == "resample":
            try:
                out[name] = int(value)
            except (TypeError, ValueError):
                raise InputRefused(
                    f"the processor's resample is {value!r}: expected a PIL resampling code (0-5)"
                ) from None
        elif key == "rescale_factor":
            out[name] = float(value)
        elif not isinstance(value, bool):
            raise InputRefused(f"the processor's {key} is {value!r}: expected true or false")
    return out


def build_processor_config(
    model: str,
    *,
    family: str,
    fps: float | None = None,
    num_frames: int | None = None,
    min_pixels: int | None = None,
    max_pixels: int | None = None,
    video_max_pixels: int | None = None,
    exif_orientation: bool | None = None,
    image_processor: str | None = None,
    image_reading: str | None = None,
    video_rotation: bool | None = None,
    thin_images: str | None = None,
    facts: Answers | None = None,
) -> ProcessorConfig:
    """The preprocessing numbers for ``model``: its checkpoint's processor files (either layout), or the
    family's defaults. The image processor's class is recorded, so a run resumed after transformers would
    pick another backend is refused. With ``facts`` (:class:`~vlfast.extraction.store.facts.ModelFacts`)
    what transformers answers comes from OUT's record, without importing transformers.

    ``image_processor``, ``image_reading``, ``video_rotation`` and ``thin_images`` are as recorded by the OUT
    resumed, or None for a new OUT: then the Qwen3-VL-Embedding recipe reads, turns and sizes as its
    reference (qwen-vl-utils) does and keeps the image class transformers picks; every other model gets
    transformers' torchvision processor (done by vlfast), EXIF and display-matrix rotation, and the
    processor's thin-image rule. ``fps`` and ``num_frames`` are exclusive (neither: the processor's 2 fps).
    InputRefused names a number given that is not finite or not whole.
    """
    given = {"min_pixels": min_pixels, "max_pixels": max_pixels, "video_max_pixels": video_max_pixels}
    _check_given(fps=fps, num_frames=num_frames, **given)
    if fps is not None and num_frames is not None:
        raise InputRefused("give either fps or num_frames for video sampling, not both")
    values, video_cfg, source, recipe = _model_values(model, family, facts)
    fields = ("image_min_pixels", "image_max_pixels", "video_max_pixels")
    values.update({key: int(value) for key, value in zip(fields, given.values()) if value is not None})
    if num_frames is None and fps is None:
        fps = video_cfg.get("fps", 2.0) if video_cfg.get("num_frames") is None else None
        num_frames = video_cfg.get("num_frames")
    numbers = _patch_numbers(values)

    # read at the call (not imported above): the module's attribute, as a test swaps it
    from vlfast.pixels.settings import transparency_rule

    transparency = transparency_rule() if facts is None else facts.answer("transparency", transparency_rule)
    upright = not recipe if exif_orientation is None else bool(exif_orientation)
    image_class = _image_processor_class(model, image_processor, recipe, numbers, facts)
    if thin_images is None:  # a new OUT: the recipe's rule where vlfast resizes, else the processor's
        thin = values.get("thin_images", "processor")
        thin_images = thin if image_class in TORCHVISION_IMAGE_PROCESSORS else "processor"
    return ProcessorConfig(
        source=source,
        image_processor=image_class,
        **numbers,
        **_video_numbers(values, video_cfg, fps, num_frames),
        image_min_pixels=values["image_min_pixels"],
        image_max_pixels=values["image_max_pixels"],
        rescale_factor=values.get("rescale_factor", 1 / 255),
        exif_orientation=upright,
        **{k: values[k] for k in PIXEL_SETTINGS if k in values},
        transparency=transparency,
        image_reading=image_reading or ("qwen-vl-utils" if recipe else "vlfast"),
        video_rotation=upright if video_rotation is None else bool(video_rotation),
        thin_images=thin_images,
    )


def _patch_numbers(values: dict[str, Any]) -> dict[str, Any]:
    """The numbers an image processor is built from: the patch sizes and the image normalisation."""
    return {
        "patch_size": values["patch_size"],
        "temporal_patch_size": values.get("temporal_patch_size", 2),
        "merge_size": values.get("merge_size", 2),
        "image_mean": tuple(float(x) for x in values["image_mean"]),
        "image_std": tuple(float(x) for x in values["image_std"]),
    }


def _model_values(
    model: str, family: str, facts: Answers | None
) -> tuple[dict[str, Any], dict[str, Any], str, bool]:
    """The family's published numbers, over them the checkpoint's files (or the embedding recipe's numbers):
    (values by ProcessorConfig field, the video processor's own settings, the source named, whether the
    embedding recipe applies)."""
    defaults = _FAMILY_DEFAULTS.get(family)
    if defaults is None:
        raise InputRefused(
            f"no published preprocessing known for the {family!r} family; vlfast extract supports Qwen2-VL, "
            "Qwen2.5-VL and Qwen3-VL(-MoE) processors"
        )
    values: dict[str, Any] = dict(defaults)
    video_cfg: dict[str, Any] = {}
    if ModelRef.of(model).is_reference:
        source = f"published {family} defaults (vlfast.pixels.engine._FAMILY_DEFAULTS)"
    else:  # the checkpoint's processor files, over the family's defaults
        image_cfg, image_from, video_cfg, video_from = _processor_dicts(Path(model), facts=facts)
        if video_from is None:
            source = f"{image_from} (video: {family} defaults)"
        elif image_from.endswith(" (image_processor)") and video_from.endswith(" (video_processor)"):
            source = f"{image_from.removesuffix(' (image_processor)')} (image_processor and video_processor)"
        else:
            source = f"{image_from} and {video_from}"
        for kind, cfg in (("image", image_cfg), ("video", video_cfg)):
            if cfg or kind == "image":  # both files name their normalisation image_mean and image_std
                lo, hi = _size_pixels(cfg, values[f"{kind}_min_pixels"], values[f"{kind}_max_pixels"])
                values[f"{kind}_min_pixels"], values[f"{kind}_max_pixels"] = lo, hi
                for stat in ("mean", "std"):
                    values[f"{kind}_{stat}"] = tuple(cfg.get(f"image_{stat}", values[f"{kind}_{stat}"]))
        values["patch_size"] = int(image_cfg.get("patch_size", values["patch_size"]))
        values["temporal_patch_size"] = int(image_cfg.get("temporal_patch_size", 2))
        values["merge_size"] = int(image_cfg.get("merge_size", 2))
        values["rescale_factor"] = float(image_cfg.get("rescale_factor", 1 / 255))
        values.update(_pixel_settings(image_cfg, video_cfg))
    recipe = is_embedding_checkpoint(model)
    if recipe:  # Qwen3-VL-Embedding prepares pixels its own way (pixels.recipe), not by its processor files
        values.update(RECIPE_PIXELS)
        source += "; Qwen3-VL-Embedding recipe (vlfast.pixels.recipe.RECIPE_PIXELS)"
        video_cfg = {k: RECIPE_PIXELS[k] for k in ("fps", "min_frames", "max_frames", "max_video_tokens")}
    return values, video_cfg, source, recipe


def _video_numbers(
    values: dict[str, Any], video_cfg: dict[str, Any], fps: float | None, num_frames: int | None
) -> dict[str, Any]:
    """The video fields of a ProcessorConfig: budgets, normalisation, sampling and sizing."""
    return {
        "video_min_pixels": values["video_min_pixels"],
        "video_max_pixels": values["video_max_pixels"],
        "video_mean": tuple(float(x) for x in values["video_mean"]),
        "video_std": tuple(float(x) for x in values["video_std"]),
        "frame_sampling": values["frame_sampling"],
        "fps": None if fps is None else float(fps),
        "num_frames": None if num_frames is None else int(num_frames),
        "min_frames": int(video_cfg.get("min_frames", 4)),
        "max_frames": int(video_cfg.get("max_frames", 768)),
        "cap_pixels_per_frame": bool(video_cfg.get("cap_pixels_per_frame") or False),
        "max_video_tokens": int(video_cfg.get("max_video_tokens", values.get("max_video_tokens", 768))),
        "video_sizing": values.get("video_sizing", "processor"),
    }


def _check_given(**given: Any) -> None:
    """InputRefused naming a number given that is not finite, not positive, or (all but ``fps``) not whole:
    int() would truncate 2.5 frames silently, and an infinite fps overflows the frame count."""
    for name, value in given.items():
        if value is None:
            continue
        if isinstance(value, bool) or not isinstance(value, Real) or not math.isfinite(value) or value <= 0:
            raise InputRefused(f"{name} must be a finite number above 0, got {value!r}")
        if name != "fps" and value != int(value):
            raise InputRefused(f"{name} must be a whole number, got {value!r}")


def _image_processor_class(
    model: str, asked: str | None, recipe: bool, numbers: dict[str, Any], facts: Answers | None
) -> str:
    """The image processor class a run uses (see :func:`build_processor_config`'s ``image_processor``)."""
    if asked is None and not recipe:  # a new OUT: transformers' default backend, done by vlfast
        return "Qwen2VLImageProcessor"
    if asked in TORCHVISION_IMAGE_PROCESSORS:
        return asked

    # transformers' own processor runs: the class asked or recorded, built here, or (the embedding recipe)
    # the one transformers picks, as its reference does
    def built() -> str:
        model_dir = ModelRef.of(model).folder
        return type(_image_processor(model_dir, cls_name=asked, **numbers)).__name__

    return built() if facts is None else facts.answer("image processor", built)


# --------------------------------------------------------------------------------------------- images


def load_image(path: Media, exif_orientation: bool = False, reading: str = "vlfast"):
    """Open an image (a file, or a tar shard's member) as PIL; raise SampleError. ``exif_orientation``: turned
    upright as transformers' ``load_image`` does (``PIL.ImageOps.exif_transpose``); animated: the first frame.

    ``reading`` "vlfast" (:data:`~vlfast.pixels.settings.IMAGE_READINGS`): 16-bit and float images scaled to 8
    bits (PIL's ``convert`` would clip them to white), CMYK to RGB, transparency left to the processor. The
    others read as a reference reads a path:

    - "decode_image": as transformers' torchvision image processors' ``fetch_images``: transparency dropped
      (scripts/decode_parity.py); 16-bit and float images refused (torchcodec and torchvision read them apart);
    - "load_image": as transformers' ``load_image``: ``convert("RGB")``, transparency left in ``img.info``;
    - "qwen-vl-utils": as its ``to_rgb``: RGBA pasted on white by its alpha, other modes ``convert("RGB")``.
    """
    from PIL import Image, ImageOps, UnidentifiedImageError

    from vlfast.pixels.image import orientation_tag

    checked_media(path)
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
    # exif_transpose copies the image even without an orientation tag: look at the tag first
    if exif_orientation and orientation_tag(img) not in (None, 1):
        try:
            img = ImageOps.exif_transpose(img)
        except Exception as e:  # noqa: BLE001 - only this file's EXIF block is parsed here: its data, not a bug
            raise SampleError(f"unreadable EXIF orientation: {type(e).__name__}: {e}") from None
    if reading == "vlfast":
        return conformed_image(img)
    img = conformed_image(img, keep_mode=True)
    if reading == "decode_image":
        if img.mode.startswith("I") or img.mode == "F":
            raise SampleError(
                f"an image of mode {img.mode} (16-bit or float) given by path: transformers' torchvision processor "
                "decodes it with torchcodec (scaled to 8 bits) or torchvision (16-bit values) by what is "
                "installed, so its pixels have no one reference; pass it opened (a PIL image is converted as "
                "the processor converts it), or convert the file to 8 bits"
            )
        img = img if img.mode == "RGB" else img.convert("RGB")
        img.info.pop("transparency", None)  # decoded to RGB values: no key left for the processor
        return img
    if reading == "qwen-vl-utils" and img.mode == "RGBA":
        white = Image.new("RGB", img.size, (255, 255, 255))
        white.paste(img, mask=img.split()[3])
        return white
    return img if img.mode == "RGB" else img.convert("RGB")


def conformed_image(img, keep_mode: bool = False):
    """A PIL image as the processors can take it (see :func:`load_image`); raise SampleError.
    ``keep_mode``: the size and aspect checks only, its mode left to the processor's conversion."""
    from PIL import Image

    w, h = img.size
    if w < 1 or h < 1:
        raise SampleError(f"image has no pixels ({w}x{h})")
    if max(w, h) / min(w, h) > MAX_ASPECT_RATIO:
        raise SampleError(
            f"aspect ratio {max(w, h) / min(w, h):.0f}:1 of a {w}x{h} image exceeds Qwen's {MAX_ASPECT_RATIO}:1 limit"
        )
    mode = img.mode
    if keep_mode:
        return img
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


# ----------------------------------------------------------------------------------------- the worker


class Item(Protocol):
    """What the preprocessor decodes: an image or a video (``kind`` "image" or "video") read from ``media``, or
    a clip's frame images (``kind`` "frames", ``paths`` in order)."""

    @property
    def kind(self) -> str: ...

    @property
    def paths(self) -> tuple[str, ...]: ...

    @property
    def media(self) -> Media: ...


@dataclass(frozen=True)
class Clip:
    """An input given by its files: an image or video file, or a clip's frame image files ("frames")."""

    kind: str
    paths: tuple[str, ...]

    @property
    def media(self) -> Media:
        return self.paths[0]


@dataclass
class Preprocessor:
    """Callable run in DataLoader workers: a sample in, tensors (or a SampleError) out. Picklable: the
    transformers image processor is built lazily, and refused unless of the class ``cfg.image_processor``
    records (transformers picks its backend by what is installed, and the backends differ in pixels)."""

    cfg: ProcessorConfig
    image_processor_dir: str | None = None  # checkpoint to load the image processor from; None: defaults
    defer_video_normalize: bool = False  # videos as uint8 (N, C, T*P*P): see normalize_patches
    # Refuse a clip of fewer frames than the temporal patch where Qwen3VLVideoProcessor does
    # (VisionPreprocessor); vlfast extract repeats the frame as the image processor repeats an image
    refuse_short_clips: bool = False
    _image_processor: Any = field(default=None, init=False, repr=False)

    def __getstate__(self) -> dict[str, Any]:
        return {**self.__dict__, "_image_processor": None}

    def image_processor(self):
        if self._image_processor is None:
            cfg = self.cfg
            numbers = ("patch_size", "temporal_patch_size", "merge_size", "image_mean", "image_std")
            numbers = {k: getattr(cfg, k) for k in numbers}
            proc = _image_processor(self.image_processor_dir, cls_name=cfg.image_processor, **numbers)
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

    def no_pixels(self) -> torch.Tensor:
        """A text sample's pixel_values: no patch rows."""
        import torch

        c = self.cfg
        return torch.empty((0, 3 * c.temporal_patch_size * c.patch_size**2), dtype=torch.float32)

    def _size(self) -> dict[str, int]:
        return {"shortest_edge": self.cfg.image_min_pixels, "longest_edge": self.cfg.image_max_pixels}

    def image(self, path: Media) -> tuple[torch.Tensor, tuple[int, int, int], dict[str, Any]]:
        decoded = None
        if self.cfg.image_processor in TORCHVISION_IMAGE_PROCESSORS:
            from vlfast.pixels.image import jpeg_rgb

            decoded = jpeg_rgb(path, self.cfg.exif_orientation)  # a JPEG by libjpeg-turbo, or None: PIL
        if decoded is None:
            img = load_image(path, self.cfg.exif_orientation, self.cfg.image_reading)
        try:
            return self.pil_image(img) if decoded is None else self._patches(*decoded)
        except SampleError as e:  # the processor's refusal: named with the file
            raise SampleError(f"{e} ({path})") from None

    def pil_image(self, img) -> tuple[torch.Tensor, tuple[int, int, int], dict[str, Any]]:
        """An opened image (as :func:`load_image` gives it) -> ``(pixel_values, grid, meta)``."""
        import torch

        meta = {"width": img.size[0], "height": img.size[1], "mode": img.mode}
        if self.cfg.image_processor in TORCHVISION_IMAGE_PROCESSORS:
            from vlfast.pixels.image import rgb_tensor

            return self._patches(rgb_tensor(img, self.cfg.transparency), meta)
        try:
            out = self.image_processor()(images=[img], size=self._size(), return_tensors="pt")
        except ValueError as e:  # e.g. smart_resize's aspect-ratio check
            raise SampleError(f"the image processor refused the image: {e}") from None
        grid = tuple(int(x) for x in out["image_grid_thw"][0].tolist())
        return out["pixel_values"].to(torch.float32), grid, meta  # (t*h*w, C*T*P*P)

    def _patches(self, rgb: torch.Tensor, meta: dict[str, Any]):
        """transformers' torchvision processor's operations on (3, H, W) uint8 (vlfast.pixels.image); left uint8
        for the model side where it normalises alike."""
        from vlfast.pixels.image import image_patches, same_normalization

        defer = self.defer_video_normalize and same_normalization(self.cfg)
        pixels, grid = image_patches(rgb, self.cfg, normalize=not defer)
        return pixels, grid, meta

    def video(self, sample: Item) -> tuple[torch.Tensor, tuple[int, int, int], dict[str, Any]]:
        import torch

        from vlfast.pixels.image import rgb_tensor
        from vlfast.pixels.video import patchify_video, read_video

        cfg = self.cfg
        if sample.kind == "video":
            frames, meta = read_video(sample.media, cfg)
        else:
            images = (load_image(p, cfg.exif_orientation, cfg.image_reading) for p in sample.paths)
            arrays = [rgb_tensor(img, cfg.transparency).permute(1, 2, 0).numpy() for img in images]  # HWC
            shapes = {a.shape for a in arrays}
            if len(shapes) != 1:
                raise SampleError(f"frames of one clip differ in size: {sorted(shapes)}")
            frames = torch.from_numpy(np.stack(arrays)).permute(0, 3, 1, 2)  # channels-last strides
            n = len(arrays)
            meta = {"video_fps": cfg.frames_list_fps, "total_frames": n, "frame_indices": list(range(n))}
        meta.update(height=int(frames.shape[-2]), width=int(frames.shape[-1]))
        n, tf = int(frames.shape[0]), self.cfg.temporal_patch_size
        if self.refuse_short_clips and self.cfg.video_sizing == "processor" and n < tf:
            # Qwen3VLVideoProcessor's smart_resize, in its own words
            raise SampleError(
                f"the video processor refused {n} sampled frame{'s' * (n != 1)}: t:{n} must be larger than "
                f"temporal_factor:{tf}"
            )
        pixels, grid = patchify_video(frames, self.cfg, normalize=not self.defer_video_normalize)
        return pixels, grid, meta

    def __call__(self, sample: Item) -> tuple[torch.Tensor, tuple[int, int, int], dict[str, Any]]:
        """``(pixel_values (N, C*T*P*P) float32, grid (t, h, w), meta)``; raises SampleError.

        With ``defer_video_normalize`` pixel_values are uint8 instead, for normalize_patches to finish:
        (N, C, T*P*P) for a video, (N, C, P*P) for an image (where images and videos normalise alike).
        """
        if sample.kind == "image":
            return self.image(sample.media)
        return self.video(sample)
