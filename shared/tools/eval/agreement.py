"""How closely one model variant's next-token predictions follow a reference's, summed over windows: the figures
`tsukimi eval kv` (a codec against fp16 KV) and `tsukimi eval fastgen` (eviction against the full cache) report.

Owns the sums and the figures made of them (perplexity, KL(reference || variant) per prediction, top-1 agreement);
which variant and reference are compared is the callers'.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F


@dataclass
class Agreement:
    """Sums over every next-token prediction so far of one variant against a reference."""

    nll: float = 0.0  # the variant's negative log-likelihood of the true next tokens
    kl: float = 0.0  # KL(reference || variant), summed over predictions
    num_agreeing: int = 0  # predictions whose top-1 token is the reference's
    num_predictions: int = 0

    def add(self, log_probs: torch.Tensor, reference_log_probs: torch.Tensor, targets: torch.Tensor) -> None:
        """log_probs, reference_log_probs: [n, vocab] log-probabilities of n predictions; targets: [n] token ids."""
        self.nll -= float(log_probs[torch.arange(targets.shape[0]), targets].double().sum())
        # sum_v p_ref(v) * (log p_ref(v) - log p(v)), summed over the n positions
        self.kl += float(F.kl_div(log_probs, reference_log_probs, reduction="sum", log_target=True))
        self.num_agreeing += int((log_probs.argmax(dim=-1) == reference_log_probs.argmax(dim=-1)).sum())
        self.num_predictions += targets.shape[0]

    @property
    def ppl(self) -> float:
        return perplexity(self.nll, self.num_predictions)

    @property
    def mean_kl(self) -> float:
        return self.kl / self.num_predictions

    @property
    def top1_agreement(self) -> float:
        return self.num_agreeing / self.num_predictions


def perplexity(nll: float, count: int) -> float:
    """exp(nll / count), in float64."""
    return torch.tensor(nll / count, dtype=torch.float64).exp().item()
