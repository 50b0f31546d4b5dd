"""The exact GEMM patch for convolutions whose stride equals their kernel.

With stride == kernel_size, zero padding, dilation 1 and groups 1 a conv reads disjoint windows, so each
output is ``b[k] + <W[k], window>``: one matrix multiply. Qwen-VL and GLM-4V embed patches with such an
``nn.Conv3d`` called on kernel-sized inputs, where it is ``F.linear`` on views of input and 5-D weight.

``patch`` swaps the module's ``_conv_forward`` through an instance attribute: class, parameters,
state_dict and wrappers around ``forward`` (accelerate, PEFT) stay as they are. Each call decides from the
geometry and the weight as they are then: a weight partitioned at ``patch`` (ZeRO-3, FSDP1, meta) and
whole at the call runs the GEMM; a conv that no longer fits runs the stock conv.
"""

from __future__ import annotations

import math
import pkgutil
import re
import sys
import weakref
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass, field
from typing import Literal

import torch
import torch.nn.functional as F
from torch import nn

from vlfast.errors import InputRefused

__all__ = [
    "ConvEntry",
    "GemmConvForward",
    "PatchReport",
    "eligibility",
    "is_patched",
    "patch",
    "patched_modules",
    "unpatch",
]

_CONV_TYPES: tuple[type[nn.Module], ...] = (nn.Conv1d, nn.Conv2d, nn.Conv3d)
_CONV_FN = {1: F.conv1d, 2: F.conv2d, 3: F.conv3d}
_CHANNELS_LAST = {2: torch.channels_last, 3: torch.channels_last_3d}
# The stock implementation for each class; a subclass that overrides it computes something else.
_STOCK_CONV_FORWARD = {cls: cls._conv_forward for cls in _CONV_TYPES}

Filter = Callable[[str, nn.Module], bool] | str | None
# torch.compiler.is_compiling is torch >= 2.3; dynamo folds it to True while tracing.
_is_compiling: Callable[[], bool] = getattr(getattr(torch, "compiler", None), "is_compiling", lambda: False)

# The number of records running (vlfast.switches.record); VLFAST_RECORD armed at start-up counts as one.
_RECORDING = int(getattr(sys.modules.get("vlfast.switches.record"), "env_armed", False))
# Every live replacement, by id (GemmConvForward compares by kernel size, so no WeakSet); the counters of
# every conv that counted a call, kept after the conv is gone; the models patch() was given (for names).
_FORWARDS: weakref.WeakValueDictionary[int, GemmConvForward] = weakref.WeakValueDictionary()
_COUNTED: list[Calls] = []
_ROOTS: list[weakref.ref] = []
# While a record runs, a global forward pre-hook counts the calls of each eligible Conv3d vlfast did not
# patch, and of each patched one (a forward replaced on its class can keep them from the GEMM).
_UNPATCHED: weakref.WeakKeyDictionary[nn.Module, Calls] = weakref.WeakKeyDictionary()
_hook: list = []  # the pre-hook's handle while one is installed


class Calls:
    """One conv's calls while a record ran: through the GEMM, through the stock conv by reason, the module
    calls the record's hook saw, and the forward that keeps them from the GEMM, if any (set when read)."""

    __slots__ = ("entered", "gemm", "name", "patched", "replaced", "stock")

    def __init__(self, name: str, patched: bool = True) -> None:
        self.name = name
        self.patched = patched
        self.gemm = 0
        self.stock: dict[str, int] = {}
        self.entered = 0
        self.replaced: str | None = None

    def _first(self) -> None:
        if not self.gemm and not self.stock and not self.entered:
            _COUNTED.append(self)


# torch's own forward of each conv class calls self._conv_forward, where the patch sits (an instance
# attribute). A forward assigned to the class afterwards (ms-swift >= 4.0.2 sets nn.Conv3d.forward on torch
# 2.9.x; a user's monkeypatch) runs instead, and reaches the patch only if it calls _conv_forward itself.
_TORCH_CONV_FILE = getattr(sys.modules.get(nn.Conv3d.__module__), "__file__", None)
BYPASSED = "vlfast's GEMM not reached, calls not counted"


def _is_torch_forward(fn: object) -> bool:
    code = getattr(fn, "__code__", None)
    return code is not None and code.co_name == "forward" and code.co_filename == _TORCH_CONV_FILE


