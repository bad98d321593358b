"""agent_server.phrase_cache: the key, the LRU, the source a SpeechStream submits to (driven by hand with
test_speech's ManualEngine and a synchronous post), the Redis tier against a real redis-server, the pre-warm
list, and pre-warming a live server before /readyz turns ready."""

from __future__ import annotations

import asyncio
import base64
import dataclasses
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import orjson
import pytest
from starlette.applications import Starlette

from agent_server.app import create_app
from agent_server.core.events import (
    AudioOut,
    SegmentDone,
    SegmentStarted,
    Stream,
    StreamDone,
    StreamEvent,
    StreamSpec,
    StreamStatus,
)
from agent_server.core.stream import SpeechStream
from agent_server.fleet.phrase_cache import (
    NO_CACHE,
    PREWARM,
    CachedAudio,
    CachedSource,
    CachePolicy,
    KeyContext,
    PhraseCache,
    RedisTier,
    normalise_text,
    parse_prewarm,
    phrase_key,
)
from agent_server.protocols import native_wire as wire
from agent_server.settings import Settings
from agent_server.text.segmenter import Segmenter
from synth.api import SAMPLES_PER_SPEECH_TOKEN, EventKind, SamplingParams

from tests.agent_server.core.test_stream import PCM24, ManualEngine, Recorder, sync_post
from tests.agent_server.fake_asgi import FakeHttpRequest, running
from tests.agent_server.fake_engine import FakeEngine
from tests.agent_server.live_server import live_server
from tests.agent_server.native_client import NativeClient
from tests.agent_server.protocol_drivers import DRIVERS, Driver, until_turn_done
from tests.services import RedisServer, redis_server

pytestmark = pytest.mark.timeout(60)

CONTEXT = KeyContext("english", "w1", "default", "ver1", None)
TEXT = "One moment, please."


def audio(tokens: int, value: float) -> CachedAudio:
    pcm = np.full(tokens * SAMPLES_PER_SPEECH_TOKEN, value, dtype=np.float32)
    pcm.setflags(write=False)
    return CachedAudio(pcm, tokens)


# ---- the key ----------------------------------------------------------------------------------------


def test_the_key_covers_everything_that_shapes_the_audio() -> None:
    base = SamplingParams(seed=7)
    key = CONTEXT.key(TEXT, base)
    assert CONTEXT.key("  One   moment,\tplease. ", base) == key  # whitespace is not audio
    assert CONTEXT.key("Cafe\u0301 time", base) == CONTEXT.key("Caf\u00e9 time", base)  # NFD = NFC
    assert normalise_text(" a \n b ") == "a b"
    changed: dict[str, Any] = {
        "temperature": 0.7, "top_p": 0.9, "min_p": 0.1, "top_k": 50, "repetition_penalty": 1.3,
        "cfg_weight": 0.4, "exaggeration": 0.6, "max_new_tokens": 99, "seed": 8,
    }
    assert set(changed) == {f.name for f in dataclasses.fields(SamplingParams)}  # every parameter is covered
    for name, value in changed.items():
        assert CONTEXT.key(TEXT, dataclasses.replace(base, **{name: value})) != key, name
    assert CONTEXT.key(TEXT, dataclasses.replace(base, seed=None)) != key
    assert CONTEXT.key("one moment, please.", base) != key  # case may change the audio: not normalised
    for field_name, text in (("model", "turbo"), ("weights_id", "w2"), ("voice_id", "other"),
                             ("voice_version", "ver2"), ("language", "fr")):
        assert dataclasses.replace(CONTEXT, **{field_name: text}).key(TEXT, base) != key, field_name
    assert phrase_key(TEXT, model="english", weights_id="w1", voice_id="default", voice_version="ver1",
                      params=base, language=None) == key


def test_values_round_trip_and_garbage_is_refused() -> None:
    value = audio(3, 0.125)
    back = CachedAudio.from_bytes(value.to_bytes())
    assert back.speech_tokens == 3 and np.array_equal(back.pcm, value.pcm) and back.pcm.dtype == np.float32
    for junk in (b"", b"PHC1", value.to_bytes()[:-1], b"XXXX" + value.to_bytes()[4:]):
        with pytest.raises(ValueError):
            CachedAudio.from_bytes(junk)


