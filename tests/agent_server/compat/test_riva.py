"""Riva TTS mapping (compat/riva.py) and the gRPC skeleton (compat/riva_service.py), driven by the
unmodified `nvidia-riva-client` (`riva.client.SpeechSynthesisService`) against a server on 127.0.0.1
with a fake backend that encodes a tone per text with our encoders (the session core comes in phase 2)."""

from __future__ import annotations

import asyncio
import io
import threading
from collections.abc import AsyncIterator, Callable, Iterator, Sequence

import av
import grpc
import numpy as np
import pytest
import riva.client
import riva.client.proto.riva_tts_pb2 as riva_tts

from agent_server.codecs import StreamFormat, make_encoder
from agent_server.compat import riva as riva_map
from agent_server.compat.common import CompatError
from agent_server.compat.riva_service import AudioPiece, add_to_server
from agent_server.speech import char_alignment
from agent_server.timestamps import ContextAlignment

KEY = "riva-key"
SECONDS_PER_TEXT = 0.4
WAIT_S = 10.0


class FakeBackend:
    variant = "english"

    def __init__(self) -> None:
        self.texts: list[list[str]] = []
        self.closed = threading.Event()  # a synthesize iterator was closed before all its audio went out
        self.release = threading.Event()  # set: the fake stops waiting between texts

    def authorize(self, api_key: str | None) -> str | None:
        return None if api_key == KEY else "unknown API key"

    def voice_ids(self) -> Sequence[str]:
        return ["default", "v_3f9c2a1b7e40"]

    async def synthesize(self, synthesis: riva_map.Synthesis, texts: AsyncIterator[str]) -> AsyncIterator[AudioPiece]:
        enc = make_encoder(synthesis.output)
        ctx = ContextAlignment()
        got: list[str] = []
        self.texts.append(got)
        completed = False
        try:
            async for text in texts:
                got.append(text)
                n = int(SECONDS_PER_TEXT * 24_000)
                tone = (0.3 * np.sin(2 * np.pi * 220 * np.arange(n) / 24_000)).astype(np.float32)
                offset_ms = enc.samples_fed / 24
                starts, durations = char_alignment(text, 0.0, SECONDS_PER_TEXT * 1000)
                seg = ctx.add(text, starts, durations, offset_ms, SECONDS_PER_TEXT * 1000, segment_relative=True)
                yield AudioPiece(b"".join(enc.push(tone) + enc.drain()), seg.words)
            yield AudioPiece(b"".join(enc.finish()))
            completed = True
        finally:
            if not completed:
                self.closed.set()
            enc.close()


def with_server(check: Callable[[str, FakeBackend], None]) -> None:
    """Serve on this thread's event loop; `check` (sync, the Riva client is sync) runs in a worker thread."""

    async def main() -> None:
        backend = FakeBackend()
        server = grpc.aio.server()
        add_to_server(server, backend)
        port = server.add_insecure_port("127.0.0.1:0")
        await server.start()
        try:
            await asyncio.wait_for(asyncio.to_thread(check, f"127.0.0.1:{port}", backend), WAIT_S)
        finally:
            await server.stop(None)

    asyncio.run(main())


def client(uri: str, key: str = KEY) -> riva.client.SpeechSynthesisService:
    return riva.client.SpeechSynthesisService(riva.client.Auth(None, False, uri, [["authorization", f"Bearer {key}"]]))


def test_synthesize_batch_with_client_defaults() -> None:
    with_server(check_synthesize_batch_with_client_defaults)


def check_synthesize_batch_with_client_defaults(uri: str, backend: FakeBackend) -> None:
    resp = client(uri).synthesize("Hello there, friend.", enable_word_time_offsets=True)  # LINEAR_PCM, 22050 Hz
    assert len(resp.audio) // 2 >= int(SECONDS_PER_TEXT * 22_050)
    assert [w.word for w in resp.meta.words] == ["Hello", "there,", "friend."]
    assert resp.meta.words[-1].end_time == round(SECONDS_PER_TEXT * 1000)
    assert backend.texts == [["Hello there, friend."]]


def test_synthesize_online_streams_each_text_in_order() -> None:
    with_server(check_synthesize_online_streams_each_text_in_order)


def check_synthesize_online_streams_each_text_in_order(uri: str, backend: FakeBackend) -> None:
    texts = ["First sentence.", "Second one.", "Third."]
    responses = list(client(uri).synthesize_online(texts, sample_rate_hz=16_000, enable_word_time_offsets=True))
    assert backend.texts == [texts]
    assert len(responses) == 4  # one per text, then the end of the stream
    starts = [w.start_time for r in responses for w in r.meta.words]
    assert starts == sorted(starts) and starts[-1] >= 2 * SECONDS_PER_TEXT * 1000  # no restart per text
    audio = b"".join(r.audio for r in responses)
    assert len(audio) // 2 >= int(3 * SECONDS_PER_TEXT * 16_000)


def test_synthesize_online_ogg_opus_decodes() -> None:
    with_server(check_synthesize_online_ogg_opus_decodes)


def check_synthesize_online_ogg_opus_decodes(uri: str, backend: FakeBackend) -> None:
    responses = client(uri).synthesize_online(["One.", "Two."], encoding=riva.client.AudioEncoding.OGGOPUS,
                                              sample_rate_hz=48_000)
    data = b"".join(r.audio for r in responses)
    with av.open(io.BytesIO(data), "r") as container:
        samples = sum(f.samples for f in container.decode(audio=0))
    assert samples / 48_000 >= 2 * SECONDS_PER_TEXT