def _calls_the_patch(fn: object) -> bool:
    """A replacement naming ``_conv_forward`` or wrapping torch's forward is taken to call it."""
    code = getattr(fn, "__code__", None)
    return (code is not None and "_conv_forward" in code.co_names) or _is_torch_forward(
        getattr(fn, "__wrapped__", None)
    )


def forward_replaced(module: nn.Module) -> str | None:
    """The qualified name of the forward that a call of ``module`` runs in place of torch's, when one was
    assigned to its class or to a conv class above it (``nn.Conv3d.forward = fn``); None for torch's own
    and for a subclass's own ``forward``, written in its class body (which calls what it calls)."""
    for cls in type(module).__mro__:
        fn = cls.__dict__.get("forward")
        if fn is None:
            continue
        if _is_torch_forward(fn) or _calls_the_patch(fn):
            return None
        if cls in _CONV_TYPES or getattr(fn, "__qualname__", None) != f"{cls.__qualname__}.forward":
            fn = getattr(fn, "__func__", fn)  # its qualified name
            where, name = getattr(fn, "__module__", None), getattr(fn, "__qualname__", None) or repr(fn)
            return f"{where}.{name}" if where else name
        return None
    return None


def _is_channels_last(t: torch.Tensor, nd: int) -> bool:
    """True when ``t`` is laid out channels-last and not also plain contiguous (a 2-D or 3-D conv only)."""
    return (
        nd in _CHANNELS_LAST and not t.is_contiguous() and t.is_contiguous(memory_format=_CHANNELS_LAST[nd])
    )


def _conv_memory_format(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, stride: tuple[int, ...]
) -> torch.memory_format:
    """The memory format the stock conv gives for these tensors when one of them is channels-last: it
    depends on the kernel torch picks (oneDNN and cuDNN: channels-last; CPU's fp16 Slow3d: contiguous), so
    ask torch's own selector, as its meta functions do; the common rule where that cannot be asked."""
    nd = len(stride)
    if _is_compiling():  # the selector returns a non-tensor that dynamo cannot trace: a graph break
        return _CHANNELS_LAST[nd]
    try:
        backend = torch._C._select_conv_backend(
            x, weight, bias, list(stride), [0] * nd, [1] * nd, False, [0] * nd, 1, None
        )
        return torch._C._conv_determine_backend_memory_format(x, weight, backend)
    except (AttributeError, RuntimeError, TypeError):  # private API: absent or different elsewhere
        return _CHANNELS_LAST[nd]


def _base_class(module: nn.Module) -> type[nn.Module]:
    return next(cls for cls in _CONV_TYPES if isinstance(module, cls))


def _frozen(v) -> bool:
    """True for the values a conv's geometry attribute holds that cannot change in place."""
    return isinstance(v, (int, str)) or (isinstance(v, tuple) and all(isinstance(i, int) for i in v))


def _weight_of(module: nn.Module) -> torch.Tensor | None:
    """The module's weight as it is now, or None where it has none (FSDP1 removes it between forwards)."""
    try:
        return getattr(module, "weight", None)
    except Exception:  # a parametrization that cannot compute yet (e.g. on the meta device)
        return None


def _kernel_shape(weight: torch.Tensor | None, kernel_size: tuple[int, ...]) -> torch.Size | None:
    """``weight.shape`` when it is a whole conv weight of this kernel; None for a partitioned or flat one."""
    if not isinstance(weight, torch.Tensor) or isinstance(weight, nn.parameter.UninitializedParameter):
        return None
    shape = weight.shape
    return shape if len(shape) == len(kernel_size) + 2 and tuple(shape[2:]) == kernel_size else None


