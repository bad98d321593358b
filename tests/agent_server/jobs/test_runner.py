"""agent_server.jobs.runner against real stores: a job rendered and assembled; a replica killed mid-job and another
resuming from the first segment not stored, with the same final bytes as an uninterrupted run; a zombie that
lost its claim storing nothing twice; a cancel stopping the work; failures and their webhooks."""

from __future__ import annotations

import asyncio
import sqlite3
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import AbstractAsyncContextManager, asynccontextmanager
from pathlib import Path

import numpy as np
import numpy.typing as npt
import orjson
import pytest
from redis.exceptions import TimeoutError as RedisTimeout

from agent_server.jobs.assembly import encode_whole, job_audio
from agent_server.jobs.model import Job, JobSegment, JobStatus
from agent_server.jobs.redis_store import RedisJobStore
from agent_server.jobs.request import job_format
from agent_server.jobs.runner import JobInterrupted, JobRunner
from agent_server.jobs.segment_audio import decode_segment, encode_segment
from agent_server.jobs.sqlite_store import SqliteJobStore
from agent_server.jobs.store import Claim, Claimed, JobStore, KeyLimits
from agent_server.jobs.webhooks import (
    SIGNATURE_HEADER,
    AllowList,
    RetryPolicy,
    WebhookSender,
    verify_signature,
    webhook_secret,
)

from tests.agent_server.jobs.conftest import fresh_prefix, make_job, make_plan, redis_client, run
from tests.agent_server.jobs.webhook_receiver import Receiver
from tests.services import RedisServer

pytestmark = pytest.mark.timeout(60)

VISIBILITY_S = 0.4
RENEW_S = 0.1
ROOT = b"fleet root"
SEGMENTS = 6


def voice_of(seed: int, segment: JobSegment) -> npt.NDArray[np.float32]:
    """What a seeded engine makes of a segment: a pure function of (seed + index, text)."""
    rng = np.random.default_rng(seed + segment.index)
    samples = 2_400 + 240 * len(segment.text) + int(rng.integers(0, 480))
    t = np.arange(samples) / 24_000
    wave = 0.2 * np.sin(2 * np.pi * (150 + 10 * segment.index) * t) + 0.01 * rng.standard_normal(samples)
    return np.asarray(wave, dtype=np.float32)


class Engine:
    """A render collaborator that records what it rendered, and what was cancelled while it rendered."""

    def __init__(self, delay_s: float = 0.0) -> None:
        self.rendered: list[int] = []
        self.delay_s = delay_s
        self.fail_at: int | None = None
        self.interrupt_at: int | None = None
        self.hang_from: int | None = None
        self.hanging = 0
        self.cancelled = 0

    async def render(self, job: Job, segment: JobSegment) -> npt.NDArray[np.float32]:
        if segment.index == self.fail_at:
            raise RuntimeError(f"engine failed on segment {segment.index}")
        if segment.index == self.interrupt_at:
            raise JobInterrupted("shutting down")
        try:
            if self.hang_from is not None and segment.index >= self.hang_from:
                self.hanging += 1
                await asyncio.Event().wait()
            await asyncio.sleep(self.delay_s)
        except asyncio.CancelledError:
            self.cancelled += 1
            raise
        self.rendered.append(segment.index)
        return voice_of(job.seed, segment)


def expected_file(job: Job, fmt_name: str, segments: int = SEGMENTS) -> bytes:
    pcm = [decode_segment(encode_segment(voice_of(job.seed, seg))) for seg in make_plan(segments)]
    return encode_whole(pcm, job_format(fmt_name))


async def file_of(store: JobStore, job_id: str, fmt_name: str) -> bytes:
    return b"".join([piece async for piece in job_audio(store, job_id, job_format(fmt_name), wait=False)])


async def until(predicate: Callable[[], Awaitable[bool] | bool], timeout_s: float = 10.0) -> None:
    deadline = asyncio.get_running_loop().time() + timeout_s
    while True:
        value = predicate()
        if isinstance(value, Awaitable):
            value = await value
        if value:
            return
        assert asyncio.get_running_loop().time() < deadline, "timed out"
        await asyncio.sleep(0.01)


@asynccontextmanager
async def redis_store(server: RedisServer, prefix: str, worker: str) -> AsyncIterator[JobStore]:
    client = redis_client(server)
    store = RedisJobStore(client, prefix=prefix, worker_id=worker, visibility_s=VISIBILITY_S)
    await store.start()
    try:
        yield store
    finally:
        await store.stop()
        await client.aclose()


