"""KV over the wire: chunks round-trip exactly, stay under the NATS payload, compress where it pays, and every corrupt,
inconsistent, missing or stalled transfer is refused with a message that names the request and chunk."""

from __future__ import annotations

import dataclasses
import math
import random

import lz4.frame
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from shared.wire.kv_transfer.chunks import DTYPE_NAMES, KvAssembly, KvTransferError, chunk_layer_kv, num_kv_chunks
from shared.wire.kv_transfer.receiver import KvReceiver
from shared.wire.payload import CODEC_LZ4_SHUFFLE, CODEC_RAW, PayloadError, checksum, compress, decompress
from shared.wire.protocol import KvChunk, decode, encode

DTYPES = list(DTYPE_NAMES.values())


def smooth_kv(num_layers: int, num_kv_heads: int, num_tokens: int, head_dim: int, seed: int = 0) -> torch.Tensor:
    """Synthetic KV [num_layers, 2, heads, tokens, head_dim], fp32: smooth along tokens, a scale per channel.

    Calibrated so shuffle+LZ4 shrinks it about as much as SmolLM2-135M's real KV (fp32 ~0.93, bf16 ~0.85).
    """
    window = 16
    if num_tokens == 0:
        return torch.zeros(num_layers, 2, num_kv_heads, 0, head_dim)
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(num_layers, 2, num_kv_heads, head_dim, num_tokens + window - 1, generator=g)
    x = x.unfold(-1, window, 1).mean(-1) * math.sqrt(window)  # moving average along tokens, unit variance
    scale = torch.exp(0.5 * torch.randn(num_layers, 2, num_kv_heads, 1, head_dim, generator=g))
    return (x.transpose(3, 4) * scale).contiguous()


def all_chunks(request_id: str, kv: torch.Tensor, max_chunk_bytes: int) -> list[KvChunk]:
    """Every chunk of `kv` [layers, 2, heads, tokens, head_dim], streamed layer by layer as prefill does."""
    num_layers, _, heads, num_tokens, head_dim = kv.shape
    total = num_kv_chunks(num_layers, num_tokens, 2 * heads * head_dim * kv.element_size(), max_chunk_bytes)
    chunks: list[KvChunk] = []
    for layer in range(num_layers):
        chunks += chunk_layer_kv(request_id, layer, kv[layer], len(chunks), total, max_chunk_bytes)
    return chunks


def as_bytes(t: torch.Tensor) -> torch.Tensor:
    """The tensor's bytes, flat (bit-exact comparison, whatever the dtype)."""
    return t.contiguous().reshape(-1).view(torch.uint8)


def assembled(chunks: list[KvChunk], kv: torch.Tensor, dtype: torch.dtype | None = None) -> torch.Tensor:
    assembly = KvAssembly(chunks[0].request_id, chunks[0].total)
    for chunk in chunks:
        assembly.add(chunk)
    num_layers, _, heads, _, head_dim = kv.shape
    return assembly.assemble(num_layers, heads, head_dim, dtype or kv.dtype)


@pytest.mark.parametrize("dtype", DTYPES, ids=list(DTYPE_NAMES))
def test_round_trip_in_any_order_is_exact(dtype: torch.dtype) -> None:
    kv = smooth_kv(4, 3, 37, 64).to(dtype)
    kv[0] = (torch.arange(kv[0].numel()) % 5).view(kv[0].shape) - 1.5  # surely compresses, unlike the others
    kv[1] = torch.randn(kv[1].shape).to(dtype)
    chunks = all_chunks("r1", kv, max_chunk_bytes=3000)
    assert len(chunks) == num_kv_chunks(4, 37, 2 * 3 * 64 * kv.element_size(), 3000) > 4
    assert [c.seq for c in chunks] == list(range(len(chunks)))
    assert {c.codec for c in chunks} == {CODEC_RAW, CODEC_LZ4_SHUFFLE}
    assert all(c.raw_size <= 3000 for c in chunks)
    random.Random(1).shuffle(chunks)
    chunks = [decode(encode(c), KvChunk) for c in chunks]
    out = assembled(chunks, kv)
    assert out.dtype == dtype and out.shape == kv.shape
    assert torch.equal(as_bytes(out), as_bytes(kv))  # bit-exact, -0.0 and all


