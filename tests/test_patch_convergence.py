"""Convergence: a tiny Qwen3-VL trained for many steps, stock and patched, must learn the same way.

One forward and one backward agreeing does not show that training is unchanged: round-off differences
feed back through the optimizer step after step. As Liger-Kernel does for its kernels, this trains a tiny
Qwen3-VL (vision tower and LLM, random init, fixed seed) on a synthetic image-caption task with AdamW,
stock and patched, and compares the loss at every step and the final weights:

- fp32: the loss within ``FP32_LOSS_RTOL`` of stock at every step, the weights within ``FP32_WEIGHT_RTOL``.
- bf16 autocast: bf16 training drifts whatever the kernels, so the band is measured, not assumed. Stock
  is trained twice, with oneDNN on and off (every bf16 matmul and the conv then run other, equally valid
  kernels); the patched run may drift from stock at most ``BF16_LOSS_FACTOR`` times as far in loss as
  those two stock runs drift apart, step by step (running maxima), and no farther in final weights.
- LoRA (PEFT) on the patched patch-embedding conv trains as stock LoRA does, in either order of wrapping.

A GEMM off by 0.1% (fp32) or 1% (bf16, whose rounding swallows 0.1%) must fail these comparisons.
docs/benchmarks.md (Training convergence) gives the numbers the tolerances come from.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable
from dataclasses import dataclass

import pytest
import torch
from torch import nn

from vlfast.patching.gemm import GemmConvForward, is_patched, patch

peft = pytest.importorskip("peft")

pytestmark = [
    pytest.mark.filterwarnings("ignore:TF32 acceleration on top of oneDNN:UserWarning"),
    pytest.mark.filterwarnings("ignore:`is_gradient_checkpointing` is deprecated:FutureWarning"),
]

STEPS = 50
LORA_STEPS = 15
LR = 1e-3

# Measured on this task (docs/benchmarks.md, Training convergence). fp32: patched vs stock drifts <= 3e-6 relative in loss
# over the 50 steps, <= 1e-5 in weights, as stock with oneDNN on vs off does.
FP32_LOSS_RTOL = 1e-5  # relative, every step
FP32_WEIGHT_RTOL = 5e-5  # all trainable parameters together, relative L2
FP32_PARAM_RTOL = 5e-4  # each parameter, relative L2 (Adam turns near-zero gradients into full steps)
# bf16: patched vs stock may drift BF16_LOSS_FACTOR times as far in loss as stock vs stock (oneDNN on vs
# off) does, and no farther in final weights (the patch changes one kernel, oneDNN off changes them all).
BF16_LOSS_FACTOR = 3.0
BF16_WEIGHT_FACTOR = 1.0
BF16_BAND_FLOOR = FP32_LOSS_RTOL  # where the stock runs agree exactly, ask no more than fp32 does

# ------------------------------------------------------------------------------------------- the task

VOCAB = 32
VISION_START, VISION_END, IMAGE_PAD, VIDEO_PAD = 1, 2, 3, 4
PATCH, TEMPORAL, MERGE = 16, 2, 2  # Qwen3-VL's patch geometry
HEIGHT, WIDTH = 32, 64  # a (1, 2, 4) grid of patches: 2 visual tokens per image
CLASSES, CAPTION_LEN, BATCH, N_BATCHES = 4, 4, 4, 8


def _config():
    from vlfast.demo import tiny_qwen3_vl_config

    config = tiny_qwen3_vl_config(
        VOCAB,
        max_position_embeddings=256,
        image_token_id=IMAGE_PAD,
        video_token_id=VIDEO_PAD,
        vision_start_token_id=VISION_START,
        vision_end_token_id=VISION_END,
    )
    vision = config.vision_config
    assert (vision.patch_size, vision.temporal_patch_size, vision.spatial_merge_size) == (
        PATCH,
        TEMPORAL,
        MERGE,
    )
    config._attn_implementation = "sdpa"
    return config


def _images(labels: torch.Tensor, gen: torch.Generator) -> torch.Tensor:
    """One image per label, (B, 3, H, W): the class picks the stripe direction, colour and phase are random."""
    y, x = torch.meshgrid(torch.arange(HEIGHT * 1.0), torch.arange(WIDTH * 1.0), indexing="ij")
    out = []
    for k in labels.tolist():
        freq = 2 * torch.pi * (1 + torch.rand(1, generator=gen)) / 16
        phase = 2 * torch.pi * torch.rand(1, generator=gen)
        stripes = [x, y, x + y, x - y][k]
        colour = 0.5 + 0.5 * torch.rand(3, 1, 1, generator=gen)
        out.append(
            colour * torch.sin(freq * stripes + phase) + 0.1 * torch.randn(3, HEIGHT, WIDTH, generator=gen)
        )
    return torch.stack(out)


def _pixel_values(images: torch.Tensor) -> torch.Tensor:
    """(B, C, H, W) images -> (B*gh*gw, C*T*P*P) rows in Qwen's processor order (each image as T frames)."""
    b, c = images.shape[:2]
    gh, gw = HEIGHT // PATCH, WIDTH // PATCH
    frames = images.unsqueeze(1).expand(b, TEMPORAL, c, HEIGHT, WIDTH)
    # (B, T, C, gh/M, M, P, gw/M, M, P) -> (B, gh/M, gw/M, M, M, C, T, P, P): merge groups stay together
    x = frames.reshape(b, TEMPORAL, c, gh // MERGE, MERGE, PATCH, gw // MERGE, MERGE, PATCH)
    return x.permute(0, 3, 6, 4, 7, 2, 1, 5, 8).reshape(b * gh * gw, c * TEMPORAL * PATCH * PATCH)


@functools.cache
def _batches() -> tuple[dict[str, torch.Tensor], ...]:
    """The training set: N_BATCHES batches of (image, caption) pairs, the caption fixed per class."""
    gen = torch.Generator().manual_seed(0)
    captions = torch.randint(5, VOCAB, (CLASSES, CAPTION_LEN), generator=gen)
    n_visual = (HEIGHT // PATCH) * (WIDTH // PATCH) // MERGE**2
    prompt = torch.tensor([VISION_START, *[IMAGE_PAD] * n_visual, VISION_END]).expand(BATCH, -1)
    batches = []
    for _ in range(N_BATCHES):
        labels = torch.randint(0, CLASSES, (BATCH,), generator=gen)
        input_ids = torch.cat([prompt, captions[labels]], dim=1)  # (B, 2 + n_visual + CAPTION_LEN)
        targets = input_ids.clone()
        targets[:, : prompt.shape[1]] = -100  # the loss is on the caption only
        batches.append(
            {
                "input_ids": input_ids,
                "attention_mask": torch.ones_like(input_ids),
                "mm_token_type_ids": (input_ids == IMAGE_PAD).int(),
                "labels": targets,
                "pixel_values": _pixel_values(_images(labels, gen)),
                "image_grid_thw": torch.tensor([[1, HEIGHT // PATCH, WIDTH // PATCH]] * BATCH),
            }
        )
    return tuple(batches)


# ------------------------------------------------------------------------------------------- training


@dataclass(frozen=True)
class Run:
    losses: torch.Tensor  # (steps,) float64
    weights: dict[str, torch.Tensor]  # the trainable parameters after the last step


def _stock(model: nn.Module) -> nn.Module:
    return model


def _patched(model: nn.Module) -> nn.Module:
    patch(model, strict=True)
    return model


def _train(
    prepare: Callable[[nn.Module], nn.Module] = _stock,
    *,
    dtype: torch.dtype = torch.float32,
    onednn: bool = True,
    steps: int = STEPS,
) -> Run:
    """Train the tiny model from its fixed init for ``steps`` AdamW steps (bf16: autocast, fp32 master weights)."""
    from transformers import Qwen3VLForConditionalGeneration

    torch.manual_seed(0)
    model = prepare(Qwen3VLForConditionalGeneration(_config()).train())
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=LR, weight_decay=0.01)
    autocast = (
        torch.autocast("cpu", dtype=torch.bfloat16) if dtype == torch.bfloat16 else contextlib.nullcontext()
    )
    batches = _batches()
    losses = []
    with torch.backends.mkldnn.flags(enabled=onednn):
        for step in range(steps):
            with autocast:
                loss = model(**batches[step % len(batches)]).loss
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            losses.append(loss.item())
    weights = {n: p.detach().clone() for n, p in model.named_parameters() if p.requires_grad}
    return Run(torch.tensor(losses, dtype=torch.float64), weights)


@functools.cache
def _stock_run(dtype: torch.dtype, onednn: bool = True) -> Run:
    return _train(dtype=dtype, onednn=onednn)


# ----------------------------------------------------------------------------------------- comparison


def _loss_drift(actual: Run, expected: Run) -> torch.Tensor:
    """Relative loss difference at every step, (steps,)."""
    return (actual.losses - expected.losses).abs() / expected.losses.abs()


def _envelope(drift: torch.Tensor) -> torch.Tensor:
    """The largest drift so far at every step: drift fluctuates, its running maximum does not."""
    return torch.cummax(drift, dim=0).values


def _weight_drift(actual: Run, expected: Run) -> tuple[float, dict[str, float]]:
    """Relative L2 difference of all trainable parameters together, and of each one."""
    diff = torch.cat([(actual.weights[n] - w).double().flatten() for n, w in expected.weights.items()])
    ref = torch.cat([w.double().flatten() for w in expected.weights.values()])
    each = {n: float((actual.weights[n] - w).norm() / w.norm()) for n, w in expected.weights.items()}
    return float(diff.norm() / ref.norm()), each


def _assert_losses_within(actual: Run, expected: Run, bound: torch.Tensor, name: str) -> None:
    """Every step's drift envelope within ``bound`` (a number or one per step); the message names the step."""
    drift = _envelope(_loss_drift(actual, expected))
    bound = torch.as_tensor(bound, dtype=torch.float64).expand_as(drift)
    bad = (drift > bound).nonzero().flatten()
    if len(bad):
        i = int(bad[0])
        raise AssertionError(
            f"{name}: loss drift {float(drift[i]):.4g} > {float(bound[i]):.4g} at step {i} of {len(drift)} "
            f"(loss {float(actual.losses[i]):.8g} vs stock {float(expected.losses[i]):.8g}); "
            f"{len(bad)} steps out of tolerance, largest drift {float(drift[-1]):.3g}"
        )


def _assert_weights_within(actual: Run, expected: Run, total: float, each: float | None, name: str) -> None:
    assert actual.weights.keys() == expected.weights.keys()
    drift, per_param = _weight_drift(actual, expected)
    worst = max(per_param, key=per_param.get)
    assert drift <= total, f"{name}: final weights drift {drift:.3g} > {total:.3g} (worst {worst})"
    if each is not None:
        assert per_param[worst] <= each, f"{name}: final {worst} drifts {per_param[worst]:.3g} > {each:.3g}"


def _assert_fp32_matches(actual: Run, expected: Run, name: str) -> None:
    _assert_losses_within(actual, expected, torch.tensor(FP32_LOSS_RTOL), name)
    _assert_weights_within(actual, expected, FP32_WEIGHT_RTOL, FP32_PARAM_RTOL, name)


def _bf16_band() -> tuple[torch.Tensor, float]:
    """How far two stock bf16 runs drift apart (oneDNN on vs off): per-step loss envelope, final weights."""
    if not torch.backends.mkldnn.is_available():
        pytest.skip("no oneDNN in this torch: no second stock kernel to measure the bf16 band with")
    stock, other = _stock_run(torch.bfloat16), _stock_run(torch.bfloat16, onednn=False)
    band = _envelope(_loss_drift(other, stock))
    if float(band[-1]) == 0:
        pytest.skip("stock bf16 trains bit-identically with oneDNN on and off here: no band to measure")
    return band.clamp_min(BF16_BAND_FLOOR), _weight_drift(other, stock)[0]


def _assert_bf16_within_band(actual: Run, name: str) -> None:
    band, weight_band = _bf16_band()
    expected = _stock_run(torch.bfloat16)
    _assert_losses_within(
        actual, expected, BF16_LOSS_FACTOR * band, f"{name} (bound {BF16_LOSS_FACTOR} x band)"
    )
    _assert_weights_within(
        actual, expected, BF16_WEIGHT_FACTOR * weight_band, None, f"{name} (bound: the band)"
    )


# ------------------------------------------------------------------------------------------------ tests


def test_the_task_is_learned_and_stock_training_is_deterministic():
    # Guards for the comparisons: training really moves (loss falls), and a rerun of stock is bit-identical,
    # so any drift below comes from the kernels, not from nondeterminism.
    stock = _stock_run(torch.float32)
    assert float(stock.losses[-8:].mean()) < 0.5 * float(stock.losses[0]), stock.losses
    assert torch.equal(_train(steps=10).losses, stock.losses[:10])


def test_fp32_training_matches_stock():
    _assert_fp32_matches(_train(_patched), _stock_run(torch.float32), "fp32 patched")


def test_bf16_training_stays_within_the_stock_kernel_band():
    _assert_bf16_within_band(_train(_patched, dtype=torch.bfloat16), "bf16 patched")


@pytest.mark.parametrize(("dtype", "error"), [(torch.float32, 1.001), (torch.bfloat16, 1.01)])
def test_the_comparison_catches_a_wrong_gemm(monkeypatch, dtype, error):
    # bf16 gets 1%: a 0.1% change of a bf16 output rounds back to the same value (8 bits of mantissa).
    original = GemmConvForward.__call__
    monkeypatch.setattr(GemmConvForward, "__call__", lambda self, x, w, b: original(self, x, w, b) * error)
    wrong = _train(_patched, dtype=dtype)
    with pytest.raises(AssertionError, match="drift"):
        if dtype == torch.float32:
            _assert_fp32_matches(wrong, _stock_run(dtype), "wrong GEMM")
        else:
            _assert_bf16_within_band(wrong, "wrong GEMM")


def _lora(model: nn.Module) -> nn.Module:
    torch.manual_seed(1)
    # init_lora_weights=False: random A and B, so the adapter changes the output from step 0 and a wrong
    # LoRA conv shows at once. (With B = 0, A's gradients start near zero and Adam turns their round-off
    # into full-size steps: stock LoRA alone drifts 2.5e-4 in weights with oneDNN on vs off.)
    config = peft.LoraConfig(
        r=4, lora_alpha=8, target_modules=r".*patch_embed\.proj", init_lora_weights=False
    )
    return peft.get_peft_model(model, config)


@pytest.mark.parametrize("order", ["patch-then-lora", "lora-then-patch"])
def test_lora_on_the_patched_conv_trains_like_stock_lora(monkeypatch, order):
    expected = _train(_lora, steps=LORA_STEPS)
    assert expected.weights and all("lora_" in n for n in expected.weights)

    calls: list[nn.Module] = []
    original = GemmConvForward.__call__

    def spy(self, x, w, b):
        calls.append(self._module())
        return original(self, x, w, b)

    monkeypatch.setattr(GemmConvForward, "__call__", spy)
    models = []

    def prepare(model):
        model = _lora(_patched(model)) if order == "patch-then-lora" else _patched(_lora(model))
        models.append(model)
        return model

    actual = _train(prepare, steps=LORA_STEPS)
    wrapped = models[0].base_model.model.model.visual.patch_embed.proj
    assert isinstance(wrapped, peft.tuners.lora.layer.Conv3d)
    assert is_patched(wrapped.base_layer)
    # The patched base conv ran at every step (and, patched after wrapping, the LoRA A and B convs too).
    assert sum(m is wrapped.base_layer for m in calls) == LORA_STEPS
    if order == "lora-then-patch":
        assert sum(m is wrapped.lora_A["default"] for m in calls) == LORA_STEPS
        assert sum(m is wrapped.lora_B["default"] for m in calls) == LORA_STEPS
    _assert_fp32_matches(actual, expected, f"LoRA {order}")
