"""Streaming encoders (agent_server/audio/codecs.py), checked by decoding their output with PyAV.

Durations: Ogg/WebM Opus, FLAC and WAV decode to exactly the samples the encoder says it put in the
stream (`samples_out`: pushed audio + drain padding). MP3 and ADTS AAC carry no gapless metadata, so a
decoder also plays the encoder's priming and the last frame's padding: decoded - samples_out is in
[priming, priming + one codec frame) (LAME at 24 kHz: 1105..1681 samples, 46..70 ms; AAC: 1024..2048).
"""

from __future__ import annotations

import io
import wave

import av
import numpy as np
import numpy.typing as npt
import pytest

from agent_server.audio.codecs import (
    PRIMING_SAMPLES,
    CompressedEncoder,
    StreamFormat,
    bitrate_range_bps,
    clamp_bitrate_bps,
    make_encoder,
)
from agent_server.audio.formats import ENGINE_SAMPLE_RATE_HZ, AudioEncoder, OutputFormat

FIRST_CHUNK = 9_600  # the engine's smallest first chunk: 10 speech tokens (400 ms at 24 kHz)
LATER_CHUNKS = [4_001, 960, 13, 19_200, 333]
OPUS_DECODE_RATE_HZ = 48_000  # an Opus decoder always outputs 48 kHz

STREAMED = [
    StreamFormat("mp3", "mp3", 24_000),
    StreamFormat("mp3", "mp3", 44_100, 128_000),
    StreamFormat("mp3", "mp3", 22_050, 32_000),
    StreamFormat("ogg", "opus", 24_000),
    StreamFormat("ogg", "opus", 48_000, 64_000),
    StreamFormat("webm", "opus", 48_000),
    StreamFormat("adts", "aac", 24_000),
    StreamFormat("adts", "aac", 22_050),
    StreamFormat("flac", "flac", 24_000),
    StreamFormat("flac", "flac", 16_000),
    StreamFormat("wav", "pcm_s16le", 24_000),
    StreamFormat("wav", "pcm_s16le", 44_100),
    StreamFormat("wav", "mulaw", 8_000),
    StreamFormat("wav", "pcm_f32le", 16_000),
]


def speechy(seconds: float, seed: int = 0) -> npt.NDArray[np.float32]:
    """Band-limited noise with a syllable-rate envelope: codecs treat it like speech, not a pure tone."""
    rng = np.random.default_rng(seed)
    n = int(seconds * ENGINE_SAMPLE_RATE_HZ)
    noise = np.convolve(rng.standard_normal(n), np.ones(8) / 8, mode="same")
    envelope = 0.5 + 0.5 * np.sin(2 * np.pi * 4 * np.arange(n) / ENGINE_SAMPLE_RATE_HZ)
    out: npt.NDArray[np.float32] = (0.3 * noise * envelope).astype(np.float32)
    return out


def chunks_of(pcm: npt.NDArray[np.float32]) -> list[npt.NDArray[np.float32]]:
    out = [pcm[:FIRST_CHUNK]]
    i, k = FIRST_CHUNK, 0
    while i < len(pcm):
        n = LATER_CHUNKS[k % len(LATER_CHUNKS)]
        out.append(pcm[i : i + n])
        i, k = i + n, k + 1
    return out


def decode(data: bytes) -> tuple[int, int, int]:
    """(samples, sample rate, channels) of the first audio stream."""
    with av.open(io.BytesIO(data), "r") as container:
        stream = container.streams.audio[0]
        samples = sum(frame.samples for frame in container.decode(stream))
        return samples, stream.rate, stream.channels


def decoded_at_codec_rate(fmt: StreamFormat, data: bytes) -> int:
    samples, rate, channels = decode(data)
    assert channels == 1
    expected_rate = OPUS_DECODE_RATE_HZ if fmt.codec == "opus" else fmt.sample_rate_hz
    assert rate == expected_rate
    return samples * fmt.sample_rate_hz // rate


def assert_duration(fmt: StreamFormat, decoded: int, samples_out: int) -> None:
    priming = PRIMING_SAMPLES.get(fmt.codec)
    if priming is None:
        assert decoded == samples_out
        return
    frame = 1_152 if fmt.codec == "mp3" and fmt.sample_rate_hz >= 32_000 else (576 if fmt.codec == "mp3" else 1_024)
    assert priming <= decoded - samples_out < priming + frame


