"""The tokenizer side of the audit: how a tag splits, which entries are added or special, and which are
known never-trained by their names (`[unused*]`, reserved tokens).
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from functools import cached_property
from pathlib import Path
from typing import Any

from vlfast.errors import InputRefused

# Files a slow or fast tokenizer is built from (tokenizer.json is read directly).
VOCAB_FILES = (
    "tokenizer.json",
    "vocab.json",
    "vocab.txt",
    "tokenizer.model",
    "spiece.model",
    "sentencepiece.bpe.model",
)

# Names that tokenizer authors give to entries they reserve and never train: BERT `[unused12]`,
# Llama-3 `<|reserved_special_token_5|>`, Gemma `<unused3>`, others `<|unused_7|>`, `<|reserved_12|>`.
UNUSED_NAME = re.compile(
    r"^(\[unused\d+\]|<\|reserved_special_token_\d+\|>|<unused\d+>|<\|unused_?\d+\|>|<\|reserved_\d+\|>)$"
)


@dataclass
class Vocabulary:
    """A loaded tokenizer plus the facts the audit needs about its entries."""

    source: Path
    tokenizer: Any  # tokenizers.Tokenizer
    added: dict[int, bool] = field(default_factory=dict)  # added-token id -> special flag

    @classmethod
    def load(cls, model_dir: str | Path) -> Vocabulary:
        model_dir = Path(model_dir)
        path = model_dir / "tokenizer.json"
        if path.is_file():
            from tokenizers import Tokenizer

            tok = Tokenizer.from_file(str(path))
        elif not any((model_dir / f).is_file() for f in VOCAB_FILES):
            # transformers would happily build an empty tokenizer from tokenizer_config.json alone.
            raise FileNotFoundError(
                f"no tokenizer files in {model_dir} (none of tokenizer.json, {', '.join(VOCAB_FILES[1:])}); "
                "save the tokenizer next to the weights with tokenizer.save_pretrained(DIR)"
            )
        else:
            try:
                from transformers import AutoTokenizer

                tok = AutoTokenizer.from_pretrained(str(model_dir), local_files_only=True).backend_tokenizer
            except Exception as e:  # noqa: BLE001 - any failure here means "no usable tokenizer"
                raise FileNotFoundError(
                    f"no usable tokenizer in {model_dir} (no tokenizer.json; transformers said: {e}); "
                    "save the tokenizer next to the weights with tokenizer.save_pretrained(DIR)"
                ) from None
        # A saved tokenizer.json may pad or truncate every encoding (BERT's pads to 128).
        tok.no_padding()
        tok.no_truncation()
        added = {int(i): bool(t.special) for i, t in tok.get_added_tokens_decoder().items()}
        return cls(model_dir, tok, added)

    @cached_property
    def vocab(self) -> dict[str, int]:
        return self.tokenizer.get_vocab(with_added_tokens=True)

    @cached_property
    def length(self) -> int:
        """Number of ids the tokenizer can produce (max id + 1): rows beyond it are padding."""
        return max(self.vocab.values()) + 1

    @cached_property
    def unk_id(self) -> int | None:
        # WordPiece/WordLevel/BPE models expose `unk_token`; Unigram an `unk_id` only in its JSON.
        unk = getattr(self.tokenizer.model, "unk_token", None)
        if isinstance(unk, str):
            return self.vocab.get(unk)
        if type(self.tokenizer.model).__name__ == "Unigram":
            unk_id = json.loads(self.tokenizer.to_str()).get("model", {}).get("unk_id")
            return unk_id if isinstance(unk_id, int) else None
        return None

    def piece(self, token_id: int) -> str:
        return self.tokenizer.id_to_token(int(token_id)) or ""

    def split(self, text: str) -> list[int]:
        """Ids the tokenizer produces for `text` in running text (added tokens included)."""
        if not text:
            raise InputRefused("empty tag: give tags such as --tags '<think>' --tags '</think>'")
        ids = self.tokenizer.encode(text, add_special_tokens=False).ids
        if not ids:
            raise InputRefused(f"the tokenizer in {self.source} produces no tokens for {text!r}")
        if self.unk_id is not None and self.unk_id in ids:
            raise InputRefused(
                f"tag {text!r} contains characters the tokenizer in {self.source} maps to its unknown token; "
                "choose a tag made of characters the tokenizer knows"
            )
        return ids

    def plain_split(self, text: str) -> list[int]:
        """Ids for `text` without the added tokens inside it: the ordinary pieces a tag falls back to."""
        spec = json.loads(self.tokenizer.to_str())
        spec["added_tokens"] = [t for t in spec.get("added_tokens", []) if t["content"] not in text]
        from tokenizers import Tokenizer

        spec["padding"] = spec["truncation"] = None
        plain = Tokenizer.from_str(json.dumps(spec))
        return plain.encode(text, add_special_tokens=False).ids

    def unused_by_name(self) -> list[int]:
        return sorted(i for t, i in self.vocab.items() if UNUSED_NAME.match(t))
