#!/usr/bin/env python
"""T3's share of a live turn's first audio beside job rows: the time from a live segment's submit to the step that
reads its first chunk's last id (`first_chunk_tokens` valid ids), on the engine stepped by hand on this thread
(no vocoder, no server: what the scheduler's "job rows sit out" changes and nothing else).

Per round, for each mode: K job segments (long texts, JOB priority) are admitted and decode a few steps, then one
live segment (its session's first audio) arrives; it is timed to its first chunk, then everything is cancelled.

- alone: no job rows (the reference);
- pause: the CPU default, compact steps, the job rows sit out the live segment's first chunk of ids, and a step of
  job rows only that is running when it arrives stops at its next layer (Scheduler.withdraw);
- pause, whole steps: the same, but a jobs-only step runs to its end (the turn signal is never raised);
- no pause: `compact_steps=False` (every row of the bucket decodes, as on a GPU): the job rows decode beside it.

`--arrival boundary` submits the live segment between two steps (T3's per-step cost only); `--arrival mid-step`
submits it from a timer thread at a random point of a step of job rows (uniform over one step's time, the same
fractions in every mode), as a real turn arrives, so the step in flight counts too. Also: the job rows left out per
turn and the jobs-only steps withdrawn per turn. Run alone (`flock -x /work/cpu.lock`). Output: a table on stdout and
<out>.json.

    python scripts/bench_job_pause.py --size tiny --jobs 3 --rounds 20 --threads 1 --out out/job_pause_tiny
    python scripts/bench_job_pause.py --size full --jobs 4 --rounds 6 --arrival mid-step --out out/job_pause_full
    python scripts/bench_job_pause.py --variant multilingual --analyzer --size full --jobs 3 --rounds 6 \
        --arrival mid-step --out out/job_pause_ml_full
"""

from __future__ import annotations

import argparse
import json
import platform
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

from synth.api import EngineConfig, Priority, SamplingParams, SegmentRequest
from synth.engine import Engine
from synth.loading import random_bundle
from synth.voices import Voice

JOB_TEXT = ("It was a bright cold day in April, and the clocks were striking thirteen. Winston Smith slipped quickly "
            "through the glass doors of Victory Mansions, though not quickly enough to keep out the gritty dust.")
LIVE_TEXT = "Sure, I can help you with that order right away."
JOB_WARM_STEPS = 4  # steps the jobs decode before the live segment arrives
MAX_STEPS = 2000


def _voice(bundle: Any) -> Voice:
    g = torch.Generator().manual_seed(1)
    plen = bundle.t3.hp.speech_cond_prompt_len
    return Voice(voice_id="v", speaker_emb=torch.randn(1, 256, generator=g),
                 prompt_speech_tokens=torch.randint(0, 6561, (1, plen), generator=g), s3gen_ref={})


class _NeverRaised(threading.Event):
    """A turn signal that is never raised: jobs-only steps run whole (the "pause, whole steps" mode)."""

    def set(self) -> None:
        pass


def _engine(bundle: Any, variant: str, jobs: int, compact: bool, stop_steps: bool, analyzer: bool) -> Engine:
    config = EngineConfig(variant=variant, weights="random", device="cpu", max_slots=jobs + 1,  # type: ignore[arg-type]
                          max_context_tokens=1024, compact_steps=compact, alignment_analyzer=analyzer)
    engine = Engine(bundle, config, render_audio=False)
    engine.voices.add(_voice(bundle))
    if not stop_steps:
        engine.turn_arrived = _NeverRaised()
    return engine


