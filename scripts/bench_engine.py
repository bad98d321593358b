"""Engine benchmark on full-size random weights: batched step loop vs chatterbox's sequential T3.inference.

For each variant, in one run on the same model:
  * sequential: chatterbox's own `T3.inference` / `inference_turbo`, one segment after another, as shipped
    (the `speedup` figures), and again with its projections run by the engine's kernels (oneDNN-prepacked
    on CPU: `speedup_same_kernels`), which isolates what batching buys from what the kernels buy;
  * batched: our engine with N segments submitted at once (T3 only, the vocoder off), N in --segments;
  * time to first audio for one segment alone (engine with the streaming vocoder, after a warm-up);
  * S3Gen milliseconds per second of audio for that segment.
Sequential throughput does not depend on how many segments queue behind each other, so it is measured
once per variant (over --sequential-segments segments) and every speedup is relative to it.
Prints a table and writes JSON (`speedup`: segments -> aggregate tokens/s relative to sequential).

    python scripts/bench_engine.py --threads 2 --ttfa-threads 1 --out out/bench_engine.json

`--ops` measures instead what one steady decode step costs the host (issue 14): aten ops dispatched, device->host
reads and host->device transfers (tests/synth/op_counts.py, counted over `Engine._step`), and ms per step
(uncounted steps; CUDA synchronized around each), for each variant and preset size at N segments on 1 voice and
on N distinct voices. `--repo LABEL=PATH` runs the same measurement against another checkout's `synth` (a
subprocess with that checkout first on sys.path), so before/after sit in one table:

    python scripts/bench_engine.py --ops --ops-sizes tiny full --repo main=/work/main --out out/ops.json
    python scripts/bench_engine.py --ops --device cuda --dtype bfloat16 --out out/ops_cuda.json
"""

from __future__ import annotations

import argparse
import functools
import importlib.util
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import replace
from pathlib import Path
from types import ModuleType
from typing import Any

import torch

# The `synth` measured: this checkout's, or (--repo) the one a parent run names in SYNTH_ROOT_ENV. The venv's
# editable install points at one fixed checkout, so the path goes first either way.
SYNTH_ROOT_ENV = "BENCH_ENGINE_SYNTH_ROOT"
THIS_REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, os.environ.get(SYNTH_ROOT_ENV) or str(THIS_REPO))

from synth import default_voice, linear_bf16w  # noqa: E402
from synth.api import AudioChunk, EngineConfig, EventKind, SamplingParams, SegmentEvent, SegmentRequest, Variant  # noqa: E402
from synth.engine import Engine  # noqa: E402
from synth.loading import ModelBundle, load_models  # noqa: E402
from synth.request import SPEECH_VOCAB_SIZE  # noqa: E402
from synth.t3_runner import T3Runner, projections  # noqa: E402
from synth.text import text_token_ids  # noqa: E402

TEXTS = [
    "Thanks for calling, how can I help you today?",
    "Your order shipped this morning and should arrive on Friday.",
    "I can move your appointment to three thirty if that works.",
    "Let me check that for you, it will only take a moment.",
]


def sequential_reference(bundle: ModelBundle, n_segments: int, n_tokens: int) -> tuple[float, list[list[int]]]:
    """Aggregate tokens/s of chatterbox's own inference run one segment at a time, and the tokens."""
    t3 = bundle.t3
    voice = default_voice(bundle)
    defaults = SamplingParams.defaults(bundle.variant)
    outputs: list[list[int]] = []
    total_tokens = 0
    t0 = time.perf_counter()
    for i in range(n_segments):
        ids = torch.tensor([text_token_ids(bundle.variant, bundle.tokenizer, TEXTS[i % len(TEXTS)], None)],
                           device=bundle.device)
        torch.manual_seed(100 + i)
        cond = voice.t3_cond(defaults.exaggeration, bundle.device)
        if bundle.variant == "turbo":
            out = t3.inference_turbo(cond, ids, max_gen_len=n_tokens - 1)[0].tolist()
        else:
            out = t3.inference(t3_cond=cond, text_tokens=torch.cat([ids, ids]), max_new_tokens=n_tokens,
                               cfg_weight=defaults.cfg_weight, top_p=defaults.top_p)[0].tolist()
        outputs.append(out)
        total_tokens += len(out)
    return total_tokens / (time.perf_counter() - t0), outputs


