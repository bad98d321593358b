"""agent_server.jobs.api over real HTTP (uvicorn on 127.0.0.1, the embedded store, a runner with a fake engine, all
on one event loop): bad requests answered 400/422 naming the field in the native error shape, quotas as 429 with
Retry-After, the growing stream while a job runs, the finished file with Content-Length and Range (edges, 416,
If-Range, HEAD), cancel, another key's job and an expired one."""

from __future__ import annotations

import asyncio
import json
import socket
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import numpy.typing as npt
import orjson
import pytest
import uvicorn
from starlette.applications import Starlette

from agent_server.jobs.api import BODY_BYTES_PER_CHAR, BODY_SLACK_BYTES, JobsApi
from agent_server.jobs.assembly import AudioFiles, encode_whole
from agent_server.jobs.model import Job, JobSegment, JobStatus
from agent_server.jobs.request import job_format, one_model
from agent_server.jobs.runner import JobRunner
from agent_server.jobs.segment_audio import decode_segment, encode_segment
from agent_server.jobs.segments import plan_segments
from agent_server.jobs.sqlite_store import SqliteJobStore
from agent_server.jobs.store import RECORD_GRACE_S, KeyLimits
from agent_server.jobs.webhooks import AllowList

from tests.agent_server.jobs.conftest import run

pytestmark = pytest.mark.timeout(90)

TEXT = ("The first chapter begins here. It was a bright cold day in April, and the clocks were striking thirteen. "
        "Winston Smith slipped quickly through the glass doors of Victory Mansions. The hallway smelt of boiled "
        "cabbage and old rag mats.")
TTL_S = 3600.0
KEY_HEADER = "x-test-key"
NO_LIMITS = KeyLimits()
NO_WEBHOOKS = AllowList()


def engine_audio(job: Job, segment: JobSegment) -> npt.NDArray[np.float32]:
    rng = np.random.default_rng(job.seed + segment.index)
    samples = 1_200 + 60 * len(segment.text)
    return np.asarray(0.1 * rng.standard_normal(samples), dtype=np.float32)


@dataclass
class Served:
    url: str
    store: SqliteJobStore
    runner: JobRunner
    clock: list[float]  # [now]: the API's and the runner's clock, turned by hand
    allowed: list[int]  # [n]: segments with an index below n may render (the others wait)

    def allow(self, segments: int = 1 << 30) -> None:
        self.allowed[0] = segments


@asynccontextmanager
async def serving(tmp_path: Path, *, limits: KeyLimits = NO_LIMITS, max_job_chars: int = 2_000,
                  allow: AllowList = NO_WEBHOOKS) -> AsyncIterator[Served]:
    store = SqliteJobStore(tmp_path / "jobs", job_ttl_s=TTL_S)
    await store.start()
    clock = [1_796_000_000.0]
    allowed = [1 << 30]

    async def render(job: Job, segment: JobSegment) -> npt.NDArray[np.float32]:
        while segment.index >= allowed[0]:
            await asyncio.sleep(0.005)
        return engine_audio(job, segment)

    runner = JobRunner(store, render, poll_s=0.02, clock=lambda: clock[0])
    api = JobsApi(store, AudioFiles(tmp_path / "files"), route=one_model("english"),
                  key_of=lambda r: r.headers[KEY_HEADER], limits_for=lambda key_id: limits, webhook_allow=allow,
                  max_job_chars=max_job_chars,
                  clock=lambda: clock[0], on_submitted=lambda _job: runner.wake(), on_cancelled=runner.cancelled,
                  poll_s=0.01)
    app = Starlette(routes=api.routes())
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning", lifespan="off"))
    serve = asyncio.create_task(server.serve(sockets=[sock]))
    while not server.started:
        await asyncio.sleep(0.01)
    await runner.start()
    try:
        yield Served(f"http://127.0.0.1:{sock.getsockname()[1]}", store, runner, clock, allowed)
    finally:
        await runner.stop()
        server.should_exit = True
        await serve
        sock.close()
        await store.stop()


def scenario(tmp_path: Path, body: Callable[[Served, httpx.AsyncClient], Awaitable[None]], **options: Any) -> None:
    async def go() -> None:
        async with serving(tmp_path, **options) as served, httpx.AsyncClient(
                base_url=served.url, headers={KEY_HEADER: "k_alice"}, timeout=20.0) as client:
            await body(served, client)

    run(go(), timeout_s=60.0)


