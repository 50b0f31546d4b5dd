"""Vision towers: built from a reference or a checkpoint, found inside a model, their inputs and outputs.

Vision towers are found from the code, not from a list: the smallest module holding a stride == kernel
conv whose ``forward`` takes ``grid_thw``. Imports torch (the package face, :mod:`vlfast.models`, does not).
"""

from __future__ import annotations

import importlib
import inspect
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from vlfast.errors import InputRefused
from vlfast.models.checkpoints import by_file, checkpoint_dir, load_config, tensor_locations
from vlfast.models.ref import ModelRef
from vlfast.models.references import resolve_reference
from vlfast.patching.gemm import eligibility


def vision_model_class(config: Any) -> type[nn.Module]:
    """The transformers class a vision config builds: found in the family's modeling module."""
    family_pkg = type(config).__module__.rsplit(".", 1)[0]  # transformers.models.<family>
    family = family_pkg.rsplit(".", 1)[-1]
    modeling = importlib.import_module(f"{family_pkg}.modeling_{family}")
    from transformers import PreTrainedModel

    matches = [
        obj
        for obj in vars(modeling).values()
        if inspect.isclass(obj)
        and issubclass(obj, PreTrainedModel)
        and getattr(obj, "config_class", None) is type(config)
    ]
    if not matches:
        raise InputRefused(f"no vision model class for {type(config).__name__} in {modeling.__name__}")
    return matches[0]


def _build_from_vision_config(config: Any, *, device: str | torch.device, dtype: torch.dtype) -> nn.Module:
    cls = vision_model_class(config)
    if getattr(config, "_attn_implementation", None) is None:
        config._attn_implementation = "sdpa"
    with torch.device(device):
        model = cls._from_config(config, **{_dtype_keyword(): dtype})
    return model.eval()


def _dtype_keyword() -> str:
    """transformers 4.56 renamed ``torch_dtype`` to ``dtype``; before it, ``dtype`` reaches the model's
    ``__init__`` and fails there."""
    import transformers

    major, minor = (int(part) for part in transformers.__version__.split(".")[:2])
    return "dtype" if (major, minor) >= (4, 56) else "torch_dtype"


def build_reference(
    name: str,
    *,
    tiny: bool = False,
    device: str | torch.device = "cpu",
    dtype: torch.dtype = torch.float32,
    seed: int = 0,
) -> nn.Module:
    """The reference vision tower ``name`` with random weights (``device="meta"`` allocates nothing)."""
    config = reference_config(name, tiny=tiny)
    torch.manual_seed(seed)
    return _build_from_vision_config(config, device=device, dtype=dtype)


def reference_config(name: str, *, tiny: bool = False) -> Any:
    """The transformers vision config the reference ``name`` is built from."""
    ref = resolve_reference(name)
    if not ref.installed():
        import transformers

        raise InputRefused(
            f"ref:{ref.name} needs the {ref.family} family, which transformers {transformers.__version__} "
            "does not have: upgrade transformers"
        )
    module = importlib.import_module(f"transformers.models.{ref.family}.configuration_{ref.family}")
    return getattr(module, ref.config_class)(**{**ref.vision, **(ref.tiny if tiny else {})})


def vision_config_of(spec: str | Path) -> Any:
    """The vision config ``spec``'s tower is built from (a reference's, or the checkpoint's), building nothing."""
    if ModelRef.of(spec).is_reference:
        return reference_config(str(spec))
    return _vision_config(checkpoint_dir(spec))[1]


def _vision_config(path: Path) -> tuple[Any, Any]:
    """(config, its vision_config) of a checkpoint folder; InputRefused where it has none."""
    config = load_config(path)
    vision_config = getattr(config, "vision_config", None)
    if vision_config is None:
        raise InputRefused(f"{path}/config.json has no vision_config: not a vision-language checkpoint")
    return config, vision_config


# ---------------------------------------------------------------------------------------------- towers


# GLM towers index position embeddings per grid row but attend per frame: their processors split a video's
# grid (t, h, w) into t rows of (1, h, w), and the tower expects that.
_FRAMES_AS_IMAGES = {"glm4v", "glm4v_moe", "glm_ocr", "glm_image", "glm5_next"}


