"""Prometheus metrics, the live dashboard's feed, and the routes of the demo page, dashboard and /metrics.

One `Metrics` per app, with its own `CollectorRegistry` (never the global one, so tests build several
apps). It is fed from three places:

- the engine's stats listener (`on_step`, engine thread: a few lock-protected adds per step, nothing else);
- the server's observers (`on_event`, event-loop thread): sessions, first audio, busy, finished contexts;
- the hub's state, read at collect time (sessions and contexts open, engine slots in use and queue depth);
- the jobs' counters and gauges (`tts_jobs_*`, agent_server/jobs/service.py), read at collect time too: the runner's,
  the API's and the render's counts, and the queue depth and per-key usage the service refreshes in the background.

The dashboard (`/dashboard`, pushed over server-sent events at `/dashboard/stream`) is computed from the
very same registry: `DashboardFeed.sample()` collects it every `sample_period_s` and turns counter deltas
into rates and histogram-bucket deltas into quantiles, the way PromQL's `rate()` and `histogram_quantile`
would. Time to first audio additionally keeps its raw values for a sliding window (exact p50/p95/p99).

Wiring (see `install`): `metrics.install(app)` once, and `*metrics.routes()` among the app's routes.
`create_metrics_app(app)` serves `/metrics` and the dashboard of that app on a second port
(`serve_in_thread` runs it on its own thread and event loop, so a flood of sessions on the main loop
cannot starve the scrapes).
"""

from __future__ import annotations

import asyncio
import bisect
import collections
import logging
import socket
import threading
import time
from collections.abc import AsyncIterator, Callable, Iterable
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import orjson
import structlog
import uvicorn
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import FileResponse, RedirectResponse, Response, StreamingResponse
from starlette.routing import BaseRoute, Mount, Route
from starlette.staticfiles import StaticFiles

from agent_server.core.hub import Hub, ServerStatus
from agent_server.core.observers import (
    BusyRejected,
    ContextFinished,
    FirstAudio,
    ObservedEvent,
    SessionClosed,
    SessionOpened,
    SlowClientDropped,
)
from agent_server.fleet.replica_metrics import ReplicaCollector
from agent_server.jobs.service import JobService
from synth.api import OUTPUT_SAMPLE_RATE_HZ, EngineLike, StepStats

log = structlog.get_logger("agent_server.metrics")

STATIC_DIR = Path(__file__).resolve().parent.parent / "static"

# Buckets sized to the real-time budget: a voice agent wants first audio well under 300 ms, and one decode
# step of the whole batch must stay under 40 ms (one speech token) to keep up with playback.
TTFA_BUCKETS_S = (0.01, 0.02, 0.03, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.5, 0.75, 1.0, 1.5, 2.0)
OVERHEAD_BUCKETS_S = (0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1)
DECODE_STEP_BUCKETS_S = (0.0005, 0.001, 0.002, 0.003, 0.005, 0.0075, 0.01, 0.015, 0.02, 0.03, 0.05, 0.075, 0.1, 0.2)
PREFILL_BUCKETS_S = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1.0)
VOCODER_BUCKETS_S = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.03, 0.05, 0.1, 0.2, 0.5)

# Close codes get their own label value; anything else (a client may send any 3000-4999) is "other".
KNOWN_CLOSE_CODES = frozenset({1000, 1001, 1002, 1003, 1005, 1006, 1007, 1008, 1009, 1011, 1012, 1013})
CONTEXT_REASONS = ("completed", "cancelled", "busy", "failed", "shutdown")
BUSY_SCOPES = ("session", "context")
DEFAULT_PROTOCOLS = ("native",)
GRAPHS_REASON_CHARS = 160  # tts_engine_graphs: the reason label, cut (the whole reason: /v1/status)

SAMPLE_PERIOD_S = 0.5  # dashboard resolution
HISTORY_S = 120.0  # dashboard history kept (and sent to a dashboard that connects)
TTFA_WINDOW_S = 60.0  # sliding window of the dashboard's time-to-first-audio quantiles
MAX_TTFA_SAMPLES = 20_000  # bound on that window's raw values
SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}
NO_CACHE = {"Cache-Control": "no-cache"}


