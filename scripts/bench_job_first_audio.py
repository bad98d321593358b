#!/usr/bin/env python
"""A live turn's first audio beside a steady job load, in one engine (T3 and its vocoder worker on their own threads,
no server), with the live-first mechanisms switched on and off between rounds of the same process, so that the
machine's drift is shared and the modes are compared pair by pair.

A feeder keeps `--jobs` short job segments in flight (each ends after `--job-tokens` ids, so the vocoder renders job
chunks all the time, and a new one is submitted at once). Every round, after a random pause, one live segment (its
session's first audio) is submitted and timed from its submit to its first audio chunk, then cancelled. Modes:

- all: the default: a jobs-only step stops at its next layer (Scheduler.withdraw), job rows sit out the turn's first
  ids until its first audio can render (Engine.first_audio_ids: 12 + 7), and the vocoder holds job renders back from
  the turn's submit (Engine.turn_pending);
- pause 12: the same, but the job rows sit out only the first chunk's 12 ids (as before first_audio_ids);
- vocoder not told: the same, but the vocoder holds job renders back only once the turn's stream opens (its first
  valid id), as before Engine.turn_pending;
- neither: the vocoder not told, and job steps run whole (the turn signal is never raised);
- alone (`--alone`, once before and once after the job rounds): no jobs; the reference;
- alone between (`--modes` may name it): a mode of the rounds: the feeder stops, its segments are cancelled and the
  engine goes idle before the turn, and the jobs resume after it (and get `RESUME_S` to get going). For p95 over
  many turns, paired with "all":

    python scripts/bench_job_first_audio.py --size full --jobs 3 --rounds 60 --modes "all" "alone between"

Run alone (`flock -x /work/cpu.lock`). Output: a table on stdout and <out>.json.

    python scripts/bench_job_first_audio.py --size full --jobs 1 --rounds 8 --out out/job_first_audio_full
"""

from __future__ import annotations

import argparse
import json
import platform
import queue
import random
import statistics
import sys
import threading
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # this checkout's synth

from synth import default_voice
from synth.api import (
    AudioChunk,
    EngineConfig,
    EngineOutput,
    EventKind,
    Priority,
    SamplingParams,
    SegmentEvent,
    SegmentRequest,
)
from synth.engine import Engine
from synth.loading import random_bundle

JOB_TEXT = ("It was a bright cold day in April, and the clocks were striking thirteen. Winston Smith slipped quickly "
            "through the glass doors of Victory Mansions.")
LIVE_TEXT = "Sure, I can help you with that order right away."
ROUND_TIMEOUT_S = 120.0
MODES = ("all", "pause 12", "vocoder not told", "neither")
ALONE_BETWEEN = "alone between"
RESUME_S = 3.0  # after the jobs resume, before the next mode's pause: they get going again


class _NeverRaised(threading.Event):
    """A turn signal that is never raised: jobs-only steps run whole."""

    def set(self) -> None:
        pass


class JobFeeder:
    """Keeps `jobs` job segments in flight: its thread submits a new one when one ends (a sink only tells it: a sink
    runs under the engine's emit lock and must not call back into the engine)."""

    def __init__(self, engine: Engine, jobs: int, tokens: int, variant: str) -> None:
        self.engine, self.jobs = engine, jobs
        self.params = replace(SamplingParams.defaults(variant), max_new_tokens=tokens)  # type: ignore[arg-type]
        self._ended: queue.Queue[None] = queue.Queue()
        self._next = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="job-feeder", daemon=True)
        self.done = 0
        self._lock = threading.Lock()
        self._paused = False
        self._owed = 0  # segments that ended while paused: submitted again on resume
        self._in_flight: set[str] = set()

    def start(self) -> None:
        for _ in range(self.jobs):
            self._ended.put(None)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()

    def pause(self) -> None:
        """Submit nothing more, cancel every job segment in flight and wait until the engine is idle."""
        with self._lock:
            self._paused = True
            in_flight = list(self._in_flight)
        for request_id in in_flight:
            self.engine.cancel(request_id)
        deadline = time.monotonic() + ROUND_TIMEOUT_S
        while self._in_flight or not self.engine.idle or self.engine.turn_pending():
            if time.monotonic() > deadline:
                raise TimeoutError(f"job segments still in flight: {sorted(self._in_flight)}")
            time.sleep(0.02)

    def resume(self) -> None:
        with self._lock:
            self._paused = False
            owed, self._owed = self._owed, 0
        for _ in range(owed):
            self._ended.put(None)

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                self._ended.get(timeout=0.1)
            except queue.Empty:
                continue
            with self._lock:
                if self._paused:
                    self._owed += 1
                    continue
                self._next += 1
                request_id = f"job-{self._next}"
                self._in_flight.add(request_id)
            self.engine.submit(SegmentRequest(
                request_id=request_id, text=JOB_TEXT, params=replace(self.params, seed=self._next),
                sink=self._sink, priority=Priority.JOB, first_audio_pending=False))

    def _sink(self, output: EngineOutput) -> None:
        if isinstance(output, SegmentEvent) and output.kind >= EventKind.DONE:
            with self._lock:
                self._in_flight.discard(output.request_id)
            self.done += 1
            self._ended.put(None)


