"""release_openmp_pool frees the calling thread's OpenMP workers (and parallel ops still work afterwards)."""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Callable

import pytest
import torch

from synth.cpu_threads import CoreLease, _libgomp, release_openmp_pool, use_threads


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


def _in_thread(fn: Callable[[], None]) -> threading.Thread:
    thread = threading.Thread(target=fn, daemon=True)
    thread.start()
    return thread


def test_an_urgent_tick_waits_for_the_running_step_then_holds_the_decodes_threads() -> None:
    """The order of events across the two threads: the running decode step ends before the borrowed tick starts;
    the tick runs with both counts; the next step waits until the tick has ended; the vocoder's count is restored."""
    lease = CoreLease(decode_threads=1, vocoder_threads=1, enabled=True)
    order: list[str] = []
    in_step, end_step, in_tick, end_tick = (threading.Event() for _ in range(4))
    counts: dict[str, int] = {}

    def decode() -> None:
        with lease.decode_step():
            order.append("step 1")
            in_step.set()
            end_step.wait(5)
        in_tick.wait(5)
        with lease.decode_step():  # the tick holds the threads: waits for it
            order.append("step 2")

    def vocoder() -> None:
        use_threads(1)
        in_step.wait(5)
        with lease.render(urgent=True) as threads:
            order.append("tick")
            counts["yielded"], counts["inside"] = threads, torch.get_num_threads()
            in_tick.set()
            end_tick.wait(5)
            order.append("tick end")
        counts["after"] = torch.get_num_threads()

    threads = [_in_thread(decode), _in_thread(vocoder)]
    in_step.wait(5)
    time.sleep(0.1)
    assert order == ["step 1"]  # the tick waits for the running step
    end_step.set()
    in_tick.wait(5)
    time.sleep(0.1)
    assert order == ["step 1", "tick"]  # the next step waits for the tick
    end_tick.set()
    for thread in threads:
        thread.join(5)
    assert order == ["step 1", "tick", "tick end", "step 2"]
    assert counts == {"yielded": 2, "inside": 2, "after": 1}
    assert lease.lent_ticks == 1 and lease.decode_waits == 1


def test_a_tick_borrows_only_when_urgent_or_from_an_idle_decode() -> None:
    lease = CoreLease(decode_threads=1, vocoder_threads=1, enabled=True)
    saved = torch.get_num_threads()
    try:
        use_threads(1)
        with lease.render(urgent=False) as threads:  # nothing has stepped yet: the decode is idle
            assert threads == 2
        with lease.decode_step():
            pass
        with lease.render(urgent=False) as threads:  # the decode has work (between steps): keeps its threads
            assert threads == 1 and torch.get_num_threads() == 1
        lease.decode_idle()
        with lease.render(urgent=False) as threads:
            assert threads == 2
        assert lease.lent_ticks == 2
        off = CoreLease(decode_threads=1, vocoder_threads=1, enabled=False)
        off.decode_idle()
        with off.render(urgent=True) as threads:
            assert threads == 1 and torch.get_num_threads() == 1
        assert off.lent_ticks == 0
    finally:
        torch.set_num_threads(saved)
