"""Character and word times measured from the start of a context's audio. Pure.

The engine's alignment is per segment (each segment's duration shared out over its characters,
`speech.char_alignment`), and each segment sits somewhere on the context's audio timeline (its
`audio_offset_ms`: where its first sample is in the stream, drain padding included). A
`ContextAlignment` (one per context) places every segment on that timeline and gives, per character and
per word, start and end in ms from the start of the context's audio, so a client's word timings do not
restart at each segment.

`lead_ms` moves the whole timeline by what the client's decoder plays before our first sample: the
encoder priming of streams without gapless metadata (MP3: LAME's 1105 samples; ADTS AAC: 1024 samples),
zero for PCM, WAV, FLAC and Ogg/WebM Opus.

Vendors differ in the time base they put on the wire: Cartesia word timestamps, ElevenLabs HTTP
`with-timestamps`, Riva word offsets and the native protocol count from the start of the context;
ElevenLabs WebSocket alignment counts from the start of the message that carries it
(`ContextAlignment.chained`: the clients add up the messages' spans). The two WebSocket consumers in the
wild disagree: Pipecat adds the spans up (message-relative times), LiveKit takes the times as they come
(context-relative); `tests/agent_server/text/test_timestamps.py` runs both on their own functions.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass, field

MS_PER_S = 1_000.0
_WORD = re.compile(r"\S+")


@dataclass(frozen=True, slots=True)
class WordTime:
    word: str
    start_ms: int  # from the start of the context's audio (or of the message, after relative_to)
    end_ms: int


@dataclass(frozen=True, slots=True)
class SegmentTimes:
    """One segment's characters and words on the context's timeline. `chars` may end with a zero-length
    space the segment's text did not have (so that segments glued together keep their word boundary)."""

    index: int
    chars: tuple[str, ...]
    start_ms: tuple[int, ...]
    end_ms: tuple[int, ...]
    words: tuple[WordTime, ...]
    audio_start_ms: float  # where the segment's audio starts on the same timeline
    audio_end_ms: float

    @property
    def duration_ms(self) -> tuple[int, ...]:
        return tuple(end - start for start, end in zip(self.start_ms, self.end_ms, strict=False))

    def relative_to(self, origin_ms: float) -> SegmentTimes:
        """The same times counted from `origin_ms` (e.g. the start of the message that carries them)."""
        shift = round(origin_ms)
        return SegmentTimes(
            self.index,
            self.chars,
            tuple(t - shift for t in self.start_ms),
            tuple(t - shift for t in self.end_ms),
            tuple(WordTime(w.word, w.start_ms - shift, w.end_ms - shift) for w in self.words),
            self.audio_start_ms - shift,
            self.audio_end_ms - shift,
        )


@dataclass(slots=True)
class ContextAlignment:
    """Every segment of one context so far, on the context's audio timeline (ms)."""

    lead_ms: float = 0.0
    segments: list[SegmentTimes] = field(default_factory=list)

    def add(
        self,
        text: str,
        char_start_ms: Sequence[float],
        char_duration_ms: Sequence[float],
        audio_offset_ms: float,
        audio_ms: float,
        *,
        segment_relative: bool,
        boundary_space: bool = True,
    ) -> SegmentTimes:
        """Place the next segment. `char_start_ms` are from the segment's start (`segment_relative`) or
        already from the context's start; `audio_offset_ms` is where the segment starts in the context's
        audio. With `boundary_space`, a zero-length space ends a segment whose text does not."""
        if not len(text) == len(char_start_ms) == len(char_duration_ms):
            raise ValueError(
                f"alignment: {len(text)} characters, {len(char_start_ms)} starts, {len(char_duration_ms)} durations"
            )
        origin = self.lead_ms + (audio_offset_ms if segment_relative else 0.0)
        starts = [round(origin + s) for s in char_start_ms]
        ends = [round(origin + s + d) for s, d in zip(char_start_ms, char_duration_ms, strict=False)]
        words = tuple(
            WordTime(m.group(), starts[m.start()], ends[m.end() - 1]) for m in _WORD.finditer(text)
        )
        chars = list(text)
        if boundary_space and chars and not chars[-1].isspace():
            chars.append(" ")
            starts.append(ends[-1])
            ends.append(ends[-1])
        audio_start_ms = self.lead_ms + audio_offset_ms
        seg = SegmentTimes(
            len(self.segments), tuple(chars), tuple(starts), tuple(ends), words, audio_start_ms,
            audio_start_ms + audio_ms,
        )
        self.segments.append(seg)
        return seg

    def chained(self, seg: SegmentTimes) -> SegmentTimes:
        """`seg` counted from where the previous segment's alignment ends (0 for the first): a client
        that adds up each message's span to place the next one (Pipecat's ElevenLabs WebSocket service)
        lands every segment, gaps between segments included, at its context time."""
        previous = self.segments[seg.index - 1] if seg.index > 0 else None
        origin = previous.end_ms[-1] if previous is not None and previous.end_ms else 0
        return seg.relative_to(origin)

    @property
    def chars(self) -> list[str]:
        return [c for seg in self.segments for c in seg.chars]

    @property
    def start_ms(self) -> list[int]:
        return [t for seg in self.segments for t in seg.start_ms]

    @property
    def end_ms(self) -> list[int]:
        return [t for seg in self.segments for t in seg.end_ms]

    @property
    def words(self) -> list[WordTime]:
        return [w for seg in self.segments for w in seg.words]


def seconds(ms: Sequence[int]) -> list[float]:
    return [t / MS_PER_S for t in ms]
