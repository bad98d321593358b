"""Several models in one engine (synth/models.py) on tiny random weights: each model's seeded segments sample the ids
they sample in a one-model engine, a burst on one model does not hold back another's first segment, a model not
loaded is an error naming the loaded ones, and slots that do not fit the memory are refused naming the model.

The engine is stepped by hand on this thread (no audio: render_audio=False), so step counts are exact."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import replace

import pytest
import torch

from synth import default_voice, gpu
from synth.api import (
    EngineConfig,
    EngineConfigError,
    EngineError,
    EventKind,
    ModelOverrides,
    Priority,
    SamplingParams,
    SegmentRequest,
    StepStats,
    Variant,
)
from synth.engine import Engine
from synth.models import MultiEngine, build_engines, model_config

from tests.synth.conftest import TEST_CUDA_GRAPHS, TEST_DEVICE, ArrivesAtLayer, Collector, make_engine, tiny_bundle

MODELS: tuple[Variant, Variant] = ("turbo", "multilingual")
TEXTS = ["Hello there, how are you today?", "Short.", "The quick brown fox jumps over the lazy dog!",
         "Is this the real life? Is this just fantasy?", "One more, with feeling"]
MAX_STEPS = 300


def _engine(variant: Variant, max_slots: int) -> Engine:
    engine = make_engine(variant, render_audio=False, max_slots=max_slots, prefill_budget_segments=2)
    engine.voices.add(default_voice(tiny_bundle(variant)))
    return engine


def _multi(slots: dict[Variant, int], prefill_budget: int = 2) -> MultiEngine:
    engines = [_engine(model, n) for model, n in slots.items()]
    return MultiEngine(engines, EngineConfig(variant=engines[0].variant, models=tuple(slots),
                                             prefill_budget_segments=prefill_budget))


def _request(collector: Collector, model: Variant, i: int, *, first: bool = True,
             name: str = "") -> SegmentRequest:
    rid = name or f"{model}-{i}"
    params = replace(SamplingParams.defaults(model), seed=100 + 31 * i, max_new_tokens=10 + 3 * i)
    return SegmentRequest(request_id=rid, text=TEXTS[i % len(TEXTS)], params=params, sink=collector.sink_for(rid),
                          language="fr" if model == "multilingual" else None, model=model,
                          first_audio_pending=first)


def _generated(collector: Collector, rids: list[str]) -> bool:
    return all(EventKind.GENERATED in collector.kinds(rid) for rid in rids)


@pytest.fixture
def no_grad() -> Iterator[None]:
    with torch.no_grad():
        yield


@pytest.mark.usefixtures("no_grad")
def test_two_models_serve_mixed_sessions_each_with_the_tokens_of_its_own_one_model_engine() -> None:
    alone = Collector()
    for model in MODELS:  # the reference: each model's segments in an engine of that model alone
        engine = _engine(model, 3)
        for i in range(5):
            engine.submit(replace(_request(alone, model, i), model=None))
        for _ in range(MAX_STEPS):
            if _generated(alone, [f"{model}-{i}" for i in range(5)]) and engine.idle:
                break
            engine._step()

    got = Collector()
    multi = _multi({"turbo": 3, "multilingual": 3})
    stats: list[StepStats] = []
    multi.set_stats_listener(stats.append)
    rids = []
    for i in range(5):  # interleaved, more than either model's slots: both queue and batch at once
        for model in MODELS:
            multi.submit(_request(got, model, i))
            rids.append(f"{model}-{i}")
        multi._step()
    for _ in range(MAX_STEPS):
        if _generated(got, rids) and all(e.idle for e in multi.engines.values()):
            break
        multi._step()
    for rid in rids:
        assert got.tokens(rid) == alone.tokens(rid), f"{rid}: tokens differ from its one-model engine's"
    stepped = [s for s in stats if not s.renders_only]
    assert {s.model for s in stepped} == set(MODELS) and len(stepped) == len(MODELS) * multi.steps
    assert max(s.active_segments for s in stats if s.model == "multilingual") == 3  # it batched its own
    status = multi.status()
    models = status["models"]
    assert isinstance(models, dict) and set(models) == set(MODELS) and models["turbo"]["max_slots"] == 3
    assert status["variant"] == "turbo" and multi.max_slots == 6 and multi.max_slots_of("multilingual") == 3


@pytest.mark.usefixtures("no_grad")
def test_a_burst_on_one_model_does_not_hold_back_the_first_segment_of_another() -> None:
    """One admission per step: eight first segments on Turbo, then one on Multilingual. It is admitted at the
    next admission, not after Turbo's burst; and first audio goes before a later segment whatever the model."""
    got = Collector()
    multi = _multi({"turbo": 8, "multilingual": 2}, prefill_budget=1)
    for i in range(8):
        multi.submit(_request(got, "turbo", i))
    multi._step()  # the burst starts
    multi.submit(_request(got, "multilingual", 0))
    multi._step()
    ml = multi.engines["multilingual"].scheduler
    assert [s.request_id for s in ml.running] == ["multilingual-0"]
    assert len(multi.engines["turbo"].scheduler.running) == 1
    later = _request(got, "multilingual", 1, first=False)  # its session has heard audio: after first segments
    multi.submit(later)
    multi._step()
    assert len(ml.running) == 1 and len(multi.engines["turbo"].scheduler.running) == 2


