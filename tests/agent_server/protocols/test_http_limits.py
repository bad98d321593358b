"""A request body over the server's limit gets 413 in the vendor's own error shape, on every HTTP speech
endpoint, whether the body came with a Content-Length or chunked, and the engine never hears of it."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import httpx
import orjson
import pytest

from tests.agent_server.protocols.conftest import Served

pytestmark = pytest.mark.timeout(60)

BIG = "word " * 240_000  # 1.2 MB: over the default 1 MiB


def chunked(data: bytes) -> Iterator[bytes]:
    for at in range(0, len(data), 65_536):
        yield data[at:at + 65_536]


@pytest.mark.parametrize("chunks", [False, True], ids=["content-length", "chunked"])
@pytest.mark.parametrize(("path", "body", "message_of"), [
    ("/v1/audio/speech", {"model": "tts-1", "voice": "alloy", "input": BIG}, lambda j: j["error"]["code"]),
    ("/v1/text-to-speech/default", {"text": BIG}, lambda j: j["detail"]["status"]),
    ("/tts/bytes", {"transcript": BIG}, lambda j: j["error_code"]),
    ("/v1/speak", {"text": BIG}, lambda j: j["err_code"].lower()),
], ids=["openai", "elevenlabs", "cartesia", "deepgram"])
def test_a_body_over_the_limit_is_413_in_the_vendors_shape(
    served: Served, path: str, body: dict[str, Any], message_of: Any, chunks: bool
) -> None:
    data = orjson.dumps(body)
    content: bytes | Iterator[bytes] = chunked(data) if chunks else data
    response = httpx.post(served.http + path, content=content, headers={"content-type": "application/json"},
                          timeout=30)
    assert response.status_code == 413, response.text
    assert message_of(response.json()) == "body_too_large"
    assert not served.engine.submits


@pytest.mark.parametrize("text", ["...", "👍 !"])
@pytest.mark.parametrize(("path", "field", "code_of", "status"), [
    ("/v1/audio/speech", "input", lambda j: j["error"]["param"] == "input" and j["error"]["code"], 400),
    ("/v1/text-to-speech/default", "text", lambda j: j["detail"][0]["loc"] == ["body", "text"]
     and j["detail"][0]["type"], 422),
    ("/tts/bytes", "transcript", lambda j: j["error_code"], 400),
    ("/v1/speak", "text", lambda j: j["err_code"].lower(), 400),
], ids=["openai", "elevenlabs", "cartesia", "deepgram"])
def test_text_with_nothing_to_say_is_refused_not_an_empty_file(
    served: Served, path: str, field: str, code_of: Any, status: int, text: str
) -> None:
    body: dict[str, Any] = {"model": "tts-1", "voice": "alloy"} if "audio" in path else {}
    if path == "/tts/bytes":
        body = {"model_id": "sonic-2", "voice": {"mode": "id", "id": "default"},
                "output_format": {"container": "mp3", "sample_rate": 44_100, "bit_rate": 128_000}}
    response = httpx.post(served.http + path, json={**body, field: text}, timeout=30)
    assert response.status_code == status, response.text
    assert code_of(response.json()) == "nothing_to_say"


def test_a_text_over_the_piece_limit_names_openai_s_field(served: Served) -> None:
    """OpenAI's error names the request field (`param`): the text is `input` there, not the session's `text`."""
    text = "word " * (served.live.hub.settings.max_text_piece_chars // 5 + 1)
    response = httpx.post(served.http + "/v1/audio/speech", json={"model": "tts-1", "voice": "alloy", "input": text},
                          timeout=30)
    assert response.status_code == 400, response.text
    assert response.json()["error"]["param"] == "input" and response.json()["error"]["code"] == "text_too_long"
    assert not served.engine.submits
