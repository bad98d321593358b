"""The session core: one `Session` per session of any protocol (a WebSocket, or one HTTP request).

Three layers, one concern each:
- a transport (core/transport.py; core/grpc_server.py for gRPC): a reader and a writer for one connection,
  nothing more;
- a wire protocol (`WireProtocol`: agent_server/protocols/*): parses the client's messages and renders events in
  its own wire form; it never touches the socket, and of the server it sees only `session.port`
  (core/port.py: the settings, the voices, the serving model's facts), never the hub;
- this core, which owns everything that must be the same for every protocol:
  - admission: `run()` holds a `try/finally` from `hub.admit` to `hub.remove` around everything the
    protocol does, so no exception in protocol code can leak a session;
  - contexts: opened only through `open_context` (-> `hub.open_stream`), where the drain, the context
    limit and busy are checked once for all protocols;
  - one set of text limits and per-key charging (`push_text`), one count of protocol errors (`reject`);
  - one bounded outbox and its writer: output of a stream cancelled before it goes out is skipped;
  - the slow-client watchdog: the client is cut (1008) when it has taken none of the bytes it was given
    for `slow_client_stall_s`, measured where the bytes leave the machine (transport buffer + kernel
    send queue), or when it is stalled (`MIN_STALL_S`) and has not shown it reads for `slow_client_behind_s`
    since the first byte it was given after it last did (`DrainWatch`: its kernel takes a buffer's worth
    unread), or when the outbox overflows, or when a context's audio encoder falls behind (`OutputOverflow`);
  - the drain (1001 after the last context), busy refusal at admission (1013), teardown;
  - how the session ends: one `Outcome` (core/outcomes.py), which its transport answers from the one table;
  - metrics events (core/observers.py) and structured logs.

A protocol implements the hooks of `WireProtocol` (`on_open`, `on_message`, `on_input_end`, `render`,
`render_error`, `on_refused`, `on_close`, `on_tick`) and calls the core's verbs: `send`, `send_audio`, `open_context`,
`push_text`, `reject`, `close`.
"""

from __future__ import annotations

import asyncio
import enum
import inspect
import itertools
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from functools import partial
from typing import TYPE_CHECKING, Any, ClassVar, Generic, TypeVar

import structlog
from starlette.routing import Route, WebSocketRoute
from starlette.types import Receive, Scope, Send

from agent_server.core.events import (
    MarkupProblem,
    OutputOverflow,
    Stream,
    StreamDone,
    StreamEvent,
    StreamSpec,
    StreamStateError,
    StreamStatus,
)
from agent_server.core.observers import (
    BusyRejected,
    ContextFinished,
    FirstAudio,
    SessionClosed,
    SessionOpened,
    SlowClientDropped,
)
from agent_server.core.outcomes import CLOSE_INVALID_PAYLOAD, CLOSE_TOO_BIG, Outcome, Refusal
from agent_server.core.transport import (
    Disconnected,
    HttpTransport,
    InputEnded,
    InputRefused,
    Outbound,
    Transport,
    TransportClosed,
    WebSocketTransport,
    outbound_bytes,
)
from agent_server.errors import (
    CONTEXT_TEXT_LIMIT,
    RATE_LIMITED,
    TEXT_TOO_LONG,
    UNAVAILABLE,
    FieldError,
    empty_message,
)
from agent_server.logging import RateLimitedLog

if TYPE_CHECKING:
    from agent_server.core.hub import Hub
    from agent_server.core.port import Port
    from agent_server.fleet.auth import Principal

log = structlog.get_logger("agent_server.session")

