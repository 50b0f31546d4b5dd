"""The image and video half of a Qwen-VL processor, for training data loaders: the inputs and outputs of
transformers' processor, the pixels of its torchvision backend, bit for bit, at the cost of vlfast's own path.

    pre = vlfast.VisionPreprocessor("Qwen3-VL-4B-Instruct")     # a local checkpoint, or "ref:qwen3-vl-4b"
    out = pre(images=["a.jpg", pil_image], videos=["clip.mp4"])
    out["pixel_values"], out["image_grid_thw"], out["pixel_values_videos"], out["video_grid_thw"]

The numbers come from the checkpoint's processor files, as ``vlfast extract`` reads them
(:func:`~vlfast.extraction.decode.preprocess.build_processor_config`); images by path are turned upright by
their EXIF orientation, as transformers' ``load_image`` does, PIL images are taken as they are, as its
processor takes them; videos are decoded with PyAV and sampled by the family's ``sample_frames`` (2 fps by
default). The object pickles small (DataLoader workers, spawn or fork) and holds no open file.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from vlfast.errors import InputRefused
from vlfast.extraction.decode.processor_config import TORCHVISION_IMAGE_PROCESSORS

if TYPE_CHECKING:  # pragma: no cover
    import torch

    from vlfast.extraction.decode.preprocess import Preprocessor

__all__ = ["VisionPreprocessor"]

_BACKENDS = {"torchvision": "Qwen2VLImageProcessor", "pil": "Qwen2VLImageProcessorPil"}


@dataclass
class VisionPreprocessor:
    """``pixel_values``/``image_grid_thw`` and ``pixel_values_videos``/``video_grid_thw`` (float32 on CPU,
    int64) for a batch of images and videos, equal to transformers' processor of ``model`` with
    ``image_backend`` (torchvision: its default for Qwen-VL, done here without torchvision; pil: its PIL
    processor, which runs). ``fps`` or ``num_frames`` sample videos; the pixel budgets override the files'."""

    model: str
    fps: float | None = None
    num_frames: int | None = None
    min_pixels: int | None = None
    max_pixels: int | None = None
    video_max_pixels: int | None = None
    image_backend: str = "torchvision"
    # "float32": transformers' outputs. "uint8": the patches before the rescale and normalisation, uint8: a
    # video's (N, C, T*P*P), a quarter of the bytes to collate, pin and copy, an image's (N, C, P*P), each patch
    # once, an eighth; finish() makes them float32 (N, C*T*P*P) where they land, the temporal repeat included.
    pixels: str = "float32"
    _pre: Preprocessor | None = field(default=None, init=False, repr=False)

    def __post_init__(self) -> None:
        if self.image_backend not in _BACKENDS:
            raise InputRefused(f"image_backend must be torchvision or pil, got {self.image_backend!r}")
        if self.pixels not in ("float32", "uint8"):
            raise InputRefused(f"pixels must be float32 or uint8, got {self.pixels!r}")
        if self.pixels == "uint8" and self.image_backend != "torchvision":
            raise InputRefused(
                "pixels='uint8' needs image_backend='torchvision' (the PIL processor returns float32)"
            )
        from vlfast.extraction.decode.preprocess import Preprocessor, build_processor_config
        from vlfast.models.ref import family_of

        model = self.model if self.model.startswith("ref:") else str(Path(self.model).resolve())
        cfg = build_processor_config(
            model,
            family=family_of(model),
            fps=self.fps,
            num_frames=self.num_frames,
            min_pixels=self.min_pixels,
            max_pixels=self.max_pixels,
            video_max_pixels=self.video_max_pixels,
            exif_orientation=True,
            image_processor=_BACKENDS[self.image_backend],
            # a path read as transformers' processor of that backend reads it (its fetch_images)
            image_reading="decode_image" if self.image_backend == "torchvision" else "load_image",
        )
        self._pre = Preprocessor(
            cfg,
            image_processor_dir=None if model.startswith("ref:") else model,
            defer_video_normalize=self.pixels == "uint8",
            refuse_short_clips=True,
        )

    @classmethod
    def from_pretrained(cls, model: str | Path, **options: Any) -> VisionPreprocessor:
        return cls(str(model), **options)

    @property
    def config(self):
        """The :class:`~vlfast.extraction.decode.processor_config.ProcessorConfig` every number comes from."""
        return self._pre.cfg

    def __call__(self, images: list | None = None, videos: list | None = None) -> dict[str, torch.Tensor]:
        """Images (paths, PIL images, uint8 arrays (H, W, C), (C, H, W) or (H, W) and such tensors; nested
        lists flattened, as transformers' processor flattens them) and videos (paths, or lists of frame
        image paths) -> tensors, each input's rows in order; raises
        :class:`~vlfast.extraction.decode.media.SampleError` naming a file that cannot be read (or a clip
        transformers' processor refuses: a Qwen3-VL video of fewer sampled frames than the temporal patch),
        and :class:`~vlfast.errors.InputRefused` naming an input of a kind it does not take. An array whose
        first axis is 1 or 3 long is (C, H, W), as transformers infers it, even where its last is too: (3, W, 3)
        is 3 channels of 3 x W. A thin image is sized as transformers' processor sizes it
        (``config.thin_images``)."""
        import torch

        out: dict[str, torch.Tensor] = {}
        if images is not None and not isinstance(images, (list, tuple)):
            images = [images]
        if images:
            conformed, why = _conformed_inputs(images, "VisionPreprocessor")
            if why is not None:
                raise InputRefused(why)
            rows, grids = self._images(conformed)
            out["pixel_values"] = rows
            out["image_grid_thw"] = torch.tensor(grids, dtype=torch.long)
        if videos is not None and not isinstance(videos, (list, tuple)):
            videos = [videos]
        if videos:
            samples = [_video_sample(x) for x in videos]  # every input checked before any is decoded
            rows, grids = [], []
            for sample in samples:
                pixels, grid, _ = _named(self._pre, sample)
                rows.append(pixels)
                grids.append(grid)
            out["pixel_values_videos"] = _cat(rows)
            out["video_grid_thw"] = torch.tensor(grids, dtype=torch.long)
        return out

    def finish(
        self,
        batch: dict[str, torch.Tensor],
        device: str | torch.device | None = None,
        dtype: torch.dtype | None = None,
    ) -> dict:
        """``batch`` (this object's outputs, collated) with uint8 pixel values made float32 on ``device`` (by
        default where they are): bit-equal to the float32 outputs (the rescale and normalisation are exact
        IEEE operations on any device). With ``dtype`` (the model's, e.g. ``torch.bfloat16``) the pixel
        values are written in it directly, rounded as ``.to(dtype)`` rounds the float32 ones, with no
        float32 copy of the batch. Other entries are moved to ``device`` as they are."""
        import torch

        from vlfast.extraction.decode.image import normalize_image_patches
        from vlfast.extraction.decode.video import empty_pixels, normalize_video_patches, pixel_width

        _check_batch(batch)
        out = {}
        for key, value in batch.items():
            if hasattr(value, "to") and device is not None:
                value = value.to(device, non_blocking=True)
            if key in ("pixel_values", "pixel_values_videos") and value.dtype == torch.uint8:
                into = None
                if dtype is not None:
                    into = empty_pixels(
                        (value.shape[0], pixel_width(value, self.config)), dtype, value.device
                    )
                normalize = normalize_image_patches if key == "pixel_values" else normalize_video_patches
                value = normalize(value, self.config, out=into)
            elif key in ("pixel_values", "pixel_values_videos") and dtype is not None:
                value = value.to(dtype)
            out[key] = value
        return out

    def as_image_processor(self, base: Any = None) -> Any:
        """``base``, a transformers Qwen-VL image processor (the one in your processor:
        ``processor.image_processor``; by default the checkpoint's ``AutoImageProcessor``), answering its calls
        with this object: the same class and methods (``fetch_images``, ``get_number_of_image_patches``,
        ``merge_size`` for the placeholder count), this object's pixels and budgets. So

            processor.image_processor = pre.as_image_processor(processor.image_processor)

        gives vlfast's path to everything that calls the processor or its image processor (TRL's collators, a
        Dataset under HF Trainer, LlamaFactory's ``mm_plugin``). Its images are PIL images, paths, or uint8
        arrays (H, W, C) and tensors (C, H, W), their channel axis inferred as transformers infers it or as a
        call's ``input_data_format`` says; a pixel setting passed to a call (``size=``, ``max_pixels=``,
        ``do_normalize=``, ...) other than this object's is refused: set it here. ``base`` may be a processor
        holding such an image processor (its ``image_processor`` is taken); anything else (a tokenizer, a
        video processor) is refused, naming it. It pickles (DataLoader workers)."""
        if base is None:
            base = self._checkpoint_image_processor()
        base = _qwen_vl_image_processor(base)
        cfg = self.config
        for name in ("patch_size", "merge_size", "temporal_patch_size"):
            theirs = getattr(base, name, None)
            if theirs is not None and int(theirs) != int(getattr(cfg, name)):
                raise InputRefused(
                    f"{type(base).__name__} has {name}={theirs}, {self.model} {getattr(cfg, name)}: pass the image "
                    "processor of the same checkpoint"
                )
        return _adapted(self, base)

    def _checkpoint_image_processor(self) -> Any:
        from transformers import AutoImageProcessor

        if self.model.startswith("ref:"):
            raise InputRefused(
                f"{self.model} has no processor files: pass the image processor to adapt "
                "(as_image_processor(processor.image_processor))"
            )
        return AutoImageProcessor.from_pretrained(str(Path(self.model).resolve()))

    def _images(self, images: list) -> tuple[torch.Tensor, list[tuple[int, int, int]]]:
        """Every image's rows in one tensor, and their grids. Several float32 images through the torchvision
        path are normalised straight into that tensor from their uint8 patches, as ``vlfast extract``'s
        runner does, instead of each into its own and ``torch.cat`` copying them all again (50 MB a 1080p
        image); the same bits."""
        import dataclasses

        import torch

        from vlfast.extraction.decode.image import normalize_image_patches
        from vlfast.extraction.decode.processor_config import TORCHVISION_IMAGE_PROCESSORS
        from vlfast.extraction.decode.video import empty_pixels, pixel_width

        cfg = self._pre.cfg
        if (
            len(images) == 1
            or self.pixels == "uint8"
            or cfg.image_processor not in TORCHVISION_IMAGE_PROCESSORS
        ):
            rows, grids = zip(*(_named(self._image, x) for x in images))
            return _cat(rows), list(grids)
        raw = dataclasses.replace(self._pre, defer_video_normalize=True)
        parts, grids = zip(*(_named(lambda y: self._image(y, raw), x) for x in images))
        widths = [pixel_width(p, cfg) if p.dtype == torch.uint8 else p.shape[1] for p in parts]
        out = empty_pixels(
            (sum(int(p.shape[0]) for p in parts), widths[0]), torch.float32, torch.device("cpu")
        )
        row = 0
        for p in parts:
            rows = out[row : row + p.shape[0]]
            if p.dtype == torch.uint8:  # the image settings: whether videos normalise alike does not matter
                normalize_image_patches(p, cfg, out=rows)
            else:
                rows.copy_(p)
            row += p.shape[0]
        return out, list(grids)

    def _image(self, x, pre=None) -> tuple[torch.Tensor, tuple[int, int, int]]:
        pre = self._pre if pre is None else pre
        if isinstance(x, (str, Path)):
            pixels, grid, _ = pre.image(str(x))
            return pixels, grid
        from vlfast.extraction.decode.preprocess import conformed_image

        pixels, grid, _ = pre.pil_image(conformed_image(x, keep_mode=True))
        return pixels, grid


