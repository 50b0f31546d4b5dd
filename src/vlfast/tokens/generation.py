"""Magikarp's second stage (Land & Bartolo 2024): does the model reproduce a token when asked to repeat it?

The token's id goes where «token» stands in a few repetition prompts (never re-tokenized from text); the
largest probability of the id at the last position decides (docs/tokens.md). One id per «token": no padding.
"""

from __future__ import annotations

import inspect
import sys
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING

from vlfast.errors import InputRefused
from vlfast.tokens.report import GenerationCheck, GenerationReport

if TYPE_CHECKING:
    import torch

    from vlfast.tokens.vocab import Vocabulary

SLOT = "«token»"
# Repetition prompts in the spirit of Magikarp's; the text around SLOT is the same for every token.
PROMPTS: dict[str, str] = {
    "please-repeat": (
        f'Please repeat the string: "{SLOT}"\nRepeated: "{SLOT}"\n\n'
        f'Please repeat the string: "{SLOT}"\nRepeated: "'
    ),
    "input-output": (
        "This machine prints its input exactly, as these trials show.\n"
        + f"Input: {SLOT}\nOutput: {SLOT}\n" * 10
        + f"Input: {SLOT}\nOutput: "
    ),
    "quote": (
        "Q: What does the string 'xqzv' mean?\nA: 'xqzv' is not a word I know.\n"
        f"Q: What does the string '{SLOT}' mean?\nA: '"
    ),
    "repeated": "The same string, written over and over:\n" + SLOT * 32,
}
STRONG = 0.001  # max probability below this: verified-strong
WEAK = 0.1  # below this: verified-weak; at or above: rejected
BATCH_SIZE = 16


def classify(max_probability: float) -> str:
    """Magikarp's reading of the largest reproduction probability."""
    if max_probability < STRONG:
        return "verified-strong"
    if max_probability < WEAK:
        return "verified-weak"
    return "rejected"


def prompt_ids(vocab: Vocabulary, template: str, token_id: int) -> list[int]:
    """Ids of `template` with `token_id` at every SLOT; the text between slots is encoded on its own."""
    ids = _prefix(vocab)
    for k, text in enumerate(template.split(SLOT)):
        if k:
            ids.append(int(token_id))
        if text:
            ids.extend(vocab.tokenizer.encode(text, add_special_tokens=False).ids)
    return ids


def _prefix(vocab: Vocabulary) -> list[int]:
    # What the tokenizer puts before a text (Llama's <s>), not after it (BERT's [SEP] would end the prompt).
    plain = vocab.tokenizer.encode("a", add_special_tokens=False).ids
    full = vocab.tokenizer.encode("a", add_special_tokens=True).ids
    for k in range(len(full) - len(plain) + 1):
        if full[k : k + len(plain)] == plain:
            return full[:k]
    return []


def resolve(device: str | None, dtype: str | None) -> tuple[str, torch.dtype]:
    """The device (default: the best available) and dtype (default: bfloat16 on CUDA, else float32: CPUs
    emulate most bfloat16 matmuls, and probabilities near 0.001 deserve the precision)."""
    import torch

    from vlfast.diagnosis.facts import check_device, default_device

    device = check_device(device or default_device())
    if device.startswith("meta"):  # accepted by torch.empty, but holds no values to compute a probability
        raise InputRefused(
            f"--device {device!r} holds no data, so the model cannot run on it; use cpu or cuda"
        )
    if dtype is None:
        return device, torch.bfloat16 if device.startswith("cuda") else torch.float32
    from vlfast.dtypes import torch_dtype

    return device, torch_dtype(dtype)


def load_model(model_dir: str | Path, device: str, dtype: torch.dtype):
    """The checkpoint as a causal LM (a VLM through its image-text-to-text class, text only), in eval mode."""
    from transformers import AutoConfig, AutoModelForCausalLM, AutoModelForImageTextToText
    from transformers.models.auto.modeling_auto import (
        MODEL_FOR_CAUSAL_LM_MAPPING_NAMES,
        MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES,
    )
    from transformers.utils import logging as hf_logging

    from vlfast.tokens.weights import check_weight_files

    model_dir = Path(model_dir)
    check_weight_files(model_dir)
    try:
        config = AutoConfig.from_pretrained(str(model_dir), local_files_only=True)
    except (OSError, ValueError) as e:
        raise InputRefused(
            f"--verify-generation needs a transformers checkpoint; {model_dir} has no usable config.json "
            f"({str(e).splitlines()[0]})"
        ) from None
    if config.model_type in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES:
        auto = AutoModelForCausalLM
    elif config.model_type in MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES:
        auto = AutoModelForImageTextToText
    else:
        raise InputRefused(
            f"--verify-generation needs a model that generates text; transformers has no causal-LM class "
            f"for model_type {config.model_type!r} in {model_dir}"
        )
    bars, verbosity = hf_logging.is_progress_bar_enabled(), hf_logging.get_verbosity()
    hf_logging.disable_progress_bar()  # a loading bar per call would bury the report in a CI log
    hf_logging.set_verbosity_error()  # missing weights are reported below, as an error
    try:
        model, info = auto.from_pretrained(
            str(model_dir), dtype=dtype, local_files_only=True, output_loading_info=True
        )
    finally:
        hf_logging.set_verbosity(verbosity)
        if bars:
            hf_logging.enable_progress_bar()
    missing = sorted(info.get("missing_keys") or ())
    if missing:  # initialised at random, they would make the probabilities say nothing of the checkpoint
        raise InputRefused(
            f"--verify-generation: {model_dir} lacks {len(missing)} weights of {type(model).__name__} "
            f"({', '.join(missing[:3])}, ...); it holds no complete model to run"
        )
    return model.to(device).eval()


