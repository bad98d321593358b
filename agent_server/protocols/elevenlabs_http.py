"""ElevenLabs text to speech over HTTP: the wire format, on the HTTP speech base (protocols/http_speech.py).

Routes (`POST`, JSON body), as the `elevenlabs` SDK calls them:
- `/v1/text-to-speech/{voice_id}` (`text_to_speech.convert`): the audio, streamed as it is made;
- `/v1/text-to-speech/{voice_id}/stream` (`.stream`): the same;
- `/v1/text-to-speech/{voice_id}/with-timestamps` (`.convert_with_timestamps`): one JSON object,
  `{"audio_base64", "alignment", "normalized_alignment"}`;
- `/v1/text-to-speech/{voice_id}/stream/with-timestamps` (`.stream_with_timestamps`): newline-delimited
  JSON objects of that shape, one per piece of audio or alignment.

Query: `output_format` (`formats.elevenlabs_format`, default `mp3_44100_128`), `enable_logging` and
`optimize_streaming_latency` (accepted, ignored). Body: `text` (required), `model_id`, `language_code`,
`seed` (served); `voice_settings`, `pronunciation_dictionary_locators`, `previous_text`, `next_text`,
`previous_request_ids`, `next_request_ids`, `use_pvc_as_ivc`, `apply_language_text_normalization`,
`audio_effects` (type-checked, ignored); `apply_text_normalization` (`auto`, `on`: numbers, money, times ...
said as words, agent_server/text/normalize/; `off`: as written); anything else is refused.

Bodies: `/v1/text-to-speech/{voice_id}` and `/stream`: the audio bytes in `output_format`, as they are
encoded. `/with-timestamps`: one JSON object, written as the audio comes (`{"audio_base64": "` first, the
base64 text piece by piece, the alignment of the whole request at the end). `/stream/with-timestamps`: one
line per piece of audio (`alignment` null), and after each segment's audio a line with `audio_base64` ""
carrying that segment's alignment.

Alignment times are seconds from the start of the request's audio (what Pipecat's HTTP service reads), MP3's
encoder delay included (`codecs.StreamFormat.lead_ms`); `normalized_alignment` is the same: both are on the
characters the client sent (a normalised "$4.50" has the times of its words). Errors: a bad request is 422
`{"detail": [{"loc": ["body"|"query", field], "msg", "type"}]}`
(the SDK's `UnprocessableEntityError`); other failures `{"detail": {"status", "message"}}` with their status.
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, ClassVar

import orjson

from agent_server.audio.codecs import StreamFormat
from agent_server.core.events import AudioOut, SegmentDone
from agent_server.core.routing import Routed, Router
from agent_server.core.session import Context
from agent_server.core.transport import Head
from agent_server.errors import FieldError, empty_message
from agent_server.protocols.common import (
    b64,
    elevenlabs_normalization,
    load_object,
    make_spec,
    parse_seed,
    place_segment,
    resolve_voice,
    route,
    voice_settings_speed,
)
from agent_server.protocols.http_speech import STATUS_BAD_REQUEST, Base64Stream, HttpSpeechProtocol, HttpSpeechRequest
from agent_server.protocols.vendor_formats import elevenlabs_format
from agent_server.text.markup import elevenlabs_tags
from agent_server.text.timestamps import ContextAlignment, seconds

STATUS_UNPROCESSABLE = 422
QUERY_FIELDS = frozenset({"output_format", "enable_logging", "optimize_streaming_latency"})
BODY_FIELDS = frozenset(
    {
        "text",
        "model_id",
        "language_code",
        "seed",
        "voice_settings",
        "pronunciation_dictionary_locators",
        "previous_text",
        "next_text",
        "previous_request_ids",
        "next_request_ids",
        "use_pvc_as_ivc",
        "apply_text_normalization",
        "apply_language_text_normalization",
        "audio_effects",
    }
)
_OPTIONAL_TYPES: Mapping[str, tuple[type, ...]] = {
    "voice_settings": (dict,),
    "audio_effects": (dict,),
    "pronunciation_dictionary_locators": (list,),
    "previous_request_ids": (list,),
    "next_request_ids": (list,),
    "previous_text": (str,),
    "next_text": (str,),
    "model_id": (str,),
    "language_code": (str,),
    "use_pvc_as_ivc": (bool,),
    "apply_language_text_normalization": (bool,),
}


@dataclass(frozen=True, slots=True)
class SpeechRequest:
    voice_id: str  # as given: the caller maps it onto our voices (common.resolve_voice)
    text: str
    model_id: str | None
    routed: Routed  # the model that serves model_id and language_code here
    seed: int | None
    output: StreamFormat
    speed: float  # voice_settings.speed
    normalize: bool  # apply_text_normalization is not "off"
    streamed: bool  # /stream routes: the client reads as it comes (every route streams the audio)
    timestamps: bool  # /with-timestamps routes: JSON bodies with alignment


def parse_request(
    voice_id: str, query: Mapping[str, str], body: object, router: Router, *, streamed: bool, timestamps: bool
) -> SpeechRequest:
    """Raises FieldError; `error_body` renders it."""
    output = elevenlabs_format(query.get("output_format"))
    obj = load_object(body, BODY_FIELDS, what="body", unknown_message="extra field {name!r} is not permitted")
    text = obj.get("text")
    if text is not None and not isinstance(text, str):
        raise FieldError("text", "text must be a string")
    if text is None or not text.strip():
        raise empty_message()
    check_optional_types(obj, _OPTIONAL_TYPES)
    model_id = obj.get("model_id")
    return SpeechRequest(
        voice_id=voice_id,
        text=text,
        model_id=model_id,
        routed=route(router, model_field="model_id", model=model_id, language_field="language_code",
                     language=obj.get("language_code")),
        seed=parse_seed("seed", obj.get("seed")),
        output=output,
        speed=voice_settings_speed(obj.get("voice_settings")),
        normalize=elevenlabs_normalization(obj.get("apply_text_normalization")),
        streamed=streamed,
        timestamps=timestamps,
    )


def check_optional_types(obj: Mapping[str, Any], types: Mapping[str, tuple[type, ...]]) -> None:
    for name, kinds in types.items():
        value = obj.get(name)
        if value is not None and not isinstance(value, kinds):
            raise FieldError(name, f"{name} must be a {' or '.join(k.__name__ for k in kinds)}")


def field_path(name: str) -> list[str | int]:
    """"inputs[0].voice_id" -> ["inputs", 0, "voice_id"]: a `loc` as FastAPI writes it."""
    return [int(part) if part.isdigit() else part for part in re.split(r"\.|\[(\d+)\]\.?", name) if part]


def error_body(exc: FieldError) -> tuple[int, dict[str, Any]]:
    """A refused request: 422 with FastAPI's validation shape, as ElevenLabs answers."""
    where = "query" if exc.field in QUERY_FIELDS else "body"
    detail = {"loc": [where, *field_path(exc.field)], "msg": exc.message, "type": exc.code}
    return STATUS_UNPROCESSABLE, {"detail": [detail]}


