"""Admission that judges what the SLO judges: a request's slowest tenth of gaps (its first, and steps that compute
prompts queued on its decode instance), decode's sequence cap, prefill queues computed in steps (prompts share a
step), and prefill on decode only where the step computing it fits the TBT SLO."""

from __future__ import annotations

import dataclasses
import time

import pytest
from test_scheduler import _beat, _cluster, _service, _submit

from shared.wire.protocol import Heartbeat, Role, attention_work


def _decode(queued: int = 0, running: int = 0, max_num_seqs: int = 0) -> Heartbeat:
    return Heartbeat("d0", Role.DECODE, 1, time.time(), num_running=running, num_queued_tokens=queued,
                     max_num_seqs=max_num_seqs, block_bytes=1 << 20)


async def test_a_short_answer_is_judged_on_its_first_gap_and_a_long_one_on_its_steps() -> None:
    scheduler, _, _ = _service()
    await _cluster(scheduler, _beat("p0", Role.PREFILL), _decode())
    view = scheduler.view()
    beat = view.decodes[0]
    step = view.tbt_s(beat, None, 100)
    assert view.judged_tbt_s(beat, None, _submit("short", 100, max_tokens=2)) == pytest.approx(2 * step)
    long = view.judged_tbt_s(beat, None, _submit("long", 100, max_tokens=201))  # 200 gaps: the slowest 20
    assert long == pytest.approx((2 * step + 19 * step) / 20)


async def test_prompts_queued_on_decode_are_slow_gaps_of_everyone_decoding_there() -> None:
    scheduler, _, _ = _service(TSUKIMI_MAX_BATCHED_TOKENS="512")
    await _cluster(scheduler, _beat("p0", Role.PREFILL), _decode(queued=1000))
    view = scheduler.view()
    beat = view.decodes[0]
    step = view.tbt_s(beat, None, 100)
    chunks = [view.prefill_cost.predict(512, 0), view.prefill_cost.predict(488, 0)]
    judged = view.judged_tbt_s(beat, None, _submit("r", 100, max_tokens=31))  # 30 gaps: the slowest 3
    assert judged == pytest.approx((2 * step + step + chunks[0] + step + chunks[1]) / 3)


async def test_a_full_decode_batch_refuses_instead_of_queueing_there() -> None:
    scheduler, _, _ = _service(TSUKIMI_REJECTION="predicted")
    await _cluster(scheduler, _beat("p0", Role.PREFILL), _decode(running=4, max_num_seqs=4))
    reply = await scheduler.handle_submit(_submit("r1", 100))
    assert not reply.accepted and reply.reason_code == "tbt_slo" and "batch is full (4 sequences)" in reply.reason
    await scheduler.handle_heartbeat(_decode(running=3, max_num_seqs=4))
    assert (await scheduler.handle_submit(_submit("r2", 100, max_tokens=500))).accepted
    assert not (await scheduler.handle_submit(_submit("r3", 100))).accepted  # r2 took the last seat, and keeps it


async def test_prompts_placed_on_a_prefill_instance_share_its_steps() -> None:
    scheduler, _, _ = _service(TSUKIMI_MAX_BATCHED_TOKENS="512", TSUKIMI_LOCAL_PREFILL_TOKENS="0")
    await _cluster(scheduler, _beat("p0", Role.PREFILL), _decode())
    for i in range(20):
        assert (await scheduler.handle_submit(_submit(f"r{i}", 20))).accepted
    view = scheduler.view()
    model, short = view.prefill_cost.model, attention_work(20, 0)
    assert view.queue_s(view.prefills[0]) == pytest.approx(model.predict(400, 20 * short))  # one step's overhead
    assert view.queue_s(view.prefills[0]) < 20 * view.prefill_cost.predict(20, 0)
    for i in range(20, 40):
        await scheduler.handle_submit(_submit(f"r{i}", 20))
    assert scheduler.view().queue_s(view.prefills[0]) == pytest.approx(2 * model.predict(400, 20 * short))


def _prefill_queue(tokens: int, work: int) -> Heartbeat:
    return Heartbeat("p0", Role.PREFILL, 1, time.time(), num_queued_tokens=tokens, queued_attention_work=work,
                     block_bytes=1 << 20)


async def test_a_prompt_behind_a_queue_gets_its_first_token_at_the_end_of_the_step_holding_its_last() -> None:
    scheduler, _, _ = _service(TSUKIMI_MAX_BATCHED_TOKENS="512")
    await _cluster(scheduler, _prefill_queue(700, 7 * attention_work(100, 0)), _decode())  # seven 100-token prompts
    view = scheduler.view()
    model, own = view.prefill_cost.model, attention_work(300, 0)
    behind = view.prefill_option(view.prefills[0], _submit("r", 300), use_pool=False)
    # 1,000 tokens: its first token at the end of the second step, both full
    assert behind.ttft_s == pytest.approx(2 * model.predict(500, (7 * attention_work(100, 0) + own) / 2))
    assert behind.compute_s == pytest.approx(view.prefill_cost.predict(300, 0))
    await _cluster(scheduler, _prefill_queue(700, attention_work(3000, 2300)))  # the last 700 of a 3,000-token prompt
    view = scheduler.view()
    long = view.prefill_option(view.prefills[0], _submit("r", 300), use_pool=False)
    assert long.ttft_s == pytest.approx(2 * model.predict(500, (attention_work(3000, 2300) + own) / 2))
    assert long.ttft_s > behind.ttft_s  # its tokens attend to 2,300 more keys each
    await _cluster(scheduler, _prefill_queue(0, 0))
    view = scheduler.view()
    alone = view.prefill_option(view.prefills[0], _submit("r", 300), use_pool=False)
    assert (alone.queue_s, alone.ttft_s) == (0.0, pytest.approx(view.prefill_cost.predict(300, 0)))


async def test_each_instance_is_priced_in_steps_of_the_budget_its_heartbeat_reports() -> None:
    scheduler, _, _ = _service(TSUKIMI_MAX_BATCHED_TOKENS="512")
    queue = dataclasses.replace(_prefill_queue(700, 7 * attention_work(100, 0)), max_batched_tokens=2048)
    await _cluster(scheduler, queue, _decode())
    view = scheduler.view()
    model, work = view.prefill_cost.model, 7 * attention_work(100, 0) + attention_work(300, 0)
    behind = view.prefill_option(view.prefills[0], _submit("r", 300), use_pool=False)
    assert behind.ttft_s == pytest.approx(model.predict(1000, work))  # one step of 2,048 holds all 1,000 tokens
    await _cluster(scheduler, dataclasses.replace(queue, max_batched_tokens=0))  # not reported: the scheduler's own
    view = scheduler.view()
    behind = view.prefill_option(view.prefills[0], _submit("r", 300), use_pool=False)
    assert behind.ttft_s == pytest.approx(2 * model.predict(500, work / 2))


async def test_the_conductor_prefills_on_decode_only_where_the_step_fits_the_tbt_slo() -> None:
    for queued_on_decode, expected in ((0, True), (4000, False)):
        scheduler, _, _ = _service(TSUKIMI_POLICY="conductor", TSUKIMI_SLO_TBT_MS="500",
                                   TSUKIMI_MAX_BATCHED_TOKENS="512")
        await _cluster(scheduler, _beat("p0", Role.PREFILL, queued=3000), _decode(queued=queued_on_decode))
        reply = await scheduler.handle_submit(_submit("short", 50))
        assert reply.accepted
        assert (reply.prefill_id == "d0") is expected, queued_on_decode  # 4000 queued: +1 s a step, past the SLO