def _probabilities(model, batch: torch.Tensor, token_ids: torch.Tensor) -> torch.Tensor:
    """P(next = token_ids[i]) at the last position of each row of `batch` (B, L) -> (B,)."""
    import torch

    # Logits of the last position only: (B, 1, V) instead of (B, L, V), where the model allows it.
    keep = {"logits_to_keep": 1} if "logits_to_keep" in inspect.signature(model.forward).parameters else {}
    out = model(input_ids=batch, use_cache=False, **keep)
    logits = out.logits[:, -1].float()  # (B, V); float: a softmax over 150k entries in bf16 is coarse
    logp = torch.log_softmax(logits, dim=-1)
    return logp.gather(1, token_ids[:, None]).squeeze(1).exp()


def _peak_memory(device: str | None) -> tuple[float, str]:
    """(MiB, what was measured): CUDA's max allocated on ``device``, else the process's peak RSS."""
    import torch

    if device is not None:
        torch.cuda.synchronize(device)
        return torch.cuda.max_memory_allocated(device) / 2**20, "cuda max allocated"
    import resource

    # ru_maxrss is KiB on Linux, bytes on macOS
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / (2**20 if sys.platform == "darwin" else 2**10)
    return peak, "process peak RSS"


def verify_generation(
    model: str | Path,
    token_ids: Sequence[int],
    *,
    weights_verdicts: Mapping[int, str] | None = None,
    vocab: Vocabulary | None = None,
    device: str | None = None,
    dtype: str | None = None,
    batch_size: int = BATCH_SIZE,
    prompts: Mapping[str, str] | None = None,
) -> GenerationReport:
    """Run the repetition prompts for `token_ids` through the model in the local folder `model`;
    `weights_verdicts` (id -> the weights audit's verdict) is carried into the report."""
    import torch

    from vlfast.tokens.vocab import Vocabulary

    if batch_size < 1:
        raise InputRefused(f"batch_size must be >= 1, got {batch_size}")
    prompts = dict(prompts or PROMPTS)
    if not prompts or any(SLOT not in p for p in prompts.values()):
        raise InputRefused(f"every prompt needs {SLOT} where the token goes")
    ids = list(dict.fromkeys(int(i) for i in token_ids))
    if not ids:
        raise InputRefused("no token ids to verify")
    vocab = vocab or Vocabulary.load(model)
    device, torch_dtype = resolve(device, dtype)
    on_cuda = device.startswith("cuda")
    if on_cuda:
        torch.cuda.reset_peak_memory_stats(device)
    t0 = time.perf_counter()
    lm = load_model(model, device, torch_dtype)
    rows = lm.get_output_embeddings().weight.shape[0]
    bad = [i for i in ids if not 0 <= i < rows]
    if bad:
        raise InputRefused(f"token ids {bad[:5]} are outside the model's {rows} output rows")
    load_seconds = time.perf_counter() - t0

    t1 = time.perf_counter()
    probs: dict[int, dict[str, float]] = {i: {} for i in ids}
    with torch.inference_mode():
        for name, template in prompts.items():
            for start in range(0, len(ids), batch_size):
                chunk = ids[start : start + batch_size]
                batch = torch.tensor([prompt_ids(vocab, template, i) for i in chunk], device=device)
                p = _probabilities(lm, batch, torch.tensor(chunk, device=device)).tolist()
                for i, value in zip(chunk, p, strict=True):
                    probs[i][name] = value
    peak, kind = _peak_memory(device if on_cuda else None)
    run_seconds = time.perf_counter() - t1

    verdicts = weights_verdicts or {}
    checks = []
    for i in ids:
        top = max(probs[i].values())
        checks.append(GenerationCheck(i, vocab.piece(i), verdicts.get(i), probs[i], top, classify(top)))
    return GenerationReport(
        model_dir=str(model),
        model_class=type(lm).__name__,
        device=device,
        dtype=str(torch_dtype).removeprefix("torch."),
        prompts=prompts,
        thresholds={"strong": STRONG, "weak": WEAK},
        tokens=checks,
        batch_size=batch_size,
        load_seconds=round(load_seconds, 3),
        run_seconds=round(run_seconds, 3),
        peak_memory_mib=round(peak, 1),
        peak_memory_kind=kind,
    )
