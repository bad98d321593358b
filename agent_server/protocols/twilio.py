"""Twilio Media Streams: the messages a bridge forwards to Twilio untouched, and Twilio's own. Pure.

A bidirectional Media Stream (`<Connect><Stream>`) carries JSON text frames. Twilio sends `connected`,
`start` (`streamSid`, `callSid`, media format: `audio/x-mulaw`, 8000 Hz, 1 channel), `media` (the caller's
audio), `dtmf`, `mark` (echoes a mark the bridge sent once the audio before it has been played, or at
once when a `clear` dropped it) and `stop`. The bridge sends `media` (base64 mu-law 8 kHz, with the
stream's `streamSid`), `mark` (a name) and `clear` (drop all buffered audio: barge-in).

`TwilioPlayout` (one per Twilio stream) renders a context's audio in those messages: one `media` message
per 20 ms mu-law frame (the encoder is `StreamFormat("raw", "mulaw", 8000, frame_ms=20)`), a `mark` after
each segment (`<context>:<segment>`), and tracks which marks Twilio has echoed, i.e. which segments the
caller has heard. A `clear` from the bridge is a barge-in: the context is cancelled and a `clear` goes to
Twilio so that it drops what it buffered. The native protocol's Twilio output mode (agent_server/protocols/native.py,
docs/protocol.md) puts these on the session core.
"""

from __future__ import annotations

import base64
import binascii
import enum
from collections import deque
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import orjson

from agent_server.audio.codecs import StreamFormat
from agent_server.errors import FieldError
from agent_server.protocols.common import b64, load_object

TWILIO_FORMAT = StreamFormat("raw", "mulaw", 8_000, frame_ms=20)  # what Twilio plays: 20 ms = 160 bytes
TWILIO_ENCODING = "audio/x-mulaw"
TWILIO_SAMPLE_RATE_HZ = 8_000
MAX_MARK_NAME_CHARS = 256
MAX_PENDING_MARKS = 1024  # per stream: a mark per segment, echoed by Twilio within seconds
EVENT_FIELDS = frozenset({"event", "sequenceNumber", "streamSid", "protocol", "version", "start", "media",
                          "mark", "dtmf", "stop"})


class Event(enum.StrEnum):
    CONNECTED = "connected"
    START = "start"
    MEDIA = "media"
    DTMF = "dtmf"
    MARK = "mark"
    CLEAR = "clear"
    STOP = "stop"


@dataclass(frozen=True, slots=True)
class Incoming:
    """One message from Twilio (or a bridge's `clear`). Fields not carried by the event are empty."""

    event: Event
    stream_sid: str = ""
    call_sid: str = ""
    custom_parameters: Mapping[str, str] = field(default_factory=dict)
    mark_name: str = ""
    payload: bytes = b""  # media: the caller's mu-law audio
    digit: str = ""


