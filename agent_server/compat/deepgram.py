"""Deepgram `/v1/speak` WebSocket (Aura), translated onto `SpeechStream`.

- query: model (aura-*), encoding (linear16 | mulaw | alaw), sample_rate, container (none), seed (our
  extension), mip_opt_out / bit_rate / speed / tag (accepted, ignored); auth `Authorization: Token ...`
  (or Bearer), checked by auth.AuthMiddleware when auth is on.
- in: {"type": "Speak", "text"}, {"type": "Flush"}, {"type": "Clear"}, {"type": "Close"}.
- out: {"type": "Metadata"} on connect, binary audio, {"type": "Flushed", "sequence_id"} once the audio
  of everything before a Flush is out, {"type": "Cleared", "sequence_id"}, {"type": "Warning"}; Close
  speaks what is left, then closes with 1000.

One socket is one audio stream: the text goes into one `SpeechStream` until a Clear cancels it (barge-in;
the engine slot is free at the next step); the next Speak opens a new one.
"""

from __future__ import annotations

import uuid
from collections import deque
from dataclasses import dataclass
from typing import ClassVar, Mapping

import orjson
from starlette.websockets import WebSocket

from agent_server.audio import OutputFormat
from agent_server.compat.common import CompatError, check_model, make_spec, parse_seed, resolve_voice
from agent_server.hub import Hub
from agent_server.session import CLOSE_NORMAL, CLOSE_POLICY, CLOSE_TRY_AGAIN_LATER, Connection, Context, OpenRefused
from agent_server.speech import AudioOut, DoneReason, SegmentDone, StreamDone, StreamEvent, StreamStatus

ENCODINGS: Mapping[str, str] = {"linear16": "pcm_s16le", "mulaw": "mulaw", "alaw": "alaw"}
DEFAULT_RATES_HZ: Mapping[str, int] = {"linear16": 24_000, "mulaw": 8_000, "alaw": 8_000}
DEFAULT_MODEL = "aura-asteria-en"
MODEL_VERSION = "chatterbox"
CONTEXT_ID = "speak"
MAX_SPEAK_CHARS = 2000  # Deepgram's own limit per Speak message


@dataclass(frozen=True, slots=True)
class Query:
    model: str
    output_format: OutputFormat
    seed: int | None


def parse_query(params: Mapping[str, str], variant: str) -> Query:
    model = params.get("model") or DEFAULT_MODEL
    check_model("model", model, variant)
    encoding = params.get("encoding") or "linear16"
    if encoding not in ENCODINGS:
        raise CompatError("encoding", f"encoding {encoding!r} is not served: use linear16, mulaw or alaw")
    container = params.get("container") or "none"
    if container != "none":
        raise CompatError("container", "only container=none is served on the WebSocket")
    rate_raw = params.get("sample_rate") or str(DEFAULT_RATES_HZ[encoding])
    if not rate_raw.isdigit():
        raise CompatError("sample_rate", f"sample_rate must be an integer (got {rate_raw!r})")
    try:
        fmt = OutputFormat(ENCODINGS[encoding], int(rate_raw))  # type: ignore[arg-type]
    except ValueError as exc:
        raise CompatError("sample_rate", str(exc)) from None
    return Query(model, fmt, parse_seed("seed", params.get("seed")))


def parse_message(raw: str | bytes) -> tuple[str, str]:
    """(type, text). Raises CompatError."""
    try:
        obj = orjson.loads(raw)
    except orjson.JSONDecodeError:
        raise CompatError("message", "messages must be JSON objects") from None
    if not isinstance(obj, dict) or obj.get("type") not in ("Speak", "Flush", "Clear", "Close"):
        raise CompatError("type", "type must be one of Speak, Flush, Clear, Close")
    text = obj.get("text", "")
    if obj["type"] == "Speak" and not isinstance(text, str):
        raise CompatError("text", "text must be a string")
    return obj["type"], text if isinstance(text, str) else ""


def _json(body: Mapping[str, object]) -> str:
    return orjson.dumps(body).decode()


