"""agent_server.jobs stores: the same checks on the embedded store (real SQLite in a temporary directory) and on
the Redis store (a real redis-server): quotas atomic across replicas, claims held, reclaimed after the
visibility timeout and lost by the late worker, a segment stored once, finish once, expiry, restart."""

from __future__ import annotations

import asyncio
import calendar
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import pytest

from agent_server.jobs.model import QUOTA_CHARS, QUOTA_RUNNING, JobStatus
from agent_server.jobs.redis_store import RedisJobStore
from agent_server.jobs.sqlite_store import DirectoryInUse, SqliteJobStore
from agent_server.jobs.store import (
    RECORD_GRACE_S,
    RUNNING_RETRY_AFTER_S,
    ClaimState,
    IncompleteJob,
    JobStore,
    KeyLimits,
    SegmentWrite,
)

from tests.agent_server.jobs.conftest import fresh_prefix, make_job, make_plan, redis_client, run
from tests.services import RedisServer

pytestmark = pytest.mark.timeout(60)

VISIBILITY_S = 0.3  # short, so that reclaiming can be watched (Redis measures idle time on its own clock)
NOW_S = 1_796_000_000.0  # 2026-11-30T00:53:20Z, a fixed clock for records and quotas
TTL_S = 3600.0

Stores = Callable[[str], Any]  # worker id -> an async context manager yielding a started JobStore


@pytest.fixture(params=["sqlite", "redis"])
def stores(request: pytest.FixtureRequest, tmp_path: Path) -> Stores:
    """Replicas of one store: each call opens a worker on the same jobs (SQLite: one process at a time)."""
    if request.param == "sqlite":

        @asynccontextmanager
        async def sqlite(worker: str) -> AsyncIterator[JobStore]:
            store = SqliteJobStore(tmp_path / "jobs", worker_id=worker, job_ttl_s=TTL_S, visibility_s=VISIBILITY_S)
            await store.start()
            try:
                yield store
            finally:
                await store.stop()

        return sqlite
    server: RedisServer = request.getfixturevalue("redis")
    prefix = fresh_prefix()

    @asynccontextmanager
    async def redis(worker: str) -> AsyncIterator[JobStore]:
        client = redis_client(server)
        store = RedisJobStore(client, prefix=prefix, worker_id=worker, job_ttl_s=TTL_S, visibility_s=VISIBILITY_S)
        await store.start()
        try:
            yield store
        finally:
            await store.stop()
            await client.aclose()

    return redis


def two_workers(stores: Stores, body: Callable[[JobStore, JobStore], Awaitable[None]]) -> None:
    """`body` with two workers on the same jobs (SQLite: the same store object twice, one process)."""

    async def scenario() -> None:
        async with stores("w1") as first:
            if isinstance(first, SqliteJobStore):
                await body(first, first)
                return
            async with stores("w2") as second:
                await body(first, second)

    run(scenario())


def test_a_job_round_trips_and_lists_newest_first(stores: Stores) -> None:
    async def scenario() -> None:
        async with stores("w1") as store:
            jobs = [make_job(NOW_S + i) for i in range(5)]
            other = make_job(NOW_S + 10, key_id="k_other")
            for job in [*jobs, other]:
                assert await store.submit(job, make_plan(3), KeyLimits(), NOW_S) is None
            got = await store.get(jobs[0].id)
            assert got is not None
            assert got.status_json() == {
                "id": jobs[0].id, "status": "queued", "segments_done": 0, "segments_total": 3,
                "audio_seconds": 0.0, "created_at": "2026-11-30T00:53:20.000+00:00", "finished_at": None,
                "error": None}
            assert (got.key_id, got.seed, got.output_format, got.text_chars) == ("k_test", 7, "wav", 60)
            assert await store.plan(jobs[0].id) == make_plan(3)
            first_page = await store.list_jobs("k_test", NOW_S, limit=2)
            assert [j.id for j in first_page] == [jobs[4].id, jobs[3].id]
            second_page = await store.list_jobs("k_test", NOW_S, limit=2, before=first_page[-1].id)
            assert [j.id for j in second_page] == [jobs[2].id, jobs[1].id]
            assert [j.id for j in await store.list_jobs("k_other", NOW_S)] == [other.id]
            assert await store.get("job_000000000000ffffffffff") is None

    run(scenario())


