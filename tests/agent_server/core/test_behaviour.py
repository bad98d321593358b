"""The behaviour table of docs/operations.md ("Every protocol, the same behaviour"): each row, asserted
for every protocol, in-process over fake ASGI channels (tests/agent_server/fake_asgi.py). Riva's column
(gRPC, which fake ASGI channels cannot carry) is asserted over a real server in protocols/test_riva.py.

Rows: refused when full; refused while not serving; the key's session limit across replicas and with the
shared state down (a real redis-server, tests/services.py); a text piece over the limit; a context over its
limit; a message with no text; the key's text budget spent, or not checkable; the engine busy (no free slot,
or its inbox full); a client that stops reading; the drain; metrics; logs.
"""

from __future__ import annotations

import asyncio
import secrets
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import orjson
import pytest
import structlog
from starlette.applications import Starlette

from agent_server.app import create_app
from agent_server.core.observers import (
    BusyRejected,
    ContextFinished,
    FirstAudio,
    ObservedEvent,
    SessionClosed,
    SessionOpened,
    SlowClientDropped,
)
from agent_server.core.session import DRAIN_IDLE_S
from agent_server.protocols import routes
from agent_server.settings import Settings
from synth.api import EngineFull, SegmentRequest

from tests.agent_server.fake_asgi import FakeHttpRequest, FakeWebSocket, running
from tests.agent_server.fake_engine import FakeEngine
from tests.agent_server.protocol_drivers import DRIVERS, WEBSOCKET_DRIVERS, Driver, speak, until
from tests.services import RedisServer, redis_server

pytestmark = pytest.mark.timeout(60)

TEXT = "Sure, I can help with that right away. "
LONG_TEXT = TEXT * 6  # ~9 s of fake audio
KEY = "sk-behaviour-test-key"
OTHER_KEY = "sk-behaviour-other-key"
UNCHECKABLE = "cannot be checked now"  # auth.UNCHECKABLE: the shared state is down
EMPTY_ANSWER = "the message carries no text"  # the core's one answer, whatever the protocol's shape


def make_app(
    tmp_path: Path, engine: FakeEngine | None = None, **settings: Any
) -> tuple[Starlette, list[ObservedEvent]]:
    app = create_app(engine or FakeEngine(), Settings(data_dir=tmp_path, **settings))
    served = {getattr(route, "path", None) for route in app.router.routes}
    app.router.routes.extend(r for r in routes() if getattr(r, "path", None) not in served)
    events: list[ObservedEvent] = []
    app.state.observers.subscribe(events.append)
    return app, events


def of(events: list[ObservedEvent], kind: type, protocol: str) -> list[Any]:
    return [e for e in events if isinstance(e, kind) and e.protocol == protocol]


async def hold_a_session(app: Starlette, headers: dict[str, str] | None = None) -> FakeWebSocket:
    holder = FakeWebSocket(app, "/v1/stream", headers=headers)
    await holder.connect()
    assert (await holder.next_json())["type"] == "session_started"
    return holder


def bearer(key: str) -> dict[str, str]:
    return {"authorization": f"Bearer {key}"}


def run(coro: Any) -> Any:
    return asyncio.run(coro)


# ---- admission ---------------------------------------------------------------------------------------


async def assert_session_refused(driver: Driver, app: Starlette, http_status: int, http_code: str,
                                 headers: dict[str, str] | None = None) -> str:
    """A new session of `driver` is refused: its protocol's busy then close 1013, or the HTTP error. The
    refusal's text (the reason)."""
    if driver.http:
        request = driver.request(app, TEXT, headers)
        await request.done()
        code, message = driver.http_error(request)
        assert request.status == http_status and code == http_code, (request.status, code, message)
        return message
    ws = await driver.connect(app, headers)
    assert await ws.wait_closed() == 1013
    refusal = ws.json_messages()[0]
    assert driver.is_session_refusal(refusal), ws.json_messages()
    return orjson.dumps(refusal).decode()


async def assert_session_served(driver: Driver, app: Starlette, headers: dict[str, str] | None = None) -> None:
    """A session of `driver` is admitted and speaks a whole turn."""
    if driver.http:
        request = driver.request(app, TEXT, headers)
        await request.done()
        await request.finished()
        assert request.status == 200 and request.content, (request.status, request.content[:200])
        return
    ws = await driver.connect(app, headers)
    got = await speak(driver, ws, "ok", TEXT)
    assert not any(driver.is_busy(m) or driver.error_of(m) for m in got), got
    assert any(isinstance(m, bytes) or '"audio":"' in m or '"data":"' in m for m in ws.log), got
    if not ws.closed.is_set():
        ws.disconnect()
    await ws.finished()


