"""Benchmark the streaming S3Gen vocoder on full-size random-weight models.

--mode stream (the default; CPU): for each variant (English: 10 CFM steps with CFG; Turbo: 2 mean-flow steps) and
a synthetic 10 s reference, with the prompt cache off and on:
- time to first chunk: the first push of 12 + latency tokens, which returns the first 12 tokens of audio, with
  its split into encoder / decoder (flow estimator) / HiFT time; for each prompt length in --prompt-sweep;
- a ~4 s utterance (100 tokens) streamed by the schedule 12, 24, 48, 96 (the last push takes what is left,
  final=True): S3Gen milliseconds per second of audio, per push and in total, and for a one-shot render.

    python scripts/bench_vocoder.py --out out/bench_vocoder.json [--threads 1] [--variants english,turbo]

--mode batched: batched render ticks (StreamingVocoder.render) of B streams due at once, all in one bucket, for
each B in --batch-sizes and three tick shapes (first chunks: 12 new tokens; a 24-token chunk after the first;
a 48-token chunk after two): ms per tick, per stream, audio seconds per second, aten ops per tick (the same for
every B), and whether a stream's PCM in the batch is bitwise what it gets alone. With --compile (CUDA), the
same after StreamingVocoder.compile() (torch.compile, mode reduce-overhead: a CUDA graph per (B, bucket)),
eager and compiled side by side; with --graphs, after StreamingVocoder.use_graphs() (a CUDA graph captured per
input signature on first use, no compiler: what the server's --vocoder-graphs on runs). For the GPU check:

    python scripts/bench_vocoder.py --mode batched --device cuda --batch-sizes 1 8 32 64 --compile \
        --variants turbo --shapes chunk_24 --out out/gpu/bench_vocoder_batched.json

Each (variant, shape, batch) compiles once with --compile: a few of them fit a 10-minute GPU slot.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import sys
import time
from collections import defaultdict
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from synth import gpu
from synth.tiny_s3gen import build_s3gen
from synth.vocoder import (
    DEFAULT_PROMPT_MAX_TOKENS,
    SAMPLE_RATE_HZ,
    SAMPLES_PER_TOKEN,
    SPEECH_VOCAB_SIZE,
    RenderJob,
    StreamingVocoder,
    VocoderStream,
)

from tests.synth.op_counter import count_ops

REFERENCE_S = 10.0
UTTERANCE_TOKENS = 100  # 4 s of speech at 25 tokens/s
SCHEDULE_TOKENS = (12, 24, 48, 96)
FIRST_CHUNK_TOKENS = 12
VARIANTS = {"english": (10, False, 0), "turbo": (2, True, 3)}  # CFM steps, meanflow, appended silence tokens

log = logging.getLogger("bench_vocoder")
Pcm = npt.NDArray[np.float32]


def synthetic_reference(seconds: float, sample_rate_hz: int) -> Pcm:
    """A voiced-looking mix: a gliding 120-220 Hz tone with harmonics, amplitude-modulated, plus noise."""
    t_s = np.arange(int(seconds * sample_rate_hz)) / sample_rate_hz
    f0_hz = 170 + 50 * np.sin(2 * np.pi * 0.3 * t_s)
    phase = 2 * np.pi * np.cumsum(f0_hz) / sample_rate_hz
    voiced = sum(np.sin(k * phase) / k for k in range(1, 6))
    envelope = 0.5 + 0.5 * np.sin(2 * np.pi * 3 * t_s) ** 2
    noise = np.random.default_rng(0).standard_normal(t_s.size)
    wav: Pcm = (0.2 * envelope * voiced + 0.02 * noise).astype(np.float32)
    return wav


@contextlib.contextmanager
def component_timer(vocoder: StreamingVocoder) -> Iterator[dict[str, float]]:
    """Accumulate wall ms spent in the vocoder's encoder, decoder (Euler loop) and HiFT calls."""
    totals: dict[str, float] = defaultdict(float)

    def timed(name: str, fn: Callable[..., Any]) -> Callable[..., Any]:
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            t0 = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                totals[name] += (time.perf_counter() - t0) * 1e3
        return wrapper

    names = {"_encode_fn": "encoder_ms", "_solve": "decoder_ms", "_render_hift": "hift_ms"}
    originals = {attr: getattr(vocoder, attr) for attr in names}
    for attr, fn in originals.items():
        setattr(vocoder, attr, timed(names[attr], fn))
    try:
        yield totals
    finally:
        for attr, fn in originals.items():
            setattr(vocoder, attr, fn)


