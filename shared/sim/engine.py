"""The sim engine: the real `LLMEngine` (batching, chunked prefill, prefix cache, stop conditions) over `SimRunner`,
which sleeps for the profile's predicted step time instead of running a model, over a `SizedKvStore` (the sizes
of the simulated model's KV, no values). Every generated token is the same word. A pipeline stage's runner
(`LLMEngine.stage_engine`) models its layers alone, and the hidden states it passes on are meta tensors: a shape
and a dtype, whose bytes the wire carries as a size (`shared.wire.handoff.stage_rows`).

It does not decide step times (that is `shared.sim.cost`) nor what a profile is (`shared.sim.profiles`).
"""

from __future__ import annotations

import dataclasses
import math
import time

import torch

from shared.engine.batching import StepPlan
from shared.engine.blocks import BlockEventHook, BlockManager
from shared.engine.config import EngineConfig
from shared.engine.engine import LLMEngine
from shared.engine.kv.sized import SizedKvStore
from shared.engine.kv.store import LayerCallback
from shared.model.checkpoint import Checkpoint
from shared.model.stages import LayerRange
from shared.sim.cost import StepWork, step_time
from shared.sim.manifest import sim_kv_format, sim_manifest
from shared.sim.profiles import SimProfile, get_profile
from shared.wire.block_hash import make_namespace

SIM_WORD = " sim"  # what every simulated token decodes to
# A step that starts within this long of the previous one's end continues a busy engine: the host's own time between
# them (delivering tokens over NATS, the event loop) counts towards its sleep, as a GPU engine's CPU work overlaps.
# The previous end is the modelled one: a host that wakes late from a step's sleep delays the tokens it passes on,
# not the next step, as a GPU's next kernel does not wait for the CPU to notice the last one ended.
BACK_TO_BACK_S = 0.05
# `before_layer` returning later than this waited for a prefix layer's KV (an unwaited check takes microseconds): the
# layer cannot start before that KV is there.
PREFIX_WAIT_S = 0.0005
STAGE_ROWS_DTYPE = {2: torch.bfloat16, 4: torch.float32}  # the hidden states' dtype, by the profile's bytes per value


def sim_checkpoint(profile: SimProfile, tokenizer_path: str | None = None) -> Checkpoint:
    """`sim_manifest` as a checkpoint with no weights, for the engine."""
    manifest = sim_manifest(profile, tokenizer_path)
    return Checkpoint(manifest.config, {}, manifest.tokenizer, manifest.fingerprint, manifest.path)


