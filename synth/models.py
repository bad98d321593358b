"""Several models in one engine (`EngineConfig.models`): one `Engine` per model, each with its own runner, KV cache,
graphs, scheduler, voices and vocoder worker (Turbo's S3Gen is not the original's), and ONE thread that runs every
model's batch at each iteration:

    wait while every model is idle -> drain every model's inbox -> admissions across the models (one budget:
    scheduler.SharedAdmissions, TTFB-first across models, then the model served least recently) -> each model's
    batch (plan, launch, read, update, hand to its vocoder, stats)

So a burst on one model never takes another's slots (each has its own) nor its place in the admissions (a model's
first segment waits at most one admission behind another model's burst of equal rank), and each model's seeded
segments sample exactly the ids they sample alone (its own runner; the equivalence tests). A request names its model
(`SegmentRequest.model`, None: the default, the first of `models`); a model not loaded is an EngineError naming it
and the loaded ones. One StepStats per model per step (`StepStats.model`).

Jobs beside live turns across the models: one thread runs every model's step, so a job step of one model delays a
live turn of another. The schedulers form one pause group (a live turn's first ids on any model make every model's
job rows sit out, where its runner can leave rows out) and the engines share one `turn_arrived` (a live turn
submitted to any model stops a jobs-only step of any model at its next layer, and holds every model's job renders
back until its first valid id: `Engine.turn_group`).

Memory (`build_engines`): every model's weights load first; then each model's slots are planned against what is left:
an explicit count (`ModelOverrides.max_slots`, else `EngineConfig.max_slots`) takes what it needs, and the models on
"auto" (0) share the rest equally. A count that does not fit is an EngineConfigError naming the model.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Sequence
from dataclasses import replace
from typing import Any

from synth.api import EngineConfig, EngineConfigError, EngineError, EngineLike, SegmentRequest, StepStats, Variant
from synth.cpu_threads import release_openmp_pool, use_threads
from synth.engine import IDLE_WAIT_S, Engine, wait_until_ready
from synth.request import Status

log = logging.getLogger(__name__)


def model_config(config: EngineConfig, model: Variant, memory_budget_gb: float | None = None) -> EngineConfig:
    """One model's own config: its overrides (`per_model`) applied over the engine-wide values; the alignment
    analyzer is the multilingual model's only (chatterbox has it for that model alone)."""
    overrides = config.per_model.get(model)
    max_slots = overrides.max_slots if overrides is not None and overrides.max_slots is not None else config.max_slots
    weights = overrides.weights if overrides is not None and overrides.weights is not None else config.weights
    budget = config.memory_budget_gb if memory_budget_gb is None else memory_budget_gb
    return replace(config, variant=model, models=(), per_model={}, max_slots=max_slots, weights=weights,
                   memory_budget_gb=budget, alignment_analyzer=config.alignment_analyzer and model == "multilingual")


def check_models(config: EngineConfig) -> tuple[Variant, ...]:
    """The models to load, the default first; EngineConfigError for a repeated model or an override of one not
    loaded."""
    models = config.models or (config.variant,)
    repeated = sorted({m for m in models if models.count(m) > 1})
    if repeated:
        raise EngineConfigError(f"models lists {', '.join(repeated)} more than once")
    stray = sorted(set(config.per_model) - set(models))
    if stray:
        raise EngineConfigError(f"per-model settings for {', '.join(stray)}, which is not loaded "
                                f"(models: {', '.join(models)})")
    return models