def first_chunk(s3gen: torch.nn.Module, ref_dict: dict[str, Any], variant: str, prompt_tokens: int, cache_prompt: bool,
                tokens: list[int]) -> dict[str, Any]:
    steps, meanflow, silence = VARIANTS[variant]
    vocoder = StreamingVocoder(s3gen, n_cfm_timesteps=steps, meanflow=meanflow, append_silence_tokens=silence,
                               prompt_max_tokens=prompt_tokens, cache_prompt=cache_prompt)
    t0 = time.perf_counter()
    voice = vocoder.prepare_voice(ref_dict)
    prepare_ms = (time.perf_counter() - t0) * 1e3
    stream = vocoder.open(voice, seed=1)
    pushed = FIRST_CHUNK_TOKENS + vocoder.latency_tokens
    with component_timer(vocoder) as parts:
        t0 = time.perf_counter()
        _, n_tokens = stream.push(tokens[:pushed], final=False)
        first_chunk_ms = (time.perf_counter() - t0) * 1e3
    row = {"cache_prompt": cache_prompt, "prompt_tokens": voice.prompt_token_count, "prepare_voice_ms": prepare_ms,
           "prompt_cache_mb": vocoder.prompt_cache_nbytes / 1e6, "pushed_tokens": pushed,
           "returned_tokens": n_tokens, "ms": first_chunk_ms, **parts}
    log.info("%s first chunk: %s", variant, row)
    return row


def stream_utterance(s3gen: torch.nn.Module, ref_dict: dict[str, Any], variant: str, cache_prompt: bool,
                     tokens: list[int]) -> dict[str, Any]:
    steps, meanflow, silence = VARIANTS[variant]
    vocoder = StreamingVocoder(s3gen, n_cfm_timesteps=steps, meanflow=meanflow, append_silence_tokens=silence,
                               cache_prompt=cache_prompt)
    voice = vocoder.prepare_voice(ref_dict)
    stream = vocoder.open(voice, seed=1)
    pushes = []
    start = 0
    total_s = 0.0
    total_samples = 0
    for size in SCHEDULE_TOKENS:
        stop = min(start + size, len(tokens))
        final = stop == len(tokens)
        t0 = time.perf_counter()
        pcm, n_tokens = stream.push(tokens[start:stop], final=final)
        elapsed_s = time.perf_counter() - t0
        total_s += elapsed_s
        total_samples += pcm.size
        pushes.append({"pushed_tokens": stop - start, "returned_tokens": n_tokens, "ms": elapsed_s * 1e3})
        log.info("%s cache_prompt=%s push: %s", variant, cache_prompt, pushes[-1])
        start = stop
        if final:
            break
    assert total_samples == SAMPLES_PER_TOKEN * (len(tokens) + silence)
    audio_s = total_samples / SAMPLE_RATE_HZ
    t0 = time.perf_counter()
    stream.oneshot()
    oneshot_s = time.perf_counter() - t0
    return {"cache_prompt": cache_prompt, "prompt_tokens": voice.prompt_token_count,
            "left_context_tokens": vocoder.left_context_tokens, "latency_tokens": vocoder.latency_tokens,
            "pushes": pushes, "audio_s": audio_s, "stream_ms_per_audio_s": total_s * 1e3 / audio_s,
            "oneshot_ms_per_audio_s": oneshot_s * 1e3 / audio_s}


