"""The thin transports (agent_server/core/transport.py): the kernel measure the slow-client watchdog reads, and
the HTTP transport's one-message reader and its last-resort error response."""

from __future__ import annotations

import asyncio
import socket
import sys
import time
from typing import Any

import orjson
import pytest
from starlette.types import Message

from agent_server.core.outcomes import Outcome
from agent_server.core.transport import Disconnected, Head, HttpTransport, InputRefused, _unsent_probe

pytestmark = pytest.mark.timeout(30)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="SIOCOUTQ is Linux's")
def test_the_unsent_probe_sees_what_the_peer_has_not_taken() -> None:
    """Bytes written to a peer that does not read stay counted (transport buffer + kernel send queue);
    once the peer reads them all, the count drops to 0."""

    async def scenario() -> tuple[int, int, int]:
        listener = socket.create_server(("127.0.0.1", 0))
        reader_sock = socket.socket()
        reader_sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        reader_sock.connect(listener.getsockname())
        server_side, _ = listener.accept()
        server_side.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 16384)
        loop = asyncio.get_running_loop()
        transport, _ = await loop.connect_accepted_socket(asyncio.Protocol, server_side)
        probe = _unsent_probe(transport)
        assert probe is not None and probe() == 0
        payload = b"x" * 20_000  # fits in the kernel's send buffer: none stays in asyncio's
        transport.write(payload)
        await asyncio.sleep(0)
        stuck, in_asyncio = probe(), transport.get_write_buffer_size()
        reader_sock.setblocking(False)
        taken = 0
        deadline_s = time.monotonic() + 10
        while taken < len(payload) and time.monotonic() < deadline_s:
            try:
                taken += len(reader_sock.recv(65536))
            except BlockingIOError:
                await asyncio.sleep(0.005)
        drained = probe()
        transport.close()
        reader_sock.close()
        listener.close()
        return stuck, in_asyncio, drained

    stuck, in_asyncio, drained = asyncio.run(scenario())
    assert in_asyncio == 0 and stuck > 10_000  # held in the kernel: more than the peer's small window took
    assert drained == 0


class Channel:
    def __init__(self, *incoming: Message) -> None:
        self.incoming = list(incoming)
        self.sent: list[Message] = []
        self.gone = asyncio.Event()

    async def receive(self) -> Message:
        if self.incoming:
            return self.incoming.pop(0)
        await self.gone.wait()
        return {"type": "http.disconnect"}

    async def send(self, message: Message) -> None:
        self.sent.append(message)


def http(channel: Channel, max_body_bytes: int = 100) -> HttpTransport:
    scope: dict[str, Any] = {"type": "http", "query_string": b"", "headers": [], "client": ("127.0.0.1", 1)}
    return HttpTransport(scope, channel.receive, channel.send, max_body_bytes=max_body_bytes)


def test_the_http_body_is_one_message_then_only_the_client_leaving_is_news() -> None:
    async def scenario() -> tuple[object, object, object]:
        channel = Channel({"type": "http.request", "body": b'{"a"', "more_body": True},
                          {"type": "http.request", "body": b": 1}", "more_body": False})
        transport = http(channel)
        body = await transport.receive()
        waiting = asyncio.ensure_future(transport.receive())
        await asyncio.sleep(0.01)
        pending = waiting.done()
        channel.gone.set()
        return body, pending, await waiting

    body, pending, after = asyncio.run(scenario())
    assert body == b'{"a": 1}' and pending is False and after == Disconnected(1001)


def test_an_http_body_over_the_limit_is_refused() -> None:
    channel = Channel({"type": "http.request", "body": b"x" * 101, "more_body": False})
    assert asyncio.run(http(channel).receive()) == InputRefused(Outcome.TOO_LARGE, "the request body is over 100 bytes")


def test_a_close_with_no_response_started_sends_an_error() -> None:
    async def scenario() -> list[Message]:
        channel = Channel()
        await http(channel).close(Outcome.INTERNAL_ERROR, "internal error")
        return channel.sent

    sent = asyncio.run(scenario())
    assert sent[0]["type"] == "http.response.start" and sent[0]["status"] == 500
    assert orjson.loads(sent[1]["body"])["error"]["message"] == "internal error"
    assert sent[-1] == {"type": "http.response.body", "body": b"", "more_body": False}


def test_a_close_after_the_response_started_ends_the_body() -> None:
    async def scenario() -> list[Message]:
        channel = Channel()
        transport = http(channel)
        await transport.send(Head(200, "audio/pcm"))
        await transport.send(b"\x00\x01")
        await transport.close(Outcome.COMPLETED, "")
        await transport.close(Outcome.COMPLETED, "")  # once only
        return channel.sent

    sent = asyncio.run(scenario())
    assert [m["type"] for m in sent] == ["http.response.start", "http.response.body", "http.response.body"]
    assert sent[-1]["more_body"] is False
