"""NVIDIA Riva TTS on --grpc-port (protocols/riva.py, riva_service.py, agent_server/core/grpc_server.py), driven by
the unmodified `nvidia-riva-client` (`riva.client.SpeechSynthesisService`, a sync gRPC client) against a real
server with auth on and the FakeEngine behind it: batch and streaming, word offsets, Ogg Opus and FLAC,
refusals with their gRPC status, a cancelled call, per-key limits and metrics shared with every protocol."""

from __future__ import annotations

import io
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import av
import grpc
import pytest
import riva.client
import riva.client.proto.riva_tts_pb2 as riva_tts

from agent_server.audio.codecs import StreamFormat
from agent_server.core.observers import FirstAudio, ObservedEvent, SessionClosed
from agent_server.core.routing import DEFAULT_ROUTES, Routed, Router
from agent_server.errors import FieldError
from agent_server.protocols import riva as riva_map

from tests.agent_server.protocols.conftest import Served, assert_length, serving, start

pytestmark = pytest.mark.timeout(60)

ENGLISH = Router(DEFAULT_ROUTES, ("english",))  # one model loaded, the built-in route table
KEY = "riva-key"
TEXT = "Hello there, friend. How are you doing today?"
WAIT_S = 10.0


@pytest.fixture
def served(tmp_path: Path) -> Iterator[Served]:
    yield from start(tmp_path, grpc=True, api_keys=(KEY,))


@pytest.fixture
def served_realtime(tmp_path: Path) -> Iterator[Served]:
    yield from start(tmp_path, grpc=True, api_keys=(KEY,), realtime_factor=1.0)


def client(served: Served, key: str = KEY) -> riva.client.SpeechSynthesisService:
    return riva.client.SpeechSynthesisService(
        riva.client.Auth(None, False, served.grpc, [["authorization", f"Bearer {key}"]]))


def metadata(key: str = KEY) -> list[tuple[str, str]]:
    return [("authorization", f"Bearer {key}")]


def until(condition: object, timeout_s: float = WAIT_S) -> None:
    deadline_s = time.monotonic() + timeout_s
    while not condition():  # type: ignore[operator]
        assert time.monotonic() < deadline_s, "timed out"
        time.sleep(0.01)


def decoded_seconds(data: bytes) -> float:
    with av.open(io.BytesIO(data), "r") as container:
        stream = container.streams.audio[0]
        return sum(f.samples for f in container.decode(stream)) / stream.rate


def test_synthesize_batch_with_client_defaults(served: Served) -> None:
    response = client(served).synthesize(TEXT, enable_word_time_offsets=True)  # LINEAR_PCM at 22050 Hz
    assert_length(served, len(response.audio), 22_050)
    words = list(response.meta.words)
    assert [w.word for w in words] == TEXT.split()
    starts = [w.start_time for w in words]
    assert starts == sorted(starts) and words[-1].end_time <= len(response.audio) / 2 / 22.05 + 1  # ms, rounded
    assert len(served.engine.submits) > 1  # more than one segment: the offsets span segments


def test_ssml_breaks_are_pauses_and_tags_are_not_spoken(served: Served) -> None:
    ssml = '<speak>Hello <break time="300ms"/> <emphasis>there</emphasis>.</speak>'
    response = client(served).synthesize(ssml, sample_rate_hz=16_000, enable_word_time_offsets=True)
    assert [r.text.strip() for r in served.engine.submits] == ["Hello", "there."]
    assert [w.word for w in response.meta.words] == ["Hello", "there."]
    assert_length(served, len(response.audio) - 2 * 4_800, 16_000)  # the break: 300 ms of silence
    assert response.meta.words[1].start_time - response.meta.words[0].end_time >= 300  # ms


def test_ssml_of_a_break_alone_is_that_much_silence(served: Served) -> None:
    response = client(served).synthesize('<speak><break time="250ms"/></speak>', sample_rate_hz=16_000)
    assert 4_000 <= len(response.audio) // 2 <= 4_000 + 1_600 and not response.audio.strip(b"\x00")  # (+ the
    # resampler's flush: at most 0.1 s)
    assert served.engine.submits == []


