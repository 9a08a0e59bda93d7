"""Whose KV a stored block is: every part a prefill instance puts carries a tag, HMAC-SHA256 (16 bytes) under the
deployment's block key of the block hash, the part's place and codec, and its bytes. The cache-store keeps the tag
and never needs the key; a reader refuses a part whose tag does not verify, so bytes relabelled under another
block's hash (by a compromised store, a file swapped on its SSD, or anyone able to put) are a miss, never KV.
"""

from __future__ import annotations

import hashlib
import hmac
import struct

from shared.wire.protocol import BlockPart, BlockPut

TAG_BYTES = 16
_PLACE = struct.Struct("<QIIQ")  # block hash, seq, total (number of parts), raw size


class BlockSigner:
    """Tags and checks block parts with one key (None: untagged, every part accepted: a deployment without a key).

    Args:
        key: the block key (`TSUKIMI_CACHE_BLOCK_KEY`), shared by the prefill instances.
    """

    def __init__(self, key: bytes | None) -> None:
        self._key = key or None

    @property
    def is_keyed(self) -> bool:
        return self._key is not None

    def tag(self, block_hash: int, seq: int, total: int, codec: str, raw_size: int, data: bytes) -> bytes:
        """The part's tag (b"" without a key)."""
        if self._key is None:
            return b""
        place = _PLACE.pack(block_hash, seq, total, raw_size) + codec.encode() + b"\0"
        return hmac.new(self._key, place + data, hashlib.sha256).digest()[:TAG_BYTES]

    def verifies(self, part: BlockPut | BlockPart) -> bool:
        """The part's tag is this key's for its hash, place and bytes (always, without a key)."""
        if self._key is None:
            return True
        expected = self.tag(part.block_hash, part.seq, part.total, part.codec, part.raw_size, part.data)
        return hmac.compare_digest(expected, part.tag)
