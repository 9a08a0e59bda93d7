"""What happened to one request: the times the client saw and what the server answered. Filled by client.py,
read by metrics.py; no I/O here.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any


@dataclass
class RequestRecord:
    """One request's outcome. Times are seconds since the start of the run (a monotonic clock).

    Args:
        request_id: the planned request's id.
        arrival_s: when it was planned to be sent (at fixed concurrency: when a slot freed).
        send_s: when it was sent (None: never sent).
        chunk_times_s: when each streamed chunk with content (non-empty text or tokens) arrived; the first is
            the first token.
        done_s: when the answer ended: the stream's end, an error, or the timeout.
        status: the HTTP status (None: no answer, e.g. the connection failed or timed out first).
        error: why it failed (None: it completed).
        num_prompt_tokens: `usage.prompt_tokens`, else the prompt's length when it was token ids.
        num_output_tokens: `usage.completion_tokens`, else the number of content chunks.
        num_cached_tokens: `usage.prompt_tokens_details.cached_tokens`, when the server reports it.
        retry_after_s: the server's `Retry-After` on a refusal (429 or 503), in seconds (None: none given).
        input_len, output_len: what was asked for.
    """

    request_id: int
    arrival_s: float
    input_len: int = 0
    output_len: int = 0
    send_s: float | None = None
    chunk_times_s: list[float] = field(default_factory=list)
    done_s: float | None = None
    status: int | None = None
    error: str | None = None
    num_prompt_tokens: int | None = None
    num_output_tokens: int = 0
    num_cached_tokens: int | None = None
    retry_after_s: float | None = None

    @property
    def is_rejected(self) -> bool:
        """The server refused it with 429 (counted apart from failures)."""
        return self.status == 429

    @property
    def is_completed(self) -> bool:
        """Answered 200 and streamed to its end without an error."""
        return self.error is None and self.status == 200 and self.done_s is not None and self.send_s is not None

    @property
    def is_failed(self) -> bool:
        """Sent, not completed and not rejected."""
        return self.send_s is not None and not self.is_completed and not self.is_rejected

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)
