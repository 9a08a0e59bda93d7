"""Virtual time for a whole cluster in one process: an event loop whose clock jumps to the next timer instead of
waiting, executor work that takes the virtual time it sleeps, and the `time` functions that read that clock.

What differs from production, and why:
- `time.monotonic`, `time.perf_counter`, `time.time` and `time.sleep` are replaced (`install`, before the services
  are imported, so that the clocks they keep as defaults are these too): the services' own timers, timestamps,
  heartbeats and the sim engine's step pacing all read and spend virtual seconds without a line of theirs changing.
  `time.sleep` may only be called on an executor thread (the sim engine sleeps there); on the event loop it would
  have blocked every service in production too.
- Executor calls (`run_in_executor`, `asyncio.to_thread`) run on the loop's own thread, one at a time: an engine
  thread's work takes exactly the virtual time it sleeps, and everything it hands to the loop (`call_soon_threadsafe`)
  happens at the moment of its own clock when it did so. Each executor keeps its own clock (a `VirtualThread`): work
  queued behind a busy engine thread starts when that thread is free, as on one real thread.
- An executor marked `threaded` runs its calls on one real thread in lock-step with the loop (never both at once, so
  a run is deterministic): its work may block on a `VirtualCondition` until the loop delivers what it waits for (the
  prefill engine waits for prefix KV from the cache-store layer by layer). Unmarked executors must never block.
"""

from __future__ import annotations

import asyncio
import contextlib
import math
import selectors
import threading
import time
from collections import deque
from collections.abc import Callable, Iterator
from concurrent.futures import Executor
from typing import Any

_local = threading.local()  # .thread: the VirtualThread whose work runs on this OS thread now
VIRTUAL_EPOCH = 1_700_000_000.0  # what time.time() says at virtual second 0 (a fixed date: runs repeat exactly)


class VirtualTimeStalled(RuntimeError):
    """Nothing is due and nothing is ready, yet the run has not finished: something waits for what never comes."""


class VirtualLoop(asyncio.SelectorEventLoop):
    """An asyncio event loop on a virtual clock: when nothing is ready it moves the clock to the next timer at once.

    No real I/O happens on it (the only file descriptor is asyncio's own self-pipe); every executor call runs as a
    `VirtualThread`.
    """

    def __init__(self) -> None:
        self.now = 0.0
        super().__init__(selector=_JumpingSelector(self))
        self._vthreads: dict[int, VirtualThread] = {}
        self._threaded: set[int] = set()

    def time(self) -> float:
        return self.now

    def mark_threaded(self, executor: Executor) -> None:
        """Run `executor`'s calls on a real thread in lock-step with the loop (they may wait on a
        `VirtualCondition`); set before its first call."""
        self._threaded.add(id(executor))

    def run_in_executor(  # type: ignore[override]
        self, executor: Any, func: Callable[..., Any], *args: Any
    ) -> asyncio.Future[Any]:
        thread = self._vthreads.get(id(executor))
        if thread is None:
            name = getattr(executor, "_thread_name_prefix", "") or "default"
            thread = VirtualThread(self, name, threaded=id(executor) in self._threaded)
            self._vthreads[id(executor)] = thread
        return thread.submit(func, args)

    def call_soon_threadsafe(  # type: ignore[override]
        self, callback: Callable[..., Any], *args: Any, context: Any = None
    ) -> asyncio.Handle:
        """From executor work: at the moment of that work's own clock."""
        thread: VirtualThread | None = getattr(_local, "thread", None)
        if thread is not None:
            return self.call_at(max(thread.cursor, self.now), callback, *args, context=context)
        return super().call_soon_threadsafe(callback, *args, context=context)

    def close(self) -> None:
        for thread in self._vthreads.values():
            thread.stop()
        super().close()


class _JumpingSelector(selectors.BaseSelector):
    """asyncio asks it to wait `timeout` seconds for I/O; it moves the virtual clock instead (there is no I/O to
    wait for but the self-pipe, read only before it gives up)."""

    def __init__(self, loop: VirtualLoop) -> None:
        self.loop = loop
        self._real = selectors.DefaultSelector()

    def register(self, fileobj: Any, events: int, data: Any = None) -> selectors.SelectorKey:
        return self._real.register(fileobj, events, data)

    def unregister(self, fileobj: Any) -> selectors.SelectorKey:
        return self._real.unregister(fileobj)

    def modify(self, fileobj: Any, events: int, data: Any = None) -> selectors.SelectorKey:
        return self._real.modify(fileobj, events, data)

    def get_map(self) -> Any:
        return self._real.get_map()

    def close(self) -> None:
        self._real.close()

    def select(self, timeout: float | None = None) -> list[tuple[selectors.SelectorKey, int]]:
        # Nothing real writes to the self-pipe (executor work schedules its callbacks itself), and what
        # call_soon_threadsafe adds is in the ready queue anyway: the pipe needs reading only before giving up.
        if timeout is None:
            events = self._real.select(0)
            if events:
                return events
            raise VirtualTimeStalled("no timer is due and nothing is ready: every task waits for something that "
                                     "will never happen")
        self.loop.now += timeout
        return []