@pytest.mark.parametrize("driver", DRIVERS, ids=str)
def test_refused_when_full(tmp_path: Path, driver: Driver) -> None:
    """max_sessions counts every protocol; the refusal is the protocol's busy and 1013 (HTTP: 429)."""
    app, events = make_app(tmp_path, max_sessions=1)

    async def scenario() -> None:
        async with running(app) as hub:
            holder = await hold_a_session(app)
            await assert_session_refused(driver, app, http_status=429, http_code="busy")
            assert len(hub.sessions) == 1
            holder.disconnect()
            await holder.finished()
            assert not hub.sessions

    run(scenario())
    assert [e.scope for e in of(events, BusyRejected, driver.name)] == ["session"]
    holders = 1 if driver.name == "native" else 0  # the session that filled the server is a native one
    assert len(of(events, SessionOpened, driver.name)) == len(of(events, SessionClosed, driver.name)) == holders


@pytest.mark.parametrize("driver", DRIVERS, ids=str)
def test_refused_while_not_serving(tmp_path: Path, driver: Driver) -> None:
    """Once the drain began (or while the model loads) a new session is refused: busy + 1013 (HTTP: 503)."""
    app, events = make_app(tmp_path)

    async def scenario() -> None:
        async with running(app) as hub:
            await hub.drain(0.0)
            await assert_session_refused(driver, app, http_status=503, http_code="not_ready")

    run(scenario())
    assert [e.scope for e in of(events, BusyRejected, driver.name)] == ["session"]


# ---- the key's session limit in the shared state (Redis) ----------------------------------------------


@pytest.fixture(scope="module")
def redis(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RedisServer]:
    with redis_server(tmp_path_factory.mktemp("redis")) as server:
        yield server


def replica_app(tmp_path: Path, redis: RedisServer, prefix: str, name: str, **settings: Any) -> Starlette:
    """One replica of a fleet sharing `redis` under `prefix` (a fresh prefix per test: a fresh fleet)."""
    app, _ = make_app(tmp_path / name, redis_url=redis.url, redis_prefix=prefix, api_keys=(KEY, OTHER_KEY),
                      phrase_cache_mb=0, **settings)
    return app


async def until_shared(app: Starlette, available: bool) -> None:
    hub = app.state.hub
    async with asyncio.timeout(10):
        while hub.shared.available != available:
            await asyncio.sleep(0.02)


@pytest.mark.parametrize("driver", DRIVERS, ids=str)
def test_the_key_session_limit_holds_across_replicas(tmp_path: Path, redis: RedisServer, driver: Driver) -> None:
    """`--max-sessions-per-key` with `--redis-url`: the key's sessions on every replica count (leases in Redis).
    A session of a key at its limit elsewhere is refused like a full server (busy + 1013, HTTP 429 `busy`);
    once the other replica's session ends, its place is free here; another key is not affected."""
    prefix = f"behaviour-{secrets.token_hex(4)}:"
    app_a = replica_app(tmp_path, redis, prefix, "a", max_sessions_per_key=1)
    app_b = replica_app(tmp_path, redis, prefix, "b", max_sessions_per_key=1)

    async def scenario() -> None:
        async with running(app_a) as hub_a, running(app_b) as hub_b:
            holder = await hold_a_session(app_a, bearer(KEY))  # the key's one session, on replica A
            reason = await assert_session_refused(driver, app_b, 429, "busy", bearer(KEY))
            assert "API key" in reason, reason
            assert not hub_b.sessions
            await assert_session_served(driver, app_b, bearer(OTHER_KEY))
            holder.disconnect()
            await holder.finished()
            assert not hub_a.sessions
            principal = hub_a.auth.verify(KEY)
            async with asyncio.timeout(5):  # A gives the lease back in the background
                while await hub_b.auth.sessions_of(principal):
                    await asyncio.sleep(0.01)
            await assert_session_served(driver, app_b, bearer(KEY))
            async with asyncio.timeout(5):
                while await hub_b.auth.sessions_of(principal):
                    await asyncio.sleep(0.01)

    run(scenario())


