"""A tiny Prometheus text exposition (format 0.0.4): counters, gauges, histograms, and the gateway's metrics.

No client library: the gateway needs a handful of series and nothing else. Times are in seconds.
"""

from __future__ import annotations

import bisect
import itertools
import math
import time
from collections.abc import Sequence
from dataclasses import dataclass, field

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
LabelValues = tuple[str, ...]


def _escape(value: str) -> str:
    return value.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")


def _labels(names: Sequence[str], values: Sequence[str], extra: str = "") -> str:
    pairs = [f'{n}="{_escape(v)}"' for n, v in zip(names, values, strict=True)]
    if extra:
        pairs.append(extra)
    return "{" + ",".join(pairs) + "}" if pairs else ""


def _number(value: float) -> str:
    if math.isinf(value):
        return "+Inf" if value > 0 else "-Inf"
    return repr(float(value)) if not float(value).is_integer() else str(int(value))


class _Metric:
    kind = ""

    def __init__(self, name: str, help_text: str, label_names: Sequence[str] = ()) -> None:
        self.name, self.help_text, self.label_names = name, help_text, tuple(label_names)

    def _key(self, labels: dict[str, str]) -> LabelValues:
        if not labels and not self.label_names:  # the per-token metrics: no labels to check
            return ()
        if set(labels) != set(self.label_names):
            raise ValueError(f"{self.name} takes labels {self.label_names}, got {sorted(labels)}")
        return tuple(str(labels[n]) for n in self.label_names)

    def render(self) -> list[str]:
        return [f"# HELP {self.name} {self.help_text}", f"# TYPE {self.name} {self.kind}", *self._samples()]

    def _samples(self) -> list[str]:
        raise NotImplementedError


class Counter(_Metric):
    """A value that only goes up."""

    kind = "counter"

    def __init__(self, name: str, help_text: str, label_names: Sequence[str] = ()) -> None:
        super().__init__(name, help_text, label_names)
        self.values: dict[LabelValues, float] = {} if label_names else {(): 0.0}

    def inc(self, amount: float = 1.0, **labels: str) -> None:
        if amount < 0:
            raise ValueError("a counter cannot go down")
        key = self._key(labels)
        self.values[key] = self.values.get(key, 0.0) + amount

    def _samples(self) -> list[str]:
        return [f"{self.name}{_labels(self.label_names, k)} {_number(v)}" for k, v in sorted(self.values.items())]


class Gauge(Counter):
    """A value that goes up and down."""

    kind = "gauge"

    def set(self, value: float, **labels: str) -> None:
        self.values[self._key(labels)] = value

    def inc(self, amount: float = 1.0, **labels: str) -> None:
        key = self._key(labels)
        self.values[key] = self.values.get(key, 0.0) + amount


@dataclass
class _Buckets:
    counts: list[int]  # observations in each bucket alone (above the bound before); cumulated when rendered
    total: float = 0.0
    count: int = 0


class Histogram(_Metric):
    """Observations counted into cumulative `le` buckets, with their sum and count."""

    kind = "histogram"

    def __init__(self, name: str, help_text: str, buckets: Sequence[float], label_names: Sequence[str] = ()) -> None:
        super().__init__(name, help_text, label_names)
        self.bounds = sorted(buckets)
        self.series: dict[LabelValues, _Buckets] = {}

    def observe(self, value: float, **labels: str) -> None:
        key = self._key(labels)
        series = self.series.get(key)
        if series is None:
            series = self.series[key] = _Buckets([0] * (len(self.bounds) + 1))
        series.counts[bisect.bisect_left(self.bounds, value)] += 1  # the first bound >= value; past all: +Inf
        series.total += value
        series.count += 1

    def _samples(self) -> list[str]:
        lines = []
        for key, series in sorted(self.series.items()):
            for bound, count in zip([*self.bounds, math.inf], itertools.accumulate(series.counts), strict=True):
                labels = _labels(self.label_names, key, f'le="{_number(bound)}"')
                lines.append(f"{self.name}_bucket{labels} {count}")
            lines.append(f"{self.name}_sum{_labels(self.label_names, key)} {_number(series.total)}")
            lines.append(f"{self.name}_count{_labels(self.label_names, key)} {series.count}")
        return lines


