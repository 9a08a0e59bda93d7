"""The model runner: owns the model, the KV pool and every tensor; turns a step plan into one forward pass.

It does not decide what runs (that is `batching.Scheduler`) nor what text comes out (that is `engine.LLMEngine`).
"""

from __future__ import annotations

from typing import Protocol

import torch

from kernels.backend import KernelBackend, select_backend
from shared.engine.batching import ScheduledChunk, StepPlan
from shared.engine.codec_attention import CodecAttention, CodecStepLayout
from shared.engine.codec_decode import FusedDecode
from shared.engine.codec_pool import CodecKvPool
from shared.engine.config import EngineConfig
from shared.engine.fastgen.attention import FastGenAttention, split_chunks
from shared.engine.fastgen.kv import FastGenKv
from shared.engine.kv_cache import KVPool, LayerCallback, PaddedPrefill, PagedAttention, PrefillSegment, StepMetadata
from shared.engine.sampling import Sampler
from shared.engine.sequence import Sequence
from shared.kvcompress import layer_codecs, load_calibration
from shared.model.checkpoint import Checkpoint
from shared.model.config import LlamaConfig
from shared.model.llama import Llama, build_model


class Runner(Protocol):
    """What the engine needs of a runner: the KV pool, the sampler's per-request state, and one step."""

    sampler: Sampler
    max_num_seqs: int  # the most sequences it can run at once (the engine's batch cap)

    @property
    def pool(self) -> KVPool | CodecKvPool: ...

    def forget(self, request_id: str) -> None:
        """The request is finished or aborted: drop its per-request state."""

    def execute(
        self, plan: StepPlan, block_tables: dict[str, list[int]], after_layer: LayerCallback | None = None,
        before_layer: LayerCallback | None = None,
    ) -> dict[str, int]: ...


