"""Shared CLI plumbing: option aliases, output helpers and the error table.

Errors a user can act on become a one-line message: vlfast's refusals and the user's own files are exit 2;
anything else is a bug, exit 3 with a hint to set ``VLFAST_DEBUG=1``. Help is click's plain layout (no
markup parsed, so ``pip install 'vlfast[plot]'`` prints as written); what goes through Rich is escaped.
"""

from __future__ import annotations

import json
import math
import os
import sys
from collections.abc import Callable
from functools import wraps
from typing import TYPE_CHECKING, Annotated, Any

import typer
from rich.console import Console
from rich.markup import escape
from rich.measure import Measurement
from rich.padding import Padding
from rich.table import Table
from typer.core import TyperArgument, TyperCommand, TyperGroup

from vlfast.cli._examples import HELP_OPTIONS
from vlfast.errors import InputRefused, VlfastError
from vlfast.limits import LIMITS

if TYPE_CHECKING:
    from typer._click import Context, HelpFormatter  # typer's own copy of click

# Exit codes a script can act on.
EXIT_OK = 0
EXIT_FINDING = 1  # the command ran and found a problem (slow path, untrained tag, failed verification)
EXIT_USAGE = 2  # a refusal: missing path, unknown model name, invalid option value, a different configuration
EXIT_ERROR = 3  # the command could not run: an unexpected exception, most likely a bug
EXIT_FULL = 4  # the output's disk is full: free space and run the same command again (it resumes)


def option(kind: Any, *flags: str, **kwargs: Any) -> Any:
    """An option alias, ``Annotated[kind, typer.Option(*flags, **kwargs)]``, in one line."""
    return Annotated[kind, typer.Option(*flags, **kwargs)]


JsonOpt = option(bool, "--json", help="Print machine-readable JSON on stdout instead of tables.")
ModelOpt = option(
    str,
    "--model",
    "-m",
    help="A local checkpoint directory, or a built-in reference such as ref:qwen3-vl-4b (see `vlfast models`).",
)
DeviceOpt = option(str | None, "--device", help="cpu, cuda, cuda:1, mps. Default: the best available.")
DtypeOpt = option(
    str | None,
    "--dtype",
    help="float32, bfloat16 or float16 (or fp32, bf16, fp16). Default: bfloat16 where supported.",
)

console = Console()
err_console = Console(stderr=True)


