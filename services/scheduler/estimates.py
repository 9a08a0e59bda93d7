"""What the scheduler predicts about the cluster at the moment of one decision: prefill queue time, a request's TTFT
on each prefill instance (queue + compute + fetching the pool's prefix), and the TBT of each decode instance now or
at the moment the request would reach it. Built from heartbeats, the block index and the cost models.
"""

from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass, field

from services.scheduler.cost_model import DecodeCostModel, PrefillCostModel
from services.scheduler.index import BlockIndex
from shared.wire.block_hash import block_hashes
from shared.wire.protocol import Heartbeat, SubmitRequest, attention_work

# A task placed this long before a heartbeat left may not have reached the instance yet (NATS delivery under load).
DELIVERY_GRACE_S = 1.0
DEFAULT_LINK_BYTES_PER_S = 300e6  # loopback NATS, measured by benchmarks/kv_transfer.py, until prefill reports its own


@dataclass
class Tracked:
    """A placed request as the scheduler predicts it: when it reaches decode and when it leaves."""

    request_id: str
    prefill_id: str
    decode_id: str
    num_tokens: int
    prefill_s: float  # predicted compute on its prefill instance
    placed_at: float  # unix seconds
    decode_start: float  # predicted unix time of its first decode step
    decode_end: float  # predicted unix time of its last token (max_tokens at the predicted TBT)
    num_new_tokens: int = 0  # of its prompt, to compute on its prefill instance (not reused)
    num_stages: int = 1  # > 1: computed by the pipeline group its prefill instance leads, not by that instance alone


@dataclass
class PrefillOption:
    instance_id: str
    num_local_blocks: int
    num_pool_blocks: int
    fetch_from_pool: bool
    queue_s: float
    compute_s: float
    fetch_s: float
    num_stages: int = 1  # > 1: the pipeline group this instance leads computes it

    @property
    def ttft_s(self) -> float:
        return self.queue_s + self.compute_s + self.fetch_s

    @property
    def num_reused_blocks(self) -> int:
        return self.num_pool_blocks if self.fetch_from_pool else self.num_local_blocks


