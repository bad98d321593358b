#!/usr/bin/env python
"""The vocoder with TF32 products against the vocoder in fp32: the SNR of the same streams' PCM.

On CUDA the engine turns on TF32 for the vocoder's float32 matmuls when T3 itself runs in bf16/fp16
(EngineConfig.vocoder_tf32 "auto", synth/gpu.use_vocoder_tf32): about 8x the fp32 rate of a Hopper GPU's tensor
cores, for a 10-bit significand in the products. This renders the same streams (random full-size S3Gen, a synthetic
reference voice, fixed seeds, the seeded chunk schedule) with torch's TF32 switches off and then on, and reports
10 log10(sum ref^2 / sum (ref - tf32)^2) per variant, over all streams (null: bitwise equal). On a CPU there is no
TF32: both renders are fp32 and equal (the script still runs end to end: scripts/gpu_check.sh --device cpu).

    python scripts/vocoder_tf32_snr.py --device cuda --preset full --json out/tf32.json
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from synth.build import S3GEN_SILENCE_TOKENS_TURBO
from synth.presets import synthetic_reference_wav
from synth.tiny_s3gen import build_s3gen
from synth.vocoder import SAMPLE_RATE_HZ, SPEECH_VOCAB_SIZE, StreamingVocoder

Pcm = npt.NDArray[np.float32]
SCHEDULE_TOKENS = (12, 24, 48, 96)  # the seeded chunk schedule (synth/vocoder_worker.ChunkPolicy)
VARIANTS = {"english": (10, False, 0), "turbo": (2, True, S3GEN_SILENCE_TOKENS_TURBO)}
UTTERANCE_TOKENS = 100


def render(vocoder: StreamingVocoder, voice: Any, streams: int) -> list[Pcm]:
    """Each stream's whole PCM, chunked by SCHEDULE_TOKENS, all streams batched per tick."""
    rng = np.random.default_rng(7)
    opened = []
    for seed in range(streams):
        stream = vocoder.open(voice, seed=100 + seed)
        stream.prompt = vocoder.prompt_cache(voice)
        stream.add(rng.integers(0, SPEECH_VOCAB_SIZE, UTTERANCE_TOKENS).tolist(), final=True)
        opened.append(stream)
    pcm: list[list[Pcm]] = [[] for _ in opened]
    for chunk in (*SCHEDULE_TOKENS, None, None, None):
        live = [(i, job) for i, job in enumerate(s.next_job(chunk) for s in opened) if job is not None]
        if not live:
            break
        for (index, _), out in zip(live, vocoder.render([job for _, job in live]), strict=True):
            pcm[index].append(out)
    return [np.concatenate(parts) for parts in pcm]


def snr_db(reference: list[Pcm], other: list[Pcm]) -> float:
    signal = sum(float(np.sum(r.astype(np.float64) ** 2)) for r in reference)
    noise = sum(float(np.sum((r.astype(np.float64) - o) ** 2)) for r, o in zip(reference, other, strict=True))
    return math.inf if noise == 0.0 else 10.0 * math.log10(signal / noise)


def set_tf32(on: bool) -> None:
    torch.backends.cuda.matmul.allow_tf32 = on
    torch.backends.cudnn.allow_tf32 = on


def measure(variant: str, preset: str, device: torch.device, streams: int) -> dict[str, Any]:
    steps, meanflow, silence = VARIANTS[variant]
    torch.manual_seed(0)
    t0 = time.perf_counter()
    s3gen = build_s3gen(preset, meanflow).to(device).eval()  # type: ignore[arg-type]
    ref = s3gen.embed_ref(synthetic_reference_wav(SAMPLE_RATE_HZ), SAMPLE_RATE_HZ, device=device)
    outputs = {}
    timings = {}
    set_tf32(False)  # an untimed render first: cuBLAS/cuDNN set-up and lazy module loading are no mode's time
    warm = StreamingVocoder(s3gen, n_cfm_timesteps=steps, meanflow=meanflow, append_silence_tokens=silence)
    render(warm, warm.prepare_voice(ref), streams)
    for tf32 in (False, True):
        set_tf32(tf32)
        vocoder = StreamingVocoder(s3gen, n_cfm_timesteps=steps, meanflow=meanflow, append_silence_tokens=silence)
        voice = vocoder.prepare_voice(ref)
        start = time.perf_counter()
        outputs[tf32] = render(vocoder, voice, streams)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        timings[tf32] = time.perf_counter() - start
    set_tf32(False)
    audio_s = sum(p.size for p in outputs[False]) / SAMPLE_RATE_HZ
    snr = round(snr_db(outputs[False], outputs[True]), 2)
    return {"variant": variant, "preset": preset, "device": str(device), "streams": streams,
            "tf32_applies": device.type == "cuda", "snr_db": snr if math.isfinite(snr) else None,  # None: equal
            "max_abs_diff": float(max(np.abs(r - o).max() for r, o in zip(outputs[False], outputs[True],
                                                                            strict=True))),
            "audio_s": round(audio_s, 2), "fp32_render_s": round(timings[False], 3),
            "tf32_render_s": round(timings[True], 3), "total_s": round(time.perf_counter() - t0, 1)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--preset", default="full", choices=["tiny", "full"])
    parser.add_argument("--variants", nargs="+", default=["turbo", "english"], choices=sorted(VARIANTS))
    parser.add_argument("--streams", type=int, default=4)
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args()
    torch.set_grad_enabled(False)
    rows = []
    for variant in args.variants:
        row = measure(variant, args.preset, torch.device(args.device), args.streams)
        print(json.dumps(row), flush=True)
        rows.append(row)
        if args.json is not None:  # after every variant: a run cut short keeps what it measured
            args.json.write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
