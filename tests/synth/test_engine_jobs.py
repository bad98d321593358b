"""Live first, always, on a tiny Turbo with its vocoder: a live arrival takes a job segment's row at the next step,
and the preempted job restarts silently and speaks exactly as if it had never been preempted (synth/scheduler.py).

The engine is stepped by hand on this thread (its vocoder worker runs on its own), so step counts are exact."""

from __future__ import annotations

import time
from collections.abc import Iterator
from dataclasses import replace
from typing import Any

import numpy as np
import numpy.typing as npt
import pytest
import torch

from synth import default_voice
from synth.api import (
    OUTPUT_SAMPLE_RATE_HZ,
    AudioChunk,
    EventKind,
    ListenerClock,
    Priority,
    SamplingParams,
    SegmentEvent,
    SegmentRequest,
    StepStats,
)
from synth.engine import LIVE_HELD_FOR_JOB_ROWS_S, Engine
from synth.request import Status

from tests.synth.conftest import TEST_DEVICE, ArrivesAtLayer, Collector, make_engine, tiny_bundle

JOB_TEXTS = ["The first job segment, read back later.", "A second one, somewhat longer than that.",
             "And a third, to fill the batch."]
MAX_STEPS = 400


@pytest.fixture(params=["off", "on"], ids=["overlap-off", "overlap-on"])
def engine(request: pytest.FixtureRequest) -> Iterator[Engine]:
    eng = make_engine("turbo", render_audio=True, max_slots=3, overlap_steps=request.param, first_chunk_tokens=6,
                      chunk_schedule_tokens=(8, 16))
    voice = default_voice(tiny_bundle("turbo"))
    eng.voices.add(voice)
    assert eng.vocoder_worker is not None
    eng.vocoder_worker.start()
    eng.vocoder_worker.prepare_voice(voice)
    assert eng.vocoder_worker.wait_prepared([voice.key], 300)
    with torch.no_grad():
        yield eng
    eng.vocoder_worker.stop()


def _request(collector: Collector, rid: str, text: str, seed: int, priority: Priority,
             may_wait: bool = True) -> SegmentRequest:
    params = replace(SamplingParams.defaults("turbo"), seed=seed, max_new_tokens=20)
    return SegmentRequest(request_id=rid, text=text, params=params, sink=collector.sink_for(rid), priority=priority,
                          first_audio_pending=priority == Priority.LIVE, may_wait=may_wait)


def _job(collector: Collector, rid: str, k: int) -> SegmentRequest:
    return _request(collector, rid, JOB_TEXTS[k], seed=500 + k, priority=Priority.JOB)


def _step_until_done(engine: Engine, collector: Collector, request_ids: list[str]) -> None:
    """Step until T3 is done with them (and no step is in flight), then wait for their audio."""
    for _ in range(MAX_STEPS):
        if engine.scheduler.idle and engine._in_flight is None and all(
                EventKind.GENERATED in collector.kinds(rid) for rid in request_ids):
            collector.wait_done(request_ids)
            return
        engine._step()
    raise AssertionError({rid: collector.kinds(rid) for rid in request_ids})


def _each_alone(engine: Engine) -> Collector:
    """The references: job-0, job-1 and the live turn "Hello, caller." (seed 7), each alone in the engine."""
    alone = Collector()
    for rid, request in (("alone-0", _job(alone, "alone-0", 0)), ("alone-1", _job(alone, "alone-1", 1)),
                         ("alone-live", _request(alone, "alone-live", "Hello, caller.", 7, Priority.LIVE))):
        engine.submit(request)
        _step_until_done(engine, alone, [rid])
    return alone


def _two_jobs_decoding(engine: Engine, collector: Collector) -> None:
    """job-0 and job-1 submitted, then 4 steps: both decode."""
    engine.submit(_job(collector, "job-0", 0))
    engine.submit(_job(collector, "job-1", 1))
    for _ in range(4):
        engine._step()


def _pcm(collector: Collector, rid: str) -> npt.NDArray[np.float32]:
    chunks = collector.chunks(rid)
    assert [c.seq for c in chunks] == list(range(len(chunks))), "a chunk sequence restarted or has a gap"
    return np.concatenate([c.pcm for c in chunks])


