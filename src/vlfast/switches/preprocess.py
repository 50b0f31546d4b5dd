"""``VLFAST_PREPROCESS``: every processor ``ProcessorMixin.from_pretrained`` loads from a local Qwen-VL checkpoint
has its torchvision image processor's calls answered by :class:`vlfast.VisionPreprocessor`
(:func:`swap_image_processor`), where a probe on the transformers installed proves the pixels equal.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

from vlfast.pixels.adapter import adapted, pixel_settings, without_resize
from vlfast.pixels.preprocessor import VisionPreprocessor
from vlfast.pixels.settings import IMAGE_PROCESSOR_SETTINGS, TORCHVISION_IMAGE_PROCESSORS

__all__ = ["install_processor_switch", "swap_image_processor"]

_said: set[str] = set()
_TORCHVISION_BACKENDS = {"TorchvisionBackend", "BaseImageProcessorFast"}  # transformers' base classes of them


def swap_image_processor(processor: Any, path: Any) -> str | None:
    """Let vlfast answer ``processor.image_processor``'s calls where its pixels are those of transformers'
    torchvision backend for the local checkpoint ``path`` (transformers' own code for any call it cannot
    answer exactly); returns why it was not swapped (None: it was)."""
    ip = getattr(processor, "image_processor", None)
    if ip is None or getattr(ip, "_vlfast", None) is not None:
        return None if ip is not None else "the processor has no image processor"
    name = type(ip).__name__
    backends = {c.__name__ for c in type(ip).__mro__}
    if name not in TORCHVISION_IMAGE_PROCESSORS or not backends & _TORCHVISION_BACKENDS:
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
    budgets = dict(pixel_settings(ip).get("size") or ())
    try:
        pre = VisionPreprocessor(
            str(folder),
            min_pixels=budgets.get("shortest_edge") or getattr(ip, "min_pixels", None),
            max_pixels=budgets.get("longest_edge") or getattr(ip, "max_pixels", None),
        )
    except Exception as e:  # noqa: BLE001 - any reason is a reason to leave transformers' code in place
        return f"{type(e).__name__}: {e}"
    if bad := _config_mismatch(ip, pre.config):
        return f"its {', '.join(bad)} differ from what vlfast reads in the checkpoint's files"
    if why := _probe(pre, ip):
        return why
    processor.image_processor = adapted(pre, ip, fallback=True)
    return None


# The proof run where the swap happens, on random pixels: an upscale to the minimum budget, and a small
# antialiased downscale to the patch grid; then _probes' thin image and do_resize=False call
_PROBES = ((67, 91), (257, 300))


def _probes(cfg) -> list[tuple[tuple[int, int], dict]]:
    """The probe images' (height, width) and call options: _PROBES; a thin one, where transformers' rule and
    qwen-vl-utils' give other grids (THIN_IMAGES); and ms-swift's call, do_resize=False on the patch grid."""
    f = cfg.factor
    short = max(1, f // 2 - 4)
    long = min(200 * short, -(-cfg.image_min_pixels // f) + 2 * f)
    return [*((size, {}) for size in _PROBES), ((short, long), {}), ((8 * f, 9 * f), {"do_resize": False})]


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
        got = (without_resize(pre) if call else pre)(images=[img])
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
    """Every processor ``ProcessorMixin.from_pretrained`` loads gets :func:`swap_image_processor`; one line
    on stderr for a processor left as it is. Safe to call twice."""
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
            line = f"vlfast: VLFAST_PREPROCESS: the processor of {pretrained_model_name_or_path} keeps "
            line += f"transformers' image processor: {why}"
            if line not in _said:  # said once
                _said.add(line)
                print(line, file=sys.stderr, flush=True)
        return processor

    from_pretrained._vlfast_switch = True
    from_pretrained.__wrapped__ = original
    from_pretrained.__doc__ = original.__doc__
    ProcessorMixin.from_pretrained = classmethod(from_pretrained)


_FLOATS = ("image_mean", "image_std")  # compared as tuples of floats


def _config_mismatch(ip: Any, cfg) -> list[str]:
    """The names of ``ip``'s pixel settings that differ from ``cfg``'s (empty: vlfast's pixels are ``ip``'s)."""
    have = pixel_settings(ip)
    want = {
        name: tuple(float(v) for v in getattr(cfg, field)) if name in _FLOATS else getattr(cfg, field)
        for name, field in IMAGE_PROCESSOR_SETTINGS.items()
        if name not in ("size", "do_convert_rgb")  # checked below: the budgets, and True
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
