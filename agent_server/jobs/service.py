"""Jobs on this server: the store, the runner, the engine render and the HTTP API, wired to the hub.

    jobs = JobService(hub, JobsConfig.from_settings(settings))
    routes = jobs.routes()                  # /v1/jobs... (create_app)
    await jobs.start() ... await jobs.stop()   # the app's lifespan

- the store: `RedisJobStore` with a Redis URL (`--jobs-redis-url`, else `--redis-url`: every replica claims from
  one queue), else `SqliteJobStore` under `--data-dir/jobs` (a restart resumes what was queued or running);
- the runner starts once the server serves (`hub.became_ready`: the engine loaded and warmed up) and stops when the
  drain begins (`hub.on_drain`), handing its claims back at once, so it is gone before the engine stops;
- each job gets its share of the engine's rows: `max_slots // jobs running here` segments in flight (at least 1),
  and at most `--job-workers` (default: max_slots) jobs run here at once: job segments in the engine's queues stay
  about max_slots, far below its wait-queue bound, so they never crowd a live segment out of it;
- every `SWEEP_S` the embedded store is swept (expired jobs purged; Redis expires keys by itself), and so are the
  files this replica assembled (those of expired jobs removed, with what a kill mid-build left);
- for the metrics, the queue depth and the per-key usage are read every `REFRESH_S` in the background (a scrape
  never waits on the store).

A store that cannot be opened (another process owns the directory, Redis refuses) leaves live speech serving: the
jobs API then answers 503 `unavailable` with the reason, and /v1/status says it.
"""

from __future__ import annotations

import asyncio
import collections
import secrets
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import structlog
from starlette.requests import Request
from starlette.routing import Route

from agent_server.core.hub import Hub
from agent_server.errors import UNAVAILABLE
from agent_server.fleet.auth import ANONYMOUS, principal_of
from agent_server.jobs.api import STATUS_UNAVAILABLE, JobsApi
from agent_server.jobs.assembly import AudioFiles
from agent_server.jobs.model import STATUS_NOT_FOUND, Job, JobError
from agent_server.jobs.redis_store import RedisJobStore
from agent_server.jobs.render import EngineRender
from agent_server.jobs.request import DEFAULT_MAX_JOB_CHARS, job_format
from agent_server.jobs.runner import JobRunner
from agent_server.jobs.sqlite_store import SqliteJobStore
from agent_server.jobs.store import DEFAULT_JOB_TTL_S, DEFAULT_VISIBILITY_S, JobStore, KeyLimits, Usage
from agent_server.jobs.webhooks import AllowList, WebhookSender, webhook_secret
from agent_server.settings import Settings

log = structlog.get_logger("agent_server.jobs.service")

JOBS_OFF = "jobs_off"
REDIS_TIMEOUT_S = 2.0  # connect and per-command: a segment's audio is tens of kB; a lost reply is an error, not a hang
SWEEP_S = 60.0
REFRESH_S = 2.0
MAX_KEY_SERIES = 50  # per-key usage series: the keys that submitted here most recently, only with per-key limits
MIB = 1024 * 1024
SECRET_BYTES = 32


@dataclass(frozen=True, slots=True)
class JobsConfig:
    """What the jobs need of the settings (`from_settings`; tests build one directly)."""

    enabled: bool = True
    data_dir: Path = Path("data")
    redis_url: str | None = field(default=None, repr=False)
    redis_prefix: str = "agent-server:"
    max_job_chars: int = DEFAULT_MAX_JOB_CHARS
    job_ttl_s: float = DEFAULT_JOB_TTL_S
    webhook_allow: tuple[str, ...] = ()
    webhook_secret: str = field(default="", repr=False)  # the root of every key's secret ("": random per process)
    max_running_jobs_per_key: int = 4
    job_chars_per_day_per_key: int = 0
    workers: int = 0  # jobs running here at once (0: the engine's max_slots)
    visibility_s: float = DEFAULT_VISIBILITY_S
    files_mb: float = 1024.0

    @classmethod
    def from_settings(cls, settings: Settings) -> JobsConfig:
        return cls(enabled=settings.jobs, data_dir=settings.data_dir,
                   redis_url=settings.jobs_redis_url or settings.redis_url, redis_prefix=settings.redis_prefix,
                   max_job_chars=settings.max_job_chars, job_ttl_s=settings.job_ttl_s,
                   webhook_allow=settings.webhook_allow, webhook_secret=settings.webhook_secret,
                   max_running_jobs_per_key=settings.max_running_jobs_per_key,
                   job_chars_per_day_per_key=settings.job_chars_per_day_per_key, workers=settings.job_workers,
                   visibility_s=settings.job_visibility_s, files_mb=settings.job_files_mb)

    @property
    def limits(self) -> KeyLimits:
        return KeyLimits(self.max_running_jobs_per_key, self.job_chars_per_day_per_key)


