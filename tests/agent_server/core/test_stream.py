"""SpeechStream, the protocol-neutral context: segment order, held audio, cancel, busy, backlog.

The stream is driven by hand through a `ManualEngine` whose sinks the test calls, with a synchronous
`post`, so every ordering case is exact.
"""

from __future__ import annotations

import asyncio
import threading
import time
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import pytest
import soxr

from agent_server.audio.codecs import StreamEncoder, StreamFormat, make_encoder
from agent_server.audio.encode_lane import EncoderPool, Lane
from agent_server.audio.formats import RESAMPLER_QUALITY, float_to_pcm16
from agent_server.core.events import (
    AudioOut,
    OutputOverflow,
    SegmentDone,
    SegmentStarted,
    Stream,
    StreamDone,
    StreamEvent,
    StreamSpec,
    StreamStarted,
    StreamStateError,
    StreamStatus,
)
from agent_server.core.stream import DRAIN_MARGIN_S, SpeechStream
from agent_server.text.segmenter import Segmenter
from synth.api import (
    SAMPLES_PER_SPEECH_TOKEN,
    AudioChunk,
    EngineError,
    EngineFull,
    EngineLike,
    EventKind,
    SamplingParams,
    SegmentEvent,
    SegmentRequest,
    Variant,
)

from tests.agent_server.fake_engine import FakeEngine

pytestmark = pytest.mark.timeout(60)

PCM24 = StreamFormat("raw", "pcm_s16le", 24_000, frame_ms=20)


@dataclass
class ManualEngine(EngineLike):
    """Records submits and cancels; the test plays the engine thread by calling `chunk` / `event`."""

    variant: Variant = "english"
    random_weights: bool = True
    max_slots: int = 4
    refuse: bool = False
    full: bool = False  # its inbox is full (synth.engine.Engine.max_inbox_items)
    submitted: list[SegmentRequest] = field(default_factory=list)
    cancelled: list[str] = field(default_factory=list)

    def submit(self, request: SegmentRequest) -> None:
        if self.refuse:
            raise EngineError("unknown voice 'x'")
        if self.full:
            raise EngineFull("the engine's inbox is full (3 items): try again later")
        self.submitted.append(request)

    def cancel(self, request_id: str) -> None:
        self.cancelled.append(request_id)

    def chunk(self, index: int, tokens: int, value: float = 0.25) -> None:
        request = self.submitted[index]
        pcm = np.full(tokens * SAMPLES_PER_SPEECH_TOKEN, value, dtype=np.float32)
        request.sink(AudioChunk(request.request_id, 0, pcm, tokens, time.monotonic()))

    def event(self, index: int, kind: EventKind, reason: str = "") -> None:
        request = self.submitted[index]
        request.sink(SegmentEvent(request.request_id, kind, time.monotonic(), reason=reason))


class Recorder:
    def __init__(self) -> None:
        self.events: list[StreamEvent] = []

    def __call__(self, stream: Stream, event: StreamEvent) -> None:
        self.events.append(event)

    def of(self, kind: type) -> list[Any]:
        return [e for e in self.events if isinstance(e, kind)]

    def kinds(self) -> list[str]:
        return [type(e).__name__ for e in self.events]


def sync_post(fn: Any, *args: Any) -> None:
    fn(*args)


def make_stream(
    engine: EngineLike, *, seed: int | None = None, max_ahead_s: float = 20.0, fmt: StreamFormat = PCM24,
    speed: float = 1.0,
) -> tuple[SpeechStream, Recorder]:
    recorder = Recorder()
    spec = StreamSpec(
        voice_id="default", params=SamplingParams(seed=seed), output_format=fmt, max_audio_ahead_s=max_ahead_s,
        speed=speed,
    )
    stream = SpeechStream("s1/1", spec, engine=engine, segmenter=Segmenter(), post=sync_post, emit=recorder)
    stream.open()
    return stream, recorder