@pytest.mark.usefixtures("no_grad")
def test_a_model_not_loaded_is_an_error_naming_it_and_the_loaded_ones() -> None:
    multi = _multi({"turbo": 1, "multilingual": 1})
    got = Collector()
    with pytest.raises(EngineError, match=r"'english' is not loaded; loaded: turbo, multilingual"):
        multi.submit(replace(_request(got, "turbo", 0), model="english"))
    with pytest.raises(EngineError, match="'english' is not loaded"):
        multi.export_voice("default", "english")
    single = _engine("turbo", 1)
    with pytest.raises(EngineError, match=r"'multilingual' is not loaded; loaded: turbo"):
        single.submit(_request(got, "multilingual", 0))
    assert got.events == {}


@pytest.mark.usefixtures("no_grad")
def test_a_request_id_is_unique_across_the_models() -> None:
    multi = _multi({"turbo": 1, "multilingual": 1})
    got = Collector()
    multi.submit(_request(got, "turbo", 0, name="same"))
    other = Collector()
    multi.submit(_request(other, "multilingual", 0, name="same"))
    assert other.kinds("same") == [EventKind.FAILED]
    multi.cancel("same")
    multi._step()
    assert got.kinds("same") == [EventKind.CANCELLED]


def test_the_models_share_one_memory_budget_and_slots_that_do_not_fit_are_refused_naming_the_model() -> None:
    bundles = {m: tiny_bundle(m) for m in MODELS}
    room = 100_000_000  # what the budget leaves after the device's headroom (kept once, not per model)
    base = EngineConfig(variant="turbo", models=MODELS, weights="random-tiny", device=TEST_DEVICE,
                        max_context_tokens=1024, cuda_graphs="off", max_slots=0,
                        memory_budget_gb=(gpu.HEADROOM_MIN_BYTES + room) / gpu.GB)
    plans = [e.slot_plan for e in build_engines(base, bundles, render_audio=False)]
    assert all(p is not None and p.auto and p.slots >= 1 for p in plans)
    # both on auto: the second plans against what the first left, and together they fit the room
    used = sum(p.kv_bytes + sum(v for k, v in p.reserved.items() if k != "headroom") for p in plans if p is not None)
    assert used <= room and plans[1] is not None and plans[1].budget_bytes < base.memory_budget_gb * gpu.GB
    with pytest.raises(EngineConfigError, match=r"^model multilingual: max_slots 1000 does not fit"):
        build_engines(replace(base, per_model={"multilingual": ModelOverrides(max_slots=1000)}), bundles,
                      render_audio=False)
    with pytest.raises(EngineConfigError, match="english, which is not loaded"):
        build_engines(replace(base, per_model={"english": ModelOverrides(max_slots=1)}), bundles, render_audio=False)


def test_build_engine_with_two_models_serves_each_on_its_own_thread_free_step_loop_and_vocoder() -> None:
    """The server's path: build_engine loads each model, a voice added once gets every model's own conditioning,
    start() warms both up, and a request of each model comes back with audio from its own vocoder family."""
    from synth import build_engine
    from synth.presets import synthetic_reference_wav

    config = EngineConfig(variant="turbo", models=MODELS, weights="random-tiny", device=TEST_DEVICE, max_slots=2,
                          max_context_tokens=1024, cuda_graphs=TEST_CUDA_GRAPHS, first_chunk_tokens=6,
                          chunk_schedule_tokens=(8, 16))
    multi = build_engine(config)
    assert isinstance(multi, MultiEngine) and multi.models == MODELS
    turbo, ml = multi.engines["turbo"], multi.engines["multilingual"]
    assert turbo.vocoder.meanflow and not ml.vocoder.meanflow and turbo.vocoder.s3gen is not ml.vocoder.s3gen
    multi.add_voice("clip", synthetic_reference_wav(24_000, seconds=6.0), 24_000)
    exported = {m: multi.export_voice("clip", m) for m in MODELS}
    assert exported["turbo"] != exported["multilingual"] and multi.export_voice("clip") == exported["turbo"]
    multi.import_voice("clip-copy", exported["multilingual"], "multilingual")
    assert "clip-copy" in ml.voice_ids() and "clip-copy" not in turbo.voice_ids()
    got = Collector()
    multi.start()
    try:
        assert multi.wait_ready(300), multi.failure
        requests = [replace(_request(got, "turbo", 0), voice_id="clip"),
                    replace(_request(got, "multilingual", 1), voice_id="clip-copy"), _request(got, "turbo", 2)]
        for request in requests:
            multi.submit(request)
        got.wait_done([r.request_id for r in requests], timeout_s=300)
    finally:
        multi.stop()
    for request in requests:
        assert got.kinds(request.request_id)[-1] == EventKind.DONE, got.kinds(request.request_id)
        assert sum(c.pcm.size for c in got.chunks(request.request_id)) > 0
    assert multi.status()["models"]["multilingual"]["slots_in_use"] == 0  # type: ignore[index]


