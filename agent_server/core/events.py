"""The shared vocabulary of a context's stream: what it is opened with, what it emits, what it is.

Every protocol (agent_server/protocols/) and the session core (core/session.py) speak these words; the stream
itself, the state machine that turns text pieces into ordered audio, is core/stream.py. Pure: no I/O, no awaits.

A stream is opened with a `StreamSpec` (`build_params` makes its sampling parameters, `parse_speed` checks a
speed wherever a client sends one), and its `emit(stream, event)` receives, in order: `StreamStarted`, then per
segment `SegmentStarted`, its `AudioOut` pieces and `SegmentDone`, then exactly one `StreamDone`, whose
`StreamStatus` is the stream's outcome. `OutputOverflow` and `MarkupProblem` are for the session core only.
"""

from __future__ import annotations

import dataclasses
import enum
import json
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from agent_server.audio.codecs import MAX_SPEED, MIN_SPEED, StreamFormat
from agent_server.errors import FieldError
from synth.api import SamplingParams, Variant

# ---- what a stream is opened with --------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class StreamSpec:
    voice_id: str
    params: SamplingParams  # seed: the context's seed (segment i uses seed + i), or None
    output_format: StreamFormat
    language: str | None = None
    # False: the first segment is refused (BUSY) when the engine has no free slot, instead of queueing.
    may_wait: bool = True
    max_audio_ahead_s: float = 20.0  # unsent audio beyond which the next segment is not submitted yet
    cache: bool = True  # False: the phrase cache neither serves nor stores this stream's segments
    speed: float = 1.0  # the audio played this much faster, its pitch kept (codecs.TempoEncoder); 1: untouched
    markup: frozenset[str] = frozenset()  # the inline tags the text may carry (agent_server/text/markup.py); none: text
    normalize: bool = True  # numbers, money, times ... said as words (agent_server/text/normalize/); False: as written
    # The loaded model that speaks it (agent_server/core/routing.py); None: the default model (Hub.open_stream names
    # it before the stream opens, so a stream always knows its model).
    model: Variant | None = None

    def __post_init__(self) -> None:
        parse_speed("speed", self.speed)


def parse_speed(field: str, value: object) -> float:
    """A speed multiplier (1: as spoken; 1.25: a quarter faster, the pitch kept); None or "" is 1. Numbers
    in query strings come as text."""
    if value is None or value == "":
        return 1.0
    if isinstance(value, str):
        try:
            value = float(value)
        except ValueError:
            raise FieldError(field, f"{field} must be a number (got {value!r})") from None
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not MIN_SPEED <= value <= MAX_SPEED:
        shown = json.dumps(value) if isinstance(value, (bool, int, float, list, dict)) else repr(value)  # as sent
        raise FieldError(field, f"{field} must be a number in [{MIN_SPEED:g}, {MAX_SPEED:g}] (got {shown})")
    return float(value)


def build_params(
    variant: str, overrides: Sequence[tuple[str, float | int]], seed: int | None
) -> SamplingParams:
    """The variant's defaults with the client's overrides and seed. Raises FieldError("sampling.x", ...)."""
    base = SamplingParams.defaults(variant)  # type: ignore[arg-type]
    changes: dict[str, Any] = {**dict(overrides), "seed": seed}
    params = dataclasses.replace(base, **changes)
    try:
        params.validate()
    except ValueError as exc:
        first = str(exc).split(" ", 1)[0]
        name = "seed" if first == "seed" else f"sampling.{first}"
        raise FieldError(name, str(exc)) from exc
    return params


# ---- what a stream emits -----------------------------------------------------------------------


class StreamStatus(enum.IntEnum):
    """Where a stream is. Order matters: everything >= COMPLETED is terminal, and the terminal status is
    the outcome `StreamDone` reports (its `reason` is the lower-case name)."""

    OPEN = 0  # taking text
    ENDED = 1  # input ended; audio still coming
    COMPLETED = 10
    CANCELLED = 11  # by the client
    BUSY = 12  # the engine refused a segment
    FAILED = 13  # the engine failed a segment or refused a submit
    SHUTDOWN = 14  # the server or the session closed under it

    @property
    def done(self) -> bool:
        return self >= StreamStatus.COMPLETED

    @property
    def reason(self) -> str:
        """The wire name of a terminal status: completed | cancelled | busy | failed | shutdown."""
        return self.name.lower()

    @property
    def output_dropped(self) -> bool:
        """Stopped from outside: output of it still queued for the client is not sent any more."""
        return self in (StreamStatus.CANCELLED, StreamStatus.SHUTDOWN)


