"""The engine loop: add requests, step, stream outputs; stop conditions (EOS, stop strings, max tokens, abort).

`LLMEngine` is synchronous and single-threaded; services drive it from an executor thread.
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass

import torch

from shared.blocks import BlockManager, OutOfBlocks, make_namespace
from shared.engine.batching import Scheduler, StepPlan
from shared.engine.codec_pool import CodecKvPool
from shared.engine.config import EngineConfig
from shared.engine.kv_cache import KVPool, LayerCallback
from shared.engine.prefix_load import PrefixLoad, PrefixSource
from shared.engine.prompt_kv import check_prompt_kv, write_packed
from shared.engine.runner import ModelRunner, Runner
from shared.engine.sampling import SamplingParams
from shared.engine.sequence import FinishReason, Sequence, SequenceStatus
from shared.fastgen.engine_kv import FastGenKv
from shared.fastgen.lane_store import CodedLaneStore, RawLaneStore
from shared.fastgen.policies import TokenClasses
from shared.fastgen.wire import PromptProfile
from shared.kv_wire_packed import PackedFormat, PackedLayerKv, PackedPromptKv
from shared.model.checkpoint import Checkpoint, load_checkpoint
from shared.model.tokenizer import IncrementalDetokenizer, Tokenizer
from shared.payload import Payload

# Called during a step as each layer's K/V lands in the pool, with the sequences whose prompt this step completes.
LayerHook = Callable[[int, list[Sequence]], None]


class EngineFull(Exception):
    """The running batch or the KV pool has no room for one more sequence now; try again after some finish."""


@dataclass(frozen=True)
class RequestOutput:
    """What one step produced for one request: new tokens and text, and the finish reason once finished."""

    request_id: str
    new_token_ids: list[int]
    new_text: str
    finish_reason: FinishReason | None
    num_prompt_tokens: int
    num_output_tokens: int
    num_cached_tokens: int
    kv_bytes_saved: int = 0  # KV bytes FastGen does not hold for this request after this step (0: full cache)

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass(frozen=True)
class StepStats:
    """What one step computed and how long it took (the figures a cost model is fitted to)."""

    num_new_tokens: int  # tokens through the model
    attention_work: int  # keys attended, summed over the new tokens (each sees every earlier token and itself)
    seconds: float  # wall time of the step, less `load_wait_s`
    load_wait_s: float  # time the forward pass blocked waiting for loaded prefix KV


@dataclass(frozen=True)
class PrefilledRequest:
    """A request whose prompt KV was computed by another engine (see `LLMEngine.add_prefilled`)."""

    request_id: str
    prompt_ids: list[int]
    first_token: int  # sampled by prefill, already streamed with its first `num_emitted_chars` characters
    num_emitted_chars: int
    params: SamplingParams
    kv: torch.Tensor | PackedPromptKv  # raw [num_layers, 2, kv_heads, len(prompt_ids), head_dim], or packed
    num_cached_tokens: int = 0  # prompt tokens prefill reused, reported in usage
    fastgen_profile: PromptProfile | None = None  # prefill's FastGen profile (None: keep every token)


@dataclass(frozen=True)
class Completion:
    """A finished request, as `LLMEngine.generate` returns it."""

    request_id: str
    text: str
    token_ids: list[int]
    finish_reason: FinishReason
    num_prompt_tokens: int
    num_cached_tokens: int


class LLMEngine:
    """Continuous-batching generation over a paged KV cache with prefix reuse.

    Args:
        checkpoint: model files (config, weights, tokenizer).
        config: engine settings.
        runner: what runs each step (default: the model on `config`'s device; the sim backend passes its own).
    """

    def __init__(
        self, checkpoint: Checkpoint, config: EngineConfig | None = None, runner: Runner | None = None
    ) -> None:
        self.config = config or EngineConfig()
        self.tokenizer: Tokenizer = checkpoint.tokenizer
        self.model_config = checkpoint.config
        self.runner: Runner = runner or ModelRunner(checkpoint, self.config)
        self.block_manager = BlockManager(
            self.runner.pool.num_blocks, self.config.block_size,
            make_namespace(checkpoint.fingerprint, self.config.kv_format),
        )
        self.scheduler = Scheduler(
            self.block_manager, self.runner.max_num_seqs, self.config.max_num_batched_tokens,
            self.config.enable_prefix_caching,
        )
        self._seqs: dict[str, Sequence] = {}
        self._detokenizers: dict[str, IncrementalDetokenizer] = {}
        self._generate_ids = itertools.count()
        self.last_step: StepStats | None = None  # set by every step that ran a forward pass
        self.fastgen = self._attach_fastgen(checkpoint) if self.config.kv_policy == "fastgen" else None

    def _attach_fastgen(self, checkpoint: Checkpoint) -> FastGenKv:
        """FastGen's lanes over this engine's pool and blocks. Raises ValueError for a pool it cannot run on."""
        pool = self.runner.pool
        if not isinstance(self.runner, ModelRunner):
            raise ValueError("FastGen runs on the model runner, not the sim engine")
        rotary = self.runner.model.rotary
        store = RawLaneStore(pool.tensor) if isinstance(pool, KVPool) else CodedLaneStore(pool, rotary)
        classes = TokenClasses.from_tokenizer(self.tokenizer, self.model_config.vocab_size)
        cfg = self.model_config
        fastgen = FastGenKv(self.config.fastgen, classes, self.block_manager, store, cfg.num_layers, cfg.num_kv_heads,
                            self.runner.scale)
        self.runner.fastgen = fastgen
        self.scheduler.lanes = fastgen
        return fastgen

    @classmethod
    def from_path(cls, model_path: str | None = None, config: EngineConfig | None = None) -> LLMEngine:
        """Load a GGUF file or safetensors folder (None: the default SmolLM2 model) and build an engine."""
        return cls(load_checkpoint(model_path), config)

    def add_request(
        self, request_id: str, prompt_ids: list[int], params: SamplingParams, prefix_source: PrefixSource | None = None
    ) -> None:
        """Queue a request.

        Args:
            prefix_source: where KV of the prompt's leading blocks may be loaded from when the request is admitted,
                for the part the local prefix cache lacks; the step then waits for it layer by layer. If the load
                fails, the request is computed from its local prefix instead.
        Raises:
            ValueError: an empty prompt, one too long for the model or for the whole KV pool, a duplicate id, or a
                source that does not supply whole blocks short of the prompt's last token.
        """
        if prefix_source is not None:
            num = prefix_source.num_tokens
            if num % self.config.block_size or not 0 < num < len(prompt_ids):
                raise ValueError(f"a prefix source of {num} tokens for a prompt of {len(prompt_ids)}")
        if request_id in self._seqs:
            raise ValueError(f"request id {request_id!r} is already running")
        if not prompt_ids:
            raise ValueError("the prompt is empty")
        limit = self.model_config.max_position
        if len(prompt_ids) >= limit:
            raise ValueError(f"the prompt has {len(prompt_ids)} tokens; this model's context is {limit}")
        needed, held = -(-(len(prompt_ids) + 1) // self.config.block_size), self.block_manager.num_blocks
        if needed > held:  # it would wait for room forever, and every request behind it with it
            raise ValueError(f"the prompt needs {needed} KV blocks; this engine's KV pool holds {held}")
        seq = Sequence(request_id, list(prompt_ids), len(prompt_ids), params, prefix_source=prefix_source)
        self.scheduler.add(seq)
        self._seqs[request_id] = seq
        self._detokenizers[request_id] = IncrementalDetokenizer(self.tokenizer)

    def abort(self, request_id: str) -> RequestOutput | None:
        """Cancel a request and free its blocks; None when it is unknown or already finished."""
        seq = self._seqs.get(request_id)
        if seq is None:
            return None
        return self._finish(seq, FinishReason.ABORT, [])

    def has_unfinished(self) -> bool:
        return self.scheduler.has_work()

    def step(self, on_layer: LayerHook | None = None) -> list[RequestOutput]:
        """Run one forward pass over the planned batch; returns an output for every request that advanced.

        Sequences admitted now with a prefix load wait for each layer's loaded KV before that layer's attention; one
        whose load fails produces nothing this step and is computed again (see `add_request`).

        Args:
            on_layer: see `LayerHook`; lets prefill stream each layer's KV while the next layer computes. A sequence
                whose load failed is left out from the first layer that did not arrive.
        """
        plan = self.scheduler.schedule()
        # The whole pool cannot hold one more token of these: they end as at the context limit.
        outgrown = [self._finish(seq, FinishReason.LENGTH, []) for seq in plan.outgrown]
        if not plan.chunks:
            return outgrown
        started = time.perf_counter()
        tables = {c.seq.request_id: self.block_manager.block_ids(c.seq.request_id) for c in plan.chunks
                  if c.seq.request_id in self.block_manager}  # not those in FastGen's lanes
        loads = [c.seq.prefix_load for c in plan.chunks if c.seq.prefix_load is not None]
        num_new, work = sum(c.num_tokens for c in plan.chunks), sum(c.attention_work for c in plan.chunks)
        sampled = self.runner.execute(plan, tables, *self._layer_hooks(plan, loads, on_layer))
        restarted = {seq.request_id for seq in self.scheduler.finish_step(plan)}
        waited = sum(load.waited_s for load in loads)
        self.last_step = StepStats(num_new, work, time.perf_counter() - started - waited, waited)
        outputs = outgrown
        for request_id, token in sampled.items():
            if request_id not in restarted:
                outputs.append(self._accept_token(self._seqs[request_id], token))
        if self.fastgen is not None:  # the prompts it profiled this step leave their blocks for lanes
            self.fastgen.move_profiled(self._seqs, restarted)
        return outputs

    @staticmethod
    def _layer_hooks(
        plan: StepPlan, loads: list[PrefixLoad], on_layer: LayerHook | None
    ) -> tuple[LayerCallback | None, LayerCallback | None]:
        """The forward pass's (after_layer, before_layer): stream finished prompts, wait for loaded prefix KV."""
        before_layer = after_layer = None
        if loads:
            def before_layer(layer_idx: int) -> None:
                for load in loads:
                    load.wait_layer(layer_idx)
        prompts_done = [c.seq for c in plan.chunks if c.completes_sequence and c.seq.num_output_tokens == 0]
        if on_layer is not None and prompts_done:
            def after_layer(layer_idx: int) -> None:
                ready = [s for s in prompts_done if s.prefix_load is None or s.prefix_load.is_layer_ready(layer_idx)]
                if ready:
                    on_layer(layer_idx, ready)
        return after_layer, before_layer

    def generate(self, prompts: Iterable[list[int]], params: SamplingParams) -> list[Completion]:
        """Run prompts to completion together (a convenience for the CLI, tests and benchmarks).

        Raises:
            RuntimeError: the engine is serving other requests (their outputs would be lost here).
        """
        if self.has_unfinished():
            raise RuntimeError("generate() needs an idle engine; drive step() to serve concurrent requests")
        ids = []
        for prompt in prompts:
            request_id = f"gen-{next(self._generate_ids)}"
            self.add_request(request_id, prompt, params)
            ids.append(request_id)
        done: dict[str, Completion] = {}
        texts: dict[str, list[str]] = {i: [] for i in ids}
        tokens: dict[str, list[int]] = {i: [] for i in ids}
        while len(done) < len(ids):
            for out in self.step():
                texts[out.request_id].append(out.new_text)
                tokens[out.request_id].extend(out.new_token_ids)
                if out.finish_reason is not None:
                    done[out.request_id] = Completion(
                        out.request_id, "".join(texts[out.request_id]), tokens[out.request_id],
                        out.finish_reason, out.num_prompt_tokens, out.num_cached_tokens,
                    )
        return [done[i] for i in ids]

    # ---- disaggregation: KV in and out of this engine -----------------------------------------------------------

    @property
    def packed_format(self) -> PackedFormat | None:
        """How this engine's prompt KV travels when it keeps KV through a codec (None: raw tensors)."""
        pool = self.runner.pool
        if not isinstance(pool, CodecKvPool):
            return None
        return PackedFormat(self.config.kv_format, pool.block_size, pool.block_bytes, pool.sink_bytes, pool.dtype)

    def read_prompt_kv(self, request_id: str, layer_idx: int) -> torch.Tensor | PackedLayerKv:
        """One layer's K and V of a running request's prompt: [2, kv_heads, num_prompt_tokens, head_dim], or with a
        codec its full blocks' bytes and its partial last block."""
        seq, pool = self._seqs[request_id], self.runner.pool
        block_ids = self.block_manager.block_ids(request_id)
        if not isinstance(pool, CodecKvPool):
            return pool.read_tokens(layer_idx, block_ids, seq.num_prompt_tokens)
        num_full = seq.num_prompt_tokens // pool.block_size
        blocks = b"".join(pool.read_block_bytes(layer_idx, block_ids[i], i == 0) for i in range(num_full))
        tail = pool.read_tail(request_id, layer_idx, seq.num_prompt_tokens % pool.block_size)
        return PackedLayerKv(blocks, tail, seq.num_prompt_tokens)

    def export_block_payloads(self, request_id: str, first_block: int, num_blocks: int) -> list[Payload]:
        """Full blocks of a running request as the cache-store keeps them (the pool's `block_payload`)."""
        block_ids = self.block_manager.block_ids(request_id)[first_block : first_block + num_blocks]
        return [self.runner.pool.block_payload(b, first_block + i == 0) for i, b in enumerate(block_ids)]

    def export_blocks(self, request_id: str, first_block: int, num_blocks: int) -> torch.Tensor:
        """Full blocks of a running request, every layer:
        [num_layers, 2, kv_heads, num_blocks, block_size, head_dim]."""
        block_ids = self.block_manager.block_ids(request_id)[first_block : first_block + num_blocks]
        pool = self.runner.pool
        if not isinstance(pool, KVPool):
            raise TypeError("export_blocks reads raw tensors; a codec pool exports block payloads")
        return pool.read_blocks(block_ids)

    def add_prefilled(self, request: PrefilledRequest) -> None:
        """Continue a request whose prompt was computed elsewhere: its KV goes into the pool and it joins the
        running batch with its first token (sampled by prefill) waiting for the next step.

        Raises:
            ValueError: a duplicate id, or KV whose shape does not fit the prompt and this model.
            EngineFull: the running batch is full or the pool lacks blocks.
        """
        prompt = request.prompt_ids
        if request.request_id in self._seqs:
            raise ValueError(f"request id {request.request_id!r} is already running")
        check_prompt_kv(request.kv, len(prompt), self.model_config, self.packed_format)
        if len(self.scheduler.running) >= self.runner.max_num_seqs:
            raise EngineFull(f"the running batch holds {self.runner.max_num_seqs} sequences")
        try:
            reused = self.block_manager.allocate(request.request_id, prompt)
        except OutOfBlocks as exc:
            raise EngineFull(str(exc)) from None
        block_ids = self.block_manager.block_ids(request.request_id)
        pool = self.runner.pool
        if isinstance(request.kv, PackedPromptKv):
            assert isinstance(pool, CodecKvPool)
            write_packed(pool, request.request_id, block_ids, request.kv, reused // self.config.block_size)
        elif isinstance(pool, KVPool):
            pool.write_tokens(block_ids, request.kv, reused // self.config.block_size)
        self.block_manager.mark_computed(request.request_id, len(prompt))
        if self.fastgen is not None:
            self._adopt_profile(request, block_ids)
        seq = Sequence(request.request_id, [*prompt, request.first_token], len(prompt), request.params)
        seq.num_computed_tokens, seq.num_cached_tokens = len(prompt), request.num_cached_tokens
        detokenizer = IncrementalDetokenizer(self.tokenizer)
        seq.text = detokenizer.push(request.first_token)
        seq.num_emitted_chars, seq.stop_checked_chars = request.num_emitted_chars, len(seq.text)
        self.scheduler.add_running(seq)
        self._seqs[seq.request_id] = seq
        self._detokenizers[seq.request_id] = detokenizer

    def _adopt_profile(self, request: PrefilledRequest, block_ids: list[int]) -> None:
        """FastGen: a prompt that came with its profile moves to lanes; without one (or without room for the lanes)
        it keeps every token."""
        assert self.fastgen is not None
        profile, request_id = request.fastgen_profile, request.request_id
        cfg = self.model_config
        if profile is None or tuple(profile.scores.shape) != (cfg.num_layers, cfg.num_kv_heads,
                                                              len(request.prompt_ids)):
            self.fastgen.declined.add(request_id)
        elif self.fastgen.adopt(request_id, request.prompt_ids, profile, block_ids):
            self.block_manager.free(request_id)

    def _accept_token(self, seq: Sequence, token: int) -> RequestOutput:
        params = seq.params
        if token in self.tokenizer.eos_token_ids and not params.ignore_eos:
            return self._finish(seq, FinishReason.STOP, [])
        seq.token_ids.append(token)
        seq.text += self._detokenizers[seq.request_id].push(token)
        if self.fastgen is not None and self.fastgen.holds(seq.request_id):
            seq.kv_bytes_saved = self.fastgen.bytes_saved(seq.request_id)
        if params.stop and self._truncate_at_stop(seq):
            return self._finish(seq, FinishReason.STOP, [token])
        if seq.num_output_tokens >= params.max_tokens or seq.num_tokens >= self.model_config.max_position:
            return self._finish(seq, FinishReason.LENGTH, [token])
        # Hold back text that might be the start of a stop string until it is decided.
        hold = max((len(s) for s in params.stop), default=1) - 1
        return self._emit(seq, [token], max(seq.num_emitted_chars, len(seq.text) - hold), None)

    def _truncate_at_stop(self, seq: Sequence) -> bool:
        longest = max(len(s) for s in seq.params.stop)
        start = max(0, seq.stop_checked_chars - longest + 1)
        hits = [i for i in (seq.text.find(s, start) for s in seq.params.stop) if i >= 0]
        seq.stop_checked_chars = len(seq.text)
        if not hits:
            return False
        seq.text = seq.text[: min(hits)]
        return True

    def _finish(self, seq: Sequence, reason: FinishReason, new_tokens: list[int]) -> RequestOutput:
        seq.status = SequenceStatus.FINISHED
        seq.finish_reason = reason
        self.scheduler.remove(seq)
        self.runner.forget(seq.request_id)
        del self._seqs[seq.request_id], self._detokenizers[seq.request_id]
        return self._emit(seq, new_tokens, len(seq.text), reason)

    @staticmethod
    def _emit(seq: Sequence, tokens: list[int], upto: int, reason: FinishReason | None) -> RequestOutput:
        new_text = seq.text[seq.num_emitted_chars : upto]
        seq.num_emitted_chars = max(seq.num_emitted_chars, upto)
        return RequestOutput(
            seq.request_id, tokens, new_text, reason, seq.num_prompt_tokens, seq.num_output_tokens,
            seq.num_cached_tokens, seq.kv_bytes_saved,
        )
