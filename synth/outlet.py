"""The one door a request's output goes out of, whichever thread produces it.

Two threads produce a segment's output: the engine thread (STARTED, GENERATED, BUSY, failures, CANCELLED) and
the vocoder worker (audio chunks, DONE). An `Outlet` keeps the promises callers rely on across both:

- nothing after `cancel()` returns but the CANCELLED event itself (`EngineLike.cancel`);
- exactly one terminal event (DONE, CANCELLED, BUSY or FAILED), and nothing after it;
- outputs reach the sink in the order they were sent (every outlet of an engine sends under one lock, so a
  sink is never called from two threads at once);
- a sink that raises ends only its own request: the outlet stops delivering and reports it, the engine cancels.

Sinks must not block (they hand the output to an event loop with call_soon_threadsafe), and must not call back
into the engine: a sink runs under the engine's emit lock, so a `submit` or `cancel` from it would wait for itself.
The lock (`EmitLock`) knows its holder and raises `SinkReentryError` instead; the outlet reports it as a sink that
raised.
"""

from __future__ import annotations

import enum
import logging
import threading
from types import TracebackType

from synth.api import EngineError, EngineOutput, EventKind, SegmentEvent, Sink

log = logging.getLogger(__name__)


class SinkReentryError(EngineError):
    """A thread that holds the engine's emit lock (a sink being called) asked for it again: a sink called back into
    the engine (submit, cancel), which would deadlock."""


class EmitLock:
    """The engine's emit lock: a plain, non-reentrant lock that knows which thread holds it, so that asking for it
    again on that thread raises `SinkReentryError` rather than waiting forever."""

    __slots__ = ("_lock", "_owner")

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._owner: int | None = None

    def __enter__(self) -> EmitLock:
        me = threading.get_ident()
        if self._owner == me:  # only this thread writes its own id here, so the read needs no lock
            raise SinkReentryError("a sink called back into the engine (it runs under the engine's emit lock): "
                                   "hand the output to another thread and call the engine from there")
        self._lock.acquire()
        self._owner = me
        return self

    def __exit__(self, kind: type[BaseException] | None, error: BaseException | None,
                 trace: TracebackType | None) -> None:
        self._owner = None
        self._lock.release()

    @property
    def held_here(self) -> bool:
        return self._owner == threading.get_ident()


class OutletState(enum.IntEnum):
    OPEN = 0
    CANCELLING = 1  # cancel() was called: only the CANCELLED event may still go out
    CLOSED = 2  # a terminal event went out (or the sink failed)


class Delivery(enum.Enum):
    DELIVERED = 1
    DROPPED = 2  # the outlet was cancelling or closed
    SINK_FAILED = 3  # the sink raised: the request must be cancelled


class Outlet:
    __slots__ = ("_lock", "_registry", "_sink", "_state", "request_id")

    def __init__(self, request_id: str, sink: Sink, lock: EmitLock | threading.Lock,
                 registry: dict[str, Outlet]) -> None:
        self.request_id = request_id
        self._sink = sink
        self._lock = lock  # shared by every outlet of one engine; it also guards the registry
        self._registry = registry  # the engine's open outlets by request id: this one leaves it when it closes
        self._state = OutletState.OPEN

    @property
    def state(self) -> OutletState:
        return self._state

    @property
    def is_open(self) -> bool:
        return self._state == OutletState.OPEN

    def send(self, output: EngineOutput) -> Delivery:
        """Deliver an output (a terminal event closes the outlet)."""
        with self._lock:
            terminal = isinstance(output, SegmentEvent) and output.kind >= EventKind.DONE
            cancelled_event = isinstance(output, SegmentEvent) and output.kind == EventKind.CANCELLED
            allowed = self._state == OutletState.OPEN or (self._state == OutletState.CANCELLING and cancelled_event)
            if not allowed:
                return Delivery.DROPPED
            if terminal:
                self._close()
            try:
                self._sink(output)
            except Exception:
                log.exception("sink of %s raised; cancelling it", self.request_id)
                self._state = OutletState.CANCELLING if not terminal else OutletState.CLOSED
                return Delivery.SINK_FAILED
            return Delivery.DELIVERED

    def _close(self) -> None:
        self._state = OutletState.CLOSED
        if self._registry.get(self.request_id) is self:
            del self._registry[self.request_id]

    def cancel(self) -> bool:
        """Stop everything but the CANCELLED event; False if the outlet had already closed."""
        with self._lock:
            if self._state == OutletState.CLOSED:
                return False
            self._state = OutletState.CANCELLING
            return True
