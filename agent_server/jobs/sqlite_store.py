"""The embedded job store: SQLite records and segment files under one directory (`--data-dir/jobs`).

    jobs/jobs.sqlite3          the records (table jobs), stored segments (segments), per-key daily characters (usage)
    jobs/audio/<job id>/<index>.opus   each segment's audio (segment_audio.py), written once
    jobs/.lock                 held (flock) by the one process that owns the directory

Every statement runs on one thread of its own (a single-worker executor), so the event loop never waits on the
disk and the statements of one process never interleave; a multi-statement change is one transaction.

A segment file is written to a temporary name and hard-linked to its final name: the link fails when the file
exists, so a file is never overwritten, and one that exists is complete. Its row is then inserted with INSERT OR
IGNORE, and only an inserted row moves the job's progress: a segment stored twice counts once, and a crash
between the file and the row is healed by the next attempt.
"""

from __future__ import annotations

import asyncio
import contextlib
import fcntl
import os
import shutil
import sqlite3
import uuid
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, TypeVar

from agent_server.jobs.model import Job, JobSegment, JobStatus, plan_from_json, plan_to_json
from agent_server.jobs.store import (
    DEFAULT_JOB_TTL_S,
    DEFAULT_LIST_LIMIT,
    DEFAULT_VISIBILITY_S,
    MAX_CLAIMS,
    RECORD_GRACE_S,
    Claim,
    Claimed,
    ClaimState,
    DueWebhook,
    IncompleteJob,
    JobStore,
    KeyLimits,
    Refusal,
    SegmentWrite,
    Usage,
    chars_refusal,
    check_list_limit,
    running_refusal,
    utc_day,
)

T = TypeVar("T")

DB_NAME = "jobs.sqlite3"
AUDIO_DIR = "audio"
LOCK_NAME = ".lock"
SEGMENT_SUFFIX = ".opus"
BUSY_TIMEOUT_S = 5.0
PROGRESS_COLUMNS = "status, segments_done, audio_samples, started_at_s, finished_at_s, error, claims"

SCHEMA = """
CREATE TABLE IF NOT EXISTS jobs (
    id TEXT PRIMARY KEY,
    key_id TEXT NOT NULL,
    spec BLOB NOT NULL,
    plan BLOB NOT NULL,
    text_chars INTEGER NOT NULL,
    status INTEGER NOT NULL,
    segments_done INTEGER NOT NULL DEFAULT 0,
    audio_samples INTEGER NOT NULL DEFAULT 0,
    started_at_s REAL,
    finished_at_s REAL,
    error TEXT,
    claims INTEGER NOT NULL DEFAULT 0,
    worker TEXT,
    lease_until_s REAL NOT NULL DEFAULT 0,
    purged INTEGER NOT NULL DEFAULT 0
);
CREATE INDEX IF NOT EXISTS jobs_by_key ON jobs (key_id, id);
CREATE INDEX IF NOT EXISTS jobs_by_status ON jobs (status, id);
CREATE TABLE IF NOT EXISTS segments (
    job_id TEXT NOT NULL,
    idx INTEGER NOT NULL,
    samples INTEGER NOT NULL,
    PRIMARY KEY (job_id, idx)
);
CREATE TABLE IF NOT EXISTS webhooks (
    job_id TEXT PRIMARY KEY,
    due_s REAL NOT NULL,
    attempts INTEGER NOT NULL DEFAULT 0
);
CREATE INDEX IF NOT EXISTS webhooks_by_due ON webhooks (due_s);
CREATE TABLE IF NOT EXISTS usage (
    key_id TEXT NOT NULL,
    day TEXT NOT NULL,
    chars INTEGER NOT NULL,
    PRIMARY KEY (key_id, day)
);
"""


class DirectoryInUse(RuntimeError):
    """Another process owns this job directory."""