def bench_variant(variant: str, prompt_sweep: list[int]) -> dict[str, Any]:
    torch.manual_seed(0)
    t0 = time.perf_counter()
    s3gen = build_s3gen("full", meanflow=VARIANTS[variant][1])
    build_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    ref_dict = s3gen.embed_ref(synthetic_reference(REFERENCE_S, SAMPLE_RATE_HZ), SAMPLE_RATE_HZ)
    embed_ref_s = time.perf_counter() - t0
    tokens = torch.randint(0, SPEECH_VOCAB_SIZE, (UTTERANCE_TOKENS,),
                           generator=torch.Generator().manual_seed(1)).tolist()
    return {
        "variant": variant, "cfm_steps": VARIANTS[variant][0], "build_s": build_s, "embed_ref_s": embed_ref_s,
        "reference_prompt_tokens": int(ref_dict["prompt_token"].shape[1]),
        "first_chunk": [first_chunk(s3gen, ref_dict, variant, prompt_tokens, cache_prompt, tokens)
                        for cache_prompt in (False, True) for prompt_tokens in prompt_sweep],
        "streams": [stream_utterance(s3gen, ref_dict, variant, cache_prompt, tokens) for cache_prompt in (False, True)],
    }


# (chunks rendered before, the tick's chunk): every stream of a tick is at the same point, so one bucket
GEMM_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
TICK_SHAPES = {"first_chunk_12": ((), 12), "chunk_24": ((12,), 24), "chunk_48": ((12, 24), 48)}


def _clone(s: VocoderStream) -> VocoderStream:
    return VocoderStream(vocoder=s.vocoder, voice=s.voice, seed=s.seed, reproducible=s.reproducible,
                         tokens=list(s.tokens), final=s.final,
                         mel_tokens=s.mel_tokens, emitted_samples=s.emitted_samples, prompt=s.prompt,
                         held_mel=None if s.held_mel is None else s.held_mel.copy(),
                         held_source=None if s.held_source is None else s.held_source.copy(),
                         held_wav=None if s.held_wav is None else s.held_wav.copy())


def _jobs(streams: list[VocoderStream], chunk: int | None) -> list[RenderJob]:
    """Each stream's next render (every stream here has tokens to render)."""
    jobs = [s.next_job(chunk) for s in streams]
    if any(job is None for job in jobs):
        raise RuntimeError("a stream had nothing to render")
    return [job for job in jobs if job is not None]


def _count_ops(vocoder: StreamingVocoder, streams: list[VocoderStream], chunk: int) -> int:
    jobs = _jobs([_clone(s) for s in streams], chunk)
    with count_ops() as ops:
        vocoder.render(jobs)
    return ops.total


def _time_ticks(vocoder: StreamingVocoder, streams: list[VocoderStream], chunk: int, reps: int,
                device: torch.device) -> tuple[list[float], list[Pcm]]:
    times_ms, outputs = [], []
    for _ in range(reps):
        jobs = _jobs([_clone(s) for s in streams], chunk)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        t0 = time.perf_counter()
        outputs = vocoder.render(jobs)  # (ends with a host copy: synchronised)
        times_ms.append((time.perf_counter() - t0) * 1e3)
    return times_ms, outputs


def _streams_at(vocoder: StreamingVocoder, voice: Any, batch: int, before: tuple[int, ...]) -> list[VocoderStream]:
    """`batch` streams (own seeds and tokens, one voice) brought to the tick's point by batched renders."""
    prompt = vocoder.prompt_cache(voice)
    streams = []
    for i in range(batch):
        s = vocoder.open(voice, seed=1000 + i)
        s.prompt = prompt
        s.add(torch.randint(0, SPEECH_VOCAB_SIZE, (UTTERANCE_TOKENS,),
                            generator=torch.Generator().manual_seed(i)).tolist(), final=False)
        streams.append(s)
    for size in before:
        vocoder.render(_jobs(streams, size))
    return streams


