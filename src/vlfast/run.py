"""Run a Python script or module with every transformers model patched: ``python -m vlfast.run``, the entry
point the docs name; its work is :mod:`vlfast.switches.run`'s.

    python -m vlfast.run train.py --lr 1e-5
    python -m vlfast.run -m my_pkg.train --lr 1e-5
"""

from __future__ import annotations

from vlfast.switches.run import main

__all__ = ["main"]

if __name__ == "__main__":
    main()
