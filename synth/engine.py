"""The engine: one thread owns the models and runs THE step loop over every live segment.

Callers (any thread) talk to it through `submit` / `cancel` (a queue) and hear back through each
request's sink (called on this thread; sinks must not block). Each iteration:

    drain inbox -> schedule -> runner.execute(plan) (prefill + one batched decode + sampling, launched)
    -> read the ids of the step before or of this one (the one host sync) -> apply cancels that landed meanwhile
    -> update -> hand new speech tokens to the vocoder worker -> stats

A live turn's first segment submitted while a step of job rows only runs (`StepPlan.jobs_only`) sets `turn_arrived`;
on a CPU the runner stops that step at its next layer and the scheduler withdraws it (Scheduler.withdraw), so the
turn is admitted at once instead of after the whole job step.

This file imports no torch (tests/test_layering.py): the runner (synth/t3_runner.py) owns the tensors behind
`execute(plan) -> StepOutput`, the scheduler (synth/scheduler.py) the per-row counters as numpy arrays, so a step's
host work is a fixed number of operations whatever the rows; Python runs per segment only for its admission, first
id and end. A decoding row feeds the id sampled for it at the step before from the device, so with overlapped steps
(`overlap_steps`, on by default with CUDA graphs) step k+1 is launched before step k's ids are read, and the host's
reading, stop checks and vocoder hand-off of step k run while the device computes step k+1 (vLLM's async
scheduling). A segment that ended at step k has also been stepped at k+1; that id is dropped.

CUDA graphs (decode step and sampling, per bucket) are captured at start-up once the warm-up threads are idle, in
thread-local capture mode, and each replay is checked against the eager step before any traffic. With
`cuda_graphs="auto"` a capture that fails or a replay that differs means eager, with the reason in the log, in
`status()` and so in /v1/status and the metrics; with "on" the engine refuses to start, naming it. The vocoder's
graphs get the same treatment (`vocoder_graphs`, "auto" / "on" / "off").

The vocoder renders on its own thread (synth/vocoder_worker.py), batched over every stream due, and emits the
audio itself; each request's output goes through its Outlet (synth/outlet.py), whichever thread sends it.
"""

from __future__ import annotations

import contextlib
import logging
import os
import queue
import random
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any

from synth import alignment, gpu
from synth.api import (
    HARD_MAX_NEW_TOKENS,
    MAX_SEGMENT_TEXT_TOKENS,
    EngineConfig,
    EngineConfigError,
    EngineError,
    EngineFull,
    EngineLike,
    EngineOutput,
    EventKind,
    SamplingParams,
    SegmentEvent,
    SegmentRequest,
    StepStats,
    ThreadBudget,
    Variant,
    max_tokens_for_text,
)
from synth.build import EngineParts
from synth.cpu_threads import CoreLease, available_cores, release_openmp_pool, use_threads
from synth.loading import ModelBundle
from synth.outlet import Delivery, EmitLock, Outlet
from synth.request import SPEECH_VOCAB_SIZE, SegmentState, Status
from synth.scheduler import Scheduler, SchedulerConfig, StepOutput, StepPlan, StepUpdate
from synth.text import text_token_ids
from synth.vocoder_worker import ChunkPolicy, Feed, StreamOpen, TokenRun, VocoderWorker
from synth.voices import Voice, VoiceRegistry, make_voice, voice_from_bytes, voice_to_bytes

if TYPE_CHECKING:
    from synth.t3_runner import T3Runner

log = logging.getLogger(__name__)

IDLE_WAIT_S = 0.05
VOICE_PREPARATION_TIMEOUT_S = 600.0  # start-up: built-in voices' vocoder prompts (English, CPU: ~10 s each)
KV_LEN_MULTIPLE = 64
WARMUP_REQUEST_ID = "engine-warmup"
WARMUP_TEXT = "Warming up."
WARMUP_TOKENS = 8  # enough for a prefill, several decode steps and a vocoder render
WARMUP_TIMEOUT_S = 600.0
PERCEIVER_POSITIONS = 32  # the Perceiver squeezes the speech prompt to 32 positions
GRAPH_MODES = ("auto", "on", "off")
# on a CPU, job rows decode beside a live segment only while its listener holds this much audio (the vocoder's job
# renders wait for at least as much: JobYield.live_margin_s)
LIVE_HELD_FOR_JOB_ROWS_S = 1.0
DUPLICATE_REQUEST_ID = "duplicate request_id"


def conditioning_positions(hp: Any, prompt_tokens: int | None = None) -> int:
    """Length of the T3 conditioning prefix: [speaker][prompt (or its Perceiver summary)][emotion], for a voice
    prompt of `prompt_tokens` speech tokens (None: the longest, the model's own prompt length)."""
    if prompt_tokens is None:
        prompt_tokens = hp.speech_cond_prompt_len
    prompt = (PERCEIVER_POSITIONS if hp.use_perceiver_resampler else prompt_tokens) if prompt_tokens else 0
    return 1 + prompt + (1 if hp.emotion_adv else 0)


