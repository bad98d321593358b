"""Transports: the thin I/O under a session (agent_server/core/session.py). Each is a reader (`receive`) and a
writer (`send`, `close`) over one ASGI connection, plus what flow control needs (`unsent_bytes`,
`abort`). They know nothing of protocols, contexts or the engine.

- `WebSocketTransport`: one WebSocket; every message in is one `receive()`, every `send()` one message.
- `HttpTransport`: one HTTP request; its body is the one message `receive()` returns (then it waits for
  the client to go; a body over the limit is `InputRefused`: the client still waits for its 413),
  `send(Head)` starts the response, each later `send()` is a chunk of its body and `close()` ends it (with
  a plain error response, the outcome's HTTP status, when none was started).
- `core/grpc_server.GrpcTransport`: one gRPC call; each request is a message, the end of the
  client's requests is `InputEnded`.

Every transport ends its connection with the session's `Outcome` and answers it from the one table
(core/outcomes.py): a WebSocket's close code, an HTTP status, a gRPC status.

`SocketControlMiddleware` reaches the server's transport under ASGI: it bounds the kernel send buffer,
lets a session drop a connection that cannot take a close, and reads how many bytes are still waiting to
leave the machine (the slow-client watchdog's measure).
"""

from __future__ import annotations

import asyncio
import fcntl
import socket
import struct
import sys
import termios
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from http import HTTPStatus
from typing import Any, Protocol

import orjson
from starlette.datastructures import Headers, QueryParams
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from agent_server.core.outcomes import CLOSE_GOING_AWAY, Outcome, http_status
from agent_server.fleet.auth import Principal, principal_of

TRANSPORT_ABORT_KEY = "agent_server.transport_abort"
TRANSPORT_CLOSE_KEY = "agent_server.transport_close"  # close after what is buffered went out (no RST)
HTTP_TRUNCATED_WAIT_S = 2.0  # how long a cut response waits for its connection to close (see HttpTransport.close)
TRANSPORT_UNSENT_KEY = "agent_server.transport_unsent_bytes"
OUTQ_FORMAT = struct.Struct("i")
HTTP_CLIENT_GONE = CLOSE_GOING_AWAY  # the close code an HTTP session records when its client leaves


@dataclass(frozen=True, slots=True)
class Head:
    """The start of an HTTP response. For HTTP transports only."""

    status: int
    media_type: str
    headers: tuple[tuple[str, str], ...] = ()


Outbound = bytes | str | Head


@dataclass(frozen=True, slots=True)
class Disconnected:
    """The client went away (`code`: its close code), or the transport refused its input and closed
    (a WebSocket message over uvicorn's limit: 1009; invalid UTF-8: 1007)."""

    code: int


@dataclass(frozen=True, slots=True)
class InputRefused:
    """The transport refused what the client sent, and the client is still there for the answer (an HTTP body
    over the limit): the session ends with `outcome` (TOO_LARGE: a 413 on HTTP)."""

    outcome: Outcome
    reason: str


@dataclass(frozen=True, slots=True)
class InputEnded:
    """The client sent its last message and still takes the answer (a gRPC call's half-close)."""


class TransportClosed(Exception):
    """A send or close on a connection that is gone."""


class Transport(Protocol):
    @property
    def client(self) -> str: ...  # "host:port"
    @property
    def principal(self) -> Principal | None: ...  # the API key the request came with (None: auth off)
    @property
    def query(self) -> Mapping[str, str]: ...
    @property
    def path_params(self) -> Mapping[str, str]: ...
    @property
    def headers(self) -> Mapping[str, str]: ...  # the request's (names case-insensitive)
    async def accept(self) -> None: ...
    async def receive(self) -> str | bytes | Disconnected | InputEnded | InputRefused: ...
    async def send(self, data: Outbound) -> None: ...
    async def close(self, outcome: Outcome, reason: str) -> None: ...
    def abort(self) -> None: ...
    def unsent_bytes(self) -> int | None: ...  # None: the transport cannot tell


def outbound_bytes(data: Outbound) -> int:
    """Bytes a message puts on the wire, less framing (a str is counted as UTF-8)."""
    if isinstance(data, bytes):
        return len(data)
    if isinstance(data, str):
        return len(data.encode())
    return 0