def test_lru_keeps_to_its_byte_budget_and_never_evicts_pinned() -> None:
    one = audio(1, 0.1)  # 3840 bytes
    cache = PhraseCache(budget_bytes=3 * one.nbytes)
    cache.put("a", one, pinned=True)
    cache.put("b", one)
    cache.put("c", one)
    assert cache.get_local("b") is not None  # b is now more recent than c
    cache.put("d", one)
    assert cache.get_local("c") is None and cache.stats.evictions == 1  # the least recent unpinned went
    cache.put("e", one)
    assert cache.get_local("a") is not None and cache.get_local("b") is None  # a is pinned
    assert cache.bytes == 3 * one.nbytes and cache.entries == 3
    cache.pin(["a"], pinned=False)
    for key in ("f", "g", "h"):  # three new entries: every older one goes, a now too
        cache.put(key, one)
    assert cache.get_local("a") is None and cache.entries == 3


# ---- the source a stream submits to -------------------------------------------------------------------


def cached_stream(engine: ManualEngine, cache: PhraseCache, *, seed: int | None, policy: CachePolicy | None = None,
                  context: KeyContext = CONTEXT, params: SamplingParams | None = None,
                  pin: bool = False) -> tuple[SpeechStream, Recorder, CachedSource]:
    recorder = Recorder()
    spec = StreamSpec(voice_id="default", params=params or SamplingParams(seed=seed), output_format=PCM24)
    source = CachedSource(engine, cache, context, policy or CachePolicy(), sync_post, pin=pin)
    stream = SpeechStream(f"s/{time.monotonic_ns()}", spec, engine=source, segmenter=Segmenter(), post=sync_post,
                          emit=recorder)
    stream.open()
    return stream, recorder, source


def speak(stream: SpeechStream, engine: ManualEngine, text: str, *, tokens: int = 3) -> None:
    """Push `text` and play the engine for every segment it submits (two chunks each)."""
    stream.push_text(text, 0.0)
    stream.end(0.0)
    played = 0
    while played < len(engine.submitted):
        engine.event(played, EventKind.STARTED)
        engine.chunk(played, tokens - 1, 0.1 + played / 10)
        engine.chunk(played, 1, -0.2)
        engine.event(played, EventKind.GENERATED)
        engine.event(played, EventKind.DONE)
        played += 1


def payloads(recorder: Recorder) -> list[bytes]:
    return [e.payload for e in recorder.of(AudioOut)]


def test_a_second_identical_seeded_stream_is_replayed_bit_identically() -> None:
    engine, cache = ManualEngine(), PhraseCache(budget_bytes=1 << 20)
    first, rec1, _ = cached_stream(engine, cache, seed=7)
    speak(first, engine, "Sure. One moment, please, I am looking it up now.")
    segments = len(engine.submitted)
    assert segments >= 2 and cache.entries == segments and cache.stats.misses == segments
    second, rec2, source = cached_stream(engine, cache, seed=7)
    speak(second, engine, "Sure. One moment, please, I am looking it up now.")
    assert len(engine.submitted) == segments  # nothing went to the engine
    assert source.hits == segments and cache.stats.hits_local == segments
    assert payloads(rec2) == payloads(rec1) and payloads(rec1)  # bit-identical frames
    assert [e.cached for e in rec2.of(SegmentStarted)] == [True] * segments
    assert [e.cached for e in rec1.of(SegmentStarted)] == [False] * segments
    assert [e.speech_tokens for e in rec2.of(SegmentDone)] == [e.speech_tokens for e in rec1.of(SegmentDone)]
    assert rec2.of(StreamDone)[0].status == StreamStatus.COMPLETED


