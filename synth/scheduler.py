"""Admission and batching policy. No torch here: it hands the runner a StepPlan and reads back the sampled ids.

- A fixed pool of cache rows; a CFG segment claims two, others one. Lowest free rows first, so the
  decode span [0, highest row in use] stays dense.
- Waiting segments are admitted by rank, then by arrival: LIVE before JOB (synth.api.Priority), and within each,
  those whose session has heard nothing yet first (TTFB). Strictly in that order: when the head cannot start,
  nothing behind it does, so a job segment only ever takes rows no live segment waits for.
- Live first, always: for a LIVE segment, rows and slots that JOB segments hold count as free. When one is at the
  head and only job rows would make room, the job segment that has sampled the fewest ids (the least work lost;
  the latest admitted of equals) is preempted at this step: its rows are released (a step of it still in flight is
  dropped by its claim id, as a cancel's) and it goes back into the queue at its old place, i.e. ahead of every job
  segment queued after it, to restart from scratch later. Seeded (every segment is, at submit), the restart
  samples the same ids. So a live segment waits at most for the step in flight, never for a job segment's end; and
  it is never refused BUSY because jobs hold rows. Nothing of a preempted attempt was delivered: a JOB segment's
  ids are held back from the vocoder stream until its generation ends (`RowTable.held`), and the engine sends its
  STARTED event then too. `preemptions` counts them (and each StepPlan's `preempted`).
- Job rows sit out a live turn's first ids (`pause_jobs_below_ids`, where the runner decodes any set of rows: the
  CPU): while a live segment that is its session's first audio has fewer valid ids than that, job rows are left out
  of the decode step and no job segment is admitted. On a CPU a step's cost grows with its rows (tiny Turbo, one
  thread: 1.9 ms for one row, 5.1 ms for five), so four job rows beside a live turn would stretch its first chunk's
  ids 2-3x. A row left out keeps its place: nothing of it advances (position, ids, and in the runner its cache,
  generator and seen set), so it resumes where it stopped and samples what it would have. It costs the jobs a live
  turn's first chunk of steps per turn, and nothing is lost. `job_rows_paused` counts the rows left out.
  They also sit out while a live segment decodes whose listener holds less than `pause_jobs_below_held_s` of audio
  (ListenerClock): on a CPU a live stream slower than real time runs dry the more for every job row beside it
  (full-size Turbo, one thread: 124 ms a step for one row, 165 for four), so there job rows decode only beside
  live ones that are ahead of their listeners, and in the time between turns.
  With several models on one thread (synth/models.py) their schedulers form one pause group (`join_pause_group`):
  a live turn's first ids on any model make every model's job rows sit out, since every model's step delays it.
- A step in which only job segments decode or are admitted is `jobs_only`: a runner that can stop between layers
  (the CPU's compact step) stops it when a live turn arrives mid-step, and `withdraw` puts it back as it was
  planned (the decoding rows at their positions, the admitted segments in the queue at their old place), so the
  turn waits for one layer of a job step, not for the whole step (~200 ms for four rows of the full-size model on
  one thread, more with a job's prefill). `job_steps_withdrawn` counts them.
- At most `prefill_budget` admissions per iteration so running segments keep their pace (live ones first, by the
  order above).
- When no row is free, a request that may not wait (or any request once the queue is full) is refused; for a LIVE
  one, job rows count as free and only live waiters as the queue.

Per-row counters live in a `RowTable` (synth/rows.py): planning a step and recording its ids are numpy operations
over the rows, whatever their number; Python runs per segment only for its admission, first id and end. A step's
inputs do not need the ids of the step before: a decoding row feeds the id its cond row sampled last, which the
runner reads from its device buffer, so the next step may be planned (and launched) before this one's ids are read
(the engine's overlapped steps). A row's ids that arrive after its segment ended or was cancelled are dropped: the
plan records each row's claim id, and a row released and claimed again has another.
"""