@pytest.mark.parametrize("fmt", STREAMED, ids=lambda f: f"{f.container}-{f.codec}-{f.sample_rate_hz}")
def test_streamed_pieces_concatenate_to_a_file_of_the_pushed_duration(fmt: StreamFormat) -> None:
    pcm = speechy(2.5)
    enc = make_encoder(fmt)
    pieces: list[bytes] = []
    for i, chunk in enumerate(chunks_of(pcm)):
        out = enc.push(chunk)
        if i == 0:
            assert b"".join(out), "the first push must yield bytes"
        pieces += out
    pieces += enc.finish()
    assert enc.finished and enc.samples_in == len(pcm)
    decoded = decoded_at_codec_rate(fmt, b"".join(pieces))
    assert_duration(fmt, decoded, enc.samples_out)
    pushed_at_rate = len(pcm) * fmt.sample_rate_hz / ENGINE_SAMPLE_RATE_HZ
    assert abs(enc.samples_resampled - pushed_at_rate) <= 1  # no drain: only real audio was resampled
    assert enc.samples_out == enc.samples_resampled  # and all of it is in the stream, unpadded


@pytest.mark.parametrize("fmt", [*STREAMED, StreamFormat("mp3", "mp3", 8_000, 32_000)],
                         ids=lambda f: f"{f.container}-{f.codec}-{f.sample_rate_hz}")
def test_samples_covered_is_what_a_client_can_decode_so_far(fmt: StreamFormat) -> None:
    """What the stream's drain deadline counts on: `samples_out - samples_covered` is what the codec (and a muxer
    that keeps its last page or cluster open) still holds back, exactly."""
    enc = make_encoder(fmt)
    data = b""
    for chunk in chunks_of(speechy(1.5)):
        data += b"".join(enc.push(chunk))
        assert enc.samples_covered <= enc.samples_out
        if enc.samples_covered:
            decodable = decoded_at_codec_rate(fmt, data) - PRIMING_SAMPLES.get(fmt.codec, 0)
            assert decodable == enc.samples_covered


@pytest.mark.parametrize("fmt", STREAMED, ids=lambda f: f"{f.container}-{f.codec}-{f.sample_rate_hz}")
def test_drain_releases_everything_pushed_and_the_stream_goes_on(fmt: StreamFormat) -> None:
    pcm = speechy(2.0, seed=1)
    first, second = pcm[:30_000], pcm[30_000:]
    enc = make_encoder(fmt)
    pieces = enc.push(first[:FIRST_CHUNK]) + enc.push(first[FIRST_CHUNK:])
    pieces += enc.drain()
    so_far = decoded_at_codec_rate(fmt, b"".join(pieces))
    priming = PRIMING_SAMPLES.get(fmt.codec, 0)
    assert so_far - priming >= len(first) * fmt.sample_rate_hz // ENGINE_SAMPLE_RATE_HZ  # nothing held back
    padding = enc.samples_out - enc.samples_resampled
    assert padding >= 0
    pieces += enc.push(second) + enc.finish()
    decoded = decoded_at_codec_rate(fmt, b"".join(pieces))
    assert_duration(fmt, decoded, enc.samples_out)


def test_wav_stream_header_says_unknown_length_and_readers_accept_it() -> None:
    fmt = StreamFormat("wav", "pcm_s16le", 16_000)
    enc = make_encoder(fmt)
    data = b"".join(enc.push(speechy(0.5)) + enc.finish())
    assert data[4:8] == b"\xff\xff\xff\xff" and data[40:44] == b"\xff\xff\xff\xff"
    with wave.open(io.BytesIO(data)) as reader:  # Python's reader reads what is there
        assert (reader.getframerate(), reader.getnchannels(), reader.getsampwidth()) == (16_000, 1, 2)
        frames = reader.readframes(reader.getnframes())
    assert len(frames) // 2 == enc.samples_out == decode(data)[0]


def test_wav_header_goes_out_even_when_nothing_else_does() -> None:
    enc = make_encoder(StreamFormat("wav", "pcm_s16le", 48_000))
    first = enc.push(np.zeros(1, dtype=np.float32))  # the resampler holds this sample back
    assert len(b"".join(first)) == 44
    assert decode(b"".join(first + enc.finish()))[1] == 48_000


def test_float32_pcm_is_pcm16_over_32768() -> None:
    pcm = speechy(0.3)
    f32 = b"".join(make_encoder(StreamFormat("raw", "pcm_f32le", 16_000)).push(pcm))
    s16 = b"".join(AudioEncoder(OutputFormat("pcm_s16le", 16_000)).push(pcm))
    np.testing.assert_array_equal(np.frombuffer(f32, "<f4"), np.frombuffer(s16, "<i2") / np.float32(32_768))


