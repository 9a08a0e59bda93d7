"""Mooncake trace replay: parsing, seeded blocks (equal hash ids give equal tokens), scaling, errors, and the real
conversation trace."""

from __future__ import annotations

import gzip
import json
from pathlib import Path

import pytest

from loadgen.prompts import BlockTokens
from loadgen.trace import (
    BUNDLED_TRACE,
    CONVERSATION_TRACE,
    TraceEntry,
    TraceError,
    TraceOptions,
    load_trace,
    read_trace,
    write_spread,
)

REAL_TRACE = BUNDLED_TRACE  # the first 1,000 lines of the real Mooncake trace (loadgen/data/README.md)

LINES = [
    {"timestamp": 0, "input_length": 1200, "output_length": 10, "hash_ids": [0, 1, 2]},
    {"timestamp": 500, "input_length": 1536, "output_length": 20, "hash_ids": [0, 1, 3]},
    {"timestamp": 2000, "input_length": 700, "output_length": 30, "hash_ids": [4, 5]},
    {"timestamp": 2500, "input_length": 1800, "output_length": 1, "hash_ids": [0, 6, 7]},  # longer than 3 blocks
]


@pytest.fixture
def trace_file(tmp_path: Path) -> Path:
    path = tmp_path / "trace.jsonl"
    path.write_text("\n".join(json.dumps(line) for line in LINES) + "\n\n")
    return path


def test_parses_every_line_with_arrivals_and_lengths(trace_file: Path) -> None:
    requests = load_trace(trace_file)
    assert [r.arrival_s for r in requests] == [0.0, 0.5, 2.0, 2.5]
    assert [len(r.prompt) for r in requests] == [1200, 1536, 700, 1800]
    assert [r.output_len for r in requests] == [10, 20, 30, 1]
    assert requests[1].hash_ids == (0, 1, 3)
    assert [r.num_shared_prefix_tokens for r in requests] == [0, 1024, 0, 512]
    tokens = [t for r in requests for t in r.prompt]
    assert all(isinstance(t, int) and 1000 <= t < 32000 for t in tokens)


def test_equal_ids_give_equal_tokens_and_different_ids_differ(trace_file: Path) -> None:
    first, second, third, fourth = (r.prompt for r in load_trace(trace_file))
    assert isinstance(first, list) and isinstance(second, list) and isinstance(fourth, list)
    assert first[:1024] == second[:1024]  # ids 0, 1
    assert first[1024:1200] != second[1024:1200]  # ids 2 and 3
    assert fourth[:512] == first[:512] and fourth[512:1024] != first[512:1024]
    assert third[:512] != first[:512]


def test_the_same_seed_gives_the_same_tokens_in_every_load(trace_file: Path) -> None:
    once = [r.prompt for r in load_trace(trace_file, TraceOptions(seed=7))]
    again = [r.prompt for r in load_trace(trace_file, TraceOptions(seed=7))]
    other_seed = [r.prompt for r in load_trace(trace_file, TraceOptions(seed=8))]
    assert once == again
    assert once[0][:512] != other_seed[0][:512]
    assert once[0][:512] == BlockTokens(512, seed=7).block(0)


def test_a_prompt_longer_than_its_blocks_is_padded_deterministically(trace_file: Path) -> None:
    fourth = load_trace(trace_file)[3].prompt
    blocks = BlockTokens(512)
    assert fourth[:1536] == blocks.block(0) + blocks.block(6) + blocks.block(7)
    assert fourth[1536:] == blocks.padding(7, 0)[: 1800 - 1536]
    assert fourth[1536:] != blocks.block(7)[: 1800 - 1536]


def test_input_scale_keeps_the_sharing_structure(trace_file: Path) -> None:
    options = TraceOptions(input_scale=1 / 16)  # blocks of 32 tokens
    first, second, third, fourth = load_trace(trace_file, options)
    assert [len(r.prompt) for r in (first, second, third, fourth)] == [75, 96, 44, 112]
    # first and second share ids 0, 1: exactly 2 blocks of 32 tokens
    shared = next(i for i, (a, b) in enumerate(zip(first.prompt, second.prompt, strict=False)) if a != b)
    assert shared == 64
    assert fourth.prompt[:32] == first.prompt[:32] and fourth.prompt[32] != first.prompt[32]
    assert second.num_shared_prefix_tokens == 64


def test_scales_are_rounded_and_at_least_one(tmp_path: Path) -> None:
    path = tmp_path / "t.jsonl"
    path.write_text(json.dumps({"timestamp": 0, "input_length": 3, "output_length": 3, "hash_ids": [9]}) + "\n")
    [request] = load_trace(path, TraceOptions(input_scale=0.0001, output_scale=0.0001))
    assert len(request.prompt) == 1 and request.output_len == 1
    [request] = load_trace(path, TraceOptions(input_scale=0.5, output_scale=2.5))
    assert len(request.prompt) == 2 and request.output_len == 8  # round(1.5) == 2, round(7.5) == 8


