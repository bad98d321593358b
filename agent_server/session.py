"""WebSocket sessions: `Connection` (protocol-neutral, one per socket) and `NativeSession` (docs/protocol.md).

A Connection owns the socket and everything that must be the same for every wire protocol:
- a reader task (socket -> `handle_message`) and a writer task draining one bounded outbox (-> socket);
- its contexts (`Context`: a `SpeechStream` from `hub.open_stream` and the per-socket stream number);
- flow control: an outbox that overflows, or a send blocked for `slow_client_stall_s`, drops the client
  (close 1008, log line `dropped_slow_client`) without touching any other session;
- cancel: queued output of a cancelled stream is skipped by the writer, so nothing of it follows the ack;
- shutdown drain (close 1001), busy refusal at admission (close 1013), teardown that cancels the engine work.

A protocol subclass implements three things: `on_open()` (greeting), `handle_message(raw, now_s)` (parse and
call `open_context` / `ctx.stream.push_text` / `.flush` / `.end` / `.cancel`) and `render(ctx, event)` (turn
each `speech.StreamEvent` into wire messages with `send_message` / `send_audio`).
"""

from __future__ import annotations

import asyncio
import enum
import itertools
import socket
import time
from dataclasses import dataclass, field
from functools import partial
from typing import Any, Callable, ClassVar

import structlog
from starlette.types import ASGIApp, Receive, Scope, Send
from starlette.websockets import WebSocket, WebSocketDisconnect

from agent_server import protocol as wire
from agent_server.auth import principal_of
from agent_server.hub import Hub, OpenRefused
from agent_server.observers import (
    BusyRejected,
    ContextFinished,
    FirstAudio,
    SessionClosed,
    SessionOpened,
    SlowClientDropped,
)
from agent_server.speech import (
    AudioOut,
    DoneReason,
    SegmentDone,
    SegmentStarted,
    SpecError,
    SpeechStream,
    StreamDone,
    StreamEvent,
    StreamSpec,
    StreamStarted,
    StreamStateError,
    StreamStatus,
    build_params,
)

log = structlog.get_logger("agent_server.session")

CLOSE_NORMAL = 1000
CLOSE_GOING_AWAY = 1001  # server shutting down
CLOSE_POLICY = 1008  # slow client, too many protocol errors
CLOSE_INTERNAL_ERROR = 1011
CLOSE_TRY_AGAIN_LATER = 1013  # busy: max sessions, model loading
TRANSPORT_ABORT_KEY = "agent_server.transport_abort"
# Sends that find the socket writable complete without yielding to the loop; after this many in a row
# the writer lets other tasks run, so one session's burst (a 4 s chunk is 200 frames) cannot hold up
# another session's first frame.
WRITER_BURST_ITEMS = 8


class ConnectionState(enum.IntEnum):
    OPEN = 0
    DRAINING = 1  # the server is shutting down: no new contexts; close 1001 after the last one ends
    CLOSING = 2  # no more output is queued
    CLOSED = 3


@dataclass(slots=True, eq=False)
class Context:
    """One open context of a connection."""

    context_id: str  # the protocol's name for it
    number: int  # 1, 2, 3 ... per connection (the native protocol's stream id)
    stream: SpeechStream = field(init=False)
    log: Any = None


@dataclass(slots=True)
class Outgoing:
    ctx: Context | None  # output of a stream that gets cancelled before this goes out is skipped
    data: bytes | str | Callable[[], bytes | str]  # a callable is rendered when it is sent
    audio: bool = False


_CLOSE = Outgoing(None, b"")  # the writer's sentinel: send the close frame and stop