# Sends that find the transport writable complete without yielding to the loop; after this many in a row
# the writer lets other tasks run, so one session's burst (a 4 s chunk is 200 frames) cannot hold up
# another session's first frame.
WRITER_BURST_ITEMS = 8
# The cumulative bound (`slow_client_behind_s`) cuts a client stalled at least this long: a reader's window reopens
# within a read or two (tens of ms; up to ~1.3 s of 24 kHz PCM on loopback, whose 64 kB MSS delays the update).
MIN_STALL_S = 1.0
# A client that took more than this since it last showed it reads has read some of it: more than a Linux receive
# buffer holds unread (128 KiB by default, ~165 kB with what it reports; measured, docs/compatibility.md). 5.5 s of
# 24 kHz PCM16, 33 s of G.711, 65 s of 32 kbit/s MP3: a slow stream proves itself rarely.
UNREAD_CAPACITY_BYTES = 256 * 1024
DRAIN_IDLE_S = 1.0  # the drain ends a context's input once the client has sent nothing for this long
INVALID_UTF8_LOG_PERIOD_S = 10.0  # at most one `invalid_utf8` line per period, with a count of the rest
CLIENT_CLOSE_REASONS = {CLOSE_INVALID_PAYLOAD: "invalid UTF-8 from the client", CLOSE_TOO_BIG: "message too big"}

_invalid_utf8_log = RateLimitedLog(log, "invalid_utf8", INVALID_UTF8_LOG_PERIOD_S)

S = TypeVar("S")  # a protocol's own per-context state


class SessionState(enum.IntEnum):
    OPEN = 0
    DRAINING = 1  # the server is shutting down: no new contexts; close 1001 after the last one ends
    CLOSING = 2  # the close is queued: nothing more is rendered
    CLOSED = 3


@dataclass(slots=True, eq=False)
class Context(Generic[S]):
    """One open context of a session: its stream, and the protocol's own state for it."""

    context_id: str  # the protocol's name for it
    number: int  # 1, 2, 3 ... per session (the native protocol's stream id)
    state: S
    log: Any  # structlog logger bound to the context
    stream: Stream = field(init=False)


Payload = Outbound | Callable[[], Outbound] | Awaitable[Outbound]


@dataclass(slots=True, eq=False)
class Outgoing:
    """One item of the outbox. `data` is sent as is, or rendered when its turn comes (a callable), or
    awaited then (an off-loop stage such as a compressing encoder: order is kept). None: a marker."""

    ctx: Context[Any] | None  # output of a stream that gets cancelled before this goes out is skipped
    data: Payload | None
    audio_ms: float = 0.0  # > 0: an audio frame of ctx holding that much audio
    on_done: Callable[[], None] | None = None  # once it went out, was skipped, or was dropped at teardown


_CLOSE = Outgoing(None, None)  # the writer's sentinel: close the transport and stop


@dataclass(slots=True)
class DrainWatch:
    """Whether the client keeps taking what it was given. Pure: fed with byte counts and times.

    `wrote(n)` counts bytes handed to the transport; `observe(unsent)` reads what of them has not left
    the machine yet (transport buffer + kernel send queue, i.e. not acknowledged by the client). The
    client is stalled from the first observation at which bytes wait for it, and stays stalled until
    more of them than ever before have drained. Framing bytes the count does not see only make the
    drained figure lower, never higher, so they cannot pass for progress.

    A client's kernel acknowledges whatever fits its receive buffer whether the application reads or not
    (~130-165 kB on Linux: 3 s of 24 kHz PCM16, many more of G.711 or MP3), and it opens its window bit by bit
    while it fills, so neither progress nor progress after a stall shows that the application reads; only
    taking more than such a buffer holds does (`UNREAD_CAPACITY_BYTES`). `unproven_s` is how long bytes have
    been given to the client since it last showed that (since the first of them), the measure of the
    cumulative bound (`Session.tick`)."""

    written_bytes: int = 0
    drained_bytes: int = 0  # the most ever seen drained
    stalled_since_s: float | None = None
    unproven_since_s: float | None = None  # the first observation with bytes written since the client last read
    proven_through_bytes: int = 0  # bytes written when the client last showed it reads
    proven_drained_bytes: int = 0  # bytes drained then

    def wrote(self, n_bytes: int) -> None:
        self.written_bytes += n_bytes

    def observe(self, unsent_bytes: int, now_s: float) -> None:
        if self.unproven_since_s is None and self.written_bytes > self.proven_through_bytes:
            self.unproven_since_s = now_s
        if unsent_bytes <= 0:  # everything left: nothing waits for the client
            self.drained_bytes = max(self.drained_bytes, self.written_bytes)
            self.stalled_since_s = None
        else:
            drained = self.written_bytes - unsent_bytes
            if drained > self.drained_bytes:
                self.drained_bytes = drained
                self.stalled_since_s = now_s
            elif self.stalled_since_s is None:
                self.stalled_since_s = now_s
        if self.drained_bytes - self.proven_drained_bytes > UNREAD_CAPACITY_BYTES:  # more than a kernel holds: it reads
            self.proven_through_bytes, self.proven_drained_bytes = self.written_bytes, self.drained_bytes
            self.unproven_since_s = None

    def stalled_s(self, now_s: float) -> float:
        return 0.0 if self.stalled_since_s is None else now_s - self.stalled_since_s

    def unproven_s(self, now_s: float) -> float:
        return 0.0 if self.unproven_since_s is None else now_s - self.unproven_since_s


