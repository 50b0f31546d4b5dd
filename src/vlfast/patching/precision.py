"""float32 that is float32: the settings that let a float32 conv or matmul round its inputs, read and set.

A stock conv and its GEMM take their float32 precision from different settings (cuDNN convs run TF32 by
default, cuBLAS matmuls IEEE), so :func:`ieee_fp32` turns every such setting to IEEE while verify compares,
and :func:`fp32_settings` says what this process would otherwise use. torch >= 2.9 raises when the
per-backend ``fp32_precision`` is read through the legacy ``allow_tf32`` flags: each API is used alone.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch

__all__ = ["fp32_settings", "ieee_fp32", "precision_knob"]

# (backend, op): the float32 conv and matmul of each device family.
_FAMILY = {"cuda": (("cudnn", "conv"), ("cuda", "matmul")), "cpu": (("mkldnn", "conv"), ("mkldnn", "matmul"))}


def _new_api() -> bool:
    try:
        torch.backends.cudnn.conv.fp32_precision  # noqa: B018
        torch.backends.mkldnn.matmul.fp32_precision  # noqa: B018
        return True
    except (AttributeError, RuntimeError):
        return False


def _get(backend: str, op: str) -> str:
    return getattr(getattr(torch.backends, backend), op).fp32_precision


def _set(backend: str, op: str, value: str) -> None:
    getattr(getattr(torch.backends, backend), op).fp32_precision = value


def precision_knob(backend: str, op: str) -> str:
    """The setting a user changes, as they would write it: ``torch.backends.cudnn.conv.fp32_precision``."""
    if _new_api():
        return f"torch.backends.{backend}.{op}.fp32_precision"
    return {
        ("cudnn", "conv"): "torch.backends.cudnn.allow_tf32",
        ("cuda", "matmul"): "torch.backends.cuda.matmul.allow_tf32",
    }.get((backend, op), f"torch.backends.{backend}")


def _effective(backend: str, op: str) -> str:
    """What ``backend``'s ``op`` does with float32: "ieee", "tf32" or "bf16". In torch's own order: the op's
    setting, else its backend's ("all"), else the global one; "none" all the way down is IEEE."""
    if not _new_api():
        tf32 = {("cudnn", "conv"): torch.backends.cudnn, ("cuda", "matmul"): torch.backends.cuda.matmul}
        if (backend, op) in tf32:
            return "tf32" if tf32[backend, op].allow_tf32 else "ieee"
        medium = torch.get_float32_matmul_precision() == "medium"
        return "bf16" if (backend, op) == ("mkldnn", "matmul") and medium else "ieee"
    settings = (
        _get(backend, op),
        getattr(getattr(torch.backends, backend), "fp32_precision", "none"),
        getattr(torch.backends, "fp32_precision", "none"),
    )
    return next((value for value in settings if value != "none"), "ieee")


def fp32_settings(device: str | torch.device) -> dict[str, tuple[str, str]]:
    """For ``device``'s family (cuda, else cpu): ``{"conv": (precision, knob), "matmul": (precision, knob)}``,
    what a stock float32 conv and the patched GEMM compute in under this process's settings, and the setting
    that decides it (an MPS or other device reports its CPU-side settings)."""
    family = _FAMILY["cuda" if torch.device(device).type == "cuda" else "cpu"]
    return {
        kind: (_effective(b, o), precision_knob(b, o)) for kind, (b, o) in zip(("conv", "matmul"), family)
    }


@contextmanager
def ieee_fp32() -> Iterator[None]:
    """Every float32 conv and matmul in IEEE float32 inside the block (cuDNN, cuBLAS, oneDNN), each setting
    put back as it was afterwards, also when the block raises. Process-wide, as torch's settings are."""
    if _new_api():
        knobs = [pair for pairs in _FAMILY.values() for pair in pairs]
        saved = [(b, o, _get(b, o)) for b, o in knobs]
        try:
            for b, o in knobs:
                _set(b, o, "ieee")
            yield
        finally:
            for b, o, value in saved:
                _set(b, o, value)
        return
    matmul = torch.get_float32_matmul_precision()
    saved_legacy = (torch.backends.cudnn.allow_tf32, torch.backends.cuda.matmul.allow_tf32)
    try:
        torch.set_float32_matmul_precision("highest")
        torch.backends.cudnn.allow_tf32 = False
        torch.backends.cuda.matmul.allow_tf32 = False
        yield
    finally:
        torch.set_float32_matmul_precision(matmul)  # first: it sets cuBLAS's flag too
        torch.backends.cudnn.allow_tf32, torch.backends.cuda.matmul.allow_tf32 = saved_legacy
