"""NVIDIA Riva TTS (`nvidia.riva.tts.RivaSpeechSynthesis`) on the session core: the request mapping and the
`RivaProtocol` of a call (protocols/riva_service.py registers the methods on agent_server/core/grpc_server.py).

One call is one session with one context: `Synthesize` (one request, one response with all the audio and
the word offsets) and `SynthesizeOnline` (a stream of requests: the first one's settings hold and each one's
text is pushed in turn; the end of the requests ends the input; a response per piece of audio as it is
encoded, and one with the word offsets of each segment once its audio is out). The call's status is that of
the session's close (agent_server/grpc_server.GRPC_STATUS): a bad request INVALID_ARGUMENT, busy or a key's
limit RESOURCE_EXHAUSTED, not ready UNAVAILABLE, a failure INTERNAL. The client cancelling the call (or
going away) cancels the context.

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
- `enable_word_time_offsets`: `meta.words` (ms from the start of the call's audio, as the client decodes it).
- errors: gRPC status INVALID_ARGUMENT with the message naming the field.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import ClassVar

import riva.client.proto.riva_audio_pb2 as riva_audio
import riva.client.proto.riva_common_pb2 as riva_common
import riva.client.proto.riva_tts_pb2 as riva_tts
from google.protobuf.message import DecodeError

from agent_server.audio.codecs import Codec, StreamFormat
from agent_server.audio.formats import ENGINE_SAMPLE_RATE_HZ
from agent_server.core.events import AudioOut, SegmentDone, StreamDone, StreamEvent, StreamStateError, StreamStatus
from agent_server.core.outcomes import Outcome
from agent_server.core.routing import SERVED_MODEL_HEADER, Routed, Router
from agent_server.core.session import Context, Session, WireProtocol
from agent_server.core.transport import Head
from agent_server.errors import FieldError, empty_message
from agent_server.protocols.common import make_spec, place_segment, resolve_voice, route
from agent_server.text.markup import SSML_TAGS, ssml_text
from agent_server.text.timestamps import ContextAlignment, WordTime
from synth.api import Variant, languages_of

AudioEncoding = riva_audio.AudioEncoding
G711_RATE_HZ = 8_000
MODEL_NAME_PREFIX = "chatterbox-"
DEFAULT_LANGUAGE_CODE = "en-US"
# a Head on a gRPC call is its initial metadata (core/grpc_server.GrpcTransport.send): its headers go, these do not
GRPC_HEAD_STATUS = 200
GRPC_MEDIA_TYPE = "application/grpc"


@dataclass(frozen=True, slots=True)
class Synthesis:
    """What one Synthesize / SynthesizeOnline call asks for (the first request's settings)."""

    voice_name: str | None  # as given: the caller maps it onto our voices (common.resolve_voice)
    routed: Routed  # the model that serves language_code here (Riva names no model)
    output: StreamFormat
    word_offsets: bool
    request_id: str  # RequestId.value, echoed in every response


def parse_request(request: riva_tts.SynthesizeSpeechRequest, router: Router) -> Synthesis:
    """Raises FieldError (the service answers INVALID_ARGUMENT)."""
    if request.HasField("zero_shot_data"):
        raise FieldError("zero_shot_data", "zero-shot voice prompts are not served: create a voice with "
                                            "POST /v1/voices and put its id in voice_name")
    return Synthesis(
        voice_name=request.voice_name or None,
        routed=route(router, language_field="language_code", language=request.language_code or None),
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
            g711: Codec = "mulaw" if encoding == AudioEncoding.MULAW else "alaw"
            return StreamFormat("raw", g711, sample_rate_hz or G711_RATE_HZ)
        if encoding == AudioEncoding.FLAC:
            return StreamFormat("flac", "flac", rate)
        if encoding == AudioEncoding.OGGOPUS:
            return StreamFormat("ogg", "opus", rate)
    except ValueError as exc:
        raise FieldError("sample_rate_hz", str(exc).split(": ", 1)[-1]) from None
    raise FieldError("encoding", f"encoding {encoding} is not one of LINEAR_PCM, MULAW, ALAW, FLAC, OGGOPUS")


def same_settings(first: riva_tts.SynthesizeSpeechRequest, later: riva_tts.SynthesizeSpeechRequest) -> None:
    """A SynthesizeOnline stream's later requests carry more text; their settings must be the first's."""
    for name in ("encoding", "sample_rate_hz", "voice_name", "language_code"):
        if getattr(later, name) != getattr(first, name):
            raise FieldError(name, f"{name} cannot change within one SynthesizeOnline call")


def response(
    audio: bytes, words: Sequence[WordTime], synthesis: Synthesis, text: str = ""
) -> riva_tts.SynthesizeSpeechResponse:
    """One response: audio (raw PCM/G.711 bytes, or the next bytes of the FLAC/Ogg stream), with the
    words it completes when word offsets were asked for."""
    meta = riva_tts.SynthesizeSpeechResponseMetadata(text=text, processed_text=text)
    if synthesis.word_offsets:
        meta.words.extend(riva_tts.WordTiming(word=w.word, start_time=w.start_ms, end_time=w.end_ms) for w in words)
    request_id = riva_common.RequestId(value=synthesis.request_id)
    return riva_tts.SynthesizeSpeechResponse(audio=audio, meta=meta, id=request_id)


def synthesis_config(models: Sequence[Variant], voice_ids: Sequence[str]) -> riva_tts.RivaSynthesisConfigResponse:
    """GetRivaSynthesisConfig: each loaded model, once per language it speaks (Riva keys a model by its language:
    English as en-US, the others by their code, which `language_code` selects), listing our voices, in the keys
    Riva's clients read."""
    configs = [riva_tts.RivaSynthesisConfigResponse.Config(
        model_name=MODEL_NAME_PREFIX + model,
        parameters={
            "language_code": DEFAULT_LANGUAGE_CODE if code == "en" else code,
            "voice_name": voice_ids[0] if voice_ids else "",
            "subvoices": ",".join(f"{voice}:{i}" for i, voice in enumerate(voice_ids)),
            "sample_rate": str(ENGINE_SAMPLE_RATE_HZ),
        },
    ) for model in models for code in languages_of(model)]
    return riva_tts.RivaSynthesisConfigResponse(model_config=configs)


# ---- the protocol --------------------------------------------------------------------------------

CONTEXT_ID = "synthesis"


@dataclass(slots=True)
class RivaState:
    first: riva_tts.SynthesizeSpeechRequest  # its settings hold for the call
    synthesis: Synthesis
    alignment: ContextAlignment
    audio: list[bytes] = field(default_factory=list)  # Synthesize: the response's audio, until the end
    audio_ms: float = 0.0
    words: list[WordTime] = field(default_factory=list)
    joined: bool = True  # the text so far ends where the next request's may start (empty, or a space)
    refused: FieldError | None = None  # a later request changed the settings: reported after the audio before it


RivaContext = Context[RivaState]


class RivaProtocol(WireProtocol[RivaState]):
    """`SynthesizeOnline`; `RivaUnaryProtocol` is `Synthesize`."""

    name: ClassVar[str] = "riva"
    unary: ClassVar[bool] = False

    def __init__(self, session: Session[RivaState]) -> None:
        super().__init__(session)
        self._opened = False  # a call has one context: once it ended, later requests are too late

    async def on_message(self, message: str | bytes, now_s: float) -> None:
        session = self.session
        try:
            request = riva_tts.SynthesizeSpeechRequest.FromString(message)
        except (DecodeError, TypeError):
            session.reject(FieldError("request", "not a SynthesizeSpeechRequest"))
            return
        ctx = session.contexts.get(CONTEXT_ID)
        try:
            if ctx is None:
                if self._opened:
                    return  # the context ended (busy, failed): the call is closing
                ctx = await self._open(request)
                if ctx is None:
                    return
            elif ctx.state.refused is not None:
                return  # the input ended at a request that changed the settings
            else:
                try:
                    same_settings(ctx.state.first, request)
                except FieldError as error:  # what came before is spoken, then the call ends with the error
                    ctx.state.refused = error
                    if ctx.stream.status == StreamStatus.OPEN:
                        ctx.stream.end(now_s)
                    return
            text = request.text
            if text.lstrip().startswith("<speak"):  # SSML: its breaks are pauses (markup.py), its text is spoken
                text = ssml_text(text)
            if text and not ctx.state.joined and not text[0].isspace():
                text = " " + text  # each request is its own text: keep the word boundary between them
            if await session.push_text(ctx, text, now_s) and text:
                ctx.state.joined = text[-1].isspace()
        except FieldError as error:
            session.reject(error)
        except StreamStateError as exc:
            session.reject(FieldError("text", str(exc), "bad_state"))

    async def _open(self, request: riva_tts.SynthesizeSpeechRequest) -> RivaContext | None:
        self._opened = True
        session = self.session
        if self.unary and not request.text.strip():
            raise empty_message()
        synthesis = parse_request(request, session.port.router)
        spec = make_spec(session.port, voice_id=resolve_voice(session.port, synthesis.voice_name),
                         output_format=synthesis.output, seed=None, routed=synthesis.routed,
                         # a unary call's client takes the whole answer at once: nothing to pace
                         max_audio_ahead_s=math.inf if self.unary else None, markup=SSML_TAGS)
        state = RivaState(request, synthesis, ContextAlignment(lead_ms=synthesis.output.lead_ms))
        ctx = await session.open_context(CONTEXT_ID, spec, state)
        if ctx is not None and ctx.stream.spec.model is not None:  # the call's metadata names the model speaking
            session.send(Head(GRPC_HEAD_STATUS, GRPC_MEDIA_TYPE, ((SERVED_MODEL_HEADER, ctx.stream.spec.model),)), ctx)
        return ctx

    async def on_input_end(self, now_s: float) -> None:
        ctx = self.session.contexts.get(CONTEXT_ID)
        if ctx is not None and ctx.stream.status == StreamStatus.OPEN:
            ctx.stream.end(now_s)
        elif ctx is None and not self._opened:
            self.session.close(Outcome.COMPLETED, "")  # no request at all: nothing to say

    def render_error(self, error: FieldError) -> None:
        message = f"{error.field}: {error.message}" if error.field else error.message
        self.session.close(Outcome.of_error(error), message)

    def render(self, ctx: RivaContext, event: StreamEvent) -> None:
        session = self.session
        state = ctx.state
        if isinstance(event, AudioOut):
            if self.unary:
                state.audio.append(event.payload)
                state.audio_ms += event.duration_ms
            else:
                session.send_audio(ctx, response(event.payload, (), state.synthesis).SerializeToString(),
                                   event.duration_ms)
        elif isinstance(event, SegmentDone) and event.text:  # a pause (an SSML break) has no words
            seg = place_segment(state.alignment, event)
            if not state.synthesis.word_offsets:
                return
            if self.unary:
                state.words.extend(seg.words)
            else:
                session.send(response(b"", seg.words, state.synthesis, event.text).SerializeToString(), ctx)
        elif isinstance(event, StreamDone):
            self._render_done(ctx, event)

    def _render_done(self, ctx: RivaContext, event: StreamDone) -> None:
        session = self.session
        state = ctx.state
        if state.refused is not None and event.status == StreamStatus.COMPLETED:
            session.reject(state.refused)  # its render_error ends the call: INVALID_ARGUMENT
        elif event.status == StreamStatus.COMPLETED:
            if self.unary:
                whole = response(b"".join(state.audio), state.words, state.synthesis, state.first.text)
                session.send_audio(ctx, whole.SerializeToString(), state.audio_ms)
            session.close(Outcome.COMPLETED, "")
        elif event.status == StreamStatus.BUSY:
            session.close(Outcome.BUSY, event.detail or "busy")
        else:  # failed; cut by the drain (the call: INTERNAL, details say which)
            session.close(Outcome.FAILED, event.detail or event.reason)


class RivaUnaryProtocol(RivaProtocol):
    unary: ClassVar[bool] = True
