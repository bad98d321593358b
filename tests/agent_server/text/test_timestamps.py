"""agent_server/text/timestamps.py, checked with the clients' own word-timing functions.

Three segments with silence between them (drain padding) and a codec lead; the truth is computed here
from the segments' offsets. Each consumer must give every word its start on the context's timeline,
never restarting at a segment:
- LiveKit's ElevenLabs plugin (`_accumulate_alignment`, `_to_timed_words`): context-relative times;
- Pipecat's ElevenLabs WebSocket function (`calculate_word_times` + its running `cumulative_time`):
  message-relative times (`ContextAlignment.chained`);
- Pipecat's ElevenLabs HTTP service (`calculate_word_times` of `ElevenLabsHttpTTSService`) and Cartesia
  service (`_normalize_word_timestamps`): context-relative seconds.
"""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest

from agent_server.core.stream import char_alignment
from agent_server.text.timestamps import ContextAlignment, SegmentTimes, WordTime, seconds

# (text, audio_offset_ms, audio_ms): gaps of 37 ms and 120 ms between segments
SEGMENTS = [("Hello there, friend.", 0.0, 1_480.0), ("How are you", 1_517.0, 1_003.0),
            ("today? Fine.", 2_640.0, 1_210.0)]
LEAD_MS = 46.0  # an MP3 stream's LAME priming at 24 kHz


def build(lead_ms: float = LEAD_MS) -> ContextAlignment:
    ctx = ContextAlignment(lead_ms=lead_ms)
    for text, offset_ms, audio_ms in SEGMENTS:
        starts, durations = char_alignment(text, 0.0, audio_ms)  # segment-relative, as the engine's
        ctx.add(text, starts, durations, offset_ms, audio_ms, segment_relative=True)
    return ctx


def expected_words() -> list[tuple[str, float]]:
    """Each word's start from the segment math alone: lead + segment offset + the word's first char."""
    out: list[tuple[str, float]] = []
    for text, offset_ms, audio_ms in SEGMENTS:
        starts, _ = char_alignment(text, 0.0, audio_ms)
        i = 0
        for word in text.split():
            i = text.index(word, i)
            out.append((word, round(LEAD_MS + offset_ms + starts[i]) / 1000.0))
            i += len(word)
    return out


def test_words_and_chars_sit_on_the_context_timeline() -> None:
    ctx = build()
    words = [(w.word, w.start_ms / 1000.0) for w in ctx.words]
    assert words == expected_words()
    starts = ctx.start_ms
    assert starts == sorted(starts)  # never restarts
    second = ctx.segments[1]
    assert second.start_ms[0] == round(LEAD_MS + 1_517.0) and second.audio_end_ms == LEAD_MS + 1_517.0 + 1_003.0
    assert second.chars[-1] == " " and second.duration_ms[-1] == 0  # boundary space


def test_context_relative_input_gives_the_same_timeline() -> None:
    ctx = ContextAlignment(lead_ms=LEAD_MS)
    for text, offset_ms, audio_ms in SEGMENTS:
        starts, durations = char_alignment(text, offset_ms, audio_ms)  # already from the context's start
        ctx.add(text, starts, durations, offset_ms, audio_ms, segment_relative=False)
    assert [(w.word, w.start_ms / 1000.0) for w in ctx.words] == expected_words()


def test_mismatched_alignment_is_refused() -> None:
    with pytest.raises(ValueError, match=r"^alignment:"):
        ContextAlignment().add("abc", [0, 1], [1, 1], 0.0, 3.0, segment_relative=True)


def test_livekit_elevenlabs_consumer_reads_context_relative_messages() -> None:
    from livekit.plugins.elevenlabs.tts import _accumulate_alignment, _to_timed_words

    ctx = build()
    stream = SimpleNamespace(_text_buffer="", _start_times_ms=[], _durations_ms=[])
    timed: list[Any] = []
    emitter = SimpleNamespace(push_timed_transcript=timed.extend)
    for seg in ctx.segments:  # one alignment message per segment, as the WebSocket sends them
        _accumulate_alignment(stream, emitter, list(seg.chars), list(seg.start_ms), list(seg.duration_ms))  # type: ignore[arg-type]
    final, _ = _to_timed_words(stream._text_buffer, stream._start_times_ms, stream._durations_ms, flush=True)
    timed.extend(final)
    got = [(str(t).strip(), t.start_time) for t in timed]
    assert got == expected_words()
    assert all(t.end_time >= t.start_time for t in timed)


