"""The packed kvquant pool one layer's kernels read and write, and the per-layer parameters they take.

Owns `KvQuantLayout` (where each section of a pool row lies) and `KvQuantLayerParams` (calibration, the key grids and
codebook midpoints derived from it, and RoPE tables on the kernels' device). The byte format itself is
`kernels.kvquant_format`'s: a pool row is that module's block layout without the sink section, the sink being kept
apart by the engine.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property

import torch

from kernels.kvquant_format import KvQuantTables, key_grid, section_sizes


@dataclass(frozen=True)
class KvQuantLayout:
    """Where each section of one pool row (one layer of one full block, uint8 [bytes_per_block]) starts, in bytes.

    The sections and their sizes are `kernels.kvquant_format.section_sizes`' (the codec's byte layout without the
    sink): K codes, V codes, K low and K high (uint8 [H, D]: each key channel's block range as two points of its
    grid), V centre and V half-range (fp16 [T]), V outlier index (uint16 [H, n]) and corrections (fp16 [H, n]).
    Keys have no outliers. Every fp16/uint16 section starts on an even byte, so `pool.view(torch.float16)` and
    `pool.view(torch.int16)` address them at offset // 2.
    """

    bits: int
    block_size: int  # T
    kv_heads: int  # H
    head_dim: int  # D
    num_outliers: int  # n value outliers per KV head in a block

    @cached_property
    def offsets(self) -> dict[str, int]:
        """Section name -> first byte, and "end" -> the row's length."""
        sizes = section_sizes(self.bits, self.kv_heads, self.block_size, self.head_dim, self.num_outliers)
        offsets, at = {}, 0
        for name, size in sizes:
            offsets[name], at = at, at + size
        return {**offsets, "end": at}

    @property
    def code_bytes(self) -> int:
        return self.offsets["v_codes"]

    @property
    def k_codes_offset(self) -> int:
        return self.offsets["k_codes"]

    @property
    def v_codes_offset(self) -> int:
        return self.offsets["v_codes"]

    @property
    def k_low_offset(self) -> int:
        return self.offsets["k_low"]

    @property
    def k_high_offset(self) -> int:
        return self.offsets["k_high"]

    @property
    def v_center_offset(self) -> int:
        return self.offsets["v_center"]

    @property
    def v_scale_offset(self) -> int:
        return self.offsets["v_scale"]

    @property
    def v_index_offset(self) -> int:
        return self.offsets["v_outlier_index"]

    @property
    def v_corr_offset(self) -> int:
        return self.offsets["v_outlier_value"]

    @property
    def bytes_per_block(self) -> int:
        return self.offsets["end"]


def check_kernel_layout(layout: KvQuantLayout) -> None:
    """Raises ValueError unless the Triton kernels handle the layout: power-of-two head_dim >= 32 and block_size
    >= 16 (whole tl.dot tiles, RoPE halves of whole code groups)."""
    dim, tokens = layout.head_dim, layout.block_size
    if dim < 32 or dim & (dim - 1):
        raise ValueError(f"kvquant kernels need a power-of-two head_dim >= 32, got {dim}")
    if tokens < 16 or tokens & (tokens - 1):
        raise ValueError(f"kvquant kernels need a power-of-two block_size >= 16, got {tokens}")


def pair_codebook(codebook: torch.Tensor) -> torch.Tensor:
    """fp32 [n * n, 2] from a codebook [n]: entry c1 * n + c0 is (codebook[c0], codebook[c1]), two adjacent codes'
    values in one 8-byte load (the decode kernel's lookups)."""
    n = codebook.shape[0]
    return torch.stack((codebook.repeat(n), codebook.repeat_interleave(n)), 1).float().contiguous()


