"""A sequence's prefix KV loaded from outside the engine (a cache-store fetch) layer by layer, overlapped with the
forward pass: a loader writes each block's bytes into the store as they arrive; the step waits before each layer.

It owns the per-layer readiness and the writes into the store; where the bytes come from is the caller's business.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

from shared.engine.kv.store import KvStore
from shared.wire.payload import Payload, SizeOnly


class PrefixLoad:
    """The KV of some full blocks of one sequence, arriving layer by layer.

    A loaded block's bytes are the store's `block_payload`: layer-major, a fixed size per layer (raw tensors, or a
    codec's bytes, the sequence's first block with its sink). Each block's bytes come in order, in pieces
    of any size (`write`); every layer completed is copied into the store at once. Layer `l` is ready when every block
    has its layer `l` in the store. A failed or abandoned load takes no more writes, and layers never ready are never
    read as valid: `wait_layer` says False. A size-only piece (the sim engine's KV, whose store holds no values) counts
    its bytes and copies nothing.

    Thread-safety: `write` and `fail` come from the loader's thread, `wait_layer` and `close` from the engine's.

    Args:
        store: the KV store written into.
        block_ids: the blocks that receive the loaded blocks, in prefix order.
        first_block: the sequence's index of the first loaded block (block 0 starts the sequence).
        timeout_s: how long a wait may go without the load making progress before the load counts as failed.
        clock: monotonic seconds (tests pass their own).
    Raises:
        ValueError: no block ids.
    """

    # How the engine thread waits for the loader (a virtual cluster, whose engine thread runs in lock-step with its
    # clock, puts its own condition here).
    condition_type: Callable[[], threading.Condition] = threading.Condition

    def __init__(
        self, store: KvStore, block_ids: list[int], timeout_s: float = 30.0,
        clock: Callable[[], float] = time.monotonic, first_block: int = 0,
    ) -> None:
        if not block_ids:
            raise ValueError("a prefix load needs at least one block")
        self.store, self.block_ids, self.clock = store, list(block_ids), clock
        self._starts = [first_block + i == 0 for i in range(len(block_ids))]
        self.num_layers = store.num_layers
        self.layer_sizes = [store.payload_layer_bytes(starts) for starts in self._starts]  # bytes of one layer, each
        self.block_sizes = [self.num_layers * size for size in self.layer_sizes]  # bytes each block brings
        self.timeout_s = timeout_s
        self._last_progress = clock()  # when the load began or last took bytes
        self.error: str | None = None
        self.waited_s = 0.0  # how long the engine thread blocked in `wait_layer`
        self._cond = self.condition_type()
        self._staged = [bytearray() for _ in block_ids]  # bytes of each block's next, incomplete layer
        self._num_layers_in = [0] * len(block_ids)
        self._num_ready = 0
        self._is_closed = False

    @property
    def num_ready_layers(self) -> int:
        return self._num_ready

    @property
    def is_complete(self) -> bool:
        """Every layer of every block is in the store (and no wait gave up before)."""
        return self._num_ready == self.num_layers

    def is_layer_ready(self, layer_idx: int) -> bool:
        return self._num_ready > layer_idx

    def write(self, block_index: int, data: Payload) -> bool:
        """Take the next `data` bytes of loaded block `block_index`, copying each layer they complete into the store.

        Returns:
            False, writing nothing, once the load failed or was closed (stop sending). More bytes than a block
            holds fail the load.
        """
        with self._cond:
            if self._is_closed or self.error is not None:
                return False
            staged, first = self._staged[block_index], self._num_layers_in[block_index]
            layer_bytes, block_bytes = self.layer_sizes[block_index], self.block_sizes[block_index]
            if first * layer_bytes + len(staged) + len(data) > block_bytes:
                self._fail(f"block {block_index} has more than {block_bytes} bytes")
                return False
            if isinstance(data, SizeOnly):  # the sim engine's store holds no values: layers complete by count
                num_new = len(data) // layer_bytes
            else:
                staged += data
                num_new = len(staged) // layer_bytes
            self._last_progress = self.clock()
            if num_new:
                if not isinstance(data, SizeOnly):
                    self.store.write_payload_layers(
                        self.block_ids[block_index], first, staged[: num_new * layer_bytes], self._starts[block_index]
                    )
                    del staged[: num_new * layer_bytes]
                self._num_layers_in[block_index] = first + num_new
                self._advance()
            return True

    def fail(self, reason: str) -> None:
        """The loader cannot deliver (a miss, a corrupt part, a dead store): wake the engine, which recomputes."""
        with self._cond:
            self._fail(reason)

    def wait_layer(self, layer_idx: int) -> bool:
        """Engine thread: block until layer `layer_idx` of every block is in the store.

        Returns:
            True when it is; False when the load failed, was closed or timed out first (the layer must not be used).
        """
        with self._cond:
            started = self.clock()
            while self._num_ready <= layer_idx and self.error is None and not self._is_closed:
                remaining = self._last_progress + self.timeout_s - self.clock()
                if remaining <= 0:
                    self._fail(f"no progress for {self.timeout_s} s")
                    break
                self._cond.wait(remaining)
            self.waited_s += self.clock() - started
            return self._num_ready > layer_idx

    def close(self) -> None:
        """No write lands after this returns (the blocks are about to be registered, reused or freed)."""
        with self._cond:
            self._is_closed = True
            self._cond.notify_all()

    def _fail(self, reason: str) -> None:
        if self.error is None and not self.is_complete:
            self.error = reason
        self._cond.notify_all()

    def _advance(self) -> None:
        ready = min(self._num_layers_in)
        if ready > self._num_ready:
            self._num_ready = ready
            self._cond.notify_all()


@dataclass(frozen=True)
class PrefixSource:
    """Where a queued sequence can load its prefix KV from; asked once, when the sequence is admitted to a step.

    Args:
        num_tokens: leading prompt tokens whose KV the source can supply: whole blocks, fewer than the prompt.
        start: `start(first_block, block_ids)` begins loading the prompt's blocks [first_block, num_tokens /
            block_size) (those the local prefix cache lacks) into the store blocks `block_ids`, and returns their
            `PrefixLoad`, or None to load nothing after all. It runs on the engine thread and must not block.
    """

    num_tokens: int
    start: Callable[[int, list[int]], PrefixLoad | None]
