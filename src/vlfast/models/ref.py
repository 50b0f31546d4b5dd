"""What ``--model`` names, read once: :class:`ModelRef`, and the model's family (:func:`family_of`).

A spec is ``ref:NAME`` (a built-in reference) or a local checkpoint folder. Code that must tell the two apart
asks a ModelRef, never the string's prefix. Imports neither torch nor transformers.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

from vlfast.models.references import REF_PREFIX, Reference, resolve_reference

__all__ = ["Answers", "ModelRef", "family_of"]


@dataclass(frozen=True)
class ModelRef:
    """``spec`` as given; :attr:`spec` is the canonical form a run records (``ref:NAME``, or the folder's
    absolute path), :attr:`folder` the checkpoint folder (None for a reference)."""

    given: str

    @classmethod
    def of(cls, spec: str | Path | ModelRef) -> ModelRef:
        return spec if isinstance(spec, ModelRef) else cls(str(spec))

    @property
    def is_reference(self) -> bool:
        return self.given.startswith(REF_PREFIX)

    @property
    def reference(self) -> Reference:
        """The built-in reference (InputRefused naming the choices where there is none of that name)."""
        return resolve_reference(self.given)

    @property
    def label(self) -> str:
        """The name shown for it: a reference's without ``ref:``, a folder as given."""
        return self.given.removeprefix(REF_PREFIX)

    @property
    def folder(self) -> str | None:
        """The checkpoint folder as given (None for a reference): where its processor files are read."""
        return None if self.is_reference else self.given

    @property
    def spec(self) -> str:
        return self.given if self.is_reference else str(Path(self.given).resolve())

    def __str__(self) -> str:
        return self.given


class Answers(Protocol):
    """A record of what transformers answered about a model (extraction's ``ModelFacts``)."""

    def answer(self, key: str, ask: Callable[[], Any]) -> Any: ...


def family_of(model: str | ModelRef, facts: Answers | None = None) -> str:
    """The model's family (``qwen3_vl``...), from its config alone; from ``facts`` where recorded."""
    ref = ModelRef.of(model)
    if ref.is_reference:
        return ref.reference.family

    def ask() -> str:
        from vlfast.models.checkpoints import load_config

        return str(load_config(ref.given).model_type)

    return ask() if facts is None else facts.answer("model type", ask)
