"""ElevenLabs text-to-speech WebSockets: `stream-input` (one context per socket) and
`multi-stream-input` (many contexts per socket), translated onto `SpeechStream`.

Wire (what the SDKs, Pipecat and LiveKit send and expect):
- query: model_id, output_format (pcm_8000..pcm_48000, ulaw_8000, alaw_8000), language_code,
  inactivity_timeout (s, default 20, at most 180), seed, sync_alignment, auto_mode, ... (see
  docs/compatibility.md for every field);
- in: {"text": " ", "voice_settings", "generation_config", "xi_api_key"} to initialise, then
  {"text": "piece ", "try_trigger_generation", "flush"}; stream-input ends with {"text": ""};
  multi-stream-input adds "context_id", {"context_id", "close_context": true}, {"close_socket": true}
  and keep-alives {"text": "", "context_id"};
- out: {"audio": base64, "isFinal": null, "alignment", "normalizedAlignment"} (multi: "contextId"),
  then {"isFinal": true}; errors {"message", "error", "code"}; stream-input closes with 1000.

Alignment: after each segment's audio comes an audio-less message whose alignment covers that segment,
its times relative to the segment's start (ElevenLabs: relative to the chunk), ending with a space.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any, ClassVar, Mapping

import orjson
from starlette.websockets import WebSocket

from agent_server.audio import PCM_SAMPLE_RATES_HZ, OutputFormat
from agent_server.compat.common import (
    CompatError,
    load_object,
    b64,
    check_model,
    make_spec,
    parse_seed,
    query_flag,
    resolve_language,
    resolve_voice,
    segment_char_times,
)
from agent_server.hub import Hub
from agent_server.session import (
    CLOSE_INTERNAL_ERROR,
    CLOSE_NORMAL,
    CLOSE_POLICY,
    CLOSE_TRY_AGAIN_LATER,
    Connection,
    ConnectionState,
    Context,
    OpenRefused,
)
from agent_server.speech import (
    AudioOut,
    DoneReason,
    SegmentDone,
    StreamDone,
    StreamEvent,
    StreamStateError,
    StreamStatus,
)

DEFAULT_INACTIVITY_TIMEOUT_S = 20
MAX_INACTIVITY_TIMEOUT_S = 180
DEFAULT_CONTEXT_ID = "default"
MAX_CONTEXT_ID_CHARS = 256
# Query parameters the vendor documents that change nothing here (see docs/compatibility.md).
IGNORED_QUERY = frozenset(
    {
        "authorization",
        "xi_api_key",
        "xi-api-key",
        "enable_logging",
        "enable_ssml_parsing",
        "optimize_streaming_latency",
        "apply_text_normalization",
        "apply_language_text_normalization",
        "sync_alignment",
        "auto_mode",
    }
)
MESSAGE_FIELDS = frozenset(
    {
        "text",
        "try_trigger_generation",
        "flush",
        "voice_settings",
        "generation_config",
        "generator_config",
        "pronunciation_dictionary_locators",
        "xi_api_key",
        "xi-api-key",
        "authorization",
        "context_id",
        "close_context",
        "close_socket",
    }
)


# ---- pure: query and messages -------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Query:
    model_id: str | None
    output_format: OutputFormat
    language_code: str | None
    inactivity_timeout_s: float
    seed: int | None
    sync_alignment: bool
    auto_mode: bool


def parse_output_format(value: str | None) -> OutputFormat:
    """pcm_<rate> (PCM16), ulaw_8000, alaw_8000. mp3/opus need an encoder this server does not carry."""
    if not value:
        raise CompatError(
            "output_format", "output_format is required here: pcm_8000..pcm_48000, ulaw_8000 or alaw_8000 (mp3 is not served)"
        )
    kind, _, rate = value.partition("_")
    encodings = {"pcm": "pcm_s16le", "ulaw": "mulaw", "alaw": "alaw"}
    if kind not in encodings or not rate.isdigit():
        raise CompatError(
            "output_format", f"unsupported output_format {value!r}: use pcm_8000..pcm_48000, ulaw_8000 or alaw_8000"
        )
    try:
        return OutputFormat(encodings[kind], int(rate))  # type: ignore[arg-type]
    except ValueError as exc:
        allowed = ", ".join(f"pcm_{r}" for r in PCM_SAMPLE_RATES_HZ)
        raise CompatError("output_format", f"unsupported output_format {value!r} ({allowed}, ulaw_8000, alaw_8000)") from exc


def parse_query(params: Mapping[str, str], variant: str) -> Query:
    check_model("model_id", params.get("model_id"), variant)
    timeout_raw = params.get("inactivity_timeout") or str(DEFAULT_INACTIVITY_TIMEOUT_S)
    if not timeout_raw.isdigit() or not 1 <= int(timeout_raw) <= MAX_INACTIVITY_TIMEOUT_S:
        raise CompatError("inactivity_timeout", f"inactivity_timeout must be 1..{MAX_INACTIVITY_TIMEOUT_S} seconds")
    return Query(
        model_id=params.get("model_id"),
        output_format=parse_output_format(params.get("output_format")),
        language_code=resolve_language("language_code", params.get("language_code"), variant),
        inactivity_timeout_s=float(timeout_raw),
        seed=parse_seed("seed", params.get("seed")),
        sync_alignment=query_flag(params, "sync_alignment"),
        auto_mode=query_flag(params, "auto_mode"),
    )


@dataclass(frozen=True, slots=True)
class Message:
    text: str | None = None  # None: absent
    flush: bool = False
    try_trigger_generation: bool = False
    context_id: str | None = None
    close_context: bool = False
    close_socket: bool = False
    voice_settings: Mapping[str, Any] | None = None


def parse_message(raw: str | bytes) -> Message:
    if isinstance(raw, bytes) and not raw:
        raise CompatError("message", "empty message")
    obj = load_object(raw, MESSAGE_FIELDS)
    text = obj.get("text")
    if text is not None and not isinstance(text, str):
        raise CompatError("text", "text must be a string")
    context_id = obj.get("context_id")
    if context_id is not None and (not isinstance(context_id, str) or not 0 < len(context_id) <= MAX_CONTEXT_ID_CHARS):
        raise CompatError("context_id", f"context_id must be a string of 1..{MAX_CONTEXT_ID_CHARS} characters")
    for name in ("flush", "try_trigger_generation", "close_context", "close_socket"):
        if obj.get(name) is not None and not isinstance(obj[name], bool):
            raise CompatError(name, f"{name} must be true or false")
    voice_settings = obj.get("voice_settings")
    if voice_settings is not None and not isinstance(voice_settings, dict):
        raise CompatError("voice_settings", "voice_settings must be an object")
    return Message(
        text=text,
        flush=bool(obj.get("flush")),
        try_trigger_generation=bool(obj.get("try_trigger_generation")),
        context_id=context_id,
        close_context=bool(obj.get("close_context")),
        close_socket=bool(obj.get("close_socket")),
        voice_settings=voice_settings,
    )


def error_message(error: str, message: str, code: int, context_id: str | None = None) -> str:
    body: dict[str, Any] = {"message": message, "error": error, "code": code}
    if context_id is not None:
        body["contextId"] = context_id
    return orjson.dumps(body).decode()


# ---- the session ---------------------------------------------------------------------------------


@dataclass(slots=True)
class ContextInput:
    """Client-side state of one ElevenLabs context (multi-stream-input bookkeeping)."""

    last_input_s: float
    unflushed: bool = False  # text arrived since the last flush
    closing: bool = False  # close_context / close_socket seen: no more input


class ElevenLabsSession(Connection):
    protocol_name: ClassVar[str] = "elevenlabs"

    def __init__(self, hub: Hub, websocket: WebSocket, *, multi: bool) -> None:
        super().__init__(hub, websocket)
        self.multi = multi
        self.voice_id = websocket.path_params.get("voice_id", "")
        self.query: Query | None = None
        self._inputs: dict[str, ContextInput] = {}
        self._closing_socket = False
        self._last_input_s = time.monotonic()

    # ---- greeting: the query is checked once the socket is open, so errors go out in vendor shape

    def on_open(self) -> None:
        engine = self.hub.engine
        assert engine is not None
        try:
            self.query = parse_query(self.websocket.query_params, engine.variant)
        except CompatError as exc:
            self._fail(exc.code if exc.code != "bad_request" else f"invalid_{exc.field}", exc.message)

    def render_refusal(self, reason: str) -> str:
        return error_message("busy", reason, CLOSE_TRY_AGAIN_LATER)

    def _fail(self, error: str, message: str, code: int = CLOSE_POLICY, context_id: str | None = None) -> None:
        self.log.info("elevenlabs_error", error=error, message=message)
        self.send_message(error_message(error, message, code, context_id))
        self.request_close(code, message[:120])  # first: nothing more is rendered after the error
        for ctx in list(self.contexts.values()):
            ctx.stream.cancel(DoneReason.SHUTDOWN, message)

    # ---- client messages -------------------------------------------------------------------------

    async def handle_message(self, raw: str | bytes, now_s: float) -> None:
        if self.query is None or self._closing_socket:
            return  # refused in on_open (the close is on its way), or closing
        self._last_input_s = now_s
        try:
            message = parse_message(raw)
        except CompatError as exc:
            self._fail("invalid_message", exc.message)
            return
        if message.close_socket:
            self._close_socket(now_s)
            return
        cid = (message.context_id or DEFAULT_CONTEXT_ID) if self.multi else DEFAULT_CONTEXT_ID
        if message.close_context:
            self._close_context(cid, now_s)
            return
        ctx = self.contexts.get(cid)
        state = self._inputs.get(cid)
        if ctx is None or state is None or state.closing:
            if state is not None and state.closing:
                self._fail("context_closing", f"context {cid!r} is closing", context_id=cid if self.multi else None)
                return
            if message.text is None and not message.flush:
                return  # nothing to open a context for
            if not self.multi and message.text == "":
                self.request_close(CLOSE_NORMAL, "end of input before any text")
                return
            ctx = self._open(cid, message, now_s)
            if ctx is None:
                return
            state = self._inputs[cid]
        state.last_input_s = now_s
        try:
            await self._apply(ctx, state, message, now_s)
        except StreamStateError as exc:
            self._fail("invalid_state", str(exc), context_id=cid if self.multi else None)

    async def _apply(self, ctx: Context, state: ContextInput, message: Message, now_s: float) -> None:
        stream = ctx.stream
        if stream.status != StreamStatus.OPEN:
            return  # the stream ended on its own (busy, failed); its isFinal is out
        text = message.text
        if text == "" and not message.flush:
            if not self.multi:  # stream-input: the empty text ends the input
                state.closing = True
                stream.end(now_s)
            return  # multi-stream-input: a keep-alive
        if text:
            if stream.text_chars + len(text) > self.settings.max_context_text_chars:
                self._fail("max_character_limit_exceeded", "the context has too much text", context_id=ctx.context_id if self.multi else None)
                return
            refusal = await self.charge_text(len(text))
            if refusal is not None:
                self._fail("rate_limited", refusal, context_id=ctx.context_id if self.multi else None)
                return
            stream.push_text(text, now_s)
            if text.strip():
                state.unflushed = True
        if message.flush:
            stream.flush(now_s)
            state.unflushed = False

    def _open(self, cid: str, message: Message, now_s: float) -> Context | None:
        assert self.query is not None
        q = self.query
        try:
            spec = make_spec(
                self.hub,
                voice_id=resolve_voice(self.hub, self.voice_id),
                output_format=q.output_format,
                seed=q.seed,
                language=q.language_code,
            )
            ctx = self.open_context(cid, spec)
        except CompatError as exc:
            self._fail(f"invalid_{exc.field}", exc.message)
            return None
        except OpenRefused as refused:
            code = CLOSE_TRY_AGAIN_LATER if refused.busy else CLOSE_POLICY
            if self.multi and refused.busy and refused.code == "too_many_contexts":
                self.send_message(error_message("max_active_conversations", refused.message, code, cid))
                return None
            self._fail("busy" if refused.busy else refused.code, refused.message, code)
            return None
        self._inputs[cid] = ContextInput(last_input_s=now_s)
        return ctx

    def _close_context(self, cid: str, now_s: float) -> None:
        """Graceful when every piece of text was flushed (the turn is complete: speak it, then isFinal);
        otherwise, or when the context is already closing, it is a barge-in: stop now."""
        ctx = self.contexts.get(cid)
        state = self._inputs.get(cid)
        if ctx is None or state is None:
            return
        if state.closing or state.unflushed:
            ctx.stream.cancel()
            return
        state.closing = True
        if ctx.stream.status == StreamStatus.OPEN:
            ctx.stream.end(now_s)

    def _close_socket(self, now_s: float) -> None:
        """Every context ends (what was sent is spoken), then the socket closes with 1000."""
        self._closing_socket = True
        for cid, ctx in list(self.contexts.items()):
            self._inputs[cid].closing = True
            if ctx.stream.status == StreamStatus.OPEN:
                ctx.stream.end(now_s)
        if not self.contexts:
            self.request_close(CLOSE_NORMAL, "close_socket")

    def tick(self, now_s: float) -> None:
        super().tick(now_s)
        if self.query is None:
            return
        timeout_s = self.query.inactivity_timeout_s
        if not self.multi:
            ctx = self.contexts.get(DEFAULT_CONTEXT_ID)
            waiting_for_text = ctx is None or ctx.stream.status == StreamStatus.OPEN
            if waiting_for_text and now_s - self._last_input_s > timeout_s and self.state == ConnectionState.OPEN:
                self._fail(
                    "input_timeout_exceeded",
                    f"Have not received a new text input within the timeout of {timeout_s:g} seconds",
                )
            return
        for cid, state in list(self._inputs.items()):
            ctx = self.contexts.get(cid)
            if ctx is not None and not state.closing and now_s - state.last_input_s > timeout_s:
                self._close_context(cid, now_s)

    # ---- stream events -> wire -------------------------------------------------------------------

    def render(self, ctx: Context, event: StreamEvent) -> None:
        if isinstance(event, AudioOut):
            self.send_audio(ctx, self._audio_json(ctx, b64(event.payload), None))
        elif isinstance(event, SegmentDone):
            times = segment_char_times(event, trailing_space=True)
            alignment = {"chars": times.chars, "charStartTimesMs": times.start_ms, "charDurationsMs": times.duration_ms}
            self.send_message(self._audio_json(ctx, "", alignment), ctx)
        elif isinstance(event, StreamDone):
            self._render_done(ctx, event)

    def _audio_json(self, ctx: Context, audio: str, alignment: dict[str, Any] | None) -> str:
        body: dict[str, Any] = {"audio": audio, "isFinal": None, "normalizedAlignment": alignment, "alignment": alignment}
        if self.multi:
            body["contextId"] = ctx.context_id
        return orjson.dumps(body).decode()

    def _render_done(self, ctx: Context, event: StreamDone) -> None:
        cid = ctx.context_id if self.multi else None
        if event.reason in (DoneReason.BUSY, DoneReason.FAILED):
            code = CLOSE_TRY_AGAIN_LATER if event.reason == DoneReason.BUSY else CLOSE_INTERNAL_ERROR
            error = "busy" if event.reason == DoneReason.BUSY else "generation_failed"
            self.send_message(error_message(error, event.detail or error, code, cid))
            if not self.multi:
                self.request_close(code, event.detail[:120])
                return
        final: dict[str, Any] = {"isFinal": True}
        if self.multi:
            final["contextId"] = ctx.context_id
        self.send_message(orjson.dumps(final).decode())
        self._inputs.pop(ctx.context_id, None)
        if not self.multi or (self._closing_socket and len(self.contexts) <= 1):
            self.request_close(CLOSE_NORMAL, "")


async def stream_input(websocket: WebSocket) -> None:
    await ElevenLabsSession(websocket.app.state.hub, websocket, multi=False).serve()


async def multi_stream_input(websocket: WebSocket) -> None:
    await ElevenLabsSession(websocket.app.state.hub, websocket, multi=True).serve()
