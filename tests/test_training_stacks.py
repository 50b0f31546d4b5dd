"""The patch inside the stacks users train with, on two CPU ranks: DeepSpeed ZeRO-2/3 (through
``deepspeed.initialize`` and HF Trainer), FSDP1 and FSDP2, accelerate. Each scenario is compared with
the plain model trained unpatched on one process (forward, loss, the patch embed's weight gradient, the
parameters after SGD steps) and asserts what ran: no convolution reached ATen, every call of the patched
conv took the GEMM. tests/_training_stacks.py holds the scenarios; one launch per launcher runs them all.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("deepspeed")
# One worker runs the module, so each launch (a module fixture) happens once under xdist, not once a worker.
pytestmark = pytest.mark.xdist_group("training-stacks")

WORKER = Path(__file__).with_name("_training_stacks.py")
STEPS = 2
FP32 = {"out_rel": 1e-5, "loss_rel": 1e-5, "grad_rel": 1e-4, "weight_rel": 1e-5}


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory) -> Path:
    """A tiny Qwen3-VL whose patch embed (128 x 1536) is over DeepSpeed's default persistence threshold
    (1e5 elements), so ZeRO-3 partitions it as it does a real one (1024 x 1536 for Qwen3-VL-2B)."""
    import torch
    from transformers import Qwen3VLForConditionalGeneration

    from vlfast.demo import tiny_qwen3_vl_config

    config = tiny_qwen3_vl_config(
        400, image_token_id=300, video_token_id=301, vision_start_token_id=302, vision_end_token_id=303
    )
    config.vision_config.hidden_size = 128
    torch.manual_seed(0)
    path = tmp_path_factory.mktemp("stack-ckpt")
    Qwen3VLForConditionalGeneration(config).save_pretrained(path)
    return path


def _launch(cmd: list[str], out: Path, ckpt: Path) -> dict[str, list[dict]]:
    out.mkdir(parents=True, exist_ok=True)
    env = {
        **os.environ,
        "DS_ACCELERATOR": "cpu",
        "OMP_NUM_THREADS": "1",
        "VLFAST_PATCH": "1",  # as a user sets it beside their launcher
        "VLFAST_RECORD": str(out / "record.jsonl"),
        "TOKENIZERS_PARALLELISM": "false",
    }
    done = subprocess.run(
        [*cmd, str(WORKER), cmd_name(cmd), str(out), str(ckpt)],
        capture_output=True, text=True, timeout=280, env=env, cwd=out,
    )  # fmt: skip
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-6000:]
    results: dict[str, list[dict]] = {}
    for path in sorted(out.glob("*-rank*.json")):
        results.setdefault(path.name.rsplit("-rank", 1)[0], []).append(json.loads(path.read_text()))
    records = [json.loads(line) for line in (out / "record.jsonl").read_text().splitlines()]
    return {"scenarios": results, "records": records, "stderr": done.stderr}


def cmd_name(cmd: list[str]) -> str:
    return "accelerate" if "accelerate" in " ".join(cmd) else "torchrun"


@pytest.fixture(scope="module")
def torchrun(ckpt, tmp_path_factory):
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2"]
    return _launch(cmd, tmp_path_factory.mktemp("torchrun"), ckpt)


@pytest.fixture(scope="module")
def accelerate(ckpt, tmp_path_factory):
    cmd = [sys.executable, "-m", "accelerate.commands.launch", "--multi_gpu", "--num_processes", "2",
           "--num_machines", "1", "--mixed_precision", "no", "--dynamo_backend", "no"]  # fmt: skip
    return _launch(cmd, tmp_path_factory.mktemp("accelerate"), ckpt)


def _ranks(run: dict, name: str) -> list[dict]:
    ranks = run["scenarios"].get(name, [])
    assert len(ranks) == 2, f"{name}: {len(ranks)} rank results"
    for r in ranks:
        assert "error" not in r, r["error"]
    return ranks


def _assert_gemm_ran(r: dict, name: str) -> None:
    # What ran, not only what came out: the stock conv never reached ATen, forward or backward, and the
    # record counted every forward call of the patched conv as the GEMM.
    assert r["aten_convs"] == 0, f"{name}: {r['aten_convs']} stock convolutions ran"
    assert r["stock_calls"] == 0 and r["gemm_calls"] == STEPS, r


def _assert_equal_numbers(r: dict, name: str, limits: dict) -> None:
    for key, limit in limits.items():
        if r.get(key) is not None:
            assert r[key] <= limit, f"{name}: {key} = {r[key]:.3g} > {limit:g}"


DEEPSPEED = [
    "zero3-init-patched-after-initialize",  # the reported failure: a (0,) weight when patched
    "zero3-init-patched-before-initialize",
    "zero3-patched-before-initialize",
    "zero2-patched-after-initialize",
]
FSDP = [
    "fsdp1-orig-params-patched-after-wrap",  # the reported failure: a flat view when patched
    "fsdp1-orig-params-patched-before-wrap",
    "fsdp1-flat-params-patched-after-wrap",
    "fsdp1-flat-params-patched-before-wrap",
    "fsdp2-patched-after-shard",
    "fsdp2-patched-before-shard",
]


@pytest.mark.parametrize("name", DEEPSPEED + FSDP)
def test_patched_conv_runs_the_gemm_and_trains_as_the_stock_one(torchrun, name):
    for r in _ranks(torchrun, name):
        _assert_gemm_ran(r, name)
        _assert_equal_numbers(r, name, FP32)
        if name.startswith("zero3-init"):
            if name.endswith("after-initialize"):
                assert r["weight_at_patch"] == [0]  # partitioned when patched: decided at each call
                assert "partitioned" in r["report"] and "decided at each call" in r["report"]
            assert r["is_patched"] and r["repr"].endswith("vlfast=gemm)")


def test_fsdp2_bf16_mixed_precision_runs_the_gemm(torchrun):
    name = "fsdp2-bf16-patched-after-shard"
    for r in _ranks(torchrun, name):
        _assert_gemm_ran(r, name)
        # bf16 compute against the fp32 reference: bf16's rounding, on both sides of the patch
        _assert_equal_numbers(
            r, name, {"out_rel": 2e-2, "loss_rel": 2e-2, "grad_rel": 5e-2, "weight_rel": 1e-2}
        )


def test_the_conv_counter_sees_the_stock_conv_under_zero3(torchrun):
    """The control: unpatched under ZeRO-3, the dispatch-mode counter does count the stock conv."""
    for r in _ranks(torchrun, "zero3-control-unpatched"):
        assert r["aten_convs"] == 2 * STEPS and r["gemm_calls"] == 0  # forward and backward per step
        _assert_equal_numbers(r, "control", FP32)


def test_hf_trainer_zero3_with_the_environment_variable(torchrun):
    """HF Trainer with a ZeRO-3 config builds the model under zero.Init (an empty weight at patch time);
    VLFAST_PATCH=1 patches it there and the GEMM runs in every step, losses and weights as unpatched."""
    for r in _ranks(torchrun, "hf-trainer-zero3"):
        assert r["weight_at_build"] == [0] and r["patched_at_build"]
        assert r["aten_convs"] == 0 and r["control_aten_convs"] == 2 * STEPS
        assert r["stock_calls"] == 0 and r["gemm_calls"] == STEPS
        assert r["losses"] == [STEPS, STEPS]
        _assert_equal_numbers(r, "hf-trainer-zero3", {"loss_rel": 1e-5, "weight_rel": 1e-5})


def test_the_record_at_exit_says_what_ran_on_each_rank(torchrun):
    """VLFAST_RECORD=PATH: one JSON line per rank at exit; every patched conv's calls took the GEMM."""
    records = torchrun["records"]
    assert sorted(r["rank"] for r in records) == [0, 1] and {r["world_size"] for r in records} == {2}
    for r in records:
        assert r["stock_calls"] == 0 and r["gemm_calls"] > 0, r
        assert any(c["name"] == "model.visual.patch_embed.proj" and c["gemm"] > 0 for c in r["convs"]), r
    assert (
        "vlfast record (rank 0 of 2" in torchrun["stderr"]
        and "vlfast record (rank 1 of 2" in torchrun["stderr"]
    )


def test_accelerate_launch_two_processes(accelerate):
    for r in _ranks(accelerate, "accelerate-ddp"):
        assert r["world_size"] == 2 and r["control_aten_convs"] == 2 * STEPS
        for label in ("built", "after_prepare"):  # VLFAST_PATCH as built; vlfast.patch after prepare()
            _assert_gemm_ran(r[label], label)
            _assert_equal_numbers(r[label], label, {"loss_rel": 1e-5, "weight_rel": 1e-5})
        assert r["built"]["patched_at_build"]
    assert sorted(r["rank"] for r in accelerate["records"]) == [0, 1]
