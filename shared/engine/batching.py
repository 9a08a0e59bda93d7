"""Continuous batching: which sequences run in the next step and how many of their tokens (chunked prefill).

Owns the waiting queue, the running set, admission against the block manager and the start and end of prefix loads
(`prefix_load`); it does not touch tensors.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from typing import Protocol

from shared.engine.blocks import BlockManager, OutOfBlocks
from shared.engine.kv.prefix_load import PrefixLoad
from shared.engine.sequence import Sequence, SequenceStatus
from shared.wire.log import get_logger
from shared.wire.protocol import attention_work

log = get_logger(__name__)


@dataclass(frozen=True)
class ScheduledChunk:
    """`num_tokens` tokens of `seq`, starting at its `num_computed_tokens`, go through the model this step."""

    seq: Sequence
    num_tokens: int

    @property
    def completes_sequence(self) -> bool:
        """After this chunk every known token has KV, so the sequence is sampled."""
        return self.seq.num_computed_tokens + self.num_tokens == self.seq.num_tokens

    @property
    def attention_work(self) -> int:
        """Keys this chunk's tokens attend to, summed: each new token sees every earlier token and itself."""
        before = self.seq.num_computed_tokens
        return attention_work(before + self.num_tokens, before)


class LaneHolder(Protocol):
    """Sequences whose KV is held outside the block manager (FastGen's lanes): room is reserved and freed there."""

    def holds(self, request_id: str) -> bool: ...

    def reserve(self, request_id: str) -> bool:
        """Room for one more token; False when there is none now."""
        ...

    def release(self, request_id: str) -> None: ...


@dataclass(frozen=True)
class StepPlan:
    chunks: list[ScheduledChunk]  # every single-token chunk (decode-shaped) first, then the longer ones
    preempted: list[Sequence]
    outgrown: list[Sequence] = field(default_factory=list)  # running alone, still no room: the engine ends them
    # cannot run here, and why (a pipeline stage lacking the prefix the first stage reused): the engine fails them
    failed: list[tuple[Sequence, str]] = field(default_factory=list)