def test_pipecat_elevenlabs_websocket_consumer_reads_chained_messages() -> None:
    from pipecat.services.elevenlabs.tts import calculate_word_times

    ctx = build()
    cumulative_s, partial, partial_start = 0.0, "", 0.0
    words: list[tuple[str, float]] = []
    for seg in ctx.segments:
        msg = ctx.chained(seg)
        alignment = {"chars": list(msg.chars), "charStartTimesMs": list(msg.start_ms),
                     "charDurationsMs": list(msg.duration_ms)}
        got, partial, partial_start = calculate_word_times(alignment, cumulative_s, partial, partial_start)
        words += got
        cumulative_s += (msg.start_ms[-1] + msg.duration_ms[-1]) / 1000.0  # what the service does per message
    assert [(w, round(t, 3)) for w, t in words] == expected_words()
    assert partial == ""  # the boundary spaces closed every word


def test_pipecat_elevenlabs_websocket_consumer_drifts_on_segment_relative_messages() -> None:
    """Why `chained`: counting each message from its own segment's audio start (what the WebSocket
    did) loses the gaps between segments."""
    from pipecat.services.elevenlabs.tts import calculate_word_times

    ctx = build()
    cumulative_s, words = 0.0, []
    for seg in ctx.segments:
        msg = seg.relative_to(seg.audio_start_ms)
        alignment = {"chars": list(msg.chars), "charStartTimesMs": list(msg.start_ms),
                     "charDurationsMs": list(msg.duration_ms)}
        got, _, _ = calculate_word_times(alignment, cumulative_s)
        words += got
        cumulative_s += (msg.start_ms[-1] + msg.duration_ms[-1]) / 1000.0
    assert [(w, round(t, 3)) for w, t in words] != expected_words()


def test_pipecat_elevenlabs_http_consumer_reads_with_timestamps_alignment() -> None:
    from pipecat.services.elevenlabs.tts import ElevenLabsHttpTTSService

    ctx = build()
    service = SimpleNamespace(_cumulative_time=0.0, _partial_word="", _partial_word_start_time=0.0)
    alignment = {"characters": ctx.chars, "character_start_times_seconds": seconds(ctx.start_ms),
                 "character_end_times_seconds": seconds(ctx.end_ms)}
    words = ElevenLabsHttpTTSService.calculate_word_times(service, alignment)  # type: ignore[arg-type]
    assert [(w, round(t, 3)) for w, t in words] == expected_words()


def test_pipecat_cartesia_consumer_reads_word_timestamps() -> None:
    from pipecat.services.cartesia.tts import CartesiaTTSService

    ctx = build()
    service = SimpleNamespace(_CARTESIA_TAG_RE=CartesiaTTSService._CARTESIA_TAG_RE)
    service._strip_cartesia_tags = lambda w: CartesiaTTSService._strip_cartesia_tags(service, w)  # type: ignore[arg-type]
    for seg in ctx.segments:  # one timestamps message per segment
        words = [w.word for w in seg.words]
        got = CartesiaTTSService._normalize_word_timestamps(service, words, seconds([w.start_ms for w in seg.words]))  # type: ignore[arg-type]
        offset = sum(len(s.words) for s in ctx.segments[: seg.index])
        assert got == expected_words()[offset : offset + len(words)]


def test_relative_to_shifts_everything() -> None:
    seg = SegmentTimes(0, ("a", " "), (100, 150), (150, 150), (WordTime("a", 100, 150),), 90.0, 160.0)
    moved = seg.relative_to(90.0)
    expected = ((10, 60), (60, 60), (WordTime("a", 10, 60),), 0.0)
    assert (moved.start_ms, moved.end_ms, moved.words, moved.audio_start_ms) == expected
