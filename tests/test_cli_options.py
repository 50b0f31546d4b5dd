"""Every numeric option of every command is checked before anything runs or is written (issue 38, item 8).

The options are discovered from the click command objects, so an option added later is covered without
touching this file: NaN, infinities, negatives, zero and huge values must exit 0 or 2, never 3; an absurd
value (NaN, an infinity, a negative, 10**30) must exit 2 naming the flag; and a refusal leaves OUT as it was.
The commands run in this process (CliRunner). What a command would do with a value it accepts is stubbed
where that is slow (doctor's probe, profile's timings, verify's towers); `vlfast extract` runs for real over
an OUT that already holds its one sample, so an accepted value answers "nothing to do" (or a configuration
refusal) without building a model.
"""

from __future__ import annotations

import itertools
import math
import warnings
from pathlib import Path

import pytest
import typer
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from typer.testing import CliRunner

from _commands import COMMANDS
from vlfast.cli._common import number_type
from vlfast.cli.main import app

runner = CliRunner()


def _flag(param) -> str:
    return max(param.opts, key=len)


# (command, flag, int or float) of every numeric option the CLI has
NUMERIC = [
    (" ".join(path), _flag(p), kind)
    for path, cmd in COMMANDS.items()
    for p in getattr(cmd, "params", [])
    if (kind := number_type(p)) is not None
]

# Options that carry numbers in text (lists, sizes): not discoverable by type, so named here; "{}" is
# where the value goes.
TEXT_NUMBERS = [
    ("extract", "--layers", "{}"),
    ("profile", "--batch", "{}"),
    ("profile", "--frames", "{}"),
    ("profile", "--size", "{}x64"),
    ("profile", "--size", "64x{}"),
    ("verify", "--grid", "2x{}x16"),
    ("verify", "--grid", "{}x16x16"),
    ("tokens audit", "--reference-ids", "{}"),
    ("tokens fix", "--reference-ids", "{}"),
    ("tokens fix", "--reference-ids", "5-{}"),
]

# What an option needs beside it to mean anything
CONTEXT = {
    "--dim": ["--features", "embedding"],
    "--layers": ["--features", "vision,llm"],
    "--ray-workers": ["--engine", "ray"],
    "--num-gpus-per-worker": ["--engine", "ray"],
    "--ray-cpus-per-worker": ["--engine", "ray"],
    "--rank": ["--world-size", "4"],
    "--world-size": ["--rank", "0"],
}

ABSURD = ["nan", "inf", "-inf", "-1", "-0.5", str(10**30), "1e30"]
VALUES = [*ABSURD, "0"]


def test_the_numeric_options_are_found():
    found = {(c, f) for c, f, _ in NUMERIC}
    assert {("extract", "--fps"), ("extract", "--batch-tokens"), ("doctor", "--budget")} <= found
    assert {("profile", "--repeats"), ("verify", "--windows"), ("extract", "--world-size")} <= found
    assert len(found) >= 20, sorted(found)


def test_every_numeric_option_has_its_range():
    """A numeric option added later must say what it takes (vlfast.limits), or it is only checked finite."""
    from vlfast.limits import LIMITS

    assert [(c, f) for c, f, _ in NUMERIC if f not in LIMITS] == []
    # the exceptions' ranges are the model's: its layers, its embedding's rows
    assert [
        (c, f) for c, f, _ in TEXT_NUMBERS if f not in LIMITS | {"--layers": 0, "--reference-ids": 0}
    ] == []


def _reached(*args, **kwargs):
    """Stands in for the work a command does once its options are accepted: exit 0 at once."""
    raise typer.Exit(0)


@pytest.fixture(scope="module")
def finished_out(tmp_path_factory, tiny_qwen3_vl):
    """A finished OUT of one image by the tiny checkpoint, and the command that made it."""
    from PIL import Image

    from vlfast.demo import pattern

    root = tmp_path_factory.mktemp("options")
    images = root / "in"
    images.mkdir()
    Image.fromarray(pattern(40, 48, 1)).save(images / "a.png")
    (images / "b.png").write_text("not an image")  # recorded: "not an image PIL can read"
    out = root / "out"
    args = ["extract", str(images), str(out), "--model", str(tiny_qwen3_vl), "--workers", "0"]
    r = runner.invoke(app, args)
    assert r.exit_code == 0, r.output
    return out, args[:5]


def _snapshot(out: Path) -> dict[str, tuple[int, int]]:
    return {str(p.relative_to(out)): (p.stat().st_size, p.stat().st_mtime_ns) for p in sorted(out.rglob("*"))}


@pytest.fixture(scope="module")
def stubbed():
    """doctor, profile and verify stop where their work would start."""
    with pytest.MonkeyPatch.context() as mp:
        import vlfast.diagnosis.doctor as doctor
        import vlfast.diagnosis.profiler as profiler
        import vlfast.diagnosis.verification as verification

        mp.setattr(doctor, "doctor", _reached)
        mp.setattr(profiler, "profile", _reached)
        mp.setattr(verification, "verify", _reached)
        mp.setattr(verification, "expected_seconds", lambda *a, **k: None)
        # --engine ray would quiet Ray's console handlers for the rest of this process (nothing undoes it)
        mp.setattr("vlfast.cli.extract.quiet_ray", lambda verbose: None)
        yield


