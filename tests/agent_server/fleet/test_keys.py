"""agent_server.fleet.keys: keys added and revoked in the shared state, seen by a replica's Auth (real redis-server)."""

from __future__ import annotations

import asyncio
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from agent_server.fleet.auth import Auth, Denied, fingerprint
from agent_server.fleet.shared_state import RedisState

from tests.services import RedisServer, redis_server

pytestmark = pytest.mark.timeout(60)
REPO = Path(__file__).resolve().parents[3]
CLI_ENV = {"PYTHONPATH": str(REPO), "PATH": "/usr/bin:/bin"}


@pytest.fixture(scope="module")
def redis(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RedisServer]:
    with redis_server(tmp_path_factory.mktemp("redis")) as server:
        yield server


def keys_cli(redis: RedisServer, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "agent_server.fleet.keys", "--redis-url", redis.url, *args],
                          check=False, capture_output=True, text=True, cwd=REPO, env=CLI_ENV)


def test_a_key_added_and_revoked_from_the_command_line_counts_on_a_running_replica(redis: RedisServer) -> None:
    added = keys_cli(redis, "add")
    assert added.returncode == 0, added.stderr
    line, key = added.stdout.split()[1], added.stdout.splitlines()[1]
    assert line == fingerprint(key)
    mine = keys_cli(redis, "add", "--key", "my-own-key-0123456789")
    assert mine.returncode == 0 and "my-own-key-0123456789" not in mine.stdout  # a given key is never echoed

    async def scenario() -> None:
        shared = RedisState(redis.url, sync_period_s=0.05)
        await shared.start()
        auth = Auth(mode="on", shared=shared)  # no configured keys: the shared ones only
        assert auth.verify(key).key_id == fingerprint(key)
        token, _ = auth.issue_token(auth.verify(key))
        assert await asyncio.to_thread(keys_cli, redis, "revoke", fingerprint(key)) is not None
        deadline_s = time.monotonic() + 2
        while True:  # within a sync period
            try:
                auth.verify(key)
            except Denied:
                break
            assert time.monotonic() < deadline_s
            await asyncio.sleep(0.02)
        with pytest.raises(Denied):
            auth.verify(token)
        assert auth.verify("my-own-key-0123456789").key_id == fingerprint("my-own-key-0123456789")
        await shared.stop()

    asyncio.run(scenario())
    listing = keys_cli(redis, "list").stdout.splitlines()
    assert f"{fingerprint(key)} (revoked)" in listing and fingerprint("my-own-key-0123456789") in listing
    assert keys_cli(redis, "add", "--key", "has space").returncode == 2


def test_a_revoke_that_names_no_key_says_so(redis: RedisServer) -> None:
    """A mistyped fingerprint must not pass for a revoked key: not a fingerprint -> refused; a fingerprint of no
    key added here -> revoked (the servers may have it from a file) with a warning."""
    known = keys_cli(redis, "add").stdout.split()[1]
    typo = keys_cli(redis, "revoke", "k_doesnotexist")
    assert typo.returncode == 2 and "not a fingerprint" in typo.stderr and not typo.stdout
    unknown = keys_cli(redis, "revoke", "k_0123456789ab")
    assert unknown.returncode == 0 and unknown.stdout == "revoked k_0123456789ab\n"
    assert "k_0123456789ab is not a key added here" in unknown.stderr
    revoked = keys_cli(redis, "revoke", known)
    assert revoked.returncode == 0 and revoked.stdout == f"revoked {known}\n" and not revoked.stderr


def test_a_redis_url_it_cannot_read_is_a_usage_error() -> None:
    result = subprocess.run([sys.executable, "-m", "agent_server.fleet.keys", "--redis-url", "notaurl", "list"],
                            check=False, capture_output=True, text=True, cwd=REPO, env=CLI_ENV)
    assert result.returncode == 2 and "--redis-url: " in result.stderr and "Traceback" not in result.stderr


def test_without_redis_it_says_so() -> None:
    result = subprocess.run([sys.executable, "-m", "agent_server.fleet.keys", "list"], check=False, capture_output=True,
                            text=True, cwd=REPO, env=CLI_ENV)
    assert result.returncode == 2 and "--redis-url" in result.stderr


def test_what_was_typed_is_checked_before_redis_is_asked(tmp_path: Path) -> None:
    """A typo is a usage error even while Redis is down (not "Redis is unavailable", which hides it)."""
    dead = RedisServer(tmp_path / "redis")  # never started: nothing listens on its port
    for args, reason in ((("revoke", "k_123"), "not a fingerprint"),
                         (("add", "--key", "short"), "at least 20 characters")):
        result = keys_cli(dead, *args)
        assert result.returncode == 2 and reason in result.stderr and "unavailable" not in result.stderr, result
    down = keys_cli(dead, "revoke", "k_0123456789ab")  # well-formed: then Redis is asked
    assert down.returncode == 1 and "Redis is unavailable" in down.stderr