def test_segments_go_one_at_a_time_and_play_in_order() -> None:
    engine = ManualEngine()
    stream, rec = make_stream(engine, seed=10)
    stream.push_text("Well hello there, this is the first sentence. And this is the second one. ", 0.0)
    stream.end(0.01)
    assert [r.text for r in engine.submitted] == ["Well hello there,"]  # only the first goes out
    assert engine.submitted[0].first_audio_pending and engine.submitted[0].params.seed == 10
    engine.event(0, EventKind.STARTED)
    engine.chunk(0, 2, 0.1)
    assert len(rec.of(AudioOut)) == 4  # 2 tokens = 1920 samples = 4 frames of 20 ms
    engine.event(0, EventKind.GENERATED)
    assert len(engine.submitted) == 2  # the next segment goes once T3 is done with this one
    assert not engine.submitted[1].first_audio_pending and engine.submitted[1].params.seed == 11
    engine.chunk(1, 1, 0.3)  # arrives before segment 0 finished playing: held
    assert len(rec.of(AudioOut)) == 4
    engine.chunk(0, 1, 0.1)
    engine.event(0, EventKind.DONE)
    # segment 0 done, then segment 1's held audio played
    kinds = rec.kinds()
    assert kinds.index("SegmentDone") < len(kinds) - 1
    assert len(rec.of(SegmentStarted)) == 2
    engine.event(1, EventKind.GENERATED)
    assert len(engine.submitted) == 3
    engine.event(1, EventKind.DONE)
    engine.chunk(2, 1, 0.5)
    engine.event(2, EventKind.GENERATED)
    engine.event(2, EventKind.DONE)
    assert isinstance(rec.events[-1], StreamDone) and rec.events[-1].status == StreamStatus.COMPLETED
    assert stream.status == StreamStatus.COMPLETED
    frames = rec.of(AudioOut)
    assert [f.seq for f in frames] == list(range(len(frames)))
    pcm = np.frombuffer(b"".join(f.payload for f in frames), dtype="<i2")
    assert len(pcm) == 5 * SAMPLES_PER_SPEECH_TOKEN
    expected = np.concatenate(
        [np.full(3 * 960, 0.1), np.full(960, 0.3), np.full(960, 0.5)]
    )  # segment order, not arrival order
    assert np.abs(pcm / 32767.0 - expected).max() < 1e-3
    done = rec.of(SegmentDone)
    assert [d.index for d in done] == [0, 1, 2]
    assert [d.audio_ms for d in done] == [120.0, 40.0, 40.0]
    assert done[1].audio_offset_ms == 120.0
    assert rec.events[0] == StreamStarted()


def test_each_turn_is_said_by_its_own_voice_and_never_shares_a_segment() -> None:
    """A dialogue: `start_turn` cuts what came before (even mid-sentence) and later segments take the
    turn's voice; the voices reach the engine segment by segment."""
    engine = ManualEngine()
    stream, rec = make_stream(engine)
    stream.start_turn("alice", 0.0)
    stream.push_text("Knock knock, who is it", 0.0)
    stream.start_turn("bob", 0.01)
    stream.push_text("It is me. Your neighbour from next door.", 0.01)
    stream.start_turn("bob", 0.02)
    stream.push_text("Open up", 0.02)
    stream.end(0.03)
    for index in range(3):
        engine.event(index, EventKind.GENERATED)
        engine.chunk(index, 1)
        engine.event(index, EventKind.DONE)
    assert [(r.voice_id, r.text) for r in engine.submitted] == [
        ("alice", "Knock knock, who is it"),
        ("bob", "It is me. Your neighbour from next door."),
        ("bob", "Open up"),
    ]
    assert [d.start_char for d in rec.of(SegmentDone)] == [0, 22, 62]
    assert rec.events[-1] == StreamDone(StreamStatus.COMPLETED)


def test_cancel_stops_audio_at_once_and_cancels_engine_work() -> None:
    engine = ManualEngine()
    stream, rec = make_stream(engine)
    stream.push_text("One two three four five six seven eight nine ten. ", 0.0)
    stream.flush(0.0)
    engine.chunk(0, 2)
    n_frames = len(rec.of(AudioOut))
    assert stream.cancel()
    assert engine.cancelled == [engine.submitted[0].request_id]
    engine.chunk(0, 2)  # late output already on its way: dropped
    engine.event(0, EventKind.CANCELLED)
    assert len(rec.of(AudioOut)) == n_frames
    assert isinstance(rec.events[-1], StreamDone) and rec.events[-1].status == StreamStatus.CANCELLED
    assert not stream.cancel()  # idempotent
    with pytest.raises(StreamStateError):
        stream.push_text("more", 1.0)