def test_what_is_not_cached_unseeded_opted_out_cancelled_failed() -> None:
    engine, cache = ManualEngine(), PhraseCache(budget_bytes=1 << 20)
    unseeded, _, _ = cached_stream(engine, cache, seed=None)
    speak(unseeded, engine, TEXT)
    assert cache.entries == 0 and cache.stats.stores == 0
    opted_out, _, _ = cached_stream(engine, cache, seed=7, policy=NO_CACHE)
    speak(opted_out, engine, TEXT)
    assert cache.entries == 0
    cancelled, _, _ = cached_stream(engine, cache, seed=7)
    cancelled.push_text(TEXT, 0.0)
    cancelled.end(0.0)
    engine.event(len(engine.submitted) - 1, EventKind.STARTED)
    engine.chunk(len(engine.submitted) - 1, 2)
    cancelled.cancel()
    assert engine.cancelled == [engine.submitted[-1].request_id]  # the forwarded segment is cancelled
    failed, _, _ = cached_stream(engine, cache, seed=7)
    failed.push_text(TEXT, 0.0)
    failed.end(0.0)
    engine.chunk(len(engine.submitted) - 1, 2)
    engine.event(len(engine.submitted) - 1, EventKind.FAILED, "vocoder error")
    assert cache.entries == 0 and cache.stats.stores == 0  # only a DONE segment is stored
    before = len(engine.submitted)
    again, _, _ = cached_stream(engine, cache, seed=7, policy=NO_CACHE)
    speak(again, engine, TEXT)
    assert len(engine.submitted) == before + 1


def test_a_changed_parameter_or_voice_version_misses() -> None:
    engine, cache = ManualEngine(), PhraseCache(budget_bytes=1 << 20)
    stream, _, _ = cached_stream(engine, cache, seed=7)
    speak(stream, engine, TEXT)
    assert len(engine.submitted) == 1
    variants = [  # (seed, params, key context)
        (8, None, CONTEXT),
        (None, SamplingParams(seed=7, temperature=0.7), CONTEXT),
        (7, None, dataclasses.replace(CONTEXT, voice_version="ver2")),
    ]
    for i, (seed, params, context) in enumerate(variants):
        other, _, source = cached_stream(engine, cache, seed=seed, params=params, context=context)
        speak(other, engine, TEXT)
        assert len(engine.submitted) == 2 + i and source.hits == 0, (seed, params, context)
    same, _, source = cached_stream(engine, cache, seed=7)
    speak(same, engine, TEXT)
    assert source.hits == 1 and len(engine.submitted) == 1 + len(variants)


def test_prewarm_stores_under_the_unseeded_key_too() -> None:
    engine, cache = ManualEngine(), PhraseCache(budget_bytes=1 << 20)
    warm, _, source = cached_stream(engine, cache, seed=None, policy=PREWARM, pin=True)
    speak(warm, engine, TEXT)
    assert cache.entries == 1 and source.stored_keys  # (an unseeded render: the unseeded key only)
    client, rec, hit = cached_stream(engine, cache, seed=None)
    speak(client, engine, TEXT)
    assert hit.hits == 1 and len(engine.submitted) == 1 and rec.of(SegmentStarted)[0].cached
    seeded_warm, _, source = cached_stream(engine, cache, seed=3, policy=PREWARM, pin=True)
    speak(seeded_warm, engine, "Goodbye.")
    assert len(source.stored_keys) == 2  # seeded and unseeded
    cache.put("filler", audio(200, 0.0))  # way over budget: pinned entries stay
    assert cache.get_local(source.stored_keys[0]) is not None


# ---- every protocol gets it -----------------------------------------------------------------------------

SEED = 5
SEED_IN_QUERY = ("deepgram_http", "jambonz_http")  # the others take it in the JSON body


async def seeded_turn(driver: Driver, app: Starlette, text: str) -> tuple[bytes, list[bool]]:
    """One turn of `text` with seed SEED over `driver`'s protocol: (the audio the client got, as raw bytes of
    its output format; the native `segment_started.cached` flags, [] for the others)."""
    if driver.http:
        if driver.name == "openai":
            body = {"model": "tts-1", "voice": "alloy", "response_format": "pcm", "input": text, "seed": SEED}
            request = FakeHttpRequest(app, driver.path, body)
            request.start()
        elif driver.name in SEED_IN_QUERY:
            request = dataclasses.replace(driver, query=f"{driver.query}&seed={SEED}".lstrip("&")).request(app, text)
        else:
            request = driver.request(app, text, extra={"seed": SEED})
        await request.done()
        await request.finished()
        assert request.status == 200, request.content[:200]
        return request.content, []
    query = driver.query if driver.name in ("native", "cartesia") else f"{driver.query}&seed={SEED}".lstrip("&")
    ws = await dataclasses.replace(driver, query=query).connect(app)
    messages = driver.turn("c", text)
    if driver.name == "cartesia":
        messages[0]["seed"] = SEED
    if driver.name == "native":
        messages[0]["seed"] = SEED
    for message in messages:
        ws.send_json(message)
    got = await until_turn_done(driver, ws, "c")
    assert not any(driver.is_busy(m) or driver.error_of(m) for m in got), got
    if not ws.closed.is_set():
        ws.disconnect()
    await ws.finished()
    audio = b""
    for item in ws.log:
        if isinstance(item, bytes):
            audio += wire.decode_frame(item)[1] if driver.name == "native" else item
            continue
        message = orjson.loads(item)
        encoded = message.get("audio") if driver.name == "elevenlabs" else message.get("data")
        if isinstance(encoded, str) and (driver.name == "elevenlabs" or message.get("type") == "chunk"):
            audio += base64.b64decode(encoded)
    cached = [m["cached"] for m in got if m.get("type") == "segment_started"]
    return audio, cached