def lowered_pcm_error(s3gen: torch.nn.Module, ref_dict: dict[str, Any], variant: str,
                      gemm_dtype: torch.dtype) -> dict[str, Any]:
    """The same seeded 100-token utterance streamed by the schedule through a float32 vocoder and one with
    `gemm_dtype` products: how far the lowered audio is from the float32 audio."""
    steps, meanflow, silence = VARIANTS[variant]
    tokens = torch.randint(0, SPEECH_VOCAB_SIZE, (UTTERANCE_TOKENS,), generator=torch.Generator().manual_seed(5))
    pcm = []
    for dtype in (torch.float32, gemm_dtype):
        vocoder = StreamingVocoder(s3gen, n_cfm_timesteps=steps, meanflow=meanflow, append_silence_tokens=silence,
                                   gemm_dtype=dtype)
        stream = vocoder.open(vocoder.prepare_voice(ref_dict), seed=1)
        chunks, start = [], 0
        for size in SCHEDULE_TOKENS:
            stop = min(start + size, len(tokens))
            chunks.append(stream.push(tokens[start:stop].tolist(), final=stop == len(tokens))[0])
            start = stop
            if start == len(tokens):
                break
        pcm.append(np.concatenate(chunks))
    exact, lowered = pcm
    error = float(np.linalg.norm(lowered - exact) / np.linalg.norm(exact))
    return {"pcm_rel_error_vs_fp32": error, "pcm_snr_db_vs_fp32": float(-20 * np.log10(error)),
            "pcm_max_abs_diff_vs_fp32": float(np.abs(lowered - exact).max()),
            "pcm_rms": float(np.sqrt(np.mean(exact ** 2)))}


def bench_batched(variant: str, args: argparse.Namespace, device: torch.device) -> list[dict[str, Any]]:
    steps, meanflow, silence = VARIANTS[variant]
    torch.manual_seed(0)
    s3gen = build_s3gen(args.preset, meanflow=meanflow).to(device)
    ref_dict = s3gen.embed_ref(synthetic_reference(REFERENCE_S, SAMPLE_RATE_HZ), SAMPLE_RATE_HZ, device=device)

    def new_vocoder() -> StreamingVocoder:
        return StreamingVocoder(s3gen, n_cfm_timesteps=steps, meanflow=meanflow, append_silence_tokens=silence,
                                gemm_dtype=GEMM_DTYPES[args.gemm_dtype])

    vocoder = new_vocoder()
    voice = vocoder.prepare_voice(ref_dict)
    results = []
    for shape in args.shapes:
        before, chunk = TICK_SHAPES[shape]
        for batch in args.batch_sizes:
            streams = _streams_at(vocoder, voice, batch, before)
            times_ms, outputs = _time_ticks(vocoder, streams, chunk, args.reps, device)
            alone = vocoder.render(_jobs([_clone(streams[0])], chunk))[0]
            audio_s = sum(o.size for o in outputs) / SAMPLE_RATE_HZ
            row = {"variant": variant, "gemm_dtype": args.gemm_dtype, "shape": shape, "batch": batch,
                   "chunk_tokens": chunk, "before": before,
                   "eager_ms": times_ms, "eager_ms_median": float(np.median(times_ms)),
                   "eager_ms_per_stream": float(np.median(times_ms)) / batch,
                   "eager_audio_s_per_s": audio_s / (float(np.median(times_ms)) / 1e3),
                   "ops_per_tick": _count_ops(vocoder, streams, chunk),
                   "stream0_bitwise_as_alone": bool(np.array_equal(outputs[0], alone)),
                   "stream0_max_abs_diff_vs_alone": float(np.abs(outputs[0] - alone).max()) if alone.size else 0.0,
                   "eager_stream0": outputs[0]}
            log.info("%s", {k: v for k, v in row.items() if k not in ("eager_ms", "eager_stream0")})
            results.append(row)
    if args.compile:
        _bench_faster("compiled", lambda v: v.compile(mode="reduce-overhead" if device.type == "cuda" else "default"),
                      new_vocoder, ref_dict, results, args.reps, device)
    if args.graphs:
        _bench_faster("graphs", lambda v: v.use_graphs(), new_vocoder, ref_dict, results, args.reps, device)
    if args.gemm_dtype != "fp32":
        error = lowered_pcm_error(s3gen, ref_dict, variant, GEMM_DTYPES[args.gemm_dtype])
        log.info("%s %s audio vs fp32: %s", variant, args.gemm_dtype, error)
        for row in results:
            row.update(error)
    for row in results:
        del row["eager_stream0"]
    return results


