"""What the engine gives back: each step's output per request, a step's measured work, a finished request."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from shared.engine.sequence import FinishReason

if TYPE_CHECKING:
    import torch


@dataclass(frozen=True)
class RequestOutput:
    """What one step produced for one request: new tokens and text, and the finish reason once finished."""

    request_id: str
    new_token_ids: list[int]
    new_text: str
    finish_reason: FinishReason | None
    num_prompt_tokens: int
    num_output_tokens: int
    num_cached_tokens: int
    kv_bytes_saved: int = 0  # KV bytes FastGen does not hold for this request after this step (0: full cache)
    error: str = ""  # with finish_reason "error": what the step raised
    # A pipeline stage before the last: the residual stream of the tokens this step computed, [n, hidden_size], for
    # the next stage; the request ends here (`LENGTH`) with its prompt's last rows.
    stage_rows: torch.Tensor | None = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass(frozen=True)
class StepStats:
    """What one step computed and how long it took (the figures a cost model is fitted to)."""

    num_new_tokens: int  # tokens through the model
    attention_work: int  # keys attended, summed over the new tokens (each sees every earlier token and itself)
    seconds: float  # wall time of the step, less `load_wait_s`
    load_wait_s: float  # time the forward pass blocked waiting for loaded prefix KV


@dataclass(frozen=True)
class Completion:
    """A finished request, as `LLMEngine.generate` returns it."""

    request_id: str
    text: str
    token_ids: list[int]
    finish_reason: FinishReason
    num_prompt_tokens: int
    num_cached_tokens: int
