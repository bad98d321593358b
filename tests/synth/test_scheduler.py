"""Scheduler policy on hand-built results (no model, no torch tensors)."""

from __future__ import annotations

import random
import threading
import time
from typing import Any

import pytest

from synth.api import ListenerClock, Priority, SamplingParams, SegmentRequest
from synth.outlet import Outlet
from synth.request import SegmentState, Status
from synth.scheduler import EOS_DEFAULT, Scheduler, SchedulerConfig, SharedAdmissions, StepPlan, StepResult, StepUpdate


def _state(rid: str, *, cfg: bool = True, first: bool = True, wait: bool = True, max_new: int = 5,
           job: bool = False, listener: ListenerClock | None = None) -> SegmentState:
    req = SegmentRequest(request_id=rid, text="hi", sink=lambda _: None, first_audio_pending=first, may_wait=wait,
                         priority=Priority.JOB if job else Priority.LIVE, listener=listener)
    outlet = Outlet(rid, req.sink, threading.Lock(), {})
    return SegmentState(request=req, outlet=outlet, params=SamplingParams(seed=1), voice=None, text_ids=[1],
                        max_new_tokens=max_new, uses_cfg=cfg)


def _scheduler(**kw: float) -> Scheduler:
    cfg: dict[str, Any] = {"max_slots": 2, "max_rows": 4, "max_waiting": 2, "prefill_budget": 2, "usable_len": 100}
    cfg.update(kw)
    return Scheduler(SchedulerConfig(**cfg))


def _decoding(sched: Scheduler, plan: StepPlan) -> list[SegmentState | None]:
    """The segments a plan decodes, from its cond rows."""
    return [sched.owner_of(row) for row in plan.sample_rows[:plan.decode_segments].tolist()]


def _update(sched: Scheduler, plan: StepPlan, ids: list[int]) -> StepUpdate:
    return sched.update(plan, StepResult.in_plan_order(plan, ids))


def test_admits_into_lowest_rows_and_frees_on_eos() -> None:
    sched = _scheduler()
    a, b = _state("a"), _state("b", cfg=False)
    assert sched.add(a) and sched.add(b)
    plan = sched.schedule()
    assert plan.prefill == [a, b] and _decoding(sched, plan) == []
    assert a.rows == (0, 1) and b.rows == (2,) and sched.rows_span == 3
    update = _update(sched, plan, [10, 6562])  # b says EOS on its first token
    assert update.ended == [b] and b.status == Status.GENERATED and b.finish_reason == "eos"
    assert update.started == [a, b] and b.tokens == [6562]
    assert update.opened == [a, b]  # a's first valid id; b ended with none: its stream opens to end at once
    assert update.valid_ids.tolist() == [10] and update.stream_gens.tolist() == [a.gen]
    assert sched.rows_span == 2  # b's row is free at the next step
    plan = sched.schedule()
    assert _decoding(sched, plan) == [a] and plan.prefill == []
    assert plan.decode_rows.tolist() == [0, 1] and plan.decode_feed.tolist() == [0, 0]  # both rows feed a's id
    assert plan.decode_speech_pos.tolist() == [1, 1]


def test_a_segment_that_may_not_wait_counts_the_queue_ahead_of_it() -> None:
    """Submissions between two steps each see what the ones before them will take: with 2 slots, a third
    first segment that may not wait is refused even though no step has admitted the first two yet."""
    sched = _scheduler(max_slots=2, max_rows=8, max_waiting=8)
    a, b, c = _state("a", wait=False), _state("b", wait=False), _state("c", wait=False)
    assert sched.add(a) and sched.add(b)
    assert not sched.add(c) and c.status == Status.REJECTED
    sched.cancel(b)  # a cancelled waiter holds nothing
    d = _state("d", wait=False)
    assert sched.add(d)
    plan = sched.schedule()
    assert plan.prefill == [a, d]


def test_token_limit_ends_generation() -> None:
    sched = _scheduler()
    a = _state("a", max_new=2)
    sched.add(a)
    plan = sched.schedule()
    _update(sched, plan, [1])
    plan = sched.schedule()
    assert _update(sched, plan, [2]).ended == [a] and a.finish_reason == "max_tokens" and a.tokens == [1, 2]


