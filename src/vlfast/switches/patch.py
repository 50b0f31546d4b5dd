"""The zero-code switches, armed at interpreter start-up: ``VLFAST_PATCH=1`` patches every transformers model a
process builds, ``VLFAST_PREPROCESS=1`` answers Qwen-VL image processors' calls with vlfast's pixels, and
``VLFAST_RECORD`` counts what ran (:mod:`vlfast.switches.record`).

A ``.pth`` file installed with vlfast calls :func:`install_from_env` at interpreter start-up when one of the
variables is set. Start-up must stay cheap and must not import torch or transformers, so this installs an
import hook (:mod:`vlfast.switches.hook`) that runs :func:`vlfast.patching.integrations.patch_transformers`
right after ``transformers.modeling_utils`` is first imported (``VLFAST_PREPROCESS``: its switch, after
``transformers.processing_utils``). Child processes inherit the variables, so launchers the user does not
control are covered. What each value means: :mod:`vlfast.switches.env`.
"""

from __future__ import annotations

import sys

from vlfast.switches.env import PREPROCESS_VAR, env_setting, preprocess_setting
from vlfast.switches.hook import after_import

__all__ = ["install_from_env"]

_TARGET = "transformers.modeling_utils"
_PREPROCESS_TARGET = "transformers.processing_utils"


def _activate(value: str) -> None:
    from vlfast.patching.integrations import patch_transformers

    patch_transformers(all_convs=value == "all")


def _activate_preprocess(value: str) -> None:
    # Runs inside the import of transformers.processing_utils: a failure here must not fail that import
    try:
        from vlfast.switches.preprocess import install_processor_switch

        install_processor_switch()
    except Exception as e:  # noqa: BLE001 - any failure leaves transformers as it is, said
        print(
            f"vlfast: {PREPROCESS_VAR} is set but vlfast could not arm it ({type(e).__name__}: {e}): "
            "processors keep transformers' image processors",
            file=sys.stderr,
        )


def _arm_preprocess() -> None:
    if preprocess_setting():
        after_import(_PREPROCESS_TARGET, "1", _activate_preprocess)


def install_from_env() -> bool:
    """Arm the switch if ``VLFAST_PATCH`` says so, ``VLFAST_PREPROCESS``'s, and ``VLFAST_RECORD``'s count;
    returns whether the patch switch was armed. Safe to call twice."""
    from vlfast.switches import record

    record.install_from_env()
    _arm_preprocess()
    value = env_setting()
    if value is None:
        return False
    after_import(_TARGET, value, _activate)  # transformers already loaded (e.g. called late): patched now
    return True
