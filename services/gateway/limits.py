"""Per-API-key limits: requests per minute, tokens per minute and requests in flight. Pure logic with a clock.

Both per-minute limits are token buckets that hold a minute's allowance and refill it evenly (a burst of a whole
minute's worth is allowed, then the steady rate). Tokens are reserved at admission, the prompt's plus `max_tokens`,
and settled when the request ends: what it did not use (an early stop, a failure) flows back.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field

from services.gateway.errors import ApiError, rate_limited
from shared.wire.api_keys import ApiKey


@dataclass
class TokenBucket:
    """Holds up to `capacity`, refilled at `capacity` per 60 s; `level` may not go below zero."""

    capacity: float
    level: float
    updated_at: float

    def refill(self, now: float) -> None:
        self.level = min(self.capacity, self.level + (now - self.updated_at) * self.capacity / 60.0)
        self.updated_at = now

    def take(self, amount: float, now: float) -> float:
        """Take `amount`: 0.0 when done, else the seconds until it would be there (nothing taken)."""
        self.refill(now)
        if amount <= self.level:
            self.level -= amount
            return 0.0
        return (amount - self.level) * 60.0 / self.capacity

    def give_back(self, amount: float, now: float) -> None:
        self.refill(now)
        self.level = min(self.capacity, self.level + amount)


@dataclass
class _KeyState:
    requests: TokenBucket | None
    tokens: TokenBucket | None
    num_in_flight: int = 0


@dataclass
class Ticket:
    """One admitted request of one key: release it with `KeyLimits.finish`, exactly once."""

    key: ApiKey
    reserved_tokens: int = 0
    is_finished: bool = field(default=False, repr=False)


class KeyLimits:
    """The limits of every key, by name.

    Args:
        clock: monotonic seconds (tests pass their own).
    """

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self.clock = clock
        self._states: dict[str, _KeyState] = {}

    def admit(self, key: ApiKey) -> Ticket:
        """Count one request against `requests_per_minute` and `max_concurrent`.

        Raises:
            ApiError: (429, with Retry-After) a limit is reached; nothing is counted then.
        """
        state = self._state(key)
        if key.max_concurrent is not None and state.num_in_flight >= key.max_concurrent:
            raise rate_limited(f"the API key {key.name!r} has {key.max_concurrent} requests in flight, its "
                               "max_concurrent; retry when one ends", 1.0)
        if state.requests is not None:
            wait_s = state.requests.take(1, self.clock())
            if wait_s:
                raise rate_limited(f"the API key {key.name!r} reached its {key.requests_per_minute} requests per "
                                   "minute", wait_s)
        state.num_in_flight += 1
        return Ticket(key)

    def reserve_tokens(self, ticket: Ticket, num_tokens: int) -> None:
        """Reserve the most tokens the request can use (prompt plus max_tokens) against `tokens_per_minute`.

        Raises:
            ApiError: (429, with Retry-After) not that many tokens left this minute, or never (more than a minute's).
        """
        key = ticket.key
        bucket = self._state(key).tokens
        if bucket is None:
            return
        if num_tokens > bucket.capacity:
            raise _too_large(key, num_tokens)
        wait_s = bucket.take(num_tokens, self.clock())
        if wait_s:
            raise rate_limited(f"the API key {key.name!r} reached its {key.tokens_per_minute} tokens per minute "
                               f"(this request reserves {num_tokens}: prompt plus max_tokens)", wait_s)
        ticket.reserved_tokens = num_tokens

    def finish(self, ticket: Ticket, num_used_tokens: int) -> None:
        """The request ended having used `num_used_tokens` (prompt plus output; 0 when it never ran)."""
        if ticket.is_finished:
            return
        ticket.is_finished = True
        state = self._state(ticket.key)
        state.num_in_flight -= 1
        unused = ticket.reserved_tokens - num_used_tokens
        if state.tokens is not None and unused > 0:
            state.tokens.give_back(unused, self.clock())

    def num_in_flight(self, key: ApiKey) -> int:
        return self._state(key).num_in_flight

    def _state(self, key: ApiKey) -> _KeyState:
        state = self._states.get(key.name)
        if state is None:
            now = self.clock()
            state = _KeyState(_bucket(key.requests_per_minute, now), _bucket(key.tokens_per_minute, now))
            self._states[key.name] = state
        return state


def _bucket(per_minute: int | None, now: float) -> TokenBucket | None:
    return None if per_minute is None else TokenBucket(float(per_minute), float(per_minute), now)


def _too_large(key: ApiKey, num_tokens: int) -> ApiError:
    error = rate_limited(f"this request reserves {num_tokens} tokens (prompt plus max_tokens), more than the API key "
                         f"{key.name!r} may use in a minute ({key.tokens_per_minute}); lower max_tokens", 60.0)
    error.code = "tokens_per_minute_exceeded"
    return error