def _p95(values: list[float]) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(0.95 * len(ordered)))]


def _set_mode(engine: Engine, mode: str) -> None:
    worker = engine.vocoder_worker
    assert worker is not None
    worker.turn_pending = engine.turn_pending if mode in ("all", "pause 12") else (lambda: False)
    below = engine.config.first_chunk_tokens if mode == "pause 12" else engine.first_audio_ids
    engine.scheduler.config = replace(engine.scheduler.config,
                                      pause_jobs_below_ids=below if engine.runner.compact_rows else 0)
    engine.turn_arrived = _NeverRaised() if mode == "neither" else threading.Event()


def _first_audio_s(engine: Engine, variant: str, seed: int) -> float:
    """One live turn: seconds from its submit to its first audio chunk (then it is cancelled)."""
    first = threading.Event()
    ended = threading.Event()
    request_id = f"live-{seed}"

    def sink(output: EngineOutput) -> None:
        if isinstance(output, AudioChunk):
            first.set()
        elif isinstance(output, SegmentEvent) and output.kind >= EventKind.DONE:
            ended.set()

    params = replace(SamplingParams.defaults(variant), seed=seed, max_new_tokens=60)  # type: ignore[arg-type]
    t0 = time.perf_counter()
    engine.submit(SegmentRequest(request_id=request_id, text=LIVE_TEXT, params=params, sink=sink))
    if not first.wait(ROUND_TIMEOUT_S):
        raise TimeoutError(f"{request_id}: no audio in {ROUND_TIMEOUT_S} s")
    elapsed = time.perf_counter() - t0
    engine.cancel(request_id)
    ended.wait(ROUND_TIMEOUT_S)
    return elapsed


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--variant", default="turbo")
    parser.add_argument("--size", default="tiny", choices=["tiny", "full"])
    parser.add_argument("--jobs", type=int, default=1, help="job segments kept in flight")
    parser.add_argument("--job-tokens", type=int, default=40, help="ids a job segment samples before it ends")
    parser.add_argument("--rounds", type=int, default=8, help="live turns per mode")
    parser.add_argument("--pause-s", type=float, nargs=2, default=(0.5, 2.0), help="random pause before a turn")
    parser.add_argument("--alone", type=int, default=4, help="turns with no jobs, before and after the job rounds")
    parser.add_argument("--threads", default="1,1", help="decode,vocoder threads")
    parser.add_argument("--modes", nargs="+", default=list(MODES), choices=[*MODES, ALONE_BETWEEN],
                        help="the modes of the rounds")
    parser.add_argument("--out", type=Path, default=Path("out/job_first_audio"))
    args = parser.parse_args()
    torch.set_grad_enabled(False)
    decode_threads, vocoder_threads = (int(n) for n in args.threads.split(","))
    bundle = random_bundle(args.variant, args.size, torch.device("cpu"))
    config = EngineConfig(variant=args.variant, weights="random", device="cpu", max_slots=args.jobs + 1,
                          max_context_tokens=512, decode_threads=decode_threads, vocoder_threads=vocoder_threads)
    engine = Engine(bundle, config)
    engine.voices.add(default_voice(bundle))
    engine.start()
    if not engine.wait_ready(900):
        raise SystemExit(f"engine did not start: {engine.failure}")
    pauses = random.Random(11)
    modes = list(args.modes)
    times: dict[str, list[float]] = {mode: [] for mode in ["alone", *modes]}

    def alone_rounds(count: int, seed0: int) -> None:
        _set_mode(engine, "all")
        for k in range(count):
            time.sleep(pauses.uniform(*args.pause_s))
            times["alone"].append(_first_audio_s(engine, args.variant, seed=seed0 + k))

    alone_rounds(1, 9000)  # warm-up, not counted
    times["alone"].clear()
    alone_rounds(args.alone, 100)
    feeder = JobFeeder(engine, args.jobs, args.job_tokens, args.variant)
    feeder.start()
    time.sleep(5.0)  # the jobs get going: segments end and render
    for r in range(args.rounds):
        for mode in (modes if r % 2 == 0 else modes[::-1]):  # alternating order: no mode always follows another
            _set_mode(engine, "all" if mode == ALONE_BETWEEN else mode)
            if mode == ALONE_BETWEEN:
                feeder.pause()
            time.sleep(pauses.uniform(*args.pause_s))
            times[mode].append(_first_audio_s(engine, args.variant, seed=1000 + r))
            if mode == ALONE_BETWEEN:
                feeder.resume()
                time.sleep(RESUME_S)
    feeder.stop()
    while engine.scheduler.running or engine.scheduler.n_waiting:
        time.sleep(0.2)
    time.sleep(2.0)  # the last job renders
    alone_rounds(args.alone, 200)
    status = engine.status()
    engine.stop()
    # the reference: the alone turns between the rounds where there are some (they share the rounds' drift)
    reference_mode = ALONE_BETWEEN if times.get(ALONE_BETWEEN) else "alone"
    reference_p50, reference_p95 = statistics.median(times[reference_mode]), _p95(times[reference_mode])
    rows = []
    for mode, values in times.items():
        rows.append({"mode": mode, "turns": len(values), "first_audio_ms_p50": round(1e3 * statistics.median(values)),
                     "first_audio_ms_p95": round(1e3 * _p95(values)),
                     "first_audio_ms_mean": round(1e3 * statistics.mean(values)),
                     "x_alone_p50": round(statistics.median(values) / reference_p50, 2),
                     "x_alone_p95": round(_p95(values) / reference_p95, 2)})
    print(f"{args.variant} {args.size}, threads {args.threads}, {args.jobs} job segment(s) in flight of "
          f"{args.job_tokens} ids ({feeder.done} done), {args.rounds} turns per mode")
    print(f"x alone: against '{reference_mode}'")
    print(f"{'mode':18} {'turns':>5} {'p50 ms':>7} {'p95 ms':>7} {'mean ms':>8} {'x alone p50':>12} {'p95':>5}")
    for row in rows:
        print(f"{row['mode']:18} {row['turns']:5} {row['first_audio_ms_p50']:7} {row['first_audio_ms_p95']:7} "
              f"{row['first_audio_ms_mean']:8} {row['x_alone_p50']:12} {row['x_alone_p95']:5}")
    counters = {key: status[key] for key in ("job_steps_withdrawn", "job_rows_paused", "preemptions",
                                             "borrowed_steps", "lent_ticks")}
    counters["job_renders_stopped"] = engine.vocoder_worker.job_renders_stopped if engine.vocoder_worker else 0
    print(json.dumps(counters))
    args.out.parent.mkdir(parents=True, exist_ok=True)
    report: dict[str, Any] = {"machine": platform.processor() or platform.machine(), "variant": args.variant,
                              "size": args.size, "threads": args.threads, "jobs": args.jobs,
                              "job_tokens": args.job_tokens, "rounds": args.rounds, "reference": reference_mode,
                              "rows": rows,
                              "engine": counters, "times_s": times}
    args.out.with_suffix(".json").write_text(json.dumps(report, indent=1))
    print(f"json: {args.out.with_suffix('.json')}")


if __name__ == "__main__":
    main()
