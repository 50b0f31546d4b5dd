"""llm features read through hooks on the requested decoder layers, stopping after the deepest: the same
bits as ``output_hidden_states`` (Qwen3-VL's DeepStack included), later layers never run, and a model
whose decoder layers cannot be found refused by name."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from vlfast.errors import InputRefused
from vlfast.extraction.decode.prompts import PromptBuilder
from vlfast.extraction.decode.stage import DecodedSample
from vlfast.extraction.model.features import (
    FeatureSpec,
    HiddenStateTaps,
    compute_llm_features,
    find_decoder,
    llm_inputs,
)

PATCH_DIM = 3 * 2 * 16 * 16  # C * T * P * P of the tiny checkpoint


@pytest.fixture(scope="module")
def tiny(tiny_qwen3_vl):
    """(checkpoint, fp32 model, token ids) of the tiny Qwen3-VL (2 decoder layers, DeepStack at both)."""
    from vlfast.models import load_model

    model = load_model(tiny_qwen3_vl, dtype=torch.float32)
    tok = PromptBuilder(str(tiny_qwen3_vl), "qwen3_vl", 2, 2).tokenizer()
    ids = {
        "image_token_id": int(tok.convert_tokens_to_ids("<|image_pad|>")),
        "video_token_id": int(tok.convert_tokens_to_ids("<|video_pad|>")),
        "pad_token_id": int(tok.pad_token_id),
    }
    return tiny_qwen3_vl, model, ids


def _items(checkpoint, kinds: str) -> list[DecodedSample]:
    """Samples of the given kinds ("i" image, "v" video), of different sizes and prompt lengths."""
    prompts = PromptBuilder(str(checkpoint), "qwen3_vl", 2, 2)
    g = torch.Generator().manual_seed(len(kinds))
    out = []
    for i, k in enumerate(kinds):
        if k == "i":
            kind, grid, meta, text = "image", (1, 4, 2 + 2 * i), {}, "Describe this image." + " What?" * i
        else:
            kind, grid = "video", (2, 4, 4)
            meta, text = {"frame_indices": [0, 6, 12, 18], "video_fps": 24.0}, "What happens?"
        t, h, w = grid
        item = DecodedSample(
            i=i,
            kind=kind,
            pixel_values=torch.randn(t * h * w, PATCH_DIM, generator=g),
            grid=grid,
            tokens=t * h * w // 4,
            meta=meta,
        )
        item.input_ids = prompts(kind, text, grid, meta)
        out.append(item)
    return out


def _reference(model, items, ids, layers, pools, dtype):
    """What the code computed before the hooks: every hidden state from ``output_hidden_states``, pooled."""
    inputs, lengths = llm_inputs(items, device=torch.device("cpu"), dtype=dtype, **ids)
    with torch.inference_mode():
        hidden = model(**inputs, output_hidden_states=True, use_cache=False).hidden_states
    ref: list[dict[str, torch.Tensor]] = [{} for _ in items]
    for layer in layers:
        resolved = layer % len(hidden)
        h = hidden[layer].float()
        for i, n in enumerate(lengths):
            if "last" in pools:
                ref[i][f"llm.last.layer{resolved}"] = h[i, n - 1].clone()
            if "mean" in pools:
                ref[i][f"llm.mean.layer{resolved}"] = h[i, :n].mean(dim=0)
    return ref, hidden, inputs


def _features(model, items, ids, spec, dtype=torch.float32):
    tower = model.model.visual if hasattr(model, "model") else nn.Identity()
    return compute_llm_features(model, tower, items, spec, device=torch.device("cpu"), dtype=dtype, **ids)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("kinds", ["ii", "v", "ivi"], ids=["images", "video", "mixed"])
def test_hooks_store_the_bits_output_hidden_states_gives(tiny, kinds, dtype):
    checkpoint, model, ids = tiny
    model = model.to(dtype)
    try:
        items = _items(checkpoint, kinds)
        layers, pools = (0, 1, -1), ("last", "mean")
        ref, hidden, inputs = _reference(model, items, ids, layers, pools, dtype)
        got = _features(model, items, ids, FeatureSpec(("vision_mean", "llm"), layers, pools), dtype)
        # DeepStack is at work here: the language model adds it to a layer's output after the layer
        # returns, so state 1 (decoder layer 1's output) is not what decoder layer 2 receives at the vision
        # tokens, and only there.
        seen = []
        second = model.model.language_model.layers[1]
        handle = second.register_forward_pre_hook(lambda _m, args: seen.append(args[0].clone()))
        try:
            with torch.inference_mode():
                model(**inputs, use_cache=False)
        finally:
            handle.remove()
    finally:
        model.float()
    assert len(hidden) == 3  # the embeddings and two layers: 0, 1 and 2 (= -1) are all of them
    for i, (g, r) in enumerate(zip(got, ref)):
        llm = {k: v for k, v in g.items() if k.startswith("llm.")}
        assert list(llm) == list(r)  # same keys, same order
        for k in r:
            assert torch.equal(llm[k], r[k]), f"sample {i} {k}: {(llm[k] - r[k]).abs().max()}"
        assert g["vision_mean"].shape == (64,)
    vision = inputs["mm_token_type_ids"] > 0
    assert not torch.equal(seen[0][vision], hidden[1][vision])
    assert torch.equal(seen[0][~vision], hidden[1][~vision])


def _count_calls(model):
    lm = model.model.language_model
    modules = {f"layer{k + 1}": layer for k, layer in enumerate(lm.layers)}
    modules.update(norm=lm.norm, lm_head=model.lm_head, tower=model.model.visual)
    calls = dict.fromkeys(modules, 0)

    def counter(name):
        def hook(*_):
            calls[name] += 1

        return hook

    handles = [m.register_forward_hook(counter(name)) for name, m in modules.items()]
    return calls, handles


@pytest.mark.parametrize(
    "layers, ran",
    [
        ((0,), {"tower"}),
        ((1,), {"tower", "layer1"}),
        ((1, 0), {"tower", "layer1"}),
        ((-1,), {"tower", "layer1", "layer2", "norm"}),
        ((2, 0), {"tower", "layer1", "layer2", "norm"}),
    ],
)
def test_layers_after_the_deepest_requested_are_not_run(tiny, layers, ran):
    checkpoint, model, ids = tiny
    items = _items(checkpoint, "iv")
    lm = model.model.language_model
    hooks_before = [
        (len(m._forward_hooks), len(m._forward_pre_hooks)) for m in (*lm.layers, lm, model.model.visual)
    ]
    with torch.inference_mode():
        logits = model(**llm_inputs(items, device=torch.device("cpu"), dtype=torch.float32, **ids)[0]).logits
    calls, handles = _count_calls(model)
    try:
        got = _features(model, items, ids, FeatureSpec(("vision", "llm"), layers, ("last",)))
    finally:
        for h in handles:
            h.remove()
    assert {name for name, n in calls.items() if n} == ran, calls
    assert all(n <= 2 for n in calls.values())  # the tower: once for the image, once for the video
    assert sorted(k for k in got[0] if k.startswith("llm.")) == sorted(
        {f"llm.last.layer{x % 3}" for x in layers}
    )
    assert got[1]["vision"].shape == (8, 64)  # the tower's outputs are still there, whatever the depth
    # The hooks are gone and the model is as it was: a full forward gives the same logits as before.
    assert hooks_before == [
        (len(m._forward_hooks), len(m._forward_pre_hooks)) for m in (*lm.layers, lm, model.model.visual)
    ]
    with torch.inference_mode():
        again = model(**llm_inputs(items, device=torch.device("cpu"), dtype=torch.float32, **ids)[0]).logits
    assert torch.equal(logits, again)


def test_layers_out_of_range_are_refused_before_the_forward(tiny):
    checkpoint, model, ids = tiny
    calls, handles = _count_calls(model)
    try:
        with pytest.raises(InputRefused, match=r"layer 3 out of range: the model has hidden states 0..2"):
            _features(model, _items(checkpoint, "i"), ids, FeatureSpec(("llm",), (0, 3)))
    finally:
        for h in handles:
            h.remove()
    assert not any(calls.values())


def _tiny_family(family: str) -> nn.Module:
    """A random ...ForConditionalGeneration of ``family`` with a 3-layer language model."""
    import transformers as T

    text = {
        "vocab_size": 300,
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_hidden_layers": 3,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
    }
    vision = {"depth": 1, "hidden_size": 32, "num_heads": 2, "out_hidden_size": 64, "intermediate_size": 64}
    mrope = {"rope_type": "default", "mrope_section": [2, 3, 3]}
    config, cls = {
        "qwen2_vl": (
            T.Qwen2VLConfig(
                text_config={**text, "rope_scaling": mrope},
                vision_config={"depth": 1, "embed_dim": 32, "num_heads": 2, "hidden_size": 64},
            ),
            T.Qwen2VLForConditionalGeneration,
        ),
        "qwen2_5_vl": (
            T.Qwen2_5_VLConfig(text_config={**text, "rope_scaling": mrope}, vision_config=vision),
            T.Qwen2_5_VLForConditionalGeneration,
        ),
        "qwen3_vl_moe": (
            T.Qwen3VLMoeConfig(
                text_config={
                    **text,
                    "head_dim": 16,
                    "num_experts": 4,
                    "num_experts_per_tok": 2,
                    "moe_intermediate_size": 32,
                    "rope_scaling": {**mrope, "mrope_interleaved": True},
                },
                vision_config={**vision, "deepstack_visual_indexes": [0]},
            ),
            T.Qwen3VLMoeForConditionalGeneration,
        ),
        "glm4v": (
            T.Glm4vConfig(
                text_config={
                    **text,
                    "rope_parameters": {
                        "rope_type": "default",
                        "mrope_section": [1, 1, 2],
                        "partial_rotary_factor": 0.5,
                    },
                },
                vision_config=vision,
            ),
            T.Glm4vForConditionalGeneration,
        ),
    }[family]
    torch.manual_seed(0)
    return cls(config).eval()


@pytest.mark.parametrize("family", ["qwen2_vl", "qwen2_5_vl", "qwen3_vl_moe", "glm4v"])
def test_every_supported_family_has_its_decoder_found_and_the_same_bits(family):
    model = _tiny_family(family)
    path, decoder, layers = find_decoder(model)
    assert path == "model.language_model" and decoder is model.model.language_model and len(layers) == 3
    ids = torch.randint(10, 290, (2, 7), generator=torch.Generator().manual_seed(1))
    with torch.inference_mode():
        ref = model(input_ids=ids, output_hidden_states=True, use_cache=False).hidden_states
        got: dict[int, torch.Tensor] = {}
        taps = HiddenStateTaps(model, [0, 1, 2, -1], lambda i, h: got.__setitem__(i, h.clone()))
        taps.run(lambda: model(input_ids=ids, use_cache=False))
    assert len(ref) == 4 and sorted(got) == [0, 1, 2, 3]
    for i in got:
        assert torch.equal(got[i], ref[i]), f"{family} state {i}"


class NoDecoder(nn.Module):
    """A model whose language model keeps its blocks under another name."""

    def __init__(self):
        super().__init__()
        self.language_model = nn.Module()
        self.language_model.blocks = nn.ModuleList([nn.Linear(4, 4)])

    def forward(self, **_):  # pragma: no cover - never reached
        raise AssertionError("the forward must not run")


def test_a_model_without_findable_decoder_layers_is_refused_by_name(tiny, monkeypatch):
    checkpoint, model, ids = tiny
    with pytest.raises(
        InputRefused, match=r"no decoder layers found in NoDecoder: expected a non-empty ModuleList"
    ):
        find_decoder(NoDecoder())
    with pytest.raises(InputRefused, match="NoDecoder"):
        _features(NoDecoder(), _items(checkpoint, "i"), ids, FeatureSpec(("llm",)), torch.float32)

    # At load time, before any sample is decoded or anything written.
    import vlfast.models
    from vlfast.extraction.model import runner

    monkeypatch.setattr(vlfast.models, "load_model", lambda *a, **k: NoDecoder())
    with pytest.raises(InputRefused, match="NoDecoder"):
        runner.load(
            str(checkpoint), "qwen3_vl", FeatureSpec(("llm",)), torch.device("cpu"), torch.float32, False
        )