@pytest.mark.parametrize("driver", DRIVERS, ids=str)
def test_every_protocol_gets_a_seeded_repeat_from_the_phrase_cache(tmp_path: Path, driver: Driver) -> None:
    """The cache sits under the session core (hub.open_stream), so every protocol, the OpenAI HTTP one
    included, gets a seeded repeat from it: no segment reaches the engine, and the client gets the same bytes
    in its own framing (native: `segment_started.cached`)."""
    engine = FakeEngine()
    app = create_app(engine, Settings(data_dir=tmp_path))
    text = "Sure. One moment, please, I am looking it up now."

    async def scenario() -> tuple[bytes, list[bool], bytes, list[bool], int]:
        async with running(app):
            first, first_cached = await seeded_turn(driver, app, text)
            rendered = len(engine.submits)
            again, again_cached = await seeded_turn(driver, app, text)
            return first, first_cached, again, again_cached, rendered

    first, first_cached, again, again_cached, rendered = asyncio.run(scenario())
    assert rendered >= 2 and len(engine.submits) == rendered  # every segment of the repeat came from the cache
    assert first and again == first
    if driver.name == "native":
        assert first_cached == [False] * rendered and again_cached == [True] * rendered


# ---- the Redis tier ------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def redis(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RedisServer]:
    with redis_server(tmp_path_factory.mktemp("redis")) as server:
        yield server


def test_another_replica_hits_through_redis_and_a_dead_redis_is_a_miss(redis: RedisServer) -> None:
    async def scenario() -> None:
        loop = asyncio.get_running_loop()
        a = PhraseCache(1 << 20, RedisTier(redis.url, prefix="pc:", ttl_s=60))
        b = PhraseCache(1 << 20, RedisTier(redis.url, prefix="pc:", ttl_s=60))
        engine_a, engine_b = ManualEngine(), ManualEngine()
        recorder_a = Recorder()
        spec = StreamSpec(voice_id="default", params=SamplingParams(seed=7), output_format=PCM24)
        stream_a = SpeechStream("a/1", spec, engine=CachedSource(engine_a, a, CONTEXT, CachePolicy(), loop.call_soon),
                                segmenter=Segmenter(), post=loop.call_soon, emit=recorder_a)
        stream_a.open()
        stream_a.push_text(TEXT, 0.0)
        stream_a.end(0.0)
        await asyncio.sleep(0.2)  # the remote lookup (a miss) forwards it
        assert len(engine_a.submitted) == 1
        engine_a.event(0, EventKind.STARTED)
        engine_a.chunk(0, 3, 0.3)
        engine_a.event(0, EventKind.GENERATED)
        engine_a.event(0, EventKind.DONE)
        await asyncio.sleep(0)
        await a.flush()
        assert a.stats.stores == 1
        done = asyncio.Event()
        recorder_b = Recorder()

        def emit_b(stream: Stream, event: StreamEvent) -> None:
            recorder_b(stream, event)
            if isinstance(event, StreamDone):
                done.set()

        stream_b = SpeechStream("b/1", spec, engine=CachedSource(engine_b, b, CONTEXT, CachePolicy(), loop.call_soon),
                                segmenter=Segmenter(), post=loop.call_soon, emit=emit_b)
        stream_b.open()
        stream_b.push_text(TEXT, 0.0)
        stream_b.end(0.0)
        await asyncio.wait_for(done.wait(), 5)
        assert engine_b.submitted == [] and b.stats.hits_remote == 1  # B never rendered it
        assert payloads(recorder_b) == payloads(recorder_a)
        assert b.get_local(CONTEXT.key(TEXT, SamplingParams(seed=7))) is not None  # kept locally from then on
        redis.stop()
        try:
            started_s = time.monotonic()
            assert await b.get_remote("absent") is None
            assert time.monotonic() - started_s < 1.0 and b.remote is not None and not b.remote.available
            stream_c = SpeechStream("b/2", StreamSpec(voice_id="default", params=SamplingParams(seed=9),
                                                      output_format=PCM24),
                                    engine=CachedSource(engine_b, b, CONTEXT, CachePolicy(), loop.call_soon),
                                    segmenter=Segmenter(), post=loop.call_soon, emit=Recorder())
            stream_c.open()
            stream_c.push_text(TEXT, 0.0)
            stream_c.end(0.0)
            assert len(engine_b.submitted) == 1  # Redis down: straight to the engine, no wait
        finally:
            redis.start()
        await a.close()
        await b.close()

    asyncio.run(scenario())


