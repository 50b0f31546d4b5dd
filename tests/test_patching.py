"""The exact GEMM patch on single convolutions: eligibility, equivalence, what it leaves alone, the API.

Every claim of the patch is checked against the stock conv it replaces: same values (per-dtype tolerance,
worst element printed), same dtype, same strides, same gradients, and for the Qwen-shaped call the
absence of any conv or copy kernel, observed at the dispatcher.
"""

from __future__ import annotations

import copy
import json
import pickle

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

import vlfast
from _patching_checks import assert_verbose_close
from vlfast.patching.gemm import GemmConvForward, eligibility, is_patched, patch, patched_modules, unpatch

CONV = {1: nn.Conv1d, 2: nn.Conv2d, 3: nn.Conv3d}
CHANNELS_LAST = {2: torch.channels_last, 3: torch.channels_last_3d}
DTYPES = [torch.float32, torch.bfloat16, torch.float16]

# (kernel, input spatial size): odd kernels; inputs of one window (the fast path) and larger, with a
# remainder the conv skips.
GEOMETRIES = [
    ((3,), (3,)),
    ((3,), (11,)),
    ((3, 5), (3, 5)),
    ((3, 5), (10, 17)),
    ((2, 3, 5), (2, 3, 5)),
    ((2, 3, 5), (5, 7, 11)),
]


def _geometry_id(g) -> str:
    kernel, size = g
    return f"{len(kernel)}d-k{'x'.join(map(str, kernel))}-in{'x'.join(map(str, size))}"


def make_conv(kernel, *, c_in=3, c_out=6, bias=True, dtype=torch.float32, seed=0, **kw) -> nn.Module:
    torch.manual_seed(seed)
    kw.setdefault("stride", kernel)
    return CONV[len(kernel)](c_in, c_out, kernel, bias=bias, **kw).to(dtype)


def make_input(n, c, size, *, dtype=torch.float32, channels_last=False, seed=1) -> torch.Tensor:
    x = torch.randn(n, c, *size, generator=torch.Generator().manual_seed(seed)).to(dtype)
    if not channels_last:
        return x
    if (
        len(size) == 1
    ):  # no channels-last format for 1-D: the same idea, an (N, L, C) buffer seen as (N, C, L)
        return x.transpose(1, 2).contiguous().transpose(1, 2)
    return x.contiguous(memory_format=CHANNELS_LAST[len(size)])


