"""release_openmp_pool frees the calling thread's OpenMP workers (and parallel ops still work afterwards)."""

from __future__ import annotations

import os
import time

import pytest
import torch

from synth.cpu_threads import _libgomp, release_openmp_pool, use_threads


def _threads() -> int:
    return len(os.listdir("/proc/self/task"))


@pytest.mark.skipif(_libgomp() is None or not os.path.isdir("/proc/self/task"),
                    reason="needs torch on GNU OpenMP and Linux /proc")
def test_release_frees_this_threads_workers() -> None:
    saved = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        x = torch.randn(512, 512)
        expected = x @ x
        with_pool = _threads()
        assert release_openmp_pool()
        deadline = time.monotonic() + 5
        while _threads() >= with_pool and time.monotonic() < deadline:
            time.sleep(0.01)
        assert _threads() == with_pool - 1  # the one worker of a 2-thread team is gone
        assert torch.equal(x @ x, expected)  # the next parallel op rebuilds the pool
    finally:
        torch.set_num_threads(saved)


def test_each_thread_keeps_its_own_count() -> None:
    """The engine sets the decode thread's and the vocoder thread's counts separately: a count set on one
    thread is that thread's (OpenMP's per-thread ICV, MKL's local count), not the other's."""
    import threading

    seen: dict[str, int] = {}
    ready = threading.Barrier(2)

    def run(name: str, count: int) -> None:
        use_threads(count)
        ready.wait()  # both have set theirs before either runs a parallel op
        torch.randn(512, 512) @ torch.randn(512, 512)
        seen[name] = torch.get_num_threads()

    threads = [threading.Thread(target=run, args=("a", 1)), threading.Thread(target=run, args=("b", 2))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert seen == {"a": 1, "b": 2}
