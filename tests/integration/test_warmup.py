"""The warm-up steps an instance times before serving, on the real model: enough samples for the scheduler's fit
(it needs 8), over the sizes it will predict, and nothing left behind in the engine."""

from __future__ import annotations

from services.common.warmup import DECODE_BATCHES, PROMPT_LENGTHS, time_decode_steps, time_prefill_steps
from services.scheduler.cost_model import DecodeCostModel, PrefillCostModel


def test_warmup_steps_fit_the_cost_models_and_leave_the_engine_empty(make_engine) -> None:
    engine = make_engine(max_num_batched_tokens=1024)
    prefill = time_prefill_steps(engine)
    assert [s.num_new_tokens for s in prefill] == list(PROMPT_LENGTHS[1:])  # the cold first step is dropped
    decode = time_decode_steps(engine)
    assert {int(batch) for batch, _, _ in decode} == set(DECODE_BATCHES)
    assert not engine.has_unfinished()
    assert not [rid for rid in ("warmup-prefill-16", "warmup-decode-32-0") if rid in engine.block_manager]
    prefill_model, decode_model = PrefillCostModel(), DecodeCostModel()
    for stats in prefill:
        prefill_model.add_step(stats.num_new_tokens, stats.attention_work, stats.seconds)
    for sample in decode:
        decode_model.add_step(*sample)
    assert prefill_model.model.num_samples >= 8 and decode_model.model.num_samples >= 8
    measured = {s.num_new_tokens: s.seconds for s in prefill}
    # the fit follows this machine (loosely: one wall-clock sample each, on a machine that may be busy)
    assert 0.5 < prefill_model.predict(512, 0) / measured[512] < 2.0