class Scheduler:
    """Plans each step: every running sequence advances (decode first), then waiting prompts fill the token budget.

    When the pool cannot hold one more token for a running sequence, the most recently admitted one is preempted:
    its blocks are freed and it goes back to the front of the queue to be recomputed (its full blocks usually come
    back from the prefix cache). A sequence that has outgrown the whole pool (no room though it runs alone) is not
    preempted, which would re-admit it forever, but planned nowhere and reported in `StepPlan.outgrown`.

    A sequence with a `prefix_source` starts loading, at admission, the prefix blocks the local cache lacks; they
    count as computed, so the step computes only the rest (waiting per layer, see `PrefixLoad`). The step settles
    the load: complete, the loaded blocks are registered like computed ones; failed, the sequence is restarted
    without the source, to be computed from its local prefix.
    """

    def __init__(
        self,
        block_manager: BlockManager,
        max_num_seqs: int,
        max_num_batched_tokens: int,
        enable_prefix_caching: bool = True,
        lanes: LaneHolder | None = None,
    ) -> None:
        self.block_manager = block_manager
        self.enable_prefix_caching = enable_prefix_caching
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.lanes = lanes  # where sequences that keep their KV outside blocks (FastGen's lanes) have it

    def add(self, seq: Sequence) -> None:
        needed = -(-seq.num_tokens // self.block_manager.block_size)
        if needed > self.block_manager.num_blocks:
            raise ValueError(
                f"request needs {needed} KV blocks but the whole pool has {self.block_manager.num_blocks}"
            )
        self.waiting.append(seq)

    def add_running(self, seq: Sequence) -> None:
        """Join a sequence whose blocks are already allocated and filled (its KV came from elsewhere)."""
        seq.status = SequenceStatus.RUNNING
        self.running.append(seq)

    def remove(self, seq: Sequence) -> None:
        """Take a sequence out wherever it is and free its blocks."""
        _end_load(seq)
        if seq in self.running:
            self.running.remove(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)
        self._free_kv(seq)

    def _free_kv(self, seq: Sequence) -> None:
        if seq.request_id in self.block_manager:
            self.block_manager.free(seq.request_id)
        if self.lanes is not None:
            self.lanes.release(seq.request_id)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def schedule(self, only: set[str] | None = None) -> StepPlan:
        """The next step's chunks.

        Args:
            only: plan none but these request ids (the others wait, holding their blocks): a step that isolates
                the request that made an earlier step fail (`shared.engine.isolation`).
        """
        preempted: list[Sequence] = []
        outgrown: list[Sequence] = []
        failed: list[tuple[Sequence, str]] = []
        budget = self.max_num_batched_tokens
        decode: list[ScheduledChunk] = []
        prefill: list[ScheduledChunk] = []
        for seq in list(self.running):
            if seq not in self.running or (only is not None and seq.request_id not in only):
                continue  # preempted while making room for an earlier one, or not in this step
            if budget <= 0:
                break
            if seq.num_ready_tokens == 0:  # a stage's prompt waiting for its next rows
                continue
            if not self._reserve_slots(seq, preempted, outgrown):
                continue
            num = min(seq.num_ready_tokens, budget)
            budget -= num
            (decode if num == 1 else prefill).append(ScheduledChunk(seq, num))
        while budget > 0 and len(self.running) < self.max_num_seqs and not preempted + outgrown:
            candidate = next((s for s in self.waiting if (only is None or s.request_id in only)
                              and (s.stage_input is None or s.stage_input.end > s.stage_input.start)), None)
            if candidate is None:
                break
            seq = candidate
            stage_start = None if seq.stage_input is None else seq.stage_input.start
            try:
                cached = self.block_manager.allocate(seq.request_id, seq.token_ids, stage_start)
            except OutOfBlocks:
                break
            self.waiting.remove(seq)
            computed = self._start_load(seq, cached)
            if stage_start is not None and computed < stage_start:
                _end_load(seq)
                self.block_manager.free(seq.request_id)
                failed.append((seq, f"this stage holds {computed} of the {stage_start} tokens the first stage "
                                    "reused (its prefix cache and the cache-store)"))
                continue
            seq.status = SequenceStatus.RUNNING
            seq.num_computed_tokens = seq.num_cached_tokens = computed
            self.running.append(seq)
            num = min(seq.num_ready_tokens, budget)
            budget -= num
            (decode if num == 1 else prefill).append(ScheduledChunk(seq, num))
        return StepPlan(decode + prefill, preempted, outgrown, failed)

    def _start_load(self, seq: Sequence, num_cached: int) -> int:
        """Start loading the prefix beyond the local cache, if the sequence has a source; returns the tokens that now
        count as computed."""
        source, size = seq.prefix_source, self.block_manager.block_size
        if source is None or source.num_tokens <= num_cached or not self.enable_prefix_caching:
            return num_cached
        block_ids = self.block_manager.block_ids(seq.request_id)[num_cached // size : source.num_tokens // size]
        load = source.start(num_cached // size, block_ids)
        if load is None:
            return num_cached
        self.block_manager.start_loading(seq.request_id, source.num_tokens)
        seq.prefix_load = load
        return source.num_tokens

    def _reserve_slots(self, seq: Sequence, preempted: list[Sequence], outgrown: list[Sequence]) -> bool:
        """Make the block table (or the lanes) cover every known token, preempting later sequences if needed; False
        if `seq` was preempted, or has outgrown the pool (added to `outgrown`, left running for the engine to end)."""
        on_lanes = self.lanes is not None and self.lanes.holds(seq.request_id)
        missing = [] if on_lanes else seq.token_ids[self.block_manager.num_tokens(seq.request_id) :]
        while not self._make_room(seq, on_lanes, len(missing)):
            if len(self.running) == 1:  # only `seq` runs: preempting it frees nothing it could use
                log.warning("the whole KV pool cannot hold one more token of this request; it ends",
                            request_id=seq.request_id, num_tokens=seq.num_tokens,
                            kv_blocks=self.block_manager.num_blocks)
                outgrown.append(seq)
                return False
            victim = self.running[-1]
            self._preempt(victim)
            preempted.append(victim)
            if victim is seq:
                return False
        if missing:
            self.block_manager.append(seq.request_id, missing)
        return True

    def _make_room(self, seq: Sequence, on_lanes: bool, num_missing: int) -> bool:
        """Whether the pool has room for the sequence's next tokens (in its lanes: reserves it)."""
        if on_lanes:
            assert self.lanes is not None
            return self.lanes.reserve(seq.request_id)
        return num_missing == 0 or self.block_manager.can_append(seq.request_id, num_missing)

    def recompute(self, seqs: list[Sequence]) -> None:
        """Drop the KV of these running sequences and queue them, in this order, at the front to be computed again
        (after a step over them failed: whatever it wrote is not trusted)."""
        for seq in reversed(seqs):
            if seq in self.running:
                self._preempt(seq)

    def _preempt(self, seq: Sequence) -> None:
        _end_load(seq)
        self.running.remove(seq)
        self._free_kv(seq)
        seq.status = SequenceStatus.WAITING
        seq.num_computed_tokens = 0
        self.waiting.appendleft(seq)

    def finish_step(self, plan: StepPlan) -> list[Sequence]:
        """Record that the planned chunks were computed (and, with prefix caching, publish their full blocks).

        Returns:
            The sequences whose prefix load failed: their step's results are void; they wait to be recomputed.
        """
        restarted = []
        for chunk in plan.chunks:
            seq = chunk.seq
            load = _end_load(seq)
            if load is not None and not load.is_complete:
                self._preempt(seq)
                seq.prefix_source = None
                restarted.append(seq)
                continue
            seq.num_computed_tokens += chunk.num_tokens
            if self.enable_prefix_caching and seq.request_id in self.block_manager:
                self.block_manager.mark_computed(seq.request_id, seq.num_computed_tokens)
            if load is not None:
                self.block_manager.finish_loading(seq.request_id)
        return restarted


def _end_load(seq: Sequence) -> PrefixLoad | None:
    """Detach the sequence's prefix load, if any, after which it writes nothing more into the pool."""
    load, seq.prefix_load = seq.prefix_load, None
    if load is not None:
        load.close()
    return load