def test_assemble_converts_to_the_pool_dtype() -> None:
    kv = smooth_kv(2, 3, 20, 16)
    out = assembled(all_chunks("r1", kv, 1000), kv, torch.bfloat16)
    assert out.dtype == torch.bfloat16 and torch.equal(out, kv.to(torch.bfloat16))


@settings(max_examples=25, deadline=None)
@given(
    num_layers=st.integers(1, 3), heads=st.integers(1, 4), num_tokens=st.integers(0, 40), head_dim=st.integers(1, 16),
    dtype=st.sampled_from(DTYPES), max_chunk_bytes=st.integers(1, 4000), seed=st.integers(0, 2**16),
)
def test_round_trip_property(
    num_layers: int, heads: int, num_tokens: int, head_dim: int, dtype: torch.dtype, max_chunk_bytes: int, seed: int
) -> None:
    kv = smooth_kv(num_layers, heads, num_tokens, head_dim, seed).to(dtype)
    chunks = all_chunks("r1", kv, max_chunk_bytes)
    bytes_per_token = 2 * heads * head_dim * kv.element_size()
    assert len(chunks) == num_kv_chunks(num_layers, num_tokens, bytes_per_token, max_chunk_bytes)
    assert all(c.raw_size <= max(max_chunk_bytes, bytes_per_token) for c in chunks)
    if num_tokens == 0:
        assert chunks == []
        return
    random.Random(seed).shuffle(chunks)
    assert torch.equal(as_bytes(assembled(chunks, kv)), as_bytes(kv))


def test_messages_stay_well_under_the_nats_payload() -> None:
    max_chunk_bytes = 256 * 1024
    noise = torch.randint(-(2**31), 2**31, (2, 3, 2048, 64), dtype=torch.int32).view(torch.float32)
    for kv in (smooth_kv(1, 3, 2048, 64)[0], noise):
        chunks = chunk_layer_kv("r1", 0, kv, 0, 100, max_chunk_bytes)
        assert len(chunks) == num_kv_chunks(1, 2048, 2 * 3 * 64 * 4, max_chunk_bytes) == 13
        assert max(len(encode(c)) for c in chunks) < max_chunk_bytes + 1024 < 1024 * 1024
    one_token = chunk_layer_kv("r1", 0, torch.zeros(2, 3, 4, 64), 0, 4, 100)  # one token is 1536 bytes > 100
    assert [(c.token_start, c.token_end) for c in one_token] == [(0, 1), (1, 2), (2, 3), (3, 4)]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_shuffle_then_lz4_shrinks_real_looking_kv(dtype: torch.dtype) -> None:
    piece = smooth_kv(1, 3, 170, 64)[0].to(dtype)  # 256 KiB of fp32
    raw = as_bytes(piece).numpy().tobytes()
    codec, data = compress(raw, piece.element_size())
    assert codec == CODEC_LZ4_SHUFFLE
    assert len(data) < 0.95 * len(raw)
    assert len(lz4.frame.compress(raw)) > 0.97 * len(raw)  # without the shuffle LZ4 finds nothing
    assert decompress(codec, data, len(raw), piece.element_size()) == raw


def test_compress_falls_back_to_raw_when_it_does_not_pay() -> None:
    noise = random.Random(0).randbytes(64 * 1024)
    assert compress(noise, 4) == (CODEC_RAW, noise)
    assert compress(b"", 2) == (CODEC_RAW, b"")
    assert decompress(CODEC_RAW, noise, len(noise), 4) == noise
    with pytest.raises(ValueError, match="whole number"):
        compress(b"\x00" * 6, 4)


