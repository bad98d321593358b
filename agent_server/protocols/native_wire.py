"""The native WebSocket protocol, version 1 (docs/protocol.md): pure data, no I/O, no awaits.

Client -> server: JSON text messages, one dataclass each (`Open`, `Text`, `Flush`, `End`, `Cancel`).
`parse(raw)` returns one of them, or a `FieldError` naming the offending field; it never raises. Text
limits are not the parser's: the session core applies one set for every protocol. A message with an
`event` and no `type` is a Twilio Media Streams message a bridge forwards (`TwilioMessage`: the Twilio
output mode, docs/protocol.md; protocols/twilio.py parses it).

Server -> client: JSON text events (`encode(event)`) and binary audio frames
(`encode_frame(header, payload)`): a 12-byte little-endian header, then the audio bytes.
"""

from __future__ import annotations

import struct
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import orjson

from agent_server.audio.formats import OutputFormat
from agent_server.core.events import parse_speed
from agent_server.errors import FieldError
from synth.api import VARIANTS

PROTOCOL_VERSION = 1

DEFAULT_ENCODING = "pcm_s16le"
DEFAULT_SAMPLE_RATE_HZ = 24_000
DEFAULT_FRAME_MS = 20

MAX_CONTEXT_ID_CHARS = 64
MAX_VOICE_ID_CHARS = 64
MAX_MODEL_NAME_CHARS = 64
CONTEXT_ID_CHARS = frozenset("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789_-.:")

# ---- binary audio frames ------------------------------------------------------------------------

# version u8 · encoding u8 · segment index u16 (mod 2**16) · stream id u32 · frame seq u32 (per context, from 0)
FRAME_HEADER = struct.Struct("<BBHII")
FRAME_HEADER_BYTES = FRAME_HEADER.size  # 12
ENCODING_CODES: Mapping[str, int] = {"pcm_s16le": 1, "mulaw": 2, "alaw": 3}


@dataclass(frozen=True, slots=True)
class FrameHeader:
    stream_id: int  # from the context_started event of that context
    seq: int  # 0, 1, 2 ... per context: a gap or a repeat means loss or reordering
    segment_index: int  # the segment playing when the frame was completed (mod 2**16)
    encoding_code: int  # ENCODING_CODES
    version: int = PROTOCOL_VERSION


def encode_frame(header: FrameHeader, payload: bytes) -> bytes:
    head = FRAME_HEADER.pack(
        header.version, header.encoding_code, header.segment_index & 0xFFFF, header.stream_id, header.seq
    )
    return head + payload


def decode_frame(data: bytes) -> tuple[FrameHeader, bytes]:
    """For clients and tests. Raises ValueError on a frame too short or of another version."""
    if len(data) < FRAME_HEADER_BYTES:
        raise ValueError(f"audio frame shorter than its {FRAME_HEADER_BYTES}-byte header")
    version, encoding_code, segment_index, stream_id, seq = FRAME_HEADER.unpack_from(data)
    if version != PROTOCOL_VERSION:
        raise ValueError(f"audio frame version {version}, expected {PROTOCOL_VERSION}")
    return FrameHeader(stream_id, seq, segment_index, encoding_code, version), data[FRAME_HEADER_BYTES:]


# ---- client messages ----------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Open:
    context_id: str
    voice: str = "default"
    model: str | None = None  # a model name (ours or a vendor's), routed by the server's table (core/routing.py)
    output_format: OutputFormat = field(
        default_factory=lambda: OutputFormat.parse(DEFAULT_ENCODING, DEFAULT_SAMPLE_RATE_HZ, DEFAULT_FRAME_MS)
    )
    sampling: tuple[tuple[str, float | int], ...] = ()  # overrides of the variant's SamplingParams defaults
    seed: int | None = None
    language: str | None = None
    text: str = ""  # optional first text piece
    cache: bool = True  # False: never served from, nor stored in, the phrase cache
    speed: float = 1.0  # the audio played this much faster (0.25-4), its pitch kept
    breaks: bool = False  # `<break time="..."/>` in the text is a pause (agent_server/text/markup.py)
    normalize: bool = True  # numbers, money, times ... said as words (agent_server/text/normalize/)
    twilio_stream_sid: str | None = None  # the Twilio output mode: the call's streamSid


