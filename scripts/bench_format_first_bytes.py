"""Time from the engine's first audio chunk to the first encoded bytes leaving the server, per output format,
through the whole server path (a live uvicorn server, the session core, the encoder lane for compressed
formats, the transport), with the FakeEngine as the engine.

For each OpenAI `response_format` (mp3, opus, aac, flac, wav, pcm) it makes `--requests` requests one after
another (with `--concurrent` > 1, that many at once) and reads the server's own measure of each request's
first audio, `FirstAudio.server_overhead_s` (the first frame handed to the socket minus the engine's
`AudioChunk.ready_monotonic_s`): the encoder's first call, the loop hops and the send. The issue's target for
MP3 and Opus: <= 50 ms. `scripts/bench_codecs.py` measures the encoders alone.

Usage:
    python scripts/bench_format_first_bytes.py                          # 21 requests per format, a table
    python scripts/bench_format_first_bytes.py --concurrent 8 --json out.json
"""

from __future__ import annotations

import argparse
import concurrent.futures
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from agent_server.core.observers import FirstAudio, ObservedEvent
from agent_server.settings import Settings

from tests.agent_server.fake_engine import FakeEngine
from tests.agent_server.live_server import live_server

FORMATS = ("mp3", "opus", "aac", "flac", "wav", "pcm")
TEXT = "Sure, I can help with that right away. Your flight leaves at nine fifteen tomorrow morning."
TARGET_MS = 50.0


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]


def one_request(url: str, response_format: str) -> int:
    with httpx.Client(timeout=60.0) as http:
        response = http.post(url + "/v1/audio/speech", json={"model": "tts-1", "voice": "alloy", "input": TEXT,
                                                              "response_format": response_format})
        response.raise_for_status()
        return len(response.content)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--formats", nargs="*", choices=FORMATS, default=list(FORMATS))
    parser.add_argument("--requests", type=int, default=21, help="requests per format")
    parser.add_argument("--concurrent", type=int, default=1, help="requests in flight at once")
    parser.add_argument("--encoder-threads", type=int, default=2)
    parser.add_argument("--json", type=Path, help="write the figures here")
    args = parser.parse_args()

    engine = FakeEngine(first_chunk_delay_s=0.05, realtime_factor=0.2)
    with tempfile.TemporaryDirectory() as data_dir:
        settings = Settings(data_dir=Path(data_dir), encoder_threads=args.encoder_threads)
        with live_server(engine, settings) as live:
            overheads: list[ObservedEvent] = []
            live.hub.observers.subscribe(lambda e: overheads.append(e) if isinstance(e, FirstAudio) else None)
            results: dict[str, dict[str, float]] = {}
            for response_format in args.formats:
                overheads.clear()
                started_s = time.monotonic()
                with concurrent.futures.ThreadPoolExecutor(args.concurrent) as pool:
                    sizes = list(pool.map(lambda _, fmt=response_format: one_request(live.http_url, fmt),
                                          range(args.requests)))
                wall_s = time.monotonic() - started_s
                first_ms = [e.server_overhead_s * 1000.0 for e in overheads
                            if isinstance(e, FirstAudio) and e.server_overhead_s is not None]
                results[response_format] = {
                    "requests": len(sizes), "p50_ms": statistics.median(first_ms), "p95_ms": percentile(first_ms, 0.95),
                    "max_ms": max(first_ms), "bytes_p50": statistics.median(sizes), "wall_s": wall_s,
                }
    print(f"{'format':8} {'requests':>8} {'first bytes ms p50':>19} {'p95':>8} {'max':>8}")
    for name, row in results.items():
        flag = "" if row["p95_ms"] <= TARGET_MS else f"  (> {TARGET_MS:g} ms)"
        print(f"{name:8} {row['requests']:8.0f} {row['p50_ms']:19.2f} {row['p95_ms']:8.2f} {row['max_ms']:8.2f}{flag}")
    if args.json:
        args.json.write_text(json.dumps({"concurrent": args.concurrent, "encoder_threads": args.encoder_threads,
                                         "formats": results}, indent=2))


if __name__ == "__main__":
    main()