def test_the_running_jobs_quota_holds_under_concurrent_submissions_across_replicas(stores: Stores) -> None:
    limits = KeyLimits(max_running_jobs=3)

    async def body(first: JobStore, second: JobStore) -> None:
        jobs = [make_job(NOW_S + i / 1000) for i in range(10)]
        refusals = await asyncio.gather(*(
            (first if i % 2 else second).submit(job, make_plan(1), limits, NOW_S) for i, job in enumerate(jobs)))
        admitted = [job for job, refusal in zip(jobs, refusals, strict=True) if refusal is None]
        assert len(admitted) == 3
        refused = [r for r in refusals if r is not None]
        assert {(r.code, r.retry_after_s) for r in refused} == {(QUOTA_RUNNING, RUNNING_RETRY_AFTER_S)}
        assert (await first.usage("k_test", NOW_S)).unfinished_jobs == 3
        assert await first.submit(make_job(NOW_S + 1, key_id="k_other"), make_plan(1), limits, NOW_S) is None
        # a finished job frees its place (cancelled here)
        _, changed = await second.finish(admitted[0].id, JobStatus.CANCELLED, None, NOW_S + 1)
        assert changed
        assert await first.submit(make_job(NOW_S + 2), make_plan(1), limits, NOW_S + 2) is None
        assert await first.submit(make_job(NOW_S + 3), make_plan(1), limits, NOW_S + 3) is not None

    two_workers(stores, body)


def test_the_daily_character_quota_refuses_until_the_next_utc_day(stores: Stores) -> None:
    limits = KeyLimits(daily_chars=100)
    late_s = float(calendar.timegm((2026, 12, 6, 23, 59, 0)))  # 60 s before midnight UTC

    async def body(first: JobStore, second: JobStore) -> None:
        assert await first.submit(make_job(late_s, chars=60), make_plan(1), limits, late_s) is None
        assert await second.submit(make_job(late_s, chars=40), make_plan(1), limits, late_s) is None  # exactly 100
        refusal = await first.submit(make_job(late_s, chars=1), make_plan(1), limits, late_s)
        assert refusal is not None
        assert (refusal.code, refusal.retry_after_s) == (QUOTA_CHARS, 60)
        assert "100 of its 100" in refusal.message
        assert (await second.usage("k_test", late_s)).chars_today == 100  # nothing charged for the refusal
        tomorrow_s = late_s + 61
        assert await second.submit(make_job(tomorrow_s, chars=100), make_plan(1), limits, tomorrow_s) is None

    two_workers(stores, body)


def test_a_claim_is_held_while_renewed_then_reclaimed_and_the_late_worker_loses_it(stores: Stores) -> None:
    async def body(first: JobStore, second: JobStore) -> None:
        job = make_job(NOW_S)
        await first.submit(job, make_plan(3), KeyLimits(), NOW_S)
        got = await first.claim(4, NOW_S)
        assert [c.job.id for c in got.claims] == [job.id]
        claim = got.claims[0]
        assert claim.job.status == JobStatus.RUNNING
        assert claim.job.started_at_s == NOW_S
        # held: renewed well inside the visibility timeout, nobody else gets it
        for step in range(1, 4):
            await asyncio.sleep(VISIBILITY_S / 3)
            assert await first.renew(claim, NOW_S + step * VISIBILITY_S / 3) == ClaimState.HELD
            assert (await second.claim(4, NOW_S + step * VISIBILITY_S / 3)).claims == []
        # the first worker stops renewing (killed): after the timeout the second one takes it
        await asyncio.sleep(VISIBILITY_S * 1.5)
        later_s = NOW_S + 3 * VISIBILITY_S
        taken = await second.claim(4, later_s)
        assert [c.job.id for c in taken.claims] == [job.id]
        assert taken.claims[0].job.claims == 2
        assert await first.renew(claim, later_s) == ClaimState.LOST
        assert await second.renew(taken.claims[0], later_s) == ClaimState.HELD

    two_workers(stores, body)


