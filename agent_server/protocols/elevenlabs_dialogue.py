"""ElevenLabs text to dialogue (the eleven_v3 / v4 API): several voices in one answer, each line said by
its own voice. The wire formats, on the session core; a line is a turn of the context's stream
(`SpeechStream.start_turn`: no segment holds two lines, each segment goes to the engine with its line's voice).

HTTP (`POST`, JSON body; the `elevenlabs` SDK's `text_to_dialogue.convert`, `.stream`,
`.convert_with_timestamps`, `.stream_with_timestamps`; LiveKit's `elevenlabs.TTS(model="eleven_v3")`
`synthesize`):
- `/v1/text-to-dialogue`, `/v1/text-to-dialogue/stream`: the audio in `output_format`;
- `/v1/text-to-dialogue/with-timestamps`: `{"audio_base64", "alignment", "normalized_alignment",
  "voice_segments"}`; `/v1/text-to-dialogue/stream/with-timestamps`: one such line per piece of audio
  (`voice_segments` []) and, after each segment's audio, a line with its alignment and voice segment.
Body: `inputs` (required: 1..MAX_INPUTS objects `{"text", "voice_id"}`, at most MAX_VOICES distinct voices),
`model_id`, `language_code`, `seed`, `apply_text_normalization` (served as in text to speech);
`settings` (an object: stability, similarity, clone_strength), `previous_text`, `future_text`,
`pronunciation_dictionary_locators`, `use_pvc_as_ivc`, `previous_request_ids`, `next_request_ids`,
`audio_effects` (type-checked, ignored). Errors as text to speech's (protocols/elevenlabs_http.py): 422 with
`{"detail": [{"loc", "msg", "type"}]}` for a bad request. A `voice_segments` entry: `{"voice_id"` (as the
client named it), `"start_time_seconds", "end_time_seconds", "character_start_index", "character_end_index"`
(into that body's or line's `alignment.characters`), `"dialogue_input_index"}`.

WebSocket `/v1/text-to-dialogue/multi-stream-input` (many contexts per socket; what LiveKit opens) and
`/v1/text-to-dialogue/stream-input` (one; no `context_id`):
- query: model_id, output_format, language_code, seed, apply_text_normalization, sync_alignment (alignment
  is sent only with `sync_alignment=true`, as the vendor documents), inactivity_timeout (s, default 20);
- in: a context's first message carries `voices` (1..MAX_VOICES ids; `voice_settings`,
  `pronunciation_dictionary_locators` accepted there), then `{"context_id", "inputs": [{"text", "voice_id",
  "new_turn"}], "flush"}`: a voice other than the last input's, or `new_turn`, starts a new line;
  `{"context_id", "keep_alive": true}` resets the context's inactivity timer; `{"context_id",
  "close_context": true}` speaks what was sent, then `is_final` (a second one stops it now: barge-in);
  `{"close_socket": true}` ends every context, then the socket closes with 1000. A context that hears
  nothing for the inactivity timeout is closed as by `close_context`.
- out: `{"audio", "context_id"}` per piece; with sync_alignment, after each segment's audio
  `{"audio": "", "alignment": {"chars", "char_start_times_ms", "char_durations_ms"}, "context_id"}`;
  `{"is_final_audio_for_turn": true, "context_id"}` once the audio of a flush is all out; `{"is_final": true,
  "context_id"}` when the context ends; errors `{"message", "error", "code", "param", "context_id"}`.
  Alignment times are relative to the message ("alignment restarts at 0 on every message"): the place of an
  audio-less message is the end of the audio sent before it, so its characters, said before that, have
  negative times. LiveKit finds that place by adding up the audio it received, Pipecat by adding up each
  alignment's span: a one-space alignment before each segment's brings the spans to that place too
  (`_send_alignment`), so both land each word at its time.
"""

from __future__ import annotations

import collections
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, ClassVar

import orjson

