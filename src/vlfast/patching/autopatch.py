"""The zero-code switch: ``VLFAST_PATCH=1`` patches every transformers model a process builds.

A ``.pth`` file installed with vlfast calls :func:`install_from_env` at interpreter start-up when the
variable is set. Start-up must stay cheap and must not import torch or transformers, so this installs an
import hook that runs :func:`vlfast.patching.integrations.patch_transformers` right after
``transformers.modeling_utils`` is first imported. Child processes (torchrun, accelerate, DataLoader
workers) inherit the variable, so launchers the user does not control are covered.

Values: ``1``/``true``/``yes``/``on`` patch Conv3d modules; ``all`` patches every eligible Conv1d/2d/3d;
unset, empty or ``0``/``false``/``no``/``off`` leave models alone. Any other value patches nothing and
says so once on stderr: a typo must not switch on a change to the user's models.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import os
import sys

ENV_VAR = "VLFAST_PATCH"
_TARGET = "transformers.modeling_utils"
_OFF = ("", "0", "false", "no", "off")
_ON = ("1", "true", "yes", "on", "all")
_warned = False


def env_setting(environ: dict | None = None) -> str | None:
    """``None`` when the switch is off (or its value is not understood), else the normalised value."""
    raw = (environ if environ is not None else os.environ).get(ENV_VAR, "")
    value = raw.strip().lower()
    if value in _OFF:
        return None
    if value not in _ON:
        _warn_unknown(raw)
        return None
    return value


def _warn_unknown(raw: str) -> None:
    global _warned
    if not _warned:
        _warned = True
        print(
            f"vlfast: ignoring {ENV_VAR}={raw!r}, nothing is patched: use 1, true, yes or on (Conv3d), "
            f"all (every eligible conv), or 0, false, no, off",
            file=sys.stderr,
        )


def _activate(value: str) -> None:
    from vlfast.patching.integrations import patch_transformers

    patch_transformers(all_convs=value == "all")


class _PatchAfterImport(importlib.abc.MetaPathFinder):
    """Lets the normal finders locate ``transformers.modeling_utils`` and wraps its loader."""

    def __init__(self, value: str) -> None:
        self.value = value

    def find_spec(self, fullname, path, target=None):
        if fullname != _TARGET:
            return None
        for finder in sys.meta_path:
            if finder is self or not hasattr(finder, "find_spec"):
                continue
            spec = finder.find_spec(fullname, path, target)
            if spec is not None and spec.loader is not None:
                spec.loader = _Loader(spec.loader, self.value)
                return spec
        return None


class _Loader(importlib.abc.Loader):
    def __init__(self, inner, value: str) -> None:
        self.inner, self.value = inner, value

    def create_module(self, spec):
        return self.inner.create_module(spec)

    def exec_module(self, module):
        self.inner.exec_module(module)
        _activate(self.value)


def install_from_env() -> bool:
    """Arm the switch if ``VLFAST_PATCH`` says so, and ``VLFAST_RECORD``'s count of what ran
    (:mod:`vlfast.patching.record`); returns whether the patch switch was armed. Safe to call twice."""
    from vlfast.patching import record

    record.install_from_env()
    value = env_setting()
    if value is None:
        return False
    if _TARGET in sys.modules:  # transformers already loaded (e.g. called late): patch now
        _activate(value)
        return True
    if not any(isinstance(f, _PatchAfterImport) for f in sys.meta_path):
        sys.meta_path.insert(0, _PatchAfterImport(value))
    return True