class _AsgiConnection:
    """What both transports read from the ASGI scope."""

    def __init__(self, scope: Scope, receive: Receive, send: Send) -> None:
        self._scope = scope
        self._receive = receive
        self._send = send
        client = scope.get("client")
        self.client = f"{client[0]}:{client[1]}" if client else ""
        self.principal = principal_of(scope)
        self.query: Mapping[str, str] = QueryParams(scope.get("query_string", b""))
        self.path_params: Mapping[str, str] = scope.get("path_params") or {}
        self.headers: Mapping[str, str] = Headers(scope=scope)
        self._abort: Callable[[], None] | None = scope.get(TRANSPORT_ABORT_KEY)
        self._close_connection: Callable[[], None] | None = scope.get(TRANSPORT_CLOSE_KEY)
        self._unsent: Callable[[], int] | None = scope.get(TRANSPORT_UNSENT_KEY)

    def abort(self) -> None:
        if self._abort is not None:
            self._abort()

    def unsent_bytes(self) -> int | None:
        return None if self._unsent is None else self._unsent()

    async def _send_or_closed(self, message: Message) -> None:
        try:
            await self._send(message)
        except (OSError, RuntimeError) as exc:  # ClientDisconnected is an OSError; a send after close a RuntimeError
            raise TransportClosed(str(exc)) from exc


class WebSocketTransport(_AsgiConnection):
    async def accept(self) -> None:
        message = await self._receive()
        if message["type"] != "websocket.connect":
            raise TransportClosed(f"expected websocket.connect, got {message['type']}")
        await self._send_or_closed({"type": "websocket.accept"})

    async def receive(self) -> str | bytes | Disconnected:
        message = await self._receive()
        if message["type"] == "websocket.disconnect":
            return Disconnected(int(message.get("code") or 1005))
        text = message.get("text")
        if text is not None:
            return str(text)
        return bytes(message.get("bytes") or b"")

    async def send(self, data: Outbound) -> None:
        if isinstance(data, bytes):
            await self._send_or_closed({"type": "websocket.send", "bytes": data})
        elif isinstance(data, str):
            await self._send_or_closed({"type": "websocket.send", "text": data})
        else:
            raise TypeError("an HTTP response head on a WebSocket")

    async def close(self, outcome: Outcome, reason: str) -> None:
        await self._send_or_closed({"type": "websocket.close", "code": outcome.close_code, "reason": reason[:120]})


class HttpTransport(_AsgiConnection):
    def __init__(self, scope: Scope, receive: Receive, send: Send, *, max_body_bytes: int) -> None:
        super().__init__(scope, receive, send)
        self.max_body_bytes = max_body_bytes
        self.started = False  # the response head went out
        self.answering = False  # ... and it was a success (2xx): the body is the answer, streamed as it comes
        self.finished = False  # the response body ended
        self._body_read = False

    async def accept(self) -> None:
        pass

    async def receive(self) -> str | bytes | Disconnected | InputRefused:
        if self._body_read:
            while True:  # the request was its one message: now only the client leaving is news
                message = await self._receive()
                if message["type"] == "http.disconnect":
                    return Disconnected(HTTP_CLIENT_GONE)
        self._body_read = True
        chunks: list[bytes] = []
        size = 0
        while True:
            message = await self._receive()
            if message["type"] == "http.disconnect":
                return Disconnected(HTTP_CLIENT_GONE)
            chunk = message.get("body", b"")
            size += len(chunk)
            if size > self.max_body_bytes:
                return InputRefused(Outcome.TOO_LARGE, f"the request body is over {self.max_body_bytes} bytes")
            chunks.append(chunk)
            if not message.get("more_body", False):
                return b"".join(chunks)

    async def send(self, data: Outbound) -> None:
        if isinstance(data, Head):
            if self.started:
                raise RuntimeError("the response has already started")
            headers = [(b"content-type", data.media_type.encode("latin-1"))]
            headers += [(k.lower().encode("latin-1"), v.encode("latin-1")) for k, v in data.headers]
            self.started = True
            self.answering = 200 <= data.status < 300
            await self._send_or_closed({"type": "http.response.start", "status": data.status, "headers": headers})
            return
        if not self.started:
            raise RuntimeError("a response body before its head")
        body = data if isinstance(data, bytes) else data.encode()
        await self._send_or_closed({"type": "http.response.body", "body": body, "more_body": True})

    async def close(self, outcome: Outcome, reason: str) -> None:
        """End the response. An answer (a 2xx response, its body streamed) that ends other than normally (a
        failure, a shutdown, a slow client cut) is cut: the connection closes without the body's end (no last
        chunk), so the client sees an incomplete response instead of a short audio file that looks whole. An
        error response was whole when it was sent, and ends as usual."""
        if self.finished:
            return
        self.finished = True
        if not self.started:
            status = outcome.http_status or http_status(Outcome.INTERNAL_ERROR)  # (none of its own: nobody reads it)
            body = orjson.dumps({"error": {"message": reason or HTTPStatus(status).phrase, "code": status}})
            await self.send(Head(status, "application/json"))
            await self._send_or_closed({"type": "http.response.body", "body": body, "more_body": True})
        elif self.answering and outcome is not Outcome.COMPLETED and self._close_connection is not None:
            self._close_connection()  # what was sent still goes out, then FIN
            await self._wait_disconnect()
            return
        await self._send_or_closed({"type": "http.response.body", "body": b"", "more_body": False})

    async def _wait_disconnect(self) -> None:
        """Until the server has seen the connection go (so it does not report the response as unfinished)."""
        try:
            async with asyncio.timeout(HTTP_TRUNCATED_WAIT_S):
                while (await self._receive())["type"] != "http.disconnect":
                    pass
        except TimeoutError:
            pass


