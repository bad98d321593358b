"""Several models in one server (issue 37), through the server with the FakeEngine (models-contract.md): every
protocol routes its model and language fields to the loaded model and its answer names that model (native
`context_started.variant`, HTTP `x-served-model`, gRPC initial metadata, the `model` of the metrics' events and
the log lines); a language no loaded model speaks is refused in the protocol's own form; two models serve mixed
sessions at once, each speaking what it speaks alone; /v1/status and /v1/models show the table; an engine that
refuses its slots (EngineConfigError) makes `agent-server` exit 2 with the numbers."""

from __future__ import annotations

import asyncio
import dataclasses
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc
import httpx
import orjson
import pytest
import riva.client
import riva.client.proto.riva_tts_pb2 as riva_tts
import structlog
from starlette.applications import Starlette

from agent_server.app import create_app
from agent_server.audio.formats import float_to_pcm16
from agent_server.core.observers import ContextFinished, FirstAudio, ObservedEvent
from agent_server.core.routing import SERVED_MODEL_HEADER
from agent_server.protocols import routes
from agent_server.settings import Settings
from synth.api import Variant

from tests.agent_server.fake_asgi import running
from tests.agent_server.fake_engine import FakeEngine
from tests.agent_server.live_server import REPO, cli_server, live_server
from tests.agent_server.native_client import NativeClient
from tests.agent_server.protocol_drivers import DRIVERS, Driver, until, until_turn_done
from tests.agent_server.protocols.conftest import Served, serving
from tests.services import free_port

pytestmark = pytest.mark.timeout(60)

TWO: tuple[Variant, ...] = ("turbo", "multilingual")  # the default first
TEXT = "Hola, le puedo ayudar con eso ahora mismo. "
Json = dict[str, Any]


def make_app(tmp_path: Path, models: tuple[Variant, ...], **engine: Any) -> tuple[Starlette, FakeEngine,
                                                                                   list[ObservedEvent]]:
    fake = FakeEngine(loaded=models, **engine)
    app = create_app(fake, Settings(data_dir=tmp_path, models=models))
    served = {getattr(route, "path", None) for route in app.router.routes}
    app.router.routes.extend(r for r in routes() if getattr(r, "path", None) not in served)
    events: list[ObservedEvent] = []
    app.state.observers.subscribe(events.append)
    return app, fake, events


# How each protocol asks for Spanish: (query to add, the fields of an HTTP body or of the first message)
SPANISH: dict[str, tuple[str, Json]] = {
    "native": ("", {"language": "es"}),
    "elevenlabs": ("language_code=es", {}),
    "cartesia": ("", {"language": "es"}),
    "deepgram": ("model=aura-2-celeste-es", {}),  # the language is the model name's last part
    "jambonz": ("language=es-ES", {}),
    "openai": ("", {"model": "tts-1-es"}),  # (OpenAI has no language field: the name's last part, as Deepgram's)
    "elevenlabs_http": ("", {"language_code": "es", "model_id": "eleven_flash_v2_5"}),
    "cartesia_http": ("", {"language": "es"}),
    "deepgram_http": ("model=aura-2-celeste-es", {}),
    "jambonz_http": ("", {"language": "es-ES"}),
}


def in_spanish(driver: Driver) -> tuple[Driver, Json]:
    query, fields = SPANISH[driver.name]
    return dataclasses.replace(driver, query="&".join(q for q in (driver.query, query) if q)), fields


async def turn(driver: Driver, app: Starlette, fields: Json) -> tuple[int | None, dict[str, str], list[Any]]:
    """One turn with `fields` in its body (HTTP) or first message: (HTTP status, HTTP headers, JSON messages)."""
    if driver.http:
        request = driver.request(app, TEXT, extra=fields)
        await request.done()
        await request.finished()
        return request.status, request.headers, [request.content]
    ws = await driver.connect(app)
    first, *rest = driver.turn("t", TEXT)
    for message in [first | fields, *rest]:
        ws.send_json(message)
    got = await until_turn_done(driver, ws, "t")
    if not ws.closed.is_set():
        ws.disconnect()
    await ws.finished()
    return None, {}, got


