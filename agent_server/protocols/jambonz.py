"""jambonz custom TTS vendor API: the HTTP form and the streaming WebSocket form, on the session core.

A jambonz application names this server as a custom speech vendor (portal: a TTS HTTP URL and/or a
streaming WebSocket URL, and an API key sent as `Authorization: Bearer <key>`).

HTTP (`POST`, jambonz's non-streaming API): body `{"text", "type": "text" | "ssml", "language", "voice"}`;
the answer is the audio with its type in `Content-Type`, which jambonz takes as `audio/mpeg` (preferred,
what it asks for with `Accept: audio/mpeg`), `audio/wav`, or `audio/l16;rate=N`. SSML: jambonz sends it
when the text starts with `<speak`; its `<break time>` / `<break strength>` are played as pauses (markup.py),
its other markup is not rendered and the text inside it is spoken (docs/compatibility.md); markup that is not
well-formed is refused.
Errors: an HTTP error status with `{"error": message}`.

WebSocket (jambonz's streaming API): jambonz connects with `?voice=...&language=...&sampleRate=N`; the
server answers `{"type": "connect", "data": {"sample_rate": N, "base64_encoding": false}}`, then jambonz
sends `{"type": "stream", "text"}` pieces, `{"type": "flush"}` (speak what was sent) and
`{"type": "stop"}` (stop: drop what is not yet played and end the connection), and may send
`{"type": "keepalive"}`; audio goes back as binary frames of PCM16 LE mono at N Hz. Errors:
`{"type": "error", "error": message}`. One context per connection, opened by the first `stream`: text goes
into it until `stop` (a barge-in: the context is cancelled, the engine slot freed, the connection closed
with 1000); a context that ended on its own (busy, failed) is replaced by the next `stream`.
"""

from __future__ import annotations

import enum
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, ClassVar

import orjson

from agent_server.audio.codecs import CODEC_SAMPLE_RATES_HZ, StreamFormat
from agent_server.core.events import AudioOut, StreamDone, StreamEvent, StreamStateError, StreamStatus
from agent_server.core.outcomes import Outcome, Refusal
from agent_server.core.session import Context, Session, WireProtocol
from agent_server.core.transport import Head
from agent_server.errors import BAD_REQUEST, BUSY, FieldError, empty_message
from agent_server.protocols.common import (
    PieceJoiner,
    is_decimal,
    load_object,
    make_spec,
    parse_seed,
    resolve_voice,
    route,
)
from agent_server.protocols.http_speech import HttpSpeechProtocol, HttpSpeechRequest
from agent_server.text.markup import SSML_TAGS, ssml_text

STATUS_BAD_REQUEST = 400
HTTP_BODY_FIELDS = frozenset({"text", "type", "language", "voice"})
MESSAGE_FIELDS = frozenset({"type", "text"})
MP3_SAMPLE_RATE_HZ = 24_000  # the engine's rate: no resampling; jambonz decodes to the call's rate
MP3_BITRATE_BPS = 64_000
WAV_SAMPLE_RATE_HZ = 24_000
PCM_SAMPLE_RATES_HZ = CODEC_SAMPLE_RATES_HZ["pcm_s16le"]
DEFAULT_STREAM_RATE_HZ = 8_000  # a telephone call's rate, when jambonz does not say
MP3_TYPES = ("audio/mpeg", "audio/mp3")
WAV_TYPES = ("audio/wav", "audio/x-wav")
L16_TYPE = "audio/l16"


# ---- HTTP ----------------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class SynthRequest:
    text: str  # what is spoken (SSML: the text inside the markup, its breaks as `<break time=.../>`)
    language: str | None
    voice: str | None  # as given: the caller maps it onto our voices (common.resolve_voice)
    output: StreamFormat
    content_type: str  # the response's Content-Type, in jambonz's spelling
    ssml: bool = False  # `text` carries breaks (markup.SSML_TAGS)


def parse_http(body: object, accept: str | None) -> SynthRequest:
    """Raises FieldError; `http_error_body` renders it."""
    obj = load_object(body, HTTP_BODY_FIELDS, what="body")
    text, kind = obj.get("text"), obj.get("type", "text")
    if text is not None and not isinstance(text, str):
        raise FieldError("text", "text must be a string")
    if text is None or not text.strip():
        raise empty_message()
    if kind not in ("text", "ssml"):
        raise FieldError("type", 'type must be "text" or "ssml"')
    for name in ("language", "voice"):
        if obj.get(name) is not None and not isinstance(obj[name], str):
            raise FieldError(name, f"{name} must be a string")
    spoken = ssml_text(text) if kind == "ssml" else text
    output, content_type = http_format(accept)
    return SynthRequest(spoken, obj.get("language"), obj.get("voice"), output, content_type, kind == "ssml")


