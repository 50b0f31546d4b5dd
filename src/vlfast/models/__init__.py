"""Models vlfast works on: built-in references, local checkpoints, and their vision towers.

A *reference* is a published vision tower rebuilt offline from transformers' config classes with its
published dimensions and random weights: enough to measure speed and prove equivalence without downloading
anything. Importing this package is free: each public name loads its module on first use (``towers``, the
only one importing torch).
"""

from __future__ import annotations

from vlfast._lazy import lazy_exports

_EXPORTS = {
    **dict.fromkeys(["DEFAULT_REFERENCE", "REF_PREFIX", "REFERENCES", "Reference"], "references"),
    **dict.fromkeys(["list_references", "resolve_reference"], "references"),
    **dict.fromkeys(["TINY_CHECKPOINT", "check_tower_shapes", "checkpoint_dir"], "checkpoints"),
    **dict.fromkeys(
        ["load_config", "missing_model_hint", "safetensors_files", "tensor_locations"], "checkpoints"
    ),
    **dict.fromkeys(["Answers", "ModelRef", "family_of"], "ref"),
    **dict.fromkeys(["TowerSpec", "build_reference", "find_vision_tower", "load_model"], "towers"),
    **dict.fromkeys(["load_vision_tower", "reference_config", "synthetic_inputs", "tower_outputs"], "towers"),
    **dict.fromkeys(["tower_shapes", "tower_spec", "tower_tensor_locations", "tower_tensor_names"], "towers"),
    **dict.fromkeys(["vision_config_of", "vision_model_class"], "towers"),
}

__all__ = list(_EXPORTS)

__getattr__, __dir__ = lazy_exports(globals(), _EXPORTS)
