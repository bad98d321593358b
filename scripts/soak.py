#!/usr/bin/env python
"""Memory soak: sessions back to back, a few at a time, over every protocol family, while the server
process's RSS, threads and open file descriptors are sampled. A leak shows as RSS (or threads, or fds)
that keeps growing with the sessions after the warm-up; allocator retention levels off.

Session kinds (round robin, shuffled): native turns (PCM, mu-law, two turns, a client gone mid-turn),
ElevenLabs stream-input (MP3 and PCM, a client gone mid-turn), OpenAI speech (MP3, Opus, PCM, a response
closed after its first bytes), Cartesia `/tts/bytes`, Deepgram `/v1/speak`, and bad requests. Each must end
as its protocol says (a completed turn, the right status); a failure is counted by kind.

By default it starts the real CLI (`--weights random-tiny`: the real engine and vocoder, tiny) on a free
loopback port and stops it at the end; `--url` and `--pid` target a server already running on this machine.

    python scripts/soak.py                                   # 16 minutes or 1,500 sessions, 3 at a time
    python scripts/soak.py --minutes 2 --max-sessions 150    # a quick look
    python scripts/soak.py --url http://127.0.0.1:8000 --pid "$(pgrep -f agent-server)"

Writes <out>/soak-<stamp>.json (every sample, failures, the growth per 100 sessions after the warm-up and over
the last third) and prints the table. Run it alone: two cores are easily oversubscribed.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import socket
import subprocess
import sys
import time
from collections import Counter
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import httpx
from websockets.asyncio.client import ClientConnection, connect

REPO = Path(__file__).resolve().parent.parent
TEXTS = (
    "Sure, I can help with that.",
    "Your appointment is confirmed for Tuesday at 9:30 am. Anything else?",
    "Let me check that for you right away.",
    "The package left our warehouse this morning; it costs $4.50 to track it.",
)
TURN_TIMEOUT_S = 120.0


class Soak:
    def __init__(self, http_url: str) -> None:
        self.http = http_url.rstrip("/")
        self.ws = "ws" + self.http[len("http"):]
        self.client = httpx.AsyncClient(timeout=TURN_TIMEOUT_S)

    # ---- native -------------------------------------------------------------------------------------

    async def native(self, turns: int = 1, output_format: dict[str, Any] | None = None, leave: bool = False) -> None:
        async with connect(self.ws + "/v1/stream", max_size=None) as ws:
            assert json.loads(await ws.recv())["type"] == "session_started"
            for turn in range(turns):
                cid = f"t{turn}"
                opened: dict[str, Any] = {"type": "open", "context_id": cid, "text": random.choice(TEXTS)}
                if output_format:
                    opened["output_format"] = output_format
                await ws.send(json.dumps(opened))
                await ws.send(json.dumps({"type": "end", "context_id": cid}))
                if leave:  # gone at the first audio: the server cancels the turn
                    while not isinstance(await ws.recv(), bytes):
                        pass
                    return
                done = await _until(ws, _context_done(cid))
                assert done["reason"] == "completed", done

    async def native_bad(self) -> None:
        async with connect(self.ws + "/v1/stream") as ws:
            await ws.recv()
            await ws.send(json.dumps({"type": "open", "context_id": "x", "sampling": {"temperature": "hot"}}))
            error = await _until(ws, lambda m: m.get("type") == "error")
            assert error["field"].startswith("sampling"), error

    # ---- ElevenLabs stream-input --------------------------------------------------------------------

    async def elevenlabs(self, output_format: str, leave: bool = False) -> None:
        url = f"{self.ws}/v1/text-to-speech/default/stream-input?output_format={output_format}"
        async with connect(url, max_size=None) as ws:
            await ws.send(json.dumps({"text": " "}))
            await ws.send(json.dumps({"text": random.choice(TEXTS) + " "}))
            await ws.send(json.dumps({"text": ""}))
            if leave:
                await _until(ws, lambda m: bool(m.get("audio")))
                return
            await _until(ws, lambda m: bool(m.get("isFinal")))

    # ---- HTTP ---------------------------------------------------------------------------------------

    async def openai(self, response_format: str, leave: bool = False) -> None:
        body = {"model": "tts-1", "voice": "alloy", "input": random.choice(TEXTS), "response_format": response_format}
        async with self.client.stream("POST", self.http + "/v1/audio/speech", json=body) as response:
            assert response.status_code == 200, response.status_code
            async for chunk in response.aiter_bytes():
                if leave and chunk:
                    return  # the response closed after its first bytes: the server cancels the turn

    async def cartesia(self) -> None:
        body = {"model_id": "sonic-2", "transcript": random.choice(TEXTS), "voice": {"mode": "id", "id": "default"},
                "output_format": {"container": "raw", "encoding": "pcm_s16le", "sample_rate": 24_000}}
        response = await self.client.post(self.http + "/tts/bytes", json=body,
                                          headers={"Cartesia-Version": "2025-04-16"})
        assert response.status_code == 200 and response.content, response.status_code

    async def deepgram(self) -> None:
        query = "model=aura-2-thalia-en&encoding=linear16&container=wav"
        response = await self.client.post(f"{self.http}/v1/speak?{query}", json={"text": random.choice(TEXTS)})
        assert response.status_code == 200 and response.content[:4] == b"RIFF", response.status_code

    async def http_bad(self) -> None:
        response = await self.client.post(self.http + "/v1/audio/speech", json={"model": "tts-1", "voice": "alloy"})
        assert response.status_code == 400, response.status_code

    def kinds(self) -> dict[str, Callable[[], Awaitable[None]]]:
        mulaw = {"encoding": "mulaw", "sample_rate_hz": 8_000}
        return {
            "native": self.native, "native_mulaw": lambda: self.native(output_format=mulaw),
            "native_two_turns": lambda: self.native(turns=2), "native_left": lambda: self.native(leave=True),
            "native_bad": self.native_bad,
            "elevenlabs_mp3": lambda: self.elevenlabs("mp3_44100_128"),
            "elevenlabs_pcm": lambda: self.elevenlabs("pcm_16000"),
            "elevenlabs_left": lambda: self.elevenlabs("mp3_44100_128", leave=True),
            "openai_mp3": lambda: self.openai("mp3"), "openai_opus": lambda: self.openai("opus"),
            "openai_pcm": lambda: self.openai("pcm"), "openai_left": lambda: self.openai("mp3", leave=True),
            "cartesia_bytes": self.cartesia, "deepgram_speak": self.deepgram, "http_bad": self.http_bad,
        }


async def _until(ws: ClientConnection, done: Callable[[dict[str, Any]], bool]) -> dict[str, Any]:
    async with asyncio.timeout(TURN_TIMEOUT_S):
        async for raw in ws:
            if isinstance(raw, str):
                message: dict[str, Any] = json.loads(raw)
                if done(message):
                    return message
    raise AssertionError("the connection closed first")


def _context_done(context_id: str) -> Callable[[dict[str, Any]], bool]:
    return lambda m: m.get("type") == "context_done" and m["context_id"] == context_id


def sample(pid: int) -> dict[str, float]:
    fields = dict(line.split(":", 1) for line in Path(f"/proc/{pid}/status").read_text().splitlines())
    return {"rss_mb": int(fields["VmRSS"].split()[0]) / 1024, "threads": int(fields["Threads"]),
            "fds": len(os.listdir(f"/proc/{pid}/fd"))}


def slope_mb_per_100(points: list[dict[str, float]]) -> float | None:
    """Least-squares RSS growth per 100 sessions over `points` (None with fewer than 3)."""
    if len(points) < 3:
        return None
    xs, ys = [p["sessions"] for p in points], [p["rss_mb"] for p in points]
    mean_x, mean_y = sum(xs) / len(xs), sum(ys) / len(ys)
    spread = sum((x - mean_x) ** 2 for x in xs)
    return None if spread == 0 else 100 * sum((x - mean_x) * (y - mean_y) for x, y in zip(xs, ys, strict=True)) / spread


async def soak(args: argparse.Namespace, http_url: str, pid: int) -> dict[str, Any]:
    runner = Soak(http_url)
    kinds = runner.kinds()
    order = list(kinds)
    done, failures = 0, Counter[str]()
    samples: list[dict[str, float]] = []
    started_s = time.monotonic()
    deadline_s = started_s + 60 * args.minutes
    next_sample_s = started_s

    def take_sample() -> None:
        samples.append({"t_s": round(time.monotonic() - started_s, 1), "sessions": done, **sample(pid)})

    async def worker(index: int) -> None:
        nonlocal done
        while time.monotonic() < deadline_s and done < args.max_sessions:
            kind = order[(done + index) % len(order)]
            try:
                await kinds[kind]()
            except Exception as exc:  # counted, never fatal: the soak is about the server's memory
                failures[f"{kind}: {type(exc).__name__}: {str(exc)[:80]}"] += 1
            done += 1

    workers = [asyncio.create_task(worker(i)) for i in range(args.concurrency)]
    while not all(w.done() for w in workers):
        if time.monotonic() >= next_sample_s:
            take_sample()
            next_sample_s += args.sample_s
        await asyncio.sleep(0.2)
    await asyncio.gather(*workers)
    await runner.client.aclose()
    await asyncio.sleep(args.sample_s)  # idle: the encoders' threads go, the last turns' buffers are freed
    take_sample()
    warm = [s for s in samples if s["sessions"] >= args.warmup_sessions]
    last_third = [s for s in samples if s["sessions"] >= 2 * done / 3]
    return {"sessions": done, "seconds": round(time.monotonic() - started_s, 1), "concurrency": args.concurrency,
            "failures": dict(failures), "samples": samples,
            "rss_mb_per_100_sessions_after_warmup": slope_mb_per_100(warm),
            "rss_mb_per_100_sessions_last_third": slope_mb_per_100(last_third)}


def start_server(weights: str) -> tuple[subprocess.Popen[bytes], str]:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    command = [sys.executable, "-m", "agent_server.cli", "--weights", weights, "--port", str(port),
               "--log-level", "warning"]
    server = subprocess.Popen(command, cwd=REPO)
    url = f"http://127.0.0.1:{port}"
    deadline_s = time.monotonic() + 300
    while time.monotonic() < deadline_s:
        try:
            if httpx.get(url + "/readyz", timeout=1.0).status_code == 200:
                return server, url
        except httpx.HTTPError:
            pass
        if server.poll() is not None:
            raise SystemExit(f"the server exited ({server.returncode}) before it was ready")
        time.sleep(0.5)
    server.terminate()
    raise SystemExit("the server was not ready within 300 s")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--minutes", type=float, default=16.0)
    p.add_argument("--max-sessions", type=int, default=1500)
    p.add_argument("--concurrency", type=int, default=3)
    p.add_argument("--warmup-sessions", type=int, default=100)
    p.add_argument("--sample-s", type=float, default=10.0)
    p.add_argument("--weights", default="random-tiny", help="for the server it starts")
    p.add_argument("--url", help="a running server (this machine), with --pid")
    p.add_argument("--pid", type=int, help="that server's process id")
    p.add_argument("--out", default=str(REPO / "out"))
    args = p.parse_args()
    if (args.url is None) != (args.pid is None):
        p.error("--url and --pid go together")
    server = None
    if args.url is None:
        server, url = start_server(args.weights)
        pid = server.pid
    else:
        url, pid = args.url, args.pid
    try:
        report = asyncio.run(soak(args, url, pid))
    finally:
        if server is not None:
            server.terminate()
            server.wait(timeout=60)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    path = out / f"soak-{time.strftime('%Y%m%d-%H%M%S')}.json"
    path.write_text(json.dumps(report, indent=1))
    print(f"{'t (s)':>7} {'sessions':>8} {'RSS MB':>8} {'threads':>7} {'fds':>4}")
    for s in report["samples"]:
        print(f"{s['t_s']:>7.0f} {s['sessions']:>8.0f} {s['rss_mb']:>8.0f} {s['threads']:>7.0f} {s['fds']:>4.0f}")
    print(f"sessions {report['sessions']} in {report['seconds']} s; failures {report['failures'] or 'none'}")
    for name in ("rss_mb_per_100_sessions_after_warmup", "rss_mb_per_100_sessions_last_third"):
        value = report[name]
        print(f"{name}: {'n/a' if value is None else f'{value:+.1f}'}")
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
