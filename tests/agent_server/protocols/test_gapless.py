"""A context is one continuous stream: a segment boundary adds no silence, in any format or rate served.

Each case asks for a seeded turn of 1, 2 and 5 segments (each a sentence), then the 5 again (every segment a
phrase-cache hit: a replay posts the next segment's audio right behind the previous segment's end), over a
vendor's HTTP endpoint or WebSocket; the client decodes what came back (PyAV; numpy for raw PCM and G.711) and
finds each segment of the engine's audio in it (tests/agent_server/boundaries.py). The engine is faster than
real time, so the listener never runs dry and the encoder is never drained mid-stream: every boundary must cost
at most `MAX_EXCESS_MS`, the first segment must start exactly where `StreamFormat.lead_ms` says (what the
timestamps are shifted by), and the stream must end within one codec frame of the last segment.

When the listener does run dry (a long pause in the LLM's text), the encoder is drained before it does: the
audio sent before the pause holds the whole of the first segment, and the stream goes on after the pause.
"""

from __future__ import annotations

import asyncio
import base64
import time
import zlib
from collections.abc import Iterator

import orjson
import pytest
from websockets.asyncio.client import connect

from agent_server.audio.formats import PCM_SAMPLE_RATES_HZ

from tests.agent_server import boundaries
from tests.agent_server.boundaries import CASES, ELEVENLABS_VOICE, Case, Heard
from tests.agent_server.protocols.conftest import Served, serving

pytestmark = pytest.mark.timeout(300)

MAX_EXCESS_MS = 5.0  # silence a boundary may add
MIN_MATCH = 0.95  # each segment, as decoded, against the engine's audio
LEAD_TOLERANCE_MS = 0.5
# The last frame of a codec without end-of-stream metadata (MP3, ADTS AAC) is padded to a whole frame.
FRAME_SAMPLES = {"mp3": (576, 1152), "aac": (1024, 1024)}  # (below 32 kHz, from 32 kHz)
MPEG1_MIN_RATE_HZ = 32_000


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Served]:
    with serving(tmp_path_factory.mktemp("gapless")) as served:
        yield served


def last_frame_ms(case: Case) -> float:
    sizes = FRAME_SAMPLES.get(case.fmt.codec)
    if sizes is None:
        return 0.0
    return sizes[case.fmt.sample_rate_hz >= MPEG1_MIN_RATE_HZ] * 1000.0 / case.fmt.sample_rate_hz


def check(heard: Heard) -> None:
    case = heard.case
    where = f"{case.id}, {heard.segments} segments"
    assert min(heard.matches) >= MIN_MATCH, (where, heard.matches)
    assert abs(heard.lead_ms - case.fmt.lead_ms) <= LEAD_TOLERANCE_MS, (where, heard.lead_ms, case.fmt.lead_ms)
    assert all(abs(excess) <= MAX_EXCESS_MS for excess in heard.excess_ms), (where, heard.excess_ms)
    assert -LEAD_TOLERANCE_MS <= heard.tail_ms <= last_frame_ms(case) + LEAD_TOLERANCE_MS, (where, heard.tail_ms)


@pytest.mark.parametrize("case", CASES, ids=str)
def test_a_boundary_adds_no_silence(served: Served, case: Case) -> None:
    seed = zlib.crc32(case.id.encode()) * 10  # each case's own audio (the cache is shared by formats)
    for segments in (1, 2, 5):
        check(boundaries.run(boundaries.hear_turn(served.http, case, segments, seed)))
    submitted = len(served.engine.submits)
    replay = boundaries.run(boundaries.hear_turn(served.http, case, 5, seed))
    assert len(served.engine.submits) == submitted, "the replay was not all cache hits"
    check(replay)


# ---- the listener runs dry --------------------------------------------------------------------------

PAUSE_S = 1.0  # past the first segment's end: the listener has been dry this long when the text goes on
MAX_DRAIN_MS = 400.0  # what a drain of a compressed stream may pad (MP3 22.05 kHz 32 kbit/s: ~200 ms)
DRY_CASES = [boundaries.elevenlabs(name, "ws") for name in ("mp3_44100_128", "mp3_22050_32", "opus_48000_64",
                                                              "pcm_8000", "pcm_44100", "ulaw_8000")]


