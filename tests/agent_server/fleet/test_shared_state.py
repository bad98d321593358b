"""agent_server.shared_state: both backends behind one interface; RedisState against a real redis-server
(tests/services.py): limits across replicas, a dead replica's leases expiring, Redis stopped and restarted."""

from __future__ import annotations

import asyncio
import secrets
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import orjson
import pytest

from agent_server.fleet.shared_state import (
    LocalState,
    RedisState,
    SharedState,
    SharedStateUnavailable,
    VoiceData,
    VoiceRecord,
)

from tests.services import RedisServer, redis_server

pytestmark = pytest.mark.timeout(60)

LEASE_TTL_S = 1.0
SYNC_S = 0.05


@pytest.fixture(scope="module")
def redis(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RedisServer]:
    with redis_server(tmp_path_factory.mktemp("redis")) as server:
        yield server


def run(coro: Any) -> Any:
    return asyncio.run(coro)


def replica(redis: RedisServer, prefix: str, name: str) -> RedisState:
    return RedisState(redis.url, prefix=prefix, lease_ttl_s=LEASE_TTL_S, replica_id=name, sync_period_s=SYNC_S)


async def until(predicate: Callable[[], bool], timeout_s: float = 5.0) -> float:
    """Wait for `predicate`; the seconds it took. Fails after `timeout_s`."""
    started_s = time.monotonic()
    while not predicate():
        assert time.monotonic() - started_s < timeout_s, "timed out"
        await asyncio.sleep(0.01)
    return time.monotonic() - started_s


def record(voice_id: str, version: str = "v1") -> VoiceRecord:
    return VoiceRecord(voice_id, version, "name", "2026-12-04T00:00:00+00:00", 6.0, 16000, "w1")


def test_a_voice_record_round_trips_and_an_older_one_still_reads() -> None:
    full = VoiceRecord("ann", "v1", "Ann", "2026-12-04T00:00:00+00:00", 6.0, 16000, "w1", "warm", "pt")
    assert VoiceRecord.from_json(full.to_json()) == full
    older = orjson.loads(full.to_json())
    del older["description"], older["language"]  # written before voices had them
    assert VoiceRecord.from_json(orjson.dumps(older)) == VoiceRecord(*list(orjson.loads(full.to_json()).values())[:7])


@pytest.fixture(params=["local", "redis"])
def backend(request: pytest.FixtureRequest) -> Callable[[], SharedState]:
    if request.param == "local":
        return lambda: LocalState(lease_ttl_s=LEASE_TTL_S)
    server: RedisServer = request.getfixturevalue("redis")
    prefix = f"t{secrets.token_hex(4)}:"
    return lambda: replica(server, prefix, "r1")


def test_the_interface_on_both_backends(backend: Callable[[], SharedState]) -> None:
    async def scenario() -> None:
        state = backend()
        await state.start()
        try:
            assert state.available
            assert await state.acquire_lease("sessions:k", "a", 2) and await state.acquire_lease("sessions:k", "b", 2)
            assert await state.acquire_lease("sessions:k", "a", 2)  # idempotent: a holder counts once
            assert not await state.acquire_lease("sessions:k", "c", 2)
            assert await state.acquire_lease("sessions:other", "c", 2)  # scopes are separate
            assert await state.lease_count("sessions:k") == 2
            await state.release_lease("sessions:k", "a")
            await state.release_lease("sessions:k", "a")  # twice: harmless
            assert await state.lease_count("sessions:k") == 1
            assert await state.acquire_lease("sessions:k", "c", 2)
            assert await state.acquire_lease("sessions:k", "d", 0)  # 0: no limit
            # a token bucket: full at first, refused whole when short
            assert await state.take("text:k", 60, 100, 0.001)
            assert not await state.take("text:k", 41, 100, 0.001)
            assert await state.take("text:k", 40, 100, 0.001)
            assert not await state.take("text:k", 1, 100, 0.001)
            assert await state.take("text:fast", 100, 100, 1000.0)
            await asyncio.sleep(0.05)  # 1000/s for 50 ms: 50 back
            assert await state.take("text:fast", 40, 100, 1000.0)
            # keys and revocations: mirrored for synchronous checks
            await state.add_key("hash-1", "k_1")
            await state.revoke_token("tok-1", time.time() + 60)
            await state.refresh()
            assert state.key_of_hash("hash-1") == "k_1" and state.key_of_hash("hash-2") is None
            assert state.token_revoked("tok-1") and not state.token_revoked("tok-2")
            await state.revoke_key("k_1")
            await state.refresh()
            assert state.key_revoked("k_1")
        finally:
            await state.stop()

    run(scenario())


