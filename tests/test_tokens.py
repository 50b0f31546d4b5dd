"""Token audit on tiny synthetic checkpoints built here: a Qwen-style byte-level BPE tokenizer trained
in the test, `<think>`/`</think>` as added (non-special) tokens, and safetensors weights with planted
never-trained, zeroed and duplicated rows."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import save_file

from vlfast.tokens import audit_tokens, audit_vocabulary, fix_tokens, parse_mapping, rewrite_tags

CORPUS = [
    "<thinking> Let me think step by step about the reasoning. </thinking> <answer> 42 </answer>",
    "<reasoning> first we think, then we answer. </reasoning> the thought is clear",
    "a thought, a reason, a solution: the final answer < > </ /> is output",
    "thinking about thinking; reasoning about reasoning; answer after answer",
] * 20
SPECIAL = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
# Qwen-VL's placeholder tokens: in the prompt, never predicted, rows never trained as outputs.
VL_SPECIAL = [
    "<|vision_start|>",
    "<|vision_end|>",
    "<|image_pad|>",
    "<|video_pad|>",
    "<|box_start|>",
    "<|box_end|>",
]
D = 48


def make_tokenizer(folder: Path, think_added: bool = True, vl_tokens: bool = False) -> int:
    """Write tokenizer.json; return its length (max id + 1)."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=420, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False
    )
    tok.train_from_iterator(CORPUS, trainer)
    tok.add_special_tokens([AddedToken(s, special=True, normalized=False) for s in SPECIAL])
    if think_added:
        tok.add_tokens([AddedToken(t, special=False, normalized=False) for t in ("<think>", "</think>")])
    if vl_tokens:  # after the others, so every other id stays where it was
        tok.add_special_tokens([AddedToken(s, special=True, normalized=False) for s in VL_SPECIAL])
    folder.mkdir(parents=True, exist_ok=True)
    tok.save(str(folder / "tokenizer.json"))
    return max(tok.get_vocab(with_added_tokens=True).values()) + 1


def make_model(
    folder: Path,
    *,
    tied: bool = False,
    think_added: bool = True,
    padding: int = 24,
    zero_padding: bool = False,
    plant: bool = False,
    sharded: bool = False,
    dtype: torch.dtype = torch.bfloat16,
    seed: int = 0,
    vl_tokens: bool = False,
) -> dict:
    """A checkpoint whose never-trained rows (added `<think>` tokens, padding, planted) look like
    fresh init: small random input rows and output rows drifted along one shared direction, as the
    softmax gradient pushes every unseen token's lm_head row. Trained rows vary most along an axis
    of their own (the first principal component, as a token-frequency direction does in real models).
    Returns what was planted. `vl_tokens` adds Qwen-VL's placeholder tokens, never trained either."""
    n_tok = make_tokenizer(folder, think_added, vl_tokens)
    rows = n_tok + padding
    g = torch.Generator().manual_seed(seed)
    common_in, common_out, axis = (torch.randn(D, generator=g) for _ in range(3))
    axis = axis / axis.norm()
    emb = torch.randn(rows, D, generator=g) + 0.3 * common_in + 3.0 * torch.randn(rows, 1, generator=g) * axis
    out = (
        torch.randn(rows, D, generator=g) + 0.5 * common_out + 3.0 * torch.randn(rows, 1, generator=g) * axis
    )
    drift = torch.randn(D, generator=g)
    drift = 4.0 * (drift - (drift @ axis) * axis) / drift.norm()

    def untrained(ids: list[int]) -> None:
        ids_t = torch.tensor(ids, dtype=torch.long)
        emb[ids_t] = 0.02 * torch.randn(len(ids), D, generator=g)
        if tied:
            emb[ids_t] += 0.1 * drift
        out[ids_t] = drift + 0.02 * torch.randn(len(ids), D, generator=g)

    vocab = json.loads((folder / "tokenizer.json").read_text())
    added = [t["id"] for t in vocab["added_tokens"] if t["content"] in ("<think>", "</think>")]
    vl = {t["content"]: t["id"] for t in vocab["added_tokens"] if t["content"] in VL_SPECIAL}
    pad = list(range(n_tok, rows))
    untrained(added + list(vl.values()) + pad)
    if zero_padding:
        emb[n_tok:] = 0
        out[n_tok:] = 0
    planted: dict[str, list[int]] = {"untrained": [], "zero": [], "duplicate": []}
    if plant:
        # Ordinary ids among the BPE merges (after the 256 byte tokens, before the added ones).
        rng = np.random.default_rng(seed)
        pick = rng.choice(np.arange(256, n_tok - len(SPECIAL) - 2), size=24, replace=False).tolist()
        planted = {"untrained": pick[:10], "zero": pick[10:16], "duplicate": pick[16:24]}
        untrained(planted["untrained"])
        z = torch.tensor(planted["zero"])
        emb[z] = 0
        out[z] = 0
        # Two groups of rows set to one trained-looking vector each (a naive shared init).
        for grp in (planted["duplicate"][:4], planted["duplicate"][4:]):
            v_in, v_out = torch.randn(D, generator=g), torch.randn(D, generator=g)
            emb[torch.tensor(grp)] = v_in
            out[torch.tensor(grp)] = v_out
    prefix = "model.language_model." if sharded else "model."
    tensors = {
        f"{prefix}embed_tokens.weight": emb.to(dtype),
        f"{prefix}norm.weight": torch.ones(D, dtype=dtype),
    }
    if tied:
        out = emb
    else:
        tensors["lm_head.weight"] = out.to(dtype)
    config = {"model_type": "qwen3", "vocab_size": rows, "hidden_size": D, "tie_word_embeddings": tied}
    (folder / "config.json").write_text(json.dumps(config))
    if sharded:
        names = sorted(tensors)
        shards = {
            "model-00001-of-00002.safetensors": names[:1],
            "model-00002-of-00002.safetensors": names[1:],
        }
        weight_map = {}
        for shard, keys in shards.items():
            save_file({k: tensors[k] for k in keys}, str(folder / shard), metadata={"format": "pt"})
            weight_map.update({k: shard for k in keys})
        (folder / "model.safetensors.index.json").write_text(
            json.dumps({"metadata": {}, "weight_map": weight_map})
        )
    else:
        save_file(tensors, str(folder / "model.safetensors"), metadata={"format": "pt"})
    return {"added": added, "vl": vl, "padding": pad, "tokenizer_length": n_tok, **planted}


