"""The GEMM is decided at each call, from the weight as it arrives, and what ran can be proven.

A weight that is not whole when ``patch`` runs (DeepSpeed ZeRO-3's empty parameter, FSDP's flat view, the
meta device) must not leave the conv on the stock path for good; ``is_patched``, the report and the repr
must not claim the GEMM for a conv that runs the stock one; a record counts what each call ran; convs
PEFT adds after ``patch_transformers`` are patched; a pickled patched model loads where vlfast is not
installed. The real stacks are in test_training_stacks.py; these are their in-process halves.
"""

from __future__ import annotations

import copy
import os
import pickle
import subprocess
import sys

import pytest
import torch
from torch import nn

import vlfast
from _patching_checks import ConvCount, assert_verbose_close
from _transformers_support import TOWER
from vlfast.models import build_reference, synthetic_inputs, tower_outputs
from vlfast.patching.gemm import is_patched, patch, patched_modules, unpatch
from vlfast.patching.integrations import patch_transformers, unpatch_transformers

K = (2, 4, 4)


def conv3d(d: int = 8) -> nn.Conv3d:
    torch.manual_seed(0)
    return nn.Conv3d(3, d, K, stride=K)


def windows(n: int = 6) -> torch.Tensor:
    return torch.randn(n, 3, *K, generator=torch.Generator().manual_seed(1))


def stock(conv: nn.Conv3d, x: torch.Tensor) -> torch.Tensor:
    return nn.Conv3d._conv_forward(conv, x, conv.weight, conv.bias)


# ------------------------------------------------------------------------------ the call-time decision


def test_a_weight_partitioned_at_patch_time_runs_the_gemm_once_whole():
    """ZeRO-3 between forwards: the parameter's data is an empty (0,) tensor; gathered for the call."""
    conv, x = conv3d(), windows()
    full = conv.weight.data
    conv.weight.data = torch.empty(0)
    report = patch(conv)
    assert report.num_patched == 1 and "partitioned" in report.entries[0].reason
    assert is_patched(conv) and repr(conv).endswith("vlfast=gemm)")
    conv.weight.data = full  # gathered
    counter = ConvCount()
    with vlfast.record_calls() as rec, counter:
        y = conv(x)
    assert counter.calls == 0 and rec.gemm_calls == 1 and rec.stock_calls == 0
    assert_verbose_close(y, stock(conv, x))
    conv.weight.data = torch.empty(0)  # released again between forwards, gathered again for the next
    conv.weight.data = full
    with ConvCount() as again:
        conv(x)
    assert again.calls == 0


def test_a_flat_view_at_patch_time_runs_the_gemm_once_viewed_back():
    """FSDP1 with use_orig_params: a 1-D view when patched after wrapping, the 5-D view at the call."""
    conv, x = conv3d(), windows()
    flat = conv.weight.data.flatten()
    conv.weight.data = flat
    patch(conv)
    conv.weight.data = flat.view(8, 3, *K)
    with ConvCount() as counter:
        y = conv(x)
    assert counter.calls == 0
    assert_verbose_close(y, stock(conv, x))


def test_a_meta_weight_is_not_an_error_and_decides_when_loaded():
    with torch.device("meta"):
        conv = nn.Conv3d(3, 8, K, stride=K)
    report = patch(conv)
    assert report.num_patched == 1 and "meta device" in report.entries[0].reason
    conv.to_empty(device="cpu")
    torch.nn.init.normal_(conv.weight)
    torch.nn.init.zeros_(conv.bias)
    with ConvCount() as counter:
        y = conv(windows())
    assert counter.calls == 0
    assert_verbose_close(y, stock(conv, windows()))


def test_a_weight_of_another_kernel_runs_the_stock_conv_and_the_record_says_why():
    conv = conv3d()
    patch(conv)
    conv.weight = nn.Parameter(torch.randn(8, 3, 1, 4, 4))  # swapped: another kernel
    conv.kernel_size = conv.stride = (1, 4, 4)  # the geometry follows, a new object: decided again
    x = torch.randn(2, 3, 1, 4, 4)
    with vlfast.record_calls() as rec:
        conv(x)
    assert rec.stock_calls == 0 and rec.gemm_calls == 1  # the new geometry is eligible: the new GEMM
    conv.weight = nn.Parameter(torch.randn(8, 3, 2, 4, 4))  # a weight that no longer fits the kernel
    with vlfast.record_calls() as rec, pytest.raises(RuntimeError):
        conv(x)  # the stock conv says what is wrong, as unpatched
    (entry,) = rec.convs()
    assert entry.gemm == 0 and list(entry.stock) == [
        "weight of shape (8, 3, 2, 4, 4) is not a (1, 4, 4) kernel"
    ]