# transformers' Qwen-VL image processor classes (every Qwen-VL family's), by name: the torchvision backend
# (5.x; "Fast" in 4.x) and the PIL one
_QWEN_VL_IMAGE_PROCESSORS = frozenset({*TORCHVISION_IMAGE_PROCESSORS, "Qwen2VLImageProcessorPil"})


def _qwen_vl_image_processor(base: Any) -> Any:
    """``base`` if it is a transformers Qwen-VL image processor, a processor's image processor if it is a
    processor holding one; else InputRefused naming what was given (a tokenizer's call would take text for
    file paths, a video processor has no image settings)."""
    if not isinstance(base, type) and {c.__name__ for c in type(base).__mro__} & _QWEN_VL_IMAGE_PROCESSORS:
        return base
    inner = getattr(base, "image_processor", None) if not isinstance(base, type) else None
    if inner is not None and {c.__name__ for c in type(inner).__mro__} & _QWEN_VL_IMAGE_PROCESSORS:
        return inner
    what = base.__name__ + " (a class)" if isinstance(base, type) else type(base).__name__
    raise InputRefused(
        f"as_image_processor: given a {what}, not a transformers Qwen-VL image processor "
        f"({', '.join(sorted(_QWEN_VL_IMAGE_PROCESSORS))}) nor a processor holding one: pass "
        "processor.image_processor"
    )