@pytest.mark.parametrize("driver", DRIVERS, ids=str)
def test_each_protocol_routes_its_language_and_names_the_model(tmp_path: Path, driver: Driver) -> None:
    """Spanish on a Turbo + Multilingual server: Multilingual speaks it, and the answer says so."""
    app, engine, events = make_app(tmp_path, TWO)
    spanish, fields = in_spanish(driver)

    async def scenario() -> tuple[int | None, dict[str, str], list[Any]]:
        async with running(app):
            return await turn(spanish, app, fields)

    with structlog.testing.capture_logs() as logs:
        status, headers, got = asyncio.run(scenario())
    assert engine.submits and {(r.model, r.language) for r in engine.submits} == {("multilingual", "es")}, got
    if driver.http:
        assert status == 200 and headers[SERVED_MODEL_HEADER] == "multilingual", (status, headers, got)
    if driver.name == "native":
        [started] = [m for m in got if m.get("type") == "context_started"]
        assert started["variant"] == "multilingual"
    finished = [e for e in events if isinstance(e, ContextFinished)]
    first_audio = [e for e in events if isinstance(e, FirstAudio)]
    assert [e.model for e in finished] == ["multilingual"] and [e.model for e in first_audio] == ["multilingual"]
    done = [line for line in logs if line["event"] == "context_done"]
    assert [line["model"] for line in done] == ["multilingual"], done


@pytest.mark.parametrize("driver", DRIVERS, ids=str)
def test_a_language_no_loaded_model_speaks_is_refused_in_the_protocols_form(tmp_path: Path, driver: Driver) -> None:
    """Spanish on a Turbo + English server: the protocol's own error naming the language, nothing spoken (never
    English instead)."""
    app, engine, _ = make_app(tmp_path, ("turbo", "english"))
    spanish, fields = in_spanish(driver)

    async def scenario() -> tuple[int | None, dict[str, str], list[Any]]:
        async with running(app):
            if driver.http:
                request = spanish.request(app, TEXT, extra=fields)
                await request.done()
                code, text = spanish.http_error(request)
                return request.status, {"code": code}, [text]
            ws = await spanish.connect(app)
            first, *rest = spanish.turn("t", TEXT)
            for message in [first | fields, *rest]:
                ws.send_json(message)
            got = await until(spanish, ws, lambda m: spanish.error_of(m) is not None)
            if not ws.closed.is_set():
                ws.disconnect()
            await ws.finished()
            errors = [spanish.error_of(m) for m in got if spanish.error_of(m) is not None]
            return None, {}, [e[1] for e in errors if e is not None] + [m.get("message", "") for m in got]

    status, headers, messages = asyncio.run(scenario())
    assert engine.submits == []
    if driver.http:
        assert status == driver.bad_request_status, (status, headers, messages)
    assert any("'es' (Spanish)" in m and "not loaded here" in m for m in messages if isinstance(m, str)), messages


def test_two_models_serve_mixed_sessions_each_as_it_speaks_alone(tmp_path: Path) -> None:
    """Turbo and Multilingual sessions at once, seeded: each answer is the audio its model gives loaded alone
    (a one-model server's answer to the same request), and names that model."""
    words = ("uno", "dos", "tres", "cuatro", "cinco", "seis", "siete", "ocho")  # (no digits: normalised by language)
    requests = [(f"tts-1{'-es' if i % 2 else ''}", f"Frase {word}, dicha con calma.", 100 + i)
                for i, word in enumerate(words)]

    def model_of(i: int) -> Variant:
        return "multilingual" if i % 2 else "turbo"

    async def speak_all(url: str, which: list[int]) -> dict[int, tuple[str, bytes]]:
        async with httpx.AsyncClient(timeout=30) as http:
            async def one(i: int) -> tuple[str, bytes]:
                model, text, seed = requests[i]
                response = await http.post(f"{url}/v1/audio/speech", json={
                    "model": model, "voice": "alloy", "input": text, "response_format": "wav", "seed": seed})
                assert response.status_code == 200, response.text
                return response.headers.get(SERVED_MODEL_HEADER, ""), response.content[44:]
            return dict(zip(which, await asyncio.gather(*(one(i) for i in which)), strict=True))

    alone: dict[int, tuple[str, bytes]] = {}
    for model in TWO:  # each model loaded alone: the reference of its own requests
        (tmp_path / model).mkdir()
        with serving(tmp_path / model, variant=model) as one_model:
            alone |= asyncio.run(speak_all(one_model.http, [i for i in range(len(requests)) if model_of(i) == model]))
    (tmp_path / "both").mkdir()
    with serving(tmp_path / "both", loaded=TWO, max_slots=3) as both:
        mixed = asyncio.run(speak_all(both.http, list(range(len(requests)))))
        assert {r.model for r in both.engine.submits} == set(TWO)
    for i, (_, text, seed) in enumerate(requests):
        served_by, audio = mixed[i]
        assert served_by == alone[i][0] == model_of(i)
        assert audio == alone[i][1], f"request {i}: not what {model_of(i)} says alone"
        expected = float_to_pcm16(FakeEngine.expected_pcm(text, seed, model=model_of(i))).astype("<i2").tobytes()
        assert audio == expected
    assert FakeEngine.expected_tokens("Hola.", 1, model="turbo") != FakeEngine.expected_tokens(
        "Hola.", 1, model="multilingual")  # (the two models do differ)


