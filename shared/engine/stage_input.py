"""What a pipeline stage after the first computes from: the residual stream of a prompt's tokens, as the stage
before sends it chunk by chunk (`shared.model.stages`). The scheduler plans a stage's sequence only as far as its
rows have arrived.
"""

from __future__ import annotations

import torch


class StageInput:
    """Rows of hidden states for a prompt's tokens [start, end): appended as they arrive, taken in order.

    Args:
        start: the first token whose row will come (the tokens before it were reused from a prefix cache).
        num_tokens: the prompt's length: no row beyond it.
    """

    def __init__(self, start: int, num_tokens: int) -> None:
        if not 0 <= start < num_tokens:
            raise ValueError(f"stage input from token {start} of a prompt of {num_tokens}")
        self.start, self.num_tokens = start, num_tokens
        self._rows: list[torch.Tensor] = []
        self._first = start  # the token of the first row held
        self.end = start  # one past the last token whose row has arrived

    def append(self, rows: torch.Tensor) -> None:
        """The next rows, [n, hidden_size], for tokens [end, end + n).

        Raises:
            ValueError: not a 2-D tensor, or rows beyond the prompt.
        """
        if rows.dim() != 2 or rows.shape[0] < 1:
            raise ValueError(f"stage input rows must be [num_tokens, hidden_size], got {tuple(rows.shape)}")
        if self.end + rows.shape[0] > self.num_tokens:
            raise ValueError(f"rows for tokens up to {self.end + rows.shape[0]} of a prompt of {self.num_tokens}")
        self._rows.append(rows)
        self.end += rows.shape[0]

    def take(self, first: int, num: int) -> torch.Tensor:
        """The rows of tokens [first, first + num), which must be the oldest held; they are let go.

        Raises:
            ValueError: rows not yet arrived, or not the next in order.
        """
        if first != self._first or first + num > self.end:
            raise ValueError(f"rows of tokens [{first}, {first + num}) asked; held [{self._first}, {self.end})")
        taken, need = [], num
        while need:
            head = self._rows[0]
            if head.shape[0] <= need:
                taken.append(self._rows.pop(0))
                need -= head.shape[0]
            else:
                taken.append(head[:need])
                self._rows[0] = head[need:]
                need = 0
        self._first += num
        return taken[0] if len(taken) == 1 else torch.cat(taken)
