"""ElevenLabs text to dialogue (protocols/elevenlabs_dialogue.py): the `elevenlabs` SDK's four HTTP calls and
the documented WebSocket messages (LiveKit's `model="eleven_v3"` client is in test_livekit.py and
test_word_timings.py), against a real server whose FakeEngine records which voice said each segment."""

from __future__ import annotations

import asyncio
import base64
import itertools
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import pytest
from elevenlabs import DialogueInput
from elevenlabs.client import ElevenLabs
from elevenlabs.core.api_error import ApiError
from websockets.asyncio.client import connect
from websockets.exceptions import ConnectionClosed

from agent_server.core.voices import encode_wav_pcm16

from tests.agent_server.protocols.conftest import Served, assert_length, start

pytestmark = pytest.mark.timeout(60)

LINES = [("ann", "Knock knock."), ("bob", "Who is there? It is late, you know."), ("ann", "Lettuce.")]
MULTI = "/v1/text-to-dialogue/multi-stream-input"


@pytest.fixture
def served(tmp_path: Path) -> Iterator[Served]:
    """A server with two voices of its own, "ann" and "bob"."""
    for served in start(tmp_path):
        rate_hz = 16_000
        t = np.arange(6 * rate_hz) / rate_hz
        for name, tone_hz in (("ann", 220), ("bob", 330)):
            clip = encode_wav_pcm16((0.3 * np.sin(2 * np.pi * tone_hz * t)).astype(np.float32), rate_hz)
            made = httpx.post(f"{served.http}/v1/voices?name={name}&voice_id={name}", content=clip,
                              headers={"content-type": "audio/wav"})
            assert made.status_code == 201, made.text
        yield served


@pytest.fixture
def http() -> Iterator[httpx.Client]:
    with httpx.Client(timeout=30.0) as client:  # closed after the test: no socket left open
        yield client


def client(served: Served, http: httpx.Client) -> ElevenLabs:
    return ElevenLabs(api_key="sk-test", base_url=served.http, httpx_client=http)


def inputs(lines: list[tuple[str, str]] = LINES) -> list[DialogueInput]:
    return [DialogueInput(text=text, voice_id=voice) for voice, text in lines]


def said(served: Served) -> list[tuple[str, str]]:
    return [(r.voice_id, r.text) for r in served.engine.submits]


# ---- HTTP ------------------------------------------------------------------------------------------------


def test_convert_says_each_line_in_its_voice(served: Served, http: httpx.Client) -> None:
    audio = b"".join(client(served, http).text_to_dialogue.convert(inputs=inputs(), output_format="pcm_16000"))
    assert said(served) == LINES  # one segment per line here, each to the engine with its own voice
    assert_length(served, len(audio), 16_000)


def test_a_vendor_voice_id_is_the_default_voice_and_lines_stay_apart(served: Served, http: httpx.Client) -> None:
    lines = [("JBFqnCBsd6RMkjVDRZzb", "[giggling] Knock knock"), ("Aw4FAjKCGjjNkVhN1Xmq", "[curious] Who is there?")]
    b"".join(client(served, http).text_to_dialogue.stream(inputs=inputs(lines)))  # the SDK's example; default MP3
    assert said(served) == [("default", "Knock knock"), ("default", "Who is there?")]  # v3 audio tags: not said
    assert len(said(served)) == 2  # one line never runs into the next, even in one voice


def test_a_voice_made_under_a_vendor_id_is_said_by_that_id(served: Served, http: httpx.Client) -> None:
    """The operator makes a voice under the vendor's id: the client's script, unchanged, gets it."""
    rate_hz = 16_000
    tone = (0.3 * np.sin(2 * np.pi * 440 * np.arange(6 * rate_hz) / rate_hz)).astype(np.float32)
    made = http.post(f"{served.http}/v1/voices", files={"file": ("george.wav", encode_wav_pcm16(tone, rate_hz))},
                     data={"name": "George", "voice_id": "JBFqnCBsd6RMkjVDRZzb"})
    assert made.status_code == 201, made.text
    lines = [("JBFqnCBsd6RMkjVDRZzb", "Knock knock."), ("Aw4FAjKCGjjNkVhN1Xmq", "Who is there?")]
    b"".join(client(served, http).text_to_dialogue.convert(inputs=inputs(lines), output_format="pcm_16000"))
    assert said(served) == [("JBFqnCBsd6RMkjVDRZzb", "Knock knock."), ("default", "Who is there?")]