@asynccontextmanager
async def sqlite_store(directory: Path) -> AsyncIterator[JobStore]:
    store = SqliteJobStore(directory, visibility_s=VISIBILITY_S)
    await store.start()
    try:
        yield store
    finally:
        await store.stop()


def one_store(backend: str, request: pytest.FixtureRequest, tmp_path: Path) -> AbstractAsyncContextManager[JobStore]:
    """A started store of `backend` ("redis": the real redis-server fixture; "sqlite": under tmp_path)."""
    if backend == "redis":
        return redis_store(request.getfixturevalue("redis"), fresh_prefix(), "w1")
    return sqlite_store(tmp_path / "jobs")


def sender(receiver: Receiver) -> WebhookSender:
    return WebhookSender(AllowList.parse(["127.0.0.0/8"]), lambda key_id: webhook_secret(ROOT, key_id))


async def killed(runner: JobRunner) -> None:
    """What kill -9 leaves: the replica's tasks gone mid-work, no release, no more renewals (a stopping runner
    hands its claims back: test_a_stopping_runner_hands_its_claims_back_at_once)."""

    async def no_release(claim: Claim) -> None:
        return None

    async def no_hand_back(job_id: str, attempts: int, due_s: float) -> None:
        return None

    runner.store.release = no_release  # type: ignore[method-assign]
    runner.store.webhook_retry = no_hand_back  # type: ignore[method-assign]
    await runner.stop()


def test_a_job_runs_to_done_and_its_webhook_arrives_signed(tmp_path: Path) -> None:
    receiver = Receiver([(200, {})])

    async def scenario() -> None:
        await receiver.start()
        async with sqlite_store(tmp_path / "jobs") as store:
            job = make_job(1_796_000_000.0, webhook_url=receiver.url + "/done")
            await store.submit(job, make_plan(SEGMENTS), KeyLimits(), job.created_at_s)
            engine = Engine()
            runner = JobRunner(store, engine.render, webhooks=sender(receiver), renew_s=RENEW_S, poll_s=0.02)
            await runner.start()
            try:
                await until(lambda: runner.stats.jobs_done == 1)
                await runner.drain_webhooks()
            finally:
                await runner.stop()
                await receiver.stop()
            done = await store.get(job.id)
            assert done is not None and done.status == JobStatus.DONE
            assert done.segments_done == SEGMENTS
            assert done.audio_samples == sum(voice_of(job.seed, s).size for s in make_plan(SEGMENTS))
            assert engine.rendered == list(range(SEGMENTS))
            assert await file_of(store, job.id, "mp3") == expected_file(job, "mp3")
            (hook,) = receiver.received
            assert orjson.loads(hook.body) == done.status_json()
            assert verify_signature(webhook_secret(ROOT, job.key_id), hook.body,
                                    hook.headers.get(SIGNATURE_HEADER.lower()), done.finished_at_s or 0)

    run(scenario())


