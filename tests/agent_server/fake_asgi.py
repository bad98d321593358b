"""In-process clients of the app, with no socket: the fake transport layer under the session core.

`FakeWebSocket` and `FakeHttpRequest` call the Starlette app (routes, auth middleware, the real
`WebSocketTransport` / `HttpTransport`) with ASGI channels the test drives, as uvicorn would: the test
sends client messages, reads what the server sent, disconnects, and decides whether the client drains
what it is sent (`stop_reading`: from then on every byte written stays in the "kernel's" send queue that
the slow-client watchdog reads), so flow control is tested without timing a real socket.

    async with running(app) as hub:
        ws = FakeWebSocket(app, "/v1/stream")
        await ws.connect()
        ws.send_text('{"type": "open", ...}')
        event = await ws.next_json()
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from typing import Any

import orjson
from starlette.applications import Starlette
from starlette.types import Message, Scope

from agent_server.core.hub import Hub
from agent_server.core.transport import TRANSPORT_ABORT_KEY, TRANSPORT_UNSENT_KEY

READY_TIMEOUT_S = 10.0
RECV_TIMEOUT_S = 10.0


@contextlib.asynccontextmanager
async def running(app: Starlette) -> AsyncIterator[Hub]:
    """The app's lifespan (engine loaded, ticker and metrics running), as a server would run it."""
    hub: Hub = app.state.hub
    async with app.router.lifespan_context(app):
        async with asyncio.timeout(READY_TIMEOUT_S):
            while not hub.ready:
                await asyncio.sleep(0.005)
        yield hub


def _headers(headers: dict[str, str] | None) -> list[tuple[bytes, bytes]]:
    return [(k.lower().encode("latin-1"), v.encode("latin-1")) for k, v in (headers or {}).items()]


class _FakeClient:
    """What both fakes share: the scope, the task running the app, and the network's drain."""

    def __init__(self, app: Starlette, kind: str, path: str, query: str, headers: dict[str, str] | None) -> None:
        self.app = app
        self.reading = True  # False: the client stopped taking what it is sent
        self.bytes_written = 0  # payload bytes the server handed to the "network"
        self._bytes_drained = 0
        self.aborted = asyncio.Event()
        self.scope: Scope = {
            "type": kind,
            "asgi": {"version": "3.0"},
            "http_version": "1.1",
            "scheme": "ws" if kind == "websocket" else "http",
            "path": path,
            "raw_path": path.encode(),
            "root_path": "",
            "query_string": query.encode(),
            "headers": _headers(headers),
            "client": ("127.0.0.1", 40000),
            "server": ("127.0.0.1", 8000),
            TRANSPORT_ABORT_KEY: self._abort,
            TRANSPORT_UNSENT_KEY: self.unsent_bytes,
        }
        self.task: asyncio.Task[None] | None = None

    def unsent_bytes(self) -> int:
        """What the "kernel" still holds for the client."""
        if self.reading:
            self._bytes_drained = self.bytes_written
        return self.bytes_written - self._bytes_drained

    def stop_reading(self) -> None:
        self.unsent_bytes()
        self.reading = False

    def start(self) -> None:
        self.task = asyncio.create_task(self.app(self.scope, self._receive, self._send))

    async def finished(self, timeout_s: float = RECV_TIMEOUT_S) -> None:
        """The app returned (the session is over, its hub.remove done)."""
        if self.task is not None:
            await asyncio.wait_for(asyncio.shield(self.task), timeout_s)

    def _abort(self) -> None:
        self.aborted.set()

    async def _receive(self) -> Message:
        raise NotImplementedError

    async def _send(self, message: Message) -> None:
        raise NotImplementedError


