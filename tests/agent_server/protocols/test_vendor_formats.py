"""agent_server/protocols/vendor_formats.py: every vendor format name the SDKs offer maps onto a StreamFormat that an
encoder can produce; defaults are the vendors'; refusals name the field."""

from __future__ import annotations

import typing

import pytest

from agent_server.audio.codecs import StreamFormat, make_encoder
from agent_server.errors import FieldError
from agent_server.protocols.vendor_formats import (
    CARTESIA_MP3_BITRATES_BPS,
    CARTESIA_SAMPLE_RATES_HZ,
    cartesia_format,
    deepgram_format,
    elevenlabs_format,
    elevenlabs_formats,
    openai_format,
)


def literal_values(alias: object) -> list[str]:
    """The names inside an SDK's type: a Literal, or one nested in Union/Required/Annotated."""
    if typing.get_origin(alias) is typing.Literal:
        return [str(v) for v in typing.get_args(alias)]
    for arg in typing.get_args(alias):
        try:
            return literal_values(arg)
        except AssertionError:
            continue
    raise AssertionError(f"no Literal in {alias!r}")


def test_every_elevenlabs_sdk_format_is_served() -> None:
    from elevenlabs.text_to_speech.types.text_to_speech_convert_request_output_format import (
        TextToSpeechConvertRequestOutputFormat,
    )
    from elevenlabs.text_to_speech.types.text_to_speech_stream_with_timestamps_request_output_format import (
        TextToSpeechStreamWithTimestampsRequestOutputFormat,
    )

    names = set(literal_values(TextToSpeechConvertRequestOutputFormat))
    names |= set(literal_values(TextToSpeechStreamWithTimestampsRequestOutputFormat))
    assert names == set(elevenlabs_formats())
    for name in names:
        make_encoder(elevenlabs_format(name)).close()  # an encoder exists for each


@pytest.mark.parametrize(("name", "expected"), [
    (None, StreamFormat("mp3", "mp3", 44_100, 128_000)),  # the SDK's default
    ("mp3_22050_32", StreamFormat("mp3", "mp3", 22_050, 32_000)),
    ("opus_48000_64", StreamFormat("ogg", "opus", 48_000, 64_000)),
    ("pcm_16000", StreamFormat("raw", "pcm_s16le", 16_000)),
    ("pcm_32000", StreamFormat("raw", "pcm_s16le", 32_000)),
    ("wav_8000", StreamFormat("wav", "pcm_s16le", 8_000)),
    ("ulaw_8000", StreamFormat("raw", "mulaw", 8_000)),
    ("alaw_8000", StreamFormat("raw", "alaw", 8_000)),
])
def test_elevenlabs_names(name: str | None, expected: StreamFormat) -> None:
    assert elevenlabs_format(name) == expected


@pytest.mark.parametrize("name", ["mp3_44100_100", "mp3_8000_32", "opus_24000_64", "opus_48000", "pcm_12000",
                                  "ulaw_16000", "pcm_16000_1", "flac_44100", "mp3", ""])
def test_elevenlabs_refusals(name: str) -> None:
    if name == "":
        with pytest.raises(FieldError) as exc:
            elevenlabs_format(name, default=None)
    else:
        with pytest.raises(FieldError) as exc:
            elevenlabs_format(name)
    assert exc.value.field == "output_format"


def test_openai_formats_and_default() -> None:
    assert openai_format(None) == StreamFormat("mp3", "mp3", 24_000, 64_000)
    assert openai_format("opus") == StreamFormat("ogg", "opus", 24_000)
    assert openai_format("aac") == StreamFormat("adts", "aac", 24_000)
    assert openai_format("flac") == StreamFormat("flac", "flac", 24_000)
    assert openai_format("wav") == StreamFormat("wav", "pcm_s16le", 24_000)
    assert openai_format("pcm") == StreamFormat("raw", "pcm_s16le", 24_000)
    for bad in ("ogg", 3, ["mp3"]):
        with pytest.raises(FieldError) as exc:
            openai_format(bad)
        assert exc.value.field == "response_format"


def test_openai_sdk_formats_are_all_served() -> None:
    from openai.types.audio.speech_create_params import SpeechCreateParams

    hints = typing.get_type_hints(SpeechCreateParams, include_extras=True)
    names = literal_values(hints["response_format"])
    assert "mp3" in names
    for name in names:
        openai_format(name)


def test_every_cartesia_sdk_combination_is_served() -> None:
    from cartesia.types.raw_encoding import RawEncoding

    for container in ("raw", "wav"):
        for encoding in typing.get_args(RawEncoding):
            for rate in CARTESIA_SAMPLE_RATES_HZ:
                spec = {"container": container, "encoding": encoding, "sample_rate": rate}
                if encoding in ("pcm_mulaw", "pcm_alaw") and rate != 8_000:
                    with pytest.raises(FieldError) as exc:
                        cartesia_format(spec, required=True)
                    assert exc.value.field == "output_format.sample_rate"
                    continue
                fmt = cartesia_format(spec, required=True)
                assert (fmt.container, fmt.sample_rate_hz) == (container, rate)
    for rate in CARTESIA_SAMPLE_RATES_HZ:
        for bit_rate in CARTESIA_MP3_BITRATES_BPS:
            fmt = cartesia_format({"container": "mp3", "sample_rate": rate, "bit_rate": bit_rate}, required=True)
            assert fmt.codec == "mp3" and fmt.bitrate_bps is not None and fmt.bitrate_bps <= bit_rate
    clamped = cartesia_format({"container": "mp3", "sample_rate": 8_000, "bit_rate": 192_000}, required=True)
    assert clamped.bitrate_bps == 64_000


