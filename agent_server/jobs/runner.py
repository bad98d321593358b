"""The worker side of jobs: claim jobs, render the segments not stored yet, store each once, finish, notify.

    runner = JobRunner(store, render, webhooks=sender)   # render(job, segment) -> PCM: the engine, at job priority
    await runner.start() ... await runner.stop()

One `JobRunner` per replica. It claims up to `max_jobs` jobs (`store.claim`: jobs abandoned by dead replicas
first), and for each renders the segments its store does not hold yet, in order, up to `segments_in_flight` at a
time (a number, or a function of the jobs running here: the app gives each job its share of the engine's rows): a
job claimed again resumes from the first segment missing, and a segment stored meanwhile by someone else
is not stored again (`SegmentWrite.ALREADY_STORED`). Each segment is encoded for storage (segment_audio.py) off the
event loop. While it works it renews its claims every `renew_s`; a claim found LOST (another replica took the job:
this one was presumed dead) or FINISHED (cancelled) stops that job's work at once: its renders are cancelled, which
in the engine frees their rows at the next step.

A segment is rendered by `render`, the collaborator the app provides: in the second phase, a segment submitted to
the engine at job priority (live segments always admitted first), through the phrase cache. Its seed is
`job.seed + segment.index` (as a live context's segments are seeded), so a segment rendered again after a crash
is the same audio. `render` raising `JobInterrupted` (the engine shutting down, a replica draining) hands the job
back to the queue at once (`store.release`); any other exception fails the job with that segment's error. A store
that cannot be reached (`STORE_ERRORS`) fails nothing: the call is made again, backing off up to
`STORE_RETRY_MAX_S`, for as long as the claim is this replica's (the keeper stops the work when it is not).

`stop()` (the replica drains or shuts down) cancels the work and hands each claim back at once (`store.release`),
so another replica takes the job without waiting out the visibility timeout.

When every segment is stored the job is DONE. Webhooks (done or failed) go through the store's outbox: the
`finish` that ended the job put it there, atomically, and every replica's runner takes what is due (`take_webhooks`,
leased for one attempt's bound and a margin), makes one attempt each, up to `MAX_DELIVERIES` at a time, and drops it
or schedules the next attempt as the sender's `RetryPolicy` says. A retry waits in the store, not in this process: a
replica that stops or dies mid-schedule leaves its webhooks to the others (mid-attempt: after the lease), so each is
delivered at least once, by whichever replica.
"""

from __future__ import annotations

import asyncio
import collections
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from functools import partial
from typing import TypeVar

import numpy as np
import numpy.typing as npt
import orjson
import structlog

from agent_server.jobs.assembly import Offload
from agent_server.jobs.model import Job, JobSegment, JobStatus
from agent_server.jobs.segment_audio import encode_segment
from agent_server.jobs.store import STORE_ERRORS, Claim, ClaimState, DueWebhook, JobStore, SegmentWrite
from agent_server.jobs.webhooks import WebhookRefused, WebhookSender, loggable_url

log = structlog.get_logger("agent_server.jobs.runner")

Pcm = npt.NDArray[np.float32]
Render = Callable[[Job, JobSegment], Awaitable[Pcm]]
Window = int | Callable[[int], int]  # segments in flight per job, or a function of the jobs running here
T = TypeVar("T")
DEFAULT_MAX_JOBS = 4
DEFAULT_POLL_S = 1.0
RECANCEL_S = 0.1
WEBHOOK_EVENTS = {JobStatus.DONE: "job.done", JobStatus.FAILED: "job.failed"}
MAX_DELIVERIES = 16  # webhook attempts in flight per replica
WEBHOOK_LEASE_MARGIN_S = 20.0  # a taken webhook is another replica's to take after its attempt's bound and this
STORE_RETRY_FIRST_S = 0.5  # a job's store call that failed is made again after this, doubling
STORE_RETRY_MAX_S = 5.0
HAND_BACK_BOUND_S = 2.0  # a stop gives an interrupted webhook attempt back to the outbox within this


class JobInterrupted(Exception):
    """Raised by `render` when this replica cannot render now (shutting down): the job goes back to the queue."""


@dataclass(slots=True)
class RunnerStats:
    """Counters for the metrics (`tts_jobs_*` in the second phase)."""

    segments_rendered: int = 0
    segments_already_stored: int = 0  # rendered, but someone stored that index first
    audio_samples: int = 0
    jobs_done: int = 0
    jobs_failed: int = 0
    claims_lost: int = 0  # jobs this replica stopped because another took them
    jobs_stopped: int = 0  # jobs stopped because they finished elsewhere (cancelled)
    webhooks_delivered: int = 0
    webhooks_failed: int = 0  # the receiver never took it (every attempt failed, or it refused with a 4xx)
    webhooks_refused: int = 0  # the URL (or a redirect) was not allowed by the time of the delivery (--webhook-allow)
    webhook_attempts: int = 0  # POSTs made (a retry counts again)


