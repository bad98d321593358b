#!/usr/bin/env python
"""The CPU side of jobs, per core: what one replica spends besides the engine.

- planning: `plan_segments` of a --chars text (segmenter + normaliser), seconds;
- storing: `encode_segment` (Ogg Opus, 32 kbit/s) and `decode_segment` of --segment-s segments, as multiples of
  real time (audio seconds per CPU second);
- assembling: decoded segments -> each job format (`assembly.encode_whole`), multiples of real time.

The audio is a synthetic voiced signal (harmonics with a moving pitch and noise), not speech: codec speeds on real
speech differ a little. Run alone (`flock -x /work/cpu.lock`): one thread, timings. Output: a table on stdout and
<out>.json.

    python scripts/bench_jobs_cpu.py --chars 200000 --audio-s 120 --out out/bench_jobs_cpu
"""

from __future__ import annotations

import argparse
import json
import platform
import time
from collections.abc import Callable
from functools import partial
from pathlib import Path

import numpy as np
import numpy.typing as npt

from agent_server.jobs.assembly import encode_whole
from agent_server.jobs.request import JOB_FORMATS, job_format
from agent_server.jobs.segment_audio import decode_segment, encode_segment
from agent_server.jobs.segments import plan_segments

RATE_HZ = 24_000
PARAGRAPH = ("Chapter 1. It was a bright cold day in April, and the clocks were striking 13. Winston Smith, his chin "
             "nuzzled into his breast in an effort to escape the vile wind, slipped quickly through the glass doors "
             "of Victory Mansions. The price was $4.50 on 12/05/2026 at 9:30am! ")


def voiced(samples: int, seed: int) -> npt.NDArray[np.float32]:
    rng = np.random.default_rng(seed)
    t = np.arange(samples) / RATE_HZ
    phase = 2 * np.pi * np.cumsum(140 + 30 * np.sin(2 * np.pi * 0.7 * t)) / RATE_HZ
    wave = sum(0.2 / k * np.sin(k * phase) for k in range(1, 6)) + 0.01 * rng.standard_normal(samples)
    return np.asarray(wave, dtype=np.float32)


def best_of(repeats: int, fn: Callable[[], object]) -> float:
    times = []
    for _ in range(repeats):
        started = time.perf_counter()
        fn()
        times.append(time.perf_counter() - started)
    return min(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--chars", type=int, default=200_000)
    parser.add_argument("--audio-s", type=float, default=120.0, help="audio per measurement")
    parser.add_argument("--segment-s", type=float, default=7.0, help="one job segment's audio")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--out", type=Path, default=Path("out/bench_jobs_cpu"))
    args = parser.parse_args()

    text = (PARAGRAPH * (args.chars // len(PARAGRAPH) + 1))[:args.chars]
    plan_s = best_of(args.repeats, lambda: plan_segments(text))
    n_segments = len(plan_segments(text))

    per_segment = int(args.segment_s * RATE_HZ)
    count = max(1, int(args.audio_s / args.segment_s))
    pcm = [voiced(per_segment, i) for i in range(count)]
    audio_s = count * per_segment / RATE_HZ
    blobs = [encode_segment(p) for p in pcm]
    encode_s = best_of(args.repeats, lambda: [encode_segment(p) for p in pcm])
    decode_s = best_of(args.repeats, lambda: [decode_segment(b) for b in blobs])
    decoded = [decode_segment(b) for b in blobs]
    stored_bytes = sum(len(b) for b in blobs)

    rows = [("plan", f"{args.chars} chars -> {n_segments} segments", f"{plan_s:.2f} s", "")]
    assembled: dict[str, float] = {}
    result: dict[str, object] = {
        "machine": platform.processor() or platform.machine(), "python": platform.python_version(),
        "chars": args.chars, "segments": n_segments, "plan_s": plan_s, "audio_s": audio_s,
        "stored_bytes_per_audio_s": stored_bytes / audio_s,
        "encode_x_realtime": audio_s / encode_s, "decode_x_realtime": audio_s / decode_s,
        "assemble_x_realtime": assembled,
    }
    rows.append(("store: Opus encode", f"{audio_s:.0f} s audio", f"{audio_s / encode_s:.0f}x real time",
                 f"{stored_bytes / audio_s / 1000:.1f} kB per audio s"))
    rows.append(("store: Opus decode", f"{audio_s:.0f} s audio", f"{audio_s / decode_s:.0f}x real time", ""))
    for name in JOB_FORMATS:
        fmt = job_format(name)
        seconds = best_of(args.repeats, partial(encode_whole, decoded, fmt))
        assembled[name] = audio_s / seconds
        rows.append((f"assemble: {name}", f"{audio_s:.0f} s audio", f"{audio_s / seconds:.0f}x real time", ""))

    width = [max(len(r[i]) for r in rows) for i in range(4)]
    for row in rows:
        print("  ".join(cell.ljust(width[i]) for i, cell in enumerate(row)).rstrip())
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.with_suffix(".json").write_text(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