class WireProtocol(Generic[S]):
    """A protocol's wire format on the session core: parse what the client sends, render what the
    session emits. It holds no socket and sends only through `self.session`. Any exception a hook
    raises closes that session (1011, or an HTTP 500 when no response has started), never the server."""

    name: ClassVar[str]

    def __init__(self, session: Session[S]) -> None:
        self.session = session

    async def on_open(self) -> None:
        """Once admitted: check the query, queue the greeting."""

    async def on_message(self, message: str | bytes, now_s: float) -> None:
        """One client message (an HTTP request's body is one message)."""
        raise NotImplementedError

    async def on_input_end(self, now_s: float) -> None:
        """The client sent its last message and waits for the answer (transports that can say so: gRPC)."""

    def render(self, ctx: Context[S], event: StreamEvent) -> None:
        """One event of a context's stream, in order; StreamDone last (then the context is gone)."""
        raise NotImplementedError

    def render_error(self, error: FieldError) -> None:
        """A refused request (`session.reject`) in the protocol's own form; it may also close."""
        raise NotImplementedError

    def on_refused(self, refusal: Refusal) -> None:
        """The session was not admitted: queue the refusal (the core then ends it with `refusal.outcome`)."""

    def on_close(self, outcome: Outcome, reason: str) -> None:
        """The session is about to close: queue any last words (they go out before the close)."""

    def on_tick(self, now_s: float) -> None:
        """Called every `tick_s` (protocol timers such as an inactivity timeout)."""