@pytest.mark.parametrize("driver", DRIVERS, ids=str)
def test_with_the_shared_state_down_what_cannot_be_checked_is_refused(
    tmp_path: Path, redis: RedisServer, driver: Driver
) -> None:
    """Redis down (docs/operations.md): a new session of a key with a session limit is refused (busy + 1013,
    HTTP 429 `busy`), text of a key with a text budget is refused like a spent budget, both saying the limit
    "cannot be checked now"; a key without limits is served; all of it is back once Redis is."""
    prefix = f"behaviour-{secrets.token_hex(4)}:"
    limited = replica_app(tmp_path, redis, prefix, "a", max_sessions_per_key=1)
    budgeted = replica_app(tmp_path, redis, prefix, "b", max_text_chars_per_minute_per_key=1000)
    unlimited = replica_app(tmp_path, redis, prefix, "c")

    async def scenario() -> tuple[int | None, str, str]:
        async with running(limited), running(budgeted), running(unlimited):
            redis.stop()
            try:
                await until_shared(limited, False)
                await until_shared(budgeted, False)
                reason = await assert_session_refused(driver, limited, 429, "busy", bearer(KEY))
                assert UNCHECKABLE in reason, reason
                refused_text = await text_refused(driver, budgeted, "w" * 40, bearer(KEY), opener=None
                                                  if driver.name in ("deepgram", "openai") else "Hi. ")
                await assert_session_served(driver, unlimited, bearer(KEY))
            finally:
                redis.start()
            await until_shared(limited, True)
            await until_shared(budgeted, True)
            await assert_session_served(driver, limited, bearer(KEY))
            await assert_session_served(driver, budgeted, bearer(KEY))
            return refused_text

    status, code, message = run(scenario())
    assert code == RATE[driver.name] and UNCHECKABLE in message, (code, message)
    assert status == (429 if driver.http else None)


# ---- limits ------------------------------------------------------------------------------------------


async def text_refused(driver: Driver, app: Starlette, text: str | None, headers: dict[str, str] | None = None,
                       opener: str | None = "Hi. ") -> tuple[int | None, str, str]:
    """(HTTP status, or None; the protocol's error code or name; its message) for one refused text."""
    if driver.http:
        request = driver.request(app, text, headers)
        await request.done()
        code, said = driver.http_error(request)
        return request.status, code, said
    ws = await driver.connect(app, headers)
    messages = driver.text("c", opener, first=True) if opener is not None else []
    messages += driver.text("c", text)
    for message in messages:
        ws.send_json(message)
    got = await until(driver, ws, lambda m: driver.error_of(m) is not None)
    error = driver.error_of(got[-1])
    assert error is not None, got
    ws.disconnect()
    await ws.finished()
    return None, error[0], error[1]


# the form each protocol gives one refusal: (HTTP status or None, error code/name)
# every HTTP protocol answers with the core's own code (lower case); WebSocket ones in their vendor's words
HTTP_NAMES = ("openai", "elevenlabs_http", "cartesia_http", "deepgram_http", "jambonz_http")
PIECE_TOO_LONG = {"native": "text_too_long", "elevenlabs": "max_character_limit_exceeded", "cartesia": "400",
                  "deepgram": "TEXT_TOO_LONG", "jambonz": "text_too_long"} | dict.fromkeys(HTTP_NAMES, "text_too_long")
CONTEXT_TOO_LONG = {"native": "context_text_limit", "elevenlabs": "max_character_limit_exceeded", "cartesia": "400",
                    "deepgram": "TEXT_TOO_LONG", "jambonz": "context_text_limit"}
EMPTY = {"native": "empty_message", "elevenlabs": "invalid_message", "cartesia": "400",
         "deepgram": "INVALID_MESSAGE", "jambonz": "empty_message"} | dict.fromkeys(HTTP_NAMES, "empty_message")
RATE = {"native": "rate_limited", "elevenlabs": "rate_limited", "cartesia": "429", "deepgram": "RATE_LIMITED",
        "jambonz": "rate_limited"} | dict.fromkeys(HTTP_NAMES, "rate_limited")