@dataclass(frozen=True, slots=True)
class Text:
    context_id: str
    text: str | None  # None: the message carries none (the session core answers `empty_message`)


@dataclass(frozen=True, slots=True)
class Flush:
    context_id: str


@dataclass(frozen=True, slots=True)
class End:
    context_id: str


@dataclass(frozen=True, slots=True)
class Cancel:
    context_id: str


@dataclass(frozen=True, slots=True)
class KeepAlive:
    """Keeps an idle socket from the inactivity timeout; no context, no answer."""


@dataclass(frozen=True, slots=True)
class TwilioMessage:
    """A Twilio Media Streams message (`mark`, `clear`, `stop`, ...), as a bridge forwards it."""

    body: Mapping[str, Any]


Message = Open | Text | Flush | End | Cancel | KeepAlive | TwilioMessage


# sampling field name -> accepted Python type (bool is rejected separately: it is an int subclass)
SAMPLING_FIELDS: Mapping[str, type] = {
    "temperature": float,
    "top_p": float,
    "min_p": float,
    "top_k": int,
    "repetition_penalty": float,
    "cfg_weight": float,
    "exaggeration": float,
    "max_new_tokens": int,
}

MESSAGE_FIELDS: Mapping[str, frozenset[str]] = {
    "open": frozenset(
        {"type", "context_id", "voice", "model", "output_format", "sampling", "seed", "language", "text", "cache",
         "speed", "breaks", "normalize", "twilio"}
    ),
    "text": frozenset({"type", "context_id", "text"}),
    "flush": frozenset({"type", "context_id"}),
    "end": frozenset({"type", "context_id"}),
    "cancel": frozenset({"type", "context_id"}),
    "keepalive": frozenset({"type"}),
}
FORMAT_FIELDS = frozenset({"encoding", "sample_rate_hz", "frame_ms"})
MAX_STREAM_SID_CHARS = 64


def parse(raw: str | bytes) -> Message | FieldError:
    """One client message -> a Message, or a FieldError naming the field at fault. Never raises."""
    if isinstance(raw, bytes):
        return FieldError("message", "binary messages are not accepted: send JSON text messages")
    try:
        obj = orjson.loads(raw)
    except orjson.JSONDecodeError as exc:
        return FieldError("message", f"malformed JSON: {exc}")
    if not isinstance(obj, dict):
        return FieldError("message", "a message must be a JSON object")
    kind = obj.get("type")
    if kind is None and "event" in obj:
        return TwilioMessage(obj)
    context_id = obj.get("context_id") if isinstance(obj.get("context_id"), str) else None
    try:
        if not isinstance(kind, str):
            raise FieldError("type", "missing or not a string: one of " + ", ".join(MESSAGE_FIELDS))
        allowed = MESSAGE_FIELDS.get(kind)
        if allowed is None:
            raise FieldError("type", f"unknown message type {kind!r}: one of " + ", ".join(MESSAGE_FIELDS))
        unknown = sorted(set(obj) - allowed)
        if unknown:
            raise FieldError(unknown[0], f"unknown field in {'an' if kind[:1] in 'aeiou' else 'a'} {kind!r} message")
        if kind == "keepalive":
            return KeepAlive()
        context_id = _context_id(obj)
        if kind == "open":
            return _open(obj, context_id)
        if kind == "text":
            return Text(context_id, _optional_text(obj, "text"))
        if kind == "flush":
            return Flush(context_id)
        if kind == "end":
            return End(context_id)
        return Cancel(context_id)
    except FieldError as exc:
        exc.context_id = context_id
        return exc


def _context_id(obj: Mapping[str, Any]) -> str:
    value = obj.get("context_id")
    if not isinstance(value, str):
        raise FieldError("context_id", "missing or not a string")
    if not (1 <= len(value) <= MAX_CONTEXT_ID_CHARS) or not set(value) <= CONTEXT_ID_CHARS:
        raise FieldError("context_id", f"must be 1-{MAX_CONTEXT_ID_CHARS} characters of [A-Za-z0-9_.:-]")
    return value


def _optional_text(obj: Mapping[str, Any], name: str) -> str | None:
    value = obj.get(name)
    if value is not None and not isinstance(value, str):
        raise FieldError(name, "must be a string")
    return value


