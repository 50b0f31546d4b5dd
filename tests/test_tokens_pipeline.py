"""`vlfast tokens check-pipeline` on tokenizers built here: a byte-level BPE trained in the test, wrapped in
PreTrainedTokenizerFast with `<think>`/`</think>` as added tokens (or not), and chat templates written to
trigger, or to pass, each check."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
from typer.testing import CliRunner

from vlfast.tokens.pipeline import builtin_sample, check_pipeline, default_reward_regex

runner = CliRunner()

CORPUS = [
    "User: What is 2 + 3? Assistant: <think> The user asks for 2 + 3. </think> <answer> 5 </answer>",
    "Adding 2 and 3 gives 5.\n</think>\n<answer>\n5\n</answer> the user asks, adding gives",
] * 20

# Qwen3's switch: reasoning on unless enable_thinking is false; the generation prompt opens no tag.
QWEN3 = (
    "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n"
    "{% if enable_thinking is defined and enable_thinking is false %}<think>\n\n</think>\n\n{% endif %}"
    "{% endif %}"
)
# DeepSeek-R1 / Qwen3-Thinking style: with reasoning on, the generation prompt ends with `<think>\n`.
PREFILL = (
    "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% if enable_thinking %}<think>\n{% endif %}"
    "{% endif %}"
)
# A plain-text template whose generation prompt ends with a space.
PLAIN = (
    "{% for m in messages %}{{ m.role | capitalize }}: {{ m.content }}\n{% endfor %}"
    "{% if add_generation_prompt %}Assistant: {% endif %}"
)


def make_tokenizer(folder: Path, template: str | None = QWEN3, think: str = "added") -> Path:
    """think: "added" (non-special, as Qwen3), "special", "lstrip" (added, swallows the space before it)
    or "absent" (the tags split into ordinary pieces, as Qwen2.5)."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=330, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False
    )
    tok.train_from_iterator(CORPUS, trainer)
    tok.add_special_tokens(
        [AddedToken(s, special=True, normalized=False) for s in ("<|im_start|>", "<|im_end|>")]
    )
    if think != "absent":
        tok.add_tokens(
            [
                AddedToken(t, special=think == "special", normalized=False, lstrip=think == "lstrip")
                for t in ("<think>", "</think>")
            ]
        )
    hf = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|im_end|>")
    if template is not None:
        hf.chat_template = template
    hf.save_pretrained(str(folder))
    return folder