class Connection:
    protocol_name: ClassVar[str] = "base"

    def __init__(self, hub: Hub, websocket: WebSocket) -> None:
        self.hub = hub
        self.settings = hub.settings
        self.websocket = websocket
        self.session_id = hub.new_session_id()
        self.principal = principal_of(websocket.scope)  # the API key it came with (None: auth off)
        self.state = ConnectionState.OPEN
        self.contexts: dict[str, Context] = {}
        self.log = log.bind(session_id=self.session_id, protocol=self.protocol_name)
        self._outbox: asyncio.Queue[Outgoing] = asyncio.Queue(maxsize=self.settings.outbox_max_items)
        self._numbers = itertools.count(1)
        self._sending_since_s: float | None = None  # set while one send is in progress
        self._close_code = CLOSE_NORMAL
        self._close_reason = ""
        self._close_queued = False
        self._close_sent = False
        self._client_gone = False
        self._aborted = False
        self._tasks: list[asyncio.Task[None]] = []
        self._opened_s = time.monotonic()

    # ---- to implement per protocol -----------------------------------------------------------------

    def on_open(self) -> None:
        """Queue the protocol's greeting, if any."""

    async def handle_message(self, raw: str | bytes, now_s: float) -> None:
        raise NotImplementedError

    def render(self, ctx: Context, event: StreamEvent) -> None:
        raise NotImplementedError

    def render_refusal(self, reason: str) -> str | None:
        """The message sent before closing with 1013 when the session is refused."""
        return None

    # ---- for protocol subclasses -----------------------------------------------------------------

    def send_message(self, data: bytes | str | Callable[[], bytes | str], ctx: Context | None = None) -> None:
        self._put(Outgoing(ctx, data))

    def send_audio(self, ctx: Context, data: bytes | str) -> None:
        self._put(Outgoing(ctx, data, audio=True))

    def open_context(self, context_id: str, spec: StreamSpec) -> Context:
        """Open a stream for a new context (it emits StreamStarted). Raises OpenRefused (busy or a field error)."""
        if self.state != ConnectionState.OPEN:
            raise OpenRefused(True, "", "the server is shutting down", "shutting_down")
        if context_id in self.contexts:
            raise OpenRefused(False, "context_id", f"context {context_id!r} is already open", "context_exists")
        if len(self.contexts) >= self.settings.max_contexts_per_session:
            raise OpenRefused(
                True,
                "context_id",
                f"too many open contexts on this socket (at most {self.settings.max_contexts_per_session})",
                "too_many_contexts",
            )
        number = next(self._numbers)
        ctx = Context(context_id, number, log=self.log.bind(context_id=context_id))
        ctx.stream = self.hub.open_stream(f"{self.session_id}/{number}", spec, partial(self._on_stream_event, ctx))
        self.contexts[context_id] = ctx
        ctx.stream.open()
        return ctx

    async def charge_text(self, chars: int) -> str | None:
        """Count text against the API key's per-minute budget; a refusal reason when it is spent."""
        return await self.hub.auth.charge_text(self.principal, chars)

    def request_close(self, code: int, reason: str) -> None:
        """Close after the output already queued has gone out."""
        if self._close_queued or self.state >= ConnectionState.CLOSING:
            return
        self._close_code, self._close_reason = code, reason
        self._close_queued = True
        self._put(_CLOSE)
        self.state = ConnectionState.CLOSING

    # ---- the hub's handles -----------------------------------------------------------------------

    @property
    def live_streams(self) -> int:
        return len(self.contexts)

    def tick(self, now_s: float) -> None:
        since_s = self._sending_since_s
        if since_s is not None and now_s - since_s > self.settings.slow_client_stall_s:
            self._drop_slow_client(f"a send has been blocked for {now_s - since_s:.1f} s")
            return
        for ctx in list(self.contexts.values()):
            if ctx.stream.has_unsegmented_text:
                ctx.stream.poll(now_s)

    def begin_drain(self) -> None:
        if self.state == ConnectionState.OPEN:
            self.state = ConnectionState.DRAINING
            if not self.contexts:
                self.request_close(CLOSE_GOING_AWAY, "server shutting down")

    def close_now(self, code: int, reason: str) -> None:
        for ctx in list(self.contexts.values()):
            ctx.stream.cancel(DoneReason.SHUTDOWN, reason)
        self.request_close(code, reason)

    def fail_streams(self, detail: str) -> None:
        for ctx in list(self.contexts.values()):
            ctx.stream.cancel(DoneReason.FAILED, detail)

    # ---- the socket ------------------------------------------------------------------------------

    async def serve(self) -> None:
        await self.websocket.accept()
        refusal = await self.hub.admit(self)
        if refusal is not None:
            await self._refuse(refusal)
            return
        self.log.info("session_opened", client=_client_of(self.websocket))
        self.hub.observers.emit(SessionOpened(self.protocol_name, self.session_id))
        self.on_open()
        reader = asyncio.create_task(self._read_loop(), name=f"read-{self.session_id}")
        writer = asyncio.create_task(self._write_loop(), name=f"write-{self.session_id}")
        self._tasks = [reader, writer]
        try:
            await asyncio.wait(self._tasks, return_when=asyncio.FIRST_COMPLETED)
        finally:
            await self._teardown(reader, writer)

    async def _refuse(self, reason: str) -> None:
        self.log.info("session_refused", reason=reason)
        self.hub.observers.emit(BusyRejected(self.protocol_name, "session", reason))
        message = self.render_refusal(reason)
        try:
            if message is not None:
                await self.websocket.send_text(message)
            await self.websocket.close(CLOSE_TRY_AGAIN_LATER, reason[:120])
        except (WebSocketDisconnect, RuntimeError):
            pass

    async def _read_loop(self) -> None:
        receive = self.websocket.receive
        while self.state < ConnectionState.CLOSING:
            message = await receive()
            if message["type"] == "websocket.disconnect":
                self._client_gone = True
                if not self._close_queued:  # (uvicorn also reports our own close this way)
                    self._close_code = int(message.get("code") or CLOSE_NORMAL)
                    self._close_reason = "client closed"
                return
            text = message.get("text")
            try:
                await self.handle_message(text if text is not None else message.get("bytes") or b"", time.monotonic())
            except Exception:
                self.log.exception("message_handling_failed")
                self.request_close(CLOSE_INTERNAL_ERROR, "internal error")

    async def _write_loop(self) -> None:
        send = self.websocket.send
        get = self._outbox.get
        burst = 0
        try:
            while True:
                burst += 1
                if burst >= WRITER_BURST_ITEMS:  # a send that finds room never yields: take turns
                    burst = 0
                    await asyncio.sleep(0)
                item = await get()
                if item is _CLOSE:
                    self._close_sent = True
                    await send({"type": "websocket.close", "code": self._close_code, "reason": self._close_reason})
                    return
                ctx = item.ctx
                if ctx is not None and ctx.stream.status == StreamStatus.CANCELLED:
                    continue  # cancelled: nothing of it goes out any more
                data = item.data
                if callable(data):
                    data = data()
                self._sending_since_s = time.monotonic()
                if isinstance(data, bytes):
                    await send({"type": "websocket.send", "bytes": data})
                else:
                    await send({"type": "websocket.send", "text": data})
                now_s = time.monotonic()
                self._sending_since_s = None
                if item.audio:
                    assert ctx is not None
                    ctx.stream.on_frame_sent(now_s)
                    if ctx.stream.frames_sent == 1:
                        self._on_first_audio(ctx)
        except (WebSocketDisconnect, OSError):
            self._client_gone = True
        except RuntimeError as exc:  # a send after the socket closed (the client's close came first)
            self._client_gone = True
            self.log.info("send_after_close", error=str(exc))

    async def _teardown(self, reader: asyncio.Task[None], writer: asyncio.Task[None]) -> None:
        if self.state < ConnectionState.CLOSING:
            self.state = ConnectionState.CLOSING
        for ctx in list(self.contexts.values()):
            ctx.stream.cancel(DoneReason.SHUTDOWN, "session closed")
        reader.cancel()
        if self._close_queued and not self._aborted and not self._client_gone and not writer.done():
            await asyncio.wait([writer], timeout=self.settings.slow_client_stall_s + self.settings.close_timeout_s)
        writer.cancel()
        for result in await asyncio.gather(reader, writer, return_exceptions=True):
            if isinstance(result, Exception):
                self.log.error("session_task_failed", error=repr(result))
        if not self._close_sent and not self._client_gone:
            await self._close_or_abort()
        self.hub.remove(self)
        self.state = ConnectionState.CLOSED
        duration_s = time.monotonic() - self._opened_s
        self.log.info("session_closed", code=self._close_code, reason=self._close_reason, duration_s=round(duration_s, 3))
        self.hub.observers.emit(
            SessionClosed(self.protocol_name, self.session_id, self._close_code, self._close_reason, duration_s)
        )

    async def _close_or_abort(self) -> None:
        """Send the close frame; a client that does not read cannot take it, so then drop the TCP connection."""
        self._close_sent = True
        try:
            async with asyncio.timeout(self.settings.close_timeout_s):
                await self.websocket.close(self._close_code, self._close_reason)
            return
        except TimeoutError:
            pass
        except (WebSocketDisconnect, OSError, RuntimeError):
            return
        abort = self.websocket.scope.get(TRANSPORT_ABORT_KEY)
        if abort is not None:
            abort()
            self.log.info("transport_aborted", code=self._close_code)

    # ---- internals -------------------------------------------------------------------------------

    def _put(self, item: Outgoing) -> None:
        try:
            self._outbox.put_nowait(item)
        except asyncio.QueueFull:
            self._drop_slow_client(f"outbox full ({self._outbox.maxsize} items)")

    def _drop_slow_client(self, why: str) -> None:
        if self._aborted or self.state >= ConnectionState.CLOSED:
            return
        backlog = self._outbox.qsize()
        self.log.warning("dropped_slow_client", why=why, backlog_items=backlog, code=CLOSE_POLICY)
        self.hub.observers.emit(SlowClientDropped(self.protocol_name, self.session_id, backlog))
        self._aborted = True
        self.state = ConnectionState.CLOSING
        self._close_code, self._close_reason = CLOSE_POLICY, "slow client: audio not read"
        for ctx in list(self.contexts.values()):
            ctx.stream.cancel(DoneReason.SHUTDOWN, "slow client")
        for task in self._tasks:
            task.cancel()

    def _on_stream_event(self, ctx: Context, stream: SpeechStream, event: StreamEvent) -> None:
        if self.state < ConnectionState.CLOSING:  # once closing, nothing more is queued
            self.render(ctx, event)
        if isinstance(event, StreamDone):
            self._finish_context(ctx, event)

    def _finish_context(self, ctx: Context, done: StreamDone) -> None:
        if self.contexts.get(ctx.context_id) is ctx:
            del self.contexts[ctx.context_id]
        stream = ctx.stream
        ctx.log.info(
            "context_done",
            reason=done.reason.value,
            detail=done.detail,
            segments=stream.segment_count,
            audio_ms=round(stream.output_ms, 1),
            frames=stream.frames_out,
        )
        self.hub.observers.emit(
            ContextFinished(
                self.protocol_name,
                self.session_id,
                ctx.context_id,
                done.reason.value,
                stream.output_ms / 1000.0,
                stream.segment_count,
            )
        )
        if done.reason == DoneReason.BUSY:
            self.hub.observers.emit(BusyRejected(self.protocol_name, "context", done.detail))
        if self.state == ConnectionState.DRAINING and not self.contexts:
            self.request_close(CLOSE_GOING_AWAY, "server shutting down")

    def _on_first_audio(self, ctx: Context) -> None:
        times = ctx.stream.times
        engine_ttfb_s = None
        if times.first_chunk_ready_s is not None and times.first_submit_s is not None:
            engine_ttfb_s = times.first_chunk_ready_s - times.first_submit_s
        self.hub.observers.emit(
            FirstAudio(
                self.protocol_name,
                self.session_id,
                ctx.context_id,
                times.ttfa_s,
                times.server_overhead_s,
                engine_ttfb_s,
            )
        )


