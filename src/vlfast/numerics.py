"""Process-wide steps that make a model's forward give the same bits every time it runs.

**MKL's vector math, set up on one thread.** On x86, torch computes ``cos``, ``sin``, ``exp``, ``erf``,
``tanh``, ``log``, ``sqrt`` and the other functions of :data:`VECTOR_MATH_OPS` on a float tensor with MKL's
vector math library (VML), splitting a tensor of more than 2,048 elements between its threads. VML sets
itself up on first use, and when that first use is several threads at once, one of them can compute its
share with a far less accurate kernel. Seen on this project's CI machine and reproduced on a 2-core Intel
Xeon (torch 2.13.0+cpu, ``MKL_CBWR=AUTO,STRICT``): in 6 of 42 fresh ``vlfast extract`` runs the first
forward's rotary ``cos`` (Qwen3-VL's vision tower) was wrong in about 1,000 of its 2,240 values, all in the
calling thread's share, by up to 1.5e-4 (cos(0.1) came out 0.99486607 instead of 0.99500417) while ``sin``
was right, so that run's first sample differed from every other run's in most of its features' last bits,
and a resumed run was not bit-identical to an uninterrupted one. Torch alone shows it: a fresh process
whose first ``cos`` is of 40,000 values on 8 threads was off by the same 1.51e-4 in 2 of 15 runs
(``benchmarks/commands.py vector-math``). How often varies with the machine's state: later the same
runs were right 34 times in 34 without the step, so the counts show the race, not a rate.

:func:`settle_vector_math` calls each of those functions once on one element (never split between
threads), on the calling thread, once per process, so VML is set up before several threads can use it; in
the hour the race showed most (3 wrong runs in 14 without it), 30 runs in 30 with it were right.
:func:`vlfast.extraction.model.runner.load` and :func:`vlfast.diagnosis.verification.verify` call it before
any model runs; a program running a model itself on the CPU can call it first for the same guarantee.
"""

from __future__ import annotations

import threading

__all__ = ["VECTOR_MATH_OPS", "settle_vector_math", "threads_keep_their_bits"]

# torch's unary functions that call MKL's VML for float32 and float64 on x86 (ATen's cpu/vml.h).
VECTOR_MATH_OPS = (
    "abs",
    "acos",
    "asin",
    "atan",
    "cos",
    "erf",
    "erfc",
    "erfinv",
    "exp",
    "expm1",
    "log",
    "log10",
    "log1p",
    "log2",
    "sin",
    "sqrt",
    "tan",
    "tanh",
    "trunc",
)

_settled = False
_lock = threading.Lock()


def settle_vector_math() -> bool:
    """Call each of :data:`VECTOR_MATH_OPS` once on a one-element float32 and float64 tensor, on this thread
    alone (one element is never split between threads), so MKL's vector math is set up before any forward
    uses it from several threads. Once per process (under ``fork`` the children inherit it); returns whether
    this call did it. Costs well under a millisecond."""
    global _settled
    if _settled:
        return False
    import torch

    with _lock:
        if _settled:
            return False
        with torch.inference_mode():
            for dtype in (torch.float32, torch.float64):
                x = torch.full((1,), 0.5, dtype=dtype)
                for name in VECTOR_MATH_OPS:
                    getattr(torch, name)(x)
        _settled = True
    return True


def threads_keep_their_bits() -> bool:
    """Whether this process's float32 products give the same bits at the thread count set and at another:
    a few products of the widths of a small vision tower, computed at that count and at one thread (two
    where it is one). What a resume, a torchrun rank or a Ray actor at another thread count keeps only where
    this holds. With ``MKL_CBWR=AUTO,STRICT`` it holds on Intel CPUs (MKL's strict mode covers its AVX2 and
    AVX-512 code) and, measured, on the 2-core AMD EPYC (Zen 4) at 1 and 2 threads; without ``MKL_CBWR`` it
    does not on this project's Xeon. Which rows share a product no longer matters to a stored feature: on
    the CPU each sample runs a forward of its own (:func:`vlfast.extraction.model.runner.runs_alone`), so
    its products hold its rows alone (on that AMD EPYC a row's bits do change with the rows beside it, in
    every ``MKL_CBWR`` mode). Tens of milliseconds; the global random state is left alone."""
    import torch
    import torch.nn.functional as F

    gen = torch.Generator().manual_seed(0)
    threads = torch.get_num_threads()
    other = 1 if threads > 1 else 2
    try:
        for k, n in ((64, 192), (256, 64), (1024, 1024)):
            w, b = torch.randn(n, k, generator=gen), torch.randn(n, generator=gen)
            a = torch.randn(190, k, generator=gen)
            here = F.linear(a, w, b)
            torch.set_num_threads(other)
            there = F.linear(a, w, b)
            torch.set_num_threads(threads)
            if not torch.equal(here, there):
                return False
    finally:
        torch.set_num_threads(threads)
    return True
