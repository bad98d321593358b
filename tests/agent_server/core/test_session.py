"""The session core (agent_server/core/session.py), driven in-process over fake ASGI channels
(tests/agent_server/fake_asgi.py): a failure at every protocol hook of every protocol, the outbox's
skip-on-cancel and what a cancelled context reports, and the slow-client watchdog's measure (DrainWatch).
"""

from __future__ import annotations

import asyncio
import threading
import time
from pathlib import Path
from typing import Any

import orjson
import pytest

from agent_server.core.observers import SessionClosed, SessionOpened, SlowClientDropped
from agent_server.core.session import MIN_STALL_S, UNREAD_CAPACITY_BYTES, DrainWatch, WireProtocol
from agent_server.protocols import native_wire as wire
from agent_server.protocols.cartesia import CartesiaProtocol
from agent_server.protocols.cartesia_http import CartesiaBytesProtocol
from agent_server.protocols.deepgram import DeepgramProtocol
from agent_server.protocols.deepgram_http import DeepgramSpeakProtocol
from agent_server.protocols.elevenlabs import ElevenLabsProtocol
from agent_server.protocols.elevenlabs_http import ElevenLabsHttpProtocol
from agent_server.protocols.jambonz import JambonzHttpProtocol, JambonzStreamProtocol
from agent_server.protocols.native import NativeProtocol
from agent_server.protocols.openai_speech import OpenAISpeechProtocol

from tests.agent_server.core.test_behaviour import KEY, OTHER_KEY, TEXT, bearer, hold_a_session, make_app
from tests.agent_server.fake_asgi import FakeHttpRequest, FakeWebSocket, running
from tests.agent_server.fake_engine import FakeEngine
from tests.agent_server.protocol_drivers import DRIVERS, Driver

pytestmark = pytest.mark.timeout(60)

PROTOCOL_CLASSES: dict[str, type[WireProtocol[Any]]] = {
    "native": NativeProtocol,
    "elevenlabs": ElevenLabsProtocol,  # MultiStreamProtocol inherits every hook
    "cartesia": CartesiaProtocol,
    "deepgram": DeepgramProtocol,
    "jambonz": JambonzStreamProtocol,
    "openai": OpenAISpeechProtocol,
    "elevenlabs_http": ElevenLabsHttpProtocol,  # the /stream route's class inherits every hook
    "cartesia_http": CartesiaBytesProtocol,
    "deepgram_http": DeepgramSpeakProtocol,
    "jambonz_http": JambonzHttpProtocol,
}
HOOKS = ("open", "message", "render", "close", "refused", "tick")
HOOK_METHODS = {"open": "on_open", "message": "on_message", "render": "render", "close": "on_close",
                "refused": "on_refused", "tick": "on_tick"}


class InjectedFault(RuntimeError):
    pass


def break_hook(monkeypatch: pytest.MonkeyPatch, cls: type[WireProtocol[Any]], hook: str) -> list[str]:
    """Make `cls`'s `hook` raise; returns the list its calls are recorded in (so a test knows it ran)."""
    name = HOOK_METHODS[hook]
    calls: list[str] = []
    original = getattr(cls, name)

    if name in ("on_open", "on_message"):
        async def broken_async(self: Any, *args: Any) -> None:
            calls.append(name)
            raise InjectedFault(name)

        monkeypatch.setattr(cls, name, broken_async)
    else:
        def broken(self: Any, *args: Any) -> None:
            calls.append(name)
            raise InjectedFault(name)

        monkeypatch.setattr(cls, name, broken)
    assert getattr(cls, name) is not original
    return calls