def test_time_scale_start_and_max_requests(trace_file: Path) -> None:
    assert [r.arrival_s for r in load_trace(trace_file, TraceOptions(time_scale=0.5))] == [0.0, 0.25, 1.0, 1.25]
    assert [r.output_len for r in load_trace(trace_file, TraceOptions(max_requests=2))] == [10, 20]
    late = load_trace(trace_file, TraceOptions(start_s=1.0, time_scale=2.0))
    assert [(r.arrival_s, r.output_len) for r in late] == [(2.0, 30), (3.0, 1)]
    assert load_trace(trace_file, TraceOptions(max_requests=0)) == []


@pytest.mark.parametrize(
    ("line", "message"),
    [
        ("{not json", "not JSON"),
        ("[1, 2]", "expected a JSON object"),
        ('{"timestamp": 0, "input_length": 5, "output_length": 1}', "missing 'hash_ids'"),
        ('{"timestamp": -1, "input_length": 5, "output_length": 1, "hash_ids": []}', "'timestamp'"),
        ('{"timestamp": 0, "input_length": 0, "output_length": 1, "hash_ids": []}', "'input_length'"),
        ('{"timestamp": 0, "input_length": 5, "output_length": 1.5, "hash_ids": []}', "'output_length'"),
        ('{"timestamp": 0, "input_length": 5, "output_length": 1, "hash_ids": [1, -2]}', "'hash_ids'"),
    ],
)
def test_a_malformed_line_names_its_line_number(tmp_path: Path, line: str, message: str) -> None:
    path = tmp_path / "bad.jsonl"
    path.write_text(json.dumps(LINES[0]) + "\n" + line + "\n")
    with pytest.raises(TraceError, match=message) as excinfo:
        read_trace(path)
    assert f"{path}:2:" in str(excinfo.value)


def test_a_missing_file_is_a_trace_error(tmp_path: Path) -> None:
    with pytest.raises(TraceError, match="cannot read trace"):
        read_trace(tmp_path / "absent.jsonl")


def test_the_real_trace_shares_block_zero_in_every_request(tmp_path: Path) -> None:
    head = tmp_path / "head.jsonl"
    with REAL_TRACE.open() as f:
        head.write_text("".join(next(f) for _ in range(200)))
    options = TraceOptions(input_scale=1 / 64)  # blocks of 8 tokens keep it fast
    requests = load_trace(head, options)
    assert len(requests) == 200
    block_zero = BlockTokens(8).block(0)
    assert all(r.hash_ids[0] == 0 and r.prompt[:8] == block_zero for r in requests)
    assert all(r.arrival_s >= 0 for r in requests)
    assert [r.arrival_s for r in requests] == sorted(r.arrival_s for r in requests)
    assert len({tuple(r.prompt) for r in requests}) == 200  # beyond the system prompt they differ


def test_a_gzip_trace_reads_as_its_jsonl(trace_file: Path, tmp_path: Path) -> None:
    packed = tmp_path / "trace.jsonl.gz"
    packed.write_bytes(gzip.compress(trace_file.read_bytes()))
    assert read_trace(packed) == read_trace(trace_file)
    broken = tmp_path / "broken.jsonl.gz"
    broken.write_bytes(packed.read_bytes()[:-12])
    with pytest.raises(TraceError, match="cannot read trace"):
        read_trace(broken)


def test_the_bundled_whole_trace_is_the_conversation_trace() -> None:
    entries = read_trace(CONVERSATION_TRACE)
    assert len(entries) == 12_031  # loadgen/data/README.md
    assert entries[:1000] == read_trace(BUNDLED_TRACE)
    assert entries[-1].timestamp_ms / 1000 == pytest.approx(3537, abs=1)


def test_a_spread_trace_starts_at_zero_and_spreads_each_tick_s_simultaneous_arrivals(tmp_path: Path) -> None:
    entries = [TraceEntry(t, 10 + i, 5, (i,)) for i, t in enumerate([6000.0, 6000.0, 6000.0, 9000.0, 12000.0, 12000.0])]
    spread = read_trace(write_spread(entries, tmp_path / "spread.jsonl"))
    assert [e.timestamp_ms for e in spread] == [0.0, 1000.0, 2000.0, 3000.0, 6000.0, 7500.0]
    assert [(e.input_length, e.output_length, e.hash_ids) for e in spread] == [
        (e.input_length, e.output_length, e.hash_ids) for e in entries]  # the same requests, in the same order