def test_a_live_arrival_preempts_a_job_that_restarts_silently_with_the_same_tokens_and_audio(engine: Engine) -> None:
    alone = Collector()
    for k in range(3):  # each job alone: the reference
        engine.submit(_job(alone, f"alone-{k}", k))
        _step_until_done(engine, alone, [f"alone-{k}"])

    got = Collector()
    stats: list[StepStats] = []
    assert engine.vocoder_worker is not None
    engine.vocoder_worker.take_stats()  # (the references' renders are not this run's)
    engine.set_stats_listener(stats.append)
    engine.submit(_job(got, "job-0", 0))
    for _ in range(3):
        engine._step()
    engine.submit(_job(got, "job-1", 1))
    engine.submit(_job(got, "job-2", 2))
    for _ in range(3):
        engine._step()
    running = engine.scheduler.running
    assert len(running) == 3 and all(not s.is_live for s in running)  # the batch is full of jobs
    assert got.kinds("job-2") == []  # a job segment hears nothing while it may still be preempted
    # a live segment that may not wait: the jobs' slots count as free for it, so it is not refused BUSY ...
    engine.submit(_request(got, "live", "Hello, caller.", seed=7, priority=Priority.LIVE, may_wait=False))
    engine._step()
    # ... and it is prefilled at this very step, in the row of the job that had sampled the fewest ids
    live = next(s for s in engine.scheduler.running if s.is_live)
    assert live.request_id == "live" and engine.scheduler.preemptions == 1
    assert engine._live["job-2"].status == Status.WAITING and engine.status()["preemptions"] == 1
    _step_until_done(engine, got, ["job-0", "job-1", "job-2", "live"])

    assert EventKind.BUSY not in got.kinds("live")
    for k in range(3):
        rid = f"job-{k}"
        # STARTED and GENERATED once each, whatever was preempted: nothing of the attempt that did not finish
        assert got.kinds(rid) == [EventKind.STARTED, EventKind.GENERATED, EventKind.DONE], rid
        assert got.tokens(rid) == alone.tokens(f"alone-{k}"), f"{rid}: tokens differ from its run alone"
        assert np.array_equal(_pcm(got, rid), _pcm(alone, f"alone-{k}")), f"{rid}: audio differs from its run alone"
    events = [e for e in got.events["job-2"] if isinstance(e, SegmentEvent | AudioChunk)]
    assert isinstance(events[0], SegmentEvent) and events[0].kind == EventKind.STARTED
    # the steps' stats split the audio by who got it (the metrics' live and job audio per second); what was
    # rendered after T3's last step is recorded by the next idle iteration, as a renders-only record
    engine._step()
    assert not engine.vocoder_worker.has_stats() and stats[-1].renders_only and stats[-1].decode_rows == 0
    job_s = sum(s.job_audio_s for s in stats)
    all_s = sum(s.audio_s for s in stats)
    delivered_job_s = sum(_pcm(got, f"job-{k}").size for k in range(3)) / OUTPUT_SAMPLE_RATE_HZ
    assert job_s == pytest.approx(delivered_job_s) and delivered_job_s > 0
    assert all_s - job_s == pytest.approx(_pcm(got, "live").size / OUTPUT_SAMPLE_RATE_HZ)


@pytest.mark.skipif(TEST_DEVICE != "cpu", reason="a CPU policy: only the CPU's compact step leaves rows out "
                    "(on a GPU a job row costs a live turn next to nothing)")
def test_job_rows_sit_out_a_live_turns_first_ids_and_resume_with_the_same_tokens_and_audio(engine: Engine) -> None:
    """While a live turn's first segment samples the ids its first audio needs (the first chunk's and those the
    vocoder looks ahead at and holds back), the job rows are left out of the decode step (on a CPU each row costs
    the step time); they resume where they stopped, each with its own cache, generator and seen set untouched, so
    every segment samples and says exactly what it says alone."""
    assert engine.vocoder is not None and engine.first_audio_ids == 6 + engine.vocoder.latency_tokens
    assert engine.runner.compact_rows and engine.scheduler.config.pause_jobs_below_ids == engine.first_audio_ids
    alone = _each_alone(engine)
    got = Collector()
    _two_jobs_decoding(engine, got)
    jobs = list(engine.scheduler.running)
    assert len(jobs) == 2 and all(not s.is_live for s in jobs)
    engine.submit(_request(got, "live", "Hello, caller.", seed=7, priority=Priority.LIVE))
    engine._step()  # the live segment is prefilled into the free row: nothing is preempted
    live = next(s for s in engine.scheduler.running if s.is_live)
    before = [engine.scheduler.tokens_sampled(s) for s in jobs]
    paused_steps = 0
    while engine.scheduler.tokens_sampled(live) < 5 and live.status == Status.RUNNING:
        engine._step()
        paused_steps += 1
    assert paused_steps >= 3 and engine.scheduler.preemptions == 0
    # the job rows sat out those steps (one step already in flight may still have carried them)
    after = [engine.scheduler.tokens_sampled(s) for s in jobs]
    assert all(a <= b + 1 for a, b in zip(after, before, strict=True)), (before, after)
    assert engine.scheduler.job_rows_paused >= 2 * (paused_steps - 1)
    assert engine.status()["job_rows_paused"] == engine.scheduler.job_rows_paused
    _step_until_done(engine, got, ["job-0", "job-1", "live"])

    for rid, reference in (("job-0", "alone-0"), ("job-1", "alone-1"), ("live", "alone-live")):
        assert got.tokens(rid) == alone.tokens(reference), f"{rid}: tokens differ from its run alone"
        assert np.array_equal(_pcm(got, rid), _pcm(alone, reference)), f"{rid}: audio differs from its run alone"