@pytest.mark.parametrize("backend", ["redis", "sqlite"])
def test_a_webhook_retry_outlives_the_replica_that_scheduled_it(backend: str, request: pytest.FixtureRequest,
                                                                  tmp_path: Path) -> None:
    """The receiver fails the first attempt; the replica that made it dies before the retry (Redis: another
    replica makes it; embedded: the process after a restart). The retry waits in the store's outbox, so it is made,
    signed, exactly once more."""
    receiver = Receiver([(503, {}), (200, {})])
    policy = RetryPolicy(attempts=3, first_delay_s=0.3, max_delay_s=1.0, timeout_s=2.0)
    if backend == "redis":
        server: RedisServer = request.getfixturevalue("redis")
        prefix = fresh_prefix()

        def replica(worker: str) -> AbstractAsyncContextManager[JobStore]:
            return redis_store(server, prefix, worker)
    else:
        def replica(worker: str) -> AbstractAsyncContextManager[JobStore]:
            return sqlite_store(tmp_path / "jobs")

    def runner_on(store: JobStore) -> JobRunner:
        hooks = WebhookSender(AllowList.parse(["127.0.0.0/8"]), lambda key_id: webhook_secret(ROOT, key_id),
                              policy=policy)
        return JobRunner(store, Engine().render, webhooks=hooks, renew_s=RENEW_S, poll_s=0.05)

    async def scenario() -> None:
        await receiver.start()
        try:
            async with replica("w1") as store:
                job = make_job(1_796_000_000.0, webhook_url=receiver.url + "/hook")
                await store.submit(job, make_plan(2), KeyLimits(), job.created_at_s)
                first = runner_on(store)
                await first.start()
                await until(lambda: len(receiver.received) == 1)  # the 503
                # killed once the retry is in the store (killed mid-attempt, it would wait out the lease)
                await until(lambda: first.stats.webhook_attempts == 1 and first.webhooks_in_flight == 0)
                await killed(first)
                assert await store.webhooks_pending() == 1
            assert first.stats.webhooks_delivered == 0
            async with replica("w2") as store:
                second = runner_on(store)
                await second.start()
                try:
                    await until(lambda: second.stats.webhooks_delivered == 1)
                    assert await store.webhooks_pending() == 0
                    await asyncio.sleep(3 * policy.first_delay_s)  # nothing more is sent
                finally:
                    await second.stop()
                done = await store.get(job.id)
        finally:
            await receiver.stop()
        assert [hook.path for hook in receiver.received] == ["/hook", "/hook"]
        assert done is not None and done.status == JobStatus.DONE
        for hook in receiver.received:
            assert orjson.loads(hook.body) == done.status_json()
            assert verify_signature(webhook_secret(ROOT, job.key_id), hook.body,
                                    hook.headers.get(SIGNATURE_HEADER.lower()), time.time())
        assert (second.stats.webhook_attempts, second.stats.webhooks_failed) == (1, 0)

    run(scenario())


def test_a_killed_replicas_job_is_resumed_elsewhere_from_the_first_missing_segment(redis: RedisServer) -> None:
    prefix = fresh_prefix()

    async def scenario() -> None:
        async with redis_store(redis, prefix, "replica-a") as store_a, redis_store(redis, prefix, "replica-b") as b:
            job = make_job(1_796_000_000.0, seed=42)
            await store_a.submit(job, make_plan(SEGMENTS), KeyLimits(), job.created_at_s)
            engine_a = Engine(delay_s=0.05)
            runner_a = JobRunner(store_a, engine_a.render, renew_s=RENEW_S, poll_s=0.02)
            await runner_a.start()

            async def two_stored() -> bool:
                return len(await b.stored_segments(job.id)) >= 2

            await until(two_stored)
            await killed(runner_a)
            stored = await b.stored_segments(job.id)
            assert 2 <= len(stored) < SEGMENTS and stored == set(range(len(stored)))

            engine_b = Engine()
            runner_b = JobRunner(b, engine_b.render, renew_s=RENEW_S, poll_s=0.02)
            await runner_b.start()
            try:
                await until(lambda: runner_b.stats.jobs_done == 1)
            finally:
                await runner_b.stop()
            assert engine_b.rendered == list(range(len(stored), SEGMENTS))  # from the first missing, no repeat
            done = await b.get(job.id)
            assert done is not None and (done.status, done.segments_done, done.claims) == (JobStatus.DONE, SEGMENTS, 2)
            assert await file_of(b, job.id, "wav") == expected_file(job, "wav")  # as an uninterrupted run's

    run(scenario())


def test_a_wake_that_comes_while_the_runner_claims_is_not_lost(tmp_path: Path) -> None:
    """A job submitted (and the runner woken) while a claim is under way is claimed at once, not a poll later: the
    wake is for the next round, so clearing it after the round would lose it."""

    async def scenario() -> None:
        async with sqlite_store(tmp_path / "jobs") as store:
            engine = Engine()
            runner = JobRunner(store, engine.render, poll_s=30.0)
            real_claim = store.claim
            job = make_job(1_796_000_000.0, seed=5)

            async def claim_then_submit(max_jobs: int, now_s: float) -> Claimed:
                claimed = await real_claim(max_jobs, now_s)
                if not claimed.claims and await store.get(job.id) is None:  # the first round: nothing queued yet
                    await store.submit(job, make_plan(2), KeyLimits(), job.created_at_s)
                    runner.wake()  # what the API does on a submit
                return claimed

            store.claim = claim_then_submit  # type: ignore[method-assign]
            await runner.start()
            try:
                await until(lambda: engine.rendered == [0, 1], timeout_s=5.0)
            finally:
                await runner.stop()

    run(scenario())


