"""Benchmark the streaming S3Gen vocoder on full-size random-weight models (CPU).

For each variant (English: 10 CFM steps with CFG; Turbo: 2 mean-flow steps) and a synthetic 10 s reference,
with the prompt cache off and on:
- time to first chunk: the first push of 12 + latency tokens, which returns the first 12 tokens of audio, with
  its split into encoder / decoder (flow estimator) / HiFT time; for each prompt length in --prompt-sweep;
- a ~4 s utterance (100 tokens) streamed by the schedule 12, 24, 48, 96 (the last push takes what is left,
  final=True): S3Gen milliseconds per second of audio, per push and in total, and for a one-shot render.

    python scripts/bench_vocoder.py --out out/bench_vocoder.json [--threads 1] [--variants english,turbo]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import sys
import time
from collections import defaultdict
from pathlib import Path
from typing import Any, Callable, Iterator

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from synth.tiny_s3gen import build_s3gen  # noqa: E402
from synth.vocoder import (DEFAULT_PROMPT_MAX_TOKENS, SAMPLE_RATE_HZ, SAMPLES_PER_TOKEN,  # noqa: E402
                           SPEECH_VOCAB_SIZE, StreamingVocoder)

REFERENCE_S = 10.0
UTTERANCE_TOKENS = 100  # 4 s of speech at 25 tokens/s
SCHEDULE_TOKENS = (12, 24, 48, 96)
FIRST_CHUNK_TOKENS = 12
VARIANTS = {"english": (10, False, 0), "turbo": (2, True, 3)}  # CFM steps, meanflow, appended silence tokens

log = logging.getLogger("bench_vocoder")


def synthetic_reference(seconds: float, sample_rate_hz: int) -> np.ndarray:
    """A voiced-looking mix: a gliding 120-220 Hz tone with harmonics, amplitude-modulated, plus noise."""
    t_s = np.arange(int(seconds * sample_rate_hz)) / sample_rate_hz
    f0_hz = 170 + 50 * np.sin(2 * np.pi * 0.3 * t_s)
    phase = 2 * np.pi * np.cumsum(f0_hz) / sample_rate_hz
    voiced = sum(np.sin(k * phase) / k for k in range(1, 6))
    envelope = 0.5 + 0.5 * np.sin(2 * np.pi * 3 * t_s) ** 2
    noise = np.random.default_rng(0).standard_normal(t_s.size)
    return (0.2 * envelope * voiced + 0.02 * noise).astype(np.float32)


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

    originals = {"_encode": vocoder._encode, "_encode_window": vocoder._encode_window, "_solve": vocoder._solve,
                 "vocode": vocoder.vocode}
    names = {"_encode": "encoder_ms", "_encode_window": "encoder_ms", "_solve": "decoder_ms", "vocode": "hift_ms"}
    for attr, fn in originals.items():
        setattr(vocoder, attr, timed(names[attr], fn))
    try:
        yield totals
    finally:
        for attr in originals:
            delattr(vocoder, attr)


def first_chunk(s3gen: torch.nn.Module, ref_dict: dict, variant: str, prompt_tokens: int, cache_prompt: bool,
                tokens: list[int]) -> dict:
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


def stream_utterance(s3gen: torch.nn.Module, ref_dict: dict, variant: str, cache_prompt: bool,
                     tokens: list[int]) -> dict:
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


def bench_variant(variant: str, prompt_sweep: list[int]) -> dict:
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


def print_table(results: list[dict]) -> None:
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
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
    if args.threads:
        torch.set_num_threads(args.threads)
    sweep = [int(p) for p in args.prompt_sweep.split(",") if p]
    results = [bench_variant(v, sweep) for v in args.variants.split(",") if v]
    meta = {"threads": torch.get_num_threads(), "torch": torch.__version__, "device": "cpu",
            "utterance_tokens": UTTERANCE_TOKENS, "schedule_tokens": SCHEDULE_TOKENS}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"meta": meta, "results": results}, indent=2))
    print_table(results)


if __name__ == "__main__":
    main()