def test_first_audio_pending_goes_first_and_budget_is_respected() -> None:
    sched = _scheduler(max_slots=4, max_rows=8, max_waiting=8, prefill_budget=1)
    late = _state("late", first=False)
    early = _state("early", first=True)
    sched.add(late)
    sched.add(early)
    assert sched.schedule().prefill == [early]
    assert sched.schedule().prefill == [late]


def test_busy_when_full_and_not_waiting_and_queue_bound() -> None:
    sched = _scheduler(max_slots=1, max_rows=2, max_waiting=1)
    assert sched.add(_state("a"))
    sched.schedule()
    assert not sched.add(_state("b", wait=False))  # no slot, may not wait
    assert sched.add(_state("c"))  # waits
    assert not sched.add(_state("d"))  # queue full
    assert sched.n_waiting == 1


def test_cancel_frees_rows_and_drops_in_flight_token() -> None:
    sched = _scheduler()
    a, b = _state("a"), _state("b")
    sched.add(a)
    sched.add(b)
    plan = sched.schedule()
    sched.cancel(a)  # lands mid-step
    _update(sched, plan, [5, 6])
    assert a.status == Status.CANCELLED and a.tokens == []
    assert sched.tokens_of(b) == [6] and sched.owner_of(0) is None and sched.owner_of(2) is b


def test_turbo_never_stops_on_first_token() -> None:
    sched = Scheduler(SchedulerConfig(max_slots=2, max_rows=2, max_waiting=2, prefill_budget=2, usable_len=100,
                                      first_token_may_be_eos=True))
    a = _state("a", cfg=False)
    sched.add(a)
    plan = sched.schedule()
    assert _update(sched, plan, [6562]).ended == []
    plan = sched.schedule()
    assert _update(sched, plan, [6562]).ended == [a]


def test_decoding_rows_advance_one_position_per_step_and_feed_their_cond_row() -> None:
    sched = _scheduler()
    a = _state("a", max_new=50)
    a.next_pos = 40  # after its prefix, text and BOS block
    sched.add(a)
    plan = sched.schedule()
    assert plan.decode_rows.size == 0 and plan.sample_next_pos.tolist() == [40]
    _update(sched, plan, [7])
    for step in range(3):
        plan = sched.schedule()
        assert plan.decode_rows.tolist() == list(a.rows) and plan.decode_pos.tolist() == [40 + step] * 2
        assert plan.decode_speech_pos.tolist() == [1 + step] * 2 and plan.longest_keys == 41 + step
        assert plan.rows_needed == 2 and plan.sample_next_pos.tolist() == [41 + step]
        _update(sched, plan, [8 + step])
    assert sched.tokens_of(a) == [7, 8, 9, 10]


def test_a_step_planned_before_the_last_was_read_drops_ids_of_a_segment_that_ended() -> None:
    """Overlapped steps: step k+1 is planned (and launched) before step k's ids are read. A segment that ends at
    step k was stepped at k+1 too; that id is dropped, also when its row was claimed again meanwhile."""
    sched = _scheduler(max_slots=1, max_rows=1)
    a, b = _state("a", cfg=False, max_new=2), _state("b", cfg=False, max_new=5)
    sched.add(a)
    first = sched.schedule()  # a's prefill: its first id
    second = sched.schedule()  # launched before `first` is read: a decodes, fed its first id on the device
    assert second.decode_rows.tolist() == [0] and second.decode_speech_pos.tolist() == [1]
    assert _update(sched, first, [1]).started == [a]
    third = sched.schedule()  # launched before `second` is read
    assert _update(sched, second, [2]).ended == [a] and a.tokens == [1, 2]
    sched.add(b)
    fourth = sched.schedule()  # b takes a's row while `third` (a's wasted step) is unread
    assert fourth.prefill == [b] and b.rows == a.rows
    stale = _update(sched, third, [3])
    assert stale.ended == [] and stale.started == [] and stale.valid_ids.size == 0 and a.tokens == [1, 2]
    assert _update(sched, fourth, [4]).started == [b] and sched.tokens_of(b) == [4]