def _bench_faster(name: str, setup: Callable[[StreamingVocoder], Any], new_vocoder: Callable[[], StreamingVocoder],
                  ref_dict: dict[str, Any], results: list[dict[str, Any]], reps: int, device: torch.device) -> None:
    """Each row's tick again on a vocoder of its own set up by `setup` (compile(): torch.compile, a CUDA graph per
    shape; use_graphs(): CUDA graphs captured per signature, no compiler): its first two ticks (compile or
    capture, then a replay) and `reps` timed ones, as `{name}_*` keys of the row."""
    faster = new_vocoder()  # a vocoder of its own: compile() comes before its voice's prompt cache
    try:
        setup(faster)
        voice = faster.prepare_voice(ref_dict)
    except Exception as exc:  # report it, keep the eager figures
        for row in results:
            row[f"{name}_error"] = f"{type(exc).__name__}: {exc}"
        return
    for row in results:
        try:
            streams = _streams_at(faster, voice, row["batch"], row["before"])
            t0 = time.perf_counter()
            _time_ticks(faster, streams, row["chunk_tokens"], 2, device)  # compile or capture, replay once
            row[f"{name}_first_calls_s"] = time.perf_counter() - t0
            times_ms, outputs = _time_ticks(faster, streams, row["chunk_tokens"], reps, device)
            row.update({f"{name}_ms": times_ms, f"{name}_ms_median": float(np.median(times_ms)),
                        f"{name}_ms_per_stream": float(np.median(times_ms)) / row["batch"],
                        f"speedup_{name}": row["eager_ms_median"] / float(np.median(times_ms)),
                        f"{name}_max_abs_diff_vs_eager": float(np.abs(outputs[0] - row["eager_stream0"]).max())})
        except Exception as exc:
            row[f"{name}_error"] = f"{type(exc).__name__}: {exc}"
        log.info("%s B=%d %s: %s", row["shape"], row["batch"], name,
                 {k: v for k, v in row.items() if (k.startswith(name) or k.endswith(name)) and k != f"{name}_ms"})


def print_batched(results: list[dict[str, Any]]) -> None:
    print(f"\n{'variant':8} {'tick':15} {'B':>4} {'eager ms':>9} {'ms/stream':>9} {'audio-s/s':>9} {'ops':>6} "
          f"{'bitwise':>7} {'compiled ms':>11} {'speedup':>7} {'graphs ms':>11} {'speedup':>7}")
    for r in results:
        faster = []
        for name in ("compiled", "graphs"):
            ms = f"{r[f'{name}_ms_median']:.1f}" if f"{name}_ms_median" in r else r.get(f"{name}_error", "-")[:11]
            faster.append(f"{ms:>11} {r[f'speedup_{name}']:>7.2f}" if f"speedup_{name}" in r else f"{ms:>11} {'-':>7}")
        print(f"{r['variant']:8} {r['shape']:15} {r['batch']:>4} {r['eager_ms_median']:>9.1f} "
              f"{r['eager_ms_per_stream']:>9.1f} {r['eager_audio_s_per_s']:>9.2f} {r['ops_per_tick']:>6} "
              f"{r['stream0_bitwise_as_alone']!s:>7} {' '.join(faster)}")