def test_convert_with_timestamps_has_a_voice_segment_per_line(served: Served, http: httpx.Client) -> None:
    result = client(served, http).text_to_dialogue.convert_with_timestamps(inputs=inputs(), output_format="pcm_16000")
    audio = base64.b64decode(result.audio_base_64)
    chars = result.alignment.characters
    assert "".join(chars) == " ".join(text for _, text in LINES)  # lines joined at their boundary space
    segments = result.voice_segments
    assert [(s.voice_id, s.dialogue_input_index) for s in segments] == [("ann", 0), ("bob", 1), ("ann", 2)]
    assert segments[0].character_start_index == 0 and segments[-1].character_end_index == len(chars)
    for before, after in itertools.pairwise(segments):
        assert before.character_end_index == after.character_start_index
        assert before.end_time_seconds <= after.start_time_seconds
    for segment, (_, text) in zip(segments, LINES, strict=True):
        assert "".join(chars[segment.character_start_index:segment.character_end_index]).strip() == text
    starts = result.alignment.character_start_times_seconds
    assert starts == sorted(starts) and starts[-1] < len(audio) / 2 / 16_000
    assert result.normalized_alignment == result.alignment


@pytest.mark.parametrize(
    ("lines", "expected"),
    [
        # v3 tags and whitespace are not in the alignment: the lines must still get their own voice segment
        ([("ann", "[excited] Wait, really?"), ("bob", "Yes."), ("ann", "Wow.")],
         [("ann", 0, "Wait, really?"), ("bob", 1, "Yes."), ("ann", 2, "Wow.")]),
        ([("ann", "Hello "), ("bob", "world.")], [("ann", 0, "Hello"), ("bob", 1, "world.")]),
        ([("ann", "  padded  "), ("bob", "\nnext\n")], [("ann", 0, "padded"), ("bob", 1, "next")]),
        ([("ann", "Wait [pause] here."), ("bob", "Okay.")], [("ann", 0, "Wait here."), ("bob", 1, "Okay.")]),
        ([("ann", "First line."), ("bob", "[sighs]"), ("ann", "Third line.")],  # a line with nothing to say
         [("ann", 0, "First line."), ("ann", 2, "Third line.")]),
    ],
)
def test_voice_segments_follow_the_lines_whatever_they_hold(
    served: Served, http: httpx.Client, lines: list[tuple[str, str]], expected: list[tuple[str, int, str]]
) -> None:
    result = client(served, http).text_to_dialogue.convert_with_timestamps(inputs=inputs(lines),
                                                                         output_format="pcm_16000")
    chars = result.alignment.characters
    got = [(s.voice_id, s.dialogue_input_index,
            "".join(chars[s.character_start_index:s.character_end_index]).strip()) for s in result.voice_segments]
    assert got == expected
    chunks = list(client(served, http).text_to_dialogue.stream_with_timestamps(inputs=inputs(lines),
                                                                              output_format="pcm_16000"))
    streamed = [(c.voice_segments[0].voice_id, c.voice_segments[0].dialogue_input_index,
                 "".join(c.alignment.characters).strip()) for c in chunks if c.alignment is not None]
    assert streamed == expected


def test_stream_with_timestamps_lines_carry_voice_segments(served: Served, http: httpx.Client) -> None:
    chunks = list(client(served, http).text_to_dialogue.stream_with_timestamps(inputs=inputs(),
                                                                            output_format="pcm_16000"))
    assert all(chunk.voice_segments is not None for chunk in chunks)  # a required field of every line
    aligned = [chunk for chunk in chunks if chunk.alignment is not None]
    assert [(c.voice_segments[0].voice_id, c.voice_segments[0].dialogue_input_index) for c in aligned] == [
        ("ann", 0), ("bob", 1), ("ann", 2)]
    for chunk in aligned:
        (segment,) = chunk.voice_segments
        assert (segment.character_start_index, segment.character_end_index) == (0, len(chunk.alignment.characters))
    audio = b"".join(base64.b64decode(c.audio_base_64) for c in chunks)
    assert_length(served, len(audio), 16_000)