# ---- the pre-warm list ---------------------------------------------------------------------------------


def test_parse_prewarm() -> None:
    entries = parse_prewarm(orjson.dumps(["Hello.", {"text": "Bye.", "voice": "v", "seed": 3, "language": "fr",
                                                     "sampling": {"temperature": 0.7}}]))
    assert entries[0].text == "Hello." and entries[0].voice_id == "default" and entries[0].seed is None
    assert entries[1].sampling == (("temperature", 0.7),) and entries[1].seed == 3
    for bad in (b"{", b"{}", b"[1]", b'[{"text": ""}]', b'[{"text": "a", "seed": -1}]', b'[{"text": "a", "x": 1}]',
                b'[{"text": "a", "sampling": {"nope": 1}}]', b'[{"text": "a", "sampling": {"seed": 1}}]'):
        with pytest.raises(ValueError):
            parse_prewarm(bad)


def test_prewarm_renders_before_ready_serves_unseeded_requests_and_reloads(tmp_path: Path) -> None:
    prewarm = tmp_path / "prewarm.json"
    prewarm.write_bytes(orjson.dumps(["One moment, please.", {"text": "Thanks for calling.", "seed": 5}]))
    engine = FakeEngine(ready_delay_s=0.0, first_chunk_delay_s=0.3)
    settings = Settings(data_dir=tmp_path, prewarm_file=prewarm)
    with live_server(engine, settings, wait_ready=False) as server:
        hub = server.hub
        saw_unready_while_warming = False
        while httpx.get(server.http_url + "/readyz").status_code != 200:
            saw_unready_while_warming |= len(engine.submits) > 0
            time.sleep(0.01)
        assert saw_unready_while_warming  # the engine was rendering while /readyz said 503
        assert hub.prewarm.rendered == 2 and hub.prewarm.failed == 0
        assert hub.phrase_cache.entries == 3  # unseeded + (seeded, unseeded)
        rendered = len(engine.submits)

        async def ask(text: str, **fields: Any) -> Any:
            client = await NativeClient.connect(server.ws_url)
            log = await client.open("c", text=text, **fields)
            await client.end("c")
            await asyncio.wait_for(log.finished.wait(), 10)
            await client.close()
            return log

        hit = asyncio.run(ask("One moment, please."))
        assert len(engine.submits) == rendered and hit.segments_started[0]["cached"] is True
        assert hit.done is not None and hit.done["reason"] == "completed" and hit.frames
        seeded = asyncio.run(ask("Thanks for calling.", seed=5))
        assert len(engine.submits) == rendered and seeded.segments_started[0]["cached"] is True
        other_seed = asyncio.run(ask("Thanks for calling.", seed=6))
        assert len(engine.submits) == rendered + 1 and other_seed.segments_started[0]["cached"] is False
        opted_out = asyncio.run(ask("One moment, please.", cache=False))
        assert len(engine.submits) == rendered + 2 and opted_out.segments_started[0]["cached"] is False
        # reload: a new phrase is rendered, one that left the list is unpinned
        prewarm.write_bytes(orjson.dumps(["One moment, please.", "Please hold."]))
        hub.post(hub.reload_prewarm)
        deadline_s = time.monotonic() + 10
        while hub.prewarm.runs < 2:
            assert time.monotonic() < deadline_s
            time.sleep(0.02)
        assert hub.prewarm.rendered == 1 and hub.prewarm.cached == 1 and len(hub.prewarm.pinned_keys) == 2
        status = httpx.get(server.http_url + "/v1/status").json()
        assert status["prewarm"]["phrases"] == 2 and status["phrase_cache"]["hits_local"] >= 2
        metrics = httpx.get(server.http_url + "/metrics").text
        assert 'tts_phrase_cache_lookups_total{result="hit_local"}' in metrics


