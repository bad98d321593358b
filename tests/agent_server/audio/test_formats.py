from __future__ import annotations

import io
import struct
import wave
from typing import Any

import numpy as np
import pytest
import soxr
from hypothesis import given, settings
from hypothesis import strategies as st
from numpy.typing import NDArray

from agent_server.audio.formats import (
    ENGINE_SAMPLE_RATE_HZ,
    PCM_SAMPLE_RATES_HZ,
    RESAMPLER_QUALITY,
    WAV_UNKNOWN_SIZE,
    AudioEncoder,
    OutputFormat,
    alaw_to_pcm16,
    float_to_pcm16,
    mulaw_to_pcm16,
    pcm16_to_alaw,
    pcm16_to_mulaw,
    wav_header,
)

RESAMPLED_RATES_HZ = [r for r in PCM_SAMPLE_RATES_HZ if r != ENGINE_SAMPLE_RATE_HZ]
AMPLITUDE = 0.5
ODD_CHUNKS = [1, 7, 960, 13, 4001, 333, 2, 9600]


def sine(freq_hz: float, seconds: float, amplitude: float = AMPLITUDE) -> NDArray[Any]:
    t = np.arange(int(seconds * ENGINE_SAMPLE_RATE_HZ)) / ENGINE_SAMPLE_RATE_HZ
    wave: NDArray[np.float32] = (amplitude * np.sin(2 * np.pi * freq_hz * t)).astype(np.float32)
    return wave


def encode_all(fmt: OutputFormat, pcm: NDArray[Any], chunks: list[int] | None = None) -> list[bytes]:
    enc = AudioEncoder(fmt)
    frames: list[bytes] = []
    if chunks is None:
        frames += enc.push(pcm)
    else:
        i = k = 0
        while i < len(pcm):
            n = chunks[k % len(chunks)]
            frames += enc.push(pcm[i : i + n])
            i, k = i + n, k + 1
    return frames + enc.finish()


def pcm16_of(frames: list[bytes]) -> NDArray[Any]:
    return np.frombuffer(b"".join(frames), dtype="<i2").astype(np.float64) / 32767