from __future__ import annotations

import heapq
import itertools
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field

import numpy as np

from synth.api import HARD_MAX_NEW_TOKENS, Priority
from synth.request import SPEECH_VOCAB_SIZE, SegmentState, Status
from synth.rows import FREE, IntArray, RowTable

EOS_DEFAULT = 6562
_NO_ROWS: IntArray = np.zeros(0, np.int64)
# A waiting segment's rank: (priority, 0 if its session has heard nothing yet else 1); lower is admitted first.
Rank = tuple[int, int]


@dataclass(slots=True)
class StepPlan:
    prefill: list[SegmentState] = field(default_factory=list)  # admitted this step: prefilled, first id sampled
    # every row that decodes this step (both rows of a CFG segment), ascending, and per row:
    decode_rows: IntArray = field(default_factory=lambda: _NO_ROWS)
    decode_pos: IntArray = field(default_factory=lambda: _NO_ROWS)  # the cache position its token is written to
    decode_speech_pos: IntArray = field(default_factory=lambda: _NO_ROWS)  # ids its segment sampled before this step
    decode_feed: IntArray = field(default_factory=lambda: _NO_ROWS)  # the row whose last sampled id it feeds
    # the cond rows whose ids the step reads back (decoding segments first, then the admitted ones), and per row:
    sample_rows: IntArray = field(default_factory=lambda: _NO_ROWS)
    sample_gens: IntArray = field(default_factory=lambda: _NO_ROWS)  # its claim id when planned
    sample_next_pos: IntArray = field(default_factory=lambda: _NO_ROWS)  # its next position after this step
    rows_needed: int = 0  # 1 + the highest row the step touches (0: none)
    longest_keys: int = 1  # keys the longest decoding row sees after its write
    decode_segments: int = 0
    decode: list[SegmentState] = field(default_factory=list)  # the decoding segments, with `track_states` only
    preempted: list[SegmentState] = field(default_factory=list)  # job segments whose rows this step took back
    job_rows_paused: int = 0  # job rows that sat out this step for a live turn's first ids
    # every decoding row and every admitted segment is a job's (and there is one): a live turn arriving mid-step may
    # stop it (T3Runner.execute's `interrupt`; then `Scheduler.withdraw`)
    jobs_only: bool = False

    @property
    def is_empty(self) -> bool:
        return not self.prefill and not self.decode_rows.size


@dataclass(frozen=True, slots=True)
class StepResult:
    ids: IntArray  # [>= plan.rows_needed] the id sampled for each row of the step (only sample_rows are read)

    @staticmethod
    def in_plan_order(plan: StepPlan, ids: Sequence[int]) -> StepResult:
        """A hand-built result (tests): `ids` in the order of `plan.sample_rows`."""
        out = np.zeros(max(plan.rows_needed, 1), np.int64)
        out[plan.sample_rows] = np.asarray(ids, np.int64)
        return StepResult(out)


class StepOutput:
    """A launched step (`runner.execute(plan)`): `result()` waits for its ids (the step's one host sync). The engine
    may launch the next step first, so that this read overlaps it (vLLM's async scheduling). `read` None: the runner
    stopped the step before it sampled (`interrupted`; a jobs-only step a live turn arrived during)."""

    __slots__ = ("_read", "plan", "prefill_ms")

    def __init__(self, plan: StepPlan, prefill_ms: float, read: Callable[[], IntArray] | None) -> None:
        self.plan = plan
        self.prefill_ms = prefill_ms
        self._read = read

    @property
    def interrupted(self) -> bool:
        return self._read is None

    def result(self) -> StepResult:
        if self._read is None:
            raise RuntimeError("an interrupted step has no ids (Scheduler.withdraw its plan)")
        return StepResult(self._read())


