"""Hidden states between pipeline stages on the wire: one chunk's rows in parts of whole rows, each coded and
checksummed on its own, that reassemble bit for bit in any order; a corrupt, conflicting, missing or misshapen part
is refused with a clear error, and the messages' own invariants hold whoever sent them."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from services.virtual.nats import wire_bytes
from shared.wire.handoff.stage_rows import RowsAssembly, rows_parts
from shared.wire.parts import PartError
from shared.wire.protocol import PrefillTask, ProtocolError, SamplingParams, StageRows, StageTask, decode, encode

HIDDEN = 96


def _rows(num_tokens: int = 40, dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    return (torch.randn(num_tokens, HIDDEN, generator=torch.Generator().manual_seed(1)) * 3).to(dtype)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("compress", [True, False])
def test_rows_reassemble_exactly_in_any_order(dtype: torch.dtype, compress: bool) -> None:
    rows = _rows(dtype=dtype)
    row_bytes = HIDDEN * dtype.itemsize
    parts = rows_parts("r", 128, rows, part_bytes=7 * row_bytes + 5, compress_payload=compress)
    assert len(parts) == 6 and all(p.raw_size % row_bytes == 0 and p.raw_size <= 7 * row_bytes for p in parts)
    assert compress or all(p.codec == "raw" for p in parts)  # compressed only where that pays
    assembly = RowsAssembly(parts[-1])
    for part in reversed(parts):
        assembly.add(decode(encode(part), StageRows))  # through the wire's own encoding
    start, back = assembly.rows(HIDDEN)
    assert start == 128 and back.dtype == dtype and torch.equal(back, rows)


def test_bad_parts_are_refused() -> None:
    parts = rows_parts("r", 0, _rows(), part_bytes=HIDDEN * 2 * 10)
    assembly = RowsAssembly(parts[0])
    with pytest.raises(PartError, match="checksum"):
        assembly.add(dataclasses.replace(parts[0], data=parts[0].data[:-1] + bytes([parts[0].data[-1] ^ 1])))
    assembly.add(parts[0])
    with pytest.raises(PartError, match="has token_end 41, the earlier"):
        assembly.add(dataclasses.replace(parts[1], token_end=41))
    with pytest.raises(PartError, match="unknown dtype"):
        assembly.add(dataclasses.replace(parts[1], dtype="int8"))
    with pytest.raises(PartError, match="missing"):
        assembly.rows(HIDDEN)
    for part in parts[1:]:
        assembly.add(part)
    with pytest.raises(PartError, match="this model's are 64"):
        assembly.rows(64)
    short = rows_parts("r", 0, _rows(), part_bytes=1 << 20)
    liar = RowsAssembly(dataclasses.replace(short[0], token_end=41))
    liar.add(dataclasses.replace(short[0], token_end=41))
    with pytest.raises(PartError, match="not 41 rows"):
        liar.rows(HIDDEN)
    with pytest.raises(ValueError, match="num_tokens, hidden_size"):
        rows_parts("r", 0, torch.zeros(HIDDEN), 1024)
    with pytest.raises(ValueError, match="num_tokens, hidden_size"):
        rows_parts("r", 0, torch.zeros(3, HIDDEN, dtype=torch.int32), 1024)


def test_stage_messages_are_checked_on_decode() -> None:
    task = PrefillTask("r-1", [5, 6, 7, 8], [], SamplingParams(), "decode-0", 1.0)
    assert decode(encode(StageTask(task, 2, 30)), StageTask) == StageTask(task, 2, 30)
    for bad in (StageTask(task, 4, 30), StageTask(task, -1, 30), StageTask(task, 0, 0),
                StageTask(dataclasses.replace(task, request_id="bad id"), 0, 30)):
        with pytest.raises(ProtocolError):
            decode(encode(bad), StageTask)
    (part,) = rows_parts("r-1", 0, _rows(4), 1 << 20)
    for fields in ({"token_end": 0}, {"hidden_size": 0}, {"seq": 1}, {"raw_size": -1}, {"checksum": -1}):
        with pytest.raises(ProtocolError):
            decode(encode(dataclasses.replace(part, **fields)), StageRows)


def test_meta_rows_travel_as_their_size_and_only_a_sizes_receiver_takes_them() -> None:
    rows = torch.empty(40, HIDDEN, dtype=torch.bfloat16, device="meta")  # the sim engine's: a shape, no values
    (part,) = rows_parts("r", 64, rows, part_bytes=HIDDEN * 2)
    assert part.codec == "size-only" and part.raw_size == 40 * HIDDEN * 2 and part.data == b""
    assert wire_bytes(encode(part)) == len(encode(part)) + 40 * HIDDEN * 2  # what the virtual network carries
    assembly = RowsAssembly(part)
    assembly.add(decode(encode(part), StageRows))
    start, back = assembly.rows(HIDDEN, sizes_only=True)
    assert start == 64 and back.is_meta and back.shape == (40, HIDDEN) and back.dtype == torch.bfloat16
    with pytest.raises(PartError, match="sizes without values, for a stage that computes them"):
        assembly.rows(HIDDEN)
    with pytest.raises(PartError, match="not 40 rows"):
        lying = RowsAssembly(part)
        lying.add(dataclasses.replace(part, raw_size=part.raw_size - 2))
        lying.rows(HIDDEN, sizes_only=True)
