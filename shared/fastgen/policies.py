"""FastGen's policies, cheapest first, their settings, and the token classes two of them keep.

Owns the policy order and names, `FastGenSettings` (with its validation) and `TokenClasses` (which vocabulary ids are
special or punctuation). What each policy keeps is `kept`'s; which policy a head gets is `profile`'s.
"""

from __future__ import annotations

import string
import unicodedata
from dataclasses import dataclass
from enum import IntEnum

import torch

from shared.model.tokenizer import Tokenizer


class Policy(IntEnum):
    """A head's compression policy. Each keeps what the one before keeps and more (cumulative unions)."""

    SPECIAL = 0  # special (control) tokens
    PUNCT = 1  # + punctuation
    FREQUENT = 2  # + heavy hitters: the top r_f of the length by accumulated attention
    LOCAL = 3  # + the most recent r_l of the length
    FULL = 4  # everything

    @property
    def label(self) -> str:
        """The name in reports, e.g. "special+punct+frequent"."""
        if self is Policy.FULL:
            return "full"
        return "+".join(p.name.lower() for p in Policy if p <= self)


CHEAP_POLICIES = tuple(p for p in Policy if p is not Policy.FULL)  # the ones that evict; full is the fallback


@dataclass(frozen=True)
class FastGenSettings:
    """How FastGen profiles and keeps.

    Attributes:
        threshold: T, the share of the attention mass a head's kept keys must recover, in (0, 1].
        r_local: the local window, a share of the current length, in [0, 1].
        r_frequent: the heavy-hitter budget, a share of the current length, in [0, 1].
        profile_rows: profile on the prompt's last W query rows; None profiles every row.
    Raises:
        ValueError: a value out of range.
    """

    threshold: float = 0.95
    r_local: float = 0.3
    r_frequent: float = 0.3
    profile_rows: int | None = None

    def __post_init__(self) -> None:
        if not 0 < self.threshold <= 1:
            raise ValueError(f"the threshold T must be in (0, 1], got {self.threshold}")
        for name, ratio in (("r_local", self.r_local), ("r_frequent", self.r_frequent)):
            if not 0 <= ratio <= 1:
                raise ValueError(f"{name} must be in [0, 1], got {ratio}")
        if self.profile_rows is not None and self.profile_rows < 1:
            raise ValueError(f"profile_rows must be at least 1 (or None for every row), got {self.profile_rows}")


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
