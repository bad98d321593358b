"""gRPC under the session core: a grpc.aio server on `Settings.grpc_port`, started and stopped in the app's
lifespan, whose calls are sessions like any WebSocket or HTTP request (agent_server/core/session.py).

- `GrpcTransport`: one call as a session transport. Messages are serialized protobuf bytes both ways (the
  method handlers are registered without (de)serializers, so the core moves bytes and the protocol owns the
  message types); each request is one `receive()`, the end of the client's requests is `InputEnded`, the
  call ending (finished, cancelled, the client gone) is `Disconnected`. A streamed response writes each
  `send()` at once (`context.write`: it waits while HTTP/2 flow control holds the client's window shut,
  which the slow-client watchdog reads as a blocked send); a unary response keeps its one message until the
  call ends. `close(outcome, reason)` ends the call with the outcome's gRPC status (core/outcomes.py).
- `run_call(...)`: what every handler runs: the credentials of the call's metadata through the server's
  Auth (UNAUTHENTICATED / PERMISSION_DENIED before any session), then one session of the protocol, which
  keeps running to its teardown when grpc.aio cancels the handler (the client went away).
- `GrpcCalls`: what a gRPC service (protocols/riva_service.py) is given: `run` and `authorize` for its calls,
  and the port (core/port.py) for what else it answers; never the hub.
- `GrpcServer`: the server, with TLS from the same certificate as the HTTP port when one is set.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import grpc
import structlog

from agent_server.core.outcomes import Outcome
from agent_server.core.session import WireProtocol, serve
from agent_server.core.transport import (
    HTTP_CLIENT_GONE,
    Disconnected,
    Head,
    InputEnded,
    Outbound,
    TransportClosed,
)
from agent_server.fleet.auth import Denied, Principal

if TYPE_CHECKING:
    from agent_server.core.hub import Hub
    from agent_server.core.port import Port
    from agent_server.settings import Settings

log = structlog.get_logger("agent_server.grpc")

Context = grpc.aio.ServicerContext[bytes, bytes]
DENIED_STATUS: Mapping[int, grpc.StatusCode] = {
    401: grpc.StatusCode.UNAUTHENTICATED,
    403: grpc.StatusCode.PERMISSION_DENIED,
}
MISSING_CREDENTIALS = "an API key or token is required (metadata authorization: Bearer <key>, or x-api-key)"
STOP_GRACE_S = 1.0  # after the hub's drain: calls still open get this long before they are cut


@dataclass(frozen=True, slots=True)
class CallEnd:
    """How a call ended: its status and details (OK: the response, for a unary call)."""

    status: grpc.StatusCode
    details: str
    response: bytes | None


class GrpcTransport:
    def __init__(self, context: Context, requests: AsyncIterator[bytes], principal: Principal | None,
                 *, unary: bool) -> None:
        self._context = context
        self._requests = requests
        self.principal = principal
        self.unary = unary
        self.client = context.peer()
        self.query: Mapping[str, str] = {}
        self.path_params: Mapping[str, str] = {}
        self.headers: Mapping[str, str] = {k: v for k, v in context.invocation_metadata() or () if isinstance(v, str)}
        self._input_ended = False
        self._gone = asyncio.Event()  # the call is over (cancelled, or the client went away)
        self._response: bytes | None = None
        self.end: CallEnd | None = None  # set by close()

    def call_done(self, ctx: Context) -> None:
        """grpc.aio ended the call (or cancelled the handler): the client is gone."""
        self._gone.set()

    async def accept(self) -> None:
        pass

    async def receive(self) -> str | bytes | Disconnected | InputEnded:
        if not self._input_ended:
            message = await self._next_request()
            if message is not None:
                return message
            self._input_ended = True
            return InputEnded()
        await self._gone.wait()
        return Disconnected(HTTP_CLIENT_GONE)

    async def _next_request(self) -> bytes | None:
        """The next request, or None at the end of the client's requests (or when the call is over)."""
        next_request = asyncio.ensure_future(anext(self._requests, None))
        gone = asyncio.ensure_future(self._gone.wait())
        try:
            await asyncio.wait([next_request, gone], return_when=asyncio.FIRST_COMPLETED)
        finally:
            gone.cancel()
        if not next_request.done():
            next_request.cancel()
            return None
        try:
            return next_request.result()
        except (grpc.RpcError, asyncio.CancelledError):  # the client cancelled while we read
            return None

    async def send(self, data: Outbound) -> None:
        if self._gone.is_set() or self.end is not None:
            raise TransportClosed("the call is over")
        if isinstance(data, Head):  # the call's initial metadata (its headers), before any message
            try:
                await self._context.send_initial_metadata(data.headers)
            except (grpc.RpcError, asyncio.InvalidStateError, RuntimeError) as exc:
                raise TransportClosed(str(exc)) from exc
            return
        if not isinstance(data, bytes):
            raise TypeError("a gRPC message is bytes (a serialized protobuf message)")
        if self.unary:
            if self._response is not None:
                raise RuntimeError("a unary call has one response")
            self._response = data
            return
        try:
            await self._context.write(data)
        except (grpc.RpcError, asyncio.InvalidStateError, RuntimeError) as exc:
            raise TransportClosed(str(exc)) from exc

    async def close(self, outcome: Outcome, reason: str) -> None:
        if self.end is None:
            status = grpc.StatusCode[outcome.answer.grpc_status]
            self.end = CallEnd(status, "" if status == grpc.StatusCode.OK else reason, self._response)

    def abort(self) -> None:
        if self.end is None:
            self.end = CallEnd(grpc.StatusCode.ABORTED, "dropped: the client took no data", None)

    def unsent_bytes(self) -> int | None:
        return None  # grpc.aio does not tell: a blocked write is the watchdog's measure


