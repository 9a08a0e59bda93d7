"""Disaggregation, the engine's side: prompt KV out of a prefill engine (per layer, as blocks for the cache-store) and
into a decode engine (`add_prefilled`), raw or through the engine's KV codec (`prompt_kv`'s packed forms). A mixin of
`LLMEngine`; how they travel is the wire's (`shared.wire.kv_transfer`), which the engine does not import.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from shared.engine.blocks import OutOfBlocks
from shared.engine.codec_pool import CodecKvPool
from shared.engine.kv_cache import KVPool
from shared.engine.prompt_kv import PackedFormat, PackedLayerKv, PackedPromptKv, check_prompt_kv, write_packed
from shared.engine.sequence import Sequence
from shared.fastgen.wire import PromptProfile
from shared.model.tokenizer import IncrementalDetokenizer
from shared.wire.payload import Payload
from shared.wire.protocol import SamplingParams

if TYPE_CHECKING:
    from shared.engine.batching import Scheduler
    from shared.engine.blocks import BlockManager
    from shared.engine.config import EngineConfig
    from shared.engine.fastgen.kv import FastGenKv
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
    kv: torch.Tensor | PackedPromptKv  # raw [num_layers, 2, kv_heads, len(prompt_ids), head_dim], or packed
    num_cached_tokens: int = 0  # prompt tokens prefill reused, reported in usage
    fastgen_profile: PromptProfile | None = None  # prefill's FastGen profile (None: keep every token)


class KvHandoff:
    """Mixed into `LLMEngine`: its prompt-KV export and import (see the module doc); reads and changes its state."""

    config: EngineConfig
    model_config: LlamaConfig
    tokenizer: Tokenizer
    runner: Runner
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
        limit = self.model_config.max_position
        if not prompt or len(prompt) >= limit:
            raise ValueError(f"a prompt of {len(prompt)} tokens; this model's context is {limit}")
        self._check_token_ids([*prompt, request.first_token])
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

