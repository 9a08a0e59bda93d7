"""The codecs by name: what `--kv-codec` and the block-hash namespace refer to.

Owns the name -> codec table only; each codec's behaviour is in its own module.
"""

from __future__ import annotations

from types import MappingProxyType

from shared.kvcompress.codec import KvCodec
from shared.kvcompress.uniform import Fp16Codec, Int8Codec, KiviCodec

CODECS: MappingProxyType[str, KvCodec] = MappingProxyType(
    {codec.name: codec for codec in (Fp16Codec(), Int8Codec(), KiviCodec(4), KiviCodec(2))}
)


def get_codec(name: str) -> KvCodec:
    """The codec registered under `name`.

    Raises:
        ValueError: no codec has that name; the message lists the known ones.
    """
    try:
        return CODECS[name]
    except KeyError:
        raise ValueError(f"unknown KV codec {name!r}; known codecs: {', '.join(CODECS)}") from None