async def wait_done(client: httpx.AsyncClient, job_id: str) -> dict[str, Any]:
    for _ in range(1000):
        status: dict[str, Any] = (await client.get(f"/v1/jobs/{job_id}")).json()
        if status["status"] != "queued" and status["status"] != "running":
            return status
        await asyncio.sleep(0.01)
    raise AssertionError("the job did not finish")


def expected_file(job: Job, fmt_name: str) -> bytes:
    pcm = [decode_segment(encode_segment(engine_audio(job, seg))) for seg in plan_segments(TEXT)]
    return encode_whole(pcm, job_format(fmt_name))


def assert_error(response: httpx.Response, status: int, field: str, code: str | None = None) -> dict[str, Any]:
    assert response.status_code == status, response.text
    error: dict[str, Any] = response.json()["error"]
    assert error["field"] == field, error
    assert error["message"]
    if code is not None:
        assert error["code"] == code, error
    return error


# ---- POST /v1/jobs -------------------------------------------------------------------------------------


def test_bad_requests_name_the_field_in_the_native_error_shape(tmp_path: Path) -> None:
    async def body(served: Served, client: httpx.AsyncClient) -> None:
        def post(payload: object) -> Awaitable[httpx.Response]:
            return client.post("/v1/jobs", content=payload if isinstance(payload, bytes) else orjson.dumps(payload))

        assert_error(await post(b"{not json"), 400, "body")
        assert_error(await post([1, 2]), 400, "body")
        assert_error(await post({}), 422, "text", "empty_message")
        assert_error(await post({"text": 5}), 422, "text")
        assert_error(await post({"text": "x" * 2_001}), 422, "text", "text_too_long")
        assert_error(await post({"text": "...!"}), 422, "text", "nothing_to_say")
        assert_error(await post({"text": "Hi.", "output_format": "mp4"}), 422, "output_format")
        assert_error(await post({"text": "Hi.", "sampling": {"temperature": 0}}), 422, "sampling.temperature")
        assert_error(await post({"text": "Hi.", "sampling": {"warmth": 1}}), 422, "sampling.warmth")
        assert_error(await post({"text": "Hi.", "seed": -1}), 422, "seed")
        assert_error(await post({"text": "Hi.", "voice": ""}), 422, "voice")
        assert_error(await post({"text": "Hi.", "language": "fr"}), 422, "language")  # the english variant
        assert_error(await post({"text": "Hi.", "speed": 2}), 422, "speed")  # not a job field: not dropped either
        assert_error(await post({"text": "Hi.", "webhook_url": "ftp://x.example/"}), 422, "webhook_url")
        assert_error(await post({"text": "Hi.", "webhook_url": "http://127.0.0.1:9/"}), 422, "webhook_url",
                     "webhook_refused")  # --webhook-allow: none
        too_big = await client.post("/v1/jobs", content=b" " * (BODY_BYTES_PER_CHAR * 2_000 + BODY_SLACK_BYTES + 1))
        assert_error(too_big, 413, "body", "body_too_large")
        assert await served.store.list_jobs("k_alice", time.time()) == []

    scenario(tmp_path, body)


def test_a_text_at_the_limit_is_accepted_however_its_json_escapes_it(tmp_path: Path) -> None:
    """`max_job_chars` characters outside the BMP, each escaped as a surrogate pair (12 bytes: what json.dumps and
    so requests' json= send): accepted, not refused as a body too large."""
    chars = 20_000

    async def body(served: Served, client: httpx.AsyncClient) -> None:
        served.allow(0)
        words = "\U0001d407\U0001d41e\U0001d425\U0001d425\U0001d428. "  # "𝐇𝐞𝐥𝐥𝐨. " in mathematical bold
        text = (words * chars)[:chars - 1] + "."
        payload = json.dumps({"text": text}).encode()  # (ensure_ascii: 12 bytes a character)
        assert len(payload) > 4 * chars + BODY_SLACK_BYTES
        response = await client.post("/v1/jobs", content=payload)
        assert response.status_code == 202, response.text
        assert_error(await client.post("/v1/jobs", content=json.dumps({"text": text + "x"}).encode()), 422, "text",
                     "text_too_long")

    scenario(tmp_path, body, max_job_chars=chars)


