"""The native protocol (docs/protocol.md) on the session core: JSON control messages in (parsed by
agent_server/protocols/native_wire.py), JSON events and binary audio frames out.

Twilio output mode (a context opened with `"twilio": {"stream_sid"}`): its audio goes out as Twilio Media
Streams messages a bridge forwards to Twilio untouched (`media`: base64 mu-law 8 kHz in 20 ms frames, with
the caller's streamSid; a `mark` after each segment's audio), its events as usual. The bridge forwards
Twilio's `mark` echoes back (each answered by a `twilio_mark` event: the caller heard that segment, or a
clear dropped it) and sends `{"event": "clear", "streamSid"}` for a barge-in: the stream's contexts are
cancelled and a `clear` goes out for Twilio to drop what it buffered. A `stop` ends the stream.
"""

from __future__ import annotations

import time
from functools import partial
from typing import ClassVar

from agent_server.audio.codecs import StreamFormat
from agent_server.core.events import (
    AudioOut,
    SegmentDone,
    SegmentStarted,
    StreamDone,
    StreamEvent,
    StreamSpec,
    StreamStarted,
    StreamStateError,
    StreamStatus,
    build_params,
)
from agent_server.core.outcomes import Outcome, Refusal
from agent_server.core.session import Context, Session, SessionState, WireProtocol
from agent_server.errors import FieldError
from agent_server.protocols import native_wire as wire
from agent_server.protocols import twilio
from agent_server.protocols.common import route
from agent_server.text.markup import SSML_TAGS

NativeContext = Context[twilio.TwilioPlayout | None]  # the Twilio stream a context plays on, if any
# contexts per session remembered as ended short (cancelled, busy, failed): text, flush, end and cancel for
# them are ignored (an LLM stream still draining after a barge-in is no error)
MAX_ENDED_SHORT = 256
TWILIO_PASSIVE = (twilio.Event.CONNECTED, twilio.Event.START, twilio.Event.MEDIA, twilio.Event.DTMF)


