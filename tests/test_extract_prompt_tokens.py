"""A prompt or caption holding a vision placeholder token is bad input, not a bug (issue 38, item 7).

`<|image_pad|>` in a row's prompt (llm) or text (embedding) would give the chat template's text more image
tokens than the image has features; `<|vision_start|>` would open a second vision span. Such a row is
recorded as the sample's error naming the token and the field, and the run goes on, under every feature
kind; the same token in --prompt or --instruction (every row) is refused before anything is written.
"""

from __future__ import annotations

import json
import warnings

import pytest
from typer.testing import CliRunner

from vlfast.cli.main import app

runner = CliRunner()

TOKENS = ["<|image_pad|>", "<|vision_start|>", "<|video_pad|>", "<|vision_end|>"]


@pytest.fixture(scope="module")
def images(tmp_path_factory):
    from PIL import Image

    from vlfast.demo import pattern

    root = tmp_path_factory.mktemp("prompt-tokens")
    for k in range(len(TOKENS) + 1):
        Image.fromarray(pattern(32, 40, k)).save(root / f"{k}.png")
    return root


def _manifest(images, column: str):
    rows = [{"id": "good", "path": str(images / f"{len(TOKENS)}.png"), column: "What is in it?"}]
    rows += [
        {"id": f"bad{k}", "path": str(images / f"{k}.png"), column: f"Describe {token} this."}
        for k, token in enumerate(TOKENS)
    ]
    path = images / f"{column}.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def _errors(out) -> dict[str, str]:
    records = [
        json.loads(line) for f in (out / "errors").glob("*.jsonl") for line in f.read_text().splitlines()
    ]
    return {r["id"]: r["reason"] for r in records}


@pytest.mark.parametrize(("features", "column"), [("vision,llm", "prompt"), ("embedding", "text")])
def test_a_placeholder_in_a_row_is_recorded_and_the_run_goes_on(
    images, tmp_path, tiny_qwen3_vl, features, column
):
    out = tmp_path / "out"
    args = ["extract", str(_manifest(images, column)), str(out), "-m", str(tiny_qwen3_vl), "-f", features]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        r = runner.invoke(app, [*args, "--workers", "0"])
    assert r.exit_code == 0, r.output
    errors = _errors(out)
    assert set(errors) == {f"bad{k}" for k in range(len(TOKENS))}, errors
    for k, token in enumerate(TOKENS):
        assert token in errors[f"bad{k}"] and f"the {column} holds" in errors[f"bad{k}"], errors[f"bad{k}"]
    import vlfast

    assert vlfast.FeatureCache(str(out)).ids() == ["good"]
    # recorded, so the same command is done: no bug stops it on every rerun
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        r = runner.invoke(app, args)
    assert r.exit_code == 0 and "nothing to do" in r.output, r.output


@pytest.mark.parametrize(("features", "flag"), [("vision,llm", "--prompt"), ("embedding", "--instruction")])
def test_a_placeholder_in_a_flag_is_refused_before_anything_is_written(
    images, tmp_path, tiny_qwen3_vl, features, flag
):
    out = tmp_path / "out"
    r = runner.invoke(
        app,
        [
            "extract",
            str(images),
            str(out),
            "-m",
            str(tiny_qwen3_vl),
            "-f",
            features,
            flag,
            "a <|image_pad|> b",
        ],
    )
    assert r.exit_code == 2, r.output
    assert flag in r.output and "<|image_pad|>" in r.output
    assert not out.exists()