class DeepgramSession(Connection):
    protocol_name: ClassVar[str] = "deepgram"

    def __init__(self, hub: Hub, websocket: WebSocket) -> None:
        super().__init__(hub, websocket)
        self.query: Query | None = None
        self._request_id = str(uuid.uuid4())
        self._flushes = 0
        self._clears = 0
        self._pending_flushes: deque[tuple[int, int]] = deque()  # (sequence_id, last segment index)
        self._segments_done = 0
        self._closing = False

    def on_open(self) -> None:
        engine = self.hub.engine
        assert engine is not None
        try:
            self.query = parse_query(self.websocket.query_params, engine.variant)
        except CompatError as exc:
            self._error("INVALID_QUERY_PARAMETER", f"{exc.field}: {exc.message}", CLOSE_POLICY)
            return
        self.send_message(
            _json(
                {
                    "type": "Metadata",
                    "request_id": self._request_id,
                    "model_name": self.query.model,
                    "model_version": MODEL_VERSION,
                    "model_uuid": str(uuid.uuid5(uuid.NAMESPACE_URL, self.query.model)),
                }
            )
        )

    def render_refusal(self, reason: str) -> str:
        return _json({"type": "Error", "err_code": "BUSY", "err_msg": reason, "description": reason})

    def _error(self, code: str, description: str, close_code: int) -> None:
        self.send_message(_json({"type": "Error", "err_code": code, "err_msg": description, "description": description}))
        self.request_close(close_code, description[:120])
        for ctx in list(self.contexts.values()):
            ctx.stream.cancel(DoneReason.SHUTDOWN, description)

    def _warn(self, code: str, description: str) -> None:
        self.send_message(_json({"type": "Warning", "code": code, "description": description}))

    # ---- client messages -------------------------------------------------------------------------

    async def handle_message(self, raw: str | bytes, now_s: float) -> None:
        if self.query is None or self._closing:
            return
        try:
            kind, text = parse_message(raw)
        except CompatError as exc:
            self._warn("INVALID_MESSAGE", exc.message)
            return
        ctx = self.contexts.get(CONTEXT_ID)
        if kind == "Speak":
            if len(text) > MAX_SPEAK_CHARS:
                self._warn("TEXT_TOO_LONG", f"a Speak message holds at most {MAX_SPEAK_CHARS} characters")
                return
            if ctx is None:
                ctx = self._open()
                if ctx is None:
                    return
            if ctx.stream.text_chars + len(text) > self.settings.max_context_text_chars:
                self._warn("TEXT_TOO_LONG", "too much text on this connection since the last Clear")
                return
            refusal = await self.charge_text(len(text))
            if refusal is not None:
                self._warn("RATE_LIMITED", refusal)
                return
            ctx.stream.push_text(text, now_s)
        elif kind == "Flush":
            sequence_id = self._flushes
            self._flushes += 1
            last = -1
            if ctx is not None and ctx.stream.status == StreamStatus.OPEN:
                ctx.stream.flush(now_s)
                last = ctx.stream.segment_count - 1
            self._pending_flushes.append((sequence_id, last))
            self._flushed_up_to(self._segments_done if ctx is not None else 1 << 62)
        elif kind == "Clear":
            if ctx is not None:
                ctx.stream.cancel()
            self._segments_done = 0
            self._pending_flushes.clear()
            self.send_message(_json({"type": "Cleared", "sequence_id": self._clears}))
            self._clears += 1
        else:  # Close: speak what is left, then close
            self._closing = True
            if ctx is None:
                self.request_close(CLOSE_NORMAL, "")
            elif ctx.stream.status == StreamStatus.OPEN:
                ctx.stream.end(now_s)

    def _open(self) -> Context | None:
        assert self.query is not None
        try:
            spec = make_spec(
                self.hub, voice_id=resolve_voice(self.hub, self.query.model), output_format=self.query.output_format,
                seed=self.query.seed, language=None,
            )
            ctx = self.open_context(CONTEXT_ID, spec)
        except CompatError as exc:
            self._warn("INVALID_REQUEST", exc.message)
            return None
        except OpenRefused as refused:
            if refused.busy:
                self._error("BUSY", refused.message, CLOSE_TRY_AGAIN_LATER)
            else:
                self._warn("INVALID_REQUEST", refused.message)
            return None
        self._segments_done = 0
        return ctx

    def _flushed_up_to(self, segments_done: int) -> None:
        while self._pending_flushes and self._pending_flushes[0][1] < segments_done:
            sequence_id, _ = self._pending_flushes.popleft()
            self.send_message(_json({"type": "Flushed", "sequence_id": sequence_id}))

    # ---- stream events -> wire -------------------------------------------------------------------

    def render(self, ctx: Context, event: StreamEvent) -> None:
        if isinstance(event, AudioOut):
            self.send_audio(ctx, event.payload)
        elif isinstance(event, SegmentDone):
            self._segments_done = event.index + 1
            self._flushed_up_to(self._segments_done)
        elif isinstance(event, StreamDone):
            if event.reason == DoneReason.COMPLETED:
                self._flushed_up_to(1 << 62)
            elif event.reason == DoneReason.BUSY:
                self._warn("BUSY", event.detail or "no free slot: the text was dropped")
            elif event.reason == DoneReason.FAILED:
                self._warn("GENERATION_FAILED", event.detail or "generation failed: the text was dropped")
            if self._closing:
                self.request_close(CLOSE_NORMAL, "")


async def speak(websocket: WebSocket) -> None:
    await DeepgramSession(websocket.app.state.hub, websocket).serve()
