"""Offline stand-ins for `vlfast demo-checkpoint`, `vlfast extract --demo`, tests and benchmarks: media and a tiny Qwen3-VL.

``make_tiny_qwen3_vl`` saves a random-weight Qwen3-VL checkpoint (a tokenizer trained on the spot, the image
and video processors) that transformers loads back through its real loading path, without any download.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import numpy as np

from vlfast.errors import InputRefused

__all__ = ["make_demo_inputs", "make_images", "make_tiny_qwen3_vl", "make_video", "pattern"]

QWEN_SPECIAL_TOKENS = [
    "<|endoftext|>",
    "<|im_start|>",
    "<|im_end|>",
    "<|vision_start|>",
    "<|vision_end|>",
    "<|image_pad|>",
    "<|video_pad|>",
]
# Qwen's template, reduced to what one user turn with one image or video needs.
CHAT_TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n"
    "{% if message['content'] is string %}{{ message['content'] }}{% else %}"
    "{% for c in message['content'] %}"
    "{% if c['type'] == 'image' %}<|vision_start|><|image_pad|><|vision_end|>"
    "{% elif c['type'] == 'video' %}<|vision_start|><|video_pad|><|vision_end|>"
    "{% elif c['type'] == 'text' %}{{ c['text'] }}{% endif %}{% endfor %}{% endif %}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


@contextmanager
def _video_processors_accepted() -> Iterator[None]:
    """Let ``ProcessorMixin.__init__`` accept a video processor where torchvision is absent.

    Video processors build and save without torchvision, but the processor's type check looks their base
    class (``VideoProcessorMixin``; 5.18-5.2x's ``BaseVideoProcessor``) up among transformers' exports, which
    hold it only with torchvision installed. This exports it for the duration (a no-op with torchvision).
    """
    from transformers import processing_utils, video_processing_utils

    name = processing_utils.MODALITY_TO_BASE_CLASS_MAPPING["video_processor"]
    module = processing_utils.transformers_module  # what the type check looks names up in
    real = getattr(video_processing_utils, name)
    exported = getattr(module, name, _ABSENT)  # without torchvision: absent, or (5.18) a placeholder
    if exported is real:
        yield
        return
    setattr(module, name, real)
    try:
        yield
    finally:
        if exported is _ABSENT:
            delattr(module, name)
        else:
            setattr(module, name, exported)


_ABSENT = object()
LAYOUTS = ("hub", "processor")


def _embedding_model_class() -> type:
    """Qwen3-VL-Embedding's ``Qwen3VLForEmbedding`` (QwenLM/Qwen3-VL-Embedding,
    src/models/qwen3_vl_embedding.py) as far as saving goes: ``Qwen3VLModel`` as ``self.model``, no LM head."""
    from transformers.models.qwen3_vl.modeling_qwen3_vl import Qwen3VLModel, Qwen3VLPreTrainedModel

    class Qwen3VLForEmbedding(Qwen3VLPreTrainedModel):
        _checkpoint_conversion_mapping: dict[str, str] = {}

        def __init__(self, config):
            super().__init__(config)
            self.model = Qwen3VLModel(config)
            self.post_init()

    return Qwen3VLForEmbedding


def tiny_qwen3_vl_config(
    vocab_size: int, *, max_position_embeddings: int = 8192, text_hidden_size: int = 64, **token_ids: int
):
    """A Qwen3-VL config at test size: 2-layer LLM and tower (DeepStack at both tower layers) with the real
    patch geometry; ``token_ids``: the image/video and vision start/end token ids."""
    from transformers import Qwen3VLConfig

    return Qwen3VLConfig(
        text_config={
            "vocab_size": vocab_size,
            "hidden_size": text_hidden_size,
            "intermediate_size": 2 * text_hidden_size,
            "num_hidden_layers": 2,
            "num_attention_heads": 4,
            "num_key_value_heads": 2,
            "head_dim": 16,
            "rope_scaling": {"rope_type": "default", "mrope_section": [2, 3, 3], "mrope_interleaved": True},
            "max_position_embeddings": max_position_embeddings,
            "tie_word_embeddings": True,
        },
        vision_config={
            "depth": 2,
            "hidden_size": 64,
            "intermediate_size": 128,
            "num_heads": 4,
            "out_hidden_size": text_hidden_size,
            "deepstack_visual_indexes": [0, 1],
            "num_position_embeddings": 64,
            "patch_size": 16,
            "spatial_merge_size": 2,
            "temporal_patch_size": 2,
        },
        **token_ids,
    )


# Qwen3-VL's published video processor settings: saved as the hub's JSON or through the processor class
_VIDEO_SETTINGS = {
    "size": {"shortest_edge": 4096, "longest_edge": 25_165_824},
    "patch_size": 16,
    "temporal_patch_size": 2,
    "merge_size": 2,
    "image_mean": [0.5] * 3,
    "image_std": [0.5] * 3,
    "fps": 2,
    "min_frames": 4,
    "max_frames": 768,
}


def _tiny_tokenizer():
    """A byte-level BPE of 400 pieces with Qwen's special tokens and chat template."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=400,
        special_tokens=QWEN_SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,  # its bar prints blank lines when stdout is not a terminal
    )
    corpus = ["Describe this image. Describe this video. What happens? user assistant system seconds"] * 8
    bpe.train_from_iterator(corpus, trainer)
    return PreTrainedTokenizerFast(
        tokenizer_object=bpe, eos_token="<|im_end|>", pad_token="<|endoftext|>", chat_template=CHAT_TEMPLATE
    )


