"""The patch on whole vision towers: every reference, end to end, forward and backward; checkpoints.

Each built-in reference (tiny dimensions, random weights) runs an image and a two-frame video through
the stock tower and through the patched one; the merged tokens, the deepstack features and every
gradient must agree. A patched tower's ``save_pretrained`` must be a plain checkpoint that stock
transformers, in a fresh process without vlfast, loads and runs to the same outputs.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest
import torch

from _patching_checks import assert_verbose_close, cosine
from _transformers_support import TOWER, TOWER_LOADS_ALONE, needs, references
from vlfast.models import build_reference, synthetic_inputs, tower_outputs
from vlfast.patching.gemm import is_patched, patch, unpatch

GRIDS = [(2, 4, 6), (1, 2, 2)]  # a two-temporal-patch video and a small image, one batch


def _run(tower, pixels, grid, *, backward=True, seed=3):
    """Outputs and gradients of one forward (and backward with fixed random cotangents)."""
    tower.zero_grad(set_to_none=True)
    x = pixels.detach().clone().requires_grad_(backward)
    out = tower_outputs(tower(x, grid_thw=grid))
    feats = [out["merged"], *out["deepstack"]]
    result = {"merged": out["merged"].detach(), "deepstack": [f.detach() for f in out["deepstack"]]}
    if backward:
        gen = torch.Generator().manual_seed(seed)
        loss = sum((f * torch.randn(f.shape, generator=gen).to(f.dtype)).sum() for f in feats)
        loss.backward()
        result["pixel_grad"] = x.grad
        result["param_grads"] = {
            n: p.grad.detach().clone() for n, p in tower.named_parameters() if p.grad is not None
        }
    return result


@pytest.mark.parametrize("name", references())
def test_reference_tower_forward_and_backward_match(name):
    tower = build_reference(name, tiny=True)
    pixels, grid = synthetic_inputs(tower, GRIDS)
    expected = _run(tower, pixels, grid)

    report = patch(tower, strict=True)
    assert any(e.name.endswith("patch_embed.proj") for e in report.patched), str(report)
    assert not report.skipped, str(report)
    actual = _run(tower, pixels, grid)

    assert_verbose_close(actual["merged"], expected["merged"], name=f"{name} merged")
    assert len(actual["deepstack"]) == len(expected["deepstack"])
    for i, (a, e) in enumerate(zip(actual["deepstack"], expected["deepstack"])):
        assert_verbose_close(a, e, name=f"{name} deepstack[{i}]")
    assert_verbose_close(actual["pixel_grad"], expected["pixel_grad"], name=f"{name} pixel grad")
    assert actual["param_grads"].keys() == expected["param_grads"].keys()
    for n, g in expected["param_grads"].items():
        assert_verbose_close(actual["param_grads"][n], g, name=f"{name} grad {n}")

    unpatch(tower)
    again = _run(tower, pixels, grid, backward=False)
    assert torch.equal(again["merged"], expected["merged"])  # unpatched: the stock kernel, bit for bit


@needs("qwen3_vl")
def test_qwen3_deepstack_features_are_compared():
    # Guard for the test above: the Qwen3 towers do return deepstack features to compare.
    tower = build_reference("qwen3-vl-4b", tiny=True)
    pixels, grid = synthetic_inputs(tower, GRIDS)
    assert len(_run(tower, pixels, grid, backward=False)["deepstack"]) == 2


@pytest.mark.parametrize("name", references())
def test_reference_tower_bf16(name):
    tower = build_reference(name, tiny=True, dtype=torch.bfloat16)
    pixels, grid = synthetic_inputs(tower, GRIDS, dtype=torch.bfloat16)
    with torch.inference_mode():
        expected = tower_outputs(tower(pixels, grid_thw=grid))
        patch(tower, strict=True)
        actual = tower_outputs(tower(pixels, grid_thw=grid))
    assert actual["merged"].dtype == torch.bfloat16
    for a, e in zip([actual["merged"], *actual["deepstack"]], [expected["merged"], *expected["deepstack"]]):
        assert cosine(a, e) >= 0.999, f"{name}: cosine {cosine(a, e):.6f}"
        assert_verbose_close(a, e, name=f"{name} bf16", dtype=torch.bfloat16)


_LOAD_STOCK = textwrap.dedent(
    """
    import sys, torch, transformers
    from safetensors.torch import load_file, save_file
    path, cls_name, module_name = sys.argv[1:4]
    cls = getattr(__import__(module_name, fromlist=[cls_name]), cls_name)
    tower = cls.from_pretrained(path).eval()
    inputs = load_file(path + "/inputs.safetensors")
    with torch.no_grad():
        out = tower(inputs["pixels"], grid_thw=inputs["grid"])
    merged = out if isinstance(out, torch.Tensor) else getattr(out, "pooler_output", None)
    if merged is None:
        merged = out[0]
    assert not any(m.startswith("vlfast") for m in sys.modules), "vlfast was imported"
    save_file({"merged": merged.contiguous()}, path + "/stock_out.safetensors")
    """
)


@TOWER_LOADS_ALONE
def test_save_pretrained_is_a_stock_checkpoint(tmp_path):
    from safetensors.torch import load_file, save_file

    tower = build_reference(TOWER, tiny=True)
    pixels, grid = synthetic_inputs(tower, GRIDS)
    with torch.no_grad():
        expected = tower_outputs(tower(pixels, grid_thw=grid))["merged"]
    tower.save_pretrained(tmp_path / "stock")
    patch(tower, strict=True)
    tower.save_pretrained(tmp_path / "patched")
    with torch.no_grad():
        patched_out = tower_outputs(tower(pixels, grid_thw=grid))["merged"]

    # The same files, byte for byte: nothing of vlfast reaches the checkpoint.
    for f in sorted(os.listdir(tmp_path / "stock")):
        assert (tmp_path / "patched" / f).read_bytes() == (tmp_path / "stock" / f).read_bytes(), f
    assert "vlfast" not in json.dumps(json.loads((tmp_path / "patched" / "config.json").read_text()))

    # A fresh object in this process: not patched, the stock outputs exactly.
    loaded = type(tower).from_pretrained(tmp_path / "patched").eval()
    assert not is_patched(loaded)
    with torch.no_grad():
        assert torch.equal(tower_outputs(loaded(pixels, grid_thw=grid))["merged"], expected)

    # A fresh process with transformers only.
    path = tmp_path / "patched"
    save_file({"pixels": pixels, "grid": grid}, str(path / "inputs.safetensors"))
    env = {k: v for k, v in os.environ.items() if k != "VLFAST_PATCH"}
    cls = type(tower)
    proc = subprocess.run(
        [sys.executable, "-c", _LOAD_STOCK, str(path), cls.__name__, cls.__module__],
        capture_output=True,
        text=True,
        env=env,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    stock_out = load_file(str(path / "stock_out.safetensors"))["merged"]
    assert torch.equal(stock_out, expected)
    assert_verbose_close(patched_out, stock_out, name="patched vs stock-loaded")


def _break_sites(tower, pixels, grid):
    torch._dynamo.reset()
    e = torch._dynamo.explain(tower)(pixels, grid_thw=grid)
    sites = sorted(
        (
            str(r.reason).split("\n")[0],
            tuple((os.path.basename(f.filename), f.lineno) for f in r.user_stack),
        )
        for r in e.break_reasons
    )
    return e.graph_count, e.graph_break_count, sites


# GLM's tower falls back to eager for the frame holding its Conv2d downsample (a data-dependent graph
# break in transformers' own code, patched or not). Called from an eager frame, the stock conv runs
# eagerly, while the patched one's GemmConvForward frame is compiled on its own: one more graph, at
# no new break site. Qwen towers call their convs from compiled frames: identical counts.
EXTRA_GRAPHS = {"qwen3-vl-4b": 0, "glm-4.1v-9b": 1}


@pytest.mark.parametrize("name", references(EXTRA_GRAPHS))
def test_compile_adds_no_graph_break_to_a_tower(name):
    tower = build_reference(name, tiny=True)
    pixels, grid = synthetic_inputs(tower, [(2, 4, 4)])
    stock_graphs, stock_breaks, stock_sites = _break_sites(tower, pixels, grid)
    patch(tower, strict=True)
    graphs, breaks, sites = _break_sites(tower, pixels, grid)
    torch._dynamo.reset()
    assert sites == stock_sites  # the same breaks, at the same places in user code
    extra = EXTRA_GRAPHS[name]
    assert (graphs, breaks) == (stock_graphs + extra, stock_breaks + extra)