class JobRunner:
    def __init__(self, store: JobStore, render: Render, *, webhooks: WebhookSender | None = None,
                 max_jobs: int = DEFAULT_MAX_JOBS, segments_in_flight: Window = 1, poll_s: float = DEFAULT_POLL_S,
                 renew_s: float | None = None, clock: Callable[[], float] = time.time,
                 offload: Offload = asyncio.to_thread, on_done: Callable[[Job], None] | None = None) -> None:
        """`on_done`: told each job this replica finished DONE (the service makes its file then)."""
        if max_jobs < 1 or (isinstance(segments_in_flight, int) and segments_in_flight < 1):
            raise ValueError("max_jobs and segments_in_flight must be >= 1")
        self.store = store
        self.stats = RunnerStats()
        self._render = render
        self._webhooks = webhooks
        self._on_done = on_done
        self.max_jobs = max_jobs
        self.segments_in_flight = segments_in_flight
        self.poll_s = poll_s
        self.renew_s = renew_s if renew_s is not None else store.visibility_s / 3
        self._clock = clock
        self._offload = offload
        self._jobs: dict[str, asyncio.Task[None]] = {}
        self._deliveries: set[asyncio.Task[None]] = set()
        self._loop_task: asyncio.Task[None] | None = None
        self._hooks_task: asyncio.Task[None] | None = None
        self._cancels_task: asyncio.Task[None] | None = None
        self._wake = asyncio.Event()
        self._wake_hooks = asyncio.Event()
        self._hook_timers: set[asyncio.TimerHandle] = set()  # wake-ups at the retries this replica scheduled
        self._stopping = False

    # ---- lifecycle ----------------------------------------------------------------------------------

    async def start(self) -> None:
        self._loop_task = asyncio.create_task(self._every_poll(self.claim_more, self._wake, "job_claim_failed"),
                                              name="job-runner")
        if self._webhooks is not None:
            self._hooks_task = asyncio.create_task(
                self._every_poll(self.send_due_webhooks, self._wake_hooks, "webhooks_take_failed"), name="job-webhooks")
        if self.store.shared:
            self._cancels_task = asyncio.create_task(self._watch_cancels(), name="job-cancels")

    def wake(self) -> None:
        """Look for work now (a job was just submitted here)."""
        self._wake.set()

    async def stop(self) -> None:
        """Stop claiming; cancel the jobs running here (their claims come back after the visibility timeout, or at
        once through the renders' JobInterrupted) and the webhook attempts in flight (each given back to the outbox,
        due at once; or, the store unreachable, left to the lease)."""
        self._stopping = True
        self._wake.set()
        self._wake_hooks.set()
        for timer in self._hook_timers:
            timer.cancel()
        self._hook_timers.clear()
        loops = [task for task in (self._loop_task, self._hooks_task, self._cancels_task) if task is not None]
        await _cancel_until_done(loops)
        self._loop_task = self._hooks_task = self._cancels_task = None
        await _cancel_until_done([*self._jobs.values(), *self._deliveries])

    @property
    def running(self) -> list[str]:
        return list(self._jobs)

    @property
    def webhooks_in_flight(self) -> int:
        """Webhook attempts under way here (each ends with its outcome written to the store)."""
        return len(self._deliveries)

    def window(self) -> int:
        """Segments each job may have in flight now (at least 1)."""
        wanted = self.segments_in_flight
        return max(1, wanted if isinstance(wanted, int) else wanted(len(self._jobs)))

    def cancelled(self, job_id: str) -> None:
        """The job was cancelled (through this replica's API, or another's: `store.watch_cancels`): stop its work
        here now rather than at the next renewal, so its renders free their engine rows at the next step."""
        task = self._jobs.get(job_id)
        if task is not None:
            log.info("job_cancel_heard", job_id=job_id)
            task.cancel()

    async def _watch_cancels(self) -> None:
        """Hear the fleet's cancels (a shared store) for as long as the runner runs; the renewal stays the
        fallback while the store cannot be heard."""
        while not self._stopping:
            try:
                await self.store.watch_cancels(self.cancelled)
            except Exception as exc:
                log.warning("job_cancels_unheard", error=f"{type(exc).__name__}: {exc}"[:300])
            await asyncio.sleep(self.poll_s)

    async def _every_poll(self, work: Callable[[], Awaitable[int]], wake: asyncio.Event, failed: str) -> None:
        """`work` every `poll_s`, or at once when `wake` is set, until the runner stops; a failure (the store
        unreachable) is logged as `failed` and tried again next period."""
        while not self._stopping:
            wake.clear()  # (before the work: a wake while it runs is for the next round, not lost)
            try:
                await work()
            except Exception as exc:
                log.warning(failed, error=f"{type(exc).__name__}: {exc}"[:300])
            try:
                # (asyncio.timeout, not wait_for: 3.11's wait_for can swallow a cancel that lands as it times out,
                # and stop() then waits for ever)
                async with asyncio.timeout(self.poll_s):
                    await wake.wait()
            except TimeoutError:
                pass

    async def claim_more(self) -> int:
        """Claim jobs up to `max_jobs` running here and start them; the number claimed."""
        room = self.max_jobs - len(self._jobs)
        if room <= 0:
            return 0
        claimed = await self.store.claim(room, self._clock())
        if claimed.failed:
            self.stats.jobs_failed += len(claimed.failed)
            self._wake_hooks.set()  # (their webhooks entered the outbox with the failure)
        for claim in claimed.claims:
            log.info("job_claimed", job_id=claim.job.id, claims=claim.job.claims, segments_done=claim.job.segments_done,
                     segments_total=claim.job.segments_total)
            superseded = self._jobs.get(claim.job.id)
            if superseded is not None:
                # this replica's own claim came back to it (its renewals stopped past the visibility timeout: the
                # store was away, or the clock jumped): the fresh claim replaces the old work, which resumes from
                # the first segment missing; two tasks on one job would render each segment twice
                log.info("job_claimed_again_here", job_id=claim.job.id)
                superseded.cancel()
            task = asyncio.create_task(self.run_claim(claim), name=f"job-{claim.job.id}")
            self._jobs[claim.job.id] = task
            task.add_done_callback(partial(self._forget, claim.job.id))
        return len(claimed.claims)

    def _forget(self, job_id: str, task: asyncio.Task[None]) -> None:
        if self._jobs.get(job_id) is task:  # (not a fresh claim's task that replaced this one)
            del self._jobs[job_id]

    # ---- one job ------------------------------------------------------------------------------------

    async def run_claim(self, claim: Claim) -> None:
        job = claim.job
        work = asyncio.create_task(self._render_missing(claim))
        keeper = asyncio.create_task(self._keep(claim, work))
        try:
            complete = await work
        except asyncio.CancelledError:
            current = asyncio.current_task()
            if self._stopping and current is not None and current.cancelling():
                await _shielded(self._release(claim))  # this replica is stopping: the next replica takes it at once
                raise
            self.stats.jobs_stopped += int(not keeper.done())  # (`cancelled`; the keeper counts its own stops)
            return  # the claim is lost, or the job finished (cancelled here or elsewhere)
        except JobInterrupted as exc:
            log.info("job_interrupted", job_id=job.id, reason=str(exc))
            await _shielded(self._release(claim))
            return
        except Exception as exc:
            log.error("job_segment_failed", job_id=job.id, error=f"{type(exc).__name__}: {exc}"[:300])
            await self._finish(job.id, JobStatus.FAILED, f"{type(exc).__name__}: {exc}"[:500])
            return
        finally:
            keeper.cancel()
            await asyncio.gather(keeper, return_exceptions=True)
        if complete:
            await self._finish(job.id, JobStatus.DONE, None)

    async def _render_missing(self, claim: Claim) -> bool:
        """Render and store every segment not stored yet. False: the job finished elsewhere (nothing more stored)."""
        job = claim.job
        plan = await self._store_call(job.id, "plan", lambda: self.store.plan(job.id))
        if plan is None:
            return False
        stored = await self._store_call(job.id, "stored_segments", lambda: self.store.stored_segments(job.id))
        pending = collections.deque(seg for seg in plan if seg.index not in stored)
        if stored:
            log.info("job_resumed", job_id=job.id, first_missing=pending[0].index if pending else None,
                     stored=len(stored), total=len(plan))
        in_flight: set[asyncio.Task[SegmentWrite]] = set()
        try:
            while pending or in_flight:
                while pending and len(in_flight) < self.window():
                    in_flight.add(asyncio.create_task(self._segment(job, pending.popleft())))
                done, in_flight = await asyncio.wait(in_flight, return_when=asyncio.FIRST_COMPLETED)
                for task in done:
                    if not task.cancelled():
                        task.exception()  # (read, each one: a second failure is not "never retrieved")
                for task in done:
                    if task.result() in (SegmentWrite.JOB_FINISHED, SegmentWrite.JOB_GONE):
                        self.stats.jobs_stopped += 1
                        return False
            return True
        finally:
            for task in in_flight:
                task.cancel()
            await asyncio.gather(*in_flight, return_exceptions=True)

    async def _segment(self, job: Job, segment: JobSegment) -> SegmentWrite:
        pcm = await self._render(job, segment)
        blob = await self._offload(encode_segment, pcm)
        outcome = await self._store_call(job.id, "put_segment",
                                         lambda: self.store.put_segment(job.id, segment.index, blob, int(pcm.size)))
        if outcome == SegmentWrite.STORED:
            self.stats.segments_rendered += 1
            self.stats.audio_samples += int(pcm.size)
        elif outcome == SegmentWrite.ALREADY_STORED:
            self.stats.segments_already_stored += 1
        return outcome

    async def _store_call(self, job_id: str, what: str, call: Callable[[], Awaitable[T]]) -> T:
        """`call()`, made again while the store cannot be reached (a Redis reply timing out, a failover, a locked
        or full disk), backing off to STORE_RETRY_MAX_S: a passing store fault costs a job time, never the job.
        A write that reached the store before its reply was lost is safe to repeat (a segment is stored once).
        Ended by the work's cancel: the claim no longer this replica's, the job finished, or the runner stopping."""
        wait_s = STORE_RETRY_FIRST_S
        while True:
            try:
                return await call()
            except STORE_ERRORS as exc:
                log.warning("job_store_failed", job_id=job_id, call=what, retry_in_s=wait_s,
                            error=f"{type(exc).__name__}: {exc}"[:300])
            await asyncio.sleep(wait_s)
            wait_s = min(STORE_RETRY_MAX_S, 2 * wait_s)

    async def _release(self, claim: Claim) -> None:
        try:
            await self.store.release(claim)
        except Exception as exc:  # the store unreachable: the claim comes back after the visibility timeout
            log.warning("job_release_failed", job_id=claim.job.id, error=f"{type(exc).__name__}: {exc}"[:300])
            return
        log.info("job_released", job_id=claim.job.id)

    async def _keep(self, claim: Claim, work: asyncio.Task[bool]) -> None:
        """Renew the claim every `renew_s`; stop the work when the claim is no longer this replica's."""
        while True:
            await asyncio.sleep(self.renew_s)
            try:
                state = await self.store.renew(claim, self._clock())
            except Exception as exc:  # the store unreachable: keep working, try again
                log.warning("job_renew_failed", job_id=claim.job.id, error=f"{type(exc).__name__}: {exc}"[:300])
                continue
            if state != ClaimState.HELD:
                if state == ClaimState.LOST:
                    self.stats.claims_lost += 1
                else:
                    self.stats.jobs_stopped += 1
                log.info("job_claim_ended", job_id=claim.job.id, state=state.name.lower())
                work.cancel()
                return

    async def _finish(self, job_id: str, status: JobStatus, error: str | None) -> None:
        job, changed = await self._store_call(job_id, "finish",
                                              lambda: self.store.finish(job_id, status, error, self._clock()))
        if job is None or not changed:
            return
        if status == JobStatus.DONE:
            self.stats.jobs_done += 1
        else:
            self.stats.jobs_failed += 1
        log.info("job_finished", job_id=job_id, status=job.status.wire, segments=job.segments_done,
                 audio_s=round(job.audio_seconds, 2), error=error)
        if job.status == JobStatus.DONE and self._on_done is not None:
            self._on_done(job)
        self._wake_hooks.set()  # (its webhook, if it has one, entered the outbox with the finish)

    # ---- webhooks -----------------------------------------------------------------------------------

    async def send_due_webhooks(self) -> int:
        """Take the webhooks due now (up to MAX_DELIVERIES in flight here) and start an attempt for each; the
        number started."""
        room = MAX_DELIVERIES - len(self._deliveries)
        if self._webhooks is None or room <= 0:
            return 0
        lease_s = self._webhooks.policy.attempt_bound_s + WEBHOOK_LEASE_MARGIN_S
        due = await self.store.take_webhooks(room, self._clock(), lease_s)
        for webhook in due:
            task = asyncio.create_task(self._attempt(self._webhooks, webhook), name=f"webhook-{webhook.job.id}")
            self._deliveries.add(task)
            task.add_done_callback(self._deliveries.discard)
        return len(due)

    async def _attempt(self, sender: WebhookSender, webhook: DueWebhook) -> None:
        """One attempt at a taken webhook, then drop it or put it back for the next. The store unreachable
        meanwhile: logged, and the lease hands the webhook to the next taker."""
        try:
            await self._attempt_once(sender, webhook)
        except asyncio.CancelledError:
            if self._stopping:
                await _shielded(self._hand_back(webhook))
            raise
        except Exception as exc:
            log.warning("webhook_store_failed", job_id=webhook.job.id, error=f"{type(exc).__name__}: {exc}"[:300])

    async def _hand_back(self, webhook: DueWebhook) -> None:
        """A stop interrupted the attempt: the webhook is due again at once for any taker (this attempt not
        counted; the receiver may have had it, so it may arrive twice, as at-least-once allows). Bounded; the store
        unreachable, the lease hands it on instead. A webhook the attempt already dropped stays dropped."""
        try:
            async with asyncio.timeout(HAND_BACK_BOUND_S):
                await self.store.webhook_retry(webhook.job.id, webhook.attempts, self._clock())
            log.info("webhook_handed_back", job_id=webhook.job.id, attempts=webhook.attempts)
        except Exception as exc:
            log.warning("webhook_store_failed", job_id=webhook.job.id, error=f"{type(exc).__name__}: {exc}"[:300])

    def _wake_hooks_in(self, delay_s: float) -> None:
        """Take due webhooks again `delay_s` from now (when a retry this replica scheduled falls due), not only at
        the next poll."""
        handle: asyncio.TimerHandle | None = None

        def fire() -> None:
            if handle is not None:
                self._hook_timers.discard(handle)
            self._wake_hooks.set()

        handle = asyncio.get_running_loop().call_later(delay_s, fire)
        self._hook_timers.add(handle)

    async def _attempt_once(self, sender: WebhookSender, webhook: DueWebhook) -> None:
        job = webhook.job
        event = WEBHOOK_EVENTS.get(job.status)
        if job.webhook_url is None or event is None:
            await self.store.webhook_done(job.id)
            return
        made = webhook.attempts + 1
        try:
            attempt = await sender.attempt(job.webhook_url, orjson.dumps(job.status_json()), job.key_id, event)
        except WebhookRefused as refused:
            self.stats.webhooks_refused += 1
            log.warning("webhook", job_id=job.id, url=loggable_url(job.webhook_url), webhook_event=event,
                        attempt=made, refused=str(refused))
            await self.store.webhook_done(job.id)
            return
        self.stats.webhook_attempts += 1
        retry_in_s = sender.policy.retry_in_s(made, attempt)
        log.info("webhook", job_id=job.id, url=loggable_url(job.webhook_url), webhook_event=event, attempt=made,
                 status=attempt.status, error=attempt.error, delivered=attempt.delivered, retry_in_s=retry_in_s)
        if retry_in_s is not None:
            await self.store.webhook_retry(job.id, made, self._clock() + retry_in_s)
            if not self._stopping:
                self._wake_hooks_in(retry_in_s)  # (after the write: the wake-up never comes before the due time)
            return
        if attempt.delivered:
            self.stats.webhooks_delivered += 1
        else:
            self.stats.webhooks_failed += 1
        await self.store.webhook_done(job.id)

    async def drain_webhooks(self) -> None:
        """Send every webhook due now and wait for the attempts, until none is due (tests, and a graceful shutdown
        that can afford it). A retry scheduled for later is not waited for."""
        while await self.send_due_webhooks() or self._deliveries:
            await asyncio.gather(*list(self._deliveries), return_exceptions=True)


async def _shielded(work: Awaitable[None]) -> None:
    """Await `work` to its end even when this task is cancelled meanwhile (stop() cancels again and again)."""
    task = asyncio.ensure_future(work)
    while not task.done():
        try:
            await asyncio.shield(task)
        except asyncio.CancelledError:
            continue
    task.result()


async def _cancel_until_done(tasks: list[asyncio.Task[None]]) -> None:
    """Cancel the tasks and wait for them, cancelling again every `RECANCEL_S` while any is left: a cancel can be
    swallowed by a library the task is in (redis-py's asyncio client does, now and then, in a command's
    clean-up), and a task that carries on after that would be waited for for ever."""
    pending = {task for task in tasks if not task.done()}
    while pending:
        for task in pending:
            task.cancel()
        _, pending = await asyncio.wait(pending, timeout=RECANCEL_S)
