"""Cartesia `/tts/websocket`: the wire format, on the session core.

- in: generation requests {"context_id", "model_id", "transcript", "voice": {"mode": "id", "id"} | {"id"} | "id",
  "output_format": {"container": "raw" | "wav" | "mp3", "encoding", "sample_rate", "bit_rate"}
  (protocols/vendor_formats.cartesia_format; raw PCM16 at 24 kHz when absent), "continue", "flush", "add_timestamps",
  "language", "seed" (our extension), ...}; {"context_id", "cancel": true}.
  The first request of a context opens it (its voice, format, language and seed hold for the context);
  "continue": false ends its input; "flush": true speaks what it has and answers "flush_done".
- out: {"type": "chunk", "data": base64, ...}, {"type": "timestamps", "word_timestamps": {"words", "start",
  "end"}} (seconds from the start of the context's audio, MP3's encoder delay included), {"type": "flush_done",
  "flush_id"}, {"type": "done"},
  {"type": "error", "title", "message", "status_code", "done": true}.
- a request without `transcript` (and without `flush` or `cancel`) is refused: "the message carries no text".
- auth: `X-API-Key` / `Authorization` header or `api_key` / `access_token` query: checked by
  auth.AuthMiddleware when auth is on.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from typing import Any, ClassVar

import orjson

from agent_server.audio.codecs import StreamFormat
from agent_server.core.events import AudioOut, SegmentDone, StreamDone, StreamEvent, StreamStateError, StreamStatus
from agent_server.core.outcomes import Refusal
from agent_server.core.session import Context, WireProtocol
from agent_server.errors import RATE_LIMITED, FieldError, empty_message
from agent_server.protocols.common import (
    PieceJoiner,
    b64,
    cartesia_speed,
    load_object,
    make_spec,
    parse_seed,
    place_segment,
    resolve_voice,
    route,
)
from agent_server.protocols.vendor_formats import CARTESIA_DEFAULT, cartesia_format
from agent_server.text.markup import CARTESIA_TAGS
from agent_server.text.timestamps import ContextAlignment, SegmentTimes, seconds

STATUS_PARTIAL = 206
STATUS_OK = 200
MAX_CONTEXT_ID_CHARS = 256
REQUEST_FIELDS = frozenset(
    {
        "context_id",
        "model_id",
        "transcript",
        "voice",
        "output_format",
        "continue",
        "flush",
        "add_timestamps",
        "add_phoneme_timestamps",
        "use_normalized_timestamps",
        "language",
        "max_buffer_delay_ms",
        "speed",
        "generation_config",
        "pronunciation_dict_id",
        "duration",
        "seed",
        "cancel",
        "stream",
        "experimental_controls",
    }
)


# ---- pure: requests --------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Request:
    context_id: str
    transcript: str | None = None  # None: absent
    continue_: bool = False
    flush: bool = False
    cancel: bool = False
    model_id: str | None = None
    voice_id: str | None = None
    output: StreamFormat = CARTESIA_DEFAULT
    add_timestamps: bool = False
    language: str | None = None
    seed: int | None = None
    speed: float = 1.0


def parse_request(raw: str | bytes) -> Request:
    obj = load_object(raw, REQUEST_FIELDS)
    cid = obj.get("context_id")
    if not isinstance(cid, str) or not 0 < len(cid) <= MAX_CONTEXT_ID_CHARS:
        raise FieldError("context_id", f"context_id must be a string of 1..{MAX_CONTEXT_ID_CHARS} characters")
    if obj.get("cancel") is True:
        return Request(cid, cancel=True)
    transcript = obj.get("transcript")
    if transcript is not None and not isinstance(transcript, str):
        raise FieldError("transcript", "transcript must be a string")
    for name in ("continue", "flush", "add_timestamps"):
        if obj.get(name) is not None and not isinstance(obj[name], bool):
            raise FieldError(name, f"{name} must be a boolean")
    for name in ("model_id", "language"):
        if obj.get(name) is not None and not isinstance(obj[name], str):
            raise FieldError(name, f"{name} must be a string")
    return Request(
        context_id=cid,
        transcript=transcript,
        continue_=bool(obj.get("continue")),
        flush=bool(obj.get("flush")),
        model_id=obj.get("model_id"),
        voice_id=voice_id(obj.get("voice")),
        output=cartesia_format(obj.get("output_format"), required=False),
        add_timestamps=bool(obj.get("add_timestamps")),
        language=obj.get("language"),
        seed=parse_seed("seed", obj.get("seed")),
        speed=cartesia_speed(obj),
    )


def voice_id(voice: object) -> str | None:
    if voice is None or isinstance(voice, str):
        return voice
    if isinstance(voice, dict) and isinstance(voice.get("id"), str):
        return str(voice["id"])
    raise FieldError("voice", 'voice must be {"mode": "id", "id": "..."} or a voice id')


def _context_id_of(raw: str | bytes) -> str | None:
    """The context an unparseable request named, so that the error reaches that context's reader."""
    try:
        obj = orjson.loads(raw)
    except orjson.JSONDecodeError:
        return None
    cid = obj.get("context_id") if isinstance(obj, dict) else None
    return cid if isinstance(cid, str) else None


def error_event(message: str, context_id: str | None, status_code: int = 400, title: str = "Invalid request") -> str:
    body: dict[str, Any] = {
        "type": "error",
        "context_id": context_id,
        "status_code": status_code,
        "done": True,
        "title": title,
        "message": message,
        "error": message,
    }
    return orjson.dumps(body).decode()


# ---- the protocol --------------------------------------------------------------------------------


