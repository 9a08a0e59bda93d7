"""The Conductor's cost models: prefill time from prompt shape and decode step time (TBT) from batch shape, both
linear in a few features, refitted online from the step timings instances report in their heartbeats.

Prefill: `t = a + b * new_tokens + c * attention_work`, where attention work is the sum over new tokens of the keys
each attends to: about `(L^2 - R^2) / 2` for a prompt of L tokens with R reused (DESIGN section 5's polynomial in L
and R; `shared.wire.protocol.attention_work`).
Decode: `t = a + b * batch_size + c * total_context_tokens`.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence

import numpy as np

from shared.wire.protocol import attention_work


class LinearCostModel:
    """`seconds = coef . [1, x1, x2]`, least squares over the last `window` samples, coefficients kept >= 0.

    The fit reaches as far beyond the range of x1 and x2 its samples cover as that range spans, by ratio: samples
    from 256 to 4096 tokens (16x) are trusted from 16 to 65,536; beyond that reach a prediction is the fit at its
    edge plus the prior's slope for the rest. A slope fitted on a narrow range says little about far values (a fresh
    decode instance that has seen 33- to 44-token contexts must not predict a 500-token one at 20 times its step).

    Args:
        prior: coefficients used until `min_samples` samples arrive.
        window: samples kept for the fit.
        min_samples: samples needed before the fit replaces the prior.
    """

    def __init__(self, prior: Sequence[float], window: int = 512, min_samples: int = 8) -> None:
        self.prior = np.asarray(prior, dtype=np.float64)
        self.coef = self.prior.copy()
        self.window, self.min_samples = window, min_samples
        self._samples: deque[tuple[float, float, float]] = deque(maxlen=window)
        self._dirty = False
        self._low = self._high = np.zeros(2)  # how far (x1, x2) the fit reaches; nowhere while the prior holds

    @property
    def num_samples(self) -> int:
        return len(self._samples)

    def add(self, x1: float, x2: float, seconds: float) -> None:
        """One measurement; malformed ones (negative, NaN) are ignored."""
        if min(x1, x2, seconds) < 0 or not np.isfinite([x1, x2, seconds]).all():
            return
        self._samples.append((x1, x2, seconds))
        self._dirty = True

    def predict(self, x1: float, x2: float) -> float:
        if self._dirty:
            self._refit()
        x = np.array([x1, x2])
        inside = np.clip(x, self._low, self._high)
        return float(self.coef @ np.array([1.0, *inside]) + self.prior[1:] @ (x - inside))

    def _refit(self) -> None:
        self._dirty = False
        if len(self._samples) < self.min_samples:
            return
        data = np.asarray(self._samples, dtype=np.float64)
        features = np.column_stack([np.ones(len(data)), data[:, 0], data[:, 1]])
        # A feature that never varied (every sample at batch 1, say) says nothing about its coefficient: keep the
        # prior's there (a decode step does get slower with batch size), fit the rest to what is left.
        fixed = [c for c in (1, 2) if np.ptp(features[:, c]) <= 1e-9 * max(np.abs(features[:, c]).max(), 1.0)]
        free = [c for c in range(3) if c not in fixed]
        target = data[:, 2] - features[:, fixed] @ self.prior[fixed]
        fitted = _nonnegative_least_squares(features[:, free], target)
        if fitted is not None:
            coef = self.prior.copy()
            coef[free] = fitted
            self.coef = coef
            self._low, self._high = _reach(data[:, :2].min(axis=0), data[:, :2].max(axis=0))


def _reach(low: np.ndarray, high: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The range [low, high] widened by its own ratio on each side: [low^2 / high, high^2 / low] (from 0 when low is
    0: then to infinity)."""
    below = np.divide(low * low, high, out=np.zeros_like(low), where=high > 0)
    above = np.divide(high * high, low, out=np.full_like(high, np.inf), where=low > 0)
    return below, above


