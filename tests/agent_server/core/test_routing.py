"""The one route table (agent_server/core/routing.py): each vendor's model and language fields reach the model the
built-in table and a custom one say, a language no loaded model speaks is refused (never given another language),
and a --model-routes file is checked."""

from __future__ import annotations

from pathlib import Path

import orjson
import pytest

from agent_server.core.routing import (
    DEFAULT_ROUTES,
    LANGUAGE_NOT_SERVED,
    MODEL_NOT_SERVED,
    Routed,
    Router,
    RouteTable,
    load_routes,
)
from agent_server.errors import FieldError
from synth.api import Variant

ALL: tuple[Variant, ...] = ("turbo", "english", "multilingual")
FAST_PAIR: tuple[Variant, ...] = ("turbo", "english")  # no model past English
MODEL, LANGUAGE = "model", "language"

# (vendor field names, model name, language) -> the model the built-in table gives with every model loaded
DEFAULT_CASES: list[tuple[str, str, str | None, str | None, Routed]] = [
    # ElevenLabs: model_id + language_code
    ("model_id", "eleven_flash_v2_5", "language_code", None, Routed("turbo", None)),
    ("model_id", "eleven_turbo_v2_5", "language_code", "en", Routed("turbo", None)),
    ("model_id", "eleven_multilingual_v2", "language_code", None, Routed("english", None)),
    ("model_id", "eleven_v3", "language_code", "en-GB", Routed("english", None)),
    ("model_id", "eleven_flash_v2_5", "language_code", "es", Routed("multilingual", "es")),
    ("model_id", "eleven_multilingual_v2", "language_code", "fr-FR", Routed("multilingual", "fr")),
    # OpenAI: model (no language field)
    ("model", "tts-1", LANGUAGE, None, Routed("turbo", None)),
    ("model", "tts-1-hd", LANGUAGE, None, Routed("english", None)),
    ("model", "gpt-4o-mini-tts", LANGUAGE, None, Routed("english", None)),
    # Cartesia: model_id + language
    ("model_id", "sonic-turbo", "language", "en", Routed("turbo", None)),
    ("model_id", "sonic-2", "language", None, Routed("english", None)),
    ("model_id", "sonic-2", "language", "de", Routed("multilingual", "de")),
    # Deepgram: model, its last part the language
    ("model", "aura-2-thalia-en", LANGUAGE, None, Routed("turbo", None)),
    ("model", "aura-asteria-en", LANGUAGE, None, Routed("turbo", None)),
    ("model", "aura-2-celeste-es", LANGUAGE, None, Routed("multilingual", "es")),
    # Riva: language_code alone (no model: the loaded order, the default first)
    ("model", "", "language_code", "en-US", Routed("turbo", None)),
    ("model", "", "language_code", "es-US", Routed("multilingual", "es")),
    # jambonz: language alone
    ("model", "", "language", "ja-JP", Routed("multilingual", "ja")),
    ("model", "", "language", None, Routed("turbo", None)),
    # our own names always mean exactly that model
    ("model", "chatterbox-multilingual", LANGUAGE, "en", Routed("multilingual", "en")),
    ("model", "english", LANGUAGE, None, Routed("english", None)),
    ("model", "turbo", LANGUAGE, "en", Routed("turbo", None)),
]


@pytest.mark.parametrize(("model_field", "model", "language_field", "language", "expected"), DEFAULT_CASES)
def test_the_built_in_table_routes_each_vendors_fields(model_field: str, model: str, language_field: str,
                                                       language: str | None, expected: Routed) -> None:
    router = Router(DEFAULT_ROUTES, ALL)
    assert router.route(model_field=model_field, model=model or None, language_field=language_field,
                        language=language) == expected


def test_the_loaded_models_bound_the_choice() -> None:
    """A rule's first model not loaded: the next loaded one it names; a request naming no model: the default."""
    english_first = Router(DEFAULT_ROUTES, ("english", "multilingual"))
    assert english_first.route(model="eleven_flash_v2_5") == Routed("english", None)  # no Turbo here
    assert english_first.route(model="aura-2-celeste-es") == Routed("multilingual", "es")
    assert english_first.route() == Routed("english", None)
    multilingual_only = Router(DEFAULT_ROUTES, ("multilingual",))
    assert multilingual_only.route(model="tts-1") == Routed("multilingual", None)
    assert multilingual_only.route(language="en") == Routed("multilingual", "en")


def refusal(router: Router, **fields: str) -> FieldError:
    with pytest.raises(FieldError) as raised:
        router.route(**fields)
    return raised.value