@pytest.mark.parametrize("backend", ["redis", "sqlite"])
def test_a_passing_store_fault_costs_the_job_time_not_the_job(backend: str, request: pytest.FixtureRequest,
                                                                tmp_path: Path) -> None:
    """The store fails once on each of plan, stored_segments, put_segment and finish (a Redis reply timing out, a
    locked SQLite file): the runner makes each call again, and the job ends DONE with every segment, each once."""
    error = RedisTimeout("Timeout reading from socket") if backend == "redis" else sqlite3.OperationalError("locked")

    def failing_once(call: Callable[..., Awaitable[object]]) -> Callable[..., Awaitable[object]]:
        failed = False

        async def flaky(*args: object) -> object:
            nonlocal failed
            if not failed:
                failed = True
                raise error
            return await call(*args)
        return flaky

    async def scenario(store: JobStore) -> None:
        job = make_job(1_796_000_000.0, seed=9)
        await store.submit(job, make_plan(SEGMENTS), KeyLimits(), job.created_at_s)
        for name in ("plan", "stored_segments", "put_segment", "finish"):
            setattr(store, name, failing_once(getattr(store, name)))
        engine = Engine()
        runner = JobRunner(store, engine.render, renew_s=RENEW_S, poll_s=0.02)
        await runner.start()
        try:
            await until(lambda: runner.stats.jobs_done == 1)
        finally:
            await runner.stop()
        done = await store.get(job.id)
        assert done is not None and done.status == JobStatus.DONE and done.error is None
        assert (done.segments_done, runner.stats.jobs_failed) == (SEGMENTS, 0)
        assert sorted(engine.rendered) == list(range(SEGMENTS))

    async def on_backend() -> None:
        async with one_store(backend, request, tmp_path) as store:
            await scenario(store)

    run(on_backend())


def test_a_claim_that_comes_back_to_its_own_runner_replaces_the_old_work(tmp_path: Path) -> None:
    """The runner's own lease ran out (its clock jumped past the visibility timeout) and it claims the job again:
    one task works on it from then on, the runner still counts it as running, and stop() hands it back."""
    now = [1_796_000_000.0]

    async def scenario() -> None:
        async with sqlite_store(tmp_path / "jobs") as store:
            job = make_job(now[0], seed=4)
            await store.submit(job, make_plan(SEGMENTS), KeyLimits(), now[0])
            engine = Engine()
            engine.hang_from = 2
            runner = JobRunner(store, engine.render, renew_s=RENEW_S, poll_s=30.0, clock=lambda: now[0])
            assert await runner.claim_more() == 1
            first = runner._jobs[job.id]
            await until(lambda: engine.hanging == 1)
            now[0] += 10 * VISIBILITY_S  # the lease runs out under the runner's feet
            assert await runner.claim_more() == 1
            await until(lambda: engine.hanging == 2)  # the fresh claim resumed at segment 2
            await asyncio.sleep(5 * RENEW_S)  # the old work's renewal would find its claim LOST by now
            assert first is not runner._jobs.get(job.id) and first.done()
            assert engine.rendered == [0, 1] and engine.cancelled == 1  # the old render stopped, nothing twice
            assert runner.running == [job.id]
            await runner.stop()
            assert engine.cancelled == 2
            record = await store.get(job.id)
            assert record is not None and record.status == JobStatus.QUEUED  # handed back

    run(scenario())


def test_a_stopping_runner_hands_its_claims_back_at_once(redis: RedisServer) -> None:
    """A replica that drains gives its jobs back: another one takes them at once, not a visibility timeout later."""
    prefix = fresh_prefix()
    long_visibility_s = 60.0

    async def scenario() -> None:
        client = redis_client(redis)
        store_a = RedisJobStore(client, prefix=prefix, worker_id="replica-a", visibility_s=long_visibility_s)
        store_b = RedisJobStore(client, prefix=prefix, worker_id="replica-b", visibility_s=long_visibility_s)
        try:
            job = make_job(1_796_000_000.0, seed=3)
            await store_a.submit(job, make_plan(SEGMENTS), KeyLimits(), job.created_at_s)
            engine_a = Engine()
            engine_a.hang_from = 2
            runner_a = JobRunner(store_a, engine_a.render, renew_s=RENEW_S, poll_s=0.02)
            await runner_a.start()
            await until(lambda: engine_a.hanging == 1)
            await runner_a.stop()  # the drain
            assert engine_a.cancelled == 1
            claimed = await store_b.claim(1, job.created_at_s + 1.0)  # long before the visibility timeout
            assert [c.job.id for c in claimed.claims] == [job.id]
            assert claimed.claims[0].job.claims == 1  # a hand-back is not a failed claim
            assert await store_b.stored_segments(job.id) == {0, 1}
        finally:
            await client.aclose()

    run(scenario())