class NativeSession(Connection):
    """The native protocol (docs/protocol.md): JSON control messages in, binary audio frames out."""

    protocol_name: ClassVar[str] = "native"

    def __init__(self, hub: Hub, websocket: WebSocket) -> None:
        super().__init__(hub, websocket)
        self._limits = wire.Limits(max_text_piece_chars=self.settings.max_text_piece_chars)
        self._errors = 0
        self._last_active_s = time.monotonic()  # the last client message, or the last open context

    def on_open(self) -> None:
        engine = self.hub.engine
        assert engine is not None
        self.send_message(
            wire.encode(
                wire.SessionStarted(
                    session_id=self.session_id,
                    protocol_version=wire.PROTOCOL_VERSION,
                    variant=engine.variant,
                    random_weights=engine.random_weights,
                    max_contexts=self.settings.max_contexts_per_session,
                )
            )
        )

    def render_refusal(self, reason: str) -> str:
        return wire.encode(wire.Busy(context_id=None, reason=reason))

    # ---- client messages -------------------------------------------------------------------------

    def tick(self, now_s: float) -> None:
        super().tick(now_s)
        if self.contexts:
            self._last_active_s = now_s
        elif self.state == ConnectionState.OPEN and now_s - self._last_active_s > self.settings.inactivity_timeout_s:
            self.log.info("inactivity_timeout", idle_s=round(now_s - self._last_active_s, 1))
            self.request_close(CLOSE_NORMAL, "inactivity timeout")

    async def handle_message(self, raw: str | bytes, now_s: float) -> None:
        self._last_active_s = now_s  # any message is a keep-alive
        message = wire.parse(raw, self._limits)
        if isinstance(message, wire.ProtocolError):
            self._reject(message)
            return
        if isinstance(message, wire.KeepAlive):
            return
        if isinstance(message, wire.Open):
            await self._open(message, now_s)
            return
        ctx = self.contexts.get(message.context_id)
        if ctx is None:
            if not isinstance(message, wire.Cancel):  # cancel is idempotent: the context may just have ended
                self._reject(
                    wire.ProtocolError(
                        "context_id", f"no open context {message.context_id!r}", message.context_id, "unknown_context"
                    )
                )
            return
        try:
            if isinstance(message, wire.Text):
                if not await self._text_fits(ctx, message.text):
                    return
                ctx.stream.push_text(message.text, now_s)
            elif isinstance(message, wire.Flush):
                ctx.stream.flush(now_s)
            elif isinstance(message, wire.End):
                ctx.stream.end(now_s)
            else:
                ctx.stream.cancel()
        except StreamStateError as exc:
            self._reject(wire.ProtocolError("type", str(exc), ctx.context_id, "bad_state"))

    async def _open(self, message: wire.Open, now_s: float) -> None:
        engine = self.hub.engine
        cid = message.context_id
        if engine is None or not self.hub.ready:
            self._busy(cid, f"the server is not ready: {self.hub.detail}")
            return
        if message.model is not None and message.model != engine.variant:
            self._reject(
                wire.ProtocolError("model", f"this server runs {engine.variant!r} (one variant per server)", cid)
            )
            return
        if message.language not in (None, "en") and engine.variant != "multilingual":
            self._reject(wire.ProtocolError("language", f"the {engine.variant!r} variant speaks English only", cid))
            return
        try:
            params = build_params(engine.variant, message.sampling, message.seed)
        except SpecError as exc:
            self._reject(wire.ProtocolError(exc.field, exc.message, cid))
            return
        spec = StreamSpec(
            voice_id=message.voice,
            params=params,
            output_format=message.output_format,
            language=message.language,
            may_wait=self.settings.queue_when_full,
            max_audio_ahead_s=self.settings.max_audio_ahead_s,
            cache=message.cache,
        )
        try:
            ctx = self.open_context(cid, spec)
        except OpenRefused as refused:
            if refused.busy:
                self._busy(cid, refused.message)
            else:
                self._reject(wire.ProtocolError(refused.field, refused.message, cid, refused.code))
            return
        if message.text and await self._text_fits(ctx, message.text):
            try:
                ctx.stream.push_text(message.text, now_s)
            except StreamStateError as exc:  # cancelled (server shutdown) while the text budget was checked
                self._reject(wire.ProtocolError("type", str(exc), cid, "bad_state"))

    async def _text_fits(self, ctx: Context, text: str) -> bool:
        limit = self.settings.max_context_text_chars
        if ctx.stream.text_chars + len(text) > limit:
            self._reject(
                wire.ProtocolError("text", f"the context would exceed {limit} characters of text", ctx.context_id)
            )
            return False
        refusal = await self.charge_text(len(text))
        if refusal is not None:
            self._reject(wire.ProtocolError("text", refusal, ctx.context_id, "rate_limited"))
            return False
        return True

    def _reject(self, error: wire.ProtocolError) -> None:
        self._errors += 1
        ctx = self.contexts.get(error.context_id) if error.context_id else None
        ctx_log = ctx.log if ctx is not None else self.log
        ctx_log.info("protocol_error", field=error.field, message=error.message, code=error.code)
        self.send_message(wire.encode(wire.error_event(error)))
        if self._errors >= self.settings.max_protocol_errors:
            self.request_close(CLOSE_POLICY, "too many protocol errors")

    def _busy(self, context_id: str | None, reason: str) -> None:
        self.hub.observers.emit(BusyRejected(self.protocol_name, "context", reason))
        self.send_message(wire.encode(wire.Busy(context_id=context_id, reason=reason)))

    # ---- stream events -> wire -------------------------------------------------------------------

    def render(self, ctx: Context, event: StreamEvent) -> None:
        cid = ctx.context_id
        stream = ctx.stream
        if isinstance(event, AudioOut):
            header = wire.FrameHeader(ctx.number, event.seq, event.segment_index, self._encoding_code(stream))
            self.send_audio(ctx, wire.encode_frame(header, event.payload))
        elif isinstance(event, SegmentStarted):
            self.send_message(
                wire.encode(
                    wire.SegmentStarted(
                        context_id=cid,
                        segment_index=event.index,
                        text=event.text,
                        start_char=event.start_char,
                        end_char=event.end_char,
                        audio_offset_ms=round(event.audio_offset_ms, 2),
                        cached=event.cached,
                    )
                ),
                ctx,
            )
        elif isinstance(event, SegmentDone):
            self.send_message(
                wire.encode(
                    wire.SegmentDone(
                        context_id=cid,
                        segment_index=event.index,
                        audio_offset_ms=round(event.audio_offset_ms, 2),
                        audio_ms=round(event.audio_ms, 2),
                        speech_tokens=event.speech_tokens,
                        alignment=wire.Alignment(list(event.text), event.char_start_ms, event.char_duration_ms),
                    )
                ),
                ctx,
            )
        elif isinstance(event, StreamStarted):
            fmt = stream.spec.output_format
            self.send_message(
                wire.encode(
                    wire.ContextStarted(
                        context_id=cid,
                        stream_id=ctx.number,
                        voice=stream.spec.voice_id,
                        variant=self.hub.engine.variant if self.hub.engine else "",
                        output_format={
                            "encoding": fmt.encoding,
                            "sample_rate_hz": fmt.sample_rate_hz,
                            "frame_ms": fmt.frame_ms,
                        },
                        seed=stream.spec.params.seed,
                    )
                )
            )
        elif isinstance(event, StreamDone):
            if event.reason == DoneReason.BUSY:
                self.send_message(wire.encode(wire.Busy(context_id=cid, reason=event.detail)))
            elif event.reason == DoneReason.FAILED:
                self.send_message(
                    wire.encode(wire.Error(context_id=cid, field="", message=event.detail, code="engine_failed"))
                )
            self.send_message(partial(self._context_done, ctx, event))

    def _context_done(self, ctx: Context, event: StreamDone) -> str:
        """Rendered when it goes out, after every frame before it: the first-frame time is known then."""
        stream = ctx.stream
        times = stream.times
        return wire.encode(
            wire.ContextDone(
                context_id=ctx.context_id,
                reason=event.reason.value,
                detail=event.detail,
                segments=stream.segment_count,
                frames=stream.frames_sent,
                audio_ms=round(stream.output_ms, 2),
                timing=wire.Timing(
                    first_text_monotonic_s=times.first_text_s,
                    first_submit_monotonic_s=times.first_submit_s,
                    first_chunk_ready_monotonic_s=times.first_chunk_ready_s,
                    first_frame_sent_monotonic_s=times.first_frame_sent_s,
                    ttfa_ms=_ms(times.ttfa_s),
                    server_overhead_ms=_ms(times.server_overhead_s),
                ),
            )
        )

    @staticmethod
    def _encoding_code(stream: SpeechStream) -> int:
        return wire.ENCODING_CODES[stream.spec.output_format.encoding]