def make_tiny_qwen3_vl(
    path: str | Path, *, seed: int = 0, layout: str = "hub", embedding: bool = False
) -> Path:
    """Save a tiny random Qwen3-VL checkpoint at ``path`` (2 to 3 MB, a few seconds).

    ``layout``: ``"hub"`` saves the processor as the published repositories have it
    (preprocessor_config.json and video_preprocessor_config.json); ``"processor"`` as transformers 5 saves a
    whole processor (the image processor, tokenizer and ``Qwen3VLVideoProcessor``: one processor_config.json
    with "image_processor" and "video_processor" entries, no preprocessor_config.json), as fine-tunes have it.

    ``embedding``: save it as Qwen3-VL-Embedding is published (architecture "Qwen3VLForEmbedding", every
    key under ``model.``, no ``lm_head``), with a 128-wide LLM so that an embedding can be cut to 64
    dimensions (Matryoshka); ``AutoModelForImageTextToText`` still loads it, as a
    ``Qwen3VLForConditionalGeneration`` with a random LM head. False: that class's own, 64-wide LLM.
    """
    import torch
    from transformers import Qwen3VLForConditionalGeneration
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    if layout not in LAYOUTS:
        raise InputRefused(f"layout must be one of {LAYOUTS}, got {layout!r}")
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    tok = _tiny_tokenizer()
    ids = {t: tok.convert_tokens_to_ids(t) for t in QWEN_SPECIAL_TOKENS}
    config = tiny_qwen3_vl_config(
        len(tok),
        text_hidden_size=128 if embedding else 64,
        image_token_id=ids["<|image_pad|>"],
        video_token_id=ids["<|video_pad|>"],
        vision_start_token_id=ids["<|vision_start|>"],
        vision_end_token_id=ids["<|vision_end|>"],
    )
    torch.manual_seed(seed)
    model = (
        _embedding_model_class()(config) if embedding else Qwen3VLForConditionalGeneration(config)
    ).eval()
    model.save_pretrained(path)
    image_processor = Qwen2VLImageProcessorPil(
        patch_size=16,
        temporal_patch_size=2,
        merge_size=2,
        image_mean=[0.5] * 3,
        image_std=[0.5] * 3,
        size={"shortest_edge": 65_536, "longest_edge": 16_777_216},
    )
    if layout == "processor":
        from transformers.models.qwen3_vl.processing_qwen3_vl import Qwen3VLProcessor
        from transformers.models.qwen3_vl.video_processing_qwen3_vl import Qwen3VLVideoProcessor

        video_processor = Qwen3VLVideoProcessor(**_VIDEO_SETTINGS)
        with _video_processors_accepted():
            processor = Qwen3VLProcessor(
                image_processor=image_processor,
                tokenizer=tok,
                video_processor=video_processor,
                chat_template=CHAT_TEMPLATE,
            )
        processor.save_pretrained(path)
        return path
    tok.save_pretrained(path)
    image_processor.save_pretrained(path)
    video = {"video_processor_type": "Qwen3VLVideoProcessor", **_VIDEO_SETTINGS}
    (path / "video_preprocessor_config.json").write_text(json.dumps(video, indent=2))
    return path