class JobService:
    def __init__(self, hub: Hub, config: JobsConfig) -> None:
        self.hub = hub
        self.config = config
        self.allow = AllowList.parse(config.webhook_allow)  # raises ValueError naming a bad entry
        self._root = config.webhook_secret.encode() if config.webhook_secret else secrets.token_bytes(SECRET_BYTES)
        self._redis: Any = None
        self.store: JobStore = self._make_store()
        self.files = AudioFiles(config.data_dir / "jobs" / "files", max_bytes=int(config.files_mb * MIB))
        self.render = EngineRender(hub)
        # a replica without --webhook-allow takes no webhooks from the outbox (in a fleet, another replica may allow
        # them; this one would refuse and drop them all)
        sender = WebhookSender(self.allow, self.secret_of) if self.allow.networks else None
        self.runner = JobRunner(self.store, self.render, webhooks=sender,
                                max_jobs=max(1, config.workers or hub.settings.max_slots.default or 1),
                                segments_in_flight=self._window, on_done=self._prepare_file)
        self.api = JobsApi(self.store, self.files, route=lambda language: hub.port.router.route(language=language),
                           key_of=key_of,
                           limits_for=lambda _key_id: config.limits, webhook_allow=self.allow,
                           max_job_chars=config.max_job_chars, on_submitted=self._submitted,
                           on_cancelled=self.runner.cancelled, secret_of=self.secret_of, unavailable=self._unavailable)
        self.failure: str | None = None  # why the store could not be opened
        self.started = False
        self.queue_depth = 0  # refreshed every REFRESH_S
        self.webhooks_pending = 0  # (the same)
        self.key_usage: dict[str, Usage] = {}  # the same
        self._recent_keys: collections.OrderedDict[str, None] = collections.OrderedDict()
        self._tasks: list[asyncio.Task[None]] = []
        hub.on_drain(self.stop_work)

    def _make_store(self) -> JobStore:
        config = self.config
        if config.redis_url:
            import redis.asyncio as aioredis

            self._redis = aioredis.Redis.from_url(config.redis_url, socket_timeout=REDIS_TIMEOUT_S,
                                                  socket_connect_timeout=REDIS_TIMEOUT_S)
            return RedisJobStore(self._redis, prefix=config.redis_prefix, worker_id=self.hub.shared.replica_id,
                                 job_ttl_s=config.job_ttl_s, visibility_s=config.visibility_s)
        return SqliteJobStore(config.data_dir / "jobs", worker_id=self.hub.shared.replica_id,
                              job_ttl_s=config.job_ttl_s, visibility_s=config.visibility_s)

    def secret_of(self, key_id: str) -> str:
        return webhook_secret(self._root, key_id)

    def routes(self) -> list[Route]:
        return self.api.routes()

    # ---- lifecycle ----------------------------------------------------------------------------------

    async def start(self) -> None:
        if not self.config.enabled:
            return
        try:
            await self.store.start()
        except Exception as exc:  # live speech serves on; the jobs API says why it cannot
            self.failure = f"{type(exc).__name__}: {exc}"[:300]
            log.error("jobs_unavailable", error=self.failure)
            return
        self.started = True
        if self.allow.networks and not self.config.webhook_secret:
            log.warning("webhook_secret_random", message="AGENT_SERVER_WEBHOOK_SECRET is not set: webhook secrets "
                        "change when this process restarts")
        self._tasks = [asyncio.create_task(self._run_when_ready(), name="jobs-start"),
                       asyncio.create_task(self._refresh_loop(), name="jobs-refresh")]
        self._tasks.append(asyncio.create_task(self._sweep_loop(), name="jobs-sweep"))

    async def stop_work(self) -> None:
        """Stop rendering, hand the claims back (the drain's first step: the engine is still running)."""
        self.render.interrupt()
        await self.runner.stop()

    async def stop(self) -> None:
        await self.stop_work()
        await self.files.close()
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        self._tasks = []
        if self.started:
            await self.store.stop()
            self.started = False
        if self._redis is not None:
            await self._redis.aclose()

    def _prepare_file(self, job: Job) -> None:
        """A job this replica finished: its file in its own format, made now (AudioFiles.prepare)."""
        self.files.prepare(self.store, job, job.output_format, job_format(job.output_format))

    async def _run_when_ready(self) -> None:
        await self.hub.became_ready.wait()
        engine = self.hub.engine
        if engine is not None and not self.config.workers:
            self.runner.max_jobs = max(1, engine.max_slots)
        await self.runner.start()
        log.info("jobs_started", store="redis" if self.store.shared else "sqlite", max_jobs=self.runner.max_jobs)

    def _window(self, running: int) -> int:
        engine = self.hub.engine
        slots = engine.max_slots if engine is not None else 1
        return max(1, slots // max(1, running))

    async def sweep(self, now_s: float) -> tuple[int, int]:
        """(jobs purged from the embedded store, files of expired jobs removed from this replica's disk)."""
        purged = await self.store.sweep(now_s)
        removed = await self.files.sweep(self.store, self.store.job_ttl_s, now_s)
        if purged or removed:
            log.info("jobs_swept", purged=purged, files_removed=removed)
        return purged, removed

    async def _sweep_loop(self) -> None:
        while True:
            try:
                await self.sweep(time.time())
            except Exception as exc:
                log.warning("jobs_sweep_failed", error=f"{type(exc).__name__}: {exc}"[:300])
            await asyncio.sleep(SWEEP_S)

    async def _refresh_loop(self) -> None:
        while True:
            try:
                await self.refresh()
            except Exception as exc:  # the store unreachable: the gauges keep their last values
                log.debug("jobs_refresh_failed", error=f"{type(exc).__name__}: {exc}"[:300])
            await asyncio.sleep(REFRESH_S)

    async def refresh(self) -> None:
        """Read the queue depth, the webhook outbox and the recent keys' usage (for the metrics)."""
        self.queue_depth = await self.store.queue_depth()
        self.webhooks_pending = await self.store.webhooks_pending()
        limits = self.config.limits
        if limits.max_running_jobs or limits.daily_chars:
            now_s = time.time()
            self.key_usage = {key_id: await self.store.usage(key_id, now_s) for key_id in list(self._recent_keys)}

    def _submitted(self, job: Job) -> None:
        self.runner.wake()
        self._recent_keys[job.key_id] = None
        self._recent_keys.move_to_end(job.key_id)
        while len(self._recent_keys) > MAX_KEY_SERIES:
            self._recent_keys.popitem(last=False)

    def _unavailable(self) -> JobError | None:
        if not self.config.enabled:
            return JobError(STATUS_NOT_FOUND, "", "jobs are off on this server (--jobs off)", JOBS_OFF)
        if self.failure is not None:
            return JobError(STATUS_UNAVAILABLE, "", f"jobs are unavailable on this server: {self.failure}",
                            UNAVAILABLE, retry_after_s=30)
        return None

    @property
    def available(self) -> bool:
        return self.config.enabled and self.started

    def status_json(self) -> dict[str, object]:
        return {
            "enabled": self.config.enabled,
            "store": "redis" if self.store.shared else "sqlite",
            "available": self.available,
            "failure": self.failure,
            "running": len(self.runner.running),
            "max_jobs": self.runner.max_jobs,
            "queue_depth": self.queue_depth,
            "webhooks": bool(self.allow.networks),
        }


def key_of(request: Request) -> str:
    """The API key of a request, by its fingerprint (ANONYMOUS when auth is off)."""
    principal = principal_of(request.scope)
    return principal.key_id if principal is not None else ANONYMOUS
