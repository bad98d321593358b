"""NVIDIA Riva TTS (`nvidia.riva.tts.RivaSpeechSynthesis`): request -> what to synthesize, audio -> response.
Pure: protobuf messages in and out, no gRPC server here (`compat/riva_service.py` is the skeleton).

Protos: the generated modules of the `nvidia-riva-client` package (`riva.client.proto.riva_tts_pb2`,
`riva_audio_pb2`), pinned and installed without its dependencies (scripts/install.sh). Why those and not
protos compiled at install time with grpcio-tools: they are what the real clients (nvidia-riva-client,
Pipecat's `NvidiaTTSService`) are generated from, so field numbers and method shapes match by
construction (2.28 made `SynthesizeOnline` a bidirectional stream: one request per piece of text);
the wheel ships no `.proto` sources, so compiling would mean keeping NVIDIA's proto files in this repo and
pinning grpcio-tools to the protobuf runtime; the gencode only needs `protobuf` and `grpcio`, both ours
already. `--no-deps` because the client pins `websockets<16`, which this server's stack is past.

Mapping:
- `encoding`: LINEAR_PCM (and ENCODING_UNSPECIFIED) -> raw PCM16 at `sample_rate_hz`; MULAW / ALAW ->
  raw G.711 at 8 kHz; FLAC -> a FLAC stream; OGGOPUS -> Ogg Opus. `sample_rate_hz` 0: 24 kHz (the model's).
- `voice_name` -> our voice id (the caller resolves it); `language_code` -> the variant's language check.
- `zero_shot_data` (a voice prompt in the request) is refused: make a voice with `POST /v1/voices` and name
  it in `voice_name`. `custom_dictionary`, `custom_configuration`: accepted, ignored.
- `enable_word_time_offsets`: each response's `meta.words` (ms from the start of the request's audio).
- errors: gRPC status INVALID_ARGUMENT with the message naming the field.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import riva.client.proto.riva_audio_pb2 as riva_audio
import riva.client.proto.riva_common_pb2 as riva_common
import riva.client.proto.riva_tts_pb2 as riva_tts

from agent_server.audio import ENGINE_SAMPLE_RATE_HZ
from agent_server.codecs import StreamFormat
from agent_server.compat.common import CompatError, resolve_language
from agent_server.timestamps import WordTime

AudioEncoding = riva_audio.AudioEncoding
G711_RATE_HZ = 8_000
MODEL_NAME_PREFIX = "chatterbox-"
DEFAULT_LANGUAGE_CODE = "en-US"


@dataclass(frozen=True, slots=True)
class Synthesis:
    """What one Synthesize / SynthesizeOnline call asks for (the first request's settings)."""

    voice_name: str | None  # as given: the caller maps it onto our voices (common.resolve_voice)
    language: str | None  # resolved for the variant
    output: StreamFormat
    word_offsets: bool
    request_id: str  # RequestId.value, echoed in every response


def parse_request(request: riva_tts.SynthesizeSpeechRequest, variant: str) -> Synthesis:
    """Raises CompatError (the service answers INVALID_ARGUMENT)."""
    if request.HasField("zero_shot_data"):
        raise CompatError("zero_shot_data", "zero-shot voice prompts are not served: create a voice with "
                                            "POST /v1/voices and put its id in voice_name")
    return Synthesis(
        voice_name=request.voice_name or None,
        language=resolve_language("language_code", request.language_code or None, variant),
        output=output_format(request.encoding, request.sample_rate_hz),
        word_offsets=request.enable_word_time_offsets,
        request_id=request.id.value if request.HasField("id") else "",
    )


def output_format(encoding: int, sample_rate_hz: int) -> StreamFormat:
    rate = sample_rate_hz or ENGINE_SAMPLE_RATE_HZ
    try:
        if encoding in (AudioEncoding.LINEAR_PCM, AudioEncoding.ENCODING_UNSPECIFIED):
            return StreamFormat("raw", "pcm_s16le", rate)
        if encoding in (AudioEncoding.MULAW, AudioEncoding.ALAW):
            return StreamFormat("raw", "mulaw" if encoding == AudioEncoding.MULAW else "alaw", sample_rate_hz or G711_RATE_HZ)
        if encoding == AudioEncoding.FLAC:
            return StreamFormat("flac", "flac", rate)
        if encoding == AudioEncoding.OGGOPUS:
            return StreamFormat("ogg", "opus", rate)
    except ValueError as exc:
        raise CompatError("sample_rate_hz", str(exc).split(": ", 1)[-1]) from None
    raise CompatError("encoding", f"encoding {encoding} is not one of LINEAR_PCM, MULAW, ALAW, FLAC, OGGOPUS")


def same_settings(first: riva_tts.SynthesizeSpeechRequest, later: riva_tts.SynthesizeSpeechRequest) -> None:
    """A SynthesizeOnline stream's later requests carry more text; their settings must be the first's."""
    for name in ("encoding", "sample_rate_hz", "voice_name", "language_code"):
        if getattr(later, name) != getattr(first, name):
            raise CompatError(name, f"{name} cannot change within one SynthesizeOnline call")


def response(audio: bytes, words: Sequence[WordTime], synthesis: Synthesis, text: str = "") -> riva_tts.SynthesizeSpeechResponse:
    """One response: audio (raw PCM/G.711 bytes, or the next bytes of the FLAC/Ogg stream), with the
    words it completes when word offsets were asked for."""
    meta = riva_tts.SynthesizeSpeechResponseMetadata(text=text, processed_text=text)
    if synthesis.word_offsets:
        meta.words.extend(riva_tts.WordTiming(word=w.word, start_time=w.start_ms, end_time=w.end_ms) for w in words)
    return riva_tts.SynthesizeSpeechResponse(audio=audio, meta=meta, id=riva_common.RequestId(value=synthesis.request_id))


def synthesis_config(variant: str, voice_ids: Sequence[str], language_code: str = DEFAULT_LANGUAGE_CODE) -> riva_tts.RivaSynthesisConfigResponse:
    """GetRivaSynthesisConfig: one model (the variant) listing our voices, in the keys Riva's clients read."""
    config = riva_tts.RivaSynthesisConfigResponse.Config(
        model_name=MODEL_NAME_PREFIX + variant,
        parameters={
            "language_code": language_code,
            "voice_name": voice_ids[0] if voice_ids else "",
            "subvoices": ",".join(f"{voice}:{i}" for i, voice in enumerate(voice_ids)),
            "sample_rate": str(ENGINE_SAMPLE_RATE_HZ),
        },
    )
    return riva_tts.RivaSynthesisConfigResponse(model_config=[config])
