"""Encoding off the event loop: one shared worker pool, each context's work in order.

A context gets a `Lane` from the `EncoderPool`. `lane.submit(work, done)` queues `work` (a call into the
context's encoder, e.g. `lambda: enc.push(pcm)`; None for a pure ordering point); the pool runs a lane's
items one at a time, in submission order (so a stateful, non-thread-safe encoder is safe) while
different lanes run side by side on the pool's threads. Each result reaches `done(result)` on the event
loop, through `post` (loop.call_soon_threadsafe), in submission order: what the writer gets keeps the
order the stream produced, so an event that must follow its audio (a segment's alignment, the end) is
submitted as `submit(None, lambda _: emit(event))` behind that audio.

Fairness: a worker runs one item and puts the lane back at the end of the pool's queue, so a context
with a long backlog does not hold a thread while others wait.

Bounds: a lane holds at most `max_pending` items; `submit` beyond that raises `LaneFull` (the encoder
cannot keep up with this context: treat it like a slow client).

`cancel()` (barge-in, the client went away): queued items are dropped and never run, no `done` runs
after it returns, and `close` (the encoder's) runs exactly once, after the item in flight (if any)
finishes, never concurrently with it. A `work` that raises fails the lane the same way, then
`on_error(exc)` runs on the loop.

`InlineStage` has the same two verbs and runs each call at once on the caller's thread: what a context
whose encoding is cheap (raw PCM, G.711, WAV) uses, so a stream drives either through one `EncodeStage`.

Threads only (no asyncio here): the loop is reached through `post` alone.
"""

from __future__ import annotations

import threading
from collections import deque
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, Protocol, TypeVar

T = TypeVar("T")
Post = Callable[..., object]  # loop.call_soon_threadsafe
Done = Callable[[Any], None]
Work = Callable[[], Any]


class LaneFull(RuntimeError):
    """A lane already holds `max_pending` items."""


@dataclass(frozen=True, slots=True)
class _Item:
    work: Work | None
    done: Done


class EncodeStage(Protocol):
    """Where a context's encoder calls run: `Lane` (a worker pool, results back on the loop in order)
    or `InlineStage` (at once)."""

    def submit(self, work: Work | None, done: Done) -> None: ...
    def cancel(self) -> None: ...


class InlineStage:
    """Runs each call at once, on the caller's thread; `done` before `submit` returns. An exception of
    `work` propagates to the caller. `cancel` runs `close` once; nothing runs after it."""

    def __init__(self, close: Callable[[], None]) -> None:
        self._close: Callable[[], None] | None = close

    def submit(self, work: Work | None, done: Done) -> None:
        if self._close is None:
            return  # cancelled
        done(None if work is None else work())

    def cancel(self) -> None:
        close, self._close = self._close, None
        if close is not None:
            close()


class EncoderPool:
    """Worker threads shared by every context's lane. Shut down once, at server exit."""

    def __init__(self, workers: int) -> None:
        if workers < 1:
            raise ValueError(f"workers must be >= 1 (got {workers})")
        self._executor = ThreadPoolExecutor(max_workers=workers, thread_name_prefix="encode")

    def lane(
        self, post: Post, *, max_pending: int, close: Callable[[], None], on_error: Callable[[Exception], None]
    ) -> Lane:
        return Lane(self._executor, post, max_pending=max_pending, close=close, on_error=on_error)

    def shutdown(self) -> None:
        self._executor.shutdown(wait=True, cancel_futures=True)


class Lane:
    """One context's ordered queue of encoder calls. `submit` and `cancel` run on the event loop."""

    def __init__(
        self,
        executor: ThreadPoolExecutor,
        post: Post,
        *,
        max_pending: int,
        close: Callable[[], None],
        on_error: Callable[[Exception], None],
    ) -> None:
        if max_pending < 1:
            raise ValueError(f"max_pending must be >= 1 (got {max_pending})")
        self._executor = executor
        self._post = post
        self._max_pending = max_pending
        self._close: Callable[[], None] | None = close
        self._on_error = on_error
        self._lock = threading.Lock()  # guards the fields below (loop thread vs worker)
        self._queue: deque[_Item] = deque()
        self._running = False  # an item of this lane is in a worker (or queued in the executor)
        self._stopped = False  # cancelled or failed: nothing more runs
        self._delivering = True  # loop thread only: False once cancelled or failed (results then dropped)

    @property
    def pending(self) -> int:
        """Items submitted and not yet run (the one in flight not counted)."""
        with self._lock:
            return len(self._queue)

    @property
    def stopped(self) -> bool:
        return not self._delivering

    def submit(self, work: Work | None, done: Done) -> None:
        with self._lock:
            if self._stopped:
                return  # a cancelled context's late output: nothing to do
            if len(self._queue) >= self._max_pending:
                raise LaneFull(f"{len(self._queue)} encoder calls already wait on this context")
            self._queue.append(_Item(work, done))
            if self._running:
                return
            self._running = True
        self._executor.submit(self._run_one)

    def cancel(self) -> None:
        """Drop what is queued; `close` runs now, or after the item in flight. Idempotent."""
        self._delivering = False
        with self._lock:
            if self._stopped:
                return
            self._stopped = True
            self._queue.clear()
            close_now = not self._running
        if close_now:
            self._run_close()

    # ---- worker side ----

    def _run_one(self) -> None:
        with self._lock:
            item = self._queue.popleft() if self._queue and not self._stopped else None
            if item is None:
                self._running = False
                close_now = self._stopped
        if item is None:
            if close_now:
                self._run_close()
            return
        try:
            result = None if item.work is None else item.work()
        except Exception as exc:
            with self._lock:
                self._stopped = True
                self._queue.clear()
                self._running = False
            self._run_close()
            self._post(self._fail, exc)
            return
        self._post(self._deliver, item.done, result)
        self._executor.submit(self._run_one)  # next item of this lane goes behind other lanes' work

    def _run_close(self) -> None:
        with self._lock:
            close, self._close = self._close, None
        if close is not None:
            close()

    # ---- loop side ----

    def _deliver(self, done: Done, result: object) -> None:
        if self._delivering:
            done(result)

    def _fail(self, exc: Exception) -> None:
        if self._delivering:  # results posted before the failure were delivered; nothing after it is
            self._delivering = False
            self._on_error(exc)
