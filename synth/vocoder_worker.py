"""The vocoder's own thread: token runs in from the step loop, batched S3Gen renders, audio out through outlets.

The engine thread decodes; after each step it hands every segment's new speech tokens to this worker in one
message (`feed`, a bounded queue: when the vocoder falls more than MAX_PENDING_STEPS steps behind, the decode
waits for it) and goes on with the next step. The worker owns every segment's vocoder state from then on:

    drain messages (opens, tokens, cancels, prepared voices)
    -> pick the due streams (ChunkPolicy: chunk sizes, and the order: listeners about to run dry first)
    -> one batched render (StreamingVocoder.render) -> each stream's chunk out through its Outlet

and emits each segment's DONE after its last chunk. The worker emits itself rather than handing PCM back to
the engine thread: the engine thread may be busy with a decode step for 100+ ms on a CPU, and a chunk that
waits for it is latency the listener hears; the Outlet keeps ordering, cancel and exactly-once terminal
events across the two threads.

Voices are prepared (the S3Gen prompt cache: ~10 s on a CPU for English) on a separate, low-priority thread,
never on the decode thread or this one: streams of a voice that is not ready yet wait for it, everyone else
keeps speaking. A cancelled stream's pending renders are dropped at the next message drain, and its Outlet
drops anything a render already in flight produces.

On a GPU the worker renders on its own CUDA stream, so its kernels overlap the decode's.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import queue
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import numpy.typing as npt
import torch

from synth import gpu
from synth.api import (
    OUTPUT_SAMPLE_RATE_HZ,
    SAMPLES_PER_SPEECH_TOKEN,
    AudioChunk,
    EventKind,
    ListenerClock,
    SegmentEvent,
)
from synth.cpu_threads import CoreLease, use_threads
from synth.outlet import Delivery, Outlet
from synth.render_checkpoints import RenderInterrupted, stop_when
from synth.vocoder import (
    PromptCache,
    RenderJob,
    StreamingVocoder,
    VocoderStream,
    VocoderVoice,
)

log = logging.getLogger(__name__)

Pcm = npt.NDArray[np.float32]  # host float32 arrays: PCM, mels, carried sources

SPEECH_TOKENS_PER_S = OUTPUT_SAMPLE_RATE_HZ / SAMPLES_PER_SPEECH_TOKEN  # 25
JOB_TICK_MARGIN_FACTOR = 2.0  # live listeners hold twice a job tick's time before one starts (JobYield)
JOB_TICK_AVERAGING = 0.3  # weight of the newest job tick in the recent job tick time (an EWMA)
MAX_PENDING_STEPS = 1024  # feed messages (one per decode step) the worker may be behind before the decode waits
IDLE_WAIT_S = 0.05  # nothing open: block this long on the inbox
PENDING_WAIT_S = 0.01  # streams open but none due: re-check the listeners this often
PREPARED_VOICES = 64  # prepared vocoder voices kept (their prompt caches have their own byte budget)
PREPARER_THREADS = 1


@dataclass(frozen=True, slots=True)
class ChunkPolicy:
    """How much audio each render of a stream produces, and which due streams render first.

    - A segment's first chunk, when the listener holds less than one (a turn's first audio, or a segment that
      starts after a dry spell), is small: that is time to first audio.
    - A listener that holds audio gets a chunk about as long as what it holds (clamped to [first, max]): a
      stream with seconds buffered renders long, efficient chunks, late.
    - A listener that has run dry (or holds less than a first chunk) after the segment's first chunk gets
      everything renderable now (at least a first chunk, at most max), rendered first. Not a small chunk: on a
      loaded machine a small chunk puts out less audio than its render takes, so the listener stays dry and
      every later chunk is small too (measured: 12-token renders only, 0.85 audio-s/s at 4 sessions, where the
      fixed schedule gave 1.16); rendering what is there catches up in fewer, cheaper renders per token.
    - Seeded requests keep the fixed schedule (first, then `schedule_tokens`), whatever the listener does: the
      protocol promises the same audio for the same seed, and chunk boundaries change the audio (slightly).
    - Due streams render in the order of how soon their listener runs dry; listeners that hold nothing render
      alone in their tick.
    """

    first_chunk_tokens: int = 12
    schedule_tokens: tuple[int, ...] = (24, 48, 96)
    max_chunk_tokens: int = 96

    def chunk_tokens(self, chunks_emitted: int, buffered_s: float, reproducible: bool, ready_tokens: int = 0) -> int:
        """Tokens of audio the stream's next render puts out; `ready_tokens`: how many it could put out now."""
        if reproducible:
            if chunks_emitted == 0:
                return self.first_chunk_tokens
            return self.schedule_tokens[min(chunks_emitted - 1, len(self.schedule_tokens) - 1)]
        held_tokens = int(max(0.0, buffered_s) * SPEECH_TOKENS_PER_S)
        if held_tokens < self.first_chunk_tokens and chunks_emitted > 0:  # ran dry: catch up with what is there
            return max(self.first_chunk_tokens, min(self.max_chunk_tokens, ready_tokens))
        return max(self.first_chunk_tokens, min(self.max_chunk_tokens, held_tokens))