def test_an_abandoned_claim_behind_many_held_ones_is_reclaimed(stores: Stores) -> None:
    """A dead worker's claim queued behind more held claims than one XAUTOCLAIM call scans (Redis reads at most
    10 x COUNT pending entries a call): the next claim still finds it, the held ones stay with their worker."""
    held_n = 25

    async def body(first: JobStore, second: JobStore) -> None:
        jobs = [make_job(NOW_S + i) for i in range(held_n + 1)]
        for job in jobs:
            assert await first.submit(job, make_plan(1), KeyLimits(), NOW_S) is None
        held = (await first.claim(held_n, NOW_S)).claims
        assert [c.job.id for c in held] == [j.id for j in jobs[:held_n]]
        (abandoned,) = (await second.claim(1, NOW_S)).claims  # the last in the queue; its worker dies
        assert abandoned.job.id == jobs[-1].id
        for step in range(1, 6):  # the first worker renews its claims; the second no longer does
            await asyncio.sleep(VISIBILITY_S / 3)
            for claim in held:
                assert await first.renew(claim, NOW_S + step * VISIBILITY_S / 3) == ClaimState.HELD
        later_s = NOW_S + 2 * VISIBILITY_S
        taken = await first.claim(1, later_s)
        assert [c.job.id for c in taken.claims] == [jobs[-1].id]
        assert (await first.claim(held_n, later_s)).claims == []

    two_workers(stores, body)


def test_release_hands_the_job_to_the_next_claim_at_once(stores: Stores) -> None:
    async def body(first: JobStore, second: JobStore) -> None:
        job = make_job(NOW_S)
        await first.submit(job, make_plan(2), KeyLimits(), NOW_S)
        (claim,) = (await first.claim(1, NOW_S)).claims
        await first.release(claim)
        (again,) = (await second.claim(1, NOW_S)).claims  # no visibility timeout to wait out
        assert again.job.id == job.id
        assert again.job.claims == 1  # a release is no failed attempt
        assert await first.renew(claim, NOW_S) == ClaimState.LOST

    two_workers(stores, body)


def test_a_segment_is_stored_once_and_counted_once(stores: Stores) -> None:
    async def body(first: JobStore, second: JobStore) -> None:
        job = make_job(NOW_S)
        await first.submit(job, make_plan(3), KeyLimits(), NOW_S)
        assert await first.put_segment(job.id, 1, b"first copy", 4800) == SegmentWrite.STORED
        # a second worker (a zombie that lost its claim) renders the same segment again
        results = await asyncio.gather(second.put_segment(job.id, 1, b"second copy", 4800),
                                       first.put_segment(job.id, 1, b"third copy", 4800))
        assert list(results) == [SegmentWrite.ALREADY_STORED, SegmentWrite.ALREADY_STORED]
        assert await second.segment(job.id, 1) == b"first copy"
        after = await second.get(job.id)
        assert after is not None
        assert (after.segments_done, after.audio_samples) == (1, 4800)
        assert await first.stored_segments(job.id) == {1}
        assert await first.segment(job.id, 0) is None
        assert await first.put_segment("job_000000000000ffffffffff", 0, b"x", 1) == SegmentWrite.JOB_GONE

    two_workers(stores, body)


def test_the_listing_leaves_out_jobs_whose_results_expired(stores: Stores) -> None:
    """`GET /v1/jobs/{id}` of an expired job answers 404 `job_expired` (its record is kept a grace longer for that):
    the listing leaves it out and still fills the page with older jobs."""
    async def scenario() -> None:
        async with stores("w1") as store:
            jobs = [make_job(NOW_S + i) for i in range(4)]
            for job in jobs:
                await store.submit(job, make_plan(1), KeyLimits(), NOW_S)
            for job, finished_s in ((jobs[3], NOW_S + 10), (jobs[1], NOW_S + 20 + TTL_S)):
                await store.put_segment(job.id, 0, b"a", 100)
                await store.finish(job.id, JobStatus.DONE, None, finished_s)
            assert [j.id for j in await store.list_jobs("k_test", NOW_S + 11)] == [j.id for j in reversed(jobs)]
            now_s = NOW_S + 30 + TTL_S  # jobs[3] finished more than TTL_S ago; jobs[1] did not
            assert [j.id for j in await store.list_jobs("k_test", now_s, limit=2)] == [jobs[2].id, jobs[1].id]
            assert [j.id for j in await store.list_jobs("k_test", now_s)] == [jobs[2].id, jobs[1].id, jobs[0].id]
            assert (await store.get(jobs[3].id)) is not None  # (kept for `get` to say "expired")

    run(scenario())