def test_a_job_is_accepted_runs_and_is_listed(tmp_path: Path) -> None:
    async def body(served: Served, client: httpx.AsyncClient) -> None:
        served.allow(0)  # hold the renders: the job is seen queued or running first
        response = await client.post("/v1/jobs", json={"text": TEXT, "seed": 11, "output_format": "wav"})
        assert response.status_code == 202
        accepted = response.json()
        job_id = accepted["id"]
        assert accepted == {"id": job_id, "status": "queued", "status_url": f"/v1/jobs/{job_id}",
                            "audio_url": f"/v1/jobs/{job_id}/audio"}
        assert response.headers["location"] == f"/v1/jobs/{job_id}"
        status = (await client.get(f"/v1/jobs/{job_id}")).json()
        assert status["status"] in ("queued", "running")
        assert status["segments_total"] == len(plan_segments(TEXT))
        served.allow()
        done = await wait_done(client, job_id)
        assert done["status"] == "done"
        assert done["segments_done"] == done["segments_total"]
        assert done["finished_at"] is not None and done["error"] is None
        listed = (await client.get("/v1/jobs")).json()
        assert [j["id"] for j in listed["jobs"]] == [job_id]
        assert listed["next"] is None
        assert (await client.get("/v1/jobs", headers={KEY_HEADER: "k_bob"})).json()["jobs"] == []
        assert_error(await client.get("/v1/jobs?limit=0"), 422, "limit")
        assert_error(await client.get("/v1/jobs?limit=%C2%B2"), 422, "limit")  # "²": isdigit(), not int()
        assert_error(await client.get("/v1/jobs?before=nope"), 422, "before")

    scenario(tmp_path, body)


def test_the_listing_pages_newest_first_and_next_is_null_on_the_last_page(tmp_path: Path) -> None:
    async def body(served: Served, client: httpx.AsyncClient) -> None:
        served.allow(0)  # the jobs stay queued: only their records matter here
        ids = []
        for i in range(4):
            served.clock[0] += 1  # (ids are time-ordered)
            response = await client.post("/v1/jobs", json={"text": f"Job number {i}."})
            assert response.status_code == 202
            ids.append(response.json()["id"])
        newest_first = ids[::-1]
        pages: list[list[str]] = []
        url = "/v1/jobs?limit=2"
        while True:
            listed = (await client.get(url)).json()
            pages.append([j["id"] for j in listed["jobs"]])
            if listed["next"] is None:
                break
            url = f"/v1/jobs?limit=2&before={listed['next']}"
        assert pages == [newest_first[:2], newest_first[2:]]  # exactly two full pages: no empty third one
        listed = (await client.get("/v1/jobs?limit=3")).json()
        assert [j["id"] for j in listed["jobs"]] == newest_first[:3]
        assert listed["next"] == newest_first[2]
        listed = (await client.get(f"/v1/jobs?limit=3&before={newest_first[2]}")).json()
        assert ([j["id"] for j in listed["jobs"]], listed["next"]) == ([newest_first[3]], None)
        listed = (await client.get("/v1/jobs?limit=100")).json()
        assert ([j["id"] for j in listed["jobs"]], listed["next"]) == (newest_first, None)

    scenario(tmp_path, body)


def test_quotas_answer_429_with_retry_after(tmp_path: Path) -> None:
    async def body(served: Served, client: httpx.AsyncClient) -> None:
        served.allow(0)
        assert (await client.post("/v1/jobs", json={"text": "One short job."})).status_code == 202
        refused = await client.post("/v1/jobs", json={"text": "A second one."})
        assert_error(refused, 429, "", "quota_running_jobs")
        assert refused.headers["retry-after"] == "30"
        other_key = await client.post("/v1/jobs", json={"text": "A second one."}, headers={KEY_HEADER: "k_bob"})
        assert other_key.status_code == 202
        assert_error(await client.post("/v1/jobs", json={"text": "x" * 501}, headers={KEY_HEADER: "k_carol"}), 422,
                     "text", "quota_daily_chars")  # bigger than a whole day's quota: no retry will do
        served.allow()

    scenario(tmp_path, body, limits=KeyLimits(max_running_jobs=1, daily_chars=500))


# ---- the audio --------------------------------------------------------------------------------------------


