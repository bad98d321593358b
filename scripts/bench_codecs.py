"""Streaming encoder costs, per output format (agent_server/audio/codecs.py).

For each format:
- first_bytes_ms: from handing the first PCM chunk (10 speech tokens, 400 ms at 24 kHz: the engine's
  smallest first chunk) to `push` returning the first encoded bytes. The encoder is built beforehand,
  when the context opens (its construction is reported apart: open_ms). Target: <= 50 ms.
- cpu_ms_per_audio_s: encoder CPU time (this thread) per second of audio, pushing engine-like chunks
  (10, 24, 48, 96, 96, ... tokens) with a drain after each "segment" and a finish.
- with --speed S: the same through the tempo stage a context with that speed gets (codecs.TempoEncoder:
  FFmpeg's atempo before the encoder); compare a run with --speed 1 (no stage) made beside it.
- with --contexts N: N contexts encoding at once through one EncoderPool (--workers threads), each
  pushing the same audio: wall time, and audio seconds encoded per wall second.

Usage:
    python scripts/bench_codecs.py                       # every format, 7 repeats, a table
    python scripts/bench_codecs.py --formats mp3-24000 ogg-opus-48000 --repeats 21 --json out.json
    python scripts/bench_codecs.py --contexts 32 --workers 4
    python scripts/bench_codecs.py --formats raw-pcm-16000 mp3-24000 --speed 1.25
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
import time
from functools import partial
from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import orjson

from agent_server.audio.codecs import StreamFormat, make_encoder
from agent_server.audio.encode_lane import EncoderPool
from synth.api import OUTPUT_SAMPLE_RATE_HZ, SAMPLES_PER_SPEECH_TOKEN

FORMATS: dict[str, StreamFormat] = {
    "mp3-24000": StreamFormat("mp3", "mp3", 24_000, 64_000),
    "mp3-44100": StreamFormat("mp3", "mp3", 44_100, 128_000),
    "mp3-22050": StreamFormat("mp3", "mp3", 22_050, 48_000),
    "ogg-opus-24000": StreamFormat("ogg", "opus", 24_000),
    "ogg-opus-48000": StreamFormat("ogg", "opus", 48_000, 64_000),
    "webm-opus-48000": StreamFormat("webm", "opus", 48_000),
    "adts-aac-24000": StreamFormat("adts", "aac", 24_000),
    "adts-aac-22050": StreamFormat("adts", "aac", 22_050, 48_000),
    "flac-24000": StreamFormat("flac", "flac", 24_000),
    "flac-48000": StreamFormat("flac", "flac", 48_000),
    "wav-pcm-24000": StreamFormat("wav", "pcm_s16le", 24_000),
    "raw-pcm-16000": StreamFormat("raw", "pcm_s16le", 16_000),
    "raw-mulaw-8000": StreamFormat("raw", "mulaw", 8_000, frame_ms=20),
}
FIRST_CHUNK_TOKENS = 10
CHUNK_TOKENS = (24, 48, 96)  # then 96 until the segment ends
SEGMENT_S = 4.0
TARGET_FIRST_BYTES_MS = 50.0


def audio(seconds: float, seed: int = 0) -> npt.NDArray[np.float32]:
    """Speech-like: band-limited noise under a syllable-rate envelope (codecs do real work on it)."""
    rng = np.random.default_rng(seed)
    n = int(seconds * OUTPUT_SAMPLE_RATE_HZ)
    noise = np.convolve(rng.standard_normal(n), np.ones(8) / 8, mode="same")
    envelope = 0.5 + 0.5 * np.sin(2 * np.pi * 4 * np.arange(n) / OUTPUT_SAMPLE_RATE_HZ)
    out: npt.NDArray[np.float32] = (0.3 * noise * envelope).astype(np.float32)
    return out


def chunks(pcm: npt.NDArray[np.float32]) -> list[npt.NDArray[np.float32]]:
    sizes = [FIRST_CHUNK_TOKENS, *CHUNK_TOKENS]
    out, i, k = [], 0, 0
    while i < len(pcm):
        n = sizes[min(k, len(sizes) - 1)] * SAMPLES_PER_SPEECH_TOKEN
        out.append(pcm[i : i + n])
        i, k = i + n, k + 1
    return out


def first_bytes(fmt: StreamFormat, pcm: npt.NDArray[np.float32], speed: float) -> tuple[float, float]:
    t0 = time.perf_counter()
    enc = make_encoder(fmt, speed)
    t1 = time.perf_counter()
    out = enc.push(pcm[: FIRST_CHUNK_TOKENS * SAMPLES_PER_SPEECH_TOKEN])
    t2 = time.perf_counter()
    if not b"".join(out):
        raise RuntimeError(f"{fmt}: the first push gave no bytes")
    enc.close()
    return (t1 - t0) * 1e3, (t2 - t1) * 1e3


def encode_segments(fmt: StreamFormat, segments: list[list[npt.NDArray[np.float32]]], speed: float) -> int:
    enc = make_encoder(fmt, speed)
    n = 0
    for seg in segments:
        for c in seg:
            n += sum(len(b) for b in enc.push(c))
        n += sum(len(b) for b in enc.drain())
    return n + sum(len(b) for b in enc.finish())


def cpu_per_audio_s(fmt: StreamFormat, segments: list[list[npt.NDArray[np.float32]]], seconds: float,
                    speed: float) -> float:
    t0 = time.thread_time()
    encode_segments(fmt, segments, speed)
    return (time.thread_time() - t0) * 1e3 / seconds


async def concurrent(fmt: StreamFormat, segments: list[list[npt.NDArray[np.float32]]], contexts: int,
                     workers: int, speed: float) -> float:
    loop = asyncio.get_running_loop()
    pool = EncoderPool(workers)
    done = [asyncio.Event() for _ in range(contexts)]
    t0 = time.perf_counter()
    for k in range(contexts):
        enc = make_encoder(fmt, speed)
        lane = pool.lane(loop.call_soon_threadsafe, max_pending=10_000, close=enc.close, on_error=print)
        for seg in segments:
            for c in seg:
                lane.submit(partial(enc.push, c), _ignore)
            lane.submit(enc.drain, _ignore)
        lane.submit(enc.finish, _ignore)
        lane.submit(None, partial(_set, done[k]))
    for event in done:
        await event.wait()
    wall = time.perf_counter() - t0
    pool.shutdown()
    return wall


def _ignore(_result: object) -> None:
    pass


def _set(event: asyncio.Event, _result: object) -> None:
    event.set()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--formats", nargs="*", default=list(FORMATS), choices=list(FORMATS))
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--seconds", type=float, default=12.0, help="audio per cost run (segments of 4 s)")
    parser.add_argument("--contexts", type=int, default=0, help="also run N contexts at once through a pool")
    parser.add_argument("--workers", type=int, default=2, help="pool threads for --contexts")
    parser.add_argument("--speed", type=float, default=1.0, help="the contexts' speed (1: no tempo stage)")
    parser.add_argument("--json", type=Path, help="write the results here too")
    args = parser.parse_args()

    pcm = audio(args.seconds)
    seg_n = int(SEGMENT_S * OUTPUT_SAMPLE_RATE_HZ)
    segments = [chunks(pcm[i : i + seg_n]) for i in range(0, len(pcm), seg_n)]
    results: list[dict[str, Any]] = []
    print(f"{'format':<18}{'open ms':>9}{'first bytes ms p50':>20}{'p95':>8}{'cpu ms / audio s':>18}"
          + (f"{'N ctx audio s / s':>20}" if args.contexts else ""))
    for name in args.formats:
        fmt = FORMATS[name]
        encode_segments(fmt, segments[:1], args.speed)  # warm-up: codec tables, first imports
        opens, firsts = zip(*(first_bytes(fmt, pcm, args.speed) for _ in range(args.repeats)), strict=True)
        costs = [cpu_per_audio_s(fmt, segments, args.seconds, args.speed) for _ in range(args.repeats)]
        row: dict[str, Any] = {
            "format": name,
            "speed": args.speed,
            "open_ms_p50": statistics.median(opens),
            "first_bytes_ms_p50": statistics.median(firsts),
            "first_bytes_ms_p95": sorted(firsts)[max(0, int(0.95 * len(firsts)) - 1)],
            "cpu_ms_per_audio_s_p50": statistics.median(costs),
        }
        line = (f"{name:<18}{row['open_ms_p50']:>9.2f}{row['first_bytes_ms_p50']:>20.2f}"
                f"{row['first_bytes_ms_p95']:>8.2f}{row['cpu_ms_per_audio_s_p50']:>18.2f}")
        if args.contexts:
            wall = asyncio.run(concurrent(fmt, segments, args.contexts, args.workers, args.speed))
            row.update(contexts=args.contexts, workers=args.workers, wall_s=wall,
                       audio_s_per_wall_s=args.contexts * args.seconds / wall)
            line += f"{row['audio_s_per_wall_s']:>20.1f}"
        if row["first_bytes_ms_p95"] > TARGET_FIRST_BYTES_MS:
            line += "  (over the 50 ms target)"
        print(line, flush=True)
        results.append(row)
    if args.json:
        args.json.write_bytes(orjson.dumps(results, option=orjson.OPT_INDENT_2))


if __name__ == "__main__":
    main()