@pytest.mark.parametrize("hook", HOOKS)
@pytest.mark.parametrize("driver", DRIVERS, ids=str)
def test_a_failure_in_any_hook_of_any_protocol_leaks_nothing(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, driver: Driver, hook: str
) -> None:
    """The hook raises; the session still leaves the hub, its key's session lease is given back (a limit of
    one: the next session of the key is admitted), its opened/closed metrics balance, a close frame (1011, or
    the refusal's 1013) or an HTTP error goes out, and the server serves the next one."""
    calls = break_hook(monkeypatch, PROTOCOL_CLASSES[driver.name], hook)
    engine = FakeEngine(first_chunk_delay_s=0.5 if hook == "tick" else 0.0)  # the tick comes before any audio
    app, events = make_app(tmp_path, engine, max_sessions=1 if hook == "refused" else 256,
                           api_keys=(KEY, OTHER_KEY), max_sessions_per_key=1)

    async def scenario() -> None:
        async with running(app) as hub:
            principal = hub.auth.verify(KEY)
            holder = await hold_a_session(app, bearer(OTHER_KEY)) if hook == "refused" else None
            if driver.http:
                request = driver.request(app, TEXT if hook != "close" else None, bearer(KEY))
                await request.done()
                await request.finished()
                assert request.status is not None and request.status >= 400, (request.status, request.content)
                try:
                    said = driver.http_error(request)[1]  # the vendor's own error shape
                except (KeyError, TypeError):  # its last words failed: the transport's plain error instead
                    said = request.json()["error"]["message"]
                assert said
            else:
                ws = FakeWebSocket(app, driver.path, driver.query, bearer(KEY))
                await ws.connect()
                if hook in ("message", "render"):
                    for message in driver.turn("f", TEXT):
                        ws.send_json(message)
                elif hook == "close":
                    await asyncio.sleep(0)  # (admitted and greeted before the drain closes it)
                    while not hub.sessions:
                        await asyncio.sleep(0.005)
                    drain = asyncio.create_task(hub.drain(5.0))
                code = await ws.wait_closed()
                await ws.finished()
                expected = {"refused": 1013, "close": 1001}.get(hook, 1011)
                if hook == "close":
                    expected = 1011  # its last words failed: an internal error, still a close frame
                    assert await drain is True
                assert code == expected, (code, ws.close_reason, ws.log)
            if holder is not None:
                holder.disconnect()
                await holder.finished()
            assert not hub.sessions
            async with asyncio.timeout(5):  # the key's lease is given back (in the background)
                while await hub.auth.sessions_of(principal):
                    await asyncio.sleep(0.005)
            if hook in ("open", "message", "render", "tick"):  # the server still serves, the key too
                monkeypatch.undo()
                ok = FakeWebSocket(app, "/v1/stream", headers=bearer(KEY))
                await ok.connect()
                assert (await ok.next_json())["type"] == "session_started"
                ok.disconnect()
                await ok.finished()
                assert not hub.sessions

    run(scenario())
    assert calls, f"the {hook} hook never ran"
    opened = [e for e in events if isinstance(e, SessionOpened)]
    closed = [e for e in events if isinstance(e, SessionClosed)]
    assert sorted(e.session_id for e in opened) == sorted(e.session_id for e in closed)


def run(coro: Any) -> Any:
    return asyncio.run(coro)


# ---- the outbox ----------------------------------------------------------------------------------------


def test_a_cancelled_context_reports_only_the_audio_it_sent(tmp_path: Path) -> None:
    """Frames queued behind a slow socket when the cancel comes are skipped; context_done's `frames` and
    `audio_ms` count what went out, not what was rendered."""
    engine = FakeEngine(realtime_factor=0.5)  # 2x real time: some is rendered while the socket is stuck
    app, _ = make_app(tmp_path, engine)

    async def scenario() -> tuple[dict[str, Any], list[bytes]]:
        async with running(app):
            ws = FakeWebSocket(app, "/v1/stream")
            await ws.connect()
            await ws.next_json()
            ws.send_json({"type": "open", "context_id": "c", "text": TEXT * 4})
            ws.send_json({"type": "end", "context_id": "c"})
            while not any(isinstance(m, bytes) for m in ws.log):
                await asyncio.sleep(0.001)
            ws.writable.clear()  # the socket stops taking data: the rest waits in the outbox
            while len(engine.submits) < 2:  # the first segment was all rendered (into the outbox)
                await asyncio.sleep(0.005)
            ws.send_json({"type": "cancel", "context_id": "c"})
            while not engine.cancels:  # the cancel was read and applied (nothing could go out meanwhile)
                await asyncio.sleep(0.001)
            ws.writable.set()
            done = None
            while done is None:
                message = await ws.next()
                if isinstance(message, str) and orjson.loads(message)["type"] == "context_done":
                    done = orjson.loads(message)
            frames = [m for m in ws.log if isinstance(m, bytes)]
            ws.disconnect()
            await ws.finished()
            return done, frames

    done, frames = run(scenario())
    frame_ms = 20.0
    assert done["reason"] == "cancelled"
    assert done["frames"] == len(frames)
    assert done["audio_ms"] == pytest.approx(len(frames) * frame_ms)
    first = engine.submits[0]
    first_segment_ms = len(FakeEngine.expected_tokens(first.text, engine.seed_of(first.request_id))) * 40.0
    assert done["audio_ms"] < first_segment_ms - 100.0  # rendered, queued, and never sent
    assert all(wire.decode_frame(f)[0].seq == i for i, f in enumerate(frames))


# ---- the slow-client measure -------------------------------------------------------------------------


