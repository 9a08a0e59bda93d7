"""Planned requests and the synthetic workloads: Poisson/Gamma arrivals, length distributions, random and
shared-prefix prompts, all seeded. Trace replay is in trace.py; sending is in runner.py.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, replace

import numpy as np

from loadgen.prompts import DEFAULT_MIN_TOKEN_ID, DEFAULT_VOCAB_SIZE, random_tokens, tokens_to_text


@dataclass(frozen=True)
class PlannedRequest:
    """One request to send.

    Args:
        request_id: its index in the workload.
        arrival_s: when to send it, in seconds from the start of the run (ignored at fixed concurrency).
        prompt: token ids (sent as they are to /v1/completions) or text.
        output_len: tokens to ask for (`max_tokens`).
        num_shared_prefix_tokens: tokens at the start meant to be shared with other requests (0: unknown/none).
        hash_ids: the trace's block hash ids, when it comes from a trace.
    """

    request_id: int
    arrival_s: float
    prompt: list[int] | str
    output_len: int
    num_shared_prefix_tokens: int = 0
    hash_ids: tuple[int, ...] = ()

    @property
    def input_len(self) -> int:
        """Prompt tokens (characters would be meaningless, so a text prompt counts its words)."""
        return len(self.prompt) if isinstance(self.prompt, list) else len(self.prompt.split())


@dataclass(frozen=True)
class SyntheticSpec:
    """A synthetic workload (vllm bench serve's random dataset, plus shared-prefix groups).

    Args:
        num_requests: how many requests.
        rate: mean arrivals per second; `math.inf` sends them all at once.
        burstiness: Gamma shape of the gaps between arrivals; 1 is Poisson, lower is burstier.
        input_len, output_len: mean prompt (after any shared prefix) and output lengths in tokens.
        range_ratio: lengths are uniform over [len * (1 - r), len * (1 + r)]; 0 means fixed.
        shared_prefix_len: tokens of the prefix each group shares (0: no prefix).
        num_prefix_groups: groups; request i belongs to group i % num_prefix_groups.
        seed: seeds every random draw.
    """

    num_requests: int = 100
    rate: float = math.inf
    burstiness: float = 1.0
    input_len: int = 1024
    output_len: int = 128
    range_ratio: float = 0.0
    shared_prefix_len: int = 0
    num_prefix_groups: int = 1
    seed: int = 0
    min_token_id: int = DEFAULT_MIN_TOKEN_ID
    vocab_size: int = DEFAULT_VOCAB_SIZE

    def __post_init__(self) -> None:
        checks = [
            (self.num_requests >= 0, "the number of requests must be at least 0"),
            (self.rate > 0, "the rate must be positive (inf: all at once)"),
            (0 < self.burstiness < math.inf, "the burstiness must be positive and finite"),
            (self.input_len >= 1 and self.output_len >= 1, "input and output lengths must be at least 1"),
            (0 <= self.range_ratio < 1, "the range ratio must be in [0, 1)"),
            (self.shared_prefix_len >= 0, "the shared prefix length must be at least 0"),
            (self.num_prefix_groups >= 1, "the number of prefix groups must be at least 1"),
        ]
        for is_ok, message in checks:
            if not is_ok:
                raise ValueError(message)


def arrival_offsets(num_requests: int, rate: float, burstiness: float, rng: np.random.Generator) -> list[float]:
    """Arrival times in seconds, the first at 0, then gaps drawn from Gamma(shape=burstiness,
    scale=1/(rate*burstiness)): mean gap 1/rate whatever the burstiness (1: exponential gaps, a Poisson process).
    `rate=inf` puts every arrival at 0."""
    if num_requests <= 0:
        return []
    if math.isinf(rate):
        return [0.0] * num_requests
    gaps = rng.gamma(shape=burstiness, scale=1.0 / (rate * burstiness), size=num_requests - 1)
    return [0.0, *np.cumsum(gaps).tolist()]


def sample_lengths(mean_len: int, range_ratio: float, num: int, rng: np.random.Generator) -> list[int]:
    """`num` lengths uniform over the integers [int(mean*(1-r)), int(mean*(1+r))] (as vllm's
    `--random-range-ratio`), each at least 1."""
    low = max(1, int(mean_len * (1 - range_ratio)))
    high = max(low, int(mean_len * (1 + range_ratio)))
    return rng.integers(low, high + 1, size=num).tolist()


def synthetic_requests(spec: SyntheticSpec) -> list[PlannedRequest]:
    """The requests of `spec` with token-id prompts: group prefix (if any) + a random suffix of the drawn length.

    The same spec gives the same requests. Arrivals, lengths, prefixes and suffixes come from separate
    seeded streams, so changing the rate does not change the prompts.
    """
    n = spec.num_requests
    arrivals = arrival_offsets(n, spec.rate, spec.burstiness, np.random.default_rng([spec.seed, 0]))
    input_lens = sample_lengths(spec.input_len, spec.range_ratio, n, np.random.default_rng([spec.seed, 1]))
    output_lens = sample_lengths(spec.output_len, spec.range_ratio, n, np.random.default_rng([spec.seed, 4]))
    prefixes = shared_prefixes(spec)
    suffix_rng = np.random.default_rng([spec.seed, 3])
    requests = []
    for i in range(n):
        prefix = prefixes[i % len(prefixes)] if prefixes else []
        suffix = random_tokens(suffix_rng, input_lens[i], spec.min_token_id, spec.vocab_size)
        requests.append(PlannedRequest(i, arrivals[i], prefix + suffix, output_lens[i], len(prefix)))
    return requests


def shared_prefixes(spec: SyntheticSpec) -> list[list[int]]:
    """The prefix of each group (none when `shared_prefix_len` is 0)."""
    if spec.shared_prefix_len == 0:
        return []
    rng = np.random.default_rng([spec.seed, 2])
    return [
        random_tokens(rng, spec.shared_prefix_len, spec.min_token_id, spec.vocab_size)
        for _ in range(spec.num_prefix_groups)
    ]


def as_text(requests: Sequence[PlannedRequest]) -> list[PlannedRequest]:
    """The same requests with token-id prompts turned into pseudo-word text (for the chat API)."""
    return [r if isinstance(r.prompt, str) else replace(r, prompt=tokens_to_text(r.prompt)) for r in requests]
