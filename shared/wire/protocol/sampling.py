"""How one request picks its tokens and when it stops: `SamplingParams`, the one sampling type from the gateway's
parse to the engine's sampler, a wire message nested in the requests of `messages.py`; validated on construction (a
decoded message too), its `SamplingError` naming the field.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from shared.wire.protocol.base import Message, message


class SamplingError(ValueError):
    """A sampling value outside its range; `field` names it (the gateway's 400 says which field)."""

    def __init__(self, field: str, message: str) -> None:
        super().__init__(message)
        self.field = field


@message("sampling")
@dataclass(frozen=True)
class SamplingParams(Message):
    """How to pick tokens and when to stop: what the gateway parses, the wire carries and the engine's sampler
    follows (one type from end to end; validated on construction, so a decoded message is valid too).

    Args:
        max_tokens: most tokens to generate (finish reason "length" when reached).
        temperature: 0 means greedy; otherwise logits are divided by it before sampling.
        top_p: nucleus sampling mass in (0, 1]; 1 disables it.
        top_k: keep only the k most likely tokens; 0 disables it.
        seed: a request with a seed samples from its own generator, so the same seed gives the same output.
        stop: strings that end generation; the matched string is not part of the output.
        ignore_eos: keep generating through end-of-sequence tokens.
        min_tokens: end-of-sequence tokens cannot be sampled until this many tokens were generated.
        output_offset: tokens of the answer generated before this placement (a request placed again after its
            instance was lost mid-answer, those tokens now ending its prompt): a seeded request's draws go on from
            there, as if the same engine had drawn them all.
    Raises:
        SamplingError: a value outside its range, naming the field.
    """

    max_tokens: int = 128
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None
    stop: list[str] = field(default_factory=list)
    ignore_eos: bool = False
    min_tokens: int = 0
    output_offset: int = 0

    def __post_init__(self) -> None:
        if self.max_tokens < 1:
            raise SamplingError("max_tokens", f"max_tokens must be at least 1, got {self.max_tokens}")
        if not 0.0 <= self.temperature <= 100.0:
            raise SamplingError("temperature", f"temperature must be in [0, 100], got {self.temperature}")
        if not 0.0 < self.top_p <= 1.0:
            raise SamplingError("top_p", f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < 0:
            raise SamplingError("top_k", f"top_k must be >= 0 (0 disables it), got {self.top_k}")
        if not 0 <= self.min_tokens <= self.max_tokens:
            raise SamplingError("min_tokens", f"min_tokens must be in [0, max_tokens], got {self.min_tokens}")
        if self.output_offset < 0:
            raise SamplingError("output_offset", f"output_offset must be >= 0, got {self.output_offset}")
        if any(not s for s in self.stop):
            raise SamplingError("stop", "stop strings must not be empty")

    @property
    def is_greedy(self) -> bool:
        return self.temperature == 0.0 or self.top_k == 1
