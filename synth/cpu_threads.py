"""One OpenMP team per process on CPU: release a thread's pool when it hands the compute to the engine.

torch's CPU build runs its intra-op parallelism on GNU OpenMP (libgomp), and every thread that runs a parallel
torch op keeps its own pool of worker threads. When the process holds more libgomp threads than CPUs, libgomp
stops spinning between parallel regions ("throttled spin", GOMP_SPINCOUNT / OMP_WAIT_POLICY) and every region
pays a futex wake-up instead. The engine runs thousands of small regions per decode step, so a pool left
behind by the thread that loaded the model made every step about twice as slow on the 2-core machine
(measured in one process, alternating the same steps between the main thread and a fresh thread: BENCHMARKS.md).

`release_openmp_pool()` frees the calling thread's pool (OpenMP 5.0 `omp_pause_resource_all`, soft pause);
the next parallel op on that thread recreates it, so it is always safe. `Engine.start()` calls it on the
starting thread (it has loaded the weights and hands the CPU to the engine thread), and `Engine.add_voice()`
on the thread that ran the voice encoders (a server's long-lived worker thread).
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
import glob
import logging
import os
import threading
from collections.abc import Iterator
from dataclasses import dataclass

import torch

log = logging.getLogger(__name__)

OMP_PAUSE_SOFT = 1  # omp_pause_resource_t: release threads, keep the runtime initialised


@functools.cache
def _libgomp() -> ctypes.CDLL | None:
    """The libgomp torch itself loaded (its wheel ships one), or None for other OpenMP runtimes / platforms."""
    candidates = sorted(glob.glob(os.path.join(os.path.dirname(torch.__file__), "lib", "libgomp*.so*")))
    for path in [*candidates, "libgomp.so.1"]:
        try:
            lib = ctypes.CDLL(path, mode=os.RTLD_NOLOAD | os.RTLD_GLOBAL)  # only if already in the process
        except OSError:
            continue
        if hasattr(lib, "omp_pause_resource_all"):
            return lib
    return None


def release_openmp_pool() -> bool:
    """Free the calling thread's OpenMP worker threads; True if the runtime did (False: nothing to do here)."""
    lib = _libgomp()
    if lib is None:
        return False
    released = bool(lib.omp_pause_resource_all(OMP_PAUSE_SOFT) == 0)
    if not released:
        log.debug("omp_pause_resource_all refused (called inside a parallel region?)")
    return released


# --- thread budget -----------------------------------------------------------------------------------------
#
# Three threads compute at once: the decode (T3 steps), the vocoder worker (S3Gen renders) and, now and then, a
# voice preparation. Each thread that runs parallel torch ops keeps its own OpenMP team, so thread counts add
# up: with torch's default (one thread per core) on each, a 2-core machine runs 4+ compute threads, and when
# another process then takes a core, every parallel region waits at its barrier for a descheduled team member:
# a decode step measured 834 ms instead of 90 ms, a render 11.3 s instead of 1.5 s (issue 15). Split the cores
# instead: the decode and the vocoder each get about half, so together they never ask for more threads than
# there are cores, and on 2 cores each runs single-threaded (no barriers at all: a busy core then halves our
# speed instead of dividing it by 9). On 4 or more cores one is left for the event loop and the sockets.
# `--threads D,V` sets the two counts; `--threads N` splits N as if the machine had N cores
# (synth.api.ThreadBudget).

WARM_UP_ELEMENTS = 1 << 16
# How long a borrowing render waits for the decode thread to free the OpenMP team its last borrowed step left
# docked: the decode thread does so at its next step or when it goes idle, within its between-step work (ms).
# Past it the render goes on beside the team (slower, not wrong) and CoreLease.team_wait_timeouts counts it.
TEAM_WAIT_S = 0.05


