"""Placement with pipeline groups (issue 22): a prompt long enough for a group runs on it from its first stage, so
the group's later stages are no option for it while the first is alive; shorter prompts go anywhere; a heartbeat
that names a group without its sender, or a group of one, is refused on decode."""

from __future__ import annotations

import dataclasses
import time

import pytest
from test_scheduler import _beat, _cluster, _service, _submit

from shared.wire.block_hash import block_hashes
from shared.wire.protocol import Heartbeat, KvEvent, ProtocolError, Role, decode, encode

GROUP = ["p0", "p1"]


def _member(instance: str, queued: int = 0) -> Heartbeat:
    namespace = f"tsukimi/v1|0123456789abcdef|bf16@{instance}"  # its stage's block ids differ from the others'
    return dataclasses.replace(_beat(instance, Role.PREFILL, queued=queued), pipeline_group=GROUP,
                               pipeline_min_tokens=1000, pipeline_namespace=namespace)


async def test_long_prompts_start_at_the_first_stage_and_short_ones_go_anywhere() -> None:
    scheduler, _, _ = _service(TSUKIMI_POLICY="least_loaded")
    await _cluster(scheduler, _member("p0", queued=5000), _member("p1"), _beat("p2", Role.PREFILL, queued=9000),
                   _beat("d0", Role.DECODE))
    assert [b.instance_id for b in scheduler.view().for_prompt(1000).prefills] == ["p0", "p2"]
    assert (await scheduler.handle_submit(_submit("long", 1200))).prefill_id == "p0"  # p1 is idle, but a stage
    assert (await scheduler.handle_submit(_submit("short", 900))).prefill_id == "p1"


async def test_without_its_first_stage_a_group_member_takes_long_prompts_whole() -> None:
    scheduler, _, _ = _service(TSUKIMI_POLICY="least_loaded")
    await _cluster(scheduler, _member("p1"), _beat("p2", Role.PREFILL, queued=9000), _beat("d0", Role.DECODE))
    assert (await scheduler.handle_submit(_submit("long", 5000))).prefill_id == "p1"


@pytest.mark.parametrize("group", [["p1", "p2"], ["p0"], ["p0", "p0"], ["p0", "bad id"]])
def test_a_heartbeat_with_a_group_not_its_own_is_refused(group: list[str]) -> None:
    beat = dataclasses.replace(_member("p0"), pipeline_group=group, sent_at=time.time())
    with pytest.raises(ProtocolError):
        decode(encode(beat), Heartbeat)


async def test_a_long_prompt_on_a_group_is_predicted_through_the_pipeline() -> None:
    """Its chunks' time on one stage plus its last chunk's on the other (half of each step a stage), well under the
    whole prompt on one instance; a second long prompt waits for the first's predicted first token."""
    scheduler, _, _ = _service(TSUKIMI_POLICY="conductor", TSUKIMI_MAX_BATCHED_TOKENS="512")
    await _cluster(scheduler, _member("p0"), _member("p1"), _beat("d0", Role.DECODE))
    view = scheduler.view().for_prompt(3000)
    assert {lead: [b.instance_id for b in group] for lead, group in view.pipelines.items()} == {"p0": GROUP}
    option = view.prefill_option(view.prefills[0], _submit("long", 3000), use_pool=True)
    cost = view.prefill_cost
    chunks = [cost.predict(min(start + 512, 3000), start) for start in range(0, 3000, 512)]
    assert option.num_stages == 2 and option.queue_s == 0.0
    assert option.compute_s == pytest.approx((sum(chunks) + chunks[-1]) / 2)
    assert option.compute_s < 0.7 * cost.predict(3000, 0)
    reply = await scheduler.handle_submit(_submit("long", 3000))
    assert reply.accepted and reply.prefill_id == "p0" and scheduler.tracked["long"].num_stages == 2
    view = scheduler.view().for_prompt(3000)
    second = view.prefill_option(view.prefills[0], _submit("next", 3000), use_pool=True)
    assert second.queue_s == pytest.approx(scheduler.tracked["long"].decode_start - view.now, abs=0.05)
    assert view.queue_s(view.prefills[0]) == 0.0  # the pipelined prompt is not in the instance's own queue
    short = view.for_prompt(500)
    assert short.pipelines == {} and short.prefill_option(short.prefills[0], _submit("s", 500), True).num_stages == 1