@dataclass(frozen=True, slots=True)
class JobYield:
    """When job segments' chunks render: the vocoder's half of "live first, always" (the scheduler's half gives
    live segments the rows). Nobody listens to a job segment as it renders, so its chunks render only in ticks no
    live stream needs:

    - never while a live segment awaits a turn's first audio (its stream is open, its voice ready, and its first
      chunk not yet rendered): the first chunk would wait for the job's render; nor while a live turn's first
      segment is on its way from T3 on a CPU (`hold_for_turns`; `VocoderWorker.turn_pending`: submitted, queued,
      or decoding before its first valid id): there the decode borrows the idle vocoder's threads for that turn's
      prefill and first ids (CoreLease; 1.6x faster steps at full size), which a job render in their way would
      hold;
    - never while a live listener holds less than the margin: `live_margin_s`, or twice the recent job ticks'
      wall time if that is longer (so that a job tick that starts never outlasts what a live listener holds);
    - after every due live chunk of a listener that holds less than `live_ahead_s` (or the margin, if longer):
      those render first; a listener that holds more has seconds to spare, and its chunk renders after the job
      chunk (on a CPU, in the next tick), so that a burst of live text rendered far ahead of its listeners leaves
      the jobs their share;
    - on a CPU, where a tick costs about the sum of its renders, one job chunk alone (`batch_with_live` False,
      `max_job_streams` 1), and that render is stopped (`stoppable`, synth/render_checkpoints.py) at its next
      stage boundary when a live turn is submitted or its stream opens, when a live stream opens whose listener
      holds less than the margin (a turn's later segment: between two segments no live stream is open, so the
      job tick may have started in that gap; `turn_pending` holds ticks back in the gap itself), or when a live
      listener falls under `stop_below_s`, a segment's stream with no chunk out yet included: the live chunk
      waits for one stage of a job render (up to ~40 ms on one thread of CPU-4 with the tiny model), not for all
      of it (a 96-token chunk: 440 ms), and the decode gets its cores for the turn's first ids. A stopped render
      is rendered again later, to the same bits (nothing of it was applied). A job render that holds the decode's
      idle threads (CoreLease) hands them back at its next stage boundary when the decode wants them;
    - on a GPU a batched render costs about one render: job chunks fill the tick's rows beside live ones, and
      nothing is stopped (a live chunk beside them costs about what it costs alone).
    """

    live_margin_s: float = 1.0
    live_ahead_s: float = 3.0
    stop_below_s: float = 0.25
    max_job_streams: int = 1
    batch_with_live: bool = False
    stoppable: bool = True
    hold_for_turns: bool = True

    @staticmethod
    def for_device(device: torch.device, max_batch: int) -> JobYield:
        if device.type == "cuda":
            return JobYield(max_job_streams=max_batch, batch_with_live=True, stoppable=False, hold_for_turns=False)
        return JobYield()

    def margin_s(self, job_tick_s: float) -> float:
        """What every live listener must hold for a job tick to start, after job ticks of `job_tick_s` lately."""
        return max(self.live_margin_s, JOB_TICK_MARGIN_FACTOR * job_tick_s)

    def room(self, live_due: int, max_batch: int) -> int:
        """Job streams a tick with `live_due` live streams may take (when `LiveNeeds` lets jobs in at all)."""
        if self.batch_with_live:
            return min(self.max_job_streams, max_batch - live_due)
        return 0 if live_due else min(self.max_job_streams, max_batch)


@dataclass(slots=True)
class LiveNeeds:
    """What the live streams need of the vocoder now (one pass over them, `VocoderWorker._due`)."""

    awaiting_first_audio: bool = False  # a live turn waits for its first chunk
    least_held_s: float = float("inf")  # the least audio a live listener holds

    def lets_jobs_in(self, margin_s: float) -> bool:
        return not self.awaiting_first_audio and self.least_held_s >= margin_s


