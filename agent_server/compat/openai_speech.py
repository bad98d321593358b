"""OpenAI `POST /v1/audio/speech`, translated onto `SpeechStream`.

- body: {"model", "input", "voice": "alloy" | {"id"}, "response_format": "pcm" | "wav", "speed",
  "instructions", "stream_format": "audio" | "sse", "seed" (our extension)}.
- `stream_format: "audio"`: the audio is sent chunked as the engine produces it (`pcm`: 24 kHz PCM16 LE,
  no header; `wav`: a streaming WAV header first). `"sse"`: `data: {"type": "speech.audio.delta",
  "audio": base64}` events, then `{"type": "speech.audio.done", "usage": {...}}`.
- errors: {"error": {"message", "type", "param", "code"}} with 400 (bad request), 429 (busy), 503.
- barge-in: the client closing the response cancels the stream (the slot is free at the next step).
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass
from functools import partial
from typing import Any, AsyncIterator, ClassVar

import orjson
import structlog
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse

from agent_server.audio import OutputFormat
from agent_server.compat.common import (CompatError, b64, check_model, load_object, make_spec, parse_seed,
                                        resolve_voice)
from agent_server.auth import Principal, principal_of
from agent_server.hub import Hub
from agent_server.observers import ContextFinished, SessionClosed, SessionOpened
from agent_server.speech import AudioOut, DoneReason, SpeechStream, StreamDone, StreamEvent, StreamStatus
from agent_server.voices import VoiceError

log = structlog.get_logger("agent_server.compat.openai")

MAX_INPUT_CHARS = 4096
SAMPLE_RATE_HZ = 24_000  # OpenAI's pcm is 24 kHz PCM16 LE mono
FORMATS = ("pcm", "wav")
UNSERVED_FORMATS = ("mp3", "opus", "aac", "flac")
MIN_SPEED, MAX_SPEED = 0.25, 4.0
BODY_FIELDS = frozenset({"model", "input", "voice", "response_format", "speed", "instructions", "stream_format", "seed"})
_DONE = object()


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
    body = load_object(body, BODY_FIELDS, what="body",
                       unknown_message="Unrecognized request argument supplied: {name}")
    model = body.get("model")
    if not isinstance(model, str) or not model:
        raise CompatError("model", "you must provide a model parameter")
    check_model("model", model, variant)
    text = body.get("input")
    if not isinstance(text, str) or not text.strip():
        raise CompatError("input", "input must be a non-empty string")
    if len(text) > MAX_INPUT_CHARS:
        raise CompatError("input", f"input is longer than {MAX_INPUT_CHARS} characters")
    voice = body.get("voice")
    if isinstance(voice, dict):
        voice = voice.get("id")
    if not isinstance(voice, str) or not voice:
        raise CompatError("voice", 'voice must be a voice name or {"id": "..."}')
    response_format = body.get("response_format", "mp3")
    if response_format in UNSERVED_FORMATS:
        raise CompatError("response_format", f"response_format {response_format!r} is not served here: use pcm or wav")
    if response_format not in FORMATS:
        raise CompatError("response_format", f"response_format must be one of {', '.join(FORMATS)}")
    stream_format = body.get("stream_format", "audio")
    if stream_format not in ("audio", "sse"):
        raise CompatError("stream_format", "stream_format must be audio or sse")
    speed = body.get("speed", 1.0)
    if isinstance(speed, bool) or not isinstance(speed, (int, float)) or not MIN_SPEED <= speed <= MAX_SPEED:
        raise CompatError("speed", f"speed must be a number in [{MIN_SPEED}, {MAX_SPEED}]")
    return SpeechRequest(model, text, voice, response_format, stream_format, float(speed), parse_seed("seed", body.get("seed")))


def error_response(status_code: int, message: str, param: str | None, kind: str = "invalid_request_error",
                   code: str | None = None) -> JSONResponse:
    body = {"error": {"message": message, "type": kind, "param": param, "code": code}}
    return JSONResponse(body, status_code=status_code)


class HttpSpeechSession:
    """One request: one SpeechStream whose events go through a bounded queue to the response body.

    It is a hub `Session` (counted against max_sessions, drained on shutdown, failed with the engine).
    A reader that falls `outbox_max_items` behind is dropped (the stream is cancelled), like a slow socket.
    """

    protocol_name: ClassVar[str] = "openai"

    def __init__(self, hub: Hub, principal: Principal | None = None) -> None:
        self.hub = hub
        self.session_id = hub.new_session_id()
        self.principal = principal  # the API key it came with (per-key limits)
        self.stream: SpeechStream | None = None
        self.queue: asyncio.Queue[object] = asyncio.Queue(maxsize=hub.settings.outbox_max_items)
        self.done: StreamDone | None = None
        self._opened_s = time.monotonic()

    # ---- hub Session protocol ----

    @property
    def live_streams(self) -> int:
        return 0 if self.stream is None or self.stream.status >= StreamStatus.DONE else 1

    def tick(self, now_s: float) -> None:
        if self.stream is not None and self.stream.has_unsegmented_text:
            self.stream.poll(now_s)

    def begin_drain(self) -> None:
        pass  # the request finishes on its own

    def close_now(self, code: int, reason: str) -> None:
        if self.stream is not None:
            self.stream.cancel(DoneReason.SHUTDOWN, reason)

    def fail_streams(self, detail: str) -> None:
        if self.stream is not None:
            self.stream.cancel(DoneReason.FAILED, detail)

    # ---- the stream ----

    def start(self, request: SpeechRequest) -> None:
        """Open the stream and give it all the text. Raises CompatError, VoiceError."""
        engine = self.hub.engine
        assert engine is not None
        spec = make_spec(
            self.hub,
            voice_id=resolve_voice(self.hub, request.voice),
            output_format=OutputFormat("pcm_s16le", SAMPLE_RATE_HZ),
            seed=request.seed,
            language=None,
        )
        voice = self.hub.voices.acquire(spec.voice_id)
        self.stream = SpeechStream(
            f"{self.session_id}/1",
            spec,
            engine=engine,
            segmenter=self.hub.make_segmenter(),
            post=self.hub.post,
            emit=partial(self._on_event, voice),
        )
        self.stream.open()
        now_s = time.monotonic()
        self.stream.push_text(request.input, now_s)
        self.stream.end(now_s)

    def _on_event(self, voice: Any, stream: SpeechStream, event: StreamEvent) -> None:
        if isinstance(event, AudioOut):
            self._put(event.payload)
        elif isinstance(event, StreamDone):
            self.done = event
            self.hub.voices.release(voice)
            self.hub.observers.emit(
                ContextFinished(self.protocol_name, self.session_id, "speech", event.reason.value,
                                stream.output_ms / 1000.0, stream.segment_count)
            )
            self._put(_DONE)

    def _put(self, item: object) -> None:
        try:
            self.queue.put_nowait(item)
        except asyncio.QueueFull:
            log.warning("dropped_slow_client", session_id=self.session_id, backlog_items=self.queue.qsize())
            if self.stream is not None:
                self.stream.cancel(DoneReason.SHUTDOWN, "slow client")
            while not self.queue.empty():
                self.queue.get_nowait()
            self.queue.put_nowait(_DONE)

    async def audio(self, first: object) -> AsyncIterator[bytes]:
        """PCM16 payloads as they come (`first`: the item already taken from the queue); ends when the
        stream does. Cancels the stream if the client leaves."""
        assert self.stream is not None
        item = first
        try:
            while True:
                if item is _DONE:
                    return
                assert isinstance(item, bytes)
                yield item
                self.stream.on_frame_sent(time.monotonic())
                item = await self.queue.get()
        finally:
            self.stream.cancel()  # no-op once done; a barge-in (client gone) otherwise
            self.hub.remove(self)
            code = 1000 if self.done is not None and self.done.reason == DoneReason.COMPLETED else 1001
            self.hub.observers.emit(
                SessionClosed(self.protocol_name, self.session_id, code, "", time.monotonic() - self._opened_s)
            )


async def speech(request: Request) -> Response:
    hub: Hub = request.app.state.hub
    engine = hub.engine
    if engine is None or not hub.ready:
        return error_response(503, f"the server is not ready: {hub.detail}", None, "server_error", "not_ready")
    try:
        body = orjson.loads(await request.body())
    except orjson.JSONDecodeError:
        return error_response(400, "the body must be JSON", None)
    try:
        speech_request = parse_request(body, engine.variant)
    except CompatError as exc:
        return error_response(400, exc.message, exc.field)
    session = HttpSpeechSession(hub, principal_of(request.scope))
    refusal = await hub.admit(session)
    if refusal is not None:
        return error_response(429, refusal, None, "rate_limit_exceeded", "busy")
    refusal = await hub.auth.charge_text(session.principal, len(speech_request.input))
    if refusal is not None:
        hub.remove(session)
        return error_response(429, refusal, "input", "rate_limit_exceeded", "rate_limited")
    hub.observers.emit(SessionOpened(session.protocol_name, session.session_id))
    try:
        session.start(speech_request)
    except CompatError as exc:
        hub.remove(session)
        return error_response(400, exc.message, exc.field)
    except VoiceError as exc:
        hub.remove(session)
        return error_response(400, exc.message, "voice")
    first = await session.queue.get()  # the first audio, or the end: an early failure gets a real status
    if first is _DONE:
        done = session.done
        assert done is not None
        if done.reason != DoneReason.COMPLETED:
            hub.remove(session)
            if done.reason == DoneReason.BUSY:
                return error_response(429, done.detail or "no free slot", None, "rate_limit_exceeded", "busy")
            return error_response(503, done.detail or "generation failed", None, "server_error", done.reason.value)
    headers = {"X-Request-Id": session.session_id}
    if speech_request.stream_format == "sse":
        return StreamingResponse(_sse(session, first), media_type="text/event-stream", headers=headers)
    fmt = speech_request.response_format
    media_type = "audio/wav" if fmt == "wav" else "audio/pcm"
    return StreamingResponse(_audio_body(session, fmt, first), media_type=media_type, headers=headers)


async def _audio_body(session: HttpSpeechSession, fmt: str, first: object) -> AsyncIterator[bytes]:
    if fmt == "wav":
        yield OutputFormat("pcm_s16le", SAMPLE_RATE_HZ).wav_header()
    async for payload in session.audio(first):
        yield payload


async def _sse(session: HttpSpeechSession, first: object) -> AsyncIterator[bytes]:
    samples = 0
    async for payload in session.audio(first):
        samples += len(payload) // 2
        yield b"data: " + orjson.dumps({"type": "speech.audio.delta", "audio": b64(payload)}) + b"\n\n"
    stream = session.stream
    input_tokens = 0 if stream is None else stream.text_chars
    output_tokens = round(samples / SAMPLE_RATE_HZ * 25)  # speech tokens: 25 per second
    usage = {"input_tokens": input_tokens, "output_tokens": output_tokens, "total_tokens": input_tokens + output_tokens}
    yield b"data: " + orjson.dumps({"type": "speech.audio.done", "usage": usage}) + b"\n\n"