@pytest.fixture(scope="module")
def models(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("pipeline")
    specs = {
        "good": (QWEN3, "added"),
        "prefill": (PREFILL, "added"),
        "special": (QWEN3, "special"),
        "pieces": (QWEN3, "absent"),  # tags split into pieces, but always after a newline
        "space": (PLAIN, "absent"),  # ... and after "Assistant: "
        "lstrip": (PLAIN, "lstrip"),
        "no-template": (None, "added"),
    }
    return {name: make_tokenizer(root / name, t, k) for name, (t, k) in specs.items()}


def statuses(report) -> dict[str, str]:
    return {c.name: c.status for c in report.checks}


def test_good_template_passes_every_check(models):
    report = check_pipeline(models["good"])
    assert statuses(report) == dict.fromkeys(
        ("template-position", "prefilled-tag", "stripped-on-decode", "round-trip"), "pass"
    )
    assert report.ok and report.failed == []
    assert report.reasoning_switches == ["enable_thinking"]
    assert report.reward_regex == "^<think>.*?</think>.*$" and report.reward_regex_default
    assert report.generation_prompt.endswith("<|im_start|>assistant\n")


# -- template position ------------------------------------------------------------------------------


def test_position_fails_on_a_leading_space_variant(models):
    check = check_pipeline(models["space"]).check("template-position")
    assert check.status == "fail"
    bad = [p for p in check.evidence.placements if not p.same]
    # "Assistant: " + "<think>": the space joins "<" into one piece that "<think>" alone never has.
    assert [(p.tag, p.context, p.kind, p.before) for p in bad] == [("<think>", "conversation", "merges", " ")]
    assert bad[0].pieces[0] == "Ġ<" and bad[0].alone_pieces[0] == "<"
    assert "leading-space variant" in bad[0].note and "added token" in check.fix


def test_position_passes_for_split_tags_after_newlines(models):
    # Not added tokens either, but every place they occur starts a new pre-token: same ids as alone.
    check = check_pipeline(models["pieces"]).check("template-position")
    assert check.status == "pass"
    contexts = {(p.tag, p.context) for p in check.evidence.placements}
    assert ("<think>", "conversation") in contexts and ("</think>", "completion") in contexts
    assert all(p.ids == p.alone_ids and len(p.ids) > 1 for p in check.evidence.placements)


def test_position_flags_an_added_tag_that_absorbs_whitespace(models):
    check = check_pipeline(models["lstrip"]).check("template-position")
    assert check.status == "fail"
    kinds = {(p.tag, p.kind, p.before) for p in check.evidence.placements if not p.same}
    assert ("</think>", "absorbs", "\n") in kinds
    assert "lstrip" in check.fix


# -- prefilled tag -------------------------------------------------------------------------------------


def test_prefilled_tag_with_default_regex_fails_and_suggests_a_regex(models):
    report = check_pipeline(models["prefill"])
    check = report.check("prefilled-tag")
    assert check.status == "fail" and report.failed == ["prefilled-tag"]
    ev = check.evidence
    assert report.reasoning_switches == ["enable_thinking"]  # the prefill appears only with reasoning on
    assert ev.prefilled_tags == ["<think>"] and ev.generation_suffix.endswith("<think>\n")
    assert not ev.completion.startswith("<think>") and ev.matches_with_prefill and not ev.matches_completion
    assert ev.suggested_regex == "^(?:<think>)?.*?</think>.*$"
    assert re.search(ev.suggested_regex, ev.completion, re.DOTALL)
    assert re.search(ev.suggested_regex, builtin_sample(["<think>", "</think>"]), re.DOTALL)


def test_prefilled_tag_keeps_the_regex_newline_in_the_suggestion(models):
    regex = r"^<think>\n.*?\n</think>\n<answer>\n.*?\n</answer>$"  # Open-R1's format reward
    ev = check_pipeline(models["prefill"], reward_regex=regex).check("prefilled-tag").evidence
    assert ev.suggested_regex == r"^(?:<think>\n)?.*?\n</think>\n<answer>\n.*?\n</answer>$"


def test_prefilled_tag_passes_when_the_regex_does_not_require_it(models):
    report = check_pipeline(
        models["prefill"], reward_regex=r"^(?:<think>)?.*?</think>\s*<answer>.*?</answer>$"
    )
    assert report.check("prefilled-tag").status == "pass" and report.ok


def test_prefilled_tag_with_a_real_completion_sample(models, tmp_path):
    # A completion as the engine returns it after the prefilled prompt: no opening tag.
    sample = tmp_path / "completion.txt"
    sample.write_text("2 + 3 = 5.\n</think>\nThe answer is 5.\n")
    ev = check_pipeline(models["prefill"], sample=sample).check("prefilled-tag").evidence
    assert ev.completion == "2 + 3 = 5.\n</think>\nThe answer is 5."  # the editor's final newline dropped
    assert ev.with_prefill == "<think>\n" + ev.completion and not ev.matches_completion


def test_prefilled_tag_skips_when_the_regex_fits_no_form_of_the_sample(models):
    report = check_pipeline(models["prefill"], reward_regex="^<solution>.*</solution>$")
    assert report.check("prefilled-tag").status == "skip"
    assert report.tags == ["<think>", "</think>", "<solution>", "</solution>"]  # the regex's tags join
    assert report.ok  # skip is not a finding


# -- stripped on decode --------------------------------------------------------------------------------


def test_special_tags_are_stripped_on_decode(models):
    check = check_pipeline(models["special"]).check("stripped-on-decode")
    assert check.status == "fail" and "skip_special_tokens=False" in check.fix
    ev = check.evidence
    assert "<think>" in ev.text_kept and "</think>" in ev.text_kept
    assert "<think>" not in ev.text_skipped and "</think>" not in ev.text_skipped
    assert [(t.tag, t.special, t.kept, t.in_sample, t.in_skipped_text) for t in ev.tags] == [
        ("<think>", [True], False, 1, 0),
        ("</think>", [True], False, 1, 0),
    ]


def test_non_special_tags_survive_decode(models):
    check = check_pipeline(models["good"]).check("stripped-on-decode")
    assert check.status == "pass"
    assert check.evidence.text_skipped == check.evidence.text_kept == check.evidence.sample


# -- round trip ----------------------------------------------------------------------------------------


def test_round_trip_fails_across_a_prompt_ending_in_a_space(models):
    ev = check_pipeline(models["space"]).check("round-trip").evidence
    # The completion alone round-trips; after "Assistant: " the space and "<" merge into one piece.
    assert ev.text_ok and ev.completion_ok and not ev.in_context_ok
    assert ev.first_difference == -1
    assert "Ġ" in ev.expected_pieces and "Ġ<" in ev.got_pieces


def test_round_trip_fails_when_an_added_tag_swallows_text(models):
    check = check_pipeline(models["lstrip"]).check("round-trip")
    assert check.status == "fail" and not check.evidence.text_ok
    assert "\n</think>" in check.evidence.completion and "\n</think>" not in check.evidence.decoded


def test_round_trip_passes_in_context(models):
    ev = check_pipeline(models["good"]).check("round-trip").evidence
    assert ev.text_ok and ev.completion_ok and ev.in_context_ok and ev.first_difference is None


# -- tags, defaults ------------------------------------------------------------------------------------


def test_custom_tags_set_the_default_regex_and_sample(models):
    tags = ["<reasoning>", "</reasoning>"]
    assert default_reward_regex(tags) == "^<reasoning>.*?</reasoning>.*$"
    report = check_pipeline(models["good"], tags=["<reasoning>,</reasoning>"])
    assert report.tags == tags and report.reward_regex == default_reward_regex(tags)
    assert report.check("round-trip").evidence.completion.startswith("<reasoning>")


# -- CLI: JSON, exit codes, tables in a pipe, bad input -----------------------------------------------


def _strict(text: str) -> dict:
    def reject(name: str):
        raise ValueError(f"non-standard JSON constant {name}")

    return json.loads(text, parse_constant=reject)


@pytest.mark.parametrize(
    ("name", "code", "failed"),
    [
        ("good", 0, []),
        ("prefill", 1, ["prefilled-tag"]),
        ("special", 1, ["stripped-on-decode"]),
        ("space", 1, ["template-position", "round-trip"]),
    ],
)
def test_cli_json_is_strict_and_exit_code_follows_checks(tokens_app, models, name, code, failed):
    r = runner.invoke(tokens_app, ["tokens", "check-pipeline", "--model", str(models[name]), "--json"])
    assert r.exit_code == code, r.output
    data = _strict(r.stdout)
    assert data["ok"] is (code == 0) and data["failed"] == failed
    assert [c["name"] for c in data["checks"]] == [
        "template-position",
        "prefilled-tag",
        "stripped-on-decode",
        "round-trip",
    ]
    assert all(c["status"] in ("pass", "fail", "skip") for c in data["checks"])
    placements = data["checks"][0]["evidence"]["placements"]
    assert placements and all({"same", "kind", "note"} <= set(p) for p in placements)


def test_cli_table_in_a_pipe_prints_names_and_verdicts_whole(models, tmp_path):
    # A real pipe at 60 columns, with a long path to squeeze the tables.
    deep = tmp_path / ("a-rather-long-folder-name-for-the-checkpoint-" * 2) / "model"
    deep.parent.mkdir(parents=True)
    os.symlink(models["space"], deep)
    env = {**os.environ, "COLUMNS": "60", "TERM": "dumb"}
    env.pop("FORCE_COLOR", None)
    r = subprocess.run(
        [sys.executable, "-m", "vlfast.cli.main", "tokens", "check-pipeline", "--model", str(deep)],
        capture_output=True,
        text=True,
        env=env,
        timeout=300,
    )
    assert r.returncode == 1, r.stderr[-2000:]
    out = r.stdout
    for name, status in [
        ("template-position", "fail"),
        ("prefilled-tag", "pass"),
        ("stripped-on-decode", "pass"),
        ("round-trip", "fail"),
    ]:
        assert re.search(rf"│ {name} +│ {status} +│", out), out
        assert f"{name}: {status}" in out.splitlines()
    # Evidence lines are never cut: the whole decoded sample is on one line.
    sample = builtin_sample(["<think>", "</think>"])
    assert f"  skip_special_tokens=True:  {sample!r}" in out.splitlines()
    assert "verdict: fail (template-position, round-trip)" in out


def test_cli_table_for_a_pass(tokens_app, models):
    r = runner.invoke(tokens_app, ["tokens", "check-pipeline", "-m", str(models["good"])])
    assert r.exit_code == 0, r.output
    assert "verdict: pass" in r.stdout and "enable_thinking=True" in r.stdout


def _bad_inputs(models: dict[str, Path], tmp: Path) -> list[tuple[list[str], str, str]]:
    (tmp / "empty").mkdir()
    (tmp / "latin1.jinja").write_bytes(b"\xff\xfe{{ messages }}")
    (tmp / "broken.jinja").write_text("{% for m in messages %}")
    (tmp / "config.json").write_text(json.dumps({"model_type": "qwen3"}))
    (tmp / "blank.txt").write_text("\n")
    good = str(models["good"])
    return [
        (["--model", str(tmp / "nope")], "model folder", "does not exist"),
        (["--model", str(tmp / "empty")], "no tokenizer files in", "save_pretrained"),
        (["--model", str(models["no-template"])], "has no chat template", "--template"),
        (["--model", good, "--template", str(tmp / "missing.jinja")], "missing.jinja", "does not exist"),
        (["--model", good, "--template", str(tmp / "empty")], "is a folder", "pass the .jinja file"),
        (["--model", good, "--template", str(tmp / "latin1.jinja")], "could not be read", "readable"),
        (["--model", good, "--template", str(tmp / "config.json")], "no chat_template", "template file"),
        (["--model", good, "--template", str(tmp / "broken.jinja")], "does not render", "fix it"),
        (["--model", good, "--reward-regex", "^<think>(.*"], "not a valid Python regex", "fix the pattern"),
        (["--model", good, "--sample", str(tmp / "nope.txt")], "sample", "does not exist"),
        (["--model", good, "--sample", str(tmp / "blank.txt")], "is empty", "one completion"),
    ]


def test_cli_bad_input_exit_2_with_a_clear_message(tokens_app, models, tmp_path):
    for args, what, todo in _bad_inputs(models, tmp_path):
        r = runner.invoke(tokens_app, ["tokens", "check-pipeline", *args, "--json"])
        assert r.exit_code == 2, (args, r.output)
        assert r.stdout == "", args  # nothing half-written on stdout for a script to parse
        err = " ".join(r.stderr.split())  # Rich may wrap the message at 80 columns
        assert what in err and todo in err, (args, err)


def test_unreadable_template_names_it(models, tmp_path, monkeypatch):
    # Tests run as root here, so chmod cannot make a file unreadable: fail the read instead.
    tmpl = tmp_path / "chat.jinja"
    tmpl.write_text(QWEN3)
    real = Path.read_bytes

    def read_bytes(self):
        if self == tmpl:
            raise PermissionError(13, "Permission denied", str(self))
        return real(self)

    monkeypatch.setattr(Path, "read_bytes", read_bytes)
    with pytest.raises(
        ValueError, match=r"chat\.jinja could not be read \(Permission denied\); pass a readable"
    ):
        check_pipeline(models["good"], template=tmpl)