@pytest.mark.parametrize(("spec", "field"), [
    (None, "output_format"),
    ("raw", "output_format"),
    ({"container": "ogg", "encoding": "pcm_s16le", "sample_rate": 24_000}, "output_format.container"),
    ({"container": "mp3", "sample_rate": 24_000}, "output_format.bit_rate"),
    ({"container": "raw", "encoding": "pcm_s16le", "sample_rate": 24_000, "bit_rate": 64_000},
     "output_format.bit_rate"),
    ({"container": "raw", "encoding": "mp3", "sample_rate": 24_000}, "output_format.encoding"),
    ({"container": "raw", "encoding": "pcm_s16le", "sample_rate": 11_025}, "output_format.sample_rate"),
    ({"container": "raw", "encoding": "pcm_s16le", "sample_rate": True}, "output_format.sample_rate"),
    ({"container": "raw", "encoding": "pcm_s16le", "sample_rate": 24_000, "speed": 1}, "output_format.speed"),
])
def test_cartesia_refusals(spec: object, field: str) -> None:
    with pytest.raises(FieldError) as exc:
        cartesia_format(spec, required=True)
    assert exc.value.field == field


def test_cartesia_websocket_default() -> None:
    assert cartesia_format(None, required=False) == StreamFormat("raw", "pcm_s16le", 24_000)


@pytest.mark.parametrize(("params", "expected"), [
    ({}, StreamFormat("wav", "pcm_s16le", 24_000)),  # the REST default
    ({"encoding": "linear16", "container": "none", "sample_rate": "16000"}, StreamFormat("raw", "pcm_s16le", 16_000)),
    ({"encoding": "mulaw"}, StreamFormat("wav", "mulaw", 8_000)),
    ({"encoding": "alaw", "container": "none"}, StreamFormat("raw", "alaw", 8_000)),
    ({"encoding": "mp3"}, StreamFormat("mp3", "mp3", 22_050, 48_000)),
    ({"encoding": "mp3", "bit_rate": "32000"}, StreamFormat("mp3", "mp3", 22_050, 32_000)),
    ({"encoding": "opus"}, StreamFormat("ogg", "opus", 48_000, 12_000)),
    ({"encoding": "opus", "bit_rate": "4000"}, StreamFormat("ogg", "opus", 48_000, 6_000)),
    ({"encoding": "flac", "sample_rate": "16000"}, StreamFormat("flac", "flac", 16_000)),
    ({"encoding": "aac", "bit_rate": "192000.0"}, StreamFormat("adts", "aac", 22_050, 132_300)),
])
def test_deepgram_rest(params: dict[str, str], expected: StreamFormat) -> None:
    assert deepgram_format(params, rest=True) == expected


def test_deepgram_sdk_encodings_are_all_served_over_rest() -> None:
    from deepgram.speak.v1.audio.types.audio_generate_request_encoding import (
        AudioGenerateRequestEncoding,
    )

    for encoding in literal_values(AudioGenerateRequestEncoding):
        make_encoder(deepgram_format({"encoding": encoding}, rest=True)).close()


@pytest.mark.parametrize(("params", "field"), [
    ({"encoding": "speex"}, "encoding"),
    ({"encoding": "mp3", "container": "wav"}, "container"),
    ({"encoding": "opus", "container": "none"}, "container"),
    ({"encoding": "mp3", "sample_rate": "44100"}, "sample_rate"),
    ({"encoding": "mulaw", "sample_rate": "16000"}, "sample_rate"),
    ({"encoding": "linear16", "sample_rate": "abc"}, "sample_rate"),
    ({"encoding": "mp3", "bit_rate": "64000"}, "bit_rate"),
    ({"encoding": "linear16", "bit_rate": "64000"}, "bit_rate"),
])
def test_deepgram_refusals(params: dict[str, str], field: str) -> None:
    with pytest.raises(FieldError) as exc:
        deepgram_format(params, rest=True)
    assert exc.value.field == field


def test_deepgram_websocket_takes_raw_pcm_and_g711_only() -> None:
    assert deepgram_format({}, rest=False) == StreamFormat("raw", "pcm_s16le", 24_000)
    assert deepgram_format({"encoding": "mulaw"}, rest=False) == StreamFormat("raw", "mulaw", 8_000)
    for params, field in (({"encoding": "mp3"}, "encoding"), ({"container": "wav"}, "container")):
        with pytest.raises(FieldError) as exc:
            deepgram_format(params, rest=False)
        assert exc.value.field == field
