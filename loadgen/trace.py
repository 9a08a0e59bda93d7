"""Mooncake trace replay: parse the JSONL trace (`timestamp` ms, `input_length`, `output_length`, `hash_ids`) and
turn each line into a planned request whose prompt is its hash ids' seeded token blocks (prompts.py).
"""

from __future__ import annotations

import gzip
import json
import math
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from loadgen.prompts import DEFAULT_MIN_TOKEN_ID, DEFAULT_VOCAB_SIZE, BlockTokens
from loadgen.workload import PlannedRequest

TRACE_BLOCK_LEN = 512  # tokens per hash id in the Mooncake traces
DATA = Path(__file__).resolve().parent / "data"  # data/README.md: what each file is, its origin and licence
BUNDLED_TRACE = DATA / "conversation_trace_head.jsonl"  # the first 1,000 requests
CONVERSATION_TRACE = DATA / "conversation_trace.jsonl.gz"  # all 12,031
TRACE_TICK_MS = 3000.0  # the Mooncake traces' timestamps come in steps of 3 s


class TraceError(ValueError):
    """A trace file that cannot be read, or a malformed line (the message names the file and line)."""


@dataclass(frozen=True)
class TraceEntry:
    """One line of the trace, as written."""

    timestamp_ms: float
    input_length: int
    output_length: int
    hash_ids: tuple[int, ...]


@dataclass(frozen=True)
class TraceOptions:
    """How to replay a trace.

    Args:
        max_requests: replay at most this many lines (None: all).
        time_scale: arrival times are multiplied by it (0.5 replays twice as fast).
        input_scale: each hash id becomes max(1, round(512 * input_scale)) tokens and input lengths are scaled the
            same way (rounded, at least 1), so prompts shrink but keep their sharing structure.
        output_scale: output lengths are scaled (rounded, at least 1).
        start_s: skip lines before this trace time (seconds) and start the replay there.
        seed: seeds the token blocks; the same seed gives the same tokens for the same hash id.
        min_token_id, vocab_size: block tokens are uniform over [min_token_id, vocab_size).
    """

    max_requests: int | None = None
    time_scale: float = 1.0
    input_scale: float = 1.0
    output_scale: float = 1.0
    start_s: float = 0.0
    seed: int = 0
    min_token_id: int = DEFAULT_MIN_TOKEN_ID
    vocab_size: int = DEFAULT_VOCAB_SIZE

    def __post_init__(self) -> None:
        for name in ("time_scale", "input_scale", "output_scale"):
            value = getattr(self, name)
            if not (value > 0 and math.isfinite(value)):
                raise ValueError(f"{name} must be positive and finite, got {value}")
        if self.max_requests is not None and self.max_requests < 0:
            raise ValueError(f"max_requests must be at least 0, got {self.max_requests}")
        if not self.start_s >= 0:
            raise ValueError(f"start_s must be at least 0, got {self.start_s}")

    @property
    def block_len(self) -> int:
        return scaled_len(TRACE_BLOCK_LEN, self.input_scale)


def scaled_len(length: int, scale: float) -> int:
    """`length * scale`, rounded, at least 1."""
    return max(1, round(length * scale))


def parse_trace_line(text: str, where: str) -> TraceEntry:
    """One JSON line; `where` (file:line) prefixes the error. Raises TraceError."""
    try:
        obj = json.loads(text)
    except json.JSONDecodeError as exc:
        raise TraceError(f"{where}: not JSON ({exc.msg})") from None
    if not isinstance(obj, dict):
        raise TraceError(f"{where}: expected a JSON object, got {type(obj).__name__}")
    timestamp = _field(obj, "timestamp", where)
    if not isinstance(timestamp, int | float) or isinstance(timestamp, bool) or not 0 <= timestamp < math.inf:
        raise TraceError(f"{where}: 'timestamp' must be a number of milliseconds >= 0, got {timestamp!r}")
    lengths = [_field(obj, key, where) for key in ("input_length", "output_length")]
    for key, value in zip(("input_length", "output_length"), lengths, strict=True):
        if not _is_int(value) or value < 1:
            raise TraceError(f"{where}: {key!r} must be an integer >= 1, got {value!r}")
    hash_ids = _field(obj, "hash_ids", where)
    if not isinstance(hash_ids, list) or not all(_is_int(h) and h >= 0 for h in hash_ids):
        raise TraceError(f"{where}: 'hash_ids' must be a list of integers >= 0")
    return TraceEntry(float(timestamp), lengths[0], lengths[1], tuple(hash_ids))


