"""The FastGen harness's codec variants (`tsukimi eval fastgen --kv-codec`): every K/V entry a decode variant stores
goes through `LaneCodec` records and back, as the engine's lanes will hold them: keys quantized before RoPE and
rotated after, the sequence's first token (the attention sink, position 0) kept exact.

Owns building the lane codec from a codec name and calibration, and the round trip; the record format is
`lane_codec`'s, which variants use it `evaluate`'s.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from shared.fastgen.lane_codec import LaneCodec
from shared.kvcompress.bundled import resolve_calibration
from shared.kvcompress.calibration import load_calibration
from shared.kvcompress.kvquant import KvQuantCodec
from shared.kvcompress.registry import CALIBRATED_CODECS, layer_codecs
from shared.model.config import LlamaConfig
from shared.model.llama import RotaryEmbedding, apply_rotary

LANE_CODECS = CALIBRATED_CODECS  # kvquant-4, -3, -2: the codecs lane records exist for


def build_lane_codec(name: str, config: LlamaConfig, kv_calib: str | Path | None = None) -> LaneCodec:
    """The lane codec `name` (a kvquant codec) for a model of `config`'s shape.

    Args:
        kv_calib: the calibration file (default: the one shipped for the default model).
    Raises:
        ValueError: a codec without lane records (`KvCalibrationError`, a ValueError: no calibration, or one of
            another shape or width).
    """
    if name not in LANE_CODECS:
        raise ValueError(f"FastGen's lanes code only {', '.join(LANE_CODECS)}, not {name!r}")
    path = resolve_calibration(name, kv_calib)
    assert path is not None  # kvquant codecs always resolve a file or raise
    codecs = layer_codecs(name, config.num_layers, config.num_kv_heads, config.head_dim, load_calibration(path))
    return LaneCodec([codec for codec in codecs if isinstance(codec, KvQuantCodec)])


class LaneRoundTrip:
    """K/V of some tokens of one layer, as they come back from lane records.

    Args:
        codec: the records' format.
        rotary: the model's RoPE (keys are coded before it).
    """

    def __init__(self, codec: LaneCodec, rotary: RotaryEmbedding) -> None:
        self.codec, self.rotary = codec, rotary

    def __call__(
        self, layer: int, k_pre_rope: torch.Tensor, v: torch.Tensor, positions: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """k_pre_rope, v: [n, num_kv_heads, head_dim]; positions: long [n]. Returns the rotated keys and the values,
        [n, num_kv_heads, head_dim] each in v's dtype; position 0's exact.

        Raises:
            ValueError: non-finite keys or values.
        """
        num_tokens, num_kv_heads, head_dim = v.shape
        heads = torch.arange(num_kv_heads).repeat(num_tokens)  # [n x kv_heads], entries token-major
        records = self.codec.encode(layer, heads, k_pre_rope.reshape(-1, head_dim), v.reshape(-1, head_dim))
        k_coded, v_coded = self.codec.decode(layer, heads, records)
        k_coded = k_coded.view(num_tokens, num_kv_heads, head_dim).to(v.dtype)
        v_coded = v_coded.view(num_tokens, num_kv_heads, head_dim).to(v.dtype)
        sink = (positions == 0)[:, None, None]
        k_coded = torch.where(sink, k_pre_rope, k_coded)
        v_coded = torch.where(sink, v, v_coded)
        cos, sin = self.rotary.cos_sin(positions, v.dtype)
        return apply_rotary(k_coded, cos, sin), v_coded


@dataclass(frozen=True)
class CodedVariants:
    """The decode variants (indices into a `DecodeAttention`'s rules) whose K/V go through `round_trip`."""

    round_trip: LaneRoundTrip
    indices: tuple[int, ...]


def entry_figures(codec: LaneCodec) -> dict[str, int | str]:
    """The codec's name and its record size against an fp16 entry (a key and a value of head_dim halves each)."""
    return {"name": codec.name, "entry_bytes": codec.entry_bytes, "fp16_entry_bytes": 2 * 2 * codec.head_dim}
