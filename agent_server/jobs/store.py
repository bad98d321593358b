"""Where jobs live: one interface, two backends.

- `SqliteJobStore` (embedded, the default: no Redis): records in SQLite under `--data-dir/jobs/`, each segment's
  audio a file beside it. One process owns the directory (a lock file); on start it takes over the jobs a
  previous process left queued or running.
- `RedisJobStore` (`--redis-url`): records and progress in Redis hashes, the queue a Redis Stream with a
  consumer group (replicas claim with XREADGROUP; a dead replica's claims come back after the visibility
  timeout through XAUTOCLAIM), each segment's audio one field of a per-job hash, written with HSETNX.

What both promise (tests/agent_server/jobs/test_store.py runs the same checks on both):
- `submit` is atomic with the key's quotas: at most `max_running_jobs` unfinished jobs per key, at most
  `daily_chars` characters submitted per key and UTC day; over either, nothing is created and a `Refusal` says
  when to come back.
- a segment is stored at most once: `put_segment` of an index already there stores nothing, counts nothing,
  and says so (ALREADY_STORED). Progress (`segments_done`, `audio_samples`) moves only with a first store, in the
  same atomic step. Nothing is stored for a finished (e.g. cancelled) job.
- resume = the segments not in `stored_segments`: a job claimed again continues from the first one missing.
- a claim is held while its worker renews it (`renew`, more often than `visibility_s`); one not renewed for
  `visibility_s` goes to the next worker that claims. A claim renewed after another worker took it is LOST.
- `finish` happens once: the first call for a job changes it (and says so); later ones return the record
  unchanged. A finished job's audio is kept `job_ttl_s`, its record `job_ttl_s + RECORD_GRACE_S` (so that `GET`
  can answer "expired" rather than "no such job").
- a store that cannot be reached raises one of `STORE_ERRORS` (the API answers 503; the runner tries again).
- the webhook outbox: a job that finishes DONE or FAILED with a `webhook_url` (by `finish`, or failed by `claim`)
  enters it in the same atomic step, due at once. `take_webhooks` leases due ones to a worker, which makes one
  attempt and then either drops it (`webhook_done`) or puts it back for later (`webhook_retry`); a worker that
  dies mid-attempt leaves it to whoever takes it after the lease. So a webhook is delivered at least once, by
  whichever replica, whatever happens to the one that finished the job.
"""

from __future__ import annotations

import enum
import math
import sqlite3
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from redis.exceptions import RedisError

from agent_server.jobs.model import QUOTA_CHARS, QUOTA_RUNNING, Job, JobSegment, JobStatus

STORE_ERRORS = (RedisError, OSError, sqlite3.OperationalError)  # the store unreachable (or its disk full)
DEFAULT_JOB_TTL_S = 86_400.0  # --job-ttl-s
RECORD_GRACE_S = 7 * 86_400.0  # an expired job's record stays this much longer: GET says "expired"
DEFAULT_VISIBILITY_S = 60.0  # a claim not renewed this long goes back to the queue
MAX_CLAIMS = 5  # a job claimed this often without finishing fails (it keeps killing its workers)
RUNNING_RETRY_AFTER_S = 30  # Retry-After when a key has its most unfinished jobs (no better guess)
SECONDS_PER_DAY = 86_400
DEFAULT_LIST_LIMIT = 20
MAX_LIST_LIMIT = 100


@dataclass(frozen=True, slots=True)
class KeyLimits:
    max_running_jobs: int = 0  # unfinished (queued or running) jobs per key; 0: no limit
    daily_chars: int = 0  # characters submitted per key and UTC day; 0: no limit


@dataclass(frozen=True, slots=True)
class Refusal:
    """A submission over a quota: nothing was created. `retry_after_s` is the Retry-After header."""

    code: str  # model.QUOTA_RUNNING | model.QUOTA_CHARS
    message: str
    retry_after_s: int


@dataclass(frozen=True, slots=True)
class Usage:
    """A key's use of its quotas now (metrics, and the 429's message)."""

    unfinished_jobs: int
    chars_today: int


@dataclass(frozen=True, slots=True)
class Claim:
    """A job a worker took. `token` is the backend's handle on the claim (the stream entry id in Redis)."""

    job: Job
    worker: str
    token: str


@dataclass(frozen=True, slots=True)
class Claimed:
    """What one `claim` call got: jobs to run, and jobs it failed instead (claimed MAX_CLAIMS times without
    finishing: the caller sends their webhooks)."""

    claims: list[Claim]
    failed: list[Job]


@dataclass(frozen=True, slots=True)
class DueWebhook:
    """A webhook whose next attempt is due, leased to the worker that took it."""

    job: Job  # the record now: its status JSON is the body
    attempts: int  # attempts made before this one


class ClaimState(enum.IntEnum):
    HELD = 0  # still this worker's
    LOST = 1  # another worker has it now (this one was presumed dead): stop, store nothing more
    FINISHED = 2  # the job finished meanwhile (cancelled, or failed elsewhere): stop
    GONE = 3  # no such job any more


class SegmentWrite(enum.IntEnum):
    STORED = 0
    ALREADY_STORED = 1  # this index was there: nothing stored, nothing counted
    JOB_FINISHED = 2  # the job is cancelled (or otherwise finished): nothing stored
    JOB_GONE = 3


