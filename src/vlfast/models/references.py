"""The built-in references: published vision towers as plain data, importable without torch.

A *reference* is a published vision tower named ``ref:NAME`` wherever a command takes ``--model``: which
transformers config class builds it and with what numbers. :mod:`vlfast.models` builds them (random
weights); ``vlfast models`` lists them from here alone, without importing torch or transformers.
"""

from __future__ import annotations

import importlib.util
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from vlfast.errors import InputRefused

__all__ = [
    "DEFAULT_REFERENCE",
    "REFERENCES",
    "REF_PREFIX",
    "Reference",
    "list_references",
    "resolve_reference",
]

REF_PREFIX = "ref:"


@dataclass(frozen=True)
class Reference:
    """A published vision tower: which transformers config class builds it and with what numbers."""

    name: str
    family: str  # transformers model_type, also the package under transformers.models
    config_class: str  # vision config class in transformers.models.<family>.configuration_<family>
    vision: dict[str, Any]  # published vision_config values
    source: str  # where the numbers come from
    tiny: dict[str, Any] = field(default_factory=dict)  # overrides for a seconds-fast test build

    def to_dict(self) -> dict[str, Any]:
        return {k: v for k, v in asdict(self).items() if k != "tiny"}

    # What `vlfast models` shows, read from the published numbers (families name them differently).
    @property
    def depth(self) -> int:
        return int(self.vision["depth"])

    @property
    def width(self) -> int:
        """The patch embedding's output width (Qwen2-VL calls it embed_dim, its hidden_size is the output)."""
        return int(self.vision.get("embed_dim", self.vision.get("hidden_size")))

    @property
    def heads(self) -> int:
        return int(self.vision["num_heads"])

    @property
    def patch(self) -> tuple[int, int]:
        """(T, P): the patch conv's kernel is (T, P, P)."""
        return int(self.vision["temporal_patch_size"]), int(self.vision["patch_size"])

    def installed(self) -> bool:
        """Whether the installed transformers has this family (its folder under ``transformers/models``)."""
        return self.family in installed_families()

    @property
    def out_width(self) -> int:
        """The merger's output width: the language model's hidden size."""
        v = self.vision
        return int(v["out_hidden_size"] if "out_hidden_size" in v else v["hidden_size"])


def _hf(repo: str) -> str:
    return f"huggingface.co/{repo} config.json (vision_config)"


# Every tower of a family shares its geometry; the references below differ only where the published
# checkpoints do (depth, width, output width, deepstack levels).
_PATCH_14 = {"in_channels": 3, "patch_size": 14, "spatial_merge_size": 2, "temporal_patch_size": 2}
_QWEN3 = {
    "in_channels": 3,
    "patch_size": 16,
    "spatial_merge_size": 2,
    "temporal_patch_size": 2,
    "num_heads": 16,
    "num_position_embeddings": 2304,
    "hidden_act": "gelu_pytorch_tanh",
}
_QWEN3_SMALL = {
    **_QWEN3,
    "depth": 24,
    "hidden_size": 1024,
    "intermediate_size": 4096,
    "deepstack_visual_indexes": [5, 11, 17],
}
_QWEN3_LARGE = {
    **_QWEN3,
    "depth": 27,
    "hidden_size": 1152,
    "intermediate_size": 4304,
    "deepstack_visual_indexes": [8, 16, 24],
}
_TINY = {"depth": 2, "hidden_size": 64, "intermediate_size": 128, "num_heads": 4, "out_hidden_size": 96}
_QWEN3_TINY = {**_TINY, "deepstack_visual_indexes": [0, 1], "num_position_embeddings": 64}

# Dimensions from the published checkpoints' config.json (vision_config), checked against transformers'
# configuration defaults where they coincide.
# fmt: off
REFERENCES: dict[str, Reference] = {
    r.name: r
    for r in [
        Reference("qwen2-vl-7b", "qwen2_vl", "Qwen2VLVisionConfig",
                  {**_PATCH_14, "depth": 32, "embed_dim": 1280, "hidden_size": 3584, "mlp_ratio": 4,
                   "num_heads": 16, "hidden_act": "quick_gelu"},
                  _hf("Qwen/Qwen2-VL-7B-Instruct"),
                  {"depth": 2, "embed_dim": 64, "hidden_size": 96, "num_heads": 4}),
        Reference("qwen2.5-vl-7b", "qwen2_5_vl", "Qwen2_5_VLVisionConfig",
                  {**_PATCH_14, "depth": 32, "hidden_size": 1280, "intermediate_size": 3420, "num_heads": 16,
                   "out_hidden_size": 3584, "window_size": 112, "fullatt_block_indexes": [7, 15, 23, 31],
                   "tokens_per_second": 2, "hidden_act": "silu"},
                  _hf("Qwen/Qwen2.5-VL-7B-Instruct"),
                  {**_TINY, "fullatt_block_indexes": [1]}),
        Reference("qwen3-vl-2b", "qwen3_vl", "Qwen3VLVisionConfig", {**_QWEN3_SMALL, "out_hidden_size": 2048},
                  _hf("Qwen/Qwen3-VL-2B-Instruct"), _QWEN3_TINY),
        Reference("qwen3-vl-4b", "qwen3_vl", "Qwen3VLVisionConfig", {**_QWEN3_SMALL, "out_hidden_size": 2560},
                  _hf("Qwen/Qwen3-VL-4B-Instruct"), _QWEN3_TINY),
        Reference("qwen3-vl-8b", "qwen3_vl", "Qwen3VLVisionConfig", {**_QWEN3_LARGE, "out_hidden_size": 4096},
                  _hf("Qwen/Qwen3-VL-8B-Instruct"), _QWEN3_TINY),
        Reference("qwen3-vl-30b-a3b", "qwen3_vl_moe", "Qwen3VLMoeVisionConfig",
                  {**_QWEN3_LARGE, "out_hidden_size": 2048},
                  _hf("Qwen/Qwen3-VL-30B-A3B-Instruct"), _QWEN3_TINY),
        Reference("glm-4.1v-9b", "glm4v", "Glm4vVisionConfig",
                  {**_PATCH_14, "depth": 24, "hidden_size": 1536, "intermediate_size": 13696, "num_heads": 12,
                   "out_hidden_size": 4096, "image_size": 336, "rms_norm_eps": 1e-5, "hidden_act": "silu"},
                  _hf("zai-org/GLM-4.1V-9B-Thinking"), _TINY),
    ]
}
# fmt: on

DEFAULT_REFERENCE = "qwen3-vl-4b"


def installed_families() -> frozenset[str]:
    """The model families (package names under ``transformers.models``) of the installed transformers."""
    spec = importlib.util.find_spec("transformers")
    if spec is None or not spec.submodule_search_locations:
        return frozenset()
    models = Path(next(iter(spec.submodule_search_locations))) / "models"
    if not models.is_dir():
        return frozenset()
    return frozenset(p.name for p in models.iterdir() if (p / "__init__.py").is_file())


def list_references() -> list[Reference]:
    return list(REFERENCES.values())


def resolve_reference(name: str) -> Reference:
    key = name[len(REF_PREFIX) :] if name.startswith(REF_PREFIX) else name
    ref = REFERENCES.get(key.lower())
    if ref is None:
        raise InputRefused(
            f"unknown reference {name!r}; choose one of: "
            + ", ".join(REF_PREFIX + n for n in REFERENCES)
            + " (see `vlfast models`)"
        )
    return ref
