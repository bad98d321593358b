"""agent_server/audio/encode_lane.py: per-context order, parallelism across contexts, bounds, cancel, failure.

Each test runs a real event loop (results come back through loop.call_soon_threadsafe) and waits on
events, never on sleeps; a negative ("never ran", "never delivered") is proved by counts once a marker
posted after the fact has come through the loop.
"""

from __future__ import annotations

import asyncio
import random
import threading
from collections import defaultdict
from collections.abc import Callable
from functools import partial
from typing import Any

import numpy as np
import pytest

from agent_server.audio.codecs import StreamFormat, make_encoder
from agent_server.audio.encode_lane import EncoderPool, Lane, LaneFull

WAIT_S = 10.0


def run(coro: Any) -> Any:
    return asyncio.run(asyncio.wait_for(coro, WAIT_S))


async def through_loop(loop: asyncio.AbstractEventLoop) -> None:
    """Returns once everything posted to the loop before this call has run."""
    marker = asyncio.Event()
    loop.call_soon_threadsafe(marker.set)
    await marker.wait()


def ignore(_result: object) -> None:
    pass


def set_event(event: asyncio.Event, _result: object) -> None:
    event.set()


def make_lane(pool: EncoderPool, loop: asyncio.AbstractEventLoop, *, max_pending: int = 1_000,
              close: Callable[[], None] = lambda: None,
              errors: list[Exception] | None = None) -> Lane:
    sink: list[Exception] = errors if errors is not None else []
    return pool.lane(loop.call_soon_threadsafe, max_pending=max_pending, close=close, on_error=sink.append)


def test_each_lane_delivers_in_submission_order_and_runs_one_item_at_a_time() -> None:
    lanes_n, items_n = 6, 60

    async def main() -> None:
        loop = asyncio.get_running_loop()
        pool = EncoderPool(workers=3)
        delivered: dict[int, list[int]] = defaultdict(list)
        active: dict[int, int] = defaultdict(int)
        max_active: dict[int, int] = defaultdict(int)
        lock = threading.Lock()
        all_done = asyncio.Event()
        rng = random.Random(0)

        def work(lane_i: int, item: int, spin: int) -> int:
            with lock:
                active[lane_i] += 1
                max_active[lane_i] = max(max_active[lane_i], active[lane_i])
            sum(range(spin))  # uneven work so lanes interleave
            with lock:
                active[lane_i] -= 1
            return item

        def done(lane_i: int, result: int | None) -> None:
            assert result is not None
            delivered[lane_i].append(result)
            if sum(len(v) for v in delivered.values()) == lanes_n * items_n:
                all_done.set()

        lanes = [make_lane(pool, loop) for _ in range(lanes_n)]
        for item in range(items_n):
            for lane_i, lane in enumerate(lanes):
                spin = rng.randrange(1, 20_000)
                lane.submit(partial(work, lane_i, item, spin), partial(done, lane_i))
        await all_done.wait()
        pool.shutdown()
        assert all(delivered[i] == list(range(items_n)) for i in range(lanes_n))
        assert all(max_active[i] == 1 for i in range(lanes_n))

    run(main())


def test_lanes_run_side_by_side_on_the_pool() -> None:
    """Two lanes' items meet at a barrier: only possible if both run at once."""

    async def main() -> None:
        loop = asyncio.get_running_loop()
        pool = EncoderPool(workers=2)
        barrier = threading.Barrier(2, timeout=WAIT_S)
        errors: list[Exception] = []
        got: list[str] = []
        both = asyncio.Event()

        def done(name: str, _result: object) -> None:
            got.append(name)
            if len(got) == 2:
                both.set()

        for name in ("a", "b"):
            make_lane(pool, loop, errors=errors).submit(barrier.wait, partial(done, name))
        await both.wait()
        pool.shutdown()
        assert sorted(got) == ["a", "b"] and errors == []

    run(main())


def test_a_long_backlog_does_not_hold_a_worker() -> None:
    """One worker, lane A with many items queued first: lane B's single item runs before A's backlog ends."""

    async def main() -> None:
        loop = asyncio.get_running_loop()
        pool = EncoderPool(workers=1)
        order: list[str] = []
        finished = asyncio.Event()
        lane_a, lane_b = make_lane(pool, loop), make_lane(pool, loop)
        gate = threading.Event()
        def note(name: str, _result: object) -> None:
            order.append(name)

        lane_a.submit(gate.wait, partial(note, "a0"))
        for i in range(1, 20):
            lane_a.submit(None, partial(note, f"a{i}"))
        lane_b.submit(None, partial(note, "b"))
        lane_a.submit(None, partial(set_event, finished))
        gate.set()
        await finished.wait()
        pool.shutdown()
        assert order.index("b") < order.index("a19")

    run(main())