def test_finish_happens_once_and_done_needs_every_segment(stores: Stores) -> None:
    async def body(first: JobStore, second: JobStore) -> None:
        job = make_job(NOW_S)
        await first.submit(job, make_plan(2), KeyLimits(), NOW_S)
        (claim,) = (await first.claim(1, NOW_S)).claims
        await first.put_segment(job.id, 0, b"a", 100)
        with pytest.raises(IncompleteJob):
            await first.finish(job.id, JobStatus.DONE, None, NOW_S + 1)
        await first.put_segment(job.id, 1, b"b", 200)
        done, changed = await first.finish(job.id, JobStatus.DONE, None, NOW_S + 2)
        assert changed and done is not None
        assert (done.status, done.finished_at_s, done.audio_samples) == (JobStatus.DONE, NOW_S + 2, 300)
        again, changed_again = await second.finish(job.id, JobStatus.FAILED, "late", NOW_S + 3)
        assert not changed_again
        assert again is not None and (again.status, again.error) == (JobStatus.DONE, None)
        assert await first.renew(claim, NOW_S + 3) == ClaimState.FINISHED
        assert (await second.claim(4, NOW_S + 10)).claims == []  # acknowledged: never handed out again

    two_workers(stores, body)


def test_a_cancelled_job_stores_nothing_more_and_its_worker_hears_of_it(stores: Stores) -> None:
    async def body(first: JobStore, second: JobStore) -> None:
        job = make_job(NOW_S)
        await first.submit(job, make_plan(3), KeyLimits(), NOW_S)
        (claim,) = (await first.claim(1, NOW_S)).claims
        await first.put_segment(job.id, 0, b"a", 100)
        cancelled, changed = await second.finish(job.id, JobStatus.CANCELLED, None, NOW_S + 1)
        assert changed and cancelled is not None and cancelled.status == JobStatus.CANCELLED
        assert await first.put_segment(job.id, 1, b"b", 100) == SegmentWrite.JOB_FINISHED
        assert await first.renew(claim, NOW_S + 1) == ClaimState.FINISHED
        assert await first.stored_segments(job.id) == {0}

    two_workers(stores, body)


def test_a_job_that_keeps_losing_its_workers_fails(stores: Stores) -> None:
    async def scenario() -> None:
        async with stores("w1") as store:
            store.max_claims = 2
            job = make_job(NOW_S)
            await store.submit(job, make_plan(1), KeyLimits(), NOW_S)
            at_s = NOW_S
            for _ in range(2):
                assert [c.job.id for c in (await store.claim(1, at_s)).claims] == [job.id]
                await asyncio.sleep(VISIBILITY_S * 1.5)
                at_s += VISIBILITY_S * 2
            third = await store.claim(1, at_s)
            assert third.claims == []
            assert [(j.id, j.status) for j in third.failed] == [(job.id, JobStatus.FAILED)]
            assert third.failed[0].error == "claimed 2 times without finishing"
            assert (await store.usage("k_test", at_s)).unfinished_jobs == 0

    run(scenario())


