"""Extraction benchmarks, one script with modes: ``python benchmarks/extract.py MODE [ARGS]``.

- ``pipeline``: ``extract`` against the tower's forward alone and the naive per-sample loop (one process);
- ``ab``: the naive loop against ``vlfast extract`` in fresh processes, alternating;
- ``alone``: a forward per sample against one per batch on the CPU;
- ``e2e-images``: ``vlfast extract`` against the report's DataLoader loop on HD JPEGs, whole processes;
- ``memory``: FeatureStore's peak memory at 10x the samples;
- ``llm-memory``: peak memory of ``--features llm`` with hooks against ``output_hidden_states``;
- ``read``: FeatureCache reads and the "nothing to do" checks;
- ``scale``: the store's bookkeeping as samples grow (local and S3 on moto);
- ``storage``: local folder, ``file://``, fsspec and S3 OUTs;
- ``store``: what integrity costs (writes, reads, resume checks, verify);
- ``fingerprint``: the weights fingerprint on a Qwen3-VL-4B-sized checkpoint.

Each mode's code is ``benchmarks/modes/<name>.py``; ``python benchmarks/extract.py MODE --help`` gives its options.
"""

from __future__ import annotations

import harness

MODES = {
    "pipeline": "extract_pipeline",
    "ab": "extract_ab",
    "alone": "extract_alone",
    "e2e-images": "e2e_images",
    "memory": "extract_memory",
    "llm-memory": "llm_features_memory",
    "read": "extract_read",
    "scale": "extract_scale",
    "storage": "extract_storage",
    "store": "extract_store",
    "fingerprint": "fingerprint",
}

if __name__ == "__main__":
    harness.run_mode(MODES, __doc__)
