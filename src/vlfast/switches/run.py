"""Run a Python script or module with every transformers model patched.

    python -m vlfast.run train.py --lr 1e-5
    python -m vlfast.run -m my_pkg.train --lr 1e-5
    torchrun --nproc_per_node 8 -m vlfast.run train.py ...
    accelerate launch -m vlfast.run train.py ...

Equivalent to putting ``vlfast.patch_transformers()`` at the top of the script. ``--all-convs`` also patches
stride == kernel Conv1d/Conv2d. Setting ``VLFAST_PATCH=1`` in the environment does the same without
changing the command line.
"""

from __future__ import annotations

import importlib.util
import os
import runpy
import sys
from typing import NoReturn

USAGE = "usage: python -m vlfast.run [--all-convs] (SCRIPT.py | -m MODULE) [ARGS ...]"


def _fail(message: str) -> NoReturn:
    """One line on stderr and exit 2, as ``python missing.py`` does (a traceback would point into vlfast)."""
    print(f"vlfast.run: error: {message}", file=sys.stderr)
    raise SystemExit(2)


def _check_module(name: str) -> None:
    try:
        spec = importlib.util.find_spec(name)
    except ModuleNotFoundError as e:
        if e.name is None or not (name + ".").startswith(e.name + "."):
            raise  # a package that exists failed to import: its traceback is the answer
        spec = None
    if spec is None:
        _fail(f"no module named {name!r}")


def main(argv: list[str] | None = None) -> None:
    args = list(sys.argv[1:] if argv is None else argv)
    all_convs = False
    while args and args[0] == "--all-convs":
        all_convs = True
        args.pop(0)
    if not args or args[0] in ("-h", "--help"):
        print(USAGE + "\n\n" + (__doc__ or "").strip(), file=sys.stderr if not args else sys.stdout)
        raise SystemExit(2 if not args else 0)
    if args[0] == "-m" and len(args) < 2:
        raise SystemExit(USAGE)
    if args[0] != "-m" and not os.path.exists(args[0]):
        _fail(f"cannot run {args[0]!r}: no such file")
    from vlfast.patching.integrations import patch_transformers

    patch_transformers(all_convs=all_convs)
    if args[0] == "-m":
        _check_module(args[1])  # after patching: finding a submodule imports its packages
        sys.argv = [args[1], *args[2:]]
        runpy.run_module(args[1], run_name="__main__", alter_sys=True)
    else:
        sys.argv = list(args)
        sys.path.insert(0, os.path.dirname(os.path.abspath(args[0])))  # as `python script.py` does
        runpy.run_path(args[0], run_name="__main__")
