"""protocols/catalog.py through each vendor's own SDK against a real server (the FakeEngine behind it): voices
cloned, listed page by page, read and deleted; models listed; refusals in each vendor's error shape."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import httpx
import numpy as np
import pytest

from agent_server.core.voices import encode_wav_pcm16

from tests.agent_server.protocols.conftest import Served

pytestmark = pytest.mark.timeout(60)


def clip(seconds: float = 6.0, rate_hz: int = 16_000) -> bytes:
    t = np.arange(int(seconds * rate_hz)) / rate_hz
    return encode_wav_pcm16((0.3 * np.sin(2 * np.pi * 200 * t)).astype(np.float32), rate_hz)


@pytest.fixture
def elevenlabs(served: Served) -> Iterator[Any]:
    from elevenlabs import ElevenLabs

    with httpx.Client(timeout=30.0) as http:
        yield ElevenLabs(api_key="xi-test", base_url=served.http, httpx_client=http)


@pytest.fixture
def cartesia_client(served: Served) -> Iterator[Any]:
    from cartesia import Cartesia

    with Cartesia(api_key="sk-test", base_url=served.http, max_retries=0) as client:
        yield client


# ---- ElevenLabs -------------------------------------------------------------------------------------------


def test_elevenlabs_clone_search_speak_and_delete(served: Served, elevenlabs: Any) -> None:
    client = elevenlabs
    made = client.voices.ivc.create(name="Narrator", files=[("n.wav", clip(), "audio/wav")],
                                    description="calm, slow")
    assert made.requires_verification is False
    found = client.voices.search(search="narr")
    assert [v.voice_id for v in found.voices] == [made.voice_id] and found.total_count == 1
    voice = found.voices[0]
    assert (voice.name, voice.category, voice.description) == ("Narrator", "cloned", "calm, slow")
    assert voice.high_quality_base_model_ids == ["chatterbox-english"]
    assert {v.voice_id for v in client.voices.get_all().voices} == {"default", made.voice_id}
    assert [v.voice_id for v in client.voices.search(category="premade").voices] == ["default"]
    assert client.voices.search(voice_type="community").voices == []
    audio = b"".join(client.text_to_speech.convert(made.voice_id, text="Hello from a cloned voice."))
    assert audio and served.engine.submits[-1].voice_id == made.voice_id
    client.voices.delete(made.voice_id)
    assert {v.voice_id for v in client.voices.search().voices} == {"default"}


def test_elevenlabs_search_pages_through_every_voice_in_order(served: Served, elevenlabs: Any) -> None:
    client = elevenlabs
    names = ["Cleo", "Ann", "Bob"]
    made = {client.voices.ivc.create(name=name, files=[(f"{name}.wav", clip(), "audio/wav")]).voice_id: name
            for name in names}
    seen: list[str] = []
    token = None
    while True:
        page = client.voices.search(page_size=1, sort="name", sort_direction="asc", next_page_token=token,
                                    voice_type="personal")
        assert page.total_count == len(names) and len(page.voices) == 1
        seen += [v.name for v in page.voices]
        if not page.has_more:
            assert page.next_page_token is None
            break
        token = page.next_page_token
    assert seen == sorted(names) and set(made.values()) == set(names)


def test_elevenlabs_models_list_names_this_servers_model(elevenlabs: Any) -> None:
    models = elevenlabs.models.list()
    assert [m.model_id for m in models] == ["chatterbox-english"]
    assert models[0].can_do_text_to_speech and [lang.language_id for lang in models[0].languages] == ["en"]


def test_elevenlabs_refusals_are_validation_errors_naming_the_field(elevenlabs: Any) -> None:
    from elevenlabs.core.api_error import ApiError

    client = elevenlabs
    cases: list[tuple[dict[str, Any], str]] = [
        ({"name": "Two", "files": [("a.wav", clip(), "audio/wav"), ("b.wav", clip(), "audio/wav")]}, "files"),
        ({"name": "Noisy", "files": [("a.wav", clip(), "audio/wav")], "remove_background_noise": True},
         "remove_background_noise"),
        ({"name": "Tagged", "files": [("a.wav", clip(), "audio/wav")], "labels": {"accent": "british"}}, "labels"),
        ({"name": "Short", "files": [("a.wav", clip(2.0), "audio/wav")]}, "file"),
        ({"name": " ", "files": [("a.wav", clip(), "audio/wav")]}, "name"),
    ]
    for arguments, field in cases:
        with pytest.raises(ApiError) as refused:
            client.voices.ivc.create(**arguments)
        assert refused.value.status_code == 422, arguments
        assert refused.value.body["detail"][0]["loc"][1] == field, refused.value.body
    with pytest.raises(ApiError) as refused:
        client.voices.search(gender="female")
    assert refused.value.status_code == 422 and refused.value.body["detail"][0]["loc"][1] == "gender"
    assert {v.voice_id for v in client.voices.get_all().voices} == {"default"}  # nothing half-made


# ---- Cartesia ---------------------------------------------------------------------------------------------


def test_cartesia_clone_get_list_pages_and_delete(cartesia_client: Any) -> None:
    import cartesia

    client = cartesia_client
    made = [client.voices.clone(clip=(f"{n}.wav", clip(), "audio/wav"), name=f"Voice {n}", language="en",
                                description=f"number {n}") for n in range(3)]
    assert made[0].name == "Voice 0" and made[0].language == "en" and made[0].user_id == "anonymous"
    got = client.voices.get(made[1].id)
    assert (got.id, got.name, got.description, got.is_owner) == (made[1].id, "Voice 1", "number 1", True)
    every = [v.id for v in client.voices.list(limit=1)]  # the SDK follows the cursor page by page
    assert every == sorted(["default", *(m.id for m in made)])
    assert [v.id for v in client.voices.list(is_owner=False)] == ["default"]
    assert [v.id for v in client.voices.list(q="number 2")] == [made[2].id]
    earlier = client.voices.list(limit=2, ending_before=every[-1])
    assert [v.id for v in earlier.data] == every[-3:-1]
    client.voices.delete(made[0].id)
    with pytest.raises(cartesia.NotFoundError):
        client.voices.get(made[0].id)
    assert made[0].id not in [v.id for v in client.voices.list()]


def test_cartesia_refusals_name_the_field(cartesia_client: Any) -> None:
    import cartesia

    client = cartesia_client
    for arguments, field in (({"language": "en", "accent": "parisian"}, "accent"),
                             ({"language": "en", "base_voice_id": "default"}, "base_voice_id"),
                             ({"language": ""}, "language")):
        with pytest.raises(cartesia.BadRequestError) as refused:
            client.voices.clone(clip=("a.wav", clip(), "audio/wav"), name="X", **arguments)
        message = refused.value.response.json()["message"]
        assert refused.value.status_code == 400 and field in message, message
    with pytest.raises(cartesia.ConflictError):
        client.voices.delete("default")  # built in
    with pytest.raises(cartesia.BadRequestError):
        client.voices.list(gender="feminine")


# ---- OpenAI and Deepgram; one path, three shapes ------------------------------------------------------------


def test_openai_models(served: Served) -> None:
    import openai

    with openai.OpenAI(api_key="sk-test", base_url=served.http + "/v1", max_retries=0) as client:
        assert [m.id for m in client.models.list()] == ["chatterbox-english"]
        assert client.models.retrieve("chatterbox-english").owned_by == "resemble-ai"
        with pytest.raises(openai.NotFoundError) as missing:
            client.models.retrieve("tts-1")
    assert missing.value.code == "model_not_found"


def test_deepgram_models_are_the_voices(served: Served) -> None:
    from deepgram import DeepgramClient
    from deepgram.environment import DeepgramClientEnvironment

    voice_id = httpx.post(served.http + "/v1/voices", files={"file": ("a.wav", clip(), "audio/wav")},
                          data={"name": "Ann", "language": "en"}).json()["voice_id"]
    ws = served.ws
    with httpx.Client(timeout=30.0) as http:
        client = DeepgramClient(api_key="dg-test", httpx_client=http, environment=DeepgramClientEnvironment(
            base=served.http, production=ws, agent=ws, agent_rest=served.http))
        listed, ann, spoken = deepgram_calls(client, voice_id)
    assert not listed.stt and {m.canonical_name for m in listed.tts} == {"default", voice_id}
    assert ann.name == "Ann" and ann.languages == ["en"] and ann.architecture == "chatterbox-english"
    assert spoken and served.engine.submits[-1].voice_id == voice_id  # the model named is the voice spoken


def deepgram_calls(client: Any, voice_id: str) -> tuple[Any, Any, bytes]:
    listed = client.manage.v1.models.list()
    ann = next(m for m in listed.tts if m.canonical_name == voice_id)
    assert client.manage.v1.models.get(ann.uuid_).canonical_name == voice_id
    return listed, ann, b"".join(client.speak.v1.audio.generate(text="Hello there.", model=voice_id))


def test_models_answer_in_the_shape_of_whoever_asks(served: Served) -> None:
    url = served.http + "/v1/models"
    assert httpx.get(url, headers={"xi-api-key": "k"}).json()[0]["model_id"] == "chatterbox-english"
    assert set(httpx.get(url, headers={"authorization": "Token k"}).json()) == {"stt", "tts"}
    assert httpx.get(url, headers={"authorization": "Bearer k"}).json()["object"] == "list"
    assert httpx.get(url).json()["object"] == "list"
    refused = httpx.get(url + "?colour=blue", headers={"authorization": "Bearer k"})
    assert refused.status_code == 400 and refused.json()["error"]["param"] == "colour"
