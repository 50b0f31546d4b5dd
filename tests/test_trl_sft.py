"""TRL's SFTTrainer on a tiny Qwen3-VL, patched as docs/training.md tells TRL users (``VLFAST_PATCH=1``,
``VLFAST_RECORD=PATH``) and not: full fine-tuning and LoRA with the patch embed among its targets train to
the same losses, and the record and a dispatch-mode count say what ran (every eligible conv, PEFT's
lora_A/lora_B included, on the GEMM; none on the stock path). tests/_trl_sft.py is the training script;
the two runs are two processes, side by side, so nothing of the patch can leak into the control.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

pytest.importorskip("trl")
pytest.importorskip("peft")
# One worker runs the module, so the two training processes (a module fixture) start once under xdist.
pytestmark = pytest.mark.xdist_group("trl-sft")

WORKER = Path(__file__).with_name("_trl_sft.py")
STEPS = 3
# The eligible convs each scenario calls once a step: the patch embed, and with LoRA PEFT's wrapper around
# it (the base conv as base_layer) and its lora_A, lora_B convs, which have the patch embed's geometry.
CONVS = {
    "full": ["model.visual.patch_embed.proj"],
    "lora": [
        "model.visual.patch_embed.proj.base_layer",
        "model.visual.patch_embed.proj.lora_A.default",
        "model.visual.patch_embed.proj.lora_B.default",
    ],
}
# Convolutions reaching ATen per step when unpatched: forward, plus the weight-gradient backward of each
# trained conv (full: the patch embed; LoRA: lora_A and lora_B, the base conv frozen). Patched: none.
STOCK_ATEN = {"full": 2, "lora": 5}

# float32 tolerances on each step's loss, relative, patched against stock. Step 1: the weights are the
# same and only the patch embed's forward differs (summation order over its 1536 products): measured
# 1.7e-6 (5.4e-6 with the kernels limited to AVX2), where each float32 run is 1e-5 from the float64 one.
# Later steps carry round-off through SGD updates of the whole model: measured up to 3.5e-5 (AVX2: 8.6e-5);
# each float32 run against the float64 one up to 8e-5 (AVX2: 1.5e-4); the stock run against itself on 2
# threads instead of 1, 2.8e-5. The float64 runs below carry the exactness claim.
FP32_FIRST_STEP = 2e-5
FP32_STEPS = 2e-4
# The trained weights in float32 are compared through the float64 run (the same training without the
# round-off): the patched run must be no farther from it than the stock run, give or take this factor.
# Measured: patched/stock 1.0 (full and LoRA); with the kernels limited to AVX2, 0.06 for both, the stock
# conv's weight gradient there being the less accurate (patch embed 6.3e-4 from float64, the GEMM's 3.8e-5).
FP32_WEIGHT_RATIO = 1.5
# float64: the same sums in another order, over 3 steps: losses measured equal, weights 3e-16 apart.
FP64 = 1e-12


@pytest.fixture(scope="module")
def runs(tiny_qwen3_vl, tmp_path_factory) -> dict:
    """The script twice, side by side (one thread each): unpatched, and with VLFAST_PATCH=1 VLFAST_RECORD."""
    base = {k: v for k, v in os.environ.items() if k not in ("VLFAST_PATCH", "VLFAST_RECORD")}
    base |= {"OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false", "HF_HUB_OFFLINE": "1"}
    procs = {}
    for name in ("stock", "patched"):
        out = tmp_path_factory.mktemp(f"trl-{name}")
        env = dict(base)
        if name == "patched":
            env |= {"VLFAST_PATCH": "1", "VLFAST_RECORD": str(out / "record.jsonl")}
        log = (out / "log.txt").open("w")
        proc = subprocess.Popen(
            [sys.executable, str(WORKER), str(tiny_qwen3_vl), str(out)],
            env=env, cwd=out, stdout=log, stderr=subprocess.STDOUT, text=True,
        )  # fmt: skip
        procs[name] = (proc, out, log)
    try:
        deadline = time.monotonic() + 280
        for proc, _, _ in procs.values():
            proc.wait(timeout=max(1.0, deadline - time.monotonic()))
    finally:  # a failure or a timeout leaves neither process behind
        for proc, _, log in procs.values():
            if proc.poll() is None:
                proc.kill()
                proc.wait()
            log.close()
    results = {}
    for name, (proc, out, _) in procs.items():
        text = (out / "log.txt").read_text()
        assert proc.returncode == 0, f"{name}: exit {proc.returncode}\n{text[-6000:]}"
        results[name] = {
            "scenarios": {p.stem: json.loads(p.read_text()) for p in out.glob("*.json")},
            "log": text,
            "record": out / "record.jsonl",
        }
    return results


def _pair(runs: dict, scenario: str) -> tuple[dict, dict]:
    return runs["stock"]["scenarios"][scenario], runs["patched"]["scenarios"][scenario]


def _rel(a: list[float], b: list[float]) -> float:
    """Largest difference of b from a, relative to a's largest magnitude."""
    return max(abs(x - y) for x, y in zip(a, b, strict=True)) / max(abs(x) for x in a)


