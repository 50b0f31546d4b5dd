"""What a ``--model`` value that names no local folder most likely meant, said as the next step to take.

vlfast never downloads: ``--model`` is a local folder or a built-in ``ref:NAME``. The two values a newcomer
types first are a Hub id (``Qwen/Qwen3-VL-4B-Instruct``) and a reference without its prefix
(``qwen3-vl-4b``); each gets the command that fixes it instead of "not found".
"""

from __future__ import annotations

import difflib
import re

# owner/name as the Hugging Face Hub spells repositories; a relative path with one slash looks the same,
# so this is only used once the path is known not to exist.
_HUB_ID = re.compile(r"[A-Za-z0-9][\w.-]*/[\w.-]+")

TINY_CHECKPOINT = "`vlfast demo-checkpoint DIR` writes a tiny offline one (random weights) to try commands on"


def missing_model_hint(spec: str, *, references: bool = True) -> str:
    """The sentence to add when ``spec`` is not an existing folder.

    ``references``: whether the command accepts ``ref:NAME`` (the tokens commands need a language model's
    weights, which the references do not have)."""
    from vlfast.models import REF_PREFIX, REFERENCES  # the error path only: keeps this module light

    key = spec.removeprefix(REF_PREFIX).lower()
    if _HUB_ID.fullmatch(spec) and not spec.startswith("."):
        local = "./" + spec.rsplit("/", 1)[1]
        return (
            f"vlfast reads local folders and downloads nothing; download it first with "
            f"`hf download {spec} --local-dir {local}`, then pass --model {local}"
        )
    if not references:
        return f"pass a local checkpoint folder with a language model; {TINY_CHECKPOINT}"
    if key in REFERENCES:
        return f"did you mean the built-in reference --model {REF_PREFIX}{key} (random weights)?"
    close = difflib.get_close_matches(key, list(REFERENCES), n=1, cutoff=0.75)
    if close:
        return f"did you mean --model {REF_PREFIX}{close[0]}? (`vlfast models` lists the references)"
    return "pass a local checkpoint folder, or ref:NAME for a built-in reference (`vlfast models` lists them)"