def test_context_full_counts_the_position_of_the_step_read_not_of_the_steps_planned_since() -> None:
    sched = _scheduler(usable_len=12, max_rows=2)
    a = _state("a", cfg=False, max_new=50)
    a.next_pos = 8
    sched.add(a)
    plan = sched.schedule()
    _update(sched, plan, [1])  # next position 8: 8 + 1 < 12
    plans = [sched.schedule() for _ in range(4)]  # write 8, 9, 10, 11; each planned before the last is read
    assert [_update(sched, p, [2]).ended for p in plans[:3]] == [[], [], [a]]  # after writing 10, 11 + 1 >= 12
    assert a.finish_reason == "context_full" and a.tokens == [1, 2, 2, 2]
    assert _update(sched, plans[3], [3]).ended == []  # the step after: dropped


# --- live first, always: job segments (Priority.JOB) ------------------------------------------------------------

def _job(rid: str, **kw: Any) -> SegmentState:
    kw.setdefault("cfg", False)
    kw.setdefault("first", False)  # as the server submits them
    kw.setdefault("max_new", 50)
    return _state(rid, job=True, **kw)


def _run(sched: Scheduler, steps: int, ids: int = 7) -> None:
    """`steps` steps in which every sampled id is `ids` (no EOS)."""
    for _ in range(steps):
        plan = sched.schedule()
        _update(sched, plan, [ids] * plan.sample_rows.size)


def _job_decoding(sched: Scheduler, steps: int) -> SegmentState:
    """A job segment added to `sched`, then `steps` steps: it decodes."""
    job = _job("j")
    sched.add(job)
    _run(sched, steps)
    return job


def test_a_live_segment_is_admitted_before_job_segments_queued_earlier() -> None:
    sched = _scheduler(max_slots=1, max_rows=2, max_waiting=8, prefill_budget=1)
    jobs = [_job(f"j{i}") for i in range(3)]
    for job in jobs:
        assert sched.add(job)
    late = _state("late", cfg=False, first=False)  # even a live segment whose session has heard audio
    assert sched.add(late)
    assert sched.schedule().prefill == [late]
    assert all(job.status == Status.WAITING for job in jobs)


def test_within_a_priority_first_audio_goes_first_and_jobs_keep_their_order() -> None:
    sched = _scheduler(max_slots=8, max_rows=8, max_waiting=8, prefill_budget=8)
    order = [_job("j0"), _state("later", cfg=False, first=False), _job("j1"), _state("first", cfg=False)]
    for state in order:
        assert sched.add(state)
    assert [s.request_id for s in sched.schedule().prefill] == ["first", "later", "j0", "j1"]


def test_job_segments_take_no_row_a_waiting_live_segment_needs() -> None:
    """Three rows: a live CFG segment runs on two; a second one waits for two. A job needing one row must not
    take the free row from under it, though it would fit."""
    sched = _scheduler(max_slots=3, max_rows=3, max_waiting=8, prefill_budget=4)
    a = _state("a", max_new=2)
    assert sched.add(a)
    _run(sched, 1)
    b, job = _state("b"), _job("j")
    assert sched.add(b) and sched.add(job)
    plan = sched.schedule()
    assert plan.prefill == [] and b.status == job.status == Status.WAITING
    _update(sched, plan, [7])  # a reaches its limit: its rows free
    assert a.status == Status.GENERATED
    assert sched.schedule().prefill == [b, job]  # b first, then the job on the row left


def test_a_full_batch_of_jobs_and_one_live_arrival_preempts_the_job_with_the_fewest_ids() -> None:
    sched = _scheduler(max_slots=3, max_rows=3, max_waiting=8, prefill_budget=4)
    j0, j1, j2 = _job("j0"), _job("j1"), _job("j2")
    sched.add(j0)
    _run(sched, 2)
    sched.add(j1)
    sched.add(j2)
    _run(sched, 1)
    j2_row = j2.rows
    assert [sched.tokens_sampled(j) for j in (j0, j1, j2)] == [3, 1, 1]  # j1, j2 tie: the later admitted goes
    later = _job("later")  # queued before the preemption: the preempted job still goes ahead of it
    sched.add(later)
    live = _state("live", cfg=False, wait=False)  # may not wait: the job rows count as free for it
    assert sched.add(live)
    plan = sched.schedule()
    assert plan.prefill == [live] and plan.preempted == [j2] and live.rows == j2_row
    assert j2.status == Status.WAITING and j2.rows == () and j2.tokens == [] and sched.preemptions == 1
    assert _decoding(sched, plan) == [j0, j1]  # the preempted job's row does not decode in the live one's step
    _update(sched, plan, [1, 2, 3])
    assert sched.schedule().prefill == []  # no row free: the jobs wait
    sched.cancel(j0)  # a row frees: the preempted job restarts ahead of the one queued after it
    plan = sched.schedule()
    assert plan.prefill == [j2] and later.status == Status.WAITING
    assert _update(sched, plan, [9] * plan.sample_rows.size).started[-1] is j2 and sched.tokens_of(j2) == [9]