def test_a_geometry_that_no_longer_fits_is_not_called_patched():
    conv = conv3d()
    report = patch(conv)
    conv.padding = (1, 1, 1)
    assert not is_patched(conv) and patched_modules(conv) == [("", conv)]
    assert repr(conv).endswith("vlfast=stock (padding (1, 1, 1) is not zero))")
    again = patch(conv)
    assert again.entries[0].status == "already_patched" and "stock conv: padding" in again.entries[0].reason
    with vlfast.record_calls() as rec:
        conv(windows())
    assert rec.gemm_calls == 0 and rec.convs()[0].stock == {"padding (1, 1, 1) is not zero": 1}
    conv.padding = (0, 0, 0)
    assert is_patched(conv) and repr(conv).endswith("vlfast=gemm)")
    assert report.num_patched == 1


# ------------------------------------------------------------------------------------------- records


def test_records_overlap_and_count_only_their_own_calls():
    conv, x = conv3d(), windows()
    patch(conv)
    outer = vlfast.record_calls()
    conv(x)
    with vlfast.record_calls() as inner:
        conv(x)
        conv(x[0])  # unbatched: the stock conv, by reason
    conv(x)
    outer.stop()
    conv(x)  # after both stopped: not counted
    assert (outer.gemm_calls, outer.stock_calls) == (3, 1)
    assert (inner.gemm_calls, inner.stock_calls) == (1, 1)
    assert inner.convs()[0].stock == {"unbatched input of shape (3, 2, 4, 4)": 1}
    assert not outer.running
    text = str(inner)
    assert "1 patched conv, 2 calls: 1 GEMM, 1 stock" in text and "one process" in text


def test_a_record_names_convs_in_the_model_and_keeps_the_counts_of_freed_ones():
    model = nn.Sequential(nn.Sequential(conv3d()))
    patch(model)
    with vlfast.record_calls() as rec:
        model(windows())
        del model  # freed before the record is read: its counts stay, under its name
    assert [(c.name, c.gemm) for c in rec.convs()] == [("0.0", 1)]


RECORD_SCRIPT = """
import torch, vlfast
conv = torch.nn.Conv3d(3, 8, (2, 4, 4), stride=(2, 4, 4))
vlfast.patch(conv)
conv(torch.randn(4, 3, 2, 4, 4)); conv(torch.randn(3, 2, 4, 4))
"""


