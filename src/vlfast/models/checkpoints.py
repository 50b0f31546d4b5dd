"""A local checkpoint folder read without torch: the folder checked (with what to do when ``--model`` names
nothing), its config as transformers reads it (:func:`load_config`, which imports transformers), its weight
files, and where a vision tower's tensors are in them. :func:`check_tower_shapes` compares the shapes a
config makes (``towers.tower_shapes``) with the safetensors headers. Torch-free, so that a finished OUT's
weights fingerprint (:mod:`vlfast.extraction.store.fingerprint`) is answered without importing torch.
"""

from __future__ import annotations

import difflib
import json
import re
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from vlfast.errors import InputRefused
from vlfast.models.references import REF_PREFIX, REFERENCES

__all__ = [
    "load_config",
    "TINY_CHECKPOINT",
    "check_tower_shapes",
    "checkpoint_dir",
    "missing_model_hint",
    "safetensors_files",
    "tensor_locations",
]

# ------------------------------------------------------------------------------------------- hints
# vlfast never downloads. A Hub id (Qwen/Qwen3-VL-4B-Instruct) and a reference without its prefix
# (qwen3-vl-4b) each get the command that fixes them instead of "not found".

# owner/name as the Hub spells repositories (a relative path looks the same: used once it is known absent)
_HUB_ID = re.compile(r"[A-Za-z0-9][\w.-]*/[\w.-]+")

TINY_CHECKPOINT = "`vlfast demo-checkpoint DIR` writes a tiny offline one (random weights) to try commands on"


def missing_model_hint(spec: str, *, references: bool = True) -> str:
    """The sentence to add when ``spec`` is not an existing folder; ``references``: whether the command
    accepts ``ref:NAME``."""
    key = spec.removeprefix(REF_PREFIX).lower()
    # A Hub id, unless its "owner" is a folder here: then it is more likely a mistyped local path.
    if _HUB_ID.fullmatch(spec) and not spec.startswith(".") and not Path(spec).parent.is_dir():
        local = "./" + spec.rsplit("/", 1)[1]
        return (
            f"vlfast reads local folders and downloads nothing; download it first with "
            f"`hf download {spec} --local-dir {local}`, then pass --model {local}"
        )
    if not references:
        return f"pass a local checkpoint folder with a language model; {TINY_CHECKPOINT}"
    if key in REFERENCES:
        return f"did you mean the built-in reference --model {REF_PREFIX}{key} (random weights)?"
    close = difflib.get_close_matches(key, list(REFERENCES), n=1, cutoff=0.75)
    if close:
        return f"did you mean --model {REF_PREFIX}{close[0]}? (`vlfast models` lists the references)"
    return "pass a local checkpoint folder, or ref:NAME for a built-in reference (`vlfast models` lists them)"


# ------------------------------------------------------------------------------------------- files


def checkpoint_dir(spec: str | Path) -> Path:
    """``spec`` as a checkpoint folder: it exists and holds a config.json (else FileNotFoundError, saying
    what to pass instead)."""
    path = Path(spec).expanduser()
    if not path.exists():
        raise FileNotFoundError(
            f"model {str(spec)!r} is neither an existing checkpoint directory nor a reference name: "
            + missing_model_hint(str(spec))
        )
    if not (path / "config.json").is_file():
        raise FileNotFoundError(f"{path} has no config.json: pass a transformers checkpoint directory")
    return path


def safetensors_files(spec: str | Path) -> list[Path]:
    """The checkpoint's weight files (from its index when sharded)."""
    path = checkpoint_dir(spec)
    index = path / "model.safetensors.index.json"
    if index.is_file():
        return [path / n for n in sorted(set(json.loads(index.read_text())["weight_map"].values()))]
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"{path} has no *.safetensors weights")
    return files


def tensor_locations(spec: str | Path, names: Sequence[str]) -> dict[str, tuple[Path, str]]:
    """Where each of the tower tensors ``names`` lives in a checkpoint: tower name -> (safetensors file,
    checkpoint key). Its keys are found by suffix under one prefix (``model.visual.``, ``visual.``, ...)
    fixed by the first name, reading only safetensors headers (as safetensors lists them: sorted)."""
    from safetensors import safe_open

    path = checkpoint_dir(spec)
    wanted = set(names)
    anchor = next(iter(names))  # e.g. "patch_embed.proj.weight"
    found: dict[str, tuple[Path, str]] = {}
    prefix: str | None = None
    for file in safetensors_files(path):
        with safe_open(str(file), framework="numpy") as f:  # keys only: no torch
            keys = list(f.keys())
        if prefix is None:
            hits = [k for k in keys if k == anchor or k.endswith("." + anchor)]
            if hits:
                prefix = hits[0][: len(hits[0]) - len(anchor)]
        if prefix is None:
            continue
        for k in keys:
            if k.startswith(prefix) and k[len(prefix) :] in wanted:
                found[k[len(prefix) :]] = (file, k)
    missing = sorted(wanted - set(found))
    if missing:
        raise InputRefused(
            f"{path}: vision tower weights missing from the checkpoint: {missing[:5]}"
            + (f" and {len(missing) - 5} more" if len(missing) > 5 else "")
        )
    return found


def check_tower_shapes(spec: str | Path, shapes: Mapping[str, Sequence[int]]) -> None:
    """Refuse (InputRefused) a checkpoint whose vision-tower tensors are not the shapes its config.json makes
    them (``shapes``: tower name -> shape). Reads only safetensors headers, so a run refuses in a second,
    before it writes anything, where loading would fail with torch's size mismatch once OUT held run.json."""
    from safetensors import safe_open

    path = checkpoint_dir(spec)
    wrong: list[str] = []
    for file, names in by_file(tensor_locations(path, list(shapes))).items():
        with safe_open(str(file), framework="numpy") as f:  # headers only
            for name, key in names:
                got = list(f.get_slice(key).get_shape())
                if got != list(shapes[name]):
                    wrong.append(
                        f"{key} in {file.name} is {got}, where config.json makes it {list(shapes[name])}"
                    )
    if wrong:
        more = f" (and {len(wrong) - 3} more tensors)" if len(wrong) > 3 else ""
        raise InputRefused(
            f"{path}: the weights do not fit config.json's vision_config: {'; '.join(wrong[:3])}{more}. The "
            "weights and config.json come from different models (or the config was edited): put the config.json "
            "saved with these weights beside them"
        )


def by_file(locations: Mapping[str, tuple[Path, str]]) -> dict[Path, list[tuple[str, str]]]:
    """:func:`tensor_locations`' answer grouped by file: file -> [(name, checkpoint key)]."""
    out: dict[Path, list[tuple[str, str]]] = {}
    for name, (file, key) in locations.items():
        out.setdefault(file, []).append((name, key))
    return out


def load_config(spec: str | Path) -> Any:
    import transformers
    from transformers import AutoConfig

    path = checkpoint_dir(spec)
    try:
        return AutoConfig.from_pretrained(path, local_files_only=True)
    # an unknown model_type (ValueError), a config.json that is not JSON (OSError): the user's files
    except (ValueError, OSError) as e:
        raise InputRefused(
            f"{path}/config.json cannot be read by transformers {transformers.__version__}: "
            f"{str(e).splitlines()[0]}"
        ) from None
