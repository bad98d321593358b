"""Deepgram `/v1/speak` WebSocket (Aura): the wire format, on the session core.

- query: model (aura-*), encoding (linear16 | mulaw | alaw), sample_rate, container (none)
  (protocols/vendor_formats.deepgram_format), seed (our extension), mip_opt_out / bit_rate / speed / tag (accepted,
  ignored); auth `Authorization: Token ...` (or Bearer), checked by auth.AuthMiddleware when auth is on.
- in: {"type": "Speak", "text"}, {"type": "Flush"}, {"type": "Clear"}, {"type": "Close"}.
- a Speak without text gets a `Warning` (`INVALID_MESSAGE`), as does any message it cannot read.
- out: {"type": "Metadata"} on connect, binary audio, {"type": "Flushed", "sequence_id"} once the audio
  of everything before a Flush is out, {"type": "Cleared", "sequence_id"}, {"type": "Warning"}; Close
  speaks what is left, then closes with 1000.

One socket is one audio stream: the text goes into one `SpeechStream` until a Clear cancels it (barge-in;
the engine slot is free at the next step); the next Speak opens a new one.
"""

from __future__ import annotations

import uuid
from collections import deque
from collections.abc import Mapping
from dataclasses import dataclass
from typing import ClassVar

import orjson

from agent_server.audio.codecs import StreamFormat
from agent_server.core.events import (
    AudioOut,
    SegmentDone,
    StreamDone,
    StreamEvent,
    StreamStateError,
    StreamStatus,
    parse_speed,
)
from agent_server.core.outcomes import Outcome, Refusal
from agent_server.core.routing import Routed, Router
from agent_server.core.session import (
    Context,
    Session,
    WireProtocol,
)
from agent_server.errors import CONTEXT_TEXT_LIMIT, RATE_LIMITED, TEXT_TOO_LONG, FieldError
from agent_server.protocols.common import PieceJoiner, make_spec, parse_seed, resolve_voice, route
from agent_server.protocols.vendor_formats import deepgram_format

DEFAULT_MODEL = "aura-asteria-en"
MODEL_VERSION = "chatterbox"
CONTEXT_ID = "speak"


@dataclass(frozen=True, slots=True)
class Query:
    model: str  # the voice too (common.resolve_voice), and its last part the language (aura-2-celeste-es)
    routed: Routed
    output_format: StreamFormat
    seed: int | None
    speed: float = 1.0


def parse_query(params: Mapping[str, str], router: Router) -> Query:
    model = params.get("model") or DEFAULT_MODEL
    routed = route(router, model_field="model", model=model)
    fmt = deepgram_format(params, rest=False)
    return Query(model, routed, fmt, parse_seed("seed", params.get("seed")), parse_speed("speed", params.get("speed")))


def parse_message(raw: str | bytes) -> tuple[str, str | None]:
    """(type, text: None when a Speak has none). Raises FieldError."""
    try:
        obj = orjson.loads(raw)
    except orjson.JSONDecodeError:
        raise FieldError("message", "messages must be JSON objects") from None
    if not isinstance(obj, dict) or obj.get("type") not in ("Speak", "Flush", "Clear", "Close"):
        raise FieldError("type", "type must be one of Speak, Flush, Clear, Close")
    text = obj.get("text")
    if obj["type"] == "Speak" and text is not None and not isinstance(text, str):
        raise FieldError("text", "text must be a string")
    return obj["type"], text if isinstance(text, str) else None


def _json(body: Mapping[str, object]) -> str:
    return orjson.dumps(body).decode()


WARNING_CODES: Mapping[str, str] = {
    TEXT_TOO_LONG: "TEXT_TOO_LONG",
    CONTEXT_TEXT_LIMIT: "TEXT_TOO_LONG",
    RATE_LIMITED: "RATE_LIMITED",
}
ALL_SEGMENTS = 1 << 62
DeepgramContext = Context[PieceJoiner]  # the context's text, as pieces come