def test_the_audio_grows_while_the_job_runs_and_is_the_finished_file(tmp_path: Path) -> None:
    async def body(served: Served, client: httpx.AsyncClient) -> None:
        served.allow(0)
        job_id = (await client.post("/v1/jobs", json={"text": TEXT, "seed": 3, "output_format": "mp3"})).json()["id"]
        head = await client.head(f"/v1/jobs/{job_id}/audio")  # answered at once, not when the job ends
        assert (head.status_code, head.content) == (200, b"")
        assert head.headers["x-job-status"] in ("queued", "running")
        received = bytearray()
        statuses_at_first_bytes: list[str] = []
        async with client.stream("GET", f"/v1/jobs/{job_id}/audio") as response:
            assert response.status_code == 200
            assert response.headers["content-type"] == "audio/mpeg"
            assert "content-length" not in response.headers
            served.allow(1)  # the first segment only, for now
            async for chunk in response.aiter_raw():
                if not received:
                    job = await served.store.get(job_id)
                    assert job is not None
                    statuses_at_first_bytes.append(job.status.wire)
                    served.allow()
                received += chunk
        assert statuses_at_first_bytes == ["running"]  # audio came before the job was done
        job = await served.store.get(job_id)
        assert job is not None and job.status == JobStatus.DONE
        final = await client.get(f"/v1/jobs/{job_id}/audio")
        assert final.status_code == 200
        assert final.headers["content-length"] == str(len(final.content))
        assert final.headers["accept-ranges"] == "bytes"
        assert bytes(received) == final.content == expected_file(job, "mp3")
        as_flac = await client.get(f"/v1/jobs/{job_id}/audio?output_format=flac")
        assert as_flac.headers["content-type"] == "audio/flac"
        assert as_flac.content == expected_file(job, "flac")
        assert_error(await client.get(f"/v1/jobs/{job_id}/audio?output_format=m4a"), 422, "output_format")

    scenario(tmp_path, body)


def test_ranges_of_the_finished_file_are_its_bytes(tmp_path: Path) -> None:
    async def body(served: Served, client: httpx.AsyncClient) -> None:
        job_id = (await client.post("/v1/jobs", json={"text": TEXT, "output_format": "wav"})).json()["id"]
        await wait_done(client, job_id)
        url = f"/v1/jobs/{job_id}/audio"
        whole = (await client.get(url)).content
        size = len(whole)
        etag = (await client.get(url)).headers["etag"]

        async def part(header: str, first: int, last: int) -> None:
            response = await client.get(url, headers={"Range": header})
            assert response.status_code == 206, (header, response.text)
            assert response.headers["content-range"] == f"bytes {first}-{last}/{size}"
            assert response.headers["content-length"] == str(last - first + 1)
            assert response.content == whole[first:last + 1]

        await part("bytes=0-0", 0, 0)
        await part("bytes=0-43", 0, 43)  # the WAV header
        await part("bytes=1-1", 1, 1)
        await part(f"bytes={size - 1}-{size - 1}", size - 1, size - 1)
        await part(f"bytes={size - 2}-", size - 2, size - 1)
        await part(f"bytes=100-{size + 50}", 100, size - 1)
        await part("bytes=-1", size - 1, size - 1)
        await part("bytes=-300", size - 300, size - 1)
        await part(f"bytes=-{size + 10}", 0, size - 1)
        await part(f"bytes=0-{size - 1}", 0, size - 1)
        pieces = [(await client.get(url, headers={"Range": f"bytes={a}-{a + 9_999}"})).content
                  for a in range(0, size, 10_000)]
        assert b"".join(pieces) == whole  # consecutive parts tile the file: no byte lost or repeated
        for header in (f"bytes={size}-", f"bytes={size + 5}-{size + 9}", "bytes=-0"):
            unsatisfiable = await client.get(url, headers={"Range": header})
            assert_error(unsatisfiable, 416, "range", "range_not_satisfiable")
            assert unsatisfiable.headers["content-range"] == f"bytes */{size}"
        for ignored in ("bytes=5-2", "bytes=0-1,4-5", "lines=1-2"):
            response = await client.get(url, headers={"Range": ignored})
            assert (response.status_code, response.content) == (200, whole)
        stale = await client.get(url, headers={"Range": "bytes=0-9", "If-Range": '"another-version"'})
        assert (stale.status_code, stale.content) == (200, whole)
        fresh = await client.get(url, headers={"Range": "bytes=0-9", "If-Range": etag})
        assert (fresh.status_code, fresh.content) == (206, whole[:10])
        head = await client.head(url, headers={"Range": "bytes=10-19"})
        assert (head.status_code, head.headers["content-length"], head.content) == (206, "10", b"")

    scenario(tmp_path, body)


# ---- cancel, ownership, expiry, a store that is down ---------------------------------------------------------