class VirtualThread:
    """One executor's thread in virtual time: its calls run one after another, each starting when the previous one
    ended (on its own clock, `cursor`) or when it was submitted, whichever is later; what a call sleeps moves its
    clock, and its result is delivered when its clock says it ended.

    Args:
        threaded: run calls on a real OS thread in lock-step with the loop (they may block on a
            `VirtualCondition`); otherwise they run on the loop's thread and must not block.
    """

    def __init__(self, loop: VirtualLoop, name: str, threaded: bool = False) -> None:
        self.loop, self.name, self.threaded = loop, name, threaded
        self.cursor = 0.0  # this thread's clock while it works
        self.free_at = 0.0  # when its last call ended
        self._pending: deque[tuple[Callable[..., Any], tuple[Any, ...], asyncio.Future[Any]]] = deque()
        self._running: tuple[asyncio.Future[Any], float] | None = None  # the call under way and when it started
        self._os_thread: threading.Thread | None = None
        self._go = threading.Semaphore(0)  # loop -> thread: run
        self._back = threading.Semaphore(0)  # thread -> loop: yielded (finished, or blocked)
        self._outcome: tuple[Any, BaseException | None] | None = None
        self._call: tuple[Callable[..., Any], tuple[Any, ...]] | None = None
        self._stopping = False

    def submit(self, func: Callable[..., Any], args: tuple[Any, ...]) -> asyncio.Future[Any]:
        future = self.loop.create_future()
        self._pending.append((func, args, future))
        if self._running is None:
            self._start_next()
        return future

    def _start_next(self) -> None:
        while self._pending and self._running is None:
            func, args, future = self._pending.popleft()
            self.cursor = max(self.loop.now, self.free_at)
            self._running = (future, self.cursor)
            if self.threaded:
                self._call = (func, args)
                self._resume()
            else:
                self._run_inline(func, args)

    def _run_inline(self, func: Callable[..., Any], args: tuple[Any, ...]) -> None:
        previous, _local.thread = getattr(_local, "thread", None), self
        try:
            outcome: tuple[Any, BaseException | None] = (func(*args), None)
        except BaseException as exc:  # delivered to the awaiting task, as an executor would
            outcome = (None, exc)
        finally:
            _local.thread = previous
        self._finished(outcome)

    def _finished(self, outcome: tuple[Any, BaseException | None]) -> None:
        assert self._running is not None
        future, started = self._running
        self._running = None
        self.free_at = self.cursor
        self.loop.call_at(self.cursor, _settle, future, *outcome)

    # ---- threaded mode: the loop and this thread pass control back and forth ------------------------------------

    def _resume(self) -> None:
        """Loop thread: let the OS thread run until it finishes its call or blocks; then carry on."""
        if self._os_thread is None:
            self._os_thread = threading.Thread(target=self._main, name=f"virtual-{self.name}", daemon=True)
            self._os_thread.start()
        self._go.release()
        self._back.acquire()
        if self._outcome is not None:  # the call ended (else it blocked: a condition resumes it)
            outcome, self._outcome = self._outcome, None
            self._finished(outcome)
            self._start_next()

    def _main(self) -> None:
        _local.thread = self
        while True:
            self._go.acquire()
            if self._stopping:
                return
            assert self._call is not None
            func, args = self._call
            self._call = None
            try:
                self._outcome = (func(*args), None)
            except BaseException as exc:
                self._outcome = (None, exc)
            self._back.release()

    def block(self) -> None:
        """OS thread: hand control back to the loop until `wake`."""
        self._back.release()
        self._go.acquire()

    def wake(self) -> None:
        """Loop thread: a condition this thread waits on was notified, or its wait timed out (now)."""
        self.cursor = max(self.cursor, self.loop.now)
        self._resume()

    def stop(self) -> None:
        if self._os_thread is not None and self._running is None:
            self._stopping = True
            self._go.release()
            self._os_thread.join(timeout=1.0)