class DeepgramProtocol(WireProtocol[PieceJoiner]):
    """One socket is one audio stream; the flush and clear counters span the streams a Clear separates."""

    name: ClassVar[str] = "deepgram"

    def __init__(self, session: Session[PieceJoiner]) -> None:
        super().__init__(session)
        self.query: Query | None = None
        self._request_id = str(uuid.uuid4())
        self._flushes = 0
        self._clears = 0
        self._pending_flushes: deque[tuple[int, int]] = deque()  # (sequence_id, last segment index)
        self._segments_done = 0
        self._closing = False

    async def on_open(self) -> None:
        session = self.session
        try:
            self.query = parse_query(session.transport.query, session.port.router)
        except FieldError as error:
            self._error("INVALID_QUERY_PARAMETER", f"{error.field}: {error.message}", Outcome.BAD_INPUT)
            return
        session.send(_json({
            "type": "Metadata",
            "request_id": self._request_id,
            "model_name": self.query.model,
            "model_version": MODEL_VERSION,
            "model_uuid": str(uuid.uuid5(uuid.NAMESPACE_URL, self.query.model)),
        }))

    def on_refused(self, refusal: Refusal) -> None:
        self.session.send(_error_json("BUSY", refusal.reason))

    def render_error(self, error: FieldError) -> None:
        if error.busy:
            self._error("BUSY", error.message, Outcome.of_error(error))
        else:
            self._warn(WARNING_CODES.get(error.code, "INVALID_MESSAGE"), error.message)

    def _error(self, code: str, description: str, outcome: Outcome) -> None:
        self.session.send(_error_json(code, description))
        self.session.close(outcome, description)

    def _warn(self, code: str, description: str) -> None:
        self.session.send(_json({"type": "Warning", "code": code, "description": description}))

    # ---- client messages -------------------------------------------------------------------------

    async def on_message(self, message: str | bytes, now_s: float) -> None:
        session = self.session
        if self.query is None or self._closing:
            return
        try:
            kind, text = parse_message(message)
        except FieldError as error:
            session.reject(error)
            return
        ctx = session.contexts.get(CONTEXT_ID)
        if kind == "Speak":
            if ctx is None:
                ctx = await self._open()
                if ctx is None:
                    return
            try:
                await session.push_text(ctx, None if text is None else ctx.state.join(text), now_s)
            except StreamStateError as exc:
                session.reject(FieldError("text", str(exc), "bad_state"))
        elif kind == "Flush":
            sequence_id = self._flushes
            self._flushes += 1
            last = -1
            if ctx is not None and ctx.stream.status == StreamStatus.OPEN:
                ctx.stream.flush(now_s)
                last = ctx.stream.segment_count - 1
            self._pending_flushes.append((sequence_id, last))
            self._flushed_up_to(self._segments_done if ctx is not None else ALL_SEGMENTS)
        elif kind == "Clear":
            if ctx is not None:
                ctx.stream.cancel()
            self._segments_done = 0
            self._pending_flushes.clear()
            session.send(_json({"type": "Cleared", "sequence_id": self._clears}))
            self._clears += 1
        else:  # Close: speak what is left, then close
            self._closing = True
            if ctx is None:
                session.close(Outcome.COMPLETED, "")
            elif ctx.stream.status == StreamStatus.OPEN:
                ctx.stream.end(now_s)

    async def _open(self) -> DeepgramContext | None:
        session = self.session
        query = self.query
        if query is None:
            return None
        try:
            spec = make_spec(session.port, voice_id=resolve_voice(session.port, query.model),
                             output_format=query.output_format, seed=query.seed, routed=query.routed,
                             speed=query.speed)
        except FieldError as error:
            session.reject(error)
            return None
        ctx = await session.open_context(CONTEXT_ID, spec, PieceJoiner())
        if ctx is not None:
            self._segments_done = 0
        return ctx

    def _flushed_up_to(self, segments_done: int) -> None:
        while self._pending_flushes and self._pending_flushes[0][1] < segments_done:
            sequence_id, _ = self._pending_flushes.popleft()
            self.session.send(_json({"type": "Flushed", "sequence_id": sequence_id}))

    # ---- stream events -> wire -------------------------------------------------------------------

    def render(self, ctx: DeepgramContext, event: StreamEvent) -> None:
        if isinstance(event, AudioOut):
            self.session.send_audio(ctx, event.payload, event.duration_ms)
        elif isinstance(event, SegmentDone):
            self._segments_done = event.index + 1
            self._flushed_up_to(self._segments_done)
        elif isinstance(event, StreamDone):
            if event.status == StreamStatus.BUSY:
                self._warn("BUSY", event.detail or "no free slot: the text was dropped")
            elif event.status == StreamStatus.FAILED:
                self._warn("GENERATION_FAILED", event.detail or "generation failed: the text was dropped")
            # nothing more of this stream comes: every flush waiting on it is answered now (a client waiting for
            # its Flushed must not hang after a busy turn, nor get it later against the next turn's audio)
            self._flushed_up_to(ALL_SEGMENTS)
            if self._closing:
                self.session.close(Outcome.COMPLETED, "")


def _error_json(code: str, description: str) -> str:
    return _json({"type": "Error", "err_code": code, "err_msg": description, "description": description})