def _unsent_probe(transport: Any) -> Callable[[], int] | None:
    """Bytes written to `transport` that have not left the machine acknowledged: its own buffer plus the
    kernel's send queue (Linux SIOCOUTQ: unsent and unacknowledged bytes). None where unsupported."""
    sock = transport.get_extra_info("socket")
    outq = getattr(termios, "TIOCOUTQ", None)  # == SIOCOUTQ on Linux
    if sock is None or outq is None or not sys.platform.startswith("linux"):
        return None
    fd = sock.fileno()

    def probe() -> int:
        if transport.is_closing():  # the descriptor may already belong to another connection
            return 0
        try:
            (queued,) = OUTQ_FORMAT.unpack(fcntl.ioctl(fd, outq, b"\0" * OUTQ_FORMAT.size))
        except OSError:
            return 0
        return int(transport.get_write_buffer_size()) + int(queued)

    return probe


class SocketControlMiddleware:
    """Bounds each connection's kernel send buffer and exposes `transport.abort` (TRANSPORT_ABORT_KEY),
    `transport.close` (TRANSPORT_CLOSE_KEY: a cut HTTP response) and a probe of the bytes not yet drained by the
    client (TRANSPORT_UNSENT_KEY) in the scope.

    All three serve flow control. Linux lets a socket's send buffer grow to megabytes (tcp_wmem), which
    hides a client that stopped reading for a minute of audio; a fixed SO_SNDBUF keeps the backlog in
    our bounded outbox. A client that does not read can never take a close frame: ASGI has no way to drop
    a connection, so this reaches the server's transport through the raw `send` (uvicorn's is a bound
    method of its protocol object). Best effort: under another server they are skipped. Must be the
    outermost ASGI layer (`agent_server.app.App` puts it there): Starlette's own ServerErrorMiddleware, outside
    every `Middleware` entry, wraps an HTTP request's `send`, and beneath it none of this is reachable.
    """

    def __init__(self, app: ASGIApp, send_buffer_bytes: int = 0) -> None:
        self.app = app
        self.send_buffer_bytes = send_buffer_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] in ("websocket", "http"):
            transport = getattr(getattr(send, "__self__", None), "transport", None)
            if transport is not None and hasattr(transport, "abort"):
                scope[TRANSPORT_ABORT_KEY] = transport.abort
                scope[TRANSPORT_CLOSE_KEY] = transport.close
                scope[TRANSPORT_UNSENT_KEY] = _unsent_probe(transport)
                sock = transport.get_extra_info("socket")
                if sock is not None and self.send_buffer_bytes > 0:
                    try:
                        sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, self.send_buffer_bytes)
                    except OSError:
                        pass
        await self.app(scope, receive, send)