def test_synthesize_online_streams_every_text_with_offsets_from_the_call_start(served: Served) -> None:
    texts = ["First sentence here.", "Second one follows it.", "Third."]
    responses = list(client(served).synthesize_online(texts, sample_rate_hz=16_000, enable_word_time_offsets=True))
    audio = b"".join(r.audio for r in responses)
    assert_length(served, len(audio), 16_000)
    assert " ".join(r.text for r in served.engine.submits).split() == " ".join(texts).split()
    assert sum(1 for r in responses if r.audio) > 1  # streamed, not one answer at the end
    words = [w for r in responses for w in r.meta.words]
    assert [w.word for w in words] == " ".join(texts).split()
    starts = [w.start_time for w in words]
    assert starts == sorted(starts) and starts[-1] > 500  # from the call's start, not each segment's


@pytest.mark.parametrize(("encoding", "rate_hz"), [(riva.client.AudioEncoding.OGGOPUS, 48_000),
                                                   (riva.client.AudioEncoding.FLAC, 22_050)])
def test_compressed_encodings_decode(served: Served, encoding: int, rate_hz: int) -> None:
    responses = client(served).synthesize_online([TEXT], encoding=encoding, sample_rate_hz=rate_hz)
    seconds = decoded_seconds(b"".join(r.audio for r in responses))
    made_s = served.produced()[0] / 24_000
    assert made_s - 0.002 <= seconds <= made_s + 0.15 * served.produced()[1]


def test_config_lists_our_voices(served: Served) -> None:
    config = client(served).stub.GetRivaSynthesisConfig(riva_tts.RivaSynthesisConfigRequest(), metadata=metadata())
    model = config.model_config[0]
    assert model.model_name == "chatterbox-english" and model.parameters["subvoices"] == "default:0"


def test_wrong_key_is_refused(served: Served) -> None:
    events: list[ObservedEvent] = []
    served.live.app.state.observers.subscribe(events.append)
    for call in (lambda: client(served, key="wrong").synthesize("Hi."),
                 lambda: list(client(served, key="wrong").synthesize_online(["Hi."])),
                 lambda: client(served, key="wrong").stub.GetRivaSynthesisConfig(
                     riva_tts.RivaSynthesisConfigRequest(), metadata=metadata("wrong")),
                 lambda: client(served).stub.Synthesize(riva_tts.SynthesizeSpeechRequest(text="Hi."))):  # no key
        with pytest.raises(grpc.RpcError) as exc:
            call()
        assert exc.value.code() == grpc.StatusCode.UNAUTHENTICATED
    assert "metadata authorization: Bearer" in (exc.value.details() or "")  # (no key) what a gRPC client can send
    assert not served.engine.submits and not events  # refused before any session


def test_bad_requests_are_invalid_argument(served: Served) -> None:
    for kwargs in ({"language_code": "fr-FR"}, {"encoding": riva.client.AudioEncoding.MULAW, "sample_rate_hz": 16_000},
                   {"encoding": riva.client.AudioEncoding.OGGOPUS, "sample_rate_hz": 44_100}):
        with pytest.raises(grpc.RpcError) as exc:
            client(served).synthesize("Hi.", **kwargs)
        assert exc.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    with pytest.raises(grpc.RpcError) as exc:
        client(served).synthesize("   ")
    assert exc.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "no text" in (exc.value.details() or "")
    assert not served.engine.submits
    until(lambda: not served.live.hub.sessions)


def test_text_over_the_servers_limit_is_refused(tmp_path: Path) -> None:
    with serving(tmp_path, grpc=True, api_keys=(KEY,)) as served:
        with pytest.raises(grpc.RpcError) as exc:
            client(served).synthesize("x" * (served.live.hub.settings.max_text_piece_chars + 1))
        assert exc.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "too long" in (exc.value.details() or "")


def test_settings_changed_mid_stream_are_refused_after_earlier_audio(served: Served) -> None:
    base = riva_tts.SynthesizeSpeechRequest(text="One.", language_code="en-US", sample_rate_hz=16_000,
                                            encoding=riva.client.AudioEncoding.LINEAR_PCM)
    changed = riva_tts.SynthesizeSpeechRequest(text="Two.", language_code="en-US", sample_rate_hz=8_000,
                                               encoding=riva.client.AudioEncoding.LINEAR_PCM)
    call = client(served).stub.SynthesizeOnline(iter([base, changed]), metadata=metadata())
    got: list[riva_tts.SynthesizeSpeechResponse] = []
    with pytest.raises(grpc.RpcError) as exc:
        got.extend(call)
    assert exc.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "sample_rate_hz" in (exc.value.details() or "")
    assert [r.text for r in served.engine.submits] == ["One."]
    assert_length(served, sum(len(r.audio) for r in got), 16_000)  # all of what came before, then the error