def test_decompress_refuses_bad_payloads() -> None:
    raw = bytes(4096)
    codec, data = compress(raw, 4)
    assert codec == CODEC_LZ4_SHUFFLE
    with pytest.raises(PayloadError, match="unknown payload codec"):
        decompress("zstd", data, len(raw), 4)
    with pytest.raises(PayloadError, match="expected 4000"):
        decompress(codec, data, 4000, 4)
    with pytest.raises(PayloadError, match="does not decode"):
        decompress(codec, data[:-3], len(raw), 4)
    with pytest.raises(PayloadError, match="expected 10"):
        decompress(CODEC_RAW, b"12345678", 10, 2)


def test_chunking_refuses_what_it_cannot_describe() -> None:
    with pytest.raises(ValueError, match="kv must be"):
        chunk_layer_kv("r1", 0, torch.zeros(3, 2, 4, 8), 0, 1, 1024)
    with pytest.raises(ValueError, match="wire name"):
        chunk_layer_kv("r1", 0, torch.zeros(2, 2, 4, 8, dtype=torch.float64), 0, 1, 1024)
    with pytest.raises(ValueError):
        num_kv_chunks(2, 10, 0, 1024)
    assert num_kv_chunks(30, 0, 1536, 1024) == 0
    assert num_kv_chunks(30, 2048, 1536, 256 * 1024) == 30 * 13


@pytest.fixture
def chunks() -> list[KvChunk]:
    return all_chunks("r1", smooth_kv(3, 3, 37, 64), max_chunk_bytes=11_000)  # 3 layers x 6 chunks


