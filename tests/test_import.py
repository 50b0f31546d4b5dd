"""`import vlfast` stays cheap: no CUDA initialisation, no heavy optional packages."""

from __future__ import annotations

import subprocess
import sys

HEAVY = ["transformers", "pyarrow", "av", "PIL", "safetensors", "matplotlib", "typer", "rich", "ray"]


def test_import_is_cheap_and_does_not_touch_cuda():
    code = (
        "import sys, torch\n"
        "def boom(*a, **k): raise RuntimeError('CUDA touched during import')\n"
        "torch.cuda.init = boom; torch.cuda.current_device = boom; torch.cuda._lazy_init = boom\n"
        "import vlfast, vlfast.patching.gemm, vlfast.extraction\n"
        f"heavy = [m for m in {HEAVY!r} if m in sys.modules]\n"
        "print('HEAVY', heavy)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert "HEAVY []" in out.stdout, out.stdout


def test_public_surface():
    import vlfast

    for name in ("patch", "unpatch", "is_patched", "verify", "patch_transformers", "discover_families"):
        assert callable(getattr(vlfast, name)), name
    assert "patch" in dir(vlfast)
    try:
        vlfast.nope  # noqa: B018
    except AttributeError as e:
        assert "nope" in str(e)
    else:
        raise AssertionError("unknown attribute did not raise")


def test_the_top_level_holds_the_capability_packages_and_little_else():
    """The tree reads like the README: a new module goes into the capability it serves."""
    from pathlib import Path

    import vlfast

    root = Path(vlfast.__file__).parent
    modules = {p.stem for p in root.glob("*.py")}
    packages = {p.name for p in root.iterdir() if (p / "__init__.py").exists()}
    top_packages = "patching diagnosis extraction tokens cli models pixels switches"
    assert packages == set(top_packages.split())
    # errors: the refusals every capability raises, a leaf that imports nothing of ours; dtypes: the one
    # policy for --dtype that every command shares; demo: the offline checkpoint and media the demo commands,
    # tests and benchmarks use; _lazy: the lazy public names of the package faces; numerics: the process-wide
    # steps for the same bits every run (MKL's vector math set up on one thread, the row check) that both
    # extraction and verify take; limits: the range of every numeric option, which the CLI and the library
    # check alike (as dtypes for --dtype). The models package holds the references, checkpoint folders and towers
    top = "__init__ _files _lazy demo dtypes errors limits numerics run"
    assert modules == set(top.split())


def test_the_autopatch_hook_imports_no_torch():
    """The .pth hook runs at every interpreter start: its import path must stay free."""
    code = "import sys, vlfast.switches.patch; print('TORCH', 'torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert "TORCH False" in out.stdout, out.stdout


def test_what_a_finished_out_needs_imports_no_torch_nor_transformers():
    """`vlfast extract` answers a finished OUT without torch and transformers (issue 39): the command, the
    configuration, the plan and the local engine's face load neither; they load with the model, when there
    is work (tests/test_extract_facts.py runs the whole command)."""
    code = (
        "import sys\n"
        "import vlfast.cli.main, vlfast.extraction.api, vlfast.extraction.plan, vlfast.extraction.engines.local\n"
        "from vlfast.extraction.config import ExtractConfig\n"
        "ExtractConfig(model='ref:qwen3-vl-2b', device='cpu', dtype='bf16', store_dtype='float16')\n"
        "print('LOADED', [m for m in ('torch', 'transformers') if m in sys.modules])\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert "LOADED []" in out.stdout, out.stdout
