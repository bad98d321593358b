"""Jobs on a fleet (issue 36): three replicas of the real server (tiny random Turbo engine) with a real redis-server
behind a real HAProxy (tests/deploy/cluster.py). A seeded job is submitted through the balancer; the replica
rendering it is killed with SIGKILL mid-job; another replica takes its claim over after the visibility timeout,
resumes from the first segment not stored, and the audio is byte for byte that of the same job run without a kill.

The phrase cache is off here: with it on, the second run would replay the first run's segments and the comparison
would prove nothing.
"""

from __future__ import annotations

import re
import signal
import time
from collections.abc import Iterator
from typing import Any

import httpx
import orjson
import pytest

from tests.deploy.cluster import Cluster, Replica, cluster

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]

KEY = "jobs-fleet-key-0123456789"
VISIBILITY_S = 2.0
SEED = 4242
# 14 sentences: about as many segments (the segmenter cuts at sentence ends past 40 characters)
TEXT = " ".join(f"Sentence number {n} of the long job is read back here, one after another." for n in range(1, 15))
JOB_TIMEOUT_S = 300.0
TAKE_OVER_TIMEOUT_S = 120.0  # after the kill: VISIBILITY_S, then the rest of the job on a loaded machine


@pytest.fixture(scope="module")
def fleet(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    env = {
        "AGENT_SERVER_API_KEYS": KEY,
        "AGENT_SERVER_MAX_SLOTS": "2",  # two segments of the job in flight: the kill lands mid-job
        "AGENT_SERVER_JOB_VISIBILITY_S": str(VISIBILITY_S),
        "AGENT_SERVER_PHRASE_CACHE_MB": "0",
    }
    with cluster(tmp_path_factory.mktemp("jobs-fleet"), env=env) as fleet:
        yield fleet


def auth() -> dict[str, str]:
    return {"Authorization": f"Bearer {KEY}"}


def submit(base: str) -> str:
    answer = httpx.post(f"{base}/v1/jobs", json={"text": TEXT, "seed": SEED, "output_format": "wav"}, headers=auth(),
                        timeout=30)
    assert answer.status_code == 202, answer.text
    return str(answer.json()["id"])


def status(replica: Replica, job_id: str) -> dict[str, Any]:
    answer = httpx.get(f"{replica.http_url}/v1/jobs/{job_id}", headers=auth(), timeout=10)
    assert answer.status_code == 200, answer.text
    result: dict[str, Any] = answer.json()
    return result


def wait_status(replica: Replica, job_id: str, predicate: Any, timeout_s: float = JOB_TIMEOUT_S) -> dict[str, Any]:
    deadline_s = time.monotonic() + timeout_s
    while not predicate(seen := status(replica, job_id)):
        assert seen["status"] not in ("failed", "cancelled"), seen
        assert time.monotonic() < deadline_s, f"timed out: {seen}"
        time.sleep(0.05)
    return seen


def events(replica: Replica, event: str, job_id: str) -> list[dict[str, Any]]:
    found = []
    for line in replica.log().splitlines():
        try:
            item = orjson.loads(line)
        except orjson.JSONDecodeError:
            continue
        if isinstance(item, dict) and item.get("event") == event and item.get("job_id") == job_id:
            found.append(item)
    return found


def audio(replica: Replica, job_id: str) -> bytes:
    answer = httpx.get(f"{replica.http_url}/v1/jobs/{job_id}/audio", params={"output_format": "wav"}, headers=auth(),
                       timeout=60)
    assert answer.status_code == 200, answer.text
    assert int(answer.headers["content-length"]) == len(answer.content)
    return answer.content


def segments_stored(replica: Replica) -> dict[str, int]:
    """tts_jobs_segments_total by result, from the replica's /metrics."""
    text = httpx.get(f"{replica.http_url}/metrics", timeout=10).text
    found = dict.fromkeys(("stored", "already_stored"), 0)
    for result in found:
        match = re.search(rf'^tts_jobs_segments_total{{result="{result}"}} (\S+)$', text, re.M)
        found[result] = int(float(match.group(1))) if match else 0
    return found


def wav_seconds(wav: bytes) -> float:
    data_at = wav.index(b"data") + 8  # (a streaming header: the sizes say 0xFFFFFFFF, the bytes say the length)
    return (len(wav) - data_at) / 2 / 24000


def test_a_job_survives_kill_9_of_its_replica(fleet: Cluster) -> None:
    job_id = submit(fleet.balancer.http_url)
    watcher = fleet.replicas[0]
    first = wait_status(watcher, job_id, lambda s: s["segments_done"] >= 2)
    total = first["segments_total"]
    assert total >= 10, first
    holders = [r for r in fleet.replicas if events(r, "job_claimed", job_id)]
    assert len(holders) == 1, [r.name for r in holders]
    victim = holders[0]
    victim.proc.send_signal(signal.SIGKILL)
    assert victim.proc.wait(10) == -signal.SIGKILL
    survivors = [r for r in fleet.replicas if r is not victim]
    at_kill = status(survivors[0], job_id)  # (the dead stores nothing more)
    assert at_kill["status"] == "running" and 2 <= at_kill["segments_done"] < total, at_kill

    done = wait_status(survivors[0], job_id, lambda s: s["status"] == "done", timeout_s=TAKE_OVER_TIMEOUT_S)
    resumed = [(r, e) for r in survivors for e in events(r, "job_resumed", job_id)]
    assert len(resumed) == 1, resumed  # one survivor took it over, once
    taker, line = resumed[0]
    assert line["stored"] == at_kill["segments_done"] and line["total"] == total
    assert line["first_missing"] <= at_kill["segments_done"]  # (a window of two may store segment k+1 before k)
    assert done["segments_done"] == done["segments_total"] == total
    # the taker rendered exactly the segments missing at the kill, each stored once
    assert segments_stored(taker) == {"stored": total - at_kill["segments_done"], "already_stored": 0}

    # the same job, uninterrupted, on the same fleet
    again = submit(fleet.balancer.http_url)
    wait_status(taker, again, lambda s: s["status"] == "done")
    killed_wav, clean_wav = audio(taker, job_id), audio(survivors[0], again)
    assert killed_wav == clean_wav  # no gap, no repeat: byte for byte
    assert abs(done["audio_seconds"] - wav_seconds(killed_wav)) <= 0.002  # nothing counted twice
    assert status(taker, again)["audio_seconds"] == done["audio_seconds"]