@pytest.fixture(scope="module")
def untied(tmp_path_factory) -> tuple[Path, dict]:
    folder = tmp_path_factory.mktemp("untied")
    return folder, make_model(folder)


@pytest.fixture(scope="module")
def tied(tmp_path_factory) -> tuple[Path, dict]:
    folder = tmp_path_factory.mktemp("tied")
    return folder, make_model(folder, tied=True)


def _digest(folder: Path) -> dict[str, str]:
    return {
        p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(folder.iterdir()) if p.is_file()
    }


# -- the audit ------------------------------------------------------------------------------------


@pytest.mark.parametrize("which", ["untied", "tied"])
def test_think_tags_untrained(which, request):
    folder, info = request.getfixturevalue(which)
    report = audit_tokens(folder)
    assert report.tied is (which == "tied")
    assert report.verdict == "untrained" and not report.ok
    assert report.untrained_tags == ["<think>", "</think>"]
    assert report.reference_sources["padding"] == len(info["padding"])
    for tag, tid in zip(report.tags, info["added"], strict=True):
        assert tag.single_token and tag.token_ids == [tid]
        tok = tag.tokens[0]
        assert tok.added and not tok.special
        assert tok.verdict == "untrained"
        assert {"low-norm", "near-unused"} <= set(tok.flags)
        assert tag.alternatives and all(a.verdict == "trained" for a in tag.alternatives)
    assert report.suggested_mapping == {"<think>": "<thinking>", "</think>": "</thinking>"}
    json.dumps(report.to_dict())  # serialisable as is


def test_trained_alternatives_pass(untied):
    folder, _ = untied
    report = audit_tokens(folder, ["<thinking>", "</thinking>", "<answer>"])
    assert report.verdict == "trained" and report.ok
    assert all(not t.single_token for t in report.tags)  # split into ordinary pieces
    assert all(not tok.added for t in report.tags for tok in t.tokens)


def test_qwen25_style_tag_splits_into_trained_pieces(tmp_path):
    make_model(tmp_path, think_added=False)
    report = audit_tokens(tmp_path)
    assert report.verdict == "trained"
    assert [len(t.token_ids) > 1 for t in report.tags] == [True, True]


def test_sharded_checkpoint_and_text_model_names(tmp_path):
    make_model(tmp_path, sharded=True)
    report = audit_tokens(tmp_path, ["<think>"])
    assert report.embedding == "model.language_model.embed_tokens.weight"
    assert report.lm_head == "lm_head.weight" and not report.tied
    assert report.verdict == "untrained"


def test_tensor_discovery_ignores_layer_outputs(tmp_path):
    from safetensors.torch import load_file

    make_model(tmp_path, tied=True)
    tensors = load_file(str(tmp_path / "model.safetensors"))
    tensors["model.layers.0.attention.output.weight"] = torch.zeros(D, D, dtype=torch.bfloat16)
    save_file(tensors, str(tmp_path / "model.safetensors"))
    report = audit_tokens(tmp_path)
    assert report.tied and report.lm_head is None
    with pytest.raises(ValueError, match="not a 2-D tensor"):
        audit_tokens(tmp_path, embedding_name="model.norm.weight")