@dataclass(frozen=True, slots=True)
class StreamOpen:
    """A segment's first message to the worker (sent with its first tokens)."""

    request_id: str
    outlet: Outlet
    voice: Any  # synth.voices.Voice: key (content hash) and s3gen_ref
    seed: int
    reproducible: bool  # the client gave the seed: fixed chunk boundaries
    listener: ListenerClock | None
    admitted_s: float
    stream_id: int = -1  # the id `TokenRun`s name it by (the engine's claim id), -1: none
    live: bool = True  # False: a job segment (synth.api.Priority.JOB): rendered only when no live listener needs it


@dataclass(frozen=True, slots=True, eq=False)
class TokenRun:
    """One decode step's valid ids of every stream, as two arrays (whatever the number of streams): the engine
    thread builds it in a fixed number of operations; the worker sorts it out per stream."""

    stream_ids: npt.NDArray[np.int64]  # StreamOpen.stream_id of each id
    tokens: npt.NDArray[np.int64]  # the ids, in step order per stream


@dataclass(frozen=True, slots=True)
class Feed:
    """New valid speech tokens of one segment; `final` once T3 is done (then the DONE event's contents)."""

    request_id: str
    tokens: tuple[int, ...]
    final: bool = False
    speech_tokens: int = 0  # final: valid tokens in all
    finish_reason: str = ""  # final: why T3 stopped


@dataclass(frozen=True, slots=True)
class _Cancel:
    request_id: str


@dataclass(frozen=True, slots=True, eq=False)
class _VoiceReady:
    key: str
    voice: VocoderVoice | None  # None: preparation failed
    prompt: PromptCache | None = None  # its prompt cache (None: the voice renders uncached)
    error: str = ""


@dataclass(slots=True, eq=False)
class _WarmGraphs:
    key: str  # a prepared voice
    done: threading.Event = field(default_factory=threading.Event)
    built: int = 0


@dataclass(slots=True, eq=False)
class _CheckGraphs:
    key: str  # a prepared voice
    fall_back: bool  # on a failure, render eagerly from now on
    done: threading.Event = field(default_factory=threading.Event)
    problem: str = ""


_Message = list[StreamOpen | TokenRun | Feed] | _Cancel | _VoiceReady | _WarmGraphs | _CheckGraphs


@dataclass(slots=True, eq=False)
class Speech:
    """The worker's state of one segment; only the worker thread touches it."""

    spec: StreamOpen
    stream: VocoderStream | None = None  # once its voice is prepared
    waiting_tokens: list[int] = field(default_factory=list)  # tokens that came before the voice was ready
    final: Feed | None = None
    chunks_emitted: int = 0
    emitted_s: float = 0.0
    first_chunk_s: float = 0.0

    @property
    def request_id(self) -> str:
        return self.spec.request_id

    def buffered_s(self, now_s: float) -> float:
        """Audio its listener holds now: the session's report, or (none yet) a listener that started playing at
        this segment's first chunk."""
        listener = self.spec.listener
        reported = listener.buffered_s(now_s) if listener is not None else None
        if reported is not None:
            return reported
        if self.chunks_emitted == 0:
            return 0.0
        return self.emitted_s - (now_s - self.first_chunk_s)


@dataclass(slots=True)
class RenderStats:
    """Renders since the last `take_stats` (read by the engine thread once per step)."""

    ms: float = 0.0
    audio_s: float = 0.0
    job_audio_s: float = 0.0  # of audio_s, what job segments got
    ticks: int = 0
    streams: int = 0