class Metrics:
    """The app's registry and its inputs. `on_step` runs on the engine thread; the rest on any thread."""

    def __init__(
        self,
        hub: Hub,
        *,
        jobs: JobService | None = None,
        sample_period_s: float = SAMPLE_PERIOD_S,
        history_s: float = HISTORY_S,
        ttfa_window_s: float = TTFA_WINDOW_S,
    ) -> None:
        self.hub = hub
        self.registry = r = CollectorRegistry(auto_describe=True)

        def counter(name: str, doc: str, labels: tuple[str, ...] = ()) -> Counter:
            return Counter(name, doc, labels, registry=r)

        def histogram(name: str, doc: str, buckets_s: tuple[float, ...], labels: tuple[str, ...] = ()) -> Histogram:
            return Histogram(name, doc, labels, buckets=buckets_s, registry=r)

        proto = ("protocol",)
        spoken = ("protocol", "model")  # a context's: the protocol it came by, the loaded model that spoke it
        # ---- per context (observers) ----
        self.ttfa = histogram(
            "tts_time_to_first_audio_seconds", "First audio frame sent - first text received", TTFA_BUCKETS_S, spoken
        )
        self.engine_ttfb = histogram(
            "tts_engine_first_chunk_seconds", "Engine's first chunk ready - first submit", TTFA_BUCKETS_S, spoken
        )
        self.server_overhead = histogram(
            "tts_server_overhead_seconds", "First frame sent - engine's first chunk ready", OVERHEAD_BUCKETS_S, spoken
        )
        self.contexts_finished = counter("tts_contexts_finished", "Contexts ended, by model and reason",
                                         ("protocol", "model", "reason"))
        self.audio_sent = counter("tts_audio_sent_seconds", "Audio sent to clients (counted as contexts end)", spoken)
        # ---- per session (observers) ----
        self.sessions_opened = counter("tts_sessions_opened", "Sessions admitted (WebSockets, HTTP requests)", proto)
        self.sessions_closed = counter("tts_sessions_closed", "Sessions closed, by close code", ("protocol", "code"))
        self.busy = counter("tts_busy_rejections", "Refusals of a session or a context", ("protocol", "scope"))
        self.slow_clients = counter("tts_slow_clients_dropped", "Sessions closed: the client stopped reading", proto)
        # ---- engine (stats listener, engine thread) ----
        # (one StepStats per loaded model per iteration: each series by the model it stepped)
        by_model = ("model",)
        self.steps = counter("tts_engine_steps", "Engine iterations that did work, per model", by_model)
        self.decode_step = histogram("tts_engine_decode_step_seconds", "One batched decode step",
                                     DECODE_STEP_BUCKETS_S, by_model)
        self.prefill = histogram("tts_engine_prefill_seconds", "Prefills of one engine iteration", PREFILL_BUCKETS_S,
                                 by_model)
        self.vocoder = histogram("tts_engine_vocoder_seconds", "Vocoder work of one iteration", VOCODER_BUCKETS_S,
                                 by_model)
        self.decode_rows = counter("tts_engine_decode_rows", "T3 rows decoded, summed over steps (CFG: 2 a segment)",
                                   by_model)
        self.slot_steps = counter("tts_engine_slot_steps", "Segments in slots, summed over steps (/ steps: mean)",
                                  by_model)
        self.prefills = counter("tts_engine_prefills", "Segments prefilled", by_model)
        self.audio_produced = counter("tts_engine_audio_seconds", "Seconds of audio the engine produced", by_model)
        self.job_audio_produced = counter("tts_engine_job_audio_seconds", "Of tts_engine_audio_seconds, what job "
                                          "segments got (the rest went to live sessions)", by_model)
        self.preemptions = counter("tts_engine_preemptions", "Job segments whose rows the engine took back for live "
                                   "ones (each starts over later; its caller hears one attempt)", by_model)
        self.job_rows_paused = counter("tts_engine_job_rows_paused", "Job rows that sat out a decode step while a "
                                       "live turn sampled its first chunk's ids (CPU; they resume where they stopped)",
                                       by_model)
        self.job_steps_withdrawn = counter("tts_engine_job_steps_withdrawn", "Steps of job rows only that stopped "
                                           "mid-step for a live turn's first segment (CPU; decoded again later)",
                                           by_model)
        # ---- read from the hub at collect time ----
        self._protocols: set[str] = set(DEFAULT_PROTOCOLS)
        self._models: tuple[str, ...] = tuple(hub.settings.models)  # the configured ones (the engine's once built)
        r.register(_HubCollector(hub, self._protocols))
        r.register(ReplicaCollector(hub))  # shared state, phrase cache, agent weight (replica_metrics.py)
        if jobs is not None:
            r.register(JobsCollector(jobs))
        for protocol in DEFAULT_PROTOCOLS:
            self._init_labels(protocol)
        for model in self._models:  # the engine's series exist (at 0) before its first step
            for series in (self.steps, self.decode_step, self.prefill, self.vocoder, self.decode_rows,
                           self.slot_steps, self.prefills, self.audio_produced, self.job_audio_produced,
                           self.preemptions,
                           self.job_rows_paused, self.job_steps_withdrawn):
                series.labels(model)

        self._engine: EngineLike | None = None
        # (when, first audio, model) over the dashboard's window
        self._ttfa_window: collections.deque[tuple[float, float, str]] = collections.deque(maxlen=MAX_TTFA_SAMPLES)
        self.feed = DashboardFeed(self, sample_period_s=sample_period_s, history_s=history_s, window_s=ttfa_window_s)

    def _init_labels(self, protocol: str) -> None:
        """Make a protocol's series exist (at 0) before its first event, so rates start from zero."""
        for metric in (self.sessions_opened, self.slow_clients):
            metric.labels(protocol)
        for model in self._models:
            for per_context in (self.ttfa, self.engine_ttfb, self.server_overhead, self.audio_sent):
                per_context.labels(protocol, model)
            for reason in CONTEXT_REASONS:
                self.contexts_finished.labels(protocol, model, reason)
        for scope in BUSY_SCOPES:
            self.busy.labels(protocol, scope)

    # ---- inputs ----------------------------------------------------------------------------------

    def on_step(self, stats: StepStats) -> None:
        """The engine's stats listener: engine thread, once per model per step. Keep it to a few counter adds."""
        model = stats.model
        if not stats.renders_only:  # (a renders-only record is no engine iteration: no step, no slot-steps)
            self.steps.labels(model).inc()
            if stats.active_segments:
                self.slot_steps.labels(model).inc(stats.active_segments)
        if stats.decode_rows:
            self.decode_step.labels(model).observe(stats.decode_ms / 1000.0)
            self.decode_rows.labels(model).inc(stats.decode_rows)
        if stats.prefill_segments:
            self.prefill.labels(model).observe(stats.prefill_ms / 1000.0)
            self.prefills.labels(model).inc(stats.prefill_segments)
        if stats.vocoder_ms:
            self.vocoder.labels(model).observe(stats.vocoder_ms / 1000.0)
        if stats.audio_s:
            self.audio_produced.labels(model).inc(stats.audio_s)
        if stats.job_audio_s:
            self.job_audio_produced.labels(model).inc(stats.job_audio_s)
        if stats.preempted:
            self.preemptions.labels(model).inc(stats.preempted)
        if stats.job_rows_paused:
            self.job_rows_paused.labels(model).inc(stats.job_rows_paused)
        if stats.job_steps_withdrawn:
            self.job_steps_withdrawn.labels(model).inc(stats.job_steps_withdrawn)

    def on_event(self, event: ObservedEvent) -> None:
        """The observers hook (event-loop thread)."""
        if self._engine is None:
            self.attach_engine()  # sessions exist only once the engine does: no step goes unseen
        if isinstance(event, FirstAudio):
            if event.ttfa_s is not None:
                self.ttfa.labels(event.protocol, event.model).observe(event.ttfa_s)
                self._ttfa_window.append((time.monotonic(), event.ttfa_s, event.model))
            if event.engine_ttfb_s is not None:
                self.engine_ttfb.labels(event.protocol, event.model).observe(event.engine_ttfb_s)
            if event.server_overhead_s is not None:
                self.server_overhead.labels(event.protocol, event.model).observe(event.server_overhead_s)
        elif isinstance(event, SessionOpened):
            if event.protocol not in self._protocols:
                self._protocols.add(event.protocol)
                self._init_labels(event.protocol)
            self.sessions_opened.labels(event.protocol).inc()
        elif isinstance(event, SessionClosed):
            code = str(event.code) if event.code in KNOWN_CLOSE_CODES else "other"
            self.sessions_closed.labels(event.protocol, code).inc()
        elif isinstance(event, BusyRejected):
            self.busy.labels(event.protocol, event.scope).inc()
        elif isinstance(event, ContextFinished):
            self.contexts_finished.labels(event.protocol, event.model, event.reason).inc()
            if event.audio_s:
                self.audio_sent.labels(event.protocol, event.model).inc(event.audio_s)
        elif isinstance(event, SlowClientDropped):
            self.slow_clients.labels(event.protocol).inc()

    def attach_engine(self) -> bool:
        """Install the stats listener on the hub's engine once it is built. True when attached."""
        engine = self.hub.engine
        if engine is None:
            return False
        if engine is not self._engine:
            engine.set_stats_listener(self.on_step)
            self._engine = engine
            if engine.models != self._models:  # (the engine's models are the configured ones: the hub checks)
                self._models = engine.models
                for protocol in list(self._protocols):
                    self._init_labels(protocol)
        return True

    def detach_engine(self) -> None:
        if self._engine is not None:
            self._engine.set_stats_listener(None)
            self._engine = None

    async def run(self) -> None:
        """Background task for the app's lifespan: attach the listener as soon as the engine exists, then
        keep the dashboard's history sampled whether or not a dashboard is open."""
        await self.hub.engine_settled.wait()
        self.attach_engine()
        while True:
            self.feed.sample_if_due()
            await asyncio.sleep(self.feed.sample_period_s / 2)

    def ttfa_window(self, since_monotonic_s: float, model: str | None = None) -> list[float]:
        """First-audio times since then (of one model's contexts, or every model's)."""
        return [v for t, v, m in list(self._ttfa_window) if t >= since_monotonic_s and model in (None, m)]

    def exposition(self) -> bytes:
        return generate_latest(self.registry)