def test_drain_watch_stalls_only_while_bytes_wait_and_none_drain() -> None:
    watch = DrainWatch()
    watch.observe(0, 0.0)
    assert watch.stalled_s(10.0) == 0.0  # nothing was given to the client: it owes nothing
    watch.wrote(1000)
    watch.observe(1000, 1.0)  # all of it still waiting
    assert watch.stalled_s(1.5) == 0.5
    watch.observe(400, 2.0)  # 600 drained: progress
    assert watch.stalled_s(2.0) == 0.0
    watch.wrote(1000)
    watch.observe(1400, 3.0)  # more written, none drained since
    assert watch.stalled_s(6.0) == pytest.approx(4.0)  # stalled since the last progress (2.0)
    watch.observe(0, 6.5)  # everything left
    assert watch.stalled_s(9.0) == 0.0


def test_drain_watch_framing_bytes_never_pass_for_progress() -> None:
    """The kernel counts frame headers (and TLS records) the session's count does not: they make the
    drained figure lower, so a client that reads nothing never looks like it progresses."""
    watch = DrainWatch()
    unsent = 0
    for i in range(100):
        watch.wrote(960)
        unsent += 960 + 4  # payload and the WebSocket header, never acknowledged
        watch.observe(unsent, i * 0.1)
    assert watch.stalled_s(10.0) == pytest.approx(10.0)


class OffLoopEncoding(NativeProtocol):
    """The native protocol with its audio frames "encoded" on a thread pool: each frame is queued as a
    future, the way a compressing encoder (MP3/Opus/AAC/FLAC) plugs in between the stream's PCM and the
    writer. Later frames are made to finish first."""

    name = "native"

    def render(self, ctx: Any, event: Any) -> None:
        from agent_server.core.events import AudioOut

        if isinstance(event, AudioOut):
            delay_s = 0.02 if event.seq % 2 == 0 else 0.0  # even frames take longer: done out of order

            def encode(payload: bytes = event.payload, seq: int = event.seq) -> bytes:
                time.sleep(delay_s)
                return seq.to_bytes(4, "little") + payload

            future = asyncio.get_running_loop().run_in_executor(None, encode)
            self.session.send_audio(ctx, future, event.duration_ms)
            return
        super().render(ctx, event)


def test_an_off_loop_encoding_stage_keeps_frame_order(tmp_path: Path) -> None:
    from agent_server.core.session import websocket_route

    app, _ = make_app(tmp_path)
    app.router.routes.insert(0, websocket_route("/offloop", OffLoopEncoding))

    async def scenario() -> tuple[list[int], dict[str, Any]]:
        async with running(app):
            ws = FakeWebSocket(app, "/offloop")
            await ws.connect()
            await ws.next_json()
            ws.send_json({"type": "open", "context_id": "c", "seed": 1, "text": TEXT})
            ws.send_json({"type": "end", "context_id": "c"})
            while True:
                message = await ws.next()
                if isinstance(message, str) and orjson.loads(message)["type"] == "context_done":
                    done = orjson.loads(message)
                    break
            seqs = [int.from_bytes(m[:4], "little") for m in ws.log if isinstance(m, bytes)]
            ws.disconnect()
            await ws.finished()
            return seqs, done

    seqs, done = run(scenario())
    assert len(seqs) > 4 and seqs == list(range(len(seqs)))  # awaited in queue order, not completion order
    assert done["frames"] == len(seqs) and done["reason"] == "completed"


# ---- the encoders falling behind -----------------------------------------------------------------------