def test_busy_and_failures_end_the_stream() -> None:
    engine = ManualEngine()
    stream, rec = make_stream(engine)
    stream.push_text("Hello there, friend. ", 0.0)
    stream.flush(0.0)
    engine.event(0, EventKind.BUSY, "no free slot")
    assert stream.status == StreamStatus.BUSY
    assert rec.events[-1] == StreamDone(StreamStatus.BUSY, "no free slot")

    refusing = ManualEngine(refuse=True)
    stream, rec = make_stream(refusing)
    stream.push_text("Hello there, friend. ", 0.0)
    stream.flush(0.0)
    assert stream.status == StreamStatus.FAILED
    assert isinstance(rec.events[-1], StreamDone) and "unknown voice" in rec.events[-1].detail

    engine = ManualEngine()
    stream, rec = make_stream(engine)
    stream.push_text("Hello there, friend. ", 0.0)
    stream.flush(0.0)
    engine.event(0, EventKind.FAILED, "cuda oom")
    assert rec.events[-1] == StreamDone(StreamStatus.FAILED, "cuda oom")


def test_an_engine_whose_inbox_is_full_makes_the_context_busy() -> None:
    """The submit refused because the engine's inbox is full (its thread behind): the context ends busy, as when
    the engine has no free slot (each protocol then says busy in its own form), not failed."""
    stream, rec = make_stream(ManualEngine(full=True))
    stream.push_text("Hello there, friend. ", 0.0)
    stream.flush(0.0)
    assert stream.status == StreamStatus.BUSY
    assert rec.events[-1] == StreamDone(StreamStatus.BUSY, "the engine's inbox is full (3 items): try again later")


def test_text_after_end_is_refused_and_empty_context_completes() -> None:
    engine = ManualEngine()
    stream, rec = make_stream(engine)
    stream.end(0.0)
    assert rec.events[-1] == StreamDone(StreamStatus.COMPLETED)
    with pytest.raises(StreamStateError):
        stream.push_text("late", 0.1)
    assert engine.submitted == []


def test_backlog_holds_the_next_segment_until_frames_go_out() -> None:
    engine = ManualEngine()
    stream, rec = make_stream(engine, max_ahead_s=0.1)
    stream.push_text("Well hello there, this is the first sentence. And this is the second one. ", 0.0)
    stream.end(0.0)
    engine.chunk(0, 10)  # 400 ms unsent
    engine.event(0, EventKind.GENERATED)
    assert len(engine.submitted) == 1  # too much audio waiting for the socket
    assert len(rec.of(AudioOut)) == 20
    for _ in range(14):  # 6 frames (120 ms) still unsent
        stream.on_frame_sent(time.monotonic(), 20.0)
    assert len(engine.submitted) == 1
    stream.on_frame_sent(time.monotonic(), 20.0)  # 100 ms unsent: under the bound
    assert len(engine.submitted) == 2


def test_first_segment_timeout_via_poll() -> None:
    engine = ManualEngine()
    stream, _ = make_stream(engine)
    stream.push_text("Well I", 0.0)
    assert engine.submitted == [] and stream.has_unsegmented_text
    stream.poll(0.05)
    assert engine.submitted == []
    stream.poll(1.0)  # the LLM went quiet: speak the complete words so far
    assert [r.text for r in engine.submitted] == ["Well"]


def test_fake_engine_round_trip() -> None:
    """The FakeEngine's audio is what expected_pcm says, in order, through its own thread."""
    engine = FakeEngine(max_slots=2)
    engine.start()
    try:
        done: list[Any] = []
        request = SegmentRequest("r1", "Hello world.", sink=done.append, params=SamplingParams(seed=5))
        engine.submit(request)
        deadline = time.monotonic() + 5
        while not any(isinstance(o, SegmentEvent) and o.kind == EventKind.DONE for o in done):
            assert time.monotonic() < deadline
            time.sleep(0.005)
        chunks = [o for o in done if isinstance(o, AudioChunk)]
        assert [c.seq for c in chunks] == list(range(len(chunks)))
        pcm = np.concatenate([c.pcm for c in chunks])
        assert np.array_equal(pcm, FakeEngine.expected_pcm("Hello world.", 5))
        assert [c.speech_tokens for c in chunks][:2] == [12, 6]
        with pytest.raises(EngineError):
            engine.submit(SegmentRequest("r2", "x", sink=done.append, voice_id="nope"))
    finally:
        engine.stop()