@dataclass(frozen=True)
class TowerSpec:
    """What it takes to feed a vision tower: the patch conv's geometry and the merge size."""

    in_channels: int
    temporal_patch_size: int
    patch_size: int
    spatial_merge_size: int
    hidden_size: int  # the patch embedding's output width
    frames_as_images: bool = False  # the tower wants a video's t frames as t rows of (1, h, w)

    @property
    def patch_dim(self) -> int:  # columns of pixel_values: C * T * P * P
        return self.in_channels * self.temporal_patch_size * self.patch_size**2


def _forward_takes_grid(module: nn.Module) -> bool:
    try:
        return "grid_thw" in inspect.signature(module.forward).parameters
    except (TypeError, ValueError):
        return False


def _patch_convs(module: nn.Module) -> list[tuple[str, nn.Module]]:
    return [(n, m) for n, m in module.named_modules() if isinstance(m, nn.Conv3d) and eligibility(m) is None]


def find_vision_tower(model: nn.Module) -> tuple[str, nn.Module]:
    """The smallest module in ``model`` that holds a patchable Conv3d and whose forward takes ``grid_thw``."""
    candidates = [(n, m) for n, m in model.named_modules() if _forward_takes_grid(m) and _patch_convs(m)]
    # Candidates nest (the VLM, its inner model, the tower): the deepest is the tower itself.
    best = max(candidates, key=lambda c: len(c[0].split(".")) if c[0] else 0, default=None)
    if best is None:
        raise InputRefused(
            f"no Qwen-VL-style vision tower found in {type(model).__name__}: expected a module whose forward "
            "takes grid_thw and holds a stride == kernel Conv3d"
        )
    return best


def tower_spec(tower: nn.Module) -> TowerSpec:
    convs = _patch_convs(tower)
    if not convs:
        raise InputRefused(f"{type(tower).__name__} holds no stride == kernel Conv3d patch embedding")
    conv = convs[0][1]
    t, p, _ = conv.kernel_size
    merge = int(getattr(getattr(tower, "config", None), "spatial_merge_size", 2) or 2)
    frames = type(tower).__module__.rsplit(".", 2)[-2] in _FRAMES_AS_IMAGES
    return TowerSpec(int(conv.in_channels), int(t), int(p), merge, int(conv.out_channels), frames)