class NativeProtocol(WireProtocol[twilio.TwilioPlayout | None]):
    name: ClassVar[str] = "native"

    def __init__(self, session: Session[twilio.TwilioPlayout | None]) -> None:
        super().__init__(session)
        self._last_active_s = time.monotonic()  # the last moment a context was open
        # Twilio streams this session plays on, by streamSid: a stream outlives its contexts (its marks
        # come back after them), at most max_contexts_per_session streams are kept
        self._twilio: dict[str, twilio.TwilioPlayout] = {}
        self._ended_short: dict[str, None] = {}  # context ids, oldest first (at most MAX_ENDED_SHORT)

    async def on_open(self) -> None:
        model = self.session.port.model
        self.session.send(wire.encode(wire.SessionStarted(
            session_id=self.session.session_id,
            protocol_version=wire.PROTOCOL_VERSION,
            variant=model.variant,
            random_weights=bool(model.random_weights),
            max_contexts=self.session.settings.max_contexts_per_session,
            inactivity_timeout_s=self.session.settings.inactivity_timeout_s,
            models=model.models,
        )))

    def on_refused(self, refusal: Refusal) -> None:
        self.session.send(wire.encode(wire.Busy(context_id=None, reason=refusal.reason)))

    def on_tick(self, now_s: float) -> None:
        session = self.session
        if session.contexts:
            self._last_active_s = now_s
            return
        idle_s = now_s - max(self._last_active_s, session.last_input_s)
        if session.state == SessionState.OPEN and idle_s > session.settings.inactivity_timeout_s:
            session.log.info("inactivity_timeout", idle_s=round(idle_s, 1))
            session.close(Outcome.COMPLETED, "inactivity timeout")

    def render_error(self, error: FieldError) -> None:
        if error.busy:
            self.session.send(wire.encode(wire.Busy(context_id=error.context_id, reason=error.message)))
        else:
            self.session.send(wire.encode(wire.error_event(error)))

    # ---- client messages -------------------------------------------------------------------------

    async def on_message(self, message: str | bytes, now_s: float) -> None:
        parsed = wire.parse(message)
        session = self.session
        if isinstance(parsed, FieldError):
            session.reject(parsed)
            return
        if isinstance(parsed, wire.KeepAlive):
            return
        if isinstance(parsed, wire.TwilioMessage):
            self._on_twilio(parsed)
            return
        if isinstance(parsed, wire.Open):
            await self._open(parsed, now_s)
            return
        ctx = session.contexts.get(parsed.context_id)
        if ctx is None:
            if parsed.context_id in self._ended_short:
                return  # its context_done (cancelled, busy, failed) is out: the rest of its input is moot
            if not isinstance(parsed, wire.Cancel):  # cancel is idempotent: the context may just have ended
                session.reject(FieldError("context_id", f"no open context {parsed.context_id!r}", "unknown_context",
                                          context_id=parsed.context_id))
            return
        try:
            if isinstance(parsed, wire.Text):
                await session.push_text(ctx, parsed.text, now_s)
            elif isinstance(parsed, wire.Flush):
                ctx.stream.flush(now_s)
            elif isinstance(parsed, wire.End):
                ctx.stream.end(now_s)
            elif ctx.state is not None:  # a Twilio context: a barge-in, and Twilio drops what it holds
                self._clear(ctx.state)
            else:
                ctx.stream.cancel()
        except StreamStateError as exc:
            session.reject(FieldError("type", str(exc), "bad_state", context_id=ctx.context_id))

    async def _open(self, message: wire.Open, now_s: float) -> None:
        session = self.session
        cid = message.context_id
        try:
            routed = route(session.port.router, model_field="model", model=message.model, language_field="language",
                           language=message.language)
            params = build_params(routed.model, message.sampling, message.seed)
        except FieldError as error:
            error.context_id = cid
            session.reject(error)
            return
        sid = message.twilio_stream_sid
        spec = StreamSpec(
            voice_id=message.voice,
            params=params,
            output_format=twilio.TWILIO_FORMAT if sid is not None else StreamFormat.raw(message.output_format),
            language=routed.language,
            model=routed.model,
            may_wait=session.settings.queue_when_full,
            max_audio_ahead_s=session.settings.max_audio_ahead_s,
            cache=message.cache,
            speed=message.speed,
            markup=SSML_TAGS if message.breaks else frozenset(),
            normalize=message.normalize,
        )
        self._ended_short.pop(cid, None)  # the id is reused: a new context's messages count again
        ctx = await session.open_context(cid, spec, None if sid is None else self._playout(sid))
        if ctx is not None and message.text:
            try:
                await session.push_text(ctx, message.text, now_s)
            except StreamStateError as exc:  # ended (the server shutting down) while the key's budget was read
                session.reject(FieldError("type", str(exc), "bad_state", context_id=cid))

    # ---- Twilio output mode ----------------------------------------------------------------------

    def _playout(self, stream_sid: str) -> twilio.TwilioPlayout:
        playout = self._twilio.get(stream_sid)
        if playout is None:
            if len(self._twilio) >= self.session.settings.max_contexts_per_session:  # forget the oldest idle one
                idle = next((sid for sid, p in self._twilio.items() if not self._contexts_on(p)), None)
                if idle is not None:
                    del self._twilio[idle]
            playout = self._twilio[stream_sid] = twilio.TwilioPlayout(stream_sid)
        return playout

    def _on_twilio(self, message: wire.TwilioMessage) -> None:
        session = self.session
        try:
            incoming = twilio.parse_incoming(message.body)
        except FieldError as error:
            session.reject(error)
            return
        if incoming.event in TWILIO_PASSIVE:
            return  # the caller's side of the call (a bridge may forward everything): nothing to play
        playout = self._twilio.get(incoming.stream_sid)
        if playout is None:
            if incoming.event == twilio.Event.MARK:  # only a mark says we sent something there
                session.reject(FieldError("streamSid", f"no context played on stream {incoming.stream_sid!r}",
                                          "unknown_stream"))
            return  # a stop or clear on a call the agent has not spoken on (yet): nothing to stop or drop
        if incoming.event == twilio.Event.MARK:
            try:
                played = playout.on_mark(incoming.mark_name)
            except FieldError as error:
                session.reject(error)
                return
            cid, _, index = incoming.mark_name.rpartition(":")
            session.send(wire.encode(wire.TwilioMark(stream_sid=playout.stream_sid, name=incoming.mark_name,
                                                     context_id=cid, segment_index=int(index), played=played)))
        elif incoming.event == twilio.Event.CLEAR:
            self._clear(playout)
        else:  # stop: the call is over
            for ctx in self._contexts_on(playout):
                ctx.stream.cancel()
            del self._twilio[playout.stream_sid]

    def _clear(self, playout: twilio.TwilioPlayout) -> None:
        """Barge-in on a Twilio stream: Twilio drops the audio it holds (the `clear` goes out first, ahead
        of the contexts' ends), and the contexts stop: what of them is still queued is never sent."""
        self.session.send(playout.clear())
        for ctx in self._contexts_on(playout):
            ctx.stream.cancel()

    def _contexts_on(self, playout: twilio.TwilioPlayout) -> list[NativeContext]:
        return [ctx for ctx in self.session.contexts.values() if ctx.state is playout]

    # ---- stream events -> wire -------------------------------------------------------------------

    def render(self, ctx: NativeContext, event: StreamEvent) -> None:
        session = self.session
        cid = ctx.context_id
        stream = ctx.stream
        playout = ctx.state
        if isinstance(event, AudioOut):
            if playout is not None:
                session.send_audio(ctx, playout.media(event.payload), event.duration_ms)
                return
            code = wire.ENCODING_CODES[stream.spec.output_format.codec]
            header = wire.FrameHeader(ctx.number, event.seq, event.segment_index, code)
            session.send_audio(ctx, wire.encode_frame(header, event.payload), event.duration_ms)
        elif isinstance(event, SegmentStarted):
            session.send(wire.encode(wire.SegmentStarted(
                context_id=cid,
                segment_index=event.index,
                text=event.text,
                start_char=event.start_char,
                end_char=event.end_char,
                audio_offset_ms=round(event.audio_offset_ms, 2),
                cached=event.cached,
            )), ctx)
        elif isinstance(event, SegmentDone):
            session.send(wire.encode(wire.SegmentDone(
                context_id=cid,
                segment_index=event.index,
                audio_offset_ms=round(event.audio_offset_ms, 2),
                audio_ms=round(event.audio_ms, 2),
                speech_tokens=event.speech_tokens,
                alignment=wire.Alignment(list(event.text), event.char_start_ms, event.char_duration_ms),
            )), ctx)
            if playout is not None:  # registered as pending only once it goes out (skipped if cancelled first)
                session.send(partial(playout.segment_end, cid, event.index), ctx)
        elif isinstance(event, StreamStarted):
            fmt = stream.spec.output_format
            session.send(wire.encode(wire.ContextStarted(
                context_id=cid,
                stream_id=ctx.number,
                voice=stream.spec.voice_id,
                variant=stream.spec.model or session.port.model.variant,
                output_format={"encoding": fmt.codec, "sample_rate_hz": fmt.sample_rate_hz,
                               "frame_ms": fmt.frame_ms},
                seed=stream.spec.params.seed,
            )))
        elif isinstance(event, StreamDone):
            if event.status != StreamStatus.COMPLETED:
                self._ended_short[cid] = None
                if len(self._ended_short) > MAX_ENDED_SHORT:
                    del self._ended_short[next(iter(self._ended_short))]
            if event.status == StreamStatus.BUSY:
                session.send(wire.encode(wire.Busy(context_id=cid, reason=event.detail)))
            elif event.status == StreamStatus.FAILED:
                session.send(wire.encode(wire.Error(context_id=cid, field="", message=event.detail,
                                                    code="engine_failed")))
            session.send(partial(_context_done, ctx, event))


def _context_done(ctx: NativeContext, event: StreamDone) -> str:
    """Rendered when it goes out, after every frame before it: what was sent is known then."""
    stream = ctx.stream
    times = stream.times
    return wire.encode(wire.ContextDone(
        context_id=ctx.context_id,
        reason=event.reason,
        detail=event.detail,
        segments=stream.segment_count,
        frames=stream.frames_sent,
        audio_ms=round(stream.sent_ms, 2),
        timing=wire.Timing(
            first_text_monotonic_s=times.first_text_s,
            first_submit_monotonic_s=times.first_submit_s,
            first_chunk_ready_monotonic_s=times.first_chunk_ready_s,
            first_frame_sent_monotonic_s=times.first_frame_sent_s,
            ttfa_ms=_ms(times.ttfa_s),
            server_overhead_ms=_ms(times.server_overhead_s),
        ),
    ))


def _ms(seconds: float | None) -> float | None:
    return None if seconds is None else round(seconds * 1000.0, 3)