def test_raw_formats_are_the_audio_encoder_itself() -> None:
    enc = make_encoder(StreamFormat("raw", "mulaw", 8_000, frame_ms=20))
    assert isinstance(enc, AudioEncoder) and enc.fmt == OutputFormat("mulaw", 8_000, 20)


@pytest.mark.parametrize(("bitrate_bps", "kind", "codec", "rate"), [
    (32_000, "mp3", "mp3", 44_100), (192_000, "mp3", "mp3", 44_100), (24_000, "ogg", "opus", 48_000),
    (96_000, "ogg", "opus", 48_000), (48_000, "adts", "aac", 24_000),
])
def test_bitrate_is_what_was_asked(bitrate_bps: int, kind: str, codec: str, rate: int) -> None:
    fmt = StreamFormat(kind, codec, rate, bitrate_bps)  # type: ignore[arg-type]
    enc = make_encoder(fmt)
    seconds = 4.0
    data = b"".join(enc.push(speechy(seconds, seed=2)) + enc.finish())
    with av.open(io.BytesIO(data), "r") as container:  # the codec's bytes, without the container's framing
        payload_bytes = sum(p.size for p in container.demux(container.streams.audio[0]))
    measured_bps = payload_bytes * 8 / seconds
    assert 0.75 * bitrate_bps <= measured_bps <= 1.25 * bitrate_bps


def test_close_releases_and_refuses_more() -> None:
    enc = make_encoder(StreamFormat("mp3", "mp3", 24_000))
    enc.push(speechy(0.5))
    enc.close()
    enc.close()  # idempotent
    assert enc.finished
    with pytest.raises(RuntimeError):
        enc.push(speechy(0.1))


def test_small_first_chunk_yields_header_bytes_where_the_container_has_a_header() -> None:
    """A container with a header (Ogg, WebM, FLAC, WAV) answers any first push; MP3 and ADTS have no
    header, so their first bytes wait for the codec's look-ahead (the engine's first chunk covers it)."""
    tiny = speechy(0.04)  # one speech token
    answered = {
        f.container: bool(b"".join(make_encoder(f).push(tiny)))
        for f in [StreamFormat("ogg", "opus", 24_000), StreamFormat("webm", "opus", 48_000),
                  StreamFormat("flac", "flac", 24_000), StreamFormat("wav", "alaw", 8_000),
                  StreamFormat("mp3", "mp3", 24_000), StreamFormat("adts", "aac", 24_000)]
    }
    assert answered == {"ogg": True, "webm": True, "flac": True, "wav": True, "mp3": False, "adts": False}


@pytest.mark.parametrize(("args", "field"), [
    (("ogg", "mp3", 24_000), "codec"),
    (("ogg", "opus", 44_100), "sample_rate_hz"),
    (("mp3", "mp3", 11_025), "sample_rate_hz"),
    (("mp3", "mp3", 24_000, 192_000), "bitrate_bps"),
    (("mp3", "mp3", 8_000, 96_000), "bitrate_bps"),
    (("flac", "flac", 24_000, 64_000), "bitrate_bps"),
    (("raw", "pcm_s16le", 24_000, None, 20), None),
    (("mp3", "mp3", 24_000, None, 20), "frame_ms"),
    (("raw", "pcm_s16le", 22_050, None, 7), "frame_ms"),
    (("mpeg", "mp3", 24_000), "container"),
    (("raw", "mulaw", 16_000), "sample_rate_hz"),
])
def test_stream_format_validation(args: tuple[object, ...], field: str | None) -> None:
    if field is None:
        StreamFormat(*args)  # type: ignore[arg-type]
        return
    with pytest.raises(ValueError, match=f"^{field}:"):
        StreamFormat(*args)  # type: ignore[arg-type]


def test_bitrate_ranges_follow_the_mpeg_version_and_aac_frame_limit() -> None:
    assert bitrate_range_bps("mp3", 44_100) == (32_000, 320_000)
    assert bitrate_range_bps("mp3", 24_000) == (8_000, 160_000)
    assert bitrate_range_bps("mp3", 8_000) == (8_000, 64_000)
    assert bitrate_range_bps("aac", 24_000) == (8_000, 144_000)
    assert bitrate_range_bps("flac", 24_000) is None
    assert clamp_bitrate_bps("mp3", 8_000, 128_000) == 64_000
    assert clamp_bitrate_bps("opus", 48_000, 1_000) == 6_000
    assert clamp_bitrate_bps("flac", 48_000, 1_000) is None