def rms_db(y: NDArray[Any], rate_hz: int) -> float:
    """RMS of the steady middle (edges trimmed by 0.1 s), in dB relative to the input sine's RMS."""
    middle = y[rate_hz // 10 : -rate_hz // 10]
    return float(20 * np.log10(np.sqrt(np.mean(middle**2)) / (AMPLITUDE / np.sqrt(2)) + 1e-20))


# ---- OutputFormat ----------------------------------------------------------------------------------


@pytest.mark.parametrize("rate", PCM_SAMPLE_RATES_HZ)
def test_parse_pcm_rates(rate: int) -> None:
    fmt = OutputFormat.parse("pcm_s16le", rate, 20)
    assert (fmt.bytes_per_sample, fmt.frame_samples, fmt.frame_bytes) == (2, rate // 50, rate // 50 * 2)


@pytest.mark.parametrize("encoding", ["mulaw", "alaw"])
def test_parse_g711(encoding: str) -> None:
    fmt = OutputFormat.parse(encoding, 8000, 20.0)
    assert (fmt.frame_ms, fmt.frame_bytes, fmt.bytes_per_s) == (20, 160, 8000)


@pytest.mark.parametrize(
    ("args", "field"),
    [
        (("mp3", 24000, None), "encoding"),
        ((b"pcm_s16le", 24000, None), "encoding"),
        (("pcm_s16le", 12345, None), "sample_rate_hz"),
        (("pcm_s16le", "24000", None), "sample_rate_hz"),
        (("pcm_s16le", True, None), "sample_rate_hz"),
        (("pcm_s16le", 24000.5, None), "sample_rate_hz"),
        (("mulaw", 16000, None), "sample_rate_hz"),
        (("alaw", 24000, 20), "sample_rate_hz"),
        (("pcm_s16le", 24000, 0), "frame_ms"),
        (("pcm_s16le", 24000, -20), "frame_ms"),
        (("pcm_s16le", 24000, 2000), "frame_ms"),
        (("pcm_s16le", 24000, 10.5), "frame_ms"),
        (("pcm_s16le", 24000, "20"), "frame_ms"),
        (("pcm_s16le", 22050, 10), "frame_ms"),  # 220.5 samples
    ],
)
def test_parse_errors_name_the_field(args: tuple[object, object, object], field: str) -> None:
    with pytest.raises(ValueError) as excinfo:
        OutputFormat.parse(*args)
    assert str(excinfo.value).split(":")[0] == field


def test_direct_construction_is_validated_too() -> None:
    with pytest.raises(ValueError, match=r"^encoding"):
        OutputFormat("opus", 48000)  # type: ignore[arg-type]


def test_format_helpers() -> None:
    fmt = OutputFormat.parse("mulaw", 8000)
    assert fmt.frame_samples is None and fmt.frame_bytes is None
    assert fmt.mime_type == "audio/basic;rate=8000"
    assert fmt.samples_to_ms(160) == 20.0


# ---- resampling --------------------------------------------------------------------------------------


@pytest.mark.parametrize(("rate", "freq_hz"), [(16000, 10_000), (8000, 5_000), (8000, 6_000), (16000, 9_000)])
def test_above_nyquist_is_attenuated_60_db(rate: int, freq_hz: int) -> None:
    y = pcm16_of(encode_all(OutputFormat("pcm_s16le", rate), sine(freq_hz, 1.0), ODD_CHUNKS))
    assert rms_db(y, rate) < -60.0


@pytest.mark.parametrize("rate", PCM_SAMPLE_RATES_HZ)
@pytest.mark.parametrize("freq_hz", [300, 1000, 3000])
def test_in_band_sine_keeps_its_level(rate: int, freq_hz: int) -> None:
    y = pcm16_of(encode_all(OutputFormat("pcm_s16le", rate), sine(freq_hz, 1.0), ODD_CHUNKS))
    assert abs(rms_db(y, rate)) < 0.5


@pytest.mark.parametrize("rate", PCM_SAMPLE_RATES_HZ)
def test_streaming_in_odd_chunks_equals_one_shot(rate: int) -> None:
    rng = np.random.default_rng(rate)
    pcm = (0.3 * rng.standard_normal(ENGINE_SAMPLE_RATE_HZ)).astype(np.float32)
    fmt = OutputFormat("pcm_s16le", rate)
    streamed = np.frombuffer(b"".join(encode_all(fmt, pcm, ODD_CHUNKS)), dtype="<i2")
    one_shot = np.frombuffer(b"".join(encode_all(fmt, pcm)), dtype="<i2")
    reference = float_to_pcm16(soxr.resample(pcm, ENGINE_SAMPLE_RATE_HZ, rate, quality=RESAMPLER_QUALITY))
    assert len(streamed) == len(one_shot) == len(reference)
    assert np.abs(streamed.astype(np.int32) - one_shot).max(initial=0) <= 1
    assert np.abs(streamed.astype(np.int32) - reference).max(initial=0) <= 1


@settings(max_examples=60, deadline=None)
@given(
    rate=st.sampled_from(PCM_SAMPLE_RATES_HZ),
    chunks=st.lists(st.integers(0, 3000), min_size=1, max_size=12),
)
def test_output_length_after_finish(rate: int, chunks: list[int]) -> None:
    """Exactly: |samples_out - n_in * rate / 24000| <= 0.5, i.e. round() except that soxr may go either
    way on an exact .5 (22.05 and 44.1 kHz); at 24 kHz samples_out == n_in."""
    enc = AudioEncoder(OutputFormat("pcm_s16le", rate))
    n_bytes = sum(len(f) for n in chunks for f in enc.push(np.zeros(n, dtype=np.float32)))
    n_bytes += sum(len(f) for f in enc.finish())
    n_in = sum(chunks)
    assert enc.samples_out * 2 == n_bytes
    assert abs(enc.samples_out - n_in * rate / ENGINE_SAMPLE_RATE_HZ) <= 0.5
    assert abs(enc.samples_out - round(n_in * rate / ENGINE_SAMPLE_RATE_HZ)) <= 1


def test_engine_rate_passes_through_bit_exact() -> None:
    pcm = np.array([0.0, 0.5, -0.5, 1.0, -1.0, 2.0, -2.0, 1 / 65534], dtype=np.float32)
    frames = encode_all(OutputFormat("pcm_s16le", 24000), pcm)
    got = np.frombuffer(b"".join(frames), dtype="<i2").tolist()
    assert got == [0, 16384, -16384, 32767, -32767, 32767, -32767, 0]


# ---- framing -----------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("encoding", "rate"), [("pcm_s16le", r) for r in PCM_SAMPLE_RATES_HZ] + [("mulaw", 8000), ("alaw", 8000)]
)
def test_fixed_frames_are_exact_except_the_last(encoding: str, rate: int) -> None:
    fmt = OutputFormat.parse(encoding, rate, 20)
    frames = encode_all(fmt, sine(440, 0.517), ODD_CHUNKS)
    assert fmt.frame_bytes == rate * 20 // 1000 * fmt.bytes_per_sample
    assert all(len(f) == fmt.frame_bytes for f in frames[:-1])
    assert 0 < len(frames[-1]) <= fmt.frame_bytes


def test_frame_per_chunk_when_frame_ms_is_none() -> None:
    enc = AudioEncoder(OutputFormat("pcm_s16le", 24000))
    assert [len(f) for f in enc.push(np.zeros(960, np.float32))] == [1920]
    assert enc.push(np.zeros(0, np.float32)) == []
    assert enc.finish() == []


def test_drain_releases_held_audio_and_the_stream_goes_on() -> None:
    enc = AudioEncoder(OutputFormat.parse("mulaw", 8000, 20))
    first, second = sine(440, 0.41), sine(660, 0.3)
    frames = enc.push(first)
    assert enc.samples_out < len(first) // 3  # the resampler and the framer hold some back
    frames += enc.drain()
    assert enc.samples_fed == enc.samples_in == len(first)  # no silence fed
    assert enc.samples_resampled == round(len(first) / 3)  # exactly the output the input determines
    assert all(len(f) == 160 for f in frames)
    padded = enc.samples_out - enc.samples_resampled
    assert 0 <= padded < 160  # the framer's padding only: the rest of the last frame
    frames += enc.push(second) + enc.finish()
    # The stream is the one-shot resampling of `first`, the framer's padding (encoded silence), then the one-shot
    # resampling of `second` (a fresh resampler after the drain).
    ref = [pcm16_to_mulaw(float_to_pcm16(soxr.resample(x, 24000, 8000, quality=RESAMPLER_QUALITY)))
           for x in (first, second)]
    mulaw_silence = np.full(padded, 0xFF, np.uint8)
    expected = np.concatenate([ref[0], mulaw_silence, ref[1]])
    assert np.array_equal(np.frombuffer(b"".join(frames), dtype=np.uint8), expected)


@pytest.mark.parametrize("rate", [r for r in PCM_SAMPLE_RATES_HZ if r != ENGINE_SAMPLE_RATE_HZ])
def test_a_drain_adds_no_silence_without_fixed_frames(rate: int) -> None:
    """The resampler is flushed, not fed silence: at every rate a drain releases exactly what the input determines
    (it used to overshoot by up to one of soxr's output lumps: 40 ms of zeros at 8 kHz)."""
    enc = AudioEncoder(OutputFormat("pcm_s16le", rate))
    pcm = sine(300, 1.0)
    out = b"".join(enc.push(pcm) + enc.drain())
    expected = float_to_pcm16(soxr.resample(pcm, 24000, rate, quality=RESAMPLER_QUALITY))
    assert np.array_equal(np.frombuffer(out, dtype="<i2"), expected)
    assert enc.samples_out == enc.samples_resampled == expected.size


@pytest.mark.parametrize("rate", PCM_SAMPLE_RATES_HZ)
def test_drain_when_nothing_is_held(rate: int) -> None:
    enc = AudioEncoder(OutputFormat("pcm_s16le", rate, 20))
    assert enc.drain() == []
    n_bytes = sum(len(f) for f in enc.push(np.zeros(480, np.float32)) + enc.drain())
    assert enc.drain() == []
    n_bytes += sum(len(f) for f in enc.finish())
    assert n_bytes == enc.samples_out * 2
    padded_frame = rate // 50
    assert abs(enc.samples_out - enc.samples_fed * rate / ENGINE_SAMPLE_RATE_HZ) <= 0.5 + padded_frame


def test_push_after_finish_raises() -> None:
    enc = AudioEncoder(OutputFormat("pcm_s16le", 16000))
    enc.finish()
    with pytest.raises(RuntimeError):
        enc.push(np.zeros(10, np.float32))


def test_stereo_input_is_refused() -> None:
    with pytest.raises(ValueError):
        AudioEncoder(OutputFormat("pcm_s16le", 24000)).push(np.zeros((2, 10), np.float32))


def test_float_to_pcm16_clips_rounds_and_survives_nan() -> None:
    x = np.array([0.0, 1.0, -1.0, 1.5, -1.5, 0.5 / 32767, 1.5 / 32767, np.nan, np.inf, -np.inf], np.float32)
    assert float_to_pcm16(x).tolist() == [0, 32767, -32767, 32767, -32767, 0, 2, 0, 32767, -32767]


# ---- G.711 -------------------------------------------------------------------------------------------


def ref_linear2ulaw(pcm_val: int) -> int:
    """Line-by-line port of linear2ulaw() from the reference g711.c (Sun Microsystems, public domain)."""
    seg_uend = [0x3F, 0x7F, 0xFF, 0x1FF, 0x3FF, 0x7FF, 0xFFF, 0x1FFF]
    pcm_val = pcm_val >> 2
    if pcm_val < 0:
        pcm_val = -pcm_val
        mask = 0x7F
    else:
        mask = 0xFF
    if pcm_val > 8159:
        pcm_val = 8159
    pcm_val += 0x84 >> 2
    seg = next((i for i, end in enumerate(seg_uend) if pcm_val <= end), 8)
    if seg >= 8:
        return 0x7F ^ mask
    return ((seg << 4) | ((pcm_val >> (seg + 1)) & 0xF)) ^ mask


def ref_linear2alaw(pcm_val: int) -> int:
    """Line-by-line port of linear2alaw() from the reference g711.c."""
    seg_aend = [0x1F, 0x3F, 0x7F, 0xFF, 0x1FF, 0x3FF, 0x7FF, 0xFFF]
    pcm_val = pcm_val >> 3
    if pcm_val >= 0:
        mask = 0xD5
    else:
        mask = 0x55
        pcm_val = -pcm_val - 1
    seg = next((i for i, end in enumerate(seg_aend) if pcm_val <= end), 8)
    if seg >= 8:
        return 0x7F ^ mask
    aval = seg << 4
    aval |= ((pcm_val >> 1) if seg < 2 else (pcm_val >> seg)) & 0xF
    return aval ^ mask


ALL_INT16 = np.arange(-32768, 32768, dtype=np.int32)


def test_mulaw_matches_the_reference_for_every_sample() -> None:
    expected = np.array([ref_linear2ulaw(int(v)) for v in ALL_INT16], dtype=np.uint8)
    assert np.array_equal(pcm16_to_mulaw(ALL_INT16.astype(np.int16)), expected)


def test_alaw_matches_the_reference_for_every_sample() -> None:
    expected = np.array([ref_linear2alaw(int(v)) for v in ALL_INT16], dtype=np.uint8)
    assert np.array_equal(pcm16_to_alaw(ALL_INT16.astype(np.int16)), expected)


@pytest.mark.parametrize(
    ("sample", "mulaw", "alaw"),
    [
        (0, 0xFF, 0xD5),
        (-1, 0x7E, 0x55),
        (32767, 0x80, 0xAA),
        (-32768, 0x00, 0x2A),
        (8, 0xFE, 0xD5),
        (-8, 0x7E, 0x55),
    ],
)
def test_canonical_codes(sample: int, mulaw: int, alaw: int) -> None:
    x = np.array([sample], dtype=np.int16)
    assert (int(pcm16_to_mulaw(x)[0]), int(pcm16_to_alaw(x)[0])) == (mulaw, alaw)


def test_canonical_decoded_values() -> None:
    mulaw = np.array([0xFF, 0x7F, 0x80, 0x00, 0x7E], np.uint8)
    assert mulaw_to_pcm16(mulaw).tolist() == [0, 0, 32124, -32124, -8]
    assert alaw_to_pcm16(np.array([0xD5, 0x55, 0xAA, 0x2A], np.uint8)).tolist() == [8, -8, 32256, -32256]


def test_digital_milliwatt() -> None:
    """G.711's digital milliwatt: a 1 kHz sine at 8 kHz, phase pi/8, at about 0 dBm0, repeats 8 codes."""
    k = np.arange(16)
    x = np.rint(-23_000 * np.sin(np.pi / 8 + k * np.pi / 4)).astype(np.int16)
    assert pcm16_to_mulaw(x).tobytes() == bytes.fromhex("1E0B0B1E9E8B8B9E") * 2
    assert pcm16_to_alaw(x).tobytes() == bytes.fromhex("34212134B4A1A1B4") * 2


def test_codes_round_trip() -> None:
    codes = np.arange(256, dtype=np.uint8)
    assert np.array_equal(pcm16_to_alaw(alaw_to_pcm16(codes)), codes)
    back = pcm16_to_mulaw(mulaw_to_pcm16(codes))
    assert np.array_equal(back[codes != 0x7F], codes[codes != 0x7F])  # 0x7F is "-0": it encodes back as +0
    assert back[0x7F] == 0xFF


def test_decode_error_is_within_half_a_step() -> None:
    """decode(encode(x)) is the middle of x's quantisation interval: off by at most half a step
    (mu-law: plus the 3 LSB its 16 -> 14-bit truncation loses; inside its clip level 32635)."""
    x = ALL_INT16
    mu = pcm16_to_mulaw(x.astype(np.int16))
    mu_step = 8 << ((~mu.astype(np.int32) & 0x70) >> 4)
    mu_err = np.abs(mulaw_to_pcm16(mu).astype(np.int32) - x)
    inside = np.abs(x) <= 32635
    assert (mu_err[inside] <= mu_step[inside] // 2 + 3).all()
    a = pcm16_to_alaw(x.astype(np.int16))
    a_seg = ((a.astype(np.int32) ^ 0x55) & 0x70) >> 4
    a_step = np.where(a_seg <= 1, 16, 8 << a_seg)
    assert (np.abs(alaw_to_pcm16(a).astype(np.int32) - x) <= a_step // 2).all()


# ---- WAV ---------------------------------------------------------------------------------------------


def test_wav_header_with_length_reads_back() -> None:
    pcm = float_to_pcm16(sine(440, 0.1))
    data = wav_header(24000, n_samples=len(pcm)) + pcm.tobytes()
    with wave.open(io.BytesIO(data)) as w:
        params = (w.getnchannels(), w.getsampwidth(), w.getframerate(), w.getnframes())
        assert params == (1, 2, 24000, len(pcm))
        assert w.readframes(len(pcm)) == pcm.tobytes()


def test_streaming_wav_header_says_unknown_length() -> None:
    header = OutputFormat("pcm_s16le", 16000).wav_header()
    assert len(header) == 44
    riff, riff_size, wave_id = struct.unpack_from("<4sI4s", header)
    assert (riff, riff_size, wave_id) == (b"RIFF", WAV_UNKNOWN_SIZE, b"WAVE")
    assert header[36:40] == b"data" and struct.unpack_from("<I", header, 40)[0] == WAV_UNKNOWN_SIZE


def test_mulaw_wav_header() -> None:
    header = OutputFormat("mulaw", 8000).wav_header(n_samples=800)
    assert struct.unpack_from("<4sIHHIIHHH", header, 12) == (b"fmt ", 18, 7, 1, 8000, 8000, 1, 8, 0)
    assert struct.unpack_from("<4sII", header, 38) == (b"fact", 4, 800)
    assert struct.unpack_from("<4sI", header, 50) == (b"data", 800)
    assert struct.unpack_from("<I", header, 4)[0] == len(header) - 8 + 800


def test_drain_releases_everything_each_time_it_is_called() -> None:
    """Two segments separated by idle drains: after each drain all output of the real input is out."""
    enc = AudioEncoder(OutputFormat.parse("pcm_s16le", 16_000))
    out_samples = 0
    for _ in range(2):
        frames = enc.push(np.full(24_000, 0.25, dtype=np.float32))  # 1 s of input
        frames += enc.drain()
        out_samples += sum(len(f) for f in frames) // 2
        assert out_samples >= enc.samples_in * 16_000 // 24_000