def test_a_finished_job_with_a_webhook_enters_the_outbox_atomically_and_is_leased(stores: Stores) -> None:
    """DONE or FAILED with a webhook_url (finished, or failed by claim): in the outbox at once; a taken webhook is
    nobody else's until its lease ends; one put back is due when it says; one done is gone. Cancelled, or no URL:
    never in it."""
    url = "http://127.0.0.1:9/hook"

    async def body(first: JobStore, second: JobStore) -> None:
        done, failed, cancelled, silent, lost = (
            make_job(NOW_S + i, webhook_url=None if i == 3 else url) for i in range(5))
        for job in (done, failed, cancelled, silent, lost):
            await first.submit(job, make_plan(1), KeyLimits(), NOW_S)
        assert await first.take_webhooks(10, NOW_S, 5.0) == []
        claims = {c.job.id: c for c in (await first.claim(5, NOW_S)).claims}
        await first.put_segment(done.id, 0, b"a", 100)
        await first.finish(done.id, JobStatus.DONE, None, NOW_S + 1)
        await first.finish(failed.id, JobStatus.FAILED, "boom", NOW_S + 2)
        await first.finish(cancelled.id, JobStatus.CANCELLED, None, NOW_S + 2)
        await first.put_segment(silent.id, 0, b"a", 100)
        await first.finish(silent.id, JobStatus.DONE, None, NOW_S + 2)
        await first.finish(done.id, JobStatus.DONE, None, NOW_S + 3)  # a second finish: no second webhook
        assert await second.webhooks_pending() == 2
        taken = await second.take_webhooks(10, NOW_S + 3, 5.0)
        assert [(w.job.id, w.job.status, w.attempts) for w in taken] == [
            (done.id, JobStatus.DONE, 0), (failed.id, JobStatus.FAILED, 0)]
        assert await first.take_webhooks(10, NOW_S + 7, 5.0) == []  # leased to the second worker
        # the second worker died mid-attempt: after the lease the first takes both
        assert [w.job.id for w in await first.take_webhooks(1, NOW_S + 8.5, 5.0)] == [done.id]
        await first.webhook_retry(done.id, 1, NOW_S + 100)
        (again,) = await first.take_webhooks(10, NOW_S + 9, 5.0)
        assert again.job.id == failed.id
        await first.webhook_done(failed.id)
        assert await second.take_webhooks(10, NOW_S + 99, 5.0) == []  # the retry is not due yet
        (retry,) = await second.take_webhooks(10, NOW_S + 100, 5.0)
        assert (retry.job.id, retry.attempts) == (done.id, 1)
        await second.webhook_done(done.id)
        await first.webhook_retry(done.id, 2, NOW_S + 101)  # a late put-back of one done elsewhere: stays done
        assert await first.webhooks_pending() == 0
        assert await first.take_webhooks(10, NOW_S + 1000, 5.0) == []
        # a job failed by claim (it kept losing its workers) enters the outbox too
        first.max_claims = second.max_claims = 1
        await asyncio.sleep(VISIBILITY_S * 1.5)  # nobody renews `lost`'s claim
        outcome = await second.claim(1, NOW_S + 1000)
        assert [j.id for j in outcome.failed] == [lost.id] and lost.id in claims
        (hook,) = await first.take_webhooks(10, NOW_S + 1000, 5.0)
        assert (hook.job.id, hook.job.status) == (lost.id, JobStatus.FAILED)

    two_workers(stores, body)


def test_the_redis_store_keeps_audio_job_ttl_s_and_records_a_grace_longer(redis: RedisServer) -> None:
    async def scenario() -> None:
        client = redis_client(redis)
        store = RedisJobStore(client, prefix=fresh_prefix(), worker_id="w1", job_ttl_s=TTL_S)
        await store.start()
        try:
            job = make_job(NOW_S)
            await store.submit(job, make_plan(1), KeyLimits(), NOW_S)
            assert await client.pttl(store._job(job.id)) == -1  # unfinished: no expiry
            await store.put_segment(job.id, 0, b"a", 100)
            assert 0 < await client.pttl(store._segs(job.id)) <= TTL_S * 1000
            await store.finish(job.id, JobStatus.DONE, None, NOW_S + 1)
            record_ttl_ms = await client.pttl(store._job(job.id))
            assert (TTL_S + RECORD_GRACE_S) * 1000 - 5000 < record_ttl_ms <= (TTL_S + RECORD_GRACE_S) * 1000
            assert TTL_S * 1000 - 5000 < await client.pttl(store._segs(job.id)) <= TTL_S * 1000
            assert await client.xlen(store._queue) == 0  # acknowledged and deleted
        finally:
            await store.stop()
            await client.aclose()

    run(scenario())


