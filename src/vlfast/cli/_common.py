"""Shared CLI plumbing: option aliases, output helpers and the error table.

Commands parse, call one library function and render its result. Errors a user can act on are mapped
to a one-line message and an exit code here; set ``VLFAST_DEBUG=1`` for the full traceback.
"""

from __future__ import annotations

import json
import os
import sys
from collections.abc import Callable
from functools import wraps
from typing import Annotated, Any

import typer
from rich.console import Console
from rich.markup import escape

from vlfast.extraction.layout import OutputInUse, OutputNotWritable

# Exit codes a script can act on.
EXIT_OK = 0
EXIT_FINDING = 1  # the command ran and found a problem (slow path, untrained tag, failed verification)
EXIT_USAGE = 2  # bad input: missing path, unknown model name, invalid option value
EXIT_ERROR = 3  # the command could not run (unexpected failure)

JsonOpt = Annotated[
    bool, typer.Option("--json", help="Print machine-readable JSON on stdout instead of tables.")
]
ModelOpt = Annotated[
    str,
    typer.Option(
        "--model",
        "-m",
        help="A local checkpoint directory, or a built-in reference such as ref:qwen3-vl-4b (see `vlfast models`).",
    ),
]
DeviceOpt = Annotated[
    str | None, typer.Option("--device", help="cpu, cuda, cuda:1, mps. Default: the best available.")
]
DtypeOpt = Annotated[
    str | None,
    typer.Option("--dtype", help="float32, bfloat16 or float16. Default: bfloat16 where supported."),
]

console = Console()
err_console = Console(stderr=True)


class UsageError(Exception):
    """Bad input from the user; the message says what to do."""


# exception type -> (exit code, prefix). Checked in order; the first isinstance match wins.
ERRORS: list[tuple[type[BaseException], int, str]] = [
    (UsageError, EXIT_USAGE, "error"),
    (OutputInUse, EXIT_USAGE, "output in use"),
    (OutputNotWritable, EXIT_USAGE, "output not writable"),
    (FileNotFoundError, EXIT_USAGE, "not found"),
    (NotADirectoryError, EXIT_USAGE, "not a folder"),
    (IsADirectoryError, EXIT_USAGE, "is a folder"),
    (PermissionError, EXIT_USAGE, "permission denied"),
    (ValueError, EXIT_USAGE, "invalid input"),
    (TypeError, EXIT_USAGE, "invalid input"),
    (ImportError, EXIT_USAGE, "missing dependency"),
    (MemoryError, EXIT_ERROR, "out of memory"),
]


def print_json(data: Any) -> None:
    sys.stdout.write(json.dumps(data, indent=2, default=str) + "\n")
    sys.stdout.flush()


def handle_errors(fn: Callable) -> Callable:
    """Turn known exceptions into a clear message and a meaningful exit code."""

    @wraps(fn)
    def wrapper(*args, **kwargs):
        try:
            return fn(*args, **kwargs)
        except typer.Exit:
            raise
        except KeyboardInterrupt:
            err_console.print("[yellow]interrupted[/yellow]")
            raise typer.Exit(130) from None
        except Exception as e:  # noqa: BLE001 - mapped below, re-raised in debug mode
            if os.environ.get("VLFAST_DEBUG"):
                raise
            code, prefix = next(
                ((c, p) for etype, c, p in ERRORS if isinstance(e, etype)),
                (EXIT_ERROR, f"unexpected {type(e).__name__}"),
            )
            # The message may hold brackets (paths, lists) that Rich would read as markup.
            # soft_wrap: a long path must not be cut across lines when stderr is a pipe (80 columns).
            err_console.print(
                f"[bold red]vlfast: {prefix}:[/bold red] {escape(str(e))}", highlight=False, soft_wrap=True
            )
            if code == EXIT_ERROR:
                err_console.print("[dim]Set VLFAST_DEBUG=1 for the full traceback.[/dim]")
            raise typer.Exit(code) from None

    return wrapper
