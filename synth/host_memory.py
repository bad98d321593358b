"""Host memory policy of a CPU engine: memory torch frees stays in the process, to be reused.

A render tick on the CPU allocates and frees hundreds of megabytes of temporaries (the batched prompt caches of
its streams alone: ~98 MB per Turbo stream, copied per tick). glibc's malloc hands freed memory back to the OS
(blocks above its mmap threshold are unmapped on free; a heap's free top is trimmed), so the next tick faults
every page of it in again, zero-filled by the kernel. Measured on the 2-core development VM (BENCHMARKS.md,
issue 15): one full-size Turbo tick of 4 first chunks spent 0.2-1.3 s of its 1.0-2.1 s in `torch.cat` of prompt
caches (~85,000 page faults per tick), and 0.02-0.1 s once freed memory is kept; a whole tick 1.4-2.7x faster.

`retain_freed_memory()` sets glibc's thresholds once for the process: allocations up to MMAP_THRESHOLD_BYTES come
from malloc's heaps, and a heap keeps up to TRIM_THRESHOLD_BYTES of free memory instead of returning it. The
process then holds its high-water mark of temporaries (bounded: the largest tick's) the way a GPU caching allocator
does. It changes no value computed, only where memory comes from. Not glibc (musl, macOS): nothing is changed.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging
import threading

log = logging.getLogger(__name__)

HOST_MEMORY_MODES = ("retain", "system")
# mallopt parameters (malloc.h)
M_TRIM_THRESHOLD = -1
M_MMAP_THRESHOLD = -3
MMAP_THRESHOLD_BYTES = 32 * 2**20  # glibc's largest allowed value (HEAP_MAX_SIZE / 2 on 64-bit)
TRIM_THRESHOLD_BYTES = 2**31 - 1  # mallopt takes a C int

_lock = threading.Lock()
_retained = False


def _libc_mallopt() -> ctypes._CFuncPtr | None:  # type: ignore[name-defined]
    name = ctypes.util.find_library("c")
    if name is None:
        return None
    try:
        libc = ctypes.CDLL(name)
        version = libc.gnu_get_libc_version  # glibc only: other C libraries' mallopt differ or do not exist
        version.restype = ctypes.c_char_p
        mallopt = libc.mallopt
    except (OSError, AttributeError):
        return None
    mallopt.argtypes = (ctypes.c_int, ctypes.c_int)
    mallopt.restype = ctypes.c_int
    return mallopt


def retain_freed_memory() -> bool:
    """Keep freed memory in this process from now on (glibc); True when in effect (also when already set)."""
    global _retained
    with _lock:
        if _retained:
            return True
        mallopt = _libc_mallopt()
        if mallopt is None:
            log.info("host memory: not glibc, malloc left as it is")
            return False
        if not (mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD_BYTES) and mallopt(M_TRIM_THRESHOLD, TRIM_THRESHOLD_BYTES)):
            log.warning("host memory: glibc refused mallopt; freed memory goes back to the OS as before")
            return False
        _retained = True
        log.info("host memory: freed memory is kept for reuse (allocations up to %d MB from the heap, no trimming "
                 "below %d MB)", MMAP_THRESHOLD_BYTES >> 20, TRIM_THRESHOLD_BYTES >> 20)
        return True


def retained() -> bool:
    return _retained
