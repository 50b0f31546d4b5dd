"""Pixel finishing, one path for every caller: inputs' pixel_values, uint8 patches deferred by the decode side
or float ones, made the model's one tensor where they land."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from vlfast.pixels.settings import ProcessorConfig
from vlfast.pixels.video import empty_pixels, normalize_patches, pixel_width

__all__ = ["finish_pixels", "moved"]


def moved(x: torch.Tensor, device: torch.device | str | None) -> torch.Tensor:
    """``x`` on ``device`` (None: where it is). To CUDA the copy starts from pinned memory, so ``non_blocking``
    really overlaps it (from pageable memory it would be synchronous)."""
    if device is None:
        return x
    device = torch.device(device)
    if device.type == "cuda" and not x.is_pinned():
        x = x.pin_memory()
    return x.to(device, non_blocking=True)


def finish_pixels(
    parts: Sequence[torch.Tensor],
    cfg: ProcessorConfig,
    *,
    images: bool = False,
    device: torch.device | str | None = None,
    dtype: torch.dtype | None = None,
) -> torch.Tensor:
    """Inputs' pixel_values as one (sum of N, C*T*P*P) tensor of ``dtype`` (None: float32) on ``device`` (None:
    where they are): what ``torch.cat`` of each one's float32 pixels, then ``.to(dtype)``, gives, bit for bit,
    without either copy. uint8 patches are normalised (after crossing to the device) straight into their rows,
    by the image processor's settings (``images``) or the video processor's; float ones are copied there. One
    float input of that dtype is given back as it is (moved)."""
    parts = [moved(x, device) for x in parts]
    if len(parts) == 1 and parts[0].dtype != torch.uint8 and dtype in (None, parts[0].dtype):
        return parts[0]
    widths = {pixel_width(x, cfg) if x.dtype == torch.uint8 else x.shape[1] for x in parts}
    if len(widths) != 1:
        raise ValueError(f"pixel_values of different widths in one batch: {sorted(widths)}")
    where = parts[0].device
    out = empty_pixels((sum(int(x.shape[0]) for x in parts), widths.pop()), dtype or torch.float32, where)
    row = 0
    for x in parts:
        rows = out[row : row + x.shape[0]]
        if x.dtype == torch.uint8:
            normalize_patches(x, cfg, out=rows, images=images)
        else:
            rows.copy_(x)
        row += x.shape[0]
    return out
