"""A prefill instance's pipeline stage, its engine thread's side (no NATS): each step it runs is reported for the
Conductor's cost model as the whole model's would take (a stage of half the layers: twice its step), and the last
stage lets a prompt go once its first token is out."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from services.prefill.stage import PipelineStage
from shared.config import load_settings
from shared.model.stages import split_layers
from shared.wire.protocol import SamplingParams, Subjects

pytestmark = pytest.mark.slow


def _stage(make_engine, index: int) -> PipelineStage:
    settings = load_settings("prefill", {"TSUKIMI_CPP_GROUP": "p0,p1", "TSUKIMI_INSTANCE_ID": f"p{index}"})
    whole = make_engine(max_num_batched_tokens=128)
    engine = whole.stage_engine(split_layers(whole.model_config.num_layers, 2)[index], 32 << 20)
    bus = SimpleNamespace(max_payload=1 << 20, subjects=Subjects())
    return PipelineStage(settings, bus, engine)  # type: ignore[arg-type]


async def test_a_stage_reports_its_steps_as_the_whole_models(make_engine) -> None:
    stage = _stage(make_engine, 0)
    stage.engine.add_request("r", list(range(1, 300)), SamplingParams(max_tokens=4))
    outputs, busy = stage._tick()
    (out,) = outputs
    assert out.stage_rows is not None and out.stage_rows.shape[0] == 128 and busy
    (sample,) = stage.samples.take()
    stats = stage.engine.last_step
    assert stats is not None and sample == [128.0, float(stats.attention_work), pytest.approx(2 * stats.seconds)]
    stage._tick()
    assert len(stage.samples.take()) == 1  # one sample a step


async def test_the_last_stage_lets_a_prompt_go_at_its_first_token(make_engine) -> None:
    stage = _stage(make_engine, 1)
    prompt = list(range(1, 100))
    stage.engine.add_stage_request("r", prompt, SamplingParams(max_tokens=4), 0)
    first = make_engine()  # the rows a first stage would send: the whole model's first half
    rows_engine = first.stage_engine(split_layers(first.model_config.num_layers, 2)[0], 32 << 20)
    rows_engine.add_request("r", prompt, SamplingParams(max_tokens=4))
    (rows,) = rows_engine.step()
    assert rows.stage_rows is not None
    stage.engine.add_stage_input("r", rows.stage_rows)
    (out,), busy = stage._tick()
    assert len(out.new_token_ids) == 1 and not out.finished
    assert not busy and not stage.engine.has_unfinished()  # its part is done: nothing held for decoding here