@pytest.fixture
def served_two_grpc(tmp_path: Path) -> Iterator[Served]:
    with serving(tmp_path, grpc=True, loaded=TWO) as served:
        yield served


def test_riva_routes_its_language_code_and_names_the_model_in_the_metadata(served_two_grpc: Served) -> None:
    stub = riva.client.SpeechSynthesisService(riva.client.Auth(None, False, served_two_grpc.grpc)).stub
    for language_code, model in (("es-US", "multilingual"), ("en-US", "turbo")):
        request = riva_tts.SynthesizeSpeechRequest(text="Hola amigo.", language_code=language_code,
                                                   sample_rate_hz=16_000, encoding=riva.client.AudioEncoding.LINEAR_PCM)
        response, call = stub.Synthesize.with_call(request)
        assert response.audio and dict(call.initial_metadata())[SERVED_MODEL_HEADER] == model
        assert served_two_grpc.engine.submits[-1].model == model
    with pytest.raises(grpc.RpcError) as refused:
        stub.Synthesize(riva_tts.SynthesizeSpeechRequest(text="Hi.", language_code="tlh"))
    assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "no model speaks" in (
        refused.value.details() or "")
    config = stub.GetRivaSynthesisConfig(riva_tts.RivaSynthesisConfigRequest())
    names = {(c.model_name, c.parameters["language_code"]) for c in config.model_config}
    assert ("chatterbox-turbo", "en-US") in names and ("chatterbox-multilingual", "es") in names


def test_status_and_models_show_the_loaded_models_and_the_table(tmp_path: Path) -> None:
    table = {"routes": [{"names": ["tts-1"], "models": ["multilingual"]}], "default": ["turbo"]}
    path = tmp_path / "routes.json"
    path.write_bytes(orjson.dumps(table))
    engine = FakeEngine(loaded=TWO, slots_of={"turbo": 6, "multilingual": 2})
    with live_server(engine, Settings(data_dir=tmp_path, models=TWO, model_routes=path),
                     extra_routes=routes()) as live:
        status = httpx.get(live.http_url + "/v1/status").json()
        listing = httpx.get(live.http_url + "/v1/models", headers={"authorization": "Bearer x"}).json()
        speech = httpx.post(live.http_url + "/v1/audio/speech", json={"model": "tts-1", "voice": "alloy",
                                                                       "input": "Hello.", "response_format": "pcm"})
        scrape = httpx.get(live.http_url + "/metrics").text.splitlines()
        feed = live.app.state.metrics.feed  # the dashboard's: a row per model, keyed on the serving model
        deadline_s = time.monotonic() + 10
        while not (rows := feed.since(0)[-1]["models"] if feed.since(0) else {}).get("multilingual", {}).get("ttfa_n"):
            assert time.monotonic() < deadline_s, rows
            feed.sample_if_due()
            time.sleep(0.05)
    assert set(rows) == {"turbo", "multilingual"}
    assert (rows["multilingual"]["ttfa_n"], rows["turbo"]["ttfa_n"]) == (1, 0)
    assert (rows["turbo"]["max_slots"], rows["multilingual"]["max_slots"]) == (6, 2)
    assert list(status["models"]) == ["turbo", "multilingual"] and status["variant"] == "turbo"
    assert (status["models"]["turbo"]["max_slots"], status["models"]["multilingual"]["max_slots"]) == (6, 2)
    assert status["routes"]["source"] == str(path)
    assert status["routes"]["routes"] == [{"names": ["tts-1"], "models": ["multilingual"]}]
    assert [m["id"] for m in listing["data"]] == ["chatterbox-turbo", "chatterbox-multilingual"]
    assert "tts-1" in listing["data"][1]["routes"] and listing["routes"]["source"] == str(path)
    assert speech.headers[SERVED_MODEL_HEADER] == "multilingual"  # the file's table, not the built-in one
    # the metrics, per model: each model's slots, and the context counted under the model that spoke it
    assert 'tts_engine_max_slots{model="turbo"} 6.0' in scrape and 'tts_engine_max_slots{model="multilingual"} 2.0' \
        in scrape
    assert 'tts_contexts_finished_total{model="multilingual",protocol="openai",reason="completed"} 1.0' in scrape
    assert 'tts_contexts_finished_total{model="turbo",protocol="openai",reason="completed"} 0.0' in scrape