@pytest.mark.parametrize("driver", DRIVERS, ids=str)
def test_one_text_piece_limit(tmp_path: Path, driver: Driver) -> None:
    app, _ = make_app(tmp_path, max_text_piece_chars=50)

    async def scenario() -> tuple[int | None, str, str]:
        async with running(app):
            return await text_refused(driver, app, "x" * 51)

    status, code, message = run(scenario())
    assert code == PIECE_TOO_LONG[driver.name] and "at most 50" in message
    assert status == (driver.bad_request_status if driver.http else None)


@pytest.mark.parametrize("driver", [d for d in DRIVERS if not d.http], ids=str)
def test_context_text_limit(tmp_path: Path, driver: Driver) -> None:
    app, _ = make_app(tmp_path, max_text_piece_chars=50, max_context_text_chars=60)

    async def scenario() -> tuple[int | None, str, str]:
        async with running(app):
            return await text_refused(driver, app, "y" * 50, opener="z" * 40)

    _, code, message = run(scenario())
    assert code == CONTEXT_TOO_LONG[driver.name] and "60" in message


@pytest.mark.parametrize("driver", DRIVERS, ids=str)
def test_a_message_without_text(tmp_path: Path, driver: Driver) -> None:
    """One answer everywhere, in each protocol's form: `{}` (ElevenLabs), `{"type": "Speak"}` (Deepgram),
    a Cartesia request with no transcript, a native `text` with none, an OpenAI body with no input."""
    app, _ = make_app(tmp_path)

    async def scenario() -> tuple[int | None, str, str]:
        async with running(app):
            return await text_refused(driver, app, None)

    status, code, message = run(scenario())
    assert code == EMPTY[driver.name] and message == EMPTY_ANSWER
    assert status == (driver.bad_request_status if driver.http else None)


@pytest.mark.parametrize("driver", DRIVERS, ids=str)
def test_text_budget_per_key(tmp_path: Path, driver: Driver) -> None:
    app, _ = make_app(tmp_path, api_keys=(KEY,), max_text_chars_per_minute_per_key=30)

    async def scenario() -> tuple[int | None, str, str]:
        async with running(app):
            return await text_refused(driver, app, "w" * 40, {"authorization": f"Bearer {KEY}"}, opener=None
                                      if driver.name in ("deepgram", "jambonz") or driver.http else "Hi. ")

    status, code, message = run(scenario())
    assert code == RATE[driver.name] and "30 characters per minute" in message
    assert status == (429 if driver.http else None)


async def assert_turn_busy(driver: Driver, app: Starlette) -> None:
    """A new turn of `driver` gets the protocol's busy for its first segment (HTTP: 429 `busy`), and ends."""
    if driver.http:
        request = driver.request(app, TEXT)
        await request.done()
        assert request.status == 429 and driver.http_error(request)[0] == "busy"
        await request.finished()
        return
    ws = await driver.connect(app)
    for message in driver.turn("b", TEXT):
        ws.send_json(message)
    got = await until(driver, ws, driver.is_busy)
    assert driver.is_busy(got[-1]), got
    ws.disconnect()
    await ws.finished()


@pytest.mark.parametrize("driver", DRIVERS, ids=str)
def test_engine_busy(tmp_path: Path, driver: Driver) -> None:
    """Every slot taken (and no queueing): the first segment of a new turn gets the protocol's busy."""
    engine = FakeEngine(max_slots=1, max_waiting=0, realtime_factor=1.0)
    app, events = make_app(tmp_path, engine)

    async def scenario() -> None:
        async with running(app) as hub:
            holder = await hold_a_session(app)
            holder.send_json({"type": "open", "context_id": "hold", "text": LONG_TEXT})
            holder.send_json({"type": "end", "context_id": "hold"})
            while not engine.status()["slots_in_use"]:
                await asyncio.sleep(0.005)
            await assert_turn_busy(driver, app)
            holder.disconnect()
            await holder.finished()
            assert not hub.sessions

    run(scenario())
    assert "context" in [e.scope for e in of(events, BusyRejected, driver.name)]


class FullInboxEngine(FakeEngine):
    """An engine whose inbox is full: every submit is refused as synth.engine.Engine refuses it then."""

    def submit(self, request: SegmentRequest) -> None:
        raise EngineFull("the engine's inbox is full (3 items): try again later")