def test_a_live_segment_preempts_only_what_it_needs_and_never_a_live_one() -> None:
    sched = _scheduler(max_slots=4, max_rows=4, max_waiting=8, prefill_budget=4)
    live0 = _state("live0", cfg=False)
    sched.add(live0)
    _run(sched, 1)
    jobs = [_job(f"j{i}") for i in range(3)]
    for job in jobs:
        sched.add(job)
    _run(sched, 1)
    live1 = _state("live1")  # CFG: two rows
    sched.add(live1)
    plan = sched.schedule()
    assert plan.prefill == [live1] and len(plan.preempted) == 2 and live0.status == Status.RUNNING
    assert sum(job.status == Status.RUNNING for job in jobs) == 1 and sched.preemptions == 2


def test_a_live_segment_is_never_busy_while_jobs_hold_slots_or_fill_the_queue() -> None:
    sched = _scheduler(max_slots=2, max_rows=2, max_waiting=1)
    for i in range(2):
        assert sched.add(_job(f"j{i}"))
    sched.schedule()
    assert sched.add(_job("queued"))  # the queue's one place
    assert not sched.add(_job("refused"))  # queue full: a job is refused ...
    assert not sched.add(_job("no-wait", wait=False))  # ... and one that may not wait finds no free row
    assert sched.add(_state("live", cfg=False, wait=False))  # a live one is neither
    assert sched.add(_state("live-waits", cfg=False))
    live_busy = _state("live-no-wait", cfg=False, wait=False)
    assert not sched.add(live_busy)  # only live work ahead of it counts: two live segments take both rows
    assert live_busy.status == Status.REJECTED


def test_a_job_segments_ids_are_held_from_the_vocoder_stream_until_it_ends() -> None:
    sched = _scheduler(max_slots=2, max_rows=2, prefill_budget=2)
    live, job = _state("live", cfg=False, max_new=3), _job("job", max_new=3)
    sched.add(live)
    sched.add(job)
    plan = sched.schedule()
    update = _update(sched, plan, [11, 22])
    assert update.started == [live, job] and update.opened == [live]
    assert update.valid_ids.tolist() == [11] and update.stream_gens.tolist() == [live.gen]
    _run(sched, 1, ids=33)
    update = _update(sched, sched.schedule(), [44, 6562])
    assert update.valid_ids.tolist() == [44] and update.ended == [live, job] and job.tokens == [22, 33, 6562]
    assert job.n_valid == 2


def test_a_job_preempted_while_its_step_is_in_flight_drops_that_steps_ids() -> None:
    """Overlapped steps: the job's step k is launched, the live arrival takes its row at step k+1 (planned before
    step k's ids are read): those ids belong to nobody and are dropped."""
    sched = _scheduler(max_slots=1, max_rows=1)
    job = _job("job")
    sched.add(job)
    first = sched.schedule()
    _update(sched, first, [5])
    in_flight = sched.schedule()  # the job decodes
    live = _state("live", cfg=False)
    sched.add(live)
    preempting = sched.schedule()
    assert preempting.prefill == [live] and preempting.preempted == [job]
    stale = _update(sched, in_flight, [6])
    assert stale.ended == [] and stale.started == [] and stale.valid_ids.size == 0 and job.tokens == []
    assert _update(sched, preempting, [7]).started == [live] and sched.tokens_of(live) == [7]


