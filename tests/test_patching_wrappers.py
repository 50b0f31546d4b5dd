"""The patch under the wrappers people put around models: accelerate hooks and offloading, PEFT LoRA.

Both libraries wrap ``forward`` or the module itself; the patch lives one level lower, in
``_conv_forward``, so it must compose with them in either order and give the wrapped model's own outputs
and gradients.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from _patching_checks import assert_verbose_close
from vlfast.models import build_reference, synthetic_inputs, tower_outputs
from vlfast.patching.gemm import is_patched, patch, patched_modules, unpatch

accelerate_hooks = pytest.importorskip("accelerate.hooks")
peft = pytest.importorskip("peft")

pytestmark = pytest.mark.filterwarnings("ignore:`is_gradient_checkpointing` is deprecated:FutureWarning")

GRIDS = [(2, 4, 4)]


def _tower_and_inputs(name="qwen3-vl-4b"):
    tower = build_reference(name, tiny=True)
    return tower, *synthetic_inputs(tower, GRIDS)


def _merged(model, pixels, grid):
    with torch.no_grad():
        return tower_outputs(model(pixels, grid_thw=grid))["merged"]


# ---------------------------------------------------------------------------------- accelerate


class ScaleHook(accelerate_hooks.ModelHook):
    """Changes the input before and the output after forward, and counts calls."""

    def __init__(self):
        self.calls = 0

    def pre_forward(self, module, *args, **kwargs):
        self.calls += 1
        return (args[0] * 2, *args[1:]), kwargs

    def post_forward(self, module, output):
        return output + 1


@pytest.mark.parametrize("order", ["patch-then-hook", "hook-then-patch"])
def test_accelerate_hook_on_the_conv(order):
    torch.manual_seed(0)
    conv = nn.Conv3d(3, 8, (2, 4, 4), stride=(2, 4, 4))
    x = torch.randn(5, 3, 2, 4, 4)
    expected = conv(x * 2) + 1
    hook = ScaleHook()
    if order == "patch-then-hook":
        patch(conv, strict=True)
        accelerate_hooks.add_hook_to_module(conv, hook)
    else:
        accelerate_hooks.add_hook_to_module(conv, hook)
        patch(conv, strict=True)
    assert_verbose_close(conv(x), expected)
    assert hook.calls == 1 and is_patched(conv) and isinstance(conv, nn.Conv3d)
    accelerate_hooks.remove_hook_from_module(conv)
    assert is_patched(conv)  # removing accelerate's hook leaves vlfast's patch in place
    assert_verbose_close(conv(x), conv._conv_forward(x, conv.weight, conv.bias))
    unpatch(conv)
    assert not is_patched(conv) and "_conv_forward" not in conv.__dict__


@pytest.mark.parametrize("order", ["patch-then-offload", "offload-then-patch"])
def test_accelerate_cpu_offload_of_a_tower(order):
    from accelerate import cpu_offload

    tower, pixels, grid = _tower_and_inputs()
    expected = _merged(tower, pixels, grid)
    if order == "patch-then-offload":
        patch(tower, strict=True)
        cpu_offload(tower, execution_device=torch.device("cpu"))
    else:
        cpu_offload(tower, execution_device=torch.device("cpu"))
        patch(tower, strict=True)
    conv = tower.patch_embed.proj
    assert conv.weight.device.type == "meta"  # weights live in the offload map between calls
    assert is_patched(tower)
    assert_verbose_close(_merged(tower, pixels, grid), expected, name="offloaded tower")


# ----------------------------------------------------------------------------------------- PEFT


def _lora(tower, targets, seed=1):
    torch.manual_seed(seed)
    # init_lora_weights=False: random A and B, so the adapters change the output and a mistake shows.
    config = peft.LoraConfig(r=4, lora_alpha=8, target_modules=targets, init_lora_weights=False)
    return peft.get_peft_model(tower, config)


def _lora_step(model, pixels, grid):
    """Merged output and the LoRA parameters' gradients of one training step."""
    model.zero_grad(set_to_none=True)
    out = tower_outputs(model(pixels, grid_thw=grid))["merged"]
    out.square().mean().backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.requires_grad}
    assert grads and all("lora_" in n for n in grads)
    return out.detach(), grads


LORA_TARGETS = {
    "conv": r".*patch_embed\.proj",
    "attention": ["qkv"],
    "both": r".*(patch_embed\.proj|qkv)",
}


@pytest.mark.parametrize("targets", LORA_TARGETS.values(), ids=LORA_TARGETS.keys())
def test_peft_lora_then_patch(targets):
    tower, pixels, grid = _tower_and_inputs()
    model = _lora(tower, targets)
    expected_out, expected_grads = _lora_step(model, pixels, grid)
    report = patch(model, strict=True)
    names = [e.name for e in report.patched]
    assert any(n.endswith("patch_embed.proj") or n.endswith("patch_embed.proj.base_layer") for n in names)
    out, grads = _lora_step(model, pixels, grid)
    assert_verbose_close(out, expected_out, name="LoRA output")
    for n, g in expected_grads.items():
        assert_verbose_close(grads[n], g, name=f"grad {n}")
    unpatch(model)
    assert torch.equal(_lora_step(model, pixels, grid)[0], expected_out)


def test_patch_then_peft_lora_on_the_conv():
    stock_tower, pixels, grid = _tower_and_inputs()
    expected_out, expected_grads = _lora_step(_lora(stock_tower, LORA_TARGETS["conv"]), pixels, grid)

    tower, _, _ = _tower_and_inputs()
    patch(tower, strict=True)
    model = _lora(tower, LORA_TARGETS["conv"])  # PEFT accepts the patched conv: still an nn.Conv3d
    wrapped = model.base_model.model.patch_embed.proj
    assert isinstance(wrapped, peft.tuners.lora.layer.Conv3d)
    assert is_patched(wrapped.base_layer) and isinstance(wrapped.base_layer, nn.Conv3d)
    out, grads = _lora_step(model, pixels, grid)
    assert_verbose_close(out, expected_out, name="LoRA output")
    for n, g in expected_grads.items():
        assert_verbose_close(grads[n], g, name=f"grad {n}")


def test_peft_merge_and_unload_after_patching():
    tower, pixels, grid = _tower_and_inputs()
    model = _lora(tower, LORA_TARGETS["both"])
    expected = _merged(model, pixels, grid)
    patch(model, strict=True)
    merged = model.merge_and_unload()
    conv = merged.patch_embed.proj
    assert type(conv) is nn.Conv3d and is_patched(conv)  # the base conv, weights merged, still patched
    assert ("patch_embed.proj", conv) in patched_modules(merged)
    assert_verbose_close(_merged(merged, pixels, grid), expected, name="merged LoRA")
