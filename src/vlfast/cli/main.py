"""Entry point of the ``vlfast`` command: registers one sub-app or command per file in this folder."""

from __future__ import annotations

import importlib

import typer

import vlfast
from vlfast.cli._common import HelpGroup, readable_help
from vlfast.cli._examples import HELP_OPTIONS, add_examples
from vlfast.cli._process import end
from vlfast.cli._quiet import quiet_third_party
from vlfast.cli._warnings import one_line_warnings

NOT_A_COMMAND = {
    # what newcomers type because the README lists it as a capability
    "patch": "there is no `vlfast patch`: the patch changes a model inside your program. Call vlfast.patch(model) "
    "or vlfast.patch_transformers() in Python, or run VLFAST_PATCH=1 python train.py, or "
    "python -m vlfast.run train.py; `vlfast verify` proves it on your model",
    "unpatch": "there is no `vlfast unpatch`: call vlfast.unpatch(model) in Python",
    # what a finished OUT is given to: `vlfast out`'s commands (`vlfast verify` is the patch's proof)
    "compact": "there is no `vlfast compact`: `vlfast out compact OUT` compacts an OUT's index",
}


class RootGroup(HelpGroup):
    """The ``vlfast`` group: a capability that is not a command says how to use it instead of 'No such command'."""

    def resolve_command(self, ctx, args):
        if args and args[0] in NOT_A_COMMAND and self.get_command(ctx, args[0]) is None:
            ctx.fail(NOT_A_COMMAND[args[0]])
        return super().resolve_command(ctx, args)


app = typer.Typer(
    name="vlfast",
    help="Make Qwen-VL-family vision models fast and trustworthy.",
    cls=RootGroup,
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
    rich_markup_mode=None,  # help and usage errors as plain text: brackets survive, lines wrap in a pipe
    context_settings=HELP_OPTIONS,  # sub-commands' contexts inherit it: -h everywhere
)

# Each module defines `register(app)`; the list is the CLI's table of contents.
_COMMAND_MODULES = ("models", "verify", "doctor", "profile", "extract", "out", "tokens", "demo")


def _version(value: bool) -> None:
    if value:
        typer.echo(f"vlfast {vlfast.__version__}")
        raise typer.Exit()


@app.callback()
def _root(
    version: bool = typer.Option(
        False, "--version", callback=_version, is_eager=True, help="Print the version and exit."
    ),
    verbose: bool = typer.Option(
        False,
        "--verbose",
        "-v",
        help="Show what transformers and Ray print (loading bars, INFO and WARNING lines); hidden by default.",
    ),
) -> None:
    """vlfast: exact GEMM patch for stride == kernel convs, slow-path doctor, extraction, token audits."""
    quiet_third_party(verbose)


for _name in _COMMAND_MODULES:
    importlib.import_module(f"vlfast.cli.{_name}").register(app)
readable_help(app)
add_examples(app)


def main() -> None:
    one_line_warnings()  # here, not in _root: a test's CliRunner keeps Python's format in its own process
    try:
        app()
    except SystemExit as e:
        if e.code is not None and not isinstance(e.code, int):
            raise
        end(e.code or 0)
    end(0)


if __name__ == "__main__":
    main()
