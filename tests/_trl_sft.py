"""TRL's SFTTrainer on a tiny Qwen-VL, full fine-tuning and LoRA on the patch embed: what each run computed
and what ran.

Run by tests/test_trl_sft.py in a process of its own, patched or not by the environment alone, as
docs/training.md tells TRL users (``VLFAST_PATCH=1 VLFAST_RECORD=... python train.py``):

    python tests/_trl_sft.py CKPT OUT

The model goes to SFTTrainer as a path, so TRL builds it (and PEFT wraps it) as in a user's script; the
processor is built here because ``AutoProcessor`` needs torchvision for Qwen3-VL's video processor. Each
scenario writes OUT/<scenario>.json: the per-step losses, what the record counted during ``train()``, and
how many convolutions reached ATen (forward and backward, however they were called).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch
from datasets import Dataset
from PIL import Image
from trl import SFTConfig, SFTTrainer

import vlfast
from _patching_checks import ConvCount  # this script's folder, tests/, is sys.path[0]
from _transformers_support import qwen3_vl_processor
from vlfast.demo import pattern

STEPS = 3
LR = 0.1
WORDS = ["Describe this image.", "What happens?", "Describe this video.", "seconds"]
# PEFT's LoRA on a Conv3d adds lora_A and lora_B convs with the patch embed's kernel and stride: eligible
# convs of their own, which the switch patches as PEFT attaches them.
LORA_TARGETS = ["patch_embed.proj", "q_proj", "v_proj"]


# (name, LoRA, dtype). float32 is what the test's tolerance is about; float64 leaves only the arithmetic,
# where the GEMM and the conv compute the same sums and the runs agree to round-off of 1e-16.
SCENARIOS = [
    ("full-fp32", False, torch.float32),
    ("lora-fp32", True, torch.float32),
    ("full-fp64", False, torch.float64),
    ("lora-fp64", True, torch.float64),
]


def dataset() -> Dataset:
    """Eight one-image conversations (48 x 64 images, resized by the processor to its pixel budget)."""
    return Dataset.from_list(
        [
            {
                "images": [Image.fromarray(pattern(48, 64, k))],
                "messages": [
                    {"role": "user", "content": [{"type": "image"}, {"type": "text", "text": WORDS[k % 4]}]},
                    {"role": "assistant", "content": [{"type": "text", "text": WORDS[(k + 1) % 4]}]},
                ],
            }
            for k in range(8)
        ]
    )


def sft(ckpt: str, out: Path, lora: bool, dtype: torch.dtype) -> dict:
    from peft import LoraConfig

    args = SFTConfig(
        output_dir=str(out / "trainer"), max_steps=STEPS, per_device_train_batch_size=2,
        optim="sgd", learning_rate=LR, logging_steps=1, report_to=[], save_strategy="no", use_cpu=True, seed=0,
        disable_tqdm=True, dataloader_num_workers=0, model_init_kwargs={"dtype": dtype},
    )  # fmt: skip
    peft_config = LoraConfig(r=4, lora_alpha=8, target_modules=LORA_TARGETS) if lora else None
    trainer = SFTTrainer(
        model=ckpt,
        args=args,
        train_dataset=dataset(),
        processing_class=qwen3_vl_processor(ckpt),
        peft_config=peft_config,
    )
    # Each training forward's loss at the model's precision (the trainer logs a float32 running sum).
    losses: list[float] = []
    trainer.model.register_forward_hook(lambda module, args, output: losses.append(output.loss.item()))
    counter = ConvCount()
    with vlfast.record_calls() as rec, counter:
        trainer.train()
    proj = trainer.model.get_base_model() if lora else trainer.model
    proj = proj.model.visual.patch_embed.proj
    trained = proj.lora_B["default"].weight if lora else proj.weight
    return {
        "patched_at_build": vlfast.is_patched(trainer.model),
        "losses": losses,
        "logged_losses": [h["loss"] for h in trainer.state.log_history if "loss" in h],
        "aten_convs": counter.calls,
        "record": rec.to_dict(),
        "record_text": str(rec),
        # the patch embed's trained weight after the steps (LoRA: its lora_B, zero at the start)
        "trained": trained.detach().flatten().tolist(),
    }


def main() -> None:
    ckpt, out = sys.argv[1], Path(sys.argv[2])
    # One thread: the same summation order whatever else the machine runs, and the two runs side by side
    # on two cores.
    torch.set_num_threads(1)
    for name, lora, dtype in SCENARIOS:
        (out / f"{name}.json").write_text(json.dumps(sft(ckpt, out, lora, dtype)))


if __name__ == "__main__":
    main()
