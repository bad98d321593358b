"""SpeechStream: one context (a turn) from text pieces to ordered, encoded audio. Protocol-neutral.

This is the one place where the server talks to the engine. Every wire protocol (protocols/native.py and the
vendors' beside it), through the session core (core/session.py), drives the same verbs and renders the same
events (their vocabulary: core/events.py):

    stream = SpeechStream(key, spec, engine=..., segmenter=..., post=..., emit=...)
    stream.open()
    stream.push_text("Hel", now_s) ; stream.flush(now_s) ; stream.end(now_s) ; stream.cancel()
    stream.poll(now_s)                     # let the segmenter release text on its own clock
    stream.on_frame_sent(now_s, audio_ms)  # the session's writer reports each audio frame it got out

and `emit(stream, event)` receives, in order: `StreamStarted`, then per segment `SegmentStarted`,
its `AudioOut` frames and `SegmentDone`, then exactly one `StreamDone`.

Threading: every method runs on the event loop thread. The engine calls its sink on its own thread; the
sink only hands the output to `post` (loop.call_soon_threadsafe), so the engine never blocks on us.

Markup (`StreamSpec.markup`: the vendor's inline tags, text/markup.py): a `<break>` ends the segment
before it and becomes a segment of its own with no text, its silence made here and never submitted; it plays in
turn like any segment (with its SegmentStarted / SegmentDone, which carry no characters). Speed
(`StreamSpec.speed`): the encoder plays the audio faster or slower (audio/codecs.TempoEncoder); segment offsets
and durations are on the audio as it plays. Voices: a segment is said by `StreamSpec.voice_id`, or after
`stream.start_turn(voice_id, now_s)` (a dialogue's next line, protocols/elevenlabs_dialogue.py) by that turn's
voice; `start_turn` cuts the text before it as a flush does, so no segment holds two turns.

Ordering: segment N+1 is submitted when segment N has finished generating (GENERATED), so T3 of the next
segment overlaps the vocoder tail of the current one; audio that arrives for a segment whose turn has not
come is held until every earlier segment has played. One encoder per context keeps the output stream
continuous across segments (a frame may straddle two segments): a context is one stream, whose codec
priming and delay are paid once.

Draining: the encoder holds back the end of what it was given (the resampler's filter, a partial frame, a
codec's delayed packets). At a segment's end that tail goes out with the next segment's audio; only when the
listener would otherwise run dry before that audio comes (`ListenerClock`: the client plays in real time from
its first frame) is the encoder drained, which costs silence (a frame padded, a codec's flush frames). The
check runs when the segment ends and on every `poll` (the session's tick) until the next audio comes or
the context ends (`finish`: the very end, no padding beyond the last frame). One more end is the client's
own: a `flush` after which nothing has come (no text, no segment) says "that is all for now", and the
protocols answer it once its speech is out (Deepgram's Flushed, Cartesia's flush_done): the last flushed
segment's tail is drained when it ends, ahead of its SegmentDone.

Encoding: the spec's `output_format` (audio/codecs.py) picks the encoder. Raw PCM, G.711 and WAV
encode inline; a compressed format (MP3, Opus, AAC, FLAC) with an `EncoderPool` encodes off the event
loop on the context's `Lane` (audio/encode_lane.py), its results coming back in order. Everything
that must follow audio (SegmentStarted, SegmentDone, the completing StreamDone) goes through the same
stage behind that audio, and the stream reads the encoder only through the counters each call returns,
so both stages give the same events in the same order. A lane that overflows (the encoders cannot keep
up) emits `OutputOverflow`: the session treats it as a slow client.

`events.Stream` is what the session core and the protocols use of a stream: `hub.open_stream` returns one.
A stream submits its segments to a `SegmentTarget` (submit/cancel): the engine itself, or the phrase
cache in front of it (fleet/phrase_cache.CachedSource, which the hub puts there), which answers a hit through
the segment's own sink as the engine would (STARTED with reason "cached", the audio, GENERATED, DONE). So a
cached segment takes the very path of engine audio: same encoder and framing, same events and metrics,
and `SegmentStarted.cached` says where it came from.
"""

from __future__ import annotations

import dataclasses
import enum
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from functools import partial
from typing import Any, Protocol

import numpy as np
import structlog
from numpy.typing import NDArray