class Session(Generic[S]):
    def __init__(self, hub: Hub, transport: Transport, protocol: type[WireProtocol[S]]) -> None:
        self._hub = hub  # the session's own: a protocol gets the port, never the hub
        self.port: Port = hub.port  # what the protocol may use of the server: settings, voices, the model's facts
        self.settings = hub.settings
        self.transport = transport
        self.protocol_name: str = protocol.name
        self.session_id: str = hub.new_session_id()
        self.principal: Principal | None = transport.principal  # the API key it came with (None: auth off)
        self.state = SessionState.OPEN
        self.contexts: dict[str, Context[S]] = {}
        self.log = log.bind(session_id=self.session_id, protocol=self.protocol_name)
        if self.principal is not None:  # every line of the session names its API key (by fingerprint)
            self.log = self.log.bind(key=self.principal.key_id)
        self.outcome = Outcome.COMPLETED  # how the session ends (core/outcomes.py): what its transport answers
        self.close_reason = ""
        self._client_close_code: int | None = None  # the close code the client ended the session with
        self.last_input_s = time.monotonic()  # the last client message
        self._opening: set[str] = set()  # context ids whose stream is being opened
        self._finished: list[Callable[[], None]] = []  # bookkeeping of contexts that ended, not yet queued
        self._outbox: asyncio.Queue[Outgoing] = asyncio.Queue(maxsize=self.settings.outbox_max_items)
        self._numbers = itertools.count(1)
        self._errors = 0
        self._drain = DrainWatch()
        self._sending_since_s: float | None = None  # set while one send is in progress
        self._close_queued = False
        self._close_sent = False
        self._client_gone = False
        self._aborted = False
        self._tasks: list[asyncio.Task[None]] = []
        self._opened_s = time.monotonic()
        self.wire: WireProtocol[S] = protocol(self)  # last: it may read any of the above

    # ---- for protocols ---------------------------------------------------------------------------

    def send(self, data: Payload, ctx: Context[S] | None = None) -> None:
        """Queue a message; with `ctx`, it is skipped if that context is cancelled before it goes out."""
        self._put(Outgoing(ctx, data))

    def send_audio(self, ctx: Context[S], data: Payload, audio_ms: float) -> None:
        """Queue one audio frame of `ctx` (it counts as sent audio once the transport took it)."""
        self._put(Outgoing(ctx, data, audio_ms=audio_ms))

    async def open_context(self, context_id: str, spec: StreamSpec, state: S) -> Context[S] | None:
        """Open a context (its stream emits StreamStarted at once), or refuse it through `reject`
        (busy while draining, at the context limit or with the engine full; a bad voice) and return None."""
        try:
            self._check_can_open(context_id)
            self._opening.add(context_id)
            try:
                number = next(self._numbers)
                ctx = Context(context_id, number, state, self.log.bind(context_id=context_id))
                emit = partial(self._on_stream_event, ctx)
                ctx.stream = await self._hub.open_stream(f"{self.session_id}/{number}", spec, emit)
                ctx.log = ctx.log.bind(model=ctx.stream.spec.model)  # every line of the context names its model
            finally:
                self._opening.discard(context_id)
        except FieldError as error:
            error.context_id = context_id
            self.reject(error)
            return None
        self.contexts[context_id] = ctx
        ctx.stream.open()
        if self.state != SessionState.OPEN:  # drained or closed while the stream was being opened
            ctx.stream.cancel(StreamStatus.SHUTDOWN, "the server is shutting down")
            return None
        return ctx

    async def push_text(self, ctx: Context[S], text: str | None, now_s: float) -> bool:
        """Text for a context, under the one set of limits every protocol shares: a message without
        text, a piece over `max_text_piece_chars`, a context over `max_context_text_chars`, or the API
        key's text budget spent is refused through `reject` (False). An empty piece is accepted and
        does nothing. Raises StreamStateError when the context no longer takes text."""
        error = self._text_error(ctx, text)
        if error is None and text:
            refusal = await self._hub.charge_text(self.principal, len(text))
            if refusal is not None:
                error = FieldError("text", refusal, RATE_LIMITED, context_id=ctx.context_id)
        if error is not None:
            self.reject(error)
            return False
        if text:
            for problem in ctx.stream.push_text(text, now_s):  # StreamStateError if it ended meanwhile
                self.reject(FieldError("text", problem, "bad_markup", context_id=ctx.context_id))
        return True

    def reject(self, error: FieldError) -> None:
        """A refused request: logged, rendered by the protocol; after `max_protocol_errors` client
        errors (busy does not count) the session closes with 1008."""
        ctx = self.contexts.get(error.context_id) if error.context_id else None
        (ctx.log if ctx is not None else self.log).info(  # busy (full, draining) is the server's, not the client's
            "context_refused" if error.busy else "protocol_error", field=error.field, message=error.message,
            code=error.code, busy=error.busy,
        )
        if error.busy:
            self._hub.observers.emit(BusyRejected(self.protocol_name, "context", error.message))
        else:
            self._errors += 1
        if self.state < SessionState.CLOSING:
            self.wire.render_error(error)
        if self._errors >= self.settings.max_protocol_errors:
            self.close(Outcome.BAD_INPUT, "too many protocol errors")

    def close(self, outcome: Outcome, reason: str) -> None:
        """End the session with `outcome` (its close code, HTTP status or gRPC status: core/outcomes.py) after the
        output already queued (and the protocol's last words, `on_close`) went out."""
        if self._close_queued or self.state >= SessionState.CLOSING:
            return
        self.outcome, self.close_reason = outcome, reason
        try:
            self.wire.on_close(outcome, reason)
        except Exception:
            self.log.exception("protocol_hook_failed", hook="close")
            self.outcome, self.close_reason = Outcome.INTERNAL_ERROR, "internal error"
        self.state = SessionState.CLOSING
        self._queue_close()

    @property
    def close_code(self) -> int:
        """The WebSocket close code of the session's end (logs and metrics record it, for every transport): the
        client's own when the client ended it."""
        if self.outcome is Outcome.CLIENT_GONE and self._client_close_code is not None:
            return self._client_close_code
        return self.outcome.close_code

    # ---- the hub's handles -----------------------------------------------------------------------

    @property
    def live_streams(self) -> int:
        return len(self.contexts)

    def tick(self, now_s: float) -> None:
        stalled_s = self._stalled_s(now_s)
        unproven_s = self._drain.unproven_s(now_s)
        if stalled_s > self.settings.slow_client_stall_s:
            self._drop_slow_client(f"the client took none of its audio for {stalled_s:.1f} s")
            return
        if stalled_s >= MIN_STALL_S and unproven_s >= self.settings.slow_client_behind_s:
            self._drop_slow_client(f"the client has not read for {unproven_s:.1f} s (stalled {stalled_s:.1f} s)")
            return
        if self.state >= SessionState.CLOSING:
            return
        for ctx in list(self.contexts.values()):
            if ctx.stream.needs_poll:
                ctx.stream.poll(now_s)
        if self.state == SessionState.DRAINING:
            self._end_idle_contexts(now_s)
        self.wire.on_tick(now_s)

    def begin_drain(self) -> None:
        if self.state == SessionState.OPEN:
            self.state = SessionState.DRAINING
            if not self.contexts and not self._opening:
                self.close(Outcome.DRAIN_CUT, "server shutting down")

    def _end_idle_contexts(self, now_s: float) -> None:
        """The drain: once the client has sent nothing for DRAIN_IDLE_S, its open contexts have had their turn
        (a voice agent keeps its socket and context open between turns, and some protocols have no end of a
        turn at all): their input ends, so what was sent is spoken, they complete and the session closes (1001)
        instead of holding the shutdown until the grace period runs out. A turn whose text is still coming goes
        on."""
        if now_s - self.last_input_s < DRAIN_IDLE_S:
            return
        for ctx in list(self.contexts.values()):
            if ctx.stream.status == StreamStatus.OPEN:
                ctx.stream.end(now_s)

    def close_now(self, outcome: Outcome, reason: str) -> None:
        for ctx in list(self.contexts.values()):
            ctx.stream.cancel(StreamStatus.SHUTDOWN, reason)
        self.close(outcome, reason)

    def fail_streams(self, detail: str) -> None:
        for ctx in list(self.contexts.values()):
            ctx.stream.cancel(StreamStatus.FAILED, detail)

    # ---- the session's life ----------------------------------------------------------------------

    async def run(self) -> None:
        """Serve the session to its end. Admission to removal is one try/finally."""
        admitted = False
        try:
            await self.transport.accept()
            refusal = await self._hub.admit(self)
            admitted = refusal is None
            if refusal is not None:
                await self._refuse(refusal)
                return
            await self._serve()
        except TransportClosed:
            self._client_gone = True
        except Exception:
            self.log.exception("session_failed")
            await self._last_resort_close()
        finally:
            if admitted:
                self._hub.remove(self)
                self.state = SessionState.CLOSED
                duration_s = time.monotonic() - self._opened_s
                self.log.info("session_closed", outcome=self.outcome.value, code=self.close_code,
                              reason=self.close_reason, duration_s=round(duration_s, 3))
                self._hub.observers.emit(SessionClosed(self.protocol_name, self.session_id, self.close_code,
                                                      self.close_reason, duration_s))

    async def _serve(self) -> None:
        self.log.info("session_opened", client=self.transport.client)
        self._hub.observers.emit(SessionOpened(self.protocol_name, self.session_id))
        writer = asyncio.create_task(self._write_loop(), name=f"write-{self.session_id}")
        self._tasks = [writer]
        try:
            try:
                await self.wire.on_open()
            except Exception:
                self._hook_failed("open")
            if self.state < SessionState.CLOSING:
                self._tasks.append(asyncio.create_task(self._read_loop(), name=f"read-{self.session_id}"))
            await asyncio.wait(self._tasks, return_when=asyncio.FIRST_COMPLETED)
        finally:
            await self._teardown()

    async def _refuse(self, refusal: Refusal) -> None:
        self.log.info("session_refused", reason=refusal.reason)
        self._hub.observers.emit(BusyRejected(self.protocol_name, "session", refusal.reason))
        try:
            self.wire.on_refused(refusal)
        except Exception:
            self.log.exception("protocol_hook_failed", hook="refused")
        self.outcome, self.close_reason = refusal.outcome, refusal.reason[:120]
        self.state = SessionState.CLOSING
        self._queue_close()
        try:
            async with asyncio.timeout(self.settings.close_timeout_s + self.settings.slow_client_stall_s):
                await self._write_loop()
        except TimeoutError:
            self.transport.abort()

    async def _read_loop(self) -> None:
        receive = self.transport.receive
        while self.state < SessionState.CLOSING:
            message = await receive()
            if isinstance(message, InputRefused):
                self.close(message.outcome, message.reason)
                return
            if isinstance(message, Disconnected):
                self._client_gone = True
                if not self._close_queued:  # (uvicorn also reports our own close this way)
                    self.outcome, self._client_close_code = Outcome.CLIENT_GONE, message.code
                    self.close_reason = CLIENT_CLOSE_REASONS.get(message.code, "client closed")
                if message.code == CLOSE_INVALID_PAYLOAD:
                    _invalid_utf8_log.emit(session_id=self.session_id, protocol=self.protocol_name)
                return
            now_s = time.monotonic()
            self.last_input_s = now_s
            try:
                if isinstance(message, InputEnded):
                    await self.wire.on_input_end(now_s)
                else:
                    await self.wire.on_message(message, now_s)
            except Exception:
                self._hook_failed("message")

    async def _write_loop(self) -> None:
        send = self.transport.send
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
                    await self.transport.close(self.outcome, self.close_reason)
                    return
                try:
                    await self._send_item(item, send)
                finally:
                    if item.on_done is not None:
                        item.on_done()
        except TransportClosed:
            self._client_gone = True

    async def _send_item(self, item: Outgoing, send: Callable[[Outbound], Awaitable[None]]) -> None:
        ctx = item.ctx
        if ctx is not None and ctx.stream.status.output_dropped:
            return  # cancelled: nothing of it goes out any more
        payload = item.data
        if payload is None:
            return
        data: Outbound
        if callable(payload):
            data = payload()
        elif inspect.isawaitable(payload):
            data = await payload
        else:
            data = payload
        self._sending_since_s = time.monotonic()
        self._drain.wrote(outbound_bytes(data))
        await send(data)
        now_s = time.monotonic()
        self._sending_since_s = None
        if item.audio_ms > 0.0 and ctx is not None:
            ctx.stream.on_frame_sent(now_s, item.audio_ms)
            if ctx.stream.frames_sent == 1:
                self._on_first_audio(ctx)

    async def _teardown(self) -> None:
        if self.state < SessionState.CLOSING:
            self.state = SessionState.CLOSING
        for ctx in list(self.contexts.values()):  # the client leaving is its cancel (metrics: not a shutdown)
            if self._client_gone:
                ctx.stream.cancel(StreamStatus.CANCELLED, "the client went away")
            else:
                ctx.stream.cancel(StreamStatus.SHUTDOWN, "session closed")
        writer, *others = self._tasks
        for task in others:
            task.cancel()
        if self._close_queued and not self._aborted and not self._client_gone and not writer.done():
            await asyncio.wait([writer], timeout=self.settings.slow_client_stall_s + self.settings.close_timeout_s)
        writer.cancel()
        for result in await asyncio.gather(*self._tasks, return_exceptions=True):
            if isinstance(result, Exception):
                self.log.error("session_task_failed", error=repr(result))
        if not self._close_sent and not self._client_gone:
            await self._close_or_abort()
        while not self._outbox.empty():  # markers still queued: their bookkeeping runs now
            item = self._outbox.get_nowait()
            if item.on_done is not None:
                item.on_done()

    async def _close_or_abort(self) -> None:
        """Close; a client that does not read cannot take a close frame, so then drop the connection."""
        self._close_sent = True
        try:
            async with asyncio.timeout(self.settings.close_timeout_s):
                await self.transport.close(self.outcome, self.close_reason)
            return
        except TimeoutError:
            pass
        except TransportClosed:
            return
        self.transport.abort()
        self.log.info("transport_aborted", code=self.close_code)

    async def _last_resort_close(self) -> None:
        """After a failure outside every hook (a bug in the core or the transport)."""
        if self._close_sent or self._client_gone:
            return
        self._close_sent = True
        self.outcome, self.close_reason = Outcome.INTERNAL_ERROR, "internal error"
        try:
            async with asyncio.timeout(self.settings.close_timeout_s):
                await self.transport.close(Outcome.INTERNAL_ERROR, "internal error")
        except (TimeoutError, TransportClosed):
            self.transport.abort()
        except Exception:
            self.log.exception("transport_close_failed")
            self.transport.abort()

    # ---- internals -------------------------------------------------------------------------------

    def _check_can_open(self, context_id: str) -> None:
        if self.state != SessionState.OPEN or not self._hub.ready:
            why = ("the server is shutting down" if self.state == SessionState.DRAINING
                   else "the session is closing" if self.state > SessionState.DRAINING
                   else f"the server is not ready: {self._hub.detail}")
            raise FieldError("", why, UNAVAILABLE, busy=True)
        if context_id in self.contexts or context_id in self._opening:
            raise FieldError("context_id", f"context {context_id!r} is already open", "context_exists")
        limit = self.settings.max_contexts_per_session
        if len(self.contexts) + len(self._opening) >= limit:
            raise FieldError("context_id", f"too many open contexts on this session (at most {limit})",
                             "too_many_contexts", busy=True)

    def _text_error(self, ctx: Context[S], text: str | None) -> FieldError | None:
        cid = ctx.context_id
        if text is None:
            return empty_message(cid)
        piece_limit = self.settings.max_text_piece_chars
        if len(text) > piece_limit:
            return FieldError("text", f"too long: {len(text)} characters, at most {piece_limit} per message",
                              TEXT_TOO_LONG, context_id=cid)
        context_limit = self.settings.max_context_text_chars
        if ctx.stream.text_chars + len(text) > context_limit:
            return FieldError("text", f"the context would exceed {context_limit} characters of text",
                              CONTEXT_TEXT_LIMIT, context_id=cid)
        if ctx.stream.status != StreamStatus.OPEN:
            raise StreamStateError(f"'text' on a context that is {ctx.stream.status.name.lower()}")
        return None

    def _stalled_s(self, now_s: float) -> float:
        unsent = self.transport.unsent_bytes()
        stalled_s = 0.0
        if unsent is not None:
            self._drain.observe(unsent, now_s)
            stalled_s = self._drain.stalled_s(now_s)
        if self._sending_since_s is not None:  # a transport that cannot report its queue: a blocked send
            stalled_s = max(stalled_s, now_s - self._sending_since_s)
        return stalled_s

    def _queue_close(self) -> None:
        """The close goes after what is queued, the bookkeeping of contexts that just ended included."""
        finished, self._finished = self._finished, []
        for fn in finished:
            self._put(Outgoing(None, None, on_done=fn))
        self._put(_CLOSE)
        self._close_queued = True

    def _put(self, item: Outgoing) -> None:
        if self._close_queued:
            if item.on_done is not None:
                item.on_done()
            return
        try:
            self._outbox.put_nowait(item)
        except asyncio.QueueFull:
            self._drop_slow_client(f"outbox full ({self._outbox.maxsize} items)")
            if item.on_done is not None:
                item.on_done()

    def _hook_failed(self, hook: str) -> None:
        self.log.exception("protocol_hook_failed", hook=hook)
        self.close(Outcome.INTERNAL_ERROR, "internal error")

    def _drop_slow_client(self, why: str) -> None:
        if self._aborted or self.state >= SessionState.CLOSED:
            return
        backlog = self._outbox.qsize()
        self.log.warning("dropped_slow_client", why=why, backlog_items=backlog, code=Outcome.SLOW_CLIENT.close_code)
        self._hub.observers.emit(SlowClientDropped(self.protocol_name, self.session_id, backlog))
        self._aborted = True
        self.state = SessionState.CLOSING
        self.outcome, self.close_reason = Outcome.SLOW_CLIENT, "slow client: audio not read"
        for ctx in list(self.contexts.values()):
            ctx.stream.cancel(StreamStatus.SHUTDOWN, "slow client")
        for task in self._tasks:
            task.cancel()

    def _on_stream_event(self, ctx: Context[S], stream: Stream, event: StreamEvent) -> None:
        if isinstance(event, OutputOverflow):  # the encoders cannot keep up with this session's audio
            self._drop_slow_client(event.detail)
            return
        if isinstance(event, MarkupProblem):  # as push_text's problems
            self.reject(FieldError("text", event.detail, "bad_markup", context_id=ctx.context_id))
            return
        done = isinstance(event, StreamDone)
        if isinstance(event, StreamDone):  # its bookkeeping runs once what was queued for it went out
            self._finished.append(partial(self._context_finished, ctx, event))
        if self.state < SessionState.CLOSING:  # once closing, nothing more is rendered
            try:
                self.wire.render(ctx, event)
            except Exception:
                self._hook_failed("render")
        if not done:
            return
        if self.contexts.get(ctx.context_id) is ctx:
            del self.contexts[ctx.context_id]
        finished, self._finished = self._finished, []
        for fn in finished:
            if self._close_queued or self.state >= SessionState.CLOSED:
                fn()
            else:
                self._put(Outgoing(None, None, on_done=fn))
        if self.state == SessionState.DRAINING and not self.contexts and not self._opening:
            self.close(Outcome.DRAIN_CUT, "server shutting down")

    def _context_finished(self, ctx: Context[S], done: StreamDone) -> None:
        stream = ctx.stream
        ctx.log.info("context_done", reason=done.reason, detail=done.detail, segments=stream.segment_count,
                     audio_ms=round(stream.sent_ms, 1), frames=stream.frames_sent)
        self._hub.observers.emit(ContextFinished(self.protocol_name, self.session_id, ctx.context_id,
                                                 stream.spec.model or "", done.reason, stream.sent_ms / 1000.0,
                                                 stream.segment_count))
        if done.status == StreamStatus.BUSY:
            self._hub.observers.emit(BusyRejected(self.protocol_name, "context", done.detail))

    def _on_first_audio(self, ctx: Context[S]) -> None:
        times = ctx.stream.times
        engine_ttfb_s = None
        if times.first_chunk_ready_s is not None and times.first_submit_s is not None:
            engine_ttfb_s = times.first_chunk_ready_s - times.first_submit_s
        self._hub.observers.emit(FirstAudio(self.protocol_name, self.session_id, ctx.context_id,
                                            ctx.stream.spec.model or "", times.ttfa_s, times.server_overhead_s,
                                            engine_ttfb_s))