def test_a_job_backlog_never_delays_a_live_first_segment_by_a_step() -> None:
    """A saturating job backlog and live arrivals at random steps (never more live work than the rows hold): every
    live segment is prefilled at the first step planned after it arrives, and the jobs still get work done."""
    rng = random.Random(36)
    sched = _scheduler(max_slots=4, max_rows=6, max_waiting=64, prefill_budget=2)
    jobs = [_job(f"j{i}", max_new=12) for i in range(40)]
    for job in jobs:
        assert sched.add(job)
    lives: list[SegmentState] = []
    for step in range(300):
        live_running = [s for s in sched.running if s.is_live]
        rows_live = sum(len(s.rows) for s in live_running)
        arrival = None
        if rng.random() < 0.3 and len(live_running) < 4:
            cfg = rng.random() < 0.5
            if rows_live + (2 if cfg else 1) <= 6:
                arrival = _state(f"live{step}", cfg=cfg, wait=False, max_new=rng.randint(2, 8))
                assert sched.add(arrival), arrival.request_id
                lives.append(arrival)
        plan = sched.schedule()
        if arrival is not None:
            assert arrival in plan.prefill, f"{arrival.request_id} waited behind job segments"
        _update(sched, plan, [7] * plan.sample_rows.size)
    assert len(lives) > 50 and sched.preemptions > 5  # the case was exercised
    assert sum(job.status == Status.GENERATED for job in jobs) > 10


def test_jobs_finish_in_the_rows_live_load_leaves_without_being_preempted() -> None:
    """Two rows always busy with live segments (each replaced as it ends), one left: the jobs run there one after
    another, to the end, and no live segment ever needs to take it."""
    sched = _scheduler(max_slots=3, max_rows=3, max_waiting=8, prefill_budget=3)
    jobs = [_job(f"j{i}", max_new=10) for i in range(3)]
    for job in jobs:
        assert sched.add(job)
    lives: list[SegmentState] = []
    for _ in range(40):
        while sum(live.status < Status.GENERATED for live in lives) < 2:
            lives.append(_state(f"live{len(lives)}", cfg=False, max_new=3))
            assert sched.add(lives[-1])
        plan = sched.schedule()
        _update(sched, plan, [7] * plan.sample_rows.size)
    assert [job.status for job in jobs] == [Status.GENERATED] * 3
    assert [len(job.tokens) for job in jobs] == [10] * 3 and sched.preemptions == 0 and len(lives) > 20


# --- several models: one admission budget across their schedulers ----------------------------------------------

def test_shared_admissions_go_by_rank_across_models_then_to_the_model_served_least_recently() -> None:
    a, b = _scheduler(max_slots=8, max_rows=8, max_waiting=16), _scheduler(max_slots=8, max_rows=8, max_waiting=16)
    shared = SharedAdmissions([a, b])
    burst = [_state(f"a{i}", cfg=False) for i in range(6)]
    for state in burst:
        a.add(state)
    assert shared.admit(1) == [1, 0]
    b_later, b_first = _state("b-later", cfg=False, first=False), _state("b-first", cfg=False)
    b.add(b_later)
    b.add(b_first)
    assert shared.admit(1) == [0, 1] and b.plan().prefill == [b_first]  # b's first audio, not a's burst
    assert shared.admit(1) == [1, 0]  # a's burst (first audio) before b's later segment
    assert shared.admit(2) == [2, 0]
    a.add(job := _job("a-job"))
    assert shared.admit(3) == [2, 1] and b.plan().prefill == [b_later]  # b's later segment before a's job
    assert job.status == Status.WAITING and all(s.status == Status.RUNNING for s in burst)
    assert shared.admit(8) == [1, 0] and job in a.running


