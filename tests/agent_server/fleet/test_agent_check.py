"""agent_server.agent_check: the reply HAProxy reads, and the port of a live server through its states."""

from __future__ import annotations

import asyncio
import socket
import time
from pathlib import Path

import pytest

from agent_server.fleet.agent_check import (
    MAX_REASON_CHARS,
    Capacity,
    ReplicaState,
    agent_reply,
    weight_pct,
)
from agent_server.settings import Settings

from tests.agent_server.fake_engine import FakeEngine
from tests.agent_server.live_server import live_server
from tests.agent_server.native_client import NativeClient
from tests.services import free_port

pytestmark = pytest.mark.timeout(60)


def capacity(state: ReplicaState = ReplicaState.READY, *, sessions: int = 0, slots: int = 0, waiting: int = 0,
             detail: str = "") -> Capacity:
    return Capacity(state, sessions, 10, slots, waiting, 8, detail)


def test_the_weight_is_the_smaller_free_share_never_zero() -> None:
    assert weight_pct(capacity()) == 100
    assert weight_pct(capacity(slots=2)) == 75  # 6 of 8 slots free
    assert weight_pct(capacity(slots=2, waiting=2)) == 50  # a queue counts against it
    assert weight_pct(capacity(sessions=9)) == 10  # sessions are the scarcer resource here
    assert weight_pct(capacity(slots=8, waiting=5)) == 1  # full: 1%, so that one still answers busy
    assert weight_pct(capacity(sessions=10)) == 1


def test_replies() -> None:
    assert agent_reply(capacity(slots=2)) == "up ready 75%\n"
    assert agent_reply(capacity(ReplicaState.DRAINING)) == "drain\n"
    assert agent_reply(capacity(ReplicaState.LOADING)) == "down#loading\n"
    failed = agent_reply(capacity(ReplicaState.FAILED, detail="the engine thread died:\nCUDA error " + "x" * 200))
    assert failed.startswith("down#engine failed: the engine thread died: CUDA error") and failed.endswith("\n")
    assert failed.count("\n") == 1 and len(failed) == len("down#") + MAX_REASON_CHARS + 1


def ask(port: int) -> str:
    with socket.create_connection(("127.0.0.1", port), timeout=2) as sock:
        chunks = []
        while chunk := sock.recv(256):
            chunks.append(chunk)
    return b"".join(chunks).decode()


def test_a_live_server_reports_capacity_drain_and_a_dead_engine(tmp_path: Path) -> None:
    port = free_port()
    engine = FakeEngine(max_slots=4, realtime_factor=0.3)
    settings = Settings(data_dir=tmp_path, agent_check_port=port, max_sessions=4)
    with live_server(engine, settings) as server:
        assert ask(port) == "up ready 100%\n"

        async def busy_then_drain() -> list[str]:
            clients = [await NativeClient.connect(server.ws_url) for _ in range(2)]
            log = await clients[0].open("c", text="Hello there, a sentence that takes a while to say. " * 2, seed=1)
            await clients[0].end("c")
            while not log.frames:
                await asyncio.sleep(0.01)
            replies = [await asyncio.to_thread(ask, port)]  # 2 of 4 sessions; slots in use
            server.hub.post(lambda: asyncio.ensure_future(server.hub.drain(5.0)))
            while server.hub.status.name != "DRAINING":
                await asyncio.sleep(0.01)
            replies.append(await asyncio.to_thread(ask, port))
            await asyncio.wait_for(log.finished.wait(), 10)  # its speech finishes during the drain
            assert log.done is not None and log.done["reason"] == "completed"
            for client in clients:
                await client.wait_closed()
            return replies

        during, drained = asyncio.run(busy_then_drain())
        assert during.startswith("up ready ") and int(during.split()[2].rstrip("%")) <= 50
        assert drained == "drain\n"
    dead = FakeEngine()
    with live_server(dead, Settings(data_dir=tmp_path, agent_check_port=port)) as server:
        assert ask(port) == "up ready 100%\n"
        dead.stop()  # the engine thread ends: the hub notices within its alive check
        deadline_s = time.monotonic() + 5
        while not (reply := ask(port)).startswith("down#"):
            assert time.monotonic() < deadline_s
            time.sleep(0.05)
        assert reply.startswith("down#engine failed")
