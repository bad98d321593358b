"""agent_server.metrics: /metrics counts what the traffic implies, the dashboard feed reads the same
registry, the metrics port serves the same numbers, and several apps never share a registry."""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import Any

import httpx
import orjson
import pytest
from prometheus_client import REGISTRY
from prometheus_client.parser import text_string_to_metric_families

from agent_server import metrics
from agent_server.app import create_app
from agent_server.settings import Settings
from synth.api import StepStats, Variant

from tests.agent_server.native_client import ContextLog, NativeClient
from tests.browser.support import SECONDS_PER_TOKEN, StatsFakeEngine, metrics_server

pytestmark = pytest.mark.timeout(60)

TEXTS = [
    "Sure, I can help with that. Your table is booked for eight.",
    "Okay. The store opens at ten and closes at six on weekdays.",
]
LONG_TEXT = "Right, let me read the whole list to you slowly, one item after another, so nothing gets lost. " * 2
# backend: local|redis; result: hit_local|hit_remote|miss; status: done|failed|cancelled (jobs)
ALLOWED_LABELS = {"protocol", "model", "code", "reason", "scope", "le", "backend", "result", "status"}

Samples = dict[tuple[str, frozenset[tuple[str, str]]], float]


def scrape(url: str) -> Samples:
    response = httpx.get(url + "/metrics", timeout=5)
    assert response.status_code == 200
    assert response.headers["content-type"].startswith("text/plain")
    out: Samples = {}
    for family in text_string_to_metric_families(response.text):
        for sample in family.samples:
            out[(sample.name, frozenset(sample.labels.items()))] = float(sample.value)
    return out


def value(samples: Samples, name: str, **labels: str) -> float:
    """Sum of the samples called `name` whose labels include `labels`."""
    want = set(labels.items())
    return sum(v for (n, ls), v in samples.items() if n == name and want <= ls)


def wait_for(predicate: Any, timeout_s: float = 5.0) -> None:
    deadline_s = time.monotonic() + timeout_s
    while not predicate():
        assert time.monotonic() < deadline_s, "timed out"
        time.sleep(0.02)


async def speak(client: NativeClient, context_id: str, text: str) -> ContextLog:
    log = await client.open(context_id, seed=1)
    await client.stream_text(context_id, text, chars_per_s=2000.0)
    await asyncio.wait_for(log.finished.wait(), 20)
    return log


# ---- pure helpers ----------------------------------------------------------------------------------


def test_bucket_quantile_interpolates_like_promql() -> None:
    buckets = [(0.01, 0.0), (0.02, 50.0), (0.05, 100.0), (float("inf"), 100.0)]
    assert metrics._bucket_quantile(buckets, 0.5) == pytest.approx(0.02)
    assert metrics._bucket_quantile(buckets, 0.25) == pytest.approx(0.015)
    assert metrics._bucket_quantile(buckets, 0.75) == pytest.approx(0.035)
    assert metrics._bucket_quantile([(0.01, 0.0), (float("inf"), 4.0)], 0.9) == 0.01  # in +Inf: the top bound
    assert metrics._bucket_quantile([(0.01, 0.0), (float("inf"), 0.0)], 0.5) is None


def test_exact_quantile_and_window_histogram() -> None:
    values = sorted([0.005, 0.04, 0.09, 0.11, 0.25, 3.0])
    assert metrics._exact_quantile(values, 0.5) == 0.09
    assert metrics._exact_quantile(values, 0.99) == 3.0
    assert metrics._exact_quantile([], 0.5) is None
    counts = metrics._histogram(values, metrics.TTFA_BUCKETS_S)
    assert sum(counts) == len(values)
    assert counts[0] == 1 and counts[-1] == 1  # <= 10 ms, > 2 s