def test_job_rows_sit_out_a_live_turns_first_ids_and_resume_where_they_stopped() -> None:
    """pause_jobs_below_ids=3: while a live first segment has < 3 valid ids, the job rows are left out of the plan
    (their positions stay) and no job segment is admitted; then they decode again from where they stopped. A live
    segment whose session has heard audio (not its first) pauses nothing; with 0 (a GPU) nothing ever pauses."""
    sched = _scheduler(max_slots=4, max_rows=4, max_waiting=8, prefill_budget=4, pause_jobs_below_ids=3)
    job = _job_decoding(sched, 3)
    job_row = job.rows[0]
    pos_before = int(sched.table.next_pos[job_row])
    live, queued = _state("live"), _job("queued")  # a CFG segment: its valid ids are counted on its cond row
    assert sched.add(live) and sched.add(queued)
    plan = sched.schedule()  # the live segment is prefilled; the job row sits out already
    assert plan.prefill == [live] and job_row not in plan.decode_rows.tolist() and plan.job_rows_paused == 1
    _update(sched, plan, [7] * plan.sample_rows.size)
    for _ in range(2):  # its 2nd and 3rd ids: the job still sits out, the queued job waits
        plan = sched.schedule()
        assert plan.decode_rows.tolist() == list(live.rows) and plan.prefill == [] and plan.job_rows_paused == 1
        _update(sched, plan, [7] * plan.sample_rows.size)
    assert int(sched.table.next_pos[job_row]) == pos_before and queued.status == Status.WAITING
    plan = sched.schedule()  # 3 valid ids: the job decodes again, at its old position, and the queued one starts
    assert job_row in plan.decode_rows.tolist() and plan.prefill == [queued] and plan.job_rows_paused == 0
    assert int(plan.decode_pos[plan.decode_rows.tolist().index(job_row)]) == pos_before
    assert sched.job_rows_paused == 3

    later = _scheduler(max_slots=4, max_rows=4, max_waiting=8, prefill_budget=4, pause_jobs_below_ids=3)
    job = _job_decoding(later, 2)
    later.add(_state("second", cfg=False, first=False))  # its session has heard audio
    assert job.rows[0] in later.schedule().decode_rows.tolist() and later.job_rows_paused == 0

    gpu = _scheduler(max_slots=4, max_rows=4, max_waiting=8, prefill_budget=4)
    job = _job_decoding(gpu, 2)
    gpu.add(_state("live", cfg=False))
    assert job.rows[0] in gpu.schedule().decode_rows.tolist() and gpu.job_rows_paused == 0


def test_job_rows_sit_out_while_a_live_listener_holds_less_than_the_margin() -> None:
    """pause_jobs_below_held_s=1: job rows decode beside a live segment (here not its session's first audio) only
    while its listener holds at least 1 s, and no job segment is admitted meanwhile; a listener that has reported
    nothing yet holds none. The rows resume at their old positions. A live segment without a clock, or one whose
    generation has ended, pauses nothing; with 0 (a GPU) nothing ever pauses."""
    clock = ListenerClock()
    sched = _scheduler(max_slots=4, max_rows=4, max_waiting=8, prefill_budget=4, pause_jobs_below_held_s=1.0)
    job = _job_decoding(sched, 2)
    job_row = job.rows[0]
    pos_before = int(sched.table.next_pos[job_row])
    live, queued = _state("live", cfg=False, first=False, max_new=50, listener=clock), _job("queued")
    assert sched.add(live) and sched.add(queued)
    plan = sched.schedule()  # nothing reported yet: the job row sits out, the queued job waits
    assert plan.prefill == [live] and job_row not in plan.decode_rows.tolist() and plan.job_rows_paused == 1
    _update(sched, plan, [7] * plan.sample_rows.size)
    clock.report(0.5, time.monotonic())  # it holds 0.5 s
    plan = sched.schedule()
    assert plan.decode_rows.tolist() == list(live.rows) and plan.prefill == [] and plan.job_rows_paused == 1
    _update(sched, plan, [7] * plan.sample_rows.size)
    assert int(sched.table.next_pos[job_row]) == pos_before and queued.status == Status.WAITING
    clock.report(5.0, time.monotonic())  # 5 s: the job decodes again, at its old position; the queued one starts
    plan = sched.schedule()
    assert job_row in plan.decode_rows.tolist() and plan.prefill == [queued] and plan.job_rows_paused == 0
    assert int(plan.decode_pos[plan.decode_rows.tolist().index(job_row)]) == pos_before
    _update(sched, plan, [7] * plan.sample_rows.size)
    clock.report(5.0, time.monotonic() - 4.5)  # 4.5 of its 5 s played: 0.5 s left, both job rows sit out
    plan = sched.schedule()
    assert plan.decode_rows.tolist() == list(live.rows) and plan.job_rows_paused == 2
    eos = [EOS_DEFAULT if sched.owner_of(row) is live else 7 for row in plan.sample_rows.tolist()]
    assert _update(sched, plan, eos).ended == [live]  # its generation ends: its listener no longer holds jobs back
    plan = sched.schedule()
    assert job_row in plan.decode_rows.tolist() and plan.job_rows_paused == 0 and sched.job_rows_paused == 4

    for held_s, clock_of_live in ((1.0, None), (0.0, ListenerClock())):  # no clock; a GPU
        other = _scheduler(max_slots=4, max_rows=4, max_waiting=8, prefill_budget=4, pause_jobs_below_held_s=held_s)
        job = _job_decoding(other, 2)
        other.add(_state("live", cfg=False, first=False, listener=clock_of_live))
        _run(other, 1)
        assert job.rows[0] in other.schedule().decode_rows.tolist() and other.job_rows_paused == 0


