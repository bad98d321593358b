"""Ops and milliseconds per decode step of the engine, steady state (every segment decoding, no admission).

Drives `Engine._step` on this thread (no engine thread, no vocoder), counts the aten ops one step dispatches
(a TorchDispatchMode) and times steps. One voice for every segment, or one voice per segment.

    .venv/bin/python scripts/bench_decode_step.py --variant turbo --size tiny --sessions 1 8 32

With `--threads 1 2` each measurement runs once per CPU thread count, and each row carries a hash of the last
step's logits: the same hash on every thread count means the same bits (a seeded segment's tokens do not depend
on `--threads`; tests/synth/test_t3_runner.py checks the tiny models, this the full-size ones).

Each row also has the step's memory floor: the bytes a step must read at least (every projection weight once, and
the keys and values of its (row bucket, key bucket)) over the device's copy bandwidth, measured here
(`floor_ms`, and `x_floor` = ms_per_step / floor_ms; the goal on an H100/H200 is within 3x).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import sys
import time
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # this checkout's synth and tests

from synth.api import EngineConfig, SamplingParams, SegmentRequest
from synth.engine import Engine
from synth.loading import random_bundle
from synth.t3_runner import projections
from synth.voices import Voice

from tests.synth.op_counter import OpCounter

TEXT = "The quick brown fox jumps over the lazy dog."
WARM_STEPS = 3


def _voice(bundle: Any, voice_id: str, seed: int) -> Voice:
    g = torch.Generator().manual_seed(seed)
    plen = bundle.t3.hp.speech_cond_prompt_len
    return Voice(voice_id=voice_id, speaker_emb=torch.randn(1, 256, generator=g),
                 prompt_speech_tokens=torch.randint(0, 6561, (1, plen), generator=g), s3gen_ref={})


def copy_bandwidth(device: torch.device) -> float:
    """Bytes per second a device-to-device copy moves (read + write), best of five: the memory-bound ceiling."""
    size = (1 << 30) if device.type == "cuda" else (1 << 27)
    src = torch.ones(size // 4, dtype=torch.float32, device=device)
    dst = torch.empty_like(src)
    best = float("inf")
    for _ in range(5):
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        t0 = time.perf_counter()
        dst.copy_(src)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        best = min(best, time.perf_counter() - t0)
    return 2 * size / best


def step_bytes(engine: Engine) -> tuple[int, tuple[int, int]]:
    """What one decode step reads at least: the projection weights once, and the keys and values of its bucket;
    and the (row bucket, key bucket) it ran in."""
    runner = engine.runner
    table = engine.scheduler.table
    span = engine.scheduler.rows_span
    weights = sum(p.numel() * p.element_size() for module in projections(runner.t3) for p in module.parameters())
    if span == 0:  # every segment ended before the last step (the timed steps outlasted them): no rows, no keys
        return weights, (0, 0)
    n_rows, n_keys = runner.step_shape(span - 1, int(table.next_pos[:span].max()))
    cache = runner.cache
    _, _, heads, _, head_dim = cache.all_keys.shape  # [layers, rows, H, L, D]
    per_position = 2 * heads * head_dim * cache.all_keys.element_size()  # keys and values of one row, one layer
    return weights + runner.n_layers * n_rows * n_keys * per_position, (n_rows, n_keys)


def measure(bundle: Any, variant: str, sessions: int, voices: int, steps: int, dtype: str, device: str,
            graphs: str, context_tokens: int, threads: int = 0, cpu_weights: str = "fp32",
            bandwidth: float = 0.0, overlap_steps: str = "auto") -> dict[str, object]:
    if threads > 0:
        torch.set_num_threads(threads)
    extra: dict[str, object] = {"cuda_graphs": graphs} if "cuda_graphs" in EngineConfig.__dataclass_fields__ else {}
    if "overlap_steps" in EngineConfig.__dataclass_fields__:
        extra["overlap_steps"] = overlap_steps
    config = EngineConfig(variant=variant, weights="random", device=device, dtype=dtype,  # type: ignore[arg-type]
                          max_slots=sessions, max_context_tokens=context_tokens, cpu_weights=cpu_weights,
                          **extra)  # type: ignore[arg-type]
    engine = Engine(bundle, config, render_audio=False)
    for v in range(voices):
        engine.voices.add(_voice(bundle, f"v{v}", v))
    torch.set_grad_enabled(False)
    if engine.runner.use_graphs:  # every bucket's graphs before timing (CUDA, graphs on), checked as at start-up
        engine._capture_decode_graphs()
    params = replace(SamplingParams.defaults(variant), seed=1, max_new_tokens=1000)  # type: ignore[arg-type]
    for i in range(sessions):
        engine.submit(SegmentRequest(request_id=f"s{i}", text=TEXT, voice_id=f"v{i % voices}",
                                     params=replace(params, seed=i), sink=lambda output: None))
    while len(engine.scheduler.running) < sessions or any(
            not engine.scheduler.tokens_sampled(s) for s in engine.scheduler.running):
        engine._step()
    for _ in range(WARM_STEPS):
        engine._step()
    counter = OpCounter()
    with counter:
        engine._step()
    sync: Callable[[], None] = torch.cuda.synchronize if engine.device.type == "cuda" else (lambda: None)
    sync()
    t0 = time.perf_counter()
    for _ in range(steps):
        engine._step()
    sync()
    ms = (time.perf_counter() - t0) * 1e3 / steps
    if len(engine.scheduler.running) < sessions:
        print(f"warning: {sessions - len(engine.scheduler.running)} of {sessions} segments ended during the "
              f"{steps} timed steps (EOS or the context): ms_per_step averages fewer rows; use fewer --steps",
              file=sys.stderr)
    n_layers = engine.runner.n_layers
    ops = counter.total
    logits = engine.runner.logits[:sessions].float().cpu().numpy()  # [sessions, V] the last step's
    digest = hashlib.sha256(logits.tobytes()).hexdigest()[:16]
    floor_bytes, (n_rows, n_keys) = step_bytes(engine)
    floor_ms = floor_bytes / bandwidth * 1e3 if bandwidth else 0.0
    return {"variant": variant, "sessions": sessions, "voices": voices, "threads": torch.get_num_threads(),
            "cpu_weights": cpu_weights, "dtype": dtype, "graphs": engine.status()["cuda_graphs_state"],
            "overlap_steps": engine.overlap_steps,
            "ops_per_step": ops, "ops_per_layer": round(ops / n_layers, 1), "ms_per_step": round(ms, 2),
            "row_bucket": n_rows, "key_bucket": n_keys, "floor_mb": round(floor_bytes / 1e6, 1),
            "floor_ms": round(floor_ms, 3), "x_floor": round(ms / floor_ms, 2) if floor_ms and n_rows else None,
            "running": len(engine.scheduler.running), "logits_sha256": digest}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--variant", default="turbo")
    parser.add_argument("--size", default="tiny", choices=["tiny", "full"])
    parser.add_argument("--sessions", type=int, nargs="+", default=[1, 8, 32])
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--cuda-graphs", default="auto")
    parser.add_argument("--voices", default="both", choices=["one", "each", "both"],
                        help="one voice for every segment, a voice per segment, or both")
    parser.add_argument("--context-tokens", type=int, default=256, help="KV positions per row after the prefix")
    parser.add_argument("--threads", type=int, nargs="+", default=[0],
                        help="CPU thread counts to run each measurement with (0: leave the count as it is)")
    parser.add_argument("--cpu-weights", default="fp32", choices=["fp32", "bf16"],
                        help="CPU, float32 T3: bf16-stored projection weights (the server's --cpu-weights)")
    parser.add_argument("--overlap-steps", default="auto", choices=["auto", "on", "off"],
                        help="launch step k+1 before reading step k's ids (auto: with CUDA graphs)")
    parser.add_argument("--json", default="")
    args = parser.parse_args()
    bundle = random_bundle(args.variant, args.size, torch.device(args.device))
    bandwidth = copy_bandwidth(torch.device(args.device))
    print(json.dumps({"copy_bandwidth_gb_s": round(bandwidth / 1e9, 1), "device": args.device}), flush=True)
    rows = []
    for sessions in args.sessions:
        choices = {"one": {1}, "each": {sessions}, "both": {1, sessions}}[args.voices]
        for voices in sorted(choices):
            for threads in args.threads:
                row = measure(bundle, args.variant, sessions, voices, args.steps, args.dtype, args.device,
                              args.cuda_graphs, args.context_tokens, threads, args.cpu_weights, bandwidth,
                              args.overlap_steps)
                row["size"] = args.size
                print(json.dumps(row), flush=True)
                rows.append(row)
                if args.json:  # after every row: a run cut short keeps what it measured
                    with open(args.json, "w") as f:
                        json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
