"""The record of what a sample's input was when it was read (a row of ``OUT/inputs/``), made where the
sample is decoded: its entry key, and for local bytes their stamp (taken before they are read) and xxh3.

Hashing reads the bytes once more (from the page cache: small next to decoding). Bytes at a URL are not
read again to be hashed (a second download): such a sample records its entry key alone. docs/extract.md
("Inputs that change") says what each check sees.
"""

from __future__ import annotations

from typing import Any

from vlfast.extraction.objstore import is_url
from vlfast.extraction.sources.identity import content_key, resolve_path, sample_key
from vlfast.extraction.sources.sample import Sample
from vlfast.extraction.sources.webdataset import TarMember
from vlfast.extraction.store.inputs import INPUT_SCHEME, file_stamp, hash_files, hash_range

__all__ = ["input_record", "input_digest"]


def _text(path: str) -> str:
    """A path as the index's text column can hold it (a folder name of non-UTF-8 bytes shown escaped)."""
    return path.encode("utf-8", "surrogateescape").decode("utf-8", "backslashreplace")


def input_digest(sample: Sample) -> str | None:
    """The xxh3 of the sample's bytes as :func:`input_record` takes it ("" for a text), or None where they
    are not hashed (at a URL) or cannot be read."""
    if sample.kind == "text":
        return ""
    member = sample.member
    try:
        if isinstance(member, TarMember) and not member.at_url:
            return hash_range(member.shard, member.offset, member.size)
        if member is None and not any(is_url(p) for p in sample.paths):
            return hash_files(sample.paths)
    except (OSError, EOFError):
        return None
    return None


def input_record(sample: Sample, texts: tuple[str, ...]) -> dict[str, Any]:
    """The input record of ``sample`` (see ``store.inputs.inputs_schema``); never raises: what cannot be
    read is left null (the decoder then says what is wrong with the sample)."""
    rec: dict[str, Any] = dict.fromkeys(
        ("content", "path", "member", "offset", "size", "mtime_ns", "stamp", "xxh3")
    )
    rec.update(scheme=INPUT_SCHEME, key=sample_key(sample, texts))
    member = sample.member
    if sample.kind == "text":
        rec["content"] = content_key(sample, texts, "")
        return rec
    if isinstance(member, TarMember):
        rec.update(path=_text(resolve_path(member.shard)), member=member.name, offset=member.offset)
        rec["size"] = member.size
        if member.at_url:
            return rec
        try:
            rec["stamp"], _, rec["mtime_ns"] = file_stamp(member.shard)
        except OSError:
            return rec
    elif member is not None or any(is_url(p) for p in sample.paths):
        rec["path"] = _text(str(member) if member is not None else sample.paths[0])
        return rec
    else:
        rec["path"] = "\x00".join(_text(resolve_path(p)) for p in sample.paths)
        try:
            stamps = [file_stamp(p) for p in sample.paths]  # before the bytes are read
        except OSError:
            return rec
        rec["stamp"] = ";".join(s[0] for s in stamps)
        rec["size"], rec["mtime_ns"] = sum(s[1] for s in stamps), max(s[2] for s in stamps)
    digest = input_digest(sample)
    if digest is not None:
        rec["xxh3"], rec["content"] = digest, content_key(sample, texts, digest)
    return rec
