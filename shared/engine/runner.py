"""The model runner: owns the model and the KV store it attends over; turns a step plan into one forward pass.

It does not decide what runs (that is `batching.Scheduler`) nor what text comes out (that is `engine.LLMEngine`);
where KV lives and how a step attends over it is the store's (`shared.engine.kv`).
"""

from __future__ import annotations

import dataclasses
import time
from typing import Protocol

import torch

from kernels.backend import KernelBackend, select_backend
from kernels.cpu_build import auto_cpu_kernels_error
from kernels.layer_ops import cpu_layer_ops
from shared.engine.batching import ScheduledChunk, StepPlan
from shared.engine.blocks import BlockEventHook
from shared.engine.config import EngineConfig
from shared.engine.kv.factory import build_kv_store
from shared.engine.kv.store import KvStore, LayerCallback
from shared.engine.sampling import Sampler
from shared.engine.sequence import Sequence
from shared.model.checkpoint import Checkpoint
from shared.model.llama import Llama, build_dummy_model, build_model, use_layer_ops
from shared.model.stages import LayerRange
from shared.wire.block_hash import make_namespace
from shared.wire.log import get_logger

log = get_logger(__name__)


class Runner(Protocol):
    """What the engine needs of a runner: the KV store, the request's end, and one step.

    Attributes:
        tokens_ready_at: `time.perf_counter()` when the last step's sampled tokens existed (what a decode instance
            times its token gaps by, before its host's own delays in passing them on).
    """

    tokens_ready_at: float

    @property
    def store(self) -> KvStore: ...

    @property
    def max_num_seqs(self) -> int:
        """The most sequences it can run at once (the engine's batch cap)."""
        ...

    def forget(self, request_id: str) -> None:
        """The request is finished or aborted: release its KV."""

    def execute(
        self, plan: StepPlan, block_tables: dict[str, list[int]], after_layer: LayerCallback | None = None,
        before_layer: LayerCallback | None = None,
    ) -> dict[str, int]: ...

    def execute_stage(
        self, plan: StepPlan, block_tables: dict[str, list[int]], after_layer: LayerCallback | None = None,
        before_layer: LayerCallback | None = None,
    ) -> dict[str, torch.Tensor]:
        """A step of a pipeline stage before the last: each chunk's output rows by request id."""
        ...

    def for_stage(self, config: EngineConfig, on_block_event: BlockEventHook | None = None) -> Runner:
        """A runner for the pipeline stage `config.stage` of this whole-model runner's model (sharing its weights),
        with a KV store of its own, whose prefix cache's changes `on_block_event` hears."""
        ...

    def block_namespace(self, layers: LayerRange) -> bytes:
        """The block-hash namespace of the KV blocks of `layers` of this runner's model in its KV format (a stage's
        blocks are never another stage's or the whole model's)."""
        ...


