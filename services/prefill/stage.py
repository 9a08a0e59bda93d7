"""A prefill instance's stage of its pipeline group: chunked pipeline parallelism (Mooncake's CPP, arXiv 2407.00079
section 5.1). Every instance of a group holds the whole model for short prompts and runs one contiguous range of
its layers, on the same weights, for long ones: the first stage computes a long prompt chunk by chunk and sends each
chunk's residual stream to the next stage (`StageRows` on `prefill.<id>.stage`), which computes that chunk with its
layers while the first computes the next chunk, and so on; each stage streams its own layers' KV into the request's
hand-off to decode (the first stage opened it), and the last one ends it with the first token. Each stage puts its
layers of a prompt's blocks into the cache-store and loads its layers of a prefix from there (`stage_store.py`).

It owns the stage engine (`LLMEngine.stage_engine`: its own KV pool, its own engine thread) and the requests in
it; the prefill service decides which prompts it leads (`PrefillService`) and forwards cancellations.
"""

from __future__ import annotations

import asyncio
import dataclasses
import functools
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from services.common.engine_host import EngineHost
from services.common.step_samples import StepSamples
from services.common.tasks import BackgroundTasks
from services.prefill.kv_send import LayerSender
from services.prefill.stage_store import StageStore
from shared.config import EngineSettings
from shared.engine.engine import LLMEngine, RequestOutput, StepStats
from shared.engine.sequence import FinishReason, Sequence
from shared.model.stages import LayerRange
from shared.wire.block_hash import block_hashes
from shared.wire.bus import Bus, BusError
from shared.wire.cache_client import CacheClient
from shared.wire.handoff.stage_rows import RowsAssembly, rows_parts
from shared.wire.log import get_logger
from shared.wire.parts import PartError
from shared.wire.payload import Payload
from shared.wire.protocol import (
    Ack,
    Cancel,
    ErrorType,
    HandoffEnd,
    Message,
    PrefillTask,
    StageRows,
    StageTask,
    StreamEvent,
)

log = get_logger(__name__)
STAGE_TASK_TIMEOUT_S = 30.0  # the next stage answers once its engine thread queued the prompt (after a step at most)


@dataclass
class _Held:
    """A request at this stage, from its task until its part is done."""

    task: PrefillTask
    num_kv_chunks: int
    hashes: list[int] = field(default_factory=list)  # the prompt's full blocks' ids in this stage's namespace
    rows_in: dict[int, RowsAssembly] = field(default_factory=dict)  # parts of the chunks arriving, by first token
    ready_in: dict[int, torch.Tensor] = field(default_factory=dict)  # whole chunks ahead of the next expected one
    next_in: int = -1  # the first token of the next chunk the engine takes (-1: before the task's start)
    rows_out: int = -1  # the first token of the next chunk sent on (-1: nothing sent yet)
    num_chunks: int = 0  # chunks of the prompt computed here (the first stage's steps, the others' chunks of rows)
    rows_bytes: int = 0  # hidden-state bytes sent to the next stage (as coded on the wire)
    rows_raw_bytes: int = 0  # the same before coding (the sim engine's: the sizes its rows stand for)
    sends: list[asyncio.Future[None]] = field(default_factory=list)
    sent_layers: set[int] = field(default_factory=set)
    started_at: float = field(default_factory=time.monotonic)


