"""WebDataset tar shards as extraction input: brace patterns, one index pass per shard, members read in place.

Members sharing a ``__key__`` (the member path up to the first dot of its file name: ``a/b.seg.png`` ->
``a/b``) form one sample. The ``webdataset`` package streams each shard front to back, so a resume would
re-read every shard and a member that crashes or hangs a decoder could not be named; here ``tarfile`` lists
each shard once (headers, plus the small ``KEY.json`` / ``KEY.txt`` prompt members) and a :class:`TarMember`
says where the media's bytes are, read in place, so resume, timeouts and crash isolation work per sample as
for plain files. Shards at an fsspec URL are listed by the same code over a ranged reader. A sample's id is
``{shard}/{__key__}``, ``shard`` relative to the folder of the pattern's first brace
(``shards/{000..099}.tar`` -> ``003.tar/sample_0042``), the same for a relative, absolute or URL pattern.
"""

from __future__ import annotations

import functools
import io
import itertools
import json
import operator
import os
import re
import tarfile
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, BinaryIO

from vlfast._files import ByteWindow
from vlfast.errors import InputRefused
from vlfast.extraction import objstore
from vlfast.extraction.sources.kept import (
    KeptListings,
    ListedMember,
    Listing,
    local_identity,
    remote_identity,
)
from vlfast.extraction.sources.sample import (
    IMAGE_SUFFIXES,
    VIDEO_SUFFIXES,
    InputProblem,
    Sample,
    display_path,
    kind_of,
    storable,
    unreadable_json,
)
from vlfast.extraction.sources.table import SampleTable, SampleTableBuilder
from vlfast.pixels.media import SampleError, checked_file

__all__ = ["MAX_SHARDS", "TarMember", "expand_braces", "is_shard_input", "list_shards", "load_shards"]

MAX_SHARDS = 1_000_000  # a pattern expanding to more is a typo (a range with one digit too many)
_BLOCK = 512  # tar's block: headers are one block, data is padded to whole blocks
_MEDIA = IMAGE_SUFFIXES | VIDEO_SUFFIXES
_PROMPT_EXTS = ("json", "txt")
_COMPRESSED_SUFFIXES = (".tar.gz", ".tgz", ".tar.bz2", ".tar.xz", ".tar.zst")
_COMPRESSED_MAGIC = {b"\x1f\x8b": "gzip", b"BZh": "bzip2", b"\xfd7zXZ\x00": "xz", b"\x28\xb5\x2f\xfd": "zstd"}
_KEY = re.compile(r"^((?:.*/|)[^.]+)[.]([^/]*)$")  # webdataset's base_plus_ext: (__key__, extension)
_META = re.compile(r"__[^/]*__($|/)")  # webdataset skips these members (its own metadata)
_RANGE = re.compile(r"^(-?\d+)\.\.(-?\d+)(?:\.\.(-?\d+))?$")
_LETTERS = re.compile(r"^([A-Za-z])\.\.([A-Za-z])$")


def _closing(text: str, start: int) -> int:
    """Index of the brace closing the one at ``start``."""
    depth = 0
    for i in range(start, len(text)):
        if text[i] == "{":
            depth += 1
        elif text[i] == "}":
            depth -= 1
            if depth == 0:
                return i
    raise InputRefused(f"pattern {text!r}: the brace at character {start + 1} is never closed")


def _split_top(body: str) -> list[str]:
    """``body`` split at the commas outside nested braces."""
    parts, depth, start = [], 0, 0
    for i, c in enumerate(body):
        if c == "{":
            depth += 1
        elif c == "}":
            depth -= 1
        elif c == "," and depth == 0:
            parts.append(body[start:i])
            start = i + 1
    parts.append(body[start:])
    return parts


def _alternatives(body: str, pattern: str) -> list[str]:
    """What one ``{body}`` stands for: a comma list (each item expanded in turn) or a range."""
    items = _split_top(body)
    if len(items) > 1:
        return [x for item in items for x in expand_braces(item)]
    if m := _RANGE.match(body):
        a, b = int(m.group(1)), int(m.group(2))
        step = abs(int(m.group(3) or 1)) or 1
        # bash pads every number to the widest endpoint when either is written with a leading zero
        padded = any(re.match(r"^-?0\d", g) for g in m.group(1, 2))
        width = max(len(m.group(1)), len(m.group(2))) if padded else 0
        if abs(b - a) // step + 1 > MAX_SHARDS:
            raise InputRefused(f"pattern {pattern!r}: {{{body}}} names more than {MAX_SHARDS:,} shards")
        values = range(a, b + 1, step) if a <= b else range(a, b - 1, -step)
        return [f"{v:0{width}d}" for v in values]
    if m := _LETTERS.match(body):
        a, b = ord(m.group(1)), ord(m.group(2))
        return [chr(c) for c in (range(a, b + 1) if a <= b else range(a, b - 1, -1))]
    raise InputRefused(
        f"pattern {pattern!r}: {{{body}}} is neither a range like {{000000..000099}} nor a list like "
        "{train,val}; a literal brace cannot be part of a shard pattern"
    )


