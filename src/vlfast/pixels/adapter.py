"""vlfast's pixels given to what calls a transformers Qwen-VL image processor: a copy of the image processor
whose calls :class:`~vlfast.pixels.preprocessor.VisionPreprocessor` answers (:func:`as_image_processor`, and
``VLFAST_PREPROCESS``'s swap), and the count of those calls that ``VLFAST_RECORD`` reports
(:func:`image_processor_calls`). Imports neither torch nor transformers at import.
"""

from __future__ import annotations

import copy
import dataclasses
import os
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

from vlfast.errors import InputRefused
from vlfast.models.ref import ModelRef
from vlfast.pixels.media import SampleError
from vlfast.pixels.settings import IMAGE_PROCESSOR_SETTINGS, TORCHVISION_IMAGE_PROCESSORS

__all__ = [
    "as_image_processor",
    "conformed_inputs",
    "count_image_processor_call",
    "image_processor_calls",
    "on_call",
    "pixel_settings",
    "without_resize",
]

# Image processor calls answered by vlfast and those passed to transformers' own code, by reason: this
# process's (a forked child starts from zero). ``on_call``: what the record runs at each call.
_lock = threading.Lock()
_image_calls: dict[str, Any] = {"pid": os.getpid(), "vlfast": 0, "stock": {}}
on_call: list[Callable[[], None]] = []


def count_image_processor_call(stock_reason: str | None = None) -> None:
    """One call of an image processor vlfast adapted: answered by vlfast (``stock_reason`` None) or passed to
    transformers' own code, and why."""
    with _lock:
        pid = os.getpid()
        if _image_calls["pid"] != pid:  # a forked worker: its own calls only
            _image_calls.update(pid=pid, vlfast=0, stock={})
        if stock_reason is None:
            _image_calls["vlfast"] += 1
        else:
            _image_calls["stock"][stock_reason] = _image_calls["stock"].get(stock_reason, 0) + 1
    for listener in on_call:
        listener()


def image_processor_calls() -> tuple[int, dict[str, int]]:
    """This process's image processor calls so far: (answered by vlfast, passed to transformers' code by
    reason)."""
    with _lock:
        if _image_calls["pid"] != os.getpid():
            return 0, {}
        return _image_calls["vlfast"], dict(_image_calls["stock"])


def as_image_processor(pre: Any, base: Any = None) -> Any:
    """``VisionPreprocessor.as_image_processor`` (:mod:`vlfast.pixels.preprocessor`, which says what it gives):
    ``base`` (by default the checkpoint's ``AutoImageProcessor``) answering its calls with ``pre``."""
    if base is None:
        base = _checkpoint_image_processor(pre.model)
    base = _qwen_vl_image_processor(base)
    cfg = pre.config
    for name in ("patch_size", "merge_size", "temporal_patch_size"):
        theirs = getattr(base, name, None)
        if theirs is not None and int(theirs) != int(getattr(cfg, name)):
            raise InputRefused(
                f"{type(base).__name__} has {name}={theirs}, {pre.model} {getattr(cfg, name)}: pass the image "
                "processor of the same checkpoint"
            )
    return adapted(pre, base)


def _checkpoint_image_processor(model: str) -> Any:
    from transformers import AutoImageProcessor

    if ModelRef.of(model).is_reference:
        raise InputRefused(
            f"{model} has no processor files: pass the image processor to adapt "
            "(as_image_processor(processor.image_processor))"
        )
    return AutoImageProcessor.from_pretrained(str(Path(model).resolve()))


# transformers' Qwen-VL image processor classes (every Qwen-VL family's), by name: the torchvision backend
# (5.x; "Fast" in 4.x) and the PIL one
_QWEN_VL_IMAGE_PROCESSORS = frozenset({*TORCHVISION_IMAGE_PROCESSORS, "Qwen2VLImageProcessorPil"})