def read_trace(path: str | Path, max_requests: int | None = None, start_s: float = 0.0) -> list[TraceEntry]:
    """The entries of a JSONL trace from trace time `start_s` on, at most `max_requests` of them; blank lines
    are skipped. Raises TraceError for a missing file or a malformed line."""
    entries: list[TraceEntry] = []
    for entry in _iter_entries(Path(path)):
        if max_requests is not None and len(entries) >= max_requests:
            break
        if entry.timestamp_ms >= start_s * 1000.0:
            entries.append(entry)
    return entries


def write_spread(entries: list[TraceEntry], out: Path, tick_ms: float = TRACE_TICK_MS) -> Path:
    """Write `entries` as a trace starting at 0 ms, each tick's simultaneous arrivals spread evenly over the tick, and
    return `out`. A Mooncake trace's timestamps come in 3 s ticks, so a dozen requests often arrive at once; which of
    them a busy machine's processes reach first (a long prompt's body and checks take longer) then decides their
    TTFTs, where a virtual clock keeps the trace's order. Spread, both replay the same arrivals."""
    first = entries[0].timestamp_ms if entries else 0.0
    ticks: dict[float, list[TraceEntry]] = {}
    for entry in entries:
        ticks.setdefault(entry.timestamp_ms - first, []).append(entry)
    with out.open("w", encoding="utf-8") as f:
        for tick in sorted(ticks):
            same = ticks[tick]
            for k, entry in enumerate(same):
                f.write(json.dumps({"timestamp": tick + k * tick_ms / len(same), "input_length": entry.input_length,
                                    "output_length": entry.output_length, "hash_ids": list(entry.hash_ids)}) + "\n")
    return out


def trace_requests(entries: list[TraceEntry], options: TraceOptions) -> list[PlannedRequest]:
    """Planned requests for `entries`: arrival = (timestamp - start) * time_scale, prompt = the seeded blocks of
    its hash ids cut to the scaled input length (padded with seeded tokens when longer than its blocks).

    `num_shared_prefix_tokens` is what an unlimited cache would hold: the leading blocks already seen in an
    earlier request of this replay.
    """
    blocks = BlockTokens(options.block_len, options.seed, options.min_token_id, options.vocab_size)
    start_ms = options.start_s * 1000.0
    seen_ids: set[int] = set()
    requests = []
    for i, entry in enumerate(entries):
        input_len = scaled_len(entry.input_length, options.input_scale)
        num_seen = next((k for k, h in enumerate(entry.hash_ids) if h not in seen_ids), len(entry.hash_ids))
        seen_ids.update(entry.hash_ids)
        requests.append(
            PlannedRequest(
                request_id=i,
                arrival_s=(entry.timestamp_ms - start_ms) / 1000.0 * options.time_scale,
                prompt=blocks.prompt(entry.hash_ids, input_len),
                output_len=scaled_len(entry.output_length, options.output_scale),
                num_shared_prefix_tokens=min(num_seen * options.block_len, input_len),
                hash_ids=entry.hash_ids,
            )
        )
    return requests


def load_trace(path: str | Path, options: TraceOptions | None = None) -> list[PlannedRequest]:
    """Read and plan a trace in one step. Raises TraceError."""
    options = options or TraceOptions()
    return trace_requests(read_trace(path, options.max_requests, options.start_s), options)


def _iter_entries(path: Path) -> Iterator[TraceEntry]:
    """The lines of a JSONL trace, gzip-compressed when its name ends in .gz."""
    try:
        with (gzip.open(path, "rt", encoding="utf-8") if path.suffix == ".gz" else path.open(encoding="utf-8")) as f:
            for line_no, line in enumerate(f, start=1):
                if line.strip():
                    yield parse_trace_line(line, f"{path}:{line_no}")
    except (OSError, EOFError, UnicodeDecodeError) as exc:  # gzip's BadGzipFile is an OSError
        raise TraceError(f"cannot read trace {path}: {exc}") from None


def _field(obj: dict[str, Any], key: str, where: str) -> Any:
    if key not in obj:
        raise TraceError(f"{where}: missing {key!r}")
    return obj[key]


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)
