"""`vlfast out`: verify, compact or export a finished OUT (`vlfast export` stays a hidden alias). None builds
a model, so any transformers will do.
"""

from __future__ import annotations

from typing import Annotated

import typer
from rich.markup import escape
from rich.table import Table

from vlfast.cli._common import (
    EXIT_FINDING,
    JsonOpt,
    add_group,
    console,
    handle_errors,
    option,
    parse_storage_options,
    print_json,
    say,
)
from vlfast.cli._extras import require

OutArg = Annotated[
    str,
    typer.Argument(
        help="The folder `vlfast extract` wrote (a local path or a URL such as s3://bucket/features).",
        show_default=False,
    ),
]
StorageOpt = option(
    str | None,
    "--storage-options",
    help="JSON object passed to fsspec for an OUT URL, e.g. "
    '\'{"client_kwargs": {"endpoint_url": "http://localhost:9000"}}\'; credentials also come from the '
    "environment.",
)


def register(app: typer.Typer) -> None:
    help = "Verify, compact or export a finished OUT (the folder `vlfast extract` wrote)."
    add_group(app, "out", help, {"verify": verify, "compact": compact, "export": export})
    app.command("export", hidden=True)(export)  # the name it had before the group: scripts keep working


def _typed(ctx: typer.Context) -> str:
    """The command as the user typed it (`vlfast out export`, or its alias `vlfast export`)."""
    names = []
    while ctx.parent is not None:
        names.append(ctx.info_name)
        ctx = ctx.parent
    return " ".join(["vlfast", *reversed(names)])


@handle_errors
def verify(
    ctx: typer.Context, out: OutArg, storage_options: StorageOpt = None, as_json: JsonOpt = False
) -> None:
    """Check every byte OUT holds against its checksum and list every damaged sample by id.

    Exit 0 the stored bytes are the ones written, 1 damage found (each finding with what to do about it),
    2 OUT missing, unreachable or not a vlfast folder, 3 an unexpected error (VLFAST_DEBUG=1 shows the
    traceback).
    """
    from vlfast.extraction.store.out import Out

    require("extract", _typed(ctx), models=False)
    from vlfast.extraction.store.integrity import check_folder

    report = check_folder(Out.reach(out, parse_storage_options(storage_options)))
    if as_json:
        print_json(report.to_dict())
    else:
        _print_check(report, out)
    if not report.ok:
        raise typer.Exit(EXIT_FINDING)


def _print_check(report, out: str) -> None:
    """``vlfast out verify``'s human output: what was checked, every damaged sample, each note, the advice."""
    plural = lambda n, word: f"{n} {word}{'' if n == 1 else 's'}"  # noqa: E731
    say(
        f"{out}: {plural(report.shards, 'shard')} in {plural(report.parts, 'index part')}, {report.samples} "
        f"samples, {report.bytes_checked / 2**20:,.1f} MiB checked in {report.seconds:.1f} s"
    )
    if report.bad_samples:
        table = Table(title=f"{len(report.bad_samples)} damaged samples")
        for column in ("id", "shard", "feature", "problem"):
            table.add_column(column, overflow="fold")
        for bad in report.bad_samples:
            table.add_row(*(escape(bad[k]) for k in ("id", "shard", "feature", "reason")))
        console.print(table)
    notes = []
    if report.damaged_error_lines:
        notes.append(f"{report.damaged_error_lines} damaged lines in errors/ (those samples will be redone)")
    if report.other_config_parts:
        notes.append(f"index parts made with another configuration: {', '.join(report.other_config_parts)}")
    # A damaged part with no samples to name (a foreign file under a part's name) is not in the table.
    notes += [f"{b['part']}: {b['reason']}" for b in report.bad_parts if not b["samples"]]
    notes += [f"{stray['path']}: {stray['problem']}" for stray in report.strays]
    for note in notes:
        say(note)
    # What was checked, and no more: bytes against checksums, not whether the values are sound.
    say("checksums OK: the stored bytes are the ones written" if report.ok else _advice(report, out))