def test_zero_padding_disables_cosine_but_still_flags(tmp_path):
    make_model(tmp_path, zero_padding=True)
    report = audit_tokens(tmp_path)
    cos = next(i for i in report.indicators if i.indicator == "cos_distance")
    assert cos.cut is None and "zero" in cos.note
    assert report.verdict == "untrained"


def test_user_reference_and_template_and_regex(untied, tmp_path):
    folder, info = untied
    tmpl = tmp_path / "chat.jinja"
    tmpl.write_text("{{ '<|im_start|>assistant\\n<think>\\n' }}{{ content }}{{ '</think><|im_end|>' }}")
    report = audit_tokens(
        folder,
        template=tmpl,
        reward_regex=r"^\<think\>.*?</think>\s*<answer>.*?</answer>$",
        reference_ids=[f"{info['padding'][0]}-{info['padding'][-1]}"],
    )
    by_tag = {t.tag: t for t in report.tags}
    assert set(by_tag) == {"<|im_start|>", "<think>", "</think>", "<|im_end|>", "<answer>", "</answer>"}
    assert by_tag["<think>"].sources == ["template", "reward-regex"]
    assert by_tag["<answer>"].verdict == "trained"
    assert report.reference_sources == {"user": len(info["padding"])}


@pytest.mark.parametrize("which", ["untied", "tied"])
def test_planted_rows_full_recall_no_false_positives(which, tmp_path):
    info = make_model(tmp_path, tied=(which == "tied"), plant=True, seed=3)
    va = audit_vocabulary(tmp_path)
    planted = set(info["untrained"]) | set(info["zero"]) | set(info["duplicate"]) | set(info["added"])
    flagged = set(va.ids("untrained"))
    assert planted <= flagged, f"missed {sorted(planted - flagged)}"
    trained = set(range(info["tokenizer_length"])) - planted
    assert not (flagged & trained), f"false positives {sorted(flagged & trained)}"
    assert not (set(va.ids("suspect")) & trained)
    assert set(info["zero"]) <= set(va.flags["zero"])
    assert set(info["duplicate"]) <= set(va.flags["duplicate"])


def test_float32_checkpoint(tmp_path):
    make_model(tmp_path, dtype=torch.float32)
    assert audit_tokens(tmp_path).verdict == "untrained"


# -- errors ---------------------------------------------------------------------------------------


def test_clear_errors(untied, tmp_path):
    folder, _ = untied
    with pytest.raises(FileNotFoundError, match="not a directory"):
        audit_tokens(tmp_path / "missing")
    empty = tmp_path / "empty"
    empty.mkdir()
    (empty / "tokenizer.json").write_text((folder / "tokenizer.json").read_text())
    with pytest.raises(FileNotFoundError, match="no \\*.safetensors"):
        audit_tokens(empty)
    no_tok = tmp_path / "no_tokenizer"
    no_tok.mkdir()
    (no_tok / "model.safetensors").write_bytes((folder / "model.safetensors").read_bytes())
    (no_tok / "tokenizer_config.json").write_text("{}")
    with pytest.raises(FileNotFoundError, match="no tokenizer files"):
        audit_tokens(no_tok)
    with pytest.raises(ValueError, match="not a valid Python regex"):
        audit_tokens(folder, reward_regex="<think>(")
    with pytest.raises(ValueError, match="no tag"):
        audit_tokens(folder, reward_regex="^answer$")
    with pytest.raises(ValueError, match="range"):
        audit_tokens(folder, reference_ids=["x-y"])


# -- fix ------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("which", "init"), [("untied", "pieces"), ("untied", "mean"), ("tied", "pieces"), ("tied", "mean")]
)
def test_fix_makes_audit_pass_and_leaves_original(which, init, request, tmp_path):
    from safetensors import safe_open

    folder, info = request.getfixturevalue(which)
    before = _digest(folder)
    out = tmp_path / "fixed"
    report = fix_tokens(folder, out, init=init)
    assert _digest(folder) == before
    assert report.after is not None and report.after.verdict != "untrained", report.after.to_dict()
    assert report.ok and report.before == "untrained"
    assert sorted(r.id for r in report.rows) == sorted(info["added"])
    assert all(r.init == init for r in report.rows)
    if init == "pieces":
        assert all(len(r.source_ids) >= 2 for r in report.rows)
    assert "tokenizer.json" in report.files_copied and report.files_rewritten == ["model.safetensors"]
    with (
        safe_open(str(folder / "model.safetensors"), "pt") as a,
        safe_open(str(out / "model.safetensors"), "pt") as b,
    ):
        assert sorted(a.keys()) == sorted(b.keys())
        for k in a.keys():  # noqa: SIM118
            x, y = a.get_tensor(k), b.get_tensor(k)
            assert x.dtype == y.dtype and x.shape == y.shape
            changed = torch.nonzero((x != y).any(dim=-1) if x.dim() == 2 else (x != y)).flatten().tolist()
            assert set(changed) <= set(info["added"]), (k, changed)


