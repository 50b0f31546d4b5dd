"""The training stacks users run, on CPU ranks, patched and not: what each scenario computed and what ran.

Run by tests/test_training_stacks.py under a real launcher, never imported by pytest:

    DS_ACCELERATOR=cpu VLFAST_PATCH=1 VLFAST_RECORD=OUT/record.jsonl torchrun --nproc_per_node 2 \
        tests/_training_stacks.py torchrun OUT CKPT
    VLFAST_PATCH=1 VLFAST_RECORD=... accelerate launch --multi_gpu --num_processes 2 \
        tests/_training_stacks.py accelerate OUT CKPT

Each scenario trains a copy of one model with a stack (DeepSpeed ZeRO-2/3, FSDP1, FSDP2, HF Trainer,
accelerate) on the same batch on every rank, so that the averaged gradient is the single-process one, and
compares with a plain model trained on one process without the patch: forward, loss, the patch embed's
weight gradient and the parameters after SGD steps (SGD: Adam would amplify 1e-8 gradient differences).
Every scenario also counts the convolutions that reached ATen (a dispatch mode sees the stock conv however
it is called, forward and backward): 0 where the patch is on. Results go to OUT/<scenario>-rank<R>.json;
a scenario that raises writes its traceback there and the others still run.
"""

from __future__ import annotations

import copy
import json
import os
import sys
import traceback
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn

import vlfast
from _patching_checks import ConvCount  # this script's folder, tests/, is sys.path[0]

STEPS = 2
LR = 0.1
# Qwen3-VL-2B's patch embed at full size: 1024 x 1536, so DeepSpeed's default
# stage3_param_persistence_threshold (1e5 elements) partitions it, as it does in a real run.
C, T, P, D = 3, 2, 16, 1024


class Embed(nn.Module):
    """A patch embed as Qwen-VL calls it (pixel rows viewed as windows), then a small head."""

    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Conv3d(C, D, (T, P, P), stride=(T, P, P))
        self.head = nn.Linear(D, 4)

    def forward(self, pixels: torch.Tensor) -> torch.Tensor:
        return self.head(self.proj(pixels.view(-1, C, T, P, P)).view(-1, D))


def batch(step: int) -> torch.Tensor:
    return torch.randn(8, C * T * P * P, generator=torch.Generator().manual_seed(100 + step))


def loss_of(out: torch.Tensor) -> torch.Tensor:
    return out.square().mean()


def reference(model: nn.Module) -> dict:
    """The plain model, unpatched, one process: what every scenario must compute."""
    model = copy.deepcopy(model)
    vlfast.unpatch(model)
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    outs, losses, grad = [], [], None
    for step in range(STEPS):
        out = model(batch(step))
        loss = loss_of(out)
        loss.backward()
        if step == 0:
            grad = model.proj.weight.grad.clone()
        outs.append(out.detach())
        losses.append(loss.item())
        opt.step()
        opt.zero_grad()
    return {"out": outs[0], "losses": losses, "grad": grad, "weight": model.proj.weight.detach().clone()}


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.detach().double().flatten(), b.detach().double().flatten()
    return ((a - b).abs().max() / b.abs().max().clamp_min(1e-30)).item()


def compare(ref: dict, out, losses, grad, weight) -> dict:
    return {
        "out_rel": rel(out, ref["out"]),
        "loss_rel": max(abs(a - b) / abs(b) for a, b in zip(losses, ref["losses"])),
        "grad_rel": rel(grad, ref["grad"]),
        "weight_rel": rel(weight, ref["weight"]),
    }


def plain_model() -> nn.Module:
    torch.manual_seed(0)
    model = Embed()
    vlfast.unpatch(model)  # VLFAST_PATCH's hook patched it as it was built; each scenario decides
    return model


# --------------------------------------------------------------------------------------- DeepSpeed


def _ds_config(stage: int, batch_size: int | str = 8) -> dict:
    return {
        "train_micro_batch_size_per_gpu": batch_size,
        "gradient_accumulation_steps": 1,
        "gradient_clipping": 0.0,  # DeepSpeed's default clips at 1.0: the reference does not
        "zero_optimization": {"stage": stage},  # stage 3: the default persistence threshold
        "zero_allow_untested_optimizer": True,
    }