class SqliteJobStore(JobStore):
    def __init__(self, directory: Path, *, worker_id: str = "embedded", job_ttl_s: float = DEFAULT_JOB_TTL_S,
                 visibility_s: float = DEFAULT_VISIBILITY_S, max_claims: int = MAX_CLAIMS) -> None:
        super().__init__(worker_id=worker_id, job_ttl_s=job_ttl_s, visibility_s=visibility_s, max_claims=max_claims)
        self.directory = directory
        self._executor: ThreadPoolExecutor | None = None
        self._db: sqlite3.Connection | None = None
        self._lock_fd: int | None = None

    # ---- lifecycle ----------------------------------------------------------------------------------

    async def start(self) -> None:
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="job-store")
        await self._run(self._open)

    async def stop(self) -> None:
        if self._executor is None:
            return
        await self._run(self._close)
        self._executor.shutdown(wait=True)
        self._executor = None

    def _open(self) -> None:
        (self.directory / AUDIO_DIR).mkdir(parents=True, exist_ok=True)
        fd = os.open(self.directory / LOCK_NAME, os.O_RDWR | os.O_CREAT, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            raise DirectoryInUse(f"{self.directory} is another server process's job store") from None
        self._lock_fd = fd
        db = sqlite3.connect(self.directory / DB_NAME, timeout=BUSY_TIMEOUT_S, isolation_level=None,
                             check_same_thread=False)
        db.execute("PRAGMA journal_mode=WAL")
        db.execute("PRAGMA synchronous=NORMAL")
        db.executescript(SCHEMA)
        # the one process here now: what an earlier one was running is free to claim at once
        db.execute("UPDATE jobs SET lease_until_s = 0, worker = NULL WHERE status = ?", (JobStatus.RUNNING,))
        self._db = db

    def _close(self) -> None:
        if self._db is not None:
            self._db.close()
            self._db = None
        if self._lock_fd is not None:
            os.close(self._lock_fd)  # (releases the flock)
            self._lock_fd = None

    async def _run(self, fn: Callable[..., T], *args: Any) -> T:
        if self._executor is None:
            raise RuntimeError("the job store is not started")
        return await asyncio.get_running_loop().run_in_executor(self._executor, fn, *args)

    @property
    def db(self) -> sqlite3.Connection:
        if self._db is None:
            raise RuntimeError("the job store is not started")
        return self._db

    # ---- clients ------------------------------------------------------------------------------------

    async def submit(self, job: Job, plan: Sequence[JobSegment], limits: KeyLimits, now_s: float) -> Refusal | None:
        job.segments_total = len(plan)
        return await self._run(self._submit, job, plan_to_json(plan), limits, now_s)

    def _submit(self, job: Job, plan: bytes, limits: KeyLimits, now_s: float) -> Refusal | None:
        day = utc_day(now_s)
        with _transaction(self.db) as db:
            if limits.max_running_jobs > 0:
                (unfinished,) = db.execute("SELECT count(*) FROM jobs WHERE key_id = ? AND status < ?",
                                           (job.key_id, JobStatus.DONE)).fetchone()
                if unfinished >= limits.max_running_jobs:
                    return running_refusal(limits.max_running_jobs)
            if limits.daily_chars > 0:
                used = _chars_on(db, job.key_id, day)
                if used + job.text_chars > limits.daily_chars:
                    return chars_refusal(used, limits.daily_chars, job.text_chars, now_s)
            db.execute("INSERT INTO usage (key_id, day, chars) VALUES (?, ?, ?) "
                       "ON CONFLICT (key_id, day) DO UPDATE SET chars = chars + excluded.chars",
                       (job.key_id, day, job.text_chars))
            db.execute("INSERT INTO jobs (id, key_id, spec, plan, text_chars, status) VALUES (?, ?, ?, ?, ?, ?)",
                       (job.id, job.key_id, job.spec_json(), plan, job.text_chars, JobStatus.QUEUED))
        return None

    async def get(self, job_id: str) -> Job | None:
        return await self._run(self._get, job_id)

    def _get(self, job_id: str) -> Job | None:
        row = self.db.execute(f"SELECT spec, {PROGRESS_COLUMNS} FROM jobs WHERE id = ?", (job_id,)).fetchone()
        return None if row is None else _job(row)

    async def list_jobs(self, key_id: str, now_s: float, *, limit: int = DEFAULT_LIST_LIMIT,
                        before: str | None = None) -> list[Job]:
        return await self._run(self._list, key_id, now_s, check_list_limit(limit), before)

    def _list(self, key_id: str, now_s: float, limit: int, before: str | None) -> list[Job]:
        rows = self.db.execute(
            f"SELECT spec, {PROGRESS_COLUMNS} FROM jobs WHERE key_id = ? AND id < ? "
            "AND (finished_at_s IS NULL OR finished_at_s > ?) ORDER BY id DESC LIMIT ?",
            (key_id, before if before is not None else "\U0010ffff", now_s - self.job_ttl_s, limit)).fetchall()
        return [_job(row) for row in rows]

    async def usage(self, key_id: str, now_s: float) -> Usage:
        return await self._run(self._usage, key_id, now_s)

    def _usage(self, key_id: str, now_s: float) -> Usage:
        (unfinished,) = self.db.execute("SELECT count(*) FROM jobs WHERE key_id = ? AND status < ?",
                                        (key_id, JobStatus.DONE)).fetchone()
        return Usage(int(unfinished), _chars_on(self.db, key_id, utc_day(now_s)))

    async def queue_depth(self) -> int:
        return await self._run(self._queue_depth)

    def _queue_depth(self) -> int:
        (queued,) = self.db.execute("SELECT count(*) FROM jobs WHERE status = ?", (JobStatus.QUEUED,)).fetchone()
        return int(queued)

    # ---- workers ------------------------------------------------------------------------------------

    async def claim(self, max_jobs: int, now_s: float) -> Claimed:
        return await self._run(self._claim, max_jobs, now_s)

    def _claim(self, max_jobs: int, now_s: float) -> Claimed:
        claims: list[Claim] = []
        failed: list[Job] = []
        with _transaction(self.db) as db:
            # abandoned claims first (leases run out), then the queue, oldest first
            rows = db.execute(
                "SELECT id FROM jobs WHERE (status = ? AND lease_until_s < ?) OR status = ? "
                "ORDER BY status DESC, id LIMIT ?",
                (JobStatus.RUNNING, now_s, JobStatus.QUEUED, max_jobs)).fetchall()
            for (job_id,) in rows:
                db.execute("UPDATE jobs SET claims = claims + 1 WHERE id = ?", (job_id,))
                (claims_so_far,) = db.execute("SELECT claims FROM jobs WHERE id = ?", (job_id,)).fetchone()
                if claims_so_far > self.max_claims:
                    self._finish_in(db, job_id, JobStatus.FAILED,
                                    f"claimed {claims_so_far - 1} times without finishing", now_s)
                    job = self._get(job_id)
                    if job is not None:
                        failed.append(job)
                    continue
                token = uuid.uuid4().hex
                db.execute("UPDATE jobs SET status = ?, worker = ?, lease_until_s = ?, "
                           "started_at_s = coalesce(started_at_s, ?) WHERE id = ?",
                           (JobStatus.RUNNING, f"{self.worker_id}/{token}", now_s + self.visibility_s, now_s, job_id))
                job = self._get(job_id)
                if job is not None:
                    claims.append(Claim(job, self.worker_id, token))
        return Claimed(claims, failed)

    async def renew(self, claim: Claim, now_s: float) -> ClaimState:
        return await self._run(self._renew, claim, now_s)

    def _renew(self, claim: Claim, now_s: float) -> ClaimState:
        with _transaction(self.db) as db:
            row = db.execute("SELECT status, worker FROM jobs WHERE id = ?", (claim.job.id,)).fetchone()
            if row is None:
                return ClaimState.GONE
            status, worker = row
            if status >= JobStatus.DONE:
                return ClaimState.FINISHED
            if worker != f"{claim.worker}/{claim.token}":
                return ClaimState.LOST
            db.execute("UPDATE jobs SET lease_until_s = ? WHERE id = ?", (now_s + self.visibility_s, claim.job.id))
        return ClaimState.HELD

    async def release(self, claim: Claim) -> None:
        await self._run(self._release, claim)

    def _release(self, claim: Claim) -> None:
        self.db.execute("UPDATE jobs SET status = ?, lease_until_s = 0, worker = NULL, claims = claims - 1 "
                        "WHERE id = ? AND worker = ? AND status = ?",
                        (JobStatus.QUEUED, claim.job.id, f"{claim.worker}/{claim.token}", JobStatus.RUNNING))

    async def plan(self, job_id: str) -> tuple[JobSegment, ...] | None:
        row = await self._run(lambda: self.db.execute("SELECT plan FROM jobs WHERE id = ?", (job_id,)).fetchone())
        return None if row is None else plan_from_json(row[0])

    async def stored_segments(self, job_id: str) -> set[int]:
        rows = await self._run(lambda: self.db.execute("SELECT idx FROM segments WHERE job_id = ?",
                                                       (job_id,)).fetchall())
        return {int(idx) for (idx,) in rows}

    async def put_segment(self, job_id: str, index: int, blob: bytes, samples: int) -> SegmentWrite:
        return await self._run(self._put_segment, job_id, index, blob, samples)

    def _put_segment(self, job_id: str, index: int, blob: bytes, samples: int) -> SegmentWrite:
        row = self.db.execute("SELECT status, segments_done FROM jobs WHERE id = ?", (job_id,)).fetchone()
        if row is None:
            return SegmentWrite.JOB_GONE
        if row[0] >= JobStatus.DONE:
            return SegmentWrite.JOB_FINISHED
        self._write_once(self._segment_path(job_id, index), blob)
        with _transaction(self.db) as db:
            status = db.execute("SELECT status FROM jobs WHERE id = ?", (job_id,)).fetchone()
            if status is None:
                return SegmentWrite.JOB_GONE
            if status[0] >= JobStatus.DONE:
                return SegmentWrite.JOB_FINISHED
            inserted = db.execute("INSERT OR IGNORE INTO segments (job_id, idx, samples) VALUES (?, ?, ?)",
                                  (job_id, index, samples)).rowcount
            if not inserted:
                return SegmentWrite.ALREADY_STORED
            db.execute("UPDATE jobs SET segments_done = segments_done + 1, audio_samples = audio_samples + ? "
                       "WHERE id = ?", (samples, job_id))
        return SegmentWrite.STORED

    def _segment_path(self, job_id: str, index: int) -> Path:
        return self.directory / AUDIO_DIR / job_id / f"{index:06d}{SEGMENT_SUFFIX}"

    @staticmethod
    def _write_once(path: Path, blob: bytes) -> None:
        """The file at `path` holds `blob` afterwards, unless it existed (then it holds an earlier, complete
        write of the same segment and is left alone)."""
        path.parent.mkdir(parents=True, exist_ok=True)
        temp = path.with_name(f".{path.name}.{uuid.uuid4().hex}")
        with open(temp, "wb") as out:
            out.write(blob)
            out.flush()
            os.fsync(out.fileno())
        try:
            os.link(temp, path)
        except FileExistsError:
            pass
        finally:
            temp.unlink()

    async def segment(self, job_id: str, index: int) -> bytes | None:
        return await self._run(self._segment, job_id, index)

    def _segment(self, job_id: str, index: int) -> bytes | None:
        if self.db.execute("SELECT 1 FROM segments WHERE job_id = ? AND idx = ?", (job_id, index)).fetchone() is None:
            return None
        try:
            return self._segment_path(job_id, index).read_bytes()
        except FileNotFoundError:
            return None  # purged (expired) under us

    async def finish(self, job_id: str, status: JobStatus, error: str | None, now_s: float) -> tuple[Job | None, bool]:
        return await self._run(self._finish, job_id, status, error, now_s)

    def _finish(self, job_id: str, status: JobStatus, error: str | None, now_s: float) -> tuple[Job | None, bool]:
        with _transaction(self.db) as db:
            changed = self._finish_in(db, job_id, status, error, now_s)
        return self._get(job_id), changed

    def _finish_in(self, db: sqlite3.Connection, job_id: str, status: JobStatus, error: str | None,
                   now_s: float) -> bool:
        if not status.finished:
            raise ValueError(f"finish with {status.name}")
        row = db.execute("SELECT status, segments_done, spec FROM jobs WHERE id = ?", (job_id,)).fetchone()
        if row is None or row[0] >= JobStatus.DONE:
            return False
        if status == JobStatus.DONE:
            total = Job.from_stored(row[2], {}).segments_total
            if row[1] != total:
                raise IncompleteJob(f"{job_id}: {row[1]} of {total} segments stored")
        db.execute("UPDATE jobs SET status = ?, error = ?, finished_at_s = ?, worker = NULL, lease_until_s = 0 "
                   "WHERE id = ?", (status, error, now_s, job_id))
        if status in (JobStatus.DONE, JobStatus.FAILED) and Job.from_stored(row[2], {}).webhook_url is not None:
            db.execute("INSERT OR IGNORE INTO webhooks (job_id, due_s) VALUES (?, ?)", (job_id, now_s))
        return True

    # ---- the webhook outbox -------------------------------------------------------------------------

    async def take_webhooks(self, max_n: int, now_s: float, lease_s: float) -> list[DueWebhook]:
        return await self._run(self._take_webhooks, max_n, now_s, lease_s)

    def _take_webhooks(self, max_n: int, now_s: float, lease_s: float) -> list[DueWebhook]:
        due: list[DueWebhook] = []
        with _transaction(self.db) as db:
            for job_id, attempts in db.execute(
                    "SELECT job_id, attempts FROM webhooks WHERE due_s <= ? ORDER BY due_s LIMIT ?",
                    (now_s, max_n)).fetchall():
                row = db.execute(f"SELECT spec, {PROGRESS_COLUMNS} FROM jobs WHERE id = ?", (job_id,)).fetchone()
                if row is None:
                    db.execute("DELETE FROM webhooks WHERE job_id = ?", (job_id,))
                    continue
                db.execute("UPDATE webhooks SET due_s = ? WHERE job_id = ?", (now_s + lease_s, job_id))
                due.append(DueWebhook(_job(row), int(attempts)))
        return due

    async def webhook_retry(self, job_id: str, attempts: int, due_s: float) -> None:
        await self._run(self._execute, "UPDATE webhooks SET attempts = ?, due_s = ? WHERE job_id = ?",
                        (attempts, due_s, job_id))

    async def webhook_done(self, job_id: str) -> None:
        await self._run(self._execute, "DELETE FROM webhooks WHERE job_id = ?", (job_id,))

    async def webhooks_pending(self) -> int:
        return await self._run(self._count, "SELECT count(*) FROM webhooks")

    def _execute(self, sql: str, args: tuple[Any, ...]) -> None:
        self.db.execute(sql, args)

    def _count(self, sql: str) -> int:
        (n,) = self.db.execute(sql).fetchone()
        return int(n)

    async def sweep(self, now_s: float) -> int:
        return await self._run(self._sweep, now_s)

    def _sweep(self, now_s: float) -> int:
        """Audio of jobs finished `job_ttl_s` ago is deleted; their records `RECORD_GRACE_S` later."""
        expired = [job_id for (job_id,) in self.db.execute(
            "SELECT id FROM jobs WHERE finished_at_s IS NOT NULL AND finished_at_s <= ? AND purged = 0",
            (now_s - self.job_ttl_s,)).fetchall()]
        for job_id in expired:
            with _transaction(self.db) as db:
                db.execute("UPDATE jobs SET purged = 1 WHERE id = ?", (job_id,))
                db.execute("DELETE FROM segments WHERE job_id = ?", (job_id,))
            shutil.rmtree(self.directory / AUDIO_DIR / job_id, ignore_errors=True)
        self.db.execute("DELETE FROM jobs WHERE purged = 1 AND finished_at_s <= ?",
                        (now_s - self.job_ttl_s - RECORD_GRACE_S,))
        self.db.execute("DELETE FROM usage WHERE day < ?", (utc_day(now_s - 2 * 86_400),))
        self.db.execute("DELETE FROM webhooks WHERE job_id NOT IN (SELECT id FROM jobs)")
        return len(expired)


@contextlib.contextmanager
def _transaction(db: sqlite3.Connection) -> Iterator[sqlite3.Connection]:
    """BEGIN IMMEDIATE ... COMMIT (ROLLBACK on an exception): the writes in it are atomic, and no other
    connection writes in between."""
    db.execute("BEGIN IMMEDIATE")
    try:
        yield db
    except BaseException:
        db.execute("ROLLBACK")
        raise
    db.execute("COMMIT")


def _chars_on(db: sqlite3.Connection, key_id: str, day: str) -> int:
    row = db.execute("SELECT chars FROM usage WHERE key_id = ? AND day = ?", (key_id, day)).fetchone()
    return 0 if row is None else int(row[0])


def _job(row: Sequence[Any]) -> Job:
    spec, status, done, samples, started, finished, error, claims = row
    return Job.from_stored(spec, {"status": status, "segments_done": done, "audio_samples": samples,
                                  "started_at_s": started, "finished_at_s": finished, "error": error,
                                  "claims": claims})