def _check_batch(batch: Any) -> None:
    """InputRefused where ``finish`` is given anything but this object's outputs (collated): a mapping whose
    pixel entries are tensors."""
    import torch

    if not hasattr(batch, "items"):
        raise InputRefused(
            f"finish: given a {type(batch).__name__}; pass the dict this VisionPreprocessor returns (collated), "
            "e.g. finish(batch, device='cuda')"
        )
    for key in ("pixel_values", "pixel_values_videos"):
        value = batch.get(key)
        if value is not None and not isinstance(value, torch.Tensor):
            raise InputRefused(
                f"finish: {key} is a {type(value).__name__}, not a tensor: pass this VisionPreprocessor's "
                "outputs (collated)"
            )


def _video_sample(x):
    """A video input (a file path, or a list of frame image paths) as the Sample the preprocessor decodes;
    InputRefused naming anything else."""
    from vlfast.extraction.sources.sample import Sample

    if isinstance(x, (str, Path)):
        return Sample(id=str(x), kind="video", paths=(str(x),))
    frames = x if isinstance(x, (list, tuple)) else [x]
    if not frames or not all(isinstance(f, (str, Path)) for f in frames):
        kinds = ", ".join(sorted({type(f).__name__ for f in frames}))
        what = f"a {type(x).__name__} of {kinds}" if frames is x else f"a {type(x).__name__}"
        raise InputRefused(
            f"VisionPreprocessor: a video given as {what if frames else 'an empty list'}: pass video file "
            "paths, or lists of frame image paths (vlfast decodes and samples them)"
        )
    paths = tuple(str(f) for f in frames)
    return Sample(id=paths[0], kind="frames", paths=paths)


