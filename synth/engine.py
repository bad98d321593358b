"""The engine: one thread owns the models and runs THE step loop over every live segment.

Callers (any thread) talk to it through `submit` / `cancel` (a queue) and hear back through each
request's sink (called on this thread; sinks must not block). Each iteration:

    drain inbox -> schedule -> prefill + one batched decode + sample (one host sync)
    -> apply cancels that landed meanwhile -> update -> hand new speech tokens to the vocoder worker -> stats

The decode step is a pure function over the runner's static buffers (synth/step_buffers.py): this thread writes
the per-row inputs into a host mirror (`_write_step_inputs`, `_write_row_params`), the runner uploads them in one
copy, decodes the row bucket with one attention call per layer, samples every row on the device and the step
reads back only the sampled ids. On CUDA those two functions are graphs captured at start-up per bucket.
Admission steps also run the packed prefill, whose inputs are built from host lists (not captured).

The vocoder renders on its own thread (synth/vocoder_worker.py), batched over every stream due, and emits the
audio itself; each request's output goes through its Outlet (synth/outlet.py), whichever thread sends it.
"""

from __future__ import annotations

import contextlib
import logging
import os
import queue
import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any

import torch

from synth import alignment, invariant_ops, linear_bf16w
from synth.api import (
    HARD_MAX_NEW_TOKENS,
    MAX_SEGMENT_TEXT_TOKENS,
    EngineConfig,
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
    max_tokens_for_text,
)
from synth.cpu_threads import CoreLease, available_cores, release_openmp_pool, use_threads
from synth.kv_cache import PrefixKV
from synth.loading import ModelBundle
from synth.outlet import Delivery, Outlet
from synth.request import SPEECH_VOCAB_SIZE, SegmentState, Status
from synth.scheduler import Scheduler, SchedulerConfig, StepPlan, StepResult
from synth.step_buffers import FLOAT_FIELDS
from synth.t3_runner import EditGuided, PrefillItem, T3Runner, projections
from synth.text import text_token_ids
from synth.vocoder_worker import ChunkPolicy, Feed, StreamOpen, VocoderWorker
from synth.voices import Voice, VoiceRegistry, make_voice, voice_from_bytes, voice_to_bytes

log = logging.getLogger(__name__)

IDLE_WAIT_S = 0.05
PREFIX_CACHE_ENTRIES = 64
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
S3GEN_SILENCE_TOKENS_TURBO = 3
VOCODER_MAX_BATCH = {"cpu": 4, "cuda": 64}  # streams per render tick: short ticks on a CPU (latency), wide on a GPU
VOICE_PREPARATION_TIMEOUT_S = 600.0  # start-up: built-in voices' vocoder prompts (English, CPU: ~10 s each)
KV_LEN_MULTIPLE = 64
WARMUP_REQUEST_ID = "engine-warmup"
WARMUP_TEXT = "Warming up."
WARMUP_TOKENS = 8  # enough for a prefill, several decode steps and a vocoder render
WARMUP_TIMEOUT_S = 600.0
PERCEIVER_POSITIONS = 32  # the Perceiver squeezes the speech prompt to 32 positions


def conditioning_positions(hp: Any) -> int:
    """Length of the T3 conditioning prefix: [speaker][prompt (or its Perceiver summary)][emotion]."""
    prompt = PERCEIVER_POSITIONS if hp.use_perceiver_resampler else hp.speech_cond_prompt_len
    return 1 + prompt + (1 if hp.emotion_adv else 0)


