"""The compute dtypes every command accepts, and their spellings: one policy for ``--dtype``.

float32, bfloat16 or float16, spelt as torch names them or as people write them (``bf16``, ``fp16``,
``half``, ``fp32``, ``float``); float64 is no dtype these models run in (``vlfast extract`` stores float16,
bfloat16 or float32 only).
"""

from __future__ import annotations

import sys
from typing import TYPE_CHECKING

from vlfast.errors import InputRefused

if TYPE_CHECKING:  # pragma: no cover
    import torch

__all__ = ["COMPUTE_DTYPES", "dtype_name", "torch_dtype"]

COMPUTE_DTYPES = ("float32", "bfloat16", "float16")

ALIASES = {
    **dict.fromkeys(["float32", "fp32", "float"], "float32"),
    **dict.fromkeys(["bfloat16", "bf16"], "bfloat16"),
    **dict.fromkeys(["float16", "fp16", "half"], "float16"),
}


def dtype_name(dtype: str | torch.dtype) -> str:
    """Canonical name of a dtype given as ``torch.bfloat16``, ``"bf16"``, ...; others are refused (exit 2).
    Imports no torch: a torch.dtype exists only once torch is imported."""
    torch = sys.modules.get("torch")
    if torch is not None and isinstance(dtype, torch.dtype):
        name = str(dtype).removeprefix("torch.")
    elif isinstance(dtype, str):
        name = dtype.lower().removeprefix("torch.")
    else:
        raise InputRefused(f"dtype must be a torch.dtype or a string, got {type(dtype).__name__}")
    if name not in ALIASES:
        why = " (these models do not run in float64)" if name in ("float64", "double") else ""
        raise InputRefused(
            f"unsupported dtype {dtype!r}{why}: dtype must be float32, bfloat16 or float16 (or bf16, fp16, fp32)"
        )
    return ALIASES[name]


def torch_dtype(dtype: str | torch.dtype) -> torch.dtype:
    """The torch dtype of any accepted spelling (see :func:`dtype_name`)."""
    import torch

    return getattr(torch, dtype_name(dtype))
