"""ElevenLabs text-to-speech WebSockets: `stream-input` (one context per socket) and
`multi-stream-input` (many contexts per socket): the wire format, on the session core.

Wire (what the SDKs, Pipecat and LiveKit send and expect):
- query: model_id, output_format (protocols/vendor_formats.elevenlabs_format: every name of the SDK, mp3_44100_128 by
  default, as the vendor's; MP3 and Opus encoded off the event loop), language_code,
  inactivity_timeout (s, default 20, at most 180), seed, sync_alignment, auto_mode, ... (see
  docs/compatibility.md for every field);
- in: {"text": " ", "voice_settings", "generation_config", "xi_api_key"} to initialise, then
  {"text": "piece ", "try_trigger_generation", "flush"}; stream-input ends with {"text": ""};
  multi-stream-input adds "context_id", {"context_id", "close_context": true}, {"close_socket": true}
  and keep-alives {"text": "", "context_id"};
- out: {"audio": base64, "isFinal": null, "alignment", "normalizedAlignment"} (multi: "contextId"),
  then {"isFinal": true}; errors {"message", "error", "code"}; stream-input closes with 1000;
- a message with neither text nor an action (`{}`, `{"text": null}`) is an `invalid_message` error.

Alignment: after each segment's audio comes an audio-less message whose alignment covers that segment
(ending with a zero-length space, a word boundary for clients that glue messages together):
- `alignment`: times relative to the message, as ElevenLabs documents them ("relative to the returned
  chunk"): counted from where the previous message's alignment ended, so a client that adds up each
  message's span (Pipecat) lands every character at its time in the context, gaps between segments
  included (`timestamps.ContextAlignment.chained`);
- `normalizedAlignment`: the same characters with times from the start of the context's audio (LiveKit
  reads this one by default and takes the times as they come). Both carry the characters the client sent,
  not their spoken form ("$4.50" has the times of "four dollars and fifty cents": agent_server/text/normalize/),
  so a client's transcript is its own text.
Both include MP3's encoder delay (`codecs.StreamFormat.lead_ms`).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, ClassVar, Protocol

import orjson

from agent_server.audio.codecs import StreamFormat
from agent_server.core.events import AudioOut, SegmentDone, StreamDone, StreamEvent, StreamStateError, StreamStatus
from agent_server.core.outcomes import Outcome, Refusal
from agent_server.core.routing import Routed, Router
from agent_server.core.session import (
    Context,
    Session,
    SessionState,
    WireProtocol,
)
from agent_server.errors import (
    BUSY,
    CONTEXT_TEXT_LIMIT,
    EMPTY_MESSAGE,
    RATE_LIMITED,
    TEXT_TOO_LONG,
    FieldError,
    empty_message,
)
from agent_server.protocols.common import (
    PieceJoiner,
    b64,
    elevenlabs_normalization,
    load_object,
    make_spec,
    parse_decimal,
    parse_seed,
    place_segment,
    query_flag,
    resolve_voice,
    route,
    voice_settings_speed,
)
from agent_server.protocols.vendor_formats import elevenlabs_format
from agent_server.text.markup import elevenlabs_tags
from agent_server.text.timestamps import ContextAlignment, SegmentTimes

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
    output_format: StreamFormat
    routed: Routed  # the model that serves model_id and language_code here
    inactivity_timeout_s: float
    seed: int | None
    sync_alignment: bool
    auto_mode: bool
    normalize: bool  # apply_text_normalization is not "off"


def parse_query(params: Mapping[str, str], router: Router) -> Query:
    timeout_s = parse_decimal(params.get("inactivity_timeout"))
    if timeout_s is None:
        timeout_s = DEFAULT_INACTIVITY_TIMEOUT_S
    if not 1 <= timeout_s <= MAX_INACTIVITY_TIMEOUT_S:
        raise FieldError("inactivity_timeout", f"inactivity_timeout must be 1..{MAX_INACTIVITY_TIMEOUT_S} seconds")
    return Query(
        model_id=params.get("model_id"),
        output_format=elevenlabs_format(params.get("output_format")),
        routed=route(router, model_field="model_id", model=params.get("model_id"), language_field="language_code",
                     language=params.get("language_code")),
        inactivity_timeout_s=float(timeout_s),
        seed=parse_seed("seed", params.get("seed")),
        sync_alignment=query_flag(params, "sync_alignment"),
        auto_mode=query_flag(params, "auto_mode"),
        normalize=elevenlabs_normalization(params.get("apply_text_normalization")),
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
    obj = load_object(raw, MESSAGE_FIELDS)
    text = obj.get("text")
    if text is not None and not isinstance(text, str):
        raise FieldError("text", "text must be a string")
    context_id = obj.get("context_id")
    if context_id is not None and (not isinstance(context_id, str) or not 0 < len(context_id) <= MAX_CONTEXT_ID_CHARS):
        raise FieldError("context_id", f"context_id must be a string of 1..{MAX_CONTEXT_ID_CHARS} characters")
    for name in ("flush", "try_trigger_generation", "close_context", "close_socket"):
        if obj.get(name) is not None and not isinstance(obj[name], bool):
            raise FieldError(name, f"{name} must be true or false")
    voice_settings = obj.get("voice_settings")
    if voice_settings is not None and not isinstance(voice_settings, dict):
        raise FieldError("voice_settings", "voice_settings must be an object")
    return Message(
        text=text,
        flush=bool(obj.get("flush")),
        try_trigger_generation=bool(obj.get("try_trigger_generation")),
        context_id=context_id,
        close_context=bool(obj.get("close_context")),
        close_socket=bool(obj.get("close_socket")),
        voice_settings=voice_settings,
    )


INPUT_TIMEOUT = "input_timeout_exceeded"
# a context's stream that ended short -> ElevenLabs' error name, text to speech's and dialogue's (the outcome:
# Outcome.of_stream)
CUT_SHORT: Mapping[StreamStatus, str] = {
    StreamStatus.BUSY: BUSY,
    StreamStatus.FAILED: "generation_failed",
    StreamStatus.SHUTDOWN: "shutting_down",
}


def input_timeout_message(timeout_s: float) -> str:
    return f"Have not received a new text input within the timeout of {timeout_s:g} seconds"


class Closing(Protocol):
    closing: bool  # no more input: the context speaks what it has, then ends


def close_socket(session: Session[Any], now_s: float) -> None:
    """`close_socket` (text to speech's and text to dialogue's): every context ends (what was sent is spoken,
    each state's `closing` set), then the socket closes with 1000 (now, when none is open; else after the last
    context's final message)."""
    for ctx in list(session.contexts.values()):
        state: Closing = ctx.state
        state.closing = True
        if ctx.stream.status == StreamStatus.OPEN:
            ctx.stream.end(now_s)
    if not session.contexts:
        session.close(Outcome.COMPLETED, "close_socket")


def error_message(error: str, message: str, outcome: Outcome, context_id: str | None = None) -> str:
    body: dict[str, Any] = {"message": message, "error": error, "code": outcome.close_code}
    if context_id is not None:
        body["contextId"] = context_id
    return orjson.dumps(body).decode()


# ---- the protocol --------------------------------------------------------------------------------

# error code -> (ElevenLabs' error name, close code); every error closes the socket (vendor behaviour)
# but max_active_conversations (multi-stream-input: too many contexts), which leaves it open.
ERROR_NAMES: Mapping[str, str] = {
    TEXT_TOO_LONG: "max_character_limit_exceeded",
    CONTEXT_TEXT_LIMIT: "max_character_limit_exceeded",
    RATE_LIMITED: "rate_limited",
    EMPTY_MESSAGE: "invalid_message",
    "bad_state": "invalid_state",
}


@dataclass(slots=True)
class ContextInput:
    """What ElevenLabs keeps per context (multi-stream-input's bookkeeping), on the session's Context."""

    last_input_s: float
    alignment: ContextAlignment  # the context's segments on its audio timeline
    pieces: PieceJoiner = field(default_factory=PieceJoiner)
    unflushed: bool = False  # text arrived since the last flush
    closing: bool = False  # close_context / close_socket seen: no more input


ElevenLabsContext = Context[ContextInput]


class ElevenLabsProtocol(WireProtocol[ContextInput]):
    """`stream-input` (one context per socket); `MultiStreamProtocol` is `multi-stream-input`."""

    name: ClassVar[str] = "elevenlabs"
    multi: ClassVar[bool] = False

    def __init__(self, session: Session[ContextInput]) -> None:
        super().__init__(session)
        self.voice_id = session.transport.path_params.get("voice_id", "")
        self.query: Query | None = None
        self._closing_socket = False
        self._last_input_s = session.last_input_s

    # ---- the query is checked once the socket is open, so that errors go out in vendor shape ----

    async def on_open(self) -> None:
        try:
            self.query = parse_query(self.session.transport.query, self.session.port.router)
        except FieldError as error:
            self.session.reject(error)

    def on_refused(self, refusal: Refusal) -> None:
        self.session.send(error_message("busy", refusal.reason, refusal.outcome))

    def render_error(self, error: FieldError) -> None:
        cid = error.context_id if self.multi else None
        if error.busy:
            if self.multi:  # other contexts may be speaking: refuse this one, keep the socket
                busy_name = "max_active_conversations" if error.code == "too_many_contexts" else BUSY
                self.session.send(error_message(busy_name, error.message, Outcome.of_error(error), cid))
                return
            self._fail(BUSY, error.message, Outcome.of_error(error), cid)
            return
        name = ERROR_NAMES.get(error.code)
        if name is None:
            name = error.code if error.code != "bad_request" else f"invalid_{error.field or 'message'}"
        self._fail(name, error.message, Outcome.of_error(error), cid)

    def _fail(self, error: str, message: str, outcome: Outcome, context_id: str | None = None) -> None:
        self.session.send(error_message(error, message, outcome, context_id))
        self.session.close(outcome, message)  # nothing more is rendered; the contexts end with the session

    # ---- client messages -------------------------------------------------------------------------

    async def on_message(self, message: str | bytes, now_s: float) -> None:
        session = self.session
        if self.query is None or self._closing_socket:
            return  # refused in on_open (the close is on its way), or closing
        self._last_input_s = now_s
        try:
            parsed = parse_message(message)
        except FieldError as error:
            error.code = "invalid_message"
            session.reject(error)
            return
        if parsed.close_socket:
            self._close_socket(now_s)
            return
        cid = (parsed.context_id or DEFAULT_CONTEXT_ID) if self.multi else DEFAULT_CONTEXT_ID
        if parsed.close_context:
            self._close_context(cid, now_s)
            return
        if parsed.text is None and not parsed.flush:
            session.reject(empty_message(cid))  # `{}`, `{"text": null}`: nothing to do
            return
        ctx = session.contexts.get(cid)
        if ctx is not None and ctx.state.closing:
            if parsed.text == "" and not parsed.flush:
                return  # an empty text is a keep-alive (Pipecat's, every 10 s): nothing
            message = f"context {cid!r} is closing: nothing more is taken"
            if self.multi:  # an LLM's late token after close_context: this context's error, the socket goes on
                session.send(error_message("context_closing", message, Outcome.BAD_INPUT, cid))
            else:
                session.reject(FieldError("context_id", message, "context_closing", context_id=cid))
            return
        if ctx is None:
            if parsed.text == "" and not parsed.flush:
                if not self.multi:  # a turn of nothing is complete: its isFinal, as after any text
                    session.send(orjson.dumps({"isFinal": True}).decode())
                    session.close(Outcome.COMPLETED, "end of input before any text")
                return  # multi-stream-input: a keep-alive for a context that is not open changes nothing
            ctx = await self._open(cid, now_s, parsed.voice_settings)
            if ctx is None:
                return
        ctx.state.last_input_s = now_s
        try:
            await self._apply(ctx, parsed, now_s)
        except StreamStateError as exc:
            session.reject(FieldError("text", str(exc), "bad_state", context_id=cid))

    async def _apply(self, ctx: ElevenLabsContext, message: Message, now_s: float) -> None:
        stream = ctx.stream
        if stream.status != StreamStatus.OPEN:
            return  # the stream ended on its own (busy, failed); its isFinal is out
        text = message.text
        if text == "" and not message.flush:
            if not self.multi:  # stream-input: the empty text ends the input
                ctx.state.closing = True
                stream.end(now_s)
            return  # multi-stream-input: a keep-alive
        if text and await self.session.push_text(ctx, ctx.state.pieces.join(text), now_s) and text.strip():
            ctx.state.unflushed = True
        if message.flush and stream.status == StreamStatus.OPEN:
            stream.flush(now_s)
            ctx.state.unflushed = False

    async def _open(self, cid: str, now_s: float, voice_settings: Mapping[str, Any] | None
                    ) -> ElevenLabsContext | None:
        """A context opened by its first message (whose `voice_settings.speed` holds for the context)."""
        session = self.session
        query = self.query
        if query is None:
            return None
        try:
            spec = make_spec(session.port, voice_id=resolve_voice(session.port, self.voice_id),
                             output_format=query.output_format, seed=query.seed, routed=query.routed,
                             speed=voice_settings_speed(voice_settings), markup=elevenlabs_tags(query.model_id),
                             normalize=query.normalize)
        except FieldError as error:
            error.context_id = cid
            session.reject(error)
            return None
        state = ContextInput(last_input_s=now_s, alignment=ContextAlignment(lead_ms=query.output_format.lead_ms))
        return await session.open_context(cid, spec, state)

    def _close_context(self, cid: str, now_s: float) -> None:
        """Graceful when every piece of text was flushed (the turn is complete: speak it, then isFinal);
        otherwise, or when the context is already closing, it is a barge-in: stop now."""
        ctx = self.session.contexts.get(cid)
        if ctx is None:
            return
        if ctx.state.closing or ctx.state.unflushed:
            ctx.stream.cancel()
            return
        ctx.state.closing = True
        if ctx.stream.status == StreamStatus.OPEN:
            ctx.stream.end(now_s)

    def _close_socket(self, now_s: float) -> None:
        self._closing_socket = True
        close_socket(self.session, now_s)

    def on_tick(self, now_s: float) -> None:
        query = self.query
        session = self.session
        if query is None or session.state != SessionState.OPEN:
            return
        timeout_s = query.inactivity_timeout_s
        if not self.multi:
            ctx = session.contexts.get(DEFAULT_CONTEXT_ID)
            waiting_for_text = ctx is None or ctx.stream.status == StreamStatus.OPEN
            if waiting_for_text and now_s - self._last_input_s > timeout_s:
                self._fail(INPUT_TIMEOUT, input_timeout_message(timeout_s), Outcome.BAD_INPUT)
            return
        for cid, ctx in list(session.contexts.items()):
            if not ctx.state.closing and now_s - ctx.state.last_input_s > timeout_s:
                self._close_context(cid, now_s)

    # ---- stream events -> wire -------------------------------------------------------------------

    def render(self, ctx: ElevenLabsContext, event: StreamEvent) -> None:
        if isinstance(event, AudioOut):
            self.session.send_audio(ctx, self._audio_json(ctx, b64(event.payload), None, None), event.duration_ms)
        elif isinstance(event, SegmentDone) and event.text:  # a pause (<break>) has no characters
            aligned = ctx.state.alignment
            seg = place_segment(aligned, event)
            self.session.send(self._audio_json(ctx, "", _alignment(aligned.chained(seg)), _alignment(seg)), ctx)
        elif isinstance(event, StreamDone):
            self._render_done(ctx, event)

    def _audio_json(self, ctx: ElevenLabsContext, audio: str, alignment: dict[str, Any] | None,
                    normalized: dict[str, Any] | None) -> str:
        body: dict[str, Any] = {"audio": audio, "isFinal": None, "normalizedAlignment": normalized,
                                "alignment": alignment}
        if self.multi:
            body["contextId"] = ctx.context_id
        return orjson.dumps(body).decode()

    def _render_done(self, ctx: ElevenLabsContext, event: StreamDone) -> None:
        session = self.session
        cid = ctx.context_id if self.multi else None
        if event.status in CUT_SHORT:
            # a turn cut short is never an isFinal: the client must not take it for the whole answer
            outcome, error = Outcome.of_stream(event.status), CUT_SHORT[event.status]
            session.send(error_message(error, event.detail or error, outcome, cid))
            if not self.multi:
                session.close(outcome, event.detail)
                return
        final: dict[str, Any] = {"isFinal": True}
        if self.multi:
            final["contextId"] = ctx.context_id
        session.send(orjson.dumps(final).decode())
        others_open = any(c is not ctx for c in session.contexts.values())
        if not self.multi or (self._closing_socket and not others_open):
            session.close(Outcome.COMPLETED, "")


class MultiStreamProtocol(ElevenLabsProtocol):
    multi: ClassVar[bool] = True


def _alignment(seg: SegmentTimes) -> dict[str, Any]:
    return {"chars": list(seg.chars), "charStartTimesMs": list(seg.start_ms), "charDurationsMs": list(seg.duration_ms)}