def test_client_cancel_cancels_the_context(served_realtime: Served) -> None:
    served = served_realtime
    gate = threading.Event()
    base = riva_tts.SynthesizeSpeechRequest(text=TEXT * 3, language_code="en-US", sample_rate_hz=16_000)

    def requests() -> Iterator[riva_tts.SynthesizeSpeechRequest]:  # the client holds the call open, then cancels
        yield base
        gate.wait(WAIT_S)

    call = client(served).stub.SynthesizeOnline(requests(), metadata=metadata())
    assert next(iter(call)).audio
    call.cancel()
    gate.set()
    until(lambda: served.engine.cancels)
    until(lambda: not served.live.hub.sessions)


def test_per_key_session_limit_and_metrics_are_the_cores(tmp_path: Path) -> None:
    with serving(tmp_path, grpc=True, api_keys=(KEY,), realtime_factor=1.0) as served:
        hub = served.live.hub
        events: list[ObservedEvent] = []
        served.live.app.state.observers.subscribe(events.append)
        hub.auth.max_sessions_per_key = 1
        gate = threading.Event()

        def held() -> Iterator[riva_tts.SynthesizeSpeechRequest]:
            yield riva_tts.SynthesizeSpeechRequest(text=TEXT, language_code="en-US", sample_rate_hz=16_000)
            gate.wait(WAIT_S)

        first = client(served).stub.SynthesizeOnline(held(), metadata=metadata())
        assert next(iter(first)).audio  # one session of this key is open
        with pytest.raises(grpc.RpcError) as exc:
            client(served).synthesize("Hi.")
        assert exc.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED and "this API key" in (exc.value.details() or "")
        gate.set()
        list(first)
        until(lambda: not hub.sessions)
        assert [e.protocol for e in events if isinstance(e, FirstAudio)] == ["riva"]
        closed = [(e.protocol, e.code) for e in events if isinstance(e, SessionClosed)]
        assert closed == [("riva", 1000)]  # the refused one was never admitted


def test_parse_request_mapping() -> None:
    req = riva_tts.SynthesizeSpeechRequest(text="Hi", language_code="en-US", voice_name="v1", sample_rate_hz=0,
                                           encoding=riva.client.AudioEncoding.FLAC, enable_word_time_offsets=True)
    req.id.value = "r-1"
    synthesis = riva_map.parse_request(req, ENGLISH)
    flac = StreamFormat("flac", "flac", 24_000)
    assert synthesis == riva_map.Synthesis("v1", Routed("english", None), flac, True, "r-1")
    assert riva_map.output_format(riva.client.AudioEncoding.ALAW, 0) == StreamFormat("raw", "alaw", 8_000)
    unspecified = riva_map.output_format(riva.client.AudioEncoding.ENCODING_UNSPECIFIED, 22_050)
    assert unspecified == StreamFormat("raw", "pcm_s16le", 22_050)
    zero_shot = riva_tts.SynthesizeSpeechRequest(text="Hi")
    zero_shot.zero_shot_data.audio_prompt = b"\x00"
    with pytest.raises(FieldError) as exc:
        riva_map.parse_request(zero_shot, ENGLISH)
    assert exc.value.field == "zero_shot_data"
    resp = riva_map.response(b"ab", [], synthesis)
    assert resp.id.value == "r-1" and list(resp.meta.words) == []


# ---- Riva's column of docs/operations.md's behaviour table ---------------------------------------------


def held_call(served: Served, gate: threading.Event, text: str = TEXT) -> Any:
    """A SynthesizeOnline call kept open (its requests end when `gate` is set), once its first audio came."""

    def requests() -> Iterator[riva_tts.SynthesizeSpeechRequest]:
        yield riva_tts.SynthesizeSpeechRequest(text=text, language_code="en-US", sample_rate_hz=16_000)
        gate.wait(WAIT_S)

    call = client(served).stub.SynthesizeOnline(requests(), metadata=metadata())
    assert next(iter(call)).audio
    return call


