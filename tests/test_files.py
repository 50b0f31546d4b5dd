"""vlfast._files: the one way vlfast writes a user's file or folder (beside it, renamed into place when
whole) and tells an output that is an input by identity; and `vlfast demo-checkpoint`, which uses it."""

from __future__ import annotations

import errno
import os
from pathlib import Path

import pytest
from typer.testing import CliRunner

from vlfast._files import is_inside, same_file, write_atomically
from vlfast.cli.main import app
from vlfast.errors import InputRefused

runner = CliRunner()


def test_same_file_is_identity_whatever_the_spelling(tmp_path, monkeypatch):
    a = tmp_path / "a.txt"
    a.write_text("x")
    (tmp_path / "twin.txt").write_text("x")  # equal content, another file
    os.link(a, tmp_path / "hard.txt")
    (tmp_path / "soft.txt").symlink_to(a)
    (tmp_path / "sub").mkdir()
    monkeypatch.chdir(tmp_path / "sub")
    assert same_file(a, tmp_path / "hard.txt")
    assert same_file(a, tmp_path / "soft.txt")
    assert same_file(a, "../a.txt")
    assert not same_file(a, tmp_path / "twin.txt")
    assert not same_file(a, tmp_path / "missing.txt") and not same_file(tmp_path / "missing.txt", a)
    (tmp_path / "dangling").symlink_to(tmp_path / "missing.txt")
    assert not same_file(tmp_path / "dangling", tmp_path / "missing.txt")

    (tmp_path / "dir-link").symlink_to(tmp_path)
    assert is_inside(tmp_path / "sub" / "new" / "x", tmp_path)
    assert is_inside(tmp_path / "dir-link" / "x", tmp_path)
    assert is_inside("x", tmp_path)  # relative to the working folder, tmp_path/sub
    assert not is_inside(tmp_path, tmp_path / "sub")
    assert not is_inside(tmp_path.parent / "elsewhere", tmp_path)


def _temps(folder: Path) -> list[str]:
    return sorted(p.name for p in folder.iterdir() if p.name.startswith("."))


@pytest.mark.parametrize("kind", ["file", "folder"])
def test_a_failed_write_leaves_nothing_and_the_previous_destination(tmp_path, kind):
    dest = tmp_path / "dest"

    def failing(tmp: Path) -> None:
        if kind == "file":
            tmp.write_text("half")
        else:
            tmp.mkdir()
            (tmp / "part").write_text("half")
        raise OSError(errno.ENOSPC, "No space left on device")

    with pytest.raises(OSError):
        write_atomically(dest, failing)
    assert list(tmp_path.iterdir()) == []
    if kind == "file":
        dest.write_text("previous")
    else:
        dest.mkdir()
        (dest / "part").write_text("previous")
    with pytest.raises(OSError):
        write_atomically(dest, failing, overwrite=True)
    assert (dest.read_text() if kind == "file" else (dest / "part").read_text()) == "previous"
    assert _temps(tmp_path) == []


def test_destinations_replaced_only_when_allowed(tmp_path):
    dest = tmp_path / "d.txt"
    write_atomically(dest, lambda tmp: tmp.write_text("one"))
    with pytest.raises(InputRefused, match="exists"):
        write_atomically(dest, lambda tmp: tmp.write_text("two"))
    assert dest.read_text() == "one"
    write_atomically(dest, lambda tmp: tmp.write_text("two"), overwrite=True)
    assert dest.read_text() == "two"

    folder = tmp_path / "f"
    folder.mkdir()  # an empty folder is a new one: filled without overwrite
    write_atomically(folder, lambda tmp: (tmp.mkdir(), (tmp / "x").write_text("1")))
    assert (folder / "x").read_text() == "1"
    with pytest.raises(InputRefused, match="exists"):
        write_atomically(folder, lambda tmp: (tmp.mkdir(), (tmp / "y").write_text("2")))
    assert [p.name for p in folder.iterdir()] == ["x"]
    assert _temps(tmp_path) == []


def test_demo_checkpoint_that_fails_leaves_no_folder(tmp_path, monkeypatch):
    """Before: a checkpoint that failed half-way stayed, partial, under the name the user gave."""
    import vlfast.demo

    def half(path, **kw):
        Path(path).mkdir(parents=True, exist_ok=True)
        (Path(path) / "config.json").write_text("{}")
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(vlfast.demo, "make_tiny_qwen3_vl", half)
    for target in (tmp_path / "new", tmp_path / "empty"):
        if target.name == "empty":
            target.mkdir()
        r = runner.invoke(app, ["demo-checkpoint", str(target)])
        assert r.exit_code == 4 and "disk full" in r.output, r.output  # not "a bug" (3)
        assert not target.exists() or list(target.iterdir()) == [], target
    assert sorted(p.name for p in tmp_path.iterdir()) == ["empty"]  # the user's empty folder, no temp


def test_demo_checkpoint_twice_and_into_an_empty_folder(tmp_path):
    target = tmp_path / "ckpt"
    target.mkdir()
    r = runner.invoke(app, ["demo-checkpoint", str(target), "--json"])
    assert r.exit_code == 0, r.output
    files = {p.name: p.read_bytes() for p in target.iterdir()}
    assert "config.json" in files and "tokenizer.json" in files
    # Before: model.safetensors was 0600, as safetensors writes it: unreadable by teammates.
    mask = os.umask(0o022)
    os.umask(mask)
    assert {p.name: p.stat().st_mode & 0o777 for p in target.iterdir()} == dict.fromkeys(files, 0o666 & ~mask)
    r = runner.invoke(app, ["demo-checkpoint", str(target)])
    assert r.exit_code == 2 and "not an empty folder" in r.output
    assert {p.name: p.read_bytes() for p in target.iterdir()} == files
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt"]


def test_tokens_rewrite_on_a_full_disk_exits_4_and_leaves_no_output(tmp_path, monkeypatch):
    """A full disk is the machine's state, not a bug: exit 4 (as extract's) with the file named, the dataset
    untouched, and no --out, whole or partial."""
    import vlfast.tokens.rewrite

    def full(dest, write, **kw):
        def half(tmp: Path) -> None:
            write(tmp)
            raise OSError(errno.ENOSPC, "No space left on device", str(tmp))

        return write_atomically(dest, half, **kw)

    monkeypatch.setattr(vlfast.tokens.rewrite, "write_atomically", full)
    data = tmp_path / "train.jsonl"
    data.write_text('{"completion": "<think>a</think> b"}\n')
    out = tmp_path / "train2.jsonl"
    args = ["tokens", "rewrite", "--map", "think=thinking", "--dataset", str(data), "--field", "completion"]
    r = runner.invoke(app, [*args, "--out", str(out)])
    assert r.exit_code == 4, r.output
    assert "disk full" in r.output and "No space left on device" in r.output
    assert data.read_text() == '{"completion": "<think>a</think> b"}\n'
    assert sorted(p.name for p in tmp_path.iterdir()) == ["train.jsonl"]
