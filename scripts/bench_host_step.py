#!/usr/bin/env python
"""Host time of one engine step, with a null runner: what the step loop costs the host beside the model.

On a GPU the decode step and sampling replay as CUDA graphs in a few milliseconds; what the host does around them
(the inbox, the scheduler, the runner's input writes, reading the sampled ids back into each segment, the hand-off
to the vocoder, the stats) is not captured and, unless it overlaps the device, adds to every step. This measures
it alone: the real `Engine._step` on this thread, the real scheduler and input writes, a runner that does no tensor
work (it returns made-up ids, never EOS) and a vocoder worker that drops what it is fed. Steady state: N segments
decoding, none admitted or ended in the measured steps.

    flock -x /work/cpu.lock .venv/bin/python scripts/bench_host_step.py --rows 1 64 128 256
    # old code beside new, one run:  --repo old=/tmp/checkout-at-f8334de --repo new=.

Each checkout runs in its own process (its `synth` first on the path). Prints a table (median and mean host us per
step, and the ratio to 1 row) and writes JSON (--json). Targets on the 2-core CI machine (issue 34): <= 300 us per
step at 128 rows, and at most 2x from 1 row to 256. tests/synth/test_bench_smoke.py runs it as a smoke test (it
checks that it runs and reports, not how fast).
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
TEXT = "Counting what the host does for one step."
SEGMENT_TOKENS = 1000  # no segment ends while the steps are measured
WARM_STEPS = 20


class NullWorker:
    """Takes the engine's vocoder hand-off and drops it (what the engine thread does to feed it stays measured)."""

    failure = ""
    ticks = 0

    def __init__(self) -> None:
        self.fed = 0

    def feed(self, items: Any) -> None:
        self.fed += 1

    def cancel(self, request_id: str) -> None:
        pass

    def take_stats(self) -> None:
        return None

    def prepare_voice(self, voice: Any) -> None:
        pass


def _engine(rows: int) -> tuple[Any, Any]:
    """A started-in-place (no thread) engine of `rows` one-row segments with the null runner and null worker."""
    import torch

    from synth.api import EngineConfig
    from synth.engine import Engine
    from synth.loading import random_bundle
    from synth.voices import Voice

    bundle = random_bundle("turbo", "tiny", torch.device("cpu"))
    config = EngineConfig(variant="turbo", weights="random-tiny", device="cpu", max_slots=rows,
                          max_context_tokens=SEGMENT_TOKENS + 64, cuda_graphs="off")
    if hasattr(Engine, "_execute"):  # the engine before issue 34: its runner calls live in Engine._execute
        engine = Engine(bundle, config, render_audio=False)
        setattr(engine, "_execute", _old_null_execute(engine))  # noqa: B010 (an attribute this engine lacks)
    else:
        from synth.null_runner import NullRunner

        engine = Engine(bundle, config, render_audio=False, runner_factory=NullRunner)
    worker = NullWorker()
    setattr(engine, "vocoder_worker", worker)  # noqa: B010 (not a VocoderWorker)
    g = torch.Generator().manual_seed(0)
    plen = bundle.t3.hp.speech_cond_prompt_len
    engine.voices.add(Voice(voice_id="v", speaker_emb=torch.randn(1, 256, generator=g),
                            prompt_speech_tokens=torch.randint(0, 6561, (1, plen), generator=g), s3gen_ref={}))
    return engine, worker


def _old_null_execute(engine: Any) -> Any:
    """The old boundary (`Engine._execute(plan) -> (ids, prefill_ms)`) without its tensor work: the host writes it
    did (every row's step inputs, an admitted segment's sampling parameters and generator seed) and made-up ids."""
    step = [0]
    bos = 1 if engine.is_llama is False else 2

    def execute(plan: Any) -> tuple[list[int], float]:
        for state in plan.prefill:
            state.next_pos = engine.prefix_positions + len(state.text_ids) + bos
            engine._write_row_params(state)
            state.admitted_s = time.monotonic()
        engine._write_step_inputs(plan)
        step[0] += 1
        return [(7 * step[0] + state.rows[0]) % 6000 for state in plan.sampled], 0.0

    return execute


def _decoding(engine: Any, rows: int) -> bool:
    running = engine.scheduler.running
    if len(running) < rows:
        return False
    if hasattr(running[0], "pending_token"):
        return all(s.pending_token is not None for s in running)
    return all(s.tokens or engine.scheduler.tokens_sampled(s) for s in running)