@dataclass(frozen=True, slots=True)
class StreamStarted:
    pass


@dataclass(frozen=True, slots=True)
class SegmentStarted:
    index: int
    text: str
    start_char: int
    end_char: int
    audio_offset_ms: float
    cached: bool = False  # replayed from the phrase cache


@dataclass(frozen=True, slots=True)
class AudioOut:
    segment_index: int
    seq: int  # 0, 1, 2 ... per stream
    payload: bytes  # the next bytes of the `output_format` stream (raw formats: one frame)
    duration_ms: float  # the audio the piece holds (compressed: the audio encoded since the last piece)


@dataclass(frozen=True, slots=True)
class SegmentDone:
    index: int
    text: str
    start_char: int
    audio_offset_ms: float
    audio_ms: float
    speech_tokens: int
    char_start_ms: list[int]  # per character of `text`, from the start of the stream's audio
    char_duration_ms: list[int]
    turn: int = 0  # the turn it belongs to: 0 before the first `start_turn`, then 1, 2, ...


@dataclass(frozen=True, slots=True)
class StreamDone:
    status: StreamStatus  # terminal
    detail: str = ""

    @property
    def reason(self) -> str:
        return self.status.reason


@dataclass(frozen=True, slots=True)
class OutputOverflow:
    """The context's encoder lane is full: its audio cannot be encoded as fast as it comes. Not for
    protocols: the session core cuts the session as it cuts a slow client."""

    detail: str


@dataclass(frozen=True, slots=True)
class MarkupProblem:
    """A tag found wrong only when the text was flushed or ended (a `<break` never closed). Not for protocols:
    the session core reports it as push_text's problems are (`bad_markup`)."""

    detail: str


StreamEvent = StreamStarted | SegmentStarted | AudioOut | SegmentDone | StreamDone | OutputOverflow | MarkupProblem


Emit = Callable[["Stream", StreamEvent], None]


# ---- what a stream is --------------------------------------------------------------------------


class Stream(Protocol):
    """What the session core and the protocols use of a context's stream (SpeechStream is one)."""

    key: str
    spec: StreamSpec
    status: StreamStatus
    times: StreamTimes
    text_chars: int  # text pushed so far
    frames_sent: int  # frames the writer reported sent (`on_frame_sent`)
    sent_ms: float  # audio in those frames

    @property
    def segment_count(self) -> int: ...
    @property
    def has_unsegmented_text(self) -> bool: ...
    @property
    def needs_poll(self) -> bool: ...  # `poll` has something to watch (held text, a tail to drain in time)
    @property
    def all_segments_done(self) -> bool: ...
    def open(self) -> None: ...
    def push_text(self, text: str, now_s: float) -> list[str]: ...
    def start_turn(self, voice_id: str, now_s: float) -> int: ...
    def flush(self, now_s: float) -> None: ...
    def end(self, now_s: float) -> None: ...
    def poll(self, now_s: float) -> None: ...
    def cancel(self, status: StreamStatus = StreamStatus.CANCELLED, detail: str = "") -> bool: ...
    def on_frame_sent(self, now_s: float, audio_ms: float) -> None: ...


@dataclass(slots=True)
class StreamTimes:
    """time.monotonic() readings for the first audio of the stream."""

    opened_s: float
    first_text_s: float | None = None
    first_submit_s: float | None = None
    first_chunk_ready_s: float | None = None  # AudioChunk.ready_monotonic_s of the stream's first chunk
    first_frame_sent_s: float | None = None

    @property
    def ttfa_s(self) -> float | None:
        if self.first_frame_sent_s is None or self.first_text_s is None:
            return None
        return self.first_frame_sent_s - self.first_text_s

    @property
    def server_overhead_s(self) -> float | None:
        if self.first_frame_sent_s is None or self.first_chunk_ready_s is None:
            return None
        return self.first_frame_sent_s - self.first_chunk_ready_s


class StreamStateError(RuntimeError):
    """A verb that the stream's state does not allow (e.g. text after end)."""