def deepspeed_run(stage: int, when: str, zero_init: bool) -> dict:
    """``when``: "before" (patched as built) or "after" (``deepspeed.initialize``); "never" for a control."""
    import deepspeed
    from deepspeed.utils import safe_get_full_grad

    base = plain_model()
    ref = reference(base)
    config = _ds_config(stage)
    if zero_init:
        with deepspeed.zero.Init(config_dict_or_path=config):
            model = Embed()
        params = list(model.parameters())
        with deepspeed.zero.GatheredParameters(params, modifier_rank=0), torch.no_grad():
            for p, q in zip(params, base.parameters()):
                p.copy_(q)
        vlfast.unpatch(model)
    else:
        model = copy.deepcopy(base)
    facts = {"weight_at_patch": list(model.proj.weight.shape)}
    if when == "before":
        facts["report"] = str(vlfast.patch(model))
    engine, *_ = deepspeed.initialize(
        model=model, optimizer=torch.optim.SGD(model.parameters(), lr=LR), config=config
    )
    if when == "after":
        facts["weight_at_patch"] = list(model.proj.weight.shape)
        facts["report"] = str(vlfast.patch(engine))
    counter, losses = ConvCount(), []
    with vlfast.record_calls() as rec, counter:
        for step in range(STEPS):
            out = engine(batch(step))
            loss = loss_of(out)
            engine.backward(loss)
            if step == 0:
                first_out, grad = out.detach(), safe_get_full_grad(model.proj.weight).clone()
            losses.append(loss.item())
            engine.step()
    with deepspeed.zero.GatheredParameters([model.proj.weight]):
        weight = model.proj.weight.detach().clone()
    return {
        **facts,
        **compare(ref, first_out, losses, grad, weight),
        "aten_convs": counter.calls,
        "gemm_calls": rec.gemm_calls,
        "stock_calls": rec.stock_calls,
        "repr": repr(model.proj),
        "is_patched": vlfast.is_patched(model),
    }


# -------------------------------------------------------------------------------------------- FSDP


def fsdp1_run(use_orig_params: bool, when: str) -> dict:
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP

    base = plain_model()
    ref = reference(base)
    model = copy.deepcopy(base)
    if when == "before":
        vlfast.patch(model)
    wrapped = FSDP(model, device_id=torch.device("cpu"), use_orig_params=use_orig_params)
    facts = {}
    if when == "after":
        inner = wrapped.module.proj
        facts["weight_at_patch"] = list(inner.weight.shape) if hasattr(inner, "weight") else None
        facts["report"] = str(vlfast.patch(wrapped))
    opt = torch.optim.SGD(wrapped.parameters(), lr=LR)
    counter, losses, grad = ConvCount(), [], None
    with vlfast.record_calls() as rec, counter:
        for step in range(STEPS):
            out = wrapped(batch(step))
            loss = loss_of(out)
            loss.backward()
            if step == 0:
                first_out = out.detach()
                if use_orig_params:  # with_grads needs the original parameters
                    with FSDP.summon_full_params(wrapped, with_grads=True):
                        grad = wrapped.module.proj.weight.grad.clone()
            losses.append(loss.item())
            opt.step()
            opt.zero_grad()
    with FSDP.summon_full_params(wrapped):
        weight = wrapped.module.proj.weight.detach().clone()
    result = compare(ref, first_out, losses, grad if grad is not None else ref["grad"], weight)
    if grad is None:
        result["grad_rel"] = None  # not observable without the original parameters: the weight is
    return {**facts, **result, "aten_convs": counter.calls, "gemm_calls": rec.gemm_calls,
            "stock_calls": rec.stock_calls}  # fmt: skip


def fsdp2_run(when: str, bf16: bool) -> dict:
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    base = plain_model()
    ref = reference(base)
    model = copy.deepcopy(base)
    mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32) if bf16 else None
    if when == "before":
        vlfast.patch(model)
    fully_shard(model, **({"mp_policy": mp} if mp else {}))
    if when == "after":
        vlfast.patch(model)
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    counter, losses = ConvCount(), []
    with vlfast.record_calls() as rec, counter:
        for step in range(STEPS):
            out = model(batch(step))
            loss = loss_of(out.float())
            loss.backward()
            if step == 0:
                first_out, grad = out.detach().float(), model.proj.weight.grad.full_tensor().clone()
            losses.append(loss.item())
            opt.step()
            opt.zero_grad()
    weight = model.proj.weight.full_tensor().detach().clone()
    return {**compare(ref, first_out, losses, grad, weight), "aten_convs": counter.calls,
            "gemm_calls": rec.gemm_calls, "stock_calls": rec.stock_calls}  # fmt: skip


