"""FastGen's coded lane store over a real kvquant codec pool: slots cut from block rows never overlap and stay in
their row; an entry reads back as its lane record decodes (keys rotated at the entry's position), or whole from the
sequence's ring while it is among the newest block_size positions; a move carries the record."""

from __future__ import annotations

import dataclasses

import torch

from kernels.layer_ops import apply_rotary_ref
from shared.engine.kv.codec.pool import CodecKvPool
from shared.engine.kv.fastgen.lane_store import CodedLaneStore
from shared.fastgen.lane_codec import LaneCodec
from shared.model.llama import RotaryEmbedding
from tests.unit.test_codec_pool import BLOCK, DIM, KV_HEADS, kvquant_codec, tiny_config

LAYERS, BLOCKS = 2, 5


def _store() -> CodedLaneStore:
    config = dataclasses.replace(tiny_config(), num_layers=LAYERS)
    pool = CodecKvPool(config, [kvquant_codec()] * LAYERS, BLOCKS, BLOCK, 2, torch.float32, torch.device("cpu"))
    return CodedLaneStore(pool, RotaryEmbedding(DIM, config.max_position, config.rope_theta))


def test_slots_are_disjoint_runs_of_records_inside_one_block_row() -> None:
    store = _store()
    row_bytes = store.pool.block_bytes
    runs = sorted((store.slot_base(s), store.slot_base(s) + store.slot_entries * store.entry_bytes)
                  for s in range(BLOCKS * store.slots_per_block))
    assert store.slots_per_block == LAYERS * store.slots_per_row and store.slot_entries >= 1
    for (_, end), (next_start, _) in zip(runs, runs[1:], strict=False):
        assert end <= next_start  # no overlap
    assert all(start // row_bytes == (end - 1) // row_bytes for start, end in runs)  # each inside one row
    assert runs[-1][1] <= store.pool.packed.numel()


def test_entries_read_as_their_records_decode_or_whole_from_the_ring() -> None:
    store, generator = _store(), torch.Generator().manual_seed(0)
    count = store.slot_entries
    heads = torch.arange(count) % KV_HEADS
    positions = torch.arange(10, 10 + count)
    addresses = store.slot_base(3) + torch.arange(count) * store.entry_stride
    k, v = torch.randn(count, DIM, generator=generator) * 2, torch.randn(count, DIM, generator=generator)
    store.write(1, heads, addresses, k, v)
    codec = LaneCodec([kvquant_codec()] * LAYERS)
    k_coded, v_coded = codec.decode(1, heads, codec.encode(1, heads, k, v))
    cos, sin = store.rotary.cos_sin(positions, torch.float32)
    read_k, read_v = store.read(1, heads, addresses, positions)
    torch.testing.assert_close(read_k, apply_rotary_ref(k_coded[:, None], cos, sin)[:, 0])
    torch.testing.assert_close(read_v, v_coded)
    assert not torch.allclose(read_v, v, atol=1e-3)  # a record is lossy

    ring = store.open_ring("seq")
    assert ring is not None
    rings = torch.full((count,), ring)
    k_heads, v_heads = (x[:, None].expand(count, KV_HEADS, DIM) for x in (k, v))  # every head the same here
    store.write_ring(1, rings, positions, k_heads, v_heads)
    recent = positions >= positions[-1] - 1  # the last two entries count as recent
    read_k, read_v = store.read(1, heads, addresses, positions, (rings, recent))
    torch.testing.assert_close(read_v[recent], v[recent])  # whole from the ring
    torch.testing.assert_close(read_k[recent], apply_rotary_ref(k[:, None], cos, sin)[:, 0][recent])
    torch.testing.assert_close(read_v[~recent], v_coded[~recent])


def test_a_move_carries_the_record() -> None:
    store, generator = _store(), torch.Generator().manual_seed(1)
    heads, positions = torch.tensor([0, 1]), torch.tensor([5, 6])
    sources = store.slot_base(0) + torch.arange(2) * store.entry_stride
    targets = store.slot_base(store.slots_per_block + 1) + torch.arange(2) * store.entry_stride  # another block
    store.write(0, heads, sources, torch.randn(2, DIM, generator=generator), torch.randn(2, DIM, generator=generator))
    before = store.read(0, heads, sources, positions)
    store.move(sources, targets)
    after = store.read(0, heads, targets, positions)
    torch.testing.assert_close(after[0], before[0])
    torch.testing.assert_close(after[1], before[1])