async def authorize(hub: Hub, context: Context) -> Principal | None:
    """The principal of a call's credentials (`authorization: Bearer <key>` metadata, as nvidia-riva-client
    and Pipecat send; `x-api-key` too). Aborts the call (UNAUTHENTICATED) when auth refuses them."""
    metadata = [(k.encode("latin-1"), v.encode("latin-1")) for k, v in context.invocation_metadata() or ()
                if isinstance(v, str)]
    scope: dict[str, Any] = {"type": "grpc", "headers": metadata, "query_string": b""}
    try:
        principal = hub.auth.check(scope)
    except Denied as denied:
        log.info("auth_denied", code=denied.code, status=denied.status_code, client=context.peer(), grpc=True)
        message = MISSING_CREDENTIALS if denied.code == "missing_credentials" else denied.message
        await context.abort(DENIED_STATUS.get(denied.status_code, grpc.StatusCode.UNAUTHENTICATED), message)
    return principal


async def run_call(hub: Hub, context: Context, requests: AsyncIterator[bytes], protocol: type[WireProtocol[Any]],
                   *, unary: bool) -> bytes | None:
    """One call as one session of `protocol`; returns a unary call's response (aborts with the status of
    the session's close otherwise)."""
    principal = await authorize(hub, context)
    transport = GrpcTransport(context, requests, principal, unary=unary)
    context.add_done_callback(transport.call_done)  # type: ignore[arg-type]  # the stub types a plain class
    session = asyncio.ensure_future(serve(hub, transport, protocol))
    _running.add(session)
    session.add_done_callback(_running.discard)
    try:
        await asyncio.shield(session)
    except asyncio.CancelledError:  # the client went away: the session sees it and tears down on its own
        transport.call_done(context)
        raise
    end = transport.end or CallEnd(grpc.StatusCode.INTERNAL, "internal error", None)
    if end.status != grpc.StatusCode.OK:
        await context.abort(end.status, end.details)
    return end.response


async def one(request: bytes) -> AsyncIterator[bytes]:
    """A unary call's request as a stream of one."""
    yield request


_running: set[asyncio.Future[None]] = set()  # sessions of calls whose handler was cancelled, until they end


class GrpcCalls:
    """The calls of one app's services: each runs as one session of a protocol on the app's hub."""

    def __init__(self, hub: Hub) -> None:
        self._hub = hub
        self.port: Port = hub.port

    async def run(self, context: Context, requests: AsyncIterator[bytes], protocol: type[WireProtocol[Any]],
                  *, unary: bool) -> bytes | None:
        return await run_call(self._hub, context, requests, protocol, unary=unary)

    async def authorize(self, context: Context) -> Principal | None:
        return await authorize(self._hub, context)


class GrpcServer:
    """The grpc.aio server of the app (one per process), holding the services `register` adds."""

    def __init__(self, settings: Settings, register: Callable[[grpc.aio.Server], None]) -> None:
        self.settings = settings
        self._server = grpc.aio.server(options=[
            ("grpc.max_receive_message_length", settings.max_message_bytes),
        ])
        register(self._server)
        address = f"{settings.host}:{settings.grpc_port}"
        if settings.tls_certfile and settings.tls_keyfile:
            key, cert = Path(settings.tls_keyfile).read_bytes(), Path(settings.tls_certfile).read_bytes()
            self.port = self._server.add_secure_port(address, grpc.ssl_server_credentials([(key, cert)]))
        else:
            self.port = self._server.add_insecure_port(address)

    async def start(self) -> None:
        await self._server.start()
        log.info("grpc_serving", host=self.settings.host, port=self.port, tls=bool(self.settings.tls_certfile))

    async def stop(self) -> None:
        """After the hub's drain (the sessions of calls ended there): stop taking calls."""
        await self._server.stop(STOP_GRACE_S)
