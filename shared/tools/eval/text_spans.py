"""Which tokens of a text calibrate a KV codec and which evaluate it: the first 30% and the rest, never overlapping.

Owns the split and the cutting into windows, so `tsukimi calibrate kv` and `tsukimi eval kv` agree by construction.
"""

from __future__ import annotations

from pathlib import Path

from shared.model.tokenizer import Tokenizer

CALIBRATION_FRACTION = 0.3


class TextSpanError(ValueError):
    """The text is missing, unreadable, or too short for what was asked of it."""


def read_tokens(path: str | Path, tokenizer: Tokenizer) -> list[int]:
    """The whole file as token ids (no special tokens).

    Raises:
        TextSpanError: the file is missing, not UTF-8, or empty.
    """
    path = Path(path)
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise TextSpanError(f"cannot read text file {path}: {exc}") from None
    tokens = tokenizer.encode(text)
    if not tokens:
        raise TextSpanError(f"text file {path} holds no tokens")
    return tokens


def calibration_span(tokens: list[int]) -> list[int]:
    """The first 30% of the tokens."""
    return tokens[: int(len(tokens) * CALIBRATION_FRACTION)]


def evaluation_span(tokens: list[int]) -> list[int]:
    """Every token after the calibration span."""
    return tokens[int(len(tokens) * CALIBRATION_FRACTION) :]


def windows(tokens: list[int], length: int, count: int | None = None) -> list[list[int]]:
    """Consecutive, non-overlapping windows of exactly `length` tokens from the start (at most `count` of them).

    Raises:
        TextSpanError: not even one window fits.
    """
    available = len(tokens) // length
    if available < 1:
        raise TextSpanError(f"the span holds {len(tokens)} tokens, fewer than one window of {length}")
    taken = available if count is None else min(count, available)
    return [tokens[i * length : (i + 1) * length] for i in range(taken)]