class _HubCollector(Collector):
    """Gauges read from the hub when collected: always current, also while the engine idles."""

    def __init__(self, hub: Hub, protocols: set[str]) -> None:
        self.hub = hub
        self.protocols = protocols

    def describe(self) -> Iterable[Metric]:
        return list(self._families())

    def collect(self) -> Iterable[Metric]:
        hub = self.hub
        sessions = list(hub.sessions)  # one C-level copy: safe from the metrics thread too
        by_protocol = dict.fromkeys(sorted(self.protocols), 0)
        for session in sessions:
            by_protocol[session.protocol_name] = by_protocol.get(session.protocol_name, 0) + 1
        engine = hub.engine
        status: dict[str, Any] = engine.status() if engine is not None else {}
        families = self._families()
        sessions_f, contexts_f, slots_f, max_slots_f, waiting_f, ready_f, random_f, graphs_f = families
        for protocol, count in by_protocol.items():
            sessions_f.add_metric([protocol], count)
        contexts_f.add_metric([], sum(s.live_streams for s in sessions))
        for model, of_model in _per_model(engine, status, hub).items():
            slots_f.add_metric([model], float(of_model.get("slots_in_use", 0)))
            max_slots_f.add_metric([model], float(of_model.get("max_slots", 0)))
            waiting_f.add_metric([model], float(of_model.get("waiting", 0)))
        ready_f.add_metric([], 1.0 if hub.ready else 0.0)
        random_f.add_metric([], 1.0 if engine is not None and engine.random_weights else 0.0)
        for part, key in (("decode", "cuda_graphs"), ("vocoder", "vocoder_graphs")):
            if f"{key}_state" in status:  # engines that report it (synth's; test fakes may not)
                reason = str(status.get(f"{key}_reason", ""))[:GRAPHS_REASON_CHARS]
                graphs_f.add_metric([part, str(status[f"{key}_state"]), reason], 1.0)
        return families

    @staticmethod
    def _families() -> list[GaugeMetricFamily]:
        return [
            GaugeMetricFamily("tts_sessions_active", "Sessions open (WebSockets, HTTP requests)", labels=["protocol"]),
            GaugeMetricFamily("tts_contexts_active", "Contexts (turns) open, all sessions"),
            GaugeMetricFamily("tts_engine_slots_in_use", "Segments holding an engine slot, by model", labels=["model"]),
            GaugeMetricFamily("tts_engine_max_slots", "Engine slots (the batch size), by model", labels=["model"]),
            GaugeMetricFamily("tts_engine_waiting_segments", "Segments in the engine's admission queue, by model",
                              labels=["model"]),
            GaugeMetricFamily("tts_server_ready", "1 once the model is loaded and the server takes sessions"),
            GaugeMetricFamily("tts_random_weights", "1 when the model runs on random weights (audio is noise)"),
            GaugeMetricFamily("tts_engine_graphs", "1 for each part's CUDA graphs state: on, off, or fallback (eager "
                              "after a capture failure or a replay unequal to eager at start-up), with the reason",
                              labels=["part", "state", "reason"]),
        ]


