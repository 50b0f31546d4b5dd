"""The zero-code switch: ``VLFAST_PATCH=1`` patches every transformers model a process builds.

A ``.pth`` file installed with vlfast calls :func:`install_from_env` at interpreter start-up when the
variable is set. Start-up must stay cheap and must not import torch or transformers, so this installs an
import hook that runs :func:`vlfast.patching.integrations.patch_transformers` right after
``transformers.modeling_utils`` is first imported. Child processes (torchrun, accelerate, DataLoader
workers) inherit the variable, so launchers the user does not control are covered.

Values: ``1``/``true``/``yes``/``on`` patch Conv3d modules; ``all`` patches every eligible Conv1d/2d/3d;
unset, empty or ``0``/``false``/``no``/``off`` leave models alone. Any other value patches nothing and
says so once on stderr: a typo must not switch on a change to the user's models.

``VLFAST_PREPROCESS=1`` (same on/off values, no ``all``) is the same kind of switch for the image half of the
processor: right after ``transformers.processing_utils`` is imported, ``ProcessorMixin.from_pretrained`` is
wrapped so that a processor loaded from a local Qwen-VL checkpoint has its torchvision image processor's calls
answered by :class:`vlfast.VisionPreprocessor` (:func:`vlfast.extraction.preprocessing.swap_image_processor`):
the same pixels, transformers' own code for any call vlfast cannot answer, both counted by ``VLFAST_RECORD``.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import os
import sys

ENV_VAR = "VLFAST_PATCH"
PREPROCESS_VAR = "VLFAST_PREPROCESS"
_TARGET = "transformers.modeling_utils"
_PREPROCESS_TARGET = "transformers.processing_utils"
_OFF = ("", "0", "false", "no", "off")
_ON = ("1", "true", "yes", "on", "all")
_warned = False
_preprocess_warned = False


def _switch(var: str, environ: dict | None, accepted: tuple[str, ...], warn) -> str | None:
    """The normalised value of switch ``var``; None when it is off or not one of ``accepted`` (then ``warn``)."""
    raw = (environ if environ is not None else os.environ).get(var, "")
    value = raw.strip().lower()
    if value in _OFF:
        return None
    if value not in accepted:
        warn(raw)
        return None
    return value


def env_setting(environ: dict | None = None) -> str | None:
    """``None`` when the switch is off (or its value is not understood), else the normalised value."""
    return _switch(ENV_VAR, environ, _ON, _warn_unknown)


def preprocess_setting(environ: dict | None = None) -> bool:
    """Whether ``VLFAST_PREPROCESS`` is on; a value not understood is off, said once on stderr."""
    return (
        _switch(PREPROCESS_VAR, environ, tuple(v for v in _ON if v != "all"), _warn_unknown_preprocess)
        is not None
    )


def _warn_unknown_preprocess(raw: str) -> None:
    global _preprocess_warned
    if not _preprocess_warned:
        _preprocess_warned = True
        print(
            f"vlfast: ignoring {PREPROCESS_VAR}={raw!r}, image processors are left as they are: use 1, true, "
            "yes or on, or 0, false, no, off",
            file=sys.stderr,
        )


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


def _activate_preprocess(value: str) -> None:
    # Runs inside the import of transformers.processing_utils: a failure here must not fail that import (the
    # user's launcher); processors then stay transformers' own, and the line says why
    try:
        from vlfast.extraction.preprocessing import install_processor_switch

        install_processor_switch()
    except Exception as e:  # noqa: BLE001 - any failure leaves transformers as it is, said
        print(
            f"vlfast: {PREPROCESS_VAR} is set but vlfast could not arm it ({type(e).__name__}: {e}): "
            "processors keep transformers' image processors",
            file=sys.stderr,
        )


class _PatchAfterImport(importlib.abc.MetaPathFinder):
    """Lets the normal finders locate ``transformers.modeling_utils`` (or, with another ``target`` and
    ``activate``, that module) and wraps its loader."""

    def __init__(self, value: str, target: str = _TARGET, activate=None) -> None:
        self.value, self.target, self.activate = value, target, activate or _activate

    def find_spec(self, fullname, path, target=None):
        if fullname != self.target:
            return None
        for finder in sys.meta_path:
            if finder is self or not hasattr(finder, "find_spec"):
                continue
            spec = finder.find_spec(fullname, path, target)
            if spec is not None and spec.loader is not None:
                spec.loader = _Loader(spec.loader, self.value, self.activate)
                return spec
        return None


class _Loader(importlib.abc.Loader):
    def __init__(self, inner, value: str, activate=_activate) -> None:
        self.inner, self.value, self.activate = inner, value, activate

    def create_module(self, spec):
        return self.inner.create_module(spec)

    def exec_module(self, module):
        self.inner.exec_module(module)
        self.activate(self.value)


def _arm_preprocess() -> None:
    if not preprocess_setting():
        return
    if _PREPROCESS_TARGET in sys.modules:
        _activate_preprocess("1")
    elif not any(getattr(f, "target", None) == _PREPROCESS_TARGET for f in sys.meta_path):
        sys.meta_path.insert(0, _PatchAfterImport("1", _PREPROCESS_TARGET, _activate_preprocess))


def install_from_env() -> bool:
    """Arm the switch if ``VLFAST_PATCH`` says so, ``VLFAST_PREPROCESS``'s, and ``VLFAST_RECORD``'s count of
    what ran (:mod:`vlfast.patching.record`); returns whether the patch switch was armed. Safe to call twice."""
    from vlfast.patching import record

    record.install_from_env()
    _arm_preprocess()
    value = env_setting()
    if value is None:
        return False
    if _TARGET in sys.modules:  # transformers already loaded (e.g. called late): patch now
        _activate(value)
        return True
    if not any(getattr(f, "target", None) == _TARGET for f in sys.meta_path):
        sys.meta_path.insert(0, _PatchAfterImport(value))
    return True