def http_format(accept: str | None) -> tuple[StreamFormat, str]:
    """The type of `Accept` we serve with the highest `q` (the first of equals; none with q=0; no Accept, or
    `*/*`: MP3, jambonz's preferred format)."""
    for media, params in _by_preference(accept or "audio/mpeg"):
        if media in MP3_TYPES or media in ("*/*", "audio/*"):
            return StreamFormat("mp3", "mp3", MP3_SAMPLE_RATE_HZ, MP3_BITRATE_BPS), MP3_TYPES[0]
        if media in WAV_TYPES:
            return StreamFormat("wav", "pcm_s16le", WAV_SAMPLE_RATE_HZ), WAV_TYPES[0]
        if media == L16_TYPE:
            rate = _rate_param(params)
            return StreamFormat("raw", "pcm_s16le", rate), f"{L16_TYPE};rate={rate}"
    raise FieldError("accept", f"Accept must name audio/mpeg, audio/wav or audio/l16;rate=N (got {accept!r})")


def _by_preference(accept: str) -> list[tuple[str, list[str]]]:
    """`Accept`'s media types (lower case) with their other parameters, highest `q` first (RFC 9110 12.5.1)."""
    ranked: list[tuple[float, str, list[str]]] = []
    for item in accept.split(","):
        media, *params = (part.strip() for part in item.split(";"))
        quality = 1.0
        for param in params:
            key, _, value = param.partition("=")
            if key.strip().lower() == "q":
                try:
                    quality = float(value)
                except ValueError:
                    raise FieldError("accept", f"q must be a number in [0, 1] (got {value.strip()!r})") from None
        if quality > 0:
            ranked.append((quality, media.lower(), params))
    ranked.sort(key=lambda entry: -entry[0])  # stable: equals keep their order
    return [(media, params) for _, media, params in ranked]


def _rate_param(params: list[str]) -> int:
    for param in params:
        key, _, value = param.partition("=")
        if key.strip().lower() == "rate":
            if is_decimal(value.strip()) and int(value) in PCM_SAMPLE_RATES_HZ:
                return int(value)
            break
    allowed = ", ".join(str(r) for r in PCM_SAMPLE_RATES_HZ)
    raise FieldError("accept", f"audio/l16 needs rate= one of {allowed}")


def http_error_body(message: str, code: str = BAD_REQUEST) -> dict[str, Any]:
    """jambonz reads `error`; `code` is ours (busy, not_ready, text_too_long, ...)."""
    return {"error": message, "code": code}


# ---- WebSocket -----------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class StreamQuery:
    voice: str | None
    language: str | None
    output: StreamFormat  # raw PCM16 at the requested rate
    seed: int | None  # our extension (`&seed=N` in the streaming URL): seeded audio, served from the phrase cache



def parse_query(params: Mapping[str, str]) -> StreamQuery:
    raw = params.get("sampleRate") or str(DEFAULT_STREAM_RATE_HZ)
    if not is_decimal(raw) or int(raw) not in PCM_SAMPLE_RATES_HZ:
        allowed = ", ".join(str(r) for r in PCM_SAMPLE_RATES_HZ)
        raise FieldError("sampleRate", f"sampleRate must be one of {allowed} (got {raw!r})")
    return StreamQuery(params.get("voice") or None, params.get("language") or None,
                       StreamFormat("raw", "pcm_s16le", int(raw)), parse_seed("seed", params.get("seed") or None))


def connect_message(query: StreamQuery) -> str:
    return _json({"type": "connect", "data": {"sample_rate": query.output.sample_rate_hz, "base64_encoding": False}})


class Kind(enum.StrEnum):
    STREAM = "stream"  # text to speak
    FLUSH = "flush"  # speak what was sent now
    STOP = "stop"  # drop what is not yet played; the connection ends
    KEEPALIVE = "keepalive"


@dataclass(frozen=True, slots=True)
class Message:
    kind: Kind
    text: str = ""


def parse_message(raw: str | bytes) -> Message:
    """Raises FieldError; `error_message` renders it (the connection stays open)."""
    if isinstance(raw, bytes):
        raise FieldError("message", "jambonz sends JSON text frames; binary frames are not taken")
    obj = load_object(raw, MESSAGE_FIELDS)
    kind = obj.get("type")
    if kind not in Kind.__members__.values():
        raise FieldError("type", f"type must be one of {', '.join(k.value for k in Kind)} (got {kind!r})")
    text = obj.get("text")
    if kind != Kind.STREAM:
        if text is not None:
            raise FieldError("text", f"a {kind} message carries no text")
        return Message(Kind(str(kind)))
    if text is None:
        raise empty_message()
    if not isinstance(text, str):
        raise FieldError("text", "text must be a string")
    return Message(Kind.STREAM, text)