def _qwen_vl_image_processor(base: Any) -> Any:
    """``base`` if it is a transformers Qwen-VL image processor, a processor's image processor if it is a
    processor holding one; else InputRefused naming what was given."""
    if not isinstance(base, type):
        for ip in (base, getattr(base, "image_processor", None)):
            if ip is not None and {c.__name__ for c in type(ip).__mro__} & _QWEN_VL_IMAGE_PROCESSORS:
                return ip
    what = base.__name__ + " (a class)" if isinstance(base, type) else type(base).__name__
    raise InputRefused(
        f"as_image_processor: given a {what}, not a transformers Qwen-VL image processor "
        f"({', '.join(sorted(_QWEN_VL_IMAGE_PROCESSORS))}) nor a processor holding one: pass "
        "processor.image_processor"
    )


# What a call may carry that changes nothing in the output's values
_LAYOUT_KWARGS = ("data_format", "input_data_format", "device", "disable_grouping")


def adapted(pre: Any, base: Any, fallback: bool = False) -> Any:
    """A copy of ``base`` whose class is a subclass of ``base``'s answering calls with ``pre``. ``fallback``
    (``VLFAST_PREPROCESS``): a call vlfast cannot answer exactly as ``base`` would runs ``base``'s own code
    instead of being refused."""
    out = copy.copy(base)
    out.__class__ = __adapted_class(type(base))
    out._vlfast = pre
    cfg = pre.config
    # the placeholder count (get_number_of_image_patches) reads these budgets: a dict (transformers 4) or a
    # SizeDict dataclass (5)
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