def _distance(a: list[float], reference: list[float]) -> float:
    """||a - reference|| / ||reference||."""
    num = sum((x - y) ** 2 for x, y in zip(a, reference, strict=True))
    return (num / sum(y * y for y in reference)) ** 0.5


@pytest.mark.parametrize("kind", ["full", "lora"])
def test_sft_float32_losses_are_the_stock_losses(runs, kind):
    stock, fast = _pair(runs, f"{kind}-fp32")
    assert len(stock["losses"]) == len(fast["losses"]) == STEPS
    # what the trainer logged is what the hook saw: one forward per step
    assert stock["logged_losses"] == stock["losses"] and fast["logged_losses"] == fast["losses"]
    rels = [abs(f - s) / abs(s) for s, f in zip(stock["losses"], fast["losses"])]
    assert rels[0] <= FP32_FIRST_STEP, (stock["losses"], fast["losses"], rels)
    assert max(rels) <= FP32_STEPS, (stock["losses"], fast["losses"], rels)
    assert stock["losses"][-1] < stock["losses"][0]  # it trained
    # The patch embed's weight after the steps (LoRA: its lora_B), against the float64 training's
    reference = runs["stock"]["scenarios"][f"{kind}-fp64"]["trained"]
    ours, theirs = _distance(fast["trained"], reference), _distance(stock["trained"], reference)
    assert ours <= FP32_WEIGHT_RATIO * theirs, f"patched {ours:.3g} from float64, stock {theirs:.3g}"


@pytest.mark.parametrize("kind", ["full", "lora"])
def test_sft_float64_losses_and_weights_are_the_stock_ones(runs, kind):
    """In float64 round-off is out of the way: the GEMM and the conv compute the same training."""
    stock, fast = _pair(runs, f"{kind}-fp64")
    assert len(stock["losses"]) == len(fast["losses"]) == STEPS
    assert max(abs(f - s) / abs(s) for s, f in zip(stock["losses"], fast["losses"])) <= FP64
    # the patch embed's weight (full) or its LoRA's lora_B (zero at the start: the GEMM's gradient moved it)
    assert max(abs(x) for x in fast["trained"]) > 0
    assert _rel(stock["trained"], fast["trained"]) <= FP64


@pytest.mark.parametrize("dtype", ["fp32", "fp64"])
@pytest.mark.parametrize("kind", ["full", "lora"])
def test_the_record_and_aten_say_every_eligible_conv_ran_the_gemm(runs, kind, dtype):
    stock, fast = _pair(runs, f"{kind}-{dtype}")
    names = CONVS[kind]
    # Patched: built patched by the switch, PEFT's convs patched as attached; no conv reached ATen, forward
    # or backward; every call of every eligible conv was the GEMM.
    rec = fast["record"]
    assert fast["patched_at_build"] and fast["aten_convs"] == 0, fast["record_text"]
    assert rec["stock_calls"] == 0 and rec["unpatched_calls"] == 0 and rec["unpatched"] == [], rec
    assert {c["name"]: c["gemm"] for c in rec["convs"]} == dict.fromkeys(names, STEPS), rec
    assert rec["gemm_calls"] == STEPS * len(names)
    head = f"{len(names)} patched conv{'s' * (len(names) > 1)}, {rec['gemm_calls']} calls: "
    assert f"{head}{rec['gemm_calls']} GEMM, 0 stock" in fast["record_text"]
    # The control: the same record and counter see the stock path when nothing is patched.
    rec = stock["record"]
    assert not stock["patched_at_build"] and stock["aten_convs"] == STEPS * STOCK_ATEN[kind]
    assert rec["gemm_calls"] == 0 and rec["convs"] == [], rec
    assert rec["unpatched_calls"] == STEPS * len(names) and len(rec["unpatched"]) == len(names), rec


def test_vlfast_record_at_exit_covers_the_whole_process(runs):
    """VLFAST_RECORD=PATH: the patched process's line at exit counts every call of its four trainings; the
    control, without the variables, never loads vlfast's record and prints nothing."""
    (line,) = runs["patched"]["record"].read_text().splitlines()
    record = json.loads(line)
    calls = 2 * STEPS * (len(CONVS["full"]) + len(CONVS["lora"]))  # both dtypes
    assert record["gemm_calls"] == calls and record["stock_calls"] == 0, record
    assert record["unpatched_calls"] == 0 and record["unpatched"] == [], record
    assert f"4 patched convs, {calls} calls: {calls} GEMM, 0 stock" in runs["patched"]["log"]
    assert "not patched" not in runs["patched"]["log"]
    assert "vlfast record (" not in runs["stock"]["log"]