def synthetic_inputs(
    tower: nn.Module,
    grids: Sequence[tuple[int, int, int]],
    *,
    dtype: torch.dtype = torch.float32,
    device: str | torch.device = "cpu",
    seed: int = 0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Random ``pixel_values`` (sum(t*h*w), C*T*P*P) and ``grid_thw`` (B, 3) in the tower's own layout."""
    spec = tower_spec(tower)
    for g in grids:
        if len(g) != 3 or g[1] % spec.spatial_merge_size or g[2] % spec.spatial_merge_size or min(g) < 1:
            raise InputRefused(
                f"grid {g} must be (t, h, w) with h and w multiples of {spec.spatial_merge_size}"
            )
    if spec.frames_as_images:
        grids = [(1, h, w) for t, h, w in grids for _ in range(t)]
    gen = torch.Generator().manual_seed(seed)
    n = sum(t * h * w for t, h, w in grids)
    pixels = torch.randn(n, spec.patch_dim, generator=gen).to(device=device, dtype=dtype)
    return pixels, torch.tensor(grids, dtype=torch.long, device=device)


def tower_outputs(out: Any) -> dict[str, Any]:
    """A tower's output across transformers versions (the merged tensor, a ``(merged, deepstack_list)``
    tuple, or an output object whose ``pooler_output`` is the merged tokens) as ``{"merged": (tokens, D_out),
    "deepstack": [...], "last_hidden_state": ... or None}``."""
    if isinstance(out, torch.Tensor):
        return {"merged": out, "deepstack": [], "last_hidden_state": None}
    if isinstance(out, (tuple, list)) and not hasattr(out, "keys"):
        deep = list(out[1]) if len(out) > 1 and isinstance(out[1], (list, tuple)) else []
        return {"merged": out[0], "deepstack": deep, "last_hidden_state": None}
    merged = getattr(out, "pooler_output", None)
    last = getattr(out, "last_hidden_state", None)
    deep = getattr(out, "deepstack_features", None) or []
    return {
        "merged": merged if merged is not None else last,
        "deepstack": list(deep),
        "last_hidden_state": last,
    }


# ------------------------------------------------------------------------------------------- loading


def load_vision_tower(
    spec: str | Path,
    *,
    device: str | torch.device = "cpu",
    dtype: torch.dtype | None = None,
    tiny: bool = False,
) -> nn.Module:
    """Only the vision tower of ``spec``: a reference, or the tower's weights read from a checkpoint (by
    matching key suffixes, so the language model is never loaded). ``device="meta"`` reads nothing."""
    if ModelRef.of(spec).is_reference:
        return build_reference(str(spec), tiny=tiny, device=device, dtype=dtype or torch.float32)
    path = checkpoint_dir(spec)
    config, vision_config = _vision_config(path)
    if dtype is None:
        # "dtype" first: transformers 5 warns "`torch_dtype` is deprecated" on reading the old name
        dtype = getattr(config, "dtype", None) or getattr(config, "torch_dtype", None) or torch.float32
        dtype = getattr(torch, dtype) if isinstance(dtype, str) else dtype
    tower = _build_from_vision_config(
        vision_config, device="meta" if device == "meta" else "cpu", dtype=dtype
    )
    if str(device) == "meta":
        return tower
    from safetensors import safe_open

    found: dict[str, torch.Tensor] = {}
    for file, names in by_file(tower_tensor_locations(path, dict(tower.state_dict()))).items():
        with safe_open(str(file), framework="pt") as f:
            for name, key in names:
                found[name] = f.get_tensor(key)
    tower.load_state_dict(found, strict=True)
    return tower.to(device=device)


def tower_tensor_names(spec: str | Path) -> list[str]:
    """The names of the vision tower's tensors (its state_dict), from building it on the meta device."""
    tower = _build_from_vision_config(vision_config_of(spec), device="meta", dtype=torch.float32)
    return list(tower.state_dict())


def tower_tensor_locations(
    spec: str | Path, names: Sequence[str] | None = None
) -> dict[str, tuple[Path, str]]:
    """Where each vision-tower tensor lives in a checkpoint: tower name -> (safetensors file, checkpoint key),
    the names from :func:`tower_tensor_names` unless given (:func:`~vlfast.models.checkpoints.tensor_locations`)."""
    path = checkpoint_dir(spec)
    return tensor_locations(path, tower_tensor_names(path) if names is None else names)


def load_model(
    spec: str | Path,
    *,
    device: str | torch.device = "cpu",
    dtype: torch.dtype | None = None,
    head: bool = True,
) -> nn.Module:
    """The whole model of a checkpoint directory (offline), or a reference's vision tower. ``head=False``
    builds the bare model (``AutoModel``: no LM head) first, for checkpoints saved without one, such as
    Qwen3-VL-Embedding's: a random head would be built, reported missing and, untied, take memory."""
    if ModelRef.of(spec).is_reference:
        return build_reference(str(spec), device=device, dtype=dtype or torch.float32)
    path = checkpoint_dir(spec)
    import transformers

    config = load_config(path)
    kwargs: dict[str, Any] = {"local_files_only": True}
    if dtype is not None:
        kwargs[_dtype_keyword()] = dtype
    last_error: Exception | None = None
    autos = ("AutoModelForImageTextToText", "AutoModelForVision2Seq", "AutoModel")
    for auto in autos if head else ("AutoModel", *autos[:2]):
        cls = getattr(transformers, auto, None)
        if cls is None:
            continue
        try:
            model = cls.from_pretrained(path, **kwargs)
            return model.to(device).eval()
        except ValueError as e:  # this auto class does not know the config
            last_error = e
    raise InputRefused(f"{path}: transformers cannot build {type(config).__name__}: {last_error}")


def tower_shapes(spec: str | Path) -> dict[str, list[int]]:
    """The vision tower's tensors (its state_dict's names, in order) and the shapes config.json gives them, from
    building the tower on the meta device."""
    return {name: list(t.shape) for name, t in load_vision_tower(spec, device="meta").state_dict().items()}
