"""The FastGen harness's codec variants (`tsukimi eval fastgen --kv-codec`): a decode variant's K/V as the engine
serves them from a kvquant pool of W-token blocks. The full cache reads every block before the step's own as kvquant
blocks (`tsukimi eval kv`'s rule); FastGen reads lanes of kvquant records, written from what the pool held (prompt
tokens in full blocks are coded twice), with the newest W positions whole beside them. The sink (position 0) is the
block codec's: whole, in fp16.

Owns building the codecs from a name and calibration, and rewriting a variant's stored K/V step by step
(`ServedKv`); which variants are coded is `fastgen`'s, the attention `fastgen_attention`'s, the record format
`shared.fastgen.lane_codec`'s.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import torch

from kernels.layer_ops import apply_rotary_ref
from shared.env_vars import default_int
from shared.fastgen.lane_codec import LaneCodec
from shared.kvcompress.bundled import resolve_calibration
from shared.kvcompress.calibration import load_calibration
from shared.kvcompress.kvquant import KvQuantCodec
from shared.kvcompress.names import CALIBRATED_CODEC_NAMES
from shared.kvcompress.registry import layer_codecs
from shared.model.config import LlamaConfig
from shared.model.llama import RotaryEmbedding

LANE_CODECS = CALIBRATED_CODEC_NAMES  # kvquant-4, -3, -2: the codecs lane records exist for
DEFAULT_BLOCK_SIZE = default_int("TSUKIMI_BLOCK_SIZE")  # the engine's


@dataclass(frozen=True)
class KvServing:
    """A kvquant codec as the engine serves it: one block codec per layer over `block_size`-token blocks, and the
    lane records built from the same calibration."""

    blocks: Sequence[KvQuantCodec]
    lanes: LaneCodec
    block_size: int

    @staticmethod
    def of(codecs: Sequence[KvQuantCodec], block_size: int = DEFAULT_BLOCK_SIZE) -> KvServing:
        """Raises ValueError: a block size below 1, or codecs `LaneCodec` refuses."""
        if block_size < 1:
            raise ValueError(f"the block size must be at least 1, got {block_size}")
        return KvServing(list(codecs), LaneCodec(codecs), block_size)

    def figures(self) -> dict[str, int | str]:
        """The codec's name, its record size against an fp16 entry (a key and a value of head_dim halves each) and
        the block size."""
        lanes = self.lanes
        return {"name": lanes.name, "entry_bytes": lanes.entry_bytes, "fp16_entry_bytes": 2 * 2 * lanes.head_dim,
                "block_size": self.block_size}


def build_kv_serving(
    name: str, config: LlamaConfig, kv_calib: str | Path | None = None, block_size: int = DEFAULT_BLOCK_SIZE
) -> KvServing:
    """The codec `name` (a kvquant codec) for a model of `config`'s shape, served in `block_size`-token blocks.

    Args:
        kv_calib: the calibration file (default: the one shipped for the default model).
    Raises:
        ValueError: a codec without lane records (`KvCalibrationError`, a ValueError: no calibration, or one of
            another shape or width), or a block size below 1.
    """
    if name not in LANE_CODECS:
        raise ValueError(f"FastGen's lanes code only {', '.join(LANE_CODECS)}, not {name!r}")
    path = resolve_calibration(name, kv_calib)
    assert path is not None  # kvquant codecs always resolve a file or raise
    codecs = layer_codecs(name, config.num_layers, config.num_kv_heads, config.head_dim, load_calibration(path))
    return KvServing.of([codec for codec in codecs if isinstance(codec, KvQuantCodec)], block_size)


class ServedKv:
    """One decode variant's stored K/V, rewritten as a step over L tokens (its own at position L - 1) reads them.

    Blocks (the full cache): block b, positions [bW, (b + 1)W), reads decoded once a step's token lies past it
    (L - 1 >= (b + 1)W); the step's own block reads exact. Lanes (FastGen): the prompt's n tokens as the pool held
    them after prefill (blocks below n // W decoded, the rest exact); then a position p in 1 .. L - W - 1 reads its
    lane record (written from that value, a generated token's exact one), newer ones their exact ring value.

    Args:
        serving: the codecs and W.
        rotary: the model's RoPE (keys are coded before it).
        variant: the variant's index among the decode's.
        lanes: FastGen's lanes rather than the full cache's blocks.
    """

    def __init__(self, serving: KvServing, rotary: RotaryEmbedding, variant: int, *, lanes: bool) -> None:
        self.serving, self.rotary, self.variant, self.lanes = serving, rotary, variant, lanes
        self.keys: dict[int, torch.Tensor] = {}  # per layer, [kv_heads, max_len, D]: what the pool or ring holds
        self.num_blocked: dict[int, int] = {}  # per layer, positions read as decoded blocks
        self.num_recorded: dict[int, int] = {}  # per layer, positions read as lane records (from 1: the sink's not)

    def begin(self, layer: int, k_cache: torch.Tensor, v_cache: torch.Tensor, k_pre_rope: torch.Tensor) -> None:
        """After the prompt's pass. k_cache, v_cache: the variant's [kv_heads, max_len, D] (rotated keys), exact over
        the prompt; k_pre_rope: the prompt's [n, kv_heads, D]."""
        num_tokens = k_pre_rope.shape[0]
        self.keys[layer] = torch.zeros_like(k_cache)
        self.keys[layer][:, :num_tokens] = k_pre_rope.transpose(0, 1)
        self.num_blocked[layer], self.num_recorded[layer] = 0, 1
        self._code_blocks(layer, k_cache, v_cache, num_tokens // self.serving.block_size)
        self._settle(layer, k_cache, v_cache, num_tokens + 1)

    def step(
        self, layer: int, k_cache: torch.Tensor, v_cache: torch.Tensor, k_pre_rope: torch.Tensor, length: int
    ) -> None:
        """The step's token (position length - 1) is in the caches, exact; k_pre_rope: its [kv_heads, D]."""
        self.keys[layer][:, length - 1] = k_pre_rope
        self._settle(layer, k_cache, v_cache, length)

    def _settle(self, layer: int, k_cache: torch.Tensor, v_cache: torch.Tensor, length: int) -> None:
        size = self.serving.block_size
        if not self.lanes:
            self._code_blocks(layer, k_cache, v_cache, (length - 1) // size)
            return
        start, end = self.num_recorded[layer], length - size
        if end <= start:
            return
        heads = torch.arange(k_cache.shape[0]).repeat_interleave(end - start)  # entries head-major
        keys, values = self.keys[layer][:, start:end], v_cache[:, start:end]
        lanes = self.serving.lanes
        k, v = lanes.decode(layer, heads, lanes.encode(layer, heads, keys.flatten(0, 1), values.flatten(0, 1)))
        self._write(k_cache, v_cache, start, k.view(keys.shape), v.view(values.shape))
        self.num_recorded[layer] = end

    def _code_blocks(self, layer: int, k_cache: torch.Tensor, v_cache: torch.Tensor, num_blocks: int) -> None:
        """Blocks up to num_blocks (exclusive) read decoded from now on; block 0 starts the sequence."""
        size, codec = self.serving.block_size, self.serving.blocks[layer]
        num_kv_heads, _, head_dim = k_cache.shape
        first = self.num_blocked[layer] // size
        # block 0 alone (a call's starts_sequence applies to each of its blocks), then the rest together
        for low, high in ((first, min(num_blocks, 1)), (max(first, 1), num_blocks)):
            if high <= low:
                continue
            start, end = low * size, high * size
            # [H, (high - low) * W, D] -> [high - low, H, W, D]
            k, v = (x[:, start:end].unflatten(1, (high - low, size)).transpose(0, 1)
                    for x in (self.keys[layer], v_cache))
            packed = codec.encode_blocks(k, v, starts_sequence=low == 0)
            k, v = (x.transpose(0, 1).flatten(1, 2) for x in codec.decode_blocks(packed, num_kv_heads, size, head_dim))
            self.keys[layer][:, start:end] = k
            self._write(k_cache, v_cache, start, k, v)
            self.num_blocked[layer] = end

    def _write(
        self, k_cache: torch.Tensor, v_cache: torch.Tensor, start: int, k: torch.Tensor, v: torch.Tensor
    ) -> None:
        """k (before RoPE), v: [kv_heads, n, D], to positions start .. start + n - 1."""
        positions = torch.arange(start, start + k.shape[1])
        cos, sin = self.rotary.cos_sin(positions, k_cache.dtype)  # [n, 1, D]
        k_cache[:, positions] = apply_rotary_ref(k.to(k_cache.dtype), cos.transpose(0, 1), sin.transpose(0, 1))
        v_cache[:, positions] = v.to(v_cache.dtype)