def _cat(rows):
    """The rows of every input, in order: one input's tensor as it is (torch.cat would copy it: 50 MB of float32
    for a 1080p image)."""
    import torch

    return rows[0] if len(rows) == 1 else torch.cat(rows)


def _named(fn, x):
    """``fn(x)``, its SampleError naming the input (a data loader's traceback then says which file)."""
    from vlfast.extraction.decode.media import SampleError

    try:
        return fn(x)
    except SampleError as e:
        what = x.paths[0] if hasattr(x, "paths") else x if isinstance(x, (str, Path)) else type(x).__name__
        raise SampleError(f"{what}: {e}") from None


# A pixel setting a call may carry, and the ProcessorConfig number it must equal ("size": its budgets;
# "do_convert_rgb": True, vlfast's only way)
_CALL_SETTINGS = {
    "do_resize": "do_resize",
    "resample": "resample",
    "do_rescale": "do_rescale",
    "rescale_factor": "rescale_factor",
    "do_normalize": "do_normalize",
    "image_mean": "image_mean",
    "image_std": "image_std",
    "min_pixels": "image_min_pixels",
    "max_pixels": "image_max_pixels",
    "patch_size": "patch_size",
    "temporal_patch_size": "temporal_patch_size",
    "merge_size": "merge_size",
    "size": "size",
    "do_convert_rgb": "do_convert_rgb",
}
# What a call may carry that changes nothing in the output's values
_LAYOUT_KWARGS = ("data_format", "input_data_format", "device", "disable_grouping")


def _adapted(pre: VisionPreprocessor, base: Any, fallback: bool = False) -> Any:
    """A copy of ``base`` whose class is a subclass of ``base``'s answering calls with ``pre``. ``fallback``
    (``VLFAST_PREPROCESS``): a call vlfast cannot answer exactly as ``base`` would (a pixel setting in the
    call, an input of another kind, a setting of the object changed since) runs ``base``'s own code instead
    of being refused; the record counts both."""
    import copy

    out = copy.copy(base)
    out.__class__ = _adapted_class(type(base))
    out._vlfast = pre
    cfg = pre.config
    # the budgets the placeholder count reads (get_number_of_image_patches) are the ones the pixels follow:
    # transformers 4's dict, transformers 5's SizeDict (a dataclass, not a dict)
    size = getattr(out, "size", None)
    if size is not None and "longest_edge" in size:
        budgets = {"shortest_edge": cfg.image_min_pixels, "longest_edge": cfg.image_max_pixels}
        out.size = {**size, **budgets} if isinstance(size, dict) else dataclasses.replace(size, **budgets)
    for name, value in (("min_pixels", cfg.image_min_pixels), ("max_pixels", cfg.image_max_pixels)):
        if getattr(out, name, None) is not None:
            setattr(out, name, value)
    out._vlfast_fallback = fallback
    out._vlfast_settings = pixel_settings(out)
    return out


