"""The continuous-batching scheduler on the real block manager, without a model: budgets, chunks, preemption."""

from __future__ import annotations

from shared.engine.batching import Scheduler
from shared.engine.blocks import BlockManager
from shared.engine.sequence import Sequence, SequenceStatus
from shared.wire.protocol import SamplingParams

PARAMS = SamplingParams(max_tokens=8, temperature=0.0)


def seq(name: str, num_tokens: int) -> Sequence:
    tokens = [(hash(name) + i) % 1000 for i in range(num_tokens)]
    return Sequence(name, tokens, num_tokens, PARAMS)


def run_step(scheduler: Scheduler) -> list[tuple[str, int]]:
    """Plan, pretend to compute, and sample a token for every completed sequence."""
    plan = scheduler.schedule()
    scheduler.finish_step(plan)
    for chunk in plan.chunks:
        if chunk.seq.num_computed_tokens == chunk.seq.num_tokens:
            chunk.seq.token_ids.append(7)
    return [(c.seq.request_id, c.num_tokens) for c in plan.chunks]


def test_long_prompt_is_prefilled_in_chunks_of_the_budget() -> None:
    scheduler = Scheduler(BlockManager(64, 4), max_num_seqs=4, max_num_batched_tokens=10)
    scheduler.add(seq("a", 25))
    assert [run_step(scheduler) for _ in range(4)] == [[("a", 10)], [("a", 10)], [("a", 5)], [("a", 1)]]


def test_decodes_go_first_and_prefills_fill_the_rest() -> None:
    scheduler = Scheduler(BlockManager(64, 4), max_num_seqs=4, max_num_batched_tokens=8)
    scheduler.add(seq("a", 3))
    run_step(scheduler)
    scheduler.add(seq("b", 20))
    assert run_step(scheduler) == [("a", 1), ("b", 7)]
    assert run_step(scheduler) == [("a", 1), ("b", 7)]


def test_max_num_seqs_bounds_the_running_batch() -> None:
    scheduler = Scheduler(BlockManager(64, 4), max_num_seqs=2, max_num_batched_tokens=100)
    for name in "abc":
        scheduler.add(seq(name, 3))
    assert [name for name, _ in run_step(scheduler)] == ["a", "b"]
    assert [s.request_id for s in scheduler.waiting] == ["c"]


def test_full_pool_preempts_the_newest_and_requeues_it_first() -> None:
    manager = BlockManager(4, 4)
    scheduler = Scheduler(manager, max_num_seqs=4, max_num_batched_tokens=100)
    a, b = seq("a", 8), seq("b", 8)
    scheduler.add(a)
    scheduler.add(b)
    run_step(scheduler)  # both prompts fill 2 blocks each: the pool is full
    plan = scheduler.schedule()  # a's next token needs a fifth block
    assert plan.preempted == [b]
    assert [c.seq.request_id for c in plan.chunks] == ["a"]
    assert b.status is SequenceStatus.WAITING and b.num_computed_tokens == 0
    assert scheduler.waiting[0] is b and "b" not in manager
    manager.check_invariants()


def test_prefix_cache_is_published_only_when_enabled() -> None:
    for enabled, expected in ((True, 8), (False, 0)):
        manager = BlockManager(16, 4)
        scheduler = Scheduler(manager, max_num_seqs=4, max_num_batched_tokens=100, enable_prefix_caching=enabled)
        first = seq("a", 9)
        scheduler.add(first)
        run_step(scheduler)
        twin = Sequence("twin", list(first.token_ids[:9]), 9, PARAMS)
        scheduler.add(twin)
        run_step(scheduler)
        assert twin.num_cached_tokens == expected
