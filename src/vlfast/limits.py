"""The range each numeric option of vlfast takes, as data keyed by flag, and the one check that reads it.

The CLI checks each value as a command parses its options (``cli._common.HelpCommand``) and the library
where the values enter it (``ExtractConfig``), so a script and a command agree. NaN, an infinity, a wrong
type or a value past either end is refused (InputRefused naming the flag and both ends, exit 2). The ends
are wide on purpose: they keep out what no run can mean (a frame rate of 1e30, a zero batch), never a
choice a user could make.
"""

from __future__ import annotations

import math
import numbers
from dataclasses import dataclass

from vlfast.errors import InputRefused

__all__ = ["LIMITS", "Limit", "check"]


@dataclass(frozen=True)
class Limit:
    """``low`` to ``high``, both included unless ``above_low``; whole numbers only if ``integer``."""

    low: float
    high: float
    integer: bool = True
    above_low: bool = False  # ``low`` itself is refused: a rate or a share of a CPU must be above 0
    meaning: str = ""  # what the number is, and what its ends mean, e.g. "seconds; 0 = no limit"

    def describe(self) -> str:
        """The range in words: "an integer from 1 to 16,777,216", "a number above 0 and at most 1,000"."""
        kind = "an integer" if self.integer else "a number"
        low, high = f"{self.low:,}", f"{self.high:,}"
        text = f"{kind} above {low} and at most {high}" if self.above_low else f"{kind} from {low} to {high}"
        return f"{text} ({self.meaning})" if self.meaning else text

    def check(self, value: object, name: str) -> int | float:
        """``value`` if it is within the limit; else InputRefused naming ``name``."""
        ok = isinstance(value, numbers.Real) and not isinstance(value, bool)
        ok = ok and (isinstance(value, numbers.Integral) or not self.integer)
        if ok:
            x = float(value) if not isinstance(value, numbers.Integral) else value
            ok = (not isinstance(x, float) or math.isfinite(x)) and self.low <= x <= self.high
            ok = ok and not (self.above_low and x == self.low)
        if not ok:
            raise InputRefused(f"{name} must be {self.describe()}, got {value!r}")
        return value  # type: ignore[return-value]


_SECONDS_A_DAY = 86_400
# PIL refuses images over 2 x Image.MAX_IMAGE_PIXELS (178,956,970 pixels), so no image budget above 2**28
# can be reached; the smallest one is a budget too, as every image is resized up to it.
_IMAGE_PIXELS = 2**28
_COUNT = 10**12  # samples, errors: more than any run holds

LIMITS: dict[str, Limit] = {
    # vlfast extract: what is computed
    "--dim": Limit(64, 65_536, meaning="dimensions, at most the model's width"),
    "--fps": Limit(0, 1_000, integer=False, above_low=True, meaning="frames per second sampled"),
    "--num-frames": Limit(1, 16_384, meaning="frames per video"),
    "--min-pixels": Limit(1, _IMAGE_PIXELS, meaning="pixels; every image is resized up to it"),
    "--max-pixels": Limit(1, _IMAGE_PIXELS, meaning="pixels"),
    # a video's budget is over all its frames: 768 frames of 1080p are 1.6e9 pixels
    "--video-max-pixels": Limit(1, 2**31, meaning="pixels over all frames"),
    # vlfast extract: how it runs
    "--batch-tokens": Limit(1, 2**24, meaning="patches per forward"),
    "--workers": Limit(0, 256, meaning="processes; 0 decodes in the main process"),
    "--decode-timeout": Limit(0, _SECONDS_A_DAY, integer=False, meaning="seconds; 0 = no limit"),
    "--commit-every": Limit(0, _SECONDS_A_DAY, integer=False, meaning="seconds; 0 = by size only"),
    "--max-errors": Limit(0, _COUNT, meaning="samples"),
    "--rank": Limit(0, 2**20 - 1, meaning="below --world-size"),
    "--world-size": Limit(1, 2**20, meaning="ranks"),
    "--ray-workers": Limit(1, 4_096, meaning="model actors"),
    "--num-gpus-per-worker": Limit(0, 64, integer=False, meaning="GPUs per model actor; 0 = CPU"),
    "--ray-cpus-per-worker": Limit(0, 1_024, integer=False, above_low=True, meaning="CPUs per model actor"),
    # doctor, profile, verify
    "--patches": Limit(1, 2**20, meaning="patches per sample"),
    "--budget": Limit(0.1, _SECONDS_A_DAY, integer=False, meaning="seconds"),
    "--warmup": Limit(0, 1_000, meaning="forwards"),
    "--repeats": Limit(1, 1_000, meaning="forwards"),
    "--windows": Limit(1, 2**20, meaning="patches per layer check"),
    # numbers inside text options: profile --batch 1,2,4 --frames 2,8 --size HxW, verify --grid TxHxW
    "--batch": Limit(1, 1_024, meaning="clips per forward"),
    "--frames": Limit(1, 16_384, meaning="frames per clip"),
    "--size": Limit(1, 16_384, meaning="pixels per side"),
    "--grid": Limit(1, 4_096, meaning="patches per side"),
}


def check(flag: str, value: object, keyword: str | None = None) -> int | float:
    """``value`` checked against ``LIMITS[flag]``; the message names ``keyword (flag)`` if given."""
    return LIMITS[flag].check(value, f"{keyword} ({flag})" if keyword else flag)