@dataclass(slots=True)
class StepUpdate:
    """What one step's ids did, for the engine to tell the listeners and the vocoder."""

    ended: list[SegmentState] = field(default_factory=list)  # generation ended (rows released), `tokens` set
    started: list[SegmentState] = field(default_factory=list)  # sampled their first id
    # first valid id, or ended without one (the vocoder stream opens); never a job segment (held until it ends)
    opened: list[SegmentState] = field(default_factory=list)
    # the claim id of each valid id read, but a job segment's (held until it ends) ...
    stream_gens: IntArray = field(default_factory=lambda: _NO_ROWS)
    valid_ids: IntArray = field(default_factory=lambda: _NO_ROWS)  # ... and the id, in plan order


@dataclass(frozen=True, slots=True)
class SchedulerConfig:
    max_slots: int
    max_rows: int
    max_waiting: int
    prefill_budget: int
    usable_len: int  # cache positions a row may fill
    eos_token: int = EOS_DEFAULT
    first_token_may_be_eos: bool = False  # Turbo never EOS-checks its first token
    max_tokens: int = HARD_MAX_NEW_TOKENS  # the most ids one segment may sample
    # job rows sit out while a live turn's first segment has fewer valid ids than this (0: never; only for a runner
    # that decodes any set of rows and leaves the others as they are: T3Runner.compact_rows)
    pause_jobs_below_ids: int = 0
    # ... and while a live segment decodes whose listener holds less than this much audio (0: never; a listener that
    # has reported nothing yet counts as holding none): on a CPU, job rows beside it slow the ids it runs short of
    pause_jobs_below_held_s: float = 0.0
    # keep `StepPlan.decode` and each running segment's `tokens` up to date every step (a Python loop over the
    # rows: only for the alignment analyzer, which reads them)
    track_states: bool = False


