"""agent_server.voices: reference clip decoding and the store's leases (HTTP flows are in test_e2e.py)."""

from __future__ import annotations

import asyncio
import io
import wave
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from numpy.typing import NDArray

from agent_server.voices import (
    VoiceError,
    VoiceStatus,
    VoiceStore,
    decode_wav,
    encode_wav_pcm16,
)

from tests.agent_server.fake_engine import FakeEngine

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
        with pytest.raises(ValueError):
            decode_wav(junk)


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