def _per_model(engine: EngineLike | None, status: dict[str, Any], hub: Hub) -> dict[str, dict[str, Any]]:
    """Each loaded model's slots and queue: the engine status's per-model entries (an engine that reports none
    serves one model: its totals), the configured slots before the engine is built."""
    if engine is None:
        settings = hub.settings
        return {model: {"max_slots": settings.max_slots.of(model)} for model in settings.models}
    per_model = status.get("models")
    if isinstance(per_model, dict) and per_model:
        return {str(model): dict(of_model) for model, of_model in per_model.items() if isinstance(of_model, dict)}
    return {engine.variant: {"slots_in_use": status.get("slots_in_use", 0), "max_slots": engine.max_slots,
                             "waiting": status.get("waiting", 0)}}


class JobsCollector(Collector):
    """`tts_jobs_*`: read from the job service when collected (its counters are this replica's; the queue depth and
    per-key usage are the fleet's, as its store last said)."""

    def __init__(self, jobs: JobService) -> None:
        self.jobs = jobs

    def describe(self) -> Iterable[Metric]:
        return list(self.collect())

    def collect(self) -> Iterable[Metric]:
        jobs = self.jobs
        runner, api, render = jobs.runner.stats, jobs.api.stats, jobs.render.stats

        def counter(name: str, doc: str, values: dict[str, float], label: str = "") -> CounterMetricFamily:
            family = CounterMetricFamily(name, doc, labels=[label] if label else None)
            for value_label, value in values.items():
                family.add_metric([value_label] if label else [], value)
            return family

        def gauge(name: str, doc: str, value: float) -> GaugeMetricFamily:
            return GaugeMetricFamily(name, doc, value=value)

        unfinished = GaugeMetricFamily("tts_jobs_key_unfinished", "A key's unfinished jobs, fleet-wide (keys that "
                                       "submitted here lately, with per-key limits)", labels=["key_id"])
        chars = GaugeMetricFamily("tts_jobs_key_chars_today", "Characters a key submitted as jobs this UTC day, "
                                  "fleet-wide (keys that submitted here lately, with per-key limits)",
                                  labels=["key_id"])
        for key_id, usage in sorted(jobs.key_usage.items()):
            unfinished.add_metric([key_id], usage.unfinished_jobs)
            chars.add_metric([key_id], usage.chars_today)
        return [
            gauge("tts_jobs_available", "1 when jobs are on and their store opened", 1.0 if jobs.available else 0.0),
            counter("tts_jobs_submitted", "Job submissions through this replica, by result",
                    {"accepted": api.accepted, "refused_quota": api.refused_quota, "bad_request": api.bad_request},
                    "result"),
            counter("tts_jobs_finished", "Jobs this replica finished (done, failed) or cancelled, by status",
                    {"done": runner.jobs_done, "failed": runner.jobs_failed, "cancelled": api.cancelled}, "status"),
            gauge("tts_jobs_queue_depth", "Jobs submitted and not claimed yet, fleet-wide", jobs.queue_depth),
            gauge("tts_jobs_running", "Jobs this replica is rendering", len(jobs.runner.running)),
            counter("tts_jobs_segments", "Job segments this replica rendered, by what storing them did",
                    {"stored": runner.segments_rendered, "already_stored": runner.segments_already_stored}, "result"),
            counter("tts_jobs_audio_seconds", "Seconds of job audio this replica rendered and stored",
                    {"": runner.audio_samples / OUTPUT_SAMPLE_RATE_HZ}),
            counter("tts_jobs_cache_hits", "Job segments the phrase cache replayed instead of the engine",
                    {"": render.cache_hits}),
            counter("tts_jobs_claims_lost", "Jobs this replica stopped because another replica took them over",
                    {"": runner.claims_lost}),
            counter("tts_jobs_webhooks", "Webhooks this replica ended, by result (delivered, failed: every attempt "
                    "made or the receiver refused, refused: the URL not allowed)",
                    {"delivered": runner.webhooks_delivered, "failed": runner.webhooks_failed,
                     "refused": runner.webhooks_refused}, "result"),
            counter("tts_jobs_webhook_attempts", "Webhook POSTs this replica made (retries included)",
                    {"": runner.webhook_attempts}),
            gauge("tts_jobs_webhooks_pending", "Webhooks in the outbox (due or waiting for a retry), fleet-wide",
                  jobs.webhooks_pending),
            unfinished,
            chars,
        ]