def refused_status(served: Served, text: str = "Hi there.") -> tuple[grpc.StatusCode, str]:
    with pytest.raises(grpc.RpcError) as exc:
        client(served).synthesize(text)
    return exc.value.code(), exc.value.details() or ""


def test_behaviour_refused_when_full_and_while_not_serving(tmp_path: Path) -> None:
    with serving(tmp_path, grpc=True, api_keys=(KEY,), realtime_factor=1.0) as served:
        served.live.hub.settings = served.live.hub.settings.replace(max_sessions=1)
        gate = threading.Event()
        call = held_call(served, gate)
        assert refused_status(served)[0] == grpc.StatusCode.RESOURCE_EXHAUSTED  # "too many sessions"
        gate.set()
        list(call)
        until(lambda: not served.live.hub.sessions)
        served.live.hub.status = served.live.hub.status.DRAINING  # what the drain sets first
        code, details = refused_status(served)
        assert code == grpc.StatusCode.RESOURCE_EXHAUSTED and "shutting down" in details


def test_behaviour_text_budget_and_engine_busy(tmp_path: Path) -> None:
    with serving(tmp_path, grpc=True, api_keys=(KEY,), realtime_factor=1.0, max_slots=1, max_waiting=0) as served:
        hub = served.live.hub
        hub.auth.max_text_chars_per_minute_per_key = 30
        code, details = refused_status(served, "w" * 40)
        assert code == grpc.StatusCode.RESOURCE_EXHAUSTED and "30 characters per minute" in details
        hub.auth.max_text_chars_per_minute_per_key = 0
        gate = threading.Event()
        call = held_call(served, gate, TEXT * 4)  # takes the engine's one slot
        code, details = refused_status(served)
        assert code == grpc.StatusCode.RESOURCE_EXHAUSTED and "slot" in details  # the engine said busy
        gate.set()
        call.cancel()
        until(lambda: not hub.sessions)


def test_behaviour_drain_lets_a_running_call_finish(tmp_path: Path) -> None:
    with serving(tmp_path, grpc=True, api_keys=(KEY,), realtime_factor=0.3) as served:
        hub = served.live.hub
        responses: list[riva_tts.SynthesizeSpeechResponse] = []
        errors: list[grpc.RpcError] = []

        def speak() -> None:
            try:
                responses.extend(client(served).synthesize_online([TEXT], sample_rate_hz=16_000))
            except grpc.RpcError as exc:
                errors.append(exc)

        worker = threading.Thread(target=speak)
        worker.start()
        until(lambda: responses)
        drained: list[bool] = []

        async def drain() -> None:
            drained.append(await hub.drain(10.0))

        hub.post(lambda: hub.spawn(drain(), "drain"))  # SIGTERM's drain, on the server's loop
        until(lambda: hub.status.name == "DRAINING")
        code, _ = refused_status(served)
        assert code == grpc.StatusCode.RESOURCE_EXHAUSTED  # a new call during the drain
        worker.join(WAIT_S)
        until(lambda: drained)
        assert not errors and drained == [True]
        assert_length(served, sum(len(r.audio) for r in responses), 16_000)  # the running call spoke to its end


def test_a_call_cancelled_before_any_audio_is_cancelled_at_once(tmp_path: Path) -> None:
    """No write can fail yet (the engine has not spoken): the call's end itself must reach the session."""
    with serving(tmp_path, grpc=True, api_keys=(KEY,), first_chunk_delay_s=30.0) as served:
        gate = threading.Event()

        def requests() -> Iterator[riva_tts.SynthesizeSpeechRequest]:
            yield riva_tts.SynthesizeSpeechRequest(text=TEXT, language_code="en-US", sample_rate_hz=16_000)
            gate.wait(WAIT_S)

        call = client(served).stub.SynthesizeOnline(requests(), metadata=metadata())
        until(lambda: served.engine.submits)
        call.cancel()
        gate.set()
        until(lambda: served.engine.cancels, timeout_s=5.0)  # not after the 30 s the engine would take
        until(lambda: not served.live.hub.sessions, timeout_s=5.0)