@pytest.mark.skipif(TEST_DEVICE != "cpu", reason="a CPU policy: only the CPU's compact step leaves rows out "
                    "(on a GPU a job row costs a live segment next to nothing)")
def test_job_rows_sit_out_while_a_live_listener_runs_short_and_resume_with_the_same_tokens_and_audio(
        engine: Engine) -> None:
    """A live segment of a turn already heard (not its first audio, so the first-ids rule does not apply) whose
    listener holds less than LIVE_HELD_FOR_JOB_ROWS_S: the job rows sit out its steps; once its listener holds more,
    they decode beside it again. Every segment says exactly what it says alone."""
    assert engine.scheduler.config.pause_jobs_below_held_s == LIVE_HELD_FOR_JOB_ROWS_S > 0
    alone = _each_alone(engine)
    got = Collector()
    _two_jobs_decoding(engine, got)
    jobs = list(engine.scheduler.running)
    assert len(jobs) == 2 and all(not s.is_live for s in jobs)
    clock = ListenerClock()
    clock.report(0.2, time.monotonic())  # its listener holds 0.2 s: short
    engine.submit(replace(_request(got, "live", "Hello, caller.", 7, Priority.LIVE), first_audio_pending=False,
                          listener=clock))
    engine._step()  # the live segment is prefilled
    live = next(s for s in engine.scheduler.running if s.is_live)
    before = [engine.scheduler.tokens_sampled(s) for s in jobs]
    for _ in range(4):
        engine._step()
    after = [engine.scheduler.tokens_sampled(s) for s in jobs]
    assert live.status == Status.RUNNING and engine.scheduler.tokens_sampled(live) >= 4
    assert all(a <= b + 1 for a, b in zip(after, before, strict=True)), (before, after)  # one step in flight
    paused = engine.scheduler.job_rows_paused
    assert paused >= 2 * 3
    clock.report(30.0, time.monotonic())  # now it holds 30 s: the job rows decode beside it
    for _ in range(3):
        engine._step()
    assert live.status == Status.RUNNING, "the live segment ended too early for this test: pick a longer one"
    again = [engine.scheduler.tokens_sampled(s) for s in jobs]
    assert all(c >= a + 2 for c, a in zip(again, after, strict=True)), (after, again)
    assert engine.scheduler.job_rows_paused == paused
    _step_until_done(engine, got, ["job-0", "job-1", "live"])

    for rid, reference in (("job-0", "alone-0"), ("job-1", "alone-1"), ("live", "alone-live")):
        assert got.tokens(rid) == alone.tokens(reference), f"{rid}: tokens differ from its run alone"
        assert np.array_equal(_pcm(got, rid), _pcm(alone, reference)), f"{rid}: audio differs from its run alone"


def test_a_live_turn_arriving_mid_job_step_stops_it_and_every_segment_still_says_what_it_says_alone(
        engine: Engine) -> None:
    """A live turn's first segment submitted while layer 1 of a step of job rows only runs: that step stops there
    and is withdrawn (its rows decode it again later), so the turn is prefilled at the very next step. With
    overlapped steps the step read is the one before, so nothing stops. Either way tokens and audio are each
    segment's alone."""
    alone = _each_alone(engine)
    got = Collector()
    _two_jobs_decoding(engine, got)
    assert len(engine.scheduler.running) == 2
    live = _request(got, "live", "Hello, caller.", seed=7, priority=Priority.LIVE)
    arrival = ArrivesAtLayer(1, lambda: engine.submit(live))
    engine.turn_arrived = arrival
    engine._step()
    if engine.overlap_steps:  # no step is stopped: the runner never asks; the turn arrives after it
        assert arrival.asked == 0 and engine.scheduler.job_steps_withdrawn == 0
        engine.submit(live)
    else:
        assert arrival.asked == 2 and engine.has_inbox_items
        assert engine.scheduler.job_steps_withdrawn == 1 and engine.status()["job_steps_withdrawn"] == 1
    engine._step()  # the live turn is prefilled now
    assert any(s.request_id == "live" for s in engine.scheduler.running)
    _step_until_done(engine, got, ["job-0", "job-1", "live"])
    assert engine.scheduler.preemptions == 0

    for rid, reference in (("job-0", "alone-0"), ("job-1", "alone-1"), ("live", "alone-live")):
        assert got.tokens(rid) == alone.tokens(reference), f"{rid}: tokens differ from its run alone"
        assert np.array_equal(_pcm(got, rid), _pcm(alone, reference)), f"{rid}: audio differs from its run alone"