def test_a_bug_fails_the_stream_instead_of_hanging_it() -> None:
    class Exploding(ManualEngine):
        def submit(self, request: SegmentRequest) -> None:
            raise ValueError("boom")

    stream, rec = make_stream(Exploding())
    stream.push_text("Hello there, friend. ", 0.0)
    stream.flush(0.0)
    assert stream.status == StreamStatus.FAILED and rec.events[-1] == StreamDone(StreamStatus.FAILED, "boom")

    engine = ManualEngine()
    stream, rec = make_stream(engine)
    stream.push_text("Hello there, friend. ", 0.0)
    stream.flush(0.0)
    request = engine.submitted[0]
    request.sink(AudioChunk(request.request_id, 0, np.zeros((2, 2), dtype=np.float32), 1, time.monotonic()))
    assert stream.status == StreamStatus.FAILED  # the encoder refused a malformed chunk
    assert isinstance(rec.events[-1], StreamDone) and "server error" in rec.events[-1].detail


def test_the_engine_hears_what_the_listener_holds() -> None:
    """Every segment of a context carries one ListenerClock; each frame the writer gets out updates it, so the
    engine's vocoder knows how much audio the client holds (sent minus played since its first frame)."""
    engine = ManualEngine()
    stream, rec = make_stream(engine)
    stream.push_text("Well hello there, this is the first sentence. And the second. ", 0.0)
    stream.end(0.0)
    listener = engine.submitted[0].listener
    assert listener is not None and listener.buffered_s(0.0) is None  # nothing sent yet
    engine.chunk(0, 25)  # 1 s of audio = 50 frames of 20 ms
    for frame in rec.of(AudioOut):
        stream.on_frame_sent(10.0, frame.duration_ms)
    assert listener.buffered_s(10.0) == pytest.approx(1.0)  # all of it sent at once, none played yet
    assert listener.buffered_s(10.25) == pytest.approx(0.75)
    engine.event(0, EventKind.GENERATED)
    assert engine.submitted[1].listener is listener  # the next segment sees the same listener


def test_a_faster_listener_holds_less_of_the_engines_audio() -> None:
    """At speed 2 a second of the engine's audio plays in half a second: the engine hears its listener in its
    own audio's seconds (the vocoder sizes chunks in those)."""
    engine = ManualEngine()
    stream, rec = make_stream(engine, speed=2.0)
    stream.push_text("Well hello there, this is the first sentence. ", 0.0)
    stream.end(0.0)
    engine.chunk(0, 50)  # 2 s of the engine's audio
    engine.event(0, EventKind.DONE)
    sent_s = 0.0
    for frame in rec.of(AudioOut):
        sent_s += frame.duration_ms / 1000
        stream.on_frame_sent(10.0, frame.duration_ms)
    assert sent_s == pytest.approx(1.0, abs=0.05)  # played in about a second
    listener = engine.submitted[0].listener
    assert listener is not None and listener.buffered_s(10.25) == pytest.approx((sent_s - 0.25) * 2.0)


# ---- draining: only when the listener would run dry ------------------------------------------------------

PCM8K = StreamFormat("raw", "pcm_s16le", 8_000, frame_ms=20)
FIRST_SENTENCE = "Hello there my friend. "  # one segment each
TWO_SENTENCES = FIRST_SENTENCE + "And this is the second one. "


def count_drains(stream: SpeechStream) -> list[int]:
    """Each drain of the stream's encoder appends 1."""
    drains: list[int] = []
    encoder = stream._encoder
    inner = encoder.drain

    def drain() -> list[bytes]:
        drains.append(1)
        return inner()

    encoder.drain = drain  # type: ignore[method-assign]
    return drains


def polls(stream: SpeechStream) -> bool:
    """The session's tick calls `poll` (read through a call: mypy would keep an asserted property narrowed)."""
    return stream.needs_poll


def send_all(stream: SpeechStream, rec: Recorder, now_s: float) -> None:
    """The writer got every frame emitted so far out at `now_s`."""
    for frame in rec.of(AudioOut)[stream.frames_sent:]:
        stream.on_frame_sent(now_s, frame.duration_ms)


def pcm16_of(rec: Recorder) -> np.ndarray[Any, Any]:
    return np.frombuffer(b"".join(f.payload for f in rec.of(AudioOut)), dtype="<i2")


