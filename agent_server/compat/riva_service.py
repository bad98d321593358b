"""A gRPC server skeleton for Riva TTS (`compat/riva.py` does the mapping). Phase 2 puts it on the session
core: the `RivaBackend` below is the seam (auth, voices, one context per call).

- `Synthesize`: one request, one response with all the audio (and word offsets).
- `SynthesizeOnline`: a stream of requests (the first one's settings hold; each one's text is spoken in
  turn), a stream of responses as audio is made. The client cancelling the call (or going away) closes
  the backend's audio iterator, which ends the context.
- `GetRivaSynthesisConfig`: our variant and voices.
- auth: the `authorization` metadata (`Bearer <key>`, what nvidia-riva-client and Pipecat send), checked
  by the backend; refused with UNAUTHENTICATED before anything else.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass
from typing import Protocol

import grpc
import riva.client.proto.riva_tts_pb2 as riva_tts
import riva.client.proto.riva_tts_pb2_grpc as riva_tts_grpc

from agent_server.compat import riva
from agent_server.compat.common import CompatError
from agent_server.timestamps import WordTime

AUTH_METADATA_KEY = "authorization"
BEARER = "bearer "


@dataclass(frozen=True, slots=True)
class AudioPiece:
    audio: bytes  # encoded in the call's output format
    words: Sequence[WordTime] = ()  # words this piece completes (ms from the start of the call's audio)


class RivaBackend(Protocol):
    variant: str

    def authorize(self, api_key: str | None) -> str | None:
        """None when the key may synthesize; else why not."""

    def voice_ids(self) -> Sequence[str]: ...

    def synthesize(self, synthesis: riva.Synthesis, texts: AsyncIterator[str]) -> AsyncIterator[AudioPiece]:
        """One context: speak each text in turn (more may come until `texts` ends), yield audio as it is
        made. Closing the returned iterator early cancels the context."""


class RivaSpeechSynthesis(riva_tts_grpc.RivaSpeechSynthesisServicer):  # type: ignore[misc]  # generated, untyped
    def __init__(self, backend: RivaBackend) -> None:
        self._backend = backend

    async def Synthesize(self, request: riva_tts.SynthesizeSpeechRequest,
                         context: grpc.aio.ServicerContext) -> riva_tts.SynthesizeSpeechResponse:
        synthesis = await self._open(request, context)
        audio: list[bytes] = []
        words: list[WordTime] = []
        pieces = self._backend.synthesize(synthesis, _one(request.text))
        async for piece in pieces:
            audio.append(piece.audio)
            words.extend(piece.words)
        return riva.response(b"".join(audio), words, synthesis, request.text)

    async def SynthesizeOnline(self, request_iterator: AsyncIterator[riva_tts.SynthesizeSpeechRequest],
                               context: grpc.aio.ServicerContext) -> AsyncIterator[riva_tts.SynthesizeSpeechResponse]:
        first = await anext(aiter(request_iterator), None)
        if first is None:
            return
        synthesis = await self._open(first, context)
        errors: list[CompatError] = []
        pieces = self._backend.synthesize(synthesis, _texts(first, request_iterator, errors))
        try:
            async for piece in pieces:
                yield riva.response(piece.audio, piece.words, synthesis)
        finally:
            await pieces.aclose()  # type: ignore[attr-defined]
        if errors:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"{errors[0].field}: {errors[0].message}")

    async def GetRivaSynthesisConfig(self, request: riva_tts.RivaSynthesisConfigRequest,
                                     context: grpc.aio.ServicerContext) -> riva_tts.RivaSynthesisConfigResponse:
        await self._authorize(context)
        return riva.synthesis_config(self._backend.variant, list(self._backend.voice_ids()))

    async def _open(self, request: riva_tts.SynthesizeSpeechRequest, context: grpc.aio.ServicerContext) -> riva.Synthesis:
        await self._authorize(context)
        try:
            return riva.parse_request(request, self._backend.variant)
        except CompatError as exc:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"{exc.field}: {exc.message}")
            raise  # abort raises; this line is for the type checker

    async def _authorize(self, context: grpc.aio.ServicerContext) -> None:
        key = None
        for name, value in context.invocation_metadata() or ():
            if name == AUTH_METADATA_KEY and isinstance(value, str):
                key = value[len(BEARER):] if value.lower().startswith(BEARER) else value
        refusal = self._backend.authorize(key)
        if refusal is not None:
            await context.abort(grpc.StatusCode.UNAUTHENTICATED, refusal)


async def _one(text: str) -> AsyncIterator[str]:
    yield text


async def _texts(first: riva_tts.SynthesizeSpeechRequest, rest: AsyncIterator[riva_tts.SynthesizeSpeechRequest],
                 errors: list[CompatError]) -> AsyncIterator[str]:
    """The call's texts in order; a later request that changes the settings ends the input (the error is
    reported once the audio of what came before has gone out)."""
    yield first.text
    async for request in rest:
        try:
            riva.same_settings(first, request)
        except CompatError as exc:
            errors.append(exc)
            return
        yield request.text


def add_to_server(server: grpc.aio.Server, backend: RivaBackend) -> None:
    riva_tts_grpc.add_RivaSpeechSynthesisServicer_to_server(RivaSpeechSynthesis(backend), server)
