"""Bit-packing of small unsigned integer codes (2, 3, 4 or 8 bits) into bytes, and back.

Owns the packed byte layout that codecs, and later the kernels, share; it knows nothing of scales or KV shapes.
"""

from __future__ import annotations

import math

import torch

SUPPORTED_BITS = (2, 3, 4, 8)


def _group(bits: int) -> tuple[int, int]:
    """(codes, bytes) of the smallest run of codes that ends on a byte boundary: 8 codes in 3 bytes for 3 bits."""
    if bits not in SUPPORTED_BITS:
        raise ValueError(f"unsupported code width {bits} bits; supported: {SUPPORTED_BITS}")
    group_bits = math.lcm(bits, 8)
    return group_bits // bits, group_bits // 8


def packed_num_bytes(num_codes: int, bits: int) -> int:
    """Bytes that `pack_codes` makes of `num_codes` codes of `bits` bits (the tail group is padded with zeros).

    Raises:
        ValueError: an unsupported width or a negative count.
    """
    group_codes, group_bytes = _group(bits)
    if num_codes < 0:
        raise ValueError(f"num_codes must be >= 0, got {num_codes}")
    return -(-num_codes // group_codes) * group_bytes


def pack_codes(codes: torch.Tensor, bits: int) -> torch.Tensor:
    """Pack codes (flattened in row-major order) into bytes.

    Layout: codes are grouped `lcm(bits, 8) / bits` at a time (4 for 2 bits, 2 for 4, 8 for 3, 1 for 8); within a
    group code i occupies bits [i * bits, (i + 1) * bits) of a little-endian integer of `lcm(bits, 8) / 8` bytes.

    Args:
        codes: uint8, any shape, every value < 2**bits.
        bits: one of `SUPPORTED_BITS`.
    Returns:
        uint8 [packed_num_bytes(codes.numel(), bits)] on the device of `codes`.
    Raises:
        ValueError: an unsupported width, a dtype other than uint8, or a code out of range.
    """
    group_codes, group_bytes = _group(bits)
    if codes.dtype != torch.uint8:
        raise ValueError(f"codes must be uint8, got {codes.dtype}")
    flat = codes.reshape(-1)
    if bits < 8 and flat.numel() and int(flat.max()) >= 1 << bits:
        raise ValueError(f"code {int(flat.max())} does not fit in {bits} bits")
    if bits == 8:
        return flat.clone()
    num_groups = -(-flat.numel() // group_codes)
    padded = flat.new_zeros(num_groups * group_codes)
    padded[: flat.numel()] = flat
    shifts = torch.arange(group_codes, dtype=torch.int32, device=codes.device) * bits
    # [num_groups]: each group's codes as one integer of group_bytes * 8 bits (at most 24, so int32 holds it)
    words = (padded.view(num_groups, group_codes).to(torch.int32) << shifts).sum(dim=1, dtype=torch.int32)
    byte_shifts = torch.arange(group_bytes, dtype=torch.int32, device=codes.device) * 8
    packed = (words[:, None] >> byte_shifts) & 0xFF  # [num_groups, group_bytes]
    return packed.to(torch.uint8).reshape(-1)


def unpack_codes(packed: torch.Tensor, num_codes: int, bits: int) -> torch.Tensor:
    """The inverse of `pack_codes`: the first `num_codes` codes as uint8 [num_codes].

    Args:
        packed: uint8 [packed_num_bytes(num_codes, bits)].
    Raises:
        ValueError: an unsupported width, a dtype other than uint8, or a length that does not match `num_codes`.
    """
    group_codes, group_bytes = _group(bits)
    expected = packed_num_bytes(num_codes, bits)
    if packed.dtype != torch.uint8:
        raise ValueError(f"packed codes must be uint8, got {packed.dtype}")
    if packed.numel() != expected:
        raise ValueError(f"{num_codes} codes of {bits} bits take {expected} bytes, got {packed.numel()}")
    if bits == 8:
        return packed.reshape(-1).clone()
    byte_shifts = torch.arange(group_bytes, dtype=torch.int32, device=packed.device) * 8
    grouped = packed.reshape(-1, group_bytes).to(torch.int32)  # [num_groups, group_bytes]
    words = (grouped << byte_shifts).sum(dim=1, dtype=torch.int32)  # [num_groups]
    shifts = torch.arange(group_codes, dtype=torch.int32, device=packed.device) * bits
    codes = (words[:, None] >> shifts) & ((1 << bits) - 1)  # [num_groups, group_codes]
    return codes.reshape(-1)[:num_codes].to(torch.uint8)