def pattern(h: int, w: int, seed: int) -> np.ndarray:
    """A smooth colour pattern (compresses well, resizes meaningfully): (h, w, 3) uint8."""
    rng = np.random.default_rng(seed)
    y, x = np.mgrid[0:h, 0:w].astype(np.float32)
    fx, fy, ph = rng.uniform(0.005, 0.05, 3), rng.uniform(0.005, 0.05, 3), rng.uniform(0, 6.28, 3)
    chans = [127.5 + 127.5 * np.sin(fx[c] * x + fy[c] * y + ph[c]) for c in range(3)]
    return np.stack(chans, axis=-1).round().astype(np.uint8)


def make_images(
    folder: str | Path, sizes: list[tuple[int, int]], *, prefix: str = "img", seed: int = 0
) -> list[Path]:
    """JPEG images of the given (width, height) sizes."""
    from PIL import Image

    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    paths = []
    for k, (w, h) in enumerate(sizes):
        p = folder / f"{prefix}{k:04d}.jpg"
        Image.fromarray(pattern(h, w, seed + k)).save(p, quality=90)
        paths.append(p)
    return paths


def make_video(
    path: str | Path,
    *,
    frames: int = 8,
    fps: int = 4,
    width: int = 64,
    height: int = 48,
    seed: int = 0,
    codec: str | None = None,
    options: dict[str, object] | None = None,
    rotation: float = 0,
    hflip: bool = False,
) -> Path:
    """A clip of a moving pattern, written with PyAV: H.264 (MPEG-4 without libx264) unless ``codec`` names
    another encoder, given ``options``; the container follows the suffix. ``rotation`` (degrees
    counter-clockwise) and ``hflip`` go into the display matrix, as a phone writes one (PyAV 17+)."""
    import av

    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    base = pattern(height, width * 2, seed)
    with av.open(str(path), mode="w") as container:
        codec = codec or ("libx264" if "libx264" in av.codecs_available else "mpeg4")
        stream = container.add_stream(codec, rate=fps)
        stream.width, stream.height, stream.pix_fmt = width, height, "yuv420p"
        stream.options = {k: str(v) for k, v in (options or {}).items()}
        if rotation or hflip:
            stream.set_display_rotation(rotation, hflip=hflip)
        for i in range(frames):
            shift = (i * 3) % width
            frame = av.VideoFrame.from_ndarray(
                np.ascontiguousarray(base[:, shift : shift + width]), format="rgb24"
            )
            for packet in stream.encode(frame):
                container.mux(packet)
        for packet in stream.encode():
            container.mux(packet)
    return path


def make_demo_inputs(folder: str | Path) -> Path:
    """A few images and a two-second video: the inputs of ``vlfast extract --demo``."""
    folder = Path(folder)
    make_images(folder / "images", [(320, 240), (256, 256), (240, 320)], prefix="photo")
    make_video(folder / "videos" / "clip.mp4", frames=8, fps=4, width=320, height=240)
    return folder
