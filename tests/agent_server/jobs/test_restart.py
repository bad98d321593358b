"""The embedded store through a restart (issue 36): the real server (`python -m agent_server.cli`, tiny random Turbo
engine, no Redis: SQLite under --data-dir) is killed with SIGKILL mid-job and started again on the same data
directory; the new process resumes the job from the segments stored, renders only the missing ones, and the audio
is byte for byte that of the same seeded job run without a restart. (The phrase cache is off: the second run must
not replay the first's segments.)
"""

from __future__ import annotations

import re
import signal
import time
from pathlib import Path
from typing import Any

import httpx
import orjson
import pytest

from tests.deploy.cluster import Replica, start_replica, wait_ready

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]

KEY = "jobs-restart-key-0123456789"
SEED = 777
TEXT = " ".join(f"Line {n} of a long announcement is spoken here, then the next one follows." for n in range(1, 13))
ENV = {
    "AGENT_SERVER_VARIANT": "turbo",
    "AGENT_SERVER_WEIGHTS": "random-tiny",
    "AGENT_SERVER_DEVICE": "cpu",
    "AGENT_SERVER_API_KEYS": KEY,
    "AGENT_SERVER_MAX_SLOTS": "2",
    "AGENT_SERVER_PHRASE_CACHE_MB": "0",
}
TIMEOUT_S = 300.0
TAKE_OVER_S = 20.0  # well under --job-visibility-s (60 s): a restart takes over at once, not when leases run out


def auth() -> dict[str, str]:
    return {"Authorization": f"Bearer {KEY}"}


def submit(server: Replica) -> str:
    answer = httpx.post(f"{server.http_url}/v1/jobs", json={"text": TEXT, "seed": SEED, "output_format": "wav"},
                        headers=auth(), timeout=30)
    assert answer.status_code == 202, answer.text
    return str(answer.json()["id"])


def wait_status(server: Replica, job_id: str, predicate: Any) -> dict[str, Any]:
    deadline_s = time.monotonic() + TIMEOUT_S
    while True:
        answer = httpx.get(f"{server.http_url}/v1/jobs/{job_id}", headers=auth(), timeout=10)
        assert answer.status_code == 200, answer.text
        seen: dict[str, Any] = answer.json()
        if predicate(seen):
            return seen
        assert seen["status"] not in ("failed", "cancelled"), seen
        assert time.monotonic() < deadline_s, f"timed out: {seen}"
        time.sleep(0.05)


def lines_of(server: Replica, event: str, job_id: str) -> list[dict[str, Any]]:
    found = []
    for line in server.log().splitlines():
        try:
            item = orjson.loads(line)
        except orjson.JSONDecodeError:
            continue
        if isinstance(item, dict) and item.get("event") == event and item.get("job_id") == job_id:
            found.append(item)
    return found


def segments_stored(server: Replica) -> dict[str, int]:
    text = httpx.get(f"{server.http_url}/metrics", timeout=10).text
    found = dict.fromkeys(("stored", "already_stored"), 0)
    for result in found:
        match = re.search(rf'^tts_jobs_segments_total{{result="{result}"}} (\S+)$', text, re.M)
        found[result] = int(float(match.group(1))) if match else 0
    return found


def audio(server: Replica, job_id: str) -> bytes:
    answer = httpx.get(f"{server.http_url}/v1/jobs/{job_id}/audio", headers=auth(), timeout=60)
    assert answer.status_code == 200, answer.text
    return answer.content


def test_a_job_survives_kill_9_and_a_restart_of_the_embedded_server(tmp_path: Path) -> None:
    data = tmp_path / "data"
    first = start_replica("first", data, ENV)
    try:
        wait_ready([first])
        job_id = submit(first)
        seen = wait_status(first, job_id, lambda s: s["segments_done"] >= 2)
        total = seen["segments_total"]
        assert total >= 8 and seen["segments_done"] < total, seen
        first.proc.send_signal(signal.SIGKILL)
        assert first.proc.wait(10) == -signal.SIGKILL
    finally:
        if first.proc.poll() is None:
            first.proc.kill()
    (data / "server.log").rename(data / "first.log")

    second = start_replica("second", data, ENV)
    try:
        wait_ready([second])
        # at once: the one process on this directory takes over what the dead one was running (no visibility wait)
        deadline_s = time.monotonic() + TAKE_OVER_S
        while not lines_of(second, "job_claimed", job_id):
            assert time.monotonic() < deadline_s, "the job was not taken over at start"
            time.sleep(0.05)
        done = wait_status(second, job_id, lambda s: s["status"] == "done")
        assert done["segments_done"] == total
        lines = lines_of(second, "job_resumed", job_id)
        assert len(lines) == 1, lines
        stored = lines[0]["stored"]
        assert seen["segments_done"] <= stored < total and lines[0]["total"] == total
        assert segments_stored(second) == {"stored": total - stored, "already_stored": 0}  # only what was missing

        again = submit(second)  # the same job, uninterrupted
        clean = wait_status(second, again, lambda s: s["status"] == "done")
        assert audio(second, job_id) == audio(second, again)  # no gap, no repeat
        assert clean["audio_seconds"] == done["audio_seconds"]
    finally:
        second.proc.send_signal(signal.SIGINT)
        try:
            second.proc.wait(15)
        except Exception:
            second.proc.kill()