def test_cancel_drops_queued_items_delivers_nothing_and_closes_after_the_item_in_flight() -> None:
    async def main() -> None:
        loop = asyncio.get_running_loop()
        pool = EncoderPool(workers=2)
        started, release, closed = threading.Event(), threading.Event(), threading.Event()
        ran: list[int] = []
        delivered: list[object] = []
        closes: list[bool] = []

        def close() -> None:
            closes.append(release.is_set())  # True: the in-flight item had finished
            closed.set()

        def blocking() -> int:
            started.set()
            release.wait(WAIT_S)
            ran.append(0)
            return 0

        lane = make_lane(pool, loop, close=close)
        lane.submit(blocking, delivered.append)
        for i in range(1, 10):
            lane.submit(partial(ran.append, i), delivered.append)
        await asyncio.to_thread(started.wait, WAIT_S)
        lane.cancel()
        lane.cancel()  # idempotent
        assert closes == [] and lane.pending == 0  # not closed under the running item
        release.set()
        await asyncio.to_thread(closed.wait, WAIT_S)
        await through_loop(loop)
        lane.submit(lambda: ran.append(99), delivered.append)  # after cancel: ignored
        await through_loop(loop)
        pool.shutdown()
        assert ran == [0] and delivered == [] and closes == [True] and lane.stopped

    run(main())


def test_cancel_with_nothing_in_flight_closes_at_once() -> None:
    async def main() -> None:
        loop = asyncio.get_running_loop()
        pool = EncoderPool(workers=1)
        closes: list[int] = []
        lane = make_lane(pool, loop, close=lambda: closes.append(1))
        lane.cancel()
        assert closes == [1]
        pool.shutdown()

    run(main())


def test_a_failing_item_stops_the_lane_after_delivering_what_came_before() -> None:
    async def main() -> None:
        loop = asyncio.get_running_loop()
        pool = EncoderPool(workers=1)
        delivered: list[object] = []
        errors: list[Exception] = []
        closes: list[int] = []
        gate = threading.Event()
        lane = make_lane(pool, loop, close=lambda: closes.append(1), errors=errors)
        def first() -> str:
            gate.wait(WAIT_S)
            return "first"

        lane.submit(first, delivered.append)

        def boom() -> None:
            raise ValueError("codec failed")

        lane.submit(boom, delivered.append)
        ran_after: list[int] = []
        lane.submit(lambda: ran_after.append(1), delivered.append)
        gate.set()
        while not errors:
            await through_loop(loop)
        await through_loop(loop)
        pool.shutdown()
        assert delivered == ["first"] and [str(e) for e in errors] == ["codec failed"]
        assert ran_after == [] and closes == [1] and lane.stopped

    run(main())


def test_a_full_lane_refuses_more() -> None:
    async def main() -> None:
        loop = asyncio.get_running_loop()
        pool = EncoderPool(workers=1)
        started, release = threading.Event(), threading.Event()
        lane = make_lane(pool, loop, max_pending=2)
        def blocking() -> None:
            started.set()
            release.wait(WAIT_S)

        lane.submit(blocking, ignore)
        await asyncio.to_thread(started.wait, WAIT_S)
        lane.submit(None, ignore)
        lane.submit(None, ignore)
        with pytest.raises(LaneFull):
            lane.submit(None, ignore)
        release.set()
        lane.cancel()
        pool.shutdown()

    run(main())


@pytest.mark.parametrize("fmt", [StreamFormat("mp3", "mp3", 24_000), StreamFormat("ogg", "opus", 48_000)],
                         ids=["mp3", "ogg"])
def test_real_encoders_through_lanes_give_the_bytes_of_direct_calls(fmt: StreamFormat) -> None:
    rng = np.random.default_rng(5)
    chunks = [(0.2 * rng.standard_normal(n)).astype(np.float32) for n in (9_600, 4_800, 19_200, 960, 9_600)]

    def direct() -> bytes:
        enc = make_encoder(fmt)
        out = [b for c in chunks for b in enc.push(c)] + enc.drain() + enc.finish()
        return b"".join(out)

    async def main() -> list[bytes]:
        loop = asyncio.get_running_loop()
        pool = EncoderPool(workers=4)
        encoders = [make_encoder(fmt) for _ in range(3)]
        outputs: list[list[bytes]] = [[] for _ in encoders]
        ended = [asyncio.Event() for _ in encoders]
        for k, enc in enumerate(encoders):
            lane = make_lane(pool, loop, close=enc.close)
            for c in chunks:
                lane.submit(partial(enc.push, c), outputs[k].extend)
            lane.submit(enc.drain, outputs[k].extend)
            lane.submit(enc.finish, outputs[k].extend)
            lane.submit(None, partial(set_event, ended[k]))
        for event in ended:
            await event.wait()
        pool.shutdown()
        return [b"".join(o) for o in outputs]

    expected = direct()
    assert run(main()) == [expected] * 3
