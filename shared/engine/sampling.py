"""Sampling parameters of one request and the batched sampler (greedy, temperature, top-k, top-p, seeded)."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch


@dataclass(frozen=True)
class SamplingParams:
    """How to pick tokens and when to stop.

    Args:
        max_tokens: most tokens to generate (finish reason "length" when reached).
        temperature: 0 means greedy; otherwise logits are divided by it before sampling.
        top_p: nucleus sampling mass in (0, 1]; 1 disables it.
        top_k: keep only the k most likely tokens; 0 disables it.
        seed: a request with a seed samples from its own generator, so the same seed gives the same output.
        stop: strings that end generation; the matched string is not part of the output.
        ignore_eos: keep generating through end-of-sequence tokens.
        min_tokens: end-of-sequence tokens cannot be sampled until this many tokens were generated.
    Raises:
        ValueError: a value outside its range.
    """

    max_tokens: int = 128
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None
    stop: tuple[str, ...] = field(default_factory=tuple)
    ignore_eos: bool = False
    min_tokens: int = 0

    def __post_init__(self) -> None:
        if self.max_tokens < 1:
            raise ValueError(f"max_tokens must be at least 1, got {self.max_tokens}")
        if not 0.0 <= self.temperature <= 100.0:
            raise ValueError(f"temperature must be in [0, 100], got {self.temperature}")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < 0:
            raise ValueError(f"top_k must be >= 0 (0 disables it), got {self.top_k}")
        if not 0 <= self.min_tokens <= self.max_tokens:
            raise ValueError(f"min_tokens must be in [0, max_tokens], got {self.min_tokens}")
        if any(not s for s in self.stop):
            raise ValueError("stop strings must not be empty")

    @property
    def is_greedy(self) -> bool:
        return self.temperature == 0.0 or self.top_k == 1


def _filter_top_k_top_p(logits: torch.Tensor, top_k: int, top_p: float) -> torch.Tensor:
    """logits: [vocab] fp32 -> the same with excluded tokens at -inf."""
    if top_k > 0 and top_k < logits.shape[-1]:
        kth = torch.topk(logits, top_k).values[-1]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p < 1.0:
        sorted_logits, order = torch.sort(logits, descending=True)
        cumulative = torch.softmax(sorted_logits, dim=-1).cumsum(-1)
        # Drop a token when the mass before it already reaches top_p (the most likely token always stays).
        drop_sorted = (cumulative - torch.softmax(sorted_logits, dim=-1)) >= top_p
        logits = logits.masked_fill(drop_sorted.scatter(0, order, drop_sorted), float("-inf"))
    return logits


class Sampler:
    """Picks one token per row. Seeded requests keep a private generator across steps."""

    def __init__(self) -> None:
        self._generators: dict[object, torch.Generator] = {}
        self._default = torch.Generator()
        self._default.seed()

    def forget(self, request_id: object) -> None:
        """Drop a finished request's generator."""
        self._generators.pop(request_id, None)

    def _generator(self, request_id: object, params: SamplingParams) -> torch.Generator:
        if params.seed is None:
            return self._default
        gen = self._generators.get(request_id)
        if gen is None:
            gen = torch.Generator()
            gen.manual_seed(params.seed)
            self._generators[request_id] = gen
        return gen

    def sample(
        self, logits: torch.Tensor, request_ids: list[object], params: list[SamplingParams]
    ) -> list[int]:
        """logits: [batch, vocab] fp32 on any device -> one token id per row."""
        greedy = logits.argmax(dim=-1).tolist()
        out: list[int] = []
        for row, (request_id, p) in enumerate(zip(request_ids, params, strict=True)):
            if p.is_greedy:
                out.append(greedy[row])
                continue
            filtered = _filter_top_k_top_p(logits[row].float().cpu() / p.temperature, p.top_k, p.top_p)
            probs = torch.softmax(filtered, dim=-1)
            out.append(int(torch.multinomial(probs, 1, generator=self._generator(request_id, p)).item()))
        return out
