"""One request inside the engine: its tokens, how many have KV computed, its output text and why it finished."""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import TYPE_CHECKING

from shared.wire.protocol import SamplingParams

if TYPE_CHECKING:
    from shared.engine.kv.prefix_load import PrefixLoad, PrefixSource
    from shared.engine.stage_input import StageInput


class FinishReason(enum.StrEnum):
    STOP = "stop"  # end-of-sequence token or stop string (OpenAI's "stop")
    LENGTH = "length"  # max_tokens or the model's context limit
    ABORT = "abort"  # cancelled by the caller
    ERROR = "error"  # a step over this request raised; it alone ends (see shared.engine.isolation)


class SequenceStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass
class Sequence:
    """Mutable state of one request; owned by the engine, advanced by the scheduler.

    `token_ids` is prompt + generated tokens; tokens [0, num_computed_tokens) have KV in the pool. A sequence needs
    a forward pass over [num_computed_tokens, len(token_ids)) and is sampled once that span is done.
    """

    request_id: str
    token_ids: list[int]
    num_prompt_tokens: int
    params: SamplingParams
    status: SequenceStatus = SequenceStatus.WAITING
    num_computed_tokens: int = 0
    num_cached_tokens: int = 0  # prompt tokens reused from the prefix cache at the last admission
    kv_bytes_saved: int = 0  # KV bytes FastGen did not hold after the last step (0: full cache)
    finish_reason: FinishReason | None = None
    text: str = ""
    num_emitted_chars: int = 0
    stop_checked_chars: int = 0
    prefix_source: PrefixSource | None = None  # where the prompt's prefix KV may be loaded from, at admission
    prefix_load: PrefixLoad | None = None  # that load, from admission to the end of the step that admitted it
    stage_input: StageInput | None = None  # a pipeline stage after the first: its prompt's rows from the one before

    @property
    def num_ready_tokens(self) -> int:
        """Tokens that can be computed now: all uncomputed ones, or, at a stage after the first, those whose rows
        from the stage before have arrived."""
        if self.stage_input is None:
            return self.num_uncomputed_tokens
        return min(self.num_uncomputed_tokens, self.stage_input.end - self.num_computed_tokens)

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def num_uncomputed_tokens(self) -> int:
        return len(self.token_ids) - self.num_computed_tokens
