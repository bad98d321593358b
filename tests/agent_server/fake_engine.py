"""A deterministic stand-in for `synth.Engine`: same contract (`synth.api.EngineLike`), no model.

It runs its own thread like the real engine, so the server's thread hops are exercised for real:
- audio is a pure function of (text, seed): `FakeEngine.expected_tokens` / `expected_pcm` recompute it;
- a segment yields `tokens_per_char * len(text)` speech tokens (at least one), emitted in chunks of
  `first_chunk_tokens` then `chunk_schedule_tokens` (12 / 24 / 48 by default), at `realtime_factor` pace
  (0: as fast as possible; 1.0: 25 tokens per second, like speech) after `first_chunk_delay_s`;
- `cancel` returns only once no further chunk of that request can reach the sink;
- at most `max_slots` segments generate at once, `max_waiting` more wait; beyond that (or with
  `may_wait=False` and no free slot) the sink gets a BUSY event;
- several models (models-contract.md): `loaded=("turbo", "multilingual")` loads those (the first the default), each
  with `max_slots` slots (or its own in `slots_of`); a segment's `SegmentRequest.model` picks one (None: the
  default). A model's tokens are a pure function of (model, text, seed), whatever else is loaded, so a model beside
  another speaks what it speaks alone (`expected_tokens(..., model=...)`; English's are the historical ones), and a
  voice's conditioning differs per model.
- priorities (`SegmentRequest.priority`, issue 36), minimally: waiting segments are admitted by (priority, first
  audio pending first, arrival), so a job segment never goes ahead of a live one; with `preempt_jobs` a live
  segment that finds every slot taken takes the slot of the running job segment that has emitted the least (that
  segment goes back to the head of the job queue and starts over: STARTED again, chunks from seq 0), and slots
  held by job segments count as free when a live segment asks whether it must wait;
- every submit, cancel, admission and preemption is recorded (`submits`, `cancels`, `admitted`, `preempted`).
"""

from __future__ import annotations

import enum
import hashlib
import json
import os
import queue
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np
from numpy.typing import NDArray

from synth.api import (
    OUTPUT_SAMPLE_RATE_HZ,
    SAMPLES_PER_SPEECH_TOKEN,
    AudioChunk,
    EngineConfigError,
    EngineError,
    EngineLike,
    EventKind,
    Priority,
    SegmentEvent,
    SegmentRequest,
    StepStats,
    Variant,
)

EOS_TOKEN = 6562
SPEECH_VOCAB = 6561  # valid speech token ids are < 6561
TOKENS_PER_SECOND = OUTPUT_SAMPLE_RATE_HZ / SAMPLES_PER_SPEECH_TOKEN  # 25
MIN_VOICE_CLIP_S = 5.0
IDLE_WAIT_S = 0.05
PITCHES = 512
AUTO_SLOTS = 8  # what max_slots 0 ("auto") gives in the fake
FAKE_SLOT_GB = 0.25  # the "memory" a fake slot takes (for the refusal's numbers)


def _token_waveforms() -> NDArray[Any]:
    freq_hz = 110.0 + np.arange(PITCHES, dtype=np.float64)[:, None] * 2.0
    t_s = np.arange(SAMPLES_PER_SPEECH_TOKEN, dtype=np.float64)[None, :] / OUTPUT_SAMPLE_RATE_HZ
    table = (0.5 * np.sin(2 * np.pi * freq_hz * t_s)).astype(np.float32)  # [PITCHES, 960]
    table.setflags(write=False)
    return table


_TOKEN_PCM = _token_waveforms()  # computed once: the fake must cost the server under test nothing


class FakeStatus(enum.IntEnum):
    WAITING = 0
    RUNNING = 1
    GENERATED = 2
    DONE = 10
    CANCELLED = 11


@dataclass(slots=True)
class FakeSegment:
    request: SegmentRequest
    seed: int
    tokens: list[int]  # valid speech tokens, in order
    model: Variant
    status: FakeStatus = FakeStatus.WAITING
    emitted_tokens: int = 0
    chunks_sent: int = 0
    next_due_s: float = 0.0
    started_s: float = 0.0