def _settle(future: asyncio.Future[Any], result: Any, error: BaseException | None) -> None:
    if future.cancelled():
        return
    if error is not None:
        future.set_exception(error)
    else:
        future.set_result(result)


class VirtualCondition:
    """`threading.Condition` for work on a threaded `VirtualThread`: a wait hands control to the loop until a
    notify (from the loop) or the timeout in virtual seconds. Only one side runs at a time, so the lock is never
    contended."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._waiters: list[_Waiter] = []

    def __enter__(self) -> bool:
        return self._lock.acquire()

    def __exit__(self, *exc: object) -> None:
        self._lock.release()

    def wait(self, timeout: float | None = None) -> bool:
        thread: VirtualThread | None = getattr(_local, "thread", None)
        if thread is None or not thread.threaded:
            raise RuntimeError("a virtual condition can only wait on a threaded virtual executor (mark_threaded)")
        waiter = _Waiter(thread)
        self._waiters.append(waiter)
        if timeout is not None and math.isfinite(timeout):
            waiter.timer = thread.loop.call_at(thread.cursor + max(0.0, timeout), waiter.fire, False)
        self._lock.release()
        try:
            thread.block()
        finally:
            self._lock.acquire()
        return waiter.notified

    def notify_all(self) -> None:
        waiters, self._waiters = self._waiters, []
        for waiter in waiters:
            waiter.thread.loop.call_soon(waiter.fire, True)


class _Waiter:
    def __init__(self, thread: VirtualThread) -> None:
        self.thread = thread
        self.timer: asyncio.TimerHandle | None = None
        self.notified = False
        self.done = False

    def fire(self, notified: bool) -> None:
        if self.done:
            return
        self.done, self.notified = True, notified
        if self.timer is not None:
            self.timer.cancel()
        self.thread.wake()


_REAL = (time.monotonic, time.perf_counter, time.time, time.sleep)
_current: list[VirtualLoop | None] = [None]


def now() -> float:
    """The virtual clock as the caller sees it: its executor thread's clock inside executor work, else the loop's
    (the real monotonic clock when no virtual run is on)."""
    thread: VirtualThread | None = getattr(_local, "thread", None)
    if thread is not None:
        return thread.cursor
    loop = _current[0]
    return _REAL[0]() if loop is None else loop.now


def _time() -> float:
    return _REAL[2]() if _current[0] is None else VIRTUAL_EPOCH + now()


def _sleep(seconds: float) -> None:
    if _current[0] is None:
        _REAL[3](seconds)
        return
    thread: VirtualThread | None = getattr(_local, "thread", None)
    if thread is None:
        raise RuntimeError("time.sleep on the event loop under virtual time (it would block every service)")
    thread.cursor += max(0.0, seconds)


def install() -> None:
    """Route `time.monotonic`, `time.perf_counter`, `time.time` and `time.sleep` through the virtual clock (real
    time whenever no virtual run is on). Call it before importing anything that keeps one of them, as the services'
    `clock=time.monotonic` defaults do: `python -m services.virtual` does so first."""
    time.monotonic = now  # type: ignore[assignment]
    time.perf_counter = now  # type: ignore[assignment]
    time.time = _time  # type: ignore[assignment]
    time.sleep = _sleep  # type: ignore[assignment]


def uninstall() -> None:
    """The real `time` functions back (tests; what imported `now` as a default keeps it, and it reads real time)."""
    time.monotonic, time.perf_counter, time.time, time.sleep = _REAL  # type: ignore[assignment]


def wall_clock() -> float:
    """Real monotonic seconds, whatever the virtual clock says (progress lines, wall-time figures)."""
    return _REAL[0]()


def is_installed_for(clock: object) -> bool:
    """`clock` (a default bound at import) reads the virtual clock."""
    return clock is now or clock is _time


@contextlib.contextmanager
def virtual_time(loop: VirtualLoop) -> Iterator[None]:
    """Virtual time for the block: the `time` functions `install` routed read `loop`'s clock. One at a time."""
    if time.monotonic is not now:
        raise RuntimeError("virtual time needs services.virtual.clock.install() before the services are imported")
    if _current[0] is not None:
        raise RuntimeError("virtual time is already on in this process")
    _current[0] = loop
    try:
        yield
    finally:
        _current[0] = None


def run_virtual(main: Callable[[], Any]) -> Any:
    """Run the coroutine `main()` on a fresh `VirtualLoop` under `virtual_time`; returns its result."""
    loop = VirtualLoop()
    try:
        with virtual_time(loop):
            asyncio.set_event_loop(loop)
            return loop.run_until_complete(main())
    finally:
        asyncio.set_event_loop(None)
        loop.close()