@contextmanager
def reference_on_runner_kernels(bundle: ModelBundle, runner: T3Runner) -> Iterator[bool]:
    """Run chatterbox's own T3 projections through the runner's packed kernels (same weights) meanwhile."""
    if runner.linears is None:
        yield False
        return
    modules = projections(bundle.t3)
    linears = runner.linears
    # the runner runs some projections fused (Llama's q, k, v): pack the library's own ones the same way for this
    missing = [m for m in modules if not linears.covers(m)]
    extra = type(linears)(missing) if missing else None
    for module in modules:
        kernels = linears if linears.covers(module) or extra is None else extra
        module.forward = functools.partial(kernels, module)  # instance attribute shadows the class's
    try:
        yield True
    finally:
        for module in modules:
            del module.forward


def run_batched(engine: Engine, n_segments: int, n_tokens: int, tag: str) -> tuple[float, list[list[int]], float]:
    """Submit n segments at once; aggregate tokens/s until the last one's T3 finished; and mean step ms."""
    done = threading.Event()
    tokens: dict[int, list[int]] = {}
    lock = threading.Lock()
    step_ms: list[float] = []
    engine.set_stats_listener(lambda s: step_ms.append(s.decode_ms) if s.decode_rows else None)
    defaults = SamplingParams.defaults(engine.variant)

    def sink_for(i: int) -> Callable[[Any], None]:
        def sink(out: Any) -> None:
            if isinstance(out, SegmentEvent) and out.kind == EventKind.GENERATED:
                with lock:
                    tokens[i] = list(out.token_ids)
                    if len(tokens) == n_segments:
                        done.set()
            elif isinstance(out, SegmentEvent) and out.kind >= EventKind.CANCELLED:
                raise RuntimeError(f"segment {i} ended with {out.kind.name}: {out.reason}")
        return sink

    t0 = time.perf_counter()
    for i in range(n_segments):
        engine.submit(SegmentRequest(request_id=f"{tag}-{i}", text=TEXTS[i % len(TEXTS)], sink=sink_for(i),
                                     params=replace(defaults, seed=100 + i, max_new_tokens=n_tokens)))
    assert done.wait(3600), "batched run did not finish"
    elapsed = time.perf_counter() - t0
    engine.set_stats_listener(None)
    ordered = [tokens[i] for i in range(n_segments)]
    steady = sorted(step_ms)[len(step_ms) // 2] if step_ms else float("nan")
    return sum(len(t) for t in ordered) / elapsed, ordered, steady


def time_to_first_audio(bundle: ModelBundle, n_tokens: int, cpu_weights: str = "fp32") -> dict[str, float]:
    """One segment alone through the whole engine (T3 + streaming vocoder), after a warm-up segment."""
    engine = Engine(bundle, EngineConfig(variant=bundle.variant, max_slots=1, max_context_tokens=1024,
                                         cpu_weights=cpu_weights))
    engine.voices.add(default_voice(bundle))
    engine.start()
    assert engine.wait_ready(600)
    result: dict[str, float] = {}
    steps: list[Any] = []  # StepStats of the segment's steps (one sampled token each)

    def stats(s: Any) -> None:
        steps.append(s)

    for attempt in ("warmup", "measured"):
        first_chunk = threading.Event()
        finished = threading.Event()
        marks: dict[str, float] = {}
        generated: list[int] = []

        def sink(out: Any, marks: dict[str, float] = marks, first_chunk: threading.Event = first_chunk,
                 generated: list[int] = generated, finished: threading.Event = finished) -> None:
            if isinstance(out, AudioChunk) and "chunk" not in marks:
                marks["chunk"] = out.ready_monotonic_s
                marks["chunk_tokens"] = out.speech_tokens
                first_chunk.set()
            elif isinstance(out, SegmentEvent) and out.kind == EventKind.STARTED:
                marks["first_token"] = out.at_monotonic_s
            elif isinstance(out, SegmentEvent) and out.kind == EventKind.GENERATED:
                generated.extend(out.token_ids)
            elif isinstance(out, SegmentEvent) and out.kind >= EventKind.DONE:
                finished.set()

        steps.clear()
        engine.set_stats_listener(stats)
        submitted = time.monotonic()
        engine.submit(SegmentRequest(request_id=attempt, text=TEXTS[0], sink=sink,
                                     params=replace(SamplingParams.defaults(bundle.variant), seed=7,
                                                    max_new_tokens=n_tokens)))
        assert finished.wait(3600)
        if attempt == "measured":
            # the step that emitted the first chunk is the first one recorded after it; none when the vocoder's
            # thread finished that chunk after T3 had generated the whole (short) segment
            stepped = [st for st in steps if not st.renders_only]  # (renders-only records: T3 was idle)
            k = next((i for i, st in enumerate(stepped) if st.at_monotonic_s >= marks["chunk"]), len(stepped) - 1)
            decode_ms = sorted(st.decode_ms for st in stepped[1:k + 1])
            sampled = generated[:k + 1]  # one token per step up to the first chunk
            dropped = sum(t >= SPEECH_VOCAB_SIZE for t in sampled)
            result = {"first_chunk_s": marks["chunk"] - submitted, "first_token_s": marks["first_token"] - submitted,
                      "first_chunk_tokens": marks["chunk_tokens"], "steps_to_first_chunk": k + 1,
                      "dropped_ids_before_first_chunk": dropped,
                      "median_decode_step_ms": decode_ms[len(decode_ms) // 2],
                      "first_render_ms": stepped[k].vocoder_ms,
                      "s3gen_ms_per_audio_s": (sum(st.vocoder_ms for st in steps)
                                               / max(sum(st.audio_s for st in steps), 1e-9)),
                      "audio_s": sum(st.audio_s for st in steps)}
            # Random weights sample ids >= 6561 (dropped before S3Gen) far more often than a trained model,
            # which emits none but EOS: the same run with those steps taken out (an estimate, labelled so).
            result["first_chunk_s_without_dropped_ids"] = (result["first_chunk_s"]
                                                          - dropped * result["median_decode_step_ms"] / 1e3)
    engine.stop()
    return result


def throughput(bundle: ModelBundle, args: argparse.Namespace) -> dict[str, Any]:
    """Sequential reference (as shipped and on the engine's kernels) vs the engine at each batch size."""
    v = bundle.variant
    engine = Engine(bundle, EngineConfig(variant=v, max_slots=max(args.segments), dtype=args.dtype,
                                         max_context_tokens=512, prefill_budget_segments=4,
                                         cpu_weights=args.cpu_weights),
                    render_audio=False)
    seq_tps, seq_tokens = sequential_reference(bundle, args.sequential_segments, args.tokens)
    print(f"   sequential T3.inference (as shipped): {seq_tps:.2f} tokens/s", flush=True)
    same_kernel_tps = seq_tps
    with reference_on_runner_kernels(bundle, engine.runner) as patched:
        if patched:
            same_kernel_tps, _ = sequential_reference(bundle, args.sequential_segments, args.tokens)
            print(f"   sequential T3.inference on the engine's kernels: {same_kernel_tps:.2f} tokens/s", flush=True)
    engine.voices.add(default_voice(bundle))
    engine.start()
    assert engine.wait_ready(600)
    rows = []
    batched_tokens: dict[int, list[list[int]]] = {}
    for n in args.segments:
        tps, tokens, step_ms = run_batched(engine, n, args.tokens, f"{v}-{n}")
        batched_tokens[n] = tokens
        same = sum(tokens[i] == seq_tokens[i] for i in range(min(n, len(seq_tokens))))
        rows.append({"segments": n, "tokens_per_s": tps, "speedup": tps / seq_tps,
                     "speedup_same_kernels": tps / same_kernel_tps, "decode_step_ms": step_ms,
                     "equal_to_reference": f"{same}/{min(n, len(seq_tokens))}"})
        print(f"   batched x{n:<3} {tps:8.2f} tokens/s  speedup {tps / seq_tps:5.2f}x "
              f"(same kernels {tps / same_kernel_tps:5.2f}x)  step {step_ms:7.1f} ms  "
              f"tokens equal to reference {same}/{min(n, len(seq_tokens))}", flush=True)
    # batch invariance: segment i (same text, same seed) in every run vs in the largest run
    largest = batched_tokens[max(batched_tokens)]
    compared = [(n, i) for n, runs in batched_tokens.items() for i in range(len(runs)) if n != max(batched_tokens)]
    invariant = sum(batched_tokens[n][i] == largest[i] for n, i in compared)
    print(f"   same tokens in a batch of {max(batched_tokens)} as in smaller batches: {invariant}/{len(compared)}")
    engine.stop()
    entry: dict[str, Any] = {"sequential_tokens_per_s": seq_tps,
                             "sequential_same_kernels_tokens_per_s": same_kernel_tps, "batched": rows,
                             "speedup": {str(r["segments"]): round(r["speedup"], 3) for r in rows},
                             "speedup_same_kernels": {str(r["segments"]): round(r["speedup_same_kernels"], 3)
                                                      for r in rows},
                             "batch_invariant_segments": f"{invariant}/{len(compared)}"}
    del engine
    return entry


# --- --ops: what one decode step costs the host ------------------------------------------------------------

OPS_CONTEXT_TOKENS = 128  # KV positions per slot: the text, the BOS block, admission and the measured steps fit


def _load_op_counts() -> ModuleType:
    """tests/synth/op_counts.py of THIS checkout (by path: with --repo, `tests` on sys.path is the other one's)."""
    path = THIS_REPO / "tests" / "synth" / "op_counts.py"
    spec = importlib.util.spec_from_file_location("bench_op_counts", path)
    if spec is None or spec.loader is None:
        raise RuntimeError(f"cannot load {path}")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


def _n_layers(bundle: ModelBundle) -> int:
    cfg = bundle.t3.cfg
    return int(cfg.n_layer if bundle.t3.is_gpt else cfg.num_hidden_layers)


def ops_rows(args: argparse.Namespace) -> list[dict[str, Any]]:
    """One row per (size, variant, segments, voices): ops, transfers and ms per steady decode step."""
    op_counts = _load_op_counts()
    rows: list[dict[str, Any]] = []
    for size in args.ops_sizes:
        for variant in args.variants:
            v: Variant = variant
            segments = args.ops_turbo_segments if v == "turbo" else args.ops_segments
            print(f"== ops: {v}/{size} on {args.device} ({args.dtype}), segments {segments}", flush=True)
            bundle = load_models(v, f"random-{size}", args.device)
            engine = Engine(bundle, EngineConfig(variant=v, device=args.device, dtype=args.dtype,
                                                 max_slots=max(segments), max_context_tokens=args.ops_context,
                                                 decode_threads=args.threads),
                            render_audio=False)
            engine.voices.add(default_voice(bundle))
            engine.start()
            if not engine.wait_ready(1800):
                raise RuntimeError(f"engine not ready: {engine.failure}")
            probe = op_counts.StepProbe(engine)
            try:
                for n in segments:
                    for n_voices in sorted({1, n}):
                        steps = op_counts.measure_decode_steps(engine, n, n_voices, steps=args.ops_steps, probe=probe,
                                                               timed_steps=args.ops_timed_steps)
                        counted, timed = steps[:args.ops_steps], steps[args.ops_steps:]
                        worst = max(counted, key=lambda c: (c.ops, c.host_syncs))
                        row = {"variant": v, "size": size, "segments": n, "voices": n_voices, "ops": worst.ops,
                               "ops_per_layer": round(worst.ops / _n_layers(bundle), 1),
                               "kernel_ops": worst.kernel_ops,
                               "kernel_ops_per_layer": round(worst.kernel_ops / _n_layers(bundle), 1),
                               "device_to_host": worst.device_to_host, "host_to_device": worst.host_to_device,
                               "ms": statistics.median(c.ms for c in timed) if timed else float("nan"),
                               "ops_all_steps": [c.ops for c in counted],
                               "transfers": dict(worst.transfers), "by_op": dict(worst.by_op.most_common())}
                        rows.append(row)
                        print(f"   {n:3d} segments, {n_voices:3d} voices: {row['ops']:6d} ops "
                              f"({row['ops_per_layer']:.1f}/layer, {row['kernel_ops']} not views)  "
                              f"d2h {row['device_to_host']:3d}  "
                              f"h2d {row['host_to_device']:3d}  {row['ms']:8.2f} ms/step", flush=True)
            finally:
                probe.close()
                engine.stop()
            del engine, bundle
    return rows


def ops_in_checkout(label: str, path: Path, args: argparse.Namespace) -> list[dict[str, Any]]:
    """The same --ops measurement run against the `synth` of the checkout at `path` (a subprocess)."""
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "ops.json"
        argv = [sys.executable, str(Path(__file__).resolve()), "--ops", "--variants", *args.variants,
                "--ops-sizes", *args.ops_sizes, "--ops-segments", *map(str, args.ops_segments),
                "--ops-turbo-segments", *map(str, args.ops_turbo_segments), "--ops-steps", str(args.ops_steps),
                "--ops-timed-steps", str(args.ops_timed_steps), "--ops-context", str(args.ops_context),
                "--device", args.device, "--dtype", args.dtype, "--threads", str(args.threads), "--out", str(out)]
        print(f"== ops against {label} ({path})", flush=True)
        subprocess.run(argv, check=True, cwd=path, env={**os.environ, SYNTH_ROOT_ENV: str(path)})
        rows: list[dict[str, Any]] = json.loads(out.read_text())["ops"]
    return rows


def print_ops_table(rows: list[dict[str, Any]]) -> None:
    print("\ncheckout  variant       size  segments  voices    ops  ops/layer  kernel_ops/layer  d2h  h2d    ms/step")
    for r in rows:
        print(f"{r.get('checkout', 'this'):8s}  {r['variant']:12s}  {r['size']:4s}  {r['segments']:8d}  "
              f"{r['voices']:6d}  {r['ops']:5d}  {r['ops_per_layer']:9.1f}  {r['kernel_ops_per_layer']:16.1f}  "
              f"{r['device_to_host']:3d}  {r['host_to_device']:3d}  {r['ms']:9.2f}")


def run_ops(args: argparse.Namespace, report: dict[str, Any]) -> None:
    rows = [{**r, "checkout": args.label} for r in ops_rows(args)]
    for spec in args.repo:
        label, _, path = spec.partition("=")
        if not path:
            raise SystemExit(f"--repo wants LABEL=PATH, not {spec!r}")
        rows += [{**r, "checkout": label} for r in ops_in_checkout(label, Path(path).resolve(), args)]
    report["ops"] = rows
    print_ops_table(rows)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--variants", nargs="+", default=["english", "turbo"])
    parser.add_argument("--segments", nargs="+", type=int, default=[1, 2, 4, 8, 16])
    parser.add_argument("--tokens", type=int, default=48, help="speech tokens per segment (fixed: random weights)")
    parser.add_argument("--sequential-segments", type=int, default=3)
    parser.add_argument("--ttfa-tokens", type=int, default=40, help="segment length for the time-to-first-audio run")
    parser.add_argument("--threads", type=int, default=2, help="torch threads for the throughput comparison")
    parser.add_argument("--ttfa-threads", type=int, default=1, help="torch threads for the time-to-first-audio run")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--cpu-weights", choices=["fp32", "bf16"], default="fp32",
                        help="bf16: T3's projection weights rounded to bf16 and stored so (EngineConfig.cpu_weights); "
                             "the sequential reference then runs chatterbox's inference on the same rounded model")
    parser.add_argument("--skip-ttfa", action="store_true")
    parser.add_argument("--ttfa-only", action="store_true", help="only the time-to-first-audio run")
    parser.add_argument("--weights", default="random-full", help="random-full (default) or random-tiny for a smoke run")
    parser.add_argument("--out", type=Path, default=Path("out/bench_engine.json"))
    parser.add_argument("--ops", action="store_true", help="ops, host transfers and ms per decode step instead")
    parser.add_argument("--ops-sizes", nargs="+", choices=["tiny", "full"], default=["tiny", "full"])
    parser.add_argument("--ops-segments", nargs="+", type=int, default=[1, 8, 32])
    parser.add_argument("--ops-turbo-segments", nargs="+", type=int, default=[1, 8, 32, 64])
    parser.add_argument("--ops-steps", type=int, default=2, help="counted steps per measurement")
    parser.add_argument("--ops-timed-steps", type=int, default=3, help="uncounted, timed steps per measurement")
    parser.add_argument("--ops-context", type=int, default=OPS_CONTEXT_TOKENS, help="KV positions per slot")
    parser.add_argument("--label", default="this", help="--ops: this checkout's name in the table")
    parser.add_argument("--repo", action="append", default=[], metavar="LABEL=PATH",
                        help="--ops: also measure the checkout at PATH (repeatable)")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)

    report: dict[str, Any] = {"machine": {"platform": platform.platform(), "processor": platform.processor(),
                                          "torch": torch.__version__, "threads": args.threads,
                                          "ttfa_threads": args.ttfa_threads,
                                          "device": args.device, "dtype": args.dtype,
                                          "cpu_weights": args.cpu_weights},
                              "tokens_per_segment": args.tokens, "variants": {}}
    if args.ops:
        run_ops(args, report)
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(report, indent=2))
        print(f"wrote {args.out}")
        return
    for variant in args.variants:
        v: Variant = variant
        print(f"== {v}: loading weights ({args.weights})", flush=True)
        bundle = load_models(v, args.weights, args.device)
        bundle.t3.to(dtype=getattr(torch, args.dtype))  # the reference runs in the engine's dtype too
        if args.cpu_weights == "bf16":  # the engines would do it when built; do it before anything runs on the model
            changed = linear_bf16w.round_to_bf16_(projections(bundle.t3))
            print(f"   cpu_weights=bf16: {changed} projection weights rounded to bf16 (reference and engine alike)")
        entry: dict[str, Any] = {} if args.ttfa_only else throughput(bundle, args)
        if not args.skip_ttfa:
            torch.set_num_threads(args.ttfa_threads)
            entry["time_to_first_audio"] = time_to_first_audio(bundle, args.ttfa_tokens, args.cpu_weights)
            torch.set_num_threads(args.threads)
            print(f"   time to first audio: {entry['time_to_first_audio']}", flush=True)
        report["variants"][v] = entry
        del bundle

    print("\nvariant       segments  tokens/s  speedup  same-kernels  step_ms")
    for v, entry in report["variants"].items():
        for r in entry.get("batched", []):
            print(f"{v:12s}  {r['segments']:8d}  {r['tokens_per_s']:8.2f}  {r['speedup']:6.2f}x  "
                  f"{r['speedup_same_kernels']:11.2f}x  {r['decode_step_ms']:7.1f}")
    report["speedup"] = {v: e["speedup"] for v, e in report["variants"].items() if "speedup" in e}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=2))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