_ADAPTED: dict[type, type] = {}


def _adapted_class(base_cls: type) -> type:
    cls = _ADAPTED.get(base_cls)
    if cls is None:
        cls = type(
            f"Vlfast{base_cls.__name__}",
            (base_cls,),
            {
                "__call__": _adapted_call,
                "preprocess": _adapted_call,
                "__reduce__": _adapted_reduce,
                "to_dict": _adapted_to_dict,
                "__module__": __name__,
                "__doc__": f"{base_cls.__name__} whose calls vlfast.VisionPreprocessor answers.",
            },
        )
        _ADAPTED[base_cls] = cls
    return cls


def _base_class(obj) -> type:
    return type(obj).__mro__[1]


def _adapted_reduce(self):
    # the object as it is now (copy.deepcopy, pickle to DataLoader workers): its settings, changed or not, and
    # the snapshot they are compared with; the VisionPreprocessor pickles by its own fields
    state = {k: v for k, v in self.__dict__.items() if k != "_vlfast"}
    return (_rebuilt, (self._vlfast, _base_class(self), state))


def _rebuilt(pre: VisionPreprocessor, base_cls: type, state: dict) -> Any:
    out = base_cls.__new__(_adapted_class(base_cls))
    out.__dict__.update(state)
    out._vlfast = pre
    return out


def _adapted_to_dict(self) -> dict[str, Any]:
    """``base``'s, as ``save_pretrained`` writes it: its own class name (what AutoImageProcessor loads back), no
    vlfast attribute."""
    out = _base_class(self).to_dict(self)
    for key in [k for k in out if k.startswith("_vlfast")]:
        del out[key]
    # the base wrote this class's name (its PIL backend without "Pil", as it saves itself): the base's
    out["image_processor_type"] = out["image_processor_type"].removeprefix("Vlfast")
    return out


def pixel_settings(ip: Any) -> dict[str, Any]:
    """The settings of a transformers image processor ``ip`` that change its pixels, as comparable values
    (transformers 4 and 5 keep the budgets in ``size`` and, in 4, also ``min_pixels``/``max_pixels``)."""
    size = getattr(ip, "size", None)
    out: dict[str, Any] = {}
    if size is not None:
        out["size"] = tuple(
            (k, size[k]) for k in ("shortest_edge", "longest_edge", "height", "width") if k in size
        )
    for name in (
        "min_pixels", "max_pixels", "patch_size", "temporal_patch_size", "merge_size", "rescale_factor",
        "do_resize", "do_rescale", "do_normalize", "do_convert_rgb", "do_center_crop", "do_pad",
    ):  # fmt: skip
        out[name] = getattr(ip, name, None)
    for name in ("image_mean", "image_std"):
        value = getattr(ip, name, None)
        out[name] = None if value is None else tuple(float(v) for v in value)
    resample = getattr(ip, "resample", None)
    try:
        out["resample"] = None if resample is None else int(resample)
    except (TypeError, ValueError):  # an enum of another library: compared as it prints
        out["resample"] = str(resample)
    return out


