"""A checkpoint whose vision-tower weights do not fit its config.json (a patch embedding saved with 8x8
patches, a config that says 16) is refused with exit 2 naming the tensor and both shapes, before `extract`
writes anything to OUT: the resume after the checkpoint is fixed needs no --overwrite. Before: exit 3 with
torch's size mismatch, after run.json and facts.json were written."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file
from typer.testing import CliRunner

from vlfast.cli.main import app

runner = CliRunner()
KEY = "model.visual.patch_embed.proj.weight"


def _swap(ckpt, key: str, tensor: torch.Tensor) -> None:
    """Replace ``key`` in the checkpoint's safetensors file, as a checkpoint saved from another model has it."""
    (weights,) = [f for f in ckpt.glob("*.safetensors") if key in load_file(str(f))]
    tensors = load_file(str(weights))
    tensors[key] = tensor.to(tensors[key].dtype)
    save_file(tensors, str(weights), metadata={"format": "pt"})


@pytest.fixture
def patch8(tiny_qwen3_vl, tmp_path):
    ckpt = tmp_path / "ckpt"
    shutil.copytree(tiny_qwen3_vl, ckpt)
    shape = list(load_file(str(next(ckpt.glob("*.safetensors"))))[KEY].shape)
    assert shape[-2:] == [16, 16]  # what config.json's patch_size says
    _swap(ckpt, KEY, torch.zeros(*shape[:-2], 8, 8))
    return ckpt


def _said(r) -> str:
    return " ".join(r.output.split())


def test_extract_refuses_before_writing_and_resumes_once_fixed(patch8, tiny_qwen3_vl, two, tmp_path):
    out = tmp_path / "out"
    args = ["extract", str(two), str(out), "-m", str(patch8), "--workers", "0", "--features", "vision"]
    r = runner.invoke(app, args)
    assert r.exit_code == 2, r.output
    said = _said(r)
    assert (
        f"{KEY} in model.safetensors is [64, 3, 2, 8, 8], where config.json makes it [64, 3, 2, 16, 16]"
        in said
    )
    assert "size mismatch" not in said
    assert not out.exists() or not any(out.iterdir()), sorted(p.name for p in out.iterdir())
    for f in tiny_qwen3_vl.glob("*.safetensors"):  # the fix: the weights saved with this config
        shutil.copy(f, patch8 / f.name)
    r = runner.invoke(app, [*args, "--json"])
    assert r.exit_code == 0, r.output
    assert json.loads(r.stdout)["extracted"] == 2


def test_extract_of_llm_features_refuses_the_same(patch8, two, tmp_path):
    """The whole model is loaded by transformers there: its own size mismatch came after run.json too."""
    out = tmp_path / "out"
    args = ["extract", str(two), str(out), "-m", str(patch8), "--workers", "0", "--features", "llm"]
    r = runner.invoke(app, args)
    assert r.exit_code == 2, r.output
    assert KEY in _said(r) and not out.exists()


def test_every_tower_tensor_is_compared(tiny_qwen3_vl, tmp_path):
    ckpt = tmp_path / "ckpt"
    shutil.copytree(tiny_qwen3_vl, ckpt)
    key = "model.visual.merger.linear_fc2.weight"
    _swap(ckpt, key, torch.zeros(32, 256))
    from vlfast.errors import InputRefused
    from vlfast.models import check_tower_shapes, tower_shapes

    with pytest.raises(
        InputRefused, match=r"merger\.linear_fc2\.weight in model\.safetensors is \[32, 256\]"
    ):
        check_tower_shapes(ckpt, tower_shapes(ckpt))
    check_tower_shapes(tiny_qwen3_vl, tower_shapes(tiny_qwen3_vl))  # a checkpoint that fits passes


def test_verify_refuses_with_exit_2(patch8):
    r = runner.invoke(app, ["verify", "--model", str(patch8)])
    assert r.exit_code == 2, r.output
    said = _said(r)
    assert KEY in said and "[64, 3, 2, 8, 8]" in said and "[64, 3, 2, 16, 16]" in said