class GemmConvForward:
    """Replacement for ``_ConvNd._conv_forward(input, weight, bias)`` computing the conv as a GEMM.

    Weight and bias arrive at call time, never stored (``.to()``, parametrizations, FSDP, ZeRO-3 keep
    working). The decision is cached by the geometry attributes (checked by identity) and the last whole
    weight shape. Holds its module weakly, so ``del model`` frees the parameters at once.
    """

    def __init__(
        self, kernel_size: tuple[int, ...] = (), module: nn.Module | None = None, name: str = ""
    ) -> None:
        self.kernel_size = tuple(int(k) for k in kernel_size)
        self.ndim = len(self.kernel_size)
        self._module = None if module is None else weakref.ref(module)
        self.calls = Calls(name)  # counted while a record runs; named as the last patch() call saw it
        self._seen: tuple | None = None  # (stride, padding, dilation, groups, padding_mode) last decided on
        self._stock: str | None = None  # why the module's geometry keeps it on the stock conv
        self._wshape: torch.Size | None = None  # the last whole weight shape seen, of this kernel
        self._ones = (1,) * self.ndim
        _FORWARDS[id(self)] = self
        if module is not None and "_parameters" in module.__dict__:
            # Decide now: state changed after torch.compile traced the first call would compile again. A
            # weight not whole here leaves _wshape unset, decided at the first call (as is a module that
            # deepcopy or unpickling passes not yet filled in).
            self._decide(module)
            self._wshape = _kernel_shape(_weight_of(module), self.kernel_size)

    def __repr__(self) -> str:
        return f"GemmConvForward(kernel_size={self.kernel_size})"

    def __eq__(self, other: object) -> bool:
        return isinstance(other, GemmConvForward) and other.kernel_size == self.kernel_size

    def __hash__(self) -> int:
        return hash(self.kernel_size)

    # A weak reference neither deep-copies nor pickles: rebuild from the (copied) module instead, whose
    # attributes may not be set yet (hence no eligibility check until the first call).
    def __deepcopy__(self, memo: dict) -> GemmConvForward:
        module = self._live()
        # Copied as part of its module: bind to the module's copy; copied alone: keep the module.
        return GemmConvForward(self.kernel_size, memo.get(id(module), module), self.calls.name)

    def __reduce__(self):
        return GemmConvForward, (self.kernel_size, self._live(), self.calls.name)

    def _live(self) -> nn.Module | None:
        return None if self._module is None else self._module()

    def status(self) -> str | None:
        """None when the next call runs the GEMM (for a weight partitioned here: once it arrives whole);
        else why it runs the stock conv: the module's geometry, or its weight's kernel, as they are now."""
        m = self._live()
        if m is None:
            return self._stock
        if (fn := forward_replaced(m)) is not None:
            return f"forward replaced by {fn}: {BYPASSED}"
        self._decide(m)
        if self._stock is not None:
            return self._stock
        w = _weight_of(m)
        # A partitioned, flat or meta weight is whole again when called, which decides then.
        whole = isinstance(w, torch.Tensor) and not w.is_meta and w.dim() == self.ndim + 2 and w.numel()
        if whole and tuple(w.shape[2:]) != self.kernel_size:
            return f"weight kernel {tuple(w.shape[2:])} != kernel_size {self.kernel_size}"
        return None

    def _decide(self, m: nn.Module) -> None:
        """Decide again where ``m``'s geometry changed (checked by identity): GEMM (with which kernel) or the
        stock conv."""
        seen = self._seen
        if not (
            seen is None
            or m.stride is not seen[0]
            or m.padding is not seen[1]
            or m.dilation is not seen[2]
            or m.groups is not seen[3]
            or m.padding_mode is not seen[4]
        ):
            return
        reason = eligibility(m)
        attrs = (m.stride, m.padding, m.dilation, m.groups, m.padding_mode)
        # Values that could change in place (a list), and F.pad's padding (padding_mode other than 'zeros'),
        # are checked again on every call.
        frozen = all(_frozen(a) for a in attrs) and m.padding_mode == "zeros"
        self._seen = attrs if frozen else None
        self._stock = reason
        if reason is None:
            kernel = tuple(int(k) for k in m.kernel_size)
            if kernel != self.kernel_size:
                self.kernel_size, self.ndim, self._ones = kernel, len(kernel), (1,) * len(kernel)
                self._wshape = None

    def _count(self, stock: str | None = None) -> None:
        """One call counted while a record runs: through the GEMM, or through the stock conv and why."""
        if _RECORDING and not _is_compiling():
            c = self.calls
            c._first()
            if stock is None:
                c.gemm += 1
            else:
                c.stock[stock] = c.stock.get(stock, 0) + 1

    def _stock_conv(self, m: nn.Module, x, weight, bias, reason: str) -> torch.Tensor:
        """The class's own ``_conv_forward``, with whatever geometry ``m`` has now."""
        self._count(reason)
        return _STOCK_CONV_FORWARD[_base_class(m)](m, x, weight, bias)

    def _fallback(self, x: torch.Tensor, weight, bias, reason: str) -> torch.Tensor:
        # Zero padding, dilation 1 and groups 1 are eligibility conditions: the stock call is exactly this.
        self._count(reason)
        return _CONV_FN[self.ndim](x, weight, bias, self.kernel_size, 0, 1, 1)

    def __call__(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        m = self._live()
        if m is not None:
            self._decide(m)
            if self._stock is not None:
                return self._stock_conv(m, x, weight, bias, self._stock)
        shape = x.shape
        # The Qwen case, kept to the fewest checks: x is (N, C, T, P, P), every sample one window, the weight
        # of the last whole shape seen, a bias of its dtype (another is the conv's error, or autocast's cast).
        if (
            shape[2:] == self.kernel_size
            and weight.shape == self._wshape
            and shape[0]
            and x.is_contiguous()
            and (bias is None or bias.dtype is weight.dtype)
        ):
            if _RECORDING:  # the hot path: no call at all unless a record runs
                self._count()
            d = self._wshape[0]
            return F.linear(x.view(shape[0], -1), weight.reshape(d, -1), bias).view(shape[0], d, *self._ones)
        return self._general(x, weight, bias, m)

    def _general(
        self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, m: nn.Module | None
    ) -> torch.Tensor:
        nd = self.ndim
        wshape = _kernel_shape(weight, self.kernel_size)
        if wshape is None:
            # A weight of another kernel (``.data`` swapped, functional_call) or not whole (partitioned):
            # the stock conv's windows are not the GEMM's, and it says what is wrong with the weight.
            if m is not None:
                why = f"weight of shape {tuple(weight.shape)} is not a {self.kernel_size} kernel"
                return self._stock_conv(m, x, weight, bias, why)
            raise InputRefused(
                f"GemmConvForward(kernel_size={self.kernel_size}) was given a weight of shape "
                f"{tuple(weight.shape)}; its kernel must be {self.kernel_size}"
            )
        if not _is_compiling():  # dynamo would store a traced shape
            self._wshape = wshape
        if x.dim() != nd + 2:
            return self._fallback(x, weight, bias, f"unbatched input of shape {tuple(x.shape)}")
        if x.shape[0] == 0:
            return self._fallback(x, weight, bias, "empty batch")
        if bias is not None and bias.dtype != weight.dtype:
            # The conv raises for it (outside autocast, which casts all three): the GEMM would cast it.
            return self._fallback(x, weight, bias, f"bias dtype {bias.dtype} != weight dtype {weight.dtype}")
        n, c = x.shape[0], x.shape[1]
        spatial = tuple(x.shape[2:])
        d = weight.shape[0]
        if spatial == self.kernel_size and x.is_contiguous():  # every VLM's call: first, nothing else asked
            self._count()
            return F.linear(x.reshape(n, -1), weight.reshape(d, -1), bias).view(n, d, *([1] * nd))
        if any(s < k for s, k in zip(spatial, self.kernel_size)):
            # the conv raises its own error for too-small input
            return self._fallback(x, weight, bias, f"input {spatial} smaller than the kernel")
        channels_last = _is_channels_last(x, nd)
        if not (x.is_contiguous() or channels_last):
            # odd strides: a copy would cost more than it saves
            return self._fallback(x, weight, bias, "input neither contiguous nor channels-last")
        self._count()
        if spatial == self.kernel_size:  # channels-last
            # Memory holds (N, *k, C): flatten that way (a view) and reorder the weight to match.
            dims = (0, *range(2, nd + 2), 1)
            y = F.linear(x.permute(dims).reshape(n, -1), weight.permute(dims).reshape(d, -1), bias)
            # The conv's channels-last strides: (D, 1, D, ..., D).
            return y.view(n, *([1] * nd), d).permute(0, nd + 1, *range(1, nd + 1))
        # Larger input: crop the remainder the conv would skip, cut into windows, one batched GEMM.
        grid = tuple(s // k for s, k in zip(spatial, self.kernel_size))
        crop = tuple(slice(0, g * k) for g, k in zip(grid, self.kernel_size))
        windows = x[(slice(None), slice(None), *crop)]
        # (N, C, g0, k0, g1, k1, ...) -> (N, C, k0, k1, ..., g0, g1, ...) -> (N, C*K, L)
        shape = [n, c, *(v for g, k in zip(grid, self.kernel_size) for v in (g, k))]
        order = [0, 1, *range(3, 2 * nd + 2, 2), *range(2, 2 * nd + 2, 2)]
        cols = windows.reshape(shape).permute(order).reshape(n, c * math.prod(self.kernel_size), -1)
        y = torch.matmul(weight.reshape(d, -1), cols)  # (D, C*K) @ (N, C*K, L) -> (N, D, L)
        if bias is not None:
            y = y + bias.view(1, d, 1).to(y.dtype)
        y = y.view(n, d, *grid)
        if channels_last or _is_channels_last(weight, nd):
            return y.contiguous(memory_format=_conv_memory_format(x, weight, bias, self.kernel_size))
        return y


class _PatchedExtraRepr:
    """``extra_repr`` for a patched conv: the original text plus ``vlfast=gemm``, or ``vlfast=stock (why)``."""

    def __init__(self, module: nn.Module) -> None:
        self._module = weakref.ref(module)

    def __call__(self) -> str:
        m = self._module()
        if m is None:  # pragma: no cover - only reachable by holding the bound method past its module
            return "vlfast=gemm"
        text = type(m).extra_repr(m)
        fwd = m.__dict__.get("_conv_forward")
        why = fwd.status() if isinstance(fwd, GemmConvForward) else None
        mark = "vlfast=gemm"
        if why is not None:
            mark = f"vlfast={'not reached' if why.endswith(BYPASSED) else 'stock'} ({why})"
        return f"{text}, {mark}" if text else mark


# What patch() puts in a conv's __dict__. Without a copy path of its own, copy.copy would share the
# original's GemmConvForward, which watches the original's geometry, not the copy's.
_PATCH_KEYS = ("_conv_forward", "__reduce_ex__", "extra_repr")


class _PatchedReduce:
    """``__reduce_ex__`` of a patched conv, set on the instance, where ``copy.copy``, ``copy.deepcopy`` and
    pickle all look it up: the module's state minus the patch, a copy rebuilt patched and bound to itself, a
    pickle the stock conv's, byte for byte (:class:`_Rebuild`). Weak: the two do not keep each other alive."""

    def __init__(self, module: nn.Module) -> None:
        self._module = weakref.ref(module)

    def __call__(self, protocol: int) -> tuple:
        m = self._module()
        if m is None:  # pragma: no cover - a reducer outliving its module is only reachable by hand
            raise RuntimeError("the patched conv of this reducer no longer exists")
        state = m.__getstate__() if hasattr(m, "__getstate__") else m.__dict__
        state = {k: v for k, v in state.items() if k not in _PATCH_KEYS}
        return _Rebuild(), (type(m),), state


class _Rebuild:
    """The callable in a patched conv's reduction. Called (copy, deepcopy): an empty patched module.

    Named ``__newobj__``: a pickler (protocol >= 2) writes a reduction by a callable of that name as the
    ``NEWOBJ`` opcode on ``cls``, exactly what it writes for a stock module. So the file names the conv's
    class and torch's tensor rebuilders only: ``torch.load(weights_only=True)`` accepts it, and it loads
    where vlfast is not installed, as the stock conv (patch the loaded model again)."""

    __name__ = "__newobj__"

    def __call__(self, cls: type) -> nn.Module:
        m = cls.__new__(cls)
        _install(m)
        return m

    def __reduce__(self):
        # Protocols 0 and 1 have no NEWOBJ and pickle the callable itself: the stock one, by name.
        return pkgutil.resolve_name, ("copyreg:__newobj__",)


def _install(m: nn.Module, name: str = "") -> None:
    kernel = tuple(m.kernel_size) if "kernel_size" in m.__dict__ else ()
    m.__dict__["_conv_forward"] = GemmConvForward(kernel, m, name)
    m.__dict__["__reduce_ex__"] = _PatchedReduce(m)
    m.__dict__["extra_repr"] = _PatchedExtraRepr(m)


@dataclass(frozen=True)
class ConvEntry:
    """One convolution found in the model and what ``patch`` did with it."""

    name: str
    kind: str  # class name, e.g. "Conv3d"
    in_channels: int
    out_channels: int
    kernel_size: tuple[int, ...]
    stride: tuple[int, ...]
    status: Literal["patched", "already_patched", "skipped", "filtered", "unpatched"]
    reason: str = ""


@dataclass
class PatchReport:
    """What ``patch``/``unpatch`` found and did, one entry per convolution module."""

    entries: list[ConvEntry] = field(default_factory=list)
    action: Literal["patch", "unpatch"] = "patch"  # the call that made this report: heads its text

    def __post_init__(self) -> None:
        if self.action not in ("patch", "unpatch"):
            raise ValueError(f"action must be 'patch' or 'unpatch', got {self.action!r}")

    def _with(self, *status: str) -> list[ConvEntry]:
        return [e for e in self.entries if e.status in status]

    @property
    def patched(self) -> list[ConvEntry]:
        return self._with("patched")

    @property
    def already_patched(self) -> list[ConvEntry]:
        return self._with("already_patched")

    @property
    def skipped(self) -> list[ConvEntry]:
        return self._with("skipped", "filtered")

    @property
    def unpatched(self) -> list[ConvEntry]:
        return self._with("unpatched")

    @property
    def num_patched(self) -> int:
        return len(self.patched)

    def __bool__(self) -> bool:  # "did this call change anything or find it done"
        return bool(self.patched or self.already_patched or self.unpatched)

    def to_dict(self) -> dict:
        return {
            "patched": self.num_patched,
            "already_patched": len(self.already_patched),
            "skipped": len(self.skipped),
            "entries": [asdict(e) for e in self.entries],
        }

    def summary(self) -> str:
        if self.action == "unpatch":
            return f"{len(self.unpatched)} unpatched" if self.entries else "nothing was patched"
        parts = [f"{self.num_patched} patched"]
        if self.already_patched:
            parts.append(f"{len(self.already_patched)} already patched")
        bypassed = sorted(
            {e.reason for e in self.patched + self.already_patched if e.reason.endswith(BYPASSED)}
        )
        if bypassed:
            n = sum(e.reason in bypassed for e in self.entries)
            parts.append(f"{n} of them not reached: " + "; ".join(bypassed))
        if self.skipped:
            parts.append(f"{len(self.skipped)} skipped")
        return ", ".join(parts) if self.entries else "no convolutions found"

    def __str__(self) -> str:
        lines = [f"vlfast {self.action}: {self.summary()}"]
        for e in self.entries:
            why = f" ({e.reason})" if e.reason else ""
            lines.append(
                f"  {e.status:<15} {e.name or '<root>'}: {e.kind} k={e.kernel_size} s={e.stride}{why}"
            )
        return "\n".join(lines)


def _tuple(v, nd: int) -> tuple[int, ...]:
    return tuple(v) if isinstance(v, (tuple, list)) else (int(v),) * nd


def eligibility(module: nn.Module) -> str | None:
    """Why ``module`` cannot be patched (user-facing), or ``None`` when it can."""
    if isinstance(module, nn.modules.conv._ConvNd) and module.transposed:
        return "transposed convolution"
    if not isinstance(module, _CONV_TYPES):
        return "not a Conv1d/Conv2d/Conv3d"
    if type(module)._conv_forward is not _STOCK_CONV_FORWARD[_base_class(module)]:
        return f"{type(module).__name__} overrides _conv_forward"
    if isinstance(_weight_of(module), nn.parameter.UninitializedParameter):
        return "lazy module not initialised yet"
    nd = len(module.kernel_size)
    if tuple(module.stride) != tuple(module.kernel_size):
        return f"stride {tuple(module.stride)} != kernel_size {tuple(module.kernel_size)}"
    padding = module.padding
    if module.padding_mode != "zeros":
        # The stock conv pads with F.pad by _reversed_padding_repeated_twice then, and ignores .padding.
        pads = tuple(module._reversed_padding_repeated_twice)
        if any(p != 0 for p in pads):
            return f"padding_mode={module.padding_mode!r} pads by {pads}"
    elif isinstance(padding, str):
        if padding != "valid":
            return f"padding={padding!r}"
    elif any(p != 0 for p in _tuple(padding, nd)):
        return f"padding {tuple(padding)} is not zero"
    if any(d != 1 for d in _tuple(module.dilation, nd)):
        return f"dilation {tuple(module.dilation)} is not 1"
    if module.groups != 1:
        return f"groups={module.groups}"
    return None


def is_patched(module: nn.Module) -> bool:
    """True when ``module`` (or any module inside it) is patched and its geometry runs the GEMM now (a
    patched conv whose geometry changed so that the GEMM no longer computes it does not count)."""
    # lazily: stops at the first that runs the GEMM
    return any(m.__dict__["_conv_forward"].status() is None for _, m in _patched(module))


def patched_modules(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """Every module inside ``model`` that carries the patch, whether its geometry runs the GEMM now or not."""
    return list(_patched(model))


def _patched(model: nn.Module) -> Iterator[tuple[str, nn.Module]]:
    return (
        (n, m)
        for n, m in model.named_modules()
        if isinstance(m.__dict__.get("_conv_forward"), GemmConvForward)
    )


def compile_filter(filter: Filter) -> Callable[[str, nn.Module], bool]:
    if filter is None:
        return lambda name, m: True
    if isinstance(filter, str):
        try:
            rx = re.compile(filter)
        except re.error as e:
            raise InputRefused(f"filter {filter!r} is not a valid regular expression: {e}") from None
        return lambda name, m: rx.search(name) is not None
    if callable(filter):
        return filter
    raise InputRefused(
        f"filter must be a callable (name, module) -> bool, a regex string, or None; got {type(filter).__name__}"
    )


def _check_module(model: object, fn: str) -> None:
    if not isinstance(model, nn.Module):
        hint = " (pass the model object, not its path or config)" if isinstance(model, (str, dict)) else ""
        raise InputRefused(f"vlfast.{fn} expects a torch.nn.Module, got {type(model).__name__}{hint}")


def _entry(name: str, m: nn.Module, status, reason: str = "") -> ConvEntry:
    channels = (int(getattr(m, "in_channels", 0)), int(getattr(m, "out_channels", 0)))
    geometry = (tuple(getattr(m, "kernel_size", ())), tuple(getattr(m, "stride", ())))
    return ConvEntry(name, type(m).__name__, *channels, *geometry, status, reason)


def _deferred(m: nn.Module) -> str:
    """A note for a conv whose weight is not whole at patch time: the GEMM is decided at each call."""
    w = _weight_of(m)
    if not isinstance(w, torch.Tensor):
        return "no weight here (a wrapper holds it): the GEMM is decided at each call"
    if w.is_meta:
        return "weight on the meta device: the GEMM is decided at each call, from the weight it gets"
    kernel = tuple(int(k) for k in m.kernel_size)
    if _kernel_shape(w, kernel) is not None:
        return ""
    if w.dim() == len(kernel) + 2 and w.numel():
        return (
            f"weight kernel {tuple(w.shape[2:])} != kernel_size {kernel}: the stock conv runs until they agree "
            f"(decided at each call)"
        )
    return (
        f"weight of shape {tuple(w.shape)} here (partitioned: DeepSpeed ZeRO-3, FSDP): "
        f"the GEMM is decided at each call, from the gathered weight"
    )


def patch_one(module: nn.Module, name: str = "") -> bool:
    """Patch one conv when it is eligible and not patched yet, without a report; returns whether it did."""
    if (
        isinstance(module, _CONV_TYPES)
        and "_conv_forward" not in module.__dict__
        and eligibility(module) is None
    ):
        _install(module, name)
        return True
    return False


def count_calls(delta: int) -> None:
    """Add ``delta`` to the number of records running (vlfast.switches.record); calls are counted, and
    the global forward pre-hook installed, while it is not zero (without the hook, ``Module.__call__``
    takes its fast path)."""
    global _RECORDING
    _RECORDING = max(0, _RECORDING + delta)
    if _RECORDING and not _hook:
        from torch.nn.modules.module import register_module_forward_pre_hook

        _hook.append(register_module_forward_pre_hook(_module_called))
    elif not _RECORDING and _hook:
        _hook.pop().remove()


def _module_called(module: nn.Module, args: tuple) -> None:
    # Every module call of the process goes through here while a record runs: one isinstance for most.
    if not isinstance(module, nn.Conv3d) or _is_compiling():
        return
    fwd = module.__dict__.get("_conv_forward")
    if isinstance(fwd, GemmConvForward):
        c = fwd.calls
    elif (c := _UNPATCHED.get(module)) is None:
        if tuple(module.stride) != tuple(module.kernel_size) or eligibility(module) is not None:
            return  # not a conv vlfast patches (decided again at its next call: geometry may change)
        c = _UNPATCHED[module] = Calls(f"{type(module).__name__}@{id(module) & 0xFFFFFF:06x}", patched=False)
    elif eligibility(module) is not None:
        return
    c._first()
    c.entered += 1


def counters() -> list[Calls]:
    """The counters of every patched conv alive now or that counted a call, and of every eligible conv
    vlfast did not patch that was called while a record ran, named as in their model."""
    name_counted_convs()
    out = {}
    for f in list(_FORWARDS.values()):
        m = f._live()
        f.calls.replaced = None if m is None else forward_replaced(m)
        out[id(f.calls)] = f.calls
    for m, c in list(_UNPATCHED.items()):
        c.replaced = forward_replaced(m)
    out.update((id(c), c) for c in _COUNTED)
    return list(out.values())


def name_counted_convs() -> None:
    """Name each live conv's counters by its qualified name in the model patch() was last given that holds
    it (transformers patches a VLM's vision tower, then the VLM: the VLM's names win)."""
    seen: set[int] = set()
    for ref in reversed(_ROOTS):
        root = ref()
        if root is None:
            continue
        for name, m in root.named_modules():
            fwd = m.__dict__.get("_conv_forward")
            c = fwd.calls if isinstance(fwd, GemmConvForward) else _UNPATCHED.get(m)
            if c is not None and id(c) not in seen:
                seen.add(id(c))
                c.name = name or c.name


def patch(model: nn.Module, *, filter: Filter = None, strict: bool = False) -> PatchReport:
    """Turn every eligible stride == kernel convolution in ``model`` (any ``nn.Module``, a bare conv too)
    into its exact GEMM, in place. ``filter``: a callable ``(qualified_name, module) -> bool`` or a regular
    expression searched in the name; ``strict``: raise when nothing ends up patched. The
    :class:`PatchReport` lists every convolution with what was done and why; calling it again is harmless.
    """
    _check_module(model, "patch")
    keep = compile_filter(filter)
    report = PatchReport()
    # Decide for every module first: a filter that raises half-way must not leave the model half patched.
    todo: list[tuple[str, nn.Module]] = []
    for name, m in model.named_modules():
        if not isinstance(m, nn.modules.conv._ConvNd):  # transposed convs too: reported, never patched
            continue
        if isinstance(fwd := m.__dict__.get("_conv_forward"), GemmConvForward):
            fwd.calls.name = name or fwd.calls.name
            why = fwd.status()
            if why and not why.endswith(BYPASSED):
                why = f"runs the stock conv: {why}"
            report.entries.append(_entry(name, m, "already_patched", why or ""))
            continue
        if not keep(name, m):
            report.entries.append(_entry(name, m, "filtered", "excluded by filter"))
            continue
        reason = eligibility(m)
        if reason is None and "_conv_forward" in m.__dict__:
            reason = "_conv_forward already replaced on this instance by someone else"
        if reason is not None:
            report.entries.append(_entry(name, m, "skipped", reason))
            continue
        todo.append((name, m))
        fn = forward_replaced(m)
        why = _deferred(m) if fn is None else f"forward replaced by {fn}: {BYPASSED}"
        report.entries.append(_entry(name, m, "patched", why))
    if strict and not report:
        found = (
            "; ".join(f"{e.name}: {e.reason}" for e in report.skipped[:5]) or "the model has no Conv1d/2d/3d"
        )
        raise InputRefused(f"vlfast.patch(strict=True): nothing was patched ({found})")
    for name, m in todo:
        _install(m, name)
    if report:  # a record names its convs from the models patch() was given
        _ROOTS[:] = [r for r in _ROOTS if r() is not None and r() is not model]
        _ROOTS.append(weakref.ref(model))
    return report


def unpatch(model: nn.Module) -> PatchReport:
    """Undo :func:`patch` on every module inside ``model``; the original forward is restored exactly."""
    _check_module(model, "unpatch")
    report = PatchReport(action="unpatch")
    for name, m in model.named_modules():
        if isinstance(m.__dict__.get("_conv_forward"), GemmConvForward):
            del m.__dict__["_conv_forward"]
            for key, cls in (("extra_repr", _PatchedExtraRepr), ("__reduce_ex__", _PatchedReduce)):
                if isinstance(m.__dict__.get(key), cls):
                    del m.__dict__[key]
            report.entries.append(_entry(name, m, "unpatched"))
    return report


if _RECORDING:  # VLFAST_RECORD armed before this import: watch from now on
    count_calls(0)
