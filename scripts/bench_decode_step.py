"""Ops and milliseconds per decode step of the engine, steady state (every segment decoding, no admission).

Drives `Engine._step` on this thread (no engine thread, no vocoder), counts the aten ops one step dispatches
(a TorchDispatchMode) and times steps. One voice for every segment, or one voice per segment.

    .venv/bin/python scripts/bench_decode_step.py --variant turbo --size tiny --sessions 1 8 32

With `--threads 1 2` each measurement runs once per CPU thread count, and each row carries a hash of the last
step's logits: the same hash on every thread count means the same bits (a seeded segment's tokens do not depend
on `--threads`; tests/synth/test_t3_runner.py checks the tiny models, this the full-size ones).
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
from synth.voices import Voice

from tests.synth.op_counter import OpCounter

TEXT = "The quick brown fox jumps over the lazy dog."
WARM_STEPS = 3


def _voice(bundle: Any, voice_id: str, seed: int) -> Voice:
    g = torch.Generator().manual_seed(seed)
    plen = bundle.t3.hp.speech_cond_prompt_len
    return Voice(voice_id=voice_id, speaker_emb=torch.randn(1, 256, generator=g),
                 prompt_speech_tokens=torch.randint(0, 6561, (1, plen), generator=g), s3gen_ref={})


def measure(bundle: Any, variant: str, sessions: int, voices: int, steps: int, dtype: str, device: str,
            graphs: str, context_tokens: int, threads: int = 0, cpu_weights: str = "fp32") -> dict[str, object]:
    if threads > 0:
        torch.set_num_threads(threads)
    extra = {"cuda_graphs": graphs} if "cuda_graphs" in EngineConfig.__dataclass_fields__ else {}
    config = EngineConfig(variant=variant, weights="random", device=device, dtype=dtype,  # type: ignore[arg-type]
                          max_slots=sessions, max_context_tokens=context_tokens, cpu_weights=cpu_weights,
                          **extra)  # type: ignore[arg-type]
    engine = Engine(bundle, config, render_audio=False)
    for v in range(voices):
        engine.voices.add(_voice(bundle, f"v{v}", v))
    torch.set_grad_enabled(False)
    if hasattr(engine.runner, "capture_graphs"):  # every bucket's graphs before timing (CUDA, graphs on)
        engine.runner.capture_graphs()
    params = replace(SamplingParams.defaults(variant), seed=1, max_new_tokens=1000)  # type: ignore[arg-type]
    for i in range(sessions):
        engine.submit(SegmentRequest(request_id=f"s{i}", text=TEXT, voice_id=f"v{i % voices}",
                                     params=replace(params, seed=i), sink=lambda output: None))
    while len(engine.scheduler.running) < sessions or any(s.pending_token is None for s in engine.scheduler.running):
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
    n_layers = engine.runner.n_layers
    ops = counter.total
    logits = engine.runner.logits[:sessions].float().cpu().numpy()  # [sessions, V] the last step's
    digest = hashlib.sha256(logits.tobytes()).hexdigest()[:16]
    return {"variant": variant, "sessions": sessions, "voices": voices, "threads": torch.get_num_threads(),
            "cpu_weights": cpu_weights,
            "ops_per_step": ops, "ops_per_layer": round(ops / n_layers, 1), "ms_per_step": round(ms, 2),
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
    parser.add_argument("--json", default="")
    args = parser.parse_args()
    bundle = random_bundle(args.variant, args.size, torch.device(args.device))
    rows = []
    for sessions in args.sessions:
        choices = {"one": {1}, "each": {sessions}, "both": {1, sessions}}[args.voices]
        for voices in sorted(choices):
            for threads in args.threads:
                row = measure(bundle, args.variant, sessions, voices, args.steps, args.dtype, args.device,
                              args.cuda_graphs, args.context_tokens, threads, args.cpu_weights)
                row["size"] = args.size
                print(json.dumps(row), flush=True)
                rows.append(row)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