@pytest.mark.parametrize("driver", DRIVERS, ids=str)
def test_engine_inbox_full(tmp_path: Path, driver: Driver) -> None:
    """The engine's inbox full (its thread behind): the turn's first segment gets the protocol's busy, as when
    every slot is taken, counted as a busy refusal."""
    app, events = make_app(tmp_path, FullInboxEngine())

    async def scenario() -> None:
        async with running(app) as hub:
            await assert_turn_busy(driver, app)
            assert not hub.sessions

    run(scenario())
    assert "context" in [e.scope for e in of(events, BusyRejected, driver.name)]


# ---- flow control ------------------------------------------------------------------------------------


@pytest.mark.parametrize("driver", DRIVERS, ids=str)
def test_a_client_that_stops_reading_is_cut(tmp_path: Path, driver: Driver) -> None:
    """Cut `slow_client_stall_s` after it stopped taking its audio, however slowly audio comes: here the
    engine speaks in real time, so no buffer ever fills and no send ever blocks."""
    stall_s = 0.4
    engine = FakeEngine(realtime_factor=1.0, first_chunk_tokens=2, chunk_schedule_tokens=(2,))
    app, events = make_app(tmp_path, engine, slow_client_stall_s=stall_s)

    async def scenario() -> float:
        async with running(app) as hub:
            client: FakeWebSocket | FakeHttpRequest
            if driver.http:
                client = driver.request(app, LONG_TEXT)
                await asyncio.wait_for(client.first_chunk.wait(), 5)
            else:
                client = await driver.connect(app)
                for message in driver.turn("s", LONG_TEXT):
                    client.send_json(message)
                while not any(isinstance(m, bytes) or '"audio":"' in m or '"data":"' in m for m in client.log):
                    await asyncio.sleep(0.005)
            client.stop_reading()
            stopped_s = time.monotonic()
            await client.finished()
            cut_after_s = time.monotonic() - stopped_s
            assert not hub.sessions
            if isinstance(client, FakeWebSocket):
                assert client.close_code == 1008 or client.aborted.is_set()
            return cut_after_s

    cut_after_s = run(scenario())
    assert stall_s <= cut_after_s < stall_s + 1.0, cut_after_s
    assert len(of(events, SlowClientDropped, driver.name)) == 1


# ---- the drain ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("driver", DRIVERS, ids=str)
def test_drain(tmp_path: Path, driver: Driver) -> None:
    """SIGTERM's drain: a running turn speaks to its end; a new context (multi-context protocols) gets
    busy; the session then closes with 1001 (HTTP: the request completes; a new one gets 503)."""
    engine = FakeEngine(realtime_factor=0.3)
    app, _ = make_app(tmp_path, engine, shutdown_grace_s=10.0)

    async def scenario() -> None:
        async with running(app) as hub:
            if driver.http:
                request = driver.request(app, TEXT)
                await asyncio.wait_for(request.first_chunk.wait(), 5)
                drain = asyncio.create_task(hub.drain(10.0))
                late = driver.request(app, TEXT)
                await late.done()
                assert late.status == 503
                await request.done()
                assert request.status == 200 and len(request.content) > 0
                assert await drain is True
                return
            ws = await driver.connect(app)
            for message in driver.turn("t1", TEXT):
                ws.send_json(message)
            while not any(isinstance(m, bytes) or '"audio":"' in m or '"data":"' in m for m in ws.log):
                await asyncio.sleep(0.005)
            drain = asyncio.create_task(hub.drain(10.0))
            while hub.status.name != "DRAINING":
                await asyncio.sleep(0.001)
            if driver.multi:
                for message in driver.text("t2", TEXT, first=True):
                    ws.send_json(message)
                got = await until(driver, ws, driver.is_busy)
                assert driver.is_busy(got[-1]), got
            code = await ws.wait_closed()
            messages = ws.json_messages()
            if driver.name not in ("deepgram", "jambonz"):  # (no end-of-turn message: the socket closes)
                assert any(driver.is_turn_done(m, "t1") for m in messages), messages
            assert code == (1000 if driver.name in ("deepgram", "elevenlabs") and not driver.multi else 1001)
            assert await drain is True

    with structlog.testing.capture_logs() as logs:
        run(scenario())
    assert not [s for s in engine.submits if "t2" in s.request_id]
    if driver.multi:  # the new context's refusal is the server's (draining), not a client's protocol error
        refused = [line for line in logs if line.get("busy")]
        assert refused and all(line["event"] == "context_refused" for line in refused), refused