def test_the_embedded_store_resumes_a_job_after_a_restart(tmp_path: Path) -> None:
    async def scenario() -> None:
        job = make_job(1_796_000_000.0, seed=5)
        async with sqlite_store(tmp_path / "jobs") as store:
            await store.submit(job, make_plan(SEGMENTS), KeyLimits(), job.created_at_s)
            engine = Engine(delay_s=0.05)
            runner = JobRunner(store, engine.render, renew_s=RENEW_S, poll_s=0.02)
            await runner.start()

            async def three_stored() -> bool:
                return len(await store.stored_segments(job.id)) >= 3

            await until(three_stored)
            await killed(runner)
        async with sqlite_store(tmp_path / "jobs") as restarted:
            first_missing = len(await restarted.stored_segments(job.id))
            assert 3 <= first_missing < SEGMENTS
            engine = Engine()
            runner = JobRunner(restarted, engine.render, renew_s=RENEW_S, poll_s=0.02)
            await runner.start()
            try:
                await until(lambda: runner.stats.jobs_done == 1)
            finally:
                await runner.stop()
            assert engine.rendered == list(range(first_missing, SEGMENTS))
            assert await file_of(restarted, job.id, "flac") == expected_file(job, "flac")

    run(scenario())


def test_a_zombie_that_lost_its_claim_stores_nothing_twice(redis: RedisServer) -> None:
    prefix = fresh_prefix()

    async def scenario() -> None:
        async with redis_store(redis, prefix, "zombie") as store_z, redis_store(redis, prefix, "healthy") as store_h:
            job = make_job(1_796_000_000.0, seed=9)
            await store_z.submit(job, make_plan(SEGMENTS), KeyLimits(), job.created_at_s)
            # the zombie renders every segment at once, slowly, and never renews in time (a long pause: GC, a
            # partition); the healthy replica takes the job over and renders it again, one segment at a time:
            # while it does, the zombie's renders land and are stored, so both store segments of one job (and
            # whichever stores the last one finishes it)
            zombie_engine = Engine(delay_s=VISIBILITY_S * 3)
            zombie = JobRunner(store_z, zombie_engine.render, renew_s=60.0, poll_s=60.0,
                               segments_in_flight=SEGMENTS)
            assert await zombie.claim_more() == 1
            await asyncio.sleep(VISIBILITY_S * 1.2)
            healthy_engine = Engine(delay_s=VISIBILITY_S / 2)
            healthy = JobRunner(store_h, healthy_engine.render, renew_s=RENEW_S, poll_s=0.02)
            await healthy.start()

            async def finished() -> bool:
                got = await store_h.get(job.id)
                return got is not None and got.status.finished and not zombie.running and not healthy.running

            try:
                await until(finished)
            finally:
                await healthy.stop()
                await zombie.stop()
            assert zombie.stats.segments_rendered >= 1  # the zombie stored some ...
            assert healthy.stats.segments_rendered >= 1  # ... and so did the healthy one
            assert zombie.stats.segments_already_stored + healthy.stats.segments_already_stored >= 1
            assert zombie.stats.segments_rendered + healthy.stats.segments_rendered == SEGMENTS
            assert zombie.stats.jobs_done + healthy.stats.jobs_done == 1
            done = await store_h.get(job.id)
            assert done is not None and done.status == JobStatus.DONE
            assert done.segments_done == SEGMENTS
            assert done.audio_samples == sum(voice_of(job.seed, s).size for s in make_plan(SEGMENTS))
            assert await file_of(store_h, job.id, "wav") == expected_file(job, "wav")

    run(scenario())