class JobStore:
    """The interface (docstring above). Times are unix seconds, passed in by the caller (its clock)."""

    shared = False  # True: other replicas see the same jobs

    def __init__(self, *, worker_id: str, job_ttl_s: float = DEFAULT_JOB_TTL_S,
                 visibility_s: float = DEFAULT_VISIBILITY_S, max_claims: int = MAX_CLAIMS) -> None:
        if job_ttl_s <= 0 or visibility_s <= 0 or max_claims < 1:
            raise ValueError("job_ttl_s and visibility_s must be > 0, max_claims >= 1")
        self.worker_id = worker_id
        self.job_ttl_s = job_ttl_s
        self.visibility_s = visibility_s
        self.max_claims = max_claims

    async def start(self) -> None:
        """Open (and, embedded, take over what a previous process left)."""

    async def stop(self) -> None:
        """Close. Claims this worker holds come back to the queue after `visibility_s` (or at once after
        `release`)."""

    # ---- clients ------------------------------------------------------------------------------------

    async def submit(self, job: Job, plan: Sequence[JobSegment], limits: KeyLimits, now_s: float) -> Refusal | None:
        """Create and enqueue the job (its `segments_total` set to the plan's length), unless that puts its key
        over a quota (then nothing happens)."""
        raise NotImplementedError

    async def get(self, job_id: str) -> Job | None:
        raise NotImplementedError

    async def list_jobs(self, key_id: str, now_s: float, *, limit: int = DEFAULT_LIST_LIMIT,
                        before: str | None = None) -> list[Job]:
        """The key's jobs whose results have not expired at `now_s`, newest first, ids below `before` (the last id
        of the previous page): `limit` of them (`check_list_limit`), fewer only where the listing ends. (An expired
        job's record outlives its results by RECORD_GRACE_S, for `get`; the listing has left it.)"""
        raise NotImplementedError

    async def usage(self, key_id: str, now_s: float) -> Usage:
        raise NotImplementedError

    async def queue_depth(self) -> int:
        """Jobs waiting for a worker: submitted and not claimed yet (metrics: `tts_jobs_queue_depth`)."""
        raise NotImplementedError

    # ---- workers ------------------------------------------------------------------------------------

    async def claim(self, max_jobs: int, now_s: float) -> Claimed:
        """Up to `max_jobs` jobs for this worker: claims abandoned by dead workers first, then queued jobs."""
        raise NotImplementedError

    async def renew(self, claim: Claim, now_s: float) -> ClaimState:
        raise NotImplementedError

    async def release(self, claim: Claim) -> None:
        """Give a claim back for the next worker at once (a replica shutting down), unless it finished."""
        raise NotImplementedError

    async def plan(self, job_id: str) -> tuple[JobSegment, ...] | None:
        raise NotImplementedError

    async def stored_segments(self, job_id: str) -> set[int]:
        raise NotImplementedError

    async def put_segment(self, job_id: str, index: int, blob: bytes, samples: int) -> SegmentWrite:
        raise NotImplementedError

    async def segment(self, job_id: str, index: int) -> bytes | None:
        raise NotImplementedError

    async def finish(self, job_id: str, status: JobStatus, error: str | None, now_s: float) -> tuple[Job | None, bool]:
        """(the record after, whether this call finished it). DONE needs every segment stored."""
        raise NotImplementedError

    async def sweep(self, now_s: float) -> int:
        """Drop what expired (the embedded store; Redis expires on its own). Returns the jobs purged."""
        return 0

    async def watch_cancels(self, cancelled: Callable[[str], None]) -> None:
        """Call `cancelled(job_id)` for each job cancelled through any replica, until the calling task is
        cancelled; raises when the store cannot be reached (the caller watches again). A store that is not
        `shared` returns at once: its one process's API tells its runner directly."""
        return

    # ---- the webhook outbox -------------------------------------------------------------------------

    async def take_webhooks(self, max_n: int, now_s: float, lease_s: float) -> list[DueWebhook]:
        """Up to `max_n` webhooks due at `now_s`, soonest first, each leased to this worker: not handed out again
        before `now_s + lease_s`. One whose job record is gone is dropped."""
        raise NotImplementedError

    async def webhook_retry(self, job_id: str, attempts: int, due_s: float) -> None:
        """Put a taken webhook back, `attempts` made so far, its next attempt due at `due_s`."""
        raise NotImplementedError

    async def webhook_done(self, job_id: str) -> None:
        """Drop a webhook from the outbox: delivered, refused, or given up."""
        raise NotImplementedError

    async def webhooks_pending(self) -> int:
        """Webhooks in the outbox, due or not (metrics: `tts_jobs_webhooks_pending`)."""
        raise NotImplementedError


class IncompleteJob(RuntimeError):
    """finish(DONE) of a job with segments missing (a bug in the caller)."""


def utc_day(now_s: float) -> str:
    return time.strftime("%Y%m%d", time.gmtime(now_s))


def seconds_to_next_utc_day(now_s: float) -> int:
    return max(1, math.ceil((math.floor(now_s / SECONDS_PER_DAY) + 1) * SECONDS_PER_DAY - now_s))


def running_refusal(limit: int) -> Refusal:
    return Refusal(QUOTA_RUNNING, f"this key has {limit} unfinished jobs, its most: wait for one to finish "
                   "(or cancel one)", RUNNING_RETRY_AFTER_S)


def chars_refusal(used: int, limit: int, asked: int, now_s: float) -> Refusal:
    return Refusal(QUOTA_CHARS, f"this key submitted {used} of its {limit} characters today (UTC); this job has "
                   f"{asked}", seconds_to_next_utc_day(now_s))


def check_list_limit(limit: int) -> int:
    """A store lists up to one more than a page: the API reads one record ahead to know whether a next page
    has any."""
    return max(1, min(MAX_LIST_LIMIT + 1, limit))