class FakeWebSocket(_FakeClient):
    def __init__(self, app: Starlette, path: str, query: str = "", headers: dict[str, str] | None = None) -> None:
        super().__init__(app, "websocket", path, query, headers)
        self.scope["subprotocols"] = []
        self.scope["extensions"] = {"websocket.http.response": {}}
        self._to_server: asyncio.Queue[Message] = asyncio.Queue()
        self._to_server.put_nowait({"type": "websocket.connect"})
        self.received: asyncio.Queue[str | bytes] = asyncio.Queue()
        self.log: list[str | bytes] = []  # every message the server sent, in order
        self.accepted = False
        self.denied_status: int | None = None  # an HTTP answer to the handshake (auth)
        self.close_code: int | None = None  # the server's close frame
        self.close_reason = ""
        self.closed = asyncio.Event()  # the server closed (or aborted) the connection
        self.writable = asyncio.Event()  # cleared: the server's sends block (a client that stopped reading)
        self.writable.set()
        self.gone = False

    async def connect(self) -> None:
        self.start()

    def send_text(self, text: str) -> None:
        self._to_server.put_nowait({"type": "websocket.receive", "text": text})

    def send_json(self, obj: object) -> None:
        self.send_text(orjson.dumps(obj).decode())

    def send_bytes(self, data: bytes) -> None:
        self._to_server.put_nowait({"type": "websocket.receive", "bytes": data})

    def disconnect(self, code: int = 1000) -> None:
        """The client goes away (its close frame, or 1006 for a dropped connection)."""
        self.gone = True
        self._to_server.put_nowait({"type": "websocket.disconnect", "code": code})

    async def next(self, timeout_s: float = RECV_TIMEOUT_S) -> str | bytes:
        return await asyncio.wait_for(self.received.get(), timeout_s)

    async def next_json(self, timeout_s: float = RECV_TIMEOUT_S) -> Any:
        while True:
            message = await self.next(timeout_s)
            if isinstance(message, str):
                return orjson.loads(message)

    async def wait_closed(self, timeout_s: float = RECV_TIMEOUT_S) -> int | None:
        await asyncio.wait_for(self.closed.wait(), timeout_s)
        return self.close_code

    def json_messages(self) -> list[Any]:
        return [orjson.loads(m) for m in self.log if isinstance(m, str)]

    def _abort(self) -> None:
        super()._abort()
        self.closed.set()
        self.disconnect(1006)

    async def _receive(self) -> Message:
        return await self._to_server.get()

    async def _send(self, message: Message) -> None:
        kind = message["type"]
        if self.gone and kind != "websocket.http.response.body":
            raise OSError("the client is gone")  # uvicorn raises ClientDisconnected, an OSError
        if kind == "websocket.accept":
            self.accepted = True
        elif kind == "websocket.send":
            await self.writable.wait()
            data = message.get("text")
            item: str | bytes = data if data is not None else message["bytes"]
            self.bytes_written += len(item.encode() if isinstance(item, str) else item)
            self.log.append(item)
            self.received.put_nowait(item)
        elif kind == "websocket.close":
            self.close_code = message.get("code", 1000)
            self.close_reason = message.get("reason", "")
            self.closed.set()
            self._to_server.put_nowait({"type": "websocket.disconnect", "code": self.close_code})
        elif kind == "websocket.http.response.start":
            self.denied_status = message["status"]
            self.closed.set()


class FakeHttpRequest(_FakeClient):
    def __init__(self, app: Starlette, path: str, body: bytes | object, headers: dict[str, str] | None = None,
                 method: str = "POST", query: str = "") -> None:
        super().__init__(app, "http", path, query, {"content-type": "application/json", **(headers or {})})
        self.scope["method"] = method
        self.body = body if isinstance(body, bytes) else orjson.dumps(body)
        self.status: int | None = None
        self.headers: dict[str, str] = {}
        self.chunks: list[bytes] = []
        self.started = asyncio.Event()  # the status line is out
        self.complete = asyncio.Event()  # the body ended (or the connection was aborted)
        self.first_chunk = asyncio.Event()
        self.writable = asyncio.Event()
        self.writable.set()
        self._body_sent = False
        self._gone = asyncio.Event()

    @property
    def content(self) -> bytes:
        return b"".join(self.chunks)

    def json(self) -> Any:
        return orjson.loads(self.content)

    def leave(self) -> None:
        """The client closes the connection (a barge-in)."""
        self._gone.set()

    async def done(self, timeout_s: float = RECV_TIMEOUT_S) -> None:
        await asyncio.wait_for(self.complete.wait(), timeout_s)

    def _abort(self) -> None:
        super()._abort()
        self.complete.set()
        self._gone.set()

    async def _receive(self) -> Message:
        if not self._body_sent:
            self._body_sent = True
            return {"type": "http.request", "body": self.body, "more_body": False}
        if not self.complete.is_set():
            waiters = [asyncio.ensure_future(self._gone.wait()), asyncio.ensure_future(self.complete.wait())]
            await asyncio.wait(waiters, return_when=asyncio.FIRST_COMPLETED)
            for waiter in waiters:
                waiter.cancel()
        return {"type": "http.disconnect"}

    async def _send(self, message: Message) -> None:
        if self._gone.is_set():
            return  # uvicorn drops what is sent after the client left
        kind = message["type"]
        if kind == "http.response.start":
            self.status = message["status"]
            self.headers = {k.decode("latin-1"): v.decode("latin-1") for k, v in message.get("headers", [])}
            self.started.set()
        elif kind == "http.response.body":
            await self.writable.wait()
            body = message.get("body", b"")
            self.bytes_written += len(body)
            if body:
                self.chunks.append(body)
                self.first_chunk.set()
            if not message.get("more_body", False):
                self.complete.set()