def error_message(message: str, code: str = BAD_REQUEST) -> str:
    """An error (the connection stays open). `code` is ours (busy, rate_limited, text_too_long, ...): jambonz
    reads `error`."""
    return _json({"type": "error", "error": message, "code": code})


def _json(body: Mapping[str, object]) -> str:
    return orjson.dumps(body).decode()


# ---- the protocols -------------------------------------------------------------------------------

JambonzHttpContext = Context[SynthRequest]


class JambonzHttpProtocol(HttpSpeechProtocol[SynthRequest]):
    name: ClassVar[str] = "jambonz_http"

    def parse(self, body: bytes) -> HttpSpeechRequest[SynthRequest]:
        session = self.session
        request = parse_http(body, session.transport.headers.get("accept"))
        seed = parse_seed("seed", session.transport.query.get("seed") or None)  # our extension, as in the stream URL
        routed = route(session.port.router, language_field="language", language=request.language)
        spec = make_spec(session.port, voice_id=resolve_voice(session.port, request.voice),
                         output_format=request.output, seed=seed, routed=routed,
                         markup=SSML_TAGS if request.ssml else frozenset())
        return HttpSpeechRequest(spec, request.text, request)

    def error_body(self, status: int, code: str, message: str, field: str | None) -> tuple[int, bytes]:
        return status, orjson.dumps(http_error_body(_described(field, message, code), code))

    def head(self, ctx: JambonzHttpContext) -> Head:
        return Head(200, ctx.state.content_type)


STREAM_CONTEXT_ID = "stream"
JambonzContext = Context[PieceJoiner]  # the context's text, as pieces come


class JambonzStreamProtocol(WireProtocol[PieceJoiner]):
    name: ClassVar[str] = "jambonz"

    def __init__(self, session: Session[PieceJoiner]) -> None:
        super().__init__(session)
        self.query: StreamQuery | None = None

    async def on_open(self) -> None:
        session = self.session
        try:
            self.query = parse_query(session.transport.query)
            route(session.port.router, language_field="language", language=self.query.language)
        except FieldError as error:
            self.query = None
            session.send(error_message(f"{error.field}: {error.message}", error.code))
            session.close(Outcome.BAD_INPUT, error.message)
            return
        session.send(connect_message(self.query))

    def on_refused(self, refusal: Refusal) -> None:
        self.session.send(error_message(refusal.reason, BUSY))

    def render_error(self, error: FieldError) -> None:
        code = BUSY if error.busy else error.code
        self.session.send(error_message(_described(error.field, error.message, code), code))

    async def on_message(self, message: str | bytes, now_s: float) -> None:
        session = self.session
        if self.query is None:
            return
        try:
            parsed = parse_message(message)
        except FieldError as error:
            session.reject(error)
            return
        ctx = session.contexts.get(STREAM_CONTEXT_ID)
        if parsed.kind == Kind.STOP:  # barge-in: what is not played yet is dropped; the connection ends
            if ctx is not None:
                ctx.stream.cancel()
            session.close(Outcome.COMPLETED, "stop")
        elif parsed.kind == Kind.FLUSH:
            if ctx is not None and ctx.stream.status == StreamStatus.OPEN:
                ctx.stream.flush(now_s)
        elif parsed.kind == Kind.STREAM:
            if ctx is None:
                ctx = await self._open(self.query)
                if ctx is None:
                    return
            try:
                await session.push_text(ctx, ctx.state.join(parsed.text), now_s)
            except StreamStateError as exc:
                session.reject(FieldError("type", str(exc), "bad_state"))

    async def _open(self, query: StreamQuery) -> JambonzContext | None:
        session = self.session
        routed = route(session.port.router, language_field="language", language=query.language)
        spec = make_spec(session.port, voice_id=resolve_voice(session.port, query.voice), output_format=query.output,
                         seed=query.seed, routed=routed)
        return await session.open_context(STREAM_CONTEXT_ID, spec, PieceJoiner())

    def render(self, ctx: JambonzContext, event: StreamEvent) -> None:
        if isinstance(event, AudioOut):
            self.session.send_audio(ctx, event.payload, event.duration_ms)
        elif isinstance(event, StreamDone) and event.status in (StreamStatus.BUSY, StreamStatus.FAILED):
            code = BUSY if event.status == StreamStatus.BUSY else "generation_failed"
            self.session.send(error_message(event.detail or event.reason, code))


def _described(field: str | None, message: str, code: str) -> str:
    """A bad request names its field; the core's own refusals (limits, busy) say it all."""
    return f"{field}: {message}" if field and code == BAD_REQUEST else message
