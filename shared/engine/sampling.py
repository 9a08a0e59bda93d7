"""The batched sampler (greedy, temperature, top-k, top-p, seeded); the parameters it follows are
`shared.wire.protocol.SamplingParams`."""

from __future__ import annotations

import torch

from shared.wire.protocol import SamplingParams


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