# ---- the dashboard feed ----------------------------------------------------------------------------


class _Samples:
    """One collect() of the registry, indexed by sample name."""

    def __init__(self, registry: CollectorRegistry) -> None:
        self.by_name: dict[str, list[tuple[dict[str, str], float]]] = collections.defaultdict(list)
        for family in registry.collect():
            for sample in family.samples:
                self.by_name[sample.name].append((sample.labels, sample.value))

    def total(self, name: str) -> float:
        return sum(value for _, value in self.by_name.get(name, ()))

    def by_label(self, name: str, label: str) -> dict[str, float]:
        out: dict[str, float] = {}
        for labels, value in self.by_name.get(name, ()):
            key = labels.get(label, "")
            out[key] = out.get(key, 0.0) + value
        return out

    def buckets(self, name: str) -> list[tuple[float, float]]:
        """Cumulative (upper bound, count) of a histogram, summed over its other labels."""
        return sorted((float(le), count) for le, count in self.by_label(name + "_bucket", "le").items())


class DashboardFeed:
    """Snapshots of the registry every `sample_period_s`, kept for `history_s`. Thread-safe."""

    def __init__(self, metrics: Metrics, *, sample_period_s: float, history_s: float, window_s: float) -> None:
        self.metrics = metrics
        self.sample_period_s = sample_period_s
        self.window_s = window_s
        self.history: collections.deque[dict[str, Any]] = collections.deque(
            maxlen=max(2, int(history_s / sample_period_s))
        )
        self.seq = 0
        self._lock = threading.Lock()
        self._prev: _Samples | None = None
        self._prev_monotonic_s = 0.0

    def sample_if_due(self) -> int:
        """Take a snapshot when the last one is a period old. Returns the latest seq."""
        with self._lock:
            now_s = time.monotonic()
            if self._prev is None or now_s - self._prev_monotonic_s >= self.sample_period_s * 0.95:
                self._sample(now_s)
            return self.seq

    def since(self, seq: int) -> list[dict[str, Any]]:
        with self._lock:
            return [snap for snap in self.history if snap["seq"] > seq]

    def hello(self) -> dict[str, Any]:
        self.sample_if_due()
        model = self.metrics.hub.model
        with self._lock:
            history = list(self.history)
        return {
            "variant": model.variant,
            "models": list(model.models),
            "random_weights": model.random_weights,
            "sample_period_s": self.sample_period_s,
            "ttfa_window_s": self.window_s,
            "ttfa_buckets_ms": [round(b * 1000, 3) for b in TTFA_BUCKETS_S],
            "history": history,
        }

    def _sample(self, now_s: float) -> None:
        cur = _Samples(self.metrics.registry)
        prev = self._prev
        dt_s = now_s - self._prev_monotonic_s if prev is not None else 0.0
        self._prev, self._prev_monotonic_s = cur, now_s
        self.seq += 1
        self.history.append(self._snapshot(cur, prev, dt_s))

    def _snapshot(self, cur: _Samples, prev: _Samples | None, dt_s: float) -> dict[str, Any]:
        def delta(name: str) -> float:
            return cur.total(name) - (prev.total(name) if prev is not None else 0.0)

        def mean_ms(histogram: str) -> float | None:
            count = delta(histogram + "_count")
            return _ms(delta(histogram + "_sum") / count) if count > 0 else None

        def per_protocol(name: str) -> dict[str, int]:
            return {p: int(v) for p, v in cur.by_label(name, "protocol").items()}

        def per_model(name: str, previous: bool = False) -> dict[str, float]:
            samples = prev if previous else cur
            return samples.by_label(name, "model") if samples is not None else {}

        steps = delta("tts_engine_steps_total")
        slots_in_use = cur.total("tts_engine_slots_in_use")
        window = sorted(self.metrics.ttfa_window(time.monotonic() - self.window_s))
        decode_buckets = _bucket_deltas(cur, prev, "tts_engine_decode_step_seconds")
        return {
            "seq": self.seq,
            "t": round(time.time(), 3),
            "dt_s": round(dt_s, 3),
            "status": self.metrics.hub.status.name.lower(),
            "ttfa": {  # over the sliding window, exact
                "n": len(window),
                **{f"p{q}_ms": _ms(_exact_quantile(window, q / 100)) for q in (50, 95, 99)},
                "hist": _histogram(window, TTFA_BUCKETS_S),  # counts per bucket, the last one is > 2 s
                "total": int(cur.total("tts_time_to_first_audio_seconds_count")),
                "new": int(delta("tts_time_to_first_audio_seconds_count")),
            },
            "decode": {  # over the last period
                "steps_per_s": _rate(steps, dt_s),
                "mean_ms": mean_ms("tts_engine_decode_step_seconds"),
                "p95_ms": _ms(_bucket_quantile(decode_buckets, 0.95)),
            },
            "prefill_mean_ms": mean_ms("tts_engine_prefill_seconds"),
            "vocoder_mean_ms": mean_ms("tts_engine_vocoder_seconds"),
            "slots": {
                "in_use": slots_in_use,
                "max": cur.total("tts_engine_max_slots"),
                "mean": round(delta("tts_engine_slot_steps_total") / steps, 3) if steps > 0 else slots_in_use,
            },
            "waiting": cur.total("tts_engine_waiting_segments"),
            "sessions": per_protocol("tts_sessions_active"),
            "contexts": int(cur.total("tts_contexts_active")),
            "audio_per_s": _rate(delta("tts_engine_audio_seconds_total"), dt_s),
            "live_audio_per_s": _rate(delta("tts_engine_audio_seconds_total")
                                      - delta("tts_engine_job_audio_seconds_total"), dt_s),
            "jobs": {
                "queue": int(cur.total("tts_jobs_queue_depth")),
                "running": int(cur.total("tts_jobs_running")),
                "audio_per_s": _rate(delta("tts_engine_job_audio_seconds_total"), dt_s),
                "stored_audio_per_s": _rate(delta("tts_jobs_audio_seconds_total"), dt_s),
                "preempted": int(delta("tts_engine_preemptions_total")),
            },
            "busy": {
                "new": int(delta("tts_busy_rejections_total")),
                "total": int(cur.total("tts_busy_rejections_total")),
            },
            "opened": per_protocol("tts_sessions_opened_total"),
            "closed": per_protocol("tts_sessions_closed_total"),
            "models": self._models(cur, per_model),
        }

    def _models(self, cur: _Samples, per_model: Callable[..., dict[str, float]]) -> dict[str, dict[str, Any]]:
        """Each model's first audio (the window's quantiles), slots, queue and contexts started this period."""
        since_s = time.monotonic() - self.window_s
        in_use, slots, waiting = (per_model(n) for n in ("tts_engine_slots_in_use", "tts_engine_max_slots",
                                                             "tts_engine_waiting_segments"))
        started, started_before = (per_model("tts_time_to_first_audio_seconds_count", previous)
                                   for previous in (False, True))
        out: dict[str, dict[str, Any]] = {}
        for model in sorted(set(slots) | set(started)):
            window = sorted(self.metrics.ttfa_window(since_s, model))
            out[model] = {
                "ttfa_n": len(window),
                **{f"ttfa_p{q}_ms": _ms(_exact_quantile(window, q / 100)) for q in (50, 95)},
                "slots_in_use": in_use.get(model, 0.0),
                "max_slots": slots.get(model, 0.0),
                "waiting": waiting.get(model, 0.0),
                "first_audio_new": int(started.get(model, 0.0) - started_before.get(model, 0.0)),
            }
        return out