# ------------------------------------------------------------------------------ HF Trainer, accelerate


def qwen_batch(i: int, image_token: int = 300) -> dict:
    """One sample as Qwen3-VL's processor gives it: a 4x4-patch image (4 merged tokens) and a few words."""
    ids = torch.tensor([302] + [image_token] * 4 + [303, 10, 11, 12, 13])
    return {
        "input_ids": ids,
        "attention_mask": torch.ones_like(ids),
        "labels": ids.clone(),
        "mm_token_type_ids": (ids == image_token).long(),
        "pixel_values": torch.randn(16, C * T * P * P, generator=torch.Generator().manual_seed(i)),
        "image_grid_thw": torch.tensor([[1, 4, 4]]),
    }


def collate(items: list[dict]) -> dict:
    out = {k: torch.stack([x[k] for x in items]) for k in ("input_ids", "attention_mask", "labels",
                                                            "mm_token_type_ids")}  # fmt: skip
    out["pixel_values"] = torch.cat([x["pixel_values"] for x in items])
    out["image_grid_thw"] = torch.cat([x["image_grid_thw"] for x in items])
    return out


def hf_trainer_zero3(ckpt: str, out_dir: Path) -> dict:
    """HF Trainer with a ZeRO-3 config: ``from_pretrained`` builds the model under ``zero.Init`` (what
    LlamaFactory, axolotl, ms-swift and TRL build on); VLFAST_PATCH=1 patches it as it is built."""
    import deepspeed
    from transformers import Qwen3VLForConditionalGeneration, Trainer, TrainingArguments

    def train(patched: bool) -> dict:
        args = TrainingArguments(
            output_dir=str(out_dir / f"trainer-{patched}"), deepspeed=_ds_config(3, "auto"), per_device_train_batch_size=1,
            max_steps=STEPS, optim="sgd", learning_rate=LR, report_to=[], save_strategy="no", logging_steps=1,
            use_cpu=True, ddp_backend="gloo", disable_tqdm=True, max_grad_norm=0.0,
        )  # fmt: skip
        model = Qwen3VLForConditionalGeneration.from_pretrained(ckpt)
        proj = model.model.visual.patch_embed.proj
        facts = {"weight_at_build": list(proj.weight.shape), "patched_at_build": vlfast.is_patched(model)}
        if not patched:
            vlfast.unpatch(model)
        trainer = Trainer(model=model, args=args, train_dataset=[qwen_batch(i) for i in range(STEPS)],
                          data_collator=collate)  # fmt: skip
        counter = ConvCount()
        with vlfast.record_calls() as rec, counter:
            trainer.train()
        with deepspeed.zero.GatheredParameters([proj.weight]):
            weight = proj.weight.detach().clone()
        losses = [h["loss"] for h in trainer.state.log_history if "loss" in h]
        return {**facts, "losses": losses, "weight": weight, "aten_convs": counter.calls,
                "gemm_calls": rec.gemm_calls, "stock_calls": rec.stock_calls, "repr": repr(proj)}  # fmt: skip

    stock = train(False)
    fast = train(True)
    return {
        "weight_at_build": fast["weight_at_build"],
        "patched_at_build": fast["patched_at_build"],
        "loss_rel": max(abs(a - b) / abs(b) for a, b in zip(fast["losses"], stock["losses"])),
        "losses": [len(fast["losses"]), len(stock["losses"])],
        "weight_rel": rel(fast["weight"], stock["weight"]),
        "aten_convs": fast["aten_convs"],
        "control_aten_convs": stock["aten_convs"],
        "gemm_calls": fast["gemm_calls"],
        "stock_calls": fast["stock_calls"],
        "repr": fast["repr"],
    }


