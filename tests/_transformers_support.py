"""What the installed transformers builds, for the patch tests that run on every transformers from the first
Qwen2-VL release (4.45) to the newest (`.ci/transformers-versions`): a family it does not have yet is a skip
that names the version, not a failure."""

from __future__ import annotations

import pytest
import transformers

from vlfast.models.references import REFERENCES, installed_families

FAMILIES = installed_families()
# The tower the single-model tests build: Qwen3-VL (deepstack features, transformers >= 4.57), else Qwen2-VL,
# which every supported transformers has.
TOWER = "qwen3-vl-4b" if REFERENCES["qwen3-vl-4b"].installed() else "qwen2-vl-7b"


def _tower_loads_alone() -> bool:
    """Whether a saved TOWER loads with its own class's from_pretrained: before 4.4x-4.5x Qwen2-VL's vision
    config had the whole model's model_type, "qwen2_vl", and its from_pretrained looks for a vision_config key."""
    from vlfast.models import reference_config

    return type(reference_config(TOWER)).model_type != REFERENCES[TOWER].family


# A test that saves TOWER and loads it back with its class, skipped where transformers cannot do that.
TOWER_LOADS_ALONE = pytest.mark.skipif(
    not _tower_loads_alone(),
    reason=f"transformers {transformers.__version__} cannot load a saved {TOWER} vision tower on its own",
)


def needs(family: str) -> pytest.MarkDecorator:
    """Skip where the installed transformers has no ``family`` (a package under transformers.models)."""
    return pytest.mark.skipif(
        family not in FAMILIES, reason=f"transformers {transformers.__version__} has no {family}"
    )


def references(names=None) -> list:
    """Every built-in reference (or ``names``) as a test parameter, skipped where its family is not installed."""
    return [pytest.param(n, marks=needs(REFERENCES[n].family)) for n in (names or REFERENCES)]


def qwen3_vl_processor(ckpt: str, **tokenizer_options):
    """The checkpoint's Qwen3VLProcessor as a framework builds it, here without torchvision: the image processor
    AutoImageProcessor picks (the PIL one) and the video processor, which builds without it
    (vlfast.demo._video_processors_accepted)."""
    from transformers import AutoImageProcessor, AutoTokenizer
    from transformers.models.qwen3_vl.processing_qwen3_vl import Qwen3VLProcessor
    from transformers.models.qwen3_vl.video_processing_qwen3_vl import Qwen3VLVideoProcessor

    from vlfast.demo import _video_processors_accepted

    tok = AutoTokenizer.from_pretrained(ckpt, **tokenizer_options)
    with _video_processors_accepted():
        return Qwen3VLProcessor(
            image_processor=AutoImageProcessor.from_pretrained(ckpt),
            tokenizer=tok,
            video_processor=Qwen3VLVideoProcessor.from_pretrained(ckpt),
            chat_template=tok.chat_template,
        )
