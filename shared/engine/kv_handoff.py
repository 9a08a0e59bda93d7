"""Disaggregation, the engine's side: prompt KV out of a prefill engine (per layer, and as blocks for the
cache-store) and into a decode engine (`add_prefilled`), in the form of the engine's KV store (`BlockFormat`), with
FastGen's profile where the engine runs it. A mixin of `LLMEngine`; how KV travels is the wire's
(`shared.wire.handoff`), which the engine does not import but for FastGen's profile.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from shared.engine.blocks import OutOfBlocks
from shared.engine.kv.store import BlockFormat, KvStore, PromptKv, PromptLayerKv
from shared.engine.sequence import Sequence
from shared.model.tokenizer import IncrementalDetokenizer
from shared.wire.handoff.profile import PromptProfile
from shared.wire.payload import Payload
from shared.wire.protocol import SamplingParams

if TYPE_CHECKING:
    from shared.engine.batching import Scheduler
    from shared.engine.blocks import BlockManager
    from shared.engine.config import EngineConfig
    from shared.engine.kv.fastgen.kv import FastGenKv
    from shared.engine.runner import Runner
    from shared.model.config import LlamaConfig
    from shared.model.tokenizer import Tokenizer


class EngineFull(Exception):
    """The running batch or the KV pool has no room for one more sequence now; try again after some finish."""


@dataclass(frozen=True)
class PrefilledRequest:
    """A request whose prompt KV was computed by another engine (see `LLMEngine.add_prefilled`)."""

    request_id: str
    prompt_ids: list[int]
    first_token: int  # sampled by prefill, already streamed with its first `num_emitted_chars` characters
    num_emitted_chars: int
    params: SamplingParams
    kv: PromptKv
    num_cached_tokens: int = 0  # prompt tokens prefill reused, reported in usage
    fastgen_profile: PromptProfile | None = None  # prefill's FastGen profile (None: keep every token)


class KvHandoff:
    """Mixed into `LLMEngine`: its prompt-KV export and import (see the module doc); reads and changes its state."""

    config: EngineConfig
    model_config: LlamaConfig
    tokenizer: Tokenizer
    runner: Runner
    store: KvStore
    block_manager: BlockManager
    scheduler: Scheduler
    fastgen: FastGenKv | None
    _seqs: dict[str, Sequence]
    _detokenizers: dict[str, IncrementalDetokenizer]

    def _check_token_ids(self, token_ids: list[int]) -> None:
        """Raises ValueError for an id outside the vocabulary (it would fail the embedding lookup of a whole step)."""
        vocab = self.model_config.vocab_size
        bad = next((t for t in token_ids if not 0 <= t < vocab), None)
        if bad is not None:
            raise ValueError(f"token id {bad} is outside the vocabulary of {vocab} tokens")

    @property
    def block_format(self) -> BlockFormat:
        """The form this engine's prompt KV travels in (the engines at both ends must agree on it)."""
        return self.store.block_format

    def read_prompt_kv(self, request_id: str, layer_idx: int) -> PromptLayerKv:
        """One layer of a running request's prompt KV."""
        seq = self._seqs[request_id]
        return self.store.read_prompt_layer(request_id, self.block_manager.block_ids(request_id),
                                            seq.num_prompt_tokens, layer_idx)

    def export_block_payloads(self, request_id: str, first_block: int, num_blocks: int) -> list[Payload]:
        """Full blocks of a running request as the cache-store keeps them (the store's `block_payload`)."""
        block_ids = self.block_manager.block_ids(request_id)[first_block : first_block + num_blocks]
        return [self.store.block_payload(b, first_block + i == 0) for i, b in enumerate(block_ids)]

    def export_cached_payloads(self, block_hashes: list[int], first_block: int) -> list[Payload] | None:
        """Full blocks of a request that has finished, from the prefix cache it left them in, as the cache-store keeps
        them; `first_block` is the first one's index in its prompt. None when one was evicted meanwhile."""
        block_ids = self.block_manager.cached_block_ids(block_hashes)
        if block_ids is None:
            return None
        return [self.store.block_payload(b, first_block + i == 0) for i, b in enumerate(block_ids)]

    def take_profile(self, request_id: str) -> PromptProfile | None:
        """FastGen's profile of a prompt this prompt-only engine computed (`EngineConfig.prompt_only`), once; None
        without FastGen."""
        return None if self.fastgen is None else self.fastgen.take_profile(request_id)

    def kv_bytes_saved(self) -> int:
        """KV bytes FastGen does not hold now, over the running requests (0 without FastGen)."""
        return 0 if self.fastgen is None else self.fastgen.total_bytes_saved()

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
        limit = self.model_config.max_position
        if not prompt or len(prompt) >= limit:
            raise ValueError(f"a prompt of {len(prompt)} tokens; this model's context is {limit}")
        self._check_token_ids([*prompt, request.first_token])
        if request.kv.num_tokens != len(prompt):
            raise ValueError(f"prompt KV of {request.kv.num_tokens} tokens for a prompt of {len(prompt)}")
        cfg = self.model_config
        self.block_format.check(request.kv, cfg.num_layers, cfg.num_kv_heads, cfg.head_dim)
        if len(self.scheduler.running) >= self.runner.max_num_seqs:
            raise EngineFull(f"the running batch holds {self.runner.max_num_seqs} sequences")
        try:
            reused = self.block_manager.allocate(request.request_id, prompt)
        except OutOfBlocks as exc:
            raise EngineFull(str(exc)) from None
        block_ids = self.block_manager.block_ids(request.request_id)
        self.store.write_prompt(request.request_id, block_ids, request.kv, reused // self.config.block_size)
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