def accelerate_ddp(ckpt: str) -> dict:
    """``accelerate launch``: VLFAST_PATCH=1 inherited by each process, the model built and prepared."""
    from accelerate import Accelerator
    from transformers import Qwen3VLForConditionalGeneration

    accelerator = Accelerator(cpu=True)

    def train(patched: bool, after_prepare: bool = False) -> dict:
        model = Qwen3VLForConditionalGeneration.from_pretrained(ckpt)
        patched_at_build = vlfast.is_patched(model)
        vlfast.unpatch(model)
        if patched and not after_prepare:
            vlfast.patch(model)
        opt = torch.optim.SGD(model.parameters(), lr=LR)
        model, opt = accelerator.prepare(model, opt)
        if patched and after_prepare:
            vlfast.patch(model)
        counter, losses = ConvCount(), []
        with vlfast.record_calls() as rec, counter:
            for i in range(STEPS):
                loss = model(**collate([qwen_batch(i)])).loss
                accelerator.backward(loss)
                opt.step()
                opt.zero_grad()
                losses.append(loss.item())
        proj = accelerator.unwrap_model(model).model.visual.patch_embed.proj
        return {"losses": losses, "weight": proj.weight.detach().clone(), "aten_convs": counter.calls,
                "gemm_calls": rec.gemm_calls, "stock_calls": rec.stock_calls,
                "patched_at_build": patched_at_build}  # fmt: skip

    stock = train(False)
    out = {"world_size": accelerator.num_processes, "control_aten_convs": stock["aten_convs"]}
    for label, after in (("built", False), ("after_prepare", True)):
        fast = train(True, after)
        out[label] = {
            "loss_rel": max(abs(a - b) / abs(b) for a, b in zip(fast["losses"], stock["losses"])),
            "weight_rel": rel(fast["weight"], stock["weight"]),
            "aten_convs": fast["aten_convs"],
            "gemm_calls": fast["gemm_calls"],
            "stock_calls": fast["stock_calls"],
            "patched_at_build": fast["patched_at_build"],
        }
    return out


# ------------------------------------------------------------------------------------------ driver


def _scenarios(launcher: str, ckpt: str, out: Path) -> dict:
    if launcher == "accelerate":
        return {"accelerate-ddp": lambda: accelerate_ddp(ckpt)}
    return {
        # First, while VLFAST_PATCH's switch is on: the transformers model is patched as it is built.
        "hf-trainer-zero3": lambda: hf_trainer_zero3(ckpt, out),
        "zero3-init-patched-after-initialize": lambda: deepspeed_run(3, "after", zero_init=True),
        "zero3-init-patched-before-initialize": lambda: deepspeed_run(3, "before", zero_init=True),
        "zero3-patched-before-initialize": lambda: deepspeed_run(3, "before", zero_init=False),
        "zero3-control-unpatched": lambda: deepspeed_run(3, "never", zero_init=True),
        "zero2-patched-after-initialize": lambda: deepspeed_run(2, "after", zero_init=False),
        "fsdp1-orig-params-patched-after-wrap": lambda: fsdp1_run(True, "after"),
        "fsdp1-orig-params-patched-before-wrap": lambda: fsdp1_run(True, "before"),
        "fsdp1-flat-params-patched-after-wrap": lambda: fsdp1_run(False, "after"),
        "fsdp1-flat-params-patched-before-wrap": lambda: fsdp1_run(False, "before"),
        "fsdp2-patched-after-shard": lambda: fsdp2_run("after", bf16=False),
        "fsdp2-patched-before-shard": lambda: fsdp2_run("before", bf16=False),
        "fsdp2-bf16-patched-after-shard": lambda: fsdp2_run("after", bf16=True),
    }


def main() -> None:
    launcher, out, ckpt = sys.argv[1], Path(sys.argv[2]), sys.argv[3]
    only = set(sys.argv[4].split(",")) if len(sys.argv) > 4 and sys.argv[4] else None
    torch.set_num_threads(1)
    if launcher == "torchrun":
        import importlib

        import deepspeed

        # DeepSpeed's CPU accelerator JIT-compiles a shared-memory allreduce with g++ at its first init: about
        # 100 s of CPU on a fresh machine, so on every CI run. The ranks use gloo's collectives instead; what
        # runs here is the patch under ZeRO, not DeepSpeed's CPU kernels (GPU users have NCCL's). By module
        # name: the attribute deepspeed.comm.torch is the torch package (a star import shadows it).
        importlib.import_module("deepspeed.comm.torch").build_shm_op = lambda: None
        deepspeed.init_distributed(dist_backend="gloo")
    rank = int(os.environ.get("RANK", "0"))
    for name, run in _scenarios(launcher, ckpt, out).items():
        if only is not None and name not in only:
            continue
        try:
            result = run()
        except Exception:
            result = {"error": traceback.format_exc()}
        (out / f"{name}-rank{rank}.json").write_text(json.dumps(result, default=str))
        if name == "hf-trainer-zero3":
            # The rest are plain modules that each scenario patches (or not) itself.
            vlfast.unpatch_transformers()
        if dist.is_initialized():
            dist.barrier()


if __name__ == "__main__":
    main()
