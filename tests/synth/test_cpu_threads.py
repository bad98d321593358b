"""release_openmp_pool frees the calling thread's OpenMP workers (and parallel ops still work afterwards)."""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Callable

import pytest
import torch

from synth import cpu_threads
from synth.cpu_threads import BorrowGain, CoreLease, _libgomp, release_openmp_pool, rows_bucket, use_threads


def _threads() -> int:
    return len(os.listdir("/proc/self/task"))


needs_gomp_and_proc = pytest.mark.skipif(_libgomp() is None or not os.path.isdir("/proc/self/task"),
                                         reason="needs torch on GNU OpenMP and Linux /proc")


@needs_gomp_and_proc
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


def _settled_threads() -> int:
    """The thread count once it has not changed for 0.2 s (at most 5 s)."""
    count, since, deadline = _threads(), time.monotonic(), time.monotonic() + 5
    while time.monotonic() - since < 0.2 and time.monotonic() < deadline:
        time.sleep(0.02)
        if (now := _threads()) != count:
            count, since = now, time.monotonic()
    return count


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


def test_a_tick_hands_the_decodes_threads_back_when_the_decode_waits_for_them() -> None:
    """`give_back` (a stoppable job render, between two stages): nothing while the decode does not wait; once a
    step waits for the lent threads, the tick drops to its own count and the step runs while the tick goes on."""
    lease = CoreLease(decode_threads=1, vocoder_threads=1, enabled=True)
    saved = torch.get_num_threads()
    stepped = threading.Event()
    try:
        use_threads(1)
        with lease.render(urgent=False) as threads:  # the decode is idle: the tick borrows its threads
            assert threads == 2 and torch.get_num_threads() == 2
            assert not lease.give_back()  # nobody waits for them
            assert torch.get_num_threads() == 2

            def decode() -> None:
                with lease.decode_step():
                    stepped.set()

            thread = _in_thread(decode)
            deadline = time.monotonic() + 5
            while not lease.give_back():  # the step waits (decode_waits) until the tick hands them back
                assert time.monotonic() < deadline and not stepped.is_set()
                time.sleep(0.01)
            assert stepped.wait(5)  # the step ran inside the tick
            assert torch.get_num_threads() == 1  # and the tick goes on with its own count
            thread.join(5)
        assert torch.get_num_threads() == 1
        assert lease.given_back == 1 and lease.decode_waits == 1 and lease.lent_ticks == 1
    finally:
        torch.set_num_threads(saved)


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


def test_the_decode_borrows_the_idle_vocoders_threads_and_a_render_waits_for_that_step() -> None:
    """decode_borrows: a step that begins while the vocoder has nothing to render runs on both counts (the decode's
    own count after it); a render that becomes due meanwhile waits for that step, then the next step keeps its own
    count. rows=0 (a voice preparation) never borrows."""
    lease = CoreLease(decode_threads=1, vocoder_threads=1, enabled=True, decode_borrows=True)
    order: list[str] = []
    counts: dict[str, int] = {}
    in_step, end_step, in_tick = (threading.Event() for _ in range(3))

    def decode() -> None:
        use_threads(1)
        with lease.decode_step(rows=1) as step:
            counts["borrowed"] = torch.get_num_threads()
            order.append("borrowed step")
            in_step.set()
            end_step.wait(5)
            step.decode_ms = 10.0
        counts["after"] = torch.get_num_threads()
        in_tick.wait(5)
        with lease.decode_step(rows=1) as step:  # the vocoder is rendering: its threads are its own
            counts["own"] = torch.get_num_threads()
            assert not step.borrowed and not step.could_borrow
            order.append("own step")

    def vocoder() -> None:
        use_threads(1)
        in_step.wait(5)
        with lease.render(urgent=False) as threads:
            counts["tick"] = threads
            order.append("tick")
            in_tick.set()
            time.sleep(0.1)  # the own step runs beside the tick

    threads = [_in_thread(decode), _in_thread(vocoder)]
    in_step.wait(5)
    time.sleep(0.1)
    assert order == ["borrowed step"]  # the render waits for the borrowed step
    end_step.set()
    for thread in threads:
        thread.join(5)
    assert order == ["borrowed step", "tick", "own step"]
    assert counts == {"borrowed": 2, "after": 1, "tick": 1, "own": 1}
    assert lease.borrowed_steps == 1 and lease.render_waits == 1
    assert lease.gain.estimates() == {"1/lent": 10.0}  # the borrowed step's time was learnt
    lease.vocoder_idle()
    count = torch.get_num_threads()
    with lease.decode_step(rows=0) as step:
        assert not step.borrowed and torch.get_num_threads() == count
    off = CoreLease(decode_threads=1, vocoder_threads=1, enabled=True)  # the vocoder borrows, the decode never
    with off.decode_step(rows=1) as step:
        assert not step.borrowed