def _round_up(value: int, multiple: int) -> int:
    return -(-value // multiple) * multiple


@dataclass(slots=True)
class GraphState:
    """One part's CUDA graphs (the decode step, the vocoder) as the status reports them."""

    mode: str  # as configured: auto | on | off
    state: str = "off"  # on (captured, replay == eager) | off | fallback (eager after a failure)
    reason: str = ""  # why off or fallback
    graphs: int = 0
    capture_s: float = 0.0
    pool_mb: float = 0.0
    parity: str = ""  # decode: "bitwise" or "within tolerance" (synth/t3_runner.PARITY_TOLERANCE)


@dataclass(frozen=True, slots=True)
class _Cancel:
    request_id: str


@dataclass(frozen=True, slots=True, eq=False)
class _PrepareVoice:
    """Precompute a new voice's T3 prefix on the engine thread when it is added rather than on its first
    request (its vocoder prompt is prepared by the vocoder worker's preparation thread)."""

    voice: Voice



class Engine(EngineLike):
    def __init__(self, bundle: ModelBundle, config: EngineConfig, *, render_audio: bool = True,
                 runner_factory: Callable[..., Any] | None = None) -> None:
        """`runner_factory`: builds the runner instead of synth.t3_runner.T3Runner, with its arguments (the
        engine's part of it: `execute`, `release`, `prefix_for`, the graph calls and the sizes; synth/null_runner.py
        has no model, for measuring the host's share of a step)."""
        self.bundle = bundle
        self.config = config
        if config.alignment_analyzer and bundle.variant != "multilingual":
            raise EngineError("alignment_analyzer is for the multilingual model only (as in chatterbox)")
        for name in ("cuda_graphs", "vocoder_graphs"):
            if getattr(config, name) not in GRAPH_MODES:
                raise EngineError(f"{name} must be 'auto', 'on' or 'off', not {getattr(config, name)!r}")
            if getattr(config, name) == "on" and bundle.device.type != "cuda":
                raise EngineError(f"{name}='on' needs a CUDA device")
        if config.overlap_steps not in GRAPH_MODES:
            raise EngineError(f"overlap_steps must be 'auto', 'on' or 'off', not {config.overlap_steps!r}")
        self.variant = bundle.variant
        self.random_weights = bundle.random_weights
        self.device = bundle.device
        self.is_llama = self.variant != "turbo"
        self.rows_per_slot = 2 if self.is_llama else 1
        self.prefix_positions = conditioning_positions(bundle.t3.hp)
        # a row holds its copy of the voice prefix, then text, the BOS block, speech, and one scratch position
        after_prefix = config.max_context_tokens or MAX_SEGMENT_TEXT_TOKENS + 2 + HARD_MAX_NEW_TOKENS + 1
        max_len = _round_up(self.prefix_positions + after_prefix, KV_LEN_MULTIPLE)
        try:
            parts = EngineParts.resolve(bundle, config, render_audio=render_audio)
        except ValueError as exc:
            raise EngineError(str(exc)) from exc
        self.vocoder: Any = parts.build_vocoder() if render_audio else None  # synth.vocoder.StreamingVocoder
        try:
            self.slot_plan = parts.plan_slots(max_len, self.rows_per_slot, self.prefix_positions, self.vocoder)
        except gpu.SlotsDoNotFit as exc:
            raise EngineConfigError(str(exc)) from exc
        self.max_slots = self.slot_plan.slots if self.slot_plan is not None else config.max_slots
        if self.slot_plan is not None:
            log.info("%s", self.slot_plan.describe())
        max_rows = self.max_slots * self.rows_per_slot
        self.graphs = GraphState(config.cuda_graphs)
        self.vocoder_graphs = GraphState(config.vocoder_graphs)
        self.runner: T3Runner = (runner_factory or parts.build_runner)(
            bundle.t3, max_rows=max_rows, max_len=max_len, device=self.device, dtype=parts.dtype,
            bf16_weights=parts.bf16_weights, cuda_graphs=parts.decode_graphs, compact_steps=config.compact_steps)
        self.vocoder_tf32 = parts.vocoder_tf32
        self._vocoder_max_batch = parts.vocoder_max_batch()
        # text tokens one segment may have: its row keeps room for the BOS block and at least one speech token
        self.max_text_positions = self.runner.usable_len - self.prefix_positions - 4
        if self.is_llama:  # the learned text positions end somewhere too
            self.max_text_positions = min(self.max_text_positions, bundle.t3.text_pos_emb.emb.num_embeddings)
        if config.alignment_analyzer:
            missing = alignment.missing_heads(self.runner.n_layers, self.runner.n_heads)
            if missing:
                raise EngineError(f"this T3 ({self.runner.n_layers} layers x {self.runner.n_heads} heads) lacks the "
                                  f"alignment analyzer's (layer, head) pairs {missing}: it needs the full-size "
                                  "multilingual model (a checkpoint or --weights random-full)")
            self.runner.use_analyzer()
        # valid ids a turn's first audio waits for: the first chunk's, and with a vocoder the ones its render looks
        # ahead at and holds back for the crossfade (StreamingVocoder.latency_tokens: 12 + 7 by default)
        self.first_audio_ids = config.first_chunk_tokens + (self.vocoder.latency_tokens if self.vocoder else 0)
        self.scheduler = Scheduler(SchedulerConfig(
            max_slots=self.max_slots, max_rows=max_rows, max_waiting=config.max_waiting,
            prefill_budget=config.prefill_budget_segments, usable_len=self.runner.usable_len,
            eos_token=bundle.t3.hp.stop_speech_token, first_token_may_be_eos=not self.is_llama,
            track_states=config.alignment_analyzer,
            # on a CPU a job row slows every step of a live turn's first chunk, and of a live segment whose listener
            # runs short; on a GPU it is nearly free
            pause_jobs_below_ids=self.first_audio_ids if self.runner.compact_rows else 0,
            pause_jobs_below_held_s=LIVE_HELD_FOR_JOB_ROWS_S if self.runner.compact_rows else 0.0),
            on_release=self.runner.release)
        # step k+1 launched before step k's ids are read: "auto" with the decode's CUDA graphs (a step is then a few
        # launches the device runs while the host reads the step before; eager, the launches are the step, and a
        # probe of the eager sampler would see the step launched after a segment's end), never with the alignment
        # analyzer (its edit of step k+1 reads step k's id on the host)
        self.overlap_steps = not config.alignment_analyzer and (
            config.overlap_steps == "on" or (config.overlap_steps == "auto" and parts.decode_graphs))
        self.threads = ThreadBudget.resolve(config.decode_threads, config.vocoder_threads, available_cores())
        # the decode's threads lent to the vocoder's urgent ticks (CPU only: on a GPU the threads only launch)
        self.lease = CoreLease(self.threads.decode, self.threads.vocoder,
                               enabled=config.lend_threads and self.device.type == "cpu" and render_audio,
                               decode_borrows=config.decode_borrows_threads)
        self.vocoder_worker: VocoderWorker | None = None
        if self.vocoder is not None:
            self.vocoder_worker = self._build_worker()
        self.voices = VoiceRegistry()
        # bounded at submit (EngineFull past max_inbox_items): cancels and voice preparations always get in, so a
        # full inbox never blocks the event loop's cancel nor the engine thread's own put
        self._inbox: queue.Queue[SegmentState | _Cancel | _PrepareVoice] = queue.Queue()
        self.max_inbox_items = self.max_slots + config.max_waiting
        self._live: dict[str, SegmentState] = {}  # request_id -> state while T3 owns it, engine thread only
        self._in_flight: StepOutput | None = None  # a launched step whose ids are not read yet (overlap_steps)
        # a live turn's first segment is in the inbox since the last drain: a jobs-only step stops at its next layer
        # (several models share one: synth/models.py)
        self.turn_arrived = threading.Event()
        # a live turn's first segment is queued or decodes before its first valid id (engine thread, per step:
        # `note_turn`); with `turn_arrived`, what holds the vocoder's job renders back (`turn_pending`)
        self.turn_in_t3 = False
        self.turn_group: list[Engine] = [self]  # the engines whose turns count (several models: all of them)
        self._emit_lock = EmitLock()  # every outlet sends under it; it also guards _outlets
        self._outlets: dict[str, Outlet] = {}  # request_id -> outlet until its terminal event
        self._stats_listener: Callable[[StepStats], None] | None = None
        self._thread: threading.Thread | None = None
        self._stop = threading.Event()
        self._ready = threading.Event()
        self._dead = threading.Event()
        self._seed_source = random.Random(config.seed) if config.seed is not None else None
        self.steps = 0
        self.failure: str = ""

    # --- public API (any thread) -------------------------------------------------------------------------

    def submit(self, request: SegmentRequest) -> None:
        if self._dead.is_set() or self._stop.is_set():
            raise EngineError("engine is not running")
        self.check_model(request.model)
        if self._inbox.qsize() >= self.max_inbox_items:
            raise EngineFull(f"the engine's inbox is full ({self.max_inbox_items} items): try again later")
        outlet = Outlet(request.request_id, request.sink, self._emit_lock, self._outlets)
        state = self._new_state(request, outlet)
        with self._emit_lock:
            duplicate = request.request_id in self._outlets
            if not duplicate:
                self._outlets[request.request_id] = outlet
        if duplicate:  # the live request keeps the id; this one fails alone
            self._emit(state, self._event(state, EventKind.FAILED, reason=DUPLICATE_REQUEST_ID))
            return
        self._inbox.put(state)
        if state.is_live and request.first_audio_pending:
            self.turn_arrived.set()  # after the put: the drain that clears it sees the segment

    def cancel(self, request_id: str) -> None:
        with self._emit_lock:
            outlet = self._outlets.get(request_id)
        if outlet is not None:
            outlet.cancel()  # from here on nothing of it goes out but the CANCELLED event
        self._inbox.put(_Cancel(request_id))
        if self.vocoder_worker is not None:
            self.vocoder_worker.cancel(request_id)  # its pending renders are dropped at the worker's next drain

    def has_request(self, request_id: str) -> bool:
        """The id is taken: a request of it has not had its terminal event yet."""
        with self._emit_lock:
            return request_id in self._outlets

    @property
    def has_inbox_items(self) -> bool:
        return not self._inbox.empty()

    @staticmethod
    def duplicate_event(request_id: str) -> SegmentEvent:
        return SegmentEvent(request_id=request_id, kind=EventKind.FAILED, at_monotonic_s=time.monotonic(),
                            reason=DUPLICATE_REQUEST_ID)

    def voice_ids(self) -> list[str]:
        return self.voices.ids()

    def add_voice(self, voice_id: str, wav: Any, sample_rate_hz: int) -> None:
        """Runs the voice encoders on the calling thread (a server's worker thread), then releases that
        thread's OpenMP pool so it does not slow the engine's steps (synth/cpu_threads.py)."""
        try:
            voice = make_voice(self.bundle, voice_id, wav, sample_rate_hz)
        finally:
            self._release_caller_cpu()
        self._register_voice(voice)

    def remove_voice(self, voice_id: str) -> None:
        self.voices.remove(voice_id)

    def export_voice(self, voice_id: str, model: Variant | None = None) -> bytes:
        self.check_model(model)
        return voice_to_bytes(self.voices.get(voice_id))

    def import_voice(self, voice_id: str, conditioning: bytes, model: Variant | None = None) -> None:
        self.check_model(model)
        self._register_voice(voice_from_bytes(voice_id, conditioning, self.device))

    def check_model(self, model: Variant | None) -> None:
        """EngineError for a model this engine has not loaded (None: the default, always loaded)."""
        if model is not None and model not in self.models:
            raise EngineError(f"model {model!r} is not loaded; loaded: {', '.join(self.models)}")

    def _register_voice(self, voice: Voice) -> None:
        """Serve `voice` from now on; its T3 prefix and vocoder prompt are prepared ahead of its first request."""
        self.voices.add(voice)
        self._inbox.put(_PrepareVoice(voice))
        if self.vocoder_worker is not None:
            self.vocoder_worker.prepare_voice(voice)  # off the decode thread and off the render thread

    def set_stats_listener(self, listener: Callable[[StepStats], None] | None) -> None:
        self._stats_listener = listener

    def status(self) -> dict[str, object]:
        vgraphs = self.vocoder.graphs if self.vocoder is not None else None
        return {
            "variant": self.variant, "random_weights": self.random_weights, "weights_source": self.bundle.source,
            "preset": self.bundle.size, "device": str(self.device), "dtype": self.config.dtype,
            "cpu_weights": self.config.cpu_weights, "cpu_vocoder": self.config.cpu_vocoder,
            "decode_attention": "shared-prefix" if self.runner.shared_prefix_attention else "torch",
            "cuda_graphs": self.graphs.mode, "cuda_graphs_state": self.graphs.state,
            "cuda_graphs_reason": self.graphs.reason, "cuda_graphs_count": self.graphs.graphs,
            "cuda_graphs_capture_s": round(self.graphs.capture_s, 3), "cuda_graphs_pool_mb": self.graphs.pool_mb,
            "cuda_graphs_parity": self.graphs.parity,
            "key_buckets": len(self.runner.key_buckets), "row_buckets": len(self.runner.row_buckets),
            "overlap_steps": self.overlap_steps,
            "vocoder_graphs": self.config.vocoder_graphs, "vocoder_graphs_state": self.vocoder_graphs.state,
            "vocoder_graphs_reason": self.vocoder_graphs.reason,
            "vocoder_graphs_captured": vgraphs.captured if vgraphs is not None else 0,
            "vocoder_graphs_failed": vgraphs.failed if vgraphs is not None else 0,
            "vocoder_graphs_mismatched": vgraphs.mismatched if vgraphs is not None else 0,
            "vocoder_tf32": self.vocoder_tf32,
            "max_slots": self.max_slots, "max_slots_auto": self.config.max_slots == 0,
            "slots_in_use": len(self.scheduler.running),
            "waiting": self.scheduler.n_waiting, "preemptions": self.scheduler.preemptions,
            "job_rows_paused": self.scheduler.job_rows_paused,
            "job_steps_withdrawn": self.scheduler.job_steps_withdrawn, "steps": self.steps,
            "ready": self.ready, "alive": self.alive,
            "failure": self.failure, "decode_threads": self.threads.decode, "vocoder_threads": self.threads.vocoder,
            "vocoder_ticks": self.vocoder_worker.ticks if self.vocoder_worker is not None else 0,
            "lend_threads": self.lease.enabled, "lent_ticks": self.lease.lent_ticks,
            "decode_waits_for_lent_ticks": self.lease.decode_waits,
            "decode_borrows_threads": self.lease.decode_borrows, "borrowed_steps": self.lease.borrowed_steps,
            "render_waits_for_borrowed_steps": self.lease.render_waits,
            "lent_ticks_beside_a_decode_team": self.lease.team_wait_timeouts,
            "borrow_gain_ms": self.lease.gain.estimates(),
            "models": {self.variant: self.model_status()},
        }

    def model_status(self) -> dict[str, object]:
        """This model's part of `status()["models"]`."""
        return {
            "max_slots": self.max_slots, "max_slots_auto": self.config.max_slots == 0,
            "slots_in_use": len(self.scheduler.running), "waiting": self.scheduler.n_waiting,
            "preemptions": self.scheduler.preemptions, "job_rows_paused": self.scheduler.job_rows_paused,
            "job_steps_withdrawn": self.scheduler.job_steps_withdrawn, "weights_source": self.bundle.source,
            "random_weights": self.random_weights, "preset": self.bundle.size, "dtype": self.config.dtype,
            "cuda_graphs_state": self.graphs.state, "vocoder_graphs_state": self.vocoder_graphs.state,
        }

    @property
    def ready(self) -> bool:
        return self._ready.is_set() and not self._dead.is_set()

    @property
    def alive(self) -> bool:
        return not self._dead.is_set() and not (self.vocoder_worker is not None and self.vocoder_worker.failure)

    def start(self) -> None:
        if self._thread is not None:
            return
        self._release_caller_cpu()  # the starting thread (it built the engine) hands the CPU over
        if self.vocoder_worker is not None:
            self.vocoder_worker.start()
        self._thread = threading.Thread(target=self._run, name="synth-engine", daemon=True)
        self._thread.start()

    def _release_caller_cpu(self) -> None:
        if self.device.type == "cpu":
            release_openmp_pool()

    def stop(self, timeout_s: float = 5.0) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout_s)
        if self.vocoder_worker is not None:
            self.vocoder_worker.stop(timeout_s)

    def wait_ready(self, timeout_s: float) -> bool:
        return wait_until_ready(self._ready, self._dead, timeout_s)

    # --- the thread --------------------------------------------------------------------------------------

    def _run(self) -> None:
        try:
            self.runner.bind_thread()  # cuda:N on this thread, no gradients (in the try: a failure is reported)
            use_threads(self.threads.decode)  # this thread's OpenMP team (synth/cpu_threads.py)
            self._warmup()
            self._ready.set()
            while not self._stop.is_set():
                self._step()
            self._fail_all(Status.CANCELLED, "shutdown")
        except Exception as exc:
            log.exception("engine thread died")
            self.failure = f"{type(exc).__name__}: {exc}"
            self._dead.set()
            self._fail_all(Status.FAILED, f"engine failure: {self.failure}")

    def _step(self) -> None:
        idle = self.idle
        if idle:
            self.lease.decode_idle()  # the vocoder may borrow this thread's cores meanwhile
        self._drain_inbox(block=idle)
        self.note_turn()
        self._step_batch(self.scheduler.schedule)

    def turn_pending(self) -> bool:
        """A live turn's first segment is on its way to the vocoder (any thread): submitted and not drained yet, or
        queued, or decoding before its first valid id, in this engine or another of its group. The vocoder worker
        holds job renders back meanwhile (JobYield), so that the turn's prefill and first ids may borrow its idle
        threads; from its first valid id on, its open stream holds them back."""
        return self.turn_arrived.is_set() or any(engine.turn_in_t3 for engine in self.turn_group)

    def note_turn(self) -> None:
        """After a drain (the turn's segment is in the scheduler now) and after each step's hand-off (its stream is
        with the vocoder now)."""
        self.turn_in_t3 = self.scheduler.turn_pending()

    @property
    def idle(self) -> bool:
        """Nothing waits, runs or is in flight (the inbox aside)."""
        return self.scheduler.idle and self._in_flight is None

    def _step_batch(self, schedule: Callable[[], StepPlan]) -> None:
        """This model's batch of one iteration: `schedule` gives the plan (the scheduler's own admissions, or with
        several models `Scheduler.plan` after their shared admissions: synth/models.py), then launch, read, update,
        hand to the vocoder, record."""
        idle = self.idle
        rows = max(1, len(self.scheduler.running))  # a step that only prefills borrows as a one-row step would
        with self.lease.decode_step(rows) if not idle else contextlib.nullcontext() as leased:
            plan = schedule()
            t0 = time.perf_counter()
            done = self._launch(plan)
            if done is not None and done.interrupted:  # a live turn arrived: its rows decode that step again later
                self.scheduler.withdraw(done.plan)
                self._record(done.plan, 0.0, done.prefill_ms, withdrawn=True)
                self.note_turn()
                return
            result = done.result() if done is not None else None  # the one host sync
            t1 = time.perf_counter()
            if leased is not None and plan.decode_rows.size:
                leased.decode_ms = (t1 - t0) * 1e3 - (done.prefill_ms if done is not None else 0.0)
        self._drain_inbox(block=False, cancels_only=True)  # aborts that landed mid-step
        if done is None and self._in_flight is None:  # no step: what the vocoder rendered meanwhile still counts,
            self._record_renders(plan.job_rows_paused)  # and the job rows that sat out (another model's live turn)
        if done is None or result is None:
            return
        update = self.scheduler.update(done.plan, result)
        self._after_update(update)
        self._hand_to_vocoder(update)  # the worker renders them while the next steps decode
        self.note_turn()
        self._record(done.plan, (t1 - t0) * 1e3 - done.prefill_ms, done.prefill_ms)

    def _launch(self, plan: StepPlan) -> StepOutput | None:
        """Launch this step; returns the step whose ids are read now: this one, or with overlapped steps the one
        launched before it (this one is read at the next iteration)."""
        now = time.monotonic()
        for state in plan.prefill:
            state.admitted_s = now
        # a jobs-only step may stop for a live turn (not with overlapped steps: the step read now is the one before)
        interrupt = self.turn_arrived.is_set if plan.jobs_only and not self.overlap_steps else None
        launched = self.runner.execute(plan, interrupt) if not plan.is_empty else None
        if not self.overlap_steps:
            return launched
        done, self._in_flight = self._in_flight, launched
        return done

    # --- inbox -------------------------------------------------------------------------------------------

    def _drain_inbox(self, block: bool, cancels_only: bool = False, clear_turn: bool = True) -> None:
        """Admit what was submitted, apply cancels (`cancels_only`: only those, the rest waits for the next full
        drain). A full drain clears `turn_arrived` first (`clear_turn`: unless the caller cleared it for several
        models' drains)."""
        if clear_turn and not cancels_only:
            self.turn_arrived.clear()
        deferred: list[SegmentState | _PrepareVoice] = []
        try:
            item = self._inbox.get(timeout=IDLE_WAIT_S) if block else self._inbox.get_nowait()
            while True:
                if isinstance(item, _Cancel):
                    self._apply_cancel(item.request_id)
                elif cancels_only:
                    deferred.append(item)
                elif isinstance(item, _PrepareVoice):
                    with self.lease.decode_step():  # computes: not while the vocoder holds the cores
                        self._prepare_voice(item.voice)
                else:
                    self._admit(item)
                item = self._inbox.get_nowait()
        except queue.Empty:
            pass
        for deferred_item in deferred:  # after the cancels; admission only queues, so update() is unaffected
            if isinstance(deferred_item, _PrepareVoice):
                self._inbox.put(deferred_item)  # heavy: runs at the next full drain, not mid-step
            else:
                self._admit(deferred_item)

    def _admit(self, state: SegmentState) -> None:
        if not state.outlet.is_open:  # cancelled before the engine saw it (its _Cancel follows in the inbox)
            return
        if not self.scheduler.add(state):
            self._emit(state, self._event(state, EventKind.BUSY, reason="no free slot"))
            return
        self._live[state.request_id] = state

    def _apply_cancel(self, request_id: str) -> None:
        """Free its slot if T3 still runs it, and send its CANCELLED event (once, whoever owns it now)."""
        state = self._live.pop(request_id, None)
        if state is not None and state.status in (Status.WAITING, Status.RUNNING):
            self.scheduler.cancel(state)
        with self._emit_lock:
            outlet = self._outlets.get(request_id)
        if outlet is not None:
            outlet.send(SegmentEvent(request_id=request_id, kind=EventKind.CANCELLED, at_monotonic_s=time.monotonic(),
                                     speech_tokens=state.n_valid if state is not None else 0, reason="cancelled"))

    # --- after sampling ----------------------------------------------------------------------------------

    def _after_update(self, update: StepUpdate) -> None:
        """STARTED at a live segment's first id; a job segment's when its generation has ended (until then it may
        be preempted and restarted: its sink hears nothing of an attempt that did not finish)."""
        if update.started:
            now = time.monotonic()
            for state in update.started:
                state.first_token_s = now
                if state.is_live:
                    self._emit(state, self._event(state, EventKind.STARTED))
        for state in update.ended:
            if not state.is_live:
                self._emit(state, self._event(state, EventKind.STARTED))
            self._emit(state, self._event(state, EventKind.GENERATED, reason=state.finish_reason,
                                          token_ids=tuple(state.tokens)))
            if self.vocoder_worker is None:
                self._finish(state)

    def _hand_to_vocoder(self, update: StepUpdate) -> None:
        """The step's valid ids of every segment (two arrays, whatever the rows), the streams that start and the
        segments that end, to the vocoder worker in one message; a finished segment is the worker's from then on
        (it sends the audio and DONE). A job segment's stream opens when its generation ends, with all its ids."""
        worker = self.vocoder_worker
        if worker is None:
            return
        items: list[StreamOpen | TokenRun | Feed] = [self._stream_open(state, state.gen) for state in update.opened]
        if update.valid_ids.size:
            items.append(TokenRun(stream_ids=update.stream_gens, tokens=update.valid_ids))
        for state in update.ended:
            held = () if state.is_live else tuple(t for t in state.tokens if t < SPEECH_VOCAB_SIZE)
            if not state.is_live:
                items.append(self._stream_open(state, -1))
            items.append(Feed(request_id=state.request_id, tokens=held, final=True, speech_tokens=state.n_valid,
                              finish_reason=state.finish_reason))
            self._live.pop(state.request_id, None)
        if items:
            worker.feed(items)

    def _stream_open(self, state: SegmentState, stream_id: int) -> StreamOpen:
        return StreamOpen(request_id=state.request_id, outlet=state.outlet, voice=state.voice,
                          seed=self._vocoder_seed(state), reproducible=state.request.params.seed is not None,
                          listener=state.request.listener, admitted_s=state.admitted_s, stream_id=stream_id,
                          live=state.is_live)

    @staticmethod
    def _vocoder_seed(state: SegmentState) -> int:
        assert state.params.seed is not None
        return (state.params.seed * 0x9E3779B1 + 0x7F4A7C15) % (2**63)

    def _finish(self, state: SegmentState) -> None:
        """Without a vocoder: a segment is done when T3 is."""
        state.status = Status.FINISHED
        self._live.pop(state.request_id, None)
        self._emit(state, self._event(state, EventKind.DONE, reason=state.finish_reason))

    def _terminate(self, state: SegmentState, status: Status, reason: str) -> None:
        if state.status == Status.RUNNING:
            self.scheduler.cancel(state, reason)
        state.status = status
        self._live.pop(state.request_id, None)
        kind = EventKind.FAILED if status == Status.FAILED else EventKind.CANCELLED
        self._emit(state, self._event(state, kind, reason=reason))

    def _fail_all(self, status: Status, reason: str) -> None:
        """Every request not yet done (T3's, the vocoder's, the inbox's) gets its terminal event."""
        self._in_flight = None
        for state in list(self._live.values()):
            try:
                self._terminate(state, status, reason)
            except Exception:
                log.exception("while failing %s", state.request_id)
        kind = EventKind.FAILED if status == Status.FAILED else EventKind.CANCELLED
        with self._emit_lock:
            outlets = list(self._outlets.values())
        for outlet in outlets:  # in the vocoder worker's hands, or still in the inbox
            outlet.send(SegmentEvent(request_id=outlet.request_id, kind=kind, at_monotonic_s=time.monotonic(),
                                     reason=reason))

    # --- output ------------------------------------------------------------------------------------------

    def _emit(self, state: SegmentState, output: EngineOutput) -> None:
        """Deliver unless the request was cancelled; a sink that raises ends only its own segment."""
        if state.outlet.send(output) == Delivery.SINK_FAILED:
            self.cancel(state.request_id)

    @staticmethod
    def _event(state: SegmentState, kind: EventKind, reason: str = "",
               token_ids: tuple[int, ...] = ()) -> SegmentEvent:
        return SegmentEvent(request_id=state.request_id, kind=kind, at_monotonic_s=time.monotonic(),
                            speech_tokens=state.n_valid, token_ids=token_ids, reason=reason)

    def _record_renders(self, job_rows_paused: int = 0) -> None:
        """With no step to record (T3 idle, or every row here sat out for another model's live turn): the vocoder's
        renders since the last record and the job rows that sat out, as a renders-only StepStats (not an engine
        step), so that audio rendered after the last step (a segment's tail) and those rows are not left
        uncounted."""
        worker, listener = self.vocoder_worker, self._stats_listener
        rendered = worker is not None and worker.has_stats()
        if listener is None or not (rendered or job_rows_paused):
            return
        renders = worker.take_stats() if worker is not None and rendered else None
        listener(StepStats(
            at_monotonic_s=time.monotonic(), decode_rows=0, active_segments=len(self.scheduler.running),
            max_slots=self.max_slots, waiting_segments=self.scheduler.n_waiting, decode_ms=0.0, prefill_ms=0.0,
            prefill_segments=0, vocoder_ms=renders.ms if renders else 0.0, audio_s=renders.audio_s if renders else 0.0,
            preempted=0, job_rows_paused=job_rows_paused, model=self.variant,
            job_audio_s=renders.job_audio_s if renders else 0.0, renders_only=True))

    def _record(self, plan: StepPlan, decode_ms: float, prefill_ms: float, withdrawn: bool = False) -> None:
        """A step's stats; `withdrawn`: a jobs-only step stopped for a live turn (nothing decoded)."""
        if self.vocoder_worker is not None and self.vocoder_worker.failure:
            raise RuntimeError(f"vocoder worker died: {self.vocoder_worker.failure}")
        renders = self.vocoder_worker.take_stats() if self.vocoder_worker is not None else None
        vocoder_ms, audio_s, job_audio_s = ((renders.ms, renders.audio_s, renders.job_audio_s)
                                            if renders is not None else (0.0, 0.0, 0.0))
        self.steps += 1
        if log.isEnabledFor(logging.DEBUG):
            log.debug("step %d: %d decoding, %d admitted, decode %.1f ms, prefill %.1f ms", self.steps,
                      plan.decode_segments, len(plan.prefill), decode_ms, prefill_ms)
        listener = self._stats_listener
        if listener is None:
            return
        listener(StepStats(
            at_monotonic_s=time.monotonic(), decode_rows=0 if withdrawn else int(plan.decode_rows.size),
            active_segments=len(self.scheduler.running), max_slots=self.max_slots,
            waiting_segments=self.scheduler.n_waiting, decode_ms=decode_ms, prefill_ms=prefill_ms,
            prefill_segments=0 if withdrawn else len(plan.prefill), vocoder_ms=vocoder_ms, audio_s=audio_s,
            preempted=len(plan.preempted), job_rows_paused=plan.job_rows_paused, model=self.variant,
            job_steps_withdrawn=int(withdrawn), job_audio_s=job_audio_s))

    # --- setup -------------------------------------------------------------------------------------------

    def _new_state(self, request: SegmentRequest, outlet: Outlet) -> SegmentState:
        params = request.params
        try:
            params.validate()
        except ValueError as exc:
            raise EngineError(str(exc)) from exc
        voice = self.voices.get(request.voice_id)
        text_ids = text_token_ids(self.variant, self.bundle.tokenizer, request.text, request.language)
        if len(text_ids) > self.max_text_positions:
            raise EngineError(f"text is too long for one segment: {len(text_ids)} text tokens, "
                              f"at most {self.max_text_positions}")
        max_new = params.max_new_tokens or max_tokens_for_text(request.text)
        seed = params.seed if params.seed is not None else self._draw_seed()
        params = replace(params, seed=seed, max_new_tokens=min(max_new, HARD_MAX_NEW_TOKENS))
        if not request.submitted_monotonic_s:
            request.submitted_monotonic_s = time.monotonic()
        return SegmentState(request=request, outlet=outlet, params=params, voice=voice, text_ids=text_ids,
                            max_new_tokens=params.max_new_tokens or HARD_MAX_NEW_TOKENS,
                            uses_cfg=self.is_llama and params.cfg_weight > 0.0,
                            next_pos=self._conditioning_positions(voice) + len(text_ids) + self.runner.bos_positions)

    def _conditioning_positions(self, voice: Voice) -> int:
        prompt = voice.prompt_speech_tokens
        return conditioning_positions(self.bundle.t3.hp, int(prompt.shape[-1]) if prompt is not None else 0)

    def _draw_seed(self) -> int:
        if self._seed_source is not None:
            return self._seed_source.randrange(2**62)
        return int.from_bytes(os.urandom(8), "little") % (2**62)

    def _build_worker(self) -> VocoderWorker:
        config = self.config
        schedule = config.chunk_schedule_tokens
        policy = ChunkPolicy(first_chunk_tokens=config.first_chunk_tokens, schedule_tokens=schedule,
                             max_chunk_tokens=max((config.first_chunk_tokens, *schedule)))
        worker = VocoderWorker(self.vocoder, policy, threads=self.threads.vocoder, max_batch=self._vocoder_max_batch,
                               on_sink_failed=self.cancel, lease=self.lease)
        worker.turn_pending = self.turn_pending
        return worker

    def _warmup(self) -> None:
        """Prepare every voice known at start (the default included) before declaring ready: T3 prefixes here,
        vocoder prompts on the vocoder's preparation thread (waited for, so a first request never waits). Then,
        with those threads idle, the CUDA graphs: captured, checked against eager, or given up (`_graphs_failed`).
        Last, one segment through the whole path."""
        voices = [self.voices.get(voice_id) for voice_id in self.voices.ids()]
        worker = self.vocoder_worker
        if worker is not None:
            for voice in voices:
                if voice.s3gen_ref:
                    worker.prepare_voice(voice)
        for voice in voices:
            self._prepare_voice(voice)
        if worker is not None and not worker.wait_prepared([v.key for v in voices if v.s3gen_ref],
                                                           VOICE_PREPARATION_TIMEOUT_S):
            raise EngineError("the built-in voices' vocoder prompts were not ready in time")
        self._capture_decode_graphs()
        if self.vocoder is not None and self.vocoder.graphs is None:
            self.vocoder_graphs.reason = ("vocoder_graphs='off'" if self.config.vocoder_graphs == "off"
                                          else "not a CUDA device")
        elif worker is not None and voices:
            self._capture_vocoder_graphs(worker, self.voices.get(self._warmup_voice_id()).key)
        self._speak_warmup_segment()

    def _capture_decode_graphs(self) -> None:
        runner = self.runner
        if not runner.use_graphs:
            self.graphs.reason = "cuda_graphs='off'" if self.config.cuda_graphs == "off" else "not a CUDA device"
            return
        try:
            report = runner.capture_graphs()
            problem = runner.check_graphs()
        except Exception as exc:
            log.exception("capturing the decode graphs failed")
            problem = f"capture failed: {type(exc).__name__}: {exc}"
        if problem:
            self._graphs_failed(self.graphs, "cuda_graphs", problem)
            runner.drop_graphs()
            if self.config.overlap_steps == "auto":  # (auto overlaps graphed steps; eager ones are as with graphs off)
                self.overlap_steps = False
            return
        self.graphs = replace(self.graphs, state="on", graphs=report.graphs, capture_s=report.capture_s,
                              pool_mb=round(report.pool_bytes / 1e6, 1), parity=runner.graph_parity)
        log.info("decode graphs: %d captured (%d row x %d key buckets + sampling) in %.1f s, pool %.0f MB; "
                 "replay == eager (%s)", report.graphs, len(runner.row_buckets), len(runner.key_buckets),
                 report.capture_s, report.pool_bytes / 1e6, runner.graph_parity)

    def _capture_vocoder_graphs(self, worker: VocoderWorker, voice_key: str) -> None:
        """The first chunks' graphs, captured on the worker thread (this thread waits: nothing else runs), then one
        first chunk replayed beside eager; a failure falls back (or refuses, with "on") as the decode's."""
        built = worker.warm_graphs(voice_key, VOICE_PREPARATION_TIMEOUT_S)
        problem = worker.check_graphs(voice_key, VOICE_PREPARATION_TIMEOUT_S,
                                      fall_back=self.config.vocoder_graphs != "on")
        if built is None or problem is None:
            raise EngineError("the vocoder's first-chunk graphs were not captured in time")
        if problem:
            self._graphs_failed(self.vocoder_graphs, "vocoder_graphs", problem)
            return
        self.vocoder_graphs.state, self.vocoder_graphs.graphs = "on", built
        log.info("vocoder graphs: %d first-chunk graphs captured; replay == eager", built)

    def _graphs_failed(self, graphs: GraphState, name: str, problem: str) -> None:
        """"on": refuse to start, naming the reason; "auto": serve eagerly, with the reason in the log and status."""
        if graphs.mode == "on":
            raise EngineError(f"{name}='on', but {problem}")
        graphs.state, graphs.reason = "fallback", problem
        log.warning("%s: falling back to eager: %s", name, problem)

    def _warmup_voice_id(self) -> str:
        voice_ids = self.voices.ids()
        return "default" if "default" in voice_ids else voice_ids[0]

    def _speak_warmup_segment(self) -> None:
        """One real segment through the whole path (prefill, decode steps, sampling, the vocoder) before the
        engine says ready: an engine that cannot speak (a dtype mismatch, an op missing on this device) fails
        here with the reason (`failure`), instead of saying ready and failing every session."""
        voice_ids = self.voices.ids()
        if not voice_ids:
            log.warning("no voice at start-up: the warm-up segment is skipped")
            return
        outcome: list[SegmentEvent] = []
        finished = threading.Event()

        def sink(output: EngineOutput) -> None:
            if isinstance(output, SegmentEvent) and output.kind >= EventKind.DONE:
                outcome.append(output)
                finished.set()

        params = replace(SamplingParams.defaults(self.variant), seed=0, max_new_tokens=WARMUP_TOKENS)
        self.submit(SegmentRequest(request_id=WARMUP_REQUEST_ID, text=WARMUP_TEXT, params=params, sink=sink,
                                   voice_id=self._warmup_voice_id()))
        deadline_s = time.monotonic() + WARMUP_TIMEOUT_S
        while not finished.is_set() or self._in_flight is not None:
            if time.monotonic() > deadline_s:
                raise EngineError("the warm-up segment did not finish in time")
            self._step()
        if outcome[0].kind != EventKind.DONE:
            raise EngineError(f"the warm-up segment failed: {outcome[0].reason}")

    def _prepare_voice(self, voice: Voice) -> None:
        try:
            self.runner.prefix_for(voice, SamplingParams.defaults(self.variant).exaggeration)
        except Exception:
            log.exception("preparing voice %s failed", voice.voice_id)


def wait_until_ready(ready: threading.Event, dead: threading.Event, timeout_s: float) -> bool:
    """An engine thread's start-up: True once `ready` is set, False when `dead` is set first or timeout_s passes."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if ready.wait(0.05):
            return True
        if dead.is_set():
            return False
    return False
