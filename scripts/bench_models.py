#!/usr/bin/env python
"""Turbo's first audio and audio per second with and without a busy Multilingual model in the same engine.

One engine of both models (`EngineConfig.models = ("turbo", "multilingual")`, synth/models.py: one step thread runs
both models' batches, each model its own vocoder worker), built once; then, alternating, --rounds rounds of each:

- quiet: --sessions Turbo segments submitted at once (first audio pending, seeded, --tokens speech tokens each),
  the Multilingual model loaded but idle;
- busy: the same, while --busy Multilingual segments (French, --busy-tokens each) run the whole time (each
  resubmitted when it ends), so both models' batches and both vocoders share the CPU.

- alone (after those): the same Turbo rounds in a one-model Engine on the same weights, the reference.

Per round: each Turbo segment's first audio (submit -> its first audio chunk) and the Turbo audio seconds per
wall second (all its audio / submit -> last DONE); reported as p50 / p95 first audio over all rounds' segments and
the mean audio-s/s, with the Multilingual audio-s/s of the busy rounds beside them. Run alone (timings):

    flock -x /work/cpu.lock .venv/bin/python scripts/bench_models.py --weights random-full --out out/bench_models

--weights random-tiny runs end to end in a minute. Output: a table on stdout and <out>.json.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import threading
import time
from dataclasses import dataclass, field, replace
from pathlib import Path

import numpy as np
import torch

from synth import build_engine, default_voice
from synth.api import (
    AudioChunk,
    EngineConfig,
    EngineLike,
    EngineOutput,
    EventKind,
    SamplingParams,
    SegmentEvent,
    SegmentRequest,
)
from synth.engine import Engine
from synth.models import MultiEngine, model_config

TURBO_TEXT = "Thanks for calling, how can I help you today?"
BUSY_TEXT = "Bonjour, je vous lis maintenant le long résumé de votre dernier appel, point par point."
OUTPUT_RATE_HZ = 24_000
LABELS = {"quiet": "beside Multilingual, idle", "busy": "beside Multilingual, busy",
          "alone": "alone (one-model Engine)"}


@dataclass
class Segment:
    submitted_s: float
    first_audio_s: float = 0.0
    done_s: float = 0.0
    samples: int = 0
    done: threading.Event = field(default_factory=threading.Event)

    def sink(self, output: EngineOutput) -> None:
        if isinstance(output, AudioChunk):
            if not self.first_audio_s:
                self.first_audio_s = time.monotonic()
            self.samples += output.pcm.size
        elif isinstance(output, SegmentEvent) and output.kind >= EventKind.DONE:
            self.done_s = time.monotonic()
            self.done.set()


class BusyLoad:
    """--busy Multilingual segments running the whole time: each resubmitted from its sink's thread when it ends."""

    def __init__(self, engine: MultiEngine, sessions: int, tokens: int) -> None:
        self.engine, self.sessions, self.tokens = engine, sessions, tokens
        self.running = False
        self.samples = 0
        self.count = 0
        self.current: dict[int, str] = {}  # slot -> its segment's request id now
        self.lock = threading.Lock()

    def start(self) -> None:
        self.running, self.samples = True, 0
        for i in range(self.sessions):
            self._submit(i)

    def stop(self) -> None:
        """Cancel the running segments (none is resubmitted from here on)."""
        self.running = False
        with self.lock:
            current = list(self.current.values())
        for rid in current:
            self.engine.cancel(rid)

    def _submit(self, slot: int) -> None:
        with self.lock:
            self.count += 1
            rid = f"busy-{slot}-{self.count}"
            self.current[slot] = rid
        params = replace(SamplingParams.defaults("multilingual"), seed=self.count, max_new_tokens=self.tokens)

        def sink(output: EngineOutput) -> None:
            if isinstance(output, AudioChunk):
                with self.lock:
                    self.samples += output.pcm.size
            elif isinstance(output, SegmentEvent) and output.kind >= EventKind.DONE and self.running:
                self._submit(slot)

        self.engine.submit(SegmentRequest(request_id=rid, text=BUSY_TEXT, params=params, sink=sink,
                                          language="fr", model="multilingual", first_audio_pending=False))