def test_a_language_no_loaded_model_speaks_is_refused_never_spoken_in_another() -> None:
    router = Router(DEFAULT_ROUTES, FAST_PAIR)
    for fields, field in (({"language_field": "language_code", "language": "es-ES", "model_field": "model_id",
                            "model": "eleven_flash_v2_5"}, "language_code"),
                          ({"model": "aura-2-celeste-es"}, "model"),  # Deepgram: the name says the language
                          ({"language_field": "language_code", "language": "fr-FR"}, "language_code")):
        error = refusal(router, **fields)
        assert (error.field, error.code) == (field, LANGUAGE_NOT_SERVED), error
        assert "multilingual would, and it is not loaded here" in error.message and "turbo, english" in error.message
    nobody = refusal(Router(DEFAULT_ROUTES, ALL), language="tlh")  # Klingon: no model at all
    zulu = refusal(Router(DEFAULT_ROUTES, ALL), model="tts-1-zu")  # a known name + a language nobody speaks
    assert (zulu.field, zulu.code) == ("model", LANGUAGE_NOT_SERVED) and "no model speaks 'zu'" in zulu.message
    assert Router(DEFAULT_ROUTES, ALL).route(model="tts-1-hd") == Routed("english", None)  # a name, not a language
    assert (nobody.field, nobody.code) == ("language", LANGUAGE_NOT_SERVED) and "no model speaks" in nobody.message
    bad = refusal(Router(DEFAULT_ROUTES, ALL), language_field="language_code", language="español")
    assert bad.field == "language_code" and "not a language code" in bad.message


def test_a_model_the_server_does_not_run_is_refused() -> None:
    router = Router(DEFAULT_ROUTES, FAST_PAIR)
    error = refusal(router, model_field="model_id", model="chatterbox-multilingual")
    assert (error.field, error.code) == ("model_id", MODEL_NOT_SERVED) and "it runs turbo, english" in error.message
    # a name whose language contradicts the language field
    clash = refusal(Router(DEFAULT_ROUTES, ALL), model="aura-2-celeste-es", language="en")
    assert clash.field == "language" and "'es'" in clash.message


def test_a_table_that_sends_a_name_only_to_models_not_loaded_is_refused() -> None:
    table = RouteTable.from_json({"routes": [{"names": ["tts-1"], "models": ["multilingual"]}]}, "test")
    error = refusal(Router(table, FAST_PAIR), model="tts-1")
    assert (error.field, error.code) == ("model", MODEL_NOT_SERVED) and "served by multilingual" in error.message


CUSTOM = {
    "routes": [
        {"names": ["tts-1", "aura-*"], "models": ["multilingual"], "note": "every fast name to Multilingual"},
        {"names": ["eleven_*", "sonic*"], "models": ["turbo", "multilingual"]},
    ],
    "default": ["english"],
}


def test_a_custom_table_replaces_the_built_in_one(tmp_path: Path) -> None:
    path = tmp_path / "routes.json"
    path.write_bytes(orjson.dumps(CUSTOM))
    table = load_routes(path)
    assert table.source == str(path)
    router = Router(table, ALL)
    assert router.route(model="tts-1") == Routed("multilingual", None)  # built in: turbo
    assert router.route(model="aura-2-thalia-en") == Routed("multilingual", "en")  # built in: turbo
    assert router.route(model_field="model_id", model="eleven_multilingual_v2") == Routed("turbo", None)  # english
    assert router.route(model_field="model_id", model="sonic-2", language="it") == Routed("multilingual", "it")
    assert router.route(model="tts-1-hd") == Routed("english", None)  # no rule: the table's default
    assert router.route(language_field="language_code", language="en-US") == Routed("english", None)
    assert router.route(model="turbo") == Routed("turbo", None)  # own names stay ours
    # the table as /v1/status shows it reads back as the same table
    assert RouteTable.from_json(orjson.loads(orjson.dumps(table.to_json())), str(path)) == table


def test_the_listing_names_the_routes_to_each_model() -> None:
    router = Router(DEFAULT_ROUTES, ("turbo", "english"))
    assert "tts-1" in router.names_served_by("turbo") and "*" in router.names_served_by("turbo")
    assert "tts-1-hd" in router.names_served_by("english") and "*" not in router.names_served_by("english")
    assert router.names_served_by("multilingual") == []


@pytest.mark.parametrize(("content", "reason"), [
    (b"{", "not JSON"),
    (b"[]", "a route table is a JSON object"),
    (orjson.dumps({"routes": [{"names": ["tts-1"], "models": ["big"]}]}), "routes[0].models: 'big' is not a model"),
    (orjson.dumps({"routes": [{"names": ["turbo"], "models": ["english"]}]}), "one of our own names"),
    (orjson.dumps({"routes": [{"names": [], "models": ["english"]}]}), "routes[0].names must be a list"),
    (orjson.dumps({"routes": [{"names": ["x"], "models": ["english", "english"]}]}), "names a model twice"),
    (orjson.dumps({"routes": [], "default": ["nope"]}), "default: 'nope' is not a model"),
])
def test_an_unusable_routes_file_is_refused_naming_the_place(tmp_path: Path, content: bytes, reason: str) -> None:
    path = tmp_path / "routes.json"
    path.write_bytes(content)
    with pytest.raises(ValueError, match=r"routes\.json") as raised:
        load_routes(path)
    assert reason in str(raised.value)
    with pytest.raises(ValueError, match="No such file"):
        load_routes(tmp_path / "missing.json")