def _config_mismatch(ip: Any, cfg) -> list[str]:
    """The names of ``ip``'s pixel settings that differ from ``cfg``'s (empty: vlfast's pixels are ``ip``'s)."""
    have = pixel_settings(ip)
    want = {
        "min_pixels": cfg.image_min_pixels,
        "max_pixels": cfg.image_max_pixels,
        "patch_size": cfg.patch_size,
        "temporal_patch_size": cfg.temporal_patch_size,
        "merge_size": cfg.merge_size,
        "rescale_factor": cfg.rescale_factor,
        "do_resize": cfg.do_resize,
        "do_rescale": cfg.do_rescale,
        "do_normalize": cfg.do_normalize,
        "resample": cfg.resample,
        "image_mean": tuple(float(v) for v in cfg.image_mean),
        "image_std": tuple(float(v) for v in cfg.image_std),
    }
    bad = [k for k, v in want.items() if have[k] is not None and have[k] != v]
    size = dict(have.get("size") or ())
    budgets = {"shortest_edge": cfg.image_min_pixels, "longest_edge": cfg.image_max_pixels}
    if any(k not in budgets or v != budgets[k] for k, v in size.items()):
        bad.append("size")
    if have["do_convert_rgb"] is False:
        bad.append("do_convert_rgb")
    bad += [k for k in ("do_center_crop", "do_pad") if have[k]]
    return bad


def _call_mismatch(kwargs: dict[str, Any], cfg) -> str | None:
    """Why a call's options cannot be answered by vlfast (None: they can): a pixel setting other than
    ``cfg``'s, or an option vlfast does not know."""
    for key, value in kwargs.items():
        if value is None or key in _LAYOUT_KWARGS:
            continue
        name = _CALL_SETTINGS.get(key)
        if name is None:
            return f"{key}={value!r} in a call: an option vlfast does not take"
        if name == "size":
            budgets = (cfg.image_min_pixels, cfg.image_max_pixels)
            try:
                same = (value["shortest_edge"], value["longest_edge"]) == budgets and all(
                    k in ("shortest_edge", "longest_edge") for k in dict(value)
                )
            except (KeyError, TypeError, ValueError):
                same = False
        elif name == "do_convert_rgb":
            same = value is True
        else:
            same = _same(value, getattr(cfg, name))
        if not same:
            ours = (
                "True"
                if name == "do_convert_rgb"
                else getattr(cfg, name, None)
                if name != "size"
                else (f"shortest_edge={cfg.image_min_pixels}, longest_edge={cfg.image_max_pixels}")
            )
            return f"{key}={value!r} in a call, where this VisionPreprocessor has {ours}"
    return None


def _channels_first(shape: tuple[int, ...], given: Any = None) -> bool:
    """Whether a 3-axis array is (C, H, W): as ``given`` says (a call's ``input_data_format``), else as
    transformers infers it (``infer_channel_dimension_format``): the first axis if it is 1 or 3 long, even
    where the last is too ((3, W, 3), (1, W, 3), (3, W, 1): transformers warns and takes the first)."""
    if given is not None:
        return str(getattr(given, "value", given)) == "channels_first"
    return shape[0] in (1, 3)


def _conformed_inputs(images, who: str, channels: Any = None):
    """``images`` as the PIL images vlfast's path takes, or (None, why) where one is of a kind it does not.
    ``channels``: a call's ``input_data_format`` (None: inferred as transformers infers it)."""
    import numpy as np
    import torch
    from PIL import Image

    flat = []
    for item in images if isinstance(images, (list, tuple)) else [images]:
        flat.extend(item if isinstance(item, (list, tuple)) else [item])
    conformed = []
    for x in flat:
        if isinstance(x, torch.Tensor):
            x = x.numpy(force=True)
        if isinstance(x, np.ndarray):
            shape = x.shape
            if x.ndim == 2:  # (H, W): grayscale, as transformers takes it
                x = x[..., None]
            elif x.ndim == 3 and _channels_first(x.shape, channels):
                x = x.transpose(1, 2, 0)  # (C, H, W)
            if x.dtype != np.uint8 or x.ndim != 3 or x.shape[-1] not in (1, 3):
                return None, (
                    f"{who}: an array of shape {shape} and dtype {x.dtype}: pass uint8 (H, W, C) or (C, H, W) "
                    "with 1 or 3 channels, a PIL image or a path"
                )
            x = Image.fromarray(np.ascontiguousarray(x if x.shape[-1] == 3 else x[..., 0]))
        elif not isinstance(x, (Image.Image, str, Path)):
            return None, f"{who}: an input of type {type(x).__name__}: pass PIL images, paths or uint8 arrays"
        conformed.append(x)
    return conformed, None