def __adapted_class(base_cls: type) -> type:
    cls = _ADAPTED.get(base_cls)
    if cls is None:
        cls = _ADAPTED[base_cls] = type(
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
    return cls


def _base_class(obj) -> type:
    return type(obj).__mro__[1]


def _adapted_reduce(self):
    # the object as it is now (deepcopy, pickle to DataLoader workers), with the snapshot of its settings
    state = {k: v for k, v in self.__dict__.items() if k != "_vlfast"}
    return (_rebuilt, (self._vlfast, _base_class(self), state))


def _rebuilt(pre: Any, base_cls: type, state: dict) -> Any:
    out = base_cls.__new__(__adapted_class(base_cls))
    out.__dict__.update(state)
    out._vlfast = pre
    return out


def _adapted_to_dict(self) -> dict[str, Any]:
    """``base``'s, as ``save_pretrained`` writes it: its own class name, no vlfast attribute."""
    out = {k: v for k, v in _base_class(self).to_dict(self).items() if not k.startswith("_vlfast")}
    out["image_processor_type"] = out["image_processor_type"].removeprefix("Vlfast")
    return out


_MEANS = ("image_mean", "image_std")


def pixel_settings(ip: Any) -> dict[str, Any]:
    """The settings of a transformers image processor ``ip`` that change its pixels, as comparable values
    (transformers 4 and 5 keep the budgets in ``size`` and, in 4, also ``min_pixels``/``max_pixels``)."""
    size = getattr(ip, "size", None)
    out: dict[str, Any] = {}
    if size is not None:
        out["size"] = tuple(
            (k, size[k]) for k in ("shortest_edge", "longest_edge", "height", "width") if k in size
        )
    plain = [k for k in IMAGE_PROCESSOR_SETTINGS if k not in ("size", "resample", *_MEANS)]
    for name in (*plain, "do_center_crop", "do_pad"):  # the last two: vlfast does neither
        out[name] = getattr(ip, name, None)
    for name in _MEANS:
        value = getattr(ip, name, None)
        out[name] = None if value is None else tuple(float(v) for v in value)
    resample = getattr(ip, "resample", None)
    try:
        out["resample"] = None if resample is None else int(resample)
    except (TypeError, ValueError):  # an enum of another library: compared as it prints
        out["resample"] = str(resample)
    return out


def _call_mismatch(kwargs: dict[str, Any], cfg) -> str | None:
    """Why a call's options cannot be answered by vlfast (None: they can): a pixel setting other than
    ``cfg``'s, or an option vlfast does not know."""
    for key, value in kwargs.items():
        if value is None or key in _LAYOUT_KWARGS:
            continue
        name = IMAGE_PROCESSOR_SETTINGS.get(key)
        if name is None:
            return f"{key}={value!r} in a call: an option vlfast does not take"
        if name == "size":
            lo, hi = cfg.image_min_pixels, cfg.image_max_pixels
            ours = f"shortest_edge={lo}, longest_edge={hi}"
            try:
                edges = {"shortest_edge", "longest_edge"}
                same = (value["shortest_edge"], value["longest_edge"]) == (lo, hi) and set(
                    dict(value)
                ) <= edges
            except (KeyError, TypeError, ValueError):
                same = False
        elif name == "do_convert_rgb":
            ours, same = "True", value is True
        else:
            ours = getattr(cfg, name)
            same = _same(value, ours)
        if not same:
            return f"{key}={value!r} in a call, where this VisionPreprocessor has {ours}"
    return None


def _channels_first(shape: tuple[int, ...], given: Any = None) -> bool:
    """Whether a 3-axis array is (C, H, W): as ``given`` says (a call's ``input_data_format``), else as
    transformers infers it: the first axis if it is 1 or 3 long, even where the last is too."""
    if given is not None:
        return str(getattr(given, "value", given)) == "channels_first"
    return shape[0] in (1, 3)


def _arrays_left_to_transformers(images, who: str, channels: Any) -> str | None:
    """Why a swapped processor's call goes to transformers: a 3-axis array whose channel axis transformers
    guesses ((3, W, 3), (1, W, 3), (3, W, 1)), or one of a single channel: releases of transformers differ
    on both. ``channels``: the call's ``input_data_format``."""
    import numpy as np
    import torch

    for x in _flat(images):
        if not isinstance(x, (np.ndarray, torch.Tensor)) or x.ndim != 3:
            continue
        if channels is None and {x.shape[0], x.shape[-1]} <= {1, 3}:
            return f"{who}: an array whose channel axis transformers guesses (pass input_data_format)"
        if x.shape[0 if _channels_first(x.shape, channels) else -1] == 1:
            return f"{who}: an array of one channel (releases of transformers read it differently)"
    return None


def _flat(images) -> list:
    """The inputs of a call, one level of nesting flattened, as transformers flattens them."""
    out = []
    for item in images if isinstance(images, (list, tuple)) else [images]:
        out.extend(item if isinstance(item, (list, tuple)) else [item])
    return out


def conformed_inputs(images, who: str, channels: Any = None):
    """``images`` as the PIL images vlfast's path takes, or (None, why) where one is of a kind it does not.
    ``channels``: a call's ``input_data_format`` (None: inferred as transformers infers it)."""
    import numpy as np
    import torch
    from PIL import Image

    conformed = []
    for x in _flat(images):
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

    pre = self._vlfast  # a VisionPreprocessor
    who = type(self).__name__
    why = None
    if args:
        why = f"{who}: {len(args)} positional options: pass options by name"
    elif images is None:
        why = f"{who}: no images given"
    if kwargs.get("do_resize") is False and pre.config.do_resize:  # ms-swift's Qwen templates' call
        pre = without_resize(pre)
    why = why or _call_mismatch(kwargs, pre.config)
    if why is None:
        changed = [k for k, v in pixel_settings(self).items() if self._vlfast_settings.get(k) != v]
        if changed:
            why = f"the image processor's {', '.join(changed)} changed since vlfast took its calls"
    conformed = None
    if why is None and self._vlfast_fallback:
        why = _arrays_left_to_transformers(images, who, kwargs.get("input_data_format"))
    if why is None:
        conformed, why = conformed_inputs(images, who, kwargs.get("input_data_format"))
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
    # counted without the values (one count per kind of refusal, not per image)
    refused = why.startswith("an image vlfast refused")
    count_image_processor_call(why.split(" (", 1)[0] if refused else why)
    return _base_class(self).preprocess(self, images, *args, return_tensors=return_tensors, **kwargs)


def without_resize(pre: Any) -> Any:
    """``pre`` with the image processor's ``do_resize`` off, as a call's ``do_resize=False`` asks."""
    from vlfast.pixels.engine import Preprocessor

    out = copy.copy(pre)
    inner = pre._pre
    out._pre = Preprocessor(
        dataclasses.replace(inner.cfg, do_resize=False),
        image_processor_dir=inner.image_processor_dir,
        defer_video_normalize=inner.defer_video_normalize,
    )
    return out


def _same(value, ours) -> bool:
    if isinstance(ours, (tuple, list)):
        try:
            return [float(v) for v in value] == [float(v) for v in ours]
        except TypeError:
            return False
    return value == ours
