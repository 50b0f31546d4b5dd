"""`--verify-generation`, Magikarp's second stage, on tiny transformers checkpoints built here.

A random-init transformer reproduces nothing, trained or not, so the check could show nothing on one.
The model here is built to copy instead: a one-layer Qwen3 whose attention and MLP write nothing
(`o_proj` and `down_proj` zero) and whose lm_head is tied to the embedding, so the logits at the last
position are E . RMSNorm(e_t) for the current token t. A row with a trained length and a direction of
its own then predicts itself wherever a prompt repeats it; a never-trained row (short, along the
direction every unseen row drifts to) does not. That is the property the check measures, in a model
small enough to load in a second. The embedding is `make_model`'s, so the weights audit sees the same
planted rows.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from typer.testing import CliRunner

from test_tokens import make_model
from test_tokens_robust import strict_loads
from vlfast.tokens import audit_tokens, fix_tokens
from vlfast.tokens.generation import PROMPTS, SLOT, STRONG, WEAK, classify, prompt_ids, verify_generation
from vlfast.tokens.vocab import Vocabulary

runner = CliRunner()


def make_copying_lm(folder: Path, *, tied: bool = True, plant: bool = False, seed: int = 0) -> dict:
    """`make_model`'s checkpoint turned into a Qwen3ForCausalLM that copies its current token (above).

    Untied, the lm_head keeps make_model's never-trained rows and takes the embedding's trained rows
    (a model whose output rows agree with its input rows wherever training reached both)."""
    from transformers import Qwen3Config, Qwen3ForCausalLM

    info = make_model(folder, tied=tied, plant=plant, seed=seed)
    tensors = load_file(str(folder / "model.safetensors"))
    emb = tensors["model.embed_tokens.weight"].float()
    rows, d = emb.shape
    config = Qwen3Config(
        vocab_size=rows,
        hidden_size=d,
        intermediate_size=2 * d,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=d // 2,
        max_position_embeddings=512,
        tie_word_embeddings=tied,
    )
    torch.manual_seed(seed)
    model = Qwen3ForCausalLM(config)
    with torch.no_grad():
        model.model.embed_tokens.weight.copy_(emb)
        if not tied:
            out = tensors["lm_head.weight"].float()
            never = set(info["added"]) | set(info["padding"]) | set(info["untrained"]) | set(info["zero"])
            trained = torch.tensor([i for i in range(rows) if i not in never])
            out[trained] = emb[trained]
            model.lm_head.weight.copy_(out)
        for layer in model.model.layers:
            layer.self_attn.o_proj.weight.zero_()
            layer.mlp.down_proj.weight.zero_()
    (folder / "model.safetensors").unlink()
    model.to(torch.bfloat16).save_pretrained(folder)
    return info


@pytest.fixture(scope="module")
def copying(tmp_path_factory) -> tuple[Path, dict]:
    folder = tmp_path_factory.mktemp("copying")
    return folder, make_copying_lm(folder, plant=True, seed=3)


def test_classify_uses_magikarps_thresholds():
    assert (STRONG, WEAK) == (0.001, 0.1)
    assert classify(0.0) == classify(0.000999) == "verified-strong"
    assert classify(0.001) == classify(0.0999) == "verified-weak"
    assert classify(0.1) == classify(1.0) == "rejected"


def test_prompts_hold_the_id_itself_and_have_one_length(copying):
    folder, info = copying
    vocab = Vocabulary.load(folder)
    think, end = info["added"]
    for name, template in PROMPTS.items():
        a, b = prompt_ids(vocab, template, think), prompt_ids(vocab, template, end)
        assert len(a) == len(b), name  # one batch per prompt, no padding
        assert a.count(think) == template.count(SLOT) and think not in b, name


def test_planted_untrained_rows_verified_trained_rows_rejected(copying):
    folder, info = copying
    never = info["added"] + info["untrained"]
    planted = set(never) | set(info["zero"]) | set(info["duplicate"])
    trained = [i for i in range(256, info["tokenizer_length"] - 5) if i not in planted][::12]
    report = verify_generation(folder, never + info["zero"] + trained, batch_size=8)
    by_id = {t.id: t for t in report.tokens}
    for i in never:
        assert by_id[i].result == "verified-strong", (i, by_id[i])
    for i in info["zero"]:  # a zero row gives a uniform distribution: P = 1/V, still below 0.1
        assert by_id[i].result.startswith("verified"), (i, by_id[i])
    for i in trained:
        assert by_id[i].result == "rejected" and by_id[i].max_probability > 0.5, (i, by_id[i])
    assert set(by_id[never[0]].probabilities) == set(PROMPTS)
    assert report.model_class == "Qwen3ForCausalLM" and report.device == "cpu" and report.dtype == "float32"
    assert report.thresholds == {"strong": 0.001, "weak": 0.1} and report.peak_memory_mib > 0


def test_audit_with_verify_generation(copying):
    folder, info = copying
    report = audit_tokens(
        folder, ["<think>", "</think>", "<thinking>"], verify_generation=True, dtype="bfloat16"
    )
    gen = report.generation
    assert gen is not None and gen.dtype == "bfloat16"
    ids = [tok.id for tag in report.tags for tok in tag.tokens]
    assert [t.id for t in gen.tokens] == ids  # every token of every audited tag, in order
    results = {t.id: (t.weights_verdict, t.result) for t in gen.tokens}
    for i in info["added"]:
        assert results[i] == ("untrained", "verified-strong")
    for tok in report.tags[2].tokens:  # <thinking>'s ordinary pieces
        assert results[tok.id] == ("trained", "rejected")
    assert report.verdict == "untrained"  # the check reports; the verdict stays the weights'
    strict_loads(json.dumps(report.to_dict()))


def test_cli_verify_generation_table_and_json(tokens_app, copying):
    folder, _ = copying
    r = runner.invoke(tokens_app, ["tokens", "audit", "--model", str(folder), "--verify-generation"])
    assert r.exit_code == 1, r.output
    assert "Generation check: Qwen3ForCausalLM on cpu, float32" in r.stdout
    assert "< 0.001 verified-strong, < 0.1 verified-weak" in r.stdout
    assert sum("verified-strong" in line and "'<think>'" in line for line in r.stdout.splitlines()) == 1
    r = runner.invoke(
        tokens_app, ["tokens", "audit", "--model", str(folder), "--verify-generation", "--json"]
    )
    data = strict_loads(r.stdout)
    assert [t["result"] for t in data["generation"]["tokens"]] == ["verified-strong", "verified-strong"]
    assert data["generation"]["prompts"] == PROMPTS
    for args in (["--dtype", "int8"], ["--device", "nonsense"]):
        r = runner.invoke(
            tokens_app, ["tokens", "audit", "--model", str(folder), "--verify-generation", *args]
        )
        assert r.exit_code == 2, r.output
    r = runner.invoke(tokens_app, ["tokens", "audit", "--model", str(folder), "--dtype", "float32"])
    assert r.exit_code == 2 and "--verify-generation" in r.stderr


@pytest.mark.parametrize("init", ["pieces", "mean"])
def test_fixed_rows_are_reproduced(copying, tmp_path, init):
    """After `tokens fix` the same check rejects the untrained hypothesis: the model now repeats the
    tags. (Tied: the input row, scaled to the median trained norm, is the output row too.)"""
    folder, info = copying
    fixed = fix_tokens(folder, tmp_path / "fixed", init=init)
    assert sorted(r.id for r in fixed.rows) == sorted(info["added"])
    report = verify_generation(tmp_path / "fixed", info["added"])
    for t in report.tokens:
        assert t.result == "rejected" and t.max_probability > 0.5, t
    # The planted rows fix did not touch are still verified in the fixed checkpoint.
    assert all(
        t.result == "verified-strong" for t in verify_generation(tmp_path / "fixed", info["untrained"]).tokens
    )


def test_fixed_rows_are_reproduced_untied(tmp_path):
    info = make_copying_lm(tmp_path / "src", tied=False)
    before = verify_generation(tmp_path / "src", info["added"])
    assert all(t.result == "verified-strong" for t in before.tokens)
    fix_tokens(tmp_path / "src", tmp_path / "fixed", init="pieces")
    after = verify_generation(tmp_path / "fixed", info["added"])
    assert all(t.result == "rejected" for t in after.tokens), after.tokens


def test_a_vlm_checkpoint_runs_text_only(tiny_qwen3_vl):
    """Qwen3-VL has no causal-LM class: it loads through its image-text-to-text class and runs text."""
    vocab = Vocabulary.load(tiny_qwen3_vl)
    ids = [vocab.vocab["<|im_start|>"], vocab.vocab["<|im_end|>"]]
    report = verify_generation(tiny_qwen3_vl, ids, batch_size=1)
    assert report.model_class == "Qwen3VLForConditionalGeneration"
    assert [t.id for t in report.tokens] == ids
    assert all(0.0 <= p <= 1.0 for t in report.tokens for p in t.probabilities.values())


def test_incomplete_checkpoint_is_refused(tmp_path):
    """make_model's folder holds only the embedding: running it would mean random layers."""
    make_model(tmp_path, tied=True)
    with pytest.raises(ValueError, match="lacks .* weights of Qwen3ForCausalLM"):
        verify_generation(tmp_path, [5])


def test_truncated_weights_named_before_loading(copying, tmp_path):
    import shutil

    folder = tmp_path / "m"
    shutil.copytree(copying[0], folder)
    data = (folder / "model.safetensors").read_bytes()
    (folder / "model.safetensors").write_bytes(data[:-100])
    with pytest.raises(ValueError, match=f"{folder / 'model.safetensors'} is truncated"):
        verify_generation(folder, [5])


def test_bad_ids(copying):
    with pytest.raises(ValueError, match="outside the model's"):
        verify_generation(copying[0], [10**6])
    with pytest.raises(ValueError, match="no token ids"):
        verify_generation(copying[0], [])