class HelpCommand(TyperCommand):
    """A command whose help reads like git's (``--device DEVICE``, ``vlfast tokens fix [OPTIONS] OUT``), not
    typer's ``<str>`` and ``{OUT}``: a number's metavar is ``N``, another value's its option in capitals.
    Every number given is checked against :data:`vlfast.limits.LIMITS` as the options are parsed."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        for p in self.params:
            if p.metavar is not None or getattr(p, "is_flag", False):
                continue
            if isinstance(p, TyperArgument):
                p.metavar = (p.name or "value").upper() + ("..." if p.nargs != 1 else "")
            elif number_type(p) is not None:
                p.metavar = "N"
            else:
                p.metavar = max(p.opts, key=len).lstrip("-").replace("-", "_").upper()

    def parse_args(self, ctx: Context, args: list[str]) -> list[str]:
        rest = super().parse_args(ctx, args)
        for p in self.params:
            value = ctx.params.get(p.name) if p.name else None
            if value is None or isinstance(p, TyperArgument) or number_type(p) is None:
                continue
            flag = max(p.opts, key=len)
            try:
                if flag in LIMITS:
                    LIMITS[flag].check(value, flag)
                elif isinstance(value, float) and not math.isfinite(value):  # an option with no entry yet
                    raise InputRefused(f"{flag} must be a finite number, got {value!r}")
            except InputRefused as e:
                ctx.fail(str(e))  # exit 2 with the usage line, as for a value that is not a number
        return rest

    def collect_usage_pieces(self, ctx: Context) -> list[str]:
        pieces = [self.options_metavar] if self.options_metavar else []
        for p in self.get_params(ctx):
            if isinstance(p, TyperArgument):
                pieces.append(p.metavar if p.required else f"[{p.metavar}]")
        return pieces

    def format_options(self, ctx: Context, formatter: HelpFormatter) -> None:
        arguments, options = [], []
        for p in self.get_params(ctx):
            record = p.get_help_record(ctx)
            if record is None:
                continue
            if isinstance(p, TyperArgument):
                arguments.append((p.metavar, record[1]))  # typer's name column ends in a type tag
            else:
                options.append(record)
        for title, rows in (("Arguments", arguments), ("Options", options)):
            if rows:
                with formatter.section(title):
                    formatter.write_dl(rows)


def number_type(param: Any) -> type | None:
    """int or float for an option that takes one number (typer >= 0.20's annotation, or a click type)."""
    if getattr(param, "is_flag", False) or getattr(param, "multiple", False):
        return None
    annotation = getattr(getattr(param, "type_descriptor", None), "annotation", None)
    if annotation in (int, float):
        return annotation
    name = getattr(getattr(param, "type", None), "name", "")
    return int if name.startswith("integer") else float if name.startswith("float") else None


class HelpGroup(TyperGroup):
    """A command group whose list gives each command's first sentence whole (click cuts it to fit a line)."""

    def format_commands(self, ctx: Context, formatter: HelpFormatter) -> None:
        rows = [
            (name, cmd.get_short_help_str(limit=1000))
            for name in self.list_commands(ctx)
            if (cmd := self.get_command(ctx, name)) is not None and not cmd.hidden
        ]
        if rows:
            with formatter.section("Commands"):
                formatter.write_dl(rows)


def readable_help(app: typer.Typer) -> None:
    """Give every command and group under ``app`` the help layout above (unless it chose one)."""
    for command in app.registered_commands:
        if command.cls in (None, TyperCommand):  # typer records its default class, not None
            command.cls = HelpCommand
    for group in app.registered_groups:
        if not group.cls or group.cls is TyperGroup:  # unset: a falsy placeholder
            group.cls = HelpGroup
        if group.typer_instance is not None:
            readable_help(group.typer_instance)


def add_group(app: typer.Typer, name: str, help: str, commands: dict[str, Callable]) -> None:
    """Register a command group (``vlfast out``, ``vlfast tokens``): ``commands`` by name, in help's order."""
    group = typer.Typer(name=name, help=help, no_args_is_help=True, context_settings=HELP_OPTIONS)
    for command, fn in commands.items():
        group.command(command)(fn)
    app.add_typer(group, name=name)


class UsageError(Exception):
    """Bad input from the user; the message says what to do."""


def _disk_full(error: BaseException) -> bool:
    """A write that failed for want of space (imported here: `vlfast -h` does not load vlfast._files)."""
    from vlfast._files import disk_full

    return disk_full(error)


# exception type (or a predicate) -> (exit code, prefix); the first match wins. OUT's refusals are named
# "module:Class", matched once their module is loaded: importing the store would slow `vlfast -h` 0.1-0.25 s.
_STORE = "vlfast.extraction.store.format"
ERRORS: list[tuple[type[BaseException] | str | Callable[[BaseException], bool], int, str]] = [
    (UsageError, EXIT_USAGE, "error"),
    (f"{_STORE}:OutputFull", EXIT_FULL, "output disk full"),
    (_disk_full, EXIT_FULL, "disk full (free space, then run the same command again)"),
    (f"{_STORE}:OutputInUse", EXIT_USAGE, "output in use"),
    (f"{_STORE}:OutputNotWritable", EXIT_USAGE, "output not writable"),
    (FileNotFoundError, EXIT_USAGE, "not found"),
    (NotADirectoryError, EXIT_USAGE, "not a folder"),
    (IsADirectoryError, EXIT_USAGE, "is a folder"),
    (PermissionError, EXIT_USAGE, "permission denied"),
    # vlfast's own refusals only: a ValueError or TypeError from anywhere else is a bug (exit 3).
    (VlfastError, EXIT_USAGE, "invalid input"),
    (ImportError, EXIT_USAGE, "missing dependency"),
    (MemoryError, EXIT_ERROR, "out of memory"),
]


def _is_a(error: BaseException, etype: type[BaseException] | str | Callable[[BaseException], bool]) -> bool:
    if isinstance(etype, str):
        module, _, name = etype.partition(":")
        loaded = sys.modules.get(module)
        return loaded is not None and isinstance(error, getattr(loaded, name))
    return isinstance(error, etype) if isinstance(etype, type) else etype(error)


def refuse_early(
    model: str | None = None, device: str | None = None, dtypes: tuple[str | None, ...] = ()
) -> None:
    """Refuse a --model, --device or --dtype the library would refuse, in its words, before the command
    imports torch and transformers (seconds; a CUDA torch alone took 6-9 s). What only torch can judge (an
    unknown device type, a missing GPU) is left to it."""
    if model is not None:
        from vlfast.models.ref import ModelRef

        ref = ModelRef.of(model)
        if ref.is_reference:
            ref.reference  # noqa: B018 - refuses an unknown name, listing the choices
        else:
            from vlfast.models.checkpoints import checkpoint_dir

            checkpoint_dir(model)
    if device is not None:
        from vlfast.extraction.config import named_device

        named_device(device)  # a type only torch knows (or a plug-in adds) is left to it
    for dtype in dtypes:
        if dtype is not None:
            from vlfast.dtypes import dtype_name

            dtype_name(dtype)


def refuse_unfit_weights(model: str | None) -> None:
    """Refuse (exit 2, naming the tensor and both shapes) a checkpoint whose vision-tower weights do not fit
    its config.json, before torch's size mismatch (exit 3). Call it where the command imports torch anyway."""
    from pathlib import Path

    from vlfast.models.ref import ModelRef

    if model is None or ModelRef.of(model).is_reference or not Path(model).expanduser().is_dir():
        return  # no checkpoint to compare: what --model lacks is the library's to say
    from vlfast.models import check_tower_shapes, tower_shapes

    check_tower_shapes(model, tower_shapes(model))


def parse_storage_options(text: str | None) -> dict | None:
    """--storage-options as a dict. The message never echoes the text: it may hold credentials."""
    if text is None:
        return None
    try:
        value = json.loads(text)
    except json.JSONDecodeError as e:
        raise UsageError(f"--storage-options is not valid JSON ({e.msg} at column {e.colno})") from None
    if not isinstance(value, dict):
        raise UsageError(f"--storage-options must be a JSON object, got {type(value).__name__}")
    return value


def say(text: str, out: Console | None = None) -> None:
    """Print ``text`` as written: no markup, no highlighting, never cut across lines in a pipe."""
    (out or console).print(text, markup=False, highlight=False, soft_wrap=True)


def ms_cell(v: float | None) -> str:
    """Milliseconds for a table cell; "-" where nothing was measured."""
    return "-" if v is None else f"{v:,.2f}"


def print_json(data: Any) -> None:
    sys.stdout.write(json.dumps(data, indent=2, default=str) + "\n")
    sys.stdout.flush()


def print_table(table: Table, out: Console | None = None) -> None:
    """Print a table without cutting any cell to `<thin…`: folded in a terminal; elsewhere (a CI log, where
    Rich would assume 80 columns) at its natural width, every row on one line, whole, for grep."""
    out = out or console
    for column in table.columns:
        if column.overflow == "ellipsis":
            column.overflow = "fold"
    if out.is_terminal:
        out.print(table)
        return
    width = _natural_width(out, table)
    wide = Console(file=out.file, width=max(width, out.width), color_system=None, highlight=False)
    if isinstance(table.title, str) and wide.render_str(table.title).cell_len > width:
        # A title wraps at the table's width: a long path would break, so print it alone.
        wide.print(table.title, soft_wrap=True)
        table.title = None
    wide.print(table)


PIPE_WIDTH = 100  # the most columns a table may take where no terminal gives a width (a pipe, a CI log)


def _natural_width(out: Console, table: Table) -> int:
    return Measurement.get(out, out.options.update_width(1_000_000), table).maximum


def print_fitted_table(table: Table, out: Console | None = None, width: int = PIPE_WIDTH) -> None:
    """:func:`print_table`, no wider than the terminal (or ``width`` in a pipe), no cell split to fit. A table
    that does not fit: two columns wrap their values; wider ones print a block per row, each cell after its
    column's name (Rich would squeeze the doctor's 13 columns into 6-character cells)."""
    out = out or console
    room = out.width if out.is_terminal else width
    if _natural_width(out, table) <= room:
        print_table(table, out)
        return
    narrow = (
        out if out.is_terminal else Console(file=out.file, width=width, color_system=None, highlight=False)
    )
    for column in table.columns:
        column.overflow = "fold"
    if len(table.columns) <= 2:
        narrow.print(table)
        return
    if table.title:
        narrow.print(table.title)
    headers = [str(column.header) for column in table.columns]
    for row in zip(*(list(column.cells) for column in table.columns)):
        block = Table(show_header=False, box=None, padding=(0, 1, 0, 0))
        block.add_column(no_wrap=True)
        block.add_column(overflow="fold")
        for header, cell in zip(headers[1:], row[1:]):
            block.add_row(header, cell)
        narrow.print(row[0])
        narrow.print(Padding(block, (0, 0, 0, 2), expand=False))


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
                ((c, p) for etype, c, p in ERRORS if _is_a(e, etype)),
                (EXIT_ERROR, f"unexpected {type(e).__name__}"),
            )
            # escape: brackets (paths, lists) are not markup; soft_wrap: a path is not cut in a pipe.
            err_console.print(
                f"[bold red]vlfast: {prefix}:[/bold red] {escape(str(e))}", highlight=False, soft_wrap=True
            )
            if code == EXIT_ERROR:
                err_console.print(
                    "[dim]This looks like a bug: run again with VLFAST_DEBUG=1 for the full traceback.[/dim]"
                )
            raise typer.Exit(code) from None

    return wrapper