def _round(engine: Engine, variant: str, jobs: int, seed: int, arrive_at: float | None
           ) -> tuple[float, int, int]:
    """One live segment beside `jobs` job segments: (seconds from its submit to its first chunk's ids, job rows
    paused meanwhile, job steps withdrawn meanwhile). `arrive_at` (mid-step arrival): the submit comes from a timer
    thread (1 + arrive_at) mean step times after the warm steps, arrive_at in [0, 1)."""
    params = replace(SamplingParams.defaults(variant), seed=seed, max_new_tokens=400)  # type: ignore[arg-type]
    ids = [f"job-{seed}-{k}" for k in range(jobs)]
    for k, request_id in enumerate(ids):
        engine.submit(SegmentRequest(request_id=request_id, text=JOB_TEXT, voice_id="v",
                                     params=replace(params, seed=seed * 100 + k), sink=lambda output: None,
                                     priority=Priority.JOB, first_audio_pending=False))
    for _ in range(2):
        engine._step()
    t_warm = time.perf_counter()
    for _ in range(JOB_WARM_STEPS):
        engine._step()
    step_s = (time.perf_counter() - t_warm) / JOB_WARM_STEPS
    live_id = f"live-{seed}"
    paused_before = engine.scheduler.job_rows_paused
    withdrawn_before = engine.scheduler.job_steps_withdrawn
    live = SegmentRequest(request_id=live_id, text=LIVE_TEXT, voice_id="v", params=params, sink=lambda output: None)
    submitted: list[float] = []

    def arrive() -> None:
        submitted.append(time.perf_counter())
        engine.submit(live)

    if arrive_at is None:
        arrive()
    else:
        timer = threading.Timer((1.0 + arrive_at) * step_s, arrive)
        timer.start()
        while not submitted:  # the job rows decode until it arrives (mid-step)
            engine._step()
        timer.join()
    wanted = engine.config.first_chunk_tokens
    admitted = False
    for _ in range(MAX_STEPS):
        engine._step()
        running = [s for s in engine.scheduler.running if s.request_id == live_id]
        admitted = admitted or bool(running)
        if admitted and (not running or engine.scheduler.table.n_valid[running[0].rows[0]] >= wanted):
            break
    elapsed = time.perf_counter() - submitted[0]
    paused = engine.scheduler.job_rows_paused - paused_before
    withdrawn = engine.scheduler.job_steps_withdrawn - withdrawn_before
    for request_id in [*ids, live_id]:
        engine.cancel(request_id)
    for _ in range(MAX_STEPS):
        if engine.scheduler.idle:
            break
        engine._step()
    return elapsed, paused, withdrawn


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--variant", default="turbo")
    parser.add_argument("--size", default="tiny", choices=["tiny", "full"])
    parser.add_argument("--jobs", type=int, default=3, help="job segments decoding when the live one arrives")
    parser.add_argument("--rounds", type=int, default=10)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--arrival", default="boundary", choices=["boundary", "mid-step"],
                        help="the live segment arrives between steps, or at a random point of a job step")
    parser.add_argument("--analyzer", action="store_true",
                        help="Multilingual's alignment analyzer on every segment (full size: tiny lacks its heads)")
    parser.add_argument("--out", type=Path, default=Path("out/job_pause"))
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    torch.set_grad_enabled(False)
    bundle = random_bundle(args.variant, args.size, torch.device("cpu"))
    # mode -> (job segments, compact steps, jobs-only steps stop for a live turn)
    modes = {"alone": (0, True, True), "pause": (args.jobs, True, True),
             "pause, whole steps": (args.jobs, True, False), "no pause": (args.jobs, False, True)}
    engines = {name: _engine(bundle, args.variant, max(jobs, 1), compact, stop, args.analyzer)
               for name, (jobs, compact, stop) in modes.items()}
    times: dict[str, list[float]] = {name: [] for name in modes}
    paused: dict[str, list[int]] = {name: [] for name in modes}
    withdrawn: dict[str, list[int]] = {name: [] for name in modes}
    fractions = random.Random(7)
    mid_step = args.arrival == "mid-step"
    for name, engine in engines.items():  # a round of each first: warm-up, not counted
        _round(engine, args.variant, modes[name][0], seed=10_000, arrive_at=0.5 if mid_step else None)
    for r in range(args.rounds):
        arrive_at = fractions.random() if mid_step else None  # the same point of a step in every mode
        for name, engine in engines.items():  # interleaved: the machine's drift is shared
            elapsed, rows, steps = _round(engine, args.variant, modes[name][0], seed=r + 1, arrive_at=arrive_at)
            times[name].append(elapsed)
            paused[name].append(rows)
            withdrawn[name].append(steps)
    rows_out = []
    for name in modes:
        values = sorted(times[name])
        rows_out.append({"mode": name, "jobs": modes[name][0], "compact": modes[name][1],
                         "stops_job_steps": modes[name][2],
                         "first_chunk_ms_p50": round(1e3 * statistics.median(values), 1),
                         "first_chunk_ms_p95": round(1e3 * values[min(len(values) - 1, int(0.95 * len(values)))], 1),
                         "x_alone_p50": round(statistics.median(values) / statistics.median(times["alone"]), 2),
                         "job_rows_paused_per_turn": round(statistics.mean(paused[name]), 1),
                         "job_steps_withdrawn_per_turn": round(statistics.mean(withdrawn[name]), 2)})
    print(f"{args.variant} {args.size}{' with its analyzer' if args.analyzer else ''}, {args.threads} thread(s), "
          f"{args.jobs} job segments, {args.rounds} rounds, "
          f"arrival {args.arrival}, first_chunk_tokens {engines['alone'].config.first_chunk_tokens}")
    print(f"{'mode':19} {'p50 ms':>8} {'p95 ms':>8} {'x alone':>8} {'rows paused/turn':>17} {'steps withdrawn':>16}")
    for row in rows_out:
        print(f"{row['mode']:19} {row['first_chunk_ms_p50']:8} {row['first_chunk_ms_p95']:8} {row['x_alone_p50']:8} "
              f"{row['job_rows_paused_per_turn']:17} {row['job_steps_withdrawn_per_turn']:16}")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    report = {"machine": platform.processor() or platform.machine(), "variant": args.variant, "size": args.size,
              "analyzer": args.analyzer, "threads": args.threads, "jobs": args.jobs, "rounds": args.rounds,
              "arrival": args.arrival,
              "rows": rows_out}
    args.out.with_suffix(".json").write_text(json.dumps(report, indent=1))
    print(f"json: {args.out.with_suffix('.json')}")


if __name__ == "__main__":
    main()