from agent_server.audio.codecs import MS_PER_S, StreamFormat
from agent_server.core.events import AudioOut, SegmentDone, StreamDone, StreamEvent, StreamStateError, StreamStatus
from agent_server.core.outcomes import Outcome, Refusal
from agent_server.core.session import (
    Context,
    Session,
    SessionState,
    WireProtocol,
)
from agent_server.errors import BUSY, FieldError, empty_message
from agent_server.protocols.common import (
    b64,
    elevenlabs_normalization,
    load_object,
    make_spec,
    parse_seed,
    place_segment,
    resolve_voice,
    route,
)
from agent_server.protocols.elevenlabs import (
    CUT_SHORT,
    DEFAULT_CONTEXT_ID,
    ERROR_NAMES,
    INPUT_TIMEOUT,
    MAX_CONTEXT_ID_CHARS,
    Query,
    close_socket,
    input_timeout_message,
    parse_query,
)
from agent_server.protocols.elevenlabs_http import (
    BODY_FIELDS as SPEECH_BODY_FIELDS,
)
from agent_server.protocols.elevenlabs_http import (
    ElevenLabsHttpProtocol,
    HttpState,
    LineTrack,
    SpeechRequest,
    check_optional_types,
)
from agent_server.protocols.http_speech import HttpSpeechRequest, Turn
from agent_server.protocols.vendor_formats import elevenlabs_format
from agent_server.text.markup import ELEVENLABS_V3_TAGS
from agent_server.text.timestamps import ContextAlignment, SegmentTimes

MAX_GONE_CONTEXTS = 256  # refused or ended context ids remembered per socket (their late messages get an error)
MAX_VOICES = 10  # distinct voices in one request or context, as the vendor allows
MAX_INPUTS = 1000  # lines in one HTTP request (the text limits bound it too)
INPUT_FIELDS = frozenset({"text", "voice_id"})
WS_INPUT_FIELDS = frozenset({"text", "voice_id", "new_turn"})
BODY_FIELDS = (SPEECH_BODY_FIELDS - {"text", "voice_settings", "next_text", "apply_language_text_normalization"}) | {
    "inputs", "settings", "future_text"}
MESSAGE_FIELDS = frozenset(
    {"context_id", "inputs", "flush", "close_context", "close_socket", "keep_alive", "voices", "voice_settings",
     "pronunciation_dictionary_locators", "xi_api_key", "authorization", "single_use_token"}
)

BODY_TYPES: Mapping[str, tuple[type, ...]] = {
    "settings": (dict,),
    "audio_effects": (dict,),
    "pronunciation_dictionary_locators": (list,),
    "previous_request_ids": (list,),
    "next_request_ids": (list,),
    "previous_text": (str,),
    "future_text": (str,),
    "model_id": (str,),
    "language_code": (str,),
    "use_pvc_as_ivc": (bool,),
}
FIRST_MESSAGE_TYPES: Mapping[str, tuple[type, ...]] = {
    "voice_settings": (dict,),
    "pronunciation_dictionary_locators": (list,),
}


# ---- pure: the lines -------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Line:
    voice_id: str  # as the client named it
    text: str
    new_turn: bool = False


def parse_lines(raw: object, fields: frozenset[str], voices: Sequence[str] | None = None) -> list[Line]:
    """`inputs`: a list of `{"text", "voice_id"}` objects. With `voices`, each voice must be one of them."""
    if not isinstance(raw, list):
        raise FieldError("inputs", "inputs must be a list of {\"text\", \"voice_id\"} objects")
    lines = []
    for i, item in enumerate(raw):
        where = f"inputs[{i}]"
        if not isinstance(item, dict):
            raise FieldError(where, f"{where} must be an object with text and voice_id")
        unknown = sorted(set(item) - fields)
        if unknown:
            raise FieldError(f"{where}.{unknown[0]}", f"extra field {unknown[0]!r} is not permitted")
        text, voice_id, new_turn = item.get("text"), item.get("voice_id"), item.get("new_turn")
        if not isinstance(text, str):
            raise FieldError(f"{where}.text", f"{where}.text must be a string")
        if not isinstance(voice_id, str) or not voice_id:
            raise FieldError(f"{where}.voice_id", f"{where}.voice_id must be a non-empty string")
        if voices is not None and voice_id not in voices:
            raise FieldError(f"{where}.voice_id",
                             f"voice {voice_id!r} is not one of this context's voices {list(voices)}")
        if new_turn is not None and not isinstance(new_turn, bool):
            raise FieldError(f"{where}.new_turn", f"{where}.new_turn must be true or false")
        lines.append(Line(voice_id, text, bool(new_turn)))
    return lines


def check_voices(field_name: str, voice_ids: Sequence[str]) -> None:
    if len(set(voice_ids)) > MAX_VOICES:
        raise FieldError(field_name, f"at most {MAX_VOICES} distinct voices (got {len(set(voice_ids))})")


