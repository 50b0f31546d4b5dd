"""The record proves the whole process and never holds it.

``VLFAST_RECORD=PATH`` appends to a regular file only: a FIFO (or a device, a directory) is refused with
one line at start and never blocks the exit. A conv class whose ``forward`` someone replaced bypasses the
patch, and the report and the record say by what. While a record runs, eligible convs that vlfast did not
patch (PEFT's LoRA convs added after ``patch``, a model built before the switch) are counted and named.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

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
