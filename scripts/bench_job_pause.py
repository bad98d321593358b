#!/usr/bin/env python
"""T3's share of a live turn's first audio beside job rows: the time from a live segment's submit to the step that
reads its first chunk's last id (`first_chunk_tokens` valid ids), on the engine stepped by hand on this thread
(no vocoder, no server: what the scheduler's "job rows sit out" changes and nothing else).

Per round, for each mode: K job segments (long texts, JOB priority) are admitted and decode a few steps, then one
live segment (its session's first audio) arrives; it is timed to its first chunk, then everything is cancelled.

- alone: no job rows (the reference);
- pause: the CPU default, compact steps, the job rows sit out the live segment's first chunk of ids;
- no pause: `compact_steps=False` (every row of the bucket decodes, as on a GPU): the job rows decode beside it.

Also: the steps the job rows sat out per turn, and the rows' steps per second while they decode (the jobs' price).
Run alone (`flock -x /work/cpu.lock`). Output: a table on stdout and <out>.json.

    python scripts/bench_job_pause.py --size tiny --jobs 3 --rounds 20 --threads 1 --out out/job_pause_tiny
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
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


def _engine(bundle: Any, variant: str, jobs: int, compact: bool) -> Engine:
    config = EngineConfig(variant=variant, weights="random", device="cpu", max_slots=jobs + 1,  # type: ignore[arg-type]
                          max_context_tokens=1024, compact_steps=compact)
    engine = Engine(bundle, config, render_audio=False)
    engine.voices.add(_voice(bundle))
    return engine


def _round(engine: Engine, variant: str, jobs: int, seed: int) -> tuple[float, int]:
    """One live segment beside `jobs` job segments: (seconds to its first chunk's ids, job rows paused meanwhile)."""
    params = replace(SamplingParams.defaults(variant), seed=seed, max_new_tokens=400)  # type: ignore[arg-type]
    ids = [f"job-{seed}-{k}" for k in range(jobs)]
    for k, request_id in enumerate(ids):
        engine.submit(SegmentRequest(request_id=request_id, text=JOB_TEXT, voice_id="v",
                                     params=replace(params, seed=seed * 100 + k), sink=lambda output: None,
                                     priority=Priority.JOB, first_audio_pending=False))
    for _ in range(JOB_WARM_STEPS + 2):
        engine._step()
    live_id = f"live-{seed}"
    paused_before = engine.scheduler.job_rows_paused
    t0 = time.perf_counter()
    engine.submit(SegmentRequest(request_id=live_id, text=LIVE_TEXT, voice_id="v", params=params,
                                 sink=lambda output: None))
    wanted = engine.config.first_chunk_tokens
    for _ in range(MAX_STEPS):
        engine._step()
        live = [s for s in engine.scheduler.running if s.request_id == live_id]
        if not live or engine.scheduler.table.n_valid[live[0].rows[0]] >= wanted:
            break
    elapsed = time.perf_counter() - t0
    paused = engine.scheduler.job_rows_paused - paused_before
    for request_id in [*ids, live_id]:
        engine.cancel(request_id)
    for _ in range(MAX_STEPS):
        if engine.scheduler.idle:
            break
        engine._step()
    return elapsed, paused


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--variant", default="turbo")
    parser.add_argument("--size", default="tiny", choices=["tiny", "full"])
    parser.add_argument("--jobs", type=int, default=3, help="job segments decoding when the live one arrives")
    parser.add_argument("--rounds", type=int, default=10)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--out", type=Path, default=Path("out/job_pause"))
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    torch.set_grad_enabled(False)
    bundle = random_bundle(args.variant, args.size, torch.device("cpu"))
    modes = {"alone": (0, True), "pause": (args.jobs, True), "no pause": (args.jobs, False)}
    engines = {name: _engine(bundle, args.variant, max(jobs, 1), compact) for name, (jobs, compact) in modes.items()}
    times: dict[str, list[float]] = {name: [] for name in modes}
    paused: dict[str, list[int]] = {name: [] for name in modes}
    for name, engine in engines.items():  # a round of each first: warm-up, not counted
        _round(engine, args.variant, modes[name][0], seed=10_000)
    for r in range(args.rounds):
        for name, engine in engines.items():  # interleaved: the machine's drift is shared
            elapsed, rows = _round(engine, args.variant, modes[name][0], seed=r + 1)
            times[name].append(elapsed)
            paused[name].append(rows)
    rows_out = []
    for name in modes:
        values = sorted(times[name])
        rows_out.append({"mode": name, "jobs": modes[name][0], "compact": modes[name][1],
                         "first_chunk_ms_p50": round(1e3 * statistics.median(values), 1),
                         "first_chunk_ms_p95": round(1e3 * values[min(len(values) - 1, int(0.95 * len(values)))], 1),
                         "x_alone_p50": round(statistics.median(values) / statistics.median(times["alone"]), 2),
                         "job_rows_paused_per_turn": round(statistics.mean(paused[name]), 1)})
    print(f"{args.variant} {args.size}, {args.threads} thread(s), {args.jobs} job rows, {args.rounds} rounds, "
          f"first_chunk_tokens {engines['alone'].config.first_chunk_tokens}")
    print(f"{'mode':10} {'p50 ms':>8} {'p95 ms':>8} {'x alone':>8} {'rows paused/turn':>17}")
    for row in rows_out:
        print(f"{row['mode']:10} {row['first_chunk_ms_p50']:8} {row['first_chunk_ms_p95']:8} {row['x_alone_p50']:8} "
              f"{row['job_rows_paused_per_turn']:17}")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    report = {"machine": platform.processor() or platform.machine(), "variant": args.variant, "size": args.size,
              "threads": args.threads, "jobs": args.jobs, "rounds": args.rounds, "rows": rows_out}
    args.out.with_suffix(".json").write_text(json.dumps(report, indent=1))
    print(f"json: {args.out.with_suffix('.json')}")


if __name__ == "__main__":
    main()
