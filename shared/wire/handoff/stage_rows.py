"""Hidden states between the stages of a prefill pipeline group: the rows of one chunk of a prompt's tokens, cut into
`StageRows` parts (checksummed, byte-shuffled and LZ4-compressed as KV chunks are) and put back together, checked, by
the next stage (`shared.wire.parts`).

Rows that are meta tensors (the sim engine's: a shape and a dtype, no values) travel as one size-only part, whose
size the virtual cluster's network counts; a stage takes them back only when it models sizes too (`sizes_only`).

Owns the rows' bytes and their checks; what a stage computes from them is the engine's (`LLMEngine.add_stage_input`).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Hashable

import numpy as np
import torch

from shared.wire.handoff.prompt import DTYPE_NAMES, WIRE_NAMES
from shared.wire.parts import PartAssembly, PartError, cut_payload
from shared.wire.payload import Payload, SizeOnly, join
from shared.wire.protocol import StageRows


def rows_parts(
    request_id: str, token_start: int, rows: torch.Tensor, part_bytes: int, compress_payload: bool = True
) -> list[StageRows]:
    """The rows of tokens [token_start, token_start + len(rows)), [n, hidden_size], as parts of at most `part_bytes`
    raw bytes (whole rows where one fits), each coded on its own; a meta tensor as one size-only part.

    Raises:
        ValueError: rows that are not a non-empty [n, hidden_size] tensor of a wire dtype.
    """
    if rows.dim() != 2 or rows.shape[0] < 1 or rows.dtype not in WIRE_NAMES:
        raise ValueError(f"stage rows must be [num_tokens, hidden_size] of {', '.join(DTYPE_NAMES)}, got "
                         f"{tuple(rows.shape)} {rows.dtype}")
    num_tokens, hidden_size = rows.shape
    itemsize = rows.dtype.itemsize
    raw: Payload
    if rows.is_meta:
        raw = SizeOnly(num_tokens * hidden_size * itemsize)
    else:
        raw = rows.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()
    bodies = cut_payload(raw, part_bytes, itemsize, hidden_size * itemsize, compress_payload)
    return [
        StageRows(request_id, token_start, token_start + num_tokens, hidden_size, WIRE_NAMES[rows.dtype], seq,
                  len(bodies), **body.fields())
        for seq, body in enumerate(bodies)
    ]


class RowsAssembly(PartAssembly[StageRows]):
    """The parts of one chunk's rows as they arrive: every part must name the same request, tokens, width and dtype.

    Raises:
        PartError: `total` < 1.
    """

    def __init__(self, first: StageRows, clock: Callable[[], float] = time.monotonic) -> None:
        what = f"request {first.request_id}: rows of tokens [{first.token_start}, {first.token_end})"
        super().__init__(what, first.total, _rows_agreed, _rows_width, clock=clock)

    def add(self, part: StageRows) -> bytes | None:  # type: ignore[override]
        """See `PartAssembly.add`; also raises PartError for an unknown dtype."""
        if part.dtype not in DTYPE_NAMES:
            raise PartError(f"{self.what} part {part.seq}/{part.total}: unknown dtype {part.dtype!r}")
        kept = super().add(part)
        return kept if kept is None or isinstance(kept, bytes) else None

    def rows(self, hidden_size: int, sizes_only: bool = False) -> tuple[int, torch.Tensor]:
        """(the first token, the rows [n, hidden_size]) of a complete assembly, for a model of `hidden_size`; size-only
        parts make a meta tensor, for a receiver that models `sizes_only` (the sim engine) and no other.

        Raises:
            PartError: parts missing, another width, bytes that are not the range's rows, or sizes without values for
                a receiver that computes.
        """
        self.check_complete()
        pieces = self.pieces()
        first = pieces[0][0]
        if first.hidden_size != hidden_size:
            raise PartError(f"{self.what}: rows of {first.hidden_size} values, this model's are {hidden_size}")
        raw = join([piece for _, piece in pieces])
        dtype = DTYPE_NAMES[first.dtype]
        num_tokens = first.token_end - first.token_start
        if len(raw) != num_tokens * hidden_size * dtype.itemsize:
            raise PartError(f"{self.what}: {len(raw)} bytes, not {num_tokens} rows of {hidden_size} {first.dtype}")
        if isinstance(raw, SizeOnly):
            if not sizes_only:
                raise PartError(f"{self.what}: sizes without values, for a stage that computes them")
            return first.token_start, torch.empty(num_tokens, hidden_size, dtype=dtype, device="meta")
        values = torch.from_numpy(np.frombuffer(raw, dtype=np.uint8).copy())
        return first.token_start, values.view(dtype).view(num_tokens, hidden_size)


def _rows_agreed(part: StageRows) -> dict[str, Hashable]:
    return {"request_id": part.request_id, "token_start": part.token_start, "token_end": part.token_end,
            "hidden_size": part.hidden_size, "dtype": part.dtype}


def _rows_width(part: StageRows) -> int:
    return DTYPE_NAMES[part.dtype].itemsize