def turbo_round(engine: EngineLike, round_no: int, sessions: int, tokens: int) -> tuple[list[Segment], float]:
    segments = []
    started = time.monotonic()
    for i in range(sessions):
        segment = Segment(submitted_s=time.monotonic())
        params = replace(SamplingParams.defaults("turbo"), seed=1000 * round_no + i, max_new_tokens=tokens)
        engine.submit(SegmentRequest(request_id=f"turbo-{round_no}-{i}", text=TURBO_TEXT, params=params,
                                     sink=segment.sink))  # the default model: Turbo
        segments.append(segment)
    for segment in segments:
        if not segment.done.wait(900):
            raise RuntimeError("a Turbo segment did not finish in 900 s")
    wall_s = max(s.done_s for s in segments) - started
    return segments, sum(s.samples for s in segments) / OUTPUT_RATE_HZ / wall_s


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--weights", default="random-full")
    parser.add_argument("--sessions", type=int, default=2, help="Turbo segments per round")
    parser.add_argument("--tokens", type=int, default=50, help="speech tokens per Turbo segment (25 a second)")
    parser.add_argument("--busy", type=int, default=2, help="Multilingual segments running in the busy rounds")
    parser.add_argument("--busy-tokens", type=int, default=150)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--threads", default="", help="decode,vocoder threads of each model (default: the engine's)")
    parser.add_argument("--out", type=Path, default=Path("out/bench_models"))
    args = parser.parse_args()

    decode_threads, vocoder_threads = (int(n) for n in args.threads.split(",")) if args.threads else (0, 0)
    config = EngineConfig(variant="turbo", models=("turbo", "multilingual"), weights=args.weights, device="cpu",
                          max_slots=max(args.sessions, args.busy, 1), cuda_graphs="off", seed=0,
                          decode_threads=decode_threads, vocoder_threads=vocoder_threads)
    t0 = time.monotonic()
    engine = build_engine(config)
    assert isinstance(engine, MultiEngine)
    engine.start()
    if not engine.wait_ready(1800):
        raise RuntimeError(f"engine not ready: {engine.failure}")
    ready_s = time.monotonic() - t0
    busy = BusyLoad(engine, args.busy, args.busy_tokens)
    results: dict[str, dict[str, list[float]]] = {
        mode: {"first_audio_ms": [], "turbo_audio_s_per_s": [], "multilingual_audio_s_per_s": []}
        for mode in ("quiet", "busy")}
    for round_no in range(args.rounds):
        for mode in ("quiet", "busy"):
            if mode == "busy":
                busy.start()
                time.sleep(2.0)  # the Multilingual segments are past their prefill and rendering
            began = time.monotonic()
            segments, rate = turbo_round(engine, 2 * round_no + (mode == "busy"), args.sessions, args.tokens)
            if mode == "busy":
                with busy.lock:
                    results[mode]["multilingual_audio_s_per_s"].append(
                        busy.samples / OUTPUT_RATE_HZ / (time.monotonic() - began))
                busy.stop()
                while engine.status()["models"]["multilingual"]["slots_in_use"]:  # type: ignore[index]
                    time.sleep(0.1)
                worker = engine.engines["multilingual"].vocoder_worker
                assert worker is not None
                ticks = -1
                while worker.ticks != ticks:  # its last render tick done: no render for a second
                    ticks = worker.ticks
                    time.sleep(1.0)
            results[mode]["first_audio_ms"] += [(s.first_audio_s - s.submitted_s) * 1e3 for s in segments]
            results[mode]["turbo_audio_s_per_s"].append(rate)
    engine.stop(120)
    # the reference: Turbo in an engine of its own (the same weights), after the two-model engine has stopped
    alone = Engine(engine.engines["turbo"].bundle, model_config(config, "turbo"))
    alone.voices.add(default_voice(alone.bundle))
    alone.start()
    if not alone.wait_ready(1800):
        raise RuntimeError(f"one-model engine not ready: {alone.failure}")
    results["alone"] = {"first_audio_ms": [], "turbo_audio_s_per_s": [], "multilingual_audio_s_per_s": []}
    for round_no in range(args.rounds):
        segments, rate = turbo_round(alone, 100 + round_no, args.sessions, args.tokens)
        results["alone"]["first_audio_ms"] += [(s.first_audio_s - s.submitted_s) * 1e3 for s in segments]
        results["alone"]["turbo_audio_s_per_s"].append(rate)
    alone.stop(120)

    rows = []
    for mode, r in results.items():
        ttfa = np.array(r["first_audio_ms"])
        rows.append({"mode": mode, "segments": len(ttfa), "first_audio_p50_ms": float(np.percentile(ttfa, 50)),
                     "first_audio_p95_ms": float(np.percentile(ttfa, 95)),
                     "turbo_audio_s_per_s": statistics.fmean(r["turbo_audio_s_per_s"]),
                     "multilingual_audio_s_per_s": (statistics.fmean(r["multilingual_audio_s_per_s"])
                                                    if r["multilingual_audio_s_per_s"] else 0.0)})
    print(f"weights {args.weights}, {args.sessions} Turbo segments x {args.tokens} tokens a round, "
          f"{args.rounds} rounds each; busy: {args.busy} Multilingual segments x {args.busy_tokens} tokens; "
          f"engine ready in {ready_s:.0f} s")
    print("| Turbo served | first audio p50 ms | p95 ms | Turbo audio-s/s | Multilingual audio-s/s |")
    print("|---|---|---|---|---|")
    for row in rows:
        print(f"| {LABELS[str(row['mode'])]} | {row['first_audio_p50_ms']:.0f} | {row['first_audio_p95_ms']:.0f} | "
              f"{row['turbo_audio_s_per_s']:.2f} | {row['multilingual_audio_s_per_s']:.2f} |")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    report = {"args": {k: str(v) for k, v in vars(args).items()}, "machine": platform.processor() or platform.machine(),
              "torch": torch.__version__, "threads": {m: engine.engines[m].threads.decode for m in engine.models},
              "ready_s": ready_s, "rows": rows, "raw": results}
    args.out.with_suffix(".json").write_text(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