def stock(conv: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """The conv's own answer, whatever its patch state."""
    return type(conv)._conv_forward(conv, x, conv.weight, conv.bias)


def strides_of(t: torch.Tensor) -> tuple[tuple[int, int], ...]:
    """Strides of the dimensions that have any (a size-1 dimension's stride is arbitrary)."""
    return tuple((i, st) for i, (n, st) in enumerate(zip(t.shape, t.stride())) if n != 1)


def run_stock(conv, x):
    try:
        return stock(conv, x)
    except RuntimeError as e:  # e.g. a CPU kernel missing for fp16: nothing to compare against
        pytest.skip(f"the stock {type(conv).__name__} itself fails for this input: {e}")


class OpLog(TorchDispatchMode):
    """Records every aten op and the storages of its tensor arguments."""

    def __init__(self):
        super().__init__()
        self.calls = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        ptrs = [a.untyped_storage().data_ptr() for a in args if isinstance(a, torch.Tensor)]
        self.calls.append((func.overloadpacket.__name__, ptrs))
        return func(*args, **kwargs)

    @property
    def names(self) -> list[str]:
        return [name for name, _ in self.calls]


COPY_OPS = {"clone", "copy_", "_to_copy", "contiguous", "_unsafe_view", "cat", "im2col", "col2im"}


def _is_conv_op(name: str) -> bool:
    return "conv" in name or "slow_conv" in name or name == "mkldnn_convolution"


# ------------------------------------------------------------------------------------ equivalence


@pytest.mark.parametrize("geometry", GEOMETRIES, ids=_geometry_id)
@pytest.mark.parametrize("bias", [True, False], ids=["bias", "nobias"])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("layout", ["contiguous", "channels_last"])
def test_forward_matches_conv(geometry, bias, dtype, layout):
    kernel, size = geometry
    conv = make_conv(kernel, bias=bias, dtype=dtype)
    x = make_input(4, 3, size, dtype=dtype, channels_last=layout == "channels_last")
    expected = run_stock(conv, x)
    assert patch(conv).num_patched == 1
    actual = conv(x)
    assert actual.dtype == expected.dtype
    assert actual.shape == expected.shape
    # Same memory format as the conv: the very same strides (where a dimension has more than one element).
    assert strides_of(actual) == strides_of(expected), (actual.stride(), expected.stride())
    assert_verbose_close(actual, expected, name=f"{layout} {dtype} output")


@pytest.mark.parametrize("geometry", GEOMETRIES, ids=_geometry_id)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("layout", ["contiguous", "channels_last"])
def test_gradients_match_conv(geometry, dtype, layout):
    kernel, size = geometry
    conv = make_conv(kernel, dtype=dtype)
    x0 = make_input(3, 3, size, dtype=dtype, channels_last=layout == "channels_last")

    def grads():
        conv.zero_grad(set_to_none=True)
        x = x0.detach().clone(memory_format=torch.preserve_format).requires_grad_(True)
        y = conv(x)
        gy = torch.randn(y.shape, generator=torch.Generator().manual_seed(2)).to(dtype)
        y.backward(gy)
        return y.detach(), x.grad, conv.weight.grad, conv.bias.grad

    expected = grads()
    patch(conv)
    actual = grads()
    for label, a, e in zip(("output", "input grad", "weight grad", "bias grad"), actual, expected):
        assert a.dtype == e.dtype
        assert_verbose_close(a, e, name=f"{label} ({dtype}, {layout})")
    assert strides_of(actual[1]) == strides_of(expected[1])  # the input's gradient keeps the input's layout


def test_weight_channels_last_keeps_the_conv_memory_format():
    # model.to(memory_format=channels_last) turns 4-D/5-D weights channels-last; the conv then answers
    # channels-last even for a contiguous input, and so must the patch.
    for kernel, size in [((3, 5), (10, 17)), ((2, 3, 5), (5, 7, 11)), ((2, 3, 5), (2, 3, 5))]:
        conv = make_conv(kernel).to(memory_format=CHANNELS_LAST[len(kernel)])
        x = make_input(2, 3, size)
        expected = stock(conv, x)
        patch(conv)
        actual = conv(x)
        assert strides_of(actual) == strides_of(expected)
        assert_verbose_close(actual, expected, name=f"{len(kernel)}d weight channels-last")


def test_crop_matches_the_conv_exactly():
    # Only the remainder past the last full window is dropped: perturbing it changes nothing, perturbing
    # the last full window changes the last output.
    conv = make_conv((2, 3, 5))
    patch(conv)
    x = make_input(1, 3, (5, 7, 11))
    base = conv(x)
    assert base.shape == (1, 6, 2, 2, 2)
    tail = x.clone()
    tail[:, :, 4:, :, :] += 100.0
    tail[:, :, :, 6:, :] += 100.0
    tail[:, :, :, :, 10:] += 100.0
    assert torch.equal(conv(tail), base)
    last = x.clone()
    last[:, :, 3, 5, 9] += 1.0
    changed = (conv(last) != base).any(dim=1)
    assert changed[0, 1, 1, 1] and changed.sum() == 1


# ------------------------------------------------------------------------ the Qwen call, op by op


def qwen_embed(c_out=32, patch_size=16, temporal=2):
    torch.manual_seed(0)
    k = (temporal, patch_size, patch_size)
    return nn.Conv3d(3, c_out, k, stride=k, bias=True)


def test_qwen_case_is_one_linear_on_views_no_conv_no_copy():
    conv = qwen_embed()
    pixels = torch.randn(10, 3 * 2 * 16 * 16)  # (N, C*T*P*P): pixel_values as the processor makes them
    expected = stock(conv, pixels.view(-1, 3, 2, 16, 16)).view(-1, 32)
    patch(conv)
    with torch.no_grad(), OpLog() as log:
        out = conv(pixels.view(-1, 3, 2, 16, 16)).view(-1, 32)
    assert_verbose_close(out, expected, name="qwen patch embed")
    names = log.names
    assert not [n for n in names if _is_conv_op(n)], names
    assert not COPY_OPS & set(names), names
    gemms = [(n, ptrs) for n, ptrs in log.calls if n in ("addmm", "mm", "linear", "matmul")]
    assert len(gemms) == 1, names
    # The GEMM reads the caller's pixel buffer and the parameter's own storage: views, not copies.
    ptrs = gemms[0][1]
    assert pixels.untyped_storage().data_ptr() in ptrs
    assert conv.weight.untyped_storage().data_ptr() in ptrs


def test_qwen_case_backward_has_no_conv():
    conv = qwen_embed()
    patch(conv)
    pixels = torch.randn(6, 3 * 2 * 16 * 16, requires_grad=True)
    with OpLog() as log:
        conv(pixels.view(-1, 3, 2, 16, 16)).view(-1, 32).square().sum().backward()
    assert not [n for n in log.names if _is_conv_op(n)], log.names
    assert pixels.grad is not None and conv.weight.grad.shape == conv.weight.shape


def test_qwen_case_channels_last_reads_the_input_in_place():
    conv = qwen_embed()
    x = torch.randn(5, 3, 2, 16, 16).contiguous(memory_format=torch.channels_last_3d)
    expected = stock(conv, x)
    patch(conv)
    with torch.no_grad(), OpLog() as log:
        out = conv(x)
    assert not [n for n in log.names if _is_conv_op(n)], log.names
    gemm = next(ptrs for n, ptrs in log.calls if n in ("addmm", "mm"))
    assert x.untyped_storage().data_ptr() in gemm  # only the (small) weight is reordered
    assert strides_of(out) == strides_of(expected)
    assert_verbose_close(out, expected, name="channels-last qwen")


def test_larger_input_is_one_batched_gemm_without_conv():
    conv = make_conv((2, 3, 5))
    patch(conv)
    with torch.no_grad(), OpLog() as log:
        conv(make_input(2, 3, (5, 7, 11)))
    assert not [n for n in log.names if _is_conv_op(n)], log.names
    assert sum(n in ("bmm", "mm", "matmul", "addmm", "baddbmm") for n in log.names) == 1, log.names


# ------------------------------------------------------------------------------------- fallbacks


def _conv_ran(conv, x) -> bool:
    with torch.no_grad(), OpLog() as log:
        conv(x)
    return any(_is_conv_op(n) for n in log.names)


@pytest.mark.parametrize("nd", [1, 2, 3])
def test_unbatched_input_falls_back_to_the_conv(nd):
    kernel, size = GEOMETRIES[2 * nd - 1]
    conv = make_conv(kernel)
    x = make_input(1, 3, size)[0]  # (C, *spatial)
    expected = stock(conv, x)
    patch(conv)
    assert torch.equal(conv(x), expected)
    assert _conv_ran(conv, x)


def test_odd_strides_fall_back_to_the_conv():
    conv = make_conv((2, 3, 5))
    patch(conv)
    for x in (
        make_input(2, 3, (2, 3, 10))[..., ::2],  # every other column: neither layout
        make_input(2, 3, (5, 7, 22))[..., ::2],
    ):
        assert not x.is_contiguous()
        assert torch.equal(conv(x), stock(conv, x))
        assert _conv_ran(conv, x)


def test_too_small_input_raises_the_conv_own_error():
    conv = make_conv((2, 3, 5))
    x = make_input(2, 3, (2, 3, 4))
    with pytest.raises(RuntimeError) as stock_error:
        stock(conv, x)
    patch(conv)
    with pytest.raises(RuntimeError) as patched_error:
        conv(x)
    assert str(patched_error.value) == str(stock_error.value)


@pytest.mark.parametrize("size", [(2, 3, 5), (4, 6, 10)], ids=["one-window", "larger"])
def test_a_bias_of_another_dtype_raises_as_the_conv_does(size):
    """nn.Conv3d refuses a float64 bias with a float32 weight and input; the GEMM must not cast it."""
    conv = make_conv((2, 3, 5))
    conv.bias.data = conv.bias.data.double()
    x = make_input(2, 3, size)
    with pytest.raises(RuntimeError) as stock_error:
        conv(x)
    patch(conv)
    with pytest.raises(RuntimeError) as patched_error:
        conv(x)
    assert str(patched_error.value) == str(stock_error.value)


def test_empty_batch_matches_the_conv():
    conv = make_conv((3, 5))
    x = make_input(0, 3, (3, 5))
    expected = stock(conv, x)
    patch(conv)
    assert conv(x).shape == expected.shape


# ------------------------------------------------------------- geometry changed after patching
# A patched conv whose stride, padding, dilation, groups or weight kernel changes afterwards must compute
# the new operation (through the stock conv when it is no longer a stride == kernel GEMM), never the old.

_CHANGES = {
    "padding": lambda conv: setattr(conv, "padding", (1,) * len(conv.kernel_size)),
    "padding-same": lambda conv: setattr(conv, "padding", "same") or setattr(conv, "stride", (1,) * 3),
    "stride": lambda conv: setattr(conv, "stride", (1,) * len(conv.kernel_size)),
    "dilation": lambda conv: setattr(conv, "dilation", (2,) * len(conv.kernel_size)),
    "groups": lambda conv: (
        setattr(conv, "groups", 3),
        setattr(conv, "weight", nn.Parameter(conv.weight.detach()[:, :1].clone())),
    ),
    "weight-kernel": lambda conv: setattr(
        conv, "weight", nn.Parameter(conv.weight.detach().reshape(6, 3, 1, 6, 5).clone())
    ),
}


@pytest.mark.parametrize("change", list(_CHANGES))
@pytest.mark.parametrize("size", [(2, 3, 5), (6, 9, 10)], ids=["one-window", "larger"])
# torch's own note on the padding="same" case (an even kernel needs a padded copy): expected here
@pytest.mark.filterwarnings("ignore:Using padding='same' with even kernel lengths:UserWarning")
def test_changed_geometry_runs_the_new_operation(change, size):
    conv = make_conv((2, 3, 5))
    patch(conv)
    x = make_input(2, 3, size)
    conv(x)  # patched and used before the change
    _CHANGES[change](conv)
    try:
        expected = stock(conv, x)
    except RuntimeError as e:  # the new operation does not fit this input: the patched conv says so too
        with pytest.raises(RuntimeError) as patched_error:
            conv(x)
        assert str(patched_error.value) == str(e)
        return
    actual = conv(x)
    assert actual.shape == expected.shape
    assert_verbose_close(actual, expected, name=f"after changing {change}")
    assert _conv_ran(conv, x)
    # Still carrying the patch (unpatch restores it as ever), but neither is_patched nor the repr may
    # claim the GEMM for a conv whose calls run the stock conv: they say why instead.
    assert patched_modules(conv) == [("", conv)]
    assert not is_patched(conv) and "vlfast=stock (" in repr(conv)


@pytest.mark.parametrize("attr", ["padding", "stride"])
def test_changed_geometry_in_gradients(attr):
    conv = make_conv((3, 5))
    patch(conv)
    setattr(conv, attr, (1, 1))
    x = make_input(2, 3, (6, 10)).requires_grad_()
    conv(x).sum().backward()
    expected_x = x.grad.clone()
    expected_w = conv.weight.grad.clone()
    x.grad = conv.weight.grad = None
    stock(conv, x).sum().backward()
    assert_verbose_close(expected_x, x.grad, name="input grad")
    assert_verbose_close(expected_w, conv.weight.grad, name="weight grad")


def _circular_with_padding_set_to_zero() -> nn.Module:
    conv = make_conv((2, 3, 5), padding=1, padding_mode="circular")
    conv.padding = (0, 0, 0)  # the stock conv still pads: by _reversed_padding_repeated_twice
    return conv


def test_padding_mode_is_read_as_the_stock_conv_reads_it_at_patch_time():
    conv = _circular_with_padding_set_to_zero()
    x = make_input(2, 3, (2, 3, 5))
    expected = stock(conv, x)
    assert expected.shape == (2, 6, 2, 1, 1)  # (4, 5, 7) padded, where the GEMM gives (1, 1, 1)
    report = patch(conv)
    assert report.num_patched == 0
    assert report.entries[0].reason == "padding_mode='circular' pads by (1, 1, 1, 1, 1, 1)"
    assert torch.equal(conv(x), expected)


_PADDING_MODE_CHANGES = {
    # built padded by 1, padding then set to 0 (eligible); the mode that makes the stock conv pad again
    "padding_mode": lambda conv: setattr(conv, "padding_mode", "circular"),
    # built circular with padding 0 (eligible, F.pad by 0); the padding F.pad reads set afterwards
    "reversed-padding": lambda conv: setattr(conv, "_reversed_padding_repeated_twice", (1,) * 6),
}


@pytest.mark.parametrize("change", list(_PADDING_MODE_CHANGES))
def test_padding_mode_is_read_as_the_stock_conv_reads_it_at_call_time(change):
    if change == "padding_mode":
        conv = make_conv((2, 3, 5), padding=1)
        conv.padding = (0, 0, 0)
    else:
        conv = make_conv((2, 3, 5), padding_mode="circular")
    x = make_input(2, 3, (2, 3, 5))
    assert patch(conv).num_patched == 1
    conv(x)  # the GEMM, before the change
    _PADDING_MODE_CHANGES[change](conv)
    expected = stock(conv, x)
    with vlfast.record_calls() as rec:
        actual = conv(x)
    assert actual.shape == expected.shape == (2, 6, 2, 1, 1)
    assert torch.equal(actual, expected)
    assert rec.gemm_calls == 0
    assert rec.convs()[0].stock == {"padding_mode='circular' pads by (1, 1, 1, 1, 1, 1)": 1}
    assert not is_patched(conv) and "vlfast=stock (padding_mode='circular'" in repr(conv)


def test_geometry_changed_back_returns_to_the_gemm():
    conv = make_conv((2, 3, 5))
    patch(conv)
    x = make_input(2, 3, (2, 3, 5))
    conv.padding = (1, 1, 1)
    assert _conv_ran(conv, x)
    conv.padding = (0, 0, 0)  # a new tuple: decided again, eligible again
    assert not _conv_ran(conv, x)
    conv.stride = (2, 3, 5)  # equal values in a new object: still the GEMM
    assert not _conv_ran(conv, x)
    assert torch.equal(
        conv(x), F.linear(x.reshape(2, -1), conv.weight.reshape(6, -1), conv.bias).view(2, 6, 1, 1, 1)
    )


def test_geometry_in_a_list_changed_in_place_is_seen():
    conv = make_conv((3, 5))
    conv.padding = [0, 0]  # a list can change without a new object: checked on every call
    patch(conv)
    x = make_input(2, 3, (6, 10))
    assert not _conv_ran(conv, x)
    conv.padding[1] = 2
    assert_verbose_close(conv(x), stock(conv, x), name="list padding changed in place")
    assert conv(x).shape == stock(conv, x).shape


@pytest.mark.parametrize(
    "clone", [copy.deepcopy, lambda m: pickle.loads(pickle.dumps(m))], ids=["deepcopy", "pickle"]
)
def test_copies_watch_their_own_geometry(clone):
    model = nn.Sequential(make_conv((2, 3, 5)))
    patch(model)
    copied = clone(model)
    copied[0].padding = (1, 1, 1)
    x = make_input(2, 3, (2, 3, 5))
    assert copied[0](x).shape == stock(copied[0], x).shape == (2, 6, 2, 1, 1)
    assert model[0](x).shape == (2, 6, 1, 1, 1)  # the original is untouched and still the GEMM
    assert not _conv_ran(model[0], x)


def test_a_shallow_copy_watches_its_own_geometry():
    """copy.copy shares the module's __dict__ values: the copy must still get a GemmConvForward of its own."""
    conv = make_conv((2, 3, 5))
    patch(conv)
    copied = copy.copy(conv)
    assert is_patched(copied) and copied.weight is conv.weight  # shallow: the parameters are shared
    assert copied._conv_forward is not conv._conv_forward and "vlfast=gemm" in repr(copied)
    copied.padding = (1, 1, 1)
    x = make_input(2, 3, (2, 3, 5))
    assert copied(x).shape == stock(copied, x).shape == (2, 6, 2, 1, 1)
    assert_verbose_close(copied(x), stock(copied, x), name="shallow copy with its own padding")
    assert conv(x).shape == (2, 6, 1, 1, 1)  # the original is untouched and still the GEMM
    assert not _conv_ran(conv, x)
    unpatch(copied)
    assert is_patched(conv) and not is_patched(copied)
    assert not is_patched(copy.copy(copied))  # a copy of an unpatched conv is a plain copy


def test_deleting_a_patched_model_frees_it_without_the_garbage_collector():
    import gc
    import weakref

    model = nn.Sequential(make_conv((2, 3, 5)))
    patch(model)
    model(make_input(2, 3, (2, 3, 5)))
    alive = weakref.ref(model[0].weight)
    gc.disable()
    try:
        del model
        assert alive() is None, "the patch holds its module in a reference cycle: its memory waits for gc"
    finally:
        gc.enable()


def test_changed_geometry_under_compile_recompiles():
    conv = make_conv((2, 3, 5))
    patch(conv)
    x = make_input(2, 3, (2, 3, 5))
    torch._dynamo.reset()
    compiled = torch.compile(conv, backend="aot_eager", fullgraph=True)
    assert compiled(x).shape == (2, 6, 1, 1, 1)
    conv.padding = (1, 1, 1)
    assert_verbose_close(compiled(x), stock(conv, x), name="compiled after a padding change")
    torch._dynamo.reset()


def test_a_standalone_replacement_refuses_a_weight_of_another_kernel():
    f = GemmConvForward((2, 3, 5))
    with pytest.raises(
        ValueError, match=r"weight of shape \(6, 3, 1, 6, 5\); its kernel must be \(2, 3, 5\)"
    ):
        f(make_input(2, 3, (2, 3, 5)), torch.randn(6, 3, 1, 6, 5), None)


# ---------------------------------------------------------------------------------- eligibility


class PlainSubclass(nn.Conv3d):
    pass


class OverridingSubclass(nn.Conv3d):
    def _conv_forward(self, input, weight, bias):
        return super()._conv_forward(input, weight * 2, bias)


ELIGIBLE = {
    "conv1d": lambda: nn.Conv1d(3, 4, 5, stride=5),
    "conv2d": lambda: nn.Conv2d(3, 4, (2, 3), stride=(2, 3)),
    "conv3d": lambda: nn.Conv3d(3, 4, (2, 4, 4), stride=(2, 4, 4)),
    "valid padding": lambda: nn.Conv2d(3, 4, 2, stride=2, padding="valid"),
    "no bias": lambda: nn.Conv2d(3, 4, 2, stride=2, bias=False),
    "reflect, zero padding": lambda: nn.Conv2d(3, 4, 2, stride=2, padding_mode="reflect"),
    "subclass": lambda: PlainSubclass(3, 4, 2, stride=2),
    "1x1": lambda: nn.Conv2d(3, 4, 1),
}

INELIGIBLE = {
    "stride": (lambda: nn.Conv2d(3, 4, 3, stride=2), "stride (2, 2) != kernel_size (3, 3)"),
    "stride 1": (lambda: nn.Conv3d(3, 4, 2), "stride (1, 1, 1) != kernel_size (2, 2, 2)"),
    "padding": (lambda: nn.Conv2d(3, 4, 2, stride=2, padding=1), "padding (1, 1) is not zero"),
    "same": (lambda: nn.Conv1d(3, 4, 1, padding="same"), "padding='same'"),
    "dilation": (lambda: nn.Conv2d(3, 4, 2, stride=2, dilation=2), "dilation (2, 2) is not 1"),
    "groups": (lambda: nn.Conv2d(3, 6, 2, stride=2, groups=3), "groups=3"),
    "override": (lambda: OverridingSubclass(3, 4, 2, stride=2), "OverridingSubclass overrides _conv_forward"),
    "lazy": (lambda: nn.LazyConv3d(4, 2, stride=2), "lazy module not initialised yet"),
    "transposed": (lambda: nn.ConvTranspose2d(3, 4, 2, stride=2), "transposed convolution"),
}


@pytest.mark.parametrize("make", ELIGIBLE.values(), ids=ELIGIBLE.keys())
def test_eligible_modules_are_patched_and_exact(make):
    conv = make()
    cls = type(conv)
    assert eligibility(conv) is None
    x = torch.randn(2, 3, *[2 * k + 1 for k in conv.kernel_size])
    expected = stock(conv, x)
    report = patch(conv)
    assert [e.status for e in report.entries] == ["patched"]
    assert type(conv) is cls and is_patched(conv)
    assert_verbose_close(conv(x), expected)


@pytest.mark.parametrize("make,reason", INELIGIBLE.values(), ids=INELIGIBLE.keys())
def test_ineligible_modules_are_untouched_and_reported_with_the_reason(make, reason):
    conv = make()
    model = nn.Sequential(conv)
    before = dict(conv.__dict__)
    assert eligibility(conv) == reason
    report = patch(model)
    assert [(e.name, e.status, e.reason) for e in report.entries] == [("0", "skipped", reason)]
    assert reason in str(report)
    assert conv.__dict__ == before and not is_patched(model)
    assert not report and report.num_patched == 0
    with pytest.raises(ValueError, match="nothing was patched.*" + reason.split(" ")[0]):
        patch(model, strict=True)


def test_lazy_conv_is_patched_once_initialised():
    conv = nn.LazyConv3d(4, 2, stride=2)
    assert patch(conv).skipped
    conv(torch.randn(1, 3, 4, 4, 4))  # materialises: now a plain Conv3d
    assert patch(conv).num_patched == 1
    x = torch.randn(2, 3, 4, 6, 6)
    assert_verbose_close(conv(x), stock(conv, x))


def test_someone_elses_instance_forward_is_left_alone():
    conv = nn.Conv2d(3, 4, 2, stride=2)
    theirs = conv._conv_forward  # e.g. another library's bound replacement
    conv._conv_forward = theirs
    report = patch(conv)
    assert report.entries[0].status == "skipped" and "someone else" in report.entries[0].reason
    assert conv.__dict__["_conv_forward"] is theirs


def test_non_conv_modules_are_not_reported():
    model = nn.Sequential(nn.Linear(3, 4), nn.Conv2d(3, 4, 2, stride=2), nn.ReLU())
    report = patch(model)
    assert [(e.name, e.kind, e.status) for e in report.entries] == [("1", "Conv2d", "patched")]
    assert eligibility(model[0]) == "not a Conv1d/Conv2d/Conv3d"


# --------------------------------------------------------------------------- API and bad input


def mixed_model() -> nn.Module:
    torch.manual_seed(0)
    return nn.ModuleDict(
        {
            "embed": nn.Conv3d(3, 8, (2, 4, 4), stride=(2, 4, 4)),
            "down": nn.Conv2d(8, 8, 2, stride=2),
            "smooth": nn.Conv2d(8, 8, 3, padding=1),
            "head": nn.Linear(8, 2),
        }
    )


def test_report_lists_every_conv_and_renders():
    report = patch(mixed_model())
    assert [(e.name, e.status) for e in report.entries] == [
        ("embed", "patched"),
        ("down", "patched"),
        ("smooth", "skipped"),
    ]
    assert report.num_patched == 2 and bool(report)
    assert report.summary() == "2 patched, 1 skipped"
    text = str(report)
    assert "smooth" in text and "stride (1, 1) != kernel_size (3, 3)" in text
    data = json.loads(json.dumps(report.to_dict()))
    assert data["patched"] == 2 and data["skipped"] == 1
    assert data["entries"][0] == {
        "name": "embed",
        "kind": "Conv3d",
        "in_channels": 3,
        "out_channels": 8,
        "kernel_size": [2, 4, 4],
        "stride": [2, 4, 4],
        "status": "patched",
        "reason": "",
    }


def test_patch_is_idempotent():
    model = mixed_model()
    first = patch(model)
    forwards = {n: m.__dict__["_conv_forward"] for n, m in patched_modules(model)}
    second = patch(model)
    assert [e.status for e in second.entries] == ["already_patched", "already_patched", "skipped"]
    assert second.num_patched == 0 and bool(second)  # nothing new, but the model is patched
    assert second.summary() == "0 patched, 2 already patched, 1 skipped"
    assert {n: m.__dict__["_conv_forward"] for n, m in patched_modules(model)} == forwards
    assert all(forwards[n] is m.__dict__["_conv_forward"] for n, m in patched_modules(model))
    assert repr(model).count("vlfast=gemm") == first.num_patched == 2
    patch(model, strict=True)  # already patched counts as patched: no error


def test_filter_by_regex_and_callable():
    assert [e.status for e in patch(mixed_model(), filter=r"^embed$").entries] == [
        "patched",
        "filtered",
        "filtered",
    ]
    report = patch(mixed_model(), filter=lambda name, m: isinstance(m, nn.Conv2d))
    assert [e.status for e in report.entries] == ["filtered", "patched", "skipped"]
    assert report.entries[0].reason == "excluded by filter"
    with pytest.raises(ValueError, match="nothing was patched"):
        patch(mixed_model(), filter="nothing-matches", strict=True)


def test_bad_filters_raise_clearly():
    with pytest.raises(ValueError, match="not a valid regular expression"):
        patch(mixed_model(), filter="embed(")
    with pytest.raises(TypeError, match="filter must be a callable"):
        patch(mixed_model(), filter=3)


def test_a_failing_filter_leaves_nothing_half_patched():
    model = mixed_model()

    def fussy(name, m):
        if name == "down":
            raise RuntimeError("boom")
        return True

    with pytest.raises(RuntimeError, match="boom"):
        patch(model, filter=fussy)
    assert not is_patched(model)  # "embed" came first and was eligible, yet nothing changed


def test_strict_failure_changes_nothing():
    model = nn.Sequential(nn.Conv2d(3, 4, 3), nn.Linear(2, 2))
    with pytest.raises(ValueError, match=r"nothing was patched \(0: stride"):
        patch(model, strict=True)
    with pytest.raises(ValueError, match="the model has no Conv1d/2d/3d"):
        patch(nn.Linear(2, 2), strict=True)
    assert not is_patched(model)


def test_nothing_eligible_gives_an_empty_report():
    report = patch(nn.Sequential(nn.Linear(2, 2)))
    assert report.entries == [] and not report
    assert report.summary() == "no convolutions found"


@pytest.mark.parametrize("bad", ["Qwen/Qwen3-VL-4B-Instruct", {"model": 1}, None, torch.zeros(2)])
def test_not_a_module_raises_type_error(bad):
    with pytest.raises(TypeError, match="expects a torch.nn.Module"):
        patch(bad)
    with pytest.raises(TypeError, match="expects a torch.nn.Module"):
        unpatch(bad)


def test_unpatch_restores_the_original_exactly():
    model = mixed_model()
    x = torch.randn(2, 3, 4, 8, 8)
    before_dicts = {n: dict(m.__dict__) for n, m in model.named_modules()}
    before_repr = repr(model)
    expected = model["embed"](x)
    patch(model)
    assert is_patched(model) and repr(model) != before_repr
    report = unpatch(model)
    assert [(e.name, e.status) for e in report.entries] == [("embed", "unpatched"), ("down", "unpatched")]
    assert not is_patched(model)
    assert {n: dict(m.__dict__) for n, m in model.named_modules()} == before_dicts
    assert repr(model) == before_repr
    assert torch.equal(model["embed"](x), expected)  # the stock kernel again: bit for bit
    assert unpatch(model).entries == []  # and again: nothing to do


def test_public_names():
    assert vlfast.patch is patch and vlfast.unpatch is unpatch and vlfast.is_patched is is_patched
    assert vlfast.PatchReport is type(patch(nn.Linear(1, 1)))


# ------------------------------------------------------------------ the module stays the module


def test_class_parameters_and_state_dict_are_untouched():
    model = mixed_model()
    params = {n: p for n, p in model.named_parameters()}
    sd_before = {k: (v.shape, v.dtype, v.clone()) for k, v in model.state_dict().items()}
    classes = {n: type(m) for n, m in model.named_modules()}
    patch(model)
    assert {n: type(m) for n, m in model.named_modules()} == classes
    assert isinstance(model["embed"], nn.Conv3d) and model["embed"].weight.dim() == 5
    assert all(p is params[n] for n, p in model.named_parameters())  # the very same tensors
    sd = model.state_dict()
    assert list(sd) == list(sd_before)
    for k, v in sd.items():
        shape, dtype, data = sd_before[k]
        assert v.shape == shape and v.dtype == dtype
        assert v.numpy().tobytes() == data.numpy().tobytes(), k


def test_load_state_dict_after_patching_takes_effect():
    conv = make_conv((2, 3, 5))
    patch(conv)
    other = make_conv((2, 3, 5), seed=7)
    conv.load_state_dict(other.state_dict())
    x = make_input(2, 3, (2, 3, 5))
    assert_verbose_close(conv(x), other(x))


def test_hooks_still_fire():
    conv = make_conv((2, 4, 4), c_in=3, c_out=4)
    x = make_input(2, 3, (2, 4, 4))
    seen = []
    conv.register_forward_pre_hook(lambda m, args: (args[0] * 2,))
    conv.register_forward_hook(lambda m, args, out: out + 1)
    conv.register_full_backward_hook(lambda m, gin, gout: seen.append("backward"))
    expected = stock(conv, x * 2) + 1
    patch(conv)
    xr = x.clone().requires_grad_(True)
    out = conv(xr)
    assert_verbose_close(out, expected)
    out.sum().backward()
    assert seen == ["backward"]


def test_hooks_registered_after_patching_fire_too():
    conv = make_conv((2, 4, 4))
    patch(conv)
    calls = []
    conv.register_forward_pre_hook(lambda m, args: calls.append("pre"))
    conv.register_forward_hook(lambda m, args, out: calls.append("post"))
    conv(make_input(1, 3, (2, 4, 4)))
    assert calls == ["pre", "post"]


@pytest.mark.parametrize(
    "convert,dtype",
    [
        (lambda m: m.to(torch.float64), torch.float64),
        (lambda m: m.half(), torch.float16),
        (lambda m: m.bfloat16(), torch.bfloat16),
        (lambda m: m.double().float(), torch.float32),
    ],
    ids=["to-float64", "half", "bfloat16", "roundtrip"],
)
def test_dtype_conversion_keeps_the_patch(convert, dtype):
    conv = make_conv((2, 3, 5))
    patch(conv)
    convert(conv)
    assert is_patched(conv) and conv.weight.dtype == dtype
    for size in [(2, 3, 5), (5, 7, 11)]:
        x = make_input(2, 3, size, dtype=dtype)
        assert_verbose_close(conv(x), run_stock(conv, x), name=f"{dtype} after conversion")


def test_deepcopy_copies_the_patch_and_the_parameters():
    model = mixed_model()
    patch(model)
    clone = copy.deepcopy(model)
    assert is_patched(clone)
    assert clone["embed"].weight is not model["embed"].weight
    assert torch.equal(clone["embed"].weight, model["embed"].weight)
    x = torch.randn(2, 3, 4, 8, 8)
    assert torch.equal(clone["embed"](x), model["embed"](x))
    unpatch(clone)
    assert is_patched(model) and not is_patched(clone)  # independent


@pytest.mark.parametrize("protocol", [0, 1, 2, pickle.HIGHEST_PROTOCOL])
def test_a_pickle_is_the_stock_models_pickle(protocol):
    """The user's own object, pickled in memory; vlfast never writes pickle data. The bytes are the stock
    model's, so they load anywhere (and under weights_only) as the stock model: patch it again."""
    model = mixed_model()
    plain = pickle.dumps(model, protocol=protocol)
    patch(model)
    assert pickle.dumps(model, protocol=protocol) == plain or protocol < 2
    clone = pickle.loads(pickle.dumps(model, protocol=protocol))
    assert not patched_modules(clone) and "vlfast" not in repr(clone)
    x = torch.randn(2, 3, 4, 8, 8)
    assert_verbose_close(clone["embed"](x), model["embed"](x))
    assert patch(clone).num_patched == 2 and is_patched(clone)


def test_repr_shows_the_patch():
    conv = nn.Conv3d(3, 8, (2, 4, 4), stride=(2, 4, 4))
    plain = repr(conv)
    patch(conv)
    assert repr(conv) == plain[:-1] + ", vlfast=gemm)"
    assert repr(conv.__dict__["_conv_forward"]) == "GemmConvForward(kernel_size=(2, 4, 4))"


def test_parametrization_after_patching():
    conv = make_conv((2, 3, 5))
    patch(conv)
    torch.nn.utils.parametrize.register_parametrization(conv, "weight", _Double())
    x = make_input(2, 3, (5, 7, 11))
    expected = F.conv3d(x, conv.weight, conv.bias, stride=(2, 3, 5))  # conv.weight is now 2x the original
    assert is_patched(conv)
    assert_verbose_close(conv(x), expected)


class _Double(nn.Module):
    def forward(self, w):
        return w * 2


def test_replacement_is_picklable_by_value():
    f = GemmConvForward((2, 16, 16))
    g = pickle.loads(pickle.dumps(f))
    assert g == f and hash(g) == hash(f) and g is not f
    assert copy.deepcopy(f) == f


# ---------------------------------------------------------------------------- execution modes


@pytest.mark.parametrize("size", [(2, 3, 5), (5, 7, 11)], ids=["one-window", "larger"])
def test_cpu_bf16_autocast(size):
    conv = make_conv((2, 3, 5))
    x = make_input(3, 3, size)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        expected = conv(x)
        patch(conv)
        actual = conv(x)
    assert actual.dtype == expected.dtype == torch.bfloat16
    assert_verbose_close(actual, expected, name="autocast output")


@pytest.mark.parametrize("mode", [torch.no_grad, torch.inference_mode])
def test_no_grad_and_inference_mode(mode):
    conv = make_conv((2, 3, 5))
    x = make_input(2, 3, (5, 7, 11))
    expected = stock(conv, x).detach()
    patch(conv)
    with mode():
        out = conv(x)
        out_one = conv(make_input(2, 3, (2, 3, 5)))
    assert not out.requires_grad and not out_one.requires_grad
    assert_verbose_close(out, expected)


def _graph_breaks(fn, *args) -> tuple[int, int]:
    torch._dynamo.reset()
    e = torch._dynamo.explain(fn)(*args)
    return e.graph_count, e.graph_break_count


@pytest.mark.parametrize("size", [(2, 16, 16), (4, 32, 48)], ids=["qwen", "larger"])
def test_compile_adds_no_graph_breaks(size):
    conv = qwen_embed(c_out=8)
    x = torch.randn(2, 3, *size)
    stock_counts = _graph_breaks(conv, x)
    patch(conv)
    assert _graph_breaks(conv, x) == stock_counts == (1, 0)


def test_compile_fullgraph_forward_and_backward():
    conv = qwen_embed(c_out=8)
    patch(conv)
    pixels = torch.randn(6, 3 * 2 * 16 * 16)

    def embed(p):
        return conv(p.view(-1, 3, 2, 16, 16)).view(-1, 8)

    expected_x = pixels.clone().requires_grad_(True)
    expected = F.conv3d(expected_x.view(-1, 3, 2, 16, 16), conv.weight, conv.bias, stride=(2, 16, 16))
    expected.view(-1, 8).square().sum().backward()
    expected_w = conv.weight.grad.clone()
    conv.zero_grad(set_to_none=True)
    torch._dynamo.reset()
    compiled = torch.compile(embed, fullgraph=True, backend="aot_eager")
    x = pixels.clone().requires_grad_(True)
    out = compiled(x)
    out.square().sum().backward()
    assert_verbose_close(out, expected.view(-1, 8), name="compiled output")
    assert_verbose_close(x.grad, expected_x.grad, name="compiled input grad")
    assert_verbose_close(conv.weight.grad, expected_w, name="compiled weight grad")
    torch._dynamo.reset()


@pytest.mark.skipif(
    tuple(int(x) for x in torch.__version__.split(".")[:2]) < (2, 13),
    reason="measured at the declared floor, torch 2.6: dynamo recompiles the patched forward per patch count "
    "(4 frames for 4 sizes); 2.13 compiles it once",
)
def test_compile_dynamic_batch_compiles_once():
    from torch._dynamo.testing import CompileCounter

    conv = qwen_embed(c_out=8)
    patch(conv)

    def embed(p):
        return conv(p.view(-1, 3, 2, 16, 16)).view(-1, 8)

    torch._dynamo.reset()
    counter = CompileCounter()
    compiled = torch.compile(embed, backend=counter, dynamic=True, fullgraph=True)
    for n in (5, 9, 17, 33):  # the patch count varies with every image
        x = torch.randn(n, 3 * 2 * 16 * 16)
        assert_verbose_close(compiled(x), embed(x), name=f"dynamic N={n}")
    assert counter.frame_count == 1
    torch._dynamo.reset()


def test_compile_with_inductor():
    conv = qwen_embed(c_out=8)
    pixels = torch.randn(9, 3 * 2 * 16 * 16)
    expected = stock(conv, pixels.view(-1, 3, 2, 16, 16)).view(-1, 8)
    patch(conv)
    torch._dynamo.reset()
    compiled = torch.compile(lambda p: conv(p.view(-1, 3, 2, 16, 16)).view(-1, 8), fullgraph=True)
    assert_verbose_close(compiled(pixels), expected, name="inductor output")
    torch._dynamo.reset()


def test_meta_device_shapes():
    # Shape-only runs (device="meta") go through the patch too.
    conv = nn.Conv3d(3, 8, (2, 16, 16), stride=(2, 16, 16), device="meta")
    patch(conv)
    assert conv(torch.empty(7, 3, 2, 16, 16, device="meta")).shape == (7, 8, 1, 1, 1)
    assert conv(torch.empty(1, 3, 4, 33, 40, device="meta")).shape == (1, 8, 2, 2, 2)


@pytest.mark.parametrize("nd", [2, 3])
@pytest.mark.parametrize("which", ["input", "weight"])
def test_compile_fullgraph_channels_last(nd, which):
    # The channels-last answer asks torch which conv kernel it would pick: that must not break a graph.
    kernel, size = GEOMETRIES[2 * nd - 1]
    conv = make_conv(kernel)
    x = make_input(2, 3, size, channels_last=which == "input")
    if which == "weight":
        conv = conv.to(memory_format=CHANNELS_LAST[nd])
    expected = stock(conv, x)
    patch(conv)
    torch._dynamo.reset()
    out = torch.compile(conv, fullgraph=True, backend="aot_eager")(x)
    torch._dynamo.reset()
    assert strides_of(out) == strides_of(expected)
    assert_verbose_close(out, expected, name=f"compiled channels-last {which}")


def test_torch_export_captures_the_gemm():
    conv = qwen_embed(c_out=8)
    patch(conv)
    x = torch.randn(3, 3, 2, 16, 16)
    exported = torch.export.export(conv, (x,))
    targets = [str(n.target) for n in exported.graph.nodes if n.op == "call_function"]
    assert any("linear" in t or "addmm" in t for t in targets), targets
    assert not any("conv" in t for t in targets), targets
    assert_verbose_close(exported.module()(x), stock(conv, x))


@pytest.mark.filterwarnings("ignore:`torch.jit.script` is deprecated:FutureWarning")  # torch >= 2.14
def test_torchscript_still_works():
    # Deprecated, still used by deployed models. TorchScript compiles the class's own _conv_forward: a scripted patched conv is the stock conv.
    conv = make_conv((2, 3, 5))
    patch(conv)
    x = make_input(2, 3, (5, 7, 11))
    assert_verbose_close(torch.jit.script(conv)(x), stock(conv, x))


def test_patching_in_steps_with_filters():
    model = mixed_model()
    assert [e.status for e in patch(model, filter="embed").entries] == ["patched", "filtered", "filtered"]
    report = patch(model)
    assert [e.status for e in report.entries] == ["already_patched", "patched", "skipped"]
    assert [n for n, _ in patched_modules(model)] == ["embed", "down"]


def test_the_comparison_helper_reports_the_worst_element():
    # The tolerance helper is what every equivalence claim here rests on: it must catch and locate errors.
    expected = torch.linspace(-1, 1, 24).view(2, 3, 4)
    actual = expected.clone()
    actual[1, 2, 3] += 1e-3
    with pytest.raises(AssertionError, match=r"1/24 elements out of tolerance.*worst at \(1, 2, 3\)"):
        assert_verbose_close(actual, expected, name="probe")
    assert_verbose_close(expected + 1e-7, expected)  # fp32 round-off passes
    flipped = expected.bfloat16()
    with pytest.raises(AssertionError, match="cosine"):
        assert_verbose_close(-flipped, flipped)