def _advice(report, out: str) -> str:
    """Each finding with the advice that works for it (`vlfast extract` redoes damage, but refuses parts of
    another configuration, which only the user can move out)."""
    from vlfast.extraction.store.format import REDO_HINT
    from vlfast.extraction.store.out import Out

    advice = []
    if report.bad_samples or report.bad_parts or report.damaged_error_lines:
        advice.append(f"Damaged. {REDO_HINT}")
    uncovered = [s for s in report.strays if s["kind"] == "uncovered"]
    if uncovered:
        advice.append(
            "Shards no index part covers: the same `vlfast extract` moves them aside to "
            f"{Out.quarantine_shown(out)} (a shard a killed run left is removed) and extracts again what is "
            "missing."
        )
    if len(uncovered) < len(report.strays):
        advice.append(
            "A file where vlfast keeps a folder, or a folder where it keeps a file: nothing is moved for you; "
            "move each out of OUT, then run again (`vlfast extract` refuses, exit 2, until then, naming the mv)."
        )
    if report.other_config_parts:
        advice.append(
            "Parts of another configuration (another run's, added to this OUT): move each, with the shard of "
            "the same rank and number, out of OUT; the same `vlfast extract` refuses to resume (exit 2) until "
            "then."
        )
    return " ".join(advice)


@handle_errors
def compact(
    ctx: typer.Context, out: OutArg, storage_options: StorageOpt = None, as_json: JsonOpt = False
) -> None:
    """Replace each rank's many index parts by one consolidated part.

    A finished run does it itself: this is for folders written before, or runs stopped before they ended.
    Each rank's lock is taken in turn, so a rank another run holds is skipped and said so. Exit 0 done, 2 OUT
    missing, unreachable, in use or not a vlfast folder, 3 an unexpected error, 4 OUT's disk is full.
    """
    from vlfast.extraction.store.out import Out

    require("extract", _typed(ctx), models=False)
    from vlfast.extraction.store.compact import compact_folder

    results = compact_folder(Out.reach(out, parse_storage_options(storage_options)))
    if as_json:
        print_json({"out": out, "ranks": [r.to_dict() for r in results]})
        return
    for r in results:
        if r.skipped:
            what = f"skipped: {r.skipped}"
        elif r.part:
            what = f"{r.replaced} parts -> {r.part} ({r.samples} samples)"
        else:
            what = "nothing to compact"
        if r.deleted:
            what += f"; {r.deleted} superseded parts deleted"
        say(f"rank {r.rank}: {what}")


@handle_errors
def export(
    ctx: typer.Context,
    out: OutArg,
    dest: Annotated[
        str,
        typer.Argument(
            help="The table to write, a local path: a .parquet file, or a Lance dataset folder.",
            show_default=False,
        ),
    ],
    format: option(
        str | None, "--format", help="parquet or lance. Default: lance if DEST ends in .lance, else parquet."
    ) = None,
    feature: option(
        str | None,
        "--feature",
        help="The stored feature to export, one vector per sample (embedding, vision_mean, "
        "llm.last.layer27, ...). Default: embedding.",
    ) = None,
    dtype: option(
        str,
        "--dtype",
        help="float32 or float16: the vectors' type in the table. A value float16 cannot hold (past 65504) "
        "is refused, naming the sample.",
    ) = "float32",
    overwrite: option(
        bool, "--overwrite", help="Replace an existing DEST table (atomically: the old one or the new)."
    ) = False,
    storage_options: StorageOpt = None,
    as_json: JsonOpt = False,
) -> None:
    """Export one vector per sample, with id, path, text, instruction and n_tokens, as one table.

    The table (columns id, embedding, path, text, instruction, n_tokens) is what vector stores and
    rerankers read: Lance searches it directly, Parquet loads into pyarrow, pandas, Hugging Face datasets
    or any vector database. It is written beside DEST and renamed into place when complete: a killed export
    leaves no partial table. Exit 0 written, 2 refused (OUT missing or not a vlfast folder, an unknown
    feature, one that is not one vector per sample, vectors of different lengths, DEST exists without
    --overwrite, DEST inside OUT or OUT inside DEST, a value --dtype cannot hold; nothing written), 3 an
    unexpected error, 4 DEST's disk is full.
    """
    require("extract", _typed(ctx), models=False)
    from vlfast.extraction.store.export import export as run_export

    result = run_export(
        out,
        dest,
        format=format,
        feature=feature,
        dtype=dtype,
        overwrite=overwrite,
        storage_options=parse_storage_options(storage_options),
    )
    if as_json:
        print_json(result.to_dict())
        return
    read = (
        f"lance.dataset({result.dest!r})"
        if result.format == "lance"
        else f"pyarrow.parquet.read_table({result.dest!r})"
    )
    say(
        f"exported {result.rows} samples of {result.feature!r} ({result.dim} x {result.dtype}) to "
        f"{result.dest} ({result.format}) in {result.seconds:.1f} s\nread back with: {read}"
    )
