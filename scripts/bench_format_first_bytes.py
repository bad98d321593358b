"""Time from the engine's first audio chunk to the first encoded bytes leaving the server, per output format,
through the whole server path (a live uvicorn server, the session core, the encoder lane for compressed
formats, the transport), with the FakeEngine as the engine.

For each OpenAI `response_format` (mp3, opus, aac, flac, wav, pcm) it makes `--requests` requests one after
another (with `--concurrent` > 1, that many at once) and reads the server's own measure of each request's
first audio, `FirstAudio.server_overhead_s` (the first frame handed to the socket minus the engine's
`AudioChunk.ready_monotonic_s`): the encoder's first call, the loop hops and the send. The issue's target for
MP3 and Opus: <= 50 ms. `scripts/bench_codecs.py` measures the encoders alone.

Then what a sentence boundary costs as the client hears it (issue 35): for each format a seeded turn of 5
sentences (5 segments) is decoded (PyAV; tests/agent_server/boundaries.py) and each segment found in it; the
excess at a boundary is how much later the next segment starts than the previous one ends (0: gapless). And a
listener that runs dry: over the ElevenLabs WebSocket, one sentence, no flush, a pause until well after its
audio has played, then a second: the drain's padding at that boundary, and how long before the listener ran
dry (a player started at the first audio) the first sentence's last bytes came.

Usage:
    python scripts/bench_format_first_bytes.py                          # 21 requests per format, tables
    python scripts/bench_format_first_bytes.py --concurrent 8 --json out.json
    python scripts/bench_format_first_bytes.py --label before --json before.json   # (from an older checkout)
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import concurrent.futures
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import httpx
import orjson
from websockets.asyncio.client import connect

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from agent_server.core.observers import FirstAudio, ObservedEvent
from agent_server.settings import Settings

from tests.agent_server import boundaries
from tests.agent_server.fake_engine import FakeEngine
from tests.agent_server.live_server import live_server

FORMATS = ("mp3", "opus", "aac", "flac", "wav", "pcm")
TEXT = "Sure, I can help with that right away. Your flight leaves at nine fifteen tomorrow morning."
TARGET_MS = 50.0
BOUNDARY_SEGMENTS = 5
BOUNDARY_CASES = (*(boundaries.openai(name) for name in FORMATS),
                  boundaries.elevenlabs("mp3_44100_32", "ws"), boundaries.elevenlabs("pcm_8000", "ws"))
DRY_CASES = (boundaries.elevenlabs("mp3_44100_128", "ws"), boundaries.elevenlabs("mp3_22050_32", "ws"),
             boundaries.elevenlabs("opus_48000_64", "ws"), boundaries.elevenlabs("pcm_8000", "ws"))
PAUSE_S = 1.0  # the listener has been dry this long when the second sentence comes


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]


def one_request(url: str, response_format: str) -> int:
    with httpx.Client(timeout=60.0) as http:
        response = http.post(url + "/v1/audio/speech", json={"model": "tts-1", "voice": "alloy", "input": TEXT,
                                                              "response_format": response_format})
        response.raise_for_status()
        return len(response.content)


def boundary_gaps(base_url: str) -> dict[str, dict[str, float]]:
    """Per case: the excess at each of the 4 boundaries of a 5-segment turn (ms), as decoded."""
    rows: dict[str, dict[str, float]] = {}
    for k, case in enumerate(BOUNDARY_CASES):
        heard = asyncio.run(boundaries.hear_turn(base_url, case, BOUNDARY_SEGMENTS, seed=9_000 + 10 * k))
        excess = heard.excess_ms
        rows[case.id] = {"max_excess_ms": max(excess), "mean_excess_ms": statistics.mean(excess),
                         "lead_ms": heard.lead_ms, "tail_ms": heard.tail_ms, "min_match": min(heard.matches)}
    return rows


async def _dry_turn(base_url: str, case: boundaries.Case, seed: int) -> tuple[bytes, bytes, float, float]:
    """One sentence (no flush: the segmenter's timeout cuts it), a pause past its end, then a second."""
    url = base_url.replace("http", "ws", 1) + (f"/v1/text-to-speech/{boundaries.ELEVENLABS_VOICE}/stream-input"
                                               f"?output_format={case.name}&seed={seed}")
    before, after = bytearray(), bytearray()
    first_s = last_s = 0.0
    first_ms = len(boundaries.engine_pcm(1, seed)[0]) / 24.0
    async with connect(url, max_size=None) as ws:
        await ws.send(orjson.dumps({"text": " "}).decode())
        await ws.send(orjson.dumps({"text": boundaries.SENTENCES[0] + " "}).decode())
        deadline_s: float | None = None
        while deadline_s is None or time.monotonic() < deadline_s:
            timeout_s = 10.0 if deadline_s is None else max(0.0, deadline_s - time.monotonic())
            try:
                raw = await asyncio.wait_for(ws.recv(), timeout_s)
            except TimeoutError:
                break
            audio = orjson.loads(raw).get("audio")
            if audio:
                before += base64.b64decode(audio)
                last_s = time.monotonic()
                if deadline_s is None:
                    first_s = last_s
                    deadline_s = first_s + first_ms / 1000.0 + PAUSE_S
        await ws.send(orjson.dumps({"text": boundaries.SENTENCES[1] + " "}).decode())
        await ws.send(orjson.dumps({"text": ""}).decode())
        async for raw in ws:
            audio = orjson.loads(raw).get("audio")
            if audio:
                after += base64.b64decode(audio)
    return bytes(before), bytes(after), first_s, last_s


def dry_listener(base_url: str) -> dict[str, dict[str, float]]:
    rows: dict[str, dict[str, float]] = {}
    for k, case in enumerate(DRY_CASES):
        seed = 8_000 + 10 * k
        pcm = boundaries.engine_pcm(2, seed)
        before, after, first_s, last_s = asyncio.run(_dry_turn(base_url, case, seed))
        alone = boundaries.hear(case, before, pcm[:1])
        whole = boundaries.hear(case, before + after, pcm)
        dry_s = first_s + (case.fmt.lead_ms + alone.lengths_ms[0]) / 1000.0
        rows[case.id] = {"drain_padding_ms": whole.excess_ms[0], "tail_before_dry_ms": (dry_s - last_s) * 1000.0,
                         "first_whole_before_pause": float(alone.matches[0] >= 0.95 and alone.tail_ms >= 0.0),
                         "min_match": min(whole.matches)}
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--formats", nargs="*", choices=FORMATS, default=list(FORMATS))
    parser.add_argument("--requests", type=int, default=21, help="requests per format")
    parser.add_argument("--concurrent", type=int, default=1, help="requests in flight at once")
    parser.add_argument("--encoder-threads", type=int, default=2)
    parser.add_argument("--json", type=Path, help="write the figures here")
    parser.add_argument("--label", default="", help="a name for this run (e.g. the commit), in the JSON and tables")
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
            gaps = boundary_gaps(live.http_url)
            dry = dry_listener(live.http_url)
    label = f" [{args.label}]" if args.label else ""
    print(f"first bytes{label}\n{'format':8} {'requests':>8} {'first bytes ms p50':>19} {'p95':>8} {'max':>8}")
    for name, row in results.items():
        flag = "" if row["p95_ms"] <= TARGET_MS else f"  (> {TARGET_MS:g} ms)"
        print(f"{name:8} {row['requests']:8.0f} {row['p50_ms']:19.2f} {row['p95_ms']:8.2f} {row['max_ms']:8.2f}{flag}")
    print(f"\nboundary excess, {BOUNDARY_SEGMENTS} segments{label}\n{'case':32} {'max ms':>8} {'mean ms':>8} "
          f"{'lead ms':>8} {'tail ms':>8}")
    for name, gap in gaps.items():
        print(f"{name:32} {gap['max_excess_ms']:8.1f} {gap['mean_excess_ms']:8.1f} {gap['lead_ms']:8.1f} "
              f"{gap['tail_ms']:8.1f}")
    print(f"\nlistener runs dry{label}\n{'case':32} {'drain padding ms':>17} {'tail before dry ms':>19} "
          f"{'first whole':>12}")
    for name, row in dry.items():
        print(f"{name:32} {row['drain_padding_ms']:17.1f} {row['tail_before_dry_ms']:19.1f} "
              f"{'yes' if row['first_whole_before_pause'] else 'NO':>12}")
    if args.json:
        args.json.write_text(json.dumps({"label": args.label, "concurrent": args.concurrent,
                                         "encoder_threads": args.encoder_threads, "formats": results,
                                         "boundaries": gaps, "dry_listener": dry}, indent=2))


if __name__ == "__main__":
    main()
