"""transformers integration: the families whose patch embedding is a stride == kernel Conv3d, discovered by
parsing (never importing) the installed modeling files, and a switch that patches every transformers model
as its constructor returns.
"""

from __future__ import annotations

import ast
import functools
import importlib.util
import threading
from dataclasses import dataclass
from pathlib import Path

from torch import nn

from vlfast.patching.gemm import Filter, compile_filter, is_patched, patch, patch_one

__all__ = [
    "Family",
    "discover_families",
    "patch_transformers",
    "transformers_patched",
    "unpatch_transformers",
]


@dataclass(frozen=True)
class Family:
    """A transformers model family whose code builds a stride == kernel Conv3d."""

    model_type: str  # the package name under transformers.models, e.g. "qwen3_vl"
    module: str  # e.g. "transformers.models.qwen3_vl.modeling_qwen3_vl"
    classes: tuple[str, ...]  # classes whose __init__ builds such a conv, e.g. ("Qwen3VLVisionPatchEmbed",)


def _call_arg(call: ast.Call, name: str, position: int) -> ast.AST | None:
    for kw in call.keywords:
        if kw.arg == name:
            return kw.value
    return call.args[position] if len(call.args) > position else None


def _is_patchable_conv3d(call: ast.Call) -> bool:
    func = call.func
    name = func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", None)
    if name != "Conv3d":
        return False
    kernel, stride = _call_arg(call, "kernel_size", 2), _call_arg(call, "stride", 3)
    if kernel is None or stride is None or ast.dump(kernel) != ast.dump(stride):
        return False
    if isinstance(kernel, ast.Constant) and kernel.value == 1:
        return False  # a pointwise conv: cuDNN keeps it (the slow path needs a kernel dim != 1), not a patch embed
    # Any explicit padding / dilation / groups other than the defaults makes it a general conv.
    for kw in call.keywords:
        if kw.arg in ("padding", "dilation", "groups") and not (
            isinstance(kw.value, ast.Constant) and kw.value.value in (0, 1, "valid")
        ):
            return False
    return True


def _scan_file(path: Path) -> tuple[str, ...]:
    try:
        tree = ast.parse(path.read_text(encoding="utf-8"))
    except (OSError, SyntaxError, UnicodeDecodeError):
        return ()
    found = [
        cls.name
        for cls in ast.walk(tree)
        if isinstance(cls, ast.ClassDef)
        and any(isinstance(c, ast.Call) and _is_patchable_conv3d(c) for c in ast.walk(cls))
    ]
    return tuple(dict.fromkeys(found))  # nested classes are walked twice


@functools.lru_cache(maxsize=1)
def discover_families() -> tuple[Family, ...]:
    """Every family of the installed transformers whose modeling code builds a stride == kernel Conv3d."""
    spec = importlib.util.find_spec("transformers")
    if spec is None or not spec.submodule_search_locations:
        raise ImportError("transformers is not installed: pip install transformers")
    models_dir = Path(next(iter(spec.submodule_search_locations))) / "models"
    families = []
    for path in sorted(models_dir.glob("*/modeling_*.py")):
        if "Conv3d" not in path.read_text(encoding="utf-8", errors="replace"):  # cheap pre-filter
            continue
        if classes := _scan_file(path):
            family = path.parent.name
            families.append(Family(family, f"transformers.models.{family}.{path.stem}", classes))
    return tuple(families)


# ----------------------------------------------------------------------------------- the switch

_lock = threading.Lock()
_state: dict[str, object] = {}


def transformers_patched() -> bool:
    """Whether :func:`patch_transformers` is active."""
    return "original_post_init" in _state


def patch_transformers(*, filter: Filter = None, all_convs: bool = False) -> None:
    """Patch every transformers model built from now on, inside its constructor, and every convolution
    attached to a module afterwards (PEFT's LoRA ``lora_A``/``lora_B``, a wrapper's own conv).

    Wraps ``PreTrainedModel.post_init``, which every transformers model calls at the end of ``__init__``
    (``from_pretrained`` and DeepSpeed's ``zero.Init`` included: the patch decides from the weight each call
    gets). By default only ``nn.Conv3d`` modules are patched; ``all_convs=True`` also takes stride == kernel
    Conv1d/2d. A convolution attached later is patched by torch's global module-registration hook, unless
    ``filter`` (a qualified name needs the whole model) narrows the models. Calling it again replaces the
    settings; undo with :func:`unpatch_transformers`.
    """
    from torch.nn.modules.module import register_module_module_registration_hook
    from transformers import PreTrainedModel

    user = compile_filter(filter)
    keep = user if all_convs else (lambda name, m: isinstance(m, nn.Conv3d) and user(name, m))
    kinds = (nn.Conv1d, nn.Conv2d, nn.Conv3d) if all_convs else (nn.Conv3d,)
    with _lock:
        original = _state.get("original_post_init", PreTrainedModel.post_init)

        @functools.wraps(original)
        def post_init(self, *args, **kwargs):
            result = original(self, *args, **kwargs)
            patch(self, filter=keep)
            return result

        post_init.__vlfast_wrapped__ = True
        _state["original_post_init"] = original
        PreTrainedModel.post_init = post_init
        old = _state.pop("registration_hook", None)
        if old is not None:
            old.remove()
        if filter is None:

            def attached(parent: nn.Module, name: str, module):
                if isinstance(module, kinds):
                    patch_one(module, name)  # when eligible; named in full by the model's own patch()
                elif isinstance(parent, PreTrainedModel) and is_patched(parent):
                    # A model whose __init__ never calls post_init (4.45's bare vision towers) is patched by
                    # this hook alone: patch() it as post_init would, so the record names its convs in full.
                    patch(parent, filter=keep)
                return None  # keep the module as given

            _state["registration_hook"] = register_module_module_registration_hook(attached)


def unpatch_transformers() -> None:
    """Stop patching new transformers models (models already built stay patched: use ``vlfast.unpatch``)."""
    with _lock:
        hook = _state.pop("registration_hook", None)
        if hook is not None:
            hook.remove()
        original = _state.pop("original_post_init", None)
        if original is not None:
            from transformers import PreTrainedModel

            PreTrainedModel.post_init = original