async def serve(hub: Hub, transport: Transport, protocol: type[WireProtocol[Any]]) -> None:
    """What every endpoint runs: one session of `protocol` over `transport`, to its end."""
    try:
        session: Session[Any] = Session(hub, transport, protocol)
    except Exception:  # a protocol whose constructor fails: nothing was admitted
        log.exception("session_setup_failed", protocol=protocol.name)
        try:
            await transport.close(Outcome.INTERNAL_ERROR, "internal error")
        except Exception:
            transport.abort()
        return
    await session.run()


class WebSocketEndpoint:
    """ASGI app of a WebSocket route: one session of `protocol` per connection."""

    def __init__(self, protocol: type[WireProtocol[Any]]) -> None:
        self.protocol = protocol

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        hub: Hub = scope["app"].state.hub
        await serve(hub, WebSocketTransport(scope, receive, send), self.protocol)


class HttpEndpoint:
    """ASGI app of an HTTP route: one session of `protocol` per request (its body is the one message)."""

    def __init__(self, protocol: type[WireProtocol[Any]]) -> None:
        self.protocol = protocol

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        hub: Hub = scope["app"].state.hub
        transport = HttpTransport(scope, receive, send, max_body_bytes=hub.settings.max_message_bytes)
        await serve(hub, transport, self.protocol)


def websocket_route(path: str, protocol: type[WireProtocol[Any]]) -> WebSocketRoute:
    return WebSocketRoute(path, WebSocketEndpoint(protocol))


def http_route(path: str, protocol: type[WireProtocol[Any]], methods: tuple[str, ...] = ("POST",)) -> Route:
    return Route(path, HttpEndpoint(protocol), methods=list(methods))