async def pause_between_sentences(served: Served, case: Case, seed: int,
                                  flush: bool) -> tuple[bytes, bytes, float, float]:
    """The first sentence (flushed: drained at its end; else cut by the segmenter's wait and drained on the
    listener's deadline); the second once the listener has run dry. (The audio that came before the second
    sentence was sent, all of it, when the first audio arrived, when the last one before the pause did.)"""
    url = f"{served.ws}/v1/text-to-speech/{ELEVENLABS_VOICE}/stream-input?output_format={case.name}&seed={seed}"
    before, after = bytearray(), bytearray()
    first_s = last_s = 0.0
    first_ms = len(boundaries.engine_pcm(1, seed)[0]) / 24.0
    async with connect(url, max_size=None) as ws:
        await ws.send(orjson.dumps({"text": " "}).decode())
        await ws.send(orjson.dumps({"text": boundaries.SENTENCES[0] + " ", "flush": flush}).decode())
        deadline_s = None
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
        await ws.send(orjson.dumps({"text": boundaries.SENTENCES[1] + " ", "flush": True}).decode())
        await ws.send(orjson.dumps({"text": ""}).decode())
        async for raw in ws:
            audio = orjson.loads(raw).get("audio")
            if audio:
                after += base64.b64decode(audio)
    return bytes(before), bytes(after), first_s, last_s


@pytest.mark.parametrize("flush", [True, False], ids=["flushed", "deadline"])
@pytest.mark.parametrize("case", DRY_CASES, ids=str)
def test_a_listener_that_runs_dry_gets_the_whole_tail_in_time_and_the_stream_goes_on(served: Served, case: Case,
                                                                                      flush: bool) -> None:
    seed = 7_000 + 10 * DRY_CASES.index(case) + flush
    pcm = boundaries.engine_pcm(2, seed)
    before, after, first_s, last_s = asyncio.run(pause_between_sentences(served, case, seed, flush))
    alone = boundaries.hear(case, before, pcm[:1])  # the first segment, whole, before the pause
    assert alone.matches[0] >= MIN_MATCH and alone.tail_ms >= 0.0, (alone.matches, alone.tail_ms)
    dry_s = first_s + (case.fmt.lead_ms + alone.lengths_ms[0]) / 1000.0  # a player started at the first audio
    assert last_s <= dry_s, f"the tail came {last_s - dry_s:.3f} s after the listener ran dry"
    whole = boundaries.hear(case, before + after, pcm)  # then the second, after the pause's silence
    assert min(whole.matches) >= MIN_MATCH, whole.matches
    assert whole.starts_ms[0] == alone.starts_ms[0]
    # the pause itself is no audio (the client's player waits); the drain's padding is (a frame, a codec's flush)
    max_drain_ms = MAX_DRAIN_MS if case.fmt.container not in ("raw", "wav") else MAX_EXCESS_MS  # (PCM: no frames)
    assert -LEAD_TOLERANCE_MS <= whole.excess_ms[0] <= max_drain_ms, whole.excess_ms
    # the stream's end: its last frame, or one drain's padding: on a loaded machine the second sentence's chunks
    # can come later than its listener plays them, and the listener clock then drains the codec (by design) once
    # more before the flush or the context's end is read (seen in CI: MP3 padded 115-169 ms without a flush, Opus
    # 40 ms with one; the same cases pass on an idle machine with the last frame only)
    max_tail_ms = max(last_frame_ms(case), max_drain_ms)
    assert whole.tail_ms <= max_tail_ms + LEAD_TOLERANCE_MS


def test_the_cases_cover_every_format_and_rate_served() -> None:
    served = {(c.fmt.container, c.fmt.codec, c.fmt.sample_rate_hz) for c in CASES}
    assert {("raw", "pcm_s16le", rate) for rate in PCM_SAMPLE_RATES_HZ} <= served
    assert {("raw", "mulaw", 8_000), ("raw", "alaw", 8_000), ("adts", "aac", 24_000), ("flac", "flac", 24_000),
            ("ogg", "opus", 48_000), ("wav", "pcm_s16le", 24_000)} <= served
    mp3 = {(c.fmt.sample_rate_hz, c.fmt.effective_bitrate_bps) for c in CASES if c.fmt.codec == "mp3"}
    assert {(44_100, kbps * 1000) for kbps in (32, 64, 96, 128, 192)} <= mp3  # every bit rate the vendors name
    assert {(8_000, 32_000), (22_050, 32_000), (24_000, 48_000)} <= mp3
    assert {c.transport for c in CASES} == {"http", "ws"}