def test_a_corrupted_byte_fails_the_checksum_naming_the_chunk(chunks: list[KvChunk]) -> None:
    data = bytearray(chunks[3].data)
    data[len(data) // 2] ^= 0x01
    assembly = KvAssembly("r1", len(chunks))
    with pytest.raises(KvTransferError, match=r"request r1: chunk 3/18 failed its checksum"):
        assembly.add(dataclasses.replace(chunks[3], data=bytes(data)))
    garbage = b"not lz4 at all"  # a sender bug: the checksum matches, the payload does not decode
    (lz4_chunk,) = chunk_layer_kv("r1", 0, torch.zeros(2, 3, 7, 64), 4, 18, 11_000)
    assert lz4_chunk.codec == CODEC_LZ4_SHUFFLE
    with pytest.raises(KvTransferError, match=r"chunk 4/18: LZ4 payload does not decode"):
        assembly.add(dataclasses.replace(lz4_chunk, data=garbage, checksum=checksum(garbage)))
    assert assembly.num_received == 0


@pytest.mark.parametrize(
    ("change", "error"),
    [
        ({"request_id": "r2"}, "belongs to request r2"),
        ({"total": 17}, "says 17 chunks, earlier ones said 18"),
        ({"seq": 18}, "seq out of range"),
        ({"seq": -1}, "seq out of range"),
        ({"dtype": "fp8"}, "unknown dtype"),
        ({"layer_end": 0}, "empty or negative range"),
        ({"token_start": 5, "token_end": 5}, "empty or negative range"),
        ({"raw_size": 1000}, "does not fit its layer and token ranges"),
    ],
)
def test_inconsistent_chunks_are_refused(chunks: list[KvChunk], change: dict[str, object], error: str) -> None:
    with pytest.raises(KvTransferError, match=error):
        KvAssembly("r1", 18).add(dataclasses.replace(chunks[2], **change))  # type: ignore[arg-type]


def test_duplicates_identical_ignored_conflicting_refused(chunks: list[KvChunk]) -> None:
    assembly = KvAssembly("r1", len(chunks))
    assembly.add(chunks[0])
    wire_bytes = assembly.num_wire_bytes
    assembly.add(chunks[0])
    assert (assembly.num_received, assembly.num_wire_bytes) == (1, wire_bytes)
    with pytest.raises(KvTransferError, match="chunk 0/18 arrived twice with different contents"):
        assembly.add(dataclasses.replace(chunks[1], seq=0))
    bf16 = chunk_layer_kv("r1", 2, torch.zeros(2, 3, 37, 64, dtype=torch.bfloat16), 17, 18, 11_000)[0]
    with pytest.raises(KvTransferError, match="is bf16, earlier chunks were fp32"):
        assembly.add(bf16)


def test_missing_chunks_make_assemble_fail(chunks: list[KvChunk]) -> None:
    assembly = KvAssembly("r1", len(chunks))
    for chunk in chunks[:5] + chunks[6:]:
        assembly.add(chunk)
    assert not assembly.is_complete and assembly.missing() == [5]
    with pytest.raises(KvTransferError, match=r"request r1: 1 of 18 chunks missing \(5\)"):
        assembly.assemble(3, 3, 64, torch.float32)


def test_assemble_checks_layer_coverage_and_shape() -> None:
    kv = smooth_kv(1, 2, 10, 8)[0]  # [2, 2, 10, 8]
    twice = chunk_layer_kv("r1", 0, kv, 0, 2, 10_000) + chunk_layer_kv("r1", 0, kv, 1, 2, 10_000)
    gap = chunk_layer_kv("r1", 0, kv, 0, 2, 10_000) + chunk_layer_kv("r1", 2, kv, 1, 2, 10_000)
    cases = [
        (twice, 1, 2, "layer 0 has an overlap at token 10"),
        (gap, 3, 2, r"layer 1 covers tokens \[0, 0\), expected \[0, 10\)"),
        (gap, 2, 2, "holds layer 2, the model has 2"),
        (chunk_layer_kv("r1", 0, kv, 0, 1, 10_000), 1, 4, "not 4 kv heads x head dim 8 of fp32"),
    ]
    for pieces, num_layers, heads, error in cases:
        assembly = KvAssembly("r1", len(pieces))
        for chunk in pieces:
            assembly.add(chunk)
        with pytest.raises(KvTransferError, match=error):
            assembly.assemble(num_layers, heads, 8, torch.float32)


class FakeClock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_receiver_expires_a_stalled_stream_while_another_completes() -> None:
    clock = FakeClock()
    receiver = KvReceiver(deadline_s=10.0, clock=clock)
    kv = smooth_kv(2, 3, 37, 64)
    stalled, healthy = all_chunks("r1", kv, 11_000), all_chunks("r2", kv, 11_000)
    for chunk in stalled[:7] + healthy:
        assert receiver.add(chunk) is None
    assert "r1" in receiver and len(receiver) == 2
    assert receiver.is_complete("r2") and not receiver.is_complete("r1")
    clock.now += 9.9
    assert receiver.expire() == []
    clock.now += 0.1
    assert receiver.expire() == [
        ("r1", "KV transfer stalled: 5 of 12 chunks missing after 10.0 s"),
        ("r2", "KV transfer complete but not taken after 10.0 s"),
    ]
    assert len(receiver) == 0
    assert receiver.add(stalled[7]) is None and "r1" not in receiver  # a late chunk does not reopen it


def test_receiver_hands_over_a_complete_assembly() -> None:
    receiver = KvReceiver(deadline_s=10.0, clock=FakeClock())
    kv = smooth_kv(2, 3, 37, 64)
    chunks = all_chunks("r2", kv, 11_000)
    for chunk in chunks[:-1]:
        receiver.add(chunk)
    assert receiver.take_complete("r2") is None and "r2" in receiver
    receiver.add(chunks[-1])
    assembly = receiver.take_complete("r2")
    assert assembly is not None and "r2" not in receiver
    assert torch.equal(assembly.assemble(2, 3, 64, torch.float32), kv)
    assert receiver.take_complete("r2") is None and receiver.take_complete("r9") is None


def test_receiver_returns_errors_and_ignores_the_failed_requests_late_chunks() -> None:
    clock = FakeClock()
    receiver = KvReceiver(deadline_s=10.0, clock=clock)
    chunks = all_chunks("r1", smooth_kv(2, 3, 37, 64), 11_000)
    assert receiver.add(chunks[0]) is None
    error = receiver.add(dataclasses.replace(chunks[1], checksum=chunks[1].checksum ^ 1))
    assert isinstance(error, KvTransferError) and "chunk 1/12 failed its checksum" in str(error)
    assert "r1" not in receiver
    assert all(receiver.add(chunk) is None for chunk in chunks[1:])
    assert "r1" not in receiver and receiver.expire() == []
    clock.now += 10 * 10.0 + 1  # forgotten after ten deadlines
    receiver.expire()
    assert receiver.add(chunks[0]) is None and "r1" in receiver
    error = receiver.add(dataclasses.replace(chunks[0], request_id="r3", total=0))
    assert isinstance(error, KvTransferError) and "r3" not in receiver


def test_discard_drops_a_stream_and_its_late_chunks() -> None:
    clock = FakeClock()
    receiver = KvReceiver(deadline_s=10.0, clock=clock)
    chunks = all_chunks("r1", smooth_kv(2, 3, 37, 64), 11_000)
    receiver.add(chunks[0])
    receiver.discard("r1")
    receiver.discard("never-seen")
    assert "r1" not in receiver and len(receiver) == 0
    assert receiver.add(chunks[1]) is None and "r1" not in receiver
    clock.now += 11
    assert receiver.expire() == []


def test_kv_nobody_announced_gets_a_small_share_of_the_buffer() -> None:
    kv = smooth_kv(2, 3, 37, 64)  # 113,664 bytes in 12 chunks
    receiver = KvReceiver(deadline_s=10.0, max_bytes=16 * 40_000, clock=FakeClock())
    receiver.expect("announced")
    stranger = [receiver.add(chunk) for chunk in all_chunks("stranger", kv, 11_000)]
    error = next(e for e in stranger if e is not None)
    assert "did not place here" in str(error) and "stranger" not in receiver
    assert receiver.num_unannounced_bytes == 0  # what it held is given back
    assert all(receiver.add(chunk) is None for chunk in all_chunks("announced", kv, 11_000))
    assert receiver.is_complete("announced") and receiver.num_held_bytes == kv.numel() * 4
    late = all_chunks("late", kv, 11_000)  # chunks before their announcement (across a NATS cluster)
    assert receiver.add(late[0]) is None and receiver.num_unannounced_bytes > 0
    receiver.expect("late")
    assert receiver.num_unannounced_bytes == 0 and all(receiver.add(chunk) is None for chunk in late[1:])


def test_the_buffer_is_shared_by_every_stream_and_freed_as_they_close() -> None:
    kv = smooth_kv(2, 3, 37, 64)
    receiver = KvReceiver(deadline_s=10.0, max_bytes=150_000, clock=FakeClock())
    for request_id in ("a", "b", "c"):
        receiver.expect(request_id)
    assert all(receiver.add(chunk) is None for chunk in all_chunks("a", kv, 11_000))
    errors = [receiver.add(chunk) for chunk in all_chunks("b", kv, 11_000)]
    assert "KV buffer is full" in str(next(e for e in errors if e is not None)) and "b" not in receiver
    assert receiver.take_complete("a") is not None and receiver.num_held_bytes == 0
    assert all(receiver.add(chunk) is None for chunk in all_chunks("c", kv, 11_000))
    receiver.discard("c")
    assert receiver.num_held_bytes == receiver.num_unannounced_bytes == 0


def test_announcements_expire_and_are_bounded() -> None:
    clock = FakeClock()
    receiver = KvReceiver(deadline_s=10.0, expect_ttl_s=60.0, clock=clock)
    receiver.expect("r1")
    clock.now += 59
    receiver.expire()
    assert receiver.is_expected("r1")
    clock.now += 2
    receiver.expire()
    assert not receiver.is_expected("r1")