def build_engines(config: EngineConfig, bundles: dict[Variant, Any], *, render_audio: bool = True,
                  free_bytes: int | None = None) -> list[Engine]:
    """One Engine per model of `config`, in its order, on the loaded `bundles`. Explicit slot counts are planned
    first, then the "auto" models share what is left of the budget (`memory_budget_gb`, else the device's free
    memory now, or `free_bytes` when given; on a CPU with neither nothing is shared: each model plans as alone)."""
    from synth import gpu

    models = check_models(config)
    free, total = gpu.device_memory(bundles[models[0]].device)
    budget = int(config.memory_budget_gb * gpu.GB) or (free if free_bytes is None else free_bytes)
    # the headroom is kept once for the device, not once per model: each model plans against its share plus it
    headroom = max(gpu.HEADROOM_MIN_BYTES, int(gpu.HEADROOM_FRACTION * (total or budget)))
    room = budget - headroom
    explicit = [m for m in models if model_config(config, m).max_slots]
    auto = [m for m in models if m not in explicit]
    built: dict[Variant, Engine] = {}
    for model in explicit + auto:
        share: float | None = None
        if budget:
            left = len(auto) - sum(m in built for m in auto) if model in auto else 1
            share = (max(0, room) // left + headroom) / gpu.GB
        try:
            engine = Engine(bundles[model], model_config(config, model, share), render_audio=render_audio)
        except EngineConfigError as exc:
            raise EngineConfigError(f"model {model}: {exc}") from exc
        if budget and engine.slot_plan is not None:
            plan = engine.slot_plan
            room -= plan.kv_bytes + sum(v for k, v in plan.reserved.items() if k != "headroom")
        built[model] = engine
    return [built[m] for m in models]


class MultiEngine(EngineLike):
    """The engine of several models: the EngineLike calls go to each request's model; one thread steps them all."""

    def __init__(self, engines: Sequence[Engine], config: EngineConfig) -> None:
        from synth.scheduler import SharedAdmissions

        if not engines:
            raise EngineConfigError("no model to serve")
        self.engines: dict[Variant, Engine] = {}
        for engine in engines:
            if engine.variant in self.engines:
                raise EngineConfigError(f"model {engine.variant} is loaded twice")
            self.engines[engine.variant] = engine
        self.default = engines[0]
        self.config = config
        self.variant = self.default.variant
        self.random_weights = any(e.random_weights for e in engines)
        self.max_slots = sum(e.max_slots for e in engines)
        self.prefill_budget = config.prefill_budget_segments
        self.admissions = SharedAdmissions([e.scheduler for e in engines])
        # one thread steps every model, so a live turn on one waits for the others' job steps too: one pause group
        # (a live turn's first ids make every model's job rows sit out) and one `turn_arrived` (a live turn on any
        # model stops a jobs-only step of any model)
        self.turn_arrived = threading.Event()
        for engine in engines:
            engine.scheduler.join_pause_group([e.scheduler for e in engines])
            engine.turn_arrived = self.turn_arrived
            engine.turn_group = list(engines)  # a turn on any model holds every model's job renders back
        self._submit_lock = threading.Lock()  # a request id is unique across the models
        self._work = threading.Event()  # set by every call that gives a model work
        self._thread: threading.Thread | None = None
        self._stop = threading.Event()
        self._ready = threading.Event()
        self._dead = threading.Event()
        self.steps = 0
        self.failure = ""

    # --- public API (any thread) -------------------------------------------------------------------------

    @property
    def models(self) -> tuple[Variant, ...]:
        return tuple(self.engines)

    def max_slots_of(self, model: Variant) -> int:
        engine = self.engines.get(model)
        return engine.max_slots if engine is not None else 0

    def engine_of(self, model: Variant | None) -> Engine:
        """The engine of `model` (None: the default); EngineError naming the loaded ones for a model not loaded."""
        if model is None:
            return self.default
        engine = self.engines.get(model)
        if engine is None:
            raise EngineError(f"model {model!r} is not loaded; loaded: {', '.join(self.engines)}")
        return engine

    def submit(self, request: SegmentRequest) -> None:
        engine = self.engine_of(request.model)
        if self._dead.is_set() or self._stop.is_set():
            raise EngineError("engine is not running")
        with self._submit_lock:
            elsewhere = any(e.has_request(request.request_id) for e in self.engines.values() if e is not engine)
            if elsewhere:  # the other model's request keeps the id; this one fails as the engine's own duplicates
                request.sink(engine.duplicate_event(request.request_id))
                return
            engine.submit(request)
        self._work.set()

    def cancel(self, request_id: str) -> None:
        for engine in self.engines.values():  # only its model knows it; to the others it is a no-op
            if engine.has_request(request_id):
                engine.cancel(request_id)
        self._work.set()

    def voice_ids(self) -> list[str]:
        return sorted({voice_id for e in self.engines.values() for voice_id in e.voice_ids()})

    def add_voice(self, voice_id: str, wav: Any, sample_rate_hz: int) -> None:
        """Every model's own conditioning for the clip, computed once per model."""
        for engine in self.engines.values():
            engine.add_voice(voice_id, wav, sample_rate_hz)
        self._work.set()

    def remove_voice(self, voice_id: str) -> None:
        for engine in self.engines.values():
            if voice_id in engine.voice_ids():
                engine.remove_voice(voice_id)

    def export_voice(self, voice_id: str, model: Variant | None = None) -> bytes:
        return self.engine_of(model).export_voice(voice_id)

    def import_voice(self, voice_id: str, conditioning: bytes, model: Variant | None = None) -> None:
        self.engine_of(model).import_voice(voice_id, conditioning)
        self._work.set()

    def set_stats_listener(self, listener: Callable[[StepStats], None] | None) -> None:
        for engine in self.engines.values():
            engine.set_stats_listener(listener)

    def status(self) -> dict[str, object]:
        """The default model's keys (as a one-model engine's), the engine's own, and every model's part."""
        status = self.default.status()
        status.update({"steps": self.steps, "ready": self.ready, "alive": self.alive, "failure": self.failure,
                       "models": {m: e.model_status() for m, e in self.engines.items()}})
        return status

    @property
    def ready(self) -> bool:
        return self._ready.is_set() and not self._dead.is_set()

    @property
    def alive(self) -> bool:
        return not self._dead.is_set() and all(e.alive for e in self.engines.values())

    def start(self) -> None:
        if self._thread is not None:
            return
        release_openmp_pool()  # the starting thread (it built the engines) hands the CPU over
        for engine in self.engines.values():
            if engine.vocoder_worker is not None:
                engine.vocoder_worker.start()
        self._thread = threading.Thread(target=self._run, name="synth-engine", daemon=True)
        self._thread.start()

    def stop(self, timeout_s: float = 5.0) -> None:
        self._stop.set()
        self._work.set()
        if self._thread is not None:
            self._thread.join(timeout_s)
        for engine in self.engines.values():
            if engine.vocoder_worker is not None:
                engine.vocoder_worker.stop(timeout_s)

    def wait_ready(self, timeout_s: float) -> bool:
        return wait_until_ready(self._ready, self._dead, timeout_s)

    # --- the thread --------------------------------------------------------------------------------------

    def _run(self) -> None:
        try:
            for engine in self.engines.values():
                engine.runner.bind_thread()
            use_threads(self.default.threads.decode)
            for engine in self.engines.values():
                engine._warmup()
            self._ready.set()
            while not self._stop.is_set():
                self._step()
            for engine in self.engines.values():
                engine._fail_all(Status.CANCELLED, "shutdown")
        except Exception as exc:
            log.exception("engine thread died")
            self.failure = f"{type(exc).__name__}: {exc}"
            self._dead.set()
            for engine in self.engines.values():
                engine._fail_all(Status.FAILED, f"engine failure: {self.failure}")

    def _step(self) -> None:
        """One iteration: every model's batch."""
        engines = list(self.engines.values())
        if all(e.idle and not e.has_inbox_items for e in engines):
            for engine in engines:
                engine.lease.decode_idle()
            self._work.wait(IDLE_WAIT_S)
        self._work.clear()  # before the drains: work put from here on sets it again
        self.turn_arrived.clear()  # likewise, once for every model's drain
        for engine in engines:
            engine._drain_inbox(block=False, clear_turn=False)
            engine.note_turn()
        self.admissions.admit(self.prefill_budget)
        for engine in engines:
            engine._step_batch(engine.scheduler.plan)
        self.steps += 1