def test_each_app_has_its_own_registry(tmp_path: Path) -> None:
    apps = [create_app(StatsFakeEngine(), Settings(data_dir=tmp_path)) for _ in range(2)]
    registries = [metrics.install(app).registry for app in apps]
    assert metrics.install(apps[0]).registry is registries[0]  # idempotent
    assert registries[0] is not registries[1]
    assert REGISTRY.get_sample_value("tts_engine_steps_total") is None  # nothing in the global registry
    text = metrics.Metrics(apps[0].state.hub).exposition().decode()
    assert "tts_time_to_first_audio_seconds_bucket" in text


def test_engine_series_are_per_model_and_count_preemptions(tmp_path: Path) -> None:
    """A MultiEngine reports one StepStats per model per step: each engine series keeps the models apart (a step
    of two models is not two steps of one), and the preemptions the engine hides from callers are counted."""
    app = create_app(StatsFakeEngine(), Settings(data_dir=tmp_path))
    registry = metrics.install(app)

    def step(model: Variant, preempted: int, paused: int = 0, withdrawn: int = 0) -> StepStats:
        return StepStats(at_monotonic_s=0.0, decode_rows=4, active_segments=2, max_slots=8, waiting_segments=0,
                         decode_ms=12.0, prefill_ms=0.0, prefill_segments=0, vocoder_ms=3.0, audio_s=0.08,
                         preempted=preempted, model=model, job_rows_paused=paused, job_steps_withdrawn=withdrawn,
                         job_audio_s=0.02 * preempted)

    tail = replace(step("turbo", 0), decode_rows=0, audio_s=0.5, renders_only=True)  # T3 idle, the vocoder not
    for stats in (step("turbo", 0), step("multilingual", 1, paused=3), step("turbo", 2, withdrawn=1), tail):
        registry.on_step(stats)
    samples = {(s.name, tuple(sorted(s.labels.items()))): s.value
               for family in registry.registry.collect() for s in family.samples}
    assert samples[("tts_engine_steps_total", (("model", "turbo"),))] == 2
    assert samples[("tts_engine_steps_total", (("model", "multilingual"),))] == 1
    assert samples[("tts_engine_decode_rows_total", (("model", "multilingual"),))] == 4
    assert samples[("tts_engine_preemptions_total", (("model", "turbo"),))] == 2
    assert samples[("tts_engine_preemptions_total", (("model", "multilingual"),))] == 1
    assert samples[("tts_engine_job_rows_paused_total", (("model", "multilingual"),))] == 3
    assert samples[("tts_engine_job_steps_withdrawn_total", (("model", "turbo"),))] == 1
    assert samples[("tts_engine_audio_seconds_total", (("model", "turbo"),))] == pytest.approx(0.66)
    assert samples[("tts_engine_job_audio_seconds_total", (("model", "turbo"),))] == pytest.approx(0.04)


# ---- a live server ---------------------------------------------------------------------------------


