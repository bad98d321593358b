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

import ctypes
import functools
import glob
import logging
import os

import torch

log = logging.getLogger(__name__)

OMP_PAUSE_SOFT = 1  # omp_pause_resource_t: release threads, keep the runtime initialised


@functools.cache
def _libgomp() -> ctypes.CDLL | None:
    """The libgomp torch itself loaded (its wheel ships one), or None for other OpenMP runtimes / platforms."""
    candidates = sorted(glob.glob(os.path.join(os.path.dirname(torch.__file__), "lib", "libgomp*.so*")))
    for path in candidates + ["libgomp.so.1"]:
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
    released = lib.omp_pause_resource_all(OMP_PAUSE_SOFT) == 0
    if not released:
        log.debug("omp_pause_resource_all refused (called inside a parallel region?)")
    return released