class Scheduler:
    def __init__(self, config: SchedulerConfig, on_release: Callable[[tuple[int, ...]], None] | None = None,
                 claims: Iterator[int] | None = None) -> None:
        """`claims`: where claim ids come from (an engine with several models gives every scheduler the same
        counter, so that a claim id names one segment engine-wide: the vocoder worker's streams are keyed by it)."""
        self.config = config
        self._on_release = on_release  # told the rows of every segment that gives its rows back (any path)
        self._free_rows = list(range(config.max_rows))
        heapq.heapify(self._free_rows)
        self._row_owner: dict[int, SegmentState] = {}
        self.table = RowTable(config.max_rows, config.max_tokens)
        self._row_index = np.arange(config.max_rows)
        self.running: list[SegmentState] = []
        self._waiting: list[tuple[Rank, int, SegmentState]] = []  # heap of (rank, arrival, state)
        self._arrival = itertools.count()
        self._claims = claims if claims is not None else itertools.count(1)
        self._admitted: list[SegmentState] = []  # this step's admissions, until `plan`
        self._preempted: list[SegmentState] = []  # this step's preemptions, until `plan`
        self.preemptions = 0  # job segments preempted so far
        self.job_rows_paused = 0  # job rows that sat out a step for a live turn's first ids or a short listener
        self.job_steps_withdrawn = 0  # jobs-only steps stopped mid-step for a live turn (`withdraw`), so far
        self._pause_group: list[Scheduler] = [self]  # whose live segments make this one's job rows sit out
        self._may_pause = config.pause_jobs_below_ids > 0 or config.pause_jobs_below_held_s > 0

    # --- queries -----------------------------------------------------------------------------------------

    @property
    def n_waiting(self) -> int:
        if not self._waiting:
            return 0
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

    def tokens_of(self, state: SegmentState) -> list[int]:
        """The ids a segment sampled so far (read back), while it runs; afterwards `state.tokens`."""
        if state.status == Status.RUNNING and state.rows:
            return self.table.tokens_of(state.rows[0])
        return list(state.tokens)

    def tokens_sampled(self, state: SegmentState) -> int:
        return len(self.tokens_of(state))

    # --- lifecycle ---------------------------------------------------------------------------------------

    def add(self, state: SegmentState) -> bool:
        """Queue a segment. False means refused (BUSY): nothing free and it may not wait, or the queue is full.
        For a LIVE segment what JOB segments hold or wait for counts as free: they give way to it."""
        if state.max_new_tokens > self.config.max_tokens:
            raise ValueError(f"max_new_tokens {state.max_new_tokens} > the scheduler's {self.config.max_tokens}")
        live = state.is_live
        # what the queue ahead of it will take counts as taken: a burst of submissions between two steps
        # must not each find the same free slot
        ahead = [s for _, _, s in self._waiting if s.status == Status.WAITING and (s.is_live or not live)]
        holding = [s for s in self.running if s.is_live] if live else self.running
        slots_free = self.config.max_slots - len(holding) - len(ahead)
        rows_free = (self.config.max_rows - sum(len(s.rows) for s in holding)
                     - sum(self._rows_needed(s) for s in ahead))
        can_start_now = slots_free > 0 and rows_free >= self._rows_needed(state)
        if not can_start_now and (not state.request.may_wait or len(ahead) >= self.config.max_waiting):
            state.status = Status.REJECTED
            return False
        state.queued = next(self._arrival)
        heapq.heappush(self._waiting, (self._rank(state), state.queued, state))
        return True

    def cancel(self, state: SegmentState, reason: str = "cancelled") -> None:
        if state.status == Status.RUNNING:
            self._release(state)
        state.status = Status.CANCELLED
        state.finish_reason = reason

    def schedule(self) -> StepPlan:
        """This step's plan: admissions (at most `prefill_budget`, in rank order), then every decoding row advances
        one position (numpy over the rows)."""
        admitted = 0
        while admitted < self.config.prefill_budget and self.next_rank() is not None:
            self.admit_next()
            admitted += 1
        return self.plan()

    def next_rank(self) -> Rank | None:
        """The rank of the segment `admit_next` would admit now; None when the head of the queue cannot start at
        this step (no room, even by preempting job segments for a live one) or nothing waits."""
        while self._waiting:
            _, _, state = self._waiting[0]
            if state.status != Status.WAITING:  # cancelled while waiting
                heapq.heappop(self._waiting)
                continue
            return self._rank(state) if self._can_start(state) else None
        return None

    def admit_next(self) -> SegmentState:
        """Admit the head of the queue (call after `next_rank` said it can start), preempting job segments
        first where a live one needs their rows. It is prefilled at this step."""
        _, _, state = heapq.heappop(self._waiting)
        while not self._fits(state):
            self._preempt(min((s for s in self.running if not s.is_live),
                              key=lambda s: (int(self.table.n_tokens[s.rows[0]]), -s.gen)))
        self._claim(state)
        self._admitted.append(state)
        return state

    def plan(self) -> StepPlan:
        """The step's plan, after this step's admissions: every decoding row advances one position, and the
        admitted segments (claimed, not decoding yet) are prefilled."""
        table = self.table
        admitted, self._admitted = self._admitted, []
        decoding = table.decoding
        paused = 0
        if self._may_pause and table.held[decoding].any() and self._jobs_sit_out():
            paused = int(np.count_nonzero(decoding & table.held))
            decoding = decoding & ~table.held
            self.job_rows_paused += paused
        rows = np.flatnonzero(decoding)
        jobs_only = (rows.size > 0 or bool(admitted)) and not any(s.is_live for s in admitted) and (
            not rows.size or bool(table.held[rows].all()))
        feed = table.feed[rows]
        pos = table.next_pos[rows]
        speech_pos = table.launched[rows]
        table.next_pos[rows] = pos + 1
        table.launched[rows] = speech_pos + 1
        cond = rows[feed == rows]
        sample_rows = cond
        rows_needed = int(rows[-1]) + 1 if rows.size else 0
        if admitted:
            sample_rows = np.concatenate([cond, np.array([s.rows[0] for s in admitted], np.int64)])
            rows_needed = max(rows_needed, max(max(s.rows) for s in admitted) + 1)
        plan = StepPlan(prefill=admitted, decode_rows=rows, decode_pos=pos, decode_speech_pos=speech_pos,
                        decode_feed=feed, sample_rows=sample_rows, sample_gens=table.gen[sample_rows],
                        sample_next_pos=table.next_pos[sample_rows], rows_needed=rows_needed,
                        longest_keys=int(pos.max()) + 1 if pos.size else 1, decode_segments=int(cond.size),
                        preempted=self._preempted, job_rows_paused=paused,
                        jobs_only=jobs_only and not self._preempted)
        self._preempted = []
        for state in admitted:  # their first id comes from this step's prefill: they decode from the next
            table.start_decoding(state.rows)
        if self.config.track_states:
            plan.decode = [self._row_owner[row] for row in cond.tolist()]
        return plan

    def withdraw(self, plan: StepPlan) -> None:
        """A jobs-only step that the runner stopped before it sampled (a live turn arrived mid-step), undone. Its
        decoding rows are put back at the positions they had when it was planned, so they decode that step again
        later, from the same ids (the runner wrote nothing but their keys and values at those positions, which the
        step writes again, with the same values, before any attention reads them). The segments it admitted give
        their rows back and wait at their old place in the queue, to be prefilled again (not a preemption: nothing
        of them was sampled). Call it before the next plan."""
        if not plan.jobs_only:
            raise ValueError("only a jobs-only step (job segments decoding or admitted, no live one) may be withdrawn")
        rows = plan.decode_rows
        if not np.array_equal(self.table.next_pos[rows], plan.decode_pos + 1):
            raise RuntimeError("the withdrawn step's rows moved since it was planned")
        self.table.next_pos[rows] = plan.decode_pos
        self.table.launched[rows] = plan.decode_speech_pos
        for state in plan.prefill:
            self._back_in_queue(state)
        self.job_steps_withdrawn += 1

    def join_pause_group(self, schedulers: Sequence[Scheduler]) -> None:
        """The schedulers of models that share one step thread: a live turn's first ids on any of them make this
        one's job rows sit out (at this scheduler's own `pause_jobs_below_ids`)."""
        self._pause_group = [self, *(s for s in schedulers if s is not self)]

    def update(self, plan: StepPlan, result: StepResult) -> StepUpdate:
        """Record a step's ids (numpy over the rows); segments whose generation ended release their rows."""
        table, config = self.table, self.config
        rows = plan.sample_rows
        next_pos = plan.sample_next_pos
        live = table.gen[rows] == plan.sample_gens  # ended or cancelled since it was planned: its id is dropped
        if not live.all():
            rows, next_pos = rows[live], next_pos[live]
        if not rows.size:
            return StepUpdate()
        ids = result.ids[rows]
        count = table.n_tokens[rows] + 1
        table.n_tokens[rows] = count
        table.tokens[rows, count - 1] = ids
        valid = ids < SPEECH_VOCAB_SIZE
        n_valid = table.n_valid[rows] + valid
        table.n_valid[rows] = n_valid
        streamed = valid & ~table.held[rows]  # a job segment's ids go to the vocoder when it ends
        eos = ids == config.eos_token
        if config.first_token_may_be_eos:
            eos &= count > 1
        maxed = count >= table.max_new[rows]
        full = next_pos + 1 >= config.usable_len
        ended = eos | maxed | full
        first = count == 1
        opened = ((valid & (n_valid == 1)) | (ended & (n_valid == 0))) & ~table.held[rows]
        update = StepUpdate(stream_gens=table.gen[rows][streamed], valid_ids=ids[streamed])
        owner = self._row_owner
        if first.any():
            update.started = [owner[row] for row in rows[first].tolist()]
        if opened.any():
            update.opened = [owner[row] for row in rows[opened].tolist()]
        if config.track_states:
            for row, token in zip(rows.tolist(), ids.tolist(), strict=True):
                owner[row].tokens.append(token)
        if ended.any():
            for row, is_eos, is_maxed in zip(rows[ended].tolist(), eos[ended].tolist(), maxed[ended].tolist(),
                                             strict=True):
                state = owner[row]
                state.finish_reason = "eos" if is_eos else "max_tokens" if is_maxed else "context_full"
                self._release(state)
                state.status = Status.GENERATED
                update.ended.append(state)
        return update

    # --- helpers -----------------------------------------------------------------------------------------

    @staticmethod
    def _rows_needed(state: SegmentState) -> int:
        return 2 if state.uses_cfg else 1

    @staticmethod
    def _rank(state: SegmentState) -> Rank:
        return int(state.request.priority), 0 if state.request.first_audio_pending else 1

    def _fits(self, state: SegmentState) -> bool:
        return len(self.running) < self.config.max_slots and len(self._free_rows) >= self._rows_needed(state)

    def _jobs_sit_out(self) -> bool:
        """A live turn's first segment holds rows and has fewer valid ids than `pause_jobs_below_ids`, or a live
        segment decodes whose listener holds less than `pause_jobs_below_held_s`, here or on another model of the
        pause group."""
        below, held_s = self.config.pause_jobs_below_ids, self.config.pause_jobs_below_held_s
        if below > 0 and any(s.first_turn_below(below) for s in self._pause_group):
            return True
        return held_s > 0 and any(s.live_listener_short(held_s) for s in self._pause_group)

    def live_listener_short(self, held_s: float) -> bool:
        """A live segment holds rows here and its listener holds less than `held_s` seconds of audio (or has not
        reported any yet). One clock read per live segment (`ListenerClock`: the session writes it on its thread)."""
        now_s = time.monotonic()
        return any(state.is_live and _listener_short(state, held_s, now_s) for state in self.running)

    def turn_pending(self) -> bool:
        """A live segment someone waits for is on its way to the vocoder (waiting in the queue, or holding rows with
        no valid id yet: its stream is not open, so the vocoder worker does not know of it): a turn's first segment,
        or (`pause_jobs_below_held_s`, a CPU) a later one whose listener holds less than that (between two segments
        of a turn no live stream is open, and a job render started then would hold the next one's first chunk). A
        turn's first segment ranks first (Priority.LIVE, first audio), so for it only the head of the queue is
        looked at."""
        if self.first_turn_below(1):
            return True
        while self._waiting and self._waiting[0][2].status != Status.WAITING:  # cancelled while waiting
            heapq.heappop(self._waiting)
        if self._waiting and self._waiting[0][0] == (int(Priority.LIVE), 0):
            return True
        held_s = self.config.pause_jobs_below_held_s
        return held_s > 0 and self._live_coming_short(held_s)

    def _live_coming_short(self, held_s: float) -> bool:
        """A live segment not with the vocoder yet (waiting, or holding rows before its first valid id) whose
        listener clock holds less than `held_s` seconds of audio (or has not reported any)."""
        now_s = time.monotonic()
        table = self.table
        # (a live segment's cond row, ids not held back, before its first valid id: numpy over rows, not a loop)
        starting = np.flatnonzero((table.gen != FREE) & ~table.held & (table.feed == self._row_index)
                                  & (table.n_valid == 0))
        coming = [s for _, _, s in self._waiting if s.status == Status.WAITING and s.is_live]
        coming += [owner for row in starting if (owner := self._row_owner.get(int(row))) is not None and owner.is_live]
        return any(_listener_short(state, held_s, now_s) for state in coming)

    def first_turn_below(self, ids: int) -> bool:
        """A live turn's first segment holds rows here and has sampled fewer than `ids` valid ids."""
        table = self.table
        return bool((table.first_audio & (table.n_valid < ids)).any())

    def _can_start(self, state: SegmentState) -> bool:
        """A free slot and rows now, or for a live segment, once job segments give theirs back. A job segment
        waits while job rows sit out."""
        if not state.is_live:
            return self._fits(state) and not self._jobs_sit_out()
        if self._fits(state):
            return True
        jobs = [s for s in self.running if not s.is_live]
        return bool(jobs) and len(self.running) - len(jobs) < self.config.max_slots and (
            len(self._free_rows) + sum(len(s.rows) for s in jobs) >= self._rows_needed(state))

    def _preempt(self, state: SegmentState) -> None:
        """A running job segment gives its rows back and waits again at its old place, to start from scratch."""
        if state in self._admitted:
            self._admitted.remove(state)
        self._back_in_queue(state)
        self._preempted.append(state)
        self.preemptions += 1

    def _back_in_queue(self, state: SegmentState) -> None:
        """A running segment gives its rows back and waits again at its old place (`queued`), to start from scratch."""
        self._release(state)
        state.status = Status.WAITING
        state.rows, state.tokens, state.n_valid, state.finish_reason = (), [], 0, ""
        state.prefix = state.aligner = None
        heapq.heappush(self._waiting, (self._rank(state), state.queued, state))

    def _claim(self, state: SegmentState) -> None:
        rows = tuple(heapq.heappop(self._free_rows) for _ in range(self._rows_needed(state)))
        state.rows = rows
        state.gen = next(self._claims)
        state.status = Status.RUNNING
        state.tokens = []
        for row in rows:
            self._row_owner[row] = state
        self.table.claim(rows, state.gen, state.next_pos, state.max_new_tokens, held=not state.is_live,
                         first_audio=state.is_live and state.request.first_audio_pending)
        self.running.append(state)

    def _release(self, state: SegmentState) -> None:
        """Its rows go back to the pool; what it sampled is copied out of the table first."""
        cond = state.rows[0]
        if self._row_owner.get(cond) is state:
            state.tokens = self.table.tokens_of(cond)
            state.n_valid = int(self.table.n_valid[cond])
        for row in state.rows:
            if self._row_owner.get(row) is state:
                del self._row_owner[row]
                heapq.heappush(self._free_rows, row)
        self.table.release(state.rows)
        self.running.remove(state)
        if self._on_release is not None:
            self._on_release(state.rows)


