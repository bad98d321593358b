"""The runner's `render` on this server: one job segment through the phrase cache and the engine, at job priority.

    render = EngineRender(hub)
    pcm = await render(job, segment)        # float32 at 24 kHz: the whole segment

A job segment is a `SegmentRequest` like a live one, but for three fields: `priority=Priority.JOB` (the engine
admits it only into rows no live segment wants, and may take its row back for a live one: the segment then starts
over, STARTED again and chunks from seq 0, and what it had emitted is dropped here), `first_audio_pending=False`
and `may_wait=True`. Its seed is `job.seed + index` (the live rule, core/stream.py: a segment rendered again after
a crash is the same audio), its generation bounded by `segment.max_new_tokens` (jobs/segments.py). It goes through
the phrase cache (`Hub.stream_source`, the target of every live stream: "cache per sentence"): a seeded segment
already rendered (by a job, a live context or the pre-warm list; on any replica, with Redis) is replayed, not
rendered, and what the engine renders is stored for the next one.

How a call ends:
- DONE: the PCM;
- BUSY (the engine's wait queue is full) or EngineFull (its inbox is): tried again after `retry_s`;
- the engine cancelling it at shutdown, the server not serving, `interrupt()` (the replica drains):
  `JobInterrupted`, and the runner hands the job back to the queue;
- FAILED, a voice this server does not have, sampling the engine refuses: `RenderFailed` (the job fails with it).
Cancelling the call cancels the segment (its row is free at the next step).
"""

from __future__ import annotations

import asyncio
import dataclasses
import itertools
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np
import structlog

from agent_server.core.events import build_params
from agent_server.core.hub import Hub
from agent_server.core.stream import SEED_MODULUS
from agent_server.fleet.phrase_cache import CachePolicy
from agent_server.jobs.model import Job, JobSegment
from agent_server.jobs.runner import JobInterrupted, Pcm
from synth.api import (
    CACHED_REASON,
    AudioChunk,
    EngineError,
    EngineFull,
    EngineOutput,
    EventKind,
    Priority,
    SamplingParams,
    SegmentEvent,
    SegmentRequest,
    max_tokens_for_text,
)

log = structlog.get_logger("agent_server.jobs.render")

RETRY_S = 0.5  # a segment the engine could not take now (BUSY, EngineFull) is submitted again this much later
SHUTDOWN_REASON = "shutdown"  # the engine's CANCELLED reason when it stops


def job_params(model: str, job: Job, segment: JobSegment) -> SamplingParams:
    """A job segment's sampling: the live rule's (`build_params`, seed + index), and its generation bound only where
    the plan's is tighter than the engine's own for that text: so that a live context's segment and a job's of the
    same text, voice and seed share one phrase-cache key (the key hashes the parameters)."""
    params = build_params(model, job.sampling, (job.seed + segment.index) % SEED_MODULUS)
    if segment.max_new_tokens == max_tokens_for_text(segment.text):
        return params
    return dataclasses.replace(params, max_new_tokens=segment.max_new_tokens)


class RenderFailed(RuntimeError):
    """The engine failed the segment, or cannot render it here (a voice it does not have): the job fails."""


@dataclass(slots=True)
class RenderStats:
    """Counters for the metrics (`tts_jobs_*`)."""

    segments: int = 0  # rendered (by the engine or from the phrase cache)
    cache_hits: int = 0  # of those, replayed from the phrase cache
    preempted: int = 0  # a segment the engine admitted again after taking its row back for a live one
    retries: int = 0  # submitted again after BUSY / EngineFull
    audio_samples: int = 0


@dataclass(slots=True, eq=False)
class _Render:
    """One segment on its way: what the sink delivered so far (loop thread)."""

    request_id: str
    done: asyncio.Future[Pcm | None]  # the PCM; None: refused for now (BUSY), try again
    pieces: list[Pcm] = field(default_factory=list)
    started: bool = False
    ended: bool = False  # the engine (or the cache) said its last word: nothing to cancel