class VocoderWorker:
    def __init__(self, vocoder: StreamingVocoder, policy: ChunkPolicy, *, threads: int, max_batch: int,
                 on_sink_failed: Callable[[str], None], max_pending_steps: int = MAX_PENDING_STEPS,
                 lease: CoreLease | None = None, job_yield: JobYield | None = None) -> None:
        if max_batch < 1 or threads < 1:
            raise ValueError("max_batch and threads must be >= 1")
        self.vocoder = vocoder
        self.policy = policy
        self.threads = threads
        self.lease = lease if lease is not None else CoreLease(0, threads, enabled=False)
        self.max_batch = max_batch
        self.job_yield = job_yield if job_yield is not None else JobYield.for_device(vocoder.device, max_batch)
        self._on_sink_failed = on_sink_failed
        self._inbox: queue.Queue[_Message] = queue.Queue()
        # Feeds are the one producer that can run ahead (the decode): each holds a slot until handled.
        self._feed_slots = threading.BoundedSemaphore(max_pending_steps)
        self._prepare_queue: queue.Queue[Any] = queue.Queue()
        self._speeches: dict[str, Speech] = {}  # worker thread only
        self._by_stream: dict[int, Speech] = {}  # StreamOpen.stream_id -> its speech while in _speeches
        self._voices: dict[str, VocoderVoice] = {}  # voice key -> prepared (worker thread only), insertion = age
        self._preparing: set[str] = set()  # worker thread only
        self._stats = RenderStats()
        self._stats_lock = threading.Lock()
        self._prepared_keys: dict[str, None] = {}  # voices whose preparation finished, oldest first (_prepared)
        self._prepared = threading.Condition()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._preparer: threading.Thread | None = None
        self.failure = ""
        self.ticks = 0  # renders done (worker thread writes; tests read)
        self.job_renders_stopped = 0  # job ticks stopped for live work (JobYield)
        self.job_tick_s = 0.0  # recent job ticks' wall time (an EWMA; worker thread)
        # set (engine thread) after feeding a live stream that awaits a turn's first audio, or whose listener holds
        # less than the jobs' margin (a job tick that started before it was known would not have started); cleared
        # by each drain
        self._live_opened = threading.Event()
        self._render_stream: Any = None  # the worker thread's CUDA stream (None elsewhere)
        # a live turn's first segment is on its way from T3 (the engine sets it: Engine.turn_pending); any thread
        self.turn_pending: Callable[[], bool] = _never
        self.drains = 0  # inbox drains done

    # --- any thread --------------------------------------------------------------------------------------

    def start(self) -> None:
        if self._thread is not None:
            return
        self._thread = threading.Thread(target=self._run, name="synth-vocoder", daemon=True)
        self._preparer = threading.Thread(target=self._run_preparer, name="synth-voice-prep", daemon=True)
        self._thread.start()
        self._preparer.start()

    def stop(self, timeout_s: float = 5.0) -> None:
        self._stop.set()
        self._prepare_queue.put(None)
        for thread in (self._thread, self._preparer):
            if thread is not None:
                thread.join(timeout_s)

    @property
    def alive(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def feed(self, items: list[StreamOpen | TokenRun | Feed]) -> None:
        """One decode step's opens and token runs. Blocks only while the worker is MAX_PENDING_STEPS behind."""
        while not self._feed_slots.acquire(timeout=IDLE_WAIT_S):
            if self._stop.is_set():
                return
        self._inbox.put(items)
        now_s = time.monotonic()
        if any(isinstance(item, StreamOpen) and item.live and self._wanted_now(item, now_s) for item in items):
            self._live_opened.set()  # after the put: a drain that clears it finds the open

    def _wanted_now(self, spec: StreamOpen, now_s: float) -> bool:
        """A live stream that opens now is waited for: a turn's first audio, or a listener holding less than the
        jobs' margin (JobYield.margin_s)."""
        if _awaits_first_audio(spec, now_s):
            return True
        held_s = spec.listener.buffered_s(now_s) if spec.listener is not None else None
        return held_s is not None and held_s < self.job_yield.margin_s(self.job_tick_s)

    def cancel(self, request_id: str) -> None:
        """Drop the stream's pending renders (its Outlet already drops its output)."""
        self._inbox.put(_Cancel(request_id))

    def prepare_voice(self, voice: Any) -> None:
        """Prepare a voice's vocoder prompt on the preparation thread, ahead of its first request."""
        self._prepare_queue.put(voice)

    def wait_prepared(self, keys: list[str], timeout_s: float) -> bool:
        """Wait until the preparation thread has finished these voices (successfully or not)."""
        with self._prepared:
            return self._prepared.wait_for(lambda: all(key in self._prepared_keys for key in keys), timeout_s)

    def warm_graphs(self, voice_key: str, timeout_s: float) -> int | None:
        """With the vocoder's graphs on: capture the first-chunk ticks of 1 .. max_batch streams now, on the worker
        thread, with a prepared voice (StreamingVocoder.warm_first_chunks). The graphs built; None if the worker
        did not get to it within timeout_s."""
        message = _WarmGraphs(voice_key)
        self._inbox.put(message)
        return message.built if message.done.wait(timeout_s) else None

    def check_graphs(self, voice_key: str, timeout_s: float, fall_back: bool) -> str | None:
        """With the vocoder's graphs on, after `warm_graphs`: a first chunk rendered through the graphs beside the
        same chunk rendered eagerly, on the worker thread (StreamingVocoder.check_graphs), and the captures that
        failed. '' when they agree and none failed, else the reason (then, with `fall_back`, the vocoder renders
        eagerly from now on); None if the worker did not get to it within timeout_s."""
        message = _CheckGraphs(voice_key, fall_back)
        self._inbox.put(message)
        return message.problem if message.done.wait(timeout_s) else None

    def has_stats(self) -> bool:
        """Renders happened since the last `take_stats` (a cheap look, without the lock)."""
        return self._stats.ticks > 0

    def take_stats(self) -> RenderStats:
        with self._stats_lock:
            stats, self._stats = self._stats, RenderStats()
        return stats

    # --- the worker thread -------------------------------------------------------------------------------

    def _run(self) -> None:
        try:
            use_threads(self.threads)
            device = self.vocoder.device
            gpu.bind_thread(device)
            stream = torch.cuda.Stream(device) if device.type == "cuda" else None  # type: ignore[no-untyped-call]
            self._render_stream = stream
            with torch.cuda.stream(stream) if stream is not None else contextlib.nullcontext():
                while not self._stop.is_set():
                    if not self._speeches:
                        self.lease.vocoder_idle()
                    self._drain(block=not self._speeches)
                    jobs = self._due(time.monotonic())
                    if jobs:
                        with self.lease.render(urgent=self._first_audio(jobs, time.monotonic())) as threads:
                            self._render(jobs, threads)
                    else:
                        self.lease.vocoder_idle()
                        if self._speeches:
                            self._drain(block=True, timeout_s=PENDING_WAIT_S)
        except Exception as exc:
            log.exception("vocoder worker died")
            self.failure = f"{type(exc).__name__}: {exc}"
            for speech in list(self._speeches.values()):
                self._fail(speech, f"vocoder failure: {self.failure}")

    def _drain(self, block: bool, timeout_s: float = IDLE_WAIT_S) -> None:
        self._live_opened.clear()
        try:
            message = self._inbox.get(timeout=timeout_s) if block else self._inbox.get_nowait()
            while True:
                self._handle(message)
                message = self._inbox.get_nowait()
        except queue.Empty:
            pass
        self.drains += 1

    def _handle(self, message: _Message) -> None:
        if isinstance(message, _Cancel):
            self._forget(message.request_id)  # its pending renders go with it
        elif isinstance(message, _VoiceReady):
            self._voice_ready(message)
        elif isinstance(message, _WarmGraphs):
            try:
                voice = self._voices.get(message.key)
                if voice is not None:
                    message.built = self.vocoder.warm_first_chunks(voice, self.policy.first_chunk_tokens,
                                                                   self.max_batch)
            finally:
                message.done.set()
        elif isinstance(message, _CheckGraphs):
            try:
                message.problem = self._check_graphs(message.key)
                if message.problem and message.fall_back:
                    self.vocoder.drop_graphs()
            finally:
                message.done.set()
        else:
            self._feed_slots.release()
            for item in message:
                if isinstance(item, StreamOpen):
                    self._open(item)
                elif isinstance(item, TokenRun):
                    self._add_run(item)
                else:
                    self._add(item)

    def _check_graphs(self, voice_key: str) -> str:
        graphs = self.vocoder.graphs
        if graphs is None:
            return ""
        if graphs.failed:
            return f"{graphs.failed} of the first chunks' graph captures failed"
        voice = self._voices.get(voice_key)
        if voice is None:
            return "the warm-up voice is not prepared"
        try:
            return str(self.vocoder.check_graphs(voice, self.policy.first_chunk_tokens))
        except Exception as exc:
            log.exception("checking the vocoder's graphs failed")
            return f"the check raised {type(exc).__name__}: {exc}"

    def _forget(self, request_id: str) -> Speech | None:
        speech = self._speeches.pop(request_id, None)
        if speech is not None and speech.spec.stream_id >= 0:
            self._by_stream.pop(speech.spec.stream_id, None)
        return speech

    def _add_run(self, run: TokenRun) -> None:
        """A step's ids of every stream: one `stream.add` per stream (a stable sort keeps each stream's order)."""
        if not run.stream_ids.size:
            return
        order = np.argsort(run.stream_ids, kind="stable")
        ids, tokens = run.stream_ids[order], run.tokens[order]
        cuts = np.flatnonzero(np.diff(ids)) + 1
        for stream_id, part in zip(ids[np.concatenate(([0], cuts))].tolist(), np.split(tokens, cuts), strict=True):
            speech = self._by_stream.get(stream_id)
            if speech is not None:  # else cancelled (or failed) meanwhile
                self._add_tokens(speech, part.tolist(), final=False)

    def _open(self, spec: StreamOpen) -> None:
        if not spec.outlet.is_open:  # cancelled before its first tokens got here
            return
        speech = Speech(spec=spec)
        self._speeches[spec.request_id] = speech
        if spec.stream_id >= 0:
            self._by_stream[spec.stream_id] = speech
        prepared = self._voices.get(spec.voice.key)
        prompt = None
        if prepared is not None and self.vocoder.uses_prompt_cache(prepared):
            prompt = self.vocoder.cached_prompt(prepared)
            if prompt is None:  # evicted from the prompt-cache budget since: rebuilt off this thread
                prepared = None
        if prepared is not None:
            self._start_stream(speech, prepared, prompt)
        elif spec.voice.key not in self._preparing:
            self._preparing.add(spec.voice.key)
            self._prepare_queue.put(spec.voice)

    def _add(self, feed: Feed) -> None:
        speech = self._speeches.get(feed.request_id)
        if speech is None:  # cancelled
            return
        if feed.final:
            speech.final = feed
        self._add_tokens(speech, feed.tokens, feed.final)

    def _add_tokens(self, speech: Speech, tokens: Sequence[int], final: bool) -> None:
        try:
            if speech.stream is None:
                speech.waiting_tokens.extend(tokens)
            else:
                speech.stream.add(tokens, final)
        except ValueError as exc:  # token ids the vocoder cannot take: this segment only
            self._fail(speech, f"vocoder failure: {exc}")

    def _voice_ready(self, ready: _VoiceReady) -> None:
        self._preparing.discard(ready.key)
        if self._render_stream is not None:
            # made on the preparation thread's stream, read on this one: freed later, a block must not go back to the
            # preparer's stream while renders queued here still read it
            _used_on(self._render_stream, ready.voice, ready.prompt)
        if ready.voice is not None:
            self._voices[ready.key] = ready.voice
            while len(self._voices) > PREPARED_VOICES:
                self._voices.pop(next(iter(self._voices)))
        for speech in list(self._speeches.values()):
            if speech.stream is None and speech.spec.voice.key == ready.key:
                if ready.voice is None:
                    self._fail(speech, f"voice preparation failed: {ready.error}")
                else:
                    self._start_stream(speech, ready.voice, ready.prompt)

    def _start_stream(self, speech: Speech, voice: VocoderVoice, prompt: PromptCache | None) -> None:
        stream = self.vocoder.open(voice, speech.spec.seed, reproducible=speech.spec.reproducible)
        stream.prompt = prompt  # the stream holds it: an eviction from the budget does not take it away
        speech.stream = stream
        try:
            stream.add(speech.waiting_tokens, speech.final is not None)
        except ValueError as exc:
            self._fail(speech, f"vocoder failure: {exc}")
        speech.waiting_tokens = []

    def _due(self, now_s: float) -> list[tuple[Speech, RenderJob]]:
        """The streams whose next chunk can render now, most urgent first, at most max_batch. When some live
        listener holds nothing (a turn's first audio, or one that ran dry), the tick takes only those: on a CPU a
        tick costs about the sum of its renders, and a first chunk must not wait for other streams' long ones.

        Job segments (`StreamOpen.live` False: nobody listens as they render) come after the live ones, and only
        when no live stream needs the vocoder (JobYield): their renders fill its idle time."""
        due: list[tuple[float, float, Speech, RenderJob]] = []
        jobs: list[tuple[float, float, Speech, RenderJob]] = []
        needs = LiveNeeds()
        for speech in self._speeches.values():
            stream = speech.stream
            if stream is None:  # its voice is being prepared: nothing to render, nothing held back meanwhile
                continue
            if not speech.spec.live:
                job = stream.next_job(self.policy.chunk_tokens(speech.chunks_emitted, 0.0, True))
                if job is not None:
                    jobs.append((0.0, speech.spec.admitted_s, speech, job))
                continue
            buffered_s = speech.buffered_s(now_s)
            if speech.chunks_emitted == 0 and _awaits_first_audio(speech.spec, now_s):
                needs.awaiting_first_audio = True
            needs.least_held_s = min(needs.least_held_s, buffered_s)
            chunk = self.policy.chunk_tokens(speech.chunks_emitted, buffered_s, speech.spec.reproducible,
                                             stream.ready_tokens)
            job = stream.next_job(chunk)
            if job is not None:
                due.append((buffered_s, speech.spec.admitted_s, speech, job))
        due.sort(key=lambda item: (item[0], item[1]))
        if due and due[0][0] <= 0.0:
            due = [item for item in due if item[0] <= 0.0]
        margin_s = self.job_yield.margin_s(self.job_tick_s)
        if jobs and needs.lets_jobs_in(margin_s) and not (self.job_yield.hold_for_turns and self.turn_pending()):
            jobs.sort(key=lambda item: item[1])  # the oldest job segment first: it ends (and is stored) first
            # live streams whose listeners hold the horizon or more can wait for a job tick (on a CPU, where a
            # tick is one or the other); the others render first
            horizon_s = max(self.job_yield.live_ahead_s, margin_s)
            ahead = [item for item in due if item[0] >= horizon_s]
            due = [item for item in due if item[0] < horizon_s]
            due.extend(jobs[:self.job_yield.room(len(due), self.max_batch)])
            due.extend(ahead if self.job_yield.batch_with_live or len(due) == 0 else [])
        return [(speech, job) for _, _, speech, job in due[:self.max_batch]]

    @staticmethod
    def _first_audio(tick: list[tuple[Speech, RenderJob]], now_s: float) -> bool:
        """The tick renders a turn's first audio: a live segment's first chunk for a listener that has been sent
        nothing yet (`_awaits_first_audio`). Someone waits in silence for it (time to first audio), so it may
        borrow the decode's threads (CoreLease). Not a later segment's first chunk after a dry spell: under load
        listeners run dry often, and pausing the decode for each of those renders costs more audio than it saves
        (measured, BENCHMARKS.md). Never a job segment's: nobody waits for it."""
        return any(speech.spec.live and speech.chunks_emitted == 0 and _awaits_first_audio(speech.spec, now_s)
                   for speech, _ in tick)

    def _render(self, tick: list[tuple[Speech, RenderJob]], threads: int = 1) -> None:
        debug = log.isEnabledFor(logging.DEBUG)
        new_tokens = [job.new_tokens for _, job in tick] if debug else []  # (a render advances the streams)
        t0 = time.perf_counter()
        outputs: list[Pcm | None] = []
        job_tick = not any(speech.spec.live for speech, _ in tick)
        try:
            with stop_when(self._job_render_yields) if job_tick and self.job_yield.stoppable else \
                    contextlib.nullcontext():
                outputs.extend(self.vocoder.render([job for _, job in tick]))
        except RenderInterrupted:  # nothing of it was applied: its streams render the same chunk again later
            self.job_renders_stopped += 1
            log.debug("job render tick of %d streams stopped after %.0f ms for live work", len(tick),
                      (time.perf_counter() - t0) * 1e3)
            return
        except Exception:
            log.exception("batched render of %d streams failed; rendering them one by one", len(tick))
            outputs = []
            for speech, job in tick:
                try:
                    outputs.append(self.vocoder.render([job])[0])
                except Exception as exc:
                    log.exception("render of %s failed", speech.request_id)
                    self._fail(speech, f"vocoder failure: {type(exc).__name__}: {exc}")
                    outputs.append(None)
        elapsed_ms = (time.perf_counter() - t0) * 1e3
        if job_tick:
            self.job_tick_s += JOB_TICK_AVERAGING * (elapsed_ms / 1e3 - self.job_tick_s)
        audio_s = job_audio_s = 0.0
        now_s = time.monotonic()
        if debug:  # per stream: request#chunk index:tokens rendered/audio its listener holds now
            log.debug("render tick: %d streams, %.0f ms, %d threads, %s", len(tick), elapsed_ms, threads, " ".join(
                f"{speech.request_id}#{speech.chunks_emitted}:{tokens}t/{speech.buffered_s(now_s):.2f}s"
                for (speech, _), tokens in zip(tick, new_tokens, strict=True)))
        for (speech, job), pcm in zip(tick, outputs, strict=False):
            if pcm is None or speech.request_id not in self._speeches:
                continue
            audio_s += pcm.size / OUTPUT_SAMPLE_RATE_HZ
            if not speech.spec.live:
                job_audio_s += pcm.size / OUTPUT_SAMPLE_RATE_HZ
            self._deliver(speech, pcm, now_s)
            if job.final:
                self._finish(speech)
        self.ticks += 1
        with self._stats_lock:
            self._stats.ms += elapsed_ms
            self._stats.audio_s += audio_s
            self._stats.job_audio_s += job_audio_s
            self._stats.ticks += 1
            self._stats.streams += len(tick)

    def _job_render_yields(self) -> bool:
        """At a stage boundary of a job tick's render (render_checkpoints): the decode's threads go back if the decode
        waits for them; the render stops if a live turn has been submitted (`turn_pending`) or its stream has opened
        meanwhile, or a live listener holds less than JobYield.stop_below_s."""
        self.lease.give_back()
        if self._live_opened.is_set() or self.turn_pending():
            return True
        now_s, floor_s = time.monotonic(), self.job_yield.stop_below_s
        # (a stream with no chunk yet counts once its listener has reported: a turn's later segment, whose listener
        # plays the segments before it; one whose listener has not awaits first audio, handled above)
        return any(speech.spec.live and (speech.chunks_emitted or not _awaits_first_audio(speech.spec, now_s))
                   and speech.buffered_s(now_s) < floor_s for speech in self._speeches.values())

    def _deliver(self, speech: Speech, pcm: Pcm, now_s: float) -> None:
        n_tokens = pcm.size // SAMPLES_PER_SPEECH_TOKEN
        if not n_tokens:
            return
        chunk = AudioChunk(request_id=speech.request_id, seq=speech.chunks_emitted, pcm=pcm, speech_tokens=n_tokens,
                           ready_monotonic_s=now_s)
        if speech.chunks_emitted == 0:
            speech.first_chunk_s = now_s
        speech.chunks_emitted += 1
        speech.emitted_s += pcm.size / OUTPUT_SAMPLE_RATE_HZ
        self._send(speech, chunk)

    def _finish(self, speech: Speech) -> None:
        final = speech.final
        assert final is not None
        self._forget(speech.request_id)
        self._send(speech, SegmentEvent(request_id=speech.request_id, kind=EventKind.DONE,
                                        at_monotonic_s=time.monotonic(), speech_tokens=final.speech_tokens,
                                        reason=final.finish_reason))

    def _fail(self, speech: Speech, reason: str) -> None:
        self._forget(speech.request_id)
        self._send(speech, SegmentEvent(request_id=speech.request_id, kind=EventKind.FAILED,
                                        at_monotonic_s=time.monotonic(), reason=reason))

    def _send(self, speech: Speech, output: AudioChunk | SegmentEvent) -> None:
        if speech.spec.outlet.send(output) == Delivery.SINK_FAILED:
            self._forget(speech.request_id)
            self._on_sink_failed(speech.request_id)

    # --- the preparation thread --------------------------------------------------------------------------

    def _run_preparer(self) -> None:
        use_threads(PREPARER_THREADS)
        device = self.vocoder.device
        gpu.bind_thread(device)
        stream = torch.cuda.Stream(device) if device.type == "cuda" else None  # type: ignore[no-untyped-call]
        prepared_voices: dict[str, VocoderVoice] = {}  # this thread only: a voice asked for again is not redone
        while True:
            voice = self._prepare_queue.get()
            if voice is None or self._stop.is_set():
                return
            try:
                with torch.cuda.stream(stream) if stream is not None else contextlib.nullcontext():
                    prepared = prepared_voices.get(voice.key)
                    if prepared is None:
                        prepared = self.vocoder.prepare_voice(voice.s3gen_ref)
                        prepared_voices[voice.key] = prepared
                        while len(prepared_voices) > PREPARED_VOICES:
                            prepared_voices.pop(next(iter(prepared_voices)))
                    prompt = self.vocoder.prompt_cache(prepared)  # resident again if it was evicted
                if stream is not None:
                    stream.synchronize()  # the worker's stream reads the cache next
                message = _VoiceReady(voice.key, prepared, prompt)
            except Exception as exc:
                log.exception("preparing the vocoder prompt of voice %s failed", voice.voice_id)
                message = _VoiceReady(voice.key, None, error=f"{type(exc).__name__}: {exc}")
            self._inbox.put(message)
            with self._prepared:
                self._prepared_keys[voice.key] = None
                while len(self._prepared_keys) > PREPARED_VOICES:
                    self._prepared_keys.pop(next(iter(self._prepared_keys)))
                self._prepared.notify_all()
            del voice, message  # hold no voice between preparations (a removed voice is freed)


def _never() -> bool:
    return False


def _awaits_first_audio(spec: StreamOpen, now_s: float) -> bool:
    """A live segment whose listener has been sent nothing yet (no playback report; without a listener clock, any
    segment): someone waits in silence for its first chunk (time to first audio)."""
    return spec.listener is None or spec.listener.buffered_s(now_s) is None


def _used_on(stream: Any, *holders: object) -> None:
    """`record_stream` every tensor in these (dataclasses of tensors and tuples of them): the caching allocator then
    reuses a block freed later only once `stream` has passed that point."""
    for holder in holders:
        if isinstance(holder, torch.Tensor):
            holder.record_stream(stream)
        elif isinstance(holder, tuple):
            _used_on(stream, *holder)
        elif dataclasses.is_dataclass(holder) and not isinstance(holder, type):
            _used_on(stream, *(getattr(holder, f.name) for f in dataclasses.fields(holder)))