# ---- HTTP ------------------------------------------------------------------------------------------


class DialogueHttpProtocol(ElevenLabsHttpProtocol):
    """`POST /v1/text-to-dialogue`; the subclasses below are its other three routes."""

    name: ClassVar[str] = "elevenlabs_dialogue_http"
    text_field: ClassVar[str] = "inputs"

    def parse(self, body: bytes) -> HttpSpeechRequest[HttpState]:
        session = self.session
        transport = session.transport
        output = elevenlabs_format(transport.query.get("output_format"))
        obj = load_object(body, BODY_FIELDS, what="body", unknown_message="extra field {name!r} is not permitted")
        if "inputs" not in obj:
            raise FieldError("inputs", "inputs is required: a list of {\"text\", \"voice_id\"} objects")
        lines = parse_lines(obj["inputs"], INPUT_FIELDS)
        if not 1 <= len(lines) <= MAX_INPUTS:
            raise FieldError("inputs", f"inputs must hold 1..{MAX_INPUTS} lines (got {len(lines)})")
        check_voices("inputs", [line.voice_id for line in lines])
        if not any(line.text.strip() for line in lines):
            raise empty_message(field="inputs")
        check_optional_types(obj, BODY_TYPES)
        request = SpeechRequest(
            voice_id=lines[0].voice_id, text="".join(line.text for line in lines), model_id=obj.get("model_id"),
            routed=route(session.port.router, model_field="model_id", model=obj.get("model_id"),
                         language_field="language_code", language=obj.get("language_code")),
            seed=parse_seed("seed", obj.get("seed")), output=output, speed=1.0,
            normalize=elevenlabs_normalization(obj.get("apply_text_normalization")), streamed=self.streamed,
            timestamps=self.timestamps,
        )
        turns = tuple(Turn(resolve_voice(session.port, line.voice_id), line.text) for line in lines)
        spec = make_spec(session.port, voice_id=turns[0].voice_id, output_format=output, seed=request.seed,
                         routed=request.routed, markup=ELEVENLABS_V3_TAGS, normalize=request.normalize)
        state = HttpState(request, ContextAlignment(lead_ms=output.lead_ms),
                          lines=LineTrack([line.voice_id for line in lines]))
        return HttpSpeechRequest(spec, request.text, state, turns)


class DialogueStreamProtocol(DialogueHttpProtocol):
    streamed: ClassVar[bool] = True


class DialogueWithTimestampsProtocol(DialogueHttpProtocol):
    timestamps: ClassVar[bool] = True


class DialogueStreamWithTimestampsProtocol(DialogueHttpProtocol):
    streamed: ClassVar[bool] = True
    timestamps: ClassVar[bool] = True


# ---- WebSocket -------------------------------------------------------------------------------------


RAW_BYTES_PER_SAMPLE: Mapping[str, int] = {"pcm_s16le": 2, "pcm_f32le": 4, "mulaw": 1, "alaw": 1}
OGG_PAGE_HEADER_BYTES = 27
OPUS_GRANULE_PER_MS = 48  # Ogg Opus granule positions count 48 kHz samples


@dataclass(slots=True)
class ReceivedAudio:
    """How much audio the bytes sent so far hold, counted from the bytes as a client counts them (LiveKit
    places an audio-less message there): raw PCM and G.711 by their size; MP3 (constant bit rate) by size x 8 /
    bit rate, its encoder's priming included; Ogg Opus by its last complete page's granule position. The
    encoders' own count (what went into the codec, the priming added) for the rest: a codec holds back
    audio it has taken (MP3: up to ~100 ms), which a client has not received yet."""

    fmt: StreamFormat
    bytes_sent: int = 0
    encoded_ms: float = 0.0
    ogg_end_ms: float = 0.0
    ogg_tail: bytes = b""

    def add(self, payload: bytes, duration_ms: float) -> None:
        self.bytes_sent += len(payload)
        self.encoded_ms += duration_ms
        if self.fmt.container == "ogg":
            self.ogg_tail += payload
            while len(self.ogg_tail) >= OGG_PAGE_HEADER_BYTES:
                header_bytes = OGG_PAGE_HEADER_BYTES + self.ogg_tail[OGG_PAGE_HEADER_BYTES - 1]
                if len(self.ogg_tail) < header_bytes:
                    break
                page_bytes = header_bytes + sum(self.ogg_tail[OGG_PAGE_HEADER_BYTES:header_bytes])
                if len(self.ogg_tail) < page_bytes:
                    break
                granule = int.from_bytes(self.ogg_tail[6:14], "little", signed=True)
                if granule > 0:  # 0 on header pages, -1 on a page where no packet ends
                    self.ogg_end_ms = granule / OPUS_GRANULE_PER_MS
                self.ogg_tail = self.ogg_tail[page_bytes:]

    @property
    def ms(self) -> float:
        fmt = self.fmt
        if fmt.container == "raw":
            return self.bytes_sent * MS_PER_S / (RAW_BYTES_PER_SAMPLE[fmt.codec] * fmt.sample_rate_hz)
        bitrate_bps = fmt.effective_bitrate_bps
        if fmt.container == "mp3" and bitrate_bps:
            return self.bytes_sent * 8 * MS_PER_S / bitrate_bps
        if fmt.container == "ogg":
            return self.ogg_end_ms
        return fmt.lead_ms + self.encoded_ms