from agent_server.audio.codecs import EncoderCounts, StreamEncoder, make_encoder
from agent_server.audio.encode_lane import EncoderPool, EncodeStage, InlineStage, LaneFull
from agent_server.core.events import (
    AudioOut,
    Emit,
    MarkupProblem,
    OutputOverflow,
    SegmentDone,
    SegmentStarted,
    StreamDone,
    StreamSpec,
    StreamStarted,
    StreamStateError,
    StreamStatus,
    StreamTimes,
)
from agent_server.text.markup import MarkupFilter, Pause, Piece
from agent_server.text.normalize import Spoken, spoken_form, unchanged
from synth.api import (
    CACHED_REASON,
    OUTPUT_SAMPLE_RATE_HZ,
    AudioChunk,
    EngineError,
    EngineFull,
    EngineOutput,
    EventKind,
    ListenerClock,
    SegmentEvent,
    SegmentRequest,
)

log = structlog.get_logger("agent_server.speech")

SAMPLES_PER_MS_24K = OUTPUT_SAMPLE_RATE_HZ / 1000.0
SEED_MODULUS = 2**63
# Relative share of a segment's duration per character for the approximate alignment.
CHAR_WEIGHT_SPACE = 0.5
CHAR_WEIGHT_PUNCT = 1.5
CHAR_WEIGHT_OTHER = 1.0
MAX_PENDING_ENCODES = 256  # encoder calls one context may have queued on its lane (beyond: OutputOverflow)
# A segment's tail held in the encoder is drained once the listener holds no more than what the codec still
# holds (its delayed packets) plus this: a tick (25 ms), the encoder call and the way to the client's player.
DRAIN_MARGIN_S = 0.1


# ---- what a stream works with --------------------------------------------------------------------


Post = Callable[..., object]  # loop.call_soon_threadsafe


class SegmentTarget(Protocol):
    """What a stream submits its segments to: the engine, or the phrase cache in front of it."""

    def submit(self, request: SegmentRequest) -> None: ...
    def cancel(self, request_id: str) -> None: ...


class SegmentLike(Protocol):
    @property
    def index(self) -> int: ...
    @property
    def text(self) -> str: ...
    @property
    def start_char(self) -> int: ...
    @property
    def end_char(self) -> int: ...


class SegmenterLike(Protocol):
    @property
    def pending_chars(self) -> int: ...  # received, not yet in a segment
    def push(self, text: str, now_s: float) -> Sequence[SegmentLike]: ...
    def poll(self, now_s: float) -> Sequence[SegmentLike]: ...
    def flush(self, now_s: float) -> Sequence[SegmentLike]: ...
    def end(self, now_s: float) -> Sequence[SegmentLike]: ...


# ---- state --------------------------------------------------------------------------------------


class StreamSegmentStatus(enum.IntEnum):
    """Where one segment of a stream is, as the server side sees it (the engine's own: synth/request.Status)."""

    PENDING = 0  # cut by the segmenter, not submitted yet
    SUBMITTED = 1
    STARTED = 2
    GENERATED = 3  # T3 finished: the next segment may go
    DONE = 10  # all of its audio arrived
    DROPPED = 11  # cancelled or failed


@dataclass(slots=True)
class StreamSegment:
    """One segment of a stream on the server side: its text, where its audio is, its place in the stream's output
    (the engine's state of the same segment is synth/request.SegmentState, which only the engine thread sees)."""

    index: int
    text: str
    start_char: int
    end_char: int
    request_id: str = ""
    status: StreamSegmentStatus = StreamSegmentStatus.PENDING
    held: list[NDArray[Any]] = field(default_factory=list)  # chunks that came before their turn to play
    speech_tokens: int = 0
    samples_24k: int = 0  # audio received so far
    audio_offset_ms: float = 0.0
    announced: bool = False  # SegmentStarted emitted
    cached: bool = False  # its STARTED event said it is replayed from the phrase cache
    pause_ms: int = 0  # > 0: a pause (markup): its silence is made here, never submitted; its text is ""
    voice_id: str = ""  # who says it (the stream's voice, or its turn's: `start_turn`)
    turn: int = 0  # `SegmentDone.turn`
    spoken: Spoken | None = None  # what the engine was given for `text` (set when submitted)


