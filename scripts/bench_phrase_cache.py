#!/usr/bin/env python
"""Time to first audio of a phrase-cache hit vs a miss, on two real replicas sharing a real redis-server.

For each of --phrases distinct seeded phrases, in this order:
  miss        replica A renders it (the engine's time to first audio)
  hit_remote  replica B has never seen it: its first audio comes from Redis
  hit_local   B again: from its own memory
Every hit is checked to be bit-identical to the miss and marked `cached`. TTFA is client-side: the `open`
carrying the text sent -> the first audio frame received. Prints and writes a JSON summary (ms: p50/p90/p99/max).

    python scripts/bench_phrase_cache.py                                # tiny random Turbo (CI-sized)
    python scripts/bench_phrase_cache.py --weights random-full --phrases 10
Needs redis-server (scripts/ci_scale_deps.sh). Loopback only; stops everything it started.
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from tests.agent_server.native_client import ContextLog, NativeClient  # noqa: E402
from tests.deploy.cluster import (  # noqa: E402
    Replica,
    cluster,
    latency_summary_ms,
    machine,
    write_summary,
)

MAX_PHRASES = 200
SEED_BASE = 9000
PHRASES = [
    "One moment, please.",
    "Thanks for calling, how can I help you today?",
    "Sure, let me check that for you.",
    "Sorry, I didn't catch that. Could you say it again?",
    "Your order is on its way.",
]


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--variant", default="turbo")
    parser.add_argument("--weights", default="random-tiny")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--phrases", type=int, default=20)
    parser.add_argument("--out", type=Path, default=REPO / "out" / "bench")
    args = parser.parse_args()
    if not 1 <= args.phrases <= MAX_PHRASES:
        parser.error(f"--phrases must be in 1..{MAX_PHRASES}")
    return args


async def ask(replica: Replica, text: str, seed: int) -> ContextLog:
    client = await NativeClient.connect(replica.ws_url)
    log = await client.open("c", text=text, seed=seed)
    await client.end("c")
    await asyncio.wait_for(log.finished.wait(), 300)
    await client.close()
    if log.done is None or log.done["reason"] != "completed" or not log.frames:
        raise RuntimeError(f"the turn did not complete: {log.done}")
    return log


def ttfa_s(log: ContextLog) -> float:
    assert log.first_text_sent_s is not None and log.first_frame_recv_s is not None
    return log.first_frame_recv_s - log.first_text_sent_s


async def measure(a: Replica, b: Replica, phrases: int) -> dict[str, list[float]]:
    times: dict[str, list[float]] = {"miss": [], "hit_remote": [], "hit_local": []}
    for i in range(phrases):
        text, seed = f"{PHRASES[i % len(PHRASES)]} ({i})", SEED_BASE + i
        miss = await ask(a, text, seed)
        await asyncio.sleep(0.2)  # the store to Redis is in the background
        for kind in ("hit_remote", "hit_local"):
            hit = await ask(b, text, seed)
            if not all(s["cached"] for s in hit.segments_started) or hit.audio != miss.audio:
                raise RuntimeError(f"{kind} of phrase {i} was not a bit-identical cache hit")
            times[kind].append(ttfa_s(hit))
        if any(s["cached"] for s in miss.segments_started):
            raise RuntimeError(f"phrase {i} was not a miss the first time")
        times["miss"].append(ttfa_s(miss))
    return times


def main() -> None:
    args = parse_args()
    env = {"AGENT_SERVER_VARIANT": args.variant, "AGENT_SERVER_WEIGHTS": args.weights,
           "AGENT_SERVER_DEVICE": args.device}
    started_s = time.monotonic()
    with (tempfile.TemporaryDirectory(prefix="bench-phrase-cache-") as tmp,
          cluster(Path(tmp), replicas=2, env=env, balancer=False) as fleet):
        times = asyncio.run(measure(fleet.replicas[0], fleet.replicas[1], args.phrases))
    summary = {
        "command": " ".join(sys.argv),
        "machine": machine(),
        "config": {"variant": args.variant, "weights": args.weights, "device": args.device, "phrases": args.phrases},
        "ttfa_ms": {kind: latency_summary_ms(values) for kind, values in times.items()},
        "wall_s": round(time.monotonic() - started_s, 1),
    }
    write_summary(args.out, "bench-phrase-cache", summary)


if __name__ == "__main__":
    main()
