"""MKL's summation order, kept one whatever the thread count and the rows of a product (vlfast.cli).

Found on an Intel Xeon with AVX-512: features extracted by torchrun ranks (OMP_NUM_THREADS=1), Ray actors
(one thread) or with other batch sizes differed in their last bits from a 2-thread, batched run's, so the
bit-for-bit comparisons of resumed and re-engined runs failed although no sample was mishandled."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

PROBE = """
import json, os, sys
import vlfast.cli  # sets what the CLI sets before torch loads
import torch
torch.manual_seed(0)
a, b = torch.randn(37, 1536), torch.randn(1536, 1024)
out = {}
for threads in (1, 2):
    torch.set_num_threads(threads)
    out[threads] = a @ b
one_row = a[:1] @ b
print(json.dumps({
    "env": os.environ.get("MKL_CBWR"),
    "threads_equal": torch.equal(out[1], out[2]),
    "rows_equal": torch.equal(one_row, out[2][:1]),
}))
"""


def _cpu_vendor() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            return next((line for line in f if line.startswith("vendor_id")), "")
    except OSError:
        return ""


def _probe(env: dict[str, str]) -> dict:
    clean = {k: v for k, v in os.environ.items() if k != "MKL_CBWR"} | env
    done = subprocess.run(
        [sys.executable, "-c", PROBE], env=clean, capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stderr[-2000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def _strict_mode_holds_here() -> bool:
    """Whether MKL's strict mode keeps products' bits across thread counts on this CPU (this process has
    MKL_CBWR set before torch loaded, conftest.py): on Intel CPUs it does, and on the 2-core AMD EPYC (Zen 4)
    at 1 and 2 threads; where it does not, vlfast warns."""
    from vlfast.numerics import threads_keep_their_bits

    return threads_keep_their_bits()


def test_the_cli_package_sets_mkl_strict_mode_before_torch_loads():
    got = _probe({})
    assert got["env"] == "AUTO,STRICT"
    if _strict_mode_holds_here():  # a row's bits beside other rows: not kept on an AMD EPYC, not needed
        assert got["threads_equal"]


def test_a_users_own_setting_is_kept():
    assert _probe({"MKL_CBWR": "COMPATIBLE"})["env"] == "COMPATIBLE"


def test_too_late_once_torch_is_imported(monkeypatch):
    import torch  # noqa: F401  (the suite's process has it)

    from vlfast import cli

    monkeypatch.delenv("MKL_CBWR", raising=False)
    assert cli.same_bits_for_any_thread_count() is False and "MKL_CBWR" not in os.environ


def test_without_it_this_cpu_may_differ():
    """Why it is set: where MKL's default order depends on threads or rows here, the probe shows it (an
    AMD or AVX2 machine may agree either way; then there is nothing to show)."""
    probe = PROBE.replace("import vlfast.cli  # sets what the CLI sets before torch loads\n", "")
    clean = {k: v for k, v in os.environ.items() if k != "MKL_CBWR"}
    done = subprocess.run(
        [sys.executable, "-c", probe], env=clean, capture_output=True, text=True, timeout=120
    )
    got = json.loads(done.stdout.strip().splitlines()[-1])
    if got["threads_equal"] and got["rows_equal"]:
        pytest.skip("MKL's default order already depends on neither threads nor rows on this CPU")
    assert got["env"] is None


def test_ray_workers_get_what_every_command_sets_for_itself():
    """The Ray engine's worker environment repeats the CLI's (the library cannot import the CLI): kept equal."""
    from vlfast.cli import SAME_BITS_ENV
    from vlfast.extraction.engines.ray import ENV

    assert SAME_BITS_ENV.items() <= ENV.items() and ENV["OMP_WAIT_POLICY"] == "PASSIVE"


def test_an_api_caller_without_it_is_told(monkeypatch):
    """``vlfast.extract`` from a user's own Python on CPU: without MKL_CBWR the local engine says what may
    differ and how to set it (once it has work, before the model loads: ``cpu_warnings``); with it, or on a
    torch without MKL, it says nothing."""
    import warnings

    import torch

    from vlfast.extraction.config import ExtractConfig
    from vlfast.extraction.engines.base import Hooks
    from vlfast.extraction.engines.local import LocalEngine

    config = ExtractConfig(model="ref:qwen3-vl-2b", device="cpu", num_workers=0)
    monkeypatch.delenv("MKL_CBWR", raising=False)
    keeps = Hooks(bits_probe=lambda: True)  # a CPU whose products keep their bits: the MKL_CBWR note alone
    with monkeypatch.context() as mp:
        mp.setattr(torch.backends.mkl, "is_available", lambda: True)
        with pytest.warns(RuntimeWarning, match="MKL_CBWR=AUTO,STRICT set before torch is imported"):
            LocalEngine(keeps).cpu_warnings(config)
        mp.setattr(torch.backends.mkl, "is_available", lambda: False)  # e.g. an aarch64 build
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            LocalEngine(keeps).cpu_warnings(config)
    monkeypatch.setenv("MKL_CBWR", "AUTO,STRICT")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        LocalEngine(Hooks(bits_probe=lambda: True)).cpu_warnings(config)  # this test is about MKL_CBWR alone


# ------------------------------------------------------------------ MKL's vector math, set up on one thread


def test_settle_vector_math_calls_each_function_on_one_element_once_per_process():
    """One element is never split between threads: each VML function is first used by this thread alone.
    (The race it prevents is inside MKL and comes and goes with the machine's state: 6 of 42 fresh runs one
    hour, none of 34 the next; counted by benchmarks/commands.py vector-math, not by a test.)"""
    probe = """