def expand_braces(pattern: str) -> list[str]:
    """Every path ``pattern`` names, in bash's order (``{x,y}{1,2}`` -> x1 x2 y1 y2). Ranges keep their
    endpoints' zero padding and may step (``{0..10..5}``) or count down; lists may nest (``{a,b{1,2}}``). A
    stray or unclosed brace, or one holding neither a range nor a list, raises ValueError naming it."""
    start = pattern.find("{")
    stray = pattern.find("}")
    if stray != -1 and (start == -1 or stray < start):
        raise InputRefused(f"pattern {pattern!r}: the brace at character {stray + 1} closes nothing")
    if start == -1:
        return [pattern]
    end = _closing(pattern, start)
    head, body, tail = pattern[:start], pattern[start + 1 : end], pattern[end + 1 :]
    rests = expand_braces(tail)
    alts = _alternatives(body, pattern)
    if len(alts) * len(rests) > MAX_SHARDS:
        raise InputRefused(f"pattern {pattern!r} names more than {MAX_SHARDS:,} shards")
    return [head + a + r for a in alts for r in rests]


def is_shard_input(source: str | os.PathLike) -> bool:
    """Whether INPUT is a ``.tar`` path (compressed too, to refuse it) or a brace pattern that is no file."""
    text = os.fspath(source)
    return text.lower().endswith((".tar", *_COMPRESSED_SUFFIXES)) or (
        "{" in text and not os.path.exists(text)
    )


def _expand_url(pattern: str) -> list[str]:
    """The URLs a pattern at a URL names: braces expanded in the path only, not the scheme or bucket."""
    scheme, _, rest = pattern.partition("://")
    prefix = f"{scheme}://"
    bucket = objstore.bucket_root(pattern)
    if bucket is not None:
        prefix = f"{bucket}/"
        rest = pattern[len(prefix) :]
    if "{" in prefix or "}" in prefix:
        raise InputRefused(
            f"pattern {pattern!r}: braces are expanded in the path only, not in the scheme or bucket; "
            "give one bucket per run"
        )
    try:
        return [prefix + p for p in expand_braces(rest)]
    except ValueError as e:  # name the whole URL and count characters in it, not in its path
        text = str(e).replace(repr(rest), repr(pattern), 1)
        text = re.sub(r"character (\d+)", lambda m: f"character {int(m.group(1)) + len(prefix)}", text)
        raise InputRefused(text) from None


class _MemberFile(ByteWindow):
    """``size`` bytes at ``offset`` of a local file, read with pread."""

    def __init__(self, path: str, offset: int, size: int, name: str):
        super().__init__(size, name)
        self._fd = os.open(path, os.O_RDONLY | getattr(os, "O_CLOEXEC", 0))
        self._offset = offset

    def readinto(self, buffer) -> int:
        n = min(len(buffer), self._size - self._pos)
        if n <= 0:
            return 0
        with memoryview(buffer) as view:
            got = os.preadv(self._fd, [view[:n]], self._offset + self._pos)
        self._pos += got
        return got

    def close(self) -> None:
        if not self.closed:
            os.close(self._fd)
        super().close()