def _ms(value_s: float | None) -> float | None:
    return None if value_s is None else round(value_s * 1000.0, 3)


def _rate(amount: float, dt_s: float) -> float:
    return round(amount / dt_s, 4) if dt_s > 0 else 0.0


def _exact_quantile(sorted_values: list[float], q: float) -> float | None:
    """Nearest-rank quantile of sorted values (None when empty)."""
    if not sorted_values:
        return None
    rank = max(0, min(len(sorted_values) - 1, int(q * len(sorted_values) + 0.999999) - 1))
    return sorted_values[rank]


def _histogram(values: list[float], bounds_s: tuple[float, ...]) -> list[int]:
    counts = [0] * (len(bounds_s) + 1)
    for value in values:
        counts[bisect.bisect_left(bounds_s, value)] += 1
    return counts


def _bucket_deltas(cur: _Samples, prev: _Samples | None, name: str) -> list[tuple[float, float]]:
    now = cur.buckets(name)
    before = dict(prev.buckets(name)) if prev is not None else {}
    return [(le, count - before.get(le, 0.0)) for le, count in now]


def _bucket_quantile(buckets: list[tuple[float, float]], q: float) -> float | None:
    """PromQL's histogram_quantile over cumulative (upper bound, count) buckets: linear within a bucket;
    a quantile in the +Inf bucket reads as the highest finite bound."""
    if not buckets or buckets[-1][1] <= 0:
        return None
    target = q * buckets[-1][1]
    lower_bound, lower_count = 0.0, 0.0
    for upper_bound, count in buckets:
        if count >= target:
            if upper_bound == float("inf"):
                return lower_bound
            if count == lower_count:
                return upper_bound
            return lower_bound + (upper_bound - lower_bound) * (target - lower_count) / (count - lower_count)
        lower_bound, lower_count = upper_bound, count
    return lower_bound