import json, torch
from torch.overrides import TorchFunctionMode
import vlfast.numerics as n
calls = []
class Spy(TorchFunctionMode):
    def __torch_function__(self, func, types, args=(), kwargs=None):
        name = getattr(func, "__name__", "")
        if name in n.VECTOR_MATH_OPS:
            calls.append([name, str(args[0].dtype), args[0].numel()])
        return func(*args, **(kwargs or {}))
with Spy():
    first, again = n.settle_vector_math(), n.settle_vector_math()
print(json.dumps({"first": first, "again": again, "calls": calls}))
"""
    done = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    got = json.loads(done.stdout.strip().splitlines()[-1])
    from vlfast.numerics import VECTOR_MATH_OPS

    assert got["first"] is True and got["again"] is False
    expected = {(op, dtype, 1) for op in VECTOR_MATH_OPS for dtype in ("torch.float32", "torch.float64")}
    assert {tuple(c) for c in got["calls"]} == expected and len(got["calls"]) == len(expected)


def test_extraction_and_verify_settle_vector_math_before_a_model_runs(monkeypatch, tiny_qwen3_vl):
    import torch

    import vlfast.numerics
    from vlfast.diagnosis.verification import verify
    from vlfast.extraction.model import runner
    from vlfast.extraction.model.features import FeatureSpec
    from vlfast.models import build_reference

    seen = []
    monkeypatch.setattr(vlfast.numerics, "settle_vector_math", lambda: seen.append("settled") or True)
    runner.load(
        str(tiny_qwen3_vl),
        "qwen3_vl",
        FeatureSpec(names=("vision",)),
        torch.device("cpu"),
        torch.float32,
        True,
    )
    assert seen == ["settled"]
    verify(build_reference("qwen3-vl-4b", tiny=True), grids=[(1, 2, 2)], n_windows=8, backward=False)
    assert seen == ["settled", "settled"]


# ------------------------------------------------- a row's bits whatever else is in the product, measured


def test_threads_keep_their_bits_here_and_the_probe_sees_products_that_do_not(monkeypatch):
    """True on an Intel CPU with MKL_CBWR set before torch loaded (conftest.py), where this measurement and
    a direct one agree; False for a product whose bits change with the thread count. A product whose rows
    change with the rows beside it (MKL's on an AMD EPYC, Zen 4, in every MKL_CBWR mode) is not a problem any
    more: on the CPU each sample runs a forward of its own (runner.runs_alone)."""
    import torch
    import torch.nn.functional as F

    from vlfast.numerics import threads_keep_their_bits

    state = torch.random.get_rng_state()
    threads = torch.get_num_threads()
    here = threads_keep_their_bits()
    assert torch.equal(torch.random.get_rng_state(), state)  # the caller's random stream is untouched
    assert torch.get_num_threads() == threads  # restored
    gen = torch.Generator().manual_seed(5)
    a, w = torch.randn(190, 1024, generator=gen), torch.randn(1024, 1024, generator=gen)
    at_threads = F.linear(a, w)
    torch.set_num_threads(1 if threads > 1 else 2)
    try:
        direct = torch.equal(F.linear(a, w), at_threads)
    finally:
        torch.set_num_threads(threads)
    if "GenuineIntel" in _cpu_vendor():
        assert here  # MKL's strict mode on an Intel CPU
    if not direct:
        assert not here  # a difference seen directly is never missed
    real = F.linear
    monkeypatch.setattr(F, "linear", lambda x, w, b: real(x, w, b) + 1e-6 * (torch.get_num_threads() == 1))
    assert not threads_keep_their_bits()
    assert torch.get_num_threads() == threads  # restored
    monkeypatch.setattr(F, "linear", lambda x, w, b: real(x, w, b) + 1e-6 * (torch.get_num_threads() == 2))
    assert not threads_keep_their_bits()  # at one thread itself, the probe runs two
    if here:  # rows that vary with their neighbours, the same at every thread count: not a problem
        monkeypatch.setattr(F, "linear", lambda x, w, b: real(x, w, b) * (1 + 1e-6 * (x.shape[0] % 3)))
        assert threads_keep_their_bits()


def test_a_cpu_whose_products_change_with_the_thread_count_is_reported(monkeypatch):
    import warnings

    from vlfast.extraction.config import ExtractConfig
    from vlfast.extraction.engines.base import Hooks
    from vlfast.extraction.engines.local import LocalEngine

    config = ExtractConfig(model="ref:qwen3-vl-2b", device="cpu", num_workers=0)
    monkeypatch.setenv("MKL_CBWR", "AUTO,STRICT")
    with pytest.warns(
        RuntimeWarning, match="other bits at another thread count.*not AMD's.*keep OMP_NUM_THREADS"
    ):
        LocalEngine(Hooks(bits_probe=lambda: False)).cpu_warnings(config)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        LocalEngine(Hooks(bits_probe=lambda: True)).cpu_warnings(config)
    if _strict_mode_holds_here():  # the real probe, on this suite's CPU (the test above)
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            LocalEngine().cpu_warnings(config)
    else:  # products that change with the thread count here: the real probe says so
        with pytest.warns(RuntimeWarning, match="other bits at another thread count"):
            LocalEngine().cpu_warnings(config)
    # A Ray model actor measures its own CPU and the driver says so: tests/test_extract_ray.py
