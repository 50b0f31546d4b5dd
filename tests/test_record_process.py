"""The record proves the whole process and never holds it.

``VLFAST_RECORD=PATH`` appends to a regular file only: a FIFO (or a device, a directory) is refused with
one line at start and never blocks the exit. A conv class whose ``forward`` someone replaced bypasses the
patch, and the report and the record say by what. While a record runs, eligible convs that vlfast did not
patch (PEFT's LoRA convs added after ``patch``, a model built before the switch) are counted and named.
"""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import vlfast
from vlfast.models import build_reference, synthetic_inputs
from vlfast.patching import gemm
from vlfast.patching.gemm import is_patched, patch
from vlfast.switches import record

K = (2, 4, 4)

RECORD_SCRIPT = """
import torch, vlfast
conv = torch.nn.Conv3d(3, 8, (2, 4, 4), stride=(2, 4, 4))
vlfast.patch(conv)
conv(torch.randn(4, 3, 2, 4, 4))
"""


def _env(**extra: str) -> dict[str, str]:
    env = {
        k: v
        for k, v in os.environ.items()
        if k not in ("VLFAST_PATCH", "VLFAST_RECORD", "RANK", "WORLD_SIZE")
    }
    return env | extra


# ------------------------------------------------------------------------------- VLFAST_RECORD=PATH


def test_a_fifo_without_a_reader_is_refused_at_start_and_never_blocks_the_exit(tmp_path):
    fifo = tmp_path / "record.fifo"
    os.mkfifo(fifo)
    done = subprocess.run(
        [sys.executable, "-c", RECORD_SCRIPT],
        env=_env(VLFAST_RECORD=str(fifo)),
        capture_output=True,
        text=True,
        timeout=120,  # before the fix: the record printed, then the exit blocked in open() for ever
    )
    assert done.returncode == 0, done.stderr
    first, *rest = done.stderr.splitlines()
    assert (
        first
        == f"vlfast record: VLFAST_RECORD={str(fifo)!r} is a FIFO, not a regular file: the record goes to stderr only"
    )
    assert "1 patched conv, 1 call: 1 GEMM, 0 stock" in done.stderr
    assert not any("FIFO" in line for line in rest)  # said once


