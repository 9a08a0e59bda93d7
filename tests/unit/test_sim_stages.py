"""Pipeline stages of the sim engine (issue 22 on the virtual clock): a stage taken of a whole sim engine models its
layers alone (its step time, its KV, its block namespace), passes meta rows to the next stage, and two stages
prefill a prompt into the same first token as the whole engine, in the time of their layers' shares."""

from __future__ import annotations

import pytest

import shared.sim.engine as sim_engine
from shared.engine.config import EngineConfig
from shared.engine.engine import LLMEngine
from shared.model.stages import split_layers
from shared.sim.cost import step_time
from shared.sim.engine import SimRunner, build_sim_engine, stage_profile
from shared.wire.protocol import SamplingParams
from tests.unit.test_sim_engine import BLOCK, CHUNK, PROFILE, FakeTime, prefill_work, prompt

PARAMS = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)


@pytest.fixture
def clock(monkeypatch: pytest.MonkeyPatch) -> FakeTime:
    fake = FakeTime()
    monkeypatch.setattr(sim_engine, "time", fake)
    return fake


def _whole() -> LLMEngine:
    return build_sim_engine(PROFILE.name, EngineConfig(block_size=BLOCK, max_num_batched_tokens=CHUNK))


def _stages(whole: LLMEngine, num_stages: int) -> list[LLMEngine]:
    return [whole.stage_engine(layers, 0) for layers in split_layers(whole.model_config.num_layers, num_stages)]


def test_a_stage_models_its_layers_alone() -> None:
    whole = _whole()
    first, last = _stages(whole, 2)
    runner = first.runner
    assert isinstance(runner, SimRunner) and runner.stage_profile.model.num_layers == 40
    assert first.store.block_format == whole.store.block_format  # per layer, the same KV
    assert first.store.num_layers == 40 and whole.store.num_layers == 80  # of which it holds its layers'
    namespaces = {e.block_manager.namespace for e in (whole, first, last)}
    assert len(namespaces) == 3  # a stage's blocks are never another stage's or the whole model's
    assert first.block_manager.num_blocks == whole.block_manager.num_blocks  # as many tokens as the whole model's
    with pytest.raises(ValueError, match="not of a stage"):
        first.stage_engine(split_layers(80, 2)[0], 0)
    with pytest.raises(ValueError, match="take a stage of it with stage_engine"):
        build_sim_engine(PROFILE.name, EngineConfig(block_size=BLOCK, stage=split_layers(80, 2)[0]))


def test_two_stages_prefill_as_the_whole_engine_in_their_layers_time(clock: FakeTime) -> None:
    whole = _whole()
    ids = prompt(3 * CHUNK + 100)
    (expected,) = whole.generate([ids], SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True))
    first, last = _stages(_whole(), 2)
    first.add_request("r", ids, PARAMS)
    last.add_stage_request("r", ids, PARAMS, 0)
    first_seconds, chunks = 0.0, []
    while first.has_unfinished():
        before = clock.now
        for out in first.step():
            assert out.stage_rows is not None and out.stage_rows.is_meta
            assert out.stage_rows.shape[1] == PROFILE.model.hidden_size
            chunks.append(out.stage_rows)
        first_seconds += clock.now - before
    assert [c.shape[0] for c in chunks] == [CHUNK, CHUNK, CHUNK, 100]
    outputs, last_seconds = [], 0.0
    for rows in chunks:
        last.add_stage_input("r", rows)
        before = clock.now
        outputs += last.step()
        last_seconds += clock.now - before
    assert [o.new_token_ids for o in outputs if o.new_token_ids] == [expected.token_ids]
    # Each stage steps through the same chunks with half the layers: half the whole model's matmuls and attention
    # (the embeddings and the LM head stay counted at both; the first stage samples nothing).
    works = [prefill_work(CHUNK, i * CHUNK, False) for i in range(3)] + [prefill_work(100, 3 * CHUNK, True)]
    whole_s = sum(step_time(PROFILE, w).total for w in works)
    half = stage_profile(PROFILE, split_layers(80, 2)[1])
    assert last_seconds == pytest.approx(sum(step_time(half, w).total for w in works))
    assert 0.45 * whole_s < first_seconds <= last_seconds < 0.6 * whole_s


def test_a_later_stage_cannot_step_past_the_rows_it_has(clock: FakeTime) -> None:
    first, last = _stages(_whole(), 2)
    ids = prompt(2 * CHUNK)
    last.add_stage_request("r", ids, PARAMS, 0)
    assert last.step() == []  # no rows yet: nothing to compute
    first.add_request("r", ids, PARAMS)
    (out,) = first.step()
    last.add_stage_input("r", out.stage_rows)
    assert last.step() == [] and last.has_unfinished()  # one chunk computed, the prompt's end still to come
