"""Which weights a run used: a content hash of the tensors its features depend on, recorded in run.json.

A new fine-tune saved into the same checkpoint folder keeps the path, the config and every tensor's name,
dtype and shape: only the bytes change. So the fingerprint hashes the bytes (xxh3-128 through a memory map,
~14 GB/s from the page cache), before the model is built, of the tensors the features read only: the
vision tower's for vision features, every tensor plus the tokenizer and config files for ``llm`` features.

A reference tower (``ref:NAME``) has no files: its fingerprint is the recipe (name, seed) and the torch and
transformers versions whose initialisers make its weights.
"""

from __future__ import annotations

import contextlib
import mmap
import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from vlfast.errors import InputRefused
from vlfast.models.ref import ModelRef

# Files beside the weights that change what an ``llm`` feature is (prompt tokens, chat template, config).
_LLM_FILES = (
    "config.json",
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "added_tokens.json",
    "vocab.json",
    "merges.txt",
    "chat_template.jinja",
    "chat_template.json",
)


def weights_fingerprint(
    model: str,
    *,
    whole: bool,
    tower_names: Sequence[str] | None = None,
    torch_version: str | None = None,
) -> dict[str, Any]:
    """The ``weights`` entry of a run configuration for ``model`` (a checkpoint directory or ``ref:NAME``).

    ``whole``: the features read the whole model (``llm``), not only the vision tower. Recorded answers
    (:class:`~vlfast.extraction.store.facts.ModelFacts`) may be given: ``tower_names``, the vision tower's
    tensor names (else the tower is built on the meta device); ``torch_version`` (else torch is imported).
    """
    if ModelRef.of(model).is_reference:
        from importlib import metadata

        if torch_version is None:
            import torch

            torch_version = str(torch.__version__)
        return {
            "scope": "reference",
            "name": model,
            "seed": 0,
            "torch": torch_version,
            "transformers": metadata.version("transformers"),
        }
    from vlfast.models.checkpoints import safetensors_files, tensor_locations

    path = Path(model)
    if whole:
        selected: dict[Path, list[str] | None] = dict.fromkeys(safetensors_files(path))
    else:
        if tower_names is None:
            from vlfast.models import tower_tensor_names

            tower_names = tower_tensor_names(path)
        selected = {}
        for file, key in tensor_locations(path, tower_names).values():
            selected.setdefault(file, []).append(key)
    digest, tensors, nbytes = hash_tensors(selected)
    out: dict[str, Any] = {
        "scope": "whole model" if whole else "vision tower",
        "scheme": "xxh3_128 over (name, dtype, shape, bytes) of each tensor, sorted by name",
        "tensors": tensors,
        "bytes": nbytes,
        "xxh3_128": digest,
    }
    if whole:
        import xxhash

        out["files"] = {
            name: xxhash.xxh3_128_hexdigest((path / name).read_bytes())
            for name in _LLM_FILES
            if (path / name).is_file()
        }
    return out


def hash_tensors(selected: dict[Path, list[str] | None]) -> tuple[str, int, int]:
    """(xxh3-128 digest, tensor count, bytes) over the named tensors of each safetensors file (all if None),
    hashed on a few threads (xxhash releases the GIL; from a cold page cache ~1.4x faster than one)."""
    from concurrent.futures import ThreadPoolExecutor

    import xxhash

    from vlfast.extraction.store.format import canonical_json, read_header

    jobs: list[tuple[str, str, list[int], Any, int, int]] = []  # name, dtype, shape, map, start, end
    with contextlib.ExitStack() as stack:
        for file, keys in selected.items():
            f = stack.enter_context(open(file, "rb"))
            size = os.fstat(f.fileno()).st_size
            try:
                data_start, _, header = read_header(f, size)
            except ValueError as e:
                raise InputRefused(f"{file} is not a readable safetensors file ({e})") from None
            names = [k for k in header if k != "__metadata__"] if keys is None else keys
            mm = stack.enter_context(mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)) if size else b""
            for name in names:
                entry = header[name]
                start, end = entry["data_offsets"]
                if data_start + end > size:
                    raise InputRefused(f"{file}: tensor {name!r} runs past the end of the file (truncated?)")
                jobs.append(
                    (name, entry["dtype"], list(entry["shape"]), mm, data_start + start, data_start + end)
                )

        def digest(job: tuple) -> str:
            with memoryview(job[3]) as view:  # released at once, so the map can close
                return xxhash.xxh3_128_hexdigest(view[job[4] : job[5]])

        with ThreadPoolExecutor(max_workers=min(4, os.cpu_count() or 1)) as pool:
            digests = list(pool.map(digest, jobs))
    entries = sorted((job[0], job[1], job[2], d) for job, d in zip(jobs, digests))
    nbytes = sum(job[5] - job[4] for job in jobs)
    return xxhash.xxh3_128_hexdigest(canonical_json(entries).encode()), len(entries), nbytes