def test_a_fifo_made_after_start_up_does_not_block_the_exit_either(tmp_path):
    fifo = tmp_path / "record.fifo"
    script = f"import os; os.mkfifo({str(fifo)!r})\n" + RECORD_SCRIPT
    done = subprocess.run(
        [sys.executable, "-c", script],
        env=_env(VLFAST_RECORD=str(fifo)),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr
    assert "1 patched conv, 1 call: 1 GEMM, 0 stock" in done.stderr
    assert f"could not append to VLFAST_RECORD={str(fifo)!r}" in done.stderr  # ENXIO: no reader


def test_a_directory_is_refused_and_a_new_file_is_created(tmp_path):
    done = subprocess.run(
        [sys.executable, "-c", RECORD_SCRIPT],
        env=_env(VLFAST_RECORD=str(tmp_path)),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0 and "is a directory, not a regular file" in done.stderr.splitlines()[0]
    target = tmp_path / "new.jsonl"
    done = subprocess.run(
        [sys.executable, "-c", RECORD_SCRIPT],
        env=_env(VLFAST_RECORD=str(target)),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0 and "regular file" not in done.stderr, done.stderr
    assert json.loads(target.read_text())["gemm_calls"] == 1


# ------------------------------------------------------------------------ a forward replaced on the class


def conv3d() -> nn.Conv3d:
    torch.manual_seed(0)
    return nn.Conv3d(3, 8, K, stride=K)


def windows(n: int = 4) -> torch.Tensor:
    return torch.randn(n, 3, *K, generator=torch.Generator().manual_seed(1))


def their_forward(self, x):
    """What ms-swift >= 4.1 assigns to nn.Conv3d.forward on torch 2.9.x: its own computation, which never
    calls the instance's _conv_forward, where vlfast's patch sits."""
    return F.conv3d(x, self.weight, self.bias, self.stride)


def their_forward_through_the_patch(self, x):
    return self._conv_forward(x, self.weight, self.bias)


@contextlib.contextmanager
def conv3d_forward(fn):
    original = nn.Conv3d.forward
    nn.Conv3d.forward = fn
    try:
        yield
    finally:
        nn.Conv3d.forward = original


@pytest.mark.parametrize("order", ["patch-then-replace", "replace-then-patch"])
def test_a_forward_replaced_on_the_class_is_named_by_the_report_repr_and_record(order):
    model, x = nn.Sequential(conv3d()), windows()
    said = f"forward replaced by {__name__}.their_forward: vlfast's GEMM not reached, calls not counted"
    with contextlib.ExitStack() as stack:
        if order == "patch-then-replace":
            patch(model)
            stack.enter_context(conv3d_forward(their_forward))
            report = patch(model)
            assert report.entries[0].status == "already_patched"
        else:
            stack.enter_context(conv3d_forward(their_forward))
            report = patch(model)
            assert report.entries[0].status == "patched"
        assert report.entries[0].reason == said
        assert f"1 of them not reached: {said}" in str(report)
        assert not is_patched(model) and repr(model[0]).endswith(f"vlfast=not reached ({said}))")
        with vlfast.record_calls() as rec:
            model(x)
            model(x)
        text = str(rec)
        assert "1 patched conv, 0 calls" not in text, text
        head, line = text.splitlines()
        assert head.endswith(f"{said} (1 patched conv)"), text
        assert line == f"  0: {said} (2 calls of the module)"
        (conv,) = rec.to_dict()["convs"]
        assert conv["forward_replaced"] == f"{__name__}.their_forward" and conv["module_calls"] == 2
        assert record._BYPASSED == gemm.BYPASSED  # one wording, spelt twice: record.py imports no torch
    assert is_patched(model) and repr(model[0]).endswith("vlfast=gemm)")  # torch's forward back


def test_a_replaced_forward_that_calls_the_patch_runs_the_gemm_and_is_not_flagged():
    model, x = nn.Sequential(conv3d()), windows()
    patch(model)
    with conv3d_forward(their_forward_through_the_patch):
        assert is_patched(model)
        with vlfast.record_calls() as rec:
            model(x)
    assert rec.gemm_calls == 1 and str(rec).splitlines()[1] == "  0: 1 GEMM"


# --------------------------------------------------------------- eligible convs vlfast did not patch


def _hooks() -> int:
    return len(torch.nn.modules.module._global_forward_pre_hooks)


def test_the_record_watches_module_calls_only_while_it_runs():
    before = _hooks()
    with vlfast.record_calls():
        assert _hooks() == before + 1
        with vlfast.record_calls():  # overlapping records share one hook
            assert _hooks() == before + 1
        assert _hooks() == before + 1
    assert _hooks() == before  # off: torch's Module.__call__ keeps its fast path, nothing counts


def test_a_conv_never_patched_is_counted_and_named_by_class_and_id():
    built_before, patched, x = conv3d(), conv3d(), windows()
    other = nn.Conv3d(3, 8, 3, padding=1)  # not eligible: not counted
    patch(patched)
    with vlfast.record_calls() as rec:
        built_before(x)
        built_before(x)
        patched(x)
        other(torch.randn(1, 3, 4, 4, 4))
    (unpatched,) = rec.unpatched()
    assert unpatched.name == f"Conv3d@{id(built_before) & 0xFFFFFF:06x}" and unpatched.module_calls == 2
    assert rec.unpatched_calls == 2 and rec.gemm_calls == 1 and rec.stock_calls == 0
    assert str(rec).splitlines()[-1] == f"  1 eligible conv not patched: {unpatched.name}: 2 stock calls"
    assert rec.to_dict()["unpatched"] == [{"name": unpatched.name, "calls": 2, "forward_replaced": None}]


def test_many_convs_not_patched_are_named_eight_at_a_time_in_the_text():
    convs, x = [conv3d() for _ in range(10)], windows()
    with vlfast.record_calls() as rec:
        for conv in convs:
            conv(x)
    assert str(rec).splitlines()[-1].endswith(" and 2 more: 10 stock calls")
    assert len(rec.to_dict()["unpatched"]) == 10


def test_a_conv_never_patched_under_a_replaced_forward_is_not_called_stock():
    model, x = nn.Sequential(conv3d()), windows()
    with conv3d_forward(their_forward), vlfast.record_calls() as rec:
        model(x)
    name = f"Conv3d@{id(model[0]) & 0xFFFFFF:06x}"
    line = f"  1 eligible conv not patched: {name}: 1 call through {__name__}.their_forward"
    assert str(rec).splitlines()[-1] == line


def test_peft_after_patch_leaves_its_lora_convs_stock_and_the_record_names_them():
    peft = pytest.importorskip("peft")
    tower = build_reference("qwen3-vl-4b", tiny=True)
    pixels, grid = synthetic_inputs(tower, [(2, 4, 4)])
    patch(tower, strict=True)
    config = peft.LoraConfig(
        r=4, lora_alpha=8, target_modules=r".*patch_embed\.proj", init_lora_weights=False
    )
    model = peft.get_peft_model(tower, config)  # lora_A, lora_B: the patch embed's geometry, left stock
    with vlfast.record_calls() as rec:
        model(pixels, grid_thw=grid)
        model(pixels, grid_thw=grid)
    lora = ["patch_embed.proj.lora_A.default", "patch_embed.proj.lora_B.default"]
    assert [(c.name, c.module_calls) for c in rec.unpatched()] == [(n, 2) for n in lora]
    assert rec.gemm_calls == 2 and rec.unpatched_calls == 4
    assert f"  2 eligible convs not patched: {', '.join(lora)}: 4 stock calls" in str(rec).splitlines()


VLFAST_PATCH_SCRIPT = """
import peft, torch, vlfast
from vlfast.models import build_reference, synthetic_inputs
tower = build_reference("qwen3-vl-4b", tiny=True)  # a transformers model: patched as built
pixels, grid = synthetic_inputs(tower, [(2, 4, 4)])
config = peft.LoraConfig(r=4, lora_alpha=8, target_modules=r".*patch_embed\\.proj", init_lora_weights=False)
model = peft.get_peft_model(tower, config)  # patched as attached
model(pixels, grid_thw=grid)
"""


def test_vlfast_patch_with_a_record_path_reports_no_unpatched_conv(tmp_path):
    pytest.importorskip("peft")
    target = tmp_path / "record.jsonl"
    env = _env(VLFAST_PATCH="1", VLFAST_RECORD=str(target))
    done = subprocess.run(
        [sys.executable, "-c", VLFAST_PATCH_SCRIPT], env=env, capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0, done.stderr[-3000:]
    record = json.loads(target.read_text())
    assert record["unpatched_calls"] == 0 and record["unpatched"] == [], record
    assert record["gemm_calls"] == 3 and record["stock_calls"] == 0
    assert "not patched" not in done.stderr and "3 patched convs, 3 calls: 3 GEMM, 0 stock" in done.stderr


@pytest.mark.parametrize(
    ("patch_env", "head_only"),
    [(None, True), ("0", True), ("bogus", True), ("1", False), ("all", False)],
)
def test_an_image_only_record_reads_vlfast_patch_as_the_switch_does(monkeypatch, patch_env, head_only):
    """With image processor calls and no patched conv, the record says only the image line unless the patch
    was asked for (then "no patched convolution" is the news). A value the switch ignores (a typo: nothing
    was patched) is not "asked"."""
    from vlfast.pixels import adapter
    from vlfast.switches import env

    if patch_env is None:
        monkeypatch.delenv("VLFAST_PATCH", raising=False)
    else:
        monkeypatch.setenv("VLFAST_PATCH", patch_env)
    monkeypatch.setattr(env, "_warned", True)  # the typo was said at start-up, not here
    with record.record_calls() as rec:
        adapter.count_image_processor_call()
        adapter.count_image_processor_call("max_pixels=16384 in a call")
    text = str(rec)
    assert "image processor: 2 calls: 1 by vlfast, 1 stock; 1 stock (max_pixels=16384 in a call)" in text
    assert ("no patched convolution" not in text) is head_only, text