_TTFT_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 20, 30, 60, 120)
_ITL_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.15, 0.2, 0.3, 0.5, 1, 2.5)
_E2E_BUCKETS = (0.1, 0.25, 0.5, 1, 2.5, 5, 10, 20, 30, 60, 120, 300)


@dataclass
class GatewayMetrics:
    """Every series the gateway exports under `tsukimi_gateway_`."""

    requests: Counter = field(default_factory=lambda: Counter(
        "tsukimi_gateway_requests_total", "HTTP requests answered, by route and status code", ("route", "code")))
    ttft: Histogram = field(default_factory=lambda: Histogram(
        "tsukimi_gateway_time_to_first_token_seconds", "arrival to the first output token", _TTFT_BUCKETS))
    itl: Histogram = field(default_factory=lambda: Histogram(
        "tsukimi_gateway_inter_token_latency_seconds", "gap between consecutive token events", _ITL_BUCKETS))
    e2e: Histogram = field(default_factory=lambda: Histogram(
        "tsukimi_gateway_e2e_request_latency_seconds", "arrival to the last output token", _E2E_BUCKETS))
    in_flight: Gauge = field(default_factory=lambda: Gauge(
        "tsukimi_gateway_requests_in_flight", "generation requests being served now"))
    queue_depth: Gauge = field(default_factory=lambda: Gauge(
        "tsukimi_gateway_queue_depth", "waiting requests by role, from the latest heartbeats", ("role",)))
    prompt_tokens: Counter = field(default_factory=lambda: Counter(
        "tsukimi_gateway_prompt_tokens_total", "prompt tokens of finished requests"))
    cached_tokens: Counter = field(default_factory=lambda: Counter(
        "tsukimi_gateway_cached_prompt_tokens_total", "prompt tokens served from cached KV blocks"))
    generation_tokens: Counter = field(default_factory=lambda: Counter(
        "tsukimi_gateway_generation_tokens_total", "output tokens streamed to clients"))
    rejections: Counter = field(default_factory=lambda: Counter(
        "tsukimi_gateway_rejections_total", "requests the scheduler refused, by reason", ("reason",)))
    placed_again: Counter = field(default_factory=lambda: Counter(
        "tsukimi_gateway_requests_placed_again_total",
        "requests placed again after the instance holding them was lost, by stage: before_first_token, mid_answer",
        ("stage",)))

    def render(self) -> str:
        metrics: list[_Metric] = [
            self.requests, self.ttft, self.itl, self.e2e, self.in_flight, self.queue_depth,
            self.prompt_tokens, self.cached_tokens, self.generation_tokens, self.rejections, self.placed_again,
        ]
        return "\n".join(line for m in metrics for line in m.render()) + "\n"


class RequestTimer:
    """Feeds TTFT, inter-token and end-to-end latency of one request into the histograms.

    Args:
        metrics: where to record.
        start: monotonic seconds when the request arrived.
    """

    def __init__(self, metrics: GatewayMetrics, start: float) -> None:
        self.metrics, self.start = metrics, start
        self.last_token_at: float | None = None

    def tokens(self, num_tokens: int) -> None:
        """An event carrying `num_tokens` output tokens arrived now."""
        if num_tokens <= 0:
            return
        now = time.monotonic()
        if self.last_token_at is None:
            self.metrics.ttft.observe(now - self.start)
        else:
            self.metrics.itl.observe(now - self.last_token_at)
        self.last_token_at = now
        self.metrics.generation_tokens.inc(num_tokens)

    def finished(self, num_prompt_tokens: int, num_cached_tokens: int) -> None:
        self.metrics.e2e.observe(time.monotonic() - self.start)
        self.metrics.prompt_tokens.inc(num_prompt_tokens)
        self.metrics.cached_tokens.inc(num_cached_tokens)