class ModelRunner:
    """Runs forward passes over the paged KV pool.

    Args:
        checkpoint: the loaded model files.
        config: engine settings (device, dtype, pool size, kernels).
    Raises:
        ValueError: a pool budget of fewer than 2 blocks, an unknown or unavailable kernel backend, or a KV codec
            calibration that does not fit the model.
    """

    def __init__(self, checkpoint: Checkpoint, config: EngineConfig) -> None:
        if config.num_threads > 0:
            torch.set_num_threads(config.num_threads)
        self.device = config.torch_device
        self.dtype = config.torch_dtype
        self.model_config = checkpoint.config
        self.model: Llama = build_model(checkpoint.config, checkpoint.state_dict, self.dtype, self.device)
        self.block_size = config.block_size
        self.max_num_seqs = config.max_num_seqs  # a codec pool may allow fewer (one tail per sequence)
        self.pool: KVPool | CodecKvPool = self._make_pool(checkpoint.config, config, checkpoint.path.name)
        self.backend: KernelBackend = select_backend(config.kernels, self.device)
        # kvquant pools pack and decode through the Triton kernels on that backend (other codecs: dequantize, attend)
        is_fused = self.backend is KernelBackend.TRITON and FusedDecode.supports(self.pool)
        self.fused_decode = FusedDecode(self.pool, self.model.rotary) if is_fused else None  # type: ignore[arg-type]
        self.scale = checkpoint.config.head_dim**-0.5
        self.sampler = Sampler()
        self.eos_token_ids = list(checkpoint.tokenizer.eos_token_ids)
        self.fastgen: FastGenKv | None = None  # set by the engine when it runs FastGen

    def execute(
        self, plan: StepPlan, block_tables: dict[str, list[int]], after_layer: LayerCallback | None = None,
        before_layer: LayerCallback | None = None,
    ) -> dict[str, int]:
        """Run one step; returns the sampled token of every sequence whose chunk completes it.

        During the forward pass, once each layer's new K/V are stored: `before_layer(layer_idx)` (it may block until
        prefix K/V loaded from outside is in the pool), then `after_layer(layer_idx)` (all of the layer's K/V are in
        the pool), then attention.
        """
        chunks, lane_chunks = plan.chunks, list[ScheduledChunk]()
        if self.fastgen is not None:
            lane_chunks, paged_chunks = split_chunks(plan.chunks, self.fastgen)
            chunks = lane_chunks + paged_chunks
        input_ids, positions, slots = self._flatten(chunks, block_tables)
        ctx: PagedAttention | CodecAttention | FastGenAttention
        paged = chunks[len(lane_chunks) :]
        if isinstance(self.pool, CodecKvPool):
            for seq in plan.preempted:
                self.pool.release(seq.request_id)
            layout = CodecStepLayout.build(paged, block_tables, self.pool, self.device)
            ctx = CodecAttention(self.pool, layout, self.scale, self.model.rotary, after_layer, before_layer,
                                 self.fused_decode, self.backend)
        else:
            meta = self._metadata(paged, block_tables, slots)
            ctx = PagedAttention(self.pool, meta, self.scale, self.backend, after_layer, before_layer)
        if self.fastgen is not None:
            ctx = FastGenAttention(ctx, self.fastgen, lane_chunks, paged, block_tables)
        with torch.inference_mode():
            hidden = self.model(self._tensor(input_ids), self._tensor(positions), ctx)
            rows, seqs = self._sample_rows(chunks)
            if not rows:
                return {}
            logits = self.model.compute_logits(hidden[self._tensor(rows)])
            self._suppress_early_eos(logits, seqs)
        tokens = self.sampler.sample(logits, [s.request_id for s in seqs], [s.params for s in seqs])
        return {seq.request_id: token for seq, token in zip(seqs, tokens, strict=True)}

    def forget(self, request_id: str) -> None:
        self.sampler.forget(request_id)
        if self.fastgen is not None:
            self.fastgen.release(request_id)
        if isinstance(self.pool, CodecKvPool):
            self.pool.release(request_id)

    def _make_pool(self, model: LlamaConfig, config: EngineConfig, checkpoint_name: str) -> KVPool | CodecKvPool:
        """The paged pool `config.kv_cache_bytes` pays for: raw tensors, or codec rows plus one tail per sequence."""
        if config.kv_codec == "none":
            per_block = KVPool.bytes_per_block(model, config.block_size, self.dtype)
            num_blocks = config.kv_cache_bytes // per_block
        else:
            path = config.kv_calibration_path
            calibration = None if path is None else load_calibration(path)
            if calibration is not None and config.kv_calib is None and calibration.info.get("model") != checkpoint_name:
                raise ValueError(
                    f"the shipped {config.kv_codec} calibration is for {calibration.info.get('model')}, not "
                    f"{checkpoint_name}: make one with `tsukimi calibrate kv --model ...` and pass --kv-calib"
                )
            codecs = layer_codecs(config.kv_codec, model.num_layers, model.num_kv_heads, model.head_dim, calibration)
            # Every running sequence holds one full-precision tail; tails take at most a quarter of the budget, and
            # the batch is capped at the number of tails (`max_num_seqs`).
            per_tail = CodecKvPool.bytes_per_tail(model, config.block_size, self.dtype)
            tails = min(config.max_num_seqs, max(1, config.kv_cache_bytes // 4 // per_tail))
            self.max_num_seqs = tails
            budget = config.kv_cache_bytes - tails * per_tail
            num_blocks = max(0, budget) // CodecKvPool.bytes_per_block(codecs[0], model, config.block_size)
        if num_blocks < 2:
            raise ValueError(f"kv_cache_bytes={config.kv_cache_bytes} holds {num_blocks} blocks; need at least 2")
        if config.kv_codec == "none":
            return KVPool(model, num_blocks, config.block_size, self.dtype, self.device)
        return CodecKvPool(model, codecs, num_blocks, config.block_size, tails, self.dtype, self.device)

    def _suppress_early_eos(self, logits: torch.Tensor, seqs: list[Sequence]) -> None:
        """Below `min_tokens`, end-of-sequence tokens cannot be sampled (vLLM's and transformers' semantics)."""
        for row, seq in enumerate(seqs):
            if seq.num_output_tokens < seq.params.min_tokens:
                logits[row, self.eos_token_ids] = float("-inf")

    def _tensor(self, values: list[int]) -> torch.Tensor:
        return torch.tensor(values, dtype=torch.long, device=self.device)

    def _flatten(
        self, chunks: list[ScheduledChunk], block_tables: dict[str, list[int]]
    ) -> tuple[list[int], list[int], list[int]]:
        input_ids: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        bs = self.block_size
        for chunk in chunks:
            seq, start = chunk.seq, chunk.seq.num_computed_tokens
            span = range(start, start + chunk.num_tokens)
            input_ids.extend(seq.token_ids[start : start + chunk.num_tokens])
            positions.extend(span)
            table = block_tables.get(seq.request_id)  # none for a sequence whose KV is in FastGen's lanes
            if table is not None:
                slots.extend(table[p // bs] * bs + p % bs for p in span)
        return input_ids, positions, slots

    def _metadata(
        self, chunks: list[ScheduledChunk], block_tables: dict[str, list[int]], slots: list[int]
    ) -> StepMetadata:
        decode = [c for c in chunks if c.num_tokens == 1]
        tables = [block_tables[c.seq.request_id] for c in decode]
        width = max((len(t) for t in tables), default=1)
        padded = [t + [0] * (width - len(t)) for t in tables] or [[0]]
        segments: list[PrefillSegment] = []
        row = len(decode)
        for chunk in chunks[len(decode) :]:
            context_len = chunk.seq.num_computed_tokens + chunk.num_tokens
            table = self._tensor(block_tables[chunk.seq.request_id])
            segments.append(PrefillSegment(row, chunk.num_tokens, context_len, table))
            row += chunk.num_tokens
        return StepMetadata(
            padded_prefill=self._padded_prefill(segments, block_tables, chunks[len(decode) :]),
            slot_mapping=self._tensor(slots),
            num_decode_tokens=len(decode),
            decode_block_tables=torch.tensor(padded, dtype=torch.int32, device=self.device),
            decode_context_lens=torch.tensor(
                [c.seq.num_computed_tokens + 1 for c in decode], dtype=torch.int32, device=self.device
            ),
            prefill_segments=segments,
        )

    def _padded_prefill(
        self, segments: list[PrefillSegment], block_tables: dict[str, list[int]], chunks: list[ScheduledChunk]
    ) -> PaddedPrefill | None:
        """On the reference path, batch the step's prefill attention when the chunks are alike in length."""
        if self.backend is not KernelBackend.TORCH or not PaddedPrefill.is_worth_it(segments, self.block_size):
            return None
        tables = [block_tables[c.seq.request_id][: -(-s.context_len // self.block_size)]
                  for c, s in zip(chunks, segments, strict=True)]
        width = max(len(t) for t in tables)
        padded = [t + [t[0]] * (width - len(t)) for t in tables]
        return PaddedPrefill(
            block_tables=torch.tensor(padded, dtype=torch.long, device=self.device),
            num_new=[s.num_tokens for s in segments],
            context_lens=[s.context_len for s in segments],
        )

    @staticmethod
    def _sample_rows(chunks: list[ScheduledChunk]) -> tuple[list[int], list[Sequence]]:
        rows: list[int] = []
        seqs: list[Sequence] = []
        end = 0
        for chunk in chunks:
            end += chunk.num_tokens
            if chunk.completes_sequence:
                rows.append(end - 1)
                seqs.append(chunk.seq)
        return rows, seqs
