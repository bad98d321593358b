"""Jobs in the whole server (create_app over a real uvicorn, the fake engine on its own thread): a job renders through
the engine at job priority and through the phrase cache; a live segment takes a job segment's slot at once and the
job still ends with the audio of an uninterrupted run; the webhook arrives signed with the key's secret; a job is
its key's only; a store that cannot be opened leaves live speech serving; the drain hands a running job back."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import replace
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import numpy.typing as npt
import orjson
import pytest
from prometheus_client.parser import text_string_to_metric_families

from agent_server.core.events import build_params
from agent_server.jobs.assembly import encode_whole
from agent_server.jobs.model import JobSegment, JobStatus
from agent_server.jobs.render import job_params
from agent_server.jobs.request import job_format
from agent_server.jobs.segment_audio import decode_segment, encode_segment
from agent_server.jobs.segments import JOB_MAX_NEW_TOKENS, plan_segments
from agent_server.jobs.service import JobsConfig, JobService
from agent_server.jobs.sqlite_store import SqliteJobStore
from agent_server.jobs.webhooks import SIGNATURE_HEADER, verify_signature
from agent_server.settings import Settings
from synth.api import Priority, max_tokens_for_text

from tests.agent_server.fake_engine import FakeEngine
from tests.agent_server.jobs.conftest import make_job, run
from tests.agent_server.jobs.webhook_receiver import Receiver
from tests.agent_server.live_server import LiveServer, live_server
from tests.agent_server.native_client import NativeClient

pytestmark = pytest.mark.timeout(120)

TEXT = ("The first chapter begins here. It was a bright cold day in April, and the clocks were striking thirteen. "
        "Winston Smith slipped quickly through the glass doors of Victory Mansions. The hallway smelt of boiled "
        "cabbage and old rag mats. At one end of it a coloured poster, too large for indoor display, had been tacked "
        "to the wall.")
KEYS = ("key-a-0123456789", "key-b-0123456789")
SEED_MODULUS = 2**63


def settings_for(tmp_path: Path, **changes: Any) -> Settings:
    return Settings(data_dir=tmp_path, phrase_cache_mb=64.0, **changes)


@contextmanager
def serving(tmp_path: Path, engine: FakeEngine, *, config: JobsConfig | None = None,
            **settings: Any) -> Iterator[LiveServer]:
    with live_server(engine, settings_for(tmp_path, **settings),
                     jobs_config=config or JobsConfig(data_dir=tmp_path)) as server:
        yield server


def jobs_of(server: LiveServer) -> JobService:
    service: JobService = server.app.state.jobs
    return service


def expected_file(text: str, seed: int, fmt_name: str, tokens_per_char: float = 1.5) -> bytes:
    """The file of an uninterrupted job: each segment as the fake engine renders it, stored (Opus) and assembled."""
    pcm = [decode_segment(encode_segment(segment_pcm(seg.text, (seed + seg.index) % SEED_MODULUS, tokens_per_char)))
           for seg in plan_segments(text)]
    return encode_whole(pcm, job_format(fmt_name))


def segment_pcm(text: str, seed: int, tokens_per_char: float) -> npt.NDArray[np.float32]:
    return np.asarray(FakeEngine.expected_pcm(text, seed, tokens_per_char), dtype=np.float32)


def submit(server: LiveServer, body: dict[str, Any], key: str | None = None) -> str:
    response = httpx.post(server.http_url + "/v1/jobs", json=body, headers=auth(key), timeout=10)
    assert response.status_code == 202, response.text
    assert response.headers["location"] == f"/v1/jobs/{response.json()['id']}"
    job_id: str = response.json()["id"]
    return job_id


def auth(key: str | None) -> dict[str, str]:
    return {} if key is None else {"Authorization": f"Bearer {key}"}


def wait_status(server: LiveServer, job_id: str, wanted: str, key: str | None = None,
                timeout_s: float = 60.0) -> dict[str, Any]:
    deadline_s = time.monotonic() + timeout_s
    while True:
        body: dict[str, Any] = httpx.get(f"{server.http_url}/v1/jobs/{job_id}", headers=auth(key), timeout=5).json()
        if body["status"] == wanted:
            return body
        assert body["status"] in ("queued", "running"), body
        assert time.monotonic() < deadline_s, f"job still {body['status']}: {body}"
        time.sleep(0.02)


def audio_of(server: LiveServer, job_id: str, fmt_name: str, key: str | None = None) -> bytes:
    response = httpx.get(f"{server.http_url}/v1/jobs/{job_id}/audio", params={"output_format": fmt_name},
                         headers=auth(key), timeout=30)
    assert response.status_code == 200, response.text
    return response.content


def samples(server: LiveServer) -> dict[tuple[str, str], float]:
    """/metrics: (sample name, its one label's value or "") -> value."""
    text = httpx.get(server.http_url + "/metrics").text
    out = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            out[(sample.name, next(iter(sample.labels.values()), ""))] = sample.value
    return out


def job_requests(engine: FakeEngine) -> list[Any]:
    return [r for r in engine.submits if r.request_id.startswith("job/")]


def test_a_job_renders_at_job_priority_through_the_phrase_cache(tmp_path: Path) -> None:
    engine = FakeEngine(max_slots=4)
    with serving(tmp_path, engine) as server:
        job_id = submit(server, {"text": TEXT, "seed": 11, "output_format": "wav"})
        done = wait_status(server, job_id, "done")
        plan = plan_segments(TEXT)
        assert done["segments_done"] == done["segments_total"] == len(plan) >= 4
        requests = job_requests(engine)
        assert sorted(r.text for r in requests) == sorted(seg.text for seg in plan)
        by_text = {seg.text: seg for seg in plan}
        for request in requests:
            seg = by_text[request.text]
            assert request.priority == Priority.JOB and not request.first_audio_pending and request.may_wait
            assert request.params == job_params("english", make_job(0.0, seed=11), seg)  # seed + index
        assert audio_of(server, job_id, "wav") == expected_file(TEXT, 11, "wav")

        again = submit(server, {"text": TEXT, "seed": 11, "output_format": "mp3"})  # every segment a cache hit
        wait_status(server, again, "done")
        assert len(job_requests(engine)) == len(plan)  # the engine rendered nothing more
        assert jobs_of(server).render.stats.cache_hits == len(plan)
        assert audio_of(server, again, "mp3") == expected_file(TEXT, 11, "mp3")

        scraped = samples(server)
        audio_s = sum(FakeEngine.token_count(seg.text) for seg in plan) * 960 / 24_000 * 2
        assert scraped[("tts_jobs_submitted_total", "accepted")] == 2
        assert scraped[("tts_jobs_finished_total", "done")] == 2
        assert scraped[("tts_jobs_segments_total", "stored")] == 2 * len(plan)
        assert scraped[("tts_jobs_cache_hits_total", "")] == len(plan)
        assert abs(scraped[("tts_jobs_audio_seconds_total", "")] - audio_s) < 1e-6
        assert scraped[("tts_jobs_running", "")] == 0 and scraped[("tts_jobs_available", "")] == 1
        feed = server.app.state.metrics.feed  # the dashboard's
        feed.sample_if_due()
        assert set(feed.history[-1]["jobs"]) == {"queue", "running", "audio_per_s", "stored_audio_per_s", "preempted"}
        assert feed.history[-1]["live_audio_per_s"] >= 0


def test_a_job_segment_has_a_live_segments_parameters_so_they_share_cache_entries() -> None:
    """The phrase cache's key hashes the sampling parameters: a job segment's are the live rule's (seed + index,
    the engine's own generation bound, left unset), so a sentence a live context or the pre-warm list rendered is
    replayed for a job, and the other way round. Only a segment whose plan bound is tighter than the engine's (the
    600-token cap of a job segment) sets it."""
    job = make_job(1_796_000_000.0, seed=40)
    short = JobSegment(2, "A short sentence.", 0, 17, max_tokens_for_text("A short sentence."))
    assert job_params("english", job, short) == build_params("english", (), 42)
    assert job_params("english", job, short).max_new_tokens is None
    long_text = "word " * 200
    capped = JobSegment(3, long_text, 0, len(long_text), JOB_MAX_NEW_TOKENS)
    assert max_tokens_for_text(long_text) > JOB_MAX_NEW_TOKENS
    assert job_params("english", job, capped) == replace(build_params("english", (), 43),
                                                         max_new_tokens=JOB_MAX_NEW_TOKENS)


def test_the_replica_that_finishes_a_job_makes_its_file_before_anyone_asks(tmp_path: Path) -> None:
    """Clients poll for `done` and then ask for a range: the file of the job's own format is made when the job
    finishes (not on that first request, which locust measured at ~4 s on a loaded server), and the request is
    served from it, byte for byte the uninterrupted run's; another format is still made on request."""
    engine = FakeEngine(max_slots=4)
    with serving(tmp_path, engine) as server:
        files = jobs_of(server).files
        job_id = submit(server, {"text": TEXT, "seed": 5, "output_format": "mp3"})
        wait_status(server, job_id, "done")
        made = files.directory / f"{job_id}.mp3"
        deadline_s = time.monotonic() + 30
        while files.prepared < 1:  # (counted once the build is done and the cache trimmed: after the file appears)
            assert time.monotonic() < deadline_s, "the finished job's file was not made"
            time.sleep(0.02)
        assert files.prepared == 1 and made.exists()
        built = made.stat().st_ino  # a build writes a new file and renames it over the old
        expected = expected_file(TEXT, 5, "mp3")
        response = httpx.get(f"{server.http_url}/v1/jobs/{job_id}/audio", headers={"Range": "bytes=100-"},
                             timeout=30)
        assert response.status_code == 206 and response.content == expected[100:]
        assert made.stat().st_ino == built and files.prepared == 1  # served from it, not made again
        assert audio_of(server, job_id, "wav") == expected_file(TEXT, 5, "wav")  # made on request
        assert not (files.directory / f"{job_id}.flac").exists()


def test_a_jobs_language_picks_the_model_as_the_native_protocol_does(tmp_path: Path) -> None:
    """A server with Turbo (the default) and Multilingual: a job in French is spoken by Multilingual (its segments
    ask for it, in French), a job without a language by Turbo; a language neither speaks is refused at submit with
    the router's code, naming the field."""
    engine = FakeEngine(max_slots=4, loaded=("turbo", "multilingual"))
    with serving(tmp_path, engine) as server:
        french = submit(server, {"text": "Bonjour. Comment allez-vous aujourd'hui?", "seed": 3, "language": "fr"})
        plain = submit(server, {"text": "Good morning. How are you today?", "seed": 4})
        wait_status(server, french, "done")
        wait_status(server, plain, "done")
        by_job = {job_id: [r for r in job_requests(engine) if r.request_id.startswith(f"job/{job_id}/")]
                  for job_id in (french, plain)}
        assert by_job[french] and {(r.model, r.language) for r in by_job[french]} == {("multilingual", "fr")}
        assert by_job[plain] and {(r.model, r.language) for r in by_job[plain]} == {("turbo", None)}
        refused = httpx.post(server.http_url + "/v1/jobs", json={"text": "Sawubona.", "language": "zu"}, timeout=10)
        assert refused.status_code == 422, refused.text
        error = refused.json()
        assert "language" in str(error) and "language_not_served" in str(error), error


def test_a_live_segment_takes_a_job_segments_slot_and_the_job_still_sounds_uninterrupted(tmp_path: Path) -> None:
    """Two slots, both rendering job segments (long: 0.4 s of wall time per second of audio) that have emitted their
    first chunk; a live context opens:
    its segment is admitted at the next step, in a job segment's slot, that segment starts over later, and the job's
    file is still the one an uninterrupted run makes (what the preempted segment had emitted is dropped)."""
    engine = FakeEngine(max_slots=2, realtime_factor=0.4)
    with serving(tmp_path, engine) as server:
        job_id = submit(server, {"text": TEXT, "seed": 5, "output_format": "pcm"})
        deadline_s = time.monotonic() + 10
        while True:  # both slots hold job segments that have emitted audio (a preempted one must drop it)
            progress = engine.running_progress()
            if len(progress) == 2 and all(r.startswith("job/") and n > 0 for r, n in progress.items()):
                break
            assert time.monotonic() < deadline_s
            time.sleep(0.005)

        async def live() -> float:
            client = await NativeClient.connect(server.ws_url)
            try:
                log = await client.open("c1", text="Hello there.")
                await client.end("c1")
                await asyncio.wait_for(log.finished.wait(), 30)
                assert log.done is not None and log.done["reason"] == "completed", log.done
                assert log.first_text_sent_s is not None and log.first_frame_recv_s is not None
                return log.first_frame_recv_s - log.first_text_sent_s
            finally:
                await client.close()

        first_audio_s = run(live())
        live_ids = [r for r in engine.admitted if not r.startswith("job/")]
        assert len(live_ids) == 1 and len(engine.preempted) == 1, (engine.admitted, engine.preempted)
        # a job segment here lasts >= 1 s of wall time (>= 60 tokens); the live one's first chunk 12 tokens
        assert first_audio_s < 0.5, first_audio_s
        wait_status(server, job_id, "done")
        after_live = engine.admitted[engine.admitted.index(live_ids[0]) + 1:]
        assert engine.preempted[0] in after_live  # the preempted job segment came back after the live one
        assert jobs_of(server).render.stats.preempted == 1
        assert audio_of(server, job_id, "pcm") == expected_file(TEXT, 5, "pcm")
        # the phrase cache stored the preempted segment as it sounds whole, not with its first try in front
        again = submit(server, {"text": TEXT, "seed": 5, "output_format": "pcm"})
        wait_status(server, again, "done")
        assert jobs_of(server).render.stats.cache_hits == len(plan_segments(TEXT))
        assert audio_of(server, again, "pcm") == expected_file(TEXT, 5, "pcm")


def test_the_webhook_arrives_signed_with_the_keys_secret(tmp_path: Path) -> None:
    receiver = Receiver([(200, {})])

    async def scenario() -> None:
        await receiver.start()
        config = JobsConfig(data_dir=tmp_path, webhook_allow=("127.0.0.0/8",), webhook_secret="fleet-root-secret")
        try:
            with serving(tmp_path, FakeEngine(), config=config, api_keys=KEYS) as server:
                body = {"text": "One short job. It says two things.", "webhook_url": receiver.url + "/hook"}
                job_id = await asyncio.to_thread(submit, server, body, KEYS[0])
                done = await asyncio.to_thread(wait_status, server, job_id, "done", KEYS[0])
                deadline_s = time.monotonic() + 10
                while jobs_of(server).runner.stats.webhooks_delivered < 1:
                    assert time.monotonic() < deadline_s
                    await asyncio.sleep(0.01)
                scraped = await asyncio.to_thread(samples, server)
                assert scraped[("tts_jobs_webhooks_total", "delivered")] == 1
                assert scraped[("tts_jobs_webhook_attempts_total", "")] == 1
                assert scraped[("tts_jobs_webhooks_pending", "")] == 0
                secrets = {}
                for key in KEYS:
                    response = await asyncio.to_thread(httpx.get, server.http_url + "/v1/jobs/webhook-secret",
                                                       headers=auth(key))
                    assert response.status_code == 200
                    secrets[key] = response.json()["secret"]
                unauthenticated = await asyncio.to_thread(httpx.get, server.http_url + "/v1/jobs/webhook-secret")
                assert unauthenticated.status_code == 401
        finally:
            await receiver.stop()
        (hook,) = receiver.received
        assert hook.path == "/hook" and hook.headers["x-agent-server-event"] == "job.done"
        assert hook.body and orjson.loads(hook.body) == done
        signature = hook.headers.get(SIGNATURE_HEADER.lower())
        assert verify_signature(secrets[KEYS[0]], hook.body, signature, time.time())
        assert secrets[KEYS[0]] != secrets[KEYS[1]]
        assert not verify_signature(secrets[KEYS[1]], hook.body, signature, time.time())  # another key's secret

    run(scenario(), timeout_s=90)


def test_a_replica_without_webhook_allow_leaves_the_outbox_alone(tmp_path: Path) -> None:
    """A process with --webhook-allow stops mid-delivery (the webhook goes back to the outbox, due); the next
    process on the same data has no --webhook-allow (in a fleet: a replica configured apart, or mid-deploy). It
    takes nothing from the outbox: it would refuse the webhook and drop it. One with the allow-list delivers it."""
    hold = asyncio.Event()
    receiver = Receiver([(200, {})], hold=hold)
    allowed = JobsConfig(data_dir=tmp_path, webhook_allow=("127.0.0.0/8",), webhook_secret="fleet-root-secret")

    async def pending() -> int:
        store = SqliteJobStore(tmp_path / "jobs")
        await store.start()
        try:
            return await store.webhooks_pending()
        finally:
            await store.stop()

    async def scenario() -> None:
        await receiver.start()
        try:
            with serving(tmp_path, FakeEngine(), config=allowed) as server:
                body = {"text": "One short job.", "webhook_url": receiver.url + "/hook"}
                await asyncio.to_thread(submit, server, body)
                while not receiver.received:
                    await asyncio.sleep(0.01)
            assert await pending() == 1  # the stop gave the attempt back
            with serving(tmp_path, FakeEngine(), config=JobsConfig(data_dir=tmp_path)):
                await asyncio.sleep(3.0)  # three of the runner's polls
            assert await pending() == 1 and len(receiver.received) == 1
            hold.set()
            with serving(tmp_path, FakeEngine(), config=allowed) as server:
                while jobs_of(server).runner.stats.webhooks_delivered < 1:
                    await asyncio.sleep(0.01)
            assert await pending() == 0 and len(receiver.received) == 2
        finally:
            hold.set()
            await receiver.stop()

    run(scenario(), timeout_s=90)


def test_a_job_is_its_keys_only(tmp_path: Path) -> None:
    with serving(tmp_path, FakeEngine(), api_keys=KEYS) as server:
        job_id = submit(server, {"text": "Hello from key a."}, KEYS[0])
        wait_status(server, job_id, "done", KEYS[0])
        for path in (f"/v1/jobs/{job_id}", f"/v1/jobs/{job_id}/audio"):
            other = httpx.get(server.http_url + path, headers=auth(KEYS[1]))
            assert other.status_code == 404 and other.json()["error"]["code"] == "job_not_found"
            assert httpx.get(server.http_url + path).status_code == 401
        assert httpx.delete(f"{server.http_url}/v1/jobs/{job_id}", headers=auth(KEYS[1])).status_code == 404
        listed = httpx.get(server.http_url + "/v1/jobs", headers=auth(KEYS[1])).json()
        assert listed == {"jobs": [], "next": None}
        mine = httpx.get(server.http_url + "/v1/jobs", headers=auth(KEYS[0])).json()
        assert [job["id"] for job in mine["jobs"]] == [job_id]


def test_a_job_store_that_cannot_open_leaves_live_speech_serving(tmp_path: Path) -> None:
    async def hold_the_directory() -> SqliteJobStore:
        store = SqliteJobStore(tmp_path / "jobs")  # another process's, as far as the server can tell
        await store.start()
        return store

    loop = asyncio.new_event_loop()
    holder = loop.run_until_complete(hold_the_directory())
    try:
        with serving(tmp_path, FakeEngine()) as server:
            refused = httpx.post(server.http_url + "/v1/jobs", json={"text": "Hello."})
            assert refused.status_code == 503 and refused.json()["error"]["code"] == "unavailable"
            assert "DirectoryInUse" in refused.json()["error"]["message"]
            status = httpx.get(server.http_url + "/v1/status").json()["jobs"]
            assert status["available"] is False

            async def live() -> str:
                client = await NativeClient.connect(server.ws_url)
                try:
                    log = await client.open("c1", text="Still speaking.")
                    await client.end("c1")
                    await asyncio.wait_for(log.finished.wait(), 30)
                    return str(log.done["reason"] if log.done else None)
                finally:
                    await client.close()

            assert run(live()) == "completed"
    finally:
        loop.run_until_complete(holder.stop())
        loop.close()


def test_the_drain_hands_a_running_job_back(tmp_path: Path) -> None:
    engine = FakeEngine(max_slots=2, realtime_factor=0.5)
    with serving(tmp_path, engine) as server:
        job_id = submit(server, {"text": TEXT, "seed": 3})
        deadline_s = time.monotonic() + 10
        while not job_requests(engine):
            assert time.monotonic() < deadline_s
            time.sleep(0.005)
    # the server stopped (its drain ran the jobs' hook): the job is queued again, the claim not counted

    async def read() -> Any:
        store = SqliteJobStore(tmp_path / "jobs")
        await store.start()
        try:
            return await store.get(job_id)
        finally:
            await store.stop()

    job = run(read())
    assert job is not None and job.status == JobStatus.QUEUED and job.claims == 0
    cancelled = {r.request_id for r in job_requests(engine)} & set(engine.cancels)
    assert cancelled  # its segments in the engine were cancelled: their rows freed
