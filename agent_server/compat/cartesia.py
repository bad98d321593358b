"""Cartesia `/tts/websocket`, translated onto `SpeechStream`.

- in: generation requests {"context_id", "model_id", "transcript", "voice": {"mode": "id", "id"} | {"id"} | "id",
  "output_format": {"container": "raw", "encoding", "sample_rate"}, "continue", "flush", "add_timestamps",
  "language", "seed" (our extension), ...}; {"context_id", "cancel": true}.
  The first request of a context opens it (its voice, format, language and seed hold for the context);
  "continue": false ends its input; "flush": true speaks what it has and answers "flush_done".
- out: {"type": "chunk", "data": base64, ...}, {"type": "timestamps", "word_timestamps": {"words", "start",
  "end"}} (seconds from the context's start), {"type": "flush_done", "flush_id"}, {"type": "done"},
  {"type": "error", "title", "message", "status_code", "done": true}.
- auth: `X-API-Key` / `Authorization` header or `api_key` / `access_token` query: checked by auth.AuthMiddleware when auth is on.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from typing import Any, ClassVar, Mapping

import numpy as np
import orjson
from starlette.websockets import WebSocket

from agent_server.audio import OutputFormat
from agent_server.compat.common import (
    CompatError,
    load_object,
    b64,
    check_model,
    make_spec,
    parse_seed,
    resolve_language,
    resolve_voice,
    segment_words,
)
from agent_server.hub import Hub
from agent_server.session import Connection, Context, OpenRefused
from agent_server.speech import (
    AudioOut,
    DoneReason,
    SegmentDone,
    StreamDone,
    StreamEvent,
    StreamStateError,
    StreamStatus,
)

ENCODINGS: Mapping[str, str] = {"pcm_s16le": "pcm_s16le", "pcm_f32le": "pcm_s16le", "pcm_mulaw": "mulaw", "pcm_alaw": "alaw"}
PCM16_SCALE = 32768.0
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
    transcript: str = ""
    continue_: bool = False
    flush: bool = False
    cancel: bool = False
    model_id: str | None = None
    voice_id: str | None = None
    encoding: str = "pcm_s16le"  # Cartesia's name
    sample_rate_hz: int = 24_000
    add_timestamps: bool = False
    language: str | None = None
    seed: int | None = None


def parse_request(raw: str | bytes) -> Request:
    obj = load_object(raw, REQUEST_FIELDS)
    cid = obj.get("context_id")
    if not isinstance(cid, str) or not 0 < len(cid) <= MAX_CONTEXT_ID_CHARS:
        raise CompatError("context_id", f"context_id must be a string of 1..{MAX_CONTEXT_ID_CHARS} characters")
    if obj.get("cancel") is True:
        return Request(cid, cancel=True)
    transcript = obj.get("transcript", "")
    if not isinstance(transcript, str):
        raise CompatError("transcript", "transcript must be a string")
    for name in ("continue", "flush", "add_timestamps"):
        if obj.get(name) is not None and not isinstance(obj[name], bool):
            raise CompatError(name, f"{name} must be a boolean")
    encoding, rate = _output_format(obj.get("output_format"))
    return Request(
        context_id=cid,
        transcript=transcript,
        continue_=bool(obj.get("continue")),
        flush=bool(obj.get("flush")),
        model_id=obj.get("model_id") if isinstance(obj.get("model_id"), str) else None,
        voice_id=_voice_id(obj.get("voice")),
        encoding=encoding,
        sample_rate_hz=rate,
        add_timestamps=bool(obj.get("add_timestamps")),
        language=obj.get("language") if isinstance(obj.get("language"), str) else None,
        seed=parse_seed("seed", obj.get("seed")),
    )


def _voice_id(voice: object) -> str | None:
    if voice is None or isinstance(voice, str):
        return voice
    if isinstance(voice, dict) and isinstance(voice.get("id"), str):
        return str(voice["id"])
    raise CompatError("voice", 'voice must be {"mode": "id", "id": "..."} or a voice id')


def _output_format(value: object) -> tuple[str, int]:
    if value is None:
        return "pcm_s16le", 24_000
    if not isinstance(value, dict):
        raise CompatError("output_format", "output_format must be an object")
    if value.get("container", "raw") != "raw":
        raise CompatError("output_format.container", f"container {value.get('container')!r} is not served; use raw")
    encoding = value.get("encoding", "pcm_s16le")
    if not isinstance(encoding, str) or encoding not in ENCODINGS:  # a list or object is not hashable
        raise CompatError("output_format.encoding", f"encoding {encoding!r} is not served ({', '.join(ENCODINGS)})")
    rate = value.get("sample_rate", 24_000)
    if not isinstance(rate, int) or isinstance(rate, bool):
        raise CompatError("output_format.sample_rate", "sample_rate must be an integer")
    try:
        OutputFormat(ENCODINGS[encoding], rate)  # type: ignore[arg-type]
    except ValueError as exc:
        raise CompatError("output_format.sample_rate", str(exc)) from None
    return encoding, rate


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


# ---- the session -----------------------------------------------------------------------------------


@dataclass(slots=True)
class ContextState:
    request: Request  # the opening request: its format, timestamps flag, ...
    flush_id: int = 0  # flushes so far
    pending_flushes: deque[tuple[int, int]] = field(default_factory=deque)  # (flush_id, last segment index)
    segments_done: int = 0


class CartesiaSession(Connection):
    protocol_name: ClassVar[str] = "cartesia"

    def __init__(self, hub: Hub, websocket: WebSocket) -> None:
        super().__init__(hub, websocket)
        self._states: dict[str, ContextState] = {}

    def render_refusal(self, reason: str) -> str:
        return error_event(reason, None, 429, "Busy")

    async def handle_message(self, raw: str | bytes, now_s: float) -> None:
        try:
            request = parse_request(raw)
        except CompatError as exc:
            self.send_message(error_event(exc.message, _context_id_of(raw)))
            return
        cid = request.context_id
        ctx = self.contexts.get(cid)
        if request.cancel:
            if ctx is not None:
                ctx.stream.cancel()
            return
        try:
            if ctx is None:
                ctx = self._open(request)
                if ctx is None:
                    return
            await self._apply(ctx, self._states[cid], request, now_s)
        except CompatError as exc:
            if exc.code == "rate_limited":
                self.send_message(error_event(exc.message, cid, 429, "Rate limited"))
            else:
                self.send_message(error_event(exc.message, cid))
        except StreamStateError:
            self.send_message(error_event(f"context {cid!r} has already ended (continue: false)", cid))

    def _open(self, request: Request) -> Context | None:
        engine = self.hub.engine
        assert engine is not None
        cid = request.context_id
        check_model("model_id", request.model_id, engine.variant)
        fmt = OutputFormat(ENCODINGS[request.encoding], request.sample_rate_hz)  # type: ignore[arg-type]
        spec = make_spec(
            self.hub,
            voice_id=resolve_voice(self.hub, request.voice_id),
            output_format=fmt,
            seed=request.seed,
            language=resolve_language("language", request.language, engine.variant),
        )
        try:
            ctx = self.open_context(cid, spec)
        except OpenRefused as refused:
            status = 429 if refused.busy else 400
            self.send_message(error_event(refused.message, cid, status, "Busy" if refused.busy else "Invalid request"))
            return None
        self._states[cid] = ContextState(request)
        return ctx

    async def _apply(self, ctx: Context, state: ContextState, request: Request, now_s: float) -> None:
        stream = ctx.stream
        if stream.status != StreamStatus.OPEN:
            raise StreamStateError("ended")
        if request.transcript:
            if stream.text_chars + len(request.transcript) > self.settings.max_context_text_chars:
                raise CompatError("transcript", "the context has too much text")
            refusal = await self.charge_text(len(request.transcript))
            if refusal is not None:
                raise CompatError("transcript", refusal, "rate_limited")
            stream.push_text(request.transcript, now_s)
        if request.flush:
            stream.flush(now_s)
            state.flush_id += 1
            state.pending_flushes.append((state.flush_id, stream.segment_count - 1))
            self._flushes_done(ctx, state)
        if not request.continue_:
            stream.end(now_s)

    def _flushes_done(self, ctx: Context, state: ContextState) -> None:
        while state.pending_flushes and state.pending_flushes[0][1] < state.segments_done:
            flush_id, _ = state.pending_flushes.popleft()
            body = {"type": "flush_done", "context_id": ctx.context_id, "flush_id": flush_id, "flush_done": True,
                    "done": False, "status_code": STATUS_OK}
            self.send_message(orjson.dumps(body).decode(), ctx)

    # ---- stream events -> wire -------------------------------------------------------------------

    def render(self, ctx: Context, event: StreamEvent) -> None:
        state = self._states.get(ctx.context_id)
        if state is None:
            return
        cid = ctx.context_id
        if isinstance(event, AudioOut):
            payload = event.payload
            if state.request.encoding == "pcm_f32le":
                payload = (np.frombuffer(payload, dtype="<i2").astype("<f4") / PCM16_SCALE).tobytes()
            body: dict[str, Any] = {"type": "chunk", "context_id": cid, "data": b64(payload), "done": False,
                                    "status_code": STATUS_PARTIAL, "step_time": 0.0}
            if state.flush_id:
                body["flush_id"] = state.flush_id
            self.send_audio(ctx, orjson.dumps(body).decode())
        elif isinstance(event, SegmentDone):
            state.segments_done = event.index + 1
            if state.request.add_timestamps:
                words, starts, ends = segment_words(event)
                body = {"type": "timestamps", "context_id": cid, "done": False, "status_code": STATUS_PARTIAL,
                        "word_timestamps": {"words": words, "start": starts, "end": ends}}
                self.send_message(orjson.dumps(body).decode(), ctx)
            self._flushes_done(ctx, state)
        elif isinstance(event, StreamDone):
            self._states.pop(cid, None)
            if event.reason == DoneReason.COMPLETED:
                state.segments_done = 1 << 62
                self._flushes_done(ctx, state)
                done = {"type": "done", "context_id": cid, "done": True, "status_code": STATUS_OK}
                self.send_message(orjson.dumps(done).decode())
            elif event.reason == DoneReason.BUSY:
                self.send_message(error_event(event.detail or "busy", cid, 429, "Busy"))
            elif event.reason in (DoneReason.FAILED, DoneReason.SHUTDOWN):
                self.send_message(error_event(event.detail or "generation failed", cid, 500, "Generation failed"))
            # CANCELLED: the client asked; nothing more is sent for the context


async def tts_websocket(websocket: WebSocket) -> None:
    await CartesiaSession(websocket.app.state.hub, websocket).serve()