def test_a_withdrawn_prefill_is_not_counted_as_a_prefill() -> None:
    """A jobs-only step that prefills a job segment stops at layer 1 for a live turn and is withdrawn: its record
    counts the withdrawn step, not a prefill (the segment is prefilled, and counted, when it is admitted again)."""
    engine = make_engine("turbo", render_audio=False, max_slots=3, overlap_steps="off")
    engine.voices.add(default_voice(tiny_bundle("turbo")))
    got, stats = Collector(), list[StepStats]()
    engine.set_stats_listener(stats.append)
    engine.submit(_request(got, "job", "A job segment here.", seed=5, priority=Priority.JOB))
    engine.turn_arrived = ArrivesAtLayer(1, lambda: engine.submit(
        _request(got, "live", "Hello, caller.", seed=7, priority=Priority.LIVE)))
    with torch.no_grad():
        engine._step()  # the job's prefill: stopped at layer 1, withdrawn
        assert engine.scheduler.job_steps_withdrawn == 1
        _step_until_done(engine, got, ["job", "live"])
    (withdrawn,) = [s for s in stats if s.job_steps_withdrawn]
    assert (withdrawn.prefill_segments, withdrawn.decode_rows) == (0, 0)
    assert sum(s.prefill_segments for s in stats) == 2


def test_the_vocoder_hears_of_a_live_turn_from_its_submit_until_its_stream_opens(engine: Engine) -> None:
    """`turn_pending`, the vocoder worker's view: raised by the submit of a live turn's first segment (before the
    engine drains it), held while it is queued and prefilled, dropped once its first valid id has opened its stream
    (then the open stream holds job renders back). A job's submit or a later live segment raise nothing."""
    worker = engine.vocoder_worker
    assert worker is not None and not worker.turn_pending()
    got = Collector()
    engine.submit(_job(got, "job", 0))
    engine.submit(replace(_request(got, "later", "Later words.", 8, Priority.LIVE), first_audio_pending=False))
    assert not worker.turn_pending()
    engine._step()
    assert not worker.turn_pending()
    execute = engine.runner.execute
    seen_during_steps: list[bool] = []

    def execute_and_look(*args: Any, **kwargs: Any) -> Any:  # what the worker sees while a step runs
        seen_during_steps.append(worker.turn_pending())
        return execute(*args, **kwargs)

    engine.runner.execute = execute_and_look  # type: ignore[method-assign]
    engine.submit(_request(got, "turn", "Hello, caller.", seed=7, priority=Priority.LIVE))
    assert worker.turn_pending()  # from the submit on, before any step
    for _ in range(MAX_STEPS):
        engine._step()
        turn = next((s for s in engine.scheduler.running if s.request_id == "turn"), None)
        if turn is not None and engine.scheduler.table.n_valid[turn.rows[0]] > 0:  # read, and handed off
            break
        assert worker.turn_pending()
    assert not worker.turn_pending()
    assert seen_during_steps and all(seen_during_steps)  # the drain took it in; the steps up to its first id
    del engine.runner.execute
    _step_until_done(engine, got, ["job", "later", "turn"])


def test_a_turns_first_chunk_renders_at_the_ids_the_job_rows_sit_out_for(engine: Engine) -> None:
    """`Engine.first_audio_ids` is the vocoder's own rule: a stream with one id fewer has no first chunk to render,
    with that many it has (so the job rows sit out exactly until a turn's first audio can render)."""
    vocoder = engine.vocoder
    assert vocoder is not None
    voice = vocoder.prepare_voice(default_voice(tiny_bundle("turbo")).s3gen_ref)
    stream = vocoder.open(voice, seed=1)
    stream.prompt = vocoder.prompt_cache(voice)
    stream.add(list(range(engine.first_audio_ids - 1)), final=False)
    assert stream.next_job(engine.config.first_chunk_tokens) is None
    stream.add([7], final=False)
    assert stream.next_job(engine.config.first_chunk_tokens) is not None