def test_a_boundary_whose_next_audio_comes_in_time_is_not_drained() -> None:
    """Segment 0 ends (DONE) before segment 1's first audio arrives, as it always does when the next segment is a
    phrase-cache replay (its audio is posted right behind that DONE): the listener holds a second of audio, so the
    encoder is not drained and the stream is the one-shot resampling of both segments, seamless."""
    engine = ManualEngine()
    stream, rec = make_stream(engine, fmt=PCM8K)
    drains = count_drains(stream)
    stream.push_text(TWO_SENTENCES, 0.0)
    stream.end(0.0)
    engine.chunk(0, 25, 0.1)  # 1 s
    send_all(stream, rec, time.monotonic())
    engine.event(0, EventKind.GENERATED)
    engine.event(0, EventKind.DONE)
    assert polls(stream)  # its tail waits for the listener's deadline
    stream.poll(time.monotonic())
    engine.chunk(1, 10, 0.3)  # the next audio pushes the tail out
    assert not polls(stream)
    engine.event(1, EventKind.GENERATED)
    engine.event(1, EventKind.DONE)
    assert stream.status == StreamStatus.COMPLETED and drains == []
    pcm_24k = np.concatenate([np.full(25 * 960, 0.1, np.float32), np.full(10 * 960, 0.3, np.float32)])
    one_shot = float_to_pcm16(soxr.resample(pcm_24k, 24_000, 8_000, quality=RESAMPLER_QUALITY))
    assert np.array_equal(pcm16_of(rec), one_shot)
    assert rec.of(SegmentStarted)[1].audio_offset_ms == 1000.0  # right where segment 0 ends


def test_the_tail_is_drained_just_before_the_listener_runs_dry_and_the_timeline_counts_its_padding() -> None:
    engine = ManualEngine()
    stream, rec = make_stream(engine, fmt=PCM8K)
    drains = count_drains(stream)
    stream.push_text(FIRST_SENTENCE, 0.0)  # then the LLM pauses (no flush: that drains at once, below)
    stream.poll(5.0)  # the segmenter's wait for more text is over: the sentence goes
    assert len(engine.submitted) == 1
    engine.chunk(0, 13, 0.1)  # 520 ms: 4160 samples at 8 kHz, some of them held by the resampler and the framer
    sent_s = time.monotonic()
    send_all(stream, rec, sent_s)
    engine.event(0, EventKind.GENERATED)
    engine.event(0, EventKind.DONE)
    held = 4160 - stream.output_ms * 8
    assert held > 0 and drains == []
    dry_s = sent_s + stream.sent_ms / 1000.0  # a player that started at the first frame has played it all
    stream.poll(dry_s - DRAIN_MARGIN_S - 0.01)  # it still holds more than the margin
    assert drains == [] and polls(stream)
    stream.poll(dry_s - DRAIN_MARGIN_S + 0.01)
    assert drains == [1]
    stream.poll(dry_s + 1.0)
    assert drains == [1]  # once
    out = pcm16_of(rec)
    assert out.size % 160 == 0 and out.size >= 4160  # all of it, the last frame padded
    assert not out[4160:].any()
    stream.push_text("And this is the second one. ", 1.0)
    stream.end(1.0)
    engine.chunk(1, 5, 0.3)
    engine.event(1, EventKind.GENERATED)
    engine.event(1, EventKind.DONE)
    assert drains == [1] and stream.status == StreamStatus.COMPLETED
    second = rec.of(SegmentStarted)[1]
    assert second.audio_offset_ms == out.size / 8  # after the padding: where its audio is
    assert pcm16_of(rec)[out.size] != 0


def test_a_tail_pending_at_the_end_goes_out_with_the_finish_not_a_drain() -> None:
    engine = ManualEngine()
    stream, rec = make_stream(engine, fmt=PCM8K)
    drains = count_drains(stream)
    stream.push_text(FIRST_SENTENCE, 0.0)
    stream.poll(5.0)
    assert len(engine.submitted) == 1
    engine.chunk(0, 25, 0.1)
    send_all(stream, rec, time.monotonic())
    engine.event(0, EventKind.GENERATED)
    engine.event(0, EventKind.DONE)
    assert polls(stream)
    stream.end(0.1)
    assert stream.status == StreamStatus.COMPLETED and drains == [] and not polls(stream)
    out = pcm16_of(rec)
    assert out.size == 8000 and out.all()  # the last frame is short: no padding at the very end


