"""The interface every KV codec implements: one layer of one KV block to self-contained bytes and back.

Owns `KvCodec`, `KvCodecError` and the little-endian byte helpers codecs share; the codecs themselves live in their
own modules and the name -> codec registry in `registry`. Where blocks live (pool, cache store, wire) is not here.
"""

from __future__ import annotations

from abc import ABC, abstractmethod

import numpy as np
import torch

# Little-endian numpy dtypes of the tensors codecs write; numpy makes the byte order explicit on any host.
_WIRE_DTYPES: dict[torch.dtype, str] = {torch.float16: "<f2", torch.uint8: "u1", torch.int8: "i1"}


class KvCodecError(ValueError):
    """A buffer cannot be decoded: its length does not match the shape it is said to hold."""


class KvCodec(ABC):
    """Encodes one layer of one KV block, K and V each [kv_heads, num_tokens, head_dim], to bytes and back.

    A block may be partial (num_tokens below the block size). The bytes hold everything decode needs besides the
    shape (codes, scales, zero points) and are exactly `num_bytes` long. `starts_sequence` marks a sequence's first
    block (its token 0 is the attention sink): a codec may store that block differently (KVQuant keeps the sink in
    fp16, so such a block is longer); encode, decode and num_bytes must be given the same flag.
    """

    name: str
    # Whether `encode` expects keys before RoPE (decode then returns them unrotated; the caller rotates). Uniform
    # codecs take the keys as the pool holds them, after RoPE.
    keys_before_rope: bool = False

    @abstractmethod
    def encode(self, k: torch.Tensor, v: torch.Tensor, *, starts_sequence: bool = False) -> bytes:
        """K and V of one layer of one block as bytes.

        Args:
            k, v: [kv_heads, num_tokens, head_dim], the same shape, any float dtype, any device.
        Raises:
            ValueError: shapes differ, are not 3-D, are empty, or the dtype is not floating point.
        """

    @abstractmethod
    def decode(
        self, data: bytes, kv_heads: int, num_tokens: int, head_dim: int, dtype: torch.dtype, *,
        starts_sequence: bool = False,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V, each [kv_heads, num_tokens, head_dim] in `dtype` on the CPU, from `encode`'s bytes.

        Raises:
            KvCodecError: `data` is not exactly `num_bytes(kv_heads, num_tokens, head_dim)` long.
            ValueError: a dimension below 1.
        """

    @abstractmethod
    def num_bytes(self, kv_heads: int, num_tokens: int, head_dim: int, *, starts_sequence: bool = False) -> int:
        """Exact length of `encode`'s output for this shape, every byte counted.

        Raises:
            ValueError: a dimension below 1.
        """

    def bits_per_element(
        self, kv_heads: int, num_tokens: int, head_dim: int, *, starts_sequence: bool = False
    ) -> float:
        """Stored bits per K or V element, metadata included: 8 * num_bytes / (2 * kv_heads * num_tokens * head_dim)."""
        num_elements = 2 * kv_heads * num_tokens * head_dim
        return 8 * self.num_bytes(kv_heads, num_tokens, head_dim, starts_sequence=starts_sequence) / num_elements

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.name!r})"


def check_dims(kv_heads: int, num_tokens: int, head_dim: int) -> None:
    """Raises ValueError unless every dimension is at least 1."""
    if min(kv_heads, num_tokens, head_dim) < 1:
        dims = f"kv_heads={kv_heads} num_tokens={num_tokens} head_dim={head_dim}"
        raise ValueError(f"dimensions must be >= 1, got {dims}")


def check_kv(k: torch.Tensor, v: torch.Tensor) -> tuple[int, int, int]:
    """(kv_heads, num_tokens, head_dim) of a block's K and V; raises ValueError if they are not a valid pair."""
    if k.shape != v.shape or k.dim() != 3:
        shapes = f"{tuple(k.shape)} and {tuple(v.shape)}"
        raise ValueError(f"k and v must both be [kv_heads, num_tokens, head_dim], got {shapes}")
    if not (k.dtype.is_floating_point and v.dtype.is_floating_point):
        raise ValueError(f"k and v must be floating point, got {k.dtype} and {v.dtype}")
    kv_heads, num_tokens, head_dim = k.shape
    check_dims(kv_heads, num_tokens, head_dim)
    return kv_heads, num_tokens, head_dim


def to_bytes(*tensors: torch.Tensor) -> bytes:
    """The tensors (fp16, uint8 or int8), each flattened row-major, concatenated as little-endian bytes."""
    parts = []
    for tensor in tensors:
        array = tensor.detach().contiguous().cpu().numpy()
        parts.append(array.astype(_WIRE_DTYPES[tensor.dtype], copy=False).tobytes())
    return b"".join(parts)


def split_bytes(codec: KvCodec, data: bytes, sections: list[tuple[torch.dtype, int]]) -> list[torch.Tensor]:
    """Cut `data` into 1-D tensors of the given (dtype, count) in order; the inverse of `to_bytes`.

    Raises:
        KvCodecError: `data` is shorter or longer than the sections add up to.
    """
    expected = sum(count * torch.empty((), dtype=dtype).element_size() for dtype, count in sections)
    if len(data) != expected:
        raise KvCodecError(f"{codec.name} buffer holds {len(data)} bytes, the shape needs exactly {expected}")
    tensors, offset = [], 0
    for dtype, count in sections:
        array = np.frombuffer(data, dtype=_WIRE_DTYPES[dtype], count=count, offset=offset)
        tensors.append(torch.from_numpy(array.astype(array.dtype.newbyteorder("="))))  # a writable copy, native order
        offset += array.nbytes
    return tensors