def test_metrics_count_the_traffic(tmp_path: Path) -> None:
    engine = StatsFakeEngine(max_slots=4, realtime_factor=0.2)
    # (no phrase cache: a2 repeats b1's seeded text, and every second spoken must come from the engine here)
    settings = Settings(data_dir=tmp_path, max_sessions=2, max_contexts_per_session=1, phrase_cache_mb=0)
    with metrics_server(engine, settings) as (server, _):
        mid: dict[str, Samples] = {}

        async def scenario() -> tuple[list[ContextLog], ContextLog, list[int | None]]:
            a = await NativeClient.connect(server.ws_url)
            b = await NativeClient.connect(server.ws_url)
            refused = await NativeClient.connect(server.ws_url)  # max_sessions=2: busy, then 1013
            refused_code = await refused.wait_closed()
            done = list(await asyncio.gather(speak(a, "a1", TEXTS[0]), speak(b, "b1", TEXTS[1])))
            done.append(await speak(a, "a2", TEXTS[1]))
            # a long one, cancelled after its first frames; a second context meanwhile is busy (1 per socket)
            doomed = await b.open("doomed", seed=2, text=LONG_TEXT)
            await b.end("doomed")
            while len(doomed.frames) < 3:
                await asyncio.sleep(0.005)
            extra = await b.open("extra", text="Hello there.")
            while extra.busy is None:
                await asyncio.sleep(0.005)
            mid["samples"] = await asyncio.to_thread(scrape, server.http_url)
            await b.cancel("doomed")
            await asyncio.wait_for(doomed.finished.wait(), 10)
            await a.close()
            await b.close()
            return done, doomed, [refused_code]

        done, doomed, codes = asyncio.run(scenario())
        assert codes == [1013]
        assert all(log.done is not None and log.done["reason"] == "completed" for log in done)
        assert doomed.done is not None and doomed.done["reason"] == "cancelled"
        assert value(mid["samples"], "tts_sessions_active", protocol="native") == 2
        assert value(mid["samples"], "tts_contexts_active") == 1
        assert value(mid["samples"], "tts_engine_slots_in_use") == 1

        wait_for(lambda: value(scrape(server.http_url), "tts_sessions_closed_total") == 2)
        s = scrape(server.http_url)

    # sessions and refusals, by protocol (the refused socket was never admitted)
    assert value(s, "tts_sessions_opened_total", protocol="native") == 2
    assert value(s, "tts_sessions_closed_total", protocol="native", code="1000") == 2
    assert value(s, "tts_sessions_active") == 0 and value(s, "tts_contexts_active") == 0
    assert value(s, "tts_busy_rejections_total", scope="session") == 1
    assert value(s, "tts_busy_rejections_total", scope="context") == 1
    # contexts: 3 completed, 1 cancelled, the busy one ended as busy (or was never opened)
    assert value(s, "tts_contexts_finished_total", reason="completed") == 3
    assert value(s, "tts_contexts_finished_total", reason="cancelled") == 1
    # every context that sent audio has a time to first audio (and an engine first-chunk time)
    assert value(s, "tts_time_to_first_audio_seconds_count", protocol="native") == 4
    assert value(s, "tts_engine_first_chunk_seconds_count") == 4
    assert value(s, "tts_server_overhead_seconds_count") == 4
    assert 0 < value(s, "tts_time_to_first_audio_seconds_sum") < 4 * 2.0
    # audio: what the engine produced covers what the completed contexts announced; sent = what clients got
    spoken_s = sum(seg["speech_tokens"] * SECONDS_PER_TOKEN for log in done for seg in log.segments_done)
    produced_s = value(s, "tts_engine_audio_seconds_total")
    assert spoken_s <= produced_s + 1e-6
    assert produced_s <= spoken_s + len(LONG_TEXT) * engine.tokens_per_char * SECONDS_PER_TOKEN
    sent_s = sum(log.done["audio_ms"] for log in [*done, doomed] if log.done is not None) / 1000.0
    assert value(s, "tts_audio_sent_seconds_total") == pytest.approx(sent_s, abs=0.01)
    # the engine's steps (from the stats listener)
    assert value(s, "tts_engine_steps_total") > 0
    assert value(s, "tts_engine_decode_step_seconds_count") > 0
    assert value(s, "tts_engine_slot_steps_total") >= value(s, "tts_engine_decode_step_seconds_count")
    segments = sum(len(log.segments_started) for log in done)
    # (+1 at most beside the doomed context's started segments: its next segment may be prefilled before the cancel
    # and never reported started; a loaded machine made it so once)
    assert segments + 1 <= value(s, "tts_engine_prefills_total") <= segments + len(doomed.segments_started) + 1
    assert value(s, "tts_engine_max_slots") == 4
    assert value(s, "tts_server_ready") == 1 and value(s, "tts_random_weights") == 1
    # low cardinality: no session or context ids anywhere, buckets sized to the real-time budget
    assert {k for _, labels in s for k, _ in labels} <= ALLOWED_LABELS
    ttfa_bounds = {dict(labels)["le"] for name, labels in s if name == "tts_time_to_first_audio_seconds_bucket"}
    assert {"0.01", "2.0", "+Inf"} <= ttfa_bounds and len(ttfa_bounds) == len(metrics.TTFA_BUCKETS_S) + 1
    step_bounds = {dict(labels)["le"] for name, labels in s if name == "tts_engine_decode_step_seconds_bucket"}
    assert {"0.0005", "0.2", "+Inf"} <= step_bounds


