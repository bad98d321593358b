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
    """
    # One op above the parallel grain size (32768 elements): this thread's lazy OpenMP initialisation happens
    # now, not after our setting (a smaller op runs serially and initialises nothing).
    torch.ones(WARM_UP_ELEMENTS).add_(1)
    torch.set_num_threads(count)


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


class CoreLease:
    """The decode thread's CPU threads lent to the vocoder worker for the render ticks that need them most.

    The split above keeps the two teams from outnumbering the cores, but a static split wastes a core whenever
    one side waits, and the two sides do not gain alike from a second thread (measured on the 2-core machine,
    BENCHMARKS.md): a decode step of 1-8 rows is a chain of memory-bound matrix-vector products, 0-17 % faster
    on 2 threads in the server (alone in a process 1.2-1.6x, but not beside the renders: a decode that borrowed
    the idle vocoder's threads gained nothing from outside and cost 8 % of the audio at 4 sessions, BENCHMARKS.md,
    ninth session); a render is convolutions, 1.45x faster. So only the vocoder borrows, and only for a tick
    whose audio a listener is waiting for with nothing to play:

    - the decode thread is idle (no segment holds a slot): nothing is lost;
    - `urgent`: the tick renders a turn's first audio (a segment's first chunk for a listener that has been sent
      nothing yet: time to first audio). The decode pauses for that tick: its next step waits for the render.

    While lent, the decode thread does not compute, so the threads in use never exceed the split's total (the
    OpenMP-collapse rule above holds). A borrowing tick first waits for a running decode step to end (at most
    one step). The decode's own count never changes; a seeded stream's audio does not change with the
    vocoder's, because its reproducible render path is thread-count invariant (tests/synth/test_vocoder.py,
    test_invariant_ops.py).
    Disabled (`enabled=False`, or a GPU), every method is a no-op and both sides keep their own counts.
    """

    def __init__(self, decode_threads: int, vocoder_threads: int, enabled: bool) -> None:
        self.decode_threads = decode_threads
        self.vocoder_threads = vocoder_threads
        self.enabled = enabled
        self._cond = threading.Condition()
        self._decode_stepping = False  # the decode thread is inside a step
        self._decode_idle = True  # no segment holds a slot (the decode thread waits for work)
        self._lent = False  # the vocoder holds the decode's threads
        self.lent_ticks = 0  # ticks rendered on borrowed threads (tests and stats read it)
        self.decode_waits = 0  # decode steps that waited for a lent tick

    # --- the decode thread --------------------------------------------------------------------------------

    def decode_idle(self) -> None:
        """The decode thread has no work and is about to wait for some."""
        with self._cond:
            self._decode_idle = True

    @contextlib.contextmanager
    def decode_step(self) -> Iterator[None]:
        """Around one decode step with work: waits while the vocoder holds the decode's threads."""
        if not self.enabled:
            yield
            return
        with self._cond:
            self._decode_idle = False
            if self._lent:
                self.decode_waits += 1
                self._cond.wait_for(lambda: not self._lent)
            self._decode_stepping = True
        try:
            yield
        finally:
            with self._cond:
                self._decode_stepping = False
                self._cond.notify_all()

    # --- the vocoder thread --------------------------------------------------------------------------------

    @contextlib.contextmanager
    def render(self, urgent: bool) -> Iterator[int]:
        """Around one render tick; yields the thread count it runs with (set on the calling thread)."""
        borrow = False
        if self.enabled:
            with self._cond:
                borrow = urgent or self._decode_idle
                if borrow:
                    self._lent = True  # from now on no step starts; wait for the running one
                    self._cond.wait_for(lambda: not self._decode_stepping)
        if not borrow:
            yield self.vocoder_threads
            return
        threads = self.vocoder_threads + self.decode_threads
        torch.set_num_threads(threads)
        try:
            yield threads
        finally:
            torch.set_num_threads(self.vocoder_threads)
            with self._cond:
                self._lent = False
                self.lent_ticks += 1
                self._cond.notify_all()