def agent_server(tmp_path: Path, options: Json, *args: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PYTHONPATH": str(REPO), "AGENT_SERVER_DATA_DIR": str(tmp_path),
           "AGENT_SERVER_ENGINE_FACTORY": "tests.agent_server.fake_engine:make_engine",
           "FAKE_ENGINE_OPTIONS": orjson.dumps(options).decode()}
    return subprocess.run([sys.executable, "-m", "agent_server.cli", "--host", "127.0.0.1", "--port",
                           str(free_port()), *args], env=env, capture_output=True, text=True, timeout=60)


def test_slots_the_memory_does_not_hold_exit_2_with_the_numbers(tmp_path: Path) -> None:
    """EngineConfigError (the fake's 'memory' holds 40 slots; 48 + 16 asked): exit 2 with its message, as for a
    bad flag, not 70 (the engine died: restart me), and no traceback; a bad routes file the same before loading."""
    done = agent_server(tmp_path, {"memory_slots": 40}, "--variant", "turbo,multilingual",
                        "--max-slots", "turbo=48,multilingual=16")
    assert done.returncode == 2, (done.returncode, done.stderr[-3000:])
    assert "max_slots does not fit: turbo 48, multilingual 16 slots asked, 40 fit" in done.stderr
    assert "Traceback" not in done.stderr.split("error:")[-1]
    bad = tmp_path / "routes.json"
    bad.write_text('{"routes": [{"names": ["tts-1"], "models": ["huge"]}]}')
    refused = agent_server(tmp_path, {}, "--model-routes", str(bad))
    assert refused.returncode == 2 and "'huge' is not a model" in refused.stderr, refused.stderr[-2000:]


def test_the_phrase_cache_keys_on_the_serving_model(tmp_path: Path) -> None:
    """One text, seed, voice and sampling asked of each model: each model's own audio (another model's cached
    segment is never served, even where every sampling parameter is the same), and each model's repeat comes from
    the cache."""
    every: tuple[Variant, ...] = ("english", "turbo", "multilingual")
    sampling = {"temperature": 0.8, "top_p": 1.0, "min_p": 0.05, "top_k": 1000, "repetition_penalty": 1.2,
                "cfg_weight": 0.5, "exaggeration": 0.5, "max_new_tokens": 200}  # every one, the same for each model

    async def speak(url: str, model: str, number: int) -> tuple[str, bytes]:
        client = await NativeClient.connect(url)
        try:
            log = await client.open(f"c{number}", model=model, seed=7, sampling=sampling, text="Hello.")
            await client.end(f"c{number}")
            await asyncio.wait_for(log.finished.wait(), 10)
        finally:
            await client.close()
        assert log.started is not None and log.done is not None and log.done["reason"] == "completed", log
        return log.started["variant"], log.audio

    with serving(tmp_path, loaded=every) as served:
        for number, model in enumerate((*every, *every)):
            expected = float_to_pcm16(FakeEngine.expected_pcm("Hello.", 7, model=model)).astype("<i2").tobytes()
            variant, audio = asyncio.run(speak(served.live.ws_url, model, number))
            assert variant == model and audio[:len(expected)] == expected, model
        assert [r.model for r in served.engine.submits] == list(every)  # the repeats: from the cache


def test_the_cli_serves_the_models_of_variant_with_their_own_slots(tmp_path: Path) -> None:
    """`agent-server --variant turbo,multilingual --max-slots turbo=3,multilingual=2` (the env var the same):
    both models loaded, the first the default, each with its slots; a Spanish request goes to Multilingual."""
    env = {"AGENT_SERVER_LOG_LEVEL": "warning", "AGENT_SERVER_MAX_SLOTS": "turbo=3,multilingual=2"}
    with cli_server(tmp_path, env, "--variant", "turbo,multilingual") as (_, port, _):
        status = httpx.get(f"http://127.0.0.1:{port}/v1/status").json()
        speech = httpx.post(f"http://127.0.0.1:{port}/v1/audio/speech", json={
            "model": "aura-2-celeste-es", "voice": "alloy", "input": "Hola.", "response_format": "pcm"})
    assert status["variant"] == "turbo" and list(status["models"]) == ["turbo", "multilingual"]
    assert {m: v["max_slots"] for m, v in status["models"].items()} == {"turbo": 3, "multilingual": 2}
    assert speech.status_code == 200 and speech.headers[SERVED_MODEL_HEADER] == "multilingual"
