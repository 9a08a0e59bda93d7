"""A GGUF file's header without its tensor data: metadata, where each tensor lives, and the Llama architecture it
describes. No torch: the gateway and the scheduler read a model through it (`manifest`); `gguf_file` loads the
weights.
"""

from __future__ import annotations

import mmap
import struct
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from math import prod
from pathlib import Path
from typing import Any

import gguf
import numpy as np

from shared.model.config import LlamaConfig

_MAGIC = b"GGUF"
_DEFAULT_ALIGNMENT = 32
# GGUF metadata value types (gguf.GGUFValueType): fixed-size scalars, then 8 = string and 9 = array.
_SCALARS = {
    0: struct.Struct("<B"), 1: struct.Struct("<b"), 2: struct.Struct("<H"), 3: struct.Struct("<h"),
    4: struct.Struct("<I"), 5: struct.Struct("<i"), 6: struct.Struct("<f"), 7: struct.Struct("<?"),
    10: struct.Struct("<Q"), 11: struct.Struct("<q"), 12: struct.Struct("<d"),
}  # fmt: skip
_STRING, _ARRAY = 8, 9
_U64 = _SCALARS[10]


@dataclass(frozen=True)
class GGUFTensorInfo:
    """Where one tensor lives in the file: `shape` in torch order (GGUF lists dims reversed)."""

    name: str
    shape: tuple[int, ...]
    ggml_type: gguf.GGMLQuantizationType
    offset: int  # absolute, from the start of the file
    nbytes: int


class _Cursor:
    """Sequential little-endian reads over the mapped file.

    gguf.GGUFReader builds a numpy view per array element and takes seconds on a 49k-token vocabulary.
    """

    def __init__(self, buf: mmap.mmap) -> None:
        self.buf = buf
        self.pos = 0

    def scalar(self, value_type: int) -> Any:
        fmt = _SCALARS[value_type]
        (value,) = fmt.unpack_from(self.buf, self.pos)
        self.pos += fmt.size
        return value

    def string(self) -> str:
        (length,) = _U64.unpack_from(self.buf, self.pos)
        start = self.pos + 8
        self.pos = start + length
        return self.buf[start : self.pos].decode("utf-8")

    def value(self, value_type: int) -> Any:
        if value_type == _STRING:
            return self.string()
        if value_type == _ARRAY:
            return self.array()
        if value_type not in _SCALARS:
            raise ValueError(f"unknown GGUF metadata value type {value_type}")
        return self.scalar(value_type)

    def array(self) -> list[Any]:
        item_type, count = self.scalar(4), self.scalar(10)
        if item_type in _SCALARS:
            fmt = _SCALARS[item_type]
            items = np.frombuffer(self.buf, np.dtype(fmt.format), count=count, offset=self.pos).tolist()
            self.pos += fmt.size * count
            return items
        if item_type == _STRING:
            return [self.string() for _ in range(count)]
        return [self.value(item_type) for _ in range(count)]


def _read_header(buf: mmap.mmap) -> tuple[dict[str, Any], list[GGUFTensorInfo]]:
    cursor = _Cursor(buf)
    if buf[:4] != _MAGIC:
        raise ValueError("not a GGUF file (bad magic)")
    cursor.pos = 4
    version = cursor.scalar(4)
    if version not in (2, 3):
        raise ValueError(f"unsupported GGUF version {version} (only 2 and 3 are read)")
    num_tensors, num_kv = cursor.scalar(10), cursor.scalar(10)
    metadata: dict[str, Any] = {}
    for _ in range(num_kv):
        key = cursor.string()
        metadata[key] = cursor.value(cursor.scalar(4))
    raw_infos = []
    for _ in range(num_tensors):
        name = cursor.string()
        dims = [cursor.scalar(10) for _ in range(cursor.scalar(4))]
        raw_infos.append((name, tuple(reversed(dims)), cursor.scalar(4), cursor.scalar(10)))
    alignment = int(metadata.get("general.alignment", _DEFAULT_ALIGNMENT))
    data_start = -(-cursor.pos // alignment) * alignment
    return metadata, [_tensor_info(*raw, data_start) for raw in raw_infos]


def _tensor_info(
    name: str, shape: tuple[int, ...], type_id: int, offset: int, data_start: int
) -> GGUFTensorInfo:
    try:
        ggml_type = gguf.GGMLQuantizationType(type_id)
    except ValueError:
        raise ValueError(f"tensor {name!r} has unknown ggml type {type_id}") from None
    block_size, type_size = gguf.GGML_QUANT_SIZES[ggml_type]
    nbytes = prod(shape[:-1]) * (shape[-1] // block_size) * type_size
    return GGUFTensorInfo(name, shape, ggml_type, data_start + offset, nbytes)


@contextmanager
def mapped_gguf(path: Path) -> Iterator[tuple[mmap.mmap, dict[str, Any], list[GGUFTensorInfo]]]:
    """The read-only mapped file with its parsed header; every numpy view must be gone when it closes."""
    if path.stat().st_size < 24:
        raise ValueError(f"{path} is too small to be a GGUF file")
    with open(path, "rb") as file, mmap.mmap(file.fileno(), 0, access=mmap.ACCESS_READ) as buf:
        try:
            metadata, infos = _read_header(buf)
        except (struct.error, UnicodeDecodeError, IndexError) as exc:
            raise ValueError(f"{path}: truncated or corrupt GGUF header ({exc})") from exc
        yield buf, metadata, infos


def read_gguf_metadata(path: str | Path) -> dict[str, Any]:
    """The metadata key/values of a GGUF file (arrays as lists), without touching tensor data.

    Raises:
        ValueError: the file is not a GGUF v2/v3 file or its header is truncated.
    """
    with mapped_gguf(Path(path)) as (_, metadata, _):
        return metadata


def llama_config(metadata: dict[str, Any], tensors: dict[str, GGUFTensorInfo]) -> LlamaConfig:
    arch = metadata.get("general.architecture")
    if arch != "llama":
        raise ValueError(f"GGUF architecture {arch!r} is not supported (only 'llama')")

    def need(key: str) -> Any:
        if f"llama.{key}" not in metadata:
            raise ValueError(f"GGUF metadata lacks llama.{key}")
        return metadata[f"llama.{key}"]

    hidden, num_heads = int(need("embedding_length")), int(need("attention.head_count"))
    head_dim = int(metadata.get("llama.attention.key_length", hidden // num_heads))
    if int(metadata.get("llama.rope.dimension_count", head_dim)) != head_dim:
        raise ValueError("partial rotary embeddings (rope.dimension_count != head_dim) are not supported")
    if metadata.get("llama.rope.scaling.type", "none") != "none":
        raise ValueError(f"RoPE scaling {metadata['llama.rope.scaling.type']!r} is not supported")
    if "token_embd.weight" not in tensors:
        raise ValueError("GGUF file has no token_embd.weight")
    return LlamaConfig(
        vocab_size=tensors["token_embd.weight"].shape[0],
        hidden_size=hidden,
        intermediate_size=int(need("feed_forward_length")),
        num_layers=int(need("block_count")),
        num_heads=num_heads,
        num_kv_heads=int(metadata.get("llama.attention.head_count_kv", num_heads)),
        head_dim=head_dim,
        rope_theta=float(metadata.get("llama.rope.freq_base", 10000.0)),
        rms_norm_eps=float(need("attention.layer_norm_rms_epsilon")),
        max_position=int(need("context_length")),
        tie_word_embeddings="output.weight" not in tensors,
    )
