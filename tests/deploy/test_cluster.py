"""Three replicas of the real server (tiny random Turbo engine) behind a real HAProxy (deploy/haproxy/haproxy.cfg)
with a real redis-server, on loopback (tests/deploy/cluster.py). In file order, on one fleet:

sessions placed by free capacity; a voice uploaded on one replica spoken by the others; a per-key limit of 2
across replicas; a phrase-cache hit from another replica (bit-identical, first audio <= 30 ms) and misses for a
changed parameter or voice version; Redis stopped mid-run and restarted; SIGTERM drains one replica; kill -9 of
another mid-speech.
"""

from __future__ import annotations

import asyncio
import signal
import socket
import time
from collections.abc import Callable, Iterator
from typing import Any

import httpx
import numpy as np
import orjson
import pytest

from agent_server.core.voices import encode_wav_pcm16
from agent_server.protocols.native_wire import FrameHeader

from tests.agent_server.native_client import ContextLog, NativeClient
from tests.deploy.cluster import Cluster, Replica, cluster

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]

KEYS = [f"cluster-key-{i:02d}" for i in range(20)]
PROBE_KEYS = KEYS[17:20]  # one per replica: instances() never meets the per-key limit
LEASE_TTL_S = 3.0  # stated: a dead replica's sessions stop counting against key limits within this
SYNC_SLACK_S = 1.5  # + a refresh period of the survivors and scheduling on two loaded cores
MAX_SESSIONS = 6
HIT_TTFA_LIMIT_S = 0.030
LONG_TEXT = "This is a long answer that keeps the replica speaking for a while, sentence after sentence. " * 2