async def test_a_group_missing_a_stage_runs_nothing_through_the_pipeline() -> None:
    scheduler, _, _ = _service(TSUKIMI_POLICY="conductor")
    await _cluster(scheduler, _member("p0"), _beat("d0", Role.DECODE))
    view = scheduler.view().for_prompt(3000)
    assert view.pipelines == {}
    assert view.prefill_option(view.prefills[0], _submit("long", 3000), use_pool=True).num_stages == 1


@pytest.mark.parametrize("bytes_per_s", [1e9, 1e5])
async def test_the_hidden_states_crossing_a_boundary_are_priced_at_the_measured_link(bytes_per_s: float) -> None:
    """Each chunk's rows cross to the next stage at the rate the instance measured from the cache-store: on a fast
    link they add the last chunk's crossing alone; on a slow one they pace the pipeline."""
    scheduler, _, _ = _service(TSUKIMI_POLICY="conductor", TSUKIMI_MAX_BATCHED_TOKENS="512")
    leader = dataclasses.replace(_member("p0"), pipeline_row_bytes=1152, fetch_bytes_per_s=bytes_per_s)
    await _cluster(scheduler, leader, _member("p1"), _beat("d0", Role.DECODE))
    view = scheduler.view().for_prompt(3000)
    option = view.prefill_option(view.prefills[0], _submit("long", 3000), use_pool=True)
    cost = view.prefill_cost
    sizes = [min(512, 3000 - start) for start in range(0, 3000, 512)]
    halves = [cost.predict(min(start + 512, 3000), start) / 2 for start in range(0, 3000, 512)]
    crossings = [n * 1152 / bytes_per_s for n in sizes]
    expected = sum(max(h, x) for h, x in zip(halves, crossings, strict=True)) + halves[-1] + crossings[-1]
    assert option.compute_s == pytest.approx(expected)
    no_link = (sum(halves) + halves[-1])
    if bytes_per_s == 1e9:
        assert option.compute_s == pytest.approx(no_link + crossings[-1]) and crossings[-1] < 0.001
    else:
        assert option.compute_s > 2 * no_link  # 2.9 s of crossings for 3000 rows of 1,152 bytes


async def test_a_pipelined_prompt_reuses_what_every_stage_holds_under_its_own_namespace() -> None:
    """The index knows each stage's blocks by the namespace its heartbeat names: the first stage's own cache is
    reused; a longer prefix in the cache-store counts only as far as the store holds it for every stage, fetched by
    the stages side by side; blocks under the whole model's namespace count for nothing."""
    scheduler, bus, _ = _service(TSUKIMI_POLICY="conductor", TSUKIMI_MAX_BATCHED_TOKENS="512")
    p0, p1 = _member("p0"), _member("p1")
    await _cluster(scheduler, p0, p1, _beat("d0", Role.DECODE), _beat("c0", Role.CACHE_STORE))
    request = _submit("long", 3000, hashes=list(range(1000, 1046)))
    size = scheduler.view().block_size
    stage0, stage1 = (block_hashes(request.prompt_ids, size, b.pipeline_namespace.encode()) for b in (p0, p1))
    view = scheduler.view().for_prompt(3000)
    cold = view.prefill_option(view.prefills[0], request, use_pool=True)
    await scheduler.handle_kv_event(KvEvent("c0", 1, 0, "stored", request.block_hashes))  # the whole model's: unused
    await scheduler.handle_kv_event(KvEvent("p0", 1, 0, "stored", stage0[:10]))
    await scheduler.handle_kv_event(KvEvent("c0", 1, 1, "stored", stage0[:30] + stage1[:20]))
    view = scheduler.view().for_prompt(3000)
    option = view.prefill_option(view.prefills[0], request, use_pool=True)
    assert (option.num_local_blocks, option.num_pool_blocks, option.fetch_from_pool) == (10, 20, True)
    assert option.compute_s == pytest.approx(view.prefill_cost.pipeline_s(3000, 20 * size, 2, 512))
    assert option.fetch_s == pytest.approx(10 * p0.block_bytes / 2 / 300e6)
    assert option.compute_s < 0.8 * cold.compute_s
    local_only = view.prefill_option(view.prefills[0], request, use_pool=False)
    assert (local_only.num_reused_blocks, local_only.fetch_s) == (10, 0.0)
    reply = await scheduler.handle_submit(request)
    assert reply.accepted and scheduler.tracked["long"].num_new_tokens == 3000 - 20 * size