def test_borrow_gain_borrows_only_while_borrowed_steps_are_faster() -> None:
    gain = BorrowGain()
    assert gain.choose(1)  # nothing known: try borrowing first
    gain.observe(1, True, 70.0)
    assert not gain.choose(1)  # then the own count once
    gain.observe(1, False, 100.0)
    choices = [gain.choose(1) for _ in range(2 * BorrowGain.PROBE_EVERY)]
    assert choices.count(False) == 2  # 100 vs 70 ms: borrows, but for a probe now and then
    slow = BorrowGain()  # a machine where a second thread gains little (CPU-3: 38 vs 36 ms)
    slow.observe(1, True, 36.0)
    slow.observe(1, False, 38.0)
    choices = [slow.choose(1) for _ in range(2 * BorrowGain.PROBE_EVERY)]
    assert choices.count(True) == 2  # keeps its own threads, but for a probe now and then
    for _ in range(20):  # the machine changes (another process leaves a core): borrowed steps get faster
        slow.observe(1, True, 20.0)
    assert slow.choose(1) or slow.choose(1)
    assert gain.choose(8)  # each row bucket learns for itself
    assert [rows_bucket(n) for n in (0, 1, 2, 3, 5, 8, 9)] == [0, 1, 2, 4, 8, 8, 16]


@needs_gomp_and_proc
def test_a_borrowed_steps_team_is_freed_once_the_decode_goes_idle() -> None:
    """The vocoder stayed idle, so nothing took the threads back after the borrowed step: its OpenMP worker is
    still docked on the decode thread until the decode goes idle (then the vocoder may borrow, and two docked
    teams would outnumber the cores)."""
    seen: dict[str, int] = {}

    def decode() -> None:
        use_threads(1)
        release_openmp_pool()
        lease = CoreLease(decode_threads=1, vocoder_threads=1, enabled=True, decode_borrows=True)
        x = torch.randn(512, 512)
        before = _settled_threads()  # workers released by earlier tests exit asynchronously
        with lease.decode_step(rows=1) as step:
            assert step.borrowed
            x @ x  # a 2-thread team
        seen["docked"] = _threads() - before
        lease.decode_idle()
        deadline = time.monotonic() + 5
        while _threads() > before and time.monotonic() < deadline:
            time.sleep(0.01)
        seen["idle"] = _threads() - before

    thread = _in_thread(decode)
    thread.join(10)
    assert seen == {"docked": 1, "idle": 0}


@needs_gomp_and_proc
def test_use_threads_leaves_no_team_docked_on_its_thread() -> None:
    """use_threads runs one parallel op to make the count stick; that op's team is formed with the process's
    default count (2 here), and a team left docked on a single-threaded vocoder worker made every 2-thread decode
    step in the server 74 instead of 62 ms (CPU-4). The thread keeps its count and nothing else."""
    saved = torch.get_num_threads()
    torch.set_num_threads(2)  # the process default a new thread's first parallel op uses
    seen: dict[str, int] = {}
    go, done = threading.Event(), threading.Event()

    def worker() -> None:
        go.wait(5)
        use_threads(1)
        torch.randn(512, 512) @ torch.randn(512, 512)  # a parallel-sized op on its own count forms no team
        seen["count"] = torch.get_num_threads()
        done.set()
        time.sleep(0.5)  # alive while the main thread counts

    try:
        thread = _in_thread(worker)
        before = _settled_threads()  # this process and the worker, before its first parallel op
        go.set()
        done.wait(5)
        seen["added"] = _settled_threads() - before
        thread.join(5)
    finally:
        torch.set_num_threads(saved)
    assert seen == {"count": 1, "added": 0}


@needs_gomp_and_proc
def test_a_borrowing_render_waits_until_the_decodes_docked_team_is_freed(monkeypatch: pytest.MonkeyPatch) -> None:
    """A turn's first render usually becomes due between two steps, after a borrowed one that left its team
    docked on the decode thread (the vocoder was idle as it ended). The render borrows the decode's threads; the
    decode thread, at its next step, frees that team before it waits for the render, and the render starts only
    then: two teams at once would outnumber the cores (libgomp stops spinning: a first render ~20 % slower)."""
    monkeypatch.setattr(cpu_threads, "TEAM_WAIT_S", 5.0)  # a loaded CI machine may take 50 ms to run a thread
    lease = CoreLease(decode_threads=1, vocoder_threads=1, enabled=True, decode_borrows=True)
    seen: dict[str, int] = {}
    stepped = threading.Event()
    x = torch.randn(512, 512)

    def decode() -> None:
        use_threads(1)
        with lease.decode_step(rows=1) as step:
            assert step.borrowed
            x @ x  # a 2-thread team, docked on this thread after the step
        seen["docked"] = _threads() - seen["before"]
        stepped.set()
        deadline = time.monotonic() + 5
        while not lease._lent and time.monotonic() < deadline:  # the render has asked for the threads
            time.sleep(0.005)
        with lease.decode_step(rows=1):  # this thread comes to its next step
            pass

    def vocoder() -> None:
        use_threads(1)
        stepped.wait(5)
        with lease.render(urgent=True) as threads:
            seen["team_at_start"] = lease._decode_team  # freed before the render began
            deadline = time.monotonic() + 5
            while _threads() - seen["before"] > 0 and time.monotonic() < deadline:  # the worker's exit is async
                time.sleep(0.01)
            seen["inside"] = _threads() - seen["before"]
            seen["threads"] = threads
            x @ x

    seen["before"] = _settled_threads() + 2  # and the two threads below
    threads = [_in_thread(decode), _in_thread(vocoder)]
    for thread in threads:
        thread.join(10)
    assert seen["docked"] == 1 and seen["threads"] == 2
    assert not seen["team_at_start"] and seen["inside"] == 0  # the decode's docked worker is gone
    assert lease.team_wait_timeouts == 0 and lease.lent_ticks == 1 and lease.decode_waits == 1