def _adapted_call(self, images=None, *args, return_tensors=None, **kwargs):
    """``images`` -> BatchFeature of ``pixel_values`` and ``image_grid_thw``, by vlfast.VisionPreprocessor."""
    from transformers.feature_extraction_utils import BatchFeature

    from vlfast.extraction.decode.media import SampleError
    from vlfast.patching.record import count_image_processor_call

    pre: VisionPreprocessor = self._vlfast
    who = type(self).__name__
    why = None
    if args:
        why = f"{who}: {len(args)} positional options: pass options by name"
    elif images is None:
        why = f"{who}: no images given"
    if kwargs.get("do_resize") is False and pre.config.do_resize:
        # ms-swift's Qwen templates resize with qwen-vl-utils, then call with do_resize=False: the same path
        # without the resize (an image off the patch grid is refused by both)
        pre = _without_resize(pre)
    why = why or _call_mismatch(kwargs, pre.config)
    if why is None:
        changed = [k for k, v in pixel_settings(self).items() if self._vlfast_settings.get(k) != v]
        if changed:
            why = f"the image processor's {', '.join(changed)} changed since vlfast took its calls"
    conformed = None
    if why is None:
        conformed, why = _conformed_inputs(images, who, kwargs.get("input_data_format"))
    if why is None:
        try:
            out = pre(images=conformed)
        except SampleError as e:
            if not self._vlfast_fallback:
                raise
            why = f"an image vlfast refused ({e})"
        else:
            count_image_processor_call()
            return BatchFeature(
                {"pixel_values": out["pixel_values"], "image_grid_thw": out["image_grid_thw"]},
                tensor_type=return_tensors,
            )
    if not self._vlfast_fallback:
        raise InputRefused(why)
    count_image_processor_call(_reason_kind(why))
    return _base_class(self).preprocess(self, images, *args, return_tensors=return_tensors, **kwargs)


def _without_resize(pre: VisionPreprocessor) -> VisionPreprocessor:
    """``pre`` with the image processor's ``do_resize`` off, as a call's ``do_resize=False`` asks."""
    import copy

    from vlfast.extraction.decode.preprocess import Preprocessor

    out = copy.copy(pre)
    inner = pre._pre
    out._pre = Preprocessor(
        dataclasses.replace(inner.cfg, do_resize=False),
        image_processor_dir=inner.image_processor_dir,
        defer_video_normalize=inner.defer_video_normalize,
    )
    return out


def _reason_kind(why: str) -> str:
    """A stock call's reason as the record counts it: without the values (one count per kind, not per image)."""
    return why.split(" (", 1)[0] if why.startswith("an image vlfast refused") else why


def _same(value, ours) -> bool:
    if isinstance(ours, (tuple, list)):
        try:
            return [float(v) for v in value] == [float(v) for v in ours]
        except TypeError:
            return False
    return value == ours


# --------------------------------------------------------------------------- VLFAST_PREPROCESS

_said: set[str] = set()


def _say_once(line: str) -> None:
    import sys

    if line not in _said:
        _said.add(line)
        print(line, file=sys.stderr, flush=True)


def swap_image_processor(processor: Any, path: Any) -> str | None:
    """Let vlfast answer ``processor.image_processor``'s calls where its pixels are those of transformers'
    torchvision backend for the local checkpoint ``path``, falling back to transformers' own code for any
    call it cannot answer exactly (``VLFAST_PREPROCESS``); returns why it was not swapped (None: it was)."""
    ip = getattr(processor, "image_processor", None)
    if ip is None or getattr(ip, "_vlfast", None) is not None:
        return None if ip is not None else "the processor has no image processor"
    name = type(ip).__name__
    backends = {c.__name__ for c in type(ip).__mro__}
    if name not in TORCHVISION_IMAGE_PROCESSORS or not backends & {
        "TorchvisionBackend",
        "BaseImageProcessorFast",
    }:
        return (
            f"its image processor is a {name}, not transformers' torchvision Qwen2VLImageProcessor (vlfast "
            "reproduces that one: install torchvision, or use VisionPreprocessor(image_backend='pil'))"
        )
    try:
        folder = Path(path)
        local = folder.is_dir()
    except (TypeError, OSError):
        local = False
    if not local:
        return "not a local checkpoint folder (vlfast reads the processor files itself)"
    size = pixel_settings(ip).get("size") or ()
    budgets = dict(size)
    try:
        pre = VisionPreprocessor(
            str(folder),
            min_pixels=budgets.get("shortest_edge") or getattr(ip, "min_pixels", None),
            max_pixels=budgets.get("longest_edge") or getattr(ip, "max_pixels", None),
        )
    except Exception as e:  # noqa: BLE001 - any reason is a reason to leave transformers' code in place
        return f"{type(e).__name__}: {e}"
    bad = _config_mismatch(ip, pre.config)
    if bad:
        return f"its {', '.join(bad)} differ from what vlfast reads in the checkpoint's files"
    why = _probe(pre, ip)
    if why:
        return why
    processor.image_processor = _adapted(pre, ip, fallback=True)
    return None


