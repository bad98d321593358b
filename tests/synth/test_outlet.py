"""synth/outlet.py: ordering, nothing after cancel but CANCELLED, one terminal event, a failing sink."""

from __future__ import annotations

import threading

import numpy as np
import pytest

from synth.api import AudioChunk, EngineOutput, EventKind, SegmentEvent
from synth.outlet import Delivery, EmitLock, Outlet, OutletState, SinkReentryError


def chunk(seq: int) -> AudioChunk:
    return AudioChunk(request_id="r", seq=seq, pcm=np.zeros(960, np.float32), speech_tokens=1, ready_monotonic_s=0.0)


def event(kind: EventKind) -> SegmentEvent:
    return SegmentEvent(request_id="r", kind=kind, at_monotonic_s=0.0)


def make() -> tuple[Outlet, list[EngineOutput], dict[str, Outlet]]:
    got: list[EngineOutput] = []
    registry: dict[str, Outlet] = {}
    outlet = Outlet("r", got.append, threading.Lock(), registry)
    registry["r"] = outlet
    return outlet, got, registry


def test_outputs_in_order_then_one_terminal_event_then_nothing() -> None:
    outlet, got, registry = make()
    assert outlet.send(event(EventKind.STARTED)) == Delivery.DELIVERED
    assert outlet.send(chunk(0)) == Delivery.DELIVERED
    assert outlet.send(event(EventKind.DONE)) == Delivery.DELIVERED
    assert registry == {} and outlet.state == OutletState.CLOSED
    assert outlet.send(chunk(1)) == Delivery.DROPPED
    assert outlet.send(event(EventKind.CANCELLED)) == Delivery.DROPPED
    assert [type(o).__name__ for o in got] == ["SegmentEvent", "AudioChunk", "SegmentEvent"]
    assert not outlet.cancel()


def test_after_cancel_only_the_cancelled_event_goes_out() -> None:
    outlet, got, registry = make()
    outlet.send(chunk(0))
    assert outlet.cancel()
    assert outlet.send(chunk(1)) == Delivery.DROPPED
    assert outlet.send(event(EventKind.DONE)) == Delivery.DROPPED  # a render finishing after the cancel
    assert outlet.send(event(EventKind.CANCELLED)) == Delivery.DELIVERED
    assert outlet.send(event(EventKind.CANCELLED)) == Delivery.DROPPED  # exactly once
    assert [getattr(o, "kind", None) for o in got] == [None, EventKind.CANCELLED] and registry == {}


def test_a_sink_that_raises_stops_its_outlet() -> None:
    calls = []

    def sink(output: EngineOutput) -> None:
        calls.append(output)
        raise RuntimeError("client went away")

    outlet = Outlet("r", sink, threading.Lock(), {})
    assert outlet.send(chunk(0)) == Delivery.SINK_FAILED
    assert outlet.send(chunk(1)) == Delivery.DROPPED
    assert outlet.send(event(EventKind.CANCELLED)) == Delivery.SINK_FAILED  # the terminal event is still tried
    assert len(calls) == 2


def test_two_threads_sending_never_interleave_a_sink_call() -> None:
    inside = threading.Event()
    overlaps = []

    def sink(output: EngineOutput) -> None:
        overlaps.append(inside.is_set())
        inside.set()
        inside.clear()

    lock = threading.Lock()
    outlets = [Outlet(f"r{i}", sink, lock, {}) for i in range(2)]
    threads = [threading.Thread(target=lambda o=o: [o.send(chunk(k)) for k in range(2000)]) for o in outlets]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(overlaps) == 4000 and not any(overlaps)


def test_the_emit_lock_refuses_its_holder_and_waits_for_others() -> None:
    """EmitLock: asked again on the thread that holds it (a sink calling the engine), it raises instead of
    deadlocking; another thread waits for it as for any lock; released, it is free for both."""
    lock = EmitLock()

    def held() -> bool:  # (a call: mypy would narrow the property across the asserts)
        return lock.held_here

    assert not held()
    with lock:
        assert held()
        with pytest.raises(SinkReentryError, match="emit lock"), lock:
            pass
        assert held()  # the refused ask did not release it
        entered = threading.Event()

        def other() -> None:
            with lock:
                entered.set()

        thread = threading.Thread(target=other)
        thread.start()
        assert not entered.wait(0.2)  # another thread waits
    thread.join(5)
    assert entered.is_set() and not held()
    with lock:
        pass


def test_a_sink_that_calls_back_under_the_emit_lock_fails_its_outlet_only() -> None:
    lock = EmitLock()
    registry: dict[str, Outlet] = {}

    def sink(output: EngineOutput) -> None:
        with lock:  # what Engine.submit / cancel / has_request do first
            pass

    outlet = Outlet("r", sink, lock, registry)
    registry["r"] = outlet
    other: list[EngineOutput] = []
    bystander = Outlet("b", other.append, lock, registry)
    assert outlet.send(chunk(0)) == Delivery.SINK_FAILED
    assert bystander.send(chunk(0)) == Delivery.DELIVERED and len(other) == 1  # the lock was released