def test_limits_hold_across_replicas_and_a_dead_replica_is_released(redis: RedisServer) -> None:
    prefix = f"t{secrets.token_hex(4)}:"

    async def scenario() -> None:
        a, b = replica(redis, prefix, "a"), replica(redis, prefix, "b")
        await a.start()
        await b.start()
        assert await a.acquire_lease("sessions:k", "a/1", 2)
        assert await b.acquire_lease("sessions:k", "b/1", 2)
        assert not await a.acquire_lease("sessions:k", "a/2", 2)  # the limit counts b's session too
        assert not await b.acquire_lease("sessions:k", "b/2", 2)
        # leases outlive their TTL while their replica lives (refreshed every TTL/3)
        await asyncio.sleep(LEASE_TTL_S * 2)
        assert await a.lease_count("sessions:k") == 2
        # b dies (no release, no refresh): its lease is gone within the TTL
        assert b._task is not None
        b._task.cancel()
        died_s = time.monotonic()
        while not await a.acquire_lease("sessions:k", "a/2", 2):
            assert time.monotonic() - died_s < LEASE_TTL_S + 0.5, "the dead replica's lease was not released"
            await asyncio.sleep(0.05)
        assert time.monotonic() - died_s <= LEASE_TTL_S + 0.5
        # a text budget shared by both replicas
        assert await a.take("text:k", 70, 100, 0.001) and not await b.take("text:k", 31, 100, 0.001)
        assert await b.take("text:k", 30, 100, 0.001)
        await a.stop()  # a clean stop gives its leases back at once
        probe = replica(redis, prefix, "probe")
        await probe.start()
        assert await probe.lease_count("sessions:k") == 0
        await probe.stop()
        await b.stop()

    run(scenario())


def test_voices_are_created_once_and_mirrored(redis: RedisServer) -> None:
    prefix = f"t{secrets.token_hex(4)}:"

    async def scenario() -> None:
        a, b = replica(redis, prefix, "a"), replica(redis, prefix, "b")
        await a.start()
        await b.start()
        data = VoiceData(record("v1"), b"RIFF-clip", {"w1": b"conditioning-bytes", "w2": b"other-model's"})
        assert await a.put_voice(data)
        assert not await b.put_voice(VoiceData(record("v1", "other"), b"x", {"w1": b"y"}))  # the id is taken
        got = await b.get_voice("v1")
        assert got == data
        # a model computed later is added under the voice it was made from, not under a changed one
        assert await b.add_conditioning("v1", "v1", "w3", b"third")
        assert not await b.add_conditioning("v1", "a changed version", "w4", b"late")
        got = await a.get_voice("v1")
        assert got is not None and got.conditioning == {**data.conditioning, "w3": b"third"}
        await until(lambda: "v1" in b.voice_index())  # b's mirror follows within a sync period
        assert b.voice_index()["v1"].version == "v1"
        await b.delete_voice("v1")
        await until(lambda: "v1" not in a.voice_index())
        assert await a.get_voice("v1") is None
        await a.stop()
        await b.stop()

    run(scenario())


def test_redis_down_fails_fast_keeps_the_mirror_and_recovers(tmp_path: Path) -> None:
    server = RedisServer(tmp_path / "redis")
    server.start()
    prefix = "down:"

    async def scenario() -> None:
        state = replica(server, prefix, "a")
        await state.start()
        await state.revoke_token("tok-1", time.time() + 600)
        assert await state.acquire_lease("sessions:k", "a/1", 2)
        server.stop()
        with pytest.raises(SharedStateUnavailable):
            await state.acquire_lease("sessions:k", "a/2", 2)
        assert not state.available and "redis unreachable" in state.detail
        started_s = time.monotonic()
        for _ in range(20):  # while down, every call fails at once
            with pytest.raises(SharedStateUnavailable):
                await state.take("text:k", 1, 100, 1.0)
        assert time.monotonic() - started_s < 0.5
        await state.release_lease("sessions:k", "nobody")  # never raises
        assert state.token_revoked("tok-1")  # the mirror still answers
        server.start()  # same port, same append-only file
        await until(lambda: state.available)
        assert state.token_revoked("tok-1")
        assert await state.lease_count("sessions:k") == 1  # re-registered (it had expired meanwhile or not)
        assert await state.acquire_lease("sessions:k", "a/2", 2)
        assert state.failures == 1
        await state.stop()

    try:
        run(scenario())
    finally:
        server.stop()