@dataclass(slots=True)
class DialogueContext:
    """What a dialogue context keeps beside its stream."""

    voices: tuple[str, ...]  # the context's voices, as the client named them
    last_input_s: float
    alignment: ContextAlignment
    received: ReceivedAudio  # the audio sent so far, as the client counts it (where an audio-less message sits)
    voice: str | None = None  # the voice of the last line (None: no line yet)
    spans_ms: int | None = None  # the alignment spans sent so far, added up (None: no alignment yet)
    flushed: bool = False  # a flush waits for its audio to be all out (is_final_audio_for_turn)
    closing: bool = False  # close_context / close_socket / inactivity: no more input


DialogueCtx = Context[DialogueContext]


def error_message(error: str, message: str, outcome: Outcome, param: str | None, context_id: str | None) -> str:
    body: dict[str, Any] = {"message": message, "error": error, "code": outcome.close_code, "param": param}
    if context_id is not None:
        body["context_id"] = context_id
    return orjson.dumps(body).decode()


class DialogueProtocol(WireProtocol[DialogueContext]):
    """`/v1/text-to-dialogue/stream-input` (one context); `MultiDialogueProtocol` is `multi-stream-input`."""

    name: ClassVar[str] = "elevenlabs_dialogue"
    multi: ClassVar[bool] = False

    def __init__(self, session: Session[DialogueContext]) -> None:
        super().__init__(session)
        self.query: Query | None = None
        self._closing_socket = False
        # contexts refused (busy: True) or ended (False), by id: a later message for one gets an error of its own,
        # not "first message needs voices" (which would close the socket and every other context with it)
        self._gone: collections.OrderedDict[str, bool] = collections.OrderedDict()

    async def on_open(self) -> None:
        try:
            self.query = parse_query(self.session.transport.query, self.session.port.router)
        except FieldError as error:
            self.session.reject(error)

    def on_refused(self, refusal: Refusal) -> None:
        self.session.send(error_message(BUSY, refusal.reason, refusal.outcome, None, None))

    def render_error(self, error: FieldError) -> None:
        cid = error.context_id if self.multi else None
        outcome = Outcome.of_error(error)
        if error.busy:
            name = "max_active_conversations" if error.code == "too_many_contexts" else BUSY
            self.session.send(error_message(name, error.message, outcome, error.field or None, cid))
            if not self.multi:
                self.session.close(outcome, error.message)
            return  # multi: other contexts may be speaking; this one is refused, the socket stays
        name = ERROR_NAMES.get(error.code) or (error.code if error.code != "bad_request" else "invalid_message")
        self.session.send(error_message(name, error.message, outcome, error.field or None, cid))
        self.session.close(outcome, error.message)

    # ---- client messages -------------------------------------------------------------------------

    async def on_message(self, message: str | bytes, now_s: float) -> None:
        session = self.session
        if self.query is None or self._closing_socket:
            return
        try:
            obj = load_object(message, MESSAGE_FIELDS)
            flags = {name: _flag(obj, name) for name in ("flush", "close_context", "close_socket", "keep_alive")}
            cid = _context_id(obj, self.multi, flags["close_socket"])
        except FieldError as error:
            session.reject(error)
            return
        if flags["close_socket"]:
            self._close_socket(now_s)
            return
        ctx = session.contexts.get(cid)
        if ctx is None and (flags["close_context"] or flags["keep_alive"]) and "voices" not in obj:
            return  # nothing open under that id: nothing to close or keep alive
        if ctx is None and "voices" not in obj and cid in self._gone:
            refused = self._gone[cid]
            why = "was refused (busy)" if refused else "has ended"
            session.send(error_message("context_closed", f"context {cid!r} {why}: open it again with voices",
                                       Outcome.BUSY if refused else Outcome.BAD_INPUT, "context_id", cid))
            return  # the socket stays open: the client's other contexts go on
        if ctx is None:
            self._gone.pop(cid, None)
            ctx = await self._open(cid, obj, now_s)
            if ctx is None:
                if session.state == SessionState.OPEN:
                    self._forget(cid, refused=True)
                return
        elif "voices" in obj:
            session.reject(FieldError("voices", "voices are set by a context's first message only",
                                      context_id=cid))
            return
        state = ctx.state
        state.last_input_s = now_s
        if flags["close_context"]:
            self._close_context(ctx, now_s)
            return
        try:
            lines = parse_lines(obj["inputs"], WS_INPUT_FIELDS, state.voices) if "inputs" in obj else []
        except FieldError as error:
            error.context_id = cid
            session.reject(error)
            return
        if state.closing:
            if lines or flags["flush"]:  # refused for that context; the client's other contexts go on
                session.send(error_message("context_closing", f"context {cid!r} is closing: nothing more is taken",
                                           Outcome.BAD_INPUT, "context_id", cid))
            return
        try:
            await self._apply(ctx, lines, flags["flush"], now_s)
        except StreamStateError as exc:
            session.reject(FieldError("inputs", str(exc), "bad_state", context_id=cid))

    async def _apply(self, ctx: DialogueCtx, lines: Sequence[Line], flush: bool, now_s: float) -> None:
        stream, state = ctx.stream, ctx.state
        if stream.status != StreamStatus.OPEN:
            return  # it ended on its own (busy, failed): its error and is_final are out
        for line in lines:
            if line.voice_id != state.voice or line.new_turn:
                stream.start_turn(resolve_voice(self.session.port, line.voice_id), now_s)
                state.voice = line.voice_id
            if line.text and not await self.session.push_text(ctx, line.text, now_s):
                return
        if flush and stream.status == StreamStatus.OPEN:
            stream.flush(now_s)
            state.flushed = True
            if stream.all_segments_done:  # nothing to say, or all of it said: the turn's audio is all out now
                state.flushed = False
                self.session.send(self._json(ctx, {"is_final_audio_for_turn": True}), ctx)

    async def _open(self, cid: str, obj: Mapping[str, Any], now_s: float) -> DialogueCtx | None:
        session = self.session
        query = self.query
        if query is None:
            return None
        try:
            voices = obj.get("voices")
            if not isinstance(voices, list) or not voices or not all(isinstance(v, str) and v for v in voices):
                raise FieldError("voices", "a context's first message needs voices: a list of 1.."
                                 f"{MAX_VOICES} voice ids")
            check_voices("voices", voices)
            check_optional_types(obj, FIRST_MESSAGE_TYPES)
            spec = make_spec(session.port, voice_id=resolve_voice(session.port, voices[0]),
                             output_format=query.output_format, seed=query.seed, routed=query.routed,
                             markup=ELEVENLABS_V3_TAGS, normalize=query.normalize)
        except FieldError as error:
            error.context_id = cid
            session.reject(error)
            return None
        state = DialogueContext(tuple(voices), now_s, ContextAlignment(lead_ms=query.output_format.lead_ms),
                                ReceivedAudio(query.output_format))
        return await session.open_context(cid, spec, state)

    def _close_context(self, ctx: DialogueCtx, now_s: float) -> None:
        """Speak what was sent, then is_final; a second close (or one on a closing context) stops it now."""
        if ctx.state.closing:
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
        if not self.multi and not session.contexts and now_s - session.last_input_s > query.inactivity_timeout_s:
            message = input_timeout_message(query.inactivity_timeout_s)
            session.send(error_message(INPUT_TIMEOUT, message, Outcome.BAD_INPUT, None, None))
            session.close(Outcome.BAD_INPUT, message)  # stream-input, as text to speech's: a socket that never spoke
            return
        for ctx in list(self.session.contexts.values()):
            if not ctx.state.closing and now_s - ctx.state.last_input_s > query.inactivity_timeout_s:
                self._close_context(ctx, now_s)

    # ---- stream events -> wire -------------------------------------------------------------------

    def render(self, ctx: DialogueCtx, event: StreamEvent) -> None:
        state = ctx.state
        if isinstance(event, AudioOut):
            state.received.add(event.payload, event.duration_ms)
            self.session.send_audio(ctx, self._json(ctx, {"audio": b64(event.payload)}), event.duration_ms)
        elif isinstance(event, SegmentDone):
            if event.text:  # a pause (<break>) has no characters
                seg = place_segment(state.alignment, event)
                if self.query is not None and self.query.sync_alignment:
                    self._send_alignment(ctx, seg)
            if state.flushed and ctx.stream.all_segments_done:
                state.flushed = False
                self.session.send(self._json(ctx, {"is_final_audio_for_turn": True}), ctx)
        elif isinstance(event, StreamDone):
            self._render_done(ctx, event)

    def _send_alignment(self, ctx: DialogueCtx, seg: SegmentTimes) -> None:
        """A segment's alignment, relative to where its message sits: the audio sent before it (what LiveKit
        adds). Pipecat adds up the messages' spans instead (each one's last character's end): a message of one
        space first moves that sum to the same place (an empty alignment opens the context's, as Pipecat strips
        spaces that lead it), so both clients land every character at its time."""
        state = ctx.state
        here_ms = round(state.received.ms)
        if state.spans_ms is None:
            self.session.send(self._json(ctx, {"audio": "", "alignment": _chars([], [], [])}), ctx)
            state.spans_ms = 0
        if state.spans_ms != here_ms:
            self.session.send(self._json(ctx, {"audio": "", "alignment": _chars([" "], [here_ms - state.spans_ms],
                                                                                  [0])}), ctx)
        starts = [start - here_ms for start in seg.start_ms]
        durations = [end - start for start, end in zip(seg.start_ms, seg.end_ms, strict=True)]
        self.session.send(self._json(ctx, {"audio": "", "alignment": _chars(list(seg.chars), starts, durations)}),
                          ctx)
        state.spans_ms = seg.end_ms[-1] if seg.end_ms else here_ms

    def _json(self, ctx: DialogueCtx, body: dict[str, Any]) -> str:
        if self.multi:
            body["context_id"] = ctx.context_id
        return orjson.dumps(body).decode()

    def _forget(self, cid: str, *, refused: bool) -> None:
        self._gone[cid] = refused
        self._gone.move_to_end(cid)
        while len(self._gone) > MAX_GONE_CONTEXTS:
            self._gone.popitem(last=False)

    def _render_done(self, ctx: DialogueCtx, event: StreamDone) -> None:
        self._forget(ctx.context_id, refused=False)
        session = self.session
        cid = ctx.context_id if self.multi else None
        if event.status in CUT_SHORT:
            outcome, error = Outcome.of_stream(event.status), CUT_SHORT[event.status]
            session.send(error_message(error, event.detail or error, outcome, None, cid))
            if not self.multi:
                session.close(outcome, event.detail)
                return
        session.send(self._json(ctx, {"is_final": True}))
        others_open = any(c is not ctx for c in session.contexts.values())
        if not self.multi or (self._closing_socket and not others_open):
            session.close(Outcome.COMPLETED, "")


class MultiDialogueProtocol(DialogueProtocol):
    multi: ClassVar[bool] = True


def _flag(obj: Mapping[str, Any], name: str) -> bool:
    value = obj.get(name)
    if value is not None and not isinstance(value, bool):
        raise FieldError(name, f"{name} must be true or false")
    return bool(value)


def _context_id(obj: Mapping[str, Any], multi: bool, close_socket: bool) -> str:
    if not multi:
        if "context_id" in obj:
            raise FieldError("context_id", "stream-input has one context: use multi-stream-input for context_id")
        return DEFAULT_CONTEXT_ID
    cid = obj.get("context_id")
    if cid is None and close_socket:
        return DEFAULT_CONTEXT_ID
    if not isinstance(cid, str) or not 0 < len(cid) <= MAX_CONTEXT_ID_CHARS:
        raise FieldError("context_id", f"context_id is required: a string of 1..{MAX_CONTEXT_ID_CHARS} characters")
    return cid


def _chars(chars: list[str], start_ms: list[int], duration_ms: list[int]) -> dict[str, Any]:
    return {"chars": chars, "char_start_times_ms": start_ms, "char_durations_ms": duration_ms}