def test_a_cancelled_job_stops_rendering_at_once_and_sends_no_webhook(tmp_path: Path) -> None:
    receiver = Receiver([(200, {})])

    async def scenario() -> None:
        await receiver.start()
        async with sqlite_store(tmp_path / "jobs") as store:
            job = make_job(1_796_000_000.0, webhook_url=receiver.url)
            await store.submit(job, make_plan(40), KeyLimits(), job.created_at_s)
            engine = Engine()
            engine.hang_from = 2  # the third render takes for ever (a long segment on a busy engine)
            runner = JobRunner(store, engine.render, webhooks=sender(receiver), renew_s=RENEW_S, poll_s=0.02)
            await runner.start()
            try:
                await until(lambda: engine.hanging == 1)
                await store.finish(job.id, JobStatus.CANCELLED, None, job.created_at_s + 1)
                await until(lambda: runner.running == [], timeout_s=10 * RENEW_S)  # at the next renewal
                assert engine.cancelled == 1  # the render in flight was stopped: its engine rows are free
                assert engine.rendered == [0, 1]
                assert runner.stats.jobs_stopped == 1
            finally:
                await runner.stop()
                await receiver.stop()
            assert receiver.received == []
            assert await store.stored_segments(job.id) == {0, 1}

    run(scenario())


def test_a_webhook_attempt_whose_store_fails_afterwards_is_left_to_the_lease(tmp_path: Path) -> None:
    """The POST was made, then the store cannot be told: the attempt ends quietly (no task dies with it), and the
    webhook, still leased in the outbox, is taken again once the lease ends."""
    receiver = Receiver([(200, {})])

    async def scenario() -> None:
        await receiver.start()
        try:
            async with sqlite_store(tmp_path / "jobs") as store:
                job = make_job(1_796_000_000.0, webhook_url=receiver.url)
                await store.submit(job, make_plan(1), KeyLimits(), job.created_at_s)
                await store.put_segment(job.id, 0, b"a", 100)
                await store.finish(job.id, JobStatus.DONE, None, job.created_at_s)
                hooks = sender(receiver)
                runner = JobRunner(store, Engine().render, webhooks=hooks)

                async def unreachable(job_id: str) -> None:
                    raise ConnectionError("the store went away")

                store.webhook_done = unreachable  # type: ignore[method-assign]
                (due,) = await store.take_webhooks(1, time.time(), 30.0)
                await runner._attempt(hooks, due)  # returns: nothing raised
                assert len(receiver.received) == 1 and runner.stats.webhooks_delivered == 1
                assert await store.webhooks_pending() == 1  # still there, for the next taker after the lease
        finally:
            await receiver.stop()

    run(scenario())


async def finished_with_webhook(store: JobStore, url: str) -> Job:
    job = make_job(1_796_000_000.0, webhook_url=url)
    await store.submit(job, make_plan(1), KeyLimits(), job.created_at_s)
    await store.put_segment(job.id, 0, b"a", 100)
    await store.finish(job.id, JobStatus.DONE, None, job.created_at_s)
    return job


def test_a_webhook_retry_is_made_when_it_falls_due_not_at_the_next_poll(tmp_path: Path) -> None:
    """The runner that scheduled a retry wakes for it at its due time: with a 30 s poll, a retry 0.3 s after a 503
    is made within seconds."""
    receiver = Receiver([(503, {}), (200, {})])
    policy = RetryPolicy(attempts=3, first_delay_s=0.3, max_delay_s=1.0, timeout_s=2.0)

    async def scenario() -> None:
        await receiver.start()
        try:
            async with sqlite_store(tmp_path / "jobs") as store:
                await finished_with_webhook(store, receiver.url)
                hooks = WebhookSender(AllowList.parse(["127.0.0.0/8"]), lambda key_id: webhook_secret(ROOT, key_id),
                                      policy=policy)
                runner = JobRunner(store, Engine().render, webhooks=hooks, poll_s=30.0)
                await runner.start()
                try:
                    await until(lambda: runner.stats.webhooks_delivered == 1, timeout_s=5.0)
                finally:
                    await runner.stop()
        finally:
            await receiver.stop()
        assert len(receiver.received) == 2

    run(scenario())


@pytest.mark.parametrize("backend", ["redis", "sqlite"])
def test_a_runner_stopped_mid_attempt_gives_the_webhook_back_due_at_once(backend: str, request: pytest.FixtureRequest,
                                                                         tmp_path: Path) -> None:
    """A graceful stop while the receiver has not answered: the webhook is due again at once (not after the lease),
    the interrupted attempt not counted; the next taker delivers it."""
    hold = asyncio.Event()
    receiver = Receiver([(200, {})], hold=hold)

    async def scenario(store: JobStore) -> None:
        job = await finished_with_webhook(store, receiver.url)
        runner = JobRunner(store, Engine().render, webhooks=sender(receiver), poll_s=0.05)
        await runner.start()
        await until(lambda: len(receiver.received) == 1)
        await runner.stop()
        (due,) = await store.take_webhooks(4, time.time(), 30.0)
        assert (due.job.id, due.attempts) == (job.id, 0)
        hold.set()

    async def on_backend() -> None:
        await receiver.start()
        try:
            async with one_store(backend, request, tmp_path) as store:
                await scenario(store)
        finally:
            hold.set()
            await receiver.stop()

    run(on_backend())


