#!/usr/bin/env python
"""Capacity of the real server: N native-protocol sessions at once, each streaming an LLM reply.

For each checkout given (--repo, default this one) it starts `python -m agent_server.cli` from that checkout
(PYTHONPATH set to it) on a free port, with the chosen variant and weights, and for each N in --sessions runs N
sessions at once. Each session connects, opens a context, streams a ~170-character reply in 1-8 character
pieces at --chars-per-s (an LLM's pace), ends it and waits for context_done. Reported per N:

- time to first audio (first audio frame received - first text piece sent), p50 and p95 over sessions;
- aggregate audio delivered per wall second (audio seconds received by all sessions / the round's wall time,
  first text sent to last frame received);
- playback underruns: each client starts playing at its first frame and plays in real time; whenever the next
  frame has not arrived when the audio before it has finished playing, it runs dry until it arrives. Per
  session: seconds dry and how many times; reported as the mean and p95 over sessions, and the count in all.

Output: a table on stdout, <out>.json, and <out>.png when matplotlib is installed (the `loadtest` extra).
Run the old and the new code side by side in one run (same machine state, alternating nothing: one checkout
after the other):

    python scripts/bench_capacity.py --variant turbo --weights random-full --sessions 1 2 4 8 16 \\
        --repo old=/path/to/checkout-at-ece70d8 --repo new=. --out out/capacity_turbo

Anything after `--` goes to every server (e.g. `-- --cpu-weights bf16 --threads 1,1`; an older checkout may not
know a flag: then give it only where it applies, with --server-args-for LABEL="..."). --busy-cores K keeps K
other processes spinning during the measured rounds (the "one core taken by another process" experiment).
--weights random-tiny runs end to end in a minute (tests/synth/test_bench_capacity.py).

--job-load K (issue 36: jobs fill the rows live calls leave idle): after the live rounds above (round A: live
alone), K jobs of --job-chars characters are submitted through POST /v1/jobs (a backlog that outlasts the run);
a jobs-only window of --job-window-s, opened once the first job segment is stored (the pipeline is full),
measures the saturation audio-s/s (the engine's, from /metrics); then for each N round B runs the same live
sessions beside the backlog. Per N: live first audio p50/p95 B against A (target: B p95 <= 1.1x A p95), live
audio-s/s, job audio-s/s (the engine's audio in the round minus the live audio received; also the job audio
stored, counted as whole segments end), and "unused capacity used" = job audio-s/s / (saturation - live audio-s/s)
(target >= 80 %). The jobs are cancelled at the end. A p95 over one session is that
session's figure: --repeat R runs every round R times in a row and pools them (N x R first audios per round).
--think-s S puts S seconds between those turns, as a caller speaking between replies: live calls are bursty, and
the engine idles between turns. In round B the live and the job audio-s/s are over the round's whole wall time,
thinking included, so the room the jobs may fill is the idle time as well as the rows live leaves free; "idle
filled" = the round's job audio / (saturation x the seconds between turns): what the jobs made of the idle time
alone (above 100 %: they also took some of the turns' room).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing
import os
import platform
import shlex
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Self

import numpy as np
import orjson
from websockets.asyncio.client import connect

# the client side always runs from this checkout (the servers from --repo)
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from agent_server.protocols.native_wire import FRAME_HEADER_BYTES

from tests.agent_server.native_client import llm_pieces

REPO = Path(__file__).resolve().parents[1]

SAMPLE_RATE_HZ = 24_000
BYTES_PER_SAMPLE = 2  # pcm_s16le
SERVER_START_TIMEOUT_S = 900.0  # full-size models load and warm up (English prepares its voice prompt)
DEFAULT_REPLY = ("Sure, I can help with that. Your flight to Lisbon leaves at nine fifteen tomorrow morning from "
                 "gate twelve, and boarding starts forty minutes before. Want me to add a seat with extra legroom?")
RANDOM_WEIGHTS_MAX_NEW_TOKENS = 90  # random weights never say EOS: cap a segment near what real speech takes


@dataclass
class SessionResult:
    ok: bool
    error: str = ""
    first_text_s: float = 0.0
    ttfa_s: float | None = None
    audio_s: float = 0.0
    last_frame_s: float = 0.0
    frames: int = 0
    underrun_s: float = 0.0
    underruns: int = 0
    reason: str = ""


@dataclass
class RoundResult:
    sessions: int
    ok: int
    failed: int
    errors: list[str]
    wall_s: float
    audio_s: float
    audio_s_per_wall_s: float
    ttfa_p50_s: float | None
    ttfa_p95_s: float | None
    underrun_mean_s: float
    underrun_p95_s: float
    underruns: int
    sessions_with_underrun: int


@dataclass
class RepoRun:
    label: str
    repo: str
    commit: str
    server_args: list[str]
    variant: str
    random_weights: bool | None
    rounds: list[RoundResult] = field(default_factory=list)
    engine_after: dict[str, Any] = field(default_factory=dict)  # /v1/status's engine after the rounds
    error: str = ""  # the server did not start (or died): why, with its log's tail
    ready_s: float | None = None  # from the server's launch to its first ready answer (build, warm-up, graphs)
    saturation: dict[str, float] = field(default_factory=dict)  # --job-load: the jobs-only window
    job_rounds: list[JobRound] = field(default_factory=list)  # --job-load: round B per N


@dataclass
class JobRound:
    """Round B of --job-load: the live sessions beside a job backlog, and what the jobs got meanwhile."""

    live: RoundResult
    wall_s: float  # the round, measured around it (the engine's and the stored audio are counted over this)
    live_audio_s_per_wall_s: float
    engine_audio_s_per_wall_s: float
    job_audio_s_per_wall_s: float  # engine audio - live audio received
    job_stored_audio_s_per_wall_s: float  # tts_jobs_audio_seconds_total (whole segments, as they end)
    ttfa_p95_vs_alone: float | None  # B p95 / A p95
    unused_capacity_used: float | None  # job audio-s/s / (saturation - live audio-s/s)
    # --think-s: the job audio of the round / (saturation x the seconds between turns): above 1, the jobs filled the
    # idle time and took some of the turns' too (None without thinking)
    idle_time_filled: float | None = None


# the engine's CUDA graph state, printed after a checkout's rounds (older checkouts lack it)
GRAPH_KEYS = ("cuda_graphs", "cuda_graphs_state", "cuda_graphs_reason", "cuda_graphs_count", "cuda_graphs_capture_s",
              "cuda_graphs_pool_mb", "cuda_graphs_parity", "overlap_steps", "vocoder_graphs_state", "vocoder_tf32",
              "max_slots")
# the engine's thread-lease counters, printed after a checkout's rounds (older checkouts lack some)
LEASE_KEYS = ("decode_threads", "vocoder_threads", "lend_threads", "lent_ticks", "decode_waits_for_lent_ticks",
              "decode_borrows_threads", "borrowed_steps", "render_waits_for_borrowed_steps",
              "lent_ticks_beside_a_decode_team", "borrow_gain_ms")


def playback(frames: list[tuple[float, float]]) -> tuple[float, int]:
    """(receive time, duration) of each frame in order -> (seconds dry, times dry) of a real-time player that
    starts at the first frame."""
    dry_s, times = 0.0, 0
    play_end: float | None = None
    for received_s, duration_s in frames:
        if play_end is not None and received_s > play_end:
            dry_s += received_s - play_end
            times += 1
            play_end = received_s
        play_end = (received_s if play_end is None else play_end) + duration_s
    return dry_s, times


async def one_session(url: str, index: int, text: str, chars_per_s: float, max_new_tokens: int, seed: int | None,
                      timeout_s: float) -> SessionResult:
    frames: list[tuple[float, float]] = []
    result = SessionResult(ok=False)
    try:
        async with connect(url, max_size=None, compression=None, open_timeout=60) as ws:
            hello = orjson.loads(await ws.recv())
            if hello.get("type") != "session_started":
                raise RuntimeError(f"unexpected first message {hello}")
            context = f"c{index}"
            open_msg: dict[str, Any] = {"type": "open", "context_id": context}
            if max_new_tokens:
                open_msg["sampling"] = {"max_new_tokens": max_new_tokens}
            if seed is not None:
                open_msg["seed"] = seed + index
            await ws.send(orjson.dumps(open_msg).decode())
            done = asyncio.Event()

            async def read() -> None:
                async for raw in ws:
                    now_s = time.monotonic()
                    if isinstance(raw, bytes):
                        payload = len(raw) - FRAME_HEADER_BYTES
                        frames.append((now_s, payload / BYTES_PER_SAMPLE / SAMPLE_RATE_HZ))
                        continue
                    event = orjson.loads(raw)
                    kind = event.get("type")
                    if kind in ("error", "busy"):
                        result.error = f"{kind}: {event.get('message') or event.get('reason') or event}"
                        done.set()
                        return
                    if kind == "context_done":
                        result.reason = str(event.get("reason"))
                        done.set()
                        return

            reader = asyncio.create_task(read())
            result.first_text_s = time.monotonic()
            for piece in llm_pieces(text, seed=index):
                await ws.send(orjson.dumps({"type": "text", "context_id": context, "text": piece}).decode())
                await asyncio.sleep(len(piece) / chars_per_s)
            await ws.send(orjson.dumps({"type": "end", "context_id": context}).decode())
            await asyncio.wait_for(done.wait(), timeout_s)
            reader.cancel()
    except Exception as exc:  # a failed session is a result, not a crash of the benchmark
        result.error = result.error or f"{type(exc).__name__}: {exc}"
    result.frames = len(frames)
    if frames:
        result.ttfa_s = frames[0][0] - result.first_text_s
        result.audio_s = sum(d for _, d in frames)
        result.last_frame_s = frames[-1][0]
        result.underrun_s, result.underruns = playback(frames)
    result.ok = not result.error and result.reason == "completed" and bool(frames)
    if not result.ok and not result.error:
        result.error = f"context ended {result.reason or 'without context_done'}"
    return result


async def one_round(url: str, sessions: int, args: argparse.Namespace, max_new_tokens: int) -> RoundResult:
    """N sessions at once, --repeat times one after the other (--think-s apart); the figures pool every repetition's
    sessions (a p95 of one session's first audio is that one figure: --repeat gives the percentiles samples). The
    round's wall time counts the turns only, not the thinking between them."""
    results: list[SessionResult] = []
    wall_s = 0.0
    for repetition in range(max(1, args.repeat)):
        if repetition and args.think_s > 0:
            await asyncio.sleep(args.think_s)  # the caller speaks: the engine has nothing live to do
        batch = await asyncio.gather(*(one_session(url, i, args.text, args.chars_per_s, max_new_tokens, args.seed,
                                                   args.session_timeout_s) for i in range(sessions)))
        started = min(r.first_text_s for r in batch)
        ended = max((r.last_frame_s for r in batch if r.frames), default=started)
        wall_s += max(ended - started, 1e-9)
        results.extend(batch)
    ok = [r for r in results if r.ok]
    audio_s = sum(r.audio_s for r in results)
    ttfas = [r.ttfa_s for r in ok if r.ttfa_s is not None]
    dry = [r.underrun_s for r in ok]
    return RoundResult(
        sessions=sessions, ok=len(ok), failed=len(results) - len(ok),
        errors=sorted({r.error for r in results if r.error}),
        wall_s=wall_s, audio_s=audio_s, audio_s_per_wall_s=audio_s / wall_s,
        ttfa_p50_s=float(np.percentile(ttfas, 50)) if ttfas else None,
        ttfa_p95_s=float(np.percentile(ttfas, 95)) if ttfas else None,
        underrun_mean_s=float(np.mean(dry)) if dry else 0.0,
        underrun_p95_s=float(np.percentile(dry, 95)) if dry else 0.0,
        underruns=sum(r.underruns for r in ok), sessions_with_underrun=sum(1 for r in ok if r.underruns))


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


def http_json(url: str) -> Any:
    with urllib.request.urlopen(url, timeout=2) as response:
        return json.loads(response.read())


def metric_sums(port: int, names: tuple[str, ...]) -> dict[str, float]:
    """The sum over label sets of each named series in the server's /metrics (0 when absent)."""
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as answer:
        text = answer.read().decode()
    sums = dict.fromkeys(names, 0.0)
    for line in text.splitlines():
        name = line.split("{", 1)[0].split(" ", 1)[0]
        if name in sums:
            sums[name] += float(line.rsplit(" ", 1)[1])
    return sums


ENGINE_AUDIO = "tts_engine_audio_seconds_total"
JOB_AUDIO = "tts_jobs_audio_seconds_total"
JOBS_RUNNING = "tts_jobs_running"


def job_text(chars: int, index: int) -> str:
    sentences: list[str] = []
    n = 0
    while sum(len(x) + 1 for x in sentences) < chars:
        n += 1
        sentences.append(f"Chapter {index}, passage {n}: the long job keeps reading while the calls come and go.")
    return " ".join(sentences)[:chars]


def submit_jobs(port: int, count: int, chars: int) -> list[str]:
    ids = []
    for index in range(count):
        body = orjson.dumps({"text": job_text(chars, index), "seed": index})
        request = urllib.request.Request(f"http://127.0.0.1:{port}/v1/jobs", data=body, method="POST",
                                         headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(request, timeout=120) as answer:
            ids.append(orjson.loads(answer.read())["id"])
    return ids


def cancel_jobs(port: int, ids: list[str]) -> None:
    for job_id in ids:
        request = urllib.request.Request(f"http://127.0.0.1:{port}/v1/jobs/{job_id}", method="DELETE")
        try:
            urllib.request.urlopen(request, timeout=30).read()
        except OSError:
            pass


def job_rounds(server: Server, run: RepoRun, args: argparse.Namespace, max_new: int, label: str,
               save: Callable[[], None]) -> None:
    """--job-load: the backlog, the jobs-only saturation window, then round B per N."""
    ids = submit_jobs(server.port, args.job_load, args.job_chars)
    try:
        deadline_s = time.monotonic() + 120
        while metric_sums(server.port, (JOBS_RUNNING,))[JOBS_RUNNING] < min(args.job_load, 1):
            if time.monotonic() > deadline_s:
                raise TimeoutError("no job started in 120 s")
            time.sleep(0.2)
        # the window opens once a job segment has come out of the whole pipeline (T3, then the vocoder, then the
        # store): at full size on a CPU that takes longer than a short window, which then measures the fill
        while metric_sums(server.port, (JOB_AUDIO,))[JOB_AUDIO] <= 0:
            if time.monotonic() > deadline_s + args.session_timeout_s:
                raise TimeoutError(f"no job segment stored in {args.session_timeout_s:.0f} s")
            time.sleep(0.2)
        before = metric_sums(server.port, (ENGINE_AUDIO, JOB_AUDIO))
        started_s = time.monotonic()
        time.sleep(args.job_window_s)
        after = metric_sums(server.port, (ENGINE_AUDIO, JOB_AUDIO))
        window_s = time.monotonic() - started_s
        run.saturation = {"window_s": window_s,
                          "engine_audio_s_per_wall_s": (after[ENGINE_AUDIO] - before[ENGINE_AUDIO]) / window_s,
                          "job_stored_audio_s_per_wall_s": (after[JOB_AUDIO] - before[JOB_AUDIO]) / window_s}
        saturation = run.saturation["engine_audio_s_per_wall_s"]
        print(f"[{label}] jobs alone: {saturation:.3f} audio-s/s (engine), "
              f"{run.saturation['job_stored_audio_s_per_wall_s']:.3f} stored", flush=True)
        alone = {r.sessions: r for r in run.rounds}
        for sessions in args.sessions:
            before = metric_sums(server.port, (ENGINE_AUDIO, JOB_AUDIO))
            started_s = time.monotonic()
            live = asyncio.run(one_round(server.url, sessions, args, max_new))
            wall_s = time.monotonic() - started_s
            after = metric_sums(server.port, (ENGINE_AUDIO, JOB_AUDIO))
            live_aps = live.audio_s / wall_s
            engine_aps = (after[ENGINE_AUDIO] - before[ENGINE_AUDIO]) / wall_s
            job_aps = max(0.0, engine_aps - live_aps)
            a = alone.get(sessions)
            ratio = (live.ttfa_p95_s / a.ttfa_p95_s if a is not None and a.ttfa_p95_s and live.ttfa_p95_s is not None
                     else None)
            room = saturation - live_aps
            result = JobRound(live=live, wall_s=wall_s, live_audio_s_per_wall_s=live_aps,
                              engine_audio_s_per_wall_s=engine_aps, job_audio_s_per_wall_s=job_aps,
                              job_stored_audio_s_per_wall_s=(after[JOB_AUDIO] - before[JOB_AUDIO]) / wall_s,
                              ttfa_p95_vs_alone=ratio, unused_capacity_used=job_aps / room if room > 0 else None)
            idle_s = (max(1, args.repeat) - 1) * args.think_s
            if idle_s > 0 and saturation > 0:
                result.idle_time_filled = job_aps * wall_s / (saturation * idle_s)
            run.job_rounds.append(result)
            print(f"[{label}] N={sessions} + jobs: {format_row(live)}; jobs {job_aps:.3f} audio-s/s", flush=True)
            save()
    finally:
        cancel_jobs(server.port, ids)


def git_commit(repo: Path) -> str:
    try:
        return subprocess.run(["git", "-C", str(repo), "rev-parse", "--short", "HEAD"], capture_output=True,
                              text=True, timeout=10, check=False).stdout.strip() or "unknown"
    except (OSError, subprocess.SubprocessError):
        return "unknown"


class Server:
    """`python -m agent_server.cli` from one checkout, on a free port, logging to a file."""

    def __init__(self, repo: Path, args: argparse.Namespace, extra: list[str], log_path: Path) -> None:
        self.port = free_port()
        self.data_dir = tempfile.TemporaryDirectory(prefix="bench_capacity_")
        python_path = os.pathsep.join(filter(None, [str(repo), os.environ.get("PYTHONPATH")]))  # the checkout first
        env = {**os.environ, "PYTHONPATH": python_path, "AGENT_SERVER_DATA_DIR": self.data_dir.name,
               "PYTHONUNBUFFERED": "1"}
        env.pop("AGENT_SERVER_ENGINE_FACTORY", None)
        command = [sys.executable, "-m", "agent_server.cli", "--host", "127.0.0.1", "--port", str(self.port),
                   "--variant", args.variant, "--weights", args.weights, "--log-level", "warning",
                   "--max-slots", str(max(args.sessions)), "--max-sessions", str(max(args.sessions) + 8), *extra]
        self.command = command
        self.log_path = log_path
        with open(log_path, "w") as log_file:
            self.proc = subprocess.Popen(command, cwd=repo, env=env, stdout=log_file, stderr=subprocess.STDOUT)

    @property
    def url(self) -> str:
        return f"ws://127.0.0.1:{self.port}/v1/stream"

    def wait_ready(self, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited with {self.proc.returncode}:\n{self.log_tail()}")
            try:
                urllib.request.urlopen(f"http://127.0.0.1:{self.port}/readyz", timeout=2)
                return
            except OSError:
                time.sleep(0.5)
        raise TimeoutError(f"server not ready in {timeout_s:.0f} s:\n{self.log_tail()}")

    def log_tail(self, lines: int = 30) -> str:
        return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.data_dir.cleanup()


def _spin(stop: Any) -> None:
    x = 0
    while not stop.is_set():
        x = (x * 1103515245 + 12345) % 2**31


class BusyCores:
    """K processes that keep one core each busy (the rest of the machine is someone else's)."""

    def __init__(self, count: int) -> None:
        self.stop = multiprocessing.Event()
        self.procs = [multiprocessing.Process(target=_spin, args=(self.stop,), daemon=True) for _ in range(count)]

    def __enter__(self) -> Self:
        for proc in self.procs:
            proc.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop.set()
        for proc in self.procs:
            proc.join(10)


def run_repo(label: str, repo: Path, args: argparse.Namespace, extra: list[str], out_dir: Path,
             runs: list[RepoRun], save: Callable[[], None]) -> RepoRun:
    """One checkout's rounds, appended to `runs` at once and saved after every round (a run cut short keeps what
    it measured). A server that does not start is recorded in its run (`error`), not raised."""
    launched_s = time.monotonic()
    server = Server(repo, args, extra, out_dir / f"{args.out.name}_{label}_server.log")
    run = RepoRun(label=label, repo=str(repo), commit=git_commit(repo), server_args=server.command[3:],
                  variant=args.variant, random_weights=None)
    runs.append(run)
    try:
        try:
            server.wait_ready(args.server_start_timeout_s)
            run.ready_s = round(time.monotonic() - launched_s, 1)
        except (RuntimeError, TimeoutError) as exc:
            run.error = f"server did not start: {exc}"
            print(f"[{label}] {run.error}", flush=True)
            return run
        status = http_json(f"http://127.0.0.1:{server.port}/v1/status")
        engine = status.get("engine", status) if isinstance(status, dict) else {}
        run.random_weights = bool(engine.get("random_weights", args.weights.startswith("random")))
        max_new = args.max_new_tokens if args.max_new_tokens >= 0 else (
            RANDOM_WEIGHTS_MAX_NEW_TOKENS if run.random_weights else 0)
        print(f"[{label}] {repo} @ {run.commit}: server ready on port {server.port} after {run.ready_s} s; "
              "max_new_tokens per segment "
              f"{max_new or 'server default'}", flush=True)
        asyncio.run(one_round(server.url, 1, args, max_new))  # warm-up: first-use costs are not capacity
        with BusyCores(args.busy_cores):
            for sessions in args.sessions:
                result = asyncio.run(one_round(server.url, sessions, args, max_new))
                run.rounds.append(result)
                print(f"[{label}] N={sessions}: {format_row(result)}", flush=True)
                save()
        if args.job_load:
            try:
                job_rounds(server, run, args, max_new, label, save)
            except (OSError, TimeoutError, KeyError, ValueError) as exc:
                run.error = f"job load: {type(exc).__name__}: {exc}"
                print(f"[{label}] {run.error}", flush=True)
        after = http_json(f"http://127.0.0.1:{server.port}/v1/status")
        run.engine_after = after.get("engine", after) if isinstance(after, dict) else {}
        graphs = {key: run.engine_after[key] for key in GRAPH_KEYS if key in run.engine_after}
        if graphs:
            print(f"[{label}] graphs: {json.dumps(graphs)}", flush=True)
        lease = {key: run.engine_after[key] for key in LEASE_KEYS if key in run.engine_after}
        if lease:
            print(f"[{label}] thread lease: {json.dumps(lease)}", flush=True)
    finally:
        server.stop()
        save()
    return run


def format_row(r: RoundResult) -> str:
    def s(value: float | None) -> str:
        return "-" if value is None else f"{value:.2f}"

    return (f"ok {r.ok}/{r.ok + r.failed}, first audio p50 {s(r.ttfa_p50_s)} s p95 {s(r.ttfa_p95_s)} s, "
            f"{r.audio_s_per_wall_s:.3f} audio-s/s, dry mean {r.underrun_mean_s:.2f} s p95 {r.underrun_p95_s:.2f} s "
            f"({r.underruns} times, {r.sessions_with_underrun} sessions)")


def print_table(runs: list[RepoRun]) -> None:
    print(f"\n{'checkout':12} {'N':>3} {'ok':>5} {'TTFA p50':>9} {'TTFA p95':>9} {'audio-s/s':>10} {'x N=1':>6} "
          f"{'dry mean':>9} {'dry p95':>8} {'dry times':>9}")
    for run in runs:
        if run.error:
            print(f"{run.label[:12]:12} {run.error.splitlines()[0][:100]}")
        base = next((r.audio_s_per_wall_s for r in run.rounds if r.sessions == 1), None)
        for r in run.rounds:
            ratio = f"{r.audio_s_per_wall_s / base:.2f}" if base else "-"
            p50 = "-" if r.ttfa_p50_s is None else f"{r.ttfa_p50_s:.2f}"
            p95 = "-" if r.ttfa_p95_s is None else f"{r.ttfa_p95_s:.2f}"
            print(f"{run.label[:12]:12} {r.sessions:>3} {r.ok:>2}/{r.ok + r.failed:<2} {p50:>9} {p95:>9} "
                  f"{r.audio_s_per_wall_s:>10.3f} {ratio:>6} {r.underrun_mean_s:>9.2f} {r.underrun_p95_s:>8.2f} "
                  f"{r.underruns:>9}")
    if not any(run.job_rounds for run in runs):
        return
    print(f"\n{'checkout':12} {'N':>3} {'p95 alone':>9} {'p95 jobs':>9} {'ratio':>6} {'live a-s/s':>10} "
          f"{'jobs a-s/s':>10} {'saturation':>10} {'unused used':>11} {'idle filled':>11}")
    for run in runs:
        alone = {r.sessions: r for r in run.rounds}
        saturation = run.saturation.get("engine_audio_s_per_wall_s", 0.0)
        for j in run.job_rounds:
            a = alone.get(j.live.sessions)
            p95_a = "-" if a is None or a.ttfa_p95_s is None else f"{a.ttfa_p95_s:.2f}"
            p95_b = "-" if j.live.ttfa_p95_s is None else f"{j.live.ttfa_p95_s:.2f}"
            ratio = "-" if j.ttfa_p95_vs_alone is None else f"{j.ttfa_p95_vs_alone:.2f}"
            used = "-" if j.unused_capacity_used is None else f"{100 * j.unused_capacity_used:.0f} %"
            idle = "-" if j.idle_time_filled is None else f"{100 * j.idle_time_filled:.0f} %"
            print(f"{run.label[:12]:12} {j.live.sessions:>3} {p95_a:>9} {p95_b:>9} {ratio:>6} "
                  f"{j.live_audio_s_per_wall_s:>10.3f} {j.job_audio_s_per_wall_s:>10.3f} {saturation:>10.3f} "
                  f"{used:>11} {idle:>11}  (ok {j.live.ok}/{j.live.ok + j.live.failed})")


def plot(runs: list[RepoRun], path: Path) -> bool:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    fig, axes = plt.subplots(1, 3, figsize=(15, 4.2))
    for run in runs:
        n = [r.sessions for r in run.rounds]
        axes[0].plot(n, [r.ttfa_p50_s or np.nan for r in run.rounds], "o-", label=f"{run.label} p50")
        axes[0].plot(n, [r.ttfa_p95_s or np.nan for r in run.rounds], "s--", label=f"{run.label} p95")
        axes[1].plot(n, [r.audio_s_per_wall_s for r in run.rounds], "o-", label=run.label)
        axes[2].plot(n, [r.underrun_mean_s for r in run.rounds], "o-", label=f"{run.label} mean")
        axes[2].plot(n, [r.underrun_p95_s for r in run.rounds], "s--", label=f"{run.label} p95")
    titles = ("time to first audio (s)", "audio seconds delivered per wall second", "playback dry time per session (s)")
    for axis, title in zip(axes, titles, strict=True):
        axis.set_title(title)
        axis.set_xlabel("concurrent sessions")
        axis.set_xscale("log", base=2)
        axis.grid(True, alpha=0.3)
        axis.legend(fontsize=8)
    fig.suptitle(f"bench_capacity: {runs[0].variant}, {', '.join(f'{r.label}@{r.commit}' for r in runs)}")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    return True


def parse_repos(values: list[str]) -> list[tuple[str, Path]]:
    repos = []
    for value in values or [f"this={REPO}"]:
        label, _, path = value.rpartition("=")
        repo = Path(path).resolve()
        if not (repo / "agent_server" / "cli.py").is_file():
            raise SystemExit(f"{repo} is not a checkout of this project (no agent_server/cli.py)")
        repos.append((label or repo.name, repo))
    return repos


def main(argv: list[str] | None = None) -> None:
    argv = list(sys.argv[1:] if argv is None else argv)
    extra: list[str] = []
    if "--" in argv:
        cut = argv.index("--")
        argv, extra = argv[:cut], argv[cut + 1:]
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repo", action="append", default=[], help="[LABEL=]PATH of a checkout (repeat to compare)")
    parser.add_argument("--server-args-for", action="append", default=[], metavar="LABEL=ARGS",
                        help="extra server arguments for one checkout only (shell-quoted)")
    parser.add_argument("--variant", default="turbo", choices=("english", "turbo", "multilingual"))
    parser.add_argument("--weights", default="random-full", help="random-tiny, random-full, auto or a checkpoint dir")
    parser.add_argument("--sessions", type=int, nargs="+", default=[1, 2, 4, 8, 16])
    parser.add_argument("--chars-per-s", type=float, default=300.0, help="LLM text pace per session")
    parser.add_argument("--text", default=DEFAULT_REPLY, help="the reply each session streams")
    parser.add_argument("--max-new-tokens", type=int, default=-1,
                        help=f"per segment (-1: {RANDOM_WEIGHTS_MAX_NEW_TOKENS} with random weights, else the "
                             "server's default; 0: the server's default)")
    parser.add_argument("--seed", type=int, default=None, help="seed the contexts (seed + session index)")
    parser.add_argument("--threads", default=None, help="--threads for the servers (checkouts that know it)")
    parser.add_argument("--busy-cores", type=int, default=0, help="processes spinning during the measured rounds")
    parser.add_argument("--session-timeout-s", type=float, default=600.0)
    parser.add_argument("--server-start-timeout-s", type=float, default=SERVER_START_TIMEOUT_S)
    parser.add_argument("--out", type=Path, default=Path("out/bench_capacity"), help="output path without suffix")
    parser.add_argument("--log-dir", type=Path, default=None, help="where the servers' logs go (default: --out's)")
    parser.add_argument("--repeat", type=int, default=1, metavar="R",
                        help="run each round R times in a row; its figures pool them (first-audio percentiles)")
    parser.add_argument("--think-s", type=float, default=0.0, metavar="S",
                        help="with --repeat: S seconds between a round's turns (the caller speaks; live leaves the "
                             "engine idle, which --job-load's jobs may fill)")
    parser.add_argument("--job-load", type=int, default=0, metavar="K",
                        help="then the same rounds beside a backlog of K jobs (0: no jobs)")
    parser.add_argument("--job-chars", type=int, default=20_000, help="characters of each job of --job-load")
    parser.add_argument("--job-window-s", type=float, default=20.0, help="the jobs-only window (saturation)")
    args = parser.parse_args(argv)
    if min(args.sessions) < 1:
        parser.error("--sessions must be >= 1")
    per_repo = {}
    for value in args.server_args_for:
        label, _, rest = value.partition("=")
        per_repo[label] = shlex.split(rest)
    if args.threads:
        extra = [*extra, "--threads", args.threads]
    if args.job_load:
        extra = [*extra, "--max-running-jobs-per-key", "0"]
    args.out.parent.mkdir(parents=True, exist_ok=True)
    log_dir = args.log_dir or args.out.parent
    log_dir.mkdir(parents=True, exist_ok=True)
    runs: list[RepoRun] = []
    report = {"machine": {"cpus": os.cpu_count(), "affinity": len(os.sched_getaffinity(0)),
                          "processor": platform.processor() or platform.machine(), "python": platform.python_version()},
              "args": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
              "server_args": extra, "runs": runs}

    def save() -> None:
        report["runs"] = [asdict(run) for run in runs]
        args.out.with_suffix(".json").write_text(json.dumps(report, indent=2))

    try:
        for label, repo in parse_repos(args.repo):
            run_repo(label, repo, args, extra + per_repo.get(label, []), log_dir, runs, save)
    except KeyboardInterrupt:  # `timeout -s INT`: the servers were stopped (run_repo's finally), the rounds saved
        print("\ninterrupted: the rounds so far are in the JSON", flush=True)
        save()
        print_table(runs)
        raise SystemExit(130) from None
    save()
    print_table(runs)
    if plot(runs, args.out.with_suffix(".png")):
        print(f"\nplot: {args.out.with_suffix('.png')}")
    print(f"json: {args.out.with_suffix('.json')}")
    if any(run.error for run in runs):
        raise SystemExit(2)


if __name__ == "__main__":
    main()