@pytest.mark.parametrize("driver", WEBSOCKET_DRIVERS, ids=str)
def test_drain_ends_a_context_left_open_between_turns(tmp_path: Path, driver: Driver) -> None:
    """A voice agent keeps its socket and its context open between turns (no end, no close_context): the drain
    ends such a context's input once the client has been quiet for DRAIN_IDLE_S, what it sent is spoken, and
    the session closes then, not when the grace period runs out."""
    engine = FakeEngine()
    grace_s = 8.0
    app, _ = make_app(tmp_path, engine, shutdown_grace_s=grace_s)

    async def scenario() -> tuple[float, bool]:
        async with running(app) as hub:
            ws = await driver.connect(app)
            for message in driver.text("t1", TEXT, first=True):
                ws.send_json(message)
            await asyncio.sleep(0.2)
            started = time.monotonic()
            complete = await hub.drain(grace_s)
            await ws.wait_closed()
            return time.monotonic() - started, complete

    took_s, complete = run(scenario())
    assert complete and took_s < DRAIN_IDLE_S + 3.0, took_s
    assert " ".join(s.text for s in engine.submits) == TEXT.strip()  # what was sent was spoken


@pytest.mark.parametrize("driver", WEBSOCKET_DRIVERS, ids=str)
def test_a_client_leaving_mid_turn_cancels_it_not_a_shutdown(tmp_path: Path, driver: Driver) -> None:
    """The metrics' `reason` of a context whose client went away is `cancelled` (by the client), never
    `shutdown`: an alert on shutdowns must not fire on ordinary client churn."""
    engine = FakeEngine(realtime_factor=1.0)
    app, events = make_app(tmp_path, engine)

    async def scenario() -> None:
        async with running(app) as hub:
            ws = await driver.connect(app)
            for message in driver.text("t1", TEXT, first=True):
                ws.send_json(message)
            while not engine.submits:
                await asyncio.sleep(0.005)
            ws.disconnect(1001)
            async with asyncio.timeout(5):
                while hub.sessions:
                    await asyncio.sleep(0.01)

    run(scenario())
    assert [e.reason for e in of(events, ContextFinished, driver.name)] == ["cancelled"]


# ---- metrics and logs ----------------------------------------------------------------------------------


@pytest.mark.parametrize("driver", [d for d in DRIVERS if d.name != "jambonz"], ids=str)
def test_metrics_and_logs_of_one_turn(tmp_path: Path, driver: Driver) -> None:
    """(jambonz has no end of a turn: its metrics row is protocols/test_telephony.py's)"""
    app, events = make_app(tmp_path)

    async def scenario() -> None:
        async with running(app) as hub:
            if driver.http:
                request = driver.request(app, TEXT)
                await request.done()
                await request.finished()
                assert request.status == 200 and request.content
            else:
                ws = await driver.connect(app)
                await speak(driver, ws, "m", TEXT)
                if not ws.closed.is_set():
                    ws.disconnect()
                await ws.finished()
            assert not hub.sessions

    with structlog.testing.capture_logs() as logs:
        run(scenario())
    first_audio = of(events, FirstAudio, driver.name)
    assert len(first_audio) == 1 and first_audio[0].ttfa_s is not None and first_audio[0].ttfa_s > 0
    assert len(of(events, SessionOpened, driver.name)) == len(of(events, SessionClosed, driver.name)) == 1
    finished = of(events, ContextFinished, driver.name)
    assert [f.reason for f in finished] == ["completed"] and finished[0].audio_s > 0
    mine = [line["event"] for line in logs if line.get("protocol") == driver.name]
    assert mine[0] == "session_opened" and mine[-1] == "session_closed" and "context_done" in mine, mine
    done = next(line for line in logs if line["event"] == "context_done")
    assert done["reason"] == "completed" and done["frames"] > 0 and done["audio_ms"] > 0


def test_every_protocol_is_in_the_table() -> None:
    """docs/operations.md's behaviour table has one column per protocol these tests drive."""
    table = (Path(__file__).resolve().parents[3] / "docs" / "operations.md").read_text()
    header = next(line for line in table.splitlines() if line.startswith("| behaviour |"))
    columns = [c.strip() for c in header.strip("|").split("|")[1:]]
    assert columns == [d.column for d in DRIVERS] + ["Riva gRPC"]
    assert len({d.column for d in DRIVERS}) == len(DRIVERS) and len(WEBSOCKET_DRIVERS) == 6
