"""``python -m vlfast.run train.py --lr 1e-5`` (or ``-m my_pkg.train``): run a script or module with every
transformers model patched, by :mod:`vlfast.switches.run`."""

from __future__ import annotations

from vlfast.switches.run import main

__all__ = ["main"]

if __name__ == "__main__":
    main()
