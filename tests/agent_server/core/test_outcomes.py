"""The one table of outcomes (agent_server/core/outcomes.py): docs/operations.md shows it row for row, and every
transport answers an outcome from it (a WebSocket's close code, an HTTP status, a gRPC status)."""

from __future__ import annotations

import asyncio
import re
from pathlib import Path
from typing import Any

import grpc
import pytest
from starlette.types import Message

from agent_server.core.events import StreamStatus
from agent_server.core.grpc_server import GrpcTransport
from agent_server.core.outcomes import ANSWERS, Answer, Outcome
from agent_server.core.transport import HttpTransport, WebSocketTransport
from agent_server.errors import RATE_LIMITED, UNAVAILABLE, FieldError

DOCS = Path(__file__).resolve().parents[3] / "docs" / "operations.md"
ROW = re.compile(r"^\| `(?P<name>[a-z_]+)` \| [^|]+ \| (?P<close>\d+) \| (?P<http>\d+|—) \| (?P<grpc>[A-Z_]+) \|$")


def documented() -> dict[str, Answer]:
    text = DOCS.read_text()
    section = text.split("## How a session ends: one table", 1)[1].split("\n## ", 1)[0]
    rows: dict[str, Answer] = {}
    for line in section.splitlines():
        match = ROW.match(line)
        if match:
            http = None if match["http"] == "—" else int(match["http"])
            rows[match["name"]] = Answer(int(match["close"]), http, match["grpc"])
    return rows


def test_the_docs_show_the_table_of_the_code() -> None:
    assert documented() == {outcome.value: answer for outcome, answer in ANSWERS.items()}


def test_every_outcome_has_one_answer() -> None:
    assert set(ANSWERS) == set(Outcome)
    for answer in ANSWERS.values():
        assert answer.grpc_status in grpc.StatusCode.__members__


class Channel:
    def __init__(self) -> None:
        self.sent: list[Message] = []

    async def receive(self) -> Message:
        await asyncio.Event().wait()
        raise AssertionError("unreachable")

    async def send(self, message: Message) -> None:
        self.sent.append(message)


def scope(kind: str) -> dict[str, Any]:
    return {"type": kind, "query_string": b"", "headers": [], "client": ("127.0.0.1", 1)}


@pytest.mark.parametrize("outcome", list(Outcome))
def test_a_websocket_closes_with_the_outcomes_code(outcome: Outcome) -> None:
    channel = Channel()
    asyncio.run(WebSocketTransport(scope("websocket"), channel.receive, channel.send).close(outcome, "why"))
    assert channel.sent == [{"type": "websocket.close", "code": ANSWERS[outcome].close_code, "reason": "why"}]


@pytest.mark.parametrize("outcome", list(Outcome))
def test_an_http_request_that_started_no_answer_gets_the_outcomes_status(outcome: Outcome) -> None:
    channel = Channel()
    transport = HttpTransport(scope("http"), channel.receive, channel.send, max_body_bytes=100)
    asyncio.run(transport.close(outcome, "why"))
    expected = ANSWERS[outcome].http_status or ANSWERS[Outcome.INTERNAL_ERROR].http_status  # none of its own: 500
    assert channel.sent[0]["type"] == "http.response.start" and channel.sent[0]["status"] == expected


class FakeCall:
    def peer(self) -> str:
        return "ipv4:127.0.0.1:1"

    def invocation_metadata(self) -> tuple[()]:
        return ()


async def no_requests() -> Any:
    return
    yield


@pytest.mark.parametrize("outcome", list(Outcome))
def test_a_grpc_call_ends_with_the_outcomes_status(outcome: Outcome) -> None:
    transport = GrpcTransport(FakeCall(), no_requests(), None, unary=False)  # type: ignore[arg-type]
    asyncio.run(transport.close(outcome, "why"))
    assert transport.end is not None and transport.end.status.name == ANSWERS[outcome].grpc_status


def test_a_refused_request_and_an_ended_stream_name_their_outcome() -> None:
    assert Outcome.of_error(FieldError("text", "x")) is Outcome.BAD_INPUT
    assert Outcome.of_error(FieldError("text", "x", RATE_LIMITED)) is Outcome.OVER_LIMIT
    assert Outcome.of_error(FieldError("", "x", "too_many_contexts", busy=True)) is Outcome.BUSY
    assert Outcome.of_error(FieldError("", "x", UNAVAILABLE, busy=True)) is Outcome.NOT_READY
    assert {status: Outcome.of_stream(status) for status in StreamStatus if status.done} == {
        StreamStatus.COMPLETED: Outcome.COMPLETED, StreamStatus.CANCELLED: Outcome.CLIENT_GONE,
        StreamStatus.BUSY: Outcome.BUSY, StreamStatus.FAILED: Outcome.FAILED, StreamStatus.SHUTDOWN: Outcome.DRAIN_CUT,
    }
