"""Admission and batching policy. No torch here: it hands the runner a StepPlan and reads back token ids.

- A fixed pool of cache rows; a CFG segment claims two, others one. Lowest free rows first, so the
  decode span [0, highest row in use] stays dense.
- Waiting segments whose session has heard nothing yet are admitted first (TTFB), then by arrival.
- At most `prefill_budget` admissions per iteration so running segments keep their pace.
- When no row is free, a request that may not wait (or any request once the queue is full) is refused.
"""

from __future__ import annotations

import heapq
import itertools
from collections.abc import Callable
from dataclasses import dataclass, field

from synth.request import SegmentState, Status

EOS_DEFAULT = 6562


@dataclass(slots=True)
class StepPlan:
    prefill: list[SegmentState] = field(default_factory=list)  # admitted this iteration, need prefill
    decode: list[SegmentState] = field(default_factory=list)  # running, with a pending token to feed

    @property
    def is_empty(self) -> bool:
        return not self.prefill and not self.decode

    @property
    def sampled(self) -> list[SegmentState]:
        """Order of the rows the runner samples (and of StepResult.token_ids): decode first, then prefill."""
        return self.decode + self.prefill


@dataclass(frozen=True, slots=True)
class StepResult:
    token_ids: list[int]  # one per StepPlan.sampled entry


@dataclass(frozen=True, slots=True)
class SchedulerConfig:
    max_slots: int
    max_rows: int
    max_waiting: int
    prefill_budget: int
    usable_len: int  # cache positions a row may fill
    eos_token: int = EOS_DEFAULT
    first_token_may_be_eos: bool = False  # Turbo never EOS-checks its first token


class Scheduler:
    def __init__(self, config: SchedulerConfig, on_release: Callable[[tuple[int, ...]], None] | None = None) -> None:
        self.config = config
        self._on_release = on_release  # told the rows of every segment that gives its rows back (any path)
        self._free_rows = list(range(config.max_rows))
        heapq.heapify(self._free_rows)
        self._row_owner: dict[int, SegmentState] = {}
        self.running: list[SegmentState] = []
        self._waiting: list[tuple[int, int, SegmentState]] = []  # heap of (priority, arrival, state)
        self._arrival = itertools.count()
        self._claims = itertools.count(1)

    # --- queries -----------------------------------------------------------------------------------------

    @property
    def n_waiting(self) -> int:
        return sum(1 for _, _, s in self._waiting if s.status == Status.WAITING)

    @property
    def idle(self) -> bool:
        return not self.running and self.n_waiting == 0

    @property
    def rows_span(self) -> int:
        """1 + the highest row in use (0 when none): the decode batch covers rows [0, rows_span)."""
        return max(self._row_owner, default=-1) + 1

    def owner_of(self, row: int) -> SegmentState | None:
        return self._row_owner.get(row)

    # --- lifecycle ---------------------------------------------------------------------------------------

    def add(self, state: SegmentState) -> bool:
        """Queue a segment. False means refused (BUSY): nothing free and it may not wait, or the queue is full."""
        # what the queue ahead of it will take counts as taken: a burst of submissions between two steps
        # must not each find the same free slot
        ahead = [s for _, _, s in self._waiting if s.status == Status.WAITING]
        slots_free = self.config.max_slots - len(self.running) - len(ahead)
        rows_free = len(self._free_rows) - sum(self._rows_needed(s) for s in ahead)
        can_start_now = slots_free > 0 and rows_free >= self._rows_needed(state)
        if not can_start_now and (not state.request.may_wait or self.n_waiting >= self.config.max_waiting):
            state.status = Status.REJECTED
            return False
        priority = 0 if state.request.first_audio_pending else 1
        heapq.heappush(self._waiting, (priority, next(self._arrival), state))
        return True

    def cancel(self, state: SegmentState, reason: str = "cancelled") -> None:
        if state.status == Status.RUNNING:
            self._release(state)
        state.status = Status.CANCELLED
        state.finish_reason = reason
        state.pending_token = None

    def schedule(self) -> StepPlan:
        plan = StepPlan(decode=[s for s in self.running if s.pending_token is not None])
        while self._waiting and len(plan.prefill) < self.config.prefill_budget:
            _, _, state = self._waiting[0]
            if state.status != Status.WAITING:  # cancelled while waiting
                heapq.heappop(self._waiting)
                continue
            if len(self.running) >= self.config.max_slots or len(self._free_rows) < self._rows_needed(state):
                break
            heapq.heappop(self._waiting)
            self._claim(state)
            plan.prefill.append(state)
        return plan

    def update(self, plan: StepPlan, result: StepResult) -> list[SegmentState]:
        """Record sampled ids; returns the segments whose generation ended this step (rows released)."""
        assert len(result.token_ids) == len(plan.sampled)
        ended: list[SegmentState] = []
        for state, token in zip(plan.sampled, result.token_ids, strict=False):
            if state.status != Status.RUNNING:  # cancelled during the step: its token is dropped
                continue
            assert all(self._row_owner.get(r) is state for r in state.rows), "stale slot"
            state.tokens.append(token)
            reason = self._stop_reason(state, token)
            if reason:
                state.finish_reason = reason
                state.pending_token = None
                state.status = Status.GENERATED
                self._release(state)
                ended.append(state)
            else:
                state.pending_token = token
        return ended

    # --- helpers -----------------------------------------------------------------------------------------

    def _stop_reason(self, state: SegmentState, token: int) -> str:
        is_first = len(state.tokens) == 1
        if token == self.config.eos_token and not (is_first and self.config.first_token_may_be_eos):
            return "eos"
        if len(state.tokens) >= state.max_new_tokens:
            return "max_tokens"
        if state.next_pos + 1 >= self.config.usable_len:
            return "context_full"
        return ""

    @staticmethod
    def _rows_needed(state: SegmentState) -> int:
        return 2 if state.uses_cfg else 1

    def _claim(self, state: SegmentState) -> None:
        rows = tuple(heapq.heappop(self._free_rows) for _ in range(self._rows_needed(state)))
        state.rows = rows
        state.gen = next(self._claims)
        state.status = Status.RUNNING
        for row in rows:
            self._row_owner[row] = state
        self.running.append(state)

    def _release(self, state: SegmentState) -> None:
        for row in state.rows:
            if self._row_owner.get(row) is state:
                del self._row_owner[row]
                heapq.heappush(self._free_rows, row)
        self.running.remove(state)
        if self._on_release is not None:
            self._on_release(state.rows)
