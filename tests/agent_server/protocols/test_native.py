"""The native protocol (agent_server/protocols/native.py) over a real socket: greeting, flow, errors, close codes.

More end-to-end cases (formats, concurrency, cancel, shutdown, voices) are in test_e2e.py.
"""

from __future__ import annotations

from typing import Any

import httpx
import orjson
import pytest
from websockets.exceptions import ConnectionClosed
from websockets.sync.client import connect

from agent_server.protocols import native_wire as wire
from agent_server.settings import Settings

from tests.agent_server.fake_engine import FakeEngine
from tests.agent_server.live_server import LiveServer, live_server

pytestmark = pytest.mark.timeout(60)


# ---- the native session over a real socket ----------------------------------------------------------


def recv_until(ws: Any, predicate: Any, limit: int = 10_000) -> list[Any]:
    """Messages (dicts for events, bytes for frames) up to the first one `predicate` accepts."""
    got: list[Any] = []
    for _ in range(limit):
        raw = ws.recv(timeout=10)
        got.append(orjson.loads(raw) if isinstance(raw, str) else raw)
        if predicate(got[-1]):
            return got
    raise AssertionError("predicate never held")


def is_event(kind: str, context_id: str | None = None) -> Any:
    def check(item: Any) -> bool:
        return isinstance(item, dict) and item.get("type") == kind and (
            context_id is None or item.get("context_id") == context_id
        )

    return check


def send(ws: Any, obj: dict[str, Any]) -> None:
    ws.send(orjson.dumps(obj).decode())


@pytest.fixture(scope="module")
def server(tmp_path_factory: Any) -> Any:
    settings = Settings(
        data_dir=tmp_path_factory.mktemp("data"), max_contexts_per_session=2, max_protocol_errors=8
    )
    with live_server(FakeEngine(), settings) as live:
        yield live


def test_native_session_basic_flow(server: LiveServer) -> None:
    with connect(server.ws_url) as ws:
        hello = orjson.loads(ws.recv(timeout=5))
        assert hello["type"] == "session_started" and hello["random_weights"] is True
        send(ws, {"type": "open", "context_id": "a", "seed": 3, "text": "Hi there, how are you today? "})
        send(ws, {"type": "end", "context_id": "a"})
        got = recv_until(ws, is_event("context_done", "a"))
        events = [g for g in got if isinstance(g, dict)]
        assert [e["type"] for e in events][:2] == ["context_started", "segment_started"]
        frames = [g for g in got if isinstance(g, bytes)]
        assert events[-1]["reason"] == "completed" and events[-1]["frames"] == len(frames)
        headers = [wire.decode_frame(f)[0] for f in frames]
        assert [h.seq for h in headers] == list(range(len(frames)))
        assert {h.stream_id for h in headers} == {events[0]["stream_id"]}
        timing = events[-1]["timing"]
        assert timing["server_overhead_ms"] is not None and timing["server_overhead_ms"] >= 0
        assert timing["ttfa_ms"] >= timing["server_overhead_ms"]


def test_native_session_errors_keep_the_session(server: LiveServer) -> None:
    with connect(server.ws_url) as ws:
        ws.recv(timeout=5)

        def error_of(message: str | dict[str, Any]) -> dict[str, Any]:
            ws.send(message if isinstance(message, str) else orjson.dumps(message).decode())
            reply: dict[str, Any] = orjson.loads(ws.recv(timeout=5))
            assert reply["type"] == "error", reply
            return reply

        assert error_of("{oops")["field"] == "message"
        err = error_of({"type": "text", "context_id": "nope", "text": "x"})
        assert err["field"] == "context_id" and err["code"] == "unknown_context"
        err = error_of({"type": "open", "context_id": "a", "voice": "ghost"})
        assert err["field"] == "voice" and err["code"] == "unknown_voice"
        assert error_of({"type": "open", "context_id": "a", "model": "turbo"})["field"] == "model"
        assert error_of({"type": "open", "context_id": "a", "language": "fr"})["field"] == "language"
        send(ws, {"type": "cancel", "context_id": "never-opened"})  # idempotent: no answer
        send(ws, {"type": "open", "context_id": "a"})
        assert orjson.loads(ws.recv(timeout=5))["type"] == "context_started"
        assert error_of({"type": "open", "context_id": "a"})["code"] == "context_exists"
        send(ws, {"type": "open", "context_id": "b"})
        assert orjson.loads(ws.recv(timeout=5))["type"] == "context_started"
        send(ws, {"type": "open", "context_id": "c"})
        busy = orjson.loads(ws.recv(timeout=5))
        assert busy["type"] == "busy" and busy["context_id"] == "c"
        send(ws, {"type": "cancel", "context_id": "b"})
        assert recv_until(ws, is_event("context_done", "b"))[-1]["reason"] == "cancelled"
        send(ws, {"type": "text", "context_id": "a", "text": "Still working, good. "})
        send(ws, {"type": "end", "context_id": "a"})
        got = recv_until(ws, is_event("context_done", "a"))
        assert got[-1]["reason"] == "completed" and any(isinstance(g, bytes) for g in got)
        # text after end is an error; the budget of 8 errors then runs out and the server closes with 1008
        assert error_of({"type": "text", "context_id": "a", "text": "x"})["field"] == "context_id"
        send(ws, {"type": "flush", "context_id": "a"})
        assert orjson.loads(ws.recv(timeout=5))["type"] == "error"
        with pytest.raises(ConnectionClosed) as closed:
            ws.recv(timeout=5)
        assert closed.value.rcvd is not None and closed.value.rcvd.code == 1008


