"""Bit-packing of KV codes: every width round-trips over odd lengths, sizes are exact, the bit layout is the documented
one, and unsupported widths, out-of-range codes and wrong-length buffers are refused."""

from __future__ import annotations

import pytest
import torch

from kernels.bitpack import SUPPORTED_BITS, pack_codes, packed_num_bytes, unpack_codes


def random_codes(num_codes: int, bits: int, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 1 << bits, (num_codes,), generator=g, dtype=torch.uint8)


@pytest.mark.parametrize("bits", SUPPORTED_BITS)
@pytest.mark.parametrize("num_codes", [1, 7, 9, 1003])
def test_round_trip(bits: int, num_codes: int) -> None:
    codes = random_codes(num_codes, bits, seed=num_codes)
    packed = pack_codes(codes, bits)
    assert packed.dtype == torch.uint8
    assert packed.numel() == packed_num_bytes(num_codes, bits)
    assert torch.equal(unpack_codes(packed, num_codes, bits), codes)


@pytest.mark.parametrize("bits", SUPPORTED_BITS)
def test_round_trip_of_extreme_codes(bits: int) -> None:
    codes = torch.tensor([0, (1 << bits) - 1] * 7, dtype=torch.uint8)
    assert torch.equal(unpack_codes(pack_codes(codes, bits), codes.numel(), bits), codes)


def test_packs_any_shape_row_major() -> None:
    codes = random_codes(3 * 5 * 7, 3).view(3, 5, 7)
    assert torch.equal(unpack_codes(pack_codes(codes, 3), codes.numel(), 3), codes.reshape(-1))


@pytest.mark.parametrize(
    ("num_codes", "bits", "expected"),
    [
        (0, 2, 0), (1, 2, 1), (4, 2, 1), (5, 2, 2),
        (1, 3, 3), (8, 3, 3), (9, 3, 6), (16, 3, 6), (17, 3, 9),
        (1, 4, 1), (2, 4, 1), (3, 4, 2),
        (7, 8, 7),
        (64 * 64, 2, 1024), (64 * 64, 3, 1536), (64 * 64, 4, 2048),
    ],
)
def test_packed_sizes(num_codes: int, bits: int, expected: int) -> None:
    assert packed_num_bytes(num_codes, bits) == expected
    assert pack_codes(torch.zeros(num_codes, dtype=torch.uint8), bits).numel() == expected


def test_two_bit_layout_puts_the_first_code_in_the_low_bits() -> None:
    packed = pack_codes(torch.tensor([1, 2, 3, 0, 3], dtype=torch.uint8), 2)
    assert packed.tolist() == [0b00_11_10_01, 0b00_00_00_11]


def test_four_bit_layout() -> None:
    packed = pack_codes(torch.tensor([0x3, 0xA, 0xF], dtype=torch.uint8), 4)
    assert packed.tolist() == [0xA3, 0x0F]


def test_three_bit_layout_is_a_little_endian_24_bit_word_per_8_codes() -> None:
    codes = [5, 0, 7, 1, 2, 6, 3, 4, 7]
    word = sum(code << (3 * i) for i, code in enumerate(codes[:8]))
    expected = list(word.to_bytes(3, "little")) + [7, 0, 0]
    assert pack_codes(torch.tensor(codes, dtype=torch.uint8), 3).tolist() == expected


@pytest.mark.parametrize("bits", [0, 1, 5, 6, 7, 16])
def test_unsupported_widths_are_refused(bits: int) -> None:
    codes = torch.zeros(4, dtype=torch.uint8)
    with pytest.raises(ValueError, match="unsupported code width"):
        pack_codes(codes, bits)
    with pytest.raises(ValueError, match="unsupported code width"):
        unpack_codes(codes, 4, bits)
    with pytest.raises(ValueError, match="unsupported code width"):
        packed_num_bytes(4, bits)


@pytest.mark.parametrize("bits", [2, 3, 4])
def test_out_of_range_codes_are_refused(bits: int) -> None:
    codes = torch.zeros(9, dtype=torch.uint8)
    codes[6] = 1 << bits
    with pytest.raises(ValueError, match=f"does not fit in {bits} bits"):
        pack_codes(codes, bits)


def test_codes_must_be_uint8() -> None:
    with pytest.raises(ValueError, match="uint8"):
        pack_codes(torch.zeros(4, dtype=torch.int32), 4)


@pytest.mark.parametrize("bits", SUPPORTED_BITS)
def test_wrong_length_buffers_are_refused(bits: int) -> None:
    packed = pack_codes(random_codes(9, bits), bits)
    with pytest.raises(ValueError, match="take"):
        unpack_codes(packed[:-1], 9, bits)
    with pytest.raises(ValueError, match="take"):
        unpack_codes(torch.cat([packed, packed[:1]]), 9, bits)


def test_negative_count_is_refused() -> None:
    with pytest.raises(ValueError, match=">= 0"):
        packed_num_bytes(-1, 4)