def measure(rows: int, steps: int) -> dict[str, Any]:
    from synth.api import SamplingParams, SegmentRequest

    engine, worker = _engine(rows)
    params = replace(SamplingParams.defaults("turbo"), max_new_tokens=SEGMENT_TOKENS)
    for i in range(rows):
        engine.submit(SegmentRequest(request_id=f"s{i}", text=TEXT, voice_id="v", params=replace(params, seed=i),
                                     sink=lambda output: None))
    for _ in range(10 * rows + 100):
        if _decoding(engine, rows):
            break
        engine._step()
    else:
        raise RuntimeError(f"{rows} segments never all decoded")
    for _ in range(WARM_STEPS):
        engine._step()
    gc.collect()
    fed = worker.fed
    times_us = []
    for _ in range(steps):
        t0 = time.perf_counter_ns()
        engine._step()
        times_us.append((time.perf_counter_ns() - t0) / 1e3)
    if len(engine.scheduler.running) != rows:
        raise RuntimeError(f"{rows - len(engine.scheduler.running)} segments ended while measured")
    return {"rows": rows, "steps": steps, "median_us": round(statistics.median(times_us), 1),
            "mean_us": round(statistics.fmean(times_us), 1), "p90_us": round(sorted(times_us)[int(0.9 * steps)], 1),
            "vocoder_feeds": worker.fed - fed}  # hand-offs during the measured steps


def child(args: argparse.Namespace) -> None:
    import torch

    torch.set_num_threads(1)
    for rows in args.rows:
        print(json.dumps(measure(rows, args.steps)), flush=True)


def run_repo(label: str, repo: Path, args: argparse.Namespace) -> dict[str, Any]:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(repo), os.environ.get("PYTHONPATH")]))}
    command = [sys.executable, str(Path(__file__).resolve()), "--child", "--steps", str(args.steps),
               "--rows", *map(str, args.rows)]
    proc = subprocess.run(command, cwd=repo, env=env, capture_output=True, text=True, check=False)
    rows = [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]
    commit = subprocess.run(["git", "-C", str(repo), "rev-parse", "--short", "HEAD"], capture_output=True,
                            text=True, check=False).stdout.strip() or "unknown"
    result: dict[str, Any] = {"label": label, "repo": str(repo), "commit": commit, "rows": rows}
    if proc.returncode != 0:
        result["error"] = proc.stderr.strip().splitlines()[-1] if proc.stderr.strip() else f"exit {proc.returncode}"
        print(proc.stderr[-3000:], file=sys.stderr)
    return result


def print_table(results: list[dict[str, Any]]) -> None:
    print(f"\n{'checkout':12} {'rows':>5} {'median us':>10} {'mean us':>9} {'p90 us':>8} {'x 1 row':>8}")
    for result in results:
        base = next((r["median_us"] for r in result["rows"] if r["rows"] == 1), None)
        for r in result["rows"]:
            ratio = f"{r['median_us'] / base:.2f}" if base else "-"
            print(f"{result['label'][:12]:12} {r['rows']:>5} {r['median_us']:>10.1f} {r['mean_us']:>9.1f} "
                  f"{r['p90_us']:>8.1f} {ratio:>8}")
        if "error" in result:
            print(f"{result['label'][:12]:12} error: {result['error']}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 64, 128, 256])
    parser.add_argument("--steps", type=int, default=300, help="measured steps per row count")
    parser.add_argument("--repo", action="append", default=[], help="[LABEL=]PATH of a checkout (repeat to compare)")
    parser.add_argument("--json", type=Path, default=None)
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        child(args)
        return
    if min(args.rows) < 1 or args.steps < 1:
        parser.error("--rows and --steps must be >= 1")
    results = []
    for value in args.repo or [f"this={REPO}"]:
        label, _, path = value.rpartition("=")
        results.append(run_repo(label or Path(path).name, Path(path).resolve(), args))
    print_table(results)
    report = {"machine": {"cpus": os.cpu_count(), "processor": platform.processor() or platform.machine(),
                          "python": platform.python_version()},
              "date": time.strftime("%Y-%m-%d"), "steps": args.steps, "runs": results}
    if args.json is not None:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(report, indent=2))
        print(f"json: {args.json}")
    if any("error" in r for r in results):
        sys.exit(1)


if __name__ == "__main__":
    main()