def test_an_llm_still_streaming_into_a_cancelled_context_is_no_error(server: LiveServer) -> None:
    """The barge-in: the client cancels while its LLM is still producing; the tokens, flush and end that follow
    for that context are moot and ignored (more of them than the session's error budget, 8 here), the session
    goes on. The id, reused for a new context, counts again."""
    with connect(server.ws_url) as ws:
        ws.recv(timeout=5)
        send(ws, {"type": "open", "context_id": "turn1", "text": "This is the start of a long answer. "})
        send(ws, {"type": "cancel", "context_id": "turn1"})
        assert recv_until(ws, is_event("context_done", "turn1"))[-1]["reason"] == "cancelled"
        for i in range(20):
            send(ws, {"type": "text", "context_id": "turn1", "text": f" token{i}"})
        send(ws, {"type": "flush", "context_id": "turn1"})
        send(ws, {"type": "end", "context_id": "turn1"})
        send(ws, {"type": "cancel", "context_id": "turn1"})
        send(ws, {"type": "open", "context_id": "turn2", "text": "Okay, sure thing. "})
        send(ws, {"type": "end", "context_id": "turn2"})
        got = recv_until(ws, is_event("context_done", "turn2"))
        assert not [g for g in got if isinstance(g, dict) and g["type"] == "error"], got
        assert got[-1]["reason"] == "completed"
        send(ws, {"type": "open", "context_id": "turn1", "text": "Again. "})  # reused: a context like any other
        send(ws, {"type": "end", "context_id": "turn1"})
        assert recv_until(ws, is_event("context_done", "turn1"))[-1]["reason"] == "completed"
        send(ws, {"type": "text", "context_id": "turn1", "text": "x"})  # after its end (completed): an error
        reply = orjson.loads(ws.recv(timeout=5))
        assert reply["type"] == "error" and reply["code"] == "unknown_context"


def test_a_break_that_never_closes_is_reported_when_the_text_ends(server: LiveServer) -> None:
    """`<break time="1s" now.` with no `>`: held in case the tag goes on; at `end` it is said as text, and the
    client is told (`bad_markup`), as for any break that cannot be played."""
    with connect(server.ws_url) as ws:
        ws.recv(timeout=5)
        send(ws, {"type": "open", "context_id": "b", "breaks": True, "text": 'Unclosed <break time="1s" now.'})
        send(ws, {"type": "end", "context_id": "b"})
        got = recv_until(ws, is_event("context_done", "b"))
        [error] = [g for g in got if isinstance(g, dict) and g["type"] == "error"]
        assert error["code"] == "bad_markup" and error["field"] == "text" and "never closes" in error["message"]
        assert got[-1]["reason"] == "completed"


def test_status_and_health(server: LiveServer) -> None:
    assert httpx.get(server.http_url + "/healthz").json()["status"] == "ready"
    body = httpx.get(server.http_url + "/v1/status").json()
    assert body["ready"] and body["random_weights"] and body["warnings"] and body["variant"] == "english"
    assert body["engine"]["weights_source"] == "fake"
