"""Cartesia text to speech over HTTP: `POST /tts/bytes` and `POST /tts/sse`, on the HTTP speech base
(protocols/http_speech.py).

- `/tts/bytes` (`client.tts.generate`, `tts.bytes`): the audio in `output_format`, streamed as it is made.
- `/tts/sse` (`tts.generate_sse`, `tts.sse`): server-sent events, each `event: <type>` + `data: <json>`:
  `chunk` `{"type", "data": base64, "done": false, "status_code": 206, "step_time", "context_id"}`,
  `timestamps` `{"type", "word_timestamps": {"words", "start", "end"}, ...}` (seconds from the start of
  the request's audio, with `add_timestamps`), `done` `{"type", "done": true, "status_code": 200}`,
  `error` `{"type", "title", "message", "error_code", "status_code", "done": true, "request_id"}`.

Body fields: the WebSocket's generation-request fields (`protocols.cartesia.REQUEST_FIELDS`, one field set)
less the streaming-only ones (`continue`, `flush`, `cancel`, `max_buffer_delay_ms`), plus the HTTP-only
`locale`, `normalization` and `save`; `/tts/bytes` takes no timestamp fields. `output_format` is required
(`formats.cartesia_format`: raw, wav or mp3), as is `transcript`; `language` and `locale` are one field
spelled two ways (both given is refused, as the API does). Errors before any audio: the HTTP status (400 for
a bad request) with the `error` event's fields; after audio started (SSE), an `error` event ends the stream.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar

import orjson

from agent_server.audio.codecs import StreamFormat
from agent_server.core.events import AudioOut, SegmentDone
from agent_server.core.routing import Routed, Router
from agent_server.core.session import Context
from agent_server.core.transport import Head
from agent_server.errors import FieldError, empty_message
from agent_server.protocols.cartesia import MAX_CONTEXT_ID_CHARS, REQUEST_FIELDS, word_timestamps
from agent_server.protocols.cartesia import voice_id as parse_voice
from agent_server.protocols.common import (
    b64,
    cartesia_speed,
    load_object,
    make_spec,
    parse_seed,
    place_segment,
    resolve_voice,
    route,
)
from agent_server.protocols.http_speech import STATUS_BAD_REQUEST, HttpSpeechProtocol, HttpSpeechRequest
from agent_server.protocols.vendor_formats import cartesia_format
from agent_server.text.markup import CARTESIA_TAGS
from agent_server.text.timestamps import ContextAlignment, SegmentTimes

SSE_MEDIA_TYPE = "text/event-stream"
TITLES = {400: "Invalid request", 413: "Request too large", 429: "Too many requests", 500: "Internal error",
          503: "Service unavailable"}
STATUS_PARTIAL = 206
STATUS_OK = 200
WEBSOCKET_ONLY_FIELDS = frozenset({"continue", "flush", "cancel", "max_buffer_delay_ms"})
TIMESTAMP_FIELDS = frozenset({"add_timestamps", "add_phoneme_timestamps", "use_normalized_timestamps", "context_id"})
HTTP_ONLY_FIELDS = frozenset({"locale", "normalization", "save"})
SSE_FIELDS = (REQUEST_FIELDS - WEBSOCKET_ONLY_FIELDS) | HTTP_ONLY_FIELDS
BYTES_FIELDS = SSE_FIELDS - TIMESTAMP_FIELDS


@dataclass(frozen=True, slots=True)
class TtsRequest:
    transcript: str
    model_id: str | None
    voice_id: str | None  # as given: the caller maps it onto our voices (common.resolve_voice)
    routed: Routed  # the model that serves model_id and language (or locale) here
    seed: int | None
    output: StreamFormat
    sse: bool
    add_timestamps: bool
    context_id: str | None  # echoed in every SSE event
    speed: float = 1.0


def parse_request(body: object, router: Router, *, sse: bool) -> TtsRequest:
    """Raises FieldError; `error_body` renders it."""
    obj = load_object(body, SSE_FIELDS if sse else BYTES_FIELDS, what="body")
    transcript = obj.get("transcript")
    if transcript is not None and not isinstance(transcript, str):
        raise FieldError("transcript", "transcript must be a string")
    if transcript is None or not transcript.strip():
        raise empty_message(field="transcript")
    model_id = obj.get("model_id")
    if model_id is not None and not isinstance(model_id, str):
        raise FieldError("model_id", "model_id must be a string")
    for name in ("add_timestamps", "add_phoneme_timestamps", "use_normalized_timestamps", "save"):
        if obj.get(name) is not None and not isinstance(obj[name], bool):
            raise FieldError(name, f"{name} must be a boolean")
    language, locale = obj.get("language"), obj.get("locale")
    if language is not None and locale is not None:
        raise FieldError("locale", "set language or locale, not both")
    field = "locale" if locale is not None else "language"
    spoken = locale if locale is not None else language
    if spoken is not None and not isinstance(spoken, str):
        raise FieldError(field, f"{field} must be a string")
    context_id = obj.get("context_id")
    if context_id is not None and (not isinstance(context_id, str) or not 0 < len(context_id) <= MAX_CONTEXT_ID_CHARS):
        raise FieldError("context_id", f"context_id must be a string of 1..{MAX_CONTEXT_ID_CHARS} characters")
    return TtsRequest(
        transcript=transcript,
        model_id=model_id,
        voice_id=parse_voice(obj.get("voice")),
        routed=route(router, model_field="model_id", model=model_id, language_field=field, language=spoken),
        seed=parse_seed("seed", obj.get("seed")),
        output=cartesia_format(obj.get("output_format"), required=True),
        sse=sse,
        add_timestamps=bool(obj.get("add_timestamps")),
        context_id=context_id,
        speed=cartesia_speed(obj),
    )


def error_body(exc: FieldError, request_id: str) -> tuple[int, dict[str, Any]]:
    return STATUS_BAD_REQUEST, _error(STATUS_BAD_REQUEST, TITLES[STATUS_BAD_REQUEST], exc.message, exc.code, request_id)


def status_body(status_code: int, title: str, message: str, error_code: str, request_id: str) -> dict[str, Any]:
    """Any other failure (busy 429, generation failed 500, not ready 503)."""
    return _error(status_code, title, message, error_code, request_id)


def _error(status_code: int, title: str, message: str, error_code: str, request_id: str) -> dict[str, Any]:
    return {"title": title, "message": message, "error_code": error_code, "status_code": status_code,
            "request_id": request_id}


# ---- SSE events ---------------------------------------------------------------------------------------


def chunk_event(audio: bytes, context_id: str | None, step_time_ms: float = 0.0) -> bytes:
    return _event({"type": "chunk", "data": b64(audio), "done": False, "status_code": STATUS_PARTIAL,
                   "step_time": step_time_ms, "context_id": context_id})


def timestamps_event(seg: SegmentTimes, context_id: str | None) -> bytes:
    return _event({"type": "timestamps", "word_timestamps": word_timestamps(seg), "done": False,
                   "status_code": STATUS_PARTIAL, "context_id": context_id})


def done_event(context_id: str | None) -> bytes:
    return _event({"type": "done", "done": True, "status_code": STATUS_OK, "context_id": context_id})


def error_event(status_code: int, title: str, message: str, error_code: str, request_id: str,
                context_id: str | None) -> bytes:
    body = {"type": "error", "done": True, "context_id": context_id,
            **_error(status_code, title, message, error_code, request_id)}
    return _event(body)


def _event(body: dict[str, Any]) -> bytes:
    return b"event: " + str(body["type"]).encode() + b"\ndata: " + orjson.dumps(body) + b"\n\n"


# ---- the protocol --------------------------------------------------------------------------------



@dataclass(slots=True)
class HttpState:
    request: TtsRequest
    alignment: ContextAlignment


HttpContext = Context[HttpState]


class CartesiaBytesProtocol(HttpSpeechProtocol[HttpState]):
    """`POST /tts/bytes`; `CartesiaSseProtocol` is `/tts/sse`."""

    name: ClassVar[str] = "cartesia_http"
    text_field: ClassVar[str] = "transcript"
    sse: ClassVar[bool] = False

    def parse(self, body: bytes) -> HttpSpeechRequest[HttpState]:
        session = self.session
        request = parse_request(body, session.port.router, sse=self.sse)
        spec = make_spec(session.port, voice_id=resolve_voice(session.port, request.voice_id),
                         output_format=request.output, seed=request.seed, routed=request.routed,
                         speed=request.speed, markup=CARTESIA_TAGS)
        state = HttpState(request, ContextAlignment(lead_ms=request.output.lead_ms))
        return HttpSpeechRequest(spec, request.transcript, state)

    def error_body(self, status: int, code: str, message: str, field: str | None) -> tuple[int, bytes]:
        return status, orjson.dumps(status_body(status, TITLES.get(status, "Error"), message, code,
                                                self.session.session_id))

    def head(self, ctx: HttpContext) -> Head:
        request = ctx.state.request
        media_type = SSE_MEDIA_TYPE if request.sse else request.output.mime_type
        return Head(200, media_type, (("x-request-id", self.session.session_id),))

    def render_audio(self, ctx: HttpContext, event: AudioOut) -> None:
        payload = chunk_event(event.payload, ctx.state.request.context_id) if self.sse else event.payload
        self.session.send_audio(ctx, payload, event.duration_ms)

    def render_segment(self, ctx: HttpContext, event: SegmentDone) -> None:
        if not event.text:
            return  # a pause (<break>): silence, no words
        state = ctx.state
        seg = place_segment(state.alignment, event)
        if self.sse and state.request.add_timestamps:
            self.session.send(timestamps_event(seg, state.request.context_id), ctx)

    def render_completed(self, ctx: HttpContext) -> None:
        if self.sse:
            self.session.send(done_event(ctx.state.request.context_id))

    def render_failed(self, ctx: HttpContext, status: int, code: str, message: str) -> None:
        if self.sse:
            self.session.send(error_event(status, TITLES.get(status, "Error"), message, code,
                                          self.session.session_id, ctx.state.request.context_id))


class CartesiaSseProtocol(CartesiaBytesProtocol):
    sse: ClassVar[bool] = True
