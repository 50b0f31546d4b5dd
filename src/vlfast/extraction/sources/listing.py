"""What a run extracts: :func:`load_inputs`, the one entry point that names the source for an INPUT."""

from __future__ import annotations

import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from vlfast.errors import InputRefused
from vlfast.extraction.objstore import is_url
from vlfast.extraction.sources.folder import load_folder
from vlfast.extraction.sources.kept import KeptListings, manifest_identity
from vlfast.extraction.sources.manifest import load_manifest, row_sample
from vlfast.extraction.sources.remote import load_url, manifest_samples, with_remote
from vlfast.extraction.sources.sample import (
    IMAGE_SUFFIXES,
    MANIFEST_SUFFIXES,
    SUPPORTED,
    VIDEO_SUFFIXES,
    InputProblem,
    Sample,
    display_path,
    kind_of,
    require_samples,
    storable,
)
from vlfast.extraction.sources.table import SampleTable, SampleTableBuilder
from vlfast.extraction.sources.webdataset import is_shard_input, load_shards

__all__ = ["load_inputs"]

_NOT_INPUTS = "inputs must be a path, or a list of Sample or dict rows; got {}"


def _load_list(items: Sequence[Any]) -> tuple[SampleTable, list[InputProblem]]:
    samples = SampleTableBuilder()
    problems: list[InputProblem] = []
    for i, item in enumerate(items):
        where = f"inputs[{i}]"
        if isinstance(item, Sample):
            reason = storable(
                item.id, item.paths, item.prompt, texts={"text": item.text, "instruction": item.instruction}
            )
            if reason:
                ok_id = item.id if storable(item.id, (), None) is None else None
                problems.append(InputProblem(where, reason, ok_id))
            else:
                samples.append(item)
        elif isinstance(item, dict):
            got = row_sample(item, where, None)  # paths as given: there is no manifest folder
            (problems if isinstance(got, InputProblem) else samples).append(got)  # type: ignore[arg-type]
        else:
            raise InputRefused(_NOT_INPUTS.format(type(item).__name__))
    return samples.build(), problems


def load_inputs(
    source: str | os.PathLike | Sequence[Sample | dict],
    storage_options: dict[str, Any] | None = None,
    kept: KeptListings | None = None,
) -> tuple[SampleTable, list[InputProblem]]:
    """The samples (a :class:`~vlfast.extraction.sources.table.SampleTable`) and problems of a folder, a
    manifest, a media file, WebDataset tar shards (a ``.tar`` path or a brace pattern), any of these at an
    fsspec URL (opened with ``storage_options``), or a list of samples or dict rows.

    A row or entry that cannot become a sample is an :class:`InputProblem` and the rest go on; in a list, at
    ``inputs[i]`` (an empty list gives nothing). An input giving no sample raises
    :class:`~vlfast.extraction.sources.sample.EmptyInput` if it had no problems either, else ValueError
    listing the first. Missing files are not checked here (they fail at load time and are recorded).
    ``kept``: the listings and tables an OUT keeps (:mod:`vlfast.extraction.sources.kept`).
    """
    if not isinstance(source, (str, os.PathLike)):
        if isinstance(source, (bytes, bytearray)) or not isinstance(source, Sequence):
            raise InputRefused(_NOT_INPUTS.format(type(source).__name__))
        return with_remote(_load_list(source), storage_options)
    if is_url(source):
        return load_url(source, storage_options, kept)  # type: ignore[arg-type]
    path = Path(source)
    name = display_path(path)
    if path.is_dir():
        return require_samples("folder", name, *load_folder(path))
    if is_shard_input(source):
        return require_samples("WebDataset shards", name, *load_shards(source, kept=kept))
    if path.suffix.lower() in MANIFEST_SUFFIXES:
        identity = manifest_identity(path, path.parent) if kept is not None and path.is_file() else None
        return manifest_samples(name, lambda: load_manifest(path), kept, identity, storage_options)
    if path.is_file() and (path.suffix.lower() in IMAGE_SUFFIXES | VIDEO_SUFFIXES):
        if reason := storable(path.name, (), None):  # as in a folder scan: the path opens as the OS gave it
            raise InputRefused(f"input {name}: {reason}")
        return SampleTable.of([Sample(path.name, kind_of(path.name), (str(path),))]), []
    raise FileNotFoundError(
        f"input {name} is neither a folder, a manifest nor an image or video file; {SUPPORTED}"
    )