def _ms(seconds: float | None) -> float | None:
    return None if seconds is None else round(seconds * 1000.0, 3)


def _client_of(websocket: WebSocket) -> str:
    client = websocket.client
    return f"{client.host}:{client.port}" if client else ""


class SocketControlMiddleware:
    """Bounds each WebSocket's kernel send buffer and exposes `transport.abort` (under TRANSPORT_ABORT_KEY).

    Both serve flow control. Linux lets a socket's send buffer grow to megabytes (tcp_wmem), which hides
    a client that stopped reading for a minute of audio; a fixed SO_SNDBUF keeps the backlog in our
    bounded outbox, where it is seen within seconds. And a client that does not read can never take a
    close frame: ASGI has no way to drop a connection, so this reaches the server's transport through the
    raw `send` (uvicorn's is a bound method of its protocol object). Best effort: under another server
    both are skipped. Must sit outside Starlette's exception middleware, which wraps `send`.
    """

    def __init__(self, app: ASGIApp, send_buffer_bytes: int = 0) -> None:
        self.app = app
        self.send_buffer_bytes = send_buffer_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "websocket":
            transport = getattr(getattr(send, "__self__", None), "transport", None)
            if transport is not None and hasattr(transport, "abort"):
                scope[TRANSPORT_ABORT_KEY] = transport.abort
                sock = transport.get_extra_info("socket")
                if sock is not None and self.send_buffer_bytes > 0:
                    try:
                        sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, self.send_buffer_bytes)
                    except OSError:
                        pass
        await self.app(scope, receive, send)
