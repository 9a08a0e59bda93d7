"""The token classes two of FastGen's policies keep whatever else they drop: which vocabulary ids are special
(control tokens) and which are punctuation."""

from __future__ import annotations

import string
import unicodedata
from dataclasses import dataclass

import torch

from shared.model.tokenizer import Tokenizer


def is_punctuation(text: str) -> bool:
    """Whether `text` is non-empty and made only of punctuation (Unicode P*, or ASCII `string.punctuation`) and
    whitespace. A whitespace-only piece (" ", "\\n\\n") counts: it separates as punctuation does."""
    return bool(text) and all(
        c.isspace() or c in string.punctuation or unicodedata.category(c).startswith("P") for c in text
    )


@dataclass(frozen=True)
class TokenClasses:
    """Which vocabulary ids are special and which are punctuation; bool [vocab] each, disjoint."""

    special: torch.Tensor
    punct: torch.Tensor

    @classmethod
    def from_tokenizer(cls, tokenizer: Tokenizer, vocab_size: int | None = None) -> TokenClasses:
        """Special: the tokenizer's control tokens. Punctuation: every other entry whose text `is_punctuation` (a
        byte-level piece that is not valid UTF-8 on its own is not). `vocab_size`: the model's, if larger."""
        size = max(tokenizer.vocab_size, vocab_size or 0)
        special = torch.zeros(size, dtype=torch.bool)
        punct = torch.zeros(size, dtype=torch.bool)
        special[sorted(tokenizer.control_token_ids)] = True
        for token_id in range(tokenizer.vocab_size):
            if not special[token_id] and is_punctuation(_token_text(tokenizer, token_id)):
                punct[token_id] = True
        return cls(special, punct)

    def of(self, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """[n] token ids -> (special, punct), bool [n] each."""
        return self.special[ids], self.punct[ids]


def _token_text(tokenizer: Tokenizer, token_id: int) -> str:
    if not tokenizer.is_byte_level:
        return tokenizer.decode([token_id], skip_special_tokens=False)
    try:
        return tokenizer.token_bytes(token_id).decode("utf-8")
    except UnicodeDecodeError:  # part of a multi-byte character
        return ""
