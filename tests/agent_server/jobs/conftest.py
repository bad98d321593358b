"""Fixtures of the jobs tests: a real redis-server (tests/services.py) for the module, and both stores."""

from __future__ import annotations

import secrets
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from agent_server.jobs.model import Job, JobSegment, new_job_id

from tests.services import RedisServer, redis_server


@pytest.fixture(scope="module")
def redis(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RedisServer]:
    with redis_server(tmp_path_factory.mktemp("redis")) as server:
        yield server


def redis_client(server: RedisServer) -> Any:
    import redis.asyncio as aioredis

    return aioredis.Redis.from_url(server.url)


def fresh_prefix() -> str:
    return f"t{secrets.token_hex(4)}:"


def make_plan(n: int) -> tuple[JobSegment, ...]:
    return tuple(JobSegment(i, f"Sentence number {i}.", 20 * i, 20 * i + 19, 100) for i in range(n))


def make_job(now_s: float, *, key_id: str = "k_test", segments: int = 3, chars: int = 60, seed: int = 7,
             webhook_url: str | None = None) -> Job:
    return Job(id=new_job_id(now_s), key_id=key_id, created_at_s=now_s, voice="default", output_format="wav",
               seed=seed, text_chars=chars, segments_total=segments, webhook_url=webhook_url)


def data_dir(tmp_path: Path) -> Path:
    return tmp_path / "jobs"
