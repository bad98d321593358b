"""OpenAI `POST /v1/audio/speech`: the wire format, on the HTTP speech base (protocols/http_speech.py).

- body: {"model", "input", "voice": "alloy" | {"id"}, "response_format": "mp3" (default) | "opus" | "aac" |
  "flac" | "wav" | "pcm", "speed", "instructions", "stream_format": "audio" | "sse", "seed" (our
  extension)}; `input` is held to the server's text limit like every protocol's text
  (`max_text_piece_chars`, 4096 by default: OpenAI's own).
- formats (protocols/vendor_formats.openai_format), all 24 kHz mono: mp3 (64 kbit/s), opus (Ogg), aac (ADTS), flac,
  wav (a streaming header: sizes "unknown"), pcm (PCM16 LE, no header). Compressed formats are encoded
  off the event loop, their first bytes out with the first audio.
- `stream_format: "audio"`: the audio is sent chunked as the engine produces it. `"sse"`: `data:
  {"type": "speech.audio.delta", "audio": base64}` events, then `{"type": "speech.audio.done", "usage"}`.
- errors: {"error": {"message", "type", "param", "code"}} with the status protocols/http_speech.py chooses.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar

import orjson

from agent_server.audio.codecs import StreamFormat
from agent_server.core.events import AudioOut, parse_speed
from agent_server.core.routing import Routed, Router
from agent_server.core.session import Context
from agent_server.core.transport import Head
from agent_server.errors import BAD_REQUEST, FieldError, empty_message
from agent_server.protocols.common import b64, load_object, make_spec, parse_seed, resolve_voice, route
from agent_server.protocols.http_speech import (
    STATUS_BAD_REQUEST,
    STATUS_BUSY,
    STATUS_TOO_LARGE,
    HttpSpeechProtocol,
    HttpSpeechRequest,
)
from agent_server.protocols.vendor_formats import openai_format
from synth.api import OUTPUT_SAMPLE_RATE_HZ, SAMPLES_PER_SPEECH_TOKEN

SPEECH_TOKENS_PER_S = OUTPUT_SAMPLE_RATE_HZ / SAMPLES_PER_SPEECH_TOKEN  # usage.output_tokens: 25 per second
MS_PER_S = 1_000.0
BODY_FIELDS = frozenset(
    {"model", "input", "voice", "response_format", "speed", "instructions", "stream_format", "seed"}
)
SSE_MEDIA_TYPE = "text/event-stream"


@dataclass(frozen=True, slots=True)
class SpeechRequest:
    model: str
    routed: Routed  # the model that serves it here (OpenAI sends no language: `model` may end in one, tts-1-es)
    input: str
    voice: str
    output: StreamFormat
    stream_format: str
    speed: float
    seed: int | None


def parse_request(body: object, router: Router) -> SpeechRequest:
    """A decoded JSON body -> the request. Raises FieldError naming the parameter at fault."""
    body = load_object(body, BODY_FIELDS, what="body", unknown_message="Unrecognized request argument supplied: {name}")
    model = body.get("model")
    if not isinstance(model, str) or not model:
        raise FieldError("model", "you must provide a model parameter")
    routed = route(router, model_field="model", model=model)
    text = body.get("input")
    if text is not None and not isinstance(text, str):
        raise FieldError("input", "input must be a string")
    if text is None or not text.strip():
        raise empty_message(field="input")
    voice = body.get("voice")
    if isinstance(voice, dict):
        voice = voice.get("id")
    if not isinstance(voice, str) or not voice:
        raise FieldError("voice", 'voice must be a voice name or {"id": "..."}')
    output = openai_format(body.get("response_format"))
    stream_format = body.get("stream_format", "audio")
    if stream_format not in ("audio", "sse"):
        raise FieldError("stream_format", "stream_format must be audio or sse")
    speed = parse_speed("speed", body.get("speed"))
    return SpeechRequest(model, routed, text, voice, output, stream_format, speed, parse_seed("seed", body.get("seed")))


def error_body(message: str, param: str | None, kind: str, code: str | None) -> bytes:
    return orjson.dumps({"error": {"message": message, "type": kind, "param": param, "code": code}})


@dataclass(slots=True)
class SpeechState:
    request: SpeechRequest
    sent_ms: float = 0.0  # audio in the body so far (SSE usage)


SpeechContext = Context[SpeechState]


class OpenAISpeechProtocol(HttpSpeechProtocol[SpeechState]):
    name: ClassVar[str] = "openai"
    text_field: ClassVar[str] = "input"

    def parse(self, body: bytes) -> HttpSpeechRequest[SpeechState]:
        session = self.session
        request = parse_request(body, session.port.router)
        spec = make_spec(session.port, voice_id=resolve_voice(session.port, request.voice),
                         output_format=request.output, seed=request.seed, routed=request.routed,
                         speed=request.speed)
        return HttpSpeechRequest(spec, request.input, SpeechState(request))

    def error_body(self, status: int, code: str, message: str, field: str | None) -> tuple[int, bytes]:
        if status in (STATUS_BAD_REQUEST, STATUS_TOO_LARGE):
            kind = "invalid_request_error"
        elif status == STATUS_BUSY:
            kind = "rate_limit_exceeded"
        else:
            kind = "server_error"
        return status, error_body(message, field, kind, None if code == BAD_REQUEST else code)

    def head(self, ctx: SpeechContext) -> Head:
        request = ctx.state.request
        headers = [("x-request-id", self.session.session_id)]
        if request.stream_format == "sse":
            return Head(200, SSE_MEDIA_TYPE, (*headers, ("cache-control", "no-cache")))
        return Head(200, request.output.mime_type, tuple(headers))

    def render_audio(self, ctx: SpeechContext, event: AudioOut) -> None:
        ctx.state.sent_ms += event.duration_ms
        if ctx.state.request.stream_format == "sse":
            delta = {"type": "speech.audio.delta", "audio": b64(event.payload)}
            self.session.send_audio(ctx, b"data: " + orjson.dumps(delta) + b"\n\n", event.duration_ms)
        else:
            self.session.send_audio(ctx, event.payload, event.duration_ms)

    def render_completed(self, ctx: SpeechContext) -> None:
        if ctx.state.request.stream_format != "sse":
            return
        input_tokens = ctx.stream.text_chars
        output_tokens = round(ctx.state.sent_ms / MS_PER_S * SPEECH_TOKENS_PER_S)
        usage: dict[str, Any] = {"input_tokens": input_tokens, "output_tokens": output_tokens,
                                 "total_tokens": input_tokens + output_tokens}
        self.session.send(b"data: " + orjson.dumps({"type": "speech.audio.done", "usage": usage}) + b"\n\n")
