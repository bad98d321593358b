"""agent_server.voices: reference clip decoding and the store's leases (HTTP flows are in test_e2e.py)."""

from __future__ import annotations

import asyncio
import io
import secrets
import time
import wave
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from numpy.typing import NDArray

from agent_server.core.voices import VoiceError, VoiceStatus, VoiceStore, decode_wav, encode_wav_pcm16
from agent_server.fleet.shared_state import RedisState
from synth.api import Variant

from tests.agent_server.fake_engine import FakeEngine
from tests.services import RedisServer, redis_server

pytestmark = pytest.mark.timeout(60)


def wav_bytes(samples: NDArray[Any], rate_hz: int, width_bytes: int, channels: int = 1) -> bytes:
    out = io.BytesIO()
    with wave.open(out, "wb") as writer:
        writer.setnchannels(channels)
        writer.setsampwidth(width_bytes)
        writer.setframerate(rate_hz)
        writer.writeframes(samples.tobytes())
    return out.getvalue()


def test_decode_pcm_widths_and_channels() -> None:
    ramp = np.linspace(-0.5, 0.5, 1000)
    wav16, rate = decode_wav(wav_bytes((ramp * 32767).astype("<i2"), 16000, 2))
    assert rate == 16000 and wav16.dtype == np.float32 and np.abs(wav16 - ramp).max() < 1e-4
    ints32 = (ramp * 2**31).astype("<i4")
    wav32, _ = decode_wav(wav_bytes(ints32, 8000, 4))
    assert np.abs(wav32 - ramp).max() < 1e-6
    ints24 = (ramp * 2**23).astype("<i4")
    packed = np.frombuffer(ints24.tobytes(), dtype=np.uint8).reshape(-1, 4)[:, :3].copy()
    wav24, _ = decode_wav(wav_bytes(packed, 8000, 3))
    assert np.abs(wav24 - ramp).max() < 1e-6
    wav8, _ = decode_wav(wav_bytes((ramp * 127 + 128).astype(np.uint8), 8000, 1))
    assert np.abs(wav8 - ramp).max() < 2e-2
    stereo = np.stack([ramp, -ramp], axis=1).ravel()
    mono, _ = decode_wav(wav_bytes((stereo * 32767).astype("<i2"), 22050, 2, channels=2))
    assert len(mono) == 1000 and np.abs(mono).max() < 1e-4


def test_decode_round_trip_and_garbage() -> None:
    clip = (0.25 * np.sin(np.arange(24000) / 10)).astype(np.float32)
    back, rate = decode_wav(encode_wav_pcm16(clip, 24000))
    assert rate == 24000 and np.abs(back - clip).max() < 1e-4
    for junk in (b"", b"RIFF", b"not a wav file at all"):
        with pytest.raises(ValueError) as refused:
            decode_wav(junk)
        assert " at 0x" not in str(refused.value) and "BytesIO" not in str(refused.value)  # no Python object repr