def _run(command: str, flag: str, value: str, finished_out) -> tuple[int, str, bool]:
    """(exit code, output, whether OUT is as it was) of ``command`` with ``flag value``."""
    out, extract = finished_out
    model = extract[4]
    fixed = out.parent / f"fixed-{next(_FIXES)}"  # tokens fix's OUT: a new folder each time
    base = {
        "extract": extract,
        "tokens audit": ["tokens", "audit", "--model", model],
        "tokens fix": ["tokens", "fix", str(fixed), "--model", model],
    }.get(command, command.split())
    before = _snapshot(out)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # e.g. the CPU's last-bits warning of every extract run
        r = runner.invoke(app, [*base, *CONTEXT.get(flag, []), flag, value])
    untouched = _snapshot(out) == before and (r.exit_code != 2 or not fixed.exists())
    return r.exit_code, r.output, untouched


_FIXES = itertools.count()


def _absurd(text: str) -> bool:
    try:
        x = float(text)
    except ValueError:
        return False
    return not math.isfinite(x) or x < 0 or abs(x) > 1e15


def _check(command: str, flag: str, value: str, finished_out, *, text: bool = False) -> None:
    code, output, untouched = _run(command, flag, value, finished_out)
    where = f"vlfast {command} {flag} {value}: exit {code}\n{output}"
    assert code in (0, 2), where
    if code == 2:
        assert untouched, f"{where}\nOUT changed on a refusal"
    if _absurd(value) and not (text and value.startswith("-")):  # --layers -1 is a layer
        assert code == 2 and flag in output, where


@pytest.mark.parametrize("command,flag,kind", NUMERIC, ids=[f"{c} {f}" for c, f, _ in NUMERIC])
def test_absurd_numbers_are_refused_naming_the_flag(command, flag, kind, finished_out, stubbed):
    for value in VALUES:
        _check(command, flag, value, finished_out)


@pytest.mark.parametrize("command,flag,form", TEXT_NUMBERS, ids=[f"{c} {f} {t}" for c, f, t in TEXT_NUMBERS])
def test_numbers_in_text_options_are_refused_or_taken(command, flag, form, finished_out, stubbed):
    for value in VALUES:
        _check(command, flag, form.format(value), finished_out, text=True)


_NUMBER_TEXT = st.one_of(
    st.sampled_from(VALUES),
    st.integers(-(10**20), 10**20).map(str),
    st.floats(allow_nan=True, allow_infinity=True).map(repr),
)


@settings(
    max_examples=60,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
@given(option=st.sampled_from(NUMERIC), value=_NUMBER_TEXT)
def test_any_number_exits_0_or_2_and_a_refusal_writes_nothing(option, value, finished_out, stubbed):
    command, flag, _ = option
    _check(command, flag, value, finished_out)


def test_a_misspelt_retry_kind_is_refused_not_answered_nothing_to_do(finished_out):
    out, extract = finished_out
    before = _snapshot(out)
    r = runner.invoke(app, [*extract, "--retry-errors", "eror"])
    assert r.exit_code == 2, r.output
    assert "--retry-errors" in r.output and "'eror'" in r.output and "did you mean 'error'" in r.output
    assert "not an image PIL can read" in r.output  # what OUT does record
    r = runner.invoke(app, [*extract, "--retry-errors", "not an image PIL can reed"])
    assert r.exit_code == 2 and "did you mean 'not an image PIL can read'" in r.output, r.output
    r = runner.invoke(app, [*extract, "--retry-errors", "duplicate"])
    assert r.exit_code == 2 and "never retried" in r.output, r.output
    assert _snapshot(out) == before
    # a kind of failure this OUT does not hold is still a kind: nothing to retry
    r = runner.invoke(app, [*extract, "--retry-errors", "transient"])
    assert r.exit_code == 0 and "nothing to do" in r.output, r.output


@pytest.mark.parametrize(
    "field,value,flag",
    [
        ("fps", math.nan, "--fps"),
        ("fps", math.inf, "--fps"),
        ("min_pixels", 10**12, "--min-pixels"),
        ("max_pixels", 10**12, "--max-pixels"),
        ("max_batch_tokens", 0, "--batch-tokens"),
        ("num_workers", -1, "--workers"),
        ("decode_timeout", math.nan, "--decode-timeout"),
        ("commit_every", math.inf, "--commit-every"),
        ("num_frames", 10**9, "--num-frames"),
        ("world_size", 0, "--world-size"),
    ],
)
def test_the_library_refuses_them_too(field, value, flag):
    from vlfast.errors import InputRefused
    from vlfast.extraction.config import ExtractConfig

    with pytest.raises(InputRefused, match=f"{field} \\({flag}\\) must be"):
        ExtractConfig(model="ref:qwen3-vl-2b", **{field: value})
