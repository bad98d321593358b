"""Fixtures of the jobs tests: a real redis-server (tests/services.py) for the module, and both stores."""

from __future__ import annotations

import asyncio
import io
import secrets
from collections.abc import Coroutine, Iterator
from pathlib import Path
from typing import Any, TypeVar

import pytest

from agent_server.jobs.model import Job, JobSegment, new_job_id

from tests.services import RedisServer, redis_server

T = TypeVar("T")
REDIS_TIMEOUT_S = 2.0  # as the server sets one (shared_state.REDIS_TIMEOUT_S): a lost reply is an error, not a hang


@pytest.fixture(scope="module")
def redis(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RedisServer]:
    with redis_server(tmp_path_factory.mktemp("redis")) as server:
        yield server


def redis_client(server: RedisServer) -> Any:
    import redis.asyncio as aioredis

    return aioredis.Redis.from_url(server.url, socket_timeout=REDIS_TIMEOUT_S, socket_connect_timeout=REDIS_TIMEOUT_S)


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


def run(coro: Coroutine[Any, Any, T], timeout_s: float = 30.0) -> T:
    """asyncio.run with a deadline: a scenario that hangs fails with every task's stack (not pytest-timeout's
    bare thread dump, which cannot show where a coroutine waits)."""

    async def bounded() -> T:
        task = asyncio.ensure_future(coro)
        done, _ = await asyncio.wait({task}, timeout=timeout_s)
        if not done:
            stacks = io.StringIO()
            for other in asyncio.all_tasks():
                if other is not asyncio.current_task():
                    other.print_stack(limit=12, file=stacks)
            for _ in range(20):  # (a task that swallows cancels is cancelled again, then given up on)
                task.cancel()
                done, _ = await asyncio.wait({task}, timeout=0.1)
                if done:
                    break
            pytest.fail(f"the scenario hung for {timeout_s} s; its tasks:\n{stacks.getvalue()}", pytrace=False)
        return task.result()

    return asyncio.run(bounded())
