"""`vlfast demo-checkpoint`: write the tiny offline Qwen3-VL checkpoint the tests use, to try commands on.

The references (``ref:NAME``) are vision towers only; the tokens commands and ``--features llm`` need a
checkpoint with a language model and a tokenizer, and vlfast downloads nothing.
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from vlfast.cli._common import JsonOpt, UsageError, handle_errors, print_json, say
from vlfast.cli._extras import require


def register(app: typer.Typer) -> None:
    app.command("demo-checkpoint")(demo_checkpoint)


@handle_errors
def demo_checkpoint(
    out: Annotated[str, typer.Argument(help="A new or empty folder to write the checkpoint into.")],
    as_json: JsonOpt = False,
) -> None:
    """Write a tiny random-weight Qwen3-VL checkpoint (2 MB) with a language model and tokenizer.

    About 7 s on a 2-core CPU at load 2, start-up included (most of it importing torch and transformers);
    longer on a busier machine.
    """
    require("extract", "vlfast demo-checkpoint")  # the processor it saves is extraction's (PIL, av)
    from vlfast._files import honour_umask, write_atomically
    from vlfast.cli._process import since_start, since_start_words
    from vlfast.demo import make_tiny_qwen3_vl

    folder = Path(out)
    if folder.exists() and (not folder.is_dir() or any(folder.iterdir())):
        raise UsageError(f"{out} exists and is not an empty folder; name a new one")

    def write(tmp: Path) -> None:
        make_tiny_qwen3_vl(tmp)
        for path in tmp.rglob("*"):
            if path.is_file():  # safetensors writes its weights 0600: readable by the user alone
                honour_umask(path)

    # Beside OUT, renamed into place when whole: a failure half-way leaves no partial checkpoint.
    write_atomically(folder, write, tag="demo")
    if as_json:
        print_json({"path": str(folder), "files": sorted(p.name for p in folder.iterdir())})
        return
    say(
        f"wrote a tiny Qwen3-VL checkpoint (random weights: its features and audits mean nothing) to {out}, "
        f"{since_start():.1f} s {since_start_words()}\n"
        f"try: vlfast tokens audit --model {out}\n"
        f"     vlfast extract --demo demo_llm --model {out} --features vision,llm"
    )
