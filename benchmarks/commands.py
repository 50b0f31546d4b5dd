"""vlfast's own commands and first calls, one script with modes: ``python benchmarks/commands.py MODE [ARGS]``.

- ``doctor``: ``vlfast doctor``'s wall time, quiet and busy, native and AVX2, and its probe against patch_embed.py;
- ``contention``: ``vlfast profile``'s gain under load;
- ``tokens-audit``: ``vlfast tokens audit``'s time and memory;
- ``vector-math``: MKL's vector math on its first call (how often it differs).

Start-up of whole commands is ``benchmarks/startup.py``. Each mode's code is ``benchmarks/modes/<name>.py``;
``python benchmarks/commands.py MODE --help`` gives its options.
"""

from __future__ import annotations

import harness

MODES = {
    "doctor": "doctor_speed",
    "contention": "profile_contention",
    "tokens-audit": "tokens_audit",
    "vector-math": "vector_math_first_call",
}

if __name__ == "__main__":
    harness.run_mode(MODES, __doc__)