def test_dashboard_stream_and_metrics_port(tmp_path: Path) -> None:
    engine = StatsFakeEngine(realtime_factor=0.2)
    with metrics_server(engine, Settings(data_dir=tmp_path), sample_period_s=0.1) as (server, m):
        app = server.app
        access = logging.getLogger("uvicorn.access")
        propagated = access.propagate
        access.propagate = True  # as a server with access lines has it (the test server runs without)
        access_before = (access.propagate, list(access.handlers))
        side, side_thread = metrics.serve_in_thread(app, "127.0.0.1", 0)
        try:
            wait_for(lambda: side.started)
            side_url = f"http://127.0.0.1:{side.config.port}"

            async def traffic() -> list[ContextLog]:
                clients = [await NativeClient.connect(server.ws_url) for _ in range(3)]
                logs = await asyncio.gather(*(speak(c, "t", TEXTS[i % 2]) for i, c in enumerate(clients)))
                for client in clients:
                    await client.close()
                return list(logs)

            logs = asyncio.run(traffic())
            assert all(log.done is not None and log.done["reason"] == "completed" for log in logs)
            wait_for(lambda: value(scrape(server.http_url), "tts_sessions_closed_total") == 3)

            # the metrics port serves the same registry, and only the metrics and the dashboard
            main, other = scrape(server.http_url), scrape(side_url)
            same = ("tts_sessions_opened_total", "tts_time_to_first_audio_seconds_count", "tts_engine_steps_total")
            for name in same:
                assert value(main, name) == value(other, name) > 0
            assert httpx.get(side_url + "/dashboard").text.startswith("<!doctype html>")
            assert httpx.get(side_url + "/static/dashboard.js").status_code == 200
            assert httpx.get(side_url + "/").headers["location"] == "/dashboard"
            assert httpx.get(side_url + "/v1/stream").status_code == 404
            assert httpx.get(server.http_url + "/").text.startswith("<!doctype html>")

            # the main port's access lines go on (uvicorn's access_log=False would have silenced both ports)
            assert (access.propagate, access.handlers) == access_before
            assert access.filter(logging.LogRecord("uvicorn.access", logging.INFO, "", 0, "GET /", None, None))
            scraped = logging.LogRecord("uvicorn.access", logging.INFO, "", 0, "GET /metrics", None, None)
            scraped.threadName = metrics.METRICS_THREAD
            assert not access.filter(scraped)  # the metrics port's own are left out
            uvicorn_error = logging.getLogger("uvicorn.error")  # and its lines about the process: one process
            for message, kept in (("Started server process [%d]", False), ("Finished server process [%d]", False),
                                  ("Uvicorn running on %s", True)):
                record = logging.LogRecord("uvicorn.error", logging.INFO, "", 0, message, (1,), None)
                assert uvicorn_error.filter(record)
                record.threadName = metrics.METRICS_THREAD
                assert bool(uvicorn_error.filter(record)) is kept, message

            hello, sample = read_stream(side_url)
            assert hello["variant"] == "english" and hello["random_weights"] is True
            history = hello["history"]
            assert len(history) >= 2 and history[-1]["seq"] < sample["seq"]
            assert sample["ttfa"]["total"] == sample["ttfa"]["n"] == 3
            assert sum(sample["ttfa"]["hist"]) == 3
            assert 0 < sample["ttfa"]["p50_ms"] <= sample["ttfa"]["p95_ms"] <= sample["ttfa"]["p99_ms"]
            assert sample["slots"]["max"] == engine.max_slots and sample["sessions"] == {"native": 0}
            assert sample["opened"] == {"native": 3} and sample["closed"] == {"native": 3}
            busy_moments = [snap for snap in history if snap["audio_per_s"] > 0]
            assert busy_moments, "no snapshot saw audio being produced"
            assert any(snap["decode"]["mean_ms"] is not None and snap["slots"]["mean"] > 0 for snap in busy_moments)
            assert all(set(snap) >= {"waiting", "contexts", "busy", "decode"} for snap in history)

            # an open dashboard does not hold up shutdown: the stream ends when the server drains
            ended, streaming = threading.Event(), threading.Event()
            events_read = [0]

            def counted() -> None:
                events_read[0] += 1
                if events_read[0] >= 2:  # the hello and a sample
                    streaming.set()

            def watch() -> None:
                read_stream(server.http_url, until_end=True, on_event=counted)
                ended.set()

            threading.Thread(target=watch, daemon=True).start()
            assert streaming.wait(10)  # the stream is open and sampling (a loaded machine: not a fixed sleep)
            t0_s = time.monotonic()
            server.stop(timeout_s=10)
            assert ended.wait(5) and time.monotonic() - t0_s < 5
        finally:
            side.should_exit = True
            side_thread.join(10)
            access.propagate = propagated
    assert not side_thread.is_alive()
    assert m.hub.engine is None or not m.hub.engine.alive


