"""KV cache compression: codecs that turn one layer of one KV block into bytes and back (fp16, int8, KIVI)."""

from __future__ import annotations

from shared.kvcompress.codec import KvCodec, KvCodecError
from shared.kvcompress.registry import CODECS, get_codec

__all__ = ["CODECS", "KvCodec", "KvCodecError", "get_codec"]