def test_a_cancel_through_another_replica_stops_the_render_at_once(redis: RedisServer) -> None:
    """DELETE on replica B of a job replica A renders: A hears it (the store's cancels) and stops the render in
    flight long before its next claim renewal."""
    prefix = fresh_prefix()

    async def scenario() -> None:
        async with redis_store(redis, prefix, "a") as store_a, redis_store(redis, prefix, "b") as store_b:
            job = make_job(1_796_000_000.0)
            await store_a.submit(job, make_plan(40), KeyLimits(), job.created_at_s)
            engine = Engine()
            engine.hang_from = 1
            runner = JobRunner(store_a, engine.render, renew_s=60.0, poll_s=0.02)  # no renewal within the test
            await runner.start()
            try:
                await until(lambda: engine.hanging == 1)
                await asyncio.sleep(0.2)  # (the watch is subscribed well before)
                _, changed = await store_b.finish(job.id, JobStatus.CANCELLED, None, job.created_at_s + 1)
                assert changed
                await until(lambda: runner.running == [], timeout_s=3.0)
                assert engine.cancelled == 1 and engine.rendered == [0]
            finally:
                await runner.stop()
            assert await store_a.stored_segments(job.id) == {0}

    run(scenario())


def test_a_failing_segment_fails_the_job_and_an_interrupted_one_hands_it_back(tmp_path: Path) -> None:
    receiver = Receiver([(200, {})])

    async def scenario() -> None:
        await receiver.start()
        async with sqlite_store(tmp_path / "jobs") as store:
            failing = make_job(1_796_000_000.0, webhook_url=receiver.url)
            await store.submit(failing, make_plan(3), KeyLimits(), failing.created_at_s)
            engine = Engine()
            engine.fail_at = 1
            runner = JobRunner(store, engine.render, webhooks=sender(receiver), renew_s=RENEW_S, poll_s=0.02)
            await runner.start()
            try:
                await until(lambda: runner.stats.jobs_failed == 1)
                await runner.drain_webhooks()
            finally:
                await runner.stop()
            failed = await store.get(failing.id)
            assert failed is not None and failed.status == JobStatus.FAILED
            assert failed.error == "RuntimeError: engine failed on segment 1"
            (hook,) = receiver.received
            assert orjson.loads(hook.body)["status"] == "failed"
            assert hook.headers["x-agent-server-event"] == "job.failed"

            interrupted = make_job(1_796_000_001.0)
            await store.submit(interrupted, make_plan(3), KeyLimits(), interrupted.created_at_s)
            engine.fail_at, engine.interrupt_at = None, 2
            draining = JobRunner(store, engine.render, renew_s=RENEW_S, poll_s=60.0)
            assert await draining.claim_more() == 1
            await until(lambda: draining.running == [])
            back = await store.get(interrupted.id)
            assert back is not None and (back.status, back.segments_done, back.claims) == (JobStatus.QUEUED, 2, 0)
            (again,) = (await store.claim(1, interrupted.created_at_s + 1)).claims  # at once, elsewhere
            assert again.job.id == interrupted.id
        await receiver.stop()

    run(scenario())


def test_stop_ends_even_when_a_library_swallows_the_cancel(tmp_path: Path) -> None:
    """redis-py's asyncio client sometimes eats a task's cancel inside a command; stop() must still return."""

    class SwallowingStore(SqliteJobStore):
        swallowed = 0

        async def claim(self, max_jobs: int, now_s: float) -> Claimed:
            try:
                await asyncio.sleep(5.0)
            except asyncio.CancelledError:
                self.swallowed += 1  # ... and carries on as if nothing happened
            return Claimed([], [])

    async def scenario() -> None:
        store = SwallowingStore(tmp_path / "jobs")
        await store.start()
        try:
            runner = JobRunner(store, Engine().render, poll_s=0.01)
            await runner.start()
            await asyncio.sleep(0.05)
            await runner.stop()
            assert store.swallowed == 1
        finally:
            await store.stop()

    run(scenario(), timeout_s=10.0)