class SpeechStream:
    """An `events.Stream` on the engine."""

    def __init__(
        self,
        key: str,
        spec: StreamSpec,
        *,
        engine: SegmentTarget,
        segmenter: SegmenterLike,
        post: Post,
        emit: Emit,
        encoder_pool: EncoderPool | None = None,
    ) -> None:
        self.key = key  # unique among the server's live streams; engine request ids are f"{key}/{index}"
        self.spec = spec
        self.status = StreamStatus.OPEN
        self.times = StreamTimes(opened_s=time.monotonic())
        self.text_chars = 0
        self.frames_out = 0  # frames emitted (seq of the next frame)
        self.frames_sent = 0  # frames the writer reported sent
        self.sent_ms = 0.0  # audio in those frames
        self._engine = engine
        self._segmenter = segmenter
        self._post = post
        self._emit = emit
        self._encoder: StreamEncoder = make_encoder(spec.output_format, spec.speed)
        self._stage: EncodeStage = self._make_stage(encoder_pool)
        self._counts = EncoderCounts()  # the encoder's counters after the last call whose output came back
        self._uncounted_samples = 0  # output-rate samples encoded but in no AudioOut yet (a codec's delay)
        self._encodes_in_flight = 0  # encoder calls submitted whose output has not come back yet
        self._finish_queued = False
        self._completing = False  # the stream's end is queued behind its last audio
        self._rate_hz = spec.output_format.sample_rate_hz
        self._padding_out_samples = 0  # silence the encoder added to complete frames (drain)
        self._tail_pending: int | None = None  # a finished segment whose tail the encoder holds: drain when due
        self._flushed_through: int | None = None  # the last segment of a `flush` no text has followed yet
        self._segments: list[StreamSegment] = []
        self._playing = 0  # index of the segment whose audio goes out now
        self._next_submit = 0
        self._waiting_for_backlog = False
        # what the client holds, for the engine's vocoder (render order, chunk sizes)
        self._listener = ListenerClock(spec.speed)
        self._markup = MarkupFilter(spec.markup) if spec.markup else None
        self._fed_covered = 0  # (markup) where the ranges of the segments cut so far end, in the text as sent
        self._voice_id = spec.voice_id  # the voice of the text pushed next (`start_turn` changes it)
        self._turn = 0  # how many turns were started

    # ---- the verbs -----------------------------------------------------------------------------

    def open(self) -> None:
        """Announce the stream (emits StreamStarted); call once, before anything else."""
        self._emit(self, StreamStarted())

    def push_text(self, text: str, now_s: float) -> list[str]:
        """Returns what was wrong with the text's markup (tags not spoken nor played: the caller reports it)."""
        self._require_open("text")
        if self.times.first_text_s is None and text:
            self.times.first_text_s = now_s
        if text.strip():
            self._flushed_through = None  # more is coming: not the end of the client's input after all
        self.text_chars += len(text)
        if self._markup is None:
            self._add_segments(self._segmenter.push(text, now_s))
            return []
        self._take_pieces(self._markup.feed(text), now_s)
        return self._markup.take_problems()

    def start_turn(self, voice_id: str, now_s: float) -> int:
        """The text pushed next is a new turn (a line of a dialogue), said by `voice_id` (a voice the caller
        checked): the text before it is cut as at a flush, so no segment holds two turns or two voices.
        Returns the turn's number (1 for the first), which its segments' `SegmentDone.turn` carries."""
        self.flush(now_s)
        self._voice_id = voice_id
        self._turn += 1
        return self._turn

    def flush(self, now_s: float) -> None:
        self._require_open("flush")
        self._end_markup(now_s)  # an unfinished tag is text
        self._add_segments(self._segmenter.flush(now_s))
        self._flushed_through = len(self._segments) - 1 if self._segments else None

    def end(self, now_s: float) -> None:
        self._require_open("end")
        self._end_markup(now_s)
        self.status = StreamStatus.ENDED
        self._add_segments(self._segmenter.end(now_s))
        self._maybe_complete()

    def _end_markup(self, now_s: float) -> None:
        if self._markup is None:
            return
        self._take_pieces(self._markup.end(), now_s)
        for problem in self._markup.take_problems():
            self._emit(self, MarkupProblem(problem))

    def _take_pieces(self, pieces: Sequence[Piece], now_s: float) -> None:
        for piece in pieces:
            if isinstance(piece, Pause):
                self._add_segments(self._segmenter.flush(now_s))  # the speech before the pause is a segment
                # its range: its tag, and the whitespace before it the segment before left
                self._segments.append(StreamSegment(len(self._segments), "", min(self._fed_covered, piece.raw_start),
                                                   piece.raw_end, pause_ms=piece.duration_ms))
                self._fed_covered = piece.raw_end
                self._submit_ready()
            else:
                self._add_segments(self._segmenter.push(piece, now_s))

    def poll(self, now_s: float) -> None:
        """The segmenter's clock (text held for a timeout) and the listener's (a tail to drain before it runs dry)."""
        if self.status == StreamStatus.OPEN:
            self._add_segments(self._segmenter.poll(now_s))
        self._drain_tail_if_due(now_s)

    def cancel(self, status: StreamStatus = StreamStatus.CANCELLED, detail: str = "") -> bool:
        """Stop at once (CANCELLED by the client, SHUTDOWN or FAILED from the server): no audio of this
        stream is emitted afterwards. False if it had already ended."""
        if self.status.done:
            return False
        self._terminate(status, detail)
        return True

    # ---- writer feedback -----------------------------------------------------------------------

    def on_frame_sent(self, now_s: float, audio_ms: float) -> None:
        self.frames_sent += 1
        self.sent_ms += audio_ms
        if self.times.first_frame_sent_s is None:
            self.times.first_frame_sent_s = now_s
        self._listener.report(self.sent_ms / 1000.0, self.times.first_frame_sent_s)
        if self._waiting_for_backlog and self._backlog_s() <= self.spec.max_audio_ahead_s:
            self._submit_ready()

    # ---- views ---------------------------------------------------------------------------------

    @property
    def output_ms(self) -> float:
        """Audio encoded so far (speech plus the silence of idle gaps between segments)."""
        return self._counts.samples_out * 1000.0 / self._rate_hz

    @property
    def segment_count(self) -> int:
        return len(self._segments)

    @property
    def all_segments_done(self) -> bool:
        """Every segment cut so far has all of its audio (or was dropped)."""
        return all(seg.status >= StreamSegmentStatus.DONE for seg in self._segments)

    @property
    def has_unsegmented_text(self) -> bool:
        return self.status == StreamStatus.OPEN and self._segmenter.pending_chars > 0

    @property
    def needs_poll(self) -> bool:
        """`poll` has something to watch: text the segmenter holds, or a tail to drain before the listener runs dry."""
        return self.has_unsegmented_text or (self._tail_pending is not None and not self.status.done)

    # ---- segments in -----------------------------------------------------------------------------

    def _require_open(self, verb: str) -> None:
        if self.status != StreamStatus.OPEN:
            raise StreamStateError(f"{verb!r} on a context that is {self.status.name.lower()}")

    def _add_segments(self, cut: Sequence[SegmentLike]) -> None:
        for seg in cut:
            if not seg.text.strip():
                continue
            index = len(self._segments)
            start, end = seg.start_char, seg.end_char
            if self._markup is not None:  # the segmenter counts the text without its tags; the client, with
                start, end = self._markup.fed_span(start, end)
                start = max(start, self._fed_covered)  # not back over a pause's tag
                end = max(end, start)
                self._fed_covered = end
            self._segments.append(StreamSegment(index, seg.text, start, end, voice_id=self._voice_id,
                                               turn=self._turn))
        if cut:
            self._submit_ready()

    def _submit_ready(self) -> None:
        self._waiting_for_backlog = False
        while self._next_submit < len(self._segments) and not self.status.done:
            if self._next_submit > 0 and self._segments[self._next_submit - 1].status < StreamSegmentStatus.GENERATED:
                return
            if self._next_submit > 0 and self._backlog_s() > self.spec.max_audio_ahead_s:
                self._waiting_for_backlog = True
                return
            seg = self._segments[self._next_submit]
            self._next_submit += 1
            if seg.pause_ms:
                self._make_pause(seg)
            else:
                self._submit(seg)

    def _submit(self, seg: StreamSegment) -> None:
        now_s = time.monotonic()
        seed = self.spec.params.seed
        params = self.spec.params if seed is None else dataclasses.replace(
            self.spec.params, seed=(seed + seg.index) % SEED_MODULUS
        )
        seg.request_id = f"{self.key}/{seg.index}"
        seg.status = StreamSegmentStatus.SUBMITTED
        seg.spoken = spoken_form(seg.text, self.spec.language) if self.spec.normalize else unchanged(seg.text)
        request = SegmentRequest(
            request_id=seg.request_id,
            text=seg.spoken.text,
            sink=self._sink_for(seg),
            voice_id=seg.voice_id,
            params=params,
            language=self.spec.language,
            first_audio_pending=self.times.first_chunk_ready_s is None,
            may_wait=self.spec.may_wait or seg.index > 0,
            submitted_monotonic_s=now_s,
            listener=self._listener,
            model=self.spec.model,
        )
        if self.times.first_submit_s is None:
            self.times.first_submit_s = now_s
        try:
            self._engine.submit(request)
        except EngineFull as exc:  # the engine's inbox is full: busy, as when it has no free slot
            seg.status = StreamSegmentStatus.DROPPED
            self._terminate(StreamStatus.BUSY, str(exc))
        except Exception as exc:  # EngineError (unknown voice, stopped), or a bug: fail the stream, not the socket
            seg.status = StreamSegmentStatus.DROPPED
            if not isinstance(exc, EngineError):
                log.exception("submit_failed", request_id=seg.request_id)
            self._terminate(StreamStatus.FAILED, str(exc) or type(exc).__name__)

    def _make_pause(self, seg: StreamSegment) -> None:
        """A pause is its silence, there at once: it plays when its turn comes, and the next segment may go."""
        silence = np.zeros(round(seg.pause_ms * SAMPLES_PER_MS_24K), dtype=np.float32)
        seg.samples_24k = silence.size
        seg.held.append(silence)
        seg.status = StreamSegmentStatus.DONE
        self._advance()

    def _sink_for(self, seg: StreamSegment) -> Callable[[EngineOutput], None]:
        post = self._post
        on_output = self._on_output

        def sink(out: EngineOutput) -> None:  # engine thread: hand over, never block
            try:
                post(on_output, seg, out)
            except RuntimeError:  # the loop is closed: the server is gone
                pass

        return sink

    # ---- engine output (loop thread) -------------------------------------------------------------

    def _on_output(self, seg: StreamSegment, out: EngineOutput) -> None:
        if self.status.done or seg.status >= StreamSegmentStatus.DONE:
            return  # late output of a cancelled or failed stream
        try:
            if isinstance(out, AudioChunk):
                self._on_chunk(seg, out)
            else:
                self._on_event(seg, out)
        except Exception as exc:  # a loop callback: an escaping error would leave the stream hanging
            log.exception("engine_output_failed", request_id=seg.request_id)
            self._terminate(StreamStatus.FAILED, f"server error: {type(exc).__name__}")

    def _on_chunk(self, seg: StreamSegment, chunk: AudioChunk) -> None:
        seg.speech_tokens += chunk.speech_tokens
        seg.samples_24k += len(chunk.pcm)
        if seg.index == self._playing:
            if self.times.first_chunk_ready_s is None:
                self.times.first_chunk_ready_s = chunk.ready_monotonic_s
            self._play(seg, chunk.pcm)
        else:
            seg.held.append(chunk.pcm)

    def _on_event(self, seg: StreamSegment, event: SegmentEvent) -> None:
        kind = event.kind
        if kind == EventKind.STARTED:
            seg.status = max(seg.status, StreamSegmentStatus.STARTED)
            seg.cached = event.reason == CACHED_REASON
        elif kind == EventKind.GENERATED:
            seg.status = StreamSegmentStatus.GENERATED
            self._submit_ready()
        elif kind == EventKind.DONE:
            seg.status = StreamSegmentStatus.DONE
            self._submit_ready()
            self._advance()
        elif kind == EventKind.BUSY:
            self._terminate(StreamStatus.BUSY, event.reason or "no free slot")
        elif kind == EventKind.CANCELLED:
            self._terminate(StreamStatus.SHUTDOWN, event.reason or "cancelled by the engine")
        else:
            self._terminate(StreamStatus.FAILED, event.reason or "engine failure")

    # ---- audio out -----------------------------------------------------------------------------

    def _announce(self, seg: StreamSegment) -> None:
        """The segment's first audio is next: SegmentStarted goes out behind the audio before it."""
        seg.announced = True
        self._behind_audio(partial(self._segment_started, seg))

    def _segment_started(self, seg: StreamSegment) -> None:
        seg.audio_offset_ms = self._timeline_ms()
        self._emit(self, SegmentStarted(seg.index, seg.text, seg.start_char, seg.end_char, seg.audio_offset_ms,
                                        seg.cached))

    def _play(self, seg: StreamSegment, pcm: NDArray[Any]) -> None:
        if not seg.announced:
            self._announce(seg)
        self._tail_pending = None  # this audio pushes the tail out: the stream goes on without a drain
        self._encode(seg.index, partial(self._encoder.push, pcm))

    # ---- the encode stage: every encoder call and everything behind one --------------------------------

    def _make_stage(self, pool: EncoderPool | None) -> EncodeStage:
        if pool is None or not self.spec.output_format.is_compressed:
            return InlineStage(close=self._encoder.close)
        return pool.lane(self._post, max_pending=MAX_PENDING_ENCODES, close=self._encoder.close,
                         on_error=self._encoder_failed)

    def _encode(self, segment_index: int, call: Callable[[], list[bytes]], *, drained: bool = False) -> None:
        encoder = self._encoder

        def work() -> tuple[list[bytes], EncoderCounts]:  # on the stage's thread
            return call(), EncoderCounts.of(encoder)

        self._encodes_in_flight += 1
        self._submit_stage(work, partial(self._encoded, segment_index, drained))

    def _behind_audio(self, then: Callable[[], None]) -> None:
        """Run `then` once everything queued on the stage before it has come back."""
        self._submit_stage(None, lambda _result: then())

    def _submit_stage(self, work: Callable[[], object] | None, done: Callable[[Any], None]) -> None:
        try:
            self._stage.submit(work, done)
        except LaneFull as exc:
            detail = f"the audio encoder fell behind: {exc}"
            log.warning("encoder_behind", key=self.key, detail=str(exc))
            self._emit(self, OutputOverflow(detail))
            self._terminate(StreamStatus.SHUTDOWN, detail)  # if the session did not cancel it already

    def _encoded(self, segment_index: int, drained: bool, result: tuple[list[bytes], EncoderCounts]) -> None:
        self._encodes_in_flight -= 1
        if self.status.done:
            return  # nothing of a finished stream goes out
        frames, counts = result
        self._uncounted_samples += counts.samples_out - self._counts.samples_out
        self._counts = counts
        if drained:
            self._padding_out_samples = counts.samples_out - counts.samples_resampled
        if not frames:
            return
        total_ms = self._uncounted_samples * 1000.0 / self._rate_hz
        self._uncounted_samples = 0
        total_bytes = sum(len(payload) for payload in frames)
        for payload in frames:  # equal frames get equal shares: exact for fixed PCM frames
            self._emit(self, AudioOut(segment_index, self.frames_out, payload, total_ms * len(payload) / total_bytes))
            self.frames_out += 1

    def _encoder_failed(self, exc: Exception) -> None:
        log.error("encoder_failed", key=self.key, error=repr(exc))
        self._terminate(StreamStatus.FAILED, f"server error: the audio encoder failed ({type(exc).__name__})")

    # ---- segments out --------------------------------------------------------------------------

    def _advance(self) -> None:
        """Play on: finish every leading DONE segment and start the next one's held audio."""
        while self._playing < len(self._segments) and not self.status.done:
            seg = self._segments[self._playing]
            if seg.held and self.times.first_chunk_ready_s is None:
                self.times.first_chunk_ready_s = time.monotonic()  # held audio becomes playable now
            for pcm in seg.held:
                self._play(seg, pcm)
            seg.held.clear()
            if seg.status != StreamSegmentStatus.DONE:
                return
            if not seg.announced:  # a segment without audio still gets its boundary events
                self._announce(seg)
            self._playing += 1
            self._release_tail(seg.index)
            self._behind_audio(partial(self._segment_done, seg))
        self._maybe_complete()

    def _release_tail(self, segment_index: int) -> None:
        """A segment's audio is all in; the encoder holds its last samples back. The next segment's audio pushes
        them out; at the context's end `finish` does; else they wait for the listener's deadline (`poll`)."""
        if self._playing < len(self._segments):
            following = self._segments[self._playing]
            if following.held or following.status == StreamSegmentStatus.DONE:
                return  # the next segment's audio pushes it out
        elif self.status == StreamStatus.ENDED:
            self._tail_pending = None
            self._finish_queued = True
            self._encode(segment_index, self._encoder.finish)  # the very end
            return
        elif segment_index == self._flushed_through:
            self._flushed_through = None
            self._encode(segment_index, self._encoder.drain, drained=True)  # the flushed speech is all out
            return
        self._tail_pending = segment_index
        self._drain_tail_if_due(time.monotonic())

    def _drain_tail_if_due(self, now_s: float) -> None:
        segment_index = self._tail_pending
        if segment_index is None or self.status.done or not self._listener_runs_dry(now_s):
            return
        self._tail_pending = None
        self._encode(segment_index, self._encoder.drain, drained=True)

    def _listener_runs_dry(self, now_s: float) -> bool:
        """The listener would run out of audio before what the encoder holds reaches it, unless it goes now."""
        started_s = self.times.first_frame_sent_s
        if started_s is None:  # it has heard nothing yet: it waits for this tail, unless audio is on its way
            return self._encodes_in_flight == 0 and self.frames_sent == self.frames_out
        holds_s = self.sent_ms / 1000.0 - (now_s - started_s)  # as played (ListenerClock, in played seconds)
        codec_holds_s = (self._counts.samples_out - self._counts.samples_covered) / self._rate_hz
        return holds_s <= codec_holds_s + DRAIN_MARGIN_S

    def _timeline_ms(self) -> float:
        """Where the next sample pushed into the encoder will sit in the stream's output, in ms."""
        return (
            self._counts.samples_fed / SAMPLES_PER_MS_24K + self._padding_out_samples * 1000.0 / self._rate_hz
        )

    def _segment_done(self, seg: StreamSegment) -> None:
        audio_ms = seg.samples_24k / SAMPLES_PER_MS_24K / self.spec.speed  # as it plays
        spoken = seg.spoken or unchanged(seg.text)  # a pause has none
        starts, durations = spoken.written_times(*char_alignment(spoken.text, seg.audio_offset_ms, audio_ms))
        self._emit(self, SegmentDone(
            seg.index, seg.text, seg.start_char, seg.audio_offset_ms, audio_ms, seg.speech_tokens, starts, durations,
            seg.turn,
        ))

    def _maybe_complete(self) -> None:
        if self.status != StreamStatus.ENDED or self._playing < len(self._segments) or self._completing:
            return
        self._completing = True
        self._tail_pending = None  # `finish` releases it
        if not self._finish_queued:
            self._finish_queued = True
            self._encode(max(0, len(self._segments) - 1), self._encoder.finish)
        self._behind_audio(self._complete)

    def _complete(self) -> None:
        if self.status == StreamStatus.ENDED:  # not cancelled while the last audio was encoded
            self.status = StreamStatus.COMPLETED
            self._emit(self, StreamDone(StreamStatus.COMPLETED))

    def _backlog_s(self) -> float:
        """Audio encoded but not yet taken by the socket."""
        return max(0.0, self.output_ms - self.sent_ms) / 1000.0

    # ---- the end -------------------------------------------------------------------------------

    def _terminate(self, status: StreamStatus, detail: str) -> None:
        if self.status.done:
            return
        self.status = status
        self._tail_pending = None
        self._stage.cancel()  # drops queued encoder calls; the encoder is closed once
        for seg in self._segments:
            if StreamSegmentStatus.SUBMITTED <= seg.status < StreamSegmentStatus.DONE:
                self._engine.cancel(seg.request_id)
            if seg.status < StreamSegmentStatus.DONE:
                seg.status = StreamSegmentStatus.DROPPED
            seg.held.clear()
        self._emit(self, StreamDone(status, detail))


def char_alignment(text: str, offset_ms: float, duration_ms: float) -> tuple[list[int], list[int]]:
    """Approximate per-character (start, duration) in ms: the duration shared out by character weight."""
    if not text:
        return [], []
    weights = np.array([_char_weight(c) for c in text], dtype=np.float64)
    edges_ms = offset_ms + duration_ms * np.concatenate(([0.0], np.cumsum(weights) / weights.sum()))
    starts = np.rint(edges_ms[:-1]).astype(np.int64)
    ends = np.rint(edges_ms[1:]).astype(np.int64)
    return starts.tolist(), (ends - starts).tolist()


def _char_weight(char: str) -> float:
    if char.isspace():
        return CHAR_WEIGHT_SPACE
    if char in ",.;:!?":
        return CHAR_WEIGHT_PUNCT
    return CHAR_WEIGHT_OTHER