@dataclass(slots=True)
class ContextState:
    """What Cartesia keeps per context, on the session's Context."""

    request: Request  # the opening request: its format, timestamps flag, ...
    alignment: ContextAlignment  # the context's segments on its audio timeline
    pieces: PieceJoiner = field(default_factory=PieceJoiner)
    flush_id: int = 0  # flushes so far
    pending_flushes: deque[tuple[int, int]] = field(default_factory=deque)  # (flush_id, last segment index)
    segments_done: int = 0


CartesiaContext = Context[ContextState]
ALL_SEGMENTS = 1 << 62


class CartesiaProtocol(WireProtocol[ContextState]):
    name: ClassVar[str] = "cartesia"

    def on_refused(self, refusal: Refusal) -> None:
        self.session.send(error_event(refusal.reason, None, 429, "Busy"))

    def render_error(self, error: FieldError) -> None:
        if error.busy:
            self.session.send(error_event(error.message, error.context_id, 429, "Busy"))
        elif error.code == RATE_LIMITED:
            self.session.send(error_event(error.message, error.context_id, 429, "Rate limited"))
        else:
            self.session.send(error_event(error.message, error.context_id))

    async def on_message(self, message: str | bytes, now_s: float) -> None:
        session = self.session
        try:
            request = parse_request(message)
        except FieldError as error:
            error.context_id = _context_id_of(message)
            session.reject(error)
            return
        cid = request.context_id
        ctx = session.contexts.get(cid)
        if request.cancel:
            if ctx is not None:
                ctx.stream.cancel()
            return
        if request.transcript is None and not request.flush:
            session.reject(empty_message(cid))
            return
        try:
            if ctx is None:
                ctx = await self._open(request)
                if ctx is None:
                    return
            await self._apply(ctx, request, now_s)
        except FieldError as error:
            error.context_id = cid
            session.reject(error)
        except StreamStateError:
            session.reject(FieldError("context_id", f"context {cid!r} has already ended (continue: false)",
                                      "bad_state", context_id=cid))

    async def _open(self, request: Request) -> CartesiaContext | None:
        session = self.session
        routed = route(session.port.router, model_field="model_id", model=request.model_id, language_field="language",
                       language=request.language)
        fmt = request.output
        spec = make_spec(session.port, voice_id=resolve_voice(session.port, request.voice_id), output_format=fmt,
                         seed=request.seed, routed=routed,
                         speed=request.speed, markup=CARTESIA_TAGS)
        state = ContextState(request, ContextAlignment(lead_ms=fmt.lead_ms))
        return await session.open_context(request.context_id, spec, state)

    async def _apply(self, ctx: CartesiaContext, request: Request, now_s: float) -> None:
        stream = ctx.stream
        state = ctx.state
        if stream.status != StreamStatus.OPEN:
            raise StreamStateError("ended")
        if request.transcript and not await self.session.push_text(ctx, state.pieces.join(request.transcript), now_s):
            return
        if request.flush:
            stream.flush(now_s)
            state.flush_id += 1
            state.pending_flushes.append((state.flush_id, stream.segment_count - 1))
            self._flushes_done(ctx)
        if not request.continue_:
            stream.end(now_s)

    def _flushes_done(self, ctx: CartesiaContext) -> None:
        state = ctx.state
        while state.pending_flushes and state.pending_flushes[0][1] < state.segments_done:
            flush_id, _ = state.pending_flushes.popleft()
            body = {"type": "flush_done", "context_id": ctx.context_id, "flush_id": flush_id, "flush_done": True,
                    "done": False, "status_code": STATUS_OK}
            self.session.send(orjson.dumps(body).decode(), ctx)

    # ---- stream events -> wire -------------------------------------------------------------------

    def render(self, ctx: CartesiaContext, event: StreamEvent) -> None:
        session = self.session
        state = ctx.state
        cid = ctx.context_id
        if isinstance(event, AudioOut):
            body: dict[str, Any] = {"type": "chunk", "context_id": cid, "data": b64(event.payload), "done": False,
                                    "status_code": STATUS_PARTIAL, "step_time": 0.0}
            if state.flush_id:
                body["flush_id"] = state.flush_id
            session.send_audio(ctx, orjson.dumps(body).decode(), event.duration_ms)
        elif isinstance(event, SegmentDone):
            state.segments_done = event.index + 1
            seg = place_segment(state.alignment, event) if event.text else None  # a pause (<break>): no words
            if seg is not None and state.request.add_timestamps:
                body = {"type": "timestamps", "context_id": cid, "done": False, "status_code": STATUS_PARTIAL,
                        "word_timestamps": word_timestamps(seg)}
                session.send(orjson.dumps(body).decode(), ctx)
            self._flushes_done(ctx)
        elif isinstance(event, StreamDone):
            if event.status == StreamStatus.COMPLETED:
                state.segments_done = ALL_SEGMENTS
                self._flushes_done(ctx)
                done = {"type": "done", "context_id": cid, "done": True, "status_code": STATUS_OK}
                session.send(orjson.dumps(done).decode())
            elif event.status == StreamStatus.BUSY:
                session.send(error_event(event.detail or "busy", cid, 429, "Busy"))
            elif event.status == StreamStatus.FAILED:
                session.send(error_event(event.detail or "generation failed", cid, 500, "Generation failed"))
            elif event.status == StreamStatus.SHUTDOWN:  # the server shutting down or the session closing
                session.send(error_event(event.detail or "the server is shutting down", cid, 503,
                                         "Service unavailable"))
            # CANCELLED: the client asked; nothing more is sent for the context


def word_timestamps(seg: SegmentTimes) -> dict[str, list[Any]]:
    """Cartesia's `word_timestamps` of one segment: seconds from the start of the context's audio."""
    return {"words": [w.word for w in seg.words], "start": seconds([w.start_ms for w in seg.words]),
            "end": seconds([w.end_ms for w in seg.words])}