@dataclass
class FakeEngine(EngineLike):
    variant: Variant = "english"
    max_slots: int = 8  # per model (with several: their sum once built, as EngineLike's)
    loaded: tuple[Variant, ...] = ()  # the models (empty: `variant` alone); the first is the default
    slots_of: dict[str, int] = field(default_factory=dict)  # a model's own slot count (else max_slots)
    # the slots the fake's "memory" holds, every model's together (None: any count); more is refused at
    # construction with EngineConfigError and the numbers, as the real engine refuses what does not fit
    memory_slots: int | None = None
    max_waiting: int = 64
    tokens_per_char: float = 1.5
    first_chunk_tokens: int = 12
    chunk_schedule_tokens: tuple[int, ...] = (24, 48)
    realtime_factor: float = 0.0  # seconds of wall time per second of audio; 0 = as fast as possible
    first_chunk_delay_s: float = 0.0
    ready_delay_s: float = 0.0
    add_voice_delay_s: float = 0.0
    random_weights: bool = True
    preempt_jobs: bool = True  # a live segment takes a job segment's slot (the job segment starts over later)
    voices: set[str] = field(default_factory=lambda: {"default"})
    # a voice's "conditioning" (export_voice / import_voice): a hash of its clip, so another clip differs
    voice_blobs: dict[str, bytes] = field(default_factory=lambda: {"default": b"fake-voice:default"})

    submits: list[SegmentRequest] = field(default_factory=list)
    cancels: list[str] = field(default_factory=list)
    conditioning_computed: dict[str, int] = field(default_factory=dict)  # model -> add_voice computations
    admitted: list[str] = field(default_factory=list)  # request ids in the order they took a slot
    preempted: list[str] = field(default_factory=list)  # job segments whose slot a live one took

    def __post_init__(self) -> None:
        if self.loaded:
            self.variant = self.loaded[0]
        self._slots = {model: self.slots_of.get(model, self.max_slots) or AUTO_SLOTS for model in self.models}
        if self.memory_slots is not None and sum(self._slots.values()) > self.memory_slots:
            asked = ", ".join(f"{model} {count}" for model, count in self._slots.items())
            free_gb = self.memory_slots * FAKE_SLOT_GB
            raise EngineConfigError(f"max_slots does not fit: {asked} slots asked, {self.memory_slots} fit "
                                    f"({FAKE_SLOT_GB:.2f} GB of KV a slot, {free_gb:.2f} GB free)")
        self.max_slots = sum(self._slots.values())
        self._inbox: queue.Queue[tuple[str, object]] = queue.Queue()
        self._lock = threading.Lock()  # held while emitting; cancel takes it, so no chunk follows a cancel
        self._segments: dict[str, FakeSegment] = {}
        self._waiting: deque[FakeSegment] = deque()
        self._running: list[FakeSegment] = []
        self._cancelled: set[str] = set()
        self._thread: threading.Thread | None = None
        self._stop = threading.Event()
        self._ready = threading.Event()
        self._seed_counter = 1_000_000
        self._stats_listener: Callable[[StepStats], None] | None = None
        self.steps = 0

    # ---- deterministic audio -------------------------------------------------------------------

    @staticmethod
    def token_count(text: str, tokens_per_char: float = 1.5) -> int:
        """How many tokens a segment of `text` makes whole: known before (and without) its admission, so also for
        a segment cancelled before the engine took it."""
        return max(1, round(tokens_per_char * len(text)))

    @classmethod
    def expected_tokens(cls, text: str, seed: int, tokens_per_char: float = 1.5, model: str = "english") -> list[int]:
        """The tokens `model` speaks for `text` with `seed` (the same loaded alone or beside others)."""
        n_tokens = cls.token_count(text, tokens_per_char)
        digest = hashlib.blake2b(f"{_mix(model)}{seed}\x00{text}".encode(), digest_size=8).digest()
        rng = np.random.default_rng(int.from_bytes(digest, "little"))
        return [int(t) for t in rng.integers(0, SPEECH_VOCAB, size=n_tokens)]

    @staticmethod
    def token_pcm(token_id: int) -> NDArray[Any]:
        """960 samples of a sine whose pitch encodes the token: float32 in [-0.5, 0.5]. Read-only."""
        pcm: NDArray[np.float32] = _TOKEN_PCM[token_id % PITCHES]
        return pcm

    @classmethod
    def expected_pcm(cls, text: str, seed: int, tokens_per_char: float = 1.5, model: str = "english") -> NDArray[Any]:
        tokens = cls.expected_tokens(text, seed, tokens_per_char, model)
        return np.concatenate([cls.token_pcm(t) for t in tokens])

    def running_progress(self) -> dict[str, int]:
        """Request id -> speech tokens emitted so far, of each segment holding a slot now."""
        with self._lock:
            return {seg.request.request_id: seg.emitted_tokens for seg in self._running}

    def seed_of(self, request_id: str) -> int:
        with self._lock:
            return self._segments[request_id].seed

    # ---- EngineLike ----------------------------------------------------------------------------

    @property
    def models(self) -> tuple[Variant, ...]:
        return self.loaded or (self.variant,)

    def max_slots_of(self, model: Variant) -> int:
        return self._slots.get(model, 0)

    def _model_of(self, model: Variant | None) -> Variant:
        chosen = model or self.variant
        if chosen not in self._slots:
            raise EngineError(f"model {chosen!r} is not loaded (loaded: {', '.join(self.models)})")
        return chosen

    def _other_model(self, model: Variant | None) -> str:
        """What the fake mixes into a loaded model's tokens and conditioning."""
        return _mix(self._model_of(model))

    def submit(self, request: SegmentRequest) -> None:
        if not self.alive:
            raise EngineError("engine stopped")
        self._model_of(request.model)
        if request.voice_id not in self.voices:
            raise EngineError(f"unknown voice {request.voice_id!r}")
        try:
            request.params.validate()
        except ValueError as exc:
            raise EngineError(str(exc)) from exc
        self.submits.append(request)
        self._inbox.put(("submit", request))

    def cancel(self, request_id: str) -> None:
        with self._lock:
            self.cancels.append(request_id)
            self._cancelled.add(request_id)
        self._inbox.put(("cancel", request_id))

    def voice_ids(self) -> list[str]:
        return sorted(self.voices)

    def add_voice(self, voice_id: str, wav: NDArray[Any], sample_rate_hz: int) -> None:
        if len(wav) < MIN_VOICE_CLIP_S * sample_rate_hz:
            raise EngineError(f"reference clip too short: need at least {MIN_VOICE_CLIP_S:g} s")
        if self.add_voice_delay_s:
            time.sleep(self.add_voice_delay_s)
        digest = hashlib.sha256(np.asarray(wav, np.float32).tobytes()).digest()
        for model in self.models:  # every loaded model its own conditioning, once
            self.voice_blobs[self._blob_key(voice_id, model)] = b"fake-voice:" + self._other_model(model).encode() \
                + digest
            self.conditioning_computed[model] = self.conditioning_computed.get(model, 0) + 1
        self.voices.add(voice_id)

    def _blob_key(self, voice_id: str, model: Variant | None) -> str:
        other = self._other_model(model)
        return f"{voice_id}@{other}" if other else voice_id

    def remove_voice(self, voice_id: str) -> None:
        self.voices.discard(voice_id)
        for model in self.models:
            self.voice_blobs.pop(self._blob_key(voice_id, model), None)

    def export_voice(self, voice_id: str, model: Variant | None = None) -> bytes:
        if voice_id not in self.voices:
            raise EngineError(f"unknown voice {voice_id!r}")
        fallback = b"fake-voice:" + self._other_model(model).encode() + voice_id.encode()
        return self.voice_blobs.get(self._blob_key(voice_id, model), fallback)

    def import_voice(self, voice_id: str, conditioning: bytes, model: Variant | None = None) -> None:
        if not conditioning.startswith(b"fake-voice:"):
            raise EngineError("not a fake voice blob")
        self.voice_blobs[self._blob_key(voice_id, model)] = conditioning
        self.voices.add(voice_id)

    def status(self) -> dict[str, object]:
        with self._lock:
            per_model = {model: {
                "variant": model,
                "random_weights": self.random_weights,
                "weights_source": "fake",
                "dtype": "float32",
                "max_slots": slots,
                "slots_in_use": sum(1 for seg in self._running if seg.model == model),
                "waiting": sum(1 for seg in self._waiting if seg.model == model),
            } for model, slots in self._slots.items()}
            return {
                "variant": self.variant,
                "random_weights": self.random_weights,
                "weights_source": "fake",
                "device": "cpu",
                "dtype": "float32",
                "max_slots": self.max_slots,
                "slots_in_use": len(self._running),
                "waiting": len(self._waiting),
                "steps": self.steps,
                "models": per_model,
            }

    def set_stats_listener(self, listener: Callable[[StepStats], None] | None) -> None:
        self._stats_listener = listener

    def start(self) -> None:
        if self._thread is not None:
            return
        self._thread = threading.Thread(target=self._run, name="fake-engine", daemon=True)
        self._thread.start()

    def stop(self, timeout_s: float = 5.0) -> None:
        self._stop.set()
        self._inbox.put(("wake", None))
        if self._thread is not None:
            self._thread.join(timeout_s)

    @property
    def ready(self) -> bool:
        return self._ready.is_set() and self.alive

    @property
    def alive(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    # ---- the engine thread ---------------------------------------------------------------------

    def _run(self) -> None:
        if self.ready_delay_s:
            time.sleep(self.ready_delay_s)
        self._ready.set()
        while not self._stop.is_set():
            self._drain_inbox(timeout_s=self._next_wait_s())
            self._admit()
            self._emit_due()
            self.steps += 1
        for seg in list(self._running) + list(self._waiting):
            self._finish(seg, EventKind.CANCELLED, reason="shutdown")

    def _next_wait_s(self) -> float:
        if not self._running:
            return IDLE_WAIT_S
        soonest_s = min(seg.next_due_s for seg in self._running)
        return max(0.0, soonest_s - time.monotonic())

    def _drain_inbox(self, timeout_s: float) -> None:
        try:
            item = self._inbox.get(timeout=timeout_s) if timeout_s > 0 else self._inbox.get_nowait()
        except queue.Empty:
            return
        while True:
            self._handle(*item)
            try:
                item = self._inbox.get_nowait()
            except queue.Empty:
                return

    def _handle(self, kind: str, payload: object) -> None:
        if kind == "submit":
            assert isinstance(payload, SegmentRequest)
            self._accept(payload)
        elif kind == "cancel":
            assert isinstance(payload, str)
            seg = self._segments.get(payload)
            if seg is not None and seg.status < FakeStatus.DONE:
                if seg in self._waiting:
                    self._waiting.remove(seg)
                if seg in self._running:
                    self._running.remove(seg)
                self._finish(seg, EventKind.CANCELLED, reason="cancelled")

    def _accept(self, request: SegmentRequest) -> None:
        seed = request.params.seed
        if seed is None:
            self._seed_counter += 1
            seed = self._seed_counter
        model = self._model_of(request.model)
        tokens = self.expected_tokens(request.text, seed, self.tokens_per_char, model)
        seg = FakeSegment(request, seed, tokens, model)
        with self._lock:
            self._segments[request.request_id] = seg
        free = self._has_room(request, model)
        if request.request_id in self._cancelled:
            self._finish(seg, EventKind.CANCELLED, reason="cancelled")
        elif not free and (not request.may_wait or len(self._waiting) >= self.max_waiting):
            self._finish(seg, EventKind.BUSY, reason="no free slot")
        else:
            self._waiting.append(seg)

    def _has_room(self, request: SegmentRequest, model: Variant) -> bool:
        """Whether `request` finds a slot of its model: a free one, or (a live segment, with `preempt_jobs`) one a
        job segment of that model holds."""
        taken = [seg for seg in self._running if seg.model == model]
        if self.preempt_jobs and request.priority == Priority.LIVE:
            taken = [seg for seg in taken if seg.request.priority == Priority.LIVE]
        return len(taken) < self._slots[model]

    def _free_slot(self, model: Variant) -> bool:
        return sum(1 for seg in self._running if seg.model == model) < self._slots[model]

    @staticmethod
    def _admission_order(seg: FakeSegment) -> tuple[int, bool]:
        # live before jobs; within a priority, segments whose session has heard nothing yet go first (that is TTFB)
        return int(seg.request.priority), not seg.request.first_audio_pending

    def _admit(self) -> None:
        # each model in its own slots; a job never goes ahead of a live segment of its model (that one has room
        # whenever the job does)
        while True:
            admissible = [s for s in self._waiting if self._has_room(s.request, s.model)]
            if not admissible:
                return
            seg = min(admissible, key=self._admission_order)  # (min: the first of the best, in arrival order)
            if not self._free_slot(seg.model):
                self._preempt_for(seg)
            self._waiting.remove(seg)
            now_s = time.monotonic()
            seg.status = FakeStatus.RUNNING
            seg.started_s = now_s
            seg.next_due_s = now_s + self.first_chunk_delay_s + self._pace_s(self._chunk_tokens(seg))
            self._running.append(seg)
            self.admitted.append(seg.request.request_id)
            self._deliver(seg, SegmentEvent(seg.request.request_id, EventKind.STARTED, now_s))

    def _preempt_for(self, seg: FakeSegment) -> bool:
        """Free a slot for a live `seg` by sending the job segment that has emitted the least back to the head of
        the job queue (it starts over when admitted again). False: nothing to preempt."""
        if not self.preempt_jobs or seg.request.priority != Priority.LIVE:
            return False
        jobs = [s for s in self._running if s.request.priority == Priority.JOB and s.model == seg.model]
        if not jobs:
            return False
        victim = min(jobs, key=lambda s: s.emitted_tokens)
        self._running.remove(victim)
        victim.status = FakeStatus.WAITING
        victim.emitted_tokens = victim.chunks_sent = 0
        self._waiting.appendleft(victim)
        self.preempted.append(victim.request.request_id)
        return True

    def _chunk_tokens(self, seg: FakeSegment) -> int:
        if seg.chunks_sent == 0:
            size = self.first_chunk_tokens
        else:
            schedule = self.chunk_schedule_tokens
            size = schedule[min(seg.chunks_sent - 1, len(schedule) - 1)]
        return min(size, len(seg.tokens) - seg.emitted_tokens)

    def _pace_s(self, n_tokens: int) -> float:
        return self.realtime_factor * n_tokens / TOKENS_PER_SECOND

    def _emit_due(self) -> None:
        now_s = time.monotonic()
        for seg in list(self._running):
            if seg.next_due_s > now_s:
                continue
            n_tokens = self._chunk_tokens(seg)
            tokens = seg.tokens[seg.emitted_tokens : seg.emitted_tokens + n_tokens]
            last = seg.emitted_tokens + n_tokens >= len(seg.tokens)
            rid = seg.request.request_id
            if last:
                # T3 is done: the slot frees now, the last audio follows (as in the real engine)
                self._running.remove(seg)
                seg.status = FakeStatus.GENERATED
                self._deliver(
                    seg,
                    SegmentEvent(
                        rid,
                        EventKind.GENERATED,
                        time.monotonic(),
                        speech_tokens=len(seg.tokens),
                        token_ids=(*tuple(seg.tokens), EOS_TOKEN),
                        reason="eos",
                    ),
                )
            pcm = np.concatenate([self.token_pcm(t) for t in tokens])
            with self._lock:
                if rid in self._cancelled:
                    continue
                seg.request.sink(AudioChunk(rid, seg.chunks_sent, pcm, n_tokens, time.monotonic()))
            seg.emitted_tokens += n_tokens
            seg.chunks_sent += 1
            if last:
                self._finish(seg, EventKind.DONE, reason="eos")
            else:
                seg.next_due_s = now_s + self._pace_s(self._chunk_tokens(seg))

    def _deliver(self, seg: FakeSegment, event: SegmentEvent) -> None:
        with self._lock:
            if seg.request.request_id in self._cancelled and event.kind < EventKind.DONE:
                return
            seg.request.sink(event)

    def _finish(self, seg: FakeSegment, kind: EventKind, reason: str) -> None:
        seg.status = FakeStatus.CANCELLED if kind != EventKind.DONE else FakeStatus.DONE
        tokens = len(seg.tokens) if kind == EventKind.DONE else seg.emitted_tokens
        event = SegmentEvent(seg.request.request_id, kind, time.monotonic(), speech_tokens=tokens, reason=reason)
        with self._lock:
            seg.request.sink(event)


def _mix(model: str) -> str:
    """What the fake mixes into a model's tokens and conditioning: English's are the historical ones (nothing)."""
    return "" if model == "english" else model


def make_engine(settings: object, engine_class: type[FakeEngine] = FakeEngine) -> FakeEngine:
    """Engine factory for `AGENT_SERVER_ENGINE_FACTORY=tests.agent_server.fake_engine:make_engine`
    (the load test's server).

    Options come from the JSON object in FAKE_ENGINE_OPTIONS (field names of FakeEngine).
    """
    options = json.loads(os.environ.get("FAKE_ENGINE_OPTIONS", "{}"))
    if "chunk_schedule_tokens" in options:
        options["chunk_schedule_tokens"] = tuple(options["chunk_schedule_tokens"])
    options.setdefault("variant", getattr(settings, "variant", "english"))
    models = getattr(settings, "models", ())
    if len(models) > 1:
        options.setdefault("loaded", tuple(models))
    slots = getattr(settings, "max_slots", None)
    for model, count in getattr(slots, "overrides", ()):  # --max-slots turbo=N: that model's own count
        options.setdefault("slots_of", {})[model] = count
    return engine_class(**options)
