"""KVQuant codes for FastGen's lanes: one fixed-size record per entry (one token of one KV head of one layer), so an
entry can move between lane slots, or be evicted, without touching any other entry.

A kvquant block codes each key channel over the block's tokens (`kvquant`), which lanes cannot keep: a lane's slot
holds whatever tokens its head kept, and they change every step. This format is KVQuant as the paper describes it
for keys (Hooper et al. 2024, section 3.4): per channel and before RoPE with the *calibrated* range of each
(layer, KV head, channel) (the calibration file's `key_center` and `key_scale`), plus dense-and-sparse outliers per
vector; values per token with their own range. Per entry, b bits and head dim D, with n = ceil(f x D) outliers per
vector (f the calibration's outlier fraction):

  V centre, V half-range   fp16 each
  K outlier values         fp16 [n], the exact pre-RoPE keys of the n channels farthest out of the calibrated range
  V outlier values         fp16 [n], the exact values farthest from the token's mean (in the token's std)
  K codes, V codes         b-bit codes of [D], packed by `bitpack`, into the layer's key and value codebooks
  K, V outlier channels    uint8 [n] each

SmolLM2 (D = 64, f = 1%: n = 1) at 4 bits: 74 bytes an entry, against 256 in fp16 (3.46x). The sequence's first
token (the attention sink) is coded like the others here; the engine's coded lane store keeps it whole beside the lanes.
Owns the record layout and its tensor encode/decode; the codebooks and ranges are the kvquant calibration's.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch

from kernels.bitpack import packed_num_bytes
from kernels.fp16_rounding import fp16_round_up
from kernels.kvquant_format import nearest_code, pack_rows, unpack_rows
from shared.kvcompress.kvquant import KvQuantCodec

_MAX_HEAD_DIM = 256  # outlier channels are uint8


class LaneCodec:
    """kvquant-b entry records for every layer, from the layers' block codecs (same calibration).

    Args:
        codecs: one `KvQuantCodec` per layer, all of one width.
    Raises:
        ValueError: no codecs, mixed widths, or a head dim beyond 256.
    """

    def __init__(self, codecs: Sequence[KvQuantCodec]) -> None:
        if not codecs or len({codec.bits for codec in codecs}) != 1:
            raise ValueError("a lane codec needs one kvquant codec per layer, all of the same width")
        self.bits = codecs[0].bits
        self.name = codecs[0].name
        self.head_dim = int(codecs[0].key_center.shape[1])
        if self.head_dim > _MAX_HEAD_DIM:
            raise ValueError(f"lane records index outlier channels in a byte: head dim {self.head_dim} > 256")
        self.num_outliers = math.ceil(codecs[0].outlier_fraction * self.head_dim - 1e-9)
        self.key_center = torch.stack([codec.key_center for codec in codecs])  # [layers, kv_heads, D]
        self.key_scale = torch.stack([codec.key_scale for codec in codecs])
        self.key_codebook = torch.stack([codec.key_codebook for codec in codecs])  # [layers, 2**bits]
        self.value_codebook = torch.stack([codec.value_codebook for codec in codecs])
        n, packed = self.num_outliers, packed_num_bytes(self.head_dim, self.bits)
        self._sections = [("v_range", 4), ("k_outlier_value", 2 * n), ("v_outlier_value", 2 * n), ("k_codes", packed),
                          ("v_codes", packed), ("k_outlier_index", n), ("v_outlier_index", n)]
        self.entry_bytes = sum(size for _, size in self._sections)

    def to(self, device: torch.device) -> LaneCodec:
        """The calibration tensors moved to `device` (in place); returns self."""
        for name in ("key_center", "key_scale", "key_codebook", "value_codebook"):
            setattr(self, name, getattr(self, name).to(device))
        return self

    def encode(self, layer: int, heads: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """Records of E entries of one layer.

        Args:
            heads: long [E], each entry's KV head; k: [E, D], keys before RoPE; v: [E, D].
        Returns:
            uint8 [E, entry_bytes].
        Raises:
            ValueError: non-finite keys or values, or magnitudes beyond fp16.
        """
        k, v = k.float(), v.float()
        if not bool(torch.isfinite(k).all() & torch.isfinite(v).all()):
            raise ValueError("cannot quantize: the keys or values hold NaN or inf")
        center, scale = self.key_center[layer, heads], self.key_scale[layer, heads]  # [E, D]
        k_norm = (k - center) / scale
        k_index = self._top(k_norm.abs())
        k_codes = nearest_code(k_norm, self.key_codebook[layer])
        v_rank = (v - v.mean(dim=1, keepdim=True)).abs() / v.std(dim=1, keepdim=True, correction=0).clamp_min(1e-6)
        v_index = self._top(v_rank)
        inlier = torch.ones_like(v, dtype=torch.bool).scatter(1, v_index, False)
        low = v.masked_fill(~inlier, math.inf).amin(dim=1)
        high = v.masked_fill(~inlier, -math.inf).amax(dim=1)
        v_center = ((high + low) / 2).to(torch.float16)
        half = torch.maximum(high - v_center.float(), v_center.float() - low)
        v_scale = fp16_round_up(half)  # the stored range still covers every inlier
        v_scale = torch.where(v_scale > 0, v_scale, torch.ones_like(v_scale))
        if not bool(torch.isfinite(v_center).all() & torch.isfinite(v_scale).all()):
            raise ValueError("cannot quantize: values beyond the fp16 range")
        v_codes = nearest_code((v - v_center.float()[:, None]) / v_scale.float()[:, None], self.value_codebook[layer])
        parts = [
            torch.stack([v_center, v_scale], dim=1), k.gather(1, k_index).to(torch.float16),
            v.gather(1, v_index).to(torch.float16), pack_rows(k_codes, self.bits), pack_rows(v_codes, self.bits),
            k_index.to(torch.uint8), v_index.to(torch.uint8),
        ]
        return torch.cat([_bytes(part) for part in parts], dim=1)

    def decode(self, layer: int, heads: torch.Tensor, records: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """K (before RoPE) and V, fp32 [E, D] each, of E records of one layer (heads: long [E])."""
        cut = dict(zip((name for name, _ in self._sections),
                       records.split([size for _, size in self._sections], dim=1), strict=True))
        fp16 = {name: cut[name].contiguous().view(torch.float16).float()
                for name in ("v_range", "k_outlier_value", "v_outlier_value")}
        count = records.shape[0]
        k_codes = unpack_rows(cut["k_codes"].contiguous(), self.head_dim, self.bits).long()
        v_codes = unpack_rows(cut["v_codes"].contiguous(), self.head_dim, self.bits).long()
        k = self.key_codebook[layer][k_codes] * self.key_scale[layer, heads] + self.key_center[layer, heads]
        v = self.value_codebook[layer][v_codes] * fp16["v_range"][:, 1:] + fp16["v_range"][:, :1]
        if self.num_outliers:
            k.scatter_(1, cut["k_outlier_index"].long(), fp16["k_outlier_value"])
            v.scatter_(1, cut["v_outlier_index"].long(), fp16["v_outlier_value"])
        return k.view(count, self.head_dim), v.view(count, self.head_dim)

    def _top(self, rank: torch.Tensor) -> torch.Tensor:
        """long [E, n]: each row's n highest-ranked channels."""
        return rank.topk(self.num_outliers, dim=1).indices


def _bytes(tensor: torch.Tensor) -> torch.Tensor:
    """[E, ...] -> uint8 [E, bytes] in native (little-endian) order."""
    return tensor.contiguous().view(tensor.shape[0], -1).view(torch.uint8)
