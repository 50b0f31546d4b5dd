"""`vlfast export`: one vector per sample of an extraction folder as one Parquet file or Lance dataset."""

from __future__ import annotations

from typing import Annotated

import typer

from vlfast.cli._common import (
    JsonOpt,
    console,
    handle_errors,
    parse_storage_options,
    print_json,
)
from vlfast.cli._extras import require


def register(app: typer.Typer) -> None:
    app.command("export")(export)


@handle_errors
def export(
    out: Annotated[
        str,
        typer.Argument(
            help="The folder `vlfast extract` wrote (a local path or a URL such as s3://bucket/features).",
            show_default=False,
        ),
    ],
    dest: Annotated[
        str,
        typer.Argument(
            help="The table to write, a local path: a .parquet file, or a Lance dataset folder.",
            show_default=False,
        ),
    ],
    format: Annotated[
        str | None,
        typer.Option(
            "--format", help="parquet or lance. Default: lance if DEST ends in .lance, else parquet."
        ),
    ] = None,
    feature: Annotated[
        str | None,
        typer.Option(
            "--feature",
            help="The stored feature to export, one vector per sample (embedding, vision_mean, "
            "llm.last.layer27, ...). Default: embedding.",
        ),
    ] = None,
    dtype: Annotated[
        str,
        typer.Option(
            "--dtype",
            help="float32 or float16: the vectors' type in the table. A value float16 cannot hold (past 65504) "
            "is refused, naming the sample.",
        ),
    ] = "float32",
    overwrite: Annotated[
        bool,
        typer.Option(
            "--overwrite", help="Replace an existing DEST table (atomically: the old one or the new)."
        ),
    ] = False,
    storage_options: Annotated[
        str | None,
        typer.Option(
            "--storage-options",
            help="JSON object passed to fsspec for an OUT URL, e.g. "
            '\'{"client_kwargs": {"endpoint_url": "http://localhost:9000"}}\'.',
        ),
    ] = None,
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
    require("extract", "vlfast export", models=False)
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
    console.print(
        f"exported {result.rows} samples of {result.feature!r} ({result.dim} x {result.dtype}) to "
        f"{result.dest} ({result.format}) in {result.seconds:.1f} s\nread back with: {read}",
        highlight=False,
        markup=False,
        soft_wrap=True,
    )
