"""HAProxy's agent check: a TCP port that answers each connection with one line about this replica, then
closes (HAProxy `agent-check agent-port N agent-inter 1s`, deploy/haproxy/haproxy.cfg):

    up ready 63%      serving; the weight is the free share of its capacity (never below 1%)
    drain             shutting down (SIGTERM): no new sessions, the ones it has finish
    down#<why>        loading, or the engine is dead

The weight is a percentage of the `weight` haproxy.cfg gives the server (100 there). Free capacity is the
smaller of the free engine slots (`max_slots - slots_in_use - waiting`, so a queue counts against it) and the
free session places (`max_sessions - sessions`). A full replica reports 1%, not 0: with `balance leastconn`
HAProxy divides a server's connections by its weight, so a replica with room always wins, and when every
replica is full a new session still reaches one, which answers `busy` in its protocol's own form (rather than
HAProxy's 503). `ready` in the reply takes a replica that restarted under the same address out of a drain.
"""

from __future__ import annotations

import asyncio
import enum
from collections.abc import Callable
from dataclasses import dataclass

import structlog

log = structlog.get_logger("agent_server.agent_check")

MIN_WEIGHT_PCT = 1
MAX_WEIGHT_PCT = 100
MAX_REASON_CHARS = 60
WRITE_TIMEOUT_S = 1.0


class ReplicaState(enum.IntEnum):
    LOADING = 0
    READY = 1
    DRAINING = 2
    FAILED = 3


@dataclass(frozen=True, slots=True)
class Capacity:
    state: ReplicaState
    sessions: int
    max_sessions: int
    slots_in_use: int
    waiting: int
    max_slots: int
    detail: str = ""


def weight_pct(capacity: Capacity) -> int:
    free_slots = max(0, capacity.max_slots - capacity.slots_in_use - capacity.waiting)
    free_sessions = max(0, capacity.max_sessions - capacity.sessions)
    share = min(free_slots / max(1, capacity.max_slots), free_sessions / max(1, capacity.max_sessions))
    return max(MIN_WEIGHT_PCT, min(MAX_WEIGHT_PCT, round(share * MAX_WEIGHT_PCT)))


def agent_reply(capacity: Capacity) -> str:
    """The line HAProxy reads (with its newline)."""
    if capacity.state == ReplicaState.READY:
        return f"up ready {weight_pct(capacity)}%\n"
    if capacity.state == ReplicaState.DRAINING:
        return "drain\n"
    reason = "loading" if capacity.state == ReplicaState.LOADING else "engine failed"
    detail = " ".join(f"{reason}: {capacity.detail}".split())[:MAX_REASON_CHARS] if capacity.detail else reason
    return f"down#{detail}\n"


class AgentCheckServer:
    """The TCP listener; `snapshot()` is called on the event loop for each connection."""

    def __init__(self, host: str, port: int, snapshot: Callable[[], Capacity]) -> None:
        self.host = host
        self.port = port
        self._snapshot = snapshot
        self._server: asyncio.Server | None = None
        self.replies = 0

    async def start(self) -> None:
        self._server = await asyncio.start_server(self._answer, self.host, self.port)
        log.info("agent_check_listening", host=self.host, port=self.port)

    async def stop(self) -> None:
        if self._server is not None:
            self._server.close()
            await self._server.wait_closed()
            self._server = None

    async def _answer(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            writer.write(agent_reply(self._snapshot()).encode("ascii", "replace"))
            self.replies += 1
            async with asyncio.timeout(WRITE_TIMEOUT_S):
                await writer.drain()
        except (OSError, TimeoutError):
            pass
        finally:
            writer.close()
