"""Scheduler policy on hand-built results (no model, no torch tensors)."""

from __future__ import annotations

import threading
from typing import Any

from synth.api import SamplingParams, SegmentRequest
from synth.outlet import Outlet
from synth.request import SegmentState, Status
from synth.scheduler import Scheduler, SchedulerConfig, StepPlan, StepResult, StepUpdate


def _state(rid: str, *, cfg: bool = True, first: bool = True, wait: bool = True, max_new: int = 5) -> SegmentState:
    req = SegmentRequest(request_id=rid, text="hi", sink=lambda _: None, first_audio_pending=first, may_wait=wait)
    outlet = Outlet(rid, req.sink, threading.Lock(), {})
    return SegmentState(request=req, outlet=outlet, params=SamplingParams(seed=1), voice=None, text_ids=[1],
                        max_new_tokens=max_new, uses_cfg=cfg)


def _scheduler(**kw: int) -> Scheduler:
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