def available_cores() -> int:
    """CPUs this process may run on (its affinity mask; cgroup quotas are not read)."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return os.cpu_count() or 1


def use_threads(count: int) -> None:
    """Set the calling thread's torch thread count (its own OpenMP team and MKL count), for this thread only.

    torch.set_num_threads sets the calling thread's OpenMP and MKL counts and a process-wide default; a thread's
    first parallel op initialises its count from that default. So a thread that sets its count before its first
    parallel op gets it overwritten by whatever another thread set meanwhile (measured: a decode thread set to 1
    ran with the vocoder's 2). Running one op first makes the count stick.

    That op runs with the process's default count, so it forms an OpenMP team of that size on this thread, which
    libgomp would keep docked for good: freed here. A docked team anywhere in the process makes every other team
    slower (more OpenMP threads than cores: libgomp stops spinning, module docstring): with the vocoder worker's
    team left docked by this op, the server's 2-thread decode step took 74 ms instead of 62 (CPU-4, BENCHMARKS.md).
    """
    # One op above the parallel grain size (32768 elements): this thread's lazy OpenMP initialisation happens
    # now, not after our setting (a smaller op runs serially and initialises nothing).
    torch.ones(WARM_UP_ELEMENTS).add_(1)
    torch.set_num_threads(count)
    release_openmp_pool()  # the next parallel op forms a team of `count` (none for 1)


@contextlib.contextmanager
def fixed_threads(count: int) -> Iterator[None]:
    """Run a block with `count` threads on this thread, then restore its count.

    For computations whose bits must not depend on the machine or its load: torch's FFTs and some GEMMs give other
    bits with other thread counts (a voice's conditioning computed with 1 and with 2 threads differs: measured),
    and MKL, unless told otherwise (torch.set_num_threads does), picks its thread count by the load.
    """
    saved = torch.get_num_threads()
    use_threads(count)
    try:
        yield
    finally:
        torch.set_num_threads(saved)


@dataclass(slots=True)
class LeasedStep:
    """One decode step under the lease: whether it runs on the vocoder's threads too, and (set by the engine) how
    long its decode part took, which teaches the lease whether borrowing pays on this machine."""

    rows_bucket: int  # segments decoding when the step began, rounded up to a power of two (0: not a T3 step)
    borrowed: bool = False
    could_borrow: bool = False  # the vocoder had nothing to render when the step began
    decode_ms: float | None = None


class BorrowGain:
    """Whether a decode step gets faster on the vocoder's threads too, learnt from the server's own steps.

    It differs by machine, so it is measured, not assumed: a one-row full-size Turbo step in the server went from
    106 ms on one thread to 62-64 ms on two on a 2-core Intel Xeon with AMX (CPU-4), and from 37-40 ms to 35-38 ms
    on a 2-core AMD EPYC (CPU-3), where borrowing then only made renders wait for steps that gained nothing (-8 %
    audio at 4 sessions; BENCHMARKS.md). Both server figures were taken with a stray OpenMP team docked on the
    vocoder thread (fixed since in use_threads: CPU-4's went from 74 to 62-64 ms), so CPU-3's is likely too low:
    one more reason to learn it on the machine at hand. Per row bucket it keeps a moving average of the
    decode time of steps that began with the vocoder idle, borrowed and not, and borrows while the borrowed ones
    are at least MIN_SPEEDUP faster. One such step in PROBE_EVERY takes the other choice, so both averages follow
    the machine's load and a step that has not been tried is tried (borrowing first).
    """

    MIN_SPEEDUP = 1.15
    PROBE_EVERY = 32
    WEIGHT = 0.25  # of the newest step in the moving average

    def __init__(self) -> None:
        self._ms: dict[tuple[int, bool], float] = {}
        self._chances = 0

    def choose(self, rows_bucket: int) -> bool:
        """For a step that could borrow: whether it does."""
        self._chances += 1
        own, lent = self._ms.get((rows_bucket, False)), self._ms.get((rows_bucket, True))
        if lent is None:
            return True
        if own is None:
            return False
        pays = own >= lent * self.MIN_SPEEDUP
        return pays != (self._chances % self.PROBE_EVERY == 0)

    def observe(self, rows_bucket: int, borrowed: bool, decode_ms: float) -> None:
        key = (rows_bucket, borrowed)
        before = self._ms.get(key)
        self._ms[key] = decode_ms if before is None else before + self.WEIGHT * (decode_ms - before)

    def estimates(self) -> dict[str, float]:
        """'rows/own' and 'rows/lent' -> ms, for the status."""
        return {f"{rows}/{'lent' if lent else 'own'}": round(ms, 1) for (rows, lent), ms in sorted(self._ms.items())}


def rows_bucket(rows: int) -> int:
    return 1 << max(0, rows - 1).bit_length() if rows > 0 else 0


class CoreLease:
    """The two compute threads lend each other their CPU threads while one of them has nothing to do.

    The split above keeps the two teams from outnumbering the cores, but a static split wastes a core whenever
    one side waits. Each side borrows the other's threads only while that side cannot use them, so the threads
    computing never exceed the split's total (the OpenMP-collapse rule above holds):

    - The vocoder borrows the decode's threads for a tick when the decode thread is idle (no segment holds a
      slot: nothing is lost), or when the tick is `urgent`: it renders a turn's first audio (a segment's first
      chunk for a listener that has been sent nothing yet: time to first audio). The decode pauses for that tick:
      its next step waits for the render. A borrowing tick first waits for a running decode step to end.
    - The decode borrows the vocoder's threads for a step (`decode_borrows`) when the vocoder worker has nothing to
      render, and only where that makes a step faster on this machine (BorrowGain, learnt from the steps). A
      render that becomes due meanwhile waits for that step to end (at most one step); the steps after it keep
      the decode's own count until the vocoder is idle again. A render is convolutions and gains from a second
      thread everywhere (1.45x on CPU-3, 1.64x on CPU-4); a decode step of a few rows is a chain of memory-bound
      matrix-vector products and gains on some machines (a one-row Turbo step 106 -> 62-64 ms in the server on
      CPU-4) and less on others (37-40 -> 35-38 ms on CPU-3, where borrowing cost 8 % of the audio at 4 sessions:
      renders waited for steps that gained nothing). BENCHMARKS.md has both.

    Whoever hands threads back frees the OpenMP team it formed with them, so no team is left docked beside the
    other side's (libgomp stops spinning once the process holds more OpenMP threads than CPUs). A borrowing render
    that becomes due between two steps (a turn's first chunk, usually) finds the last borrowed step's team still
    docked on the decode thread: it waits (TEAM_WAIT_S at most) until the decode thread, coming to its next step or
    going idle, has freed it; beside it a 16-token first render took 545-671 ms instead of 250-340 (CPU-4).
    Neither side's own count ever changes; seeded output does not change with the counts: T3's logits are the same
    bits on 1 and 2 threads (tests/synth/test_t3_runner.py) and the reproducible render path is thread-count
    invariant (tests/synth/test_vocoder.py, test_invariant_ops.py).
    Disabled (`enabled=False`, or a GPU), every method is a no-op and both sides keep their own counts.
    """

    def __init__(self, decode_threads: int, vocoder_threads: int, enabled: bool,
                 decode_borrows: bool = False) -> None:
        self.decode_threads = decode_threads
        self.vocoder_threads = vocoder_threads
        self.enabled = enabled
        self.decode_borrows = enabled and decode_borrows
        self._cond = threading.Condition()
        self._decode_stepping = False  # the decode thread is inside a step
        self._decode_idle = True  # no segment holds a slot (the decode thread waits for work)
        self._lent = False  # the vocoder holds the decode's threads
        self._decode_wants = False  # the decode thread waits for the threads the vocoder holds
        self._vocoder_idle = True  # the vocoder worker has nothing to render (it waits for tokens or time)
        self._borrowing = False  # the decode's running step holds the vocoder's threads
        self._decode_team = False  # the decode thread keeps a team of more than its own count (pool to free)
        self.lent_ticks = 0  # ticks rendered on borrowed threads (tests and stats read it)
        self.decode_waits = 0  # decode steps that waited for a lent tick
        self.borrowed_steps = 0  # decode steps run on the vocoder's threads too
        self.render_waits = 0  # render ticks that waited for a borrowed step to end
        self.team_wait_timeouts = 0  # borrowing ticks that ran beside a decode team not freed in TEAM_WAIT_S
        self.given_back = 0  # ticks that handed the decode's threads back before their end (`give_back`)
        self.gain = BorrowGain()

    # --- the decode thread --------------------------------------------------------------------------------

    def decode_idle(self) -> None:
        """The decode thread has no work and is about to wait for some (the vocoder may borrow its threads: no
        team of a borrowed step is left docked here)."""
        if self._decode_team:
            self._free_decode_team()
        with self._cond:
            self._decode_idle = True

    @contextlib.contextmanager
    def decode_step(self, rows: int = 0) -> Iterator[LeasedStep]:
        """Around one decode step with work (`rows` segments decoding; 0: other work on the decode thread, which
        never borrows): waits while the vocoder holds the decode's threads; with decode_borrows, runs on the
        vocoder's threads too while it has nothing to render and BorrowGain says it pays. The engine sets the
        yielded step's decode_ms."""
        step = LeasedStep(rows_bucket(rows))
        if not self.enabled:
            yield step
            return
        with self._cond:
            self._decode_idle = False
            if self._lent:
                self.decode_waits += 1
                if self._decode_team:  # the borrowing render waits for this team to go (TEAM_WAIT_S)
                    self._free_decode_team()
                self._decode_wants = True  # (a stoppable render hands the threads back early: `give_back`)
                self._cond.wait_for(lambda: not self._lent)
                self._decode_wants = False
            self._decode_stepping = True
            step.could_borrow = self.decode_borrows and rows > 0 and self._vocoder_idle
            step.borrowed = borrow = step.could_borrow and self.gain.choose(step.rows_bucket)
            self._borrowing = borrow
            self._decode_team |= borrow
        if borrow:
            torch.set_num_threads(self.decode_threads + self.vocoder_threads)
        elif self._decode_team:  # the vocoder has its threads back: free the team left docked here
            self._free_decode_team()
        try:
            yield step
        finally:
            if step.could_borrow and step.decode_ms is not None:
                self.gain.observe(step.rows_bucket, borrow, step.decode_ms)
            if borrow:
                torch.set_num_threads(self.decode_threads)
                with self._cond:
                    hand_back = not self._vocoder_idle  # a render waits for this step: free the team first
                if hand_back:
                    self._free_decode_team()
            with self._cond:
                self._decode_stepping = False
                self._borrowing = False
                self.borrowed_steps += borrow
                self._cond.notify_all()

    def _free_decode_team(self) -> None:
        """Free the OpenMP workers a borrowed step left docked on the decode thread: with them and a team on the
        vocoder thread, the process holds more OpenMP threads than cores and libgomp stops spinning (a 2-thread
        step 40 ms instead of 35, measured)."""
        release_openmp_pool()
        with self._cond:  # re-entrant: also called with it held
            self._decode_team = False
            self._cond.notify_all()

    # --- the vocoder thread --------------------------------------------------------------------------------

    def vocoder_idle(self) -> None:
        """The vocoder worker has nothing due and is about to wait; with decode_borrows, the decode's next steps
        run on its threads too until the next render."""
        with self._cond:
            self._vocoder_idle = True

    def give_back(self) -> bool:
        """Inside a render tick holding the decode's threads (vocoder thread): when the decode thread waits for them,
        hand them back now, and the tick goes on with the vocoder's own count (a job segment's render, between two
        of its stages: render_checkpoints). True when it did."""
        with self._cond:
            if not (self._lent and self._decode_wants):
                return False
        torch.set_num_threads(self.vocoder_threads)
        release_openmp_pool()  # the team formed with the decode's threads goes with them
        with self._cond:
            self._lent = False
            self.given_back += 1
            self._cond.notify_all()
        return True

    @contextlib.contextmanager
    def render(self, urgent: bool) -> Iterator[int]:
        """Around one render tick; yields the thread count it runs with (set on the calling thread)."""
        borrow = False
        if self.enabled:
            with self._cond:
                self._vocoder_idle = False
                borrow = urgent or self._decode_idle
                if borrow:
                    self._lent = True  # from now on no step starts; wait for the running one
                    self._cond.wait_for(lambda: not self._decode_stepping)
                    # and for the team a borrowed step left docked on the decode thread, which that thread frees
                    # as it sees the lend (its next step, or going idle); beside it this tick's team would run
                    # with libgomp not spinning (a 16-token first render 545-671 ms instead of 250-340, CPU-4)
                    if self._decode_team and not self._cond.wait_for(lambda: not self._decode_team, TEAM_WAIT_S):
                        self.team_wait_timeouts += 1
                elif self._borrowing:  # the running step holds this thread's cores: at most one step
                    self.render_waits += 1
                    self._cond.wait_for(lambda: not self._borrowing)
        if not borrow:
            yield self.vocoder_threads
            return
        threads = self.vocoder_threads + self.decode_threads
        torch.set_num_threads(threads)
        try:
            yield threads
        finally:
            torch.set_num_threads(self.vocoder_threads)
            if self.decode_borrows:  # the decode may form a team next: leave no docked one here
                release_openmp_pool()
            with self._cond:
                self._lent = False
                self.lent_ticks += 1
                self._cond.notify_all()