def status_body(status: str, message: str) -> dict[str, Any]:
    """Any other failure (busy, rate limited, generation failed, not ready), with its HTTP status."""
    return {"detail": {"status": status, "message": message}}


def alignment(chars: Sequence[str], start_ms: Sequence[int], end_ms: Sequence[int]) -> dict[str, Any]:
    return {
        "characters": list(chars),
        "character_start_times_seconds": seconds(start_ms),
        "character_end_times_seconds": seconds(end_ms),
    }


WITH_TIMESTAMPS_OPEN = b'{"audio_base64":"'


def with_timestamps_close(chars: Sequence[str], start_ms: Sequence[int], end_ms: Sequence[int],
                          voice_segments: list[dict[str, Any]] | None = None) -> bytes:
    """`/with-timestamps`: what ends the object after the audio's base64 text: the whole request's
    alignment (`normalized_alignment` is the same: the request's own characters); a dialogue's
    `voice_segments` (protocols/elevenlabs_dialogue.py)."""
    aligned = orjson.dumps(alignment(chars, start_ms, end_ms))
    tail = b"" if voice_segments is None else b',"voice_segments":' + orjson.dumps(voice_segments)
    return b'","alignment":' + aligned + b',"normalized_alignment":' + aligned + tail + b"}"


def stream_line(audio: bytes, aligned: dict[str, Any] | None,
                voice_segments: list[dict[str, Any]] | None = None) -> bytes:
    """One line of `/stream/with-timestamps`: a piece of audio, or ("") the alignment of a segment
    (a dialogue's lines carry `voice_segments`)."""
    body: dict[str, Any] = {"audio_base64": b64(audio), "alignment": aligned, "normalized_alignment": aligned}
    if voice_segments is not None:
        body["voice_segments"] = voice_segments
    return orjson.dumps(body) + b"\n"


def media_type(request: SpeechRequest) -> str:
    return "application/json" if request.timestamps else request.output.mime_type


def voice_segment(voice_id: str, start_ms: float, end_ms: float, first_char: int, end_char: int,
                  line: int) -> dict[str, Any]:
    """One `voice_segments` entry of a dialogue: a line's voice, its audio span, its characters."""
    return {"voice_id": voice_id, "start_time_seconds": round(start_ms / 1000.0, 3),
            "end_time_seconds": round(end_ms / 1000.0, 3), "character_start_index": first_char,
            "character_end_index": end_char, "dialogue_input_index": line}


@dataclass(slots=True)
class LineTrack:
    """A dialogue's lines (protocols/elevenlabs_dialogue.py), each pushed as a turn of its own (line i is turn
    i + 1: `SpeechStream.start_turn`): their voices as the client named them, and each placed segment's line."""

    voice_ids: list[str]
    segment_lines: list[int] = field(default_factory=list)

    @staticmethod
    def line_of(turn: int) -> int:
        return turn - 1

    def whole_request(self, alignment: ContextAlignment, chars_kept: int) -> list[dict[str, Any]]:
        """`voice_segments` of the whole answer: one per line, over the first `chars_kept` characters."""
        out: list[dict[str, Any]] = []
        first_char = 0
        for seg, line in zip(alignment.segments, self.segment_lines, strict=True):
            end_char = min(first_char + len(seg.chars), chars_kept)
            if out and out[-1]["dialogue_input_index"] == line:
                out[-1]["end_time_seconds"] = round(seg.audio_end_ms / 1000.0, 3)
                out[-1]["character_end_index"] = end_char
            else:
                out.append(voice_segment(self.voice_ids[line], seg.audio_start_ms, seg.audio_end_ms, first_char,
                                         end_char, line))
            first_char += len(seg.chars)
        return out