# ---- wiring ----------------------------------------------------------------------------------------


def install(app: Starlette, **options: Any) -> Metrics:
    """Give `app` (from `create_app`) its Metrics: subscribe to its observers and run `Metrics.run` in its
    lifespan (attaches the engine's stats listener, samples the dashboard). Idempotent. Routes are separate
    (`routes()`), so that the metrics can also be served by `create_metrics_app` alone."""
    existing: Metrics | None = getattr(app.state, "metrics", None)
    if existing is not None:
        return existing
    metrics = Metrics(app.state.hub, jobs=getattr(app.state, "jobs", None), **options)
    app.state.metrics = metrics
    app.state.observers.subscribe(metrics.on_event)
    inner = app.router.lifespan_context

    @asynccontextmanager
    async def lifespan(app_: Starlette) -> AsyncIterator[Any]:
        async with inner(app_) as state:
            task = asyncio.create_task(metrics.run(), name="metrics")
            try:
                yield state
            finally:
                task.cancel()
                await asyncio.gather(task, return_exceptions=True)
                metrics.detach_engine()

    app.router.lifespan_context = lifespan
    return metrics


def routes(*, demo: bool = True) -> list[BaseRoute]:
    """`/` (the demo page, unless demo=False: then it redirects to the dashboard), `/dashboard`,
    `/dashboard/stream`, `/metrics` and `/static`. Handlers find the Metrics at `app.state.metrics`."""
    return [
        Route("/", demo_page if demo else to_dashboard, methods=["GET"]),
        Route("/dashboard", dashboard_page, methods=["GET"]),
        Route("/dashboard/stream", dashboard_stream, methods=["GET"]),
        Route("/metrics", scrape, methods=["GET"]),
        Mount("/static", app=StaticFiles(directory=STATIC_DIR), name="static"),
    ]