def test_a_flush_with_nothing_after_it_drains_its_last_segment_when_it_ends() -> None:
    """The client said "that is all for now": its speech must be all out when the protocol answers the flush
    (Flushed, flush_done), so the last flushed segment's tail is drained at its end, not at the listener's
    deadline; text after the flush takes that back."""
    engine = ManualEngine()
    stream, rec = make_stream(engine, fmt=PCM8K)
    drains = count_drains(stream)
    stream.push_text(FIRST_SENTENCE, 0.0)
    stream.flush(0.0)
    engine.chunk(0, 25, 0.1)
    send_all(stream, rec, time.monotonic())
    engine.event(0, EventKind.GENERATED)
    engine.event(0, EventKind.DONE)
    assert drains == [1]
    stream.poll(time.monotonic() + 100.0)  # long dry: nothing is left to drain
    assert drains == [1]
    assert pcm16_of(rec).size == 8000  # all of it (1 s at 8 kHz, exactly 50 frames: nothing to pad)
    stream.push_text("And this is the second one. ", 1.0)
    stream.flush(1.0)
    stream.push_text("And a third one follows it here. ", 1.0)  # text after the flush: not the end after all
    engine.chunk(1, 25, 0.1)
    send_all(stream, rec, time.monotonic())
    engine.event(1, EventKind.GENERATED)
    engine.event(1, EventKind.DONE)
    assert drains == [1] and polls(stream)  # its tail waits for the listener's deadline
    stream.poll(time.monotonic() + 100.0)
    assert drains == [1, 1]


# ---- the encode stage: compressed formats on the encoder pool ------------------------------------------

MP3 = StreamFormat("mp3", "mp3", 24_000, 64_000)
LANE_TEXT = "Well hello there, this is the first sentence. And this is the second one. "


async def play_script(engine: ManualEngine, stream: SpeechStream) -> None:
    """Every segment: chunks, the next one's first chunk held while this one plays, the ends. Engine
    outputs reach the stream through its `post`; a yield lets posted ones run."""
    stream.push_text(LANE_TEXT, 0.0)
    stream.end(0.01)
    await asyncio.sleep(0)
    index = 0
    while index < len(engine.submitted):
        engine.chunk(index, 12 + index, 0.1 + 0.1 * index)
        engine.event(index, EventKind.GENERATED)
        await asyncio.sleep(0)
        if index + 1 < len(engine.submitted):
            engine.chunk(index + 1, 5, 0.05)  # held: this segment is still playing
        engine.chunk(index, 3, 0.2)
        engine.event(index, EventKind.DONE)
        await asyncio.sleep(0)
        index += 1


class EndRecorder(Recorder):
    """A Recorder whose `ended` is set at the stream's StreamDone (create it on the running loop)."""

    def __init__(self) -> None:
        super().__init__()
        self.ended = asyncio.Event()

    def __call__(self, stream: Stream, event: StreamEvent) -> None:
        super().__call__(stream, event)
        if isinstance(event, StreamDone):
            self.ended.set()


def pool_stream(engine: ManualEngine, pool: EncoderPool, emit: Recorder) -> SpeechStream:
    """An MP3 stream encoding on `pool`, its results coming back on the running loop."""
    spec = StreamSpec(voice_id="default", params=SamplingParams(), output_format=MP3)
    stream = SpeechStream("s1/1", spec, engine=engine, segmenter=Segmenter(),
                          post=asyncio.get_running_loop().call_soon_threadsafe, emit=emit, encoder_pool=pool)
    stream.open()
    return stream


def stuck_pool() -> tuple[EncoderPool, threading.Event, Lane]:
    """A pool of one thread, kept busy until the event is set (by a lane of its own, also returned)."""
    pool = EncoderPool(workers=1)
    gate = threading.Event()
    blocker = pool.lane(asyncio.get_running_loop().call_soon_threadsafe, max_pending=4, close=lambda: None,
                        on_error=lambda e: None)
    blocker.submit(gate.wait, lambda _: None)
    return pool, gate, blocker


def without_audio(events: list[StreamEvent]) -> list[StreamEvent]:
    return [e for e in events if not isinstance(e, AudioOut)]