def _nonnegative_least_squares(features: np.ndarray, target: np.ndarray) -> np.ndarray | None:
    """Least squares with every coefficient >= 0: the best of the fits over each subset of columns (3 columns:
    7 subsets) whose coefficients all come out non-negative. None when no subset fits."""
    num_cols = features.shape[1]
    best, best_error = None, np.inf
    scale = np.maximum(np.abs(features).max(axis=0), 1e-12)  # conditions the solve; undone below
    for mask in range(1, 1 << num_cols):
        cols = [c for c in range(num_cols) if mask >> c & 1]
        sub = features[:, cols] / scale[cols]
        coef_sub, *_ = np.linalg.lstsq(sub, target, rcond=None)
        if (coef_sub < 0).any():
            continue
        coef = np.zeros(num_cols)
        coef[cols] = coef_sub / scale[cols]
        error = float(np.sum((features @ coef - target) ** 2))
        if error < best_error:
            best, best_error = coef, error
    return best


class PrefillCostModel:
    """Predicts a prompt's prefill seconds on one instance (every prefill instance shares the fit: same hardware)."""

    def __init__(self) -> None:
        # Prior: SmolLM2-135M fp32 on one CPU core: ~300 tokens/s, attention a minor term at these lengths.
        self.model = LinearCostModel([0.02, 1 / 300, 1e-8])

    def add_step(self, num_new_tokens: float, work: float, seconds: float) -> None:
        self.model.add(num_new_tokens, work, seconds)

    def predict(self, num_tokens: int, num_reused: int) -> float:
        num_new = max(num_tokens - num_reused, 0)
        return self.model.predict(num_new, attention_work(num_tokens, num_reused)) if num_new else 0.0

    def pipeline_s(self, num_tokens: int, num_reused: int, num_stages: int, step_tokens: int,
                   boundary_s_per_token: float = 0.0) -> float:
        """Seconds for a pipeline group of `num_stages` stages (an equal share of the layers each) to compute a prompt
        from token `num_reused` in chunks of `step_tokens`, a token's hidden state taking `boundary_s_per_token` to
        cross a boundary between stages: a chunk takes 1/num_stages of its step on each stage, and chunk c+1 enters
        the first stage as chunk c leaves it (or, when its rows take longer to cross than to compute, as they have
        crossed), so the prompt takes its chunks' time on one stage plus its last chunk's compute and crossings on the
        others (Mooncake's CPP, arXiv 2407.00079 section 5.1)."""
        starts = range(num_reused, num_tokens, step_tokens)
        sizes = [min(step_tokens, num_tokens - start) for start in starts]
        if not sizes:
            return 0.0
        chunk_s = [self.model.predict(n, attention_work(start + n, start)) / num_stages
                   for start, n in zip(starts, sizes, strict=True)]
        crossing_s = [n * boundary_s_per_token for n in sizes] if num_stages > 1 else [0.0] * len(sizes)
        paced = sum(max(c, x) for c, x in zip(chunk_s, crossing_s, strict=True))
        return paced + (num_stages - 1) * (chunk_s[-1] + crossing_s[-1])

    def queue_s(self, num_tokens: int, work: float, step_tokens: int) -> float:
        """Seconds to compute `num_tokens` of queued prompts, of attention work `work` in all, in steps of
        `step_tokens`: ceil(num_tokens / step_tokens) steps, each the average one (the model is linear)."""
        if num_tokens <= 0:
            return 0.0
        num_steps = -(-num_tokens // step_tokens)
        return num_steps * self.model.predict(num_tokens / num_steps, work / num_steps)


class DecodeCostModel:
    """Predicts a decode step's seconds (the time between tokens) from batch size and total context."""

    def __init__(self) -> None:
        # Prior: SmolLM2-135M fp32 on one CPU core: ~40 ms at batch 1, growing with batch and context.
        self.model = LinearCostModel([0.04, 0.004, 2e-6])

    def add_step(self, batch_size: float, context_tokens: float, seconds: float) -> None:
        self.model.add(batch_size, context_tokens, seconds)

    def predict(self, batch_size: int, context_tokens: int) -> float:
        return self.model.predict(batch_size, context_tokens)