def test_encoders_that_fall_behind_cut_the_session_as_a_slow_client(tmp_path: Path,
                                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    """A context's encoder lane full (its compressed audio cannot be encoded as fast as it comes): the
    session is cut as a slow client would be, the engine's work cancelled, nothing leaks."""
    monkeypatch.setattr("agent_server.core.stream.MAX_PENDING_ENCODES", 2)
    engine = FakeEngine(first_chunk_tokens=2, chunk_schedule_tokens=(2,))
    app, events = make_app(tmp_path, engine, encoder_threads=1)

    async def scenario() -> None:
        async with running(app) as hub:
            gate = threading.Event()
            hub.encoders.lane(hub.post, max_pending=1, close=lambda: None,
                              on_error=lambda e: None).submit(gate.wait, lambda _: None)  # its one thread, stuck
            request = FakeHttpRequest(app, "/v1/audio/speech", {"model": "tts-1", "voice": "alloy", "input": TEXT})
            request.start()  # mp3, the SDK's default
            await request.finished()
            gate.set()
            assert request.status == 400 and request.json()["error"]["message"] == "slow client: audio not read"
            assert not hub.sessions

    run(scenario())
    dropped = [e for e in events if isinstance(e, SlowClientDropped)]
    assert [e.protocol for e in dropped] == ["openai"]
    assert engine.cancels
    closed = [e for e in events if isinstance(e, SessionClosed)]
    assert [(e.protocol, e.code) for e in closed] == [("openai", 1008)]


# ---- the cumulative bound: a non-reader's kernel takes a buffer's worth unread ------------------------

RECEIVE_BUFFER_BYTES = 130_000  # a non-reading Linux client's kernel takes about this much (then its window is 0)
PCM_BYTES_PER_S = 48_000  # 24 kHz PCM16
TICK_S = 0.025


def non_reader_cut_s(pace: float, *, burst: bool = False, behind_s: float = 5.0, stall_s: float = 3.0) -> float:
    """When the session's rules (`Session.tick`) cut a client that never reads, audio produced at `pace` x real
    time (or all at once), on loopback (acknowledged at once until the client's receive buffer is full)."""
    watch = DrainWatch()
    acked = 0
    for tick in range(1, 2000):
        now_s = tick * TICK_S
        due = 10 * PCM_BYTES_PER_S if burst else int(now_s * pace * PCM_BYTES_PER_S)
        if due > watch.written_bytes:
            watch.wrote(due - watch.written_bytes)
        acked = min(watch.written_bytes, RECEIVE_BUFFER_BYTES)
        watch.observe(watch.written_bytes - acked, now_s)
        stalled = watch.stalled_s(now_s)
        if stalled > stall_s or (stalled >= MIN_STALL_S and watch.unproven_s(now_s) >= behind_s):
            return now_s
    return float("inf")


@pytest.mark.parametrize(("pace", "burst"), [(1.0, False), (2.0, False), (4.0, False), (1.0, True)])
def test_a_non_reader_is_cut_within_5_s_of_its_first_audio_however_fast_audio_comes(pace: float, burst: bool) -> None:
    """Its kernel fills its receive buffer first (at 1x: 2.7 s), and only then does the stall clock start: with
    the stall rule alone it was cut at 5.7 s; the cumulative bound cuts it by 5 s of its first audio."""
    cut_s = non_reader_cut_s(pace, burst=burst)
    assert cut_s <= 5.0 + 2 * TICK_S, cut_s
    assert cut_s >= 1.0  # never before it has been stalled MIN_STALL_S


def test_the_stall_rule_alone_would_cut_a_one_x_non_reader_late() -> None:
    """(What the cumulative bound is for: the same non-reader under the stall rule alone.)"""
    assert non_reader_cut_s(1.0, behind_s=float("inf")) > 5.5


def test_a_reader_behind_a_fast_producer_is_never_cut() -> None:
    """A client that reads in real time, behind a producer at 4x: its window closes and opens again a segment's
    worth at a time; it shows it reads every 256 KiB (5.5 s of 24 kHz PCM16) and never stalls for long."""
    watch = DrainWatch()
    read = 0
    proofs = 0
    for tick in range(1, 1600):  # 40 s
        now_s = tick * TICK_S
        watch.wrote(int(4 * PCM_BYTES_PER_S * TICK_S))  # 4x real time
        read += int(PCM_BYTES_PER_S * TICK_S)  # the application reads in real time
        acked = min(watch.written_bytes, RECEIVE_BUFFER_BYTES + read - read % 1460)  # window updates of an MSS
        proven = watch.proven_drained_bytes
        watch.observe(watch.written_bytes - acked, now_s)
        proofs += watch.proven_drained_bytes > proven
        stalled_s = watch.stalled_s(now_s)
        assert stalled_s < MIN_STALL_S and not (stalled_s > 3.0), now_s
    assert proofs >= 5


def test_a_kernels_trickle_after_the_buffer_filled_is_no_proof_of_reading() -> None:
    """A non-reader's kernel takes a few hundred bytes now and then after its buffer is full (it collapses its
    queue): that is progress for the stall clock, but it shows no reading."""
    watch = DrainWatch()
    watch.wrote(200_000)
    watch.observe(70_000, 1.0)  # its buffer is full: 130 kB taken
    watch.observe(70_000, 1.2)  # stalled
    for i in range(1, 20):
        watch.observe(70_000 - 500 * i, 1.2 + 0.2 * i)  # 500 B now and then
    assert watch.unproven_s(6.0) == pytest.approx(5.0)


def test_a_client_that_stops_reading_later_is_measured_from_its_last_proof() -> None:
    watch = DrainWatch()
    watch.wrote(400_000)
    watch.observe(400_000 - UNREAD_CAPACITY_BYTES, 1.0)  # it has taken all a kernel holds: not yet proof
    assert watch.unproven_s(2.0) == pytest.approx(1.0)
    watch.observe(400_000 - UNREAD_CAPACITY_BYTES - 1, 2.0)  # one byte more: it reads
    assert watch.unproven_s(10.0) == 0.0
    watch.wrote(1000)
    watch.observe(100_000, 3.0)  # bytes given since: unproven from here
    watch.observe(100_000, 4.0)
    assert watch.unproven_s(8.0) == pytest.approx(5.0)
    assert watch.stalled_s(8.0) == pytest.approx(5.0)  # stalled since its last progress (3.0)