class SharedAdmissions:
    """One step's admissions for an engine with several models, one scheduler each (synth/models.py), at most one
    budget in all: always the best rank any model can start now (live before job, then first audio first: TTFB-first
    across models), and among equal ranks the model served least recently, so a burst on one model never holds
    another's first segment back by more than one admission. Each model's rows and slots stay its own."""

    def __init__(self, schedulers: Sequence[Scheduler]) -> None:
        self.schedulers = list(schedulers)
        self._served = [0] * len(self.schedulers)  # the admission count at each model's last admission (0: never)
        self._admissions = itertools.count(1)

    def admit(self, budget: int) -> list[int]:
        """Admit up to `budget` segments across the models (then each model's `Scheduler.plan`); how many each."""
        counts = [0] * len(self.schedulers)
        while sum(counts) < budget:
            heads = [(rank, self._served[i], i) for i, sched in enumerate(self.schedulers)
                     if (rank := sched.next_rank()) is not None]
            if not heads:
                break
            _, _, best = min(heads)
            self.schedulers[best].admit_next()
            self._served[best] = next(self._admissions)
            counts[best] += 1
        return counts


def _listener_short(state: SegmentState, held_s: float, now_s: float) -> bool:
    """The segment's listener clock holds less than `held_s` seconds of audio, or has reported none; a segment
    without a clock holds nothing back. One clock read (`ListenerClock`: the session writes it on its thread)."""
    listener = state.request.listener
    if listener is None:
        return False
    held = listener.buffered_s(now_s)
    return held is None or held < held_s