def test_the_redis_group_forgets_consumers_of_replicas_that_are_gone(redis: RedisServer) -> None:
    """Each process claims under a name of its own, so every restart adds a consumer to the group: those that hold
    no claim and were idle long enough are deleted; one holding a claim, and the worker itself, are kept."""
    async def scenario() -> None:
        client = redis_client(redis)
        prefix = fresh_prefix()
        gone, holder, this = (RedisJobStore(client, prefix=prefix, worker_id=name, visibility_s=60.0)
                              for name in ("gone", "holder", "this"))
        try:
            await gone.start()
            for i, store in enumerate((gone, holder, this)):
                job = make_job(NOW_S + i)
                await store.submit(job, make_plan(1), KeyLimits(), NOW_S)
                assert len((await store.claim(1, NOW_S)).claims) == 1
                if store is not holder:  # done: its consumer holds nothing any more
                    await store.put_segment(job.id, 0, b"a", 100)
                    await store.finish(job.id, JobStatus.DONE, None, NOW_S + 1)
            await asyncio.sleep(0.1)
            assert await this.forget_consumers(0.05) == 1
            consumers = await client.xinfo_consumers(this._queue, "workers")
            assert sorted(_text(c["name"]) for c in consumers) == ["holder", "this"]
            assert await this.forget_consumers(0.05) == 0
        finally:
            await client.aclose()

    run(scenario())


def _text(value: bytes | str) -> str:
    return value.decode() if isinstance(value, bytes) else value


def test_the_redis_listing_skips_expired_records_and_still_fills_the_page(redis: RedisServer) -> None:
    """The listing keeps ids longer than their records: a page that meets expired ones fills up with older ids,
    and forgets the expired ones."""
    async def scenario() -> None:
        client = redis_client(redis)
        store = RedisJobStore(client, prefix=fresh_prefix(), worker_id="w1", job_ttl_s=TTL_S)
        await store.start()
        try:
            jobs = [make_job(NOW_S + i) for i in range(6)]
            for job in jobs:
                await store.submit(job, make_plan(1), KeyLimits(), NOW_S)
            await client.delete(store._job(jobs[4].id), store._job(jobs[3].id))  # expired: the ids stay listed
            first_page = await store.list_jobs("k_test", NOW_S, limit=3)
            assert [j.id for j in first_page] == [jobs[5].id, jobs[2].id, jobs[1].id]
            second_page = await store.list_jobs("k_test", NOW_S, limit=3, before=first_page[-1].id)
            assert [j.id for j in second_page] == [jobs[0].id]
            assert await client.zcard(store._list("k_test")) == 4  # the expired ids are forgotten
        finally:
            await store.stop()
            await client.aclose()

    run(scenario())


def test_the_embedded_store_resumes_after_a_restart_and_purges_expired_audio(tmp_path: Path) -> None:
    directory = tmp_path / "jobs"

    async def scenario() -> None:
        store = SqliteJobStore(directory, job_ttl_s=TTL_S, visibility_s=600.0)
        await store.start()
        running, queued = make_job(NOW_S), make_job(NOW_S + 1)
        await store.submit(running, make_plan(2), KeyLimits(), NOW_S)
        await store.submit(queued, make_plan(2), KeyLimits(), NOW_S)
        (claim,) = (await store.claim(1, NOW_S)).claims
        assert claim.job.id == running.id
        await store.put_segment(running.id, 0, b"segment zero", 100)
        with pytest.raises(DirectoryInUse):
            await SqliteJobStore(directory).start()
        await store.stop()  # (a crash leaves the same: the lease is not given back)

        restarted = SqliteJobStore(directory, job_ttl_s=TTL_S, visibility_s=600.0)
        await restarted.start()
        try:
            got = await restarted.claim(4, NOW_S + 1)  # long before the old lease would run out
            assert [c.job.id for c in got.claims] == [running.id, queued.id]
            assert await restarted.stored_segments(running.id) == {0}
            assert await restarted.segment(running.id, 0) == b"segment zero"
            await restarted.put_segment(running.id, 1, b"segment one", 100)
            await restarted.finish(running.id, JobStatus.DONE, None, NOW_S + 2)
            assert await restarted.sweep(NOW_S + 2 + TTL_S - 1) == 0
            assert await restarted.sweep(NOW_S + 2 + TTL_S) == 1
            assert await restarted.segment(running.id, 0) is None
            assert not (directory / "audio" / running.id).exists()
            assert await restarted.get(running.id) is not None  # the record stays: GET says "expired"
            await restarted.sweep(NOW_S + 2 + TTL_S + RECORD_GRACE_S)
            assert await restarted.get(running.id) is None
        finally:
            await restarted.stop()

    run(scenario())