def test_lead_is_the_priming_where_the_stream_does_not_signal_it() -> None:
    assert StreamFormat("mp3", "mp3", 24_000).lead_ms == pytest.approx(1_105 / 24)
    assert StreamFormat("adts", "aac", 22_050).lead_ms == pytest.approx(1_024 / 22.05)
    assert StreamFormat("ogg", "opus", 48_000).lead_ms == 0 == StreamFormat("flac", "flac", 24_000).lead_ms


def test_mime_types_and_extensions() -> None:
    assert StreamFormat("mp3", "mp3", 44_100).mime_type == "audio/mpeg"
    assert StreamFormat("ogg", "opus", 48_000).mime_type == "audio/ogg"
    assert StreamFormat("raw", "pcm_s16le", 16_000).mime_type == "audio/pcm;rate=16000"
    assert StreamFormat("adts", "aac", 24_000).mime_type == "audio/aac"


def test_compressed_encoder_refuses_pcm_formats() -> None:
    with pytest.raises(ValueError):
        CompressedEncoder(StreamFormat("wav", "pcm_s16le", 24_000))



@pytest.mark.parametrize("rate", [24_000, 16_000])
def test_lossless_stream_is_the_pcm16_stream_with_drain_padding_in_place(rate: int) -> None:
    """FLAC decodes bit-exactly: push, drain, push, finish equals the PCM16 encoder's output for the same
    calls, with the drain's codec-frame padding (silence) where the drain was."""
    pcm = speechy(1.5, seed=3)
    first, second = pcm[:17_000], pcm[17_000:]
    enc = make_encoder(StreamFormat("flac", "flac", rate))
    ref = AudioEncoder(OutputFormat("pcm_s16le", rate))
    data = enc.push(first) + enc.drain()
    padding = enc.samples_out - enc.samples_resampled
    data += enc.push(second) + enc.finish()
    before = b"".join(ref.push(first) + ref.drain())
    after = b"".join(ref.push(second) + ref.finish())
    expected = np.concatenate([np.frombuffer(before, "<i2"), np.zeros(padding, np.int16), np.frombuffer(after, "<i2")])
    with av.open(io.BytesIO(b"".join(data)), "r") as container:
        decoded = np.concatenate([f.to_ndarray().reshape(-1) for f in container.decode(audio=0)])
    assert padding > 0
    np.testing.assert_array_equal(decoded, expected)


@pytest.mark.parametrize("fmt", STREAMED, ids=lambda f: f"{f.container}-{f.codec}-{f.sample_rate_hz}")
def test_same_audio_same_bytes(fmt: StreamFormat) -> None:
    """No random stream serials or container UIDs: a seeded context's bytes repeat exactly."""
    pcm = speechy(1.0, seed=4)
    outputs = []
    for _ in range(2):
        enc = make_encoder(fmt)
        outputs.append(b"".join(enc.push(pcm[:FIRST_CHUNK]) + enc.push(pcm[FIRST_CHUNK:]) + enc.finish()))
    assert outputs[0] == outputs[1]


# ---- speed (TempoEncoder: FFmpeg's atempo) ----------------------------------------------------------------

# atempo's output differs from n / speed by its edges (what it holds back at the start and the end of a
# run): measured here up to 24 ms of a 1 s run at speed 0.5, 10 ms at 2.0, 77 ms at 0.25 (two chained filters).
TEMPO_EDGE_S = {0.25: 0.09, 0.5: 0.035, 0.8: 0.035, 1.25: 0.035, 2.0: 0.035, 4.0: 0.035}


def tone(seconds: float, hz: float) -> npt.NDArray[np.float32]:
    t = np.arange(int(seconds * ENGINE_SAMPLE_RATE_HZ)) / ENGINE_SAMPLE_RATE_HZ
    out: npt.NDArray[np.float32] = (0.3 * np.sin(2 * np.pi * hz * t)).astype(np.float32)
    return out


def peak_hz(pcm: npt.NDArray[np.int16], rate_hz: int) -> float:
    spectrum = np.abs(np.fft.rfft(pcm.astype(np.float64) * np.hanning(len(pcm))))
    return float(np.argmax(spectrum) * rate_hz / len(pcm))