def _open(obj: Mapping[str, Any], context_id: str) -> Open:
    voice = obj.get("voice", "default")
    if not isinstance(voice, str) or not (1 <= len(voice) <= MAX_VOICE_ID_CHARS):
        raise FieldError("voice", f"must be a voice id: a string of 1-{MAX_VOICE_ID_CHARS} characters")
    model = obj.get("model")
    if model is not None and (not isinstance(model, str) or not 1 <= len(model) <= MAX_MODEL_NAME_CHARS):
        raise FieldError("model", f"must be a model name: {', '.join(VARIANTS)}, or a vendor's (routed by the "
                                  "server's route table)")
    seed = obj.get("seed")
    if seed is not None and (not _is_int(seed) or not (0 <= seed < 2**63)):
        raise FieldError("seed", "must be an integer in [0, 2**63)")
    language = obj.get("language")
    if language is not None and (
        not isinstance(language, str) or not (2 <= len(language) <= 3) or not language.isalpha()
    ):
        raise FieldError("language", "must be a 2- or 3-letter language code such as 'fr'")
    cache = obj.get("cache", True)
    if not isinstance(cache, bool):
        raise FieldError("cache", "must be true or false")
    breaks = obj.get("breaks", False)
    if not isinstance(breaks, bool):
        raise FieldError("breaks", "must be true or false")
    normalize = obj.get("normalize", True)
    if not isinstance(normalize, bool):
        raise FieldError("normalize", "must be true or false")
    return Open(
        context_id=context_id,
        voice=voice,
        model=model,
        output_format=_output_format(obj.get("output_format")),
        sampling=_sampling(obj.get("sampling")),
        seed=seed,
        language=language.lower() if language else None,
        text=_optional_text(obj, "text") or "",
        cache=cache,
        speed=parse_speed("speed", obj.get("speed")),
        breaks=breaks,
        normalize=normalize,
        twilio_stream_sid=_twilio(obj),
    )


def _twilio(obj: Mapping[str, Any]) -> str | None:
    value = obj.get("twilio")
    if value is None:
        return None
    if not isinstance(value, dict) or set(value) != {"stream_sid"}:
        raise FieldError("twilio", 'must be {"stream_sid": "<the call\'s streamSid>"}')
    sid = value["stream_sid"]
    if not isinstance(sid, str) or not 1 <= len(sid) <= MAX_STREAM_SID_CHARS:
        raise FieldError("twilio.stream_sid", f"must be a string of 1-{MAX_STREAM_SID_CHARS} characters")
    if "output_format" in obj:
        raise FieldError("output_format", "a Twilio context plays mu-law at 8 kHz in 20 ms frames: leave it out")
    return sid


def _output_format(value: object) -> OutputFormat:
    if value is None:
        value = {}
    if not isinstance(value, dict):
        raise FieldError("output_format", "must be an object {encoding, sample_rate_hz, frame_ms}")
    unknown = sorted(set(value) - FORMAT_FIELDS)
    if unknown:
        raise FieldError(f"output_format.{unknown[0]}", "unknown field")
    encoding = value.get("encoding", DEFAULT_ENCODING)
    sample_rate_hz = value.get("sample_rate_hz", DEFAULT_SAMPLE_RATE_HZ)
    frame_ms = value.get("frame_ms", DEFAULT_FRAME_MS)
    if not isinstance(encoding, str):
        raise FieldError("output_format.encoding", "must be a string")
    if not _is_int(sample_rate_hz):
        raise FieldError("output_format.sample_rate_hz", "must be an integer")
    if not _is_number(frame_ms):
        raise FieldError("output_format.frame_ms", "must be a number")
    try:
        fmt = OutputFormat.parse(encoding, sample_rate_hz, frame_ms)
    except ValueError as exc:
        raise FieldError("output_format." + _field_of(exc, FORMAT_FIELDS, "encoding"), str(exc)) from exc
    if fmt.encoding not in ENCODING_CODES:
        raise FieldError("output_format.encoding", f"not served over this protocol: {fmt.encoding!r}")
    return fmt


