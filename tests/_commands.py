"""Every command of the ``vlfast`` CLI, walked once for the help and polish tests."""

from __future__ import annotations

import typer

from vlfast.cli.main import app


def _walk(cmd, path: tuple[str, ...] = ()):
    yield path, cmd
    for name, sub in getattr(cmd, "commands", {}).items():
        yield from _walk(sub, (*path, name))


COMMANDS = dict(_walk(typer.main.get_command(app)))
PATHS = list(COMMANDS)
IDS = [" ".join(p) or "vlfast" for p in PATHS]
