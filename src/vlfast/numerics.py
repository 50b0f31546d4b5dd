"""Process-wide steps that make a model's forward give the same bits every time it runs.

**MKL's vector math, set up on one thread.** On x86, torch computes the functions of
:data:`VECTOR_MATH_OPS` with MKL's VML, splitting a tensor of over 2,048 elements between threads. VML sets
itself up on first use, and when that is several threads at once, one can compute its share with a far less
accurate kernel: on a 2-core Xeon (torch 2.13.0+cpu, ``MKL_CBWR=AUTO,STRICT``) 6 of 42 fresh ``vlfast
extract`` runs had the first forward's rotary ``cos`` off by up to 1.5e-4, so a resumed run was not
bit-identical (``benchmarks/commands.py vector-math``). :func:`settle_vector_math`, called before a model
runs, sets VML up on one thread first (30 runs in 30 right where 3 in 14 were wrong without it).
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
    """Call each of :data:`VECTOR_MATH_OPS` once on a one-element float32 and float64 tensor, on this
    thread alone. Once per process (``fork``'s children inherit it); returns whether this call did it. Costs
    well under a millisecond; a program running a model itself on the CPU can call it first."""
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
    """Whether this process's float32 products give the same bits at the thread count set and at another
    (one thread; two where it is one), for a few products of a small vision tower's widths: what a resume,
    a torchrun rank or a Ray actor at another thread count needs. With ``MKL_CBWR=AUTO,STRICT`` it holds on
    Intel CPUs and, measured, on a 2-core AMD EPYC (Zen 4); without it, not on this project's Xeon. On the
    CPU each sample runs a forward of its own (:func:`vlfast.extraction.model.runner.runs_alone`): on that
    AMD EPYC a row's bits change with the rows beside it, in every ``MKL_CBWR`` mode. Tens of milliseconds;
    the global random state is left alone."""
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
