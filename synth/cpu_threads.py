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