class PipelineStage:
    """Serves `prefill.<id>.stage` (`StageTask`, `StageRows`, `Cancel` from the group) for one instance's stage.

    Args:
        settings: the prefill service's settings (`cpp_group` names the group, first stage first).
        bus: the NATS connection.
        engine: the stage engine (`EngineConfig.stage` set), over the instance's model.
        cache: the cache-store its layers' blocks go to (None: none).
    Raises:
        ValueError: this instance is not in the group, or the engine runs no stage of it.
    """

    def __init__(self, settings: EngineSettings, bus: Bus, engine: LLMEngine, cache: CacheClient | None = None) -> None:
        group, me = settings.cpp_group, settings.instance_id
        stage = engine.config.stage
        if me not in group or stage is None:
            raise ValueError(f"{me} runs no stage of the pipeline group {', '.join(group)}")
        self.settings, self.bus, self.engine, self.group = settings, bus, engine, group
        self.stage: LayerRange = stage
        self.index = group.index(me)
        self.next_id = None if stage.is_last else group[self.index + 1]
        self.host: EngineHost[RequestOutput] = EngineHost(engine)
        self.store = None if cache is None else StageStore(engine, self.host, len(group), cache,
                                                           settings.kv_deadline_s)
        self._held: dict[str, _Held] = {}
        self._new_blocks: dict[str, tuple[int, list[Payload]]] = {}  # engine thread -> loop: (first block, blocks)
        self._aborts: set[str] = set()
        self.tasks = BackgroundTasks()
        self.sender = LayerSender(settings, bus, self.host, self.tasks)  # its layers' KV, and its hidden states
        self.num_moved_tokens = 0  # prompt tokens whose hand-off this stage ended (their KV reached decode)
        # Its steps, as the whole model's would take on this instance (its layers' share of the time scaled up): the
        # Conductor's prefill cost model learns long prompts' late chunks from them, the pipeline's time too.
        self.samples = StepSamples()
        self._last_stats: StepStats | None = None
        self.after_step: Callable[[], None] = lambda: None  # engine thread, after each step (the instance's KV events)

    @property
    def leads(self) -> bool:
        """The first stage: the group's long prompts start here."""
        return self.stage.is_first

    @property
    def row_bytes(self) -> int:
        """Bytes of one token's hidden-state row sent to the next stage, before coding (what the Conductor prices
        each boundary at)."""
        return self.engine.model_config.hidden_size * self.engine.config.torch_dtype.itemsize

    @property
    def namespace(self) -> str:
        """The block-hash namespace of this stage's KV blocks, as text (the heartbeat's: the Conductor hashes a
        prompt under it to find what this stage's prefix cache and the cache-store hold of its layers)."""
        return self.engine.block_namespace(self.stage).decode()

    @property
    def request_ids(self) -> list[str]:
        """The requests held here (the heartbeat reports them: a lost stage fails them)."""
        return list(self._held)

    async def start(self) -> None:
        subject = self.bus.subjects.prefill_stage(self.settings.instance_id)
        await self.bus.route(subject, {StageTask: self.handle_task, StageRows: self.handle_rows,
                                       Cancel: self.handle_cancel})
        self.host.start(self._tick, self._deliver)
        log.info("pipeline stage", stage=self.index, layers=str(self.stage), group=",".join(self.group),
                 next_stage=self.next_id, min_tokens=self.settings.cpp_min_tokens)

    async def stop(self) -> None:
        if self.store is not None:
            await self.store.stop()
        await self.host.stop()
        await self.tasks.close()
        self.sender.close()

    async def takes(self, prompt_ids: list[int]) -> bool:
        """Whether this first stage leads `prompt_ids` through the group: at least `cpp_min_tokens` of it to compute
        beyond what the stage's own prefix cache holds."""
        if not self.leads or len(prompt_ids) < self.settings.cpp_min_tokens:
            return False
        reusable = await self.host.call(self.engine.block_manager.num_reusable_tokens, prompt_ids)
        return len(prompt_ids) - reusable >= self.settings.cpp_min_tokens

    async def lead(self, task: PrefillTask, num_kv_chunks: int) -> None:
        """The first stage takes a prompt whose hand-off to decode is open, with `num_kv_chunks` chunks."""
        held = self._held[task.request_id] = _Held(task, num_kv_chunks, self._hashes(task.prompt_ids))
        log.info("pipeline prompt", request_id=task.request_id, stage=self.index, layers=str(self.stage),
                 prompt_tokens=len(task.prompt_ids), stages=len(self.group))
        try:
            source = None if self.store is None else await self.store.group_prefix(
                task.request_id, task.prompt_ids, held.hashes)
            await self.host.call(self.engine.add_request, task.request_id, task.prompt_ids, task.sampling, source)
        except ValueError as exc:
            await self._fail(task.request_id, ErrorType.INVALID, str(exc))
            return
        self.host.wake()

    # ---- from the stage before --------------------------------------------------------------------------------

    async def handle_task(self, msg: StageTask) -> Ack:
        """Take a prompt from the stage before; the answer says this stage is there (a failure here is told to the
        client here)."""
        task = msg.task
        if self.leads or task.request_id in self._held:
            return Ack(False, f"{self.settings.instance_id} is stage {self.index}, or holds {task.request_id} already")
        held = self._held[task.request_id] = _Held(task, msg.num_kv_chunks, self._hashes(task.prompt_ids),
                                                   next_in=msg.start)
        log.info("pipeline prompt", request_id=task.request_id, stage=self.index, layers=str(self.stage),
                 prompt_tokens=len(task.prompt_ids), tokens_from=msg.start)
        try:
            self.engine.check_prompt(task.prompt_ids)
            source = None if self.store is None else await self.store.missing_prefix(
                task.request_id, task.prompt_ids, held.hashes, msg.start)
            await self.host.call(self.engine.add_stage_request, task.request_id, task.prompt_ids, task.sampling,
                                 msg.start, source)
        except ValueError as exc:
            await self._fail(task.request_id, ErrorType.INVALID, str(exc))
        return Ack()

    async def handle_rows(self, msg: StageRows) -> None:
        held = self._held.get(msg.request_id)
        if held is None:
            return  # failed or cancelled here meanwhile
        assembly = held.rows_in.get(msg.token_start)
        if assembly is None:
            assembly = held.rows_in[msg.token_start] = RowsAssembly(msg)
        try:
            assembly.add(msg)
            if not assembly.is_complete:
                return
            start, rows = assembly.rows(self.engine.model_config.hidden_size, self.settings.engine_kind == "sim")
        except PartError as exc:
            await self._fail(msg.request_id, ErrorType.KV_TRANSFER, f"hidden states from the stage before: {exc}")
            return
        del held.rows_in[msg.token_start]
        held.ready_in[start] = rows
        held.num_chunks += 1
        while held.next_in in held.ready_in:  # chunks in token order, whatever order their parts completed in
            rows = held.ready_in.pop(held.next_in)
            held.next_in += rows.shape[0]
            try:
                await self.host.call(self.engine.add_stage_input, msg.request_id, rows)
            except (KeyError, ValueError) as exc:
                await self._fail(msg.request_id, ErrorType.KV_TRANSFER, f"hidden states from the stage before: {exc}")
                return
        self.host.wake()

    async def handle_cancel(self, msg: Cancel) -> None:
        """Another stage of the group failed the request (its client has heard), or the instance was told to drop
        it: abort it here, without a word to the client."""
        if self._held.pop(msg.request_id, None) is not None:
            self._aborts.add(msg.request_id)
            self.host.wake()
            log.info("pipeline prompt dropped", request_id=msg.request_id, stage=self.index, reason=msg.reason)

    # ---- the engine thread ------------------------------------------------------------------------------------

    def _tick(self) -> tuple[list[RequestOutput], bool]:
        """A step, and whether to step again at once: only after a step that computed something. A prompt waiting
        for the stage before's rows is unfinished but has nothing to compute; `handle_rows` wakes the loop when they
        come (stepping on meanwhile would spin this thread beside the stages it waits for)."""
        for request_id in list(self._aborts):
            self._aborts.discard(request_id)
            self.engine.abort(request_id)
        outputs = self.engine.step(self._on_layer) if self.engine.has_unfinished() else []
        stats = self.engine.last_step
        computed = stats is not None and stats is not self._last_stats
        if computed:
            assert stats is not None
            self._last_stats = stats
            scale = self.stage.num_layers / len(self.stage)
            self.samples.add(dataclasses.replace(stats, seconds=stats.seconds * scale))
        for out in outputs:
            part_done = out.finished or bool(out.new_token_ids)  # rows of the prompt's end sent, or its first token
            if part_done and out.finish_reason != FinishReason.ERROR:
                self._export_blocks(out)
            if out.new_token_ids and not out.finished:  # the last stage's first token: its part is done
                self.engine.abort(out.request_id)
        self.after_step()
        return outputs, computed and self.engine.has_unfinished()

    def _export_blocks(self, out: RequestOutput) -> None:
        """Engine thread: the prompt's new full blocks, for the cache-store (`_deliver` puts them there)."""
        held = self._held.get(out.request_id)
        if self.store is not None and held is not None:
            new_blocks = self.store.export(out, held.hashes)
            if new_blocks is not None:
                self._new_blocks[out.request_id] = new_blocks

    def _on_layer(self, layer_idx: int, seqs: list[Sequence]) -> None:
        """Engine thread, mid-forward: this stage's layer of a finished prompt, copied for decode."""
        for seq in seqs:
            held = self._held.get(seq.request_id)
            if held is None or layer_idx in held.sent_layers:
                continue
            held.sent_layers.add(layer_idx)
            kv = self.engine.read_prompt_kv(seq.request_id, layer_idx)
            held.sends.append(self.sender.send(held.task, self.stage.start + layer_idx, kv, self.engine.block_format,
                                               held.num_kv_chunks, self.stage.num_layers))

    # ---- back on the event loop -------------------------------------------------------------------------------

    async def _deliver(self, outputs: list[RequestOutput]) -> None:
        for out in outputs:
            held = self._held.get(out.request_id)
            new_blocks = self._new_blocks.pop(out.request_id, None)
            if held is None:
                continue
            if self.store is not None and new_blocks is not None:
                self.tasks.spawn(self.store.put(out.request_id, held.hashes, *new_blocks),
                                 f"store-stage-blocks-{out.request_id}")
            if out.finish_reason == FinishReason.ERROR:
                await self._fail(out.request_id, ErrorType.INTERNAL, f"pipeline stage {self.index}: {out.error}")
                continue
            held.num_chunks += self.leads
            try:
                if out.stage_rows is not None:
                    await self._send_rows(held, out)
                else:
                    await self._hand_off(held, out)
            except Exception as exc:
                await self._fail(out.request_id, ErrorType.KV_TRANSFER, f"pipeline stage {self.index}: {exc}")

    async def _send_rows(self, held: _Held, out: RequestOutput) -> None:
        """A chunk's rows to the next stage (its task first); with the prompt's last rows, this stage's part ends,
        once its KV is out (so decode has it before the last stage ends the hand-off)."""
        assert out.stage_rows is not None and self.next_id is not None
        task, subject = held.task, self.bus.subjects.prefill_stage(self.next_id)
        if held.rows_out < 0:
            held.rows_out = out.num_cached_tokens
            try:  # asked, not told: a stage that is not there fails the request now, not at decode's deadline
                await self.bus.request(subject, StageTask(task, held.rows_out, held.num_kv_chunks), Ack,
                                       timeout_s=STAGE_TASK_TIMEOUT_S)
            except BusError as exc:
                await self._fail(task.request_id, ErrorType.UNAVAILABLE,
                                 f"pipeline stage {self.next_id} is not answering: {exc}")
                return
        if out.finished:
            await asyncio.gather(*held.sends)
        encode = functools.partial(rows_parts, task.request_id, held.rows_out, out.stage_rows, self.sender.part_bytes,
                                   self.settings.kv_compress)
        for part in await self.sender.encode(encode):
            await self.bus.publish(subject, part)
            held.rows_bytes += len(part.data)
            held.rows_raw_bytes += part.raw_size
        held.rows_out += out.stage_rows.shape[0]
        if out.finished:
            self._held.pop(task.request_id, None)
            log.info("pipeline stage done", request_id=task.request_id, stage=self.index, layers=str(self.stage),
                     chunks=held.num_chunks, tokens_from=out.num_cached_tokens, next_stage=self.next_id,
                     rows_bytes=held.rows_bytes, rows_raw_bytes=held.rows_raw_bytes,
                     seconds=round(time.monotonic() - held.started_at, 4))

    async def _hand_off(self, held: _Held, out: RequestOutput) -> None:
        """The last stage: end the hand-off with the first token (or, finished at it, answer here and close it)."""
        task = held.task
        self._held.pop(task.request_id, None)
        await asyncio.gather(*held.sends)
        if out.finished:
            await self.bus.publish(self.bus.subjects.stream(task.request_id), StreamEvent(
                task.request_id, 0, out.new_token_ids, out.new_text, out.finish_reason, out.num_prompt_tokens,
                out.num_cached_tokens,
            ))
            await self._to_decode(held, Cancel(task.request_id, "finished at prefill"))
        else:
            await self._to_decode(held, HandoffEnd(task.request_id, out.new_token_ids[0], out.new_text,
                                                   out.num_cached_tokens, 0))
            self.num_moved_tokens += len(task.prompt_ids)
        log.info("prefilled", request_id=task.request_id, stage=self.index, layers=str(self.stage),
                 chunks=held.num_chunks, ttft_s=round(time.time() - task.arrival_time, 4),
                 kv_chunks=held.num_kv_chunks)

    def _hashes(self, prompt_ids: list[int]) -> list[int]:
        return block_hashes(prompt_ids, self.engine.config.block_size, self.engine.block_manager.namespace)

    async def _to_decode(self, held: _Held, msg: Message) -> None:
        await self.bus.publish(self.bus.subjects.decode_handoff(held.task.decode_id), msg)

    async def _fail(self, request_id: str, error_type: ErrorType, error: str) -> None:
        """Fail a request held here: its client hears, decode drops its hand-off, the group's other stages drop it."""
        held = self._held.pop(request_id, None)
        if held is None:
            return
        self._aborts.add(request_id)
        self.host.wake()
        log.warning("pipeline prompt failed", request_id=request_id, stage=self.index, error_type=error_type,
                    error=error)
        await self.bus.publish(self.bus.subjects.stream(request_id), StreamEvent.failure(request_id, error_type, error))
        await self._to_decode(held, Cancel(request_id, f"failed at pipeline stage {self.index}: {error}"))
        for other in self.group:
            if other != self.settings.instance_id:
                await self.bus.publish(self.bus.subjects.prefill_stage(other), Cancel(request_id, error))
