"""The chained block hash, the spec of docs/block-hash.md: every service names a KV block by it.

Pure functions over token ids; `shared.engine.blocks` pages and caches blocks by these ids.
"""

from __future__ import annotations

import struct
import sys
from array import array
from collections.abc import Iterator, Sequence

import xxhash

NAMESPACE_VERSION = "tsukimi/v1"
_PARENT = struct.Struct("<Q")  # the parent hash: 8 bytes, little-endian
_U32 = next(code for code in ("I", "L") if array(code).itemsize == 4)
_IS_BIG_ENDIAN = sys.byteorder == "big"


def make_namespace(model_fingerprint: str, kv_codec: str) -> bytes:
    """The namespace bytes that seed every hash chain: UTF-8 of ``"tsukimi/v1|<fingerprint>|<codec>"``.

    Args:
        model_fingerprint: identifies the model weights (for example a digest of the GGUF file).
        kv_codec: the KV codec name (``"fp16"``, a KVQuant codec, ...); codecs never share block ids.

    Raises:
        ValueError: a field is empty or contains ``"|"`` (the encoding would be ambiguous).
    """
    for name, value in (("model_fingerprint", model_fingerprint), ("kv_codec", kv_codec)):
        if not value or "|" in value:
            raise ValueError(f"{name} must be non-empty and must not contain '|': {value!r}")
    return f"{NAMESPACE_VERSION}|{model_fingerprint}|{kv_codec}".encode()


def u32_tokens(token_ids: Sequence[int]) -> array[int]:
    try:
        return array(_U32, token_ids)
    except OverflowError as exc:
        raise ValueError(f"token ids must lie in [0, 2**32): {exc}") from exc


def le_bytes(tokens: array[int]) -> bytes:
    if _IS_BIG_ENDIAN:
        tokens = array(_U32, tokens)
        tokens.byteswap()
    return tokens.tobytes()


def chain_hash(parent: int | None, block_bytes: bytes, namespace: bytes) -> int:
    if parent is None:
        return xxhash.xxh3_64_intdigest(namespace + block_bytes)
    try:
        prefix = _PARENT.pack(parent)
    except struct.error as exc:
        raise ValueError(f"parent hash must lie in [0, 2**64): {parent!r}") from exc
    return xxhash.xxh3_64_intdigest(prefix + block_bytes)


def hash_block(parent: int | None, token_ids: Sequence[int], namespace: bytes) -> int:
    """One block's id: ``xxh3_64(namespace || tokens)`` for a first block, else ``xxh3_64(parent || tokens)``.

    Args:
        parent: the previous block's id (an unsigned 64-bit int), or None for the first block of a sequence.
        token_ids: the block's tokens, each encoded as a little-endian uint32.
        namespace: from ``make_namespace``; hashed only into a first block (later ones inherit it via parent).

    Raises:
        ValueError: token_ids is empty, a token or the parent is out of range.
    """
    if len(token_ids) == 0:
        raise ValueError("a block holds at least one token")
    return chain_hash(parent, le_bytes(u32_tokens(token_ids)), namespace)


def block_hashes(token_ids: Sequence[int], block_size: int, namespace: bytes) -> list[int]:
    """The chained ids of the full blocks of ``token_ids``; a partial tail block has no id.

    Raises:
        ValueError: block_size is not positive or a token is out of range.
    """
    if block_size <= 0:
        raise ValueError(f"block_size must be positive: {block_size}")
    return [block_hash for _, block_hash in chain_hashes(u32_tokens(token_ids), block_size, namespace)]


def chain_hashes(tokens: array[int], block_size: int, namespace: bytes, start: int = 0,
                 parent: int | None = None) -> Iterator[tuple[array[int], int]]:
    """Each full block of ``tokens`` from block ``start`` on, with its chained id, lazily (a caller may stop at the
    first miss); ``parent`` is block ``start - 1``'s id (None when ``start`` is 0)."""
    for i in range(start, len(tokens) // block_size):
        block_tokens = tokens[i * block_size : (i + 1) * block_size]
        parent = chain_hash(parent, le_bytes(block_tokens), namespace)
        yield block_tokens, parent