def test_vlfast_record_prints_at_exit_and_appends_json(tmp_path):
    """VLFAST_RECORD is armed by the .pth at start-up, before torch is imported; the process says at exit
    what ran. A process that never loaded the patch (a launcher) says nothing."""
    target = tmp_path / "record.jsonl"
    env = {k: v for k, v in os.environ.items() if k not in ("VLFAST_PATCH", "RANK", "WORLD_SIZE")}
    env["VLFAST_RECORD"] = str(target)
    done = subprocess.run([sys.executable, "-c", RECORD_SCRIPT], env=env, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    assert "1 patched conv, 2 calls: 1 GEMM, 1 stock" in done.stderr
    assert "<root>: 1 GEMM, 1 stock (unbatched input of shape (3, 2, 4, 4))" in done.stderr
    (line,) = target.read_text().splitlines()
    assert '"gemm_calls": 1, "stock_calls": 1' in line and '"rank": null' in line
    silent = subprocess.run([sys.executable, "-c", "print(1)"], env=env, capture_output=True, text=True)
    assert silent.returncode == 0 and silent.stderr == "" and len(target.read_text().splitlines()) == 1


# ------------------------------------------------------------------------------ modules added later


@pytest.fixture
def transformers_switch():
    patch_transformers()
    yield
    unpatch_transformers()


def _tower():
    tower = build_reference(TOWER, tiny=True)
    return tower, *synthetic_inputs(tower, [(2, 4, 4)])


def _peft(tower, dora: bool):
    peft = pytest.importorskip("peft")
    torch.manual_seed(1)
    config = peft.LoraConfig(
        r=4, lora_alpha=8, target_modules=r".*patch_embed\.proj", init_lora_weights=False, use_dora=dora
    )
    return peft.get_peft_model(tower, config)


def _step(model, pixels, grid, lr: float = 0.5):
    """Output, gradients and trainable parameters after one SGD step (SGD: Adam would amplify round-off)."""
    model.zero_grad(set_to_none=True)
    out = tower_outputs(model(pixels, grid_thw=grid))["merged"]
    loss = out.square().mean()
    loss.backward()
    trainable = {n: p for n, p in model.named_parameters() if p.requires_grad}
    grads = {n: p.grad.clone() for n, p in trainable.items()}
    with torch.no_grad():
        for p in trainable.values():
            p -= lr * p.grad
    after = {f"{n} after a step": p.detach().clone() for n, p in trainable.items()}
    return torch.cat([out.detach().flatten(), loss.detach().view(1)]), grads | after


@pytest.mark.parametrize("dora", [False, True], ids=["lora", "dora"])
@pytest.mark.parametrize("order", ["patch_transformers-then-peft", "peft-then-patch"])
def test_peft_convs_run_the_gemm_in_either_order(order, dora, request):
    base, pixels, grid = _tower()
    expected_out, expected_grads = _step(_peft(copy.deepcopy(base), dora), pixels, grid)
    if order == "patch_transformers-then-peft":
        request.getfixturevalue("transformers_switch")
        tower, _, _ = _tower()  # built patched
        model = _peft(tower, dora)  # lora_A, lora_B: attached after the patch, patched as attached
    else:
        model = _peft(copy.deepcopy(base), dora)
        patch(model, strict=True)
    convs = {n for n, _ in patched_modules(model)}
    assert {n.rsplit("patch_embed.proj.", 1)[-1] for n in convs} == {
        "base_layer",
        "lora_A.default",
        "lora_B.default",
    }
    with vlfast.record_calls() as rec, ConvCount() as counter:
        out, grads = _step(model, pixels, grid)
    assert counter.calls == 0, f"{counter.calls} stock convolutions ran"
    assert rec.stock_calls == 0 and rec.gemm_calls == 3
    names = {c.name for c in rec.convs() if c.gemm}
    assert any(n.endswith("patch_embed.proj.lora_A.default") for n in names), names
    assert_verbose_close(out, expected_out, name="PEFT output")
    for n, g in expected_grads.items():
        assert_verbose_close(grads[n], g, name=f"grad {n}")


def test_patch_transformers_with_a_filter_leaves_later_convs_to_the_user():
    patch_transformers(filter="patch_embed")
    try:
        later = nn.Sequential()
        later.add_module("conv", conv3d())
        assert not is_patched(later)
    finally:
        unpatch_transformers()
    unfiltered = nn.Sequential()
    patch_transformers()
    try:
        unfiltered.add_module("conv", conv3d())
        unfiltered.add_module("conv2d", nn.Conv2d(3, 4, 2, stride=2))  # Conv3d only by default
        assert is_patched(unfiltered.conv) and not is_patched(unfiltered.conv2d)
    finally:
        unpatch_transformers()
    after = nn.Sequential()
    after.add_module("conv", conv3d())
    assert not is_patched(after)  # the hook went with unpatch_transformers


# ------------------------------------------------------------------------- checkpointing, compile


@pytest.mark.parametrize("reentrant", [True, False])
def test_gradient_checkpointing_recomputes_through_the_gemm(reentrant):
    from torch.utils.checkpoint import checkpoint

    conv = conv3d()
    x = windows().requires_grad_(True)
    ref = copy.deepcopy(conv)
    checkpoint(ref, x, use_reentrant=reentrant).square().sum().backward()
    expected = (x.grad.clone(), ref.weight.grad.clone())
    x.grad = None
    patch(conv)
    with vlfast.record_calls() as rec, ConvCount() as counter:
        checkpoint(conv, x, use_reentrant=reentrant).square().sum().backward()
    assert counter.calls == 0 and rec.gemm_calls == 2 and rec.stock_calls == 0  # forward, recompute
    assert_verbose_close(x.grad, expected[0], name="input grad")
    assert_verbose_close(conv.weight.grad, expected[1], name="weight grad")


def _compiled(model, pixels, grid) -> tuple[set[str], torch.Tensor, torch.Tensor]:
    """The ops dynamo traced for ``model``, its merged output and the patch embed's weight gradient."""
    graphs = []

    def backend(gm, example_inputs):
        graphs.append(gm)
        return gm.forward

    torch._dynamo.reset()
    model.zero_grad(set_to_none=True)
    try:
        out = tower_outputs(torch.compile(model, backend=backend)(pixels, grid_thw=grid))["merged"]
        out.square().mean().backward()
    finally:
        torch._dynamo.reset()
    ops = {str(node.target) for gm in graphs for node in gm.graph.nodes if node.op == "call_function"}
    return ops, out.detach(), model.patch_embed.proj.weight.grad.clone()


def test_torch_compile_traces_the_gemm_not_the_conv():
    tower, pixels, grid = _tower()
    stock_ops, stock_out, stock_grad = _compiled(tower, pixels, grid)
    assert any("conv3d" in op for op in stock_ops), "the control: the stock tower's graph holds the conv"
    patch(tower, strict=True)
    ops, out, grad = _compiled(tower, pixels, grid)
    assert not any("conv" in op for op in ops), sorted(op for op in ops if "conv" in op)
    assert any("linear" in op for op in ops)
    assert_verbose_close(out, stock_out, name="compiled output")
    assert_verbose_close(grad, stock_grad, name="compiled patch-embed weight gradient")


# ------------------------------------------------------------------------------------------- pickle

LOAD_WITHOUT_VLFAST = """
import os, sys
sys.path = [p for p in sys.path if not os.path.isdir(os.path.join(p or ".", "vlfast"))]  # not installed here
import importlib.util, torch
assert importlib.util.find_spec("vlfast") is None
model = torch.load({path!r}, weights_only={weights_only})
conv = model[0]
assert "vlfast" not in sys.modules and "_conv_forward" not in conv.__dict__, conv.__dict__.keys()
x = torch.randn(4, 3, 2, 4, 4, generator=torch.Generator().manual_seed(3))
torch.testing.assert_close(model(x), torch.load({expected!r}))
print("stock", repr(conv))
"""


@pytest.mark.parametrize("weights_only", [False, True])
def test_a_saved_patched_model_loads_as_the_stock_model_without_vlfast_and_with_it(tmp_path, weights_only):
    """torch.save writes the stock model's pickle: no vlfast name, no global beyond what the stock model
    needs, so torch.load(weights_only=True) takes it with the stock classes allowlisted, where vlfast is
    installed or not; it loads as the stock conv (nothing in the file may run vlfast's code)."""
    model = nn.Sequential(conv3d())
    patch(model)
    x = torch.randn(4, 3, 2, 4, 4, generator=torch.Generator().manual_seed(3))
    torch.save(model, tmp_path / "model.pt")
    torch.save(model(x).detach(), tmp_path / "expected.pt")
    assert b"vlfast" not in (tmp_path / "model.pt").read_bytes()
    script = LOAD_WITHOUT_VLFAST.format(
        path=str(tmp_path / "model.pt"), expected=str(tmp_path / "expected.pt"), weights_only=weights_only
    )
    if weights_only:
        script = script.replace(
            "model = torch.load(",
            "torch.serialization.add_safe_globals([torch.nn.Sequential, torch.nn.Conv3d])\nmodel = torch.load(",
        )
    env = {k: v for k, v in os.environ.items() if k not in ("VLFAST_PATCH", "VLFAST_RECORD")}
    done = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.strip() == "stock Conv3d(3, 8, kernel_size=(2, 4, 4), stride=(2, 4, 4))"
    with torch.serialization.safe_globals([nn.Sequential, nn.Conv3d]):
        loaded = torch.load(tmp_path / "model.pt", weights_only=weights_only)  # vlfast here: stock too
    assert not patched_modules(loaded) and repr(loaded[0]) == repr(conv3d())
    assert_verbose_close(loaded(x), model(x))
    patch(loaded)  # patched again, as any stock model
    with ConvCount() as counter:
        assert torch.equal(loaded(x), model(x))
    assert counter.calls == 0
    copied = pickle.loads(pickle.dumps(model))
    copied[0].padding = (1, 1, 1)  # a pickle copy is the stock conv; a deepcopy watches its own geometry
    deep = copy.deepcopy(model)
    deep[0].padding = (1, 1, 1)
    assert is_patched(model) and not is_patched(copied) and not is_patched(deep) and patched_modules(deep)


def test_unpatch_after_a_reload_restores_the_stock_conv(tmp_path):
    model = nn.Sequential(conv3d())
    patch(model)
    torch.save(model, tmp_path / "m.pt")
    loaded = torch.load(tmp_path / "m.pt", weights_only=False)
    unpatch(loaded)
    assert not patched_modules(loaded) and set(loaded[0].__dict__) == set(conv3d().__dict__)