@pytest.mark.parametrize(
    ("body", "loc"),
    [
        ({}, ["body", "inputs"]),
        ({"inputs": "hello"}, ["body", "inputs"]),
        ({"inputs": []}, ["body", "inputs"]),
        ({"inputs": [{"text": "Hi."}]}, ["body", "inputs", 0, "voice_id"]),
        ({"inputs": [{"text": "Hi.", "voice_id": "a", "speed": 2}]}, ["body", "inputs", 0, "speed"]),
        ({"inputs": [{"text": 5, "voice_id": "a"}]}, ["body", "inputs", 0, "text"]),
        ({"inputs": [{"text": " ... ", "voice_id": "a"}]}, ["body", "inputs"]),
        ({"inputs": [{"text": "Hi.", "voice_id": f"v{i}"} for i in range(11)]}, ["body", "inputs"]),
        ({"inputs": [{"text": "Hi.", "voice_id": "a"}], "settings": 1}, ["body", "settings"]),
        ({"inputs": [{"text": "Hi.", "voice_id": "a"}], "text": "Hi."}, ["body", "text"]),
    ],
)
def test_a_bad_request_is_a_422_naming_the_field(served: Served, body: dict[str, Any], loc: list[Any]) -> None:
    response = httpx.post(served.http + "/v1/text-to-dialogue", json=body)
    assert response.status_code == 422, response.text
    assert response.json()["detail"][0]["loc"] == loc
    assert said(served) == []


def test_the_sdk_raises_the_422(served: Served, http: httpx.Client) -> None:
    with pytest.raises(ApiError) as raised:
        b"".join(client(served, http).text_to_dialogue.convert(inputs=[DialogueInput(text="Hi.", voice_id="")]))
    assert raised.value.status_code == 422


# ---- WebSocket -------------------------------------------------------------------------------------------


async def exchange(url: str, messages: list[dict[str, Any]]) -> tuple[list[dict[str, Any]], int | None]:
    """Send `messages`, read until the socket closes: (what came, the close code)."""
    got = []
    async with connect(url) as ws:
        for message in messages:
            await ws.send(json.dumps(message))
        try:
            while True:
                got.append(json.loads(await ws.recv()))
        except ConnectionClosed:
            return got, ws.close_code


ENCODER_HOLD_MS = 36.0  # what soxr HQ holds back of a segment's end at 16 kHz (~20-35 ms) until more audio comes


