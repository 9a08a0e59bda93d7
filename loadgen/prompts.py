"""What a prompt is made of: one fixed random block of token ids per trace hash id, seeded random tokens, and the
pseudo-word text that stands in for token ids on the chat API. Nothing here knows about arrivals or HTTP.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence

import numpy as np

DEFAULT_MIN_TOKEN_ID = 1000  # above SmolLM2's special and byte tokens
DEFAULT_VOCAB_SIZE = 32000  # below SmolLM2's 49152, and every common tokenizer's
# Generator seeds are [seed, kind, ...] of a fixed length per kind: numpy treats [a, b] and [a, b, 0] alike.
_BLOCK, _PADDING = 0, 1

# Two-letter syllables: with SmolLM2's tokenizer a run of them costs about 1.1 tokens per word.
_WORDS = tuple(c + v for c in "bdfghklmnprstvwz" for v in "aeiou")


def random_tokens(rng: np.random.Generator, num_tokens: int, min_token_id: int, vocab_size: int) -> list[int]:
    """`num_tokens` ids drawn uniformly from [min_token_id, vocab_size)."""
    return rng.integers(min_token_id, vocab_size, size=num_tokens).tolist()


def tokens_to_text(token_ids: Sequence[int]) -> str:
    """Pseudo-words standing for `token_ids`, one word per id: equal ids give equal text, so sharing survives at
    the text level, but the server's tokenizer decides the real count (about 1.1 tokens a word for SmolLM2)."""
    return " ".join(_WORDS[t % len(_WORDS)] for t in token_ids)


class BlockTokens:
    """The tokens of trace blocks: hash id `h` is `block_len` ids from a generator seeded by (seed, 0, h).

    Equal ids give equal tokens in every process and run with the same seed; recent blocks are kept in an LRU
    cache, since a trace repeats ids (every request of the conversation trace starts with id 0).
    """

    def __init__(
        self,
        block_len: int,
        seed: int = 0,
        min_token_id: int = DEFAULT_MIN_TOKEN_ID,
        vocab_size: int = DEFAULT_VOCAB_SIZE,
        cache_size: int = 65536,
    ) -> None:
        """Raises ValueError for a block length below 1 or an empty or negative token id range."""
        if block_len < 1:
            raise ValueError(f"block length must be at least 1, got {block_len}")
        if not 0 <= min_token_id < vocab_size:
            raise ValueError(f"need 0 <= min_token_id < vocab_size, got {min_token_id} and {vocab_size}")
        self.block_len = block_len
        self.seed = seed
        self.min_token_id = min_token_id
        self.vocab_size = vocab_size
        self.cache_size = cache_size
        self._cache: OrderedDict[tuple[int, ...], list[int]] = OrderedDict()
        # One int object per token id, shared by every block: a whole trace's prompts then cost 8 bytes a token.
        self._token_objects = list(range(vocab_size))

    def block(self, hash_id: int) -> list[int]:
        """The tokens of block `hash_id` (a non-negative int). Do not modify the returned list."""
        return self._cached((_BLOCK, hash_id))

    def padding(self, last_hash_id: int | None, index: int) -> list[int]:
        """Extra block `index` (0, 1, ...) after a prompt whose last hash id is `last_hash_id` (None: no blocks)."""
        return self._cached((_PADDING, 0 if last_hash_id is None else last_hash_id + 1, index))

    def prompt(self, hash_ids: Sequence[int], input_len: int) -> list[int]:
        """The blocks of `hash_ids` concatenated and cut to `input_len`; padded with `padding` blocks when
        `input_len` is longer than the blocks."""
        tokens: list[int] = []
        for hash_id in hash_ids:
            if len(tokens) >= input_len:
                break
            tokens.extend(self.block(hash_id))
        last_hash_id = hash_ids[-1] if hash_ids else None
        index = 0
        while len(tokens) < input_len:
            tokens.extend(self.padding(last_hash_id, index))
            index += 1
        return tokens[:input_len]

    def _cached(self, key: tuple[int, ...]) -> list[int]:
        tokens = self._cache.get(key)
        if tokens is not None:
            self._cache.move_to_end(key)
            return tokens
        rng = np.random.default_rng([self.seed, *key])
        drawn = random_tokens(rng, self.block_len, self.min_token_id, self.vocab_size)
        tokens = list(map(self._token_objects.__getitem__, drawn))
        self._cache[key] = tokens
        if len(self._cache) > self.cache_size:
            self._cache.popitem(last=False)
        return tokens