def test_a_jobs_only_step_is_marked_and_withdrawing_it_puts_its_rows_back_where_they_were() -> None:
    """A step is `jobs_only` when only job segments decode or are admitted (a live turn may stop it). Withdrawn, its
    decoding rows are planned again at the same positions, with the same speech positions, and the segments it
    admitted wait at their old place and are admitted again into the same rows (not counted as preemptions); a
    step with a live row or a live admission is not jobs-only, and withdrawing it is an error."""
    sched = _scheduler(max_slots=4, max_rows=4, max_waiting=8, prefill_budget=2, pause_jobs_below_ids=3)
    jobs = [_job("j1"), _job("j2")]
    later = _job("later")
    for job in (*jobs, later):
        sched.add(job)
    first = sched.schedule()  # the two jobs' admission: jobs-only too
    assert first.prefill == jobs and first.jobs_only
    sched.withdraw(first)
    assert all(job.status == Status.WAITING and job.rows == () for job in jobs) and not sched.running
    assert sched.preemptions == 0 and sched.job_steps_withdrawn == 1
    first = sched.schedule()  # admitted again, in their order, ahead of the job queued after them
    assert first.prefill == jobs and [job.rows for job in jobs] == [(0,), (1,)] and later.status == Status.WAITING
    _update(sched, first, [7] * first.sample_rows.size)
    sched.cancel(later)
    _run(sched, 2)
    plan = sched.schedule()
    assert plan.jobs_only and plan.decode_rows.size == 2
    sched.withdraw(plan)
    again = sched.schedule()
    assert again.jobs_only and sched.job_steps_withdrawn == 2
    assert again.decode_rows.tolist() == plan.decode_rows.tolist()
    assert again.decode_pos.tolist() == plan.decode_pos.tolist()
    assert again.decode_speech_pos.tolist() == plan.decode_speech_pos.tolist()
    _update(sched, again, [7] * again.sample_rows.size)
    assert [int(sched.table.n_tokens[j.rows[0]]) for j in jobs] == [4, 4]  # 1 from the prefill, 3 decoded

    sched.add(_state("second", cfg=False, first=False))  # a live segment, not its session's first audio
    plan = sched.schedule()
    assert plan.prefill and not plan.jobs_only
    _update(sched, plan, [7] * plan.sample_rows.size)
    plan = sched.schedule()  # the live row decodes beside the jobs'
    assert plan.decode_rows.size == 3 and not plan.jobs_only
    with pytest.raises(ValueError, match="jobs-only"):
        sched.withdraw(plan)


