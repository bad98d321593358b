#!/usr/bin/env python
"""Load test of the native WebSocket protocol: N concurrent sessions streaming LLM-like text.

Each session connects, then until --duration-s runs out: opens a context, streams a reply in 1-8
character pieces at --chars-per-s, ends it, waits for context_done, pauses (the user speaks), repeats.

Reported (p50 / p95 / p99 over contexts):
- ttfa_ms: first audio frame received - first text piece sent (client clock);
- server_overhead_ms: the server's own share of it, first frame handed to the socket - the engine's
  first chunk ready (`AudioChunk.ready_monotonic_s`), both read by the server (context_done.timing);
- delivery_overhead_ms: first frame received by this client - engine's first chunk ready (valid because
  client and server share a machine and time.monotonic; includes loopback and this client's own lag);
- frames lost or reordered (per-context seq gaps/repeats, and frames of unknown streams): must be 0.

By default it starts its own server on 127.0.0.1 in a subprocess, with the FakeEngine
(tests/agent_server/fake_engine.py) behind it; --url targets a running server (loopback only).
Writes <out>/loadtest-<stamp>.json and, if matplotlib is installed, a .png of the distributions.

    python scripts/loadtest.py                       # 200 sessions, 30 s
    python scripts/loadtest.py --sessions 50 --duration-s 10
    python scripts/loadtest.py --url ws://127.0.0.1:8000/v1/stream
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import os
import random
import resource
import socket
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import urlparse

import numpy as np

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from tests.agent_server.native_client import ContextLog, NativeClient  # noqa: E402

MAX_SESSIONS = 2000
MAX_DURATION_S = 600.0
LOOPBACK_HOSTS = {"127.0.0.1", "localhost", "::1"}
SERVER_START_TIMEOUT_S = 60.0
CONTEXT_TIMEOUT_S = 120.0

REPLIES = [
    "Sure, I can help with that. Your flight to Lisbon leaves at nine fifteen tomorrow morning, from gate "
    "twelve. Would you like me to add a seat with extra legroom?",
    "Okay, let me check. The store opens at ten and closes at six on weekdays, and at four on Saturdays.",
    "Hello! I found three restaurants nearby. The closest one is Italian, about five minutes away on foot, "
    "and it has good reviews.",
    "Right, your balance is two hundred and twelve dollars. The last payment went through on Monday. "
    "Anything else I can do for you today?",
    "Got it, the meeting is moved to Thursday at three. I will send the new invitation to everyone now.",
    "I am sorry to hear that. Let me open a ticket for you, and a technician will call you back within "
    "two hours.",
]


@dataclass
class ContextResult:
    session: int
    turn: int
    reason: str
    ttfa_ms: float | None
    server_ttfa_ms: float | None
    server_overhead_ms: float | None
    delivery_overhead_ms: float | None
    frames: int
    lost_frames: int
    reordered_frames: int
    audio_ms: float


@dataclass
class SessionResult:
    contexts: list[ContextResult] = field(default_factory=list)
    connect_error: str = ""
    stray_frames: int = 0
    errors: int = 0
    closed_code: int | None = None


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--sessions", type=int, default=200)
    p.add_argument("--duration-s", type=float, default=30.0, help="how long sessions keep starting turns")
    p.add_argument("--ramp-s", type=float, default=3.0, help="spread the session starts over this long")
    p.add_argument("--chars-per-s", type=float, default=150.0, help="LLM output speed (~40 tokens/s)")
    p.add_argument("--pause-s", type=float, default=2.0, help="mean pause between turns (the user speaks)")
    p.add_argument("--encoding", default="pcm_s16le")
    p.add_argument("--sample-rate-hz", type=int, default=24000)
    p.add_argument("--frame-ms", type=int, default=20)
    p.add_argument("--url", help="a running server's native endpoint (loopback only)")
    p.add_argument("--fake-realtime-factor", type=float, default=0.5,
                   help="FakeEngine: wall seconds per second of audio (0.5: twice real time)")
    p.add_argument("--fake-first-chunk-delay-ms", type=float, default=60.0, help="FakeEngine: its TTFB")
    p.add_argument("--fake-max-slots", type=int, default=256)
    p.add_argument("--out", default=str(REPO / "out"), help="directory for the JSON and PNG")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args()
    if not 1 <= args.sessions <= MAX_SESSIONS:
        p.error(f"--sessions must be in 1..{MAX_SESSIONS}")
    if not 0 < args.duration_s <= MAX_DURATION_S:
        p.error(f"--duration-s must be in (0, {MAX_DURATION_S}]")
    if args.url and urlparse(args.url).hostname not in LOOPBACK_HOSTS:
        p.error("--url must point at this machine (127.0.0.1 / localhost / ::1)")
    return args


# ---- the server under test ----------------------------------------------------------------------


def start_server(args: argparse.Namespace, log_path: Path) -> tuple[subprocess.Popen[bytes], str]:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    fake = {
        "realtime_factor": args.fake_realtime_factor,
        "first_chunk_delay_s": args.fake_first_chunk_delay_ms / 1000.0,
        "max_slots": args.fake_max_slots,
        "max_waiting": 4 * args.fake_max_slots,
    }
    env = {
        **os.environ,
        "PYTHONPATH": str(REPO),
        "AGENT_SERVER_ENGINE_FACTORY": "tests.agent_server.fake_engine:make_engine",
        "FAKE_ENGINE_OPTIONS": json.dumps(fake),
        "AGENT_SERVER_DATA_DIR": str(log_path.parent / "loadtest-data"),
    }
    cmd = [sys.executable, "-m", "agent_server.cli", "--host", "127.0.0.1", "--port", str(port),
           "--max-sessions", str(args.sessions + 10), "--log-level", "info"]
    log_file = open(log_path, "wb")  # noqa: SIM115 - lives as long as the server
    proc = subprocess.Popen(cmd, env=env, stdout=log_file, stderr=subprocess.STDOUT)
    import httpx

    deadline_s = time.monotonic() + SERVER_START_TIMEOUT_S
    while True:
        try:
            if httpx.get(f"http://127.0.0.1:{port}/readyz", timeout=1.0).status_code == 200:
                break
        except httpx.HTTPError:
            pass
        if proc.poll() is not None or time.monotonic() > deadline_s:
            raise RuntimeError(f"server did not start; see {log_path}")
        time.sleep(0.1)
    return proc, f"ws://127.0.0.1:{port}/v1/stream"


# ---- one session --------------------------------------------------------------------------------


async def run_session(index: int, url: str, args: argparse.Namespace, start_s: float, end_s: float) -> SessionResult:
    result = SessionResult()
    rng = random.Random(args.seed * 100_003 + index)
    await asyncio.sleep(max(0.0, start_s - time.monotonic()))
    try:
        client = await NativeClient.connect(url, open_timeout=30)
    except Exception as exc:  # reported, not raised
        result.connect_error = f"{type(exc).__name__}: {exc}"
        return result
    fmt = {"encoding": args.encoding, "sample_rate_hz": args.sample_rate_hz, "frame_ms": args.frame_ms}
    turn = 0
    try:
        while time.monotonic() < end_s and client.closed is None:
            cid = f"t{turn}"
            log = await client.open(cid, output_format=fmt, seed=rng.randrange(2**31))
            await client.stream_text(cid, rng.choice(REPLIES), chars_per_s=args.chars_per_s, seed=rng.randrange(2**31))
            await asyncio.wait_for(log.finished.wait(), CONTEXT_TIMEOUT_S)
            result.contexts.append(context_result(index, turn, log))
            turn += 1
            await asyncio.sleep(rng.uniform(0.5, 1.5) * args.pause_s)
    except Exception as exc:
        result.connect_error = f"{type(exc).__name__}: {exc}"
    finally:
        result.stray_frames = client.stray_frames
        result.errors = client.errors.qsize()
        await client.close()
        result.closed_code = client.close_code
    return result


def context_result(session: int, turn: int, log: ContextLog) -> ContextResult:
    done = log.done or {}
    timing = done.get("timing") or {}
    seqs = [header.seq for header, _, _ in log.frames]
    reordered = sum(1 for a, b in itertools.pairwise(seqs) if b <= a)
    expected = done.get("frames", len(seqs))
    lost = max(0, expected - len(set(seqs))) + sum(1 for s in seqs if s >= expected)
    ttfa_ms = delivery_ms = None
    if log.first_frame_recv_s is not None and log.first_text_sent_s is not None:
        ttfa_ms = (log.first_frame_recv_s - log.first_text_sent_s) * 1000.0
    ready_s = timing.get("first_chunk_ready_monotonic_s")
    if log.first_frame_recv_s is not None and ready_s is not None:
        delivery_ms = (log.first_frame_recv_s - ready_s) * 1000.0
    return ContextResult(
        session=session,
        turn=turn,
        reason=done.get("reason", "no context_done"),
        ttfa_ms=ttfa_ms,
        server_ttfa_ms=timing.get("ttfa_ms"),
        server_overhead_ms=timing.get("server_overhead_ms"),
        delivery_overhead_ms=delivery_ms,
        frames=len(seqs),
        lost_frames=lost,
        reordered_frames=reordered,
        audio_ms=done.get("audio_ms", 0.0),
    )


# ---- report -------------------------------------------------------------------------------------


def percentiles(values: list[float]) -> dict[str, float | int | None]:
    if not values:
        return {"n": 0, "p50": None, "p95": None, "p99": None, "max": None}
    arr = np.asarray(values, dtype=np.float64)
    return {
        "n": len(values),
        "p50": round(float(np.percentile(arr, 50)), 3),
        "p95": round(float(np.percentile(arr, 95)), 3),
        "p99": round(float(np.percentile(arr, 99)), 3),
        "max": round(float(arr.max()), 3),
    }


def summarize(args: argparse.Namespace, sessions: list[SessionResult], wall_s: float) -> dict[str, Any]:
    contexts = [c for s in sessions for c in s.contexts]
    completed = [c for c in contexts if c.reason == "completed"]

    def column(name: str) -> list[float]:
        return [getattr(c, name) for c in completed if getattr(c, name) is not None]

    return {
        "config": dict(vars(args)),
        "machine": {"cpus": os.cpu_count(), "python": sys.version.split()[0]},
        "wall_s": round(wall_s, 2),
        "sessions": len(sessions),
        "sessions_failed": sum(1 for s in sessions if s.connect_error),
        "session_errors": sorted({s.connect_error for s in sessions if s.connect_error})[:5],
        "contexts": len(contexts),
        "contexts_by_reason": {r: sum(1 for c in contexts if c.reason == r)
                               for r in sorted({c.reason for c in contexts})},
        "audio_s_received": round(sum(c.audio_ms for c in completed) / 1000.0, 1),
        "frames_received": sum(c.frames for c in contexts),
        "frames_lost": sum(c.lost_frames for c in contexts),
        "frames_reordered": sum(c.reordered_frames for c in contexts),
        "stray_frames": sum(s.stray_frames for s in sessions),
        "protocol_errors": sum(s.errors for s in sessions),
        "ttfa_ms": percentiles(column("ttfa_ms")),
        "server_ttfa_ms": percentiles(column("server_ttfa_ms")),
        "server_overhead_ms": percentiles(column("server_overhead_ms")),
        "delivery_overhead_ms": percentiles(column("delivery_overhead_ms")),
    }


def plot(path: Path, sessions: list[SessionResult], summary: dict[str, Any]) -> bool:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    completed = [c for s in sessions for c in s.contexts if c.reason == "completed"]
    series = {
        "time to first audio (client)": [c.ttfa_ms for c in completed if c.ttfa_ms is not None],
        "server overhead (first frame out - engine chunk ready)": [
            c.server_overhead_ms for c in completed if c.server_overhead_ms is not None
        ],
        "delivery overhead (frame received - engine chunk ready)": [
            c.delivery_overhead_ms for c in completed if c.delivery_overhead_ms is not None
        ],
    }
    fig, axes = plt.subplots(1, len(series), figsize=(6 * len(series), 4.5))
    for ax, (title, values) in zip(axes, series.items(), strict=True):
        if values:
            ax.hist(values, bins=60, color="#3a7bd5")
            for q, style in ((50, "-"), (95, "--"), (99, ":")):
                x = float(np.percentile(values, q))
                ax.axvline(x, color="k", linestyle=style, label=f"p{q} {x:.1f} ms")
            ax.legend()
        ax.set_title(title, fontsize=10)
        ax.set_xlabel("ms")
        ax.set_ylabel("contexts")
    cfg = summary["config"]
    fig.suptitle(
        f"{summary['sessions']} sessions, {summary['contexts']} contexts, {cfg['chars_per_s']:g} chars/s, "
        f"{cfg['encoding']} {cfg['sample_rate_hz']} Hz / {cfg['frame_ms']} ms frames; "
        f"frames lost {summary['frames_lost']}, reordered {summary['frames_reordered']}"
    )
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True


async def run_all(args: argparse.Namespace, url: str) -> tuple[list[SessionResult], float]:
    t0 = time.monotonic()
    end_s = t0 + args.ramp_s + args.duration_s
    jobs = [
        run_session(i, url, args, t0 + args.ramp_s * i / max(1, args.sessions), end_s) for i in range(args.sessions)
    ]
    results = await asyncio.gather(*jobs)
    return list(results), time.monotonic() - t0


def main() -> None:
    args = parse_args()
    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft < 4 * args.sessions + 64:
        resource.setrlimit(resource.RLIMIT_NOFILE, (min(hard, 4 * args.sessions + 64), hard))
    stamp = time.strftime("%Y%m%d-%H%M%S")
    proc = None
    url = args.url
    if url is None:
        proc, url = start_server(args, out_dir / f"loadtest-{stamp}-server.log")
    try:
        sessions, wall_s = asyncio.run(run_all(args, url))
    finally:
        if proc is not None:
            proc.terminate()
            proc.wait(30)
    summary = summarize(args, sessions, wall_s)
    json_path = out_dir / f"loadtest-{stamp}.json"
    json_path.write_text(
        json.dumps({"summary": summary, "contexts": [asdict(c) for s in sessions for c in s.contexts]}, indent=1)
    )
    png_path = out_dir / f"loadtest-{stamp}.png"
    plotted = plot(png_path, sessions, summary)
    print(json.dumps(summary, indent=1))
    print(f"wrote {json_path}" + (f" and {png_path}" if plotted else " (no PNG: pip install matplotlib)"))
    if summary["frames_lost"] or summary["frames_reordered"] or summary["stray_frames"]:
        sys.exit(1)


if __name__ == "__main__":
    main()