def _round_up(value: int, multiple: int) -> int:
    return -(-value // multiple) * multiple


@dataclass(frozen=True, slots=True)
class _Cancel:
    request_id: str


@dataclass(frozen=True, slots=True, eq=False)
class _PrepareVoice:
    """Precompute a new voice's T3 prefix on the engine thread when it is added rather than on its first
    request (its vocoder prompt is prepared by the vocoder worker's preparation thread)."""

    voice: Voice


class Engine(EngineLike):
    def __init__(self, bundle: ModelBundle, config: EngineConfig, *, render_audio: bool = True) -> None:
        self.bundle = bundle
        self.config = config
        if config.alignment_analyzer and bundle.variant != "multilingual":
            raise EngineError("alignment_analyzer is for the multilingual model only (as in chatterbox)")
        self.variant = bundle.variant
        self.random_weights = bundle.random_weights
        self.max_slots = config.max_slots
        self.device = bundle.device
        self.dtype = DTYPES[config.dtype]
        self.is_llama = self.variant != "turbo"
        max_rows = config.max_slots * (2 if self.is_llama else 1)
        self.prefix_positions = conditioning_positions(bundle.t3.hp)
        # a row holds its copy of the voice prefix, then text, the BOS block, speech, and one scratch position
        after_prefix = config.max_context_tokens or MAX_SEGMENT_TEXT_TOKENS + 2 + HARD_MAX_NEW_TOKENS + 1
        max_len = _round_up(self.prefix_positions + after_prefix, KV_LEN_MULTIPLE)
        bf16_weights = self._round_weights_for(config)
        self.vocoder_gemm_dtype = self._vocoder_gemm_dtype_for(config)
        self.runner = T3Runner(bundle.t3, max_rows=max_rows, max_len=max_len, device=self.device, dtype=self.dtype,
                               bf16_weights=bf16_weights, cuda_graphs=self._graphs_for(config))
        # text tokens one segment may have: its row keeps room for the BOS block and at least one speech token
        self.max_text_positions = self.runner.cache.usable_len - self.prefix_positions - 4
        if self.is_llama:  # the learned text positions end somewhere too
            self.max_text_positions = min(self.max_text_positions, bundle.t3.text_pos_emb.emb.num_embeddings)
        log.info("KV cache: %d rows x %d positions, %.2f GB", max_rows, max_len, self.runner.cache.nbytes / 1e9)
        if config.alignment_analyzer:
            missing = alignment.missing_heads(self.runner.n_layers, self.runner.n_heads)
            if missing:
                raise EngineError(f"this T3 ({self.runner.n_layers} layers x {self.runner.n_heads} heads) lacks the "
                                  f"alignment analyzer's (layer, head) pairs {missing}: it needs the full-size "
                                  "multilingual model (a checkpoint or --weights random-full)")
            self.runner.capture_heads = alignment.ALIGNED_HEADS
        self.scheduler = Scheduler(SchedulerConfig(
            max_slots=config.max_slots, max_rows=max_rows, max_waiting=config.max_waiting,
            prefill_budget=config.prefill_budget_segments, usable_len=self.runner.cache.usable_len,
            eos_token=bundle.t3.hp.stop_speech_token, first_token_may_be_eos=not self.is_llama),
            on_release=self.runner.release)
        self.threads = ThreadBudget.resolve(config.decode_threads, config.vocoder_threads, available_cores())
        # the decode's threads lent to the vocoder's urgent ticks (CPU only: on a GPU the threads only launch)
        self.lease = CoreLease(self.threads.decode, self.threads.vocoder,
                               enabled=config.lend_threads and self.device.type == "cpu" and render_audio,
                               decode_borrows=config.decode_borrows_threads)
        self.vocoder: Any = None  # synth.vocoder.StreamingVocoder when rendering audio
        self.vocoder_worker: VocoderWorker | None = None
        if render_audio:
            self.vocoder, self.vocoder_worker = self._build_vocoder()
        self.voices = VoiceRegistry()
        # keyed by Voice.key (a content hash), never by id(): a freed voice's address is reused at once
        self._prefixes: OrderedDict[tuple[str, float], PrefixKV] = OrderedDict()
        # bounded at submit (EngineFull past max_inbox_items): cancels and voice preparations always get in, so a
        # full inbox never blocks the event loop's cancel nor the engine thread's own put
        self._inbox: queue.Queue[SegmentState | _Cancel | _PrepareVoice] = queue.Queue()
        self.max_inbox_items = config.max_slots + config.max_waiting
        self._live: dict[str, SegmentState] = {}  # request_id -> state while T3 owns it, engine thread only
        self._emit_lock = threading.Lock()  # every outlet sends under it; it also guards _outlets
        self._outlets: dict[str, Outlet] = {}  # request_id -> outlet until its terminal event
        self._stats_listener: Callable[[StepStats], None] | None = None
        self._thread: threading.Thread | None = None
        self._stop = threading.Event()
        self._ready = threading.Event()
        self._dead = threading.Event()
        self._seed_source = torch.Generator().manual_seed(config.seed) if config.seed is not None else None
        self.steps = 0
        self.failure: str = ""

    # --- public API (any thread) -------------------------------------------------------------------------

    def submit(self, request: SegmentRequest) -> None:
        if self._dead.is_set() or self._stop.is_set():
            raise EngineError("engine is not running")
        if self._inbox.qsize() >= self.max_inbox_items:
            raise EngineFull(f"the engine's inbox is full ({self.max_inbox_items} items): try again later")
        outlet = Outlet(request.request_id, request.sink, self._emit_lock, self._outlets)
        state = self._new_state(request, outlet)
        with self._emit_lock:
            duplicate = request.request_id in self._outlets
            if not duplicate:
                self._outlets[request.request_id] = outlet
        if duplicate:  # the live request keeps the id; this one fails alone
            self._emit(state, self._event(state, EventKind.FAILED, reason="duplicate request_id"))
            return
        self._inbox.put(state)

    def cancel(self, request_id: str) -> None:
        with self._emit_lock:
            outlet = self._outlets.get(request_id)
        if outlet is not None:
            outlet.cancel()  # from here on nothing of it goes out but the CANCELLED event
        self._inbox.put(_Cancel(request_id))
        if self.vocoder_worker is not None:
            self.vocoder_worker.cancel(request_id)  # its pending renders are dropped at the worker's next drain

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

    def export_voice(self, voice_id: str) -> bytes:
        return voice_to_bytes(self.voices.get(voice_id))

    def import_voice(self, voice_id: str, conditioning: bytes) -> None:
        self._register_voice(voice_from_bytes(voice_id, conditioning, self.device))

    def _register_voice(self, voice: Voice) -> None:
        """Serve `voice` from now on; its T3 prefix and vocoder prompt are prepared ahead of its first request."""
        self.voices.add(voice)
        self._inbox.put(_PrepareVoice(voice))
        if self.vocoder_worker is not None:
            self.vocoder_worker.prepare_voice(voice)  # off the decode thread and off the render thread

    def set_stats_listener(self, listener: Callable[[StepStats], None] | None) -> None:
        self._stats_listener = listener

    def status(self) -> dict[str, object]:
        graphs = self.vocoder.graphs if self.vocoder is not None else None
        return {
            "variant": self.variant, "random_weights": self.random_weights, "weights_source": self.bundle.source,
            "preset": self.bundle.size, "device": str(self.device), "dtype": self.config.dtype,
            "cpu_weights": self.config.cpu_weights, "cpu_vocoder": self.config.cpu_vocoder,
            "decode_attention": "shared-prefix" if self.runner.shared_prefix_attention else "torch",
            "vocoder_graphs": self.config.vocoder_graphs,
            "vocoder_graphs_captured": graphs.captured if graphs is not None else 0,
            "vocoder_graphs_failed": graphs.failed if graphs is not None else 0,
            "max_slots": self.max_slots, "slots_in_use": len(self.scheduler.running),
            "waiting": self.scheduler.n_waiting, "steps": self.steps, "ready": self.ready, "alive": self.alive,
            "failure": self.failure, "decode_threads": self.threads.decode, "vocoder_threads": self.threads.vocoder,
            "vocoder_ticks": self.vocoder_worker.ticks if self.vocoder_worker is not None else 0,
            "lend_threads": self.lease.enabled, "lent_ticks": self.lease.lent_ticks,
            "decode_waits_for_lent_ticks": self.lease.decode_waits,
            "decode_borrows_threads": self.lease.decode_borrows, "borrowed_steps": self.lease.borrowed_steps,
            "render_waits_for_borrowed_steps": self.lease.render_waits,
            "lent_ticks_beside_a_decode_team": self.lease.team_wait_timeouts,
            "borrow_gain_ms": self.lease.gain.estimates(),
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
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self._ready.wait(0.05):
                return True
            if self._dead.is_set():
                return False
        return False

    # --- the thread --------------------------------------------------------------------------------------

    def _run(self) -> None:
        torch.set_grad_enabled(False)
        use_threads(self.threads.decode)  # this thread's OpenMP team (synth/cpu_threads.py)
        try:
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
        if self.scheduler.idle:
            self.lease.decode_idle()  # the vocoder may borrow this thread's cores meanwhile
        self._drain_inbox(block=self.scheduler.idle)
        idle = self.scheduler.idle
        rows = max(1, len(self.scheduler.running))  # a step that only prefills borrows as a one-row step would
        with self.lease.decode_step(rows) if not idle else contextlib.nullcontext() as leased:
            plan = self.scheduler.schedule()
            t0 = time.perf_counter()
            token_ids, prefill_ms = self._execute(plan)  # the one host sync of the step
            t1 = time.perf_counter()
            if leased is not None and plan.decode:
                leased.decode_ms = (t1 - t0) * 1e3 - prefill_ms  # teaches the lease whether borrowing pays
        self._drain_inbox(block=False, cancels_only=True)  # aborts that landed mid-step
        ended = self.scheduler.update(plan, StepResult(token_ids))
        self._after_update(plan, ended)
        self._hand_to_vocoder(plan)  # the worker renders them while the next steps decode
        self._record(plan, (t1 - t0) * 1e3 - prefill_ms, prefill_ms)

    # --- inbox -------------------------------------------------------------------------------------------

    def _drain_inbox(self, block: bool, cancels_only: bool = False) -> None:
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
                                     speech_tokens=len(state.valid_tokens) if state is not None else 0,
                                     reason="cancelled"))

    # --- T3 ----------------------------------------------------------------------------------------------

    def _execute(self, plan: StepPlan) -> tuple[list[int], float]:
        """Prefill the admitted (one packed pass), decode the running (one static-shape step over the row
        bucket), sample every row of the bucket; one host sync. Returns (ids in `plan.sampled` order, prefill_ms)."""
        if plan.is_empty:
            return [], 0.0
        t0 = time.perf_counter()
        runner = self.runner
        items = [item for state in plan.prefill for item in self._prefill_items(state)]
        analyzed = any(s.aligner is not None for s in plan.prefill)
        prefill_logits = runner.prefill(items, capture=analyzed) if items else None  # [len(items), V]
        prefill_ms = (time.perf_counter() - t0) * 1e3
        n_rows, n_keys = self._write_step_inputs(plan)
        runner.inputs.upload()  # the step's one host-to-device copy
        if plan.decode:
            runner.decode(n_rows, n_keys, capture=any(s.aligner is not None for s in plan.decode))
        if prefill_logits is not None:
            runner.place_logits([item.row for item in items], prefill_logits)
        sampled = runner.sample(n_rows, self._analyzer_edit(plan, items)).tolist()  # the one host sync
        return [sampled[state.rows[0]] for state in plan.sampled], prefill_ms

    def _write_step_inputs(self, plan: StepPlan) -> tuple[int, int]:
        """The host mirror of the step's per-row inputs: idle rows by default, the admitted rows' first
        sample, the running rows' next token. Returns the step's (row bucket, key bucket)."""
        inputs = self.runner.inputs
        ints = inputs.ints
        highest_row = max((row for state in plan.sampled for row in state.rows), default=0)
        inputs.idle_rows(highest_row + 1)
        for state in plan.prefill:
            ints["reset"][list(state.rows)] = 1
        longest_keys = 1
        for state in plan.decode:
            for row in state.rows:  # both rows of a CFG segment have the same length
                ints["token"][row] = state.pending_token
                ints["speech_pos"][row] = len(state.tokens)  # sampled token i is embedded at speech position i+1
                ints["pos"][row] = ints["write"][row] = state.next_pos
                ints["keys"][row] = state.next_pos + 1
            state.next_pos += 1
            longest_keys = max(longest_keys, state.next_pos)
        return self.runner.step_shape(highest_row, longest_keys)

    def _analyzer_edit(self, plan: StepPlan, items: list[PrefillItem]) -> EditGuided | None:
        """The alignment analyzers' step on the guided logits (one row per cache row) of the segments that
        have one."""
        if not self.config.alignment_analyzer:  # the usual case: nothing to look at in the step loop
            return None
        runner = self.runner
        rows: list[tuple[int, SegmentState, list[torch.Tensor]]] = []  # (cond row, state, text probs)
        for state in plan.decode:
            if state.aligner is not None:  # the text block sits right after the conditioning in the row
                n_text, cols = len(state.text_ids), state.prefix.cond_len
                rows.append((state.rows[0], state, [runner.captured_decode[h][state.rows[0], cols:cols + n_text][None]
                                                    for h in alignment.ALIGNED_HEADS]))
        prefix_cols, starts = runner.captured_layout
        cond_items = [k for k, item in enumerate(items) if item.row in {s.rows[0] for s in plan.prefill}]
        for state, item in zip(plan.prefill, cond_items, strict=True):
            if state.aligner is not None:  # the BOS block's two queries over the item's own text keys
                n_text, start = len(state.text_ids), starts[item]
                end = start + items[item].embeds.shape[0]
                cols = prefix_cols + start
                rows.append((state.rows[0], state, [runner.captured_prefill[h][end - 2:end, cols:cols + n_text]
                                                    for h in alignment.ALIGNED_HEADS]))
        if not rows:
            return None

        def edit(logits: torch.Tensor) -> torch.Tensor:
            for row, state, text_probs in rows:
                alignment.feed(state.aligner, text_probs)
                last = state.tokens[-1] if state.tokens else runner.start_speech_token
                logits[row:row + 1] = state.aligner.step(logits[row:row + 1], next_token=last)
            return logits

        return edit

    def _prefill_items(self, state: SegmentState) -> list[PrefillItem]:
        """The cond row gets the voice prefix and runs its text and BOS block; a CFG uncond row gets the prefix
        and the shared unconditional text block of the same length, and runs only its BOS block. Also writes
        the rows' sampling parameters and seeds their generators."""
        prefix = self._prefix_for(state.voice, state.params.exaggeration)
        n_text = len(state.text_ids)
        bos = self.runner.bos_embeds()
        items = [PrefillItem(state.rows[0], prefix, prefix.cond_len,
                             torch.cat([self.runner.text_embeds(state.text_ids), bos]))]
        if state.uses_cfg:
            self.runner.extend_uncond_text(prefix, n_text)
            items.append(PrefillItem(state.rows[1], prefix, prefix.cond_len + n_text, bos))
        state.prefix = prefix
        if self.config.alignment_analyzer:
            state.aligner = alignment.new_analyzer(prefix.cond_len, n_text, self.runner.stop_speech_token)
        state.next_pos = prefix.cond_len + n_text + bos.shape[0]
        self._write_row_params(state)
        state.admitted_s = time.monotonic()
        return items

    def _write_row_params(self, state: SegmentState) -> None:
        """A claimed segment's rows: sampling parameters, CFG partner, and the cond row's generator seeded."""
        inputs, params, rows = self.runner.inputs, state.params, state.rows
        for row in rows:
            for name in FLOAT_FIELDS:
                inputs.floats[name][row] = getattr(params, name)
            inputs.ints["partner"][row] = row
        inputs.ints["partner"][rows[0]] = rows[-1]  # the uncond row's logits (its own without CFG)
        if params.seed is None:  # resolved at submit: never None here
            raise EngineError(f"{state.request_id}: unseeded segment")
        self.runner.generators[rows[0]].manual_seed(params.seed)

    def _prefix_for(self, voice: Voice, exaggeration: float) -> PrefixKV:
        key = (voice.key, float(exaggeration) if self.is_llama else 0.0)
        prefix = self._prefixes.get(key)
        if prefix is None:
            cond = voice.t3_cond(exaggeration, self.device)
            prefix = self.runner.compute_prefix(self.runner.cond_embeds(cond))
            self._prefixes[key] = prefix
            if len(self._prefixes) > PREFIX_CACHE_ENTRIES:
                self._prefixes.popitem(last=False)
        else:
            self._prefixes.move_to_end(key)
        return prefix

    # --- after sampling ----------------------------------------------------------------------------------

    def _after_update(self, plan: StepPlan, ended: list[SegmentState]) -> None:
        now = time.monotonic()
        for state in plan.sampled:
            if state.status not in (Status.RUNNING, Status.GENERATED):
                continue
            token = state.tokens[-1]
            if len(state.tokens) == 1:
                state.first_token_s = now
                self._emit(state, self._event(state, EventKind.STARTED))
            if token < SPEECH_VOCAB_SIZE:
                state.valid_tokens.append(token)
        for state in ended:
            self._emit(state, self._event(state, EventKind.GENERATED, reason=state.finish_reason,
                                          token_ids=tuple(state.tokens)))
            if self.vocoder_worker is None:
                self._finish(state)

    def _hand_to_vocoder(self, plan: StepPlan) -> None:
        """Every sampled segment's new valid tokens, and the end of the finished ones, to the vocoder worker in
        one message; a finished segment is the worker's from then on (it sends the audio and DONE)."""
        worker = self.vocoder_worker
        if worker is None:
            return
        items: list[StreamOpen | Feed] = []
        for state in plan.sampled:
            if state.status not in (Status.RUNNING, Status.GENERATED):  # cancelled or failed meanwhile
                continue
            final = state.status == Status.GENERATED  # T3 ended it this step (it leaves the plans after)
            new_tokens = state.valid_tokens[state.pushed_tokens:]
            if not new_tokens and not final:
                continue
            if state.pushed_tokens == 0:  # its first message (a segment's first feed has tokens, or is final)
                items.append(StreamOpen(request_id=state.request_id, outlet=state.outlet, voice=state.voice,
                                        seed=self._vocoder_seed(state),
                                        reproducible=state.request.params.seed is not None,
                                        listener=state.request.listener, admitted_s=state.admitted_s))
            items.append(Feed(request_id=state.request_id, tokens=tuple(new_tokens), final=final,
                              speech_tokens=len(state.valid_tokens), finish_reason=state.finish_reason))
            state.pushed_tokens = len(state.valid_tokens)
            if final:
                self._live.pop(state.request_id, None)
        if items:
            worker.feed(items)

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
                            speech_tokens=len(state.valid_tokens), token_ids=token_ids, reason=reason)

    def _record(self, plan: StepPlan, decode_ms: float, prefill_ms: float) -> None:
        if self.vocoder_worker is not None and self.vocoder_worker.failure:
            raise RuntimeError(f"vocoder worker died: {self.vocoder_worker.failure}")
        if plan.is_empty:
            return
        renders = self.vocoder_worker.take_stats() if self.vocoder_worker is not None else None
        vocoder_ms, audio_s = (renders.ms, renders.audio_s) if renders is not None else (0.0, 0.0)
        self.steps += 1
        if log.isEnabledFor(logging.DEBUG):
            log.debug("step %d: %d decoding, %d admitted, decode %.1f ms, prefill %.1f ms", self.steps,
                      len(plan.decode), len(plan.prefill), decode_ms, prefill_ms)
        listener = self._stats_listener
        if listener is None:
            return
        listener(StepStats(
            at_monotonic_s=time.monotonic(), decode_rows=sum(len(s.rows) for s in plan.decode),
            active_segments=len(self.scheduler.running), max_slots=self.max_slots,
            waiting_segments=self.scheduler.n_waiting, decode_ms=decode_ms, prefill_ms=prefill_ms,
            prefill_segments=len(plan.prefill), vocoder_ms=vocoder_ms, audio_s=audio_s))

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
                            uses_cfg=self.is_llama and params.cfg_weight > 0.0)

    def _draw_seed(self) -> int:
        if self._seed_source is not None:
            return int(torch.randint(0, 2**62, (1,), generator=self._seed_source).item())
        return int.from_bytes(os.urandom(8), "little") % (2**62)

    def _round_weights_for(self, config: EngineConfig) -> bool:
        """cpu_weights="bf16": round T3's projection weights to bf16 in place (once; the bundle's model then
        holds the values the engine computes with, so chatterbox's own inference on it stays the reference)."""
        if config.cpu_weights == "fp32":
            return False
        if config.cpu_weights != "bf16":
            raise EngineError(f"cpu_weights must be 'fp32' or 'bf16', not {config.cpu_weights!r}")
        if self.device.type != "cpu" or self.dtype != torch.float32:
            raise EngineError("cpu_weights='bf16' is for the CPU with dtype float32 (on a GPU use dtype bfloat16)")
        try:
            linear_bf16w.available(raise_error=True)
        except linear_bf16w.KernelUnavailable as exc:
            raise EngineError(str(exc)) from exc
        changed = linear_bf16w.round_to_bf16_(projections(self.bundle.t3))
        if changed:
            log.warning("cpu_weights=bf16: rounded %d T3 projection weights to bfloat16 (fp32 math on the rounded "
                        "values; the model is no longer bit-identical to the checkpoint)", changed)
        return True

    def _vocoder_gemm_dtype_for(self, config: EngineConfig) -> torch.dtype:
        """cpu_vocoder="bf16": S3Gen's products in bfloat16 (CPU only, where the CPU runs them natively)."""
        if config.cpu_vocoder == "fp32":
            return torch.float32
        if config.cpu_vocoder != "bf16":
            raise EngineError(f"cpu_vocoder must be 'fp32' or 'bf16', not {config.cpu_vocoder!r}")
        if self.device.type != "cpu":
            raise EngineError("cpu_vocoder='bf16' is for the CPU")
        if not invariant_ops.bf16_gemms_supported():
            raise EngineError("cpu_vocoder='bf16' needs a CPU with AVX512-BF16 or AMX (bf16 products elsewhere are "
                              "slower than fp32); use cpu_vocoder='fp32'")
        return torch.bfloat16

    def _graphs_for(self, config: EngineConfig) -> bool:
        """cuda_graphs: "auto" = on for a CUDA device; "on" needs one; with the alignment analyzer the
        analysed steps run eagerly anyway (they read attention probabilities back)."""
        if config.cuda_graphs not in ("auto", "on", "off"):
            raise EngineError(f"cuda_graphs must be 'auto', 'on' or 'off', not {config.cuda_graphs!r}")
        if config.cuda_graphs == "on" and self.device.type != "cuda":
            raise EngineError("cuda_graphs='on' needs a CUDA device")
        if config.vocoder_graphs not in ("on", "off"):
            raise EngineError(f"vocoder_graphs must be 'on' or 'off', not {config.vocoder_graphs!r}")
        if config.vocoder_graphs == "on" and self.device.type != "cuda":
            raise EngineError("vocoder_graphs='on' needs a CUDA device")
        return config.cuda_graphs != "off" and self.device.type == "cuda"

    def _build_vocoder(self) -> tuple[Any, VocoderWorker]:
        from synth.vocoder import StreamingVocoder

        config = self.config
        turbo = self.variant == "turbo"
        schedule = config.chunk_schedule_tokens
        vocoder = StreamingVocoder(self.bundle.s3gen, n_cfm_timesteps=2 if turbo else 10, meanflow=turbo,
                                   append_silence_tokens=S3GEN_SILENCE_TOKENS_TURBO if turbo else 0,
                                   max_chunk_tokens=max((config.first_chunk_tokens, *schedule)),
                                   gemm_dtype=self.vocoder_gemm_dtype)
        if config.vocoder_graphs == "on":
            vocoder.use_graphs(capture=True)  # each (batch, bucket) captured when first met (synth/render_graphs.py)
        policy = ChunkPolicy(first_chunk_tokens=config.first_chunk_tokens, schedule_tokens=schedule,
                             max_chunk_tokens=max((config.first_chunk_tokens, *schedule)))
        max_batch = config.vocoder_max_batch or VOCODER_MAX_BATCH.get(self.device.type, VOCODER_MAX_BATCH["cpu"])
        return vocoder, VocoderWorker(vocoder, policy, threads=self.threads.vocoder, max_batch=max_batch,
                                      on_sink_failed=self.cancel, lease=self.lease)

    def _warmup(self) -> None:
        """Prepare every voice known at start (the default included) before declaring ready: T3 prefixes here,
        vocoder prompts on the vocoder's preparation thread (waited for, so a first request never waits)."""
        voices = [self.voices.get(voice_id) for voice_id in self.voices.ids()]
        worker = self.vocoder_worker
        if worker is not None:
            for voice in voices:
                if voice.s3gen_ref:
                    worker.prepare_voice(voice)
        for voice in voices:
            self._prepare_voice(voice)
        graphs = self.runner.capture_graphs()
        if graphs:
            log.info("captured %d CUDA graphs of the decode step and sampling", graphs)
        if worker is not None and not worker.wait_prepared([v.key for v in voices if v.s3gen_ref],
                                                           VOICE_PREPARATION_TIMEOUT_S):
            raise EngineError("the built-in voices' vocoder prompts were not ready in time")
        if worker is not None and self.vocoder.graphs is not None and voices:
            built = worker.warm_graphs(self.voices.get(self._warmup_voice_id()).key, VOICE_PREPARATION_TIMEOUT_S)
            if built is None:
                raise EngineError("the vocoder's first-chunk graphs were not captured in time")
            log.info("captured %d CUDA graphs of the vocoder's first chunks (%d failed)", built,
                     self.vocoder.graphs.failed)
        self._speak_warmup_segment()

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
        while not finished.is_set():
            if time.monotonic() > deadline_s:
                raise EngineError("the warm-up segment did not finish in time")
            self._step()
        if outcome[0].kind != EventKind.DONE:
            raise EngineError(f"the warm-up segment failed: {outcome[0].reason}")

    def _prepare_voice(self, voice: Voice) -> None:
        try:
            self._prefix_for(voice, SamplingParams.defaults(self.variant).exaggeration)
        except Exception:
            log.exception("preparing voice %s failed", voice.voice_id)