def test_a_live_turn_on_one_model_makes_every_models_job_rows_sit_out() -> None:
    """Two models' schedulers in one pause group (one step thread): a live first turn on model A makes model B's
    job rows sit out and holds B's queued jobs back until A's turn has its first ids; a scheduler outside the group
    never pauses for A. A model whose runner cannot leave rows out (pause_jobs_below_ids=0) never pauses its own,
    but its live turn still pauses the other's."""
    a = _scheduler(max_slots=2, max_rows=4, max_waiting=8, prefill_budget=2)  # pause 0: e.g. the analyzer model
    b = _scheduler(max_slots=4, max_rows=4, max_waiting=8, prefill_budget=4, pause_jobs_below_ids=3)
    alone = _scheduler(max_slots=4, max_rows=4, max_waiting=8, prefill_budget=4, pause_jobs_below_ids=3)
    for sched in (a, b):
        sched.join_pause_group([a, b])
    job_a, job_b, job_alone = _job("ja"), _job("jb"), _job("jalone")
    for sched, job in ((a, job_a), (b, job_b), (alone, job_alone)):
        sched.add(job)
        _run(sched, 2)
    live = _state("live")  # CFG, its session's first audio, on model A
    assert a.add(live)
    queued = _job("queued")
    assert b.add(queued)
    plan_a = a.schedule()
    assert plan_a.prefill == [live] and job_a.rows[0] in plan_a.decode_rows.tolist()  # A's own rows never pause
    _update(a, plan_a, [7] * plan_a.sample_rows.size)
    for _ in range(2):  # A's turn has 1, then 2 valid ids: B's job row sits out and B's queued job waits
        plan_b = b.schedule()
        assert plan_b.decode_rows.size == 0 and plan_b.job_rows_paused == 1 and queued.status == Status.WAITING
        plan_a = a.schedule()
        _update(a, plan_a, [7] * plan_a.sample_rows.size)
    plan_b = b.schedule()  # 3 valid ids: B decodes again and admits its queued job
    assert job_b.rows[0] in plan_b.decode_rows.tolist() and plan_b.prefill == [queued]
    assert b.job_rows_paused == 2 and a.job_rows_paused == 0
    alone_plan = alone.schedule()
    assert job_alone.rows[0] in alone_plan.decode_rows.tolist() and alone.job_rows_paused == 0


def test_a_turn_is_pending_from_its_queueing_to_its_first_valid_id() -> None:
    """`turn_pending` (what holds the vocoder's job renders back before a turn's stream opens): a live turn's first
    segment waiting in the queue, even behind a full batch, or holding rows with no valid id yet. Not a job, not a
    live segment whose session has heard audio, not a cancelled one, and not once the turn has a valid id."""
    sched = _scheduler(max_slots=1, max_rows=2, max_waiting=8, prefill_budget=1)
    sched.add(_job("j"))
    sched.add(_state("later", cfg=False, first=False))
    assert not sched.turn_pending()
    cancelled = _state("cancelled", cfg=False)
    sched.add(cancelled)
    assert sched.turn_pending()
    sched.cancel(cancelled)
    assert not sched.turn_pending()
    turn = _state("turn", cfg=False)
    sched.add(turn)
    assert sched.turn_pending()
    plan = sched.schedule()  # the turn is admitted (it ranks first): it holds rows, no id yet
    assert plan.prefill == [turn] and sched.turn_pending()
    _update(sched, plan, [6561 + 100] * plan.sample_rows.size)  # an id the vocoder does not take (not valid)
    assert sched.turn_pending()
    plan = sched.schedule()
    _update(sched, plan, [7] * plan.sample_rows.size)  # its first valid id: its stream opens
    assert not sched.turn_pending()


def test_a_later_segment_for_a_short_listener_is_pending_until_its_first_valid_id() -> None:
    """On a CPU (`pause_jobs_below_held_s`): between two segments of a turn no live stream is open in the vocoder,
    so a later segment whose listener holds less than the margin is pending (job renders are held back and stopped)
    while it waits or prefills, until its first valid id opens its stream. A listener holding more, and a GPU's
    config (0), hold nothing."""
    clock = ListenerClock()
    clock.report(3.0, time.monotonic())
    sched = _scheduler(max_slots=2, max_rows=4, max_waiting=8, prefill_budget=2, pause_jobs_below_held_s=1.0)
    sched.add(_job("j"))
    later = _state("later", cfg=False, first=False, listener=clock)
    sched.add(later)
    assert not sched.turn_pending()  # 3 s held
    clock.report(0.1, time.monotonic())
    assert sched.turn_pending()  # waiting, 0.1 s held
    plan = sched.schedule()
    assert later in plan.prefill and sched.turn_pending()  # holding rows, no valid id yet
    _update(sched, plan, [7] * plan.sample_rows.size)  # its first valid id: the vocoder has its stream now
    assert not sched.turn_pending()
    gpu = _scheduler(max_slots=2, max_rows=4, max_waiting=8, prefill_budget=2)
    gpu.add(_state("later", cfg=False, first=False, listener=clock))
    assert not gpu.turn_pending()
