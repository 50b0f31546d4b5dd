"""Input lists and exports, one script with modes: ``python benchmarks/inputs.py MODE [ARGS]``.

- ``check``: the full check of recorded inputs, per file;
- ``memory``: a run's input list (manifest, WebDataset) in memory and time as entries grow;
- ``kept``: a resume's manifest read, parsed again or from the table kept in OUT;
- ``webdataset``: listing WebDataset shards, local and on S3 (moto);
- ``export``: ``vlfast export``'s memory and time against the number of samples.

Each mode's code is ``benchmarks/modes/<name>.py``; ``python benchmarks/inputs.py MODE --help`` gives its options.
"""

from __future__ import annotations

import harness

MODES = {
    "check": "input_check",
    "memory": "input_memory",
    "kept": "kept_manifest",
    "webdataset": "webdataset_listing",
    "export": "export_memory",
}

if __name__ == "__main__":
    harness.run_mode(MODES, __doc__)
