"""The system under a benchmark (its lifecycle is `shared.tools.experiment.system`, re-exported here) and one
streamed chat request timed by the client. No workload here, and nothing from tests/.
"""

from __future__ import annotations

import asyncio
import json
import time
from dataclasses import dataclass
from typing import Any

import aiohttp

from shared.tools.experiment.system import (  # noqa: F401  (re-exported for the benchmarks)
    REPO_ROOT,
    RunningSystem,
    StartError,
    SystemSpec,
    placement_counts,
    start_system,
    stop_system,
)

# ---- one request, timed by the client -------------------------------------------------------------------------


@dataclass
class Outcome:
    """What one request got; seconds from sending it."""

    index: int
    doc: int
    status: str = "unsent"  # ok, rejected (429), error, unsent
    http_status: int | None = None
    ttft_s: float | None = None
    e2e_s: float | None = None
    prompt_tokens: int = 0
    cached_tokens: int = 0
    completion_tokens: int = 0
    detail: str = ""


def chat_body(model: str, content: str, max_tokens: int) -> dict[str, Any]:
    return {"model": model, "messages": [{"role": "user", "content": content}], "max_tokens": max_tokens,
            "temperature": 0, "stream": True, "stream_options": {"include_usage": True}}


async def send(session: aiohttp.ClientSession, url: str, body: dict[str, Any], request_id: str,
               outcome: Outcome, timeout_s: float) -> Outcome:
    """POST one streamed chat completion and fill `outcome`; never raises (a failure is status "error")."""
    start = time.perf_counter()
    try:
        async with asyncio.timeout(timeout_s):
            async with session.post(url, json=body, headers={"X-Request-Id": request_id}) as response:
                outcome.http_status = response.status
                if response.status == 429:
                    outcome.status = "rejected"
                    outcome.detail = f"Retry-After {response.headers.get('Retry-After')}: {await response.text()}"
                elif response.status != 200:
                    outcome.status, outcome.detail = "error", (await response.text())[:300]
                else:
                    await read_stream(response, outcome, start)
    except TimeoutError:
        outcome.status, outcome.detail = "error", f"no answer within {timeout_s:.0f} s"
    except (aiohttp.ClientError, ValueError) as exc:
        outcome.status, outcome.detail = "error", f"{type(exc).__name__}: {exc}"
    return outcome


async def read_stream(response: aiohttp.ClientResponse, outcome: Outcome, start: float) -> None:
    """Server-sent events: TTFT at the first chunk with content (else the finishing one), usage from the last."""
    usage = None
    async for raw in response.content:
        line = raw.strip()
        if not line.startswith(b"data: ") or line == b"data: [DONE]":
            continue
        event = json.loads(line[6:])
        if "error" in event:
            outcome.status, outcome.detail = "error", str(event["error"])[:300]
            return
        for choice in event.get("choices", []):
            has_text = bool(choice.get("delta", {}).get("content")) or choice.get("finish_reason")
            if has_text and outcome.ttft_s is None:
                outcome.ttft_s = time.perf_counter() - start
        usage = event.get("usage") or usage
    outcome.e2e_s = time.perf_counter() - start
    if usage is None:
        outcome.status, outcome.detail = "error", "the stream ended without usage"
        return
    outcome.status = "ok"
    outcome.prompt_tokens, outcome.completion_tokens = usage["prompt_tokens"], usage["completion_tokens"]
    outcome.cached_tokens = (usage.get("prompt_tokens_details") or {}).get("cached_tokens", 0)
