"""OpenAI `POST /v1/audio/speech`: the wire format, on the session core (one session, one context per
request, over agent_server/transport.py's HttpTransport).

- body: {"model", "input", "voice": "alloy" | {"id"}, "response_format": "pcm" | "wav", "speed",
  "instructions", "stream_format": "audio" | "sse", "seed" (our extension)}; `input` is held to the
  server's text limit like every protocol's text (`max_text_piece_chars`, 4096 by default: OpenAI's own).
- `stream_format: "audio"`: the audio is sent chunked as the engine produces it (`pcm`: 24 kHz PCM16 LE,
  no header; `wav`: a streaming WAV header first). `"sse"`: `data: {"type": "speech.audio.delta",
  "audio": base64}` events, then `{"type": "speech.audio.done", "usage": {...}}`.
- the status line waits for the first audio, so a request refused before any audio gets a real status:
  errors are {"error": {"message", "type", "param", "code"}} with 400 (bad request), 413 (body too
  large), 429 (busy, rate limited), 503 (not ready, shutting down, generation failed), 500 (a bug).
- barge-in: the client closing the response cancels the stream (the slot is free at the next step).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar

import orjson

from agent_server.audio import OutputFormat
from agent_server.compat.common import b64, check_model, load_object, make_spec, parse_seed, resolve_voice
from agent_server.errors import BAD_REQUEST, RATE_LIMITED, UNAVAILABLE, FieldError, empty_message
from agent_server.hub import Refusal
from agent_server.session import (
    CLOSE_GOING_AWAY,
    CLOSE_INTERNAL_ERROR,
    CLOSE_NORMAL,
    CLOSE_POLICY,
    CLOSE_TOO_BIG,
    CLOSE_TRY_AGAIN_LATER,
    Context,
    Session,
    WireProtocol,
)
from agent_server.speech import AudioOut, StreamDone, StreamEvent, StreamStatus
from agent_server.transport import Head
from synth.api import OUTPUT_SAMPLE_RATE_HZ, SAMPLES_PER_SPEECH_TOKEN

OUTPUT_FORMAT = OutputFormat("pcm_s16le", OUTPUT_SAMPLE_RATE_HZ)  # OpenAI's pcm: 24 kHz PCM16 LE mono
SPEECH_TOKENS_PER_S = OUTPUT_SAMPLE_RATE_HZ / SAMPLES_PER_SPEECH_TOKEN  # usage.output_tokens: 25 per second
FORMATS = ("pcm", "wav")
UNSERVED_FORMATS = ("mp3", "opus", "aac", "flac")
MIN_SPEED, MAX_SPEED = 0.25, 4.0
BODY_FIELDS = frozenset(
    {"model", "input", "voice", "response_format", "speed", "instructions", "stream_format", "seed"}
)
CONTEXT_ID = "speech"
MEDIA_TYPES = {"wav": "audio/wav", "pcm": "audio/pcm", "sse": "text/event-stream"}
# A close with no response started yet -> (status, type, code) of the error the client gets.
CLOSE_ERRORS: dict[int, tuple[int, str, str]] = {
    CLOSE_GOING_AWAY: (503, "server_error", "shutting_down"),
    CLOSE_POLICY: (400, "invalid_request_error", "bad_request"),
    CLOSE_TOO_BIG: (413, "invalid_request_error", "body_too_large"),
    CLOSE_TRY_AGAIN_LATER: (429, "rate_limit_exceeded", "busy"),
}
INTERNAL_ERROR = (500, "server_error", "internal_error")


@dataclass(frozen=True, slots=True)
class SpeechRequest:
    model: str
    input: str
    voice: str
    response_format: str
    stream_format: str
    speed: float
    seed: int | None


def parse_request(body: object, variant: str) -> SpeechRequest:
    """A decoded JSON body -> the request. Raises FieldError naming the parameter at fault."""
    body = load_object(body, BODY_FIELDS, what="body", unknown_message="Unrecognized request argument supplied: {name}")
    model = body.get("model")
    if not isinstance(model, str) or not model:
        raise FieldError("model", "you must provide a model parameter")
    check_model("model", model, variant)
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
    response_format = body.get("response_format", "mp3")
    if response_format in UNSERVED_FORMATS:
        raise FieldError("response_format", f"response_format {response_format!r} is not served here: use pcm or wav")
    if response_format not in FORMATS:
        raise FieldError("response_format", f"response_format must be one of {', '.join(FORMATS)}")
    stream_format = body.get("stream_format", "audio")
    if stream_format not in ("audio", "sse"):
        raise FieldError("stream_format", "stream_format must be audio or sse")
    speed = body.get("speed", 1.0)
    if isinstance(speed, bool) or not isinstance(speed, (int, float)) or not MIN_SPEED <= speed <= MAX_SPEED:
        raise FieldError("speed", f"speed must be a number in [{MIN_SPEED}, {MAX_SPEED}]")
    return SpeechRequest(model, text, voice, response_format, stream_format, float(speed),
                         parse_seed("seed", body.get("seed")))


def error_body(message: str, param: str | None, kind: str, code: str | None) -> bytes:
    return orjson.dumps({"error": {"message": message, "type": kind, "param": param, "code": code}})


@dataclass(slots=True)
class SpeechState:
    request: SpeechRequest
    sent_samples: int = 0  # 24 kHz samples in the body so far (SSE usage)


SpeechContext = Context[SpeechState]


class OpenAISpeechProtocol(WireProtocol[SpeechState]):
    name: ClassVar[str] = "openai"

    def __init__(self, session: Session[SpeechState]) -> None:
        super().__init__(session)
        self._head_sent = False

    # ---- the request -----------------------------------------------------------------------------

    async def on_message(self, message: str | bytes, now_s: float) -> None:
        session = self.session
        if self._head_sent:
            return
        try:
            body = orjson.loads(message)
        except orjson.JSONDecodeError:
            session.reject(FieldError("", "the body must be JSON"))
            return
        try:
            request = parse_request(body, session.variant)
            spec = make_spec(session.hub, voice_id=resolve_voice(session.hub, request.voice),
                             output_format=OUTPUT_FORMAT, seed=request.seed, language=None)
        except FieldError as error:
            session.reject(error)
            return
        ctx = await session.open_context(CONTEXT_ID, spec, SpeechState(request))
        if ctx is None:
            return
        if not await session.push_text(ctx, request.input, now_s):
            ctx.stream.cancel()
            return
        ctx.stream.end(now_s)

    # ---- refusals and errors: a status line while none went out -------------------------------------

    def on_refused(self, refusal: Refusal) -> None:
        if refusal.unavailable:
            self._error_response(503, refusal.reason, None, "server_error", "not_ready")
        else:
            self._error_response(429, refusal.reason, None, "rate_limit_exceeded", "busy")

    def render_error(self, error: FieldError) -> None:
        if self._head_sent:
            self.session.close(CLOSE_INTERNAL_ERROR, error.message)
            return
        param = error.field or None
        if error.busy and error.code == UNAVAILABLE:
            self._error_response(503, error.message, param, "server_error", "not_ready")
            self.session.close(CLOSE_GOING_AWAY, error.message)
        elif error.busy or error.code == RATE_LIMITED:
            busy_code = "rate_limited" if error.code == RATE_LIMITED else "busy"
            self._error_response(429, error.message, param, "rate_limit_exceeded", busy_code)
            self.session.close(CLOSE_TRY_AGAIN_LATER, error.message)
        else:
            code = None if error.code == BAD_REQUEST else error.code
            self._error_response(400, error.message, param, "invalid_request_error", code)
            self.session.close(CLOSE_POLICY, error.message)

    def on_close(self, code: int, reason: str) -> None:
        if not self._head_sent:
            status, kind, error_code = CLOSE_ERRORS.get(code, INTERNAL_ERROR)
            self._error_response(status, reason or error_code, None, kind, error_code)

    def _error_response(self, status: int, message: str, param: str | None, kind: str, code: str | None) -> None:
        self._head_sent = True
        self.session.send(Head(status, "application/json"))
        self.session.send(error_body(message, param, kind, code))

    # ---- the audio ---------------------------------------------------------------------------------

    def _start(self, ctx: SpeechContext) -> None:
        request = ctx.state.request
        kind = "sse" if request.stream_format == "sse" else request.response_format
        headers = [("x-request-id", self.session.session_id)]
        if kind == "sse":
            headers.append(("cache-control", "no-cache"))
        self._head_sent = True
        self.session.send(Head(200, MEDIA_TYPES[kind], tuple(headers)))
        if kind == "wav":
            self.session.send(OUTPUT_FORMAT.wav_header())

    def render(self, ctx: SpeechContext, event: StreamEvent) -> None:
        session = self.session
        if isinstance(event, AudioOut):
            if not self._head_sent:
                self._start(ctx)
            ctx.state.sent_samples += len(event.payload) // OUTPUT_FORMAT.bytes_per_sample
            if ctx.state.request.stream_format == "sse":
                delta = {"type": "speech.audio.delta", "audio": b64(event.payload)}
                session.send_audio(ctx, b"data: " + orjson.dumps(delta) + b"\n\n", event.duration_ms)
            else:
                session.send_audio(ctx, event.payload, event.duration_ms)
        elif isinstance(event, StreamDone):
            self._render_done(ctx, event)

    def _render_done(self, ctx: SpeechContext, event: StreamDone) -> None:
        session = self.session
        if event.status == StreamStatus.COMPLETED:
            if not self._head_sent:
                self._start(ctx)  # nothing speakable in the input: an empty audio body
            if ctx.state.request.stream_format == "sse":
                session.send(self._sse_done(ctx))
            session.close(CLOSE_NORMAL, "")
            return
        if self._head_sent:  # a failure after audio started ends the body early
            session.close(CLOSE_INTERNAL_ERROR, event.detail or event.reason)
        elif event.status == StreamStatus.BUSY:
            self._error_response(429, event.detail or "no free slot", None, "rate_limit_exceeded", "busy")
            session.close(CLOSE_TRY_AGAIN_LATER, event.detail)
        else:
            self._error_response(503, event.detail or "generation failed", None, "server_error", event.reason)
            session.close(CLOSE_INTERNAL_ERROR, event.detail)

    def _sse_done(self, ctx: SpeechContext) -> bytes:
        input_tokens = ctx.stream.text_chars
        output_tokens = round(ctx.state.sent_samples / OUTPUT_SAMPLE_RATE_HZ * SPEECH_TOKENS_PER_S)
        usage: dict[str, Any] = {"input_tokens": input_tokens, "output_tokens": output_tokens,
                                 "total_tokens": input_tokens + output_tokens}
        return b"data: " + orjson.dumps({"type": "speech.audio.done", "usage": usage}) + b"\n\n"
