#!/usr/bin/env python
"""The load balancer's added latency: the same load straight to one replica, and through HAProxy
(deploy/haproxy/haproxy.cfg) to three, on loopback with a real redis-server.

Three runs, each --clients concurrent sessions per replica doing --turns turns (a seeded reply sent whole,
`cache: false` so the engine works every turn; a short pause between turns):
  direct_1       --clients sessions straight to replica r1
  haproxy_3      3 x --clients sessions through HAProxy (the same load per replica)
  haproxy_3_same --clients sessions through HAProxy (the same total load as direct_1)
Per run, in ms (p50/p90/p99/max): the WebSocket handshake (connect -> session_started) and time to first
audio (open sent -> first frame). The balancer's added latency is haproxy_3 minus direct_1.

    python scripts/bench_balancer.py                        # the fake engine: what is measured is the path
    python scripts/bench_balancer.py --engine tiny          # the tiny random Turbo model behind it
Needs redis-server and haproxy (scripts/ci_scale_deps.sh). Loopback only; stops everything it started.
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from tests.agent_server.native_client import NativeClient  # noqa: E402
from tests.deploy.cluster import cluster, latency_summary_ms, machine, write_summary  # noqa: E402

MAX_CLIENTS = 64
MAX_TURNS = 100
PAUSE_S = 0.05
REPLY = "Sure, I can help with that. Your table for two is booked for eight o'clock tonight."


@dataclass
class RunTimes:
    handshake_s: list[float] = field(default_factory=list)
    ttfa_s: list[float] = field(default_factory=list)
    failed_turns: int = 0


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--engine", choices=("fake", "tiny"), default="fake")
    parser.add_argument("--clients", type=int, default=8, help="concurrent sessions per replica")
    parser.add_argument("--turns", type=int, default=10, help="turns per session")
    parser.add_argument("--out", type=Path, default=REPO / "out" / "bench")
    args = parser.parse_args()
    if not 1 <= args.clients <= MAX_CLIENTS or not 1 <= args.turns <= MAX_TURNS:
        parser.error(f"--clients must be in 1..{MAX_CLIENTS} and --turns in 1..{MAX_TURNS}")
    return args


async def session(url: str, index: int, turns: int, times: RunTimes) -> None:
    started_s = time.monotonic()
    client = await NativeClient.connect(url)
    if client.hello.get("type") != "session_started":
        raise RuntimeError(f"refused: {client.hello}")
    times.handshake_s.append(time.monotonic() - started_s)
    for turn in range(turns):
        context_id = f"t{turn}"
        log = await client.open(context_id, text=REPLY, seed=index * MAX_TURNS + turn, cache=False)
        await client.end(context_id)
        await asyncio.wait_for(log.finished.wait(), 300)
        if log.done is None or log.done["reason"] != "completed" or log.first_frame_recv_s is None:
            times.failed_turns += 1
        elif log.first_text_sent_s is not None:
            times.ttfa_s.append(log.first_frame_recv_s - log.first_text_sent_s)
        await asyncio.sleep(PAUSE_S)
    await client.close()


async def run(url: str, sessions: int, turns: int) -> RunTimes:
    times = RunTimes()
    await asyncio.gather(*(session(url, i, turns, times) for i in range(sessions)))
    return times


def main() -> None:
    args = parse_args()
    env = {"AGENT_SERVER_MAX_SESSIONS": str(4 * args.clients), "AGENT_SERVER_MAX_SLOTS": str(max(4, args.clients))}
    if args.engine == "fake":
        env["AGENT_SERVER_ENGINE_FACTORY"] = "tests.agent_server.fake_engine:make_engine"
    started_s = time.monotonic()
    results: dict[str, RunTimes] = {}
    with tempfile.TemporaryDirectory(prefix="bench-balancer-") as tmp, cluster(Path(tmp), replicas=3, env=env) as fleet:
        direct, proxy = fleet.replicas[0].ws_url, fleet.balancer.ws_url
        results["direct_1"] = asyncio.run(run(direct, args.clients, args.turns))
        results["haproxy_3"] = asyncio.run(run(proxy, 3 * args.clients, args.turns))
        results["haproxy_3_same"] = asyncio.run(run(proxy, args.clients, args.turns))
    runs: dict[str, dict[str, Any]] = {
        name: {"handshake_ms": latency_summary_ms(t.handshake_s), "ttfa_ms": latency_summary_ms(t.ttfa_s),
               "failed_turns": t.failed_turns}
        for name, t in results.items()
    }
    summary: dict[str, object] = {
        "command": " ".join(sys.argv),
        "machine": machine(),
        "config": {"engine": args.engine, "clients_per_replica": args.clients, "turns": args.turns},
        "runs": runs,
        "wall_s": round(time.monotonic() - started_s, 1),
    }
    base, proxied = runs["direct_1"], runs["haproxy_3"]
    summary["added_by_balancer_ms"] = {
        metric: {q: round(proxied[metric][q] - base[metric][q], 3) for q in ("p50", "p99")
                 if proxied[metric][q] is not None and base[metric][q] is not None}
        for metric in ("handshake_ms", "ttfa_ms")
    }
    write_summary(args.out, "bench-balancer", summary)


if __name__ == "__main__":
    main()