@dataclass
class ClusterView:
    """Everything a placement policy may look at for one request."""

    prefills: list[Heartbeat]
    decodes: list[Heartbeat]
    store_ids: list[str]
    index: BlockIndex
    prefill_cost: PrefillCostModel
    decode_cost: DecodeCostModel
    tracked: dict[str, Tracked]
    block_size: int
    balance_ratio: float
    now: float = field(default_factory=time.time)
    max_batched_tokens: int = 2048  # a step's token budget where a heartbeat does not report its instance's
    # First stages that would run this prompt: their groups' heartbeats, first stage first.
    pipelines: dict[str, list[Heartbeat]] = field(default_factory=dict)

    # ---- prefill ------------------------------------------------------------------------------------------------

    def for_prompt(self, num_tokens: int) -> ClusterView:
        """The view a prompt of `num_tokens` is placed in: one long enough for a pipeline group
        (`Heartbeat.pipeline_group`) runs on it from its first stage, so, while that one is alive, the group's other
        instances are no option for it (shorter prompts run whole on any instance)."""
        beats = {b.instance_id: b for b in self.prefills}

        def is_later_stage(beat: Heartbeat) -> bool:
            group = beat.pipeline_group
            return bool(group) and group[0] != beat.instance_id and group[0] in beats and (
                num_tokens >= beat.pipeline_min_tokens)

        prefills = [b for b in self.prefills if not is_later_stage(b)]
        pipelines = {b.instance_id: [beats[i] for i in b.pipeline_group] for b in prefills
                     if b.pipeline_group and b.pipeline_group[0] == b.instance_id
                     and num_tokens >= b.pipeline_min_tokens and set(beats).issuperset(b.pipeline_group)}
        if len(prefills) == len(self.prefills) and pipelines == self.pipelines:
            return self
        return dataclasses.replace(self, prefills=prefills, pipelines=pipelines)

    def budget(self, beat: Heartbeat) -> int:
        """The most tokens a step of this instance runs (TSUKIMI_MAX_BATCHED_TOKENS, its heartbeat's, else this
        scheduler's): the chunk a long prompt is computed in."""
        return beat.max_batched_tokens or self.max_batched_tokens

    def queued_work(self, beat: Heartbeat) -> tuple[int, float]:
        """Prompt tokens waiting at this prefill instance, and their attention work: what its heartbeat reports (of a
        prompt part-computed, what is left of it) plus what was placed there since (not in the heartbeat yet)."""
        tokens, work = beat.num_queued_tokens, beat.queued_attention_work
        for t in self.tracked.values():
            if t.prefill_id == beat.instance_id and _unreported(t, beat) and t.num_stages == 1:
                tokens += t.num_new_tokens
                work += attention_work(t.num_tokens, t.num_tokens - t.num_new_tokens)
        return tokens, work

    def queue_s(self, beat: Heartbeat) -> float:
        """Predicted seconds of prefill work ahead at this instance, in steps of the token budget (prompts share a
        step)."""
        return self.prefill_cost.queue_s(*self.queued_work(beat), self.budget(beat))

    def prefill_option(self, beat: Heartbeat, request: SubmitRequest, use_pool: bool) -> PrefillOption:
        """TTFT on one prefill instance; with `use_pool`, fetch the pool's prefix when it is `balance_ratio` times
        longer than the local one (DESIGN section 5), which also replicates a hot prefix onto this instance. On the
        first stage of a pipeline group that would run the prompt (`for_prompt`), the group's time instead."""
        if beat.instance_id in self.pipelines:
            return self._pipeline_option(beat, request, self.pipelines[beat.instance_id], use_pool)
        hashes = request.block_hashes
        usable = hashes[: max(len(request.prompt_ids) - 1, 0) // self.block_size]  # the last token is computed
        local = self.index.prefix_len(beat.instance_id, usable)
        pool = self.index.pool_prefix_len(self.store_ids, usable) if use_pool else 0
        fetch = pool > local and pool >= self.balance_ratio * max(local, 1)
        reused = (pool if fetch else local) * self.block_size
        fetch_bytes = (pool - local) * beat.block_bytes if fetch else 0
        rate = beat.fetch_bytes_per_s or DEFAULT_LINK_BYTES_PER_S
        compute = self.prefill_cost.predict(len(request.prompt_ids), reused)
        wait = self._wait_s(beat, len(request.prompt_ids), reused, compute)
        return PrefillOption(beat.instance_id, local, pool, fetch, wait, compute, fetch_bytes / rate)

    def _pipeline_option(self, beat: Heartbeat, request: SubmitRequest, stages: list[Heartbeat],
                         use_pool: bool) -> PrefillOption:
        """TTFT on the pipeline group `beat` leads: the prompts it already leads first (each until its predicted first
        token: the group computes them in order), then its chunks through the stages, their hidden states crossing
        each boundary at the rate the instance measures from the cache-store (the same network; a default before it
        has measured one). It starts after the prefix the first stage will reuse, as `PipelineStage` decides: its own
        cache's, or, when longer, the longest prefix the cache-store holds for every stage's layers, each stage then
        fetching its own layers of it at once (the index knows each stage's blocks by its namespace)."""
        size = self.block_size
        usable = max(len(request.prompt_ids) - 1, 0) // size
        local = pool = 0
        if all(s.pipeline_namespace for s in stages):
            hashes = [block_hashes(request.prompt_ids[: usable * size], size, s.pipeline_namespace.encode())
                      for s in stages]
            local = self.index.prefix_len(beat.instance_id, hashes[0])
            if use_pool:
                pool = min(self.index.pool_prefix_len(self.store_ids, h) for h in hashes)
        fetch = pool > local
        reused = (pool if fetch else local) * size
        rate = beat.fetch_bytes_per_s or DEFAULT_LINK_BYTES_PER_S
        fetch_s = (pool - local) * beat.block_bytes / len(stages) / rate if fetch else 0.0
        compute = self.prefill_cost.pipeline_s(len(request.prompt_ids), reused, len(stages), self.budget(beat),
                                               beat.pipeline_row_bytes / rate)
        ahead = [t.decode_start for t in self.tracked.values() if t.prefill_id == beat.instance_id and t.num_stages > 1]
        wait = max(max(ahead, default=self.now) - self.now, 0.0)
        return PrefillOption(beat.instance_id, local, pool, fetch, wait, compute, fetch_s, len(stages))

    def _wait_s(self, beat: Heartbeat, num_tokens: int, num_reused: int, compute_s: float) -> float:
        """What a prompt waits beyond its own compute. Prefill runs FIFO steps of the token budget, and a prompt's first
        token comes at the end of the step holding its last token: behind a queue, the steps that compute the queue
        and the prompt together (full: the prompts after it share the last), less its own compute; alone, nothing."""
        tokens, work = self.queued_work(beat)
        if tokens <= 0:
            return 0.0
        together = self.prefill_cost.queue_s(tokens + num_tokens - num_reused,
                                             work + attention_work(num_tokens, num_reused), self.budget(beat))
        return max(together - compute_s, 0.0)

    def transfer_s(self, request: SubmitRequest, beat: Heartbeat) -> float:
        """Moving the prompt's KV prefill -> decode (overlapped with compute layer by layer; what is left is about one
        layer's share, but a slow link can make it the bottleneck)."""
        num_blocks = -(-len(request.prompt_ids) // self.block_size)
        return num_blocks * beat.block_bytes / (beat.fetch_bytes_per_s or DEFAULT_LINK_BYTES_PER_S)

    # ---- decode -------------------------------------------------------------------------------------------------

    def decode_batch(self, beat: Heartbeat, at_time: float | None) -> int:
        """Sequences on this decode instance: now (heartbeat plus placements since), or predicted at `at_time`, when
        requests now decoding may have finished (Mooncake's prediction-based early rejection)."""
        mine = [t for t in self.tracked.values() if t.decode_id == beat.instance_id]
        since = sum(1 for t in mine if _unreported(t, beat))
        now_count = beat.num_running + beat.num_waiting + since
        if at_time is None:
            return now_count
        untracked = max(now_count - len(mine), 0)  # e.g. placed before this scheduler started
        return untracked + sum(1 for t in mine if t.decode_end > at_time)

    def tbt_s(self, beat: Heartbeat, at_time: float | None, extra_tokens: int) -> float:
        """Predicted step time with this request added (`extra_tokens` of context)."""
        batch = self.decode_batch(beat, at_time) + 1
        context = beat.kv_blocks_used * self.block_size + extra_tokens
        return self.decode_cost.predict(batch, context)

    def local_prefill_tokens(self, beat: Heartbeat) -> int:
        """Prompt tokens waiting to be computed on this decode instance itself: what its heartbeat reports, plus the
        prompts placed there since."""
        since = sum(t.num_tokens for t in self.tracked.values()
                    if t.prefill_id == t.decode_id == beat.instance_id and _unreported(t, beat))
        return beat.num_queued_tokens + since

    def interleaved_step_s(self, beat: Heartbeat, at_time: float | None, extra_tokens: int,
                           prefill_tokens: int) -> float:
        """A step of this decode instance (with this request added) that also computes a chunk of the prompts
        queued there: every request decoding there sees it as one gap."""
        chunk = min(prefill_tokens, self.budget(beat))
        return self.tbt_s(beat, at_time, extra_tokens) + (self.prefill_cost.predict(chunk, 0) if chunk else 0.0)

    def judged_tbt_s(self, beat: Heartbeat, at_time: float | None, request: SubmitRequest) -> float:
        """The TBT an SLO judges, predicted: the mean of the slowest tenth of the request's gaps. Its slowest are its
        first (it joins after the step in progress, then its own runs: two steps), and the steps that compute the
        prompts queued on the instance, a chunk of the token budget each; the others are plain steps."""
        step = self.tbt_s(beat, at_time, len(request.prompt_ids))
        num_slowest = -(-max(request.sampling.max_tokens - 1, 1) // 10)  # ceil(gaps / 10)
        gaps = [2 * step]
        queued = self.local_prefill_tokens(beat)
        while queued > 0 and len(gaps) < num_slowest:
            chunk = min(queued, self.budget(beat))
            gaps.append(step + self.prefill_cost.predict(chunk, 0))
            queued -= chunk
        gaps += [step] * (num_slowest - len(gaps))
        return sum(sorted(gaps, reverse=True)[:num_slowest]) / num_slowest

    def has_seat(self, beat: Heartbeat, at_time: float | None) -> bool:
        """The instance's batch has room for one more sequence (now, or at `at_time`); without one the request would
        wait there for a sequence to finish."""
        return not beat.max_num_seqs or self.decode_batch(beat, at_time) < beat.max_num_seqs


def _unreported(tracked: Tracked, beat: Heartbeat) -> bool:
    """A placement on `beat`'s instance that the heartbeat cannot show: placed after it left, or shortly before and
    not among the requests it lists (the task was still on its way; a request it lists is in its figures already)."""
    return tracked.placed_at > beat.sent_at or (
        tracked.placed_at > beat.sent_at - DELIVERY_GRACE_S and tracked.request_id not in beat.request_ids)