def test_config_lists_our_voices() -> None:
    with_server(check_config_lists_our_voices)


def check_config_lists_our_voices(uri: str, backend: FakeBackend) -> None:
    config = client(uri).stub.GetRivaSynthesisConfig(riva_tts.RivaSynthesisConfigRequest(),
                                                     metadata=[("authorization", f"Bearer {KEY}")])
    model = config.model_config[0]
    assert model.model_name == "chatterbox-english"
    assert model.parameters["subvoices"] == "default:0,v_3f9c2a1b7e40:1"


def test_wrong_key_is_refused() -> None:
    with_server(check_wrong_key_is_refused)


def check_wrong_key_is_refused(uri: str, backend: FakeBackend) -> None:
    with pytest.raises(grpc.RpcError) as exc:
        client(uri, key="wrong").synthesize("Hi.")
    assert exc.value.code() == grpc.StatusCode.UNAUTHENTICATED
    with pytest.raises(grpc.RpcError) as exc:
        list(client(uri, key="wrong").synthesize_online(["Hi."]))
    assert exc.value.code() == grpc.StatusCode.UNAUTHENTICATED
    assert backend.texts == []


def test_bad_requests_are_invalid_argument() -> None:
    with_server(check_bad_requests_are_invalid_argument)


def check_bad_requests_are_invalid_argument(uri: str, backend: FakeBackend) -> None:
    for kwargs in ({"language_code": "fr-FR"}, {"encoding": riva.client.AudioEncoding.MULAW, "sample_rate_hz": 16_000},
                   {"encoding": riva.client.AudioEncoding.OGGOPUS, "sample_rate_hz": 44_100}):
        with pytest.raises(grpc.RpcError) as exc:
            client(uri).synthesize("Hi.", **kwargs)
        assert exc.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert backend.texts == []


def test_settings_changed_mid_stream_are_refused_after_earlier_audio() -> None:
    with_server(check_settings_changed_mid_stream_are_refused_after_earlier_audio)


def check_settings_changed_mid_stream_are_refused_after_earlier_audio(uri: str, backend: FakeBackend) -> None:
    svc = client(uri)
    base = riva_tts.SynthesizeSpeechRequest(text="One.", language_code="en-US", sample_rate_hz=16_000,
                                            encoding=riva.client.AudioEncoding.LINEAR_PCM)
    changed = riva_tts.SynthesizeSpeechRequest(text="Two.", language_code="en-US", sample_rate_hz=8_000,
                                               encoding=riva.client.AudioEncoding.LINEAR_PCM)
    call = svc.stub.SynthesizeOnline(iter([base, changed]), metadata=[("authorization", f"Bearer {KEY}")])
    got = []
    with pytest.raises(grpc.RpcError) as exc:
        got.extend(call)
    assert exc.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "sample_rate_hz" in exc.value.details()
    assert backend.texts == [["One."]] and got and got[0].audio


def test_client_cancel_closes_the_backend_context() -> None:
    with_server(check_client_cancel_closes_the_backend_context)


def check_client_cancel_closes_the_backend_context(uri: str, backend: FakeBackend) -> None:
    gate = threading.Event()

    base = riva_tts.SynthesizeSpeechRequest(text="First.", language_code="en-US", sample_rate_hz=16_000)

    def requests() -> Iterator[riva_tts.SynthesizeSpeechRequest]:  # what Pipecat's NvidiaTTSService does
        yield base
        gate.wait(WAIT_S)  # the client holds the call open, then cancels it
        yield riva_tts.SynthesizeSpeechRequest(text="Never sent.", language_code="en-US", sample_rate_hz=16_000)

    call = client(uri).stub.SynthesizeOnline(requests(), metadata=[("authorization", f"Bearer {KEY}")])
    first = next(iter(call))
    assert first.audio
    call.cancel()
    gate.set()
    assert backend.closed.wait(WAIT_S)
    assert backend.texts == [["First."]]


def test_parse_request_mapping() -> None:
    req = riva_tts.SynthesizeSpeechRequest(text="Hi", language_code="en-US", voice_name="v1", sample_rate_hz=0,
                                           encoding=riva.client.AudioEncoding.FLAC, enable_word_time_offsets=True)
    req.id.value = "r-1"
    synthesis = riva_map.parse_request(req, "english")
    assert synthesis == riva_map.Synthesis("v1", None, StreamFormat("flac", "flac", 24_000), True, "r-1")
    assert riva_map.output_format(riva.client.AudioEncoding.ALAW, 0) == StreamFormat("raw", "alaw", 8_000)
    assert riva_map.output_format(riva.client.AudioEncoding.ENCODING_UNSPECIFIED, 22_050) == StreamFormat("raw", "pcm_s16le", 22_050)
    zero_shot = riva_tts.SynthesizeSpeechRequest(text="Hi")
    zero_shot.zero_shot_data.audio_prompt = b"\x00"
    with pytest.raises(CompatError) as exc:
        riva_map.parse_request(zero_shot, "english")
    assert exc.value.field == "zero_shot_data"
    resp = riva_map.response(b"ab", [], synthesis)
    assert resp.id.value == "r-1" and list(resp.meta.words) == []