@dataclass(frozen=True, slots=True)  # slots: one per key of a listing of millions
class TarMember:
    """Where one sample's media lies inside a tar shard, read in place (:meth:`open`), never extracted.
    ``str()`` is ``{shard}/{name}``, the path errors and ``meta["path"]`` show."""

    shard: str  # the shard's path or URL, as the pattern expanded to
    name: str  # the member's name in the tar
    offset: int  # byte offset of the member's data in the shard file
    size: int  # bytes of data
    options_json: str = field(default="{}", repr=False)  # a URL shard's storage options (JSON): never shown

    def __post_init__(self) -> None:
        if not all(isinstance(v, int) for v in (self.offset, self.size)) or min(self.offset, self.size) < 0:
            raise InputRefused(
                f"offset and size must be non-negative ints, got {self.offset!r}, {self.size!r}"
            )

    def __str__(self) -> str:
        return f"{self.shard}/{self.name}"

    @property
    def at_url(self) -> bool:
        return objstore.is_url(self.shard)

    def open(self) -> io.BufferedReader:
        """The member's bytes as a seekable binary file (PIL and PyAV take it); raises OSError."""
        if self.at_url:
            return objstore.open_range(self.shard, self.options_json, self.offset, self.size, str(self))
        return io.BufferedReader(_MemberFile(self.shard, self.offset, self.size, str(self)), 1 << 16)

    def read_bytes(self) -> bytes:
        if self.at_url:  # one ranged request for the whole member
            return objstore.read_range(self.shard, self.options_json, self.offset, self.size, str(self))
        with self.open() as f:
            return f.read()

    def checked_size(self) -> int:
        """Its size in bytes; SampleError where it is empty or its shard is gone or cut since it was listed."""
        # At a URL no request: a ranged read past the object's end says "truncated shard" itself.
        shard_size = None if self.at_url else checked_file(self.shard).st_size
        if self.size == 0:
            raise SampleError(f"empty file (0 bytes): {self}")
        if shard_size is not None and shard_size < self.offset + self.size:  # cut since it was listed
            raise SampleError(
                f"truncated shard: {self.shard} ends at byte {shard_size:,}, inside member {self.name!r} "
                f"(bytes {self.offset:,} to {self.offset + self.size:,})"
            )
        return self.size

    def read_failure(self, e: BaseException) -> Exception | None:
        """The store's TransientReadError where ``e`` is its transient failure mid-read at a URL."""
        return objstore.transient_error(str(self), e) if self.at_url and objstore.is_transient(e) else None