def _sampling(value: object) -> tuple[tuple[str, float | int], ...]:
    if value is None:
        return ()
    if not isinstance(value, dict):
        raise FieldError("sampling", "must be an object of sampling parameters")
    overrides: list[tuple[str, float | int]] = []
    for name, item in value.items():
        kind = SAMPLING_FIELDS.get(name)
        if kind is None:
            raise FieldError(f"sampling.{name}", "unknown sampling parameter: one of " + ", ".join(SAMPLING_FIELDS))
        if kind is int and not _is_int(item):
            raise FieldError(f"sampling.{name}", "must be an integer")
        if kind is float and not _is_number(item):
            raise FieldError(f"sampling.{name}", "must be a number")
        overrides.append((name, float(item) if kind is float else int(item)))
    return tuple(overrides)


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value: object) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _field_of(exc: ValueError, names: frozenset[str], default: str) -> str:
    """The field a ValueError message names (its first word), else `default`."""
    words = str(exc).replace(":", " ").split()
    return next((w for w in words[:3] if w in names), default)


# ---- server events ------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class SessionStarted:
    type: str = field(default="session_started", init=False)
    session_id: str
    protocol_version: int
    variant: str  # the default model (a context that names none, in a language it speaks)
    random_weights: bool
    max_contexts: int
    inactivity_timeout_s: float  # a session with no open context that sends nothing this long is closed
    models: tuple[str, ...] = ()  # every loaded model, the default first (an `open`'s `model` picks one)


@dataclass(frozen=True, slots=True)
class ContextStarted:
    type: str = field(default="context_started", init=False)
    context_id: str
    stream_id: int  # the id in this context's binary frame headers
    voice: str
    variant: str  # the model that speaks this context (routed from the open's model and language)
    output_format: dict[str, Any]  # {encoding, sample_rate_hz, frame_ms}
    seed: int | None


@dataclass(frozen=True, slots=True)
class SegmentStarted:
    type: str = field(default="segment_started", init=False)
    context_id: str
    segment_index: int
    text: str
    start_char: int  # [start_char, end_char) of all text pushed into the context
    end_char: int
    audio_offset_ms: float  # where the segment starts in the context's audio
    cached: bool = False  # served from the phrase cache


@dataclass(frozen=True, slots=True)
class Alignment:
    chars: list[str]
    char_start_ms: list[int]  # from the start of the context's audio
    char_duration_ms: list[int]


@dataclass(frozen=True, slots=True)
class SegmentDone:
    type: str = field(default="segment_done", init=False)
    context_id: str
    segment_index: int
    audio_offset_ms: float
    audio_ms: float
    speech_tokens: int
    alignment: Alignment  # approximate: the segment's duration shared out over its characters


@dataclass(frozen=True, slots=True)
class Timing:
    """time.monotonic() readings on the server (comparable with a client's on the same machine)."""

    first_text_monotonic_s: float | None
    first_submit_monotonic_s: float | None
    first_chunk_ready_monotonic_s: float | None  # the engine's AudioChunk.ready_monotonic_s
    first_frame_sent_monotonic_s: float | None  # the first frame was handed to the socket
    ttfa_ms: float | None  # first frame sent - first text received
    server_overhead_ms: float | None  # first frame sent - first chunk ready


@dataclass(frozen=True, slots=True)
class ContextDone:
    type: str = field(default="context_done", init=False)
    context_id: str
    reason: str  # completed | cancelled | busy | failed | shutdown
    detail: str
    segments: int
    frames: int  # frames sent for this context (seq of the last one + 1)
    audio_ms: float
    timing: Timing


@dataclass(frozen=True, slots=True)
class Busy:
    type: str = field(default="busy", init=False)
    context_id: str | None
    reason: str


@dataclass(frozen=True, slots=True)
class Error:
    type: str = field(default="error", init=False)
    context_id: str | None
    field: str
    message: str
    code: str = "bad_request"


@dataclass(frozen=True, slots=True)
class TwilioMark:
    """Twilio echoed a segment's mark: the caller heard that segment (`played`), or a clear dropped it."""

    type: str = field(default="twilio_mark", init=False)
    stream_sid: str
    name: str  # "<context_id>:<segment_index>"
    context_id: str
    segment_index: int
    played: bool


Event = SessionStarted | ContextStarted | SegmentStarted | SegmentDone | ContextDone | Busy | Error | TwilioMark


def encode(event: Event) -> str:
    return orjson.dumps(event).decode()


def error_event(error: FieldError) -> Error:
    return Error(context_id=error.context_id, field=error.field, message=error.message, code=error.code)
