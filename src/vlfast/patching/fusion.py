"""transformers' own patch-embedding fusion (>= 5.6, ``fusion_config={"patch_embeddings": True}`` at load or
in config.json), seen from vlfast: the module becomes a ``Fused<Class>`` holding ``linear_proj``, nothing
left to patch or verify, and not a failure. Read without importing transformers.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from torch import nn

__all__ = ["checkpoint_fusion", "fused_patch_embeddings", "fusion_note"]


def fused_patch_embeddings(model: nn.Module) -> list[tuple[str, str]]:
    """(qualified name, class name) of each patch embedding transformers' fusion replaced in ``model``:
    a module holding a ``linear_proj`` Linear and the ``patch_volume`` it flattens windows to."""
    return [
        (name, type(m).__name__)
        for name, m in model.named_modules()
        if isinstance(getattr(m, "linear_proj", None), nn.Linear)
        and isinstance(getattr(m, "patch_volume", None), int)
    ]


def checkpoint_fusion(path: str | Path) -> dict[str, Any] | None:
    """The ``fusion_config`` a local checkpoint's config.json asks for, when it asks to fuse the patch
    embeddings; None otherwise (no such file, no such key, or a file that is not JSON)."""
    try:
        data = json.loads((Path(path) / "config.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    fusion = data.get("fusion_config") if isinstance(data, dict) else None
    return fusion if isinstance(fusion, dict) and fusion.get("patch_embeddings") else None


def fusion_note(path: str | Path) -> str | None:
    """A sentence for doctor and verify when a checkpoint's config asks transformers to fuse."""
    fusion = checkpoint_fusion(path)
    if fusion is None:
        return None
    return (
        f"{path}: config.json asks transformers to fuse the patch embedding (fusion_config "
        f"{json.dumps(fusion)}): from_pretrained replaces the Conv3d with a Linear (linear_proj), so a model "
        f"loaded the usual way is already on the GEMM and vlfast's patch finds no conv to replace there; "
        f"the figures here are for the conv the weights define (what loading without fusion runs)"
    )