class EngineRender:
    def __init__(self, hub: Hub, *, retry_s: float = RETRY_S, policy: CachePolicy | None = None) -> None:
        self.hub = hub
        self.retry_s = retry_s
        self.policy = policy or CachePolicy()
        self.stats = RenderStats()
        self._numbers = itertools.count(1)
        self._in_flight: set[_Render] = set()
        self._interrupted: str | None = None

    def interrupt(self, reason: str = "the server is shutting down") -> None:
        """Every render in flight, and every one asked for from now on, raises JobInterrupted (the replica drains:
        its jobs go back to the queue for another replica, their rows free at the next step)."""
        self._interrupted = reason
        for render in list(self._in_flight):
            if not render.done.done():
                render.done.set_exception(JobInterrupted(reason))

    @property
    def in_flight(self) -> int:
        return len(self._in_flight)

    async def __call__(self, job: Job, segment: JobSegment) -> Pcm:
        while True:
            pcm = await self._once(job, segment)
            if pcm is not None:
                self.stats.segments += 1
                self.stats.audio_samples += int(pcm.size)
                return pcm
            self.stats.retries += 1
            await asyncio.sleep(self.retry_s)

    async def _once(self, job: Job, segment: JobSegment) -> Pcm | None:
        hub, engine = self.hub, self.hub.engine
        if self._interrupted is not None:
            raise JobInterrupted(self._interrupted)
        if engine is None or not hub.ready:
            raise JobInterrupted(f"the server is not serving ({hub.status.name.lower()})")
        try:
            routed = hub.port.router.route(language=job.language)  # (a FieldError: no loaded model speaks it)
            params = job_params(routed.model, job, segment)
            voice = hub.voices.acquire(job.voice)  # (a FieldError: this server has no such voice)
        except ValueError as exc:
            raise RenderFailed(str(exc)) from None
        render = _Render(f"job/{job.id}/{segment.index}/{next(self._numbers)}",
                         asyncio.get_running_loop().create_future())
        self._in_flight.add(render)
        source = hub.stream_source(engine, voice, routed.language, self.policy, model=routed.model)
        try:
            request = SegmentRequest(request_id=render.request_id, text=segment.text, sink=self._sink(render),
                                     voice_id=job.voice, params=params, language=routed.language,
                                     first_audio_pending=False, may_wait=True, priority=Priority.JOB,
                                     submitted_monotonic_s=time.monotonic(), model=routed.model)
            try:
                source.submit(request)
            except EngineFull:
                render.ended = True  # (nothing was taken)
                return None
            except EngineError as exc:
                render.ended = True
                raise RenderFailed(str(exc)) from None
            return await render.done
        finally:
            self._in_flight.discard(render)
            if not render.ended:
                source.cancel(render.request_id)  # cancelled or interrupted: its row frees at the next step
            hub.voices.release(voice)

    def _sink(self, render: _Render) -> Callable[[EngineOutput], None]:
        post, on_output = self.hub.post, self._on_output

        def sink(out: EngineOutput) -> None:  # engine thread (or the loop, for a cache hit): hand over, never block
            try:
                post(on_output, render, out)
            except RuntimeError:  # the loop is closed: the server is gone
                pass

        return sink

    def _on_output(self, render: _Render, out: EngineOutput) -> None:
        if isinstance(out, SegmentEvent) and out.kind >= EventKind.DONE:
            render.ended = True
        if render.done.done():
            return  # late output of a segment given up on
        if isinstance(out, AudioChunk):
            render.pieces.append(out.pcm)
            return
        if out.kind == EventKind.STARTED:
            if render.started:  # admitted again: the engine took its row back for a live segment; it starts over
                self.stats.preempted += 1
                render.pieces.clear()
            render.started = True
            if out.reason == CACHED_REASON:
                self.stats.cache_hits += 1
        elif out.kind == EventKind.DONE:
            pcm = np.concatenate(render.pieces) if render.pieces else np.zeros(0, np.float32)
            render.done.set_result(pcm.astype(np.float32, copy=False))
        elif out.kind == EventKind.BUSY:
            render.done.set_result(None)
        elif out.kind == EventKind.CANCELLED:
            render.done.set_exception(JobInterrupted(f"the engine cancelled the segment: {out.reason}"))
        elif out.kind == EventKind.FAILED:
            render.done.set_exception(RenderFailed(f"the engine failed segment {render.request_id}: {out.reason}"))