@pytest.mark.parametrize("speed", sorted(TEMPO_EDGE_S))
def test_speed_shortens_the_audio_keeps_its_pitch_and_places_the_next_sample(speed: float) -> None:
    fmt = StreamFormat("raw", "pcm_s16le", 24_000)
    pcm = tone(3.0, 220.0)
    enc = make_encoder(fmt, speed)
    out = b"".join(piece for chunk in chunks_of(pcm[:48_000]) for piece in enc.push(chunk))
    assert enc.samples_in == 48_000
    # where the next pushed sample will play: what went out plus what the filter holds, at the new tempo
    assert abs(enc.samples_fed - 48_000 / speed) <= TEMPO_EDGE_S[speed] * 24_000
    out += b"".join(enc.drain())  # the filter flushed: all of it is out
    drained = len(out) // 2
    assert abs(drained - 48_000 / speed) <= TEMPO_EDGE_S[speed] * 24_000 + (enc.samples_out - enc.samples_resampled)
    out += b"".join(enc.push(pcm[48_000:])) + b"".join(enc.finish())  # a fresh filter after the drain
    played = np.frombuffer(out, dtype="<i2")
    padding = enc.samples_out - enc.samples_resampled
    assert abs(len(played) - padding - len(pcm) / speed) <= 2 * TEMPO_EDGE_S[speed] * 24_000
    assert abs(peak_hz(played[: len(played) // 2], 24_000) - 220.0) < 3.0  # the pitch is the voice's


def test_speed_output_does_not_depend_on_how_the_audio_was_cut() -> None:
    fmt = StreamFormat("mp3", "mp3", 24_000)
    pcm = speechy(2.0, seed=3)
    whole = make_encoder(fmt, 1.3)
    pieces = make_encoder(fmt, 1.3)
    a = b"".join(whole.push(pcm) + whole.finish())
    b = b"".join([piece for chunk in chunks_of(pcm) for piece in pieces.push(chunk)] + pieces.finish())
    assert a == b  # seeded audio stays reproducible at any speed
    samples, _, _ = decode(a)
    assert abs(samples - len(pcm) / 1.3) <= (TEMPO_EDGE_S[1.25] * 24_000 + 1_681)  # + MP3 priming and last frame


def test_speed_one_is_no_tempo_stage_and_out_of_range_is_refused() -> None:
    fmt = StreamFormat("raw", "pcm_s16le", 24_000)
    assert isinstance(make_encoder(fmt, 1.0), AudioEncoder)  # untouched: the same bytes as before speed existed
    for bad in (0.2, 4.5):
        with pytest.raises(ValueError):
            make_encoder(fmt, bad)


@pytest.mark.parametrize("speed", [0.5, 0.8, 1.25, 2.0])
def test_speed_gives_a_chunks_audio_back_with_the_chunk(speed: float) -> None:
    """atempo answers a frame when the next one comes: fed a whole chunk at once it would hold the first chunk
    of a turn back until the second (time to first audio). Fed in 20 ms frames, it holds back ~100 ms."""
    enc = make_encoder(StreamFormat("raw", "pcm_s16le", 24_000), speed)
    first = b"".join(enc.push(speechy(0.4)))  # the engine's smallest first chunk
    held_back_in_s = 0.4 - len(first) / 2 / 24_000 * speed
    assert held_back_in_s <= 0.13, held_back_in_s


def test_a_finished_or_closed_encoder_leaves_no_codec_threads() -> None:
    """Each compressed encoder's codec runs worker threads (its resampler's filter graph); they must go when the
    stream ends, not when the garbage collector happens to free the encoder (a soak piled up 60+ idle threads)."""
    import gc
    import os

    def threads() -> int:
        return len(os.listdir(f"/proc/{os.getpid()}/task"))

    gc.disable()  # what frees them must be the encoder's end itself
    try:
        before = threads()
        kept = []
        for i, fmt in enumerate([StreamFormat("mp3", "mp3", 44_100, 128_000), StreamFormat("ogg", "opus", 48_000),
                                 StreamFormat("adts", "aac", 24_000), StreamFormat("flac", "flac", 24_000)] * 3):
            encoder = CompressedEncoder(fmt)
            encoder.push(np.zeros(4_800, dtype=np.float32))
            encoder.finish() if i % 2 else encoder.close()
            kept.append(encoder)  # still referenced, as a finished context's state may be for a while
        assert threads() <= before
    finally:
        gc.enable()