def test_multi_stream_input_turns_voices_and_events(served: Served) -> None:
    url = served.ws + MULTI + "?output_format=pcm_16000&sync_alignment=true"
    messages: list[dict[str, Any]] = [
        {"context_id": "c1", "voices": ["ann", "bob"]},
        {"context_id": "c1", "inputs": [{"text": "Hello there, ", "voice_id": "ann"}]},
        {"context_id": "c1", "inputs": [{"text": "how are you doing today?", "voice_id": "ann"}]},
        {"context_id": "c1", "keep_alive": True},
        {"context_id": "c1", "inputs": [{"text": "Fine, thanks.", "voice_id": "bob"},
                                        {"text": "And you?", "voice_id": "bob", "new_turn": True}], "flush": True},
        {"context_id": "c1", "close_context": True},
        {"close_socket": True},
    ]
    got, code = asyncio.run(exchange(url, messages))
    assert code == 1000
    assert said(served) == [("ann", "Hello there, how are you doing"), ("ann", "today?"),  # first: 6 words
                            ("bob", "Fine, thanks."), ("bob", "And you?")]
    assert all(m["context_id"] == "c1" for m in got)
    audio = b"".join(base64.b64decode(m["audio"]) for m in got if m.get("audio"))
    assert_length(served, len(audio), 16_000)
    words = [m for m in got if "alignment" in m and "".join(m["alignment"]["chars"]).strip()]
    assert len(words) == 4  # one alignment per segment (and messages of no characters, or one space)
    kinds = ["is_final_audio_for_turn" if "is_final_audio_for_turn" in m else "is_final" if "is_final" in m
             else "other" for m in got]
    assert kinds.count("is_final_audio_for_turn") == 1 and kinds[-2:] == ["is_final_audio_for_turn", "is_final"]
    # Alignment times are relative to the message. LiveKit places a message where the audio before it ends;
    # Pipecat where the spans of the alignments before it (each one's last character's end) add up to. Both
    # must put every character at the same time, inside the audio, never going back. (A segment's alignment comes
    # when its audio is all generated; the last few ms of that audio are still in the encoder then, the resampler's
    # filter, and follow with the next segment's audio: a context is one stream, issue 35.)
    audio_clock_ms, span_clock_ms, last_ms = 0.0, 0.0, 0.0
    for message in got:
        if message.get("audio"):
            audio_clock_ms += len(base64.b64decode(message["audio"])) / 32.0
        elif "alignment" in message:
            aligned = message["alignment"]
            starts, durations = aligned["char_start_times_ms"], aligned["char_durations_ms"]
            for char, start, duration in zip(aligned["chars"], starts, durations, strict=True):
                if char != " ":
                    at_ms = audio_clock_ms + start  # LiveKit's
                    assert abs(at_ms - (span_clock_ms + start)) <= 1, (audio_clock_ms, span_clock_ms)  # Pipecat's
                    assert last_ms - 1 <= at_ms and at_ms + duration <= audio_clock_ms + ENCODER_HOLD_MS
                    last_ms = at_ms
            if starts:
                span_clock_ms += starts[-1] + durations[-1]
    assert last_ms > 0.8 * audio_clock_ms and last_ms <= audio_clock_ms


def test_without_sync_alignment_no_alignment_is_sent(served: Served) -> None:
    got, _ = asyncio.run(exchange(served.ws + MULTI, [
        {"context_id": "a", "voices": ["ann"], "inputs": [{"text": "Just one line.", "voice_id": "ann"}]},
        {"context_id": "a", "close_context": True}, {"close_socket": True}]))
    assert not any("alignment" in m for m in got) and got[-1] == {"is_final": True, "context_id": "a"}


BAD_MESSAGES: list[tuple[list[dict[str, Any]], str]] = [
    ([{"context_id": "c", "inputs": [{"text": "Hi.", "voice_id": "ann"}]}], "voices"),
    ([{"context_id": "c", "voices": ["ann"]}, {"context_id": "c", "inputs": [{"text": "Hi.", "voice_id": "bob"}]}],
     "inputs[0].voice_id"),
    ([{"context_id": "c", "voices": ["ann"]}, {"context_id": "c", "voices": ["bob"]}], "voices"),
    ([{"voices": ["ann"]}], "context_id"),
    ([{"context_id": "c", "voices": ["ann"], "text": "Hi."}], "text"),
    ([{"context_id": "c", "voices": ["ann"], "flush": "yes"}], "flush"),
]


@pytest.mark.parametrize(("messages", "param"), BAD_MESSAGES)
def test_a_bad_message_is_an_error_naming_the_param_then_1008(served: Served, messages: list[dict[str, Any]],
                                                             param: str) -> None:
    got, code = asyncio.run(exchange(served.ws + MULTI, messages))
    assert code == 1008
    error = got[-1]
    assert error["param"] == param and error["code"] == 1008 and error["error"] and error["message"], error
    assert said(served) == []


def test_stream_input_has_one_context_and_closes_after_it(served: Served) -> None:
    url = served.ws + "/v1/text-to-dialogue/stream-input?output_format=pcm_16000"
    got, code = asyncio.run(exchange(url, [
        {"voices": ["ann", "bob"], "inputs": [{"text": "Ready?", "voice_id": "ann"}]},
        {"inputs": [{"text": "Always.", "voice_id": "bob"}], "close_socket": False},
        {"close_socket": True}]))
    assert code == 1000 and got[-1] == {"is_final": True}
    assert said(served) == [("ann", "Ready?"), ("bob", "Always.")]
    assert all("context_id" not in m for m in got)