# The proof run where the swap happens, on the transformers installed: an upscale to the minimum budget, and a
# small antialiased downscale to the patch grid (random pixels: every value and edge matters); then a thin
# image and one on the grid called with do_resize=False (_probes)
_PROBES = ((67, 91), (257, 300))


def _probes(cfg) -> list[tuple[tuple[int, int], dict]]:
    """The probe images' (height, width) and call options: _PROBES; a thin one, its short side rounded to 0
    patches and its long side enough for one row of merged patches to pass the minimum budget, where
    transformers' rule and qwen-vl-utils' give other grids (THIN_IMAGES); and the call ms-swift makes,
    do_resize=False on an image already on the patch grid."""
    f = cfg.factor
    short = max(1, f // 2 - 4)
    long = min(200 * short, -(-cfg.image_min_pixels // f) + 2 * f)
    return [
        *((size, {}) for size in _PROBES),
        ((short, long), {}),
        ((8 * f, 9 * f), {"do_resize": False}),
    ]


def _probe(pre: VisionPreprocessor, ip: Any) -> str | None:
    """Why vlfast's pixels are not ``ip``'s on the probe images (None: bit-equal, grids too)."""
    import numpy as np
    import torch
    import transformers
    from PIL import Image

    rng = np.random.default_rng(0)
    for (height, width), call in _probes(pre.config):
        img = Image.fromarray(rng.integers(0, 256, (height, width, 3), dtype=np.uint8))
        want = ip.preprocess([img], return_tensors="pt", **call)
        got = (_without_resize(pre) if call else pre)(images=[img])
        if not torch.equal(want["image_grid_thw"], got["image_grid_thw"]):
            what = f"grid {got['image_grid_thw'].tolist()} where transformers gives {want['image_grid_thw'].tolist()}"
        elif not torch.equal(want["pixel_values"], got["pixel_values"]):
            diff = (want["pixel_values"] - got["pixel_values"]).abs().max().item()
            what = f"pixel values up to {diff:.3g} apart"
        else:
            continue
        how = " with do_resize=False" if call else ""
        return (
            f"vlfast's pixels differ from {type(ip).__name__}'s (transformers {transformers.__version__}) on a "
            f"{width}x{height} probe image{how}: {what}"
        )
    return None


def install_processor_switch() -> None:
    """``VLFAST_PREPROCESS``: every processor ``ProcessorMixin.from_pretrained`` loads from a local Qwen-VL
    checkpoint gets :func:`swap_image_processor`; one line on stderr for a processor left as it is. Safe to
    call twice."""
    from transformers.processing_utils import ProcessorMixin

    current = ProcessorMixin.__dict__["from_pretrained"]
    if getattr(current.__func__, "_vlfast_switch", False):
        return
    original = current.__func__

    def from_pretrained(cls, pretrained_model_name_or_path, *args, **kwargs):
        processor = original(cls, pretrained_model_name_or_path, *args, **kwargs)
        try:
            why = swap_image_processor(processor, pretrained_model_name_or_path)
        except Exception as e:  # noqa: BLE001 - never break the user's launcher: say so, leave it stock
            why = f"{type(e).__name__}: {e}"
        if why is not None and getattr(processor, "image_processor", None) is not None:
            _say_once(
                f"vlfast: VLFAST_PREPROCESS: the processor of {pretrained_model_name_or_path} keeps "
                f"transformers' image processor: {why}"
            )
        return processor

    from_pretrained._vlfast_switch = True
    from_pretrained.__wrapped__ = original
    from_pretrained.__doc__ = original.__doc__
    ProcessorMixin.from_pretrained = classmethod(from_pretrained)