def test_each_model_gets_its_own_overrides_and_the_analyzer_only_where_it_exists() -> None:
    config = EngineConfig(variant="turbo", models=MODELS, max_slots=4, weights="random-tiny", alignment_analyzer=True,
                          per_model={"multilingual": ModelOverrides(max_slots=2, weights="/ckpt/ml")})
    turbo, ml = model_config(config, "turbo"), model_config(config, "multilingual")
    assert (turbo.variant, turbo.max_slots, turbo.weights, turbo.alignment_analyzer) == ("turbo", 4, "random-tiny",
                                                                                         False)
    assert (ml.variant, ml.max_slots, ml.weights, ml.alignment_analyzer) == ("multilingual", 2, "/ckpt/ml", True)
    assert turbo.models == ml.models == () and not turbo.per_model


@pytest.mark.usefixtures("no_grad")
def test_a_live_turn_on_one_model_stops_and_pauses_another_models_job_steps_without_changing_any_tokens() -> None:
    """One thread steps both models, so a job step of Turbo delays a live turn of Multilingual. The live turn arrives
    while layer 1 of a Turbo jobs-only step runs: that step stops and is withdrawn, the Turbo job rows sit out the
    turn's first ids, and then they go on. Every segment samples the ids it samples in its one-model engine."""
    job = replace(_request(Collector(), "turbo", 2, name="job"), priority=Priority.JOB, first_audio_pending=False)
    job = replace(job, params=replace(job.params, max_new_tokens=60))
    live = _request(Collector(), "multilingual", 0, name="live")
    alone = Collector()
    for request in (job, live):  # the reference: each in an engine of its model alone
        engine = _engine(request.model or "turbo", 1)
        engine.submit(replace(request, model=None, sink=alone.sink_for(request.request_id)))
        for _ in range(MAX_STEPS):
            if _generated(alone, [request.request_id]) and engine.idle:
                break
            engine._step()

    got = Collector()
    multi = _multi({"turbo": 2, "multilingual": 2})
    turbo = multi.engines["turbo"]
    stats: list[StepStats] = []
    for engine in multi.engines.values():
        engine.set_stats_listener(stats.append)
    multi.submit(replace(job, sink=got.sink_for("job")))
    for _ in range(3):
        multi._step()
    assert len(turbo.scheduler.running) == 1
    assert all(e.turn_arrived is multi.turn_arrived for e in multi.engines.values())  # one signal for both
    arrival = ArrivesAtLayer(1, lambda: multi.submit(replace(live, sink=got.sink_for("live"))))
    multi.turn_arrived = arrival
    for engine in multi.engines.values():
        engine.turn_arrived = arrival
    multi._step()
    assert arrival.asked == 2 and turbo.scheduler.job_steps_withdrawn == 1
    multi._step()  # the live turn is admitted; Turbo's job row sits out
    assert turbo.scheduler.job_rows_paused == 1
    for _ in range(MAX_STEPS):
        if _generated(got, ["job", "live"]) and all(e.idle for e in multi.engines.values()):
            break
        multi._step()
    assert turbo.scheduler.job_rows_paused >= 2 and multi.engines["multilingual"].scheduler.job_rows_paused == 0
    for rid in ("job", "live"):
        assert got.tokens(rid) == alone.tokens(rid), f"{rid}: tokens differ from its one-model engine's"
    assert multi.status()["models"]["turbo"]["job_steps_withdrawn"] == 1  # type: ignore[index]
    # the metrics see every row that sat out, also in Turbo's iterations where all of them did (nothing launched)
    assert sum(s.job_rows_paused for s in stats if s.model == "turbo") == turbo.scheduler.job_rows_paused


@pytest.mark.usefixtures("no_grad")
def test_a_turn_on_one_model_is_pending_for_every_models_vocoder() -> None:
    """Every model's vocoder worker asks `Engine.turn_pending`: with several models on one thread (and on one CPU)
    a live turn's first segment on Multilingual holds Turbo's job renders back too, from its submit to its first
    valid id."""
    multi = _multi({"turbo": 2, "multilingual": 2})
    turbo, ml = multi.engines["turbo"], multi.engines["multilingual"]
    assert turbo.turn_group == ml.turn_group == [turbo, ml]
    got = Collector()
    multi.submit(replace(_request(got, "turbo", 0, name="job"), priority=Priority.JOB, first_audio_pending=False))
    multi._step()
    assert not turbo.turn_pending() and not ml.turn_pending()
    multi.submit(_request(got, "multilingual", 1, name="turn"))
    assert turbo.turn_pending() and ml.turn_pending()
    multi._step()  # drained and prefilled: pending until its first valid id is read
    for _ in range(MAX_STEPS):
        turn = ml.scheduler.running[0] if ml.scheduler.running else None
        if turn is not None and ml.scheduler.table.n_valid[turn.rows[0]] > 0:
            break
        assert turbo.turn_pending()
        multi._step()
    assert not turbo.turn_pending() and not ml.turn_pending()