def test_a_context_refused_or_ended_gets_its_own_error_and_the_others_go_on(served: Served) -> None:
    """Past the per-socket context limit a new context is refused (busy); the client's next message for it (LiveKit
    sends its text right after the registration) must not close the socket under the contexts that are open."""
    limit = served.live.hub.settings.max_contexts_per_session
    messages: list[dict[str, Any]] = [{"context_id": f"c{i}", "voices": ["ann"]} for i in range(limit + 1)]
    messages += [
        {"context_id": f"c{limit}", "inputs": [{"text": "Am I in?", "voice_id": "ann"}]},
        {"context_id": "c0", "inputs": [{"text": "Still here.", "voice_id": "ann"}], "flush": True},
        {"context_id": "c0", "close_context": True},
    ]

    async def scenario() -> tuple[list[dict[str, Any]], list[dict[str, Any]], int | None]:
        async with connect(served.ws + MULTI + "?output_format=pcm_16000") as ws:
            for message in messages:
                await ws.send(json.dumps(message))
            got: list[dict[str, Any]] = []
            while not any(m.get("is_final") for m in got):
                got.append(json.loads(await asyncio.wait_for(ws.recv(), 10)))
            await ws.send(json.dumps({"context_id": "c0", "inputs": [{"text": "Again.", "voice_id": "ann"}]}))
            late = [json.loads(await asyncio.wait_for(ws.recv(), 10))]
            await ws.send(json.dumps({"close_socket": True}))
            try:
                while True:
                    late.append(json.loads(await asyncio.wait_for(ws.recv(), 10)))
            except ConnectionClosed:
                return got, late, ws.close_code

    got, late, code = asyncio.run(scenario())
    refused = f"c{limit}"
    errors = [m for m in got if "error" in m]
    assert [(m["error"], m["context_id"]) for m in errors] == [("max_active_conversations", refused),
                                                                ("context_closed", refused)]
    assert [m["context_id"] for m in got if m.get("is_final")] == ["c0"]  # spoken to its end, socket open
    assert any(m.get("audio") and m["context_id"] == "c0" for m in got)
    assert (late[0]["error"], late[0]["context_id"]) == ("context_closed", "c0") and "ended" in late[0]["message"]
    assert code == 1000  # close_socket: the other contexts end, then the socket
    assert said(served) == [("ann", "Still here.")]


def test_a_flush_with_nothing_to_say_still_ends_its_turn(served: Served) -> None:
    got, _ = asyncio.run(exchange(served.ws + MULTI, [
        {"context_id": "a", "voices": ["ann"], "inputs": [{"text": "[laughs] ", "voice_id": "ann"}], "flush": True},
        {"context_id": "a", "close_context": True}, {"close_socket": True}]))
    assert got == [{"is_final_audio_for_turn": True, "context_id": "a"}, {"is_final": True, "context_id": "a"}]
    assert said(served) == []


def test_stream_input_that_never_speaks_times_out(served: Served) -> None:
    got, code = asyncio.run(exchange(served.ws + "/v1/text-to-dialogue/stream-input?inactivity_timeout=1", []))
    assert code == 1008 and got[-1]["error"] == "input_timeout_exceeded"


def test_input_for_a_closing_context_is_refused_for_that_context_only(served: Served) -> None:
    got, code = asyncio.run(exchange(served.ws + MULTI, [
        {"context_id": "a", "voices": ["ann"], "inputs": [{"text": "First and last words.", "voice_id": "ann"}]},
        {"context_id": "a", "close_context": True},
        {"context_id": "a", "inputs": [{"text": "One more thing.", "voice_id": "ann"}]},
        {"close_socket": True}]))
    errors = [m for m in got if "error" in m]
    assert [(m["error"], m["context_id"]) for m in errors] == [("context_closing", "a")]
    assert code == 1000 and got[-1] == {"is_final": True, "context_id": "a"}
    assert said(served) == [("ann", "First and last words.")]
