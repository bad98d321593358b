#!/usr/bin/env python
"""How long after a client stops reading does the server cut it, on a quiet and on a loaded machine?

Starts `agent-server` (fake engine, defaults: slow_client_stall_s 3 s) in a subprocess, optionally
loads the machine (`--load-sessions` native clients speaking without pause, `--cpu-hogs` busy
processes), then opens `--non-readers` clients that ask for a long turn at 48 kHz and never read (a 4 KiB
receive window). From the server's log it reports, per non-reader, the time from its session opening to
its `dropped_slow_client` line (the issue's bound: <= 5 s whatever the load), and the p50/max over them.

    python scripts/bench_slow_client.py                                   # quiet: ~15 s
    python scripts/bench_slow_client.py --load-sessions 40 --cpu-hogs 2   # loaded: ~20 s
"""

from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from datetime import datetime
from pathlib import Path
from typing import Any

import httpx
import orjson
from websockets.asyncio.client import ClientConnection, connect

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

TEXT = " ".join(["Your flight to Lisbon leaves at nine fifteen tomorrow morning, from gate twelve."] * 40)
SENTENCE = "Sure, I can help with that right away. "
CUT_BOUND_S = 5.0


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


def hog(stop_at: float) -> None:
    while time.monotonic() < stop_at:
        pass


async def non_reader(url: str, port: int) -> ClientConnection:
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    sock.connect(("127.0.0.1", port))
    ws = await connect(url, sock=sock, max_queue=1, max_size=None)
    await ws.recv()  # session_started
    fmt = {"encoding": "pcm_s16le", "sample_rate_hz": 48000, "frame_ms": 10}
    await ws.send(orjson.dumps({"type": "open", "context_id": "hog", "output_format": fmt, "text": TEXT}).decode())
    await ws.send(orjson.dumps({"type": "end", "context_id": "hog"}).decode())
    return ws


async def speaker(url: str, until_s: float) -> None:
    async with connect(url, max_size=None) as ws:
        await ws.recv()
        turn = 0
        while time.monotonic() < until_s:
            cid = f"t{turn}"
            await ws.send(orjson.dumps({"type": "open", "context_id": cid, "text": SENTENCE * 3}).decode())
            await ws.send(orjson.dumps({"type": "end", "context_id": cid}).decode())
            async for message in ws:
                if isinstance(message, str) and orjson.loads(message).get("type") == "context_done":
                    break
            turn += 1


def stamp(line: dict[str, Any]) -> float:
    return datetime.fromisoformat(str(line["timestamp"]).replace("Z", "+00:00")).timestamp()


async def scenario(args: argparse.Namespace, port: int) -> None:
    url = f"ws://127.0.0.1:{port}/v1/stream"
    until_s = time.monotonic() + args.run_s
    speakers = [asyncio.create_task(speaker(url, until_s)) for _ in range(args.load_sessions)]
    await asyncio.sleep(1.0 if speakers else 0.0)  # the load is on before the non-readers come
    readers_from_s = time.monotonic()
    readers = [await non_reader(url, port) for _ in range(args.non_readers)]
    await asyncio.gather(*speakers, return_exceptions=True)
    await asyncio.sleep(max(0.0, readers_from_s + CUT_BOUND_S * 2 - time.monotonic()))  # time to be cut
    for ws in readers:
        ws.transport.abort()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--non-readers", type=int, default=4)
    parser.add_argument("--load-sessions", type=int, default=0)
    parser.add_argument("--cpu-hogs", type=int, default=0)
    parser.add_argument("--run-s", type=float, default=12.0, help="how long the load runs")
    parser.add_argument("--fake-realtime-factor", type=float, default=0.1)
    args = parser.parse_args()
    port = free_port()
    with tempfile.TemporaryDirectory() as tmp:
        log_path = Path(tmp) / "server.log"
        env = {**os.environ, "PYTHONPATH": str(REPO), "PORT": str(port), "AGENT_SERVER_DATA_DIR": tmp,
               "AGENT_SERVER_ENGINE_FACTORY": "tests.agent_server.fake_engine:make_engine",
               "AGENT_SERVER_LOG_LEVEL": "info", "AGENT_SERVER_MAX_SESSIONS": "1000",
               "FAKE_ENGINE_OPTIONS": json.dumps({"realtime_factor": args.fake_realtime_factor, "max_slots": 256})}
        with open(log_path, "w") as log_file:
            server = subprocess.Popen([sys.executable, "-m", "agent_server.cli", "--host", "127.0.0.1"], env=env,
                                      stderr=log_file, stdout=subprocess.DEVNULL)
        hogs: list[multiprocessing.Process] = []
        try:
            deadline_s = time.monotonic() + 30
            while True:
                try:
                    if httpx.get(f"http://127.0.0.1:{port}/readyz", timeout=1).status_code == 200:
                        break
                except httpx.HTTPError:
                    pass
                if time.monotonic() > deadline_s:
                    raise SystemExit("the server did not get ready")
                time.sleep(0.1)
            stop_at = time.monotonic() + args.run_s + 2
            hogs = [multiprocessing.Process(target=hog, args=(stop_at,)) for _ in range(args.cpu_hogs)]
            for process in hogs:
                process.start()
            asyncio.run(scenario(args, port))
        finally:
            for process in hogs:
                process.terminate()
            server.terminate()
            server.wait(30)
        lines = [orjson.loads(line) for line in log_path.read_text().splitlines() if line.startswith("{")]
    hog_sessions = {line["session_id"]: stamp(line) for line in lines
                    if line.get("event") == "context_done" and line.get("context_id") == "hog"}
    opened = {line["session_id"]: stamp(line) for line in lines if line.get("event") == "session_opened"}
    cuts = sorted(stamp(line) - opened[line["session_id"]] for line in lines
                  if line.get("event") == "dropped_slow_client" and line.get("session_id") in opened)
    result = {"non_readers": args.non_readers, "cut": len(cuts), "hog_contexts_done": len(hog_sessions),
              "load_sessions": args.load_sessions, "cpu_hogs": args.cpu_hogs,
              "cut_after_open_s": [round(c, 3) for c in cuts],
              "p50_s": round(statistics.median(cuts), 3) if cuts else None,
              "max_s": round(max(cuts), 3) if cuts else None, "bound_s": CUT_BOUND_S}
    print(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