def test_a_server_whose_redis_is_down_stays_ready_says_so_and_refuses_only_what_it_cannot_check(
    tmp_path: Path,
) -> None:
    from agent_server.settings import Settings

    from tests.agent_server.fake_engine import FakeEngine
    from tests.agent_server.live_server import live_server
    from tests.agent_server.native_client import NativeClient
    from tests.services import free_port

    dead_redis = f"redis://127.0.0.1:{free_port()}/0"  # nothing listens there
    settings = Settings(data_dir=tmp_path, redis_url=dead_redis, api_keys=("limited-key",), max_sessions_per_key=2)
    with live_server(FakeEngine(), settings) as server:
        import httpx

        ready = httpx.get(server.http_url + "/readyz")
        assert ready.status_code == 200 and "degraded: shared state unavailable" in ready.json()["detail"]
        assert ready.json()["shared_state"] == {"backend": "redis", "available": False}
        assert 'tts_shared_state_up{backend="redis"} 0.0' in httpx.get(server.http_url + "/metrics").text

        async def session() -> tuple[dict[str, Any], int | None]:
            client = await NativeClient.connect(server.ws_url + "?api_key=limited-key")
            return client.hello, await client.wait_closed()

        hello, code = asyncio.run(session())
        assert hello["type"] == "busy" and "cannot be checked" in hello["reason"] and code == 1013
        status = httpx.get(server.http_url + "/v1/status", headers={"X-API-Key": "limited-key"})
        assert status.status_code == 200  # a configured key is still accepted (for what needs no shared state)
        assert status.json()["shared_state"]["available"] is False


@pytest.mark.parametrize("fleet_has_keys", [True, False])
def test_auto_auth_fails_closed_until_the_shared_state_is_first_read(tmp_path: Path, fleet_has_keys: bool) -> None:
    """`--auth auto`, Redis down when the replica starts: it cannot know whether the fleet has keys, so it
    serves nobody without a configured key (503 `auth_unavailable`, in the vendor's shape on a vendor path),
    then, once Redis is read, is on (the fleet has keys: 401 without one) or off (none: open)."""
    import httpx

    from agent_server.fleet.auth import fingerprint, key_hash
    from agent_server.settings import Settings

    from tests.agent_server.fake_engine import FakeEngine
    from tests.agent_server.live_server import live_server

    key = "sk-" + secrets.token_urlsafe(24)
    server = RedisServer(tmp_path / "redis")
    if fleet_has_keys:  # the fleet's key, in Redis's append-only file before this replica starts
        server.start()

        async def add() -> None:
            state = RedisState(server.url)
            await state.start()
            await state.add_key(key_hash(key), fingerprint(key))
            await state.stop()

        run(add())
        server.stop()
    settings = Settings(data_dir=tmp_path / "data", redis_url=server.url, auth="auto")
    try:
        with live_server(FakeEngine(), settings) as live:
            for headers in ({}, {"X-API-Key": key}):
                refused = httpx.get(live.http_url + "/v1/status", headers=headers)
                assert refused.status_code == 503 and refused.headers["retry-after"]
                assert refused.json()["error"]["code"] == "auth_unavailable"
            eleven = httpx.get(live.http_url + "/v1/voices", headers={"xi-api-key": key})
            assert eleven.status_code == 503 and "Redis" in eleven.json()["detail"]["message"]
            server.start()  # same port, same append-only file
            deadline_s = time.monotonic() + 10.0
            while (answer := httpx.get(live.http_url + "/v1/status")).status_code == 503:
                assert time.monotonic() < deadline_s, "the replica never read the shared state"
                time.sleep(0.05)
            if fleet_has_keys:
                assert answer.status_code == 401
                assert httpx.get(live.http_url + "/v1/status", headers={"X-API-Key": key}).status_code == 200
            else:
                assert answer.status_code == 200 and answer.json()["auth"]["enabled"] is False
    finally:
        server.stop()