def test_sighup_reloads_the_prewarm_list_of_the_real_command(tmp_path: Path) -> None:
    import signal

    from tests.agent_server.live_server import cli_server

    prewarm = tmp_path / "prewarm.json"
    prewarm.write_bytes(orjson.dumps(["One moment, please."]))
    with cli_server(tmp_path, {"AGENT_SERVER_PREWARM": str(prewarm)}) as (proc, port, log_path):
        status = httpx.get(f"http://127.0.0.1:{port}/v1/status").json()["prewarm"]
        assert status["runs"] == 1 and status["rendered"] == 1 and status["phrases"] == 1  # before ready
        prewarm.write_bytes(orjson.dumps(["One moment, please.", "Please hold.", "Goodbye."]))
        proc.send_signal(signal.SIGHUP)
        deadline_s = time.monotonic() + 15
        while (status := httpx.get(f"http://127.0.0.1:{port}/v1/status").json()["prewarm"])["runs"] < 2:
            assert time.monotonic() < deadline_s and proc.poll() is None
            time.sleep(0.05)
        assert status["phrases"] == 3 and status["rendered"] == 2 and status["cached"] == 1
        prewarm.write_text("[not json")  # a broken file keeps the old list, and the server
        proc.send_signal(signal.SIGHUP)
        while "prewarm_reload_failed" not in log_path.read_text():  # the server says it kept the old list
            assert time.monotonic() < deadline_s + 15 and proc.poll() is None
            time.sleep(0.05)
        assert httpx.get(f"http://127.0.0.1:{port}/v1/status").json()["prewarm"]["phrases"] == 3


def test_weights_identity(tmp_path: Path) -> None:
    from agent_server.fleet.phrase_cache import WEIGHT_FILE_SAMPLE_BYTES, weights_identity

    base: dict[str, object] = {"weights_source": "random-tiny", "preset": "tiny", "dtype": "float32",
                               "cpu_weights": "fp32", "device": "cuda:0"}
    same = weights_identity(base, "turbo")
    assert weights_identity({**base, "device": "cuda:3"}, "turbo") == same  # which GPU does not matter
    for change in ({"dtype": "bfloat16"}, {"cpu_weights": "bf16"}, {"cpu_vocoder": "bf16"}, {"device": "cpu"},
                   {"preset": "full"}, {"decode_attention": "shared-prefix"},
                   {"weights_source": "random-full"}):
        assert weights_identity({**base, **change}, "turbo") != same, change
    assert weights_identity(base, "english") != same
    # a checkpoint directory: its files, wherever it lies
    first, second = tmp_path / "a", tmp_path / "b"
    for directory in (first, second):
        directory.mkdir()
        (directory / "t3.safetensors").write_bytes(bytes(3 * WEIGHT_FILE_SAMPLE_BYTES))
        (directory / "notes.txt").write_text("not a weight file")
    ids = [weights_identity({**base, "weights_source": str(d)}, "turbo") for d in (first, second)]
    assert ids[0] == ids[1]
    assert weights_identity({**base, "weights_source": f"hf-cache:{first}"}, "turbo") == ids[0]
    tail_changed = bytearray(3 * WEIGHT_FILE_SAMPLE_BYTES)
    tail_changed[-1] = 1  # a fine-tune differs everywhere; the last MiB is enough to see it
    (second / "t3.safetensors").write_bytes(bytes(tail_changed))
    assert weights_identity({**base, "weights_source": str(second)}, "turbo") != ids[0]
