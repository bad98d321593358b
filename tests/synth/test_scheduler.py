"""Scheduler policy on hand-built results (no model, no torch tensors)."""

from __future__ import annotations

import threading
from typing import Any

from synth.api import SamplingParams, SegmentRequest
from synth.outlet import Outlet
from synth.request import SegmentState, Status
from synth.scheduler import Scheduler, SchedulerConfig, StepResult


def _state(rid: str, *, cfg: bool = True, first: bool = True, wait: bool = True, max_new: int = 5) -> SegmentState:
    req = SegmentRequest(request_id=rid, text="hi", sink=lambda _: None, first_audio_pending=first, may_wait=wait)
    outlet = Outlet(rid, req.sink, threading.Lock(), {})
    return SegmentState(request=req, outlet=outlet, params=SamplingParams(seed=1), voice=None, text_ids=[1],
                        max_new_tokens=max_new, uses_cfg=cfg)


def _scheduler(**kw: int) -> Scheduler:
    cfg: dict[str, Any] = {"max_slots": 2, "max_rows": 4, "max_waiting": 2, "prefill_budget": 2, "usable_len": 100}
    cfg.update(kw)
    return Scheduler(SchedulerConfig(**cfg))


def test_admits_into_lowest_rows_and_frees_on_eos() -> None:
    sched = _scheduler()
    a, b = _state("a"), _state("b", cfg=False)
    assert sched.add(a) and sched.add(b)
    plan = sched.schedule()
    assert plan.prefill == [a, b] and plan.decode == []
    assert a.rows == (0, 1) and b.rows == (2,) and sched.rows_span == 3
    ended = sched.update(plan, StepResult([10, 6562]))  # b says EOS on its first token
    assert ended == [b] and b.status == Status.GENERATED and b.finish_reason == "eos"
    assert sched.rows_span == 2  # b's row is free at the next step
    plan = sched.schedule()
    assert plan.decode == [a] and plan.prefill == []


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
    sched.update(plan, StepResult([1]))
    plan = sched.schedule()
    assert sched.update(plan, StepResult([2])) == [a] and a.finish_reason == "max_tokens"


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
    sched.update(plan, StepResult([5, 6]))
    assert a.status == Status.CANCELLED and a.tokens == []
    assert b.tokens == [6] and sched.owner_of(0) is None and sched.owner_of(2) is b


def test_turbo_never_stops_on_first_token() -> None:
    sched = Scheduler(SchedulerConfig(max_slots=2, max_rows=2, max_waiting=2, prefill_budget=2, usable_len=100,
                                      first_token_may_be_eos=True))
    a = _state("a", cfg=False)
    sched.add(a)
    plan = sched.schedule()
    assert sched.update(plan, StepResult([6562])) == []
    plan = sched.schedule()
    assert sched.update(plan, StepResult([6562])) == [a]