def _cut(size: int, members: list[ListedMember], f: BinaryIO) -> str | None:
    """How the shard is cut short or broken, in words, or None when its end-of-archive marker is there."""
    if not members:
        return None
    last = members[-1]
    if last.offset_data + last.size > size:
        got = size - last.offset_data
        return (
            f"it ends at byte {size:,}, {max(got, 0):,} of the {last.size:,} bytes into member {last.name!r}"
        )
    end = last.offset_data + -(-last.size // _BLOCK) * _BLOCK
    f.seek(end)
    tail = f.read(2 * _BLOCK)
    if not tail:
        return (
            f"it ends at byte {size:,} right after member {last.name!r}, without the end-of-archive "
            "marker every tar writer adds"
        )
    if not tail.strip(b"\0"):
        return None  # the end marker (maybe cut itself: nothing is lost)
    if end + _BLOCK > size:
        return f"it ends at byte {size:,}, inside the header of the member after {last.name!r}"
    return f"the member header at byte {end:,}, after member {last.name!r}, is not valid tar (corrupt data)"


def _scan(f: BinaryIO, size: int, where: str) -> Listing:
    """The shard's members in order (headers only), how it is cut short (None if whole), and its prompt
    members' bytes by data offset; ValueError when it is not a plain tar. ``f``: the shard as a seekable
    file (local, or a ranged reader). Prompts are read as the scan passes them, while still in the reader's
    buffer: afterwards each would cost a request at a URL."""
    if size == 0:
        return [], "it is empty (0 bytes)", {}
    head = f.read(_BLOCK)
    kind = next((kind for magic, kind in _COMPRESSED_MAGIC.items() if head.startswith(magic)), None)
    if kind is not None:
        raise InputRefused(
            f"{display_path(where)} is a {kind}-compressed file: vlfast reads members in place and needs plain "
            ".tar shards; decompress them first"
        )
    f.seek(0)
    try:
        tf = tarfile.open(fileobj=f, mode="r:")  # noqa: SIM115 - the caller closes f
    except tarfile.ReadError as e:
        if size < _BLOCK and head[257:262] == b"ustar":  # a header cut in two: still a tar
            return [], f"it ends at byte {size:,}, inside the header of its first member", {}
        raise InputRefused(
            f"{display_path(where)} is not a tar archive ({e}); a WebDataset pattern must name .tar shards"
        ) from None
    members: list[ListedMember] = []
    texts: dict[int, bytes] = {}
    while True:
        try:
            m = tf.next()
        except tarfile.ReadError:  # tarfile found the previous member's data cut: judged below
            break
        if m is None:  # a zero block, the end of the file, or a header tarfile rejects
            break
        members.append(ListedMember.of(m))
        key = _KEY.match(m.name) if m.isreg() else None
        if key is not None and key.group(2).lower() in _PROMPT_EXTS:  # a prompt (tarfile seeks on itself)
            f.seek(m.offset_data)
            texts[m.offset_data] = f.read(m.size)
    tf.members = []  # its own copy: a shard of 100k members need not be held twice
    return members, _cut(size, members, f), texts


def _groups(members: list[ListedMember]) -> Iterator[tuple[str, list[tuple[str, ListedMember]]]]:
    """(__key__, [(extension, member), ...]) for runs of consecutive members sharing a key, as webdataset
    groups them: regular files only, its own ``__meta__`` members and names without an extension skipped,
    extensions lower-cased."""
    keyed = (
        (match.group(1), match.group(2).lower(), m)
        for m in members
        if m.isreg() and not _META.match(m.name) and (match := _KEY.match(m.name))
    )
    for key, run in itertools.groupby(keyed, key=operator.itemgetter(0)):
        yield key, [(ext, m) for _, ext, m in run]


def _prompt(raw: bytes, ext: str) -> str | None:
    """The prompt a ``.txt`` (its text) or ``.json`` (its ``"prompt"``) member gives, else ValueError."""
    try:
        text = raw.decode("utf-8-sig")
    except UnicodeDecodeError as e:
        raise InputRefused(
            f"{ext} member is not valid UTF-8 (byte 0x{raw[e.start]:02x} at {e.start})"
        ) from None
    if ext == "txt":
        return text.strip() or None
    try:
        data = json.loads(text)
    except json.JSONDecodeError as e:
        raise InputRefused(
            f"json member is not valid JSON ({e.msg} at line {e.lineno} column {e.colno})"
        ) from None
    except (ValueError, RecursionError) as e:
        raise InputRefused(f"json member is {unreadable_json(e)}") from None
    if not isinstance(data, dict):
        raise InputRefused(f"json member holds a JSON {type(data).__name__}, not an object")
    prompt = data.get("prompt")
    if prompt is None or prompt == "":
        return None
    if not isinstance(prompt, str):
        raise InputRefused(f'json member\'s "prompt" must be text, got {type(prompt).__name__}')
    return prompt


def _storable_id(sid: str) -> str | None:
    """``sid`` when the store can hold it, else None."""
    return None if storable(sid, (), None) else sid


def _key_sample(
    shard: str,
    sid: str,
    members: list[tuple[str, ListedMember]],
    texts: Mapping[int, bytes],
    options_json: str,
) -> Sample | InputProblem | None:
    """The sample of one key, the problem that stops it, or None for a key with nothing to extract."""
    refs = [(ext, TarMember(shard, m.name, m.offset_data, m.size, options_json), m) for ext, m in members]

    def problem(ref: TarMember, reason: str) -> InputProblem:
        return InputProblem(display_path(str(ref)), reason, _storable_id(sid))

    seen: set[str] = set()
    for ext, ref, _ in refs:
        if ext in seen:
            return problem(
                ref, f"the key has two members with extension .{ext}; rename one (keys must be unique)"
            )
        seen.add(ext)
    media = [(ext, ref, m) for ext, ref, m in refs if "." + ext.rsplit(".", 1)[-1] in _MEDIA]
    prompts = {ext: ref for ext, ref, _ in refs if ext in _PROMPT_EXTS}
    if not media:
        if not prompts:
            return None  # labels, embeddings...: nothing vlfast extracts, as a folder scan skips such files
        found = ", ".join(f".{ext}" for ext, _, _ in refs)
        return problem(
            refs[0][1], f"the key has {found} but no image or video member; add its media or remove the key"
        )
    if len(media) > 1:
        names = ", ".join(f".{ext}" for ext, _, _ in media)
        return problem(
            media[0][1],
            f"the key has {len(media)} media members ({names}); vlfast extracts one image or video per key: "
            "give each its own key",
        )
    _, ref, m = media[0]
    if m.issparse():
        return problem(ref, "a sparse tar member cannot be read in place; write the shard without --sparse")
    prompt = None
    for ext in ("txt", "json"):  # json last: its "prompt" wins over a .txt
        if ext in prompts:
            text = prompts[ext]
            try:
                prompt = _prompt(texts[text.offset], ext) or prompt
            except ValueError as e:
                return problem(text, f"{e}; fix or remove it")
    display = str(ref)
    if reason := storable(sid, (display,), prompt):
        return problem(ref, reason)
    return Sample(sid, kind_of(m.name), (display,), prompt, member=ref)


def _entries(
    shard: str,
    rel: str,
    members: list[ListedMember],
    cut: str | None,
    texts: Mapping[int, bytes],
    options_json: str = "{}",
) -> tuple[list[Sample], list[InputProblem]]:
    """The samples and problems of one listed shard, local or at a URL; a cut records its key and shard."""
    samples: list[Sample] = []
    problems: list[InputProblem] = []

    def truncated(where: str, what: str, sid: str) -> None:
        reason = f"truncated shard: {cut}; {what}; download or rewrite the shard, then run again"
        problems.append(InputProblem(display_path(where), reason, _storable_id(sid)))

    groups = list(_groups(members))
    for n, (key, group) in enumerate(groups):
        sid = f"{rel}/{key}"
        if cut is not None and n == len(groups) - 1:
            # The key at the cut: its media, or a prompt member after it, may be lost.
            what = "this key's members may be incomplete, so it is not extracted"
            truncated(f"{shard}/{group[-1][1].name}", what, sid)
            continue
        got = _key_sample(shard, sid, group, texts, options_json)
        if isinstance(got, Sample):
            samples.append(got)
        elif got is not None:
            problems.append(got)
    if cut is not None:
        after = f"{members[-1].name!r} " if members else "its start "
        truncated(shard, f"whatever members followed {after}cannot be listed and are not extracted", rel)
    return samples, problems


_LIST_THREADS = 8  # shards listed at once: a listing waits on requests more than on the CPU


def list_shards(
    pattern: str,
    shards: Sequence[str],
    rels: Sequence[str],
    storage_options: Mapping[str, Any] | None,
    kept: KeptListings | None = None,
) -> Iterator[tuple[list[Sample], list[InputProblem]]]:
    """Each shard URL's samples and problems (ids ``{rel}/{__key__}``) in order, listed as a local shard is
    over a :class:`~vlfast.extraction.objstore.RangeReader`, :data:`_LIST_THREADS` at once. A generator: the
    refusals raise at the first ``next``.

    Refused before any shard is read, naming ``pattern`` and never the credentials: an unreachable
    endpoint, a missing bucket or refused credentials, and shards that do not exist or are not files. A
    shard that is not a plain tar raises ValueError; one that cannot be read mid-listing,
    :class:`RemoteInputError`."""
    from concurrent.futures import ThreadPoolExecutor

    options = objstore.encode_options(storage_options)
    bucket = objstore.bucket_root(pattern)
    if bucket is not None:
        label = f"bucket {bucket} of input {pattern}"
        objstore.probe(bucket, options, label, f"{label} does not exist (or the credentials cannot see it)")
    fs, _ = objstore.filesystem(shards[0], options)
    fs.invalidate_cache()
    paths = {s: fs._strip_protocol(s) for s in shards}
    pool = ThreadPoolExecutor(min(_LIST_THREADS, len(shards)), thread_name_prefix="vlfast-list")
    try:
        found = _shard_infos(fs, pattern, list(paths.values()), options, pool.map)
        missing = [s for s in shards if paths[s] not in found]
        not_files = [s for s in shards if paths[s] in found and found[paths[s]].get("type") != "file"]
        _refuse_missing(pattern, list(shards), missing, not_files)

        def one(shard: str, rel: str, position: int) -> tuple[list[Sample], list[InputProblem]]:
            entry = found[paths[shard]]  # its size, and its ETag for ``kept``
            if entry.get("size") is None:
                raise objstore.RemoteInputError(
                    f"shard {shard}: the store does not give its size, which reading its members in place needs"
                )
            size = int(entry["size"])

            def scan() -> Listing:
                source = objstore.ObjectRange(fs, paths[shard], shard, options)
                with objstore.RangeReader(source, 0, size, shard) as f:
                    try:
                        return _scan(f, size, shard)
                    except (OSError, objstore.TransientReadError) as e:  # naming the URL, never the options
                        raise objstore.RemoteInputError(f"shard {shard} cannot be listed: {e}") from None

            identity = remote_identity(shard, entry) if kept is not None else None
            listing = scan() if kept is None else kept.listing(identity, size, position, scan)
            return _entries(shard, rel, *listing, options)

        yield from pool.map(one, shards, rels, range(len(shards)))
    finally:
        pool.shutdown(wait=True, cancel_futures=True)


def _shard_infos(fs, pattern: str, paths: list[str], options_json: str, map_) -> dict[str, dict[str, Any]]:
    """The ``fs.info`` entries of the shards that exist, by path: one listing per folder. Where a listing
    holds none of its shards (a missing folder, or plain HTTP, which cannot list), the first shard is asked
    for, and the others (``map_``: in parallel) only if it exists; so are shards listed without a size."""

    def asked(call: Callable[[str], Any], path: str, missing: Any = None) -> Any:
        try:
            return call(path)
        except FileNotFoundError:
            return missing
        except Exception as e:
            raise objstore.refusal(f"input {pattern}", e, options_json) from None

    info = functools.partial(asked, fs.info)

    folders: dict[str, list[str]] = {}
    for path in paths:
        folders.setdefault(fs._parent(path), []).append(path)
    found: dict[str, dict[str, Any]] = {}
    for folder, wanted in folders.items():
        entries = asked(functools.partial(fs.ls, detail=True), folder, [])
        listed = {fs._strip_protocol(e["name"]).rstrip("/"): e for e in entries}
        found.update(listed)
        if any(path in listed for path in wanted):
            continue
        first = info(wanted[0])
        if first is not None:
            found[wanted[0]] = first
            found.update((p, i) for p, i in zip(wanted[1:], map_(info, wanted[1:])) if i is not None)
    # an HTTP index page lists files without their sizes: ask each one
    unsized = [p for p in paths if p in found and found[p].get("size") is None]
    found.update((p, i) for p, i in zip(unsized, map_(info, unsized)) if i is not None)
    return found


def _refuse_missing(pattern: str, shards: list[str], missing: list[str], not_files: list[str]) -> None:
    """FileNotFoundError naming the shards of ``pattern`` that do not exist, or the first that is not a file."""
    if missing:
        shown = ", ".join(display_path(s) for s in missing[:5]) + (
            f" and {len(missing) - 5} more" if len(missing) > 5 else ""
        )
        what = "the shard" if len(shards) == 1 else f"{len(missing)} of the {len(shards)} shards"
        raise FileNotFoundError(
            f"{what} named by {pattern!r} do{'es' if len(missing) == 1 else ''} not exist: {shown}"
        )
    if not_files:
        raise FileNotFoundError(
            f"{display_path(not_files[0])} (named by {pattern!r}) is not a file: a shard is a .tar file"
        )


def load_shards(
    pattern: str | os.PathLike,
    storage_options: Mapping[str, Any] | None = None,
    kept: KeptListings | None = None,
) -> tuple[SampleTable, list[InputProblem]]:
    """Samples of every shard ``pattern`` names, in pattern then tar order, and the problems found.

    Refused before anything is read: a pattern that does not parse, a shard that does not exist or is not
    a file (FileNotFoundError), a file that is not a plain tar, compressed ones included (ValueError).
    Recorded, the run going on: a truncated shard (its last key and the shard itself), and per key, two
    media members, an unreadable prompt member, a repeated extension, an id that cannot be stored. A key
    with neither media nor prompts is skipped, as a folder scan skips captions. A pattern at a URL is
    listed by :func:`list_shards` with ``storage_options``. ``kept``: the listings OUT keeps
    (:mod:`vlfast.extraction.sources.kept`), used where they fit, and offered the fresh ones.
    """
    text = os.fspath(pattern)
    url = objstore.is_url(text)
    shards = list(dict.fromkeys(_expand_url(text) if url else expand_braces(text)))  # named twice: once
    brace = text.find("{")  # ids are relative to the first brace's folder (the file's own without one)
    base = os.path.dirname(text if brace == -1 else text[:brace])
    rels = [shard[len(base) :].lstrip("/") if base else shard for shard in shards]
    if url:
        listed = list_shards(text, shards, rels, storage_options, kept)
    else:
        missing = [s for s in shards if not os.path.exists(s)]
        not_files = [s for s in shards if not os.path.isfile(s) and os.path.exists(s)]
        _refuse_missing(text, shards, missing, not_files)

        def one(shard: str, rel: str, position: int) -> tuple[list[Sample], list[InputProblem]]:
            st = os.stat(shard)

            def scan() -> Listing:
                with open(shard, "rb") as f:
                    return _scan(f, st.st_size, shard)

            identity = local_identity(shard, st) if kept is not None else None
            listing = scan() if kept is None else kept.listing(identity, st.st_size, position, scan)
            return _entries(shard, rel, *listing)

        # one shard's samples at a time into the table, not every shard's objects at once
        listed = map(one, shards, rels, range(len(shards)))
    samples = SampleTableBuilder()
    problems: list[InputProblem] = []
    for got, bad in listed:
        samples.extend(got)
        problems += bad
    return samples.build(), problems