# ---- the protocol --------------------------------------------------------------------------------


@dataclass(slots=True)
class HttpState:
    request: SpeechRequest
    alignment: ContextAlignment
    audio_b64: Base64Stream = field(default_factory=Base64Stream)  # /with-timestamps: the audio as it comes
    opened: bool = False  # /with-timestamps: the object's opening went out
    lines: LineTrack | None = None  # a dialogue: its bodies carry `voice_segments`


HttpContext = Context[HttpState]


class ElevenLabsHttpProtocol(HttpSpeechProtocol[HttpState]):
    """`POST /v1/text-to-speech/{voice_id}`; the subclasses below are its other three routes."""

    name: ClassVar[str] = "elevenlabs_http"
    streamed: ClassVar[bool] = False
    timestamps: ClassVar[bool] = False

    def parse(self, body: bytes) -> HttpSpeechRequest[HttpState]:
        session = self.session
        transport = session.transport
        request = parse_request(transport.path_params.get("voice_id", ""), transport.query, body,
                                session.port.router, streamed=self.streamed, timestamps=self.timestamps)
        spec = make_spec(session.port, voice_id=resolve_voice(session.port, request.voice_id),
                         output_format=request.output, seed=request.seed, routed=request.routed,
                         speed=request.speed, markup=elevenlabs_tags(request.model_id), normalize=request.normalize)
        state = HttpState(request, ContextAlignment(lead_ms=request.output.lead_ms))
        return HttpSpeechRequest(spec, request.text, state)

    def error_body(self, status: int, code: str, message: str, field: str | None) -> tuple[int, bytes]:
        if status == STATUS_BAD_REQUEST:
            status, body = error_body(FieldError(field or "body", message, code))
        else:
            body = status_body(code, message)
        return status, orjson.dumps(body)

    def head(self, ctx: HttpContext) -> Head:
        return Head(200, media_type(ctx.state.request), (("request-id", self.session.session_id),))

    def render_audio(self, ctx: HttpContext, event: AudioOut) -> None:
        state = ctx.state
        if not state.request.timestamps:
            self.session.send_audio(ctx, event.payload, event.duration_ms)
        elif state.request.streamed:
            no_segments: list[dict[str, Any]] | None = None if state.lines is None else []
            self.session.send_audio(ctx, stream_line(event.payload, None, no_segments), event.duration_ms)
        else:
            self.session.send_audio(ctx, self._opening(state) + state.audio_b64.push(event.payload), event.duration_ms)

    def render_segment(self, ctx: HttpContext, event: SegmentDone) -> None:
        if not event.text:
            return  # a pause (<break>): silence, no characters
        state = ctx.state
        seg = place_segment(state.alignment, event)
        voice_segments = None
        if state.lines is not None:
            line = state.lines.line_of(event.turn)
            state.lines.segment_lines.append(line)
            voice_segments = [voice_segment(state.lines.voice_ids[line], seg.audio_start_ms, seg.audio_end_ms, 0,
                                            len(seg.chars), line)]
        if state.request.timestamps and state.request.streamed:
            self.session.send(stream_line(b"", alignment(seg.chars, seg.start_ms, seg.end_ms), voice_segments), ctx)

    def render_completed(self, ctx: HttpContext) -> None:
        state = ctx.state
        if state.request.timestamps and not state.request.streamed:
            aligned = state.alignment
            chars, start_ms, end_ms = aligned.chars, aligned.start_ms, aligned.end_ms
            if chars and chars[-1].isspace() and not state.request.text[-1:].isspace():
                del chars[-1], start_ms[-1], end_ms[-1]  # the zero-length space that ended the last segment
            voice_segments = None if state.lines is None else state.lines.whole_request(aligned, len(chars))
            self.session.send(self._opening(state) + state.audio_b64.finish()
                              + with_timestamps_close(chars, start_ms, end_ms, voice_segments))

    @staticmethod
    def _opening(state: HttpState) -> bytes:
        if state.opened:
            return b""
        state.opened = True
        return WITH_TIMESTAMPS_OPEN


class ElevenLabsStreamProtocol(ElevenLabsHttpProtocol):
    streamed: ClassVar[bool] = True


class ElevenLabsWithTimestampsProtocol(ElevenLabsHttpProtocol):
    timestamps: ClassVar[bool] = True


class ElevenLabsStreamWithTimestampsProtocol(ElevenLabsHttpProtocol):
    streamed: ClassVar[bool] = True
    timestamps: ClassVar[bool] = True