def test_store_leases_defer_the_engine_forgetting(tmp_path: Path) -> None:
    engine = FakeEngine()
    store = VoiceStore(tmp_path / "voices")

    async def scenario() -> None:
        await store.attach(engine)
        clip = encode_wav_pcm16(np.zeros(16000 * 6, dtype=np.float32), 16000)
        voice = await store.create(clip, name="n", voice_id="mine")
        assert voice.status == VoiceStatus.READY and "mine" in engine.voices
        lease = store.acquire("mine")
        await store.delete("mine")
        assert "mine" in engine.voices and not (tmp_path / "voices" / "mine.wav").exists()
        with pytest.raises(VoiceError):
            store.acquire("mine")
        store.release(lease)
        assert "mine" not in engine.voices
        with pytest.raises(VoiceError) as err:
            await store.create(clip[: len(clip) // 2], voice_id="short")
        assert err.value.status_code == 422 and err.value.field == "file"
        with pytest.raises(VoiceError) as err:
            await store.create(clip, voice_id="bad id!")
        assert err.value.field == "voice_id"

    asyncio.run(scenario())


# ---- shared voices (RedisState against a real redis-server) ---------------------------------------------


def version_on(store: VoiceStore, voice_id: str) -> str | None:
    """The version a new context would get there (None: none now)."""
    try:
        return store.get(voice_id).version
    except VoiceError:
        return None


class CountingEngine(FakeEngine):
    """Counts how each voice arrived: computed from a clip, or imported as conditioning."""

    def __init__(self, **options: Any) -> None:
        super().__init__(**options)
        self.computed: list[str] = []
        self.imported: list[str] = []

    def add_voice(self, voice_id: str, wav: NDArray[Any], sample_rate_hz: int) -> None:
        super().add_voice(voice_id, wav, sample_rate_hz)
        self.computed.append(voice_id)

    def import_voice(self, voice_id: str, conditioning: bytes, model: Variant | None = None) -> None:
        super().import_voice(voice_id, conditioning, model)
        self.imported.append(voice_id)


@pytest.fixture(scope="module")
def redis(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RedisServer]:
    with redis_server(tmp_path_factory.mktemp("redis")) as server:
        yield server


def test_a_voice_created_on_one_replica_is_served_by_the_others_without_recomputing(
    tmp_path: Path, redis: RedisServer
) -> None:
    prefix = f"v{secrets.token_hex(4)}:"
    clip = encode_wav_pcm16((0.1 * np.sin(np.arange(16000 * 6) / 7)).astype(np.float32), 16000)
    other_clip = encode_wav_pcm16((0.1 * np.sin(np.arange(16000 * 6) / 5)).astype(np.float32), 16000)

    async def until(predicate: Any) -> None:
        deadline_s = time.monotonic() + 5
        while not predicate():
            assert time.monotonic() < deadline_s, "timed out"
            await asyncio.sleep(0.01)

    async def scenario() -> None:
        replicas = []
        for name, weights_id in (("a", "w1"), ("b", "w1"), ("c", "w2")):  # c runs other weights
            shared = RedisState(redis.url, prefix=prefix, replica_id=name, sync_period_s=0.05)
            await shared.start()
            engine = CountingEngine()
            store = VoiceStore(tmp_path / name, shared=shared)
            await store.attach(engine, {"english": weights_id})
            replicas.append((store, engine, shared))
        (a, engine_a, _), (b, engine_b, shared_b), (c, engine_c, _) = replicas
        created = await a.create(clip, name="Ann", voice_id="ann")
        assert created.version and engine_a.computed == ["ann"]
        assert not (tmp_path / "a").exists()  # shared: nothing on the replica's disk
        await until(lambda: "ann" in engine_b.voices and "ann" in engine_c.voices)
        await until(lambda: b.get("ann").status == VoiceStatus.READY and c.get("ann").status == VoiceStatus.READY)
        assert engine_b.imported == ["ann"] and engine_b.computed == []  # b: the conditioning, not the encoders
        assert engine_b.voice_blobs["ann"] == engine_a.voice_blobs["ann"] and b.get("ann").version == created.version
        assert engine_c.computed == ["ann"] and engine_c.imported == []  # c: other weights, recomputed
        assert b.get("ann").name == "Ann"
        with pytest.raises(VoiceError) as err:
            await b.create(clip, voice_id="ann")  # one id, one voice, whichever replica is asked
        assert err.value.status_code == 409
        # deleted on b: a forgets it once its context is over
        lease = a.acquire("ann")
        await b.delete("ann")
        await until(lambda: a.list() == [v for v in a.list() if v.voice_id != "ann"])
        assert "ann" in engine_a.voices  # its context still holds it
        a.release(lease)
        assert "ann" not in engine_a.voices
        # created again from another clip: another version, and every replica moves to it
        again = await c.create(other_clip, voice_id="ann")
        assert again.version != created.version
        await until(lambda: "ann" in engine_a.voices and a.get("ann").status == VoiceStatus.READY)
        await until(lambda: "ann" in engine_b.voices and b.get("ann").version not in ("", created.version)
                    and b.get("ann").status == VoiceStatus.READY)  # (b may still be computing it for w1)
        # made on w2 weights: a (w1) recomputed it from the clip, or imported the w1 conditioning b computed and
        # shared a moment before (whichever replica syncs first computes it for the other)
        assert engine_a.computed == ["ann", "ann"] or (engine_a.computed == ["ann"] and engine_a.imported == ["ann"]
                                                       and engine_b.computed == ["ann"]), (engine_a, engine_b)
        # changed again while a context on b still speaks the old version: that context ends, the new stays
        old_lease = b.acquire("ann")
        await c.delete("ann")
        third = await c.create(clip, voice_id="ann")
        await until(lambda: version_on(b, "ann") == third.version)
        b.release(old_lease)
        assert "ann" in engine_b.voices and b.get("ann").status == VoiceStatus.READY
        # the shared state down: what is loaded keeps serving; creating and deleting are refused (503)
        redis.stop()
        try:
            assert b.acquire("ann") is not None
            with pytest.raises(VoiceError) as err:
                await b.create(clip, voice_id="bob")
            assert err.value.status_code == 503 and "bob" not in engine_b.voices  # (rolled back)
            await until(lambda: not shared_b.available)
            with pytest.raises(VoiceError) as err:
                await b.create(clip, voice_id="bob")
            assert err.value.status_code == 503 and err.value.code == "shared_state_unavailable"
            with pytest.raises(VoiceError) as err:
                await b.delete("ann")
            assert err.value.status_code == 503
        finally:
            redis.start()
        await until(lambda: shared_b.available)
        assert (await b.create(clip, voice_id="bob")).status == VoiceStatus.READY
        for store, _, shared in replicas:
            await store.detach()
            await shared.stop()

    asyncio.run(scenario())


def test_each_models_conditioning_is_shared_by_the_replicas_keyed_by_that_model(
    tmp_path: Path, redis: RedisServer
) -> None:
    """Several models (issue 37): one clip gives each loaded model its own conditioning, shared through Redis by
    the model's weights identity. A replica with the same models imports every one (no encoder runs), a replica
    with a model not computed yet computes from the clip and shares that model's for the next, which imports it."""
    prefix = f"m{secrets.token_hex(4)}:"
    clip = encode_wav_pcm16((0.1 * np.sin(np.arange(16000 * 6) / 7)).astype(np.float32), 16000)

    async def until(predicate: Any) -> None:
        deadline_s = time.monotonic() + 5
        while not predicate():
            assert time.monotonic() < deadline_s, "timed out"
            await asyncio.sleep(0.01)

    async def replica(name: str, loaded: tuple[Variant, ...]) -> tuple[VoiceStore, CountingEngine]:
        shared = RedisState(redis.url, prefix=prefix, replica_id=name, sync_period_s=0.05)
        await shared.start()
        engine = CountingEngine(loaded=loaded)
        store = VoiceStore(tmp_path / name, shared=shared)
        await store.attach(engine, {model: f"w-{model}" for model in loaded})
        return store, engine

    async def scenario() -> None:
        a, engine_a = await replica("a", ("turbo", "multilingual"))
        b, engine_b = await replica("b", ("turbo", "multilingual"))
        c, engine_c = await replica("c", ("english", "multilingual"))
        created = await a.create(clip, voice_id="ann")
        assert engine_a.conditioning_computed == {"turbo": 1, "multilingual": 1}
        assert created.versions["turbo"] != created.versions["multilingual"]  # each model its own
        await until(lambda: all(version_on(s, "ann") for s in (b, c)))
        assert engine_b.computed == [] and engine_b.imported == ["ann", "ann"]  # both models, no encoder
        for model in ("turbo", "multilingual"):
            assert engine_b.export_voice("ann", model) == engine_a.export_voice("ann", model)
        assert b.get("ann").versions == created.versions
        assert engine_c.computed == ["ann"]  # English was not computed anywhere yet: from the clip
        assert c.get("ann").versions["multilingual"] == created.versions["multilingual"]
        shared_a = a.shared
        assert shared_a is not None

        async def shared_models() -> set[str]:
            data = await shared_a.get_voice("ann")
            return set(data.conditioning) if data is not None else set()

        deadline_s = time.monotonic() + 5
        while "w-english" not in await shared_models():  # c shares the English conditioning it computed
            assert time.monotonic() < deadline_s, "c never shared its English conditioning"
            await asyncio.sleep(0.01)
        d, engine_d = await replica("d", ("english",))  # a replica after c: English only, imported
        assert version_on(d, "ann") == c.get("ann").versions["english"]
        assert engine_d.computed == [] and engine_d.imported == ["ann"]
        assert engine_d.export_voice("ann", "english") == engine_c.export_voice("ann", "english")
        for store in (a, b, c, d):
            await store.detach()
            assert store.shared is not None
            await store.shared.stop()

    asyncio.run(scenario())