def read_stream(url: str, until_end: bool = False,
                on_event: Callable[[], None] = lambda: None) -> tuple[dict[str, Any], dict[str, Any]]:
    """The hello and the first sample of /dashboard/stream (with until_end: read on until the server ends it);
    `on_event` is called after each event read."""
    events: list[tuple[str, dict[str, Any]]] = []
    with httpx.stream("GET", url + "/dashboard/stream", timeout=10) as response:
        assert response.headers["content-type"].startswith("text/event-stream")
        kind = ""
        for line in response.iter_lines():
            if line.startswith("event: "):
                kind = line[len("event: ") :]
            elif line.startswith("data: "):
                events.append((kind, orjson.loads(line[len("data: ") :])))
                on_event()
                if not until_end and len(events) == 2:
                    break
    assert events[0][0] == "hello" and events[1][0] == "sample"
    return events[0][1], events[1][1]


class _GraphsFakeEngine(StatsFakeEngine):
    """Reports its CUDA graphs as synth's engine does (synth/engine.py: status())."""

    def status(self) -> dict[str, object]:
        return {**super().status(), "cuda_graphs_state": "fallback",
                "cuda_graphs_reason": "capture failed: RuntimeError: operation not permitted when stream is capturing",
                "vocoder_graphs_state": "off", "vocoder_graphs_reason": "vocoder_graphs='off'"}


def test_the_engines_graph_states_and_their_reasons_are_a_metric(tmp_path: Path) -> None:
    """A start that fell back to eager says so in the metrics too (with the reason; all of it in /v1/status)."""
    app = create_app(_GraphsFakeEngine(), Settings(data_dir=tmp_path))
    app.state.hub.engine = app.state.hub._given_engine  # as once built
    samples = {(family.name, tuple(sorted(sample.labels.items()))): sample.value
               for family in text_string_to_metric_families(metrics.install(app).exposition().decode())
               for sample in family.samples}
    decode = ("tts_engine_graphs", (("part", "decode"), ("reason", "capture failed: RuntimeError: operation not "
                                    "permitted when stream is capturing"), ("state", "fallback")))
    vocoder = ("tts_engine_graphs", (("part", "vocoder"), ("reason", "vocoder_graphs='off'"), ("state", "off")))
    assert samples[decode] == 1.0 and samples[vocoder] == 1.0
    assert sum(1 for name, _ in samples if name == "tts_engine_graphs") == 2
