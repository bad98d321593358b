"""NVIDIA Riva's TTS service (`nvidia.riva.tts.RivaSpeechSynthesis`) on the app's gRPC server
(agent_server/core/grpc_server.py): each call runs one session of `protocols/riva.RivaProtocol` on the core, with
the same auth (the `authorization: Bearer <key>` metadata that nvidia-riva-client and Pipecat send), the same
admission, per-key limits, text limits and metrics (protocol `riva`) as every WebSocket and HTTP endpoint.

- `Synthesize` (unary): one request, one response with all the audio (and the word offsets).
- `SynthesizeOnline` (a stream of requests, a stream of responses as the audio is encoded).
- `GetRivaSynthesisConfig`: our variant and voices, after the same credentials check.

The methods are registered without (de)serializers: the session core moves serialized messages, and the
protocol parses and writes them (`riva_tts_pb2`, nvidia-riva-client's generated classes).
"""

from __future__ import annotations

from collections.abc import AsyncIterator

import grpc

from agent_server.core.grpc_server import Context, GrpcCalls, one
from agent_server.protocols import riva

SERVICE = "nvidia.riva.tts.RivaSpeechSynthesis"


class RivaService:
    def __init__(self, calls: GrpcCalls) -> None:
        self.calls = calls

    async def synthesize(self, request: bytes, context: Context) -> bytes | None:
        return await self.calls.run(context, one(request), riva.RivaUnaryProtocol, unary=True)

    async def synthesize_online(self, requests: AsyncIterator[bytes], context: Context) -> None:
        await self.calls.run(context, requests, riva.RivaProtocol, unary=False)

    async def synthesis_config(self, request: bytes, context: Context) -> bytes:
        await self.calls.authorize(context)
        port = self.calls.port
        voices = [voice.voice_id for voice in port.voices.list()]
        config: bytes = riva.synthesis_config(port.model.models, voices).SerializeToString()
        return config


def add_to_server(server: grpc.aio.Server, calls: GrpcCalls) -> None:
    service = RivaService(calls)
    handlers: dict[str, grpc.RpcMethodHandler[bytes, bytes]] = {
        "Synthesize": grpc.unary_unary_rpc_method_handler(service.synthesize),
        "SynthesizeOnline": grpc.stream_stream_rpc_method_handler(service.synthesize_online),
        "GetRivaSynthesisConfig": grpc.unary_unary_rpc_method_handler(service.synthesis_config),
    }
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(SERVICE, handlers),))
