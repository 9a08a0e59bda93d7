"""Replaying a trace against a virtual cluster through the gateway's own request path: for each request, at its
arrival, the prompt's block hashes as the gateway computes them, then a `Session` over `NatsBackend` (stream opened
first, submit, events released in order, a request lost or silent failed as the gateway fails it), and the times
its client would have seen each token.

What differs from production, and why: no HTTP, no tokenizer (trace prompts are token ids, as loadgen sends them),
no SSE framing; what a `RequestRecord` holds is the same as loadgen's, so every metric and SLO is computed alike.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from dataclasses import dataclass

from loadgen.prompts import BlockTokens
from loadgen.record import RequestRecord
from loadgen.trace import TRACE_BLOCK_LEN, TraceEntry
from services.gateway.__main__ import model_info
from services.gateway.backend import COLOCATED_ROLES_FOR_HEALTH, ROLES_FOR_HEALTH, NatsBackend
from services.gateway.errors import ApiError
from services.gateway.metrics import GatewayMetrics, RequestTimer
from services.gateway.prompt import PromptBuilder
from services.gateway.session import Deadlines, Session
from services.virtual.cluster import VirtualCluster
from shared.config import GatewaySettings, load_role_settings
from shared.wire.block_hash import block_hashes
from shared.wire.protocol import SamplingParams, SubmitRequest

GATEWAY_NODE = "gateway"


@dataclass(frozen=True)
class ReplayOptions:
    """How to replay: arrival times multiplied by `time_scale`; `seed` of the trace blocks' tokens; every output at
    most `max_output_tokens` (None: the trace's)."""

    time_scale: float = 1.0
    seed: int = 0
    ready_timeout_s: float = 30.0
    max_output_tokens: int | None = None


class Replay:
    """Sends a trace's requests to a virtual cluster at their times and records what each client saw.

    Args:
        cluster: a started cluster.
        on_done: called with each finished record (a progress bar).
    """

    def __init__(self, cluster: VirtualCluster, options: ReplayOptions,
                 on_done: Callable[[RequestRecord], None] | None = None) -> None:
        self.cluster, self.options, self.on_done = cluster, options, on_done
        settings = load_role_settings(GatewaySettings, "gateway", cluster.spec.env_for_all())
        self.block_size = settings.engine.block_size
        self.namespace = PromptBuilder(model_info(settings), self.block_size).namespace
        self.backend = NatsBackend(cluster.connect("gateway-0", GATEWAY_NODE), settings.instance_timeout_s)
        self.deadlines = Deadlines(settings.request_timeout_s, settings.progress_timeout_s)
        self.metrics = GatewayMetrics()
        self.start_s = 0.0

    async def run(self, entries: list[TraceEntry]) -> list[RequestRecord]:
        """Every entry at (its timestamp - the first's) x time_scale from now; returns their records in order."""
        await self.backend.start()
        await self._wait_ready()
        loop = asyncio.get_running_loop()
        self.start_s = loop.time()
        blocks = BlockTokens(TRACE_BLOCK_LEN, self.options.seed)
        first_ms = entries[0].timestamp_ms if entries else 0.0
        tasks = []
        for i, entry in enumerate(entries):
            arrival_s = (entry.timestamp_ms - first_ms) / 1000.0 * self.options.time_scale
            delay = self.start_s + arrival_s - loop.time()
            if delay > 0:
                await asyncio.sleep(delay)
            tasks.append(loop.create_task(self._one(i, arrival_s, entry, blocks)))
        records = await asyncio.gather(*tasks)
        await self.backend.stop()
        return list(records)

    def elapsed_s(self) -> float:
        """Virtual seconds since the first request was due."""
        return asyncio.get_running_loop().time() - self.start_s if self.start_s else 0.0

    async def _wait_ready(self) -> None:
        """Until the gateway would say healthy: a live scheduler and the engine roles."""
        roles = COLOCATED_ROLES_FOR_HEALTH if self.cluster.spec.colocated else ROLES_FOR_HEALTH
        deadline = time.monotonic() + self.options.ready_timeout_s
        while not all(self.backend.num_alive(role) for role in roles):
            if time.monotonic() > deadline:
                alive = [role for role in roles if self.backend.num_alive(role)]
                raise RuntimeError(f"the virtual cluster did not come up (alive: {alive or 'nothing'})")
            await asyncio.sleep(0.1)

    async def _one(self, index: int, arrival_s: float, entry: TraceEntry, blocks: BlockTokens) -> RequestRecord:
        prompt = blocks.prompt(list(entry.hash_ids), entry.input_length)
        output_len = min(entry.output_length, self.options.max_output_tokens or entry.output_length)
        record = RequestRecord(index, arrival_s, entry.input_length, output_len)
        sampling = SamplingParams(max_tokens=output_len, temperature=0.0, ignore_eos=True)
        request = SubmitRequest(f"trace-{index}", prompt, block_hashes(prompt, self.block_size, self.namespace),
                                sampling, time.time())
        loop = asyncio.get_running_loop()
        record.send_s = loop.time() - self.start_s
        try:
            async with Session(self.backend, request, self.deadlines,
                               RequestTimer(self.metrics, time.monotonic())) as session:
                while True:
                    delta = await session.next_delta()
                    if delta.num_tokens or delta.text:
                        record.chunk_times_s.append(loop.time() - self.start_s)
                    if delta.finish_reason is not None:
                        break
                record.status = 200
                record.num_output_tokens = session.num_output_tokens
                record.num_prompt_tokens = session.num_prompt_tokens
                record.num_cached_tokens = session.num_cached_tokens
        except ApiError as exc:
            record.status, record.error = exc.status, exc.message
        record.done_s = loop.time() - self.start_s
        if self.on_done is not None:
            self.on_done(record)
        return record