class ModelRunner:
    """Runs forward passes over the KV store `build_kv_store` makes of the config.

    Args:
        checkpoint: the loaded model files.
        config: engine settings (device, dtype, KV store, kernels).
        on_block_event: hears every change of the prefix cache's index (`BlockManager`'s `on_event`).
        model: run this model (another engine's, or a `Llama.stage_of` view of it) instead of building one.
    Raises:
        ValueError: a KV budget of fewer than 2 blocks, an unknown or unavailable kernel backend, or a KV codec
            calibration that does not fit the model.
    """

    def __init__(
        self, checkpoint: Checkpoint, config: EngineConfig, on_block_event: BlockEventHook | None = None,
        model: Llama | None = None,
    ) -> None:
        if config.num_threads > 0:
            torch.set_num_threads(config.num_threads)
        self.device, self.dtype = config.torch_device, config.torch_dtype
        self.stage = config.stage or LayerRange.whole(checkpoint.config.num_layers)
        stage_config = self.stage.local_config(checkpoint.config)  # its KV store holds its layers alone
        self.checkpoint = dataclasses.replace(checkpoint, state_dict={})  # what another engine over its model needs
        self.kv_format = config.kv_format
        self.model: Llama
        if model is not None:
            if model.stage != self.stage:
                raise ValueError(f"a model of {model.stage} for an engine of {self.stage}")
            self.model = model
        elif checkpoint.is_dummy:
            self.model = build_dummy_model(checkpoint.config, config.torch_dtype, self.device, layers=self.stage)
        else:
            self.model = build_model(checkpoint.config, checkpoint.state_dict, config.torch_dtype, self.device,
                                     layers=self.stage)
        self.block_size = config.block_size
        self.backend: KernelBackend = select_backend(config.kernels, self.device)
        if self.device.type == "cpu" and self.backend is KernelBackend.TORCH and config.kernels == "auto":
            log.warning("decode attention takes the PyTorch reference (slower)", reason=auto_cpu_kernels_error())
        if self.backend is KernelBackend.CPU and model is None:
            use_layer_ops(self.model, cpu_layer_ops())  # norms, rotary and SwiGLU in C++ too
        self.store: KvStore = build_kv_store(dataclasses.replace(checkpoint, config=stage_config), config,
                                             self.model.rotary, self.backend, on_block_event)
        self.sampler = Sampler()
        self.eos_token_ids = list(checkpoint.tokenizer.eos_token_ids)
        # A vocabulary larger than the tokenizer's (padded embeddings; a dummy model's shape) never samples an id
        # the tokenizer cannot decode.
        self.num_decodable = min(checkpoint.config.vocab_size, checkpoint.tokenizer.vocab_size)
        self.tokens_ready_at = 0.0

    @property
    def max_num_seqs(self) -> int:
        return self.store.max_num_seqs

    def for_stage(self, config: EngineConfig, on_block_event: BlockEventHook | None = None) -> ModelRunner:
        assert config.stage is not None
        return ModelRunner(self.checkpoint, config, on_block_event, model=self.model.stage_of(config.stage))

    def block_namespace(self, layers: LayerRange) -> bytes:
        return make_namespace(self.checkpoint.fingerprint, layers.block_format(self.kv_format))

    def execute(
        self, plan: StepPlan, block_tables: dict[str, list[int]], after_layer: LayerCallback | None = None,
        before_layer: LayerCallback | None = None,
    ) -> dict[str, int]:
        """Run one step; returns the sampled token of every sequence whose chunk completes it.

        During the forward pass, once each layer's new K/V are stored: `before_layer(layer_idx)` (it may block until
        prefix K/V loaded from outside is in the pool), then `after_layer(layer_idx)` (all of the layer's K/V are in
        the pool), then attention. At a pipeline stage, layer indices are the stage's own (from 0).
        """
        hidden, chunks = self._forward(plan, block_tables, after_layer, before_layer)
        with torch.inference_mode():
            rows, seqs = self._sample_rows(chunks)
            if not rows:
                return {}
            logits = self.model.compute_logits(hidden[self._tensor(rows)])
            if self.num_decodable < logits.shape[-1]:
                logits[:, self.num_decodable :] = float("-inf")
            self._suppress_early_eos(logits, seqs)
        positions = [s.params.output_offset + s.num_output_tokens for s in seqs]  # of the whole answer
        tokens = self.sampler.sample(logits, [s.params for s in seqs], positions)
        self.tokens_ready_at = time.perf_counter()
        return {seq.request_id: token for seq, token in zip(seqs, tokens, strict=True)}

    def execute_stage(
        self, plan: StepPlan, block_tables: dict[str, list[int]], after_layer: LayerCallback | None = None,
        before_layer: LayerCallback | None = None,
    ) -> dict[str, torch.Tensor]:
        """Run one step of a pipeline stage before the last: each chunk's rows of the residual stream, [num_tokens,
        hidden_size] by request id, for the next stage (hooks as for `execute`)."""
        hidden, chunks = self._forward(plan, block_tables, after_layer, before_layer)
        rows = hidden.split([c.num_tokens for c in chunks])
        return {c.seq.request_id: r for c, r in zip(chunks, rows, strict=True)}

    def _forward(
        self, plan: StepPlan, block_tables: dict[str, list[int]], after_layer: LayerCallback | None,
        before_layer: LayerCallback | None,
    ) -> tuple[torch.Tensor, list[ScheduledChunk]]:
        """The step's forward pass over this runner's layers: (hidden states of every token, the chunks in the
        order of its rows). A stage after the first starts from the rows its chunks' sequences received."""
        chunks, ctx = self.store.attention(plan.chunks, block_tables, after_layer, before_layer)
        input_ids, positions = self._flatten(chunks)
        stage_input = None
        if not self.stage.is_first:
            parts = []
            for chunk in chunks:
                if chunk.seq.stage_input is None:
                    raise ValueError(f"request {chunk.seq.request_id} has no rows from the stage before")
                parts.append(chunk.seq.stage_input.take(chunk.seq.num_computed_tokens, chunk.num_tokens))
            stage_input = (parts[0] if len(parts) == 1 else torch.cat(parts)).to(self.device, self.dtype)
        with torch.inference_mode():
            return self.model(self._tensor(input_ids), self._tensor(positions), ctx, stage_input), chunks

    def forget(self, request_id: str) -> None:
        self.store.release(request_id)

    def _suppress_early_eos(self, logits: torch.Tensor, seqs: list[Sequence]) -> None:
        """Below `min_tokens`, end-of-sequence tokens cannot be sampled (vLLM's and transformers' semantics)."""
        for row, seq in enumerate(seqs):
            if seq.num_output_tokens < seq.params.min_tokens:
                logits[row, self.eos_token_ids] = float("-inf")

    def _tensor(self, values: list[int]) -> torch.Tensor:
        return torch.tensor(values, dtype=torch.long, device=self.device)

    @staticmethod
    def _flatten(chunks: list[ScheduledChunk]) -> tuple[list[int], list[int]]:
        """The step's token ids and their positions, chunk after chunk."""
        input_ids: list[int] = []
        positions: list[int] = []
        for chunk in chunks:
            seq, start = chunk.seq, chunk.seq.num_computed_tokens
            input_ids.extend(seq.token_ids[start : start + chunk.num_tokens])
            positions.extend(range(start, start + chunk.num_tokens))
        return input_ids, positions

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
