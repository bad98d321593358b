"""Auth (agent_server/fleet/auth.py): keys, tokens, origins, per-key limits; units, then a real server on 127.0.0.1."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path
from typing import Any

import httpx
import orjson
import pytest
from structlog.testing import capture_logs
from websockets.asyncio.client import connect
from websockets.exceptions import ConnectionClosed, InvalidStatus

from agent_server.cli import settings_from
from agent_server.fleet.auth import (
    AUTH_OFF_WARNING,
    Auth,
    AuthConfigError,
    Denied,
    Principal,
    find_credential,
    fingerprint,
    key_hash,
)
from agent_server.fleet.shared_state import LocalState
from agent_server.settings import Settings

from tests.agent_server.fake_engine import FakeEngine
from tests.agent_server.live_server import LiveServer, live_server
from tests.agent_server.native_client import NativeClient

pytestmark = pytest.mark.timeout(60)

KEY_A = "k-alpha-0123456789"
KEY_B = "k-beta-9876543210"
ORIGIN = "https://app.example"
TEXT_PER_MINUTE = 200


def run(coro: Any) -> Any:
    return asyncio.run(coro)


def scope(headers: dict[str, str] | None = None, query: str = "") -> dict[str, Any]:
    return {
        "type": "http",
        "path": "/v1/status",
        "headers": [(k.lower().encode(), v.encode()) for k, v in (headers or {}).items()],
        "query_string": query.encode(),
    }


# ---- units --------------------------------------------------------------------------------------


def test_modes() -> None:
    assert not Auth(mode="auto").enabled
    assert Auth(mode="auto", keys=[KEY_A]).enabled
    assert not Auth(mode="off", keys=[KEY_A]).enabled
    assert Auth(mode="on", keys=[KEY_A]).enabled
    with pytest.raises(AuthConfigError):
        Auth(mode="on")
    with pytest.raises(AuthConfigError):
        Auth(mode="maybe", keys=[KEY_A])
    with pytest.raises(AuthConfigError):
        Auth(keys=["has space"])


def test_keys_from_environment_and_file_are_never_shown(tmp_path: Path) -> None:
    keys_file = tmp_path / "keys"
    keys_file.write_text(f"# comment\n\n{KEY_B}  # after a key, a comment\n")
    settings = settings_from(["--api-keys-file", str(keys_file)], {"AGENT_SERVER_API_KEYS": f"{KEY_A}, "})
    assert settings.api_keys == (KEY_A,) and settings.auth == "auto"
    assert KEY_A not in repr(settings)
    auth = Auth.from_settings(settings)
    assert auth.enabled and auth.key_count == 2
    assert auth.verify(KEY_B) == Principal(fingerprint(KEY_B))
    with capture_logs() as logs:
        auth.announce()
    assert logs[0]["event"] == "auth_on" and KEY_A not in repr(logs) and KEY_B not in repr(logs)
    with pytest.raises(AuthConfigError):
        Auth.from_settings(Settings(api_keys_file=tmp_path / "missing"))
    with pytest.raises(SystemExit):
        settings_from(["--auth", "sometimes"], {})


def test_auth_off_is_loud() -> None:
    with capture_logs() as logs:
        Auth.from_settings(Settings()).announce()
    assert [(e["event"], e["log_level"], e["message"]) for e in logs] == [("auth_off", "warning", AUTH_OFF_WARNING)]


def test_where_credentials_are_read() -> None:
    assert find_credential(scope({"Authorization": "Bearer abc"})) == "abc"
    assert find_credential(scope({"Authorization": "Token abc"})) == "abc"  # Deepgram
    assert find_credential(scope({"X-API-Key": "abc"})) == "abc"  # Cartesia
    assert find_credential(scope({"xi-api-key": "abc"})) == "abc"  # ElevenLabs
    assert find_credential(scope(query="token=t1")) == "t1"
    assert find_credential(scope(query="api_key=k1")) == "k1"
    assert find_credential(scope(query="access_token=t2")) == "t2"  # Cartesia's browser form
    assert find_credential(scope({"Authorization": "Bearer h"}, "token=q")) == "h"  # headers first
    assert find_credential(scope()) is None


def test_a_bare_authorization_header_is_refused() -> None:
    """`Authorization: <key>` with no scheme is not a credential (one answer for every protocol: 401)."""
    auth = Auth(keys=[KEY_A])
    assert find_credential(scope({"Authorization": KEY_A})) is None
    with pytest.raises(Denied) as denied:
        auth.check(scope({"Authorization": KEY_A}))
    assert (denied.value.status_code, denied.value.code) == (401, "invalid_authorization")
    assert auth.check(scope({"Authorization": f"Bearer {KEY_A}"})) is not None


def test_tokens_sign_expire_and_follow_their_key() -> None:
    auth = Auth(keys=[KEY_A, KEY_B], token_ttl_s=60)
    principal = auth.verify(KEY_A)
    token, expires_at = auth.issue_token(principal)
    assert KEY_A not in token and 55 <= expires_at - time.time() <= 60
    assert auth.verify(token) == Principal(principal.key_id, via_token=True)
    expired, _ = auth.issue_token(principal, now_s=time.time() - 120)
    with pytest.raises(Denied) as denied:
        auth.verify(expired)
    assert denied.value.code == "expired_token"
    head, payload, signature = token.split(".")
    for bad in (f"{head}.{payload}.{signature[:-2]}AA", f"{head}.{payload[:-2]}.{signature}", "v1.x.y", KEY_A + "x"):
        with pytest.raises(Denied) as denied:
            auth.verify(bad)
        assert denied.value.status_code == 401
    other = Auth(keys=[KEY_A])  # another process: another secret
    with pytest.raises(Denied):
        other.verify(token)
    shared = Auth(keys=[KEY_A], token_secret=b"s3cret")
    token = shared.issue_token(principal)[0]
    assert Auth(keys=[KEY_A], token_secret=b"s3cret").verify(token).key_id == principal.key_id
    without_b = Auth(keys=[KEY_A], token_secret=b"s3cret")
    with pytest.raises(Denied):  # a token stands for a key only while the key is configured
        without_b.verify(shared.issue_token(Principal(fingerprint(KEY_B)))[0])


def test_per_key_limits() -> None:
    clock = [10.0]
    auth = Auth(keys=[KEY_A, KEY_B], max_sessions_per_key=2, max_text_chars_per_minute_per_key=120,
                shared=LocalState(clock=lambda: clock[0]))
    a, b = auth.verify(KEY_A), auth.verify(KEY_B)

    async def scenario() -> None:
        assert await auth.acquire_session(a, "s1") is None and await auth.acquire_session(a, "s2") is None
        assert "too many sessions" in (await auth.acquire_session(a, "s3") or "")
        assert await auth.acquire_session(b, "s4") is None
        await auth.release_session(a, "s1")
        assert await auth.sessions_of(a) == 1
        assert await auth.acquire_session(a, "s5") is None
        assert await auth.charge_text(a, 100) is None
        assert await auth.charge_text(a, 30) is not None  # 20 left: refused whole
        assert await auth.charge_text(b, 120) is None  # each key has its own budget
        clock[0] = 15.0
        assert await auth.charge_text(a, 30) is None  # 5 s refill 2 chars/s
        clock[0] = 1000.0
        assert await auth.charge_text(a, 121) is not None  # never more than a minute's worth
        assert await auth.charge_text(None, 10**9) is None  # auth off: no accounting

    run(scenario())


def test_keys_are_kept_hashed_and_shared_keys_and_revocations_apply() -> None:
    auth = Auth(keys=[KEY_A], token_secret=b"s3cret")
    assert KEY_A not in repr(vars(auth)) and key_hash(KEY_A) in auth._key_hashes  # only the hash is kept
    runtime_key = "k-runtime-added-1"
    with pytest.raises(Denied):
        auth.verify(runtime_key)

    async def scenario() -> None:
        await auth.shared.add_key(key_hash(runtime_key), fingerprint(runtime_key))
        assert auth.verify(runtime_key) == Principal(fingerprint(runtime_key))  # a key added at run time
        principal = auth.verify(KEY_A)
        token, _ = auth.issue_token(principal)
        other, _ = auth.issue_token(principal)
        assert auth.verify(token).via_token
        with pytest.raises(Denied) as err:
            await auth.revoke_token(token, Principal(fingerprint(runtime_key)))  # not that key's token
        assert err.value.status_code == 403
        await auth.revoke_token(token, principal)
        with pytest.raises(Denied) as err:
            auth.verify(token)
        assert err.value.code == "revoked_token"
        assert auth.verify(other).key_id == principal.key_id  # only that token
        await auth.shared.revoke_key(principal.key_id)  # a revoked key: refused, and its tokens with it
        for credential in (KEY_A, other):
            with pytest.raises(Denied):
                auth.verify(credential)

    run(scenario())


def test_auto_turns_on_with_the_first_shared_key_and_stays_on() -> None:
    """auto with no configured key: open, until a key is added to the shared state (`python -m
    agent_server.fleet.keys add` on a fleet); revoking that key later must not open the server again."""
    auth = Auth(mode="auto")
    assert not auth.enabled and auth.check(scope()) is None
    key = "k-fleet-added-1"

    async def scenario() -> None:
        await auth.shared.add_key(key_hash(key), fingerprint(key))
        with pytest.raises(Denied):
            auth.check(scope())  # on now: no credential is refused
        assert auth.check(scope({"X-API-Key": key})) == Principal(fingerprint(key))
        await auth.shared.revoke_key(fingerprint(key))
        with pytest.raises(Denied):
            auth.check(scope())  # still on
        assert auth.enabled and auth.status_json()["enabled"] is True

    run(scenario())


def test_a_named_keys_file_means_keys_even_when_empty(tmp_path: Path) -> None:
    empty = tmp_path / "keys"
    empty.write_text("# nothing yet\n")
    with pytest.raises(AuthConfigError, match="holds no key"):
        Auth.from_settings(Settings(api_keys_file=empty))  # auto: would have been an open server
    assert not Auth.from_settings(Settings(api_keys_file=empty, auth="off")).enabled


# ---- a real server -------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Any:
    settings = Settings(
        data_dir=tmp_path_factory.mktemp("data"),
        auth="on",
        api_keys=(KEY_A, KEY_B),
        allowed_origins=(ORIGIN,),
        max_sessions_per_key=2,
        max_text_chars_per_minute_per_key=TEXT_PER_MINUTE,
    )
    with live_server(FakeEngine(), settings) as live:
        yield live


def ws_url(server: LiveServer, path: str = "/v1/stream", query: str = "") -> str:
    return f"ws://127.0.0.1:{server.port}{path}" + (f"?{query}" if query else "")


async def handshake_status(url: str, **kwargs: Any) -> int:
    """101 when the server upgraded, else the HTTP status it answered the handshake with."""
    try:
        async with connect(url, **kwargs):
            return 101
    except InvalidStatus as exc:
        return exc.response.status_code


def test_http_endpoints_need_a_key(server: LiveServer) -> None:
    base = server.http_url
    for path in ("/healthz", "/readyz", "/metrics", "/"):  # probes and metrics stay open (metrics_auth off)
        assert httpx.get(base + path).status_code == 200, path
    for method, path in (("GET", "/v1/status"), ("GET", "/v1/voices"), ("POST", "/v1/audio/speech"),
                         ("POST", "/v1/tokens"), ("DELETE", "/v1/voices/x")):
        response = httpx.request(method, base + path)
        assert response.status_code == 401, path
        assert response.json()["error"]["code"] == "missing_credentials"
        assert response.headers["www-authenticate"] == "Bearer"
    wrong = httpx.get(base + "/v1/status", headers={"Authorization": "Bearer nope"})
    assert wrong.status_code == 401 and wrong.json()["error"]["code"] == "invalid_credentials"
    for kwargs in ({"headers": {"Authorization": f"Bearer {KEY_A}"}}, {"headers": {"X-API-Key": KEY_B}},
                   {"params": {"api_key": KEY_A}}):
        response = httpx.get(base + "/v1/status", **kwargs)  # type: ignore[arg-type]
        assert response.status_code == 200
        assert response.json()["auth"]["enabled"] is True and response.json()["auth"]["keys"] == 2
    bad_origin = httpx.get(base + "/v1/voices", headers={"X-API-Key": KEY_A, "Origin": "https://evil.example"})
    assert bad_origin.status_code == 403
    assert httpx.get(base + "/v1/voices", headers={"X-API-Key": KEY_A, "Origin": ORIGIN}).status_code == 200
    with capture_logs() as logs:
        speech = httpx.post(base + "/v1/audio/speech", headers={"Authorization": f"Bearer {KEY_A}"},
                            json={"model": "tts-1", "input": "Hello there.", "voice": "alloy",
                                  "response_format": "pcm"})
        deadline_s = time.monotonic() + 5.0  # the session closes (and says so) just after the body's last byte
        while not any(e["event"] == "session_closed" for e in logs) and time.monotonic() < deadline_s:
            time.sleep(0.01)
    assert speech.status_code == 200 and len(speech.content) > 0
    session_lines = [e for e in logs if e["event"] in ("session_opened", "context_done", "session_closed")]
    assert len(session_lines) == 3 and all(e["key"] == fingerprint(KEY_A) for e in session_lines)  # traceable
    assert KEY_A not in repr(logs)


def test_websocket_handshakes_are_refused_before_upgrade(server: LiveServer) -> None:
    auth = server.hub.auth
    key_a = auth.verify(KEY_A)
    token, _ = auth.issue_token(key_a)
    expired, _ = auth.issue_token(key_a, now_s=time.time() - 3600)

    async def scenario() -> dict[str, int]:
        return {
            "missing": await handshake_status(ws_url(server)),
            "wrong": await handshake_status(ws_url(server, query="api_key=wrong")),
            "expired": await handshake_status(ws_url(server, query=f"token={expired}")),
            "token": await handshake_status(ws_url(server, query=f"token={token}")),
            "header": await handshake_status(ws_url(server), additional_headers={"Authorization": f"Bearer {KEY_B}"}),
            "bad_origin": await handshake_status(ws_url(server, query=f"token={token}"), origin="https://evil.example"),
            "good_origin": await handshake_status(ws_url(server, query=f"token={token}"), origin=ORIGIN),
            # each vendor endpoint, with the vendor's own header
            "deepgram": await handshake_status(ws_url(server, "/v1/speak"),
                                               additional_headers={"Authorization": f"Token {KEY_A}"}),
            "deepgram_none": await handshake_status(ws_url(server, "/v1/speak")),
            "cartesia": await handshake_status(ws_url(server, "/tts/websocket"),
                                               additional_headers={"X-API-Key": KEY_A}),
            "cartesia_none": await handshake_status(ws_url(server, "/tts/websocket")),
            "elevenlabs": await handshake_status(
                ws_url(server, "/v1/text-to-speech/x/stream-input", "output_format=pcm_16000"),
                additional_headers={"xi-api-key": KEY_A}),
            "elevenlabs_none": await handshake_status(ws_url(server, "/v1/text-to-speech/x/stream-input")),
        }

    statuses = run(scenario())
    assert statuses == {
        "missing": 401, "wrong": 401, "expired": 401, "token": 101, "header": 101, "bad_origin": 403,
        "good_origin": 101, "deepgram": 101, "deepgram_none": 401, "cartesia": 101, "cartesia_none": 401,
        "elevenlabs": 101, "elevenlabs_none": 401,
    }


def test_token_endpoint(server: LiveServer) -> None:
    base = server.http_url
    response = httpx.post(base + "/v1/tokens", headers={"X-API-Key": KEY_A}, json={"ttl_s": 30})
    assert response.status_code == 200 and response.headers["cache-control"] == "no-store"
    body = response.json()
    assert 25 <= body["expires_in_s"] <= 30 and KEY_A not in body["token"]
    token = body["token"]
    assert httpx.get(base + "/v1/status", params={"token": token}).status_code == 200
    again = httpx.post(base + "/v1/tokens", params={"token": token})
    assert again.status_code == 403 and again.json()["error"]["code"] == "key_required"
    assert httpx.post(base + "/v1/tokens", headers={"X-API-Key": KEY_A}, json={"ttl_s": 10**6}).status_code == 400
    assert httpx.post(base + "/v1/tokens", headers={"X-API-Key": KEY_A}, content=b"{").status_code == 400


def test_per_key_session_limit_answers_busy_in_the_protocol(server: LiveServer) -> None:
    async def wait_sessions(at_most: int) -> None:
        deadline_s = time.monotonic() + 5
        while await server.hub.auth.sessions_of(Principal(fingerprint(KEY_A))) > at_most:
            assert time.monotonic() < deadline_s
            await asyncio.sleep(0.02)

    async def scenario() -> None:
        await wait_sessions(0)  # earlier tests' sessions have gone
        a1 = await NativeClient.connect(ws_url(server, query=f"api_key={KEY_A}"))
        a2 = await NativeClient.connect(ws_url(server, query=f"api_key={KEY_A}"))
        async with connect(ws_url(server, query=f"api_key={KEY_A}")) as third:
            refusal = orjson.loads(await third.recv())
            with pytest.raises(ConnectionClosed) as closed:
                await third.recv()
        assert refusal["type"] == "busy" and refusal["context_id"] is None
        assert "API key" in refusal["reason"]
        assert closed.value.rcvd is not None and closed.value.rcvd.code == 1013
        b1 = await NativeClient.connect(ws_url(server, query=f"api_key={KEY_B}"))  # another key is not affected
        await a1.close()
        await wait_sessions(1)
        a3 = await NativeClient.connect(ws_url(server, query=f"api_key={KEY_A}"))  # the slot came back
        for client in (a2, a3, b1):
            await client.close()

    run(scenario())


def test_text_per_minute_limit(server: LiveServer) -> None:
    async def scenario() -> tuple[list[dict[str, Any]], Any]:
        client = await NativeClient.connect(ws_url(server, query=f"api_key={KEY_B}"))
        log = await client.open("t", seed=1)
        await client.text("t", "Hello there, this fits. " * 6)  # 144 characters
        await client.text("t", "And this one does not fit into what is left of the minute. ")  # 59 > 56 left
        error = await asyncio.wait_for(client.errors.get(), 5)
        await client.end("t")
        await asyncio.wait_for(log.finished.wait(), 10)
        await client.close()
        return [error], log

    errors, log = run(scenario())
    assert errors[0]["code"] == "rate_limited" and errors[0]["field"] == "text"
    assert log.done is not None and log.done["reason"] == "completed"  # the turn still ends normally


def test_metrics_auth_flag(tmp_path: Path) -> None:
    settings = Settings(data_dir=tmp_path, api_keys=(KEY_A,), metrics_auth=True)
    with live_server(FakeEngine(), settings) as live:
        assert httpx.get(live.http_url + "/metrics").status_code == 401
        assert httpx.get(live.http_url + "/metrics", headers={"X-API-Key": KEY_A}).status_code == 200
        assert httpx.get(live.http_url + "/healthz").status_code == 200


def test_a_refusal_comes_in_the_shape_of_the_vendor_asked(server: LiveServer) -> None:
    """A wrong key on a vendor's path: the vendor's SDK raises its own error carrying our message (each vendor's
    error body; native paths keep `{"error": {"code", "message"}}`)."""
    import openai
    from cartesia import Cartesia
    from deepgram import DeepgramClient
    from deepgram.core.api_error import ApiError as DeepgramError
    from deepgram.environment import DeepgramClientEnvironment
    from elevenlabs.client import ElevenLabs
    from elevenlabs.core.api_error import ApiError as ElevenLabsError

    base = server.http_url
    http = httpx.Client()
    eleven_labs = ElevenLabs(api_key="wrong", base_url=base, httpx_client=http)
    with pytest.raises(ElevenLabsError) as eleven:
        b"".join(eleven_labs.text_to_speech.convert("JBFqnCBsd6RMkjVDRZzb", text="Hello.", output_format="pcm_16000"))
    assert eleven.value.status_code == 401
    assert eleven.value.body == {"detail": {"status": "invalid_credentials", "message": "invalid API key"}}
    with pytest.raises(ElevenLabsError) as eleven_voices:  # a native route the SDK calls: its shape by its header
        eleven_labs.voices.get_all()
    assert eleven_voices.value.body["detail"]["status"] == "invalid_credentials"

    with openai.OpenAI(api_key="wrong", base_url=base + "/v1", max_retries=0) as client, \
            pytest.raises(openai.AuthenticationError) as refused_openai:
        client.audio.speech.create(model="tts-1", voice="alloy", input="Hello.", response_format="pcm")
    assert refused_openai.value.message == "Error code: 401 - invalid API key"  # the SDK reads error.message
    assert refused_openai.value.code == "invalid_credentials"

    with Cartesia(api_key="wrong", base_url=base, max_retries=0) as cartesia, pytest.raises(Exception) as refused:
        cartesia.voices.get("default")
    assert getattr(refused.value, "status_code", None) == 401
    assert getattr(refused.value, "body", None) == {
        "title": "Unauthorized", "message": "invalid API key", "error_code": "invalid_credentials",
        "status_code": 401, "request_id": ""}

    env = DeepgramClientEnvironment(base=base, production=server.ws_url, agent=server.ws_url, agent_rest=base)
    with pytest.raises(DeepgramError) as refused_deepgram:
        b"".join(DeepgramClient(api_key="wrong", environment=env, httpx_client=http).speak.v1.audio.generate(
            text="Hello."))
    http.close()
    assert refused_deepgram.value.status_code == 401
    assert refused_deepgram.value.body == {"err_code": "INVALID_CREDENTIALS", "err_msg": "invalid API key",
                                           "request_id": ""}

    jambonz = httpx.post(base + "/v1/jambonz/tts", json={"text": "Hello."})
    assert jambonz.status_code == 401
    assert jambonz.json() == {"error": "an API key or token is required (Authorization: Bearer, X-API-Key, or "
                                       "?token= in the URL)", "code": "missing_credentials"}
    native = httpx.get(base + "/v1/voices")
    assert native.json() == {"error": {"code": "missing_credentials", "message": native.json()["error"]["message"]}}