class SimRunner:
    """Stands in for `ModelRunner`: each step sleeps for `step_time` of its work, layer by layer when the engine
    hooks layers (prefill streams KV per layer, and waits per layer for a loaded prefix), and samples `token_id`.
    Back-to-back steps are paced from the previous step's end (see `BACK_TO_BACK_S`), so a busy engine steps at the
    modelled rate as long as this host keeps up; `tokens_ready_at` is a step's modelled end (or, when the host was
    slower than the model, when it handed the step over).

    A pipeline stage's runner (`config.stage`) models its layers: its steps take their share of the profile's
    (`stage_profile`; no LM head before the last stage), it holds its layers' KV, as many tokens of it as the whole
    model's runner would (the stage's layers in the same GPU memory), and hands the next stage meta tensors.

    Args:
        profile: the model and GPUs simulated.
        config: engine settings; the store holds as many `block_size` blocks as the profile's GPU memory allows
            (`kv_cache_bytes` is ignored).
        token_id: the token every step produces.
        fingerprint: the simulated model's (`sim_checkpoint`), for the block-hash namespace ("": an empty namespace).
        on_block_event: hears every change of the prefix cache's index (`BlockManager`'s `on_event`).
        sized_codec: "none", or the codec whose bytes a block has in the pool and on the wire (`SizedKvStore`).
        kv_tokens: the tokens of KV it holds (0: what the profile's GPUs hold beside the weights).
    """

    def __init__(
        self, profile: SimProfile, config: EngineConfig, token_id: int, fingerprint: str = "",
        on_block_event: BlockEventHook | None = None, sized_codec: str = "none", kv_tokens: int = 0,
    ) -> None:
        if config.kv_policy != "full" or config.kv_codec != "none":
            raise ValueError("the sim engine's KV has sizes alone: no KV codec, no FastGen (they need real values)")
        self.profile, self.token_id, self.fingerprint = profile, token_id, fingerprint
        self.sized_codec, self.kv_tokens = sized_codec, kv_tokens
        self.stage = config.stage or LayerRange.whole(profile.model.num_layers)
        self.stage_profile = stage_profile(profile, self.stage)
        num_blocks = (kv_tokens or profile.kv_capacity_tokens) // config.block_size
        if num_blocks < 2:
            raise ValueError(f"profile {profile.name} leaves room for {num_blocks} KV blocks of {config.block_size}")
        self.kv_format = config.kv_format
        blocks = BlockManager(num_blocks, config.block_size, self.block_namespace(self.stage), on_block_event)
        self.store = SizedKvStore(self.stage_profile.model, blocks, config.kv_format, config.max_num_seqs,
                                  sized_codec=sized_codec)
        self.last_step_s = 0.0  # the predicted time of the last step
        self.tokens_ready_at = 0.0
        self._last_end = -math.inf  # perf_counter() when the last step ended

    @property
    def max_num_seqs(self) -> int:
        return self.store.max_num_seqs

    def forget(self, request_id: str) -> None:
        self.store.release(request_id)

    def block_namespace(self, layers: LayerRange) -> bytes:
        if not self.fingerprint:
            return b""
        return make_namespace(self.fingerprint, layers.block_format(sim_kv_format(self.kv_format, self.sized_codec)))

    def for_stage(self, config: EngineConfig, on_block_event: BlockEventHook | None = None) -> SimRunner:
        """A runner for the pipeline stage `config.stage` of this whole model (its own KV, its own block events)."""
        return SimRunner(self.profile, config, self.token_id, self.fingerprint, on_block_event, self.sized_codec,
                         self.kv_tokens)

    def execute(
        self, plan: StepPlan, block_tables: dict[str, list[int]], after_layer: LayerCallback | None = None,
        before_layer: LayerCallback | None = None,
    ) -> dict[str, int]:
        self._step(plan, after_layer, before_layer)
        return {c.seq.request_id: self.token_id for c in plan.chunks if c.completes_sequence}

    def execute_stage(
        self, plan: StepPlan, block_tables: dict[str, list[int]], after_layer: LayerCallback | None = None,
        before_layer: LayerCallback | None = None,
    ) -> dict[str, torch.Tensor]:
        """A step of a stage before the last: each chunk's rows as a meta tensor [num_tokens, hidden_size]."""
        self._step(plan, after_layer, before_layer)
        hidden, dtype = self.profile.model.hidden_size, STAGE_ROWS_DTYPE[self.profile.dtype_bytes]
        return {c.seq.request_id: torch.empty(c.num_tokens, hidden, dtype=dtype, device="meta") for c in plan.chunks}

    def _step(self, plan: StepPlan, after_layer: LayerCallback | None, before_layer: LayerCallback | None) -> None:
        for chunk in plan.chunks:  # a later stage spends the rows its chunks came with, as the model's runner does
            if chunk.seq.stage_input is not None:
                chunk.seq.stage_input.take(chunk.seq.num_computed_tokens, chunk.num_tokens)
        work = StepWork(
            num_new_tokens=sum(c.num_tokens for c in plan.chunks),
            num_sampled=sum(c.completes_sequence for c in plan.chunks) if self.stage.is_last else 0,
            attention_work=sum(c.attention_work for c in plan.chunks),
            num_kv_tokens_read=sum(c.seq.num_computed_tokens + c.num_tokens for c in plan.chunks),
        )
        self.last_step_s = step_time(self.stage_profile, work).total
        now = time.perf_counter()
        start = self._last_end if now - self._last_end < BACK_TO_BACK_S else now
        if after_layer is None and before_layer is None:
            end = max(start + self.last_step_s, now)
            _sleep_until(end)
        else:  # the hooks' host time may push the end past the modelled one (see `_layer_by_layer`)
            self._layer_by_layer(start, self.last_step_s, after_layer, before_layer)
            end = time.perf_counter()
        self._last_end = self.tokens_ready_at = end

    def _layer_by_layer(self, start: float, seconds: float, after_layer: LayerCallback | None,
                        before_layer: LayerCallback | None) -> None:
        """Each layer takes its share of the step; a wait for loaded prefix KV delays the layers after it. The host's
        own time in the hooks (sending a layer's KV) overlaps the modelled layers, as a GPU's copies and the CPU's
        work overlap its compute, unless it falls behind them."""
        num_layers = len(self.stage)
        per_layer = seconds / num_layers
        due = start
        for layer in range(num_layers):
            if before_layer is not None:
                asked = time.perf_counter()
                before_layer(layer)
                if time.perf_counter() - asked > PREFIX_WAIT_S:  # it waited for the layer's KV to arrive
                    due = max(due, time.perf_counter())
            due += per_layer
            _sleep_until(due)
            if after_layer is not None:
                after_layer(layer)


def stage_profile(profile: SimProfile, stage: LayerRange) -> SimProfile:
    """The profile of a pipeline stage: the model of its layers alone (its weights, KV and FLOPs per token; the
    embeddings and the LM head stay counted, a few percent of a large model's weights)."""
    return profile if stage.is_whole else dataclasses.replace(profile, model=stage.local_config(profile.model))


def _sleep_until(deadline: float) -> None:
    remaining = deadline - time.perf_counter()
    if remaining > 0:
        time.sleep(remaining)


def build_sim_engine(
    profile_name: str, config: EngineConfig, tokenizer_path: str | None = None,
    on_block_event: BlockEventHook | None = None, sized_codec: str = "none", kv_tokens: int = 0,
) -> LLMEngine:
    """An engine for `profile_name` (see `shared.sim.profiles.PROFILES`); `on_block_event`, `sized_codec` and
    `kv_tokens` as `SimRunner`'s.

    Raises:
        ValueError: an unknown profile, a block size that leaves fewer than 2 blocks, or a pipeline stage's config (a
            stage's engine is the whole model's `stage_engine`).
    """
    if config.stage is not None:
        raise ValueError("build the whole model's sim engine and take a stage of it with stage_engine")
    profile = get_profile(profile_name)
    checkpoint = sim_checkpoint(profile, tokenizer_path)
    token_id = checkpoint.tokenizer.encode(SIM_WORD)[0]
    runner = SimRunner(profile, config, token_id, checkpoint.fingerprint, on_block_event, sized_codec, kv_tokens)
    return LLMEngine(checkpoint, config, runner=runner)