def print_table(results: list[dict[str, Any]]) -> None:
    print(f"\n{'variant':8} {'cache':>5} {'prompt tok':>10} {'prepare ms':>10} {'cache MB':>9} "
          f"{'first chunk ms':>14} {'encoder':>8} {'decoder':>8} {'hift':>8}")
    for r in results:
        for row in r["first_chunk"]:
            print(f"{r['variant']:8} {row['cache_prompt']!s:>5} {row['prompt_tokens']:>10} "
                  f"{row['prepare_voice_ms']:>10.0f} {row['prompt_cache_mb']:>9.0f} {row['ms']:>14.0f} "
                  f"{row['encoder_ms']:>8.0f} {row['decoder_ms']:>8.0f} {row['hift_ms']:>8.0f}")
    print(f"\n{'variant':8} {'cache':>5} {'pushes (in->out tokens: ms)':56} {'stream ms/s':>11} {'oneshot ms/s':>12}")
    for r in results:
        for s in r["streams"]:
            pushes = ", ".join(f"{p['pushed_tokens']}->{p['returned_tokens']}: {p['ms']:.0f}" for p in s["pushes"])
            print(f"{r['variant']:8} {s['cache_prompt']!s:>5} {pushes:56} {s['stream_ms_per_audio_s']:>11.0f} "
                  f"{s['oneshot_ms_per_audio_s']:>12.0f}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, required=True, help="JSON results path")
    parser.add_argument("--threads", type=int, default=1, help="torch.set_num_threads (0: leave torch's default)")
    parser.add_argument("--variants", default="english,turbo")
    parser.add_argument("--prompt-sweep", default=f"50,{DEFAULT_PROMPT_MAX_TOKENS},250",
                        help="prompt lengths (tokens) for the first-chunk timing")
    parser.add_argument("--mode", choices=("stream", "batched"), default="stream")
    parser.add_argument("--device", default="auto", help="batched mode: cpu, cuda, cuda:N or auto")
    parser.add_argument("--preset", choices=("full", "tiny"), default="full", help="batched mode: model size")
    parser.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 8, 32, 64], help="batched mode")
    parser.add_argument("--reps", type=int, default=5, help="batched mode: timed ticks per (shape, batch)")
    parser.add_argument("--compile", action="store_true", help="batched mode: also compiled (CUDA graphs on CUDA)")
    parser.add_argument("--graphs", action="store_true",
                        help="batched mode: also with use_graphs() (CUDA graphs captured per signature, no compiler; "
                             "on the CPU the same static-buffer plumbing, eagerly)")
    parser.add_argument("--gemm-dtype", choices=sorted(GEMM_DTYPES), default="fp32",
                        help="batched mode, CPU: the vocoder's products (bf16 = the server's --cpu-vocoder bf16)")
    parser.add_argument("--tf32", choices=("auto", "on", "off"), default="auto",
                        help="batched mode, CUDA: TF32 for the vocoder's products, as the server's --vocoder-tf32 "
                             "(auto: on, as the server with a bf16 T3, the GPU default)")
    parser.add_argument("--shapes", nargs="+", choices=sorted(TICK_SHAPES), default=list(TICK_SHAPES),
                        help="batched mode: tick shapes (each (shape, batch) is one compilation with --compile)")
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.mode == "batched":
        device = torch.device("cuda" if args.device == "auto" and torch.cuda.is_available() else
                              ("cpu" if args.device == "auto" else args.device))
        tf32 = gpu.use_vocoder_tf32(args.tf32, device, torch.bfloat16)  # (the server's switch, the same rule)
        with torch.inference_mode():
            batched = [row for v in args.variants.split(",") if v for row in bench_batched(v, args, device)]
        meta = {"mode": "batched", "threads": torch.get_num_threads(), "torch": torch.__version__,
                "device": str(device), "device_name": torch.cuda.get_device_name(device) if device.type == "cuda"
                else "cpu", "preset": args.preset, "compile": args.compile, "tick_shapes": TICK_SHAPES, "tf32": tf32}
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps({"meta": meta, "results": batched}, indent=2))
        print_batched(batched)
        return
    sweep = [int(p) for p in args.prompt_sweep.split(",") if p]
    results = [bench_variant(v, sweep) for v in args.variants.split(",") if v]
    meta = {"threads": torch.get_num_threads(), "torch": torch.__version__, "device": "cpu",
            "utterance_tokens": UTTERANCE_TOKENS, "schedule_tokens": SCHEDULE_TOKENS}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"meta": meta, "results": results}, indent=2))
    print_table(results)


if __name__ == "__main__":
    main()