def test_fix_sharded_checkpoint(tmp_path):
    make_model(tmp_path / "src", sharded=True)
    report = fix_tokens(tmp_path / "src", tmp_path / "out", ["<think>"], init="mean")
    assert report.after.verdict == "trained"
    # lm_head sits in the first shard, the embedding in the second: both are rewritten.
    assert report.files_rewritten == ["model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors"]
    assert "model.safetensors.index.json" in report.files_copied


def test_fixed_files_honour_the_umask(tmp_path):
    """safetensors writes 0600; a fixed checkpoint on shared storage must be readable like any other file."""
    import os
    import stat

    make_model(tmp_path / "src", sharded=True)
    old = os.umask(0o002)
    try:
        report = fix_tokens(tmp_path / "src", tmp_path / "out", ["<think>"], init="mean", verify=False)
    finally:
        os.umask(old)
    modes = {f: stat.S_IMODE((tmp_path / "out" / f).stat().st_mode) for f in report.files_rewritten}
    assert set(modes.values()) == {0o664}, modes


def test_fix_refuses_to_overwrite(untied, tmp_path):
    folder, _ = untied
    with pytest.raises(ValueError, match="new folder"):
        fix_tokens(folder, folder)
    with pytest.raises(ValueError, match="--init"):
        fix_tokens(folder, tmp_path / "x", init="zeros")


# -- rewrite --------------------------------------------------------------------------------------


def test_parse_mapping():
    assert parse_mapping(["think=thinking"]) == {"<think>": "<thinking>", "</think>": "</thinking>"}
    assert parse_mapping({"<think>": "<reasoning>"}) == {"<think>": "<reasoning>"}
    with pytest.raises(ValueError, match="both"):
        parse_mapping(["<a>=<b>", "<a>=<c>"])
    with pytest.raises(ValueError, match="must look like"):
        parse_mapping(["think"])


def test_rewrite_jsonl_parquet_template_regex(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    src = tmp_path / "data.jsonl"
    rows = [
        {"id": 1, "completion": "<think>a</think> b"},
        {"id": 2, "completion": [{"role": "assistant", "content": "<think></think>x"}]},
    ]
    src.write_text("".join(json.dumps(r) + "\n" for r in rows))
    tmpl = tmp_path / "t.jinja"
    tmpl.write_text("{{ '<think>\\n' }}")
    report = rewrite_tags(
        ["think=thinking"],
        dataset=src,
        field="completion",
        dataset_out=tmp_path / "out.jsonl",
        template=tmpl,
        template_out=tmp_path / "t2.jinja",
        reward_regex=r"^\<think\>.*?<\/think>$",
    )
    out = [json.loads(x) for x in (tmp_path / "out.jsonl").read_text().splitlines()]
    assert out[0]["completion"] == "<thinking>a</thinking> b"
    assert out[1]["completion"][0]["content"] == "<thinking></thinking>x"
    assert report.dataset.replacements == {"<think>": 2, "</think>": 2}
    assert (tmp_path / "t2.jinja").read_text() == "{{ '<thinking>\\n' }}"
    assert report.reward_regex_out == r"^\<thinking\>.*?<\/thinking>$"
    assert report.reward_replacements == {"<think>": 1, "</think>": 1}

    pq.write_table(pa.table({"text": ["<think>x</think>", "plain"], "n": [1, 2]}), tmp_path / "d.parquet")
    r2 = rewrite_tags(
        ["<think>=<reasoning>"],
        dataset=tmp_path / "d.parquet",
        field="text",
        dataset_out=tmp_path / "o.parquet",
    )
    assert pq.read_table(tmp_path / "o.parquet").column("text").to_pylist() == [
        "<reasoning>x</think>",
        "plain",
    ]
    assert r2.dataset.records == 2
    with pytest.raises(ValueError, match="no column"):
        rewrite_tags(
            ["think=thinking"],
            dataset=tmp_path / "d.parquet",
            field="nope",
            dataset_out=tmp_path / "z.parquet",
        )
    with pytest.raises(ValueError, match="is the same file as --dataset"):
        rewrite_tags(["think=thinking"], dataset=src, field="completion", dataset_out=src)


def test_import_is_cheap():
    """`import vlfast.tokens` must not pull in tokenizers, transformers or safetensors."""
    import subprocess
    import sys

    code = (
        "import sys, vlfast.tokens, vlfast.cli.tokens; "
        "print([m for m in ('tokenizers', 'transformers', 'safetensors') if m in sys.modules])"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"