@dataclass(frozen=True)
class KvQuantLayerParams:
    """What the kvquant kernels take for one layer, on their device.

    key_center, key_scale: fp32 [H, D], the calibration; key_grid_base, key_grid_step: fp32 [H, D], each key
    channel's grid (point q is base + q * step; `kernels.kvquant_format.key_grid`, the codec's own arithmetic), on
    which a block's K low and K high bytes place its range; key_codebook, value_codebook: fp32 [2**b] ascending, in
    units of a range ([-1, 1]), and their midpoints fp32 [2**b - 1] (a code is the number of midpoints below the
    normalised element); cos, sin: fp32 [max_position, D / 2], the model's RoPE tables (`RotaryEmbedding.cos`/`.sin`).
    """

    layout: KvQuantLayout
    outlier_fraction: float
    key_center: torch.Tensor
    key_scale: torch.Tensor
    key_codebook: torch.Tensor
    value_codebook: torch.Tensor
    key_midpoints: torch.Tensor
    value_midpoints: torch.Tensor
    key_grid_base: torch.Tensor
    key_grid_step: torch.Tensor
    cos: torch.Tensor
    sin: torch.Tensor

    @classmethod
    def build(
        cls, layout: KvQuantLayout, outlier_fraction: float, calibration: tuple[torch.Tensor, ...],
        cos: torch.Tensor, sin: torch.Tensor,
    ) -> KvQuantLayerParams:
        """From (key_center, key_scale, key_codebook, value_codebook) on the device of `cos`.

        Raises:
            ValueError: tensors whose shapes do not fit the layout.
        """
        device = cos.device
        center, scale, key_cb, value_cb = (t.detach().float().to(device) for t in calibration)
        heads, dim, codes = layout.kv_heads, layout.head_dim, 1 << layout.bits
        if center.shape != (heads, dim) or scale.shape != (heads, dim):
            raise ValueError(f"key centre and scale must be [{heads}, {dim}], got {tuple(center.shape)}")
        if key_cb.shape != (codes,) or value_cb.shape != (codes,):
            raise ValueError(f"{layout.bits}-bit codebooks need {codes} entries")
        if cos.dim() != 2 or cos.shape[1] * 2 != dim or sin.shape != cos.shape:
            raise ValueError(f"cos and sin must be [max_position, {dim // 2}], got {tuple(cos.shape)}")
        base, step = key_grid(center, scale)
        return cls(
            layout, outlier_fraction, center, scale, key_cb, value_cb, (key_cb[1:] + key_cb[:-1]) / 2,
            (value_cb[1:] + value_cb[:-1]) / 2, base.contiguous(), step.contiguous(), cos.float().contiguous(),
            sin.float().contiguous(),
        )

    @classmethod
    def from_tables(
        cls, tables: KvQuantTables, block_size: int, cos: torch.Tensor, sin: torch.Tensor
    ) -> KvQuantLayerParams:
        """One layer's params from its calibration (`KvQuantCodec.tables`), for pool blocks of `block_size` tokens.

        Raises:
            ValueError: cos/sin do not fit the tables' head dim.
        """
        heads, dim = tables.key_center.shape
        layout = KvQuantLayout(tables.bits, block_size, heads, dim, tables.outliers_per_head(block_size, dim))
        calibration = (tables.key_center, tables.key_scale, tables.key_codebook, tables.value_codebook)
        return cls.build(layout, tables.outlier_fraction, calibration, cos, sin)

    @cached_property
    def key_pair_codebook(self) -> torch.Tensor:
        """`pair_codebook(key_codebook)`, built once."""
        return pair_codebook(self.key_codebook)

    @cached_property
    def value_pair_codebook(self) -> torch.Tensor:
        """`pair_codebook(value_codebook)`, built once."""
        return pair_codebook(self.value_codebook)

    @cached_property
    def tables(self) -> KvQuantTables:
        """The calibration these params describe, on their device (what the references compute with)."""
        return KvQuantTables(
            self.layout.bits, self.outlier_fraction, self.key_center, self.key_scale, self.key_codebook,
            self.value_codebook,
        )
