"""An engine step that raises on the real model: only the request that causes it fails (with the error), the others
finish with exactly the tokens they get without it, every block is freed, and an engine whose every step fails says
it is broken. Token ids outside the vocabulary never reach a step."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest

from shared.engine.engine import LLMEngine
from shared.engine.sequence import FinishReason
from shared.wire.protocol import SamplingParams

GREEDY = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
TEXTS = ["The capital of France is", "Once upon a time", "1, 2, 3, 4,", "The weather today is", "Dear diary,",
         "In the beginning"]


def _poison(engine: LLMEngine, request_id: str, fails: Callable[[int], bool]) -> list[int]:
    """Make the runner raise on steps that include `request_id` (the `n`-th such step raises when `fails(n)`), as a
    fault of that request's inputs would. Returns the list of the step sizes that raised."""
    execute, raised, seen = engine.runner.execute, [], [0]

    def faulty(plan: Any, *args: Any) -> Any:
        ids = [chunk.seq.request_id for chunk in plan.chunks]
        if request_id in ids:
            seen[0] += 1
            if fails(seen[0]):
                raised.append(len(ids))
                raise IndexError("index out of range in self")
        return execute(plan, *args)

    engine.runner.execute = faulty  # type: ignore[method-assign]
    return raised


def _drain(engine: LLMEngine) -> dict[str, Any]:
    tokens: dict[str, list[int]] = {}
    ends: dict[str, Any] = {}
    while engine.has_unfinished():
        for out in engine.step():
            tokens.setdefault(out.request_id, []).extend(out.new_token_ids)
            if out.finished:
                ends[out.request_id] = (out.finish_reason, out.error)
    return {"tokens": tokens, "ends": ends}


def test_the_poisoned_request_alone_fails_and_the_batch_finishes_as_without_it(checkpoint, engine) -> None:
    prompts = {f"r{i}": checkpoint.tokenizer.encode(t) for i, t in enumerate(TEXTS)}
    expected = {rid: c.token_ids for rid, c in zip(prompts, engine.generate(list(prompts.values()), GREEDY),
                                                   strict=True)}
    execute = engine.runner.execute
    raised = _poison(engine, "r3", lambda n: n >= 3)  # its third step on: mid-generation, in a full batch
    try:
        for rid, ids in prompts.items():
            engine.add_request(rid, ids, GREEDY)
        result = _drain(engine)
    finally:
        engine.runner.execute = execute  # type: ignore[method-assign]
    assert result["ends"]["r3"] == (FinishReason.ERROR, "IndexError: index out of range in self")
    for rid in prompts.keys() - {"r3"}:
        assert result["ends"][rid][0] == FinishReason.LENGTH
        assert result["tokens"][rid] == expected[rid], rid  # recomputed after the failed steps, same greedy tokens
    assert raised[0] == len(prompts) and raised[-1] == 1  # the whole batch first, the culprit alone last
    assert len(raised) <= 4  # bisection of 6: not one step per request
    engine.block_manager.check_invariants()
    assert not [rid for rid in prompts if rid in engine.block_manager]  # every table freed, the culprit's too
    assert not engine.is_broken
    engine.add_request("after", prompts["r0"], GREEDY)  # and it serves on
    assert _drain(engine)["tokens"]["after"] == expected["r0"]


def test_an_engine_whose_every_step_fails_is_broken(checkpoint, make_engine) -> None:
    engine = make_engine(kv_cache_bytes=8 << 20)
    execute = engine.runner.execute

    def broken(*args: Any) -> Any:
        raise RuntimeError("CUDA error: an illegal memory access was encountered")

    engine.runner.execute = broken  # type: ignore[method-assign]
    for i in range(20):
        engine.add_request(f"r{i}", checkpoint.tokenizer.encode(TEXTS[i % len(TEXTS)]), GREEDY)
    steps = 0
    while not engine.is_broken and steps < 100:
        engine.step()
        steps += 1
    assert engine.is_broken
    engine.runner.execute = execute  # type: ignore[method-assign]


@pytest.mark.parametrize("bad", [[1, 2, 49_152], [-1], [60_000]])
def test_token_ids_outside_the_vocabulary_are_refused_before_any_step(engine, bad: list[int]) -> None:
    with pytest.raises(ValueError, match="outside the vocabulary of 49152"):
        engine.add_request("bad", bad, GREEDY)
    assert not engine.has_unfinished()