def test_a_cancel_stops_the_local_render_at_once(tmp_path: Path) -> None:
    async def body(served: Served, client: httpx.AsyncClient) -> None:
        assert served.runner.renew_s >= 10.0  # a renewal would take long to notice: the API tells the runner
        served.allow(1)
        job_id = (await client.post("/v1/jobs", json={"text": TEXT})).json()["id"]
        for _ in range(500):
            if (await client.get(f"/v1/jobs/{job_id}")).json()["segments_done"] == 1:
                break
            await asyncio.sleep(0.01)
        assert served.runner.running == [job_id]  # rendering (waiting in the engine for) segment 1
        assert (await client.delete(f"/v1/jobs/{job_id}")).json()["status"] == "cancelled"
        for _ in range(100):
            if not served.runner.running:
                break
            await asyncio.sleep(0.01)
        assert served.runner.running == []
        assert served.runner.stats.jobs_stopped == 1
        assert await served.store.stored_segments(job_id) == {0}

    scenario(tmp_path, body)


def test_cancel_ownership_and_expiry(tmp_path: Path) -> None:
    async def body(served: Served, client: httpx.AsyncClient) -> None:
        served.allow(0)
        job_id = (await client.post("/v1/jobs", json={"text": TEXT})).json()["id"]
        assert_error(await client.get(f"/v1/jobs/{job_id}", headers={KEY_HEADER: "k_bob"}), 404, "id",
                     "job_not_found")
        assert_error(await client.delete(f"/v1/jobs/{job_id}", headers={KEY_HEADER: "k_bob"}), 404, "id")
        cancelled = await client.delete(f"/v1/jobs/{job_id}")
        assert cancelled.status_code == 200
        assert cancelled.json()["status"] == "cancelled"
        assert (await client.delete(f"/v1/jobs/{job_id}")).json()["status"] == "cancelled"  # idempotent
        served.allow()
        assert_error(await client.get(f"/v1/jobs/{job_id}/audio"), 409, "id", "job_not_ready")
        served.clock[0] += TTL_S + 1  # its results expired
        error = assert_error(await client.get(f"/v1/jobs/{job_id}"), 404, "id", "job_expired")
        assert "expired at" in error["message"]
        assert_error(await client.get(f"/v1/jobs/{job_id}/audio"), 404, "id", "job_expired")
        await served.store.sweep(served.clock[0] + RECORD_GRACE_S)  # and later its record is gone too
        assert_error(await client.get(f"/v1/jobs/{job_id}"), 404, "id", "job_not_found")
        assert_error(await client.get("/v1/jobs/job_000000000000ffffffffff"), 404, "id", "job_not_found")
        assert_error(await client.get("/v1/jobs/not-an-id"), 404, "id", "job_not_found")

    scenario(tmp_path, body)


def test_a_store_that_cannot_be_reached_is_a_503(tmp_path: Path) -> None:
    async def body(served: Served, client: httpx.AsyncClient) -> None:
        async def down(job_id: str) -> Job | None:
            raise ConnectionRefusedError("redis is down")

        served.store.get = down  # type: ignore[method-assign]
        response = await client.get("/v1/jobs/job_000000000000ffffffffff")
        assert_error(response, 503, "", "unavailable")
        assert response.headers["retry-after"] == "1"

    scenario(tmp_path, body)



def test_every_status_the_jobs_api_answers_is_a_row_of_the_outcome_table() -> None:
    """The statuses come from core/outcomes.py (docs/operations.md shows the table); a field at fault is the one 422."""
    from agent_server.core.outcomes import ANSWERS, Outcome
    from agent_server.jobs import api, model, request

    answered = {request.STATUS_BAD_REQUEST: Outcome.BAD_INPUT, model.STATUS_NOT_FOUND: Outcome.NOT_FOUND,
                api.STATUS_CONFLICT: Outcome.NO_RESULT, api.STATUS_TOO_LARGE: Outcome.TOO_LARGE,
                api.STATUS_RANGE: Outcome.OUT_OF_RANGE, api.STATUS_QUOTA: Outcome.OVER_LIMIT,
                api.STATUS_UNAVAILABLE: Outcome.NOT_READY, model.STATUS_UNPROCESSABLE: Outcome.BAD_INPUT}
    assert sorted(answered) == [400, 404, 409, 413, 416, 422, 429, 503]
    for status, outcome in answered.items():
        assert model.JobError(status, "", "why", "code").outcome is outcome
        assert status == model.STATUS_UNPROCESSABLE or ANSWERS[outcome].http_status == status