@pytest.fixture(scope="module")
def fleet(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    env = {
        "AGENT_SERVER_API_KEYS": ",".join(KEYS),
        "AGENT_SERVER_MAX_SESSIONS_PER_KEY": "2",
        "AGENT_SERVER_MAX_SESSIONS": str(MAX_SESSIONS),
        "AGENT_SERVER_MAX_SLOTS": "4",
        "AGENT_SERVER_SHARED_LEASE_TTL_S": str(LEASE_TTL_S),
        "AGENT_SERVER_SHUTDOWN_GRACE_S": "60",
    }
    with cluster(tmp_path_factory.mktemp("cluster"), env=env) as fleet:
        wait_for(lambda: all(s["status"] == "UP" and s["agent_status"] == "L7OK" and s["check_status"] == "L7OK"
                             for s in fleet.balancer.servers().values()), 30)
        yield fleet


async def ahttp(method: str, target: str, **kwargs: Any) -> httpx.Response:
    """An HTTP call from a scenario's event loop (in a thread: the clients' readers keep running)."""
    return await asyncio.to_thread(httpx.request, method.upper(), target, **kwargs)


def wait_for(predicate: Callable[[], bool], timeout_s: float = 15.0) -> float:
    started_s = time.monotonic()
    while not predicate():
        assert time.monotonic() - started_s < timeout_s, "timed out"
        time.sleep(0.05)
    return time.monotonic() - started_s


def url(base: str, key: str) -> str:
    return f"{base}?api_key={key}"


def auth(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


def instance_of(client: NativeClient) -> str:
    return str(client.hello["session_id"]).split("-")[0]


def instances(fleet: Cluster) -> dict[str, Replica]:
    """Each replica's session-id prefix, learnt by a session straight to it."""

    async def probe() -> dict[str, Replica]:
        out = {}
        for replica, key in zip(fleet.replicas, PROBE_KEYS, strict=True):
            if replica.alive:
                client = await NativeClient.connect(url(replica.ws_url, key))
                out[instance_of(client)] = replica
                await client.close()
        return out

    return asyncio.run(probe())


async def speak(client: NativeClient, context_id: str, text: str, **fields: Any) -> ContextLog:
    log = await client.open(context_id, text=text, **fields)
    await client.end(context_id)
    await asyncio.wait_for(log.finished.wait(), 120)
    return log


async def refused(ws_url: str) -> tuple[dict[str, Any], int | None]:
    """The busy message and close code of a session that is refused."""
    client = await NativeClient.connect(ws_url)  # the hello is the busy message here
    return client.hello, await client.wait_closed()


def seqs_contiguous(log: ContextLog) -> bool:
    headers: list[FrameHeader] = [h for h, _, _ in log.frames]
    return [h.seq for h in headers] == list(range(len(headers)))


def log_events(replica: Replica) -> list[dict[str, Any]]:
    """The replica's JSON log lines."""
    events = []
    for line in replica.log().splitlines():
        try:
            events.append(orjson.loads(line))
        except orjson.JSONDecodeError:
            pass
    return events


def wav_clip(seconds: float, freq_hz: float, rate_hz: int = 16000) -> bytes:
    t = np.arange(int(seconds * rate_hz)) / rate_hz
    return encode_wav_pcm16((0.3 * np.sin(2 * np.pi * freq_hz * t) * np.sin(2 * np.pi * 3 * t)).astype(np.float32),
                            rate_hz)


# ---- placement ---------------------------------------------------------------------------------------


def test_sessions_go_where_the_agent_check_says_there_is_room(fleet: Cluster) -> None:
    by_instance = instances(fleet)
    r1 = fleet.replicas[0]

    async def scenario() -> list[str]:
        # three sessions straight to r1 (another balancer's, say): it has 3 of 6 places left and says 50%
        direct = [await NativeClient.connect(url(r1.ws_url, KEYS[i // 2])) for i in range(3)]
        await asyncio.to_thread(wait_for, lambda: fleet.balancer.servers()["r1"]["weight"] == "50")
        via = [await NativeClient.connect(url(fleet.balancer.ws_url, KEYS[2 + i // 2])) for i in range(7)]
        placed = [instance_of(c) for c in via]
        for client in direct + via:
            await client.close()
        return placed

    placed = asyncio.run(scenario())
    names = [by_instance[p].name for p in placed]
    # leastconn divides each server's connections by its weight (an idle server counts 0 whatever its weight):
    # with r1 at half weight it gets fewer than either other replica (equal weights would spread 3/2/2)
    counts = {name: names.count(name) for name in ("r1", "r2", "r3")}
    assert counts["r1"] < min(counts["r2"], counts["r3"]) and sum(counts.values()) == 7, names


def test_the_proxy_logs_no_credential(fleet: Cluster) -> None:
    """A browser's key rides in the WebSocket URL (`?api_key=`): the shipped haproxy.cfg logs each session's
    request line without its query, as the server logs no key."""
    log_path = fleet.balancer.stats_socket.parent / "haproxy.log"
    wait_for(lambda: log_path.read_text().count("/v1/stream") >= 7)  # the sessions above (logged as they end)
    lines = [line for line in log_path.read_text().splitlines() if "/v1/stream" in line]
    assert all('"GET /v1/stream HTTP/1.1"' in line for line in lines), lines[:3]
    assert not any(key in log_path.read_text() for key in KEYS)


# ---- shared voices -----------------------------------------------------------------------------------


def test_a_voice_uploaded_through_one_replica_is_spoken_by_the_others(fleet: Cluster) -> None:
    r1, r2, r3 = fleet.replicas
    created = httpx.post(r1.http_url + "/v1/voices", headers=auth(KEYS[6]), timeout=60,
                         files={"file": ("ann.wav", wav_clip(6.0, 220.0), "audio/wav")},
                         data={"voice_id": "ann", "name": "Ann"})
    assert created.status_code == 201, created.text
    version = created.json()["version"]

    def ready_on(replica: Replica) -> bool:
        response = httpx.get(replica.http_url + "/v1/voices/ann", headers=auth(KEYS[6]))
        return response.status_code == 200 and response.json()["status"] == "ready"

    for replica in (r2, r3):
        wait_for(lambda replica=replica: ready_on(replica), 10)  # type: ignore[misc]
        assert httpx.get(replica.http_url + "/v1/voices/ann", headers=auth(KEYS[6])).json()["version"] == version

    async def scenario() -> list[ContextLog]:
        logs = []
        for replica in (r2, r3):
            client = await NativeClient.connect(url(replica.ws_url, KEYS[6]))
            logs.append(await speak(client, "c", "Hello from another replica.", voice="ann", seed=11))
            await client.close()
        return logs

    for log in asyncio.run(scenario()):
        assert log.done is not None and log.done["reason"] == "completed" and log.frames and not log.errors
        assert log.started is not None and log.started["voice"] == "ann"
    imported = [e for e in log_events(r2) if e.get("event") == "voice_imported" and e.get("voice_id") == "ann"]
    assert imported and imported[0]["computed_for"] == ""  # r2 took the conditioning, not its voice encoders


# ---- per-key limits ------------------------------------------------------------------------------------


def test_a_per_key_session_limit_of_two_holds_across_replicas(fleet: Cluster) -> None:
    r1, r2, r3 = fleet.replicas
    key = KEYS[7]

    async def scenario() -> None:
        first = await NativeClient.connect(url(r1.ws_url, key))
        second = await NativeClient.connect(url(r2.ws_url, key))
        busy, code = await refused(url(r3.ws_url, key))
        assert busy["type"] == "busy" and busy["context_id"] is None and "API key" in busy["reason"], busy
        assert code == 1013
        busy, code = await refused(url(fleet.balancer.ws_url, key))  # wherever the balancer sends it
        assert busy["type"] == "busy" and code == 1013
        other = await NativeClient.connect(url(r3.ws_url, KEYS[8]))  # another key is not affected
        await first.close()
        deadline_s = time.monotonic() + 5
        while True:  # the released place comes back (the release is asynchronous)
            client = await NativeClient.connect(url(r3.ws_url, key))
            if client.hello["type"] == "session_started":
                break
            await client.wait_closed()
            assert time.monotonic() < deadline_s
            await asyncio.sleep(0.05)
        for c in (second, other, client):
            await c.close()

    asyncio.run(scenario())


# ---- the phrase cache ----------------------------------------------------------------------------------


def test_a_phrase_cache_hit_from_another_replica_is_bit_identical_and_immediate(fleet: Cluster) -> None:
    r1, r2, r3 = fleet.replicas
    text = "Thanks for calling, one moment please."

    async def ask(replica: Replica, **fields: Any) -> tuple[ContextLog, float]:
        client = await NativeClient.connect(url(replica.ws_url, KEYS[9]))
        log = await speak(client, "c", text, **fields)
        await client.close()
        assert log.done is not None and log.done["reason"] == "completed" and log.frames
        assert log.first_text_sent_s is not None and log.first_frame_recv_s is not None
        return log, log.first_frame_recv_s - log.first_text_sent_s

    async def scenario() -> None:
        miss, _ = await ask(r1, seed=21)
        assert not any(s["cached"] for s in miss.segments_started)
        await asyncio.sleep(0.3)  # (the store to Redis is in the background)
        hit, ttfa_s = await ask(r2, seed=21)
        assert all(s["cached"] for s in hit.segments_started), (
            hit.segments_started, miss.segments_started,
            (await ahttp("get", r2.http_url + "/v1/status", headers=auth(KEYS[9]))).json()["phrase_cache"])
        assert hit.audio == miss.audio  # bit-identical, from a replica that never rendered it
        assert ttfa_s <= HIT_TTFA_LIMIT_S, f"first audio of a hit took {ttfa_s * 1000:.1f} ms"
        for changed in ({"seed": 22}, {"seed": 21, "sampling": {"temperature": 0.7}},
                        {"seed": 21, "output_format": {"encoding": "mulaw", "sample_rate_hz": 8000}}):
            log, _ = await ask(r3, **changed)
            cached = [s["cached"] for s in log.segments_started]
            if "output_format" in changed:  # the format is encoded per request from the same cached audio
                status = await ahttp("get", r3.http_url + "/v1/status", headers=auth(KEYS[9]))
                assert all(cached), (log.segments_started, miss.segments_started, status.json()["phrase_cache"])
            else:
                assert not any(cached), changed
        # the voice changes (deleted and created again from another clip): its old entries miss everywhere
        before, _ = await ask(r1, seed=23, voice="ann")
        again, _ = await ask(r2, seed=23, voice="ann")
        assert all(s["cached"] for s in again.segments_started) and again.audio == before.audio
        assert (await ahttp("delete", r1.http_url + "/v1/voices/ann", headers=auth(KEYS[9]))).status_code == 200
        recreated = await ahttp("post", r1.http_url + "/v1/voices", headers=auth(KEYS[9]), timeout=60,
                               files={"file": ("ann.wav", wav_clip(6.0, 330.0), "audio/wav")}, data={"voice_id": "ann"})
        assert recreated.status_code == 201, recreated.text

        def new_version_on_r2() -> bool:
            response = httpx.get(r2.http_url + "/v1/voices/ann", headers=auth(KEYS[9]))
            return response.status_code == 200 and response.json()["version"] == recreated.json()["version"]

        await asyncio.to_thread(wait_for, new_version_on_r2, 10)
        after, _ = await ask(r2, seed=23, voice="ann")
        assert not any(s["cached"] for s in after.segments_started)

    asyncio.run(scenario())


# ---- Redis stopped mid-run --------------------------------------------------------------------------------


def test_redis_stopped_mid_run_degrades_as_documented_and_recovers(fleet: Cluster) -> None:
    r1 = fleet.replicas[0]

    async def scenario() -> None:
        open_session = await NativeClient.connect(url(r1.ws_url, KEYS[10]))
        fleet.redis.stop()
        try:
            await asyncio.to_thread(wait_for, lambda: "shared state unavailable" in httpx.get(
                r1.http_url + "/readyz").json()["detail"], 10)
            ready = await ahttp("get", r1.http_url + "/readyz")
            assert ready.status_code == 200 and ready.json()["shared_state"]["available"] is False
            assert "tts_shared_state_up{backend=\"redis\"} 0.0" in (await ahttp("get", r1.http_url + "/metrics")).text
            # served: an open session speaks (it needs no shared state), a known voice included
            log = await speak(open_session, "c", "Still speaking while Redis is down.", seed=31)
            assert log.done is not None and log.done["reason"] == "completed" and log.frames
            # refused: what cannot be checked (a new session of a key with a session limit; a new voice)
            busy, code = await refused(url(r1.ws_url, KEYS[11]))
            assert busy["type"] == "busy" and "cannot be checked" in busy["reason"] and code == 1013
            upload = await ahttp("post", r1.http_url + "/v1/voices", headers=auth(KEYS[10]), timeout=60,
                                files={"file": ("b.wav", wav_clip(6.0, 200.0), "audio/wav")}, data={"voice_id": "bob"})
            assert upload.status_code == 503 and upload.json()["error"]["code"] == "shared_state_unavailable"
        finally:
            fleet.redis.start()
        await asyncio.to_thread(wait_for,
                                lambda: httpx.get(r1.http_url + "/readyz").json()["shared_state"]["available"])
        assert "tts_shared_state_up{backend=\"redis\"} 1.0" in (await ahttp("get", r1.http_url + "/metrics")).text
        client = await NativeClient.connect(url(r1.ws_url, KEYS[11]))
        assert client.hello["type"] == "session_started"
        log = await speak(open_session, "d", "And after it came back.", seed=32)
        assert log.done is not None and log.done["reason"] == "completed"
        await client.close()
        await open_session.close()

    asyncio.run(scenario())


# ---- losing replicas -------------------------------------------------------------------------------------


def agent_says(replica: Replica) -> str:
    with socket.create_connection(("127.0.0.1", replica.agent_port), timeout=2) as sock:
        return sock.recv(256).decode()


def test_sigterm_drains_one_replica(fleet: Cluster) -> None:
    by_instance = instances(fleet)
    r2 = fleet.replicas[1]
    names = {replica.name: prefix for prefix, replica in by_instance.items()}

    async def scenario() -> None:
        client = await NativeClient.connect(url(r2.ws_url, KEYS[12]))
        log = await client.open("long", text=LONG_TEXT, seed=41, cache=False)
        await client.end("long")
        while not log.frames:
            await asyncio.sleep(0.01)
        r2.proc.send_signal(signal.SIGTERM)
        await asyncio.to_thread(wait_for, lambda: agent_says(r2) == "drain\n", 10)
        await asyncio.to_thread(wait_for, lambda: fleet.balancer.servers()["r2"]["status"] in ("DRAIN", "DOWN", "MAINT")
                                or fleet.balancer.servers()["r2"]["weight"] == "0", 10)
        newcomers = [await NativeClient.connect(url(fleet.balancer.ws_url, KEYS[13 + i % 2])) for i in range(4)]
        assert all(c.hello["type"] == "session_started" for c in newcomers)
        assert names["r2"] not in {instance_of(c) for c in newcomers}  # no new session lands on it
        await asyncio.wait_for(log.finished.wait(), 120)  # its speech finishes
        assert log.done is not None and log.done["reason"] == "completed" and seqs_contiguous(log)
        assert await client.wait_closed() == 1001
        for c in newcomers:
            await c.close()

    asyncio.run(scenario())
    assert r2.proc.wait(30) in (0, -signal.SIGTERM)  # (uvicorn re-raises the signal once it has shut down)
    drained = [e for e in log_events(r2) if e.get("event") == "drain_done"]
    assert drained and drained[0]["sessions_left"] == 0


def test_kill_9_one_replica_mid_speech(fleet: Cluster) -> None:
    by_instance = instances(fleet)
    r1, r3 = fleet.replicas[0], fleet.replicas[2]
    victim_prefix = next(p for p, r in by_instance.items() if r is r3)
    key = KEYS[14]  # limit 2: one session on the victim, one on the survivor

    async def scenario() -> float:
        doomed = await NativeClient.connect(url(r3.ws_url, key))
        survivor = await NativeClient.connect(url(r1.ws_url, key))
        doomed_log = await doomed.open("c", text=LONG_TEXT, seed=51, cache=False)
        survivor_log = await survivor.open("c", text=LONG_TEXT, seed=52, cache=False)
        for c in (doomed, survivor):
            await c.end("c")
        while not doomed_log.frames or not survivor_log.frames:
            await asyncio.sleep(0.01)
        r3.proc.kill()
        killed_s = time.monotonic()

        async def until_released() -> tuple[float, NativeClient]:
            """The dead replica's session stops counting against the key: a second session is admitted."""
            while True:
                client = await NativeClient.connect(url(r1.ws_url, key))
                if client.hello["type"] == "session_started":
                    return time.monotonic() - killed_s, client
                await client.wait_closed()
                await asyncio.sleep(0.1)

        release = asyncio.create_task(until_released())
        await asyncio.wait_for(doomed.wait_closed(), 10)  # its client is closed (no close frame: it died)
        assert doomed_log.done is None
        # new sessions go to the live replica (HAProxy retries a refused connection elsewhere)
        newcomers = [await NativeClient.connect(url(fleet.balancer.ws_url, KEYS[15])) for _ in range(2)]
        assert all(c.hello["type"] == "session_started" and instance_of(c) != victim_prefix for c in newcomers)
        # the other replica's stream carries on without a lost frame
        await asyncio.wait_for(survivor_log.finished.wait(), 120)
        assert survivor_log.done is not None and survivor_log.done["reason"] == "completed"
        assert seqs_contiguous(survivor_log) and survivor_log.done["frames"] == len(survivor_log.frames)
        released_s, client = await release
        for c in (survivor, client, *newcomers):
            await c.close()
        return released_s

    released_s = asyncio.run(scenario())
    assert released_s <= LEASE_TTL_S + SYNC_SLACK_S, f"released after {released_s:.2f} s"
    assert r3.proc.wait(5) == -signal.SIGKILL