def test_a_compressed_stream_on_the_pool_gives_what_encoding_inline_gives() -> None:
    """The lane only moves the encoder calls off the loop: the same events, in the same order, with the same
    timeline (segment offsets, alignment), and the same bytes as the same encoder called inline."""
    engine = ManualEngine()
    inline, inline_rec = make_stream(engine, fmt=MP3)
    asyncio.run(play_script(engine, inline))
    assert len(engine.submitted) == 3
    assert isinstance(inline_rec.events[-1], StreamDone) and inline_rec.events[-1].status == StreamStatus.COMPLETED

    async def on_the_pool() -> Recorder:
        pool = EncoderPool(workers=2)
        recorder = EndRecorder()
        lane_engine = ManualEngine()
        await play_script(lane_engine, pool_stream(lane_engine, pool, recorder))
        await asyncio.wait_for(recorder.ended.wait(), 10)
        pool.shutdown()
        return recorder

    lane_rec = asyncio.run(on_the_pool())
    assert without_audio(lane_rec.events) == without_audio(inline_rec.events)
    assert [type(e).__name__ for e in lane_rec.events][-2:] == ["SegmentDone", "StreamDone"]
    lane_bytes = b"".join(e.payload for e in lane_rec.of(AudioOut))
    assert lane_bytes == b"".join(e.payload for e in inline_rec.of(AudioOut)) and lane_bytes
    audio_ms = sum(e.duration_ms for e in lane_rec.of(AudioOut))
    assert audio_ms == pytest.approx(sum(e.duration_ms for e in inline_rec.of(AudioOut)))
    assert audio_ms >= (15 + 5 + 16 + 5 + 17) * 40.0  # every token's 40 ms, counted once


def test_cancel_cancels_the_lane_and_closes_the_encoder_once(monkeypatch: pytest.MonkeyPatch) -> None:
    closes: list[str] = []

    def counted_encoder(fmt: StreamFormat, speed: float = 1.0) -> StreamEncoder:
        encoder = make_encoder(fmt, speed)
        close = encoder.close

        def counted_close() -> None:
            closes.append("close")
            close()

        encoder.close = counted_close  # type: ignore[method-assign]
        return encoder

    monkeypatch.setattr("agent_server.core.stream.make_encoder", counted_encoder)

    async def main() -> tuple[Recorder, ManualEngine]:
        pool, gate, blocker = stuck_pool()  # the stream's encoder calls queue behind the blocker
        engine = ManualEngine()
        recorder = Recorder()
        stream = pool_stream(engine, pool, recorder)
        stream.push_text(LANE_TEXT, 0.0)
        stream.flush(0.0)
        engine.chunk(0, 12)
        engine.chunk(0, 12)
        await asyncio.sleep(0)  # the chunks reach the stream: their encoder calls queue behind the blocker
        assert not recorder.of(AudioOut) and not recorder.of(SegmentStarted)
        assert stream.cancel()
        gate.set()
        marker = asyncio.Event()
        blocker.submit(None, lambda _: marker.set())  # delivered after anything the stream's lane could still do
        await asyncio.wait_for(marker.wait(), 10)
        pool.shutdown()  # (waits for the lane's close, which runs on the worker)
        return recorder, engine

    rec, engine = asyncio.run(main())
    assert engine.cancelled == [engine.submitted[0].request_id]
    assert not rec.of(AudioOut)  # nothing encoded after the cancel reached the client
    assert isinstance(rec.events[-1], StreamDone) and rec.events[-1].status == StreamStatus.CANCELLED
    assert closes == ["close"]


def test_a_full_lane_is_an_overflow(monkeypatch: pytest.MonkeyPatch) -> None:
    """The encoders cannot keep up: the stream says `OutputOverflow` (the session cuts it as a slow client)
    and ends; the engine's work is cancelled."""
    monkeypatch.setattr("agent_server.core.stream.MAX_PENDING_ENCODES", 3)

    async def main() -> tuple[Recorder, ManualEngine]:
        pool, gate, _ = stuck_pool()
        engine = ManualEngine()
        recorder = EndRecorder()
        stream = pool_stream(engine, pool, recorder)
        stream.push_text(LANE_TEXT, 0.0)
        stream.flush(0.0)
        for _ in range(5):  # each chunk is an encoder call (the first also its SegmentStarted): the lane fills
            engine.chunk(0, 2)
        await asyncio.wait_for(recorder.ended.wait(), 10)
        gate.set()
        pool.shutdown()
        return recorder, engine

    rec, engine = asyncio.run(main())
    overflows = rec.of(OutputOverflow)
    assert len(overflows) == 1 and "fell behind" in overflows[0].detail
    assert isinstance(rec.events[-1], StreamDone) and rec.events[-1].status == StreamStatus.SHUTDOWN
    assert engine.cancelled == [engine.submitted[0].request_id]