def parse_incoming(raw: str | bytes | Mapping[str, Any]) -> Incoming:
    """Raises FieldError (field named) for what is not a well-formed Media Streams message."""
    obj = load_object(raw, EVENT_FIELDS)
    name = obj.get("event")
    if name not in Event.__members__.values():
        raise FieldError("event", f"event must be one of {', '.join(e.value for e in Event)} (got {name!r})")
    event = Event(str(name))
    if event == Event.CONNECTED:
        return Incoming(event)
    sid = obj.get("streamSid")
    if not isinstance(sid, str) or not sid:
        raise FieldError("streamSid", f"a {event} message carries its streamSid")
    if event == Event.START:
        start = _object(obj, "start")
        media_format = start.get("mediaFormat") or {}
        if not isinstance(media_format, dict) or media_format.get("encoding", TWILIO_ENCODING) != TWILIO_ENCODING \
                or media_format.get("sampleRate", TWILIO_SAMPLE_RATE_HZ) != TWILIO_SAMPLE_RATE_HZ:
            raise FieldError("start.mediaFormat", f"only {TWILIO_ENCODING} at {TWILIO_SAMPLE_RATE_HZ} Hz is played")
        params = start.get("customParameters") or {}
        if not isinstance(params, dict) or not all(isinstance(v, str) for v in params.values()):
            raise FieldError("start.customParameters", "customParameters must map names to strings")
        call_sid = start.get("callSid", "")
        return Incoming(event, sid, call_sid if isinstance(call_sid, str) else "", params)
    if event == Event.MEDIA:
        payload = _object(obj, "media").get("payload")
        if not isinstance(payload, str):
            raise FieldError("media.payload", "media.payload must be base64 text")
        try:
            return Incoming(event, sid, payload=base64.b64decode(payload, validate=True))
        except binascii.Error:
            raise FieldError("media.payload", "media.payload is not valid base64") from None
    if event == Event.MARK:
        mark = _object(obj, "mark").get("name")
        if not isinstance(mark, str) or not mark:
            raise FieldError("mark.name", "mark.name must be a non-empty string")
        return Incoming(event, sid, mark_name=mark)
    if event == Event.DTMF:
        digit = _object(obj, "dtmf").get("digit")
        return Incoming(event, sid, digit=digit if isinstance(digit, str) else "")
    return Incoming(event, sid)  # clear, stop


def _object(obj: Mapping[str, Any], name: str) -> Mapping[str, Any]:
    value = obj.get(name)
    if not isinstance(value, dict):
        raise FieldError(name, f"{name} must be an object")
    return value


# ---- outgoing ------------------------------------------------------------------------------------


def media_message(stream_sid: str, mulaw: bytes) -> str:
    return _json({"event": "media", "streamSid": stream_sid, "media": {"payload": b64(mulaw)}})


def mark_message(stream_sid: str, name: str) -> str:
    return _json({"event": "mark", "streamSid": stream_sid, "mark": {"name": name}})


def clear_message(stream_sid: str) -> str:
    return _json({"event": "clear", "streamSid": stream_sid})


def _json(body: Mapping[str, object]) -> str:
    return orjson.dumps(body).decode()


@dataclass(slots=True)
class TwilioPlayout:
    """One Twilio stream's outgoing audio: media frames, a mark per segment, what Twilio has played."""

    stream_sid: str
    # sent, not yet echoed, in order; a bridge that never forwards the echoes keeps the newest MAX_PENDING_MARKS
    pending_marks: deque[str] = field(default_factory=lambda: deque(maxlen=MAX_PENDING_MARKS))
    dropped_pending: int = 0  # marks pending when a clear went out: their echoes are for dropped audio

    def media(self, frame: bytes) -> str:
        """The `media` message of one encoded 20 ms frame."""
        return media_message(self.stream_sid, frame)

    def segment_end(self, context_id: str, segment_index: int) -> str:
        name = f"{context_id}:{segment_index}"
        if len(name) > MAX_MARK_NAME_CHARS:
            raise ValueError(f"mark name longer than {MAX_MARK_NAME_CHARS} characters")
        if len(self.pending_marks) == MAX_PENDING_MARKS and self.dropped_pending:
            self.dropped_pending -= 1  # the oldest, forgotten now, was one of them
        self.pending_marks.append(name)
        return mark_message(self.stream_sid, name)

    def clear(self) -> str:
        """Barge-in: tell Twilio to drop its buffer; the marks still pending will come back at once."""
        self.dropped_pending = len(self.pending_marks)
        return clear_message(self.stream_sid)

    def on_mark(self, name: str) -> bool:
        """An echo from Twilio. True when it says its segment was played (not dropped by a clear).
        Raises FieldError for a mark this stream never sent, or out of order."""
        if not self.pending_marks or self.pending_marks[0] != name:
            expected = self.pending_marks[0] if self.pending_marks else "none"
            raise FieldError("mark.name", f"mark {name!r} was not the next pending mark (expected {expected})")
        self.pending_marks.popleft()
        if self.dropped_pending:
            self.dropped_pending -= 1
            return False
        return True
