"""jambonz custom TTS vendor API: the HTTP form and the streaming WebSocket form. Pure wire format.

A jambonz application names this server as a custom speech vendor (portal: a TTS HTTP URL and/or a
streaming WebSocket URL, and an API key sent as `Authorization: Bearer <key>`).

HTTP (`POST`, jambonz's non-streaming API): body `{"text", "type": "text" | "ssml", "language", "voice"}`;
the answer is the audio with its type in `Content-Type`, which jambonz takes as `audio/mpeg` (preferred,
what it asks for with `Accept: audio/mpeg`), `audio/wav`, or `audio/l16;rate=N`. SSML: jambonz sends it
when the text starts with `<speak`; this engine does not render SSML markup, so the text inside the
markup is spoken (documented in docs/compatibility.md), and markup that is not well-formed is refused.
Errors: an HTTP error status with `{"error": message}`.

WebSocket (jambonz's streaming API): jambonz connects with `?voice=...&language=...&sampleRate=N`; the
server answers `{"type": "connect", "data": {"sample_rate": N, "base64_encoding": false}}`, then jambonz
sends `{"type": "stream", "text"}` pieces, `{"type": "flush"}` (speak what was sent) and
`{"type": "stop"}` (stop: drop what is not yet played and end the connection), and may send
`{"type": "keepalive"}`; audio goes back as binary frames of PCM16 LE mono at N Hz. Errors:
`{"type": "error", "error": message}`.
"""

from __future__ import annotations

import enum
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any
from xml.etree import ElementTree

import orjson

from agent_server.codecs import CODEC_SAMPLE_RATES_HZ, StreamFormat
from agent_server.compat.common import CompatError, load_object

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
    text: str  # what is spoken (SSML: the text inside the markup)
    language: str | None
    voice: str | None  # as given: the caller maps it onto our voices (common.resolve_voice)
    output: StreamFormat
    content_type: str  # the response's Content-Type, in jambonz's spelling


def parse_http(body: object, accept: str | None) -> SynthRequest:
    """Raises CompatError; `http_error_body` renders it."""
    obj = load_object(body, HTTP_BODY_FIELDS, what="body")
    text, kind = obj.get("text"), obj.get("type", "text")
    if not isinstance(text, str) or not text.strip():
        raise CompatError("text", "text is required and must be a non-empty string")
    if kind not in ("text", "ssml"):
        raise CompatError("type", 'type must be "text" or "ssml"')
    for name in ("language", "voice"):
        if obj.get(name) is not None and not isinstance(obj[name], str):
            raise CompatError(name, f"{name} must be a string")
    spoken = ssml_text(text) if kind == "ssml" else text
    output, content_type = http_format(accept)
    return SynthRequest(spoken, obj.get("language"), obj.get("voice"), output, content_type)


def http_format(accept: str | None) -> tuple[StreamFormat, str]:
    """The first type of `Accept` we serve (no Accept, or `*/*`: MP3, jambonz's preferred format)."""
    for item in (accept or "audio/mpeg").split(","):
        media, *params = (part.strip() for part in item.split(";"))
        media = media.lower()
        if media in MP3_TYPES or media in ("*/*", "audio/*"):
            return StreamFormat("mp3", "mp3", MP3_SAMPLE_RATE_HZ, MP3_BITRATE_BPS), MP3_TYPES[0]
        if media in WAV_TYPES:
            return StreamFormat("wav", "pcm_s16le", WAV_SAMPLE_RATE_HZ), WAV_TYPES[0]
        if media == L16_TYPE:
            rate = _rate_param(params)
            return StreamFormat("raw", "pcm_s16le", rate), f"{L16_TYPE};rate={rate}"
    raise CompatError("accept", f"Accept must name audio/mpeg, audio/wav or audio/l16;rate=N (got {accept!r})")


def _rate_param(params: list[str]) -> int:
    for param in params:
        key, _, value = param.partition("=")
        if key.strip().lower() == "rate":
            if value.strip().isdigit() and int(value) in PCM_SAMPLE_RATES_HZ:
                return int(value)
            break
    allowed = ", ".join(str(r) for r in PCM_SAMPLE_RATES_HZ)
    raise CompatError("accept", f"audio/l16 needs rate= one of {allowed}")


def ssml_text(ssml: str) -> str:
    """The text an SSML document speaks (its markup is not rendered here)."""
    try:
        root = ElementTree.fromstring(ssml)
    except ElementTree.ParseError as exc:
        raise CompatError("text", f"the SSML is not well-formed: {exc}") from None
    spoken = " ".join(" ".join(root.itertext()).split())
    if not spoken:
        raise CompatError("text", "the SSML speaks no text")
    return spoken


def http_error_body(message: str) -> dict[str, Any]:
    return {"error": message}


# ---- WebSocket -----------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class StreamQuery:
    voice: str | None
    language: str | None
    output: StreamFormat  # raw PCM16 at the requested rate


def parse_query(params: Mapping[str, str]) -> StreamQuery:
    raw = params.get("sampleRate") or str(DEFAULT_STREAM_RATE_HZ)
    if not raw.isdigit() or int(raw) not in PCM_SAMPLE_RATES_HZ:
        allowed = ", ".join(str(r) for r in PCM_SAMPLE_RATES_HZ)
        raise CompatError("sampleRate", f"sampleRate must be one of {allowed} (got {raw!r})")
    return StreamQuery(params.get("voice") or None, params.get("language") or None,
                       StreamFormat("raw", "pcm_s16le", int(raw)))


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
    """Raises CompatError; `error_message` renders it (the connection stays open)."""
    if isinstance(raw, bytes):
        raise CompatError("message", "jambonz sends JSON text frames; binary frames are not taken")
    obj = load_object(raw, MESSAGE_FIELDS)
    kind = obj.get("type")
    if kind not in Kind.__members__.values():
        raise CompatError("type", f"type must be one of {', '.join(k.value for k in Kind)} (got {kind!r})")
    text = obj.get("text", "")
    if kind == Kind.STREAM and not isinstance(text, str):
        raise CompatError("text", "text must be a string")
    if kind != Kind.STREAM and obj.get("text") is not None:
        raise CompatError("text", f"a {kind} message carries no text")
    return Message(Kind(str(kind)), text if kind == Kind.STREAM else "")


def error_message(message: str) -> str:
    return _json({"type": "error", "error": message})


def _json(body: Mapping[str, object]) -> str:
    return orjson.dumps(body).decode()