def create_metrics_app(main_app: Starlette) -> Starlette:
    """/metrics and the dashboard of `main_app`, for a second port (the demo page stays on the main one)."""
    metrics = install(main_app)
    app = Starlette(routes=routes(demo=False))
    app.state.metrics = metrics
    app.state.hub = main_app.state.hub
    return app


METRICS_THREAD = "metrics-http"


class _NotFromThread(logging.Filter):
    """Leaves out the records a thread logs: all of them, or those whose message starts with one of `messages`."""

    def __init__(self, thread_name: str, messages: tuple[str, ...] = ()) -> None:
        super().__init__()
        self.thread_name = thread_name
        self.messages = messages

    def filter(self, record: logging.LogRecord) -> bool:
        if record.threadName != self.thread_name:
            return True
        return bool(self.messages) and not record.getMessage().startswith(self.messages)


# uvicorn's lines about the process, said again by the metrics port's server, read as a second server process
PROCESS_LINES = ("Started server process", "Finished server process", "Shutting down")


def serve_in_thread(
    main_app: Starlette, host: str, port: int, **config: Any
) -> tuple[uvicorn.Server, threading.Thread]:
    """Run `create_metrics_app(main_app)` with its own uvicorn server, thread and event loop: a flood of
    sessions on the main loop does not delay a scrape. Stop it with `server.should_exit = True` and
    `thread.join()`. `port=0` picks a free port (then `server.config.port` says which)."""
    sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((host, port))
    # uvicorn's `access_log=False` empties the process-wide "uvicorn.access" logger, the main port's too:
    # the scrapes' lines are left out by the thread that logs them instead.
    options: dict[str, Any] = {"log_config": None, "timeout_graceful_shutdown": 1, **config}
    for logger, messages in ((logging.getLogger("uvicorn.access"), ()), (logging.getLogger("uvicorn.error"),
                                                                            PROCESS_LINES)):
        if not any(isinstance(f, _NotFromThread) and f.thread_name == METRICS_THREAD for f in logger.filters):
            logger.addFilter(_NotFromThread(METRICS_THREAD, messages))
    app = create_metrics_app(main_app)
    server = uvicorn.Server(uvicorn.Config(app, host=host, port=sock.getsockname()[1], lifespan="off", **options))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, name=METRICS_THREAD, daemon=True)
    thread.start()
    return server, thread


# ---- handlers --------------------------------------------------------------------------------------


def _metrics(request: Request) -> Metrics:
    metrics: Metrics = request.app.state.metrics
    return metrics


async def scrape(request: Request) -> Response:
    return Response(_metrics(request).exposition(), media_type=CONTENT_TYPE_LATEST)


async def demo_page(request: Request) -> Response:
    return FileResponse(STATIC_DIR / "index.html", headers=NO_CACHE)


async def dashboard_page(request: Request) -> Response:
    return FileResponse(STATIC_DIR / "dashboard.html", headers=NO_CACHE)


async def to_dashboard(request: Request) -> Response:
    return RedirectResponse("/dashboard")


async def dashboard_stream(request: Request) -> Response:
    """Server-sent events: `hello` (settings and history), then a `sample` per snapshot. Ends when the
    server starts shutting down (EventSource reconnects on its own)."""
    metrics = _metrics(request)
    return StreamingResponse(_sse_events(metrics), media_type="text/event-stream", headers=SSE_HEADERS)


async def _sse_events(metrics: Metrics) -> AsyncIterator[bytes]:
    feed = metrics.feed
    hello = feed.hello()
    last_seq = hello["history"][-1]["seq"] if hello["history"] else 0
    yield _sse("hello", hello, retry_ms=1000)
    while metrics.hub.status not in (ServerStatus.DRAINING, ServerStatus.STOPPED):
        await asyncio.sleep(feed.sample_period_s / 2)
        feed.sample_if_due()
        for snap in feed.since(last_seq):
            last_seq = snap["seq"]
            yield _sse("sample", snap)


def _sse(event: str, data: Any, retry_ms: int | None = None) -> bytes:
    head = f"retry: {retry_ms}\n" if retry_ms is not None else ""
    return f"{head}event: {event}\n".encode() + b"data: " + orjson.dumps(data) + b"\n\n"

