"""A small publish/subscribe hook for metrics (and tests): the server reports, subscribers count.

`app.state.observers.subscribe(fn)`; `fn(event)` is called on the event loop thread with one of the
dataclasses below. It must be cheap and must not block; an exception in it is logged, never raised.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import structlog

log = structlog.get_logger("agent_server.observers")


@dataclass(frozen=True, slots=True)
class SessionOpened:
    protocol: str  # "native", later "elevenlabs", "cartesia", ...
    session_id: str


@dataclass(frozen=True, slots=True)
class SessionClosed:
    protocol: str
    session_id: str
    code: int  # the WebSocket close code
    reason: str
    duration_s: float


@dataclass(frozen=True, slots=True)
class BusyRejected:
    protocol: str
    scope: str  # "session" (max sessions, not ready, draining) or "context" (engine full, too many contexts)
    reason: str


@dataclass(frozen=True, slots=True)
class FirstAudio:
    protocol: str
    session_id: str
    context_id: str
    model: str  # the loaded model that spoke it
    ttfa_s: float | None  # first frame sent - first text received
    server_overhead_s: float | None  # first frame sent - engine's first chunk ready
    engine_ttfb_s: float | None  # engine's first chunk ready - first segment submitted


@dataclass(frozen=True, slots=True)
class ContextFinished:
    protocol: str
    session_id: str
    context_id: str
    model: str  # the loaded model that spoke it
    reason: str  # completed | cancelled | busy | failed | shutdown
    audio_s: float
    segments: int


@dataclass(frozen=True, slots=True)
class SlowClientDropped:
    protocol: str
    session_id: str
    backlog_items: int


ObservedEvent = SessionOpened | SessionClosed | BusyRejected | FirstAudio | ContextFinished | SlowClientDropped
Observer = Callable[[ObservedEvent], None]


class Observers:
    def __init__(self) -> None:
        self._subscribers: list[Observer] = []

    def subscribe(self, observer: Observer) -> Callable[[], None]:
        """Returns the unsubscribe function."""
        self._subscribers.append(observer)
        return lambda: self._subscribers.remove(observer)

    def emit(self, event: ObservedEvent) -> None:
        for observer in self._subscribers:
            try:
                observer(event)
            except Exception:
                log.exception("observer_failed", observer=repr(observer), event=type(event).__name__)
